"""Store format 2's sealed segment: a Kafka log segment and its lean index.

Spec: docs/formats/segment-v2.md (the .log: Kafka RecordBatch v2, compressed with the topic's
codec; Kafka's DumpLogSegments reads it) and docs/formats/bcq-v2.md (the .bcq: checksummed
column chunks of whole batches, a directory). ``KafkaSegment`` is the ``Segment``
(reput/segment.py) of this kind. A format-2 segment is written whole (a seal, a compaction, a
replica's install of a shipped one) and never appended to, so it is immutable until a swap
replaces it by rename: its .log is mapped once on a local store, a batch checked once may be
remembered (``kafka_batches``), and its index is checked by its own CRCs.

Reads: the batches holding the records asked for are read whole and each is accepted by its
CRC-32C, its records walked, their offsets against its header and its record count against the
index (reput/batch.py). Records are handed out as format-1 records decoded in memory
(``RecordColumns``: one layout above the reader whatever the segment), each checked against its
index entry by format 1's record check (``segment_v1.verify_records``, without the CRC the
decoder computed) - or, where a path can skip that decode, taken where they lie in the
decompressed batches (``read_fields``: keys and values only, each record still checked against
its entry), or sent as the stored batches themselves (``kafka_batches``: the Kafka endpoint).
A sequential reader's next read usually starts in the batch the previous one decompressed: the
partition keeps that one batch (``PartitionContext.last_batch``).

(Over 600 lines on purpose: every read of a format-2 segment and the checks that guard it stay
in one file, as they did in the one partition reader.)
"""

from __future__ import annotations

import struct
import threading
from typing import Iterator

import numpy as np

from . import _kernels as K
from . import batch as KB
from . import bcq as B
from . import bcq2 as B2
from . import parallel
from .backend import Backend, _oserror
from .columns import KeyValues, RecordColumns, Spans, stored_records
from .errors import CorruptRecordError
from .jit import native
from .record import digest_key_words, gather, scan
from .segment import (CHUNK_ENTRIES, DEFAULT_BLOCK_BYTES, KafkaBatches, Located, RawRange,
                      ReadPlan, Segment, Selection, corrupt, register_format)
from .segment_desc import SegmentDesc
from .segment_list import crc32c, stream_crc32c
from .segment_v1 import mismatch, verify_records

_N = native()

_BASE, _DELTA = struct.Struct(">q"), struct.Struct(">i")  # a batch's baseOffset, lastOffsetDelta
_ZERO = np.zeros(1, np.int64)  # where a block's one record starts in its bytes
_ZERO.flags.writeable = False

#: the fields ``kcompact verify`` compares between a decoded record and its lean index entry
_CMP_V2 = ("offset", "timestamp", "digest_lo", "digest_hi", "flags")


def corrupt_batch(path: str, e: CorruptRecordError, prefix, last_good) -> CorruptRecordError:
    """A batch that failed a check (``e``, from reput/batch.py), as a read's error."""
    why = str(e).removeprefix(f"{path}: ")
    return CorruptRecordError(f"{path}: corrupt record batch at byte {e.position} ({why}); run "
                              "`kcompact verify` and rebuild this partition from a replica",
                              path, e.position, last_good_offset=last_good, prefix=prefix)


@register_format(2)
class KafkaSegment(Segment):
    """A sealed format-2 segment (see the module docstring).

    (About 650 lines on purpose, as ``RecordSegment``: the whole interface for one format,
    over the same batches and lean index.)"""

    format = 2
    restamps_in_place = True
    #: replication may ship its files byte for byte (replication-protocol.md, version 2)
    ships_as_stored = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._log_map: np.ndarray | None = None
        #: {position: codec} of batches whose header and CRC-32C ``kafka_batches`` checked
        self._kafka_checked: dict[int, int] = {}
        self._checked_lock = threading.Lock()

    def invalidate(self) -> None:
        super().invalidate()
        self._log_map = None
        with self._checked_lock:
            self._kafka_checked = {}

    @property
    def _mapped(self) -> bool:
        """Its .log is read through a mapping (local disk) rather than by requests."""
        return self.kind == "file" and not self.open_tail and self.log_size > 0

    def log_bytes(self, start: int, length: int) -> np.ndarray:
        """``read_log`` as a uint8 array; on local disk the sealed .log is mapped once (it never
        changes: a seal or a compaction replaces it by rename) and sliced."""
        if self._mapped:
            m = self._log_map
            if m is None or m.shape[0] != self.log_size:
                m = self._log_map = self.fs.map(self.log_path, self.log_size).view(np.ndarray)
            return m[start:start + length]
        return np.frombuffer(self.read_log(start, length), np.uint8)

    # -- index -------------------------------------------------------------------------------

    def index(self) -> B2.LeanIndex:
        """Its lean index (chunks decoded on demand)."""
        if self._index is not None and self._index_key == (self.index_size, self.log_size):
            return self._index
        fs, path = self.fs, self.bcq_path
        if self.kind in ("remote", "shared"):
            # an object: read whole, in one request (a compaction stays at <= 4 requests a
            # segment; a lean index is ~17 bytes a record)
            whole = fs.read(path)
            read = lambda start, length: whole[start:start + length]  # noqa: E731
        else:
            read = lambda start, length: fs.read(path, start, length)  # noqa: E731
        idx = B2.LeanIndex(read, path, self.index_size)
        if self.kind in ("remote", "shared"):  # what check_index checks against the manifest entry
            idx.file_check = (len(whole), crc32c(whole))
        if idx.log_size != self.log_size:
            raise CorruptRecordError(f"{path}: the lean index describes a .log of "
                                     f"{idx.log_size} bytes, the .log holds {self.log_size}",
                                     path, 0)
        self._index_key = (self.index_size, self.log_size)
        self._index = idx
        return idx

    def first_last(self) -> tuple[int, int]:
        idx = self.index()
        if not idx.n:
            return -1, -1
        return int(idx.dir["first_offset"][0]), int(idx.dir["last_offset"][-1])

    def codec_name(self) -> str:
        return KB.CODEC_NAMES.get(self.index().codec, "unknown")

    def batches(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.index().batches()

    def index_chunks(self, start_entry: int = 0, buf: np.ndarray | None = None,
                     chunk_entries: int = CHUNK_ENTRIES) -> Iterator[tuple[int, np.ndarray]]:
        """The lean index's own chunks, decoded one at a time (the next in the helper thread
        while the caller works on this one); a pass from entry 0 first checks the file."""
        idx = self.index()
        n = idx.n
        if start_entry == 0 and not self.bcq_checked:
            self._check_lean()
        for i, e in parallel.ahead(idx.chunk, range(idx.chunk_of_entry(start_entry)
                                                    if n else 0, idx.chunk_count)):
            f = idx.chunk_first_entry(i)
            yield max(f, start_entry), e[max(0, start_entry - f):]

    def tombstone_columns(self, buf: np.ndarray | None = None
                          ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A lean index's chunks decompressed but not decoded into entries
        (LeanIndex.tombstone_columns)."""
        idx = self.index()
        if not self.bcq_checked:
            self._check_lean()
        for _, cols in parallel.ahead(idx.tombstone_columns,
                                      range(idx.chunk_count if idx.n else 0)):
            yield cols

    def check_index(self, buf: np.ndarray | None = None) -> None:
        """By its file's CRC32C alone (its chunks are checked by their own CRCs when decoded)."""
        if self.expected_bcq() is None or self.bcq_checked:
            return
        self._check_lean()

    def _check_lean(self) -> None:
        """The lean index against the size and checksum its segment-list or manifest entry
        gives (its chunks are also checked each by their own CRC as they are decoded)."""
        expect = self.expected_bcq()
        if expect is None:
            return
        path = self.bcq_path
        got = getattr(self.index(), "file_check", None)  # an object: read whole already
        if got is None:  # streamed, a block at a time (a large segment's index is 100s of MB)
            with self.fs.open_read(path) as f:
                try:
                    got = stream_crc32c(f, expect[0], DEFAULT_BLOCK_BYTES)
                except OSError as e:  # a stream's reads raise raw OSError: say which file
                    raise _oserror(e, "read", path) from e
        if got != expect:
            raise CorruptRecordError(
                f"{path}: the lean index does not match its checksum ({got[0]} bytes, crc32c "
                f"{got[1]:08x}; its entry says {expect[0]} bytes, {expect[1]:08x}): its entries "
                "cannot be trusted; run `kcompact verify` and rebuild this partition from a "
                "replica", path, 0)
        self.bcq_checked = True

    @classmethod
    def describe_files(cls, fs: Backend, log_path: str, bcq_path: str, base: int,
                       nxt: int | None, log_size: int, bcq_size: int) -> SegmentDesc:
        """``segment.describe_files`` of a format-2 segment: its lean index's header and
        directory read and checked (the directory gives the records and the first and last
        offsets), and the whole file streamed once through a reused buffer for its CRC32C (read
        whole, a large index cost a fresh allocation, a page fault every 4 KiB, each time a swap
        described it)."""
        idx = B2.LeanIndex(lambda start, length: fs.read(bcq_path, start, length), bcq_path,
                           bcq_size)
        with fs.open_read(bcq_path) as f:
            done, crc = stream_crc32c(f, bcq_size)
        if done != bcq_size:
            raise CorruptRecordError(f"{bcq_path}: shorter than its size while read", bcq_path,
                                     done)
        if idx.log_size != log_size:
            raise CorruptRecordError(f"{bcq_path}: the lean index describes a .log of "
                                     f"{idx.log_size} bytes, the .log holds {log_size}",
                                     bcq_path, 0)
        first = int(idx.dir["first_offset"][0]) if idx.chunk_count else -1
        last = int(idx.dir["last_offset"][-1]) if idx.chunk_count else -1
        return SegmentDesc(base, max(last + 1, base) if nxt is None else nxt, idx.n, first, last,
                           log_size, bcq_size, crc, 2)

    def index_bytes(self) -> np.ndarray:
        return np.frombuffer(self.fs.read(self.bcq_path), np.uint8)

    def stored_version(self) -> tuple[int, int] | None:
        """(its .log's size, its lean index's header CRC, read now): the version of the pair
        as stored, which a compaction or a seal under the same base changes; None when its
        .bcq is no lean index any more (replaced)."""
        head = self.fs.read(self.bcq_path, 0, B2.HEADER_SIZE)
        if len(head) < B2.HEADER_SIZE or not B2.is_lean(head):
            return None
        return self.log_size, B2.HEADER.unpack_from(head, 0)[-1]

    # -- reads -------------------------------------------------------------------------------

    def plan(self, from_offset: int, max_records: int | None,
             max_bytes: int | None) -> ReadPlan | None:
        """The lean index's chunks from the read's first (a lean index is checked whole by
        its CRCs and a format-2 read decodes whole batches: no guard record)."""
        idx = self.index()
        n = idx.n
        j = int(idx.lower_bound(from_offset))
        if j < n:
            e = idx.slice_within(j, n if max_records is None else min(n, j + max_records),
                                 max_bytes)
            stop = j + e.shape[0]
            return ReadPlan(self, e, 0, j == 0, stop == n and not self.open_tail)
        self._check_stepped_over(idx, from_offset)
        return None

    def _check_stepped_over(self, idx, from_offset: int) -> None:
        """A segment the index says holds nothing at or after ``from_offset``: its last batch's
        header (read alone; the lean index chains the batches to the end of the .log) is a
        valid batch header of the size the index says, whose last offset is the index's last,
        below ``from_offset``."""
        if idx.n == 0:
            if self.log_size:
                raise corrupt(self.log_path, 0, "the lean index lists no record of a .log of "
                              f"{self.log_size} bytes", None)
            return
        bpos, bsize, _ = idx.batches()
        pos, size = int(bpos[-1]), int(bsize[-1])
        path = self.log_path
        if pos + size != self.log_size:  # (before anything is allocated for the claimed size)
            raise corrupt(path, pos, f"the lean index's last batch ({size} bytes at {pos}) "
                          f"does not end the .log ({self.log_size} bytes)", None)
        head = np.frombuffer(self.read_log(pos, KB.HEADER_SIZE), np.uint8)
        try:
            h = KB.parse_head(np.concatenate([head, np.zeros(max(0, size - head.shape[0]),
                                                             np.uint8)]),
                              0, path, pos, check_crc=False)
        except CorruptRecordError as e:
            raise corrupt_batch(path, e, None, None) from None
        last = int(idx.dir["last_offset"][-1])
        if h.size != size or pos + size != self.log_size or h.last_offset != last \
                or last >= from_offset:
            raise corrupt(path, pos, f"the last batch's header (last offset {h.last_offset}, "
                          f"{h.size} bytes) is not what the lean index lists (offset {last}, "
                          f"{size} bytes, ending the .log)", None)

    def read(self, plan: ReadPlan, max_bytes: int | None) -> RecordColumns:
        """A run of entries read: the batches holding them, each checked whole. A run inside
        one batch (a short read) takes ``_one_batch``, which reuses the batch the previous read
        decompressed (a sequential reader's next read usually starts in it). A longer run
        decodes batches until the records reach ``max_bytes`` (``plan`` bounds the run by the
        .log's bytes, which are compressed) and starts with the kept batch when it is the
        first."""
        ctx = self.ctx
        sel = plan.entries[plan.guard:]
        p0 = int(sel[0]["position"])
        b = None
        if int(sel[-1]["position"]) == p0:
            at = self.index().batch_at(p0)
            if at is not None:
                b = self._one_batch(sel, p0, at[0], at[1])
        if b is None:
            start, end, _, _ = self._batch_span(sel)
            data = self.log_bytes(start, end - start)
            last = ctx.last_batch
            first = (last[2] if last is not None and last[0] is self
                     and last[1] == (self.log_size, self.index_size, start) else None)
            b = self._decoded(data, start, sel, None, keep=True, max_bytes=max_bytes,
                              first=first)
        if max_bytes is not None and len(b) > 1:
            # the bound is on the records returned (format 1), not on the batches read
            ends = np.cumsum(stored_records(b)[2])
            b = b.head(max(1, int(np.searchsorted(ends, max_bytes, side="right"))))
        return b

    def read_fields(self, plan: ReadPlan, max_bytes: int | None,
                    want: np.ndarray | None) -> KeyValues | None:
        """Keys and values taken where they lie in the decompressed batches, each batch and each
        record checked as ``read`` checks them (batch CRC-32C and walk; offset, timestamp,
        flags and key digest against the entry), without writing format-1 records (the C
        kernels; None without them or when anything fails: ``read`` then names it)."""
        if _N is None:
            return None
        ctx = self.ctx
        sel = plan.entries[plan.guard:]
        start, end, _, _ = self._batch_span(sel)
        k0, k1 = digest_key_words(ctx.secret)
        got = KB.span_fields(self.log_bytes(start, end - start), start, len(ctx.topic_bytes),
                             sel, k0, k1, max_bytes, want)
        if got is None:
            return None
        n = got.count
        return KeyValues(sel["offset"][got.picked].astype(np.int64),
                         Spans(got.pay, got.kstart, got.klen, got.klen < 0),
                         Spans(got.pay, got.vstart, got.vlen, got.vlen < 0),
                         int(sel[n - 1]["offset"]) + 1)

    def keep_batch(self, sizes: tuple[int, int], walked) -> None:
        """Keep ``walked`` (a batch just checked whole) for the partition's next read. An
        uncompressed batch's payload is a view of the read's buffer: copied when that buffer
        is much larger (a multi-batch read), so that one batch is all that is kept."""
        pay = walked.payload
        base = pay.base
        if base is not None and memoryview(base).nbytes > 2 * pay.nbytes + (64 << 10):
            walked = walked._replace(payload=pay.copy())
        self.ctx.last_batch = (self, sizes + (walked.head.position,), walked)

    def _batch_span(self, sel: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(start, end) in the .log of the batches holding ``sel``'s records, and those batches'
        positions and record counts (from the lean index)."""
        bpos, bsize, bcount = self.index().batches()
        p = sel["position"].astype(np.int64)  # in position order: each batch's first entry
        want = p[np.r_[True, p[1:] != p[:-1]]] if p.shape[0] else p
        k = np.searchsorted(bpos, want)
        if bool(np.any(k >= bpos.shape[0])) or bool(np.any(bpos[np.minimum(k, bpos.shape[0] - 1)]
                                                           != want)):
            path = self.bcq_path
            raise CorruptRecordError(f"{path}: an index entry names no batch of the .log; run "
                                     "`kcompact verify`", path, int(want[0]) if want.size else 0)
        return int(want[0]), int(bpos[k[-1]] + bsize[k[-1]]), want, bcount[k]

    def _decoded(self, data: np.ndarray, start: int, sel: np.ndarray, want: "set[int] | None",
                 *, keep: bool = False, max_bytes: int | None = None,
                 first=None) -> RecordColumns:
        """The block of ``sel``'s records from the batches in ``data`` (the .log from
        ``start``; with ``want``, only the batches at those positions are decoded). Each batch
        is accepted by its CRC-32C, its record count must be the index's and each selected
        entry's offset must be a record of the batch the entry names. ``keep``: the last batch
        is kept for the partition's next read (an offset read; a selection reads on).
        ``max_bytes``, ``first``: batch.decode_batches'; the block then holds the entries of
        the batches decoded."""
        ctx = self.ctx
        path = self.log_path
        try:
            key = (self.log_size, self.index_size)
            d = KB.decode_batches(data, start, ctx.topic_bytes, ctx.partition, path,
                                  want=want, lo=int(sel[0]["offset"]), hi=int(sel[-1]["offset"]),
                                  keep=(lambda w: self.keep_batch(key, w)) if keep else None,
                                  max_bytes=max_bytes, first=first)
            if max_bytes is not None and len(d.heads):
                sel = sel[sel["position"] <= int(d.heads.positions[-1])]
        except CorruptRecordError as e:
            d = getattr(e, "decoded", None)
            if d is None or not len(d.heads):
                raise corrupt_batch(path, e, None, None) from None
            upto = int(d.heads.positions[-1])
            kept = sel[sel["position"] <= upto]
            try:
                prefix = self._columns(d, kept, path) if kept.shape[0] else None
            except CorruptRecordError:
                prefix = None
            raise corrupt_batch(path, e, prefix, int(kept[-1]["offset"]) if prefix else None) \
                from None
        return self._columns(d, sel, path)

    def _columns(self, d, sel: np.ndarray, path: str) -> RecordColumns:
        bpos, _, bcount = self.index().batches()
        heads_pos, heads_cnt = d.heads.positions, d.heads.counts
        k = np.searchsorted(bpos, heads_pos)
        if bool(np.any(bcount[np.minimum(k, bcount.shape[0] - 1)] != heads_cnt)):
            bad = int(heads_pos[np.flatnonzero(bcount[np.minimum(k, bcount.shape[0] - 1)]
                                               != heads_cnt)[0]])
            raise CorruptRecordError(f"{path}: the batch at byte {bad} does not hold the records "
                                     "its index lists; run `kcompact verify`", path, bad)
        offs = sel["offset"].astype(np.int64)
        j = np.searchsorted(d.offsets, offs)
        jj = np.minimum(j, max(0, d.offsets.shape[0] - 1))
        ok = (j < d.offsets.shape[0]) & (d.offsets[jj] == offs) if d.offsets.shape[0] else \
            np.zeros(offs.shape[0], np.bool_)
        ok &= heads_pos[d.batch_of[jj]] == sel["position"].astype(np.int64) if ok.any() else ok
        if not bool(ok.all()):
            first_bad = int(np.flatnonzero(~ok)[0])
            pos = int(sel[first_bad]["position"])
            raise CorruptRecordError(
                f"{path}: the batch at byte {pos} does not hold offset "
                f"{int(offs[first_bad])} its index lists; run `kcompact verify`", path, pos)
        return self._checked(sel, d.data, d.sizes[j], d.positions[j], path)

    def _checked(self, sel: np.ndarray, data: np.ndarray, sizes: np.ndarray,
                 rel: np.ndarray, path: str) -> RecordColumns:
        """The block of ``sel``'s records decoded into ``data`` (format-1 records at ``rel``,
        ``sizes`` bytes), each checked against its entry (offset, timestamp, flags, key digest)
        by the one check every format-1 read goes through, run on the decoded records without
        their CRCs (the decoder computed them from the bytes it wrote; the batch's CRC-32C
        accepted the bytes they came from)."""
        ctx = self.ctx
        ent = sel.copy()
        ent["size"] = sizes
        if ent.shape[0] == 1:  # the record alone: data's byte 0 stands for its entry's position
            bad = verify_records(data, int(ent["position"][0]), ent, ctx.secret, decoded=True)
        else:  # checked at their places in data, then given back their batches' positions
            ent["position"] = rel
            n = ent.shape[0]
            if parallel.worth_splitting(data.shape[0]):  # in two halves at once
                h = n // 2
                a, b = parallel.both(
                    lambda: verify_records(data, 0, ent[:h], ctx.secret, decoded=True),
                    lambda: verify_records(data, 0, ent[h:], ctx.secret, decoded=True))
                bad = a if a >= 0 else (h + b if b >= 0 else -1)
            else:
                bad = verify_records(data, 0, ent, ctx.secret, decoded=True)
            ent["position"] = sel["position"]
        if bad >= 0:
            chk = ent.copy()
            chk["position"] = rel
            pos = int(sel[bad]["position"])
            last_good = int(sel[bad - 1]["offset"]) if bad else None
            prefix = (RecordColumns(ctx.topic, ctx.partition, data, ent[:bad], rel[:bad],
                                    last_good + 1) if bad else None)
            raise CorruptRecordError(
                f"{path}: corrupt record batch at byte {pos} (its record at offset "
                f"{int(sel[bad]['offset'])} does not match its lean index entry: "
                f"{mismatch(data, 0, chk[bad], ctx.secret)}); run `kcompact verify` and "
                "rebuild this partition from a replica", path, pos,
                last_good_offset=last_good, prefix=prefix)
        return RecordColumns(ctx.topic, ctx.partition, data, ent, rel,
                             int(sel[-1]["offset"]) + 1)

    def _one_batch(self, sel: np.ndarray, pos: int, size: int, count: int) -> RecordColumns:
        """``read`` of entries that all lie in the one batch at ``pos`` (``size`` bytes,
        ``count`` records by the lean index; ``sel`` a run of its entries): the batch is read
        and checked whole (its CRC-32C, then every record walked and its offsets against its
        header), unless it is the one the previous read of the partition decompressed (then
        only walked again), and only ``sel``'s records are converted and checked."""
        ctx = self.ctx
        path = self.log_path
        last = ctx.last_batch
        try:
            if last is not None and last[0] is self and last[1] == (self.log_size,
                                                                    self.index_size, pos):
                b = last[2]
            else:
                b = KB.open_batch(self.log_bytes(pos, size), 0, pos, path)
                if b.head.size != size:
                    raise CorruptRecordError(f"{path}: the batch at byte {pos} holds "
                                             f"{b.head.size} bytes, its index lists {size}",
                                             path, pos)
                self.keep_batch((self.log_size, self.index_size), b)
        except CorruptRecordError as e:
            raise corrupt_batch(path, e, None, None) from None
        if b.head.count != count:
            raise CorruptRecordError(f"{path}: the batch at byte {pos} does not hold the records "
                                     "its index lists; run `kcompact verify`", path, pos)
        if sel.shape[0] == 1 and _N is not None:  # one record: walked, converted, checked at once
            h = b.head
            k0, k1 = digest_key_words(ctx.secret)
            st, last_delta, rec = _N.kafka_read_one(b.payload, h.count, ctx.topic_bytes,
                                                    ctx.partition, h.base_offset, h.base_ts,
                                                    sel.view(np.uint8).reshape(-1), k0, k1)
            if st == 0 and last_delta == h.last_offset - h.base_offset:
                ent = sel.copy()
                ent["size"] = len(rec)
                return RecordColumns(ctx.topic, ctx.partition, np.frombuffer(rec, np.uint8), ent,
                                     _ZERO, int(ent["offset"][0]) + 1)
            # whatever failed: the general path below names it
        try:
            lo, hi = int(sel[0]["offset"]), int(sel[-1]["offset"])
            d = KB.decode_run(b, ctx.topic_bytes, ctx.partition, lo, hi, path)
            if d is None:  # several records: each one's size and place
                d = KB.decode_walked([KB.walk_opened(b, len(ctx.topic_bytes), path)],
                                     ctx.topic_bytes, ctx.partition, lo=lo, hi=hi)
        except CorruptRecordError as e:
            raise corrupt_batch(path, e, None, None) from None
        if d.offsets.shape[0] != sel.shape[0]:  # (the offsets themselves: _checked)
            raise CorruptRecordError(
                f"{path}: the batch at byte {pos} does not hold offsets "
                f"{int(sel[0]['offset'])}..{int(sel[-1]['offset'])} as its index lists; run "
                "`kcompact verify`", path, pos)
        return self._checked(sel, d.data, d.sizes, d.positions, path)

    def read_raw(self, plan: ReadPlan, max_bytes: int | None, pool) -> RawRange:
        """The records as format-1 records, back to back (what a replica appends and what the
        live digests cover, whatever the master's segment format)."""
        b = self.read(plan, max_bytes)
        data, rel, sizes, ent = stored_records(b)
        buf = gather(data, rel, sizes)
        ent = ent.copy()
        pos = np.zeros(sizes.shape[0], np.int64)
        np.cumsum(sizes[:-1], out=pos[1:])
        ent["position"] = pos
        return RawRange(buf, buf.shape[0], ent, b.next_offset)

    def locate(self, plan: ReadPlan, max_bytes: int | None) -> Located:
        """No file range to send: the records, decoded, from memory."""
        r = self.read_raw(plan, max_bytes, None)
        return Located(-1, 0, r.nbytes, r.count, r.next_offset, data=r.buf[:r.nbytes])

    def selection(self, sequential: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                  buffer: np.ndarray | None = None) -> "KafkaSelection":
        return KafkaSelection(self, sequential, block_bytes, buffer)

    def kafka_batches(self, from_offset: int, max_bytes: int) -> KafkaBatches | None:
        """The stored batches themselves (no decode, no re-encode): slices of the mapped .log
        on a local store, bytes from an object store. Each batch's header and CRC-32C is
        checked before it is handed out, once per batch of this immutable segment."""
        d = self.desc
        if (d is not None and d.first_offset is not None and d.first_offset >= 0
                and from_offset <= d.first_offset and 0 < self.log_size <= max_bytes):
            # the whole segment from its first record (a consumer at the live edge reading a
            # flush's part): its batches, header by header, without its index
            part, last, zstd = self._checked_batches(0, self.log_size, None)
            if d.last_offset is not None and last < d.last_offset:
                raise CorruptRecordError(
                    f"{self.log_path}: its batches end at offset {last}, below the "
                    f"{d.last_offset} its catalog entry lists; run `kcompact verify`",
                    self.log_path, 0)
            return KafkaBatches([part], self.log_size, last + 1, zstd)
        idx = self.index()
        n = idx.n
        j = int(idx.lower_bound(from_offset))
        if j >= n:
            return None
        pos0 = int(idx.slice(j, j + 1)["position"][0])
        bpos, bsize, _ = idx.batches()
        k = int(np.searchsorted(bpos, pos0))
        if k >= bpos.shape[0] or int(bpos[k]) != pos0:
            raise CorruptRecordError(f"{self.bcq_path}: an index entry names no batch of the "
                                     ".log; run `kcompact verify`", self.bcq_path, pos0)
        ends = np.cumsum(bsize[k:])
        m = max(1, int(np.searchsorted(ends, max_bytes, side="right")))
        total = int(ends[m - 1])
        part, last, zstd = self._checked_batches(pos0, total, bsize[k:k + m])
        if last < from_offset:
            raise CorruptRecordError(f"{self.log_path}: the batch at byte {pos0} ends at offset "
                                     f"{last}, below {from_offset} its index places in it",
                                     self.log_path, pos0)
        return KafkaBatches([part], total, last + 1, zstd)

    def _checked_batches(self, pos0: int, total: int, sizes) -> tuple:
        """(the .log's bytes ``pos0``..+``total``, the last batch's last offset, whether any
        batch is zstd), every batch in them checked (its header and CRC-32C, once per batch
        of this immutable segment). ``sizes``: the batches' sizes as the index lists them
        (each header must agree), or None to take each from its header (the batches must
        then tile the range exactly: a batch running past it is cut short)."""
        if self._mapped:  # a local .log: slices of its mapping
            data = self.log_bytes(pos0, total)
            part = memoryview(data)
        else:
            part = self.read_log(pos0, total)
            data = np.frombuffer(part, np.uint8)
        path = self.log_path
        if data.shape[0] != total:
            raise CorruptRecordError(f"{path}: the .log ends inside the batches its index lists "
                                     f"(byte {pos0 + data.shape[0]})", path,
                                     pos0 + data.shape[0])
        done = self._kafka_checked
        p, b, last, zstd = 0, 0, -1, False
        while p < total:
            where = pos0 + p
            codec = done.get(where)
            if codec is not None:  # baseOffset, batchLength, lastOffsetDelta (segment-v2.md)
                size = (int(sizes[b]) if sizes is not None
                        else _DELTA.unpack_from(data, p + 8)[0] + KB.LOG_OVERHEAD)
                last = _BASE.unpack_from(data, p)[0] + _DELTA.unpack_from(data, p + 23)[0]
            else:
                h = KB.parse_head(data, p, path, where)  # (one cut short by the range's end)
                size = int(sizes[b]) if sizes is not None else h.size
                if h.size != size:
                    raise CorruptRecordError(f"{path}: the batch at byte {where} holds "
                                             f"{h.size} bytes, its index lists {size}", path,
                                             where)
                last, codec = h.last_offset, h.codec
                with self._checked_lock:
                    done[where] = codec
            zstd |= codec == KB.CODEC_ZSTD
            p += size
            b += 1
        return part, last, zstd

    # -- compaction, recovery ---------------------------------------------------------------

    def kept_bytes(self, chunk: np.ndarray, keep: np.ndarray, kept: int) -> int:
        """Sizes are per batch: a kept record counts the segment's mean stored size."""
        if not kept:
            return 0
        per_record = self.log_size / max(1, self.count())
        return -(-int(kept * per_record) // 1)

    def write_index(self, entries: Iterator[np.ndarray], fs: Backend, path: str,
                    spill_dir: str | None) -> int:
        """A lean index of its batches as they are, from ``entries`` (chunks hold whole
        batches: bcq-v2.md)."""
        idx = self.index()
        bpos, bsize, bcount = idx.batches()
        builder = B2.IndexBuilder(spill_dir=spill_dir)
        b = 0
        for ent in entries:
            at = 0
            while at < ent.shape[0]:
                c = int(bcount[b])
                builder.add_batch(int(bpos[b]), int(bsize[b]), ent[at:at + c])
                at += c
                b += 1
        idxf = fs.open_append(path)
        try:
            written = builder.write_to(idxf, idx.codec, idx.target)
            idxf.sync()
        finally:
            idxf.close()
        return written

    def check_sealed(self, next_base: int) -> None:
        """The lean index checks itself when opened (header, directory CRCs, the .log's size);
        its offsets must lie in the segment's range (a replica's pull installs shipped ones)."""
        idx = self.index()  # raises CorruptRecordError naming the .bcq
        d = idx.dir
        if idx.n and (int(d["first_offset"][0]) < self.base
                      or int(d["last_offset"][-1]) >= next_base):
            raise CorruptRecordError(f"{self.bcq_path}: offsets outside the segment's range; "
                                     "this sealed segment is not repaired on open: run "
                                     "`kcompact verify` and rebuild the partition from a "
                                     "replica", self.bcq_path, 0)

    # -- verify ------------------------------------------------------------------------------

    def verify(self, secret: bytes, problem, prev_last: int, next_base: int | None
               ) -> tuple[int, int]:
        """The lean index's header, directory and chunk CRCs, every batch's CRC-32C and
        records, each record against its entry (offset, timestamp, key digest, flags), the
        catalog entry."""
        log_path, idx_path = self.log_path, self.bcq_path
        records = 0
        try:
            idx = self.index()
        except CorruptRecordError as e:
            problem(idx_path, e.position or 0, f"{e} (the lean index is damaged: rebuild the "
                    "partition from a replica)")
            return records, prev_last
        except FileNotFoundError as e:
            # (the segment's own path names its partition; a part of a shared object says
            # which object is gone)
            gone = e.filename if e.filename and e.filename not in (log_path, idx_path) else None
            problem(log_path if gone else (e.filename or log_path), 0,
                    "listed by the partition manifest but missing from the store"
                    + (f" ({gone})" if gone else ""))
            return records, prev_last
        ent = self.bitmap_desc
        if ent is not None:
            try:
                size = self.fs.size(log_path)
            except FileNotFoundError:
                problem(log_path, 0, "listed by the partition manifest but missing from the "
                        "store")
                return records, prev_last
            if size != ent.log_size:
                problem(log_path, size, f"the .log object holds {size} bytes, the manifest says "
                        f"{ent.log_size}")
            if idx.n != ent.records:
                problem(idx_path, 0, f"the lean index lists {idx.n} records, the manifest says "
                        f"{ent.records}")
            else:
                try:
                    if idx.n and not np.array_equal(idx.entries["offset"], ent.offset_array()):
                        problem(idx_path, 0, "the manifest's offset bitmap does not match the "
                                "lean index's offsets")
                except CorruptRecordError:
                    pass  # a chunk that fails its CRC: each is listed below
        expect = self.expected_bcq()  # (size, CRC32C) its segment-list or manifest entry gives
        if expect is not None:
            try:
                raw = self.fs.read(idx_path)
            except FileNotFoundError:
                raw = b""
            if (len(raw), crc32c(raw)) != expect:
                problem(idx_path, 0, f"the lean index does not match its checksum ({len(raw)} "
                        f"bytes, crc32c {crc32c(raw):08x}; listed {expect[0]} bytes, "
                        f"{expect[1]:08x})")
        m = self.desc if self.desc is not None and self.desc.next is not None else None
        if m is not None:
            first, last = self.first_last()
            if m.format != 2:
                problem(idx_path, 0, f"the segment list says format {m.format}, the .bcq is a "
                        "lean index (format 2)")
            elif idx.n != m.records or (first, last) != (m.first_offset, m.last_offset):
                problem(idx_path, 0, f"the lean index lists {idx.n} records, offsets "
                        f"{first}..{last}; the segment list says {m.records}, "
                        f"{m.first_offset}..{m.last_offset}")
        topic = self.ctx.topic_bytes
        nxt_base = m.next if m is not None else next_base
        for i in range(idx.chunk_count):
            try:
                e = idx.chunk(i)
            except CorruptRecordError as err:
                problem(idx_path, err.position or 0, str(err))
                continue
            start = int(idx.dir["first_position"][i])
            end = (int(idx.dir["first_position"][i + 1]) if i + 1 < idx.chunk_count
                   else idx.log_size)
            try:
                data = np.frombuffer(self.read_log(start, end - start), np.uint8)
                d = KB.decode_batches(data, start, topic, self.ctx.partition, log_path)
            except CorruptRecordError as err:
                problem(log_path, err.position or start, f"{err} (rebuild the partition from "
                        "a replica)")
                continue
            records += d.offsets.shape[0]
            sc = scan(d.data, 0, d.data.shape[0], secret=secret, verify_crc=True)
            exp = B.entries_from_scan(sc, 0, len(sc), 0)
            if len(sc) != e.shape[0] or sc.status != K.SCAN_OK:
                problem(log_path, start, f"the batches at byte {start} hold {len(sc)} records, "
                        f"the lean index lists {e.shape[0]}")
                continue
            bad = np.zeros(e.shape[0], dtype=bool)
            for f in _CMP_V2:
                bad |= exp[f] != e[f]
            heads = d.heads.positions
            bad |= heads[d.batch_of] != e["position"].astype(np.int64)
            for j in np.nonzero(bad)[0][:20]:
                problem(idx_path, int(idx.dir["chunk_pos"][i]),
                        f"lean index entry {int(idx.chunk_first_entry(i) + j)} does not match "
                        f"record {int(d.offsets[j])} of the batches (rebuild the partition from "
                        "a replica)")
            offs = d.offsets
            if offs.shape[0] and (offs[0] <= prev_last or offs[0] < self.base
                                  or (nxt_base is not None and offs[-1] >= nxt_base)):
                problem(log_path, start, "offsets outside the segment's range or not increasing")
            if offs.shape[0]:
                prev_last = int(offs[-1])
        return records, prev_last


class KafkaSelection(Selection):
    """Chosen records of a format-2 segment: the batches holding them, read in spans of at most
    ``block_bytes`` (or one batch), only those batches decoded; or whole batches as stored
    (``raw``: a compaction copying batches whose records all stay)."""

    def select(self, entries: np.ndarray) -> Iterator[RecordColumns]:
        if entries.shape[0] == 0:
            return
        seg = self.seg
        bpos, bsize, _ = seg.index().batches()
        _, _, want, _ = seg._batch_span(entries)
        k = np.searchsorted(bpos, want)
        ends = bpos[k] + bsize[k]
        epos = entries["position"].astype(np.int64)
        i, nb = 0, want.shape[0]
        while i < nb:
            j = max(i + 1, int(np.searchsorted(ends, want[i] + self.block_bytes, side="right")))
            start, stop = int(want[i]), int(ends[j - 1])
            data = self._read(start, stop - start)
            lo = int(np.searchsorted(epos, start))
            hi = int(np.searchsorted(epos, stop))
            yield seg._decoded(data, start, entries[lo:hi], set(want[i:j].tolist()))
            i = j

    def raw(self, start: int, length: int, sizes: np.ndarray | None = None) -> np.ndarray:
        """Batches' bytes as stored: ``length`` bytes from ``start``, one batch, or batches of
        ``sizes`` bytes back to back; each header and CRC-32C checked; valid until the next read
        of this selection."""
        data = self._read(start, length)
        if data.shape[0] != length:
            raise CorruptRecordError(f"{self._path}: batch at byte {start} is cut short",
                                     self._path, start)
        p = 0
        for size in ([length] if sizes is None else sizes.tolist()):
            h = KB.parse_head(data, p, self._path, start + p)
            if h.size != size:
                raise CorruptRecordError(f"{self._path}: the batch at byte {start + p} holds "
                                         f"{h.size} bytes, its index lists {size}", self._path,
                                         start + p)
            p += size
        return data


class IncomingSegment:
    """A format-2 segment downloaded as stored, before it is installed (a replica's pull,
    replication protocol version 2: replication/shipped.py): its lean index opened from the
    bytes received (``raw_index``; header, directory and chunk CRCs checked, CorruptRecordError
    naming ``where`` otherwise), its batches checked a block at a time against it (``check``)
    and indexed anew under the replica's secret into a new lean index (``write_index``)."""

    def __init__(self, raw_index: np.ndarray, where: str, spill_dir: str | None):
        self.idx = idx = B2.LeanIndex(lambda a, n: raw_index[a:a + n].tobytes(), where,
                                      len(raw_index))
        self.n, self.log_size, self.codec = idx.n, idx.log_size, idx.codec
        self.target = idx.target
        d = idx.dir
        self.first = int(d["first_offset"][0]) if idx.chunk_count else -1
        self.last = int(d["last_offset"][-1]) if idx.chunk_count else -1
        #: where each chunk's batches start and end in the .log
        self.chunk_starts = d["first_position"].astype(np.int64)
        self.chunk_ends = np.append(self.chunk_starts[1:], np.int64(idx.log_size))
        self.builder = B2.IndexBuilder(spill_dir=spill_dir)

    def chunk_batches(self, lo: int, hi: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(the master's entries, batch positions, sizes, record counts) of chunks lo..hi-1
        (each decoded once, when its block is checked)."""
        parts = [self.idx.chunk(i, collect=False) for i in range(lo, hi)]
        m = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return (m,) + B2.LeanIndex.batch_rows(m)

    @staticmethod
    def check(data: np.ndarray, start: int, topic: bytes, partition: int, where: str,
              secret: bytes) -> tuple[np.ndarray, np.ndarray]:
        """The batches of ``data`` (the .log received, from byte ``start``) checked whole (as
        ``KafkaSegment.read`` checks them), and the index entries of their records under
        ``secret`` (offsets, timestamps, key digests and flags: what a lean index keeps):
        (their heads table, entries). In one C pass when built (batch.span_entries), else
        decoded into records and scanned. CorruptRecordError naming ``where`` and the byte."""
        k0, k1 = digest_key_words(secret)
        got = KB.span_entries(data, start, topic, k0, k1, where, B.BCQ_DTYPE)
        if got is not None:
            return got[0].table, got[1]
        try:
            d = KB.decode_batches(data, start, topic, partition, where)
        except CorruptRecordError as e:
            why = str(e).removeprefix(f"{where}: ")
            raise CorruptRecordError(f"{where}: corrupt record batch at byte {e.position} "
                                     f"({why})", where, e.position) from None
        n = d.offsets.shape[0]
        s = scan(d.data, 0, d.data.shape[0], secret=secret, verify_crc=True)
        if s.status != K.SCAN_OK or len(s) != n:
            raise CorruptRecordError(f"{where}: a decoded record does not check at byte "
                                     f"{start}", where, start)
        return d.heads.table, B.entries_from_scan(s, 0, n, 0).copy()

    def add_batches(self, start: int, sizes: np.ndarray, counts: np.ndarray,
                    entries: np.ndarray) -> None:
        """Index checked batches (back to back from ``start``) with their new ``entries``."""
        self.builder.add_batches(start, sizes, counts, entries)

    def write_index(self, out) -> int:
        """Write the new lean index with ``out.write`` (the codec of its batches)."""
        return self.builder.write_to(out, self.codec, self.target)


def lean_offsets(bcq, name: str) -> np.ndarray:
    """The offsets listed by a format-2 lean index held in memory (``bcq``: its bytes; ``name``
    names it in errors): a shared part encoded straight into the writer's object
    (docs/formats/shared-upload.md, "A writer's flush")."""
    if not len(bcq):
        return np.empty(0, np.int64)
    view = memoryview(bcq)
    return B2.LeanIndex(lambda pos, n: bytes(view[pos:pos + n]), name, len(bcq)).entries["offset"]


__all__ = ["IncomingSegment", "KafkaSegment", "KafkaSelection", "corrupt_batch", "lean_offsets"]
