"""The lean .bcq of a format-2 segment: compressed column chunks of whole batches, a directory.

Spec: docs/formats/bcq-v2.md. ``IndexBuilder`` collects the entries of a segment's batches as
they are written and ``finish`` returns the file; ``LeanIndex`` reads one: the header and the
directory once, then a chunk at a time, each decoded into format 1's entry dtype
(``bcq.BCQ_DTYPE``: ``position`` is the record's batch position, ``size`` the batch's size on
the batch's first record and 0 on the others) so that every caller of an index reads both formats
alike. Unlike format 1's index this one is checksummed (header, directory, each chunk).
"""

from __future__ import annotations

import bisect
import io
import itertools
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from . import bcq as B
from .codecs import ZSTD_MAX_CONTENT, zstd_compress, zstd_decompress
from .errors import CorruptRecordError
from . import _native as _N

FORMAT_VERSION = 2
MAGIC = b"KCBQ2\x00\x00\xff"
#: magic version codec target chunk_count records log_size dir_crc header_crc
HEADER = struct.Struct("<8sHBBIQQII")
HEADER_SIZE = HEADER.size  # 40
assert HEADER_SIZE == 40
DIR_DTYPE = np.dtype([
    ("first_offset", "<i8"), ("last_offset", "<i8"), ("first_entry", "<u8"),
    ("chunk_pos", "<u8"), ("first_position", "<u8"), ("chunk_len", "<u4"),
    ("chunk_crc", "<u4"),
])
assert DIR_DTYPE.itemsize == 48
CHUNK_ENTRIES = 8192
CHUNK_LEVEL = 3
_U32 = struct.Struct("<II")
#: bytes of a chunk's columns a record: offset_delta timestamp_delta flags clean_time digest
_ENTRY_BYTES = 4 + 8 + 1 + 4 + 8 + 8
#: the most records a chunk can hold: its columns decompress to at most ZSTD_MAX_CONTENT bytes
#: (8 + 8 * batches + 33 * records, one batch at least); a header or directory claiming more is
#: refused before anything is allocated for them (issue 44)
MAX_CHUNK_RECORDS = (ZSTD_MAX_CONTENT - 16) // _ENTRY_BYTES
#: a whole-index decode of more entries than this first checks each chunk's claim against its
#: zstd frame's declared size (bytes read, not allocated)
CHECK_CLAIMS_ABOVE = 1 << 20


def is_lean(head: bytes) -> bool:
    """Does a .bcq starting with ``head`` (its first 8 bytes or more) hold a lean index?"""
    return head[:8] == MAGIC


def _crc(data) -> int:
    from .batch import crc32c
    arr = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    return crc32c(arr, 0, arr.shape[0]) if arr.shape[0] else 0


#: compressed chunks a builder holds in memory before it moves them to its spill file
SPILL_ABOVE = 1 << 20


class IndexBuilder:
    """The entries of a segment, batch by batch (``add_batch``), into a lean index
    (``write_to`` a file, or ``finish`` for the bytes). Memory stays bounded whatever the
    segment: closed chunks over ``SPILL_ABOVE`` bytes go to an unnamed temporary file (in
    ``spill_dir``, else the system's temporary directory) until the index is written."""

    def __init__(self, chunk_entries: int | None = None, spill_dir: str | None = None):
        self.chunk_entries = CHUNK_ENTRIES if chunk_entries is None else chunk_entries
        self.spill_dir = spill_dir
        self._chunks: list[bytes] = []
        self._held = 0   # bytes of _chunks
        self._spill = None
        self._dir: list[tuple] = []
        self._pending: list[np.ndarray] = []
        self._pending_counts: list[np.ndarray] = []  # records of each pending batch
        self._pending_sizes: list[np.ndarray] = []   # bytes of each pending batch
        self._pending_n = 0
        self._pending_first_pos = 0
        self.records = 0
        self.log_size = 0

    def add_batch(self, position: int, size: int, entries: np.ndarray) -> None:
        """A batch written at ``position`` (``size`` bytes) holding the records of ``entries``
        (BCQ_DTYPE: offset, timestamp, digests, flags, clean_time are used)."""
        self.add_batches(position, [size], [entries.shape[0]], entries)

    def add_batches(self, position: int, sizes, counts, entries: np.ndarray) -> None:
        """Batches written back to back from ``position`` (``sizes`` bytes, ``counts``
        records each) holding the records of ``entries``, in order: ``add_batch`` of each, with
        the entries taken in slices as large as a chunk allows (a chunk closes after the batch
        that brings it to ``chunk_entries`` records)."""
        if position != self.log_size:
            raise ValueError("batches must be added back to back")
        sizes = np.asarray(sizes, np.int64).reshape(-1)
        counts = np.asarray(counts, np.int64).reshape(-1)
        nb = counts.shape[0]
        ends = np.cumsum(counts)  # records through each batch
        if sizes.shape[0] != nb or (int(ends[-1]) if nb else 0) != entries.shape[0]:
            raise ValueError("the batches' counts are not the entries given")
        i = 0
        while i < nb:
            if not self._pending_counts:
                self._pending_first_pos = self.log_size
            done = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, done + self.chunk_entries - self._pending_n))
            k = min(j, nb - 1) + 1  # batches i..k-1 go into this chunk
            self._pending.append(entries[done:int(ends[k - 1])])
            self._pending_counts.append(counts[i:k])
            self._pending_sizes.append(sizes[i:k])
            self._pending_n += int(ends[k - 1]) - done
            self.log_size += int(sizes[i:k].sum())
            if self._pending_n >= self.chunk_entries:
                self._close_chunk()
            i = k

    def _close_chunk(self) -> None:
        if not self._pending_counts:
            return
        e = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        n = e.shape[0]
        counts = np.concatenate(self._pending_counts).astype(np.uint32)
        sizes = np.concatenate(self._pending_sizes).astype(np.uint32)
        off = e["offset"].astype(np.int64)
        od = np.empty(n, np.uint32)
        od[0] = 0
        od[1:] = np.diff(off)
        ts = e["timestamp"].astype(np.int64)
        td = np.empty(n, np.int64)
        td[0] = ts[0]
        td[1:] = np.diff(ts)
        body = b"".join([_U32.pack(n, counts.shape[0]), counts.tobytes(), sizes.tobytes(),
                         od.tobytes(), td.tobytes(), e["flags"].astype(np.uint8).tobytes(),
                         e["clean_time"].astype(np.uint32).tobytes(),
                         e["digest_lo"].astype(np.uint64).tobytes(),
                         e["digest_hi"].astype(np.uint64).tobytes()])
        packed = zstd_compress(body, CHUNK_LEVEL)
        self._dir.append((int(off[0]), int(off[-1]), self.records, 0, self._pending_first_pos,
                          len(packed), _crc(packed)))
        self._chunks.append(packed)
        self._held += len(packed)
        if self._held > SPILL_ABOVE:
            if self._spill is None:
                where = self.spill_dir if self.spill_dir and os.path.isdir(self.spill_dir) \
                    else None
                self._spill = tempfile.TemporaryFile(prefix="kcompact-bcq-", dir=where)
            for c in self._chunks:
                self._spill.write(c)
            self._chunks, self._held = [], 0
        self.records += n
        self._pending, self._pending_counts, self._pending_sizes = [], [], []
        self._pending_n = 0

    def write_to(self, out, codec: int, target: int = 0) -> int:
        """Write the whole .bcq with ``out.write`` (``codec``: the codec its segment's batches
        are written with; ``target``: what compression.type it was written for,
        codecs.target_of, 0 unknown); returns its bytes."""
        self._close_chunk()
        d = np.zeros(len(self._dir), DIR_DTYPE)
        pos = HEADER_SIZE + d.nbytes
        for i, row in enumerate(self._dir):
            d[i] = row
            d[i]["chunk_pos"] = pos
            pos += row[5]
        dbytes = d.tobytes()
        head = HEADER.pack(MAGIC, FORMAT_VERSION, codec, target, len(self._dir), self.records,
                           self.log_size, _crc(dbytes), 0)
        head = head[:36] + struct.pack("<I", _crc(head[:36]))
        out.write(head + dbytes)
        if self._spill is not None:  # the chunks spilled first, then the ones held
            self._spill.seek(0)
            while piece := self._spill.read(1 << 20):
                out.write(piece)
            self._spill.close()
            self._spill = None
        for c in self._chunks:
            out.write(c)
        self._chunks, self._held = [], 0
        return pos

    def finish(self, codec: int, target: int = 0) -> bytes:
        """The whole .bcq, as bytes."""
        buf = io.BytesIO()
        self.write_to(buf, codec, target)
        return buf.getvalue()


#: bytes of decoded chunks kept for lookups by offset, over every lean index of the process,
#: the least recently used dropped first (bcq-v2.md, "Lookups"): a one-record read decodes no
#: chunk when the chunk holding its offset was looked up lately (a chunk of 8,192 entries
#: decodes to 384 KiB)
LOOKUP_CACHE_BYTES = 32 << 20


class _LookupCache:
    """Arrays of decoded chunks by (index, chunk number), least recently used dropped past
    ``budget`` bytes. Shared by the threads of a process (a lock)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._chunks: OrderedDict[tuple[int, int], tuple[int, tuple[np.ndarray, ...]]] = \
            OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int]) -> tuple[np.ndarray, ...] | None:
        with self._lock:
            hit = self._chunks.get(key)
            if hit is None:
                return None
            self._chunks.move_to_end(key)
            return hit[1]

    def put(self, key: tuple[int, int], arrays: tuple[np.ndarray, ...]) -> None:
        size = sum(a.nbytes for a in arrays)
        with self._lock:
            if key in self._chunks or size > self.budget:
                return
            self._chunks[key] = (size, arrays)
            self._bytes += size
            while self._bytes > self.budget:
                _, (old, _) = self._chunks.popitem(last=False)
                self._bytes -= old

    def forget(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held this one
        when it forked) and nothing kept."""
        self._lock = threading.Lock()
        self._chunks = OrderedDict()
        self._bytes = 0


_LOOKUPS = _LookupCache(LOOKUP_CACHE_BYTES)
_INDEX_IDS = itertools.count()
os.register_at_fork(after_in_child=lambda: _LOOKUPS.forget())


class LeanIndex:
    """A lean .bcq opened for reading (``read(start, length) -> bytes`` reads the file). Quacks
    like ``bcq.Index``: ``n``, ``lower_bound``, ``entries`` (every entry, decoded on first use);
    ``chunk(i)`` decodes one chunk, ``chunk_of_entry``/``chunk_of_offset`` find one."""

    format = 2

    def __init__(self, read: Callable[[int, int], bytes], path: str, size: int):
        self._read, self.path, self.file_size = read, path, size
        head = read(0, min(size, 1 << 16))
        if len(head) < HEADER_SIZE or not is_lean(head):
            raise CorruptRecordError(f"{path}: not a lean index (bad magic or cut short)", path, 0)
        (_m, version, codec, target, chunks, records, log_size, dir_crc,
         head_crc) = HEADER.unpack_from(head, 0)
        if version != FORMAT_VERSION or _crc(head[:36]) != head_crc:
            raise CorruptRecordError(f"{path}: lean index header check failed", path, 0)
        dlen = chunks * DIR_DTYPE.itemsize
        if HEADER_SIZE + dlen > size:
            raise CorruptRecordError(f"{path}: lean index directory runs past the file", path,
                                     HEADER_SIZE)
        raw = head[HEADER_SIZE:HEADER_SIZE + dlen]
        if len(raw) < dlen:
            raw = read(HEADER_SIZE, dlen)
        if _crc(raw) != dir_crc:
            raise CorruptRecordError(f"{path}: lean index directory CRC mismatch", path,
                                     HEADER_SIZE)
        if records > chunks * MAX_CHUNK_RECORDS or (records == 0) != (chunks == 0):
            raise CorruptRecordError(f"{path}: lean index header claims {records} records in "
                                     f"{chunks} chunks", path, 0)
        self.codec, self.n, self.log_size = codec, int(records), int(log_size)
        #: what compression.type the segment was written for (codecs.target_of; 0 unknown)
        self.target = int(target)
        self.dir = np.frombuffer(raw, DIR_DTYPE).copy()
        ends = self.dir["chunk_pos"].astype(np.int64) + self.dir["chunk_len"]
        if chunks and (int(ends[-1]) != size or int(self.dir["first_entry"][0]) != 0):
            raise CorruptRecordError(f"{path}: lean index chunks do not fill the file", path,
                                     HEADER_SIZE)
        d = self.dir
        if chunks and (int(d["first_position"][0]) != 0 or bool(np.any(
                d["first_offset"] > d["last_offset"])) or bool(np.any(
                d["first_offset"][1:] <= d["last_offset"][:-1])) or bool(np.any(
                d["first_entry"][1:] <= d["first_entry"][:-1])) or bool(np.any(
                d["first_position"][1:] <= d["first_position"][:-1])) or int(
                d["first_entry"][-1]) >= records or int(d["first_position"][-1]) >= log_size):
            raise CorruptRecordError(f"{path}: lean index directory out of order (chunks must "
                                     "start at byte 0 of the .log, entry 0, and follow each "
                                     "other in offsets, entries and positions)", path,
                                     HEADER_SIZE)
        #: (bytes, CRC32C) of the whole file when it was read whole (an object), else None
        self.file_check: tuple[int, int] | None = None
        self._cache: dict[int, np.ndarray] = {}
        self._id = next(_INDEX_IDS)  # (its chunks' key in the lookup cache)
        self._lists: tuple[list[int], list[int], list[int]] | None = None
        self._all: np.ndarray | None = None
        self._batches: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # batches' so far
        self._rows_lock = threading.Lock()
        self._batch_at: dict[int, tuple[int, int]] | None = None

    @property
    def chunk_count(self) -> int:
        return self.dir.shape[0]

    def _dir_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The directory's first entries, last offsets and first positions as lists (a lookup
        bisects them: a fraction of numpy's call on a small array)."""
        if self._lists is None:
            self._lists = (self.dir["first_entry"].tolist(), self.dir["last_offset"].tolist(),
                           self.dir["first_position"].tolist())
        return self._lists

    def chunk_first_entry(self, i: int) -> int:
        return self._dir_lists()[0][i]

    def chunk_of_entry(self, j: int) -> int:
        return max(0, bisect.bisect_right(self._dir_lists()[0], j) - 1)

    def chunk(self, i: int, collect: bool = True) -> np.ndarray:
        """Entries of chunk ``i`` (BCQ_DTYPE, a fresh array; the last one decoded is cached).
        Chunks decoded in order from the first also collect ``batches``' table on the way (a
        compaction's first pass over the index leaves it ready for the second), unless
        ``collect`` is false (a caller that takes each chunk's batches itself)."""
        hit = self._cache.get(i)
        if hit is not None:
            return hit
        e = self._load(i)
        self._cache = {i: e}
        if collect and self._batches is None:
            with self._rows_lock:
                if self._batches is None and i == len(self._rows):
                    self._add_rows(e)
        return e

    @staticmethod
    def batch_rows(e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, sizes, record counts) of the whole batches whose entries are ``e``."""
        p = e["position"].astype(np.int64)
        first = np.flatnonzero(np.diff(p, prepend=-1)) if p.shape[0] else p
        return (p[first], e["size"][first].astype(np.int64),
                np.diff(first, append=p.shape[0]).astype(np.int64))

    def _add_rows(self, e: np.ndarray) -> None:
        """Add the batches of the next chunk's entries ``e`` to the table ``batches`` builds
        (chunks hold whole batches); the table is made once every chunk is in."""
        self._rows.append(self.batch_rows(e))
        if len(self._rows) == self.chunk_count:
            self._batches = tuple(np.concatenate(c)  # type: ignore[assignment]
                                  for c in zip(*self._rows))
            self._rows = []

    def tombstone_columns(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(flags, clean_time) of chunk ``i``'s records, read, checked against its CRC and
        decompressed but not decoded into entries: what a look for tombstones due for purging
        needs (the columns lie whole in the chunk, so the offsets, positions and digests are not
        rebuilt). The chunk's size and counts are checked as a decode checks them."""
        raw, pos = self._raw(i)
        body = self._body(i, raw, pos)
        n, b = self._layout(i, body, pos)
        p = 8 + 8 * b + 12 * n  # past batch_count, batch_size, offset and timestamp deltas
        return body[p:p + n], body[p + n:p + 5 * n].view(np.uint32)

    def _records_in(self, i: int) -> int:
        """Entries of chunk ``i``, as the directory gives them."""
        nxt = int(self.dir["first_entry"][i + 1]) if i + 1 < self.chunk_count else self.n
        return nxt - int(self.dir["first_entry"][i])

    def _layout(self, i: int, body: np.ndarray, pos: int) -> tuple[int, int]:
        """(records, batches) of chunk ``i``'s decompressed ``body``: as many records as the
        directory gives, at least one batch, and exactly the bytes their columns take."""
        if body.shape[0] < 8:
            raise self._bad(i, pos)
        n, b = _U32.unpack_from(body, 0)
        if n == 0 or b == 0 or n != self._records_in(i) \
                or body.shape[0] != 8 + 8 * b + n * _ENTRY_BYTES:
            raise self._bad(i, pos)
        return n, b

    def _raw(self, i: int) -> tuple[bytes, int]:
        """Chunk ``i`` as stored, checked against its CRC, and its byte position."""
        d = self.dir[i]
        pos, length = int(d["chunk_pos"]), int(d["chunk_len"])
        raw = self._read(pos, length)
        if len(raw) != length or _crc(raw) != int(d["chunk_crc"]):
            raise CorruptRecordError(f"{self.path}: lean index chunk {i} at byte {pos} fails "
                                     "its CRC (or is cut short)", self.path, pos)
        return raw, pos

    def _bad(self, i: int, pos: int) -> CorruptRecordError:
        return CorruptRecordError(f"{self.path}: lean index chunk {i} at byte {pos} does not "
                                  "decode", self.path, pos)

    def _body(self, i: int, raw: bytes, pos: int) -> np.ndarray:
        """Chunk ``i``'s columns, decompressed."""
        try:
            return np.frombuffer(zstd_decompress(raw), np.uint8)
        except Exception:  # noqa: BLE001 - the codec's own error
            raise self._bad(i, pos) from None

    def _load(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        """Chunk ``i`` read, checked against its CRC and decoded (into ``out`` when given)."""
        raw, pos = self._raw(i)
        return self._decode(i, raw, pos, out)

    def batches(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, sizes, record counts) of every batch of the .log (int64 each): from the
        entries when they are decoded already, else chunk by chunk from the first not yet
        collected (memory bounded by a chunk: a compaction's pass over a large segment does not
        hold all its entries); cached."""
        if self._batches is not None:
            return self._batches
        with self._rows_lock:
            if self._batches is not None:
                return self._batches
            if self.chunk_count == 0:
                self._batches = (np.zeros(0, np.int64),) * 3  # type: ignore[assignment]
            elif self._all is not None:
                self._batches = self.batch_rows(self._all)
                self._rows = []
            while self._batches is None:
                self._add_rows(self._load(len(self._rows)))
        return self._batches

    def batch_at(self, position: int) -> tuple[int, int] | None:
        """(size, record count) of the batch at byte ``position`` of the .log, None when no batch
        starts there (a one-record read's lookup: a dict made once from ``batches``)."""
        if self._batch_at is None:
            pos, size, count = self.batches()
            self._batch_at = dict(zip(pos.tolist(), zip(size.tolist(), count.tolist())))
        return self._batch_at.get(position)

    def _decode(self, i: int, raw: bytes, pos: int, out: np.ndarray | None = None
                ) -> np.ndarray:
        d = self.dir[i]
        bad = self._bad(i, pos)
        body = self._body(i, raw, pos)
        # one pass in C (reput/_kafka_native.h lean_decode)
        last = i + 1 >= self.chunk_count
        n = self._records_in(i)
        nxt_pos = self.log_size if last else int(self.dir["first_position"][i + 1])
        if n <= 0 or not 16 + _ENTRY_BYTES * n <= body.shape[0] <= 8 + (8 + _ENTRY_BYTES) * n:
            raise bad  # (the body's size first: a count is never trusted before it)
        e = np.empty(n, B.BCQ_DTYPE) if out is None else out
        if e.shape[0] != n or not _N.lean_decode(
                body, n, int(d["first_offset"]), int(d["last_offset"]),
                int(d["first_position"]), nxt_pos, e.view(np.uint8).reshape(-1)):
            raise bad
        return e

    @property
    def entries(self) -> np.ndarray:
        """Every entry of the segment (decoded once, then cached)."""
        if self._all is None:
            if self.n > CHECK_CLAIMS_ABOVE:
                self._check_claims()
            out = np.empty(self.n, B.BCQ_DTYPE)
            for i in range(self.chunk_count):
                lo = int(self.dir["first_entry"][i])
                hi = int(self.dir["first_entry"][i + 1]) if i + 1 < self.chunk_count else self.n
                hit = self._cache.get(i)
                if hit is not None and hit.shape[0] == hi - lo:
                    out[lo:hi] = hit
                else:
                    self._load(i, out[lo:hi])
            self._all = out
        return self._all

    def _check_claims(self) -> None:
        """Each chunk's record count (the directory's) against what its zstd frame declares it
        decompresses to (8 + 8 * batches + 33 * records bytes, batches <= records): a claim no
        chunk can hold is refused before the entries are allocated."""
        from .codecs import _zstandard
        for i in range(self.chunk_count):
            raw, pos = self._raw(i)
            n = self._records_in(i)
            try:
                size = _zstandard().frame_content_size(raw)
            except Exception:  # noqa: BLE001 - the codec's own error
                raise self._bad(i, pos) from None
            if n <= 0 or (size >= 0 and not 16 + _ENTRY_BYTES * n <= size
                          <= 8 + (8 + _ENTRY_BYTES) * n):
                raise self._bad(i, pos)

    @property
    def words(self) -> np.ndarray:
        return self.entries.view(np.int64) if self.n else np.zeros(0, np.int64)

    def _looked_up(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``i`` for a lookup by offset or entry (``lower_bound``, ``slice``), with its
        offsets (contiguous, for a search): from the process's cache of recently looked-up
        chunks (LOOKUP_CACHE_BYTES), else decoded and kept there. Not for passes over every
        chunk (``chunk``), which would only evict."""
        key = (self._id, i)
        hit = _LOOKUPS.get(key)
        if hit is None:
            e = self.chunk(i)
            e.flags.writeable = False  # shared from now on: a caller copies what it changes
            offs = np.ascontiguousarray(e["offset"])
            offs.flags.writeable = False
            hit = (e, offs)
            _LOOKUPS.put(key, hit)
        return hit

    def lower_bound(self, target: int) -> int:
        """Number of the first entry with offset >= target (n if none)."""
        if self.n == 0:
            return 0
        if self._all is not None:
            return int(np.searchsorted(self._all["offset"], target))
        firsts, lasts, _ = self._dir_lists()
        i = bisect.bisect_left(lasts, target)
        if i >= len(lasts):
            return self.n
        _, offs = self._looked_up(i)
        return firsts[i] + int(offs.searchsorted(target))

    def slice(self, j: int, k: int) -> np.ndarray:
        """Entries j..k-1, decoding only the chunks they lie in."""
        if self._all is not None:
            return self._all[j:k]
        if j >= k:
            return np.zeros(0, B.BCQ_DTYPE)
        a, z = self.chunk_of_entry(j), self.chunk_of_entry(k - 1)
        parts = []
        for i in range(a, z + 1):
            e = self._looked_up(i)[0]
            f = self.chunk_first_entry(i)
            parts.append(e[max(0, j - f):k - f])
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def slice_within(self, j: int, k: int, max_bytes: int | None) -> np.ndarray:
        """``slice(j, k)``, or with ``max_bytes`` only the entries of the batches that start
        less than ``max_bytes`` past the first one's (at least one batch), decoding only the
        chunks they reach (a read by offset bounded in bytes: the decode that follows bounds
        the batches by the bytes of their records, at least their bytes here). The chunks the
        directory places wholly inside are decoded straight into the result; the first and the
        last, where the next read starts, through the lookup cache."""
        if max_bytes is None:
            return self.slice(j, k)
        if j >= k:
            return np.zeros(0, B.BCQ_DTYPE)
        c = self.chunk_of_entry(j)
        f = self.chunk_first_entry(c)
        head = self._looked_up(c)[0]
        limit = int(head["position"][j - f]) + max(1, int(max_bytes))
        firsts, _, fpos = self._dir_lists()
        # the last chunk holding a batch that starts before the limit
        z = min(max(c, bisect.bisect_left(fpos, limit) - 1), self.chunk_of_entry(k - 1))
        if z == c:
            e = head[j - f:k - f]
            return e[:int(np.searchsorted(e["position"].astype(np.int64), limit))]
        fz = firsts[z]
        tail = self._looked_up(z)[0][:max(0, k - fz)]
        hi = fz + int(np.searchsorted(tail["position"].astype(np.int64), limit))
        out = np.empty(hi - j, B.BCQ_DTYPE)
        out[:firsts[c + 1] - j] = head[j - f:]
        for i in range(c + 1, z):
            self._load(i, out[firsts[i] - j:firsts[i + 1] - j])
        out[fz - j:] = tail[:hi - fz]
        return out


__all__ = ["CHUNK_ENTRIES", "DIR_DTYPE", "FORMAT_VERSION", "HEADER", "IndexBuilder",
           "LeanIndex", "MAGIC", "is_lean"]
