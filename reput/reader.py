"""The one partition reader: every read of partition data goes through here.

RocketMQ's ``ConsumeQueueInterface.iterateFrom``: one index iterator serves every reader. A
partition's records are found through its .bcq entries (docs/formats/bcq.md) and read from the
.log (docs/formats/record.md); this module is the only place that walks the entries, coalesces
them into reads, reads the bytes, checks them and decodes them. Three ways in:

* **By offset** (``PartitionReader.read``, ``blocks``, ``records``): the records with offset >=
  ``from_offset`` in offset order, one segment per block; a missing offset continues at the next
  existing one; at least one record per block when any exists, even one larger than
  ``max_bytes``. ``dump``, restore's progress, the KV map's catch-up, the replica's merge.
* **A selection** (``PartitionReader.segment(seg).select(entries)``): chosen entries of one
  segment (what ``IndexCursor`` and a decision over them picked: the compactor's kept records,
  the latest record per key of a partition), read in blocks whose span is at most
  ``block_bytes``; ``sequential=True`` streams the .log front to back (one request on an object
  store, however many blocks).
* **Raw ranges, for replication only** (``read_raw``, ``locate``): the bytes of a run of records
  exactly as stored, which the master ships as they are (``kcompact serve``). Nothing else may
  depend on how records are laid out in a .log; issue 28 replaces that layout.

A block is a ``RecordColumns`` (reput/columns.py): offsets, timestamps, flags (tombstone,
keyless), key digests and clean times (from the index), key, value and header columns
(``BytesColumn``: one buffer, n+1 offsets, a null mask; headers encoded, decoded on demand by
``header_lists``), and ``Record`` objects for the slow paths (``records()``: dump, tests).

**What is verified.** Every record handed out passed ``verify_records``, the one check every path
goes through (C in reput/_native.c, numba in reput/_kernels.py): at the position its index entry
names there is a record with a valid header and a CRC32C that matches, whose size, offset,
timestamp, attributes and key digest (under the store's secret) are the entry's. So the index is
cross-checked against the record wherever a record is read, and nothing the index says about a
record handed out can differ from the record. An offset read and a raw range must also be
contiguous: records back to back, nothing before, between or after them. And an offset read
checks that the index search could not have stepped over a record: the record before the first
one handed out (the "guard", when there is one) is read and verified too, and must end where the
first begins with an offset below the one asked for; a read from the first entry must start at
byte 0 of the .log; a read to the last entry of an exact segment (every segment but a writer's
open one: reput/segment.py) must end where the .log ends; a segment stepped over must end with
a record below the offset asked for. So a read returns every record of the .log at or after the
offset asked for, or fails. The check returns the first record that fails, so a reader can hand
out the verified prefix of a block: the ``CorruptRecordError`` it raises carries it
(``prefix``, ``last_good_offset``) and names the file, the byte position and what did not match;
``blocks``/``records`` yield the prefix before they raise.

Index-only consumers (compaction's passes, the KV map's winner pass, the planner) read entries
they do not verify against records: ``IndexCursor`` checks a .bcq it reads whole against the
checksum its segment-list or manifest entry gives (once per segment, until the files change),
and raises at the end of that pass when it differs, before its caller acts on what it read.

**Across a compaction swap.** A read-only reader next to a compactor in another process can meet
a .log and a .bcq from different sides of a swap (docs/formats/compaction-swap.md: the two are
replaced one after the other): the check fails. Offset reads and raw ranges then re-list the
partition and try again (4 attempts, 20-80 ms apart); a mismatch that persists is corruption and
is raised. A writer's view (the compactor's own) has no one swapping under it: one attempt.

**On an object store** (S3) a committed segment's manifest entry gives its offsets (a bitmap), so
an offset read of a few records fetches only the index entries it needs: the range of the .bcq
from the entry the bitmap ranks, up to the end of the cache block holding it (the "short index
read"), instead of the whole .bcq; a mismatch with the bitmap is corruption.

``IndexCursor`` is the index side of the same walk: a segment's entries in bounded chunks read
into a reused buffer (what compaction's first pass, the planner, the KV map's winner pass and the
live-set computation read), never the data.

(Over 600 lines on purpose: every read path and the checks that guard it stay in one file, so
that no reader of partition data can bypass them.)
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Iterator, NamedTuple

import numpy as np

from . import batch as KB
from . import bcq as B
from . import parallel
from .backend import _oserror
from .errors import CorruptRecordError
from .jit import native
from .columns import KeyValues, RecordColumns, Spans, stored_records
from .record import HEADER, HEADER_SIZE, Record, field_spans, gather, secret_words
from .segment_list import crc32c, stream_crc32c

#: the smallest record is its header + a 1-byte topic
MIN_RECORD = HEADER_SIZE + 1
#: default span of one block (bytes read at once)
DEFAULT_BLOCK_BYTES = 4 << 20
#: attempts of a read-only view's offset read across a compaction swap
SWAP_ATTEMPTS = 4

_N = native()
_verify = _N.verify_records

_EMPTY_ENTRIES = np.zeros(0, dtype=B.BCQ_DTYPE)
_ZERO = np.zeros(1, np.int64)  # where a block's one record starts in its bytes
_ZERO.flags.writeable = False


def verify_records(data: np.ndarray, start: int, entries: np.ndarray, secret: bytes, *,
                   contiguous: bool = False, guard: bool = False, decoded: bool = False) -> int:
    """The one check of records against their index entries: the number of the first entry
    whose record fails (see module docstring), ``len(entries)`` when only the contiguity of a
    range fails after the last one, -1 when all pass. ``data`` holds the .log bytes from file
    position ``start``; ``secret`` is the store's digest secret. ``contiguous``: back to back
    from ``data[0]`` to its end, offsets increasing; ``guard`` (contiguous only): the first
    entry is the guard, only its header checked. ``decoded`` (a selection only): the records
    were just written by store format 2's decoder, which computed their CRCs (the batch's
    CRC-32C accepted the bytes they came from): everything but the CRC is checked."""
    if entries.shape[0] == 0:
        return 0 if contiguous and data.shape[0] else -1
    if not 0 <= start <= 0xFFFFFFFF:  # a .log position is 32 bits (bcq.md)
        return 0
    k0, k1 = _secret_words(secret)
    raw = np.ascontiguousarray(entries).view(np.uint8).reshape(-1)
    mode = 2 if guard else 1 if contiguous else 3 if decoded else 0
    return int(_verify(data, int(start), raw, k0, k1, mode))


@functools.lru_cache(maxsize=64)
def _secret_words(secret: bytes) -> tuple[int, int]:
    k0, k1 = secret_words(secret)
    return int(k0), int(k1)


def mismatch(data: np.ndarray, start: int, entry, secret: bytes) -> str:
    """What differs between one index entry and the bytes at its position (the reason in a
    corruption message; ``data`` holds the .log from position ``start``)."""
    p, size = int(entry["position"]) - start, int(entry["size"])
    if size < MIN_RECORD or p < 0 or p + HEADER_SIZE > data.shape[0]:
        return (f"the .bcq entry for offset {int(entry['offset'])} points at no whole record "
                f"(byte {int(entry['position'])}, {size} bytes)")
    (rsize, crc, magic, attrs, tl, resv, _part, off, ts, kl, vl, hl) = HEADER.unpack_from(
        memoryview(data), p)
    if (magic != 1 or resv or attrs & ~3 or min(kl, vl, hl) < 0 or tl < 1
            or HEADER_SIZE + tl + kl + vl + hl != rsize):
        return "no valid record header there"
    if rsize != size:
        return f"the .bcq entry says {size} bytes, the record has {rsize}"
    if p + size > data.shape[0]:
        return "the record runs past the end of the .log"
    if off != int(entry["offset"]):
        return f"the .bcq entry says offset {int(entry['offset'])}, the record has {off}"
    if ts != int(entry["timestamp"]):
        return f"the .bcq entry's timestamp {int(entry['timestamp'])} is not the record's {ts}"
    if attrs != int(entry["flags"]):
        return (f"the .bcq entry's flags {int(entry['flags'])} are not the record's attributes "
                f"{attrs} (tombstone, keyless)")
    if crc != crc32c(np.ascontiguousarray(data[p + 8:p + size])):
        return "CRC mismatch: the record's bytes are damaged"
    one = np.array([entry], dtype=B.BCQ_DTYPE)
    if verify_records(data, start, one, secret) >= 0:
        return "the .bcq entry's key digest does not match the record's key"
    return ("the record is not back to back with the one before it, or its offset does not "
            "follow that one's, as the index says")


def _corrupt_v2(path: str, e: CorruptRecordError, prefix, last_good) -> CorruptRecordError:
    why = str(e).removeprefix(f"{path}: ")
    return CorruptRecordError(f"{path}: corrupt record batch at byte {e.position} ({why}); run "
                              "`kcompact verify` and rebuild this partition from a replica",
                              path, e.position, last_good_offset=last_good, prefix=prefix)


def _corrupt(path: str, pos: int, what: str, last_good: int | None,
             prefix=None) -> CorruptRecordError:
    after = (f"; the records up to offset {last_good} were read" if last_good is not None
             else "")
    return CorruptRecordError(
        f"{path}: corrupt record at byte {pos}: {what}{after}; run `kcompact verify` and rebuild "
        "this partition from a replica", path, pos, last_good_offset=last_good, prefix=prefix)


class RawRange(NamedTuple):
    """A verified run of records exactly as stored (replication only): ``buf[:nbytes]``, their
    index entries (positions in the .log), and where the next read starts. ``buf`` comes from
    the pool given to ``read_raw`` (give it back once sent); None when there are no records."""

    buf: np.ndarray | None
    nbytes: int
    entries: np.ndarray
    next_offset: int

    @property
    def count(self) -> int:
        return self.entries.shape[0]

    def positions(self) -> np.ndarray:
        """Where each record starts in ``buf`` (int64)."""
        e = self.entries
        return e["position"].astype(np.int64) - (int(e[0]["position"]) if e.shape[0] else 0)


class Located:
    """A range of one segment's .log to send as it is (``os.sendfile``): ``fd`` is open on the
    .log the index entries describe (close it after sending). A format-2 segment's records are
    not a range of its file: ``data`` holds them (fd -1), decoded, to be written as they are."""

    __slots__ = ("fd", "start", "nbytes", "count", "next_offset", "data")

    def __init__(self, fd: int, start: int, nbytes: int, count: int, next_offset: int,
                 data: np.ndarray | None = None):
        self.fd, self.start, self.nbytes = fd, start, nbytes
        self.count, self.next_offset = count, next_offset
        self.data = data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BufferPool:
    """Reusable uint8 buffers (a few per server): take() / give()."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.shape[0] >= n:
                    return self._free.pop(i)
        return np.empty(max(n, 1 << 20), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


def read_fully(f, out: np.ndarray) -> int:
    """readinto until ``out`` is full or the stream ends; returns bytes read."""
    mv = memoryview(out).cast("B")
    done = 0
    while done < len(mv):
        n = f.readinto(mv[done:])
        if not n:
            break
        done += n
    return done


_HEAD = 24  # a record's size (u32 at 0) and offset (u64 at 16): record.md


def _head_matches(fd: int, pos: int, size: int, offset: int) -> bool:
    head = os.pread(fd, _HEAD, pos)
    return (len(head) == _HEAD and int.from_bytes(head[0:4], "little") == size
            and int.from_bytes(head[16:24], "little") == offset)


class PartitionReader:
    """Reads one partition (a ``PartitionLog``); see the module docstring."""

    def __init__(self, pl, *, attempts: int | None = None):
        self.pl = pl
        self.attempts = attempts or (1 if pl.writable else SWAP_ATTEMPTS)

    # -- by offset -------------------------------------------------------------------------

    def read(self, from_offset: int, max_records: int | None = None,
             max_bytes: int | None = None) -> RecordColumns:
        """Records with offset >= ``from_offset``, from one segment at most (module docstring).
        Raises ``CorruptRecordError`` when a record fails its check (carrying the verified
        records before it)."""
        pl = self.pl
        if max_records is not None and max_records <= 0:
            return RecordColumns.empty(pl.topic, pl.partition, from_offset)
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        return self._retrying(self._read_once, from_offset, max_records, max_bytes)

    def read_fields(self, from_offset: int, max_bytes: int | None = None,
                    want: np.ndarray | None = None) -> KeyValues:
        """``read``'s records as their keys and values only (with offsets), for a reader that
        needs nothing else (the KV map's build). From a format-2 segment they are taken where
        they lie in the decompressed batches, each batch and each record checked as ``read``
        checks them (batch CRC-32C and walk; offset, timestamp, flags and key digest against
        the entry), without writing format-1 records; anything that fails goes through
        ``read``, which names it. ``max_bytes`` bounds the batches decoded (about that many
        bytes of records). ``want`` (offsets, rising): only those records are handed out (and
        checked against their entries; every batch is still checked whole), ``next_offset``
        still the read's; a format-1 segment's block gives them all."""
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        if want is not None:
            want = np.asarray(want, np.int64)
        return self._retrying(self._fields_once, from_offset, max_bytes, want)

    def _fields_once(self, from_offset: int, max_bytes: int | None,
                     want: np.ndarray | None) -> KeyValues:
        pl = self.pl
        plan = self._plan(from_offset, None, max_bytes)
        if plan is not None and pl.seg_format(plan[0]) == 2 and _N is not None:
            seg, sel = plan[0], plan[1][plan[2]:]
            start, end, _, _ = self._batch_span(seg, sel)
            k0, k1 = _secret_words(pl.secret)
            got = KB.span_fields(pl.log_bytes(seg, start, end - start), start,
                                 len(pl.topic_bytes), sel, k0, k1, max_bytes, want)
            if got is not None:
                n = got.count
                return KeyValues(sel["offset"][got.picked].astype(np.int64),
                                 Spans(got.pay, got.kstart, got.klen, got.klen < 0),
                                 Spans(got.pay, got.vstart, got.vlen, got.vlen < 0),
                                 int(sel[n - 1]["offset"]) + 1)
        return KeyValues.of(self._read_once(from_offset, None, max_bytes))

    def blocks(self, from_offset: int = 0, *, max_bytes: int | None = DEFAULT_BLOCK_BYTES,
               limit: int | None = None) -> Iterator[RecordColumns]:
        """Blocks from ``from_offset`` to the end (at most ``limit`` records). When a record
        fails its check, the verified records before it are yielded, then the error raised."""
        off, n = from_offset, 0
        while limit is None or n < limit:
            try:
                b = self.read(off, None if limit is None else limit - n, max_bytes)
            except CorruptRecordError as e:
                err = e
            else:
                if len(b) == 0:
                    return
                yield b
                n += len(b)
                off = b.next_offset
                continue
            if err.prefix is not None and len(err.prefix):
                yield err.prefix
            raise err

    def records(self, from_offset: int = 0, limit: int | None = None,
                block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Record]:
        """``Record`` objects from ``from_offset`` (dump, restore's progress, tests)."""
        for b in self.blocks(from_offset, max_bytes=block_bytes, limit=limit):
            yield from b.records()

    def _read_once(self, from_offset: int, max_records: int | None,
                   max_bytes: int | None) -> RecordColumns:
        plan = self._plan(from_offset, max_records, max_bytes)
        if plan is None:
            return RecordColumns.empty(self.pl.topic, self.pl.partition,
                                       max(from_offset, self.pl.next_offset))
        seg, sel, guard, at_start, at_end = plan
        if self.pl.seg_format(seg) == 2:  # the lean index's batches chain over the whole .log
            return self._read_v2(seg, sel[guard:], max_bytes)
        sel = sel.copy()
        start = int(sel[0]["position"])
        # the furthest end, not the last entry's: a damaged entry must not shorten the read
        # of the good records before it (their prefix is handed out before the error)
        end = int((sel["position"].astype(np.int64) + sel["size"]).max())
        # max(0, ..): entries damaged out of order must fail the check, not the read
        data = np.frombuffer(self.pl.read_log(seg, start, max(0, end - start)), np.uint8)
        return self._verified(seg, data, start, sel, contiguous=True, guard=guard,
                              at_start=at_start, at_end=at_end)

    def _verified(self, seg, data: np.ndarray, start: int, sel: np.ndarray, *,
                  contiguous: bool = False, guard: int = 0, at_start: bool = False,
                  at_end: bool = False) -> RecordColumns:
        """The block of ``sel[guard:]``'s records in ``data`` (the .log from ``start``),
        verified (module docstring): every record against its entry; with ``contiguous``,
        back to back and in offset order; ``at_start``: the first is at byte 0; ``at_end``:
        the last ends where the .log ends. The guard entry before them (``guard`` = 1) is
        checked, not handed out."""
        pl = self.pl
        n = sel.shape[0]
        bad = verify_records(data, start, sel, pl.secret, contiguous=contiguous,
                             guard=bool(guard))
        what = None
        if bad < 0 and at_start and int(sel[0]["position"]) != 0:
            bad, what = 0, "the first .bcq entry does not point at the start of the .log"
        if bad < 0 and at_end and start + data.shape[0] != seg.log_size:
            bad = n
            what = (f"records after the last .bcq entry (the .log holds {seg.log_size} bytes, "
                    f"its last entry ends at byte {start + data.shape[0]})")
        if guard:
            if bad == 0:
                g = sel[0]
                raise _corrupt(pl.seg_log_path(seg), int(g["position"]), (
                    f"the .bcq entry for offset {int(g['offset'])} does not match the record "
                    "at its position, or is not next to the records after it, so the read "
                    "cannot tell what lies between them"), None)
            gsize = int(sel[0]["size"])  # (verified: the records follow it)
            data, start, sel, n = data[gsize:], start + gsize, sel[1:], n - 1
            bad = bad - 1 if bad > 0 else bad
        rel = sel["position"].astype(np.int64) - start
        if bad < 0:
            return RecordColumns(pl.topic, pl.partition, data, sel, rel,
                                 int(sel[-1]["offset"]) + 1)
        prefix = None
        if bad > 0:
            prefix = RecordColumns(pl.topic, pl.partition, data, sel[:bad], rel[:bad],
                                   int(sel[bad - 1]["offset"]) + 1)
        if what is None:
            what = ("bytes after the last record" if bad >= n else
                    mismatch(data, start, sel[bad], pl.secret))
        if bad < n:
            pos = int(sel[bad]["position"])
        else:
            pos = start + data.shape[0] if at_end else \
                int(sel[-1]["position"]) + int(sel[-1]["size"])
        last_good = int(sel[bad - 1]["offset"]) if bad > 0 else None
        raise _corrupt(pl.seg_log_path(seg), pos, what, last_good, prefix)

    def _check_guard_at(self, seg, head: np.ndarray, g, next_pos: int | None,
                        log_end: int | None = None) -> int:
        """The guard (module docstring): the record at entry ``g``'s position (``head``: its
        first HEADER_SIZE bytes, fewer where the .log ends) has the entry's size and offset in
        a valid header, lies inside the .log, and ends at ``next_pos`` (the first record
        handed out) or at ``log_end``. Its body is not checked: it is not handed out, and a
        damaged body cannot make the index search step over a record. Returns its size;
        raises CorruptRecordError."""
        pos, size = int(g["position"]), int(g["size"])
        ok = size >= MIN_RECORD and head.shape[0] >= HEADER_SIZE and pos + size <= seg.log_size
        if ok:
            (rsize, _crc, magic, _a, _tl, resv, _part, off, *_rest) = HEADER.unpack_from(
                memoryview(np.ascontiguousarray(head[:HEADER_SIZE])), 0)
            ok = rsize == size and magic == 1 and resv == 0 and off == int(g["offset"])
        if ok and next_pos is not None:
            ok = pos + size == next_pos
        if ok and log_end is not None:
            ok = pos + size == log_end
        if not ok:
            raise _corrupt(self.pl.seg_log_path(seg), pos, (
                f"the .bcq entry for offset {int(g['offset'])} does not match the record at "
                "its position, or is not next to the records after it, so the read cannot "
                "tell what lies between them"), None)
        return size

    # -- format 2: Kafka batches (docs/formats/segment-v2.md) ------------------------------------

    def _batch_span(self, seg, sel: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(start, end) in the .log of the batches holding ``sel``'s records, and those batches'
        positions and record counts (from the lean index)."""
        bpos, bsize, bcount = self.pl.index(seg).batches()
        p = sel["position"].astype(np.int64)  # in position order: each batch's first entry
        want = p[np.r_[True, p[1:] != p[:-1]]] if p.shape[0] else p
        k = np.searchsorted(bpos, want)
        if bool(np.any(k >= bpos.shape[0])) or bool(np.any(bpos[np.minimum(k, bpos.shape[0] - 1)]
                                                           != want)):
            path = self.pl.seg_index_path(seg)
            raise CorruptRecordError(f"{path}: an index entry names no batch of the .log; run "
                                     "`kcompact verify`", path, int(want[0]) if want.size else 0)
        return int(want[0]), int(bpos[k[-1]] + bsize[k[-1]]), want, bcount[k]

    def _read_v2(self, seg, sel: np.ndarray, max_bytes: int | None) -> RecordColumns:
        """A run of a format-2 segment's entries (from ``_plan``) read: the batches holding
        them, each checked whole. A run inside one batch (a short read) takes
        ``_one_batch_v2``, which reuses the batch the previous read decompressed (a sequential
        reader's next read usually starts in it). A longer run decodes batches until the
        records reach ``max_bytes`` (``_plan`` bounds the run by the .log's bytes, which are
        compressed) and starts with the kept batch when it is the first."""
        pl = self.pl
        p0 = int(sel[0]["position"])
        b = None
        if int(sel[-1]["position"]) == p0:
            at = pl.index(seg).batch_at(p0)
            if at is not None:
                b = self._one_batch_v2(seg, sel, p0, at[0], at[1])
        if b is None:
            start, end, _, _ = self._batch_span(seg, sel)
            data = pl.log_bytes(seg, start, end - start)
            last = pl.last_batch
            first = (last[2] if last is not None and last[0] is seg
                     and last[1] == (seg.log_size, seg.index_size, start) else None)
            b = self._decoded_v2(seg, data, start, sel, None, keep=True, max_bytes=max_bytes,
                                 first=first)
        if max_bytes is not None and len(b) > 1:
            # the bound is on the records returned (format 1), not on the batches read
            ends = np.cumsum(stored_records(b)[2])
            b = b.head(max(1, int(np.searchsorted(ends, max_bytes, side="right"))))
        return b

    def _decoded_v2(self, seg, data: np.ndarray, start: int, sel: np.ndarray,
                    want: "set[int] | None", *, keep: bool = False,
                    max_bytes: int | None = None, first=None) -> RecordColumns:
        """The block of ``sel``'s records from the batches in ``data`` (the .log from
        ``start``; with ``want``, only the batches at those positions are decoded). Each batch
        is accepted by its CRC-32C, its record count must be the index's and each selected
        entry's offset must be a record of the batch the entry names. ``keep``: the last batch
        is kept for the partition's next read (an offset read; a selection reads on).
        ``max_bytes``, ``first``: batch.decode_batches'; the block then holds the entries of
        the batches decoded."""
        pl = self.pl
        path = pl.seg_log_path(seg)
        try:
            key = (seg.log_size, seg.index_size)
            d = KB.decode_batches(data, start, pl.topic_bytes, pl.partition, path,
                                  want=want, lo=int(sel[0]["offset"]), hi=int(sel[-1]["offset"]),
                                  keep=(lambda w: pl.keep_batch(seg, key, w)) if keep else None,
                                  max_bytes=max_bytes, first=first)
            if max_bytes is not None and len(d.heads):
                sel = sel[sel["position"] <= int(d.heads.positions[-1])]
        except CorruptRecordError as e:
            d = getattr(e, "decoded", None)
            if d is None or not len(d.heads):
                raise _corrupt_v2(path, e, None, None) from None
            upto = int(d.heads.positions[-1])
            keep = sel[sel["position"] <= upto]
            try:
                prefix = self._columns_v2(seg, d, keep, path) if keep.shape[0] else None
            except CorruptRecordError:
                prefix = None
            raise _corrupt_v2(path, e, prefix, int(keep[-1]["offset"]) if prefix else None) \
                from None
        return self._columns_v2(seg, d, sel, path)

    def _columns_v2(self, seg, d, sel: np.ndarray, path: str) -> RecordColumns:
        pl = self.pl
        bpos, _, bcount = pl.index(seg).batches()
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
        return self._checked_v2(sel, d.data, d.sizes[j], d.positions[j], path)

    def _checked_v2(self, sel: np.ndarray, data: np.ndarray, sizes: np.ndarray,
                    rel: np.ndarray, path: str) -> RecordColumns:
        """The block of ``sel``'s records decoded into ``data`` (format-1 records at ``rel``,
        ``sizes`` bytes), each checked against its entry (offset, timestamp, flags, key digest)
        by the one check every format-1 read goes through, run on the decoded records without
        their CRCs (the decoder computed them from the bytes it wrote; the batch's CRC-32C
        accepted the bytes they came from)."""
        pl = self.pl
        ent = sel.copy()
        ent["size"] = sizes
        if ent.shape[0] == 1:  # the record alone: data's byte 0 stands for its entry's position
            bad = verify_records(data, int(ent["position"][0]), ent, pl.secret, decoded=True)
        else:  # checked at their places in data, then given back their batches' positions
            ent["position"] = rel
            n = ent.shape[0]
            if parallel.worth_splitting(data.shape[0]):  # in two halves at once
                h = n // 2
                a, b = parallel.both(
                    lambda: verify_records(data, 0, ent[:h], pl.secret, decoded=True),
                    lambda: verify_records(data, 0, ent[h:], pl.secret, decoded=True))
                bad = a if a >= 0 else (h + b if b >= 0 else -1)
            else:
                bad = verify_records(data, 0, ent, pl.secret, decoded=True)
            ent["position"] = sel["position"]
        if bad >= 0:
            chk = ent.copy()
            chk["position"] = rel
            pos = int(sel[bad]["position"])
            last_good = int(sel[bad - 1]["offset"]) if bad else None
            prefix = (RecordColumns(pl.topic, pl.partition, data, ent[:bad], rel[:bad],
                                    last_good + 1) if bad else None)
            raise CorruptRecordError(
                f"{path}: corrupt record batch at byte {pos} (its record at offset "
                f"{int(sel[bad]['offset'])} does not match its lean index entry: "
                f"{mismatch(data, 0, chk[bad], pl.secret)}); run `kcompact verify` and "
                "rebuild this partition from a replica", path, pos,
                last_good_offset=last_good, prefix=prefix)
        return RecordColumns(pl.topic, pl.partition, data, ent, rel,
                             int(sel[-1]["offset"]) + 1)

    def _one_batch_v2(self, seg, sel: np.ndarray, pos: int, size: int,
                      count: int) -> RecordColumns:
        """``_read_v2`` of entries that all lie in the one batch at ``pos`` (``size`` bytes,
        ``count`` records by the lean index; ``sel`` a run of its entries): the batch is read
        and checked whole (its CRC-32C, then every record walked and its offsets against its
        header), unless it is the one the previous read of the partition decompressed (then
        only walked again), and only ``sel``'s records are converted and checked."""
        pl = self.pl
        path = pl.seg_log_path(seg)
        last = pl.last_batch
        try:
            if last is not None and last[0] is seg and last[1] == (seg.log_size, seg.index_size,
                                                                   pos):
                b = last[2]
            else:
                b = KB.open_batch(pl.log_bytes(seg, pos, size), 0, pos, path)
                if b.head.size != size:
                    raise CorruptRecordError(f"{path}: the batch at byte {pos} holds "
                                             f"{b.head.size} bytes, its index lists {size}",
                                             path, pos)
                pl.keep_batch(seg, (seg.log_size, seg.index_size), b)
        except CorruptRecordError as e:
            raise _corrupt_v2(path, e, None, None) from None
        if b.head.count != count:
            raise CorruptRecordError(f"{path}: the batch at byte {pos} does not hold the records "
                                     "its index lists; run `kcompact verify`", path, pos)
        if sel.shape[0] == 1 and _N is not None:  # one record: walked, converted, checked at once
            h = b.head
            k0, k1 = _secret_words(pl.secret)
            st, last_delta, rec = _N.kafka_read_one(b.payload, h.count, pl.topic_bytes,
                                                    pl.partition, h.base_offset, h.base_ts,
                                                    sel.view(np.uint8).reshape(-1), k0, k1)
            if st == 0 and last_delta == h.last_offset - h.base_offset:
                ent = sel.copy()
                ent["size"] = len(rec)
                return RecordColumns(pl.topic, pl.partition, np.frombuffer(rec, np.uint8), ent,
                                     _ZERO, int(ent["offset"][0]) + 1)
            # whatever failed: the general path below names it
        try:
            lo, hi = int(sel[0]["offset"]), int(sel[-1]["offset"])
            d = KB.decode_run(b, pl.topic_bytes, pl.partition, lo, hi, path)
            if d is None:  # several records: each one's size and place
                d = KB.decode_walked([KB.walk_opened(b, len(pl.topic_bytes), path)],
                                     pl.topic_bytes, pl.partition, lo=lo, hi=hi)
        except CorruptRecordError as e:
            raise _corrupt_v2(path, e, None, None) from None
        if d.offsets.shape[0] != sel.shape[0]:  # (the offsets themselves: _checked_v2)
            raise CorruptRecordError(
                f"{path}: the batch at byte {pos} does not hold offsets "
                f"{int(sel[0]['offset'])}..{int(sel[-1]['offset'])} as its index lists; run "
                "`kcompact verify`", path, pos)
        return self._checked_v2(sel, d.data, d.sizes, d.positions, path)

    def _plan(self, from_offset: int, max_records: int | None, max_bytes: int | None):
        """What a read from ``from_offset`` reads: (segment, its entries to read, how many of
        them are guards, whether the first read is the segment's first, whether the last is
        its last in an exact segment), or None when no record at or after it exists."""
        pl = self.pl
        i = pl.segment_for(from_offset)
        while i < len(pl.segments):
            seg = pl.segments[i]
            if seg.entry is not None and (seg.entry.records == 0
                                          or seg.entry.last_offset < from_offset):
                i += 1  # the manifest says it holds nothing at or after from_offset
                continue
            part = self._short_index_read(seg, from_offset, max_records)
            if part is not None:  # the manifest's bitmap placed it: no guard needed
                e, j, whole = part, 0, False
            elif pl.seg_format(seg) == 2:  # the lean index's chunks from the read's first
                # (a lean index is checked whole by its CRCs and a format-2 read decodes whole
                # batches: no guard record)
                idx = pl.index(seg)
                n = idx.n
                j = int(idx.lower_bound(from_offset))
                if j < n:
                    e = idx.slice_within(j, n if max_records is None else min(n, j + max_records),
                                         max_bytes)
                    stop = j + e.shape[0]
                    return seg, e, 0, j == 0, stop == n and not seg.open_tail
                self._check_stepped_over_v2(seg, idx, from_offset)
                i += 1
                continue
            else:
                idx = pl.index(seg)
                e = idx.entries
                # from the first entry when the offset is not past it (what a search of sorted
                # entries returns), so a damaged index further on cannot misplace a read from
                # the segment's start: the records before the damage are still read
                j = 0 if e.shape[0] and from_offset <= int(e[0]["offset"]) else \
                    int(idx.lower_bound(from_offset))
                whole = True
            n = e.shape[0]
            if j < n:
                stop = n if max_records is None else min(n, j + max_records)
                if max_bytes is not None:
                    # entries are >= MIN_RECORD bytes each: no need to look further than this
                    stop = min(stop, j + max_bytes // MIN_RECORD + 1)
                    ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] \
                        - int(e[j]["position"])
                    stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
                guard = 1 if whole and j > 0 else 0
                return (seg, e[j - guard:stop], guard, whole and j == 0,
                        whole and stop == n and not seg.open_tail)
            if whole:
                self._check_stepped_over(seg, e, from_offset)
            i += 1
        return None

    def _check_stepped_over(self, seg, e: np.ndarray, from_offset: int) -> None:
        """A segment the index search says holds nothing at or after ``from_offset``: its last
        entry's record is verified, and in an exact segment ends where the .log ends (the
        search saw that entry below ``from_offset``, so no record of the .log is at or after
        it). An empty index of an exact segment needs an empty .log."""
        n = e.shape[0]
        path = self.pl.seg_log_path(seg)
        if n == 0:
            if not seg.open_tail and seg.log_size:
                raise _corrupt(path, 0, f"the .bcq lists no record of a .log of {seg.log_size} "
                               "bytes", None)
            return
        last = e[n - 1]
        pos = int(last["position"])
        head = np.frombuffer(self.pl.read_log(seg, pos, HEADER_SIZE), np.uint8)
        self._check_guard_at(seg, head, last, None, None if seg.open_tail else seg.log_size)

    def _check_stepped_over_v2(self, seg, idx, from_offset: int) -> None:
        """``_check_stepped_over`` of a format-2 segment: its last batch's header (read alone;
        the lean index chains the batches to the end of the .log) is a valid batch header of
        the size the index says, whose last offset is the index's last, below ``from_offset``."""
        if idx.n == 0:
            if seg.log_size:
                raise _corrupt(self.pl.seg_log_path(seg), 0, "the lean index lists no record of "
                               f"a .log of {seg.log_size} bytes", None)
            return
        bpos, bsize, _ = idx.batches()
        pos, size = int(bpos[-1]), int(bsize[-1])
        path = self.pl.seg_log_path(seg)
        head = np.frombuffer(self.pl.read_log(seg, pos, KB.HEADER_SIZE), np.uint8)
        try:
            h = KB.parse_head(np.concatenate([head, np.zeros(max(0, size - head.shape[0]),
                                                             np.uint8)]),
                              0, path, pos, check_crc=False)
        except CorruptRecordError as e:
            raise _corrupt_v2(path, e, None, None) from None
        last = int(idx.dir["last_offset"][-1])
        if h.size != size or pos + size != seg.log_size or h.last_offset != last \
                or last >= from_offset:
            raise _corrupt(path, pos, f"the last batch's header (last offset {h.last_offset}, "
                           f"{h.size} bytes) is not what the lean index lists (offset {last}, "
                           f"{size} bytes, ending the .log)", None)

    def _short_index_read(self, seg, from_offset: int,
                          max_records: int | None) -> np.ndarray | None:
        """Object store: the .bcq entries of a committed segment from the first offset
        >= ``from_offset``, at most ``max_records`` and not past the cache block holding the
        first, read by range (the manifest bitmap's rank is the entry number). None when the
        whole .bcq is the better read: it is local already, no larger than a block, or the
        read wants more entries than a block holds."""
        pl = self.pl
        ent = seg.entry
        bs = int(getattr(pl.fs, "block_size", 0) or 0)
        if ent is None or pl.seg_format(seg) == 2 or seg.index_cached or max_records is None \
                or bs <= 0 or max_records * B.ENTRY_SIZE > bs or ent.bcq_size <= bs:
            return None
        path = pl.seg_index_path(seg)
        if pl.fs.has_local_copy(path):
            return None
        j = ent.rank_below(from_offset)
        if j >= ent.records:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        start = j * B.ENTRY_SIZE
        hi = min(ent.records, j + max_records,
                 max(j + 1, (start // bs + 1) * bs // B.ENTRY_SIZE))
        raw = pl.fs.read(path, start, (hi - j) * B.ENTRY_SIZE)
        e = B.view(np.frombuffer(raw, dtype=np.uint8))
        want = ent.offset_at_or_after(from_offset)
        if e.shape[0] != hi - j or int(e[0]["offset"]) != want:
            raise CorruptRecordError(
                f"{path}: entry {j} does not hold offset {want} as the manifest's bitmap says "
                "(or the index is short); run `kcompact verify`", path, start)
        return e

    def _retrying(self, fn, *args):
        """``fn(*args)``, again after re-listing the partition when a .log/.bcq pair caught in
        the middle of a compaction swap fails the checks; a mismatch that persists is raised."""
        pl = self.pl
        for attempt in range(self.attempts):
            try:
                return fn(*args)
            except (CorruptRecordError, FileNotFoundError):
                if attempt == self.attempts - 1:
                    raise
                time.sleep(0.02 * (attempt + 1))
                for seg in pl.segments:
                    seg.invalidate()
                pl.refresh()
        raise AssertionError("unreachable")

    # -- Kafka batches (the Kafka endpoint) -----------------------------------------------------

    def kafka_batches(self, from_offset: int, max_bytes: int):
        """Whole RecordBatch v2 batches from the one holding ``from_offset`` (or the next one),
        within ``max_bytes`` but the first whole: a ``KafkaBatches`` (reput/kafka_batches.py)."""
        from .kafka_batches import kafka_batches
        return kafka_batches(self, from_offset, max_bytes)

    # -- a selection ---------------------------------------------------------------------------

    def segment(self, seg, *, sequential: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                buffer: np.ndarray | None = None) -> "SegmentRecords":
        """Selected records of segment ``seg``: ``with reader.segment(seg) as s:
        for block in s.select(entries): ...`` (module docstring)."""
        return SegmentRecords(self, seg, sequential, block_bytes, buffer)

    # -- raw ranges: replication only ------------------------------------------------------------

    def read_raw(self, from_offset: int, max_bytes: int, pool: BufferPool | None = None
                 ) -> RawRange:
        """The records ``read`` would return, as stored, in a buffer from ``pool``: the master's
        records response (``kcompact serve``). Verified and contiguous (module docstring)."""
        return self._retrying(self._read_raw_once, int(from_offset), max_bytes, pool)

    def _read_raw_once(self, from_offset: int, max_bytes: int, pool: BufferPool | None
                       ) -> RawRange:
        pl = self.pl
        plan = self._plan(from_offset, None, max_bytes)
        if plan is None:
            return RawRange(None, 0, _EMPTY_ENTRIES, max(from_offset, pl.next_offset))
        seg, sel, guard, at_start, at_end = plan
        if pl.seg_format(seg) == 2:
            return self._raw_v2(seg, sel[guard:], max_bytes)
        self._check_guard(seg, sel, guard, at_start)
        sel = sel[guard:]
        start = int(sel[0]["position"])
        nbytes = max(0, int(sel[-1]["position"]) + int(sel[-1]["size"]) - start)
        buf = pool.take(nbytes) if pool is not None else np.empty(nbytes, np.uint8)
        try:
            got = pl.seg_fs(seg).read_into(pl.seg_log_path(seg), start, buf[:nbytes])
            self._verified(seg, buf[:got], start, sel, contiguous=True, at_end=at_end)
        except BaseException:
            if pool is not None:
                pool.give(buf)
            raise
        return RawRange(buf, nbytes, sel.copy(), int(sel[-1]["offset"]) + 1)

    def _check_guard(self, seg, sel: np.ndarray, guard: int, at_start: bool) -> None:
        """A raw range's guard (module docstring), read on its own: verified, and ending where
        the range begins; or, from the first entry, the range beginning at byte 0."""
        if at_start and int(sel[0]["position"]) != 0:
            raise _corrupt(self.pl.seg_log_path(seg), int(sel[0]["position"]),
                           "the first .bcq entry does not point at the start of the .log", None)
        if not guard:
            return
        g = sel[0]
        head = np.frombuffer(self.pl.read_log(seg, int(g["position"]), HEADER_SIZE), np.uint8)
        self._check_guard_at(seg, head, g, int(sel[1]["position"]))

    def _raw_v2(self, seg, sel: np.ndarray, max_bytes: int | None) -> RawRange:
        """A format-2 segment's records as format-1 records, back to back (what a replica
        appends and what the live digests cover, whatever the master's segment format)."""
        b = self._read_v2(seg, sel, max_bytes)
        data, rel, sizes, ent = stored_records(b)
        buf = gather(data, rel, sizes)
        ent = ent.copy()
        pos = np.zeros(sizes.shape[0], np.int64)
        np.cumsum(sizes[:-1], out=pos[1:])
        ent["position"] = pos
        return RawRange(buf, buf.shape[0], ent, b.next_offset)

    def locate(self, from_offset: int, max_bytes: int) -> Located | None:
        """Where the records ``read_raw`` would return lie, for a local store: a Located range
        (open fd) or None when no record at or after ``from_offset`` exists. No byte is read but
        the record headers at the ends of the range and before it; the replica checks every
        record."""
        return self._retrying(self._locate_once, int(from_offset), max_bytes)

    def _locate_once(self, from_offset: int, max_bytes: int) -> Located | None:
        pl = self.pl
        plan = self._plan(from_offset, None, max_bytes)
        if plan is None:
            return None
        seg, e, guard, at_start, at_end = plan
        if pl.seg_format(seg) == 2:  # no file range to send: the records, decoded, from memory
            r = self._raw_v2(seg, e[guard:], max_bytes)
            return Located(-1, 0, r.nbytes, r.count, r.next_offset, data=r.buf[:r.nbytes])
        first = int(e[guard]["position"])
        nbytes = int(e[-1]["position"]) + int(e[-1]["size"]) - first
        rel = pl.seg_log_path(seg)
        fd = os.open(pl.seg_fs(seg).local_path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            # The fd pins this .log (a swap renames, never rewrites). The index entries must
            # describe *this* file: a .bcq read before a swap and a .log opened after it differ
            # at the range's ends (different records at those positions) - re-list and retry.
            # The guard's header and position say the index search stepped over nothing.
            size = os.fstat(fd).st_size
            g = e[0] if guard else None
            if (nbytes <= 0 or size < first + nbytes
                    or not _head_matches(fd, first, int(e[guard]["size"]),
                                         int(e[guard]["offset"]))
                    or not _head_matches(fd, int(e[-1]["position"]), int(e[-1]["size"]),
                                         int(e[-1]["offset"]))
                    or (g is not None and (int(g["position"]) + int(g["size"]) != first
                                           or not _head_matches(fd, int(g["position"]),
                                                                int(g["size"]),
                                                                int(g["offset"]))))
                    or (at_start and first != 0)
                    or (at_end and first + nbytes != size)):
                raise CorruptRecordError(
                    f"{rel}: the .bcq does not match the .log at byte {first}; run "
                    "`kcompact verify`", rel, first)
        except BaseException:
            os.close(fd)
            raise
        return Located(fd, first, nbytes, e.shape[0] - guard, int(e[-1]["offset"]) + 1)


class SegmentRecords:
    """Chosen records of one segment, read in blocks (``PartitionReader.segment``).

    ``select(entries)`` takes entries of this segment in position order (a subset of its index,
    possibly with clean times of the caller's; each call's entries after the previous call's
    when ``sequential``) and yields verified ``RecordColumns`` blocks of them, each read as one
    span of at most ``block_bytes`` (or one record). ``bytes_read`` counts what was read.
    """

    def __init__(self, reader: PartitionReader, seg, sequential: bool, block_bytes: int,
                 buffer: np.ndarray | None):
        self.reader, self.seg = reader, seg
        self.sequential, self.block_bytes = sequential, block_bytes
        self.bytes_read = 0
        self._buf = buffer
        self._stream = None
        self._at = 0
        self._path = reader.pl.seg_log_path(seg)

    def __enter__(self) -> "SegmentRecords":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def select(self, entries: np.ndarray) -> Iterator[RecordColumns]:
        n = entries.shape[0]
        if n == 0:
            return
        if self.reader.pl.seg_format(self.seg) == 2:
            yield from self._select_v2(entries)
            return
        pos = entries["position"].astype(np.int64)
        ends = pos + entries["size"]
        i = 0
        while i < n:
            j = max(i + 1, int(np.searchsorted(ends, pos[i] + self.block_bytes, side="right")))
            start, stop = int(pos[i]), int(ends[j - 1])
            data = self._read(start, max(0, stop - start))
            yield self.reader._verified(self.seg, data, start, entries[i:j])
            i = j

    def raw(self, start: int, length: int, sizes: np.ndarray | None = None) -> np.ndarray:
        """Format-2 batches' bytes as stored (a compaction copying batches whose records all
        stay): ``length`` bytes from ``start``, one batch, or batches of ``sizes`` bytes back to
        back; each header and CRC-32C checked; valid until the next read of this selection."""
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

    def _select_v2(self, entries: np.ndarray) -> Iterator[RecordColumns]:
        """Format 2: the batches holding the entries' records, read in spans of at most
        ``block_bytes`` (or one batch), only those batches decoded."""
        reader = self.reader
        bpos, bsize, _ = reader.pl.index(self.seg).batches()
        _, _, want, _ = reader._batch_span(self.seg, entries)
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
            yield reader._decoded_v2(self.seg, data, start, entries[lo:hi],
                                     set(want[i:j].tolist()))
            i = j

    def _read(self, start: int, length: int) -> np.ndarray:
        self.bytes_read += length
        pl = self.reader.pl
        if not self.sequential:
            return np.frombuffer(pl.read_log(self.seg, start, length), np.uint8)
        try:
            if self._stream is None:
                self._stream = pl.open_log(self.seg)
                self._at = 0
            if start != self._at:
                self._skip(start)
            if self._buf is None or self._buf.shape[0] < length:
                self._buf = np.empty(max(length, self.block_bytes), np.uint8)
            out = self._buf[:length]
            got = read_fully(self._stream, out)
            self._at = start + got
            return out[:got]  # a short read fails the check
        except FileNotFoundError:
            raise
        except OSError as e:  # a stream's reads raise raw OSError: say which file
            raise _oserror(e, "read", self._path) from e

    def _skip(self, to: int) -> None:
        if self._stream.seekable():
            self._stream.seek(to)
            self._at = to
            return
        if to < self._at:
            raise CorruptRecordError(f"{self._path}: entries out of position order at byte {to}",
                                     self._path, to)
        junk = np.empty(min(1 << 20, to - self._at), np.uint8)
        while self._at < to:
            n = read_fully(self._stream, junk[:min(to - self._at, junk.shape[0])])
            if n == 0:
                return  # the file ends here: the read that follows is short and fails
            self._at += n


class IndexCursor:
    """A partition's .bcq entries, segment by segment, in bounded chunks read into one reused
    buffer (each chunk valid until the next). Memory stays bounded whatever the index size (no
    mapping of the whole file), and a .bcq is read as one sequential stream (one request on an
    object store). Entries a read-only view indexed in memory from a .log tail its .bcq does not
    list yet (a writer's append in progress) come last, from memory."""

    def __init__(self, pl, chunk_entries: int = 1 << 15, buf: np.ndarray | None = None):
        self.pl = pl
        self.chunk_entries = chunk_entries
        if buf is None or buf.shape[0] < chunk_entries * B.ENTRY_SIZE:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
        self.buf = buf

    def count(self, seg) -> int:
        """Valid entries of ``seg``."""
        return self.pl.index(seg).n

    def lower_bound(self, seg, offset: int) -> int:
        """Number of the first entry of ``seg`` with offset >= ``offset``."""
        return int(self.pl.index(seg).lower_bound(offset))

    def chunks(self, seg, start_entry: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """(number of the first entry, entries) of ``seg`` from entry ``start_entry``. A pass
        from entry 0 to the end over a .bcq whose segment-list or manifest entry gives its
        checksum checks it (module docstring): a mismatch raises ``CorruptRecordError`` after
        the last chunk, before the caller acts on the pass."""
        pl = self.pl
        idx = pl.index(seg)
        n = idx.n
        if pl.seg_format(seg) == 2:  # the lean index's own chunks, decoded one at a time
            if start_entry == 0 and not seg.bcq_checked:
                self._check_lean(seg)
            # the next chunk decoded in the helper thread while the caller works on this one
            for i, e in parallel.ahead(idx.chunk, range(idx.chunk_of_entry(start_entry)
                                                        if n else 0, idx.chunk_count)):
                f = idx.chunk_first_entry(i)
                yield max(f, start_entry), e[max(0, start_entry - f):]
            return
        n_file = min(n, seg.entry_count)
        path = pl.seg_index_path(seg)
        step, buf = self.chunk_entries, self.buf
        expect = seg.expected_bcq() if start_entry == 0 and not seg.bcq_checked else None
        crc = 0
        if start_entry < n_file:
            try:
                with pl.seg_fs(seg).open_read(path, start_entry * B.ENTRY_SIZE) as f:
                    for lo in range(start_entry, n_file, step):
                        hi = min(n_file, lo + step)
                        want = (hi - lo) * B.ENTRY_SIZE
                        if read_fully(f, buf[:want]) != want:
                            raise CorruptRecordError(
                                f"{path}: index shorter than expected at entry {lo}",
                                path, lo * B.ENTRY_SIZE)
                        if expect is not None:
                            crc = crc32c(buf[:want], crc)
                        yield lo, buf[:want].view(B.BCQ_DTYPE)
            except FileNotFoundError:
                raise
            except OSError as e:  # the stream's reads raise raw OSError: say which file
                raise _oserror(e, "read", path) from e
        if expect is not None:
            if (n_file * B.ENTRY_SIZE, crc) != expect:
                raise CorruptRecordError(
                    f"{path}: the index does not match its checksum ({n_file} entries, crc32c "
                    f"{crc:08x}; its segment list says {expect[0] // B.ENTRY_SIZE} entries, "
                    f"{expect[1]:08x}): its entries cannot be trusted; run `kcompact verify` "
                    "and rebuild this partition from a replica", path, 0)
            seg.bcq_checked = True
        for lo in range(max(start_entry, n_file), n, step):
            yield lo, idx.entries[lo:min(n, lo + step)]

    def tombstone_columns(self, seg) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(flags, clean_time) of every entry of ``seg``, a chunk at a time: what a look for
        tombstones due for purging reads. A lean index's chunks are decompressed but not decoded
        into entries (LeanIndex.tombstone_columns); checked as ``chunks`` checks a pass from
        entry 0."""
        pl = self.pl
        if pl.seg_format(seg) != 2:
            for _, e in self.chunks(seg):
                yield e["flags"], e["clean_time"]
            return
        idx = pl.index(seg)
        if not seg.bcq_checked:
            self._check_lean(seg)
        for _, cols in parallel.ahead(idx.tombstone_columns,
                                      range(idx.chunk_count if idx.n else 0)):
            yield cols

    def check(self, seg) -> None:
        """``seg``'s index against the size and checksum its segment-list or manifest entry
        gives (CorruptRecordError otherwise; nothing when no entry gives one or it was checked
        since the files last changed): a .bcq read whole in chunks, a lean index by its file's
        CRC32C alone (its chunks are checked by their own CRCs when decoded)."""
        if seg.expected_bcq() is None or seg.bcq_checked:
            return
        if self.pl.seg_format(seg) == 2:
            self._check_lean(seg)
            return
        for _ in self.chunks(seg):
            pass

    def _check_lean(self, seg) -> None:
        """A lean index against the size and checksum its segment-list or manifest entry
        gives (its chunks are also checked each by their own CRC as they are decoded)."""
        expect = seg.expected_bcq()
        if expect is None:
            return
        pl = self.pl
        path = pl.seg_index_path(seg)
        got = getattr(pl.index(seg), "file_check", None)  # an object: read whole already
        if got is None:  # streamed, a block at a time (a large segment's index is 100s of MB)
            with pl.seg_fs(seg).open_read(path) as f:
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
        seg.bcq_checked = True


def warm_up() -> None:
    """Load the kernels a read runs (numba's cache, when the C module was not built)."""
    from .record import encode
    raw = np.frombuffer(encode([Record("t", 0, 5, 0, b"k", b"v")]), np.uint8)
    e = np.zeros(1, dtype=B.BCQ_DTYPE)
    e["offset"], e["size"] = 5, raw.shape[0]
    verify_records(raw, 0, e, bytes(16), contiguous=True)
    field_spans(raw, np.zeros(1, np.int64))


__all__ = ["BufferPool", "DEFAULT_BLOCK_BYTES", "IndexCursor", "Located", "PartitionReader",
           "RawRange", "RecordColumns", "SegmentRecords", "Spans", "read_fully",
           "verify_records", "warm_up"]
