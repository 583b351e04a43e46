"""OffsetCommit (key 8): versions 2-7 (none flexible; v8 is the first flexible one).

Behaviour (the coordinator, groups.py): the offsets are appended to the store
(replication/group_offsets.py), durable before the answer; generation checks as Kafka's; a
commit with generation -1 and no member id (a consumer using ``assign``) is accepted while the
group has no members; with ACLs: READ on the group, then READ on each topic (authorize.Gate).

Version notes:
* v2: retention_time_ms in the request (ignored: committed offsets are kept);
* v3: throttle_time_ms; v4: the same fields;
* v5: retention_time_ms gone; v6: committed_leader_epoch;
* v7: group_instance_id (accepted, not fenced).
"""

from __future__ import annotations

from .. import cluster
from .base import register

KEY, NAME = 8, "OffsetCommit"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 2, 7, None


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"topics": [{"name": t.name, "partitions": [
            {"partition_index": p.partition_index, "error_code": cluster.NOT_COORDINATOR}
            for p in t.partitions]} for t in req.body.topics]}
    return {"topics": await ep.coordinator.commit(req.body)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
