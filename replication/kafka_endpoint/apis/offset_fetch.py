"""OffsetFetch (key 9): versions 1-7, flexible from 6.

Behaviour (the coordinator, groups.py): what was committed here merged with what a mirror
captured from the source cluster; with ACLs: DESCRIBE on the group, then DESCRIBE on each
topic, a topic not allowed left out of an all-topics answer (authorize.Gate).

Version notes:
* v1: offsets kept by the coordinator (v0: ZooKeeper's), the version every client sends;
* v2: a top-level error_code, and topics null for all the group's topics;
* v3: throttle_time_ms; v4: the same fields; v5: committed_leader_epoch;
* v6: flexible; v7: require_stable (nothing is ever pending here);
* v8: several groups per request: not served.
"""

from __future__ import annotations

from .. import cluster
from ..wire import NONE
from .base import register

KEY, NAME = 9, "OffsetFetch"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 1, 7, 6


async def handle(ep, req, conn) -> dict:
    if not cluster.coordinates(ep, req.body.group_id):
        return {"error_code": cluster.NOT_COORDINATOR, "topics": [
            {"name": t.name, "partitions": [
                {"partition_index": p, "error_code": cluster.NOT_COORDINATOR,
                 "committed_offset": -1, "committed_leader_epoch": -1, "metadata": ""}
                for p in t.partition_indexes]} for t in (req.body.topics or ())]}
    return {"error_code": NONE, "topics": ep.coordinator.fetch_offsets(req.body)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
