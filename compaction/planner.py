"""Which partitions to compact, and a background scheduler for long-running processes.

The planner follows Kafka's LogCleanerManager on the assessment it shares with `kcompact
inspect` (assessment.py): a partition is picked when its dirty ratio (dirty / (clean + dirty)
bytes over the cleanable range) reaches ``min.cleanable.dirty.ratio``, or when a dirty record in a
sealed segment is older than ``max.compaction.lag.ms``; beyond Kafka, when a tombstone cleaned
once is past ``delete.retention.ms`` ("tombstones expired"), or for a run of small sealed
segments (what short batch jobs leave behind). The filthiest partition goes first; each pick
carries its reasons. ``force`` picks everything.

Only sealed segments are cleanable, so before planning the active segments are rolled where
that is the rule: ``compact_store`` rolls a partition's active segment when no writer holds it
(a store at rest, e.g. written before rolls existed), and the ``Scheduler`` of a long-running
writer rolls those open longer than their topic's roll time
(``PartitionLog.roll_if_due``: min(segment.ms, max.compaction.lag.ms)).

``Scheduler`` runs the planner in the background of a long-running process, one partition at a
time, within an I/O budget (``IOBudget``, Kafka's ``log.cleaner.io.max.bytes.per.second``).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from kcompact.reput.config import SYSTEM_CLOCK, Clock
from kcompact.reput.errors import CorruptRecordError, StoreLockedError
from kcompact.reput.store import Store

from .assessment import (SMALL_SEGMENTS, Assessment,  # noqa: F401  (SMALL_SEGMENTS: API)
                         assess_partition)
from .compactor import CompactionOptions, CompactionResult, Compactor
from .damage import (REPAIR_HINT, Damage, Uncleanable, compacted, damage_in, recorded,
                     remember, unique)
from .errors import CompactionError
from .throttle import CompactionStopped, IOBudget  # noqa: F401  (re-exported)


@dataclass
class Candidate:
    topic: str
    partition: int
    reason: str                  # the first trigger (or "forced")
    dirty_ratio: float
    reasons: list[str] = field(default_factory=list)   # every trigger that fired


def assess(store: Store, topic: str, partition: int, clock: Clock = SYSTEM_CLOCK,
           seen: dict[tuple[str, int], Assessment] | None = None) -> Candidate | None:
    """The partition as a candidate when a trigger fires (assessment.py), else None.
    ``seen``: where to keep the partition's assessment (the Scheduler's, for metrics)."""
    pl = store.partition(topic, partition)
    if not pl.sealed_segments and seen is None:
        return None
    a = assess_partition(pl, store.topic_config(topic), clock.ms())
    if seen is not None:
        seen[(topic, partition)] = a
    if not a.triggers or not pl.sealed_segments:
        return None
    return Candidate(topic, partition, a.triggers[0], a.dirty_ratio, a.triggers)


def _selected(store: Store, topic: str | None, partition: int | None):
    for t in ([topic] if topic else store.topics()):
        for p in store.partitions(t):
            if partition is None or p == partition:
                yield t, p


def plan(store: Store, *, topic: str | None = None, partition: int | None = None,
         force: bool = False, clock: Clock = SYSTEM_CLOCK,
         seen: dict[tuple[str, int], Assessment] | None = None,
         damaged: list[Damage] | None = None) -> list[Candidate]:
    """The partitions due for compaction, filthiest first; ``seen`` (not with ``force``):
    where to keep every partition's assessment. ``damaged``: where to put the partitions whose
    assessment met damage (they are left out); without it, the damage is raised."""
    out = []
    for t, p in _selected(store, topic, partition):
        if force:
            out.append(Candidate(t, p, "forced", 0.0, ["forced"]))
            continue
        try:
            c = assess(store, t, p, clock, seen)
        except CorruptRecordError as e:
            if damaged is None:
                raise
            damaged.append(Damage.of(t, p, e))
            continue
        if c is not None:
            out.append(c)
    out.sort(key=lambda c: -c.dirty_ratio)
    return out


def roll_unheld(store: Store, topic: str, partition: int) -> bool:
    """Roll the active segment of a partition that no writer holds (a store at rest), so
    compaction may clean it; a partition another live process writes is left to that writer.
    Returns whether it rolled. For a store that is not itself a writer (`kcompact compact`)."""
    pl = store.partition(topic, partition)
    if not any(s.kind == "file" and s.log_size for s in pl.segments[-1:]):
        return False
    try:
        with store.lock:
            pl = store.writable_partition(topic, partition)
            if not any(s.kind == "file" and s.log_size for s in pl.segments[-1:]):
                return False
            pl.roll(writer="compactor")
            pl.sync()
            return True
    except StoreLockedError:
        return False


def compact_store(store: Store, *, topic: str | None = None, partition: int | None = None,
                  force: bool = False, options: CompactionOptions = CompactionOptions(),
                  clock: Clock | None = None,
                  progress: Callable[[str], None] | None = None,
                  budget: IOBudget | None = None) -> list[CompactionResult]:
    """Roll the active segments no writer holds (a store that is not a writer) or those due
    (a writer's own store), plan, then compact each chosen partition once (`kcompact
    compact`). ``budget``: the I/O budget (default: ``options.throttle_bytes_per_s``).

    A partition found damaged (compaction/damage.py) is skipped: its result has ``damaged``
    set (and ``skipped``), ``progress`` gets its one line, and every other partition is
    compacted."""
    clock = clock or store.clock
    results: list[CompactionResult] = []
    damaged: list[Damage] = []

    def skip(d: Damage) -> None:
        remember(store, d, "compact")  # beside the partition, until repaired
        if progress:
            progress(d.line())
        if store.writer is None:
            store.release_partition(d.topic, d.partition)
        results.append(damaged_result(d))

    if not force:
        if store.writer is None:
            for t, p in _selected(store, topic, partition):
                try:
                    if roll_unheld(store, t, p) and progress:
                        progress(f"rolled the active segment of {t}-{p} (no writer holds it)")
                except CorruptRecordError as e:
                    damaged.append(Damage.of(t, p, e))
        else:
            store.roll(only_due=True)
    compactor = Compactor(store, options, clock, budget)
    found = {(d.topic, d.partition) for d in damaged}
    cands = [c for c in plan(store, topic=topic, partition=partition, force=force, clock=clock,
                             damaged=damaged) if (c.topic, c.partition) not in found]
    for d in unique(damaged):
        skip(d)
    with one_object_per_run(store, compactor) as done:
        for c in cands:
            why = ", ".join(c.reasons) or c.reason
            if progress:
                progress(f"compacting {c.topic}-{c.partition} ({why})")
            try:
                r = compactor.compact_partition(c.topic, c.partition, force=force, reason=why)
            except (CorruptRecordError, CompactionError, FileNotFoundError) as e:
                d = damage_in(c.topic, c.partition, e)
                if d is None:
                    raise
                skip(d)
                continue
            compacted(store, c.topic, c.partition)  # (its damage record, when it is gone)
            done(c.topic, c.partition)
            results.append(r)
    if store.writer is None:
        for t, p in _selected(store, topic, partition):
            store.release_partition(t, p)  # the partitions rolled above
    if (topic is None and partition is None) or any(r.shared_parts_split for r in results):
        # S3 with shared uploads: objects every partition has split (a run over one topic or
        # partition collects too when it split: an object holding other partitions' parts
        # stays until they split it)
        store.collect_shared_garbage()
    if compactor.batch is not None and topic is None and partition is None:
        store.collect_compaction_garbage()
    return results


@contextmanager
def one_object_per_run(store, compactor: Compactor):
    """S3: a run's outputs of every partition in one object (docs/formats/compaction-object.md):
    the store's batch set on ``compactor`` for the block, published when it ends and aborted
    when it raises (None elsewhere: each partition publishes its own). Yields ``done(topic,
    partition)``, called with each partition compacted: a store opened without a writer
    releases it then, or once the batch has published it."""
    batch = compactor.batch = store.compaction_batch()
    held: list[tuple[str, int]] = []

    def done(topic: str, partition: int) -> None:
        if store.writer is not None:
            return
        if batch is None:
            store.release_partition(topic, partition)
        else:
            held.append((topic, partition))

    try:
        yield done
        if batch is not None:
            batch.publish()
    except BaseException:
        if batch is not None:
            batch.abort()
        raise
    finally:
        for t, p in held:
            store.release_partition(t, p)


def damaged_result(d: Damage) -> CompactionResult:
    """The result of a partition skipped as damaged."""
    return CompactionResult(d.topic, d.partition, skipped=f"damaged: {d.where()}",
                            damaged=d.to_dict())


class Scheduler:
    """Runs the planner every ``interval_s`` in a background thread, for `mirror --follow`,
    `replicate --follow` and other long-running processes.

    One partition is compacted at a time (one thread), and pass 2's reads and writes share an
    I/O budget of ``options.throttle_bytes_per_s`` (None or 0: unlimited), so compaction does
    not starve the process's own writes. ``stop()`` is prompt: it interrupts a budget wait or
    the pause between runs, abandons the partition being compacted (uncommitted, so nothing
    changes) and joins the thread. ``monotonic``/``wait`` are the budget's (injected in tests);
    by default it waits on the stop request itself. A failed run is reported on stderr and in
    ``errors``, and the next run is tried (the process keeps going). A damaged partition is
    not a failed run: it is skipped, said once on stderr and kept in ``uncleanable`` until it
    compacts again (compaction/damage.py)."""

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
        #: every partition's assessment as of this thread's last look (each run's plan, and
        #: again after compacting it): what a metrics scrape reads, so it takes no lock of
        #: the writer's and reads no index while the writer appends
        self.assessments: dict[tuple[str, int], Assessment] = {}
        #: the partitions found damaged (Kafka's uncleanable partitions): skipped, the others
        #: compacted; the metric kcompact_uncleanable_partitions counts them
        self.uncleanable = Uncleanable()
        #: partitions with a damage record this process knows of (``_after``)
        self._with_record: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.budget = IOBudget(options.throttle_bytes_per_s, monotonic=monotonic,
                               wait=wait if wait is not None else self._stop.wait)

    def run_once(self) -> list[CompactionResult]:
        """Plan, then compact each chosen partition, until done or stopped. A partition found
        damaged is skipped and kept in ``uncleanable`` (compaction/damage.py); its line is
        printed once, not at every run."""
        res = []
        # a compactor per run, as `kcompact compact` does: its offset map is not kept
        # allocated in the long-running process between runs
        compactor = Compactor(self.store, self.options, self.clock, self.budget)
        # S3: the run's outputs of every partition in one object (compaction-object.md)
        batch = compactor.batch = self.store.compaction_batch()
        done: list[tuple[str, int]] = []
        # the partitions this process writes whose active segment is due (idle, or open for
        # min(segment.ms, max.compaction.lag.ms)): only sealed segments are cleanable
        self.store.roll(only_due=True)
        seen: dict[tuple[str, int], Assessment] = {}
        damaged: list[Damage] = []
        planned = plan(self.store, clock=self.clock, seen=seen, damaged=damaged)
        self.assessments = seen
        for key in self.uncleanable.snapshot():
            if key in seen:  # assessed without damage this time (repaired meanwhile)
                self.uncleanable.clear(*key)
        for d in damaged:
            self._damaged(d)
        for d in self._recorded(seen):
            self._damaged(d, record=False)
        try:
            for c in planned:
                if self._stop.is_set():
                    break
                self.busy = (c.topic, c.partition)
                self.budget.restart()
                try:
                    r = compactor.compact_partition(c.topic, c.partition,
                                                    reason=", ".join(c.reasons) or c.reason)
                except (CorruptRecordError, CompactionError, FileNotFoundError) as e:
                    d = damage_in(c.topic, c.partition, e)
                    if d is None:
                        raise
                    self._damaged(d)
                    if self.store.writer is None:
                        self.store.release_partition(c.topic, c.partition)
                    continue
                finally:
                    self.busy = None
                done.append((c.topic, c.partition))
                res.append(r)
                self.results.append(r)
                if batch is None:
                    self._after(c.topic, c.partition, seen)
            if batch is not None:
                batch.publish()
                for t, p in done:
                    self._after(t, p, seen)
        except BaseException:
            if batch is not None:
                batch.abort()
                for t, p in done:
                    if self.store.writer is None:
                        self.store.release_partition(t, p)
            raise
        if any(r.shared_parts_split for r in res):
            self.store.collect_shared_garbage()  # objects split a grace period ago
        if batch is not None and batch.objects:
            self.store.collect_compaction_garbage()  # objects compacted again, dead runs'
        self.runs += 1
        return res

    def _after(self, topic: str, partition: int, seen: dict) -> None:
        """A partition's compaction is committed: its damage record and assessment. On an
        object store only a partition this process knows damaged (its first run's look at every
        record, or damage it met since: ``_recorded``) has its record read again, not every
        partition compacted (two GETs of a key that does not exist each, 1,024 a split of 512
        partitions)."""
        key = (topic, partition)
        if self.store.publisher.cheap_metadata or key in self._with_record:
            compacted(self.store, topic, partition)  # (its damage record, when gone)
            if recorded(self.store, topic, partition) is None:
                self.uncleanable.clear(topic, partition)
                self._with_record.discard(key)
        assess(self.store, topic, partition, self.clock, seen)
        if self.store.writer is None:
            self.store.release_partition(topic, partition)

    def _recorded(self, seen: dict) -> list[Damage]:
        """The damage recorded beside partitions (by this process, another compaction, a
        verify or a reader: reput/damage_record.py), so that the metric counts it until it is
        repaired. Every run on a local store (a missing file is one failed open); on an object
        store the first run only (a request per partition), then what this process records."""
        if self.runs and not self.store.publisher.cheap_metadata:
            return []
        out = []
        for t in self.store.topics():
            for p in self.store.partitions(t):
                d = recorded(self.store, t, p)
                if d is not None:
                    out.append(d)
        return out

    def _damaged(self, d: Damage, *, record: bool = True) -> None:
        self._with_record.add((d.topic, d.partition))  # (recorded, or found recorded)
        if record:
            remember(self.store, d, "background compaction")
        if self.uncleanable.mark(d):
            print(f"kcompact: {d.line()}; the other partitions are compacted; {REPAIR_HINT}",
                  file=sys.stderr, flush=True)

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
