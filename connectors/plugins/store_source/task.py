"""The store source's task: plans a store topic's records and hands them out in chunks.

* ``mode=latest`` (default): the compacted state - the latest record per key of each partition,
  decided from the .bcq index alone (``kcompact.compaction.latest.latest_selection``: compacted
  segments plus the dirty tail; keyless records and deleted keys left out). When the target topic
  already existed, or the run continues an earlier one, a key whose latest record is a tombstone
  is re-published as that tombstone, so that stale values in the target are deleted too.
* ``mode=all``: every record the store holds, in offset order (tombstones and keyless included).
* ``as.of.ms``: the same over the records with a timestamp <= it only: the state as of that time
  (compaction/history.py; the runner refuses a time compaction already cleaned past).

Placement: record of store partition p -> target partition p. ``repartition=true`` places keyed
records with Kafka's default partitioner instead (``murmur2(key) & 0x7fffffff % partitions``,
exactly the Java client's), and keyless records round-robin (deterministically, in store order;
the Java client would spread them with its sticky partitioner).

Progress is a position per store partition: every selected record with a store offset below it
has been produced. The runner (runner.py) records it and gives it back through
:class:`SourceTaskContext` on a restart; the task then plans only the records at or after it. The
plan is made from the store as it is when the task starts: records appended later are picked up
by the next run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from kcompact.reput import Store
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.reader import PartitionReader

from ...errors import ConfigError, ConnectorsError
from ...framework.api import SourceTask
from .chunks import RecordBlock, SourceChunk, field_spec
from .progress import PROGRESS_TOPIC

#: Bytes of .log read at once when gathering selected records.
READ_WINDOW = 8 << 20
#: Re-plans of a partition after its segments changed under the reader (a compaction swap).
MAX_REPLANS = 3

# Props the runner adds for the task (not user-settable).
TARGET_TOPIC = "__target.topic"
TARGET_PARTITIONS = "__target.partitions"
INCLUDE_TOMBSTONES = "__include.tombstones"


# ---------------------------------------------------------------------------------------------
# planning: which entries of which segment, from a position on


@dataclass
class _PartitionPlan:
    partition: int
    pieces: list = field(default_factory=list)  # [(Segment, sorted entry indices)]
    total: int = 0        # records planned
    taken: int = 0        # records handed out in chunks
    piece: int = 0
    at: int = 0
    cursor: int = 0       # next store offset to hand out
    end: int = 0          # the partition's next offset when planned

    @property
    def exhausted(self) -> bool:
        return self.piece >= len(self.pieces)

    @property
    def position(self) -> int:
        """Progress after everything handed out so far."""
        return max(self.end, self.cursor) if self.exhausted else self.cursor


def _latest_tombstones(pl, segs, from_offset: int) -> dict[int, np.ndarray]:
    """{segment base: indices} of keyed tombstones at or after ``from_offset`` that are the
    latest record of their key (only records at or after from_offset can be later ones)."""
    rows = []
    for k, seg in enumerate(segs):
        e = seg.index().entries
        if e.shape[0] == 0:
            continue
        lo = int(np.searchsorted(e["offset"], from_offset))
        tail = e[lo:]
        if tail.shape[0]:
            rows.append((k, lo, tail))
    if not rows:
        return {}
    tomb_lo = np.concatenate([t["digest_lo"][(t["flags"] & 3) == 1] for _, _, t in rows])
    if tomb_lo.shape[0] == 0:
        return {}
    seg_of, idx_of, offs, dlo, dhi, flags = [], [], [], [], [], []
    for k, lo, t in rows:
        cand = np.isin(t["digest_lo"], tomb_lo) & ((t["flags"] & 2) == 0)
        where = np.nonzero(cand)[0]
        seg_of.append(np.full(where.shape[0], k))
        idx_of.append(where + lo)
        offs.append(t["offset"][where])
        dlo.append(t["digest_lo"][where])
        dhi.append(t["digest_hi"][where])
        flags.append(t["flags"][where])
    seg_of, idx_of = np.concatenate(seg_of), np.concatenate(idx_of)
    offs, dlo, dhi = np.concatenate(offs), np.concatenate(dlo), np.concatenate(dhi)
    flags = np.concatenate(flags)
    order = np.lexsort((offs, dlo, dhi))
    last = np.ones(order.shape[0], bool)
    last[:-1] = (dhi[order][1:] != dhi[order][:-1]) | (dlo[order][1:] != dlo[order][:-1])
    win = order[last]
    win = win[(flags[win] & 1) == 1]
    out: dict[int, list] = {}
    for k, i in zip(seg_of[win].tolist(), idx_of[win].tolist()):
        out.setdefault(segs[k].base, []).append(i)
    return {b: np.sort(np.asarray(v, np.int64)) for b, v in out.items()}


def plan_partition(pl, mode: str, from_offset: int, *, include_tombstones: bool,
                   selection: list | None = None, as_of_ms: int | None = None
                   ) -> _PartitionPlan:
    """The entries of a partition to restore from ``from_offset`` on, in offset order.
    ``selection``: ``latest_selection(pl, as_of_ms=as_of_ms)`` when it was computed already.
    ``as_of_ms``: only records with a timestamp <= it count (the state as of that time;
    mode=all: every stored record up to it)."""
    pp = _PartitionPlan(pl.partition, cursor=from_offset, end=pl.next_offset)
    segs = [s for s in pl.segments if s.index().n]
    if mode == "all":
        for seg in segs:
            e = seg.index().entries
            lo = int(np.searchsorted(e["offset"], from_offset))
            which = np.arange(lo, e.shape[0], dtype=np.int64)
            if as_of_ms is not None:
                which = which[e["timestamp"][lo:] <= as_of_ms]
            if which.shape[0]:
                pp.pieces.append((seg, which))
    else:
        from kcompact.compaction.latest import latest_selection
        if not include_tombstones:
            tombs = {}
        elif as_of_ms is None:
            tombs = _latest_tombstones(pl, segs, from_offset)
        else:
            from kcompact.compaction.history import tombstone_winners
            tombs = tombstone_winners(pl, as_of_ms, from_offset)
        if selection is None:
            selection = latest_selection(pl, as_of_ms=as_of_ms)
        for seg, which in selection:
            e = seg.index().entries
            which = which.astype(np.int64)
            which = which[e["offset"][which] >= from_offset]
            extra = tombs.get(seg.base)
            if extra is not None:
                which = np.union1d(which, extra)
            if which.shape[0]:
                pp.pieces.append((seg, which))
    pp.total = sum(w.shape[0] for _, w in pp.pieces)
    return pp


class StoreSourceTask(SourceTask):
    """Plans a store topic's records from the stored positions, then hands them out in chunks."""

    store: Store | None = None

    def open(self, props: Mapping[str, Any]) -> None:
        """Open the store and, in mode=latest, start deciding every partition's latest records
        in a thread (numba kernels that release the GIL). The restore runner calls this before
        it talks to Kafka, so that the two overlap; ``start`` calls it if nobody did."""
        if self.store is not None:
            return
        self.topic = props["store.topic"]
        self.mode = props.get("mode") or "latest"
        as_of = props.get("as.of.ms")
        self.as_of_ms = None if as_of is None else int(as_of)
        self.store = open_store_topic(props["store.url"], self.topic)
        self.pls = {p: self.store.partition(self.topic, p)
                    for p in self.store.partitions(self.topic)}
        self._selections: dict[int, list] = {}
        self._selection_error: BaseException | None = None
        self._selector: threading.Thread | None = None
        if self.mode == "latest":
            self._selector = threading.Thread(target=self._select, name="restore-plan",
                                              daemon=True)
            self._selector.start()

    def _select(self) -> None:
        from kcompact.compaction.latest import latest_selection
        try:
            for p, pl in self.pls.items():
                self._selections[p] = latest_selection(pl, as_of_ms=self.as_of_ms)
        except BaseException as e:  # noqa: BLE001 - raised by start()
            self._selection_error = e

    def _join_selector(self) -> None:
        if getattr(self, "_selector", None) is not None:
            self._selector.join()
            self._selector = None

    def start(self, props: Mapping[str, Any]) -> None:
        self.props = dict(props)
        self.open(props)
        self.target = props.get(TARGET_TOPIC) or props.get("topic") or self.topic
        self.chunk_records = int(props.get("restore.chunk.records") or 250_000)
        self.repartition = bool(props.get("repartition"))
        self.num_target = int(props.get(TARGET_PARTITIONS) or 0)
        self.include_tombstones = bool(props.get(INCLUDE_TOMBSTONES))
        if self.repartition and self.num_target <= 0:
            raise ConfigError("repartition needs the target topic's partition count")
        self._join_selector()
        if self._selection_error is not None:
            raise self._selection_error
        self._next_keyless = 0
        self.replans = 0  # times a partition was planned again (segments changed under us)
        self.plans: dict[int, _PartitionPlan] = {}
        for p, pl in self.pls.items():
            self.plans[p] = plan_partition(pl, self.mode, self.position(p),
                                           include_tombstones=self.include_tombstones,
                                           selection=self._selections.pop(p, None),
                                           as_of_ms=self.as_of_ms)

    def position(self, partition: int) -> int:
        ctx = getattr(self, "context", None)
        stored = ctx.offset({"partition": partition}) if ctx is not None else None
        return int(stored["position"]) if stored else 0

    @property
    def total(self) -> int:
        return sum(pp.total for pp in self.plans.values())

    @property
    def remaining(self) -> int:
        return sum(pp.total - pp.taken for pp in self.plans.values())

    def finished(self) -> bool:
        return all(pp.exhausted for pp in self.plans.values())

    def poll(self) -> SourceChunk | None:
        """The next chunk (at most ``restore.chunk.records``, spread over the partitions that
        have records left), or None when everything has been handed out."""
        if self.finished():
            return None
        live = [pp for pp in self.plans.values() if not pp.exhausted]
        per = max(1, -(-self.chunk_records // len(live)))
        chunk = SourceChunk(self.target)
        for pp in live:
            self._take(pp, per, chunk)
        chunk.positions = {p: pp.position for p, pp in self.plans.items()}
        chunk.taken = {p: pp.taken for p, pp in self.plans.items()}
        chunk.done = self.finished()
        return chunk

    def _take(self, pp: _PartitionPlan, want: int, chunk: SourceChunk) -> None:
        replans = 0
        while want > 0 and not pp.exhausted:
            seg, idx = pp.pieces[pp.piece]
            j = min(idx.shape[0], pp.at + want)
            pl = self.pls[pp.partition]
            mark = chunk.mark()
            try:
                entries = seg.index().entries
                a, b = int(idx[pp.at]), int(idx[j - 1])
                # a run of consecutive entries (nothing overwritten) is a view, not a copy
                e = entries[a:b + 1] if b - a == j - 1 - pp.at else entries[idx[pp.at:j]]
                self._emit(pl, seg, e, pp.partition, chunk)
            except (CorruptRecordError, FileNotFoundError):
                # A compaction swapped the segments under this reader: plan again from the
                # cursor (offsets never change, so the rest of the plan is the same records).
                chunk.rollback(mark)
                replans += 1
                if replans > MAX_REPLANS:
                    raise
                self._replan(pp)
                continue
            n = j - pp.at
            want -= n
            pp.taken += n
            pp.cursor = int(e["offset"][-1]) + 1
            pp.at = j
            if j == idx.shape[0]:
                pp.piece += 1
                pp.at = 0

    def _replan(self, pp: _PartitionPlan) -> None:
        assert self.store is not None
        self.replans += 1
        self.store.release_partition(self.topic, pp.partition)
        pl = self.pls[pp.partition] = self.store.partition(self.topic, pp.partition)
        if self.as_of_ms is not None and not self.props.get("as.of.allow.inexact"):
            # segments changed under us: a compaction, which may have cleaned history past it
            from kcompact.compaction.history import check_exact
            check_exact([pl], self.as_of_ms, f"{self.topic}-{pp.partition}")
        new = plan_partition(pl, self.mode, pp.cursor, include_tombstones=self.include_tombstones,
                             as_of_ms=self.as_of_ms)
        new.taken = pp.taken
        new.total = pp.taken + new.total
        pp.__dict__.update(new.__dict__)  # in place: poll() holds this object

    def _emit(self, pl, seg, e: np.ndarray, partition: int, chunk: SourceChunk) -> None:
        """The records of entries ``e`` of segment ``seg``, through the partition reader (each
        checked against its entry and CRC; a mismatch raises CorruptRecordError, which the
        caller takes for a compaction swap under it and plans again from its cursor)."""
        # random-access reads, not a memory map: measured 2x slower here (a page fault per 4 KiB)
        with PartitionReader(pl).segment(seg, block_bytes=READ_WINDOW) as src:
            for block in src.select(e):
                self._columns(block, partition, chunk)

    def _columns(self, block, partition: int, chunk: SourceChunk) -> None:
        m = len(block)
        k, v, h = block.key_spans(), block.value_spans(), block.header_spans()
        # the bytes as one object, for fields of varied widths taken as slices (field_spec)
        varied = any(x.lengths.shape[0] and int(x.lengths.min()) != int(x.lengths.max())
                     for x in (k, v))
        data = k.buf.tobytes() if varied or h.lengths.any() else b""
        kspec = field_spec(data, k.buf, k.starts, k.lengths, k.null)
        vspec = field_spec(data, v.buf, v.starts, v.lengths, v.null)
        hspans = (data, h.starts, h.starts + h.lengths) if h.lengths.any() else None
        parts = None
        if self.repartition:
            from .kernels import murmur2_partitions
            out = np.empty(m, np.int64)
            self._next_keyless = int(murmur2_partitions(k.buf, k.starts, k.lengths, k.null,
                                                        self.num_target, self._next_keyless,
                                                        out))
            parts = out.tolist()
        chunk.add(RecordBlock(None if parts is not None else partition, parts, kspec, vspec,
                              block.timestamps.copy(), hspans, partition, block.offsets.copy()),
                  int(k.lengths.sum() + v.lengths.sum()))

    def stop(self) -> None:
        self._join_selector()
        if self.store is not None:
            store, self.store = self.store, None
            store.close()


def open_store_topic(url: str, topic: str) -> Store:
    """The store, read-only, with a clear error when it or the topic is not there."""
    store = Store.open(url)
    if topic not in store.topics() or not store.partitions(topic):
        known = [t for t in store.topics() if t != PROGRESS_TOPIC]
        store.close()
        raise ConnectorsError(f"topic {topic!r} is not in store {url} (it holds: "
                              f"{', '.join(known) or 'no topics'}); see `kcompact inspect`")
    return store


def partition_count(store: Store, topic: str) -> int:
    """Partitions a target topic needs to keep the store's partition numbers."""
    parts = store.partitions(topic)
    return (max(parts) + 1) if parts else 0
