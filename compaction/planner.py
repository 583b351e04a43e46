"""Which partitions to compact, and a background scheduler for long-running processes.

The planner follows Kafka's LogCleanerManager: a partition is cleanable when its dirty ratio
(dirty bytes / (clean + dirty bytes) over the cleanable range) reaches
``min.cleanable.dirty.ratio``, or when its oldest dirty record is older than
``max.compaction.lag.ms``; the filthiest partition goes first. It also merges runs of small
sealed segments (``small_segments`` of them under a quarter of ``segment.bytes``), which is what
many short flushes leave behind. ``force`` picks everything.

``Scheduler`` runs the planner in the background of a long-running process, one partition at a
time, within an I/O budget (``IOBudget``, Kafka's ``log.cleaner.io.max.bytes.per.second``).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kcompact.reput.config import SYSTEM_CLOCK, Clock
from kcompact.reput.reader import IndexCursor
from kcompact.reput.store import Store

from .compactor import CompactionOptions, CompactionResult, Compactor
from .errors import CompactionError

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
    cursor = IndexCursor(pl)
    for k, seg in enumerate(pl.sealed_segments):
        if seg.log_size < cfg.segment_bytes // 4:
            small += 1
        for _, e in cursor.chunks(seg):
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


class IOBudget:
    """A byte-rate limit (Kafka's cleaner ``Throttler``): ``charge(n)`` after moving ``n`` bytes
    waits until the bytes charged since the budget's first use average at most ``bytes_per_s``.

    Pacing is from the end of the previous charge, so the time the work itself took counts
    toward the budget; the first charge of a run pays in full. ``monotonic`` and ``wait`` are
    injected (tests pass a fake clock, never sleeping): ``wait(seconds)`` returns True when the
    wait was cut short by a stop request, and then ``charge`` raises :class:`CompactionStopped`.
    ``bytes_per_s`` None or 0 means unlimited (bytes are still counted)."""

    def __init__(self, bytes_per_s: float | None, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], bool] | None = None):
        if bytes_per_s is not None and bytes_per_s < 0:
            raise CompactionError(f"I/O budget must be >= 0 bytes/s (0 = unlimited), "
                                  f"got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s or 0
        self.monotonic = monotonic
        self._wait = wait if wait is not None else _sleep
        self._last: float | None = None
        self.bytes = 0          # charged so far
        self.waited_s = 0.0     # time asked of wait() so far

    def restart(self) -> None:
        """Forget the pace (idle time between runs is not credit for the next run)."""
        self._last = None

    def charge(self, nbytes: int) -> None:
        self.bytes += nbytes
        if not self.bytes_per_s:
            return
        now = self.monotonic()
        due = (now if self._last is None else self._last) + nbytes / self.bytes_per_s
        if due <= now:
            self._last = now
            return
        self._last = due
        self.waited_s += due - now
        if self._wait(due - now):
            raise CompactionStopped("compaction stopped by Scheduler.stop(); the old segments "
                                    "are still in place")


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


class CompactionStopped(CompactionError):
    """A background compaction was cut short by a stop request: it was never committed, so the
    partition is as it was (its staged output is discarded by the next compaction or on open)."""


class _BudgetedCompactor(Compactor):
    """The compactor, paced by an :class:`IOBudget`: pass 2 reports the bytes of each chunk it
    read and wrote to ``Compactor._throttle`` (compactor.py), routed here to the budget instead
    of the compactor's own ``time.sleep``."""

    def __init__(self, store: Store, options: CompactionOptions, clock: Clock, budget: IOBudget):
        super().__init__(store, options, clock)
        self.budget = budget

    def _throttle(self, nbytes: int) -> None:
        self.budget.charge(nbytes)


class Scheduler:
    """Runs the planner every ``interval_s`` in a background thread, for `mirror --follow`,
    `replicate --follow` and other long-running processes.

    One partition is compacted at a time (one thread), and pass 2's reads and writes share an
    I/O budget of ``options.throttle_bytes_per_s`` (None or 0: unlimited), so compaction does
    not starve the process's own writes. ``stop()`` is prompt: it interrupts a budget wait or
    the pause between runs, abandons the partition being compacted (uncommitted, so nothing
    changes) and joins the thread. ``monotonic``/``wait`` are the budget's (injected in tests);
    by default it waits on the stop request itself. A failed run is reported on stderr and in
    ``errors``, and the next run is tried (the process keeps going)."""

    def __init__(self, store: Store, options: CompactionOptions = CompactionOptions(),
                 interval_s: float = 30.0, clock: Clock | None = None, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], bool] | None = None):
        self.store, self.options, self.interval_s = store, options, interval_s
        self.clock = clock or store.clock
        self.results: list[CompactionResult] = []
        self.errors: list[str] = []
        self.runs = 0                                    # planner runs finished
        self.busy: tuple[str, int] | None = None         # the partition being compacted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.budget = IOBudget(options.throttle_bytes_per_s, monotonic=monotonic,
                               wait=wait if wait is not None else self._stop.wait)

    def run_once(self) -> list[CompactionResult]:
        """Plan, then compact each chosen partition, until done or stopped."""
        res = []
        # a compactor per run, as `kcompact compact` does: its offset map is not kept
        # allocated in the long-running process between runs
        compactor = _BudgetedCompactor(self.store, self.options, self.clock, self.budget)
        for c in plan(self.store, clock=self.clock):
            if self._stop.is_set():
                break
            self.busy = (c.topic, c.partition)
            self.budget.restart()
            try:
                r = compactor.compact_partition(c.topic, c.partition)
            finally:
                self.busy = None
            if self.store.writer is None:
                self.store.release_partition(c.topic, c.partition)
            res.append(r)
            self.results.append(r)
        self.runs += 1
        return res

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except CompactionStopped:
                return
            except Exception as e:  # keep the mirror running; report the failure
                self.errors.append(f"{type(e).__name__}: {e}")
                print(f"kcompact: background compaction failed: {e}", file=sys.stderr)

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="kcompact-compaction", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stop and join the thread; False if it is still running after ``timeout`` s."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
