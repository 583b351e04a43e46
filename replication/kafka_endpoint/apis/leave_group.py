"""LeaveGroup (key 13): versions 0-2 (none flexible; v4 is the first flexible one).

Behaviour (the coordinator, groups.py): the member is removed and the group rebalances; with
ACLs: READ on the group (authorize.Gate).

Version notes:
* v1: throttle_time_ms; v2: the same fields;
* v3: several members per request (KIP-345's batch leave): not served.
"""

from __future__ import annotations

from .. import cluster
from .base import register

KEY, NAME = 13, "LeaveGroup"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 2, None


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"error_code": cluster.NOT_COORDINATOR}
    return {"error_code": ep.coordinator.leave(req.body)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
