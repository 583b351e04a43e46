"""Reading a topic and a store back for comparison, and records as the column producer takes
them (shared by the integration tests)."""

from __future__ import annotations

import time
import uuid

import numpy as np
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kcompact.connectors.plugins.store_source.progress import RestoreJob
from kcompact.reput import Store


def read_topic(bootstrap: str, topic: str, partitions: int, *, offsets: bool = True
               ) -> dict[int, list[tuple]]:
    """Everything a read_committed consumer sees, per partition in offset order:
    (offset, timestamp, key, value, headers), or without the offset when ``offsets`` is False."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": "read_committed", "queued.min.messages": 1_000_000})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: dict[int, list[tuple]] = {p: [] for p in range(partitions)}
    eof: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while len(eof) < partitions:
            assert time.monotonic() < deadline, "reading the topic back timed out"
            for m in c.consume(10_000, 0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(m.partition())
                    continue
                row = (m.timestamp()[1], m.key(), m.value(), tuple(m.headers() or ()))
                out[m.partition()].append((m.offset(), *row) if offsets else row)
    finally:
        c.close()
    return out


def read_store(url: str, topic: str) -> dict[int, list[tuple]]:
    """Every stored record per partition: (offset, timestamp, key, value, headers)."""
    with Store.open(url) as st:
        return {p: [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers))
                    for r in st.iter_records(topic, p)] for p in st.partitions(topic)}


def packed_columns(items: list) -> tuple:
    """bytes | None items as NativeProducer.produce_columns takes a key or value column:
    (buffer, int64 starts, int64 ends, uint8 nulls)."""
    starts, ends, at = [], [], 0
    for x in items:
        starts.append(at)
        at += len(x or b"")
        ends.append(at)
    return (b"".join(x or b"" for x in items), np.array(starts, np.int64),
            np.array(ends, np.int64), np.array([x is None for x in items], np.uint8))


def restore_job(bootstrap: str, url: str, target: str, topic: str = "orders") -> RestoreJob:
    """The job a ``kcompact restore`` of ``topic`` from ``url`` to ``target`` records its
    progress under (tests wait on that progress before they kill a restore)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        cluster = c.list_topics(timeout=10).cluster_id or bootstrap
    finally:
        c.close()
    with Store.open(url) as st:
        return RestoreJob(st.meta.store_id, topic, cluster, target)
