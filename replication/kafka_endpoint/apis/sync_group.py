"""SyncGroup (key 14): versions 0-3 (none flexible; v4 is the first flexible one).

Behaviour (the coordinator, groups.py): the leader's assignments handed to each member once
the leader has sent them; ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID, REBALANCE_IN_PROGRESS as Kafka
answers them; with ACLs: READ on the group (authorize.Gate).

Version notes:
* v1: throttle_time_ms; v2: the same fields;
* v3: group_instance_id (accepted, not fenced).
"""

from __future__ import annotations

from .. import cluster
from .base import register

KEY, NAME = 14, "SyncGroup"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 3, None


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"error_code": cluster.NOT_COORDINATOR, "assignment": b""}
    got = await ep.coordinator.sync(req.body)
    return {"error_code": got["error_code"], "assignment": got["assignment"]}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
