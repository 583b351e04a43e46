"""ListOffsets (key 2): versions 1-7, flexible from 6.

Behaviour, per partition:
* LATEST (-1): the high watermark; EARLIEST (-2): the log start offset;
* MAX_TIMESTAMP (-3): the offset and timestamp of the record with the largest timestamp;
* a timestamp >= 0: the first record at or after it (offset and timestamp -1 when none is);
* another negative timestamp (KIP-1005's -4, -5): INVALID_REQUEST;
* a partition the store does not have: UNKNOWN_TOPIC_OR_PARTITION; in a fleet, one another
  node leads: NOT_LEADER_OR_FOLLOWER (cluster.py); one that fails its checks
  (damaged): KAFKA_STORAGE_ERROR, as Kafka answers for an offline log;
* with ACLs: DESCRIBE on the topic (authorize.Gate).

Version notes:
* v1: one offset per partition (v0's max_num_offsets gone), timestamp in the response;
* v2: isolation_level (both levels answer the same: the store holds no open transaction);
* v3: the same fields; v4: current_leader_epoch in the request, leader_epoch in the response;
* v5: the same fields; v6: flexible;
* v7: MAX_TIMESTAMP (KIP-734); v8+ (KIP-405's -4, KIP-1005's -5): not served.
"""

from __future__ import annotations

from kcompact.reput.errors import CorruptRecordError

from ..wire import INVALID_REQUEST, KAFKA_STORAGE_ERROR, NONE, UNKNOWN_TOPIC_OR_PARTITION
from .. import cluster
from .base import register

KEY, NAME = 2, "ListOffsets"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 1, 7, 6
#: the special timestamps
LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3
#: offset and timestamp Kafka answers when no record is at or after a timestamp
NO_OFFSET = -1


async def handle(ep, req, conn) -> dict:
    view = ep.view

    def answer() -> list[dict]:
        out = []
        for t in req.body.topics:
            have = set(view.partitions(t.name))
            parts = []
            for p in t.partitions:
                pi, ts = int(p.partition_index), int(p.timestamp)
                row = {"partition_index": pi, "error_code": NONE, "timestamp": -1,
                       "offset": NO_OFFSET, "leader_epoch": -1}
                if pi not in have:
                    row["error_code"] = UNKNOWN_TOPIC_OR_PARTITION
                elif not cluster.leads(ep, t.name, pi):
                    row["error_code"] = cluster.NOT_LEADER_OR_FOLLOWER
                else:
                    try:
                        b = view.bounds(t.name, pi, fresh=ts == LATEST)
                    except CorruptRecordError:  # damaged: an offline log
                        row["error_code"] = KAFKA_STORAGE_ERROR
                        parts.append(row)
                        continue
                    if ts == LATEST:
                        row["offset"] = b.high_watermark
                    elif ts == EARLIEST:
                        row["offset"] = b.log_start
                    elif ts == MAX_TIMESTAMP:
                        hit = view.max_timestamp(t.name, pi)
                        if hit is not None:
                            row["offset"], row["timestamp"] = hit
                    elif ts >= 0:
                        hit = view.offset_for_timestamp(t.name, pi, ts)
                        if hit is not None:
                            row["offset"], row["timestamp"] = hit
                    else:  # another negative timestamp (e.g. KIP-1005's -4, -5)
                        row["error_code"] = INVALID_REQUEST
                parts.append(row)
            out.append({"name": t.name, "partitions": parts})
        return out

    return {"topics": await ep.run(answer)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
