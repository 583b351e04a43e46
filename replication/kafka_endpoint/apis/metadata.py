"""Metadata (key 3): versions 1-12, flexible from 9.

Behaviour:
* one broker, node 0, at the address the client reached (``ep.advertised_for``), also the
  controller; the cluster id is ``kcompact-<store id>``; in a fleet every live node, each
  partition led by its owner on the ring, the lowest node id the controller (cluster.py);
* every topic of the store (a request naming none), or the topics named: each partition led
  by node 0, in sync on node 0, leader epoch -1; the topic id recorded by the mirror (zero when
  unknown); a topic the store does not have (or one with no partition) UNKNOWN_TOPIC_OR_PARTITION,
  never created (allow_auto_topic_creation is ignored: the endpoint is read-only);
* with ACLs: DESCRIBE on each topic (authorize.Gate).

Version notes:
* v1: controller_id, is_internal, rack (v0 is not served: clients of the last decade send v1+);
* v2: cluster_id;
* v3: throttle_time_ms; v4: allow_auto_topic_creation in the request;
* v5: offline_replicas; v7: leader_epoch; v8: authorized operations (the schema's default);
* v9: flexible; v10: topic ids; v11: cluster authorized operations dropped;
* v12: topic names nullable in the request (by id), the same answer here.
"""

from __future__ import annotations

import base64
import uuid

from ..wire import NONE, UNKNOWN_TOPIC_OR_PARTITION
from .. import cluster
from .base import register

KEY, NAME = 3, "Metadata"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 1, 12, 9


def topic_uuid(tid: str | None) -> uuid.UUID:
    """A recorded topic id (Kafka's text form: 16 bytes in URL-safe base64 without padding, or
    a hex UUID) as a UUID; the zero UUID when unknown or unreadable (Kafka's "no id")."""
    if not tid:
        return uuid.UUID(int=0)
    try:
        if len(tid) == 22:
            return uuid.UUID(bytes=base64.urlsafe_b64decode(tid + "=="))
        return uuid.UUID(tid)
    except ValueError:
        return uuid.UUID(int=0)


async def handle(ep, req, conn) -> dict:
    view = ep.view
    names = None if req.body.topics is None else [t.name for t in req.body.topics]

    def topics() -> list[dict]:
        have = view.topics()
        out = []
        for name in (have if names is None else names):
            parts = view.partitions(name) if name in have else []
            if not parts:
                out.append({"error_code": UNKNOWN_TOPIC_OR_PARTITION, "name": name,
                            "topic_id": uuid.UUID(int=0), "partitions": []})
                continue
            tid = view.topic_id(name)
            out.append({"error_code": NONE, "name": name, "is_internal": False,
                        "topic_id": topic_uuid(tid),
                        "partitions": [{"error_code": NONE, "partition_index": p,
                                        "leader_id": (lead := cluster.leader(ep, name, p)),
                                        "leader_epoch": -1,
                                        "replica_nodes": [lead], "isr_nodes": [lead],
                                        "offline_replicas": []} for p in parts]})
        return out

    return {"brokers": cluster.brokers(ep, conn),
            "cluster_id": ep.cluster_id, "controller_id": cluster.controller(ep),
            "topics": await ep.run(topics)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
