"""JoinGroup (key 11): versions 0-5 (none flexible; v6 is the first flexible one).

Behaviour (the coordinator, groups.py): Kafka's classic group protocol on one node: the join
barrier, the generation moved on, the first protocol of the leader's that all members support,
the leader given the members' metadata; with ACLs: READ on the group (authorize.Gate).

Version notes:
* v1: rebalance_timeout_ms (v0: the session timeout is the rebalance timeout);
* v2: throttle_time_ms; v3: the same fields;
* v4: a join without a member id is answered MEMBER_ID_REQUIRED with the id to use (KIP-394);
* v5: group_instance_id (static membership: accepted as a plain member).
"""

from __future__ import annotations

from .. import cluster
from .base import register

KEY, NAME = 11, "JoinGroup"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 5, None


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"error_code": cluster.NOT_COORDINATOR, "generation_id": -1, "protocol_name": "",
                "leader": "", "members": [], "member_id": req.body.member_id}
    return await ep.coordinator.join(req.version, req.body, req.client_id or "")


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
