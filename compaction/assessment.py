"""One assessment of a partition, shared by the planner, the compactor and `kcompact inspect`.

Kafka's LogCleanerManager, on the .bcq entries alone (no data read):

* the **cleanable range** ends at the active segment, or at the first sealed segment holding a
  record younger than ``min.compaction.lag.ms`` (``cleanable_end``: the compactor's rounds stop
  there too);
* **clean bytes** are the records at or below the compaction horizon, **dirty bytes** those
  above it in the cleanable range; the **dirty ratio** is dirty / (clean + dirty). Records above
  the horizon past the cleanable end (too young) are counted apart (``uncleanable_bytes``), and
  so are the active segment's bytes (``active_bytes``): neither is cleanable, neither is in the
  ratio;
* the **triggers** (``Assessment.triggers``), each a reason string shown by `kcompact compact`
  and `inspect --json`: ``dirty ratio R`` (R >= ``min.cleanable.dirty.ratio``),
  ``max.compaction.lag.ms`` (a dirty record in a sealed segment is older than it), and beyond
  Kafka ``tombstones expired`` (a tombstone cleaned once whose ``delete.retention.ms`` has run
  out since), ``N small segments`` (runs left by short batch jobs, merged) and, with
  ``cleanup.policy=compact,delete``, ``retention.ms``.

"now" is read once by the caller (the injected clock) and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kcompact.reput.shared import split_max_shared
from kcompact.reput import bcq as B
from kcompact.reput.config import TopicConfig
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import IndexCursor

#: this many sealed segments under a quarter of segment.bytes make a partition worth a merge
SMALL_SEGMENTS = 8

TRIGGER_DIRTY = "dirty ratio"
TRIGGER_LAG = "max.compaction.lag.ms"
TRIGGER_TOMBSTONES = "tombstones expired"
TRIGGER_SMALL = "small segments"
TRIGGER_RETENTION = "retention.ms"
#: S3 with shared uploads: the partition depends on too many shared objects, or on one older
#: than max.compaction.lag.ms (docs/formats/shared-upload.md, the split)
TRIGGER_SHARED = "shared objects"


@dataclass
class Assessment:
    """What a partition holds, from the compaction's point of view, and why it is due."""

    topic: str
    partition: int
    horizon: int                   # last cleaned offset, -1: never compacted
    clean_bytes: int = 0           # records at or below the horizon (sealed segments)
    dirty_bytes: int = 0           # records above it, in the cleanable range
    uncleanable_bytes: int = 0     # above it, in sealed segments younger than min.compaction.lag
    active_bytes: int = 0          # the active segment (never cleaned without --force)
    oldest_dirty_ms: int | None = None   # timestamp of the oldest dirty sealed record
    small_segments: int = 0
    tombstones_expired: int = 0    # cleaned tombstones past delete.retention.ms
    triggers: list[str] = field(default_factory=list)

    @property
    def dirty_ratio(self) -> float:
        total = self.clean_bytes + self.dirty_bytes
        return self.dirty_bytes / total if total else 0.0


def expired_tombstones(flags: np.ndarray, clean_time: np.ndarray, now_s: int,
                       retention_s: int, spare_last: bool = False) -> int:
    """How many of the entries whose ``flags`` and ``clean_time`` columns are given (index
    entries, or IndexCursor.tombstone_columns) are keyed tombstones cleaned once (``clean_time``
    set) whose ``delete.retention.ms`` (``retention_s``, rounded up) has run out at ``now_s``.
    ``spare_last``: the last entry is the partition's last record, which compaction keeps (as
    Kafka's never-cleaned active segment does: ``tail_offset``), so it is not counted."""
    if spare_last:
        flags, clean_time = flags[:-1], clean_time[:-1]
    tomb = (flags & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS)) == B.FLAG_TOMBSTONE
    ct = clean_time[tomb]
    ct = ct[ct != 0]
    return int(np.count_nonzero(now_s - ct.astype(np.int64) > retention_s)) if ct.size else 0


def tail_offset(pl: PartitionLog) -> int:
    """The offset of the partition's last record (-1: none), which compaction never removes:
    Kafka never cleans its active segment, so a Kafka partition's last record is always there,
    even a tombstone past ``delete.retention.ms``. kcompact rolls its active segment at the end
    of a batch job and under ``compact --force``; keeping that record keeps the partition's end
    as Kafka's (a consumer reads a record at the high watermark - 1 where Kafka has one, not an
    offset gap). It goes the usual way once a later record is written."""
    return pl.last_offset


def retention_s(cfg: TopicConfig) -> int:
    """delete.retention.ms in whole seconds, rounded up (clean_time is in seconds)."""
    return -(-cfg.delete_retention_ms // 1000)


def _young(e: np.ndarray, limit: int | None) -> bool:
    return limit is not None and e.shape[0] > 0 and int(e["timestamp"].max()) > limit


def cleanable_end(pl: PartitionLog, cfg: TopicConfig, now_ms: int,
                  cursor: IndexCursor | None = None) -> int:
    """First offset that may not be cleaned: the active segment's base, or the base of the
    first sealed segment holding a record younger than ``min.compaction.lag.ms``."""
    if cfg.min_compaction_lag_ms > 0:
        limit = now_ms - cfg.min_compaction_lag_ms
        cursor = cursor or IndexCursor(pl)
        for seg in pl.sealed_segments:
            tr = seg.time_range
            if tr is not None:
                if tr[1] > limit:
                    return seg.base
                continue
            if any(_young(e, limit) for _, e in cursor.chunks(seg)):
                return seg.base
    return pl.active_base


def assess_partition(pl: PartitionLog, cfg: TopicConfig, now_ms: int,
                     cursor: IndexCursor | None = None) -> Assessment:
    """The assessment of one partition at ``now_ms`` (index only, one pass over the sealed
    segments' entries; see the module docstring)."""
    cleaned, _ = pl.checkpoint()
    a = Assessment(pl.topic, pl.partition, cleaned, active_bytes=pl.active_bytes)
    cursor = cursor or IndexCursor(pl)
    limit = now_ms - cfg.min_compaction_lag_ms if cfg.min_compaction_lag_ms > 0 else None
    now_s, ret_s = now_ms // 1000, retention_s(cfg)
    tail = tail_offset(pl)
    first_max_ts = None
    young = False        # past the cleanable end: this segment or an earlier one is too young
    for k, seg in enumerate(pl.sealed_segments):
        if seg.log_size < cfg.segment_bytes // 4 and seg.kind != "shared":  # (split apart)
            a.small_segments += 1
        seg_dirty = 0
        tr = seg.time_range
        d = seg.desc
        if tr is not None and d is not None and d.first_offset is not None \
                and d.first_offset > cleaned:
            # a part this process wrote, every record above the horizon: what its index
            # would give (the sum of its batches' sizes is its .log) without reading it
            if k == 0:
                first_max_ts = tr[1] if first_max_ts is None else max(first_max_ts, tr[1])
            young = young or (limit is not None and tr[1] > limit)
            a.oldest_dirty_ms = tr[0] if a.oldest_dirty_ms is None else min(a.oldest_dirty_ms,
                                                                             tr[0])
            if young:
                a.uncleanable_bytes += seg.log_size
            else:
                a.dirty_bytes += seg.log_size
            continue
        for _, e in cursor.chunks(seg):
            if e.shape[0] == 0:
                continue
            if k == 0:
                m = int(e["timestamp"].max())
                first_max_ts = m if first_max_ts is None else max(first_max_ts, m)
            young = young or _young(e, limit)
            i = int(np.searchsorted(e["offset"], cleaned + 1))
            a.clean_bytes += int(e["size"][:i].sum())
            seg_dirty += int(e["size"][i:].sum())
            if i < e.shape[0]:
                t = int(e["timestamp"][i:].min())
                a.oldest_dirty_ms = t if a.oldest_dirty_ms is None else min(a.oldest_dirty_ms, t)
            if cfg.compact and i:
                a.tombstones_expired += expired_tombstones(
                    e["flags"][:i], e["clean_time"][:i], now_s, ret_s,
                    spare_last=int(e["offset"][i - 1]) == tail)
        if young:
            a.uncleanable_bytes += seg_dirty
        else:
            a.dirty_bytes += seg_dirty
    if cfg.delete and cfg.retention_ms >= 0 and first_max_ts is not None \
            and first_max_ts < now_ms - cfg.retention_ms:
        a.triggers.append(TRIGGER_RETENTION)
    shared = pl.shared_objects
    if shared:
        oldest = pl.oldest_part_ms()
        if shared >= split_max_shared() or (oldest is not None
                                            and now_ms - oldest > cfg.max_compaction_lag_ms):
            a.triggers.append(f"{shared} {TRIGGER_SHARED}")
    if not cfg.compact:
        return a
    if a.dirty_bytes and a.dirty_ratio >= cfg.min_cleanable_dirty_ratio:
        a.triggers.append(f"{TRIGGER_DIRTY} {a.dirty_ratio:.2f}")
    if a.oldest_dirty_ms is not None and now_ms - a.oldest_dirty_ms > cfg.max_compaction_lag_ms:
        a.triggers.append(TRIGGER_LAG)
    if a.tombstones_expired:
        a.triggers.append(TRIGGER_TOMBSTONES)
    if a.small_segments >= SMALL_SEGMENTS:
        a.triggers.append(f"{a.small_segments} {TRIGGER_SMALL}")
    return a
