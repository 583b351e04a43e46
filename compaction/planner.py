"""Which partitions to compact, and a background scheduler for long-running processes.

The planner follows Kafka's LogCleanerManager: a partition is cleanable when its dirty ratio
(dirty bytes / (clean + dirty bytes) over the cleanable range) reaches
``min.cleanable.dirty.ratio``, or when its oldest dirty record is older than
``max.compaction.lag.ms``; the filthiest partition goes first. It also merges runs of small
sealed segments (``small_segments`` of them under a quarter of ``segment.bytes``), which is what
many short flushes leave behind. ``force`` picks everything.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from reput.config import SYSTEM_CLOCK, Clock
from reput.store import Store

from .compactor import CompactionOptions, CompactionResult, Compactor

SMALL_SEGMENTS = 8


@dataclass
class Candidate:
    topic: str
    partition: int
    reason: str
    dirty_ratio: float


def assess(store: Store, topic: str, partition: int, clock: Clock = SYSTEM_CLOCK
           ) -> Candidate | None:
    cfg = store.topic_config(topic)
    pl = store.partition(topic, partition)
    if not pl.sealed_segments:
        return None
    cleaned, _ = pl.checkpoint()
    now = clock.ms()
    clean = dirty = 0
    oldest_dirty = None
    small = 0
    first_max_ts = None
    for k, seg in enumerate(pl.sealed_segments):
        if seg.log_size < cfg.segment_bytes // 4:
            small += 1
        for _, e in pl.index_chunks(seg):
            if k == 0:
                m = int(e["timestamp"].max())
                first_max_ts = m if first_max_ts is None else max(first_max_ts, m)
            i = int(np.searchsorted(e["offset"], cleaned + 1))
            clean += int(e["size"][:i].sum())
            dirty += int(e["size"][i:].sum())
            if i < e.shape[0]:
                t = int(e["timestamp"][i:].min())
                oldest_dirty = t if oldest_dirty is None else min(oldest_dirty, t)
    if cfg.delete and cfg.retention_ms >= 0:
        if first_max_ts is not None and first_max_ts < now - cfg.retention_ms:
            return Candidate(topic, partition, "retention.ms", 0.0)
    if not cfg.compact:
        return None
    ratio = dirty / (clean + dirty) if clean + dirty else 0.0
    if dirty and ratio >= cfg.min_cleanable_dirty_ratio:
        return Candidate(topic, partition, f"dirty ratio {ratio:.2f}", ratio)
    if oldest_dirty is not None and now - oldest_dirty > cfg.max_compaction_lag_ms:
        return Candidate(topic, partition, "max.compaction.lag.ms", ratio)
    if small >= SMALL_SEGMENTS:
        return Candidate(topic, partition, f"{small} small segments", ratio)
    return None


def plan(store: Store, *, topic: str | None = None, partition: int | None = None,
         force: bool = False, clock: Clock = SYSTEM_CLOCK) -> list[Candidate]:
    out = []
    for t in ([topic] if topic else store.topics()):
        for p in store.partitions(t):
            if partition is not None and p != partition:
                continue
            if force:
                out.append(Candidate(t, p, "forced", 0.0))
                continue
            c = assess(store, t, p, clock)
            if c is not None:
                out.append(c)
    out.sort(key=lambda c: -c.dirty_ratio)
    return out


def compact_store(store: Store, *, topic: str | None = None, partition: int | None = None,
                  force: bool = False, options: CompactionOptions = CompactionOptions(),
                  clock: Clock | None = None,
                  progress: Callable[[str], None] | None = None) -> list[CompactionResult]:
    """Plan, then compact each chosen partition once (`kcompact compact`)."""
    clock = clock or store.clock
    compactor = Compactor(store, options, clock)
    results = []
    for c in plan(store, topic=topic, partition=partition, force=force, clock=clock):
        if progress:
            progress(f"compacting {c.topic}-{c.partition} ({c.reason})")
        r = compactor.compact_partition(c.topic, c.partition, force=force)
        if store.writer is None:
            store.release_partition(c.topic, c.partition)
        results.append(r)
    return results


class Scheduler:
    """Runs the planner every ``interval_s`` in a background thread (one compaction at a time,
    ``options.throttle_bytes_per_s`` as the I/O budget), for `mirror --follow` and friends."""

    def __init__(self, store: Store, options: CompactionOptions = CompactionOptions(),
                 interval_s: float = 30.0, clock: Clock | None = None):
        self.store, self.options, self.interval_s = store, options, interval_s
        self.clock = clock or store.clock
        self.results: list[CompactionResult] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> list[CompactionResult]:
        res = compact_store(self.store, options=self.options, clock=self.clock)
        self.results += res
        return res

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception as e:  # keep the mirror running; report the failure
                self.errors.append(f"{type(e).__name__}: {e}")
                print(f"kcompact: background compaction failed: {e}", file=sys.stderr)

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="kcompact-compaction", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
