"""What `kcompact inspect` shows: per-partition segments, records, sizes, offsets, dirty ratio."""

from __future__ import annotations

from typing import Any

import numpy as np

from kcompact.reput import FLAG_KEYLESS, FLAG_TOMBSTONE, Store
from kcompact.reput import filenames as fn


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
        from kcompact.compaction import partition_status  # compaction adds horizon, dirty ratio, last run
    except ImportError:
        return doc
    doc.update(partition_status(store, topic, partition))
    doc["last_compaction_ms"] = _last_compaction_ms(store, pl, doc) if \
        doc.get("last_compaction") else None
    return doc


def _last_compaction_ms(store: Store, pl, doc: dict[str, Any]) -> int | None:
    """When the last compaction ended: the time its result was written to the partition's
    compaction checkpoint (the file's modification time, from the backend). None when that is
    unknown (an S3 store keeps the last run in its manifest)."""
    if pl.manifest_mode:
        return None
    try:
        return store.fs.mtime_ms(fn.compaction_checkpoint(pl.topic, pl.partition))
    except FileNotFoundError:
        return None


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


def plot_store(doc: dict[str, Any], path: str) -> None:
    """Per-partition stacked bars of live (clean), dirty and reclaimed bytes, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, clean, dirty, reclaimed = [], [], [], []
    for t in doc["topics"]:
        for p in t["partitions"]:
            labels.append(f"{t['topic']}-{p['partition']}")
            d = p.get("dirty_bytes", 0) + p.get("active_bytes", 0)
            dirty.append(d / 2**20)
            clean.append(max(0, p["bytes"] - d) / 2**20)
            reclaimed.append(p.get("reclaimed_bytes", 0) / 2**20)
    if not labels:
        from .errors import ConnectorsError
        raise ConnectorsError("nothing to plot: the store has no partitions")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.6))
    y = range(len(labels))
    ax.barh(y, clean, color="#2b8a3e", label="live (compacted)")
    ax.barh(y, dirty, left=clean, color="#f08c00", label="dirty (not yet compacted)")
    ax.barh(y, reclaimed, left=[c + d for c, d in zip(clean, dirty)], color="#ced4da",
            hatch="//", label="reclaimed by compaction")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"kcompact store {doc['store']}")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
