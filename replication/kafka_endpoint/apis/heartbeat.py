"""Heartbeat (key 12): versions 0-3 (none flexible; v4 is the first flexible one).

Behaviour (the coordinator, groups.py): keeps the member's session; REBALANCE_IN_PROGRESS
tells it to rejoin; ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID as Kafka answers them; with ACLs:
READ on the group (authorize.Gate).

Version notes:
* v1: throttle_time_ms; v2: the same fields;
* v3: group_instance_id (accepted, not fenced).
"""

from __future__ import annotations

from .. import cluster
from .base import register

KEY, NAME = 12, "Heartbeat"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 3, None


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"error_code": cluster.NOT_COORDINATOR}
    return {"error_code": ep.coordinator.heartbeat(req.body)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
