"""Multi-round, bounded-memory compaction of one partition (Kafka's semantics, RocketMQ's rounds).

A round:

1. **Map** (pass 1, index only): from the first dirty offset (compaction checkpoint + 1) up to
   the end of the cleanable range — the last sealed segment, stopping before the first segment
   holding a record younger than ``min.compaction.lag.ms`` — insert every keyed .bcq entry's
   digest -> offset into the offset map, until the map is full. ``last_mapped`` is the last
   offset inserted.
2. **Decide** (index only): for every record of the sealed segments up to the one holding
   ``last_mapped``: keep it if keyless, or after ``last_mapped``, or the latest offset for its
   digest; a kept tombstone gets ``clean_time = now`` the first time it is cleaned and is dropped
   once ``delete.retention.ms`` has passed since. The partition's last record is always kept
   (``assessment.tail_offset``: Kafka's never-cleaned active segment holds it; only a tombstone
   past ``delete.retention.ms`` could be that record and be dropped otherwise). Segments are
   grouped so that each group's kept bytes fit in ``segment.bytes`` (merging runs of small
   segments); a group with nothing dropped, nothing to stamp and one member is left as it is.
3. **Copy** (pass 2): each rewritten group streams its input .log segments once, in chunks, and
   writes the kept records (bytes unchanged, offsets unchanged) and their entries into
   ``.compacting/``; then the swap (reput/swap.py) replaces the inputs and advances the
   checkpoint to ``last_mapped``.

Rounds repeat until the dirty range is empty, so deduplication is exact for any number of keys.

**Damage is refused, never spread.** Before a local run writes anything, every sealed .bcq is
read whole and ``IndexCursor`` checks it against the checksum in the partition's segment list
(``_check_inputs``; on S3 the manifest's, as each round reads it, and nothing is published
before the run ends): a mismatch raises ``CorruptRecordError`` naming the .bcq. The
records a round keeps are read through the partition reader, each checked against its entry and
its CRC, so a damaged .log fails the copy; the round's staged outputs are then deleted and no
swap happens. A forced compaction that is refused takes back its roll of the active segment
(``PartitionLog.unroll``), so a refused compaction leaves the partition as it was.
Memory: the map's budget plus a few chunk buffers (``io_chunk_bytes``), whatever the partition
size. The active segment is never compacted, except with ``force``, which rolls it first.

On S3 (docs/formats/manifest.md) the sealed segments are the manifest's objects: each input
``.bcq`` is fetched once into the local spool (every pass then reads it locally), each
rewritten ``.log`` is streamed once (one GET), outputs are staged in the local directory, and at
the end ``PartitionLog.commit_staged`` uploads each output once and commits one manifest version
(the commit point; replaced objects are deleted after the grace period). So a compaction issues
a few requests per segment and per partition, whatever the record count. ``force`` publishes the
writer's local segments (when this process writes the partition) instead of rolling.

(About 700 lines on purpose: a round's passes share its state, the map, the plan and the budget,
and the order of their checks and swaps is the crash-safety argument; split, it would be read
across files.)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kcompact.reput import bcq as B
from kcompact.reput import filenames as fn
from kcompact.reput import swap
from kcompact.reput.swap import wait_for_deletes  # noqa: F401 (deferred deletes live there)
from kcompact.reput.config import SYSTEM_CLOCK, Clock, TopicConfig
from kcompact.reput.errors import CorruptRecordError, StoreLockedError
from kcompact.reput.locks import FileLock
from kcompact.reput.partition import PartitionLog, Segment
from kcompact.reput.reader import IndexCursor, PartitionReader
from kcompact.reput.batch import codec_of
from kcompact.reput.codecs import needs_recode, target_of
from kcompact.reput.rewrite import SegmentWriter2
from kcompact.reput.store import Store

from .assessment import (assess_partition, cleanable_end, expired_tombstones, retention_s,
                         tail_offset)
from .errors import CompactionError
from . import history
from .offset_map import OffsetMap
from .throttle import IOBudget

DEFAULT_MAP_MEMORY = 128 << 20


@dataclass(frozen=True)
class CompactionOptions:
    offset_map_memory: int = DEFAULT_MAP_MEMORY
    io_chunk_bytes: int = 4 << 20          # data read/written per step of pass 2
    index_chunk_entries: int = 1 << 15     # .bcq entries read per step (1.5 MiB)
    max_load: float = 0.9
    #: I/O budget (bytes read + written per second, index reads included; None/0: unlimited)
    throttle_bytes_per_s: float | None = None

    def __post_init__(self):
        if self.offset_map_memory < 4096:
            raise CompactionError("offset map memory must be at least 4 KiB")
        if self.io_chunk_bytes < 1 << 16:
            raise CompactionError("io_chunk_bytes must be at least 64 KiB")


@dataclass
class CompactionResult:
    topic: str
    partition: int
    rounds: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    records_read: int = 0      # index entries examined, summed over rounds
    records_kept: int = 0      # records in the partition after compaction
    records_dropped: int = 0   # records before minus records after
    reason: str | None = None  # why the planner picked the partition (its triggers, "forced")
    tombstones_dropped: int = 0
    segments_before: int = 0
    segments_after: int = 0
    segments_rewritten: int = 0
    map_keys_max: int = 0
    map_utilization_max: float = 0.0
    map_bytes_per_key: float = 0.0
    cleaned_offset: int = -1
    duration_s: float = 0.0
    skipped: str | None = None
    size_before: int = 0
    size_after: int = 0
    #: set when the partition was skipped as damaged (compaction/damage.py: Damage.to_dict)
    damaged: dict | None = None
    #: S3 with shared uploads: parts of shared objects joined into its own segments (the split)
    shared_parts_split: int = 0

    @property
    def recopy_percent(self) -> float:
        """Bytes rewritten as a percentage of the partition's size before compaction."""
        return 100.0 * self.bytes_written / self.size_before if self.size_before else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recopy_percent"] = round(self.recopy_percent, 2)
        return d


# ---------------------------------------------------------------------------------------------


@dataclass
class _SegPlan:
    seg: Segment
    kept_bytes: int = 0
    kept: int = 0
    dropped: int = 0
    tdropped: int = 0
    stamped: int = 0
    masks: dict = field(default_factory=dict)  # first entry number of a chunk -> packed keep bits
    #: written for another compression.type: re-encoded even when it keeps every record
    recode: bool = False

    @property
    def changed(self) -> bool:
        # (a format-1 segment is rewritten into format 2 when met: Segment.needs_rewrite)
        return self.dropped > 0 or self.stamped > 0 or self.seg.needs_rewrite or self.recode


@dataclass
class _Group:
    members: list[_SegPlan] = field(default_factory=list)

    @property
    def kept_bytes(self) -> int:
        return sum(m.kept_bytes for m in self.members)

    @property
    def rewrite(self) -> bool:
        return len(self.members) > 1 or any(m.changed for m in self.members)


class Compactor:
    """Compacts one partition at a time (``compact_partition``; about 440 lines: a round's
    passes share its state, see the module docstring). Every byte it reads or writes,
    index reads included, is charged to ``budget`` (``options.throttle_bytes_per_s`` by default;
    the background scheduler passes its own, whose waits a stop request interrupts)."""

    def __init__(self, store: Store, options: CompactionOptions = CompactionOptions(),
                 clock: Clock | None = None, budget: IOBudget | None = None):
        self.store = store
        self.options = options
        self.clock = clock or store.clock or SYSTEM_CLOCK
        self.budget = budget if budget is not None else IOBudget(options.throttle_bytes_per_s)
        self._map: OffsetMap | None = None
        self._buffers: dict[str, np.ndarray] = {}
        #: seconds before replaced segments are unlinked (Kafka's file.delete.delay.ms); 0 = at
        #: the end of compact_partition. Leftovers are removed when the partition is next opened.
        self.delete_delay_s = 0.0
        #: S3: the run's batch (``Store.compaction_batch``, reput/compaction_object.py) that
        #: publishes every partition's outputs in one object; None: each partition commits its
        #: own at its end
        self.batch = None

    @property
    def offset_map(self) -> OffsetMap:
        if self._map is None:
            self._map = OffsetMap(self.options.offset_map_memory, self.options.max_load)
        return self._map

    # -- reading indexes in bounded chunks ---------------------------------------------------

    def _index_chunks(self, pl: PartitionLog, seg: Segment, start_entry: int = 0):
        """Bounded-memory .bcq chunks in this compactor's reused buffer."""
        for lo, chunk in self._cursor(pl).chunks(seg, start_entry):
            self._throttle(chunk.nbytes)
            yield lo, chunk

    def _cursor(self, pl: PartitionLog) -> IndexCursor:
        step = self.options.index_chunk_entries
        return IndexCursor(pl, step, self._buffer("index", step * B.ENTRY_SIZE))

    def _buffer(self, name: str, size: int) -> np.ndarray:
        b = self._buffers.get(name)
        if b is None or b.shape[0] < size:
            b = self._buffers[name] = np.empty(size, np.uint8)
        return b[:size]

    # -- the public entry point ---------------------------------------------------------------

    def compact_partition(self, topic: str, partition: int, *, force: bool = False,
                          reason: str | None = None) -> CompactionResult:
        res = CompactionResult(topic, partition, reason=reason or ("forced" if force else None))
        t0 = time.perf_counter()
        try:
            pl = self.store.writable_partition(topic, partition)
        except StoreLockedError:
            res.skipped = "being written by another live process (its own compaction runs there)"
            return res
        lock = FileLock(pl.local_fs, f"{pl.dir}/{fn.COMPACTION_LOCK}")
        if not lock.acquire(blocking=False):
            res.skipped = "another compaction of this partition is running"
            return res
        pub = self.store.publisher
        writer = self.store.writer or "compactor"
        try:
            cfg = self.store.topic_config(topic)
            pl.config = cfg
            with self.store.lock:
                pub.begin_compaction(pl)
            res.segments_before = len(pl.segments)
            res.size_before = pl.size_bytes()
            records_before = pl.record_count()
            self._split(pl, res)
            rolled = False
            if pub.commits_each_round:
                self._check_inputs(pl)  # before the forced roll: a refusal writes nothing
            with self.store.lock:
                if force:
                    rolled = pub.compaction_roll(pl, writer)
                pl.sync()
            try:
                if cfg.delete:
                    self._delete_retention(pl, cfg, res)
                if cfg.compact:
                    while self._round(pl, cfg, res):
                        pass
                    self._recode(pl, cfg, res)
                    if self.purge_due(pl, cfg) or self._mergeable(pl, cfg):
                        self._purge(pl, cfg, res)
            except FileNotFoundError as e:
                if not pub.inputs_may_vanish:
                    raise
                # S3: an input was replaced by another compactor and deleted after the grace
                # period while this one still read it; nothing of this run is published
                with self.store.lock:
                    pl.abort_staged()  # (the latest manifest read again)
                    if any(e.filename in (s.log_path, s.bcq_path) for s in pl.segments):
                        # still listed: not a race but a missing object (issue 44)
                        raise CorruptRecordError(f"{e.filename}: listed by the partition "
                                                 "manifest but missing from the store",
                                                 e.filename, 0) from None
                res.skipped = (f"its input segments were replaced and deleted meanwhile "
                               f"({e.filename}); nothing was changed")
                res.duration_s = time.perf_counter() - t0
                return res
            except BaseException:
                with self.store.lock:
                    pub.abort_compaction(pl, rolled)
                raise
            res.segments_after = len(pl.segments)
            res.size_after = pl.size_bytes()
            res.records_kept = pl.record_count()
            res.records_dropped = records_before - res.records_kept
            res.cleaned_offset = pl.checkpoint()[0]
            res.duration_s = time.perf_counter() - t0
            run = None
            if res.rounds or res.segments_rewritten:
                prev = pub.published_last_run(pl)
                run = res.to_dict()
                run["reclaimed_bytes_total"] = ((prev or {}).get("reclaimed_bytes_total", 0)
                                                + max(0, res.size_before - res.size_after))
                # the history horizon as the rounds left it (history.py)
                run[history.HISTORY_KEY] = history.partition_horizon(pl)
            if self.batch is not None and pl.has_staged:
                # (an S3 store's: Store.compaction_batch) published with the run's other
                # partitions; the batch releases the lock
                self.batch.add(pl, run, self._published(pl, lock, res, records_before))
                lock = None
            elif not pub.finish_compaction(pl, run, writer, self.delete_delay_s):
                self._lost(pl, res, records_before)
            return res
        finally:
            if lock is not None:
                lock.release()

    def _split(self, pl: PartitionLog, res: CompactionResult) -> None:
        """S3 with shared uploads: the partition's parts of shared objects are joined into a
        segment of its own first (docs/formats/shared-upload.md, the split), staged with the
        rounds' outputs and committed with them in one manifest version. The joining reads
        without the store's lock (the writer goes on flushing; its new parts come after these
        and stay above the split)."""
        shared = [s for s in pl.segments if s.kind == "shared"]
        if not shared:
            return
        try:
            outputs = pl.join_parts(shared, pl.config.segment_bytes)
            with self.store.lock:
                pl.stage_swap([s.base for s in shared], outputs, None)
        except BaseException:
            with self.store.lock:
                pl.abort_staged()
            raise
        res.shared_parts_split = len(shared)

    def _check_inputs(self, pl: PartitionLog) -> None:
        """Before a local run writes anything (its forced roll included): the horizon is
        readable and every .bcq whose segment-list entry gives a checksum (every segment but
        one a writer has open) matches it (a whole ``IndexCursor`` pass raises at its end
        otherwise; the check is remembered per segment, so the rounds' passes do not repeat
        it). So a run refused for damage leaves every file as it was, whichever round would
        have met it. (On S3 nothing is published before the run's end anyway.)"""
        pl.checkpoint()
        cursor = self._cursor(pl)
        for seg in pl.segments:
            if seg.expected_bcq() is not None and not seg.bcq_checked:
                self._throttle(seg.index_size)
                cursor.check(seg)

    @staticmethod
    def _lost(pl: PartitionLog, res: CompactionResult, records_before: int) -> None:
        res.skipped = ("another compaction replaced this partition's segments "
                       "meanwhile; nothing was changed")
        res.segments_after = len(pl.segments)
        res.size_after = pl.size_bytes()
        res.records_kept = pl.record_count()
        res.records_dropped = records_before - res.records_kept
        res.cleaned_offset = pl.checkpoint()[0]

    def _published(self, pl: PartitionLog, lock: FileLock, res: CompactionResult,
                   records_before: int):
        """What the batch calls once it committed (or abandoned) the partition."""
        def finish(ok: bool) -> None:
            try:
                if not ok:
                    self._lost(pl, res, records_before)
                else:
                    pl.collect_garbage()
            finally:
                lock.release()
        return finish

    # -- retention (cleanup.policy=compact,delete) --------------------------------------------

    def _delete_retention(self, pl: PartitionLog, cfg: TopicConfig, res: CompactionResult) -> None:
        if cfg.retention_ms < 0:
            return
        limit = self.clock.ms() - cfg.retention_ms
        doomed = []
        for seg in pl.sealed_segments:
            if any(int(e["timestamp"].max()) >= limit for _, e in self._index_chunks(pl, seg)
                   if e.shape[0]):
                break
            doomed.append(seg.base)
        if not doomed:
            return
        plan = swap.SwapPlan(doomed, [], None)
        self._apply(pl, plan)
        res.segments_rewritten += len(doomed)

    # -- tombstone purge: nothing dirty, but tombstones past delete.retention.ms -------------

    def purge_due(self, pl: PartitionLog, cfg: TopicConfig) -> bool:
        """Does a cleaned tombstone's delete.retention.ms run out (index only; the planner's
        "tombstones expired" trigger, assessment.py)?"""
        now_s, ret_s = self.clock.ms() // 1000, retention_s(cfg)
        cursor = self._cursor(pl)
        tail = tail_offset(pl)  # (kept whatever its age)
        for seg in pl.sealed_segments:
            n, seen = seg.count(), 0
            holds_tail = _last_offset(pl, seg) == tail
            for flags, clean in cursor.tombstone_columns(seg):
                self._throttle(flags.nbytes + clean.nbytes)
                seen += flags.shape[0]
                if expired_tombstones(flags, clean, now_s, ret_s,
                                      spare_last=holds_tail and seen == n):
                    return True
        return False

    @staticmethod
    def _mergeable(pl: PartitionLog, cfg: TopicConfig) -> bool:
        """Are there two adjacent sealed segments that fit in one?"""
        sealed = pl.sealed_segments
        return any(a.log_size + b.log_size <= cfg.segment_bytes
                   for a, b in zip(sealed, sealed[1:]))

    def _purge(self, pl: PartitionLog, cfg: TopicConfig, res: CompactionResult) -> None:
        """A pass with an empty map over the cleaned range: drops expired tombstones and merges
        small segments; nothing is superseded because nothing is mapped."""
        cleaned, _ = pl.checkpoint()
        if cleaned < 0:
            return
        self.offset_map.clear(cleaned + 1, keys=0)  # (no key: the table's smallest prefix)
        self._rewrite(pl, cfg, cleaned, res)

    # -- one round ----------------------------------------------------------------------------

    def _cleanable_end(self, pl: PartitionLog, cfg: TopicConfig) -> int:
        """First offset that may not be cleaned (assessment.cleanable_end, the planner's)."""
        return cleanable_end(pl, cfg, self.clock.ms(), _Charged(self, pl))

    def _round(self, pl: PartitionLog, cfg: TopicConfig, res: CompactionResult) -> bool:
        if not pl.sealed_segments:
            return False
        cleaned, prev_run = pl.checkpoint()
        first_dirty = cleaned + 1
        end = self._cleanable_end(pl, cfg)
        if not any(s.base < end and _last_offset(pl, s) >= first_dirty
                   for s in pl.sealed_segments):
            return False  # nothing dirty in the cleanable range
        m = self.offset_map
        sealed = [s for s in pl.sealed_segments if s.base < end]
        # at most this many keys enter the map this round (its dirty segments' records): the
        # map clears and probes no more of its table than they need
        bound = sum(s.count() for si, s in enumerate(sealed)
                    if (sealed[si + 1].base if si + 1 < len(sealed) else end) > first_dirty)
        m.clear(first_dirty, bound)
        last_mapped = first_dirty - 1
        mapped_ts = history.NOTHING_CLEANED  # the highest timestamp mapped (the horizon's)
        full = False
        for si, seg in enumerate(sealed):
            nxt = sealed[si + 1].base if si + 1 < len(sealed) else end
            if nxt <= first_dirty:
                continue
            idx = seg.index()
            start = int(idx.lower_bound(first_dirty))
            for lo, chunk in self._index_chunks(pl, seg, start):
                res.bytes_read += chunk.nbytes
                stop = int(np.searchsorted(chunk["offset"], end))
                chunk = chunk[:stop]
                if chunk.shape[0] == 0:
                    break
                j, full = m.insert_entries(chunk)
                if j > 0:
                    last_mapped = int(chunk["offset"][j - 1])
                    mapped_ts = max(mapped_ts, history.mapped_max_timestamp(chunk[:j]))
                if full:
                    break
            if full:
                break
        if last_mapped < first_dirty:
            return False  # nothing dirty to clean
        res.map_keys_max = max(res.map_keys_max, m.count)
        res.map_utilization_max = max(res.map_utilization_max, m.utilization)
        res.map_bytes_per_key = m.bytes_per_key
        # the horizon moves with the checkpoint, in the same swap plan (compaction-swap.md)
        horizon = history.combine(history.horizon_of(cleaned, prev_run), mapped_ts)
        self._rewrite(pl, cfg, last_mapped, res, history.with_horizon(prev_run, horizon))
        res.rounds += 1
        return True

    def _rewrite(self, pl: PartitionLog, cfg: TopicConfig, last_mapped: int,
                 res: CompactionResult, last_run: dict | None = None) -> None:
        m = self.offset_map
        now_s = self.clock.ms() // 1000
        retention_s = -(-cfg.delete_retention_ms // 1000)
        targets = [s for s in pl.sealed_segments if s.base <= last_mapped]
        tail = tail_offset(pl)  # the partition's last record stays (Kafka's active segment)

        # index-only planning: what each segment keeps (bit-packed: 1 bit a record)
        plans = []
        for seg in targets:
            sp = _SegPlan(seg, recode=_recode_due(pl, seg, cfg))
            for lo, chunk in self._index_chunks(pl, seg):
                keep, _, (k, d, td, st) = m.decide(chunk, last_mapped, now_s, retention_s, tail)
                sp.kept += k
                sp.dropped += d
                sp.tdropped += td
                sp.stamped += st
                sp.kept_bytes += seg.kept_bytes(chunk, keep, k)
                sp.masks[lo] = np.packbits(keep)
            plans.append(sp)

        def recall(sp, lo, chunk):
            """The planning pass's decision for a chunk; clean_time recomputed without lookups."""
            keep = np.unpackbits(sp.masks[lo], count=chunk.shape[0]).astype(np.bool_)
            clean = chunk["clean_time"].copy()
            stamp = (keep & ((chunk["flags"] & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS))
                             == B.FLAG_TOMBSTONE) & (clean == 0)
                     & (chunk["offset"] <= last_mapped))
            clean[stamp] = now_s
            return keep, clean, None
        groups: list[_Group] = []
        for sp in plans:
            if groups and groups[-1].kept_bytes + sp.kept_bytes <= cfg.segment_bytes:
                groups[-1].members.append(sp)
            else:
                groups.append(_Group([sp]))
        # merging is only worth a rewrite when it removes segments: split unchanged singletons
        final: list[_Group] = []
        for g in groups:
            if len(g.members) > 1 or g.rewrite:
                final.append(g)
        self._write_groups(pl, final, recall, res, plans, last_mapped, last_run)

    def _recode(self, pl: PartitionLog, cfg: TopicConfig, res: CompactionResult) -> None:
        """Re-encode, every record kept, each sealed segment written for another
        compression.type than the topic's now (codecs.needs_recode): a change of
        compression.type reaches every segment at the next compaction, not only those a
        round rewrites. The checkpoint does not move."""
        todo = [s for s in pl.sealed_segments if _recode_due(pl, s, cfg)]
        if not todo:
            return
        plans = []
        for seg in todo:
            sp = _SegPlan(seg, recode=True)
            for lo, chunk in self._index_chunks(pl, seg):
                keep = np.ones(chunk.shape[0], np.bool_)
                sp.kept += chunk.shape[0]
                sp.kept_bytes += seg.kept_bytes(chunk, keep, chunk.shape[0])
                sp.masks[lo] = np.packbits(keep)
            plans.append(sp)

        def recall(sp, lo, chunk):
            return np.ones(chunk.shape[0], np.bool_), chunk["clean_time"].copy(), None
        self._write_groups(pl, [_Group([sp]) for sp in plans], recall, res, [], None, None)

    def _write_groups(self, pl: PartitionLog, final: list, recall, res: CompactionResult,
                      plans: list, last_mapped: int | None, last_run: dict | None) -> None:
        """Stage each group's output segment and swap them in (``last_mapped``: the new
        checkpoint, None: unchanged)."""
        inputs, outputs = [], []
        staged: list[tuple[int, str, str]] = []
        pub = self.store.publisher
        pub.begin_outputs(pl)
        for g in final:
            out_base = g.members[0].seg.base
            log_out, idx_out = pub.output_paths(pl, out_base)
            if self._index_only(g):
                wrote = self._restamp_index(pl, g.members[0], idx_out, recall, res)
            else:
                wrote = self._copy_group(pl, g, log_out, idx_out, recall, res)
            inputs += [sp.seg.base for sp in g.members]
            if wrote:
                outputs.append(out_base)
                staged.append((out_base, log_out, idx_out))
            res.segments_rewritten += len(g.members)
        for sp in plans:
            res.records_read += sp.kept + sp.dropped
            res.tombstones_dropped += sp.tdropped
        self._apply(pl, swap.SwapPlan(inputs, outputs, last_mapped, last_run), staged)

    def _index_only(self, g: _Group) -> bool:
        """A group that only stamps tombstones (one segment, every record kept, .log holding
        nothing but those records) changes the .bcq alone: only the index is rewritten and the
        .log stays where it is (compaction-swap.md, "index-only outputs"). Not on an object
        store, whose manifest names a new object pair per output."""
        if not self.store.publisher.restamps_in_place or len(g.members) != 1:
            return False
        sp = g.members[0]
        return sp.seg.restamps_in_place and sp.dropped == 0 and sp.kept > 0 and not sp.recode

    def _restamp_index(self, pl: PartitionLog, sp: _SegPlan, idx_out: str, recall,
                       res: CompactionResult) -> bool:
        """Write ``sp``'s index with the planned clean_time stamps, its records where they are
        (``Segment.write_index``: a format-2 segment's lean index of its batches as they are)."""
        def stamped():
            for lo, chunk in self._index_chunks(pl, sp.seg):
                _, clean, _ = recall(sp, lo, chunk)
                ent = chunk.copy()
                ent["clean_time"] = clean
                yield ent
        res.bytes_written += sp.seg.write_index(
            stamped(), pl.local_fs, idx_out, pl.local_fs.local_path(swap.staging_dir(pl.dir)))
        return True

    def _copy_group(self, pl: PartitionLog, g: _Group, log_out: str, idx_out: str, recall,
                    res: CompactionResult) -> bool:
        """Pass 2 for one group: its members' kept records, byte for byte and with their new
        clean times, into one output segment. The records come from the partition reader
        (each checked against its entry and CRC), each input .log streamed once front to back."""
        if g.kept_bytes == 0:
            return False
        chunk_bytes = self.options.io_chunk_bytes
        reader = PartitionReader(pl)
        cfg = pl.config
        # outputs go to the store itself, or to the local directory on S3; always format 2
        self.store.require_format(2)
        # compression.type=producer: the group's stored codec is kept (Kafka's meaning: a batch
        # keeps its source batch's), and for format-1 records the codec the mirror read the
        # source's batches of the partition with (PartitionLog.source_codec), none when it
        # did not know (a consumer's records: codecs.codec_of)
        stored = [_codec(pl, sp.seg) for sp in g.members]
        source = next((c for c in stored if c), None)
        if source is None and None in stored:
            source = getattr(pl, "source_codec", None)
        out = SegmentWriter2(pl.local_fs, log_out, idx_out,
                             codec=codec_of(cfg.compression_type, source),
                             level=cfg.compression_zstd_level,
                             batch_bytes=cfg.compression_batch_bytes,
                             target=target_of(cfg.compression_type))
        try:
            for sp in g.members:
                batches = sp.seg.batches()  # (None: records stored one by one)
                with reader.segment(sp.seg, sequential=True, block_bytes=chunk_bytes,
                                    buffer=self._buffer("data", chunk_bytes)) as src:
                    for lo, chunk in self._index_chunks(pl, sp.seg):
                        keep, clean, _ = recall(sp, lo, chunk)
                        if not keep.any():
                            continue
                        for kept, whole in _runs(chunk, keep, clean, batches):
                            read0 = src.bytes_read
                            if whole and not sp.recode:  # every record stays: as stored
                                first = np.flatnonzero(kept["size"])  # each batch's first entry
                                sizes = kept["size"][first].astype(np.int64)
                                counts = np.diff(np.r_[first, kept.shape[0]])
                                p = int(kept[0]["position"])
                                wrote = out.append_batches(src.raw(p, int(sizes.sum()), sizes),
                                                           sizes, counts, kept,
                                                           _codec(pl, sp.seg) or 0)
                            else:
                                wrote = 0
                                for block in src.select(kept):
                                    wrote += out.append(block)
                            res.bytes_written += wrote
                            self._throttle(src.bytes_read - read0 + wrote)
                    res.bytes_read += src.bytes_read
            out.sync()
        except OSError as e:  # reading the input .log failed (the stream raises raw OSError)
            raise CompactionError(f"{sp.seg.log_path}: read error: {e.strerror or e}; "
                                  "compaction stopped, the old segments are still in place") from e
        finally:
            out.close()
        return True

    def _throttle(self, nbytes: int) -> None:
        self.budget.charge(nbytes)

    def _apply(self, pl: PartitionLog, plan: swap.SwapPlan,
               staged: list[tuple[int, str, str]] | None = None) -> None:
        """Swap a round's outputs in (the store's publisher: at once on a local store, staged
        until the run's end on S3)."""
        self.store.publisher.swap(pl, plan, staged or [])


class _Charged:
    """An index cursor whose every chunk is charged to the compactor's I/O budget."""

    def __init__(self, compactor: "Compactor", pl: PartitionLog):
        self.compactor, self.pl = compactor, pl

    def chunks(self, seg: Segment, start_entry: int = 0):
        return self.compactor._index_chunks(self.pl, seg, start_entry)


# ---------------------------------------------------------------------------------------------

def _runs(entries: np.ndarray, keep: np.ndarray, clean: np.ndarray, batches):
    """(kept entries, whole) in position order, each a copy of ``entries``' kept ones with
    their new ``clean`` times: with ``batches`` (a format-2 segment's batch positions, sizes,
    counts) consecutive batches whose records all stay make a run with whole=True (copied byte
    for byte); the kept records of the others come in runs with whole=False. (Only kept entries
    are copied: most of a dirty chunk is dropped.)"""

    def kept(a: int, z: int, every: bool = False) -> np.ndarray:
        if every:
            sel = entries[a:z].copy()
            sel["clean_time"] = clean[a:z]
        else:
            m = keep[a:z]
            sel = entries[a:z][m]
            sel["clean_time"] = clean[a:z][m]
        return sel
    if batches is None:
        yield kept(0, entries.shape[0]), False
        return
    pos = entries["position"].astype(np.int64)
    starts = _changes(pos)
    ends = np.append(starts[1:], pos.shape[0])
    # a batch is whole when every entry is kept and the chunk holds all of its records
    bpos, _, bcount = batches
    k = np.searchsorted(bpos, pos[starts])
    full = np.add.reduceat(keep.astype(np.int64), starts) == (ends - starts)
    full &= bcount[np.minimum(k, bcount.shape[0] - 1)] == (ends - starts)
    # runs of batches alike (all whole, or not): a boundary where ``full`` changes
    edges = _changes(full).tolist() + [starts.shape[0]]
    for b, c in zip(edges[:-1], edges[1:]):
        a, z = int(starts[b]), int(ends[c - 1])
        if full[b]:
            yield kept(a, z, every=True), True  # consecutive whole batches: in one piece
        else:
            sel = kept(a, z)
            if sel.shape[0]:
                yield sel, False


def _codec(pl: PartitionLog, seg) -> int | None:
    """The codec a format-2 segment's lean index records (None: a format-1 segment)."""
    return getattr(seg.index(), "codec", None) if seg.format == 2 else None


def _recode_due(pl: PartitionLog, seg, cfg: TopicConfig) -> bool:
    """Whether ``seg`` was written for another compression.type than ``cfg``'s."""
    if seg.format != 2:
        return False  # (format 1 is rewritten whenever met: Segment.needs_rewrite)
    idx = seg.index()
    return needs_recode(cfg.compression_type, idx.codec, getattr(idx, "target", 0))


def _changes(a: np.ndarray) -> np.ndarray:
    """Where each run of equal values of ``a`` starts (0 first; none when ``a`` is empty)."""
    edge = np.empty(a.shape[0], np.bool_)
    edge[:1] = True
    np.not_equal(a[1:], a[:-1], out=edge[1:])
    return np.flatnonzero(edge)


def _last_offset(pl: PartitionLog, seg: Segment) -> int:
    """A sealed segment's last offset (-1 if empty): its manifest or segment-list entry says
    it when there is one."""
    listed = seg.listed()
    if listed is not None:
        return listed[2] if listed[0] else -1
    idx = seg.index()
    return int(idx.entries[-1]["offset"]) if idx.n else -1




# ---------------------------------------------------------------------------------------------


def partition_status(store: Store, topic: str, partition: int) -> dict:
    """Compaction horizon, dirty ratio, triggers and last run of a partition (for `kcompact
    inspect`): the planner's own assessment (assessment.py) at the store clock's "now". The
    dirty ratio is dirty bytes / (clean + dirty bytes) over the cleanable range (honouring
    ``min.compaction.lag.ms``); the active segment's bytes (``active_bytes``) and the sealed
    bytes still too young to clean (``uncleanable_bytes``) are counted apart."""
    pl = store.partition(topic, partition)
    cleaned, last_run = pl.checkpoint()
    a = assess_partition(pl, store.topic_config(topic), store.clock.ms())
    return {"compaction_horizon": a.horizon,
            # --as-of is exact from this record timestamp on (-1: any; None: unknown)
            "cleaned_timestamp": history.horizon_of(cleaned, last_run),
            "clean_bytes": a.clean_bytes,
            "dirty_bytes": a.dirty_bytes,
            "uncleanable_bytes": a.uncleanable_bytes,
            "active_bytes": a.active_bytes,
            "reclaimed_bytes": (last_run or {}).get("reclaimed_bytes_total", 0),
            "dirty_ratio": round(a.dirty_ratio, 4),
            "compaction_due": a.triggers,
            "last_compaction": last_run}
