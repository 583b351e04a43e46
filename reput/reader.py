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
names there is a record with a valid header, the entry's size and offset, and a CRC32C that
matches. A raw range must also be contiguous: its records back to back, nothing before, between
or after them (every byte shipped is a checked record). The check returns the first record that
fails, so a reader can hand out the verified prefix of a block: the ``CorruptRecordError`` it
raises carries it (``prefix``, ``last_good_offset``), and ``blocks``/``records`` yield it before
they raise. (Issue 27 adds the key digest to this check.)

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
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator, NamedTuple

import numpy as np

from . import _kernels as K
from . import bcq as B
from .backend import _oserror
from .errors import CorruptRecordError
from .jit import native
from .columns import RecordColumns, Spans
from .record import HEADER_SIZE, Record, field_spans

#: the smallest record is its header + a 1-byte topic
MIN_RECORD = HEADER_SIZE + 1
#: default span of one block (bytes read at once)
DEFAULT_BLOCK_BYTES = 4 << 20
#: attempts of a read-only view's offset read across a compaction swap
SWAP_ATTEMPTS = 4

_N = native()
_verify = _N.verify_records if _N is not None else K.verify_records

_EMPTY_ENTRIES = np.zeros(0, dtype=B.BCQ_DTYPE)


def verify_records(data: np.ndarray, start: int, entries: np.ndarray, *,
                   contiguous: bool = False) -> int:
    """The one check of records against their index entries: the number of the first entry
    whose record fails (see module docstring), ``len(entries)`` when only the contiguity of a
    raw range fails after the last one, -1 when all pass. ``data`` holds the .log bytes from
    file position ``start``."""
    if entries.shape[0] == 0:
        return 0 if contiguous and data.shape[0] else -1
    return int(_verify(data, int(start), entries["position"], entries["size"], entries["offset"],
                       bool(contiguous)))


def _corrupt(path: str, start: int, entries: np.ndarray, bad: int, prefix) -> CorruptRecordError:
    if bad < entries.shape[0]:
        pos = int(entries[bad]["position"])
    else:  # a raw range with bytes after its last record
        pos = int(entries[-1]["position"]) + int(entries[-1]["size"]) if entries.shape[0] \
            else start
    last_good = int(entries[bad - 1]["offset"]) if bad > 0 else None
    return CorruptRecordError(
        f"{path}: corrupt record at byte {pos} (CRC or header check failed, or the .bcq does not "
        "match the .log); run `kcompact verify` and rebuild this partition from a replica",
        path, pos, last_good_offset=last_good, prefix=prefix)


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
    .log the index entries describe (close it after sending)."""

    __slots__ = ("fd", "start", "nbytes", "count", "next_offset")

    def __init__(self, fd: int, start: int, nbytes: int, count: int, next_offset: int):
        self.fd, self.start, self.nbytes = fd, start, nbytes
        self.count, self.next_offset = count, next_offset

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
        seg, sel = plan
        sel = sel.copy()
        start = int(sel[0]["position"])
        end = int(sel[-1]["position"]) + int(sel[-1]["size"])
        # max(0, ..): entries damaged out of order must fail the check, not the read
        data = np.frombuffer(self.pl.read_log(seg, start, max(0, end - start)), np.uint8)
        return self._verified(seg, data, start, sel)

    def _verified(self, seg, data: np.ndarray, start: int, sel: np.ndarray, *,
                  contiguous: bool = False) -> RecordColumns:
        """The block of ``sel``'s records in ``data`` (the .log from ``start``), verified."""
        pl = self.pl
        bad = verify_records(data, start, sel, contiguous=contiguous)
        rel = sel["position"].astype(np.int64) - start
        if bad < 0:
            return RecordColumns(pl.topic, pl.partition, data, sel, rel,
                                 int(sel[-1]["offset"]) + 1)
        prefix = None
        if bad > 0:
            prefix = RecordColumns(pl.topic, pl.partition, data, sel[:bad], rel[:bad],
                                   int(sel[bad - 1]["offset"]) + 1)
        raise _corrupt(pl.seg_log_path(seg), start, sel, bad, prefix)

    def _plan(self, from_offset: int, max_records: int | None, max_bytes: int | None):
        """(segment, its entries to read) for a read from ``from_offset``, or None."""
        pl = self.pl
        i = pl.segment_for(from_offset)
        while i < len(pl.segments):
            seg = pl.segments[i]
            if seg.entry is not None and (seg.entry.records == 0
                                          or seg.entry.last_offset < from_offset):
                i += 1  # the manifest says it holds nothing at or after from_offset
                continue
            part = self._short_index_read(seg, from_offset, max_records)
            if part is not None:
                e, j = part, 0
            else:
                idx = pl.index(seg)
                e = idx.entries
                j = int(idx.lower_bound(from_offset))
            if j < e.shape[0]:
                stop = e.shape[0] if max_records is None else min(e.shape[0], j + max_records)
                if max_bytes is not None:
                    # entries are >= MIN_RECORD bytes each: no need to look further than this
                    stop = min(stop, j + max_bytes // MIN_RECORD + 1)
                    ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] \
                        - int(e[j]["position"])
                    stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
                return seg, e[j:stop]
            i += 1
        return None

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
        if ent is None or seg.index_cached or max_records is None or bs <= 0 \
                or max_records * B.ENTRY_SIZE > bs or ent.bcq_size <= bs:
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
        seg, sel = plan
        start = int(sel[0]["position"])
        nbytes = max(0, int(sel[-1]["position"]) + int(sel[-1]["size"]) - start)
        buf = pool.take(nbytes) if pool is not None else np.empty(nbytes, np.uint8)
        try:
            got = pl.seg_fs(seg).read_into(pl.seg_log_path(seg), start, buf[:nbytes])
            bad = verify_records(buf[:got], start, sel, contiguous=True)
            if bad >= 0:
                raise _corrupt(pl.seg_log_path(seg), start, sel, bad, None)
        except BaseException:
            if pool is not None:
                pool.give(buf)
            raise
        return RawRange(buf, nbytes, sel.copy(), int(sel[-1]["offset"]) + 1)

    def locate(self, from_offset: int, max_bytes: int) -> Located | None:
        """Where the records ``read_raw`` would return lie, for a local store: a Located range
        (open fd) or None when no record at or after ``from_offset`` exists. No byte is read but
        the two record headers at the ends of the range; the replica checks every record."""
        return self._retrying(self._locate_once, int(from_offset), max_bytes)

    def _locate_once(self, from_offset: int, max_bytes: int) -> Located | None:
        pl = self.pl
        plan = self._plan(from_offset, None, max_bytes)
        if plan is None:
            return None
        seg, e = plan
        first = int(e[0]["position"])
        nbytes = int(e[-1]["position"]) + int(e[-1]["size"]) - first
        rel = pl.seg_log_path(seg)
        fd = os.open(pl.seg_fs(seg).local_path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            # The fd pins this .log (a swap renames, never rewrites). The index entries must
            # describe *this* file: a .bcq read before a swap and a .log opened after it differ
            # at the range's ends (different records at those positions) - re-list and retry.
            if (nbytes <= 0 or os.fstat(fd).st_size < first + nbytes
                    or not _head_matches(fd, first, int(e[0]["size"]), int(e[0]["offset"]))
                    or not _head_matches(fd, int(e[-1]["position"]), int(e[-1]["size"]),
                                         int(e[-1]["offset"]))):
                raise CorruptRecordError(
                    f"{rel}: the .bcq does not match the .log at byte {first}; run "
                    "`kcompact verify`", rel, first)
        except BaseException:
            os.close(fd)
            raise
        return Located(fd, first, nbytes, e.shape[0], int(e[-1]["offset"]) + 1)


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
        pos = entries["position"].astype(np.int64)
        ends = pos + entries["size"]
        i = 0
        while i < n:
            j = max(i + 1, int(np.searchsorted(ends, pos[i] + self.block_bytes, side="right")))
            start, stop = int(pos[i]), int(ends[j - 1])
            data = self._read(start, max(0, stop - start))
            yield self.reader._verified(self.seg, data, start, entries[i:j])
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
        """(number of the first entry, entries) of ``seg`` from entry ``start_entry``."""
        pl = self.pl
        idx = pl.index(seg)
        n = idx.n
        n_file = min(n, seg.entry_count)
        path = pl.seg_index_path(seg)
        step, buf = self.chunk_entries, self.buf
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
                        yield lo, buf[:want].view(B.BCQ_DTYPE)
            except FileNotFoundError:
                raise
            except OSError as e:  # the stream's reads raise raw OSError: say which file
                raise _oserror(e, "read", path) from e
        for lo in range(max(start_entry, n_file), n, step):
            yield lo, idx.entries[lo:min(n, lo + step)]


def warm_up() -> None:
    """Load the kernels a read runs (numba's cache, when the C module was not built)."""
    from .record import encode
    raw = np.frombuffer(encode([Record("t", 0, 5, 0, b"k", b"v")]), np.uint8)
    e = np.zeros(1, dtype=B.BCQ_DTYPE)
    e["offset"], e["size"] = 5, raw.shape[0]
    verify_records(raw, 0, e, contiguous=True)
    field_spans(raw, np.zeros(1, np.int64))


__all__ = ["BufferPool", "DEFAULT_BLOCK_BYTES", "IndexCursor", "Located", "PartitionReader",
           "RawRange", "RecordColumns", "SegmentRecords", "Spans", "read_fully",
           "verify_records", "warm_up"]
