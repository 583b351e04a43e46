"""What `kcompact inspect` shows: per-partition segments, records, sizes, offsets, dirty ratio."""

from __future__ import annotations

from typing import Any

import numpy as np

from reput import FLAG_KEYLESS, FLAG_TOMBSTONE, Store


def partition_summary(store: Store, topic: str, partition: int) -> dict[str, Any]:
    pl = store.partition(topic, partition)
    records = tombstones = keyless = 0
    for seg in pl.segments:
        e = pl.entries(seg)
        records += e.shape[0]
        if e.shape[0]:
            flags = e["flags"]
            tombstones += int(np.count_nonzero(flags & FLAG_TOMBSTONE))
            keyless += int(np.count_nonzero(flags & FLAG_KEYLESS))
    doc: dict[str, Any] = {
        "partition": partition, "segments": len(pl.segments), "records": records,
        "tombstones": tombstones, "keyless": keyless, "bytes": pl.size_bytes(),
        "first_offset": pl.first_offset, "next_offset": pl.next_offset,
    }
    try:
        from compaction import partition_status  # compaction adds horizon, dirty ratio, last run
    except ImportError:
        return doc
    doc.update(partition_status(store, topic, partition))
    return doc


def store_summary(store: Store, topic: str | None = None) -> dict[str, Any]:
    topics = [topic] if topic else store.topics()
    if topic and topic not in store.topics():
        from .errors import ConnectorsError
        raise ConnectorsError(f"topic {topic!r} is not in store {store.url}; topics: "
                              + (", ".join(store.topics()) or "(none)"))
    return {
        "store": store.url, "store_id": store.meta.store_id,
        "format_version": store.meta.format_version,
        "topics": [{"topic": t, "config": store.topic_config(t).to_dict(),
                    "partitions": [partition_summary(store, t, p) for p in store.partitions(t)]}
                   for t in topics],
    }
