"""Store format 1's segment: kcompact's own records and a 48-byte index entry per record.

Spec: docs/formats/record.md (the .log) and docs/formats/bcq.md (the .bcq). ``RecordSegment``
is the ``Segment`` (reput/segment.py) of this kind: the active segment a writer appends to,
a rolled one not sealed yet, and every segment of a store written before format 2. Its index
is mapped (a sorted array of fixed-size entries viewed without parsing); its records are read
by range and each is checked by ``verify_records``, the one check every record handed out
passes (C in reput/_native.c; its numba reference is tests/unit/_oracle_kernels.py): at the
position its entry names there is a record with a valid header and a CRC32C that matches,
whose size, offset, timestamp, attributes and key digest (under the store's secret) are the entry's.

An offset read also checks that the index search could not have stepped over a record: the
record before the first one handed out (the "guard") is read and checked too, and must end
where the first begins with an offset below the one asked for; a read from the first entry
must start at byte 0 of the .log; a read to the last entry of an exact segment must end where
the .log ends; a segment stepped over must end with a record below the offset asked for. On
an object store a committed segment's manifest bitmap ranks the first entry a short read
needs (``_short_index_read``), so a few records cost a range of the .bcq, not all of it.

A read-only view indexes, in memory, whole valid records of an open segment's .log that its
.bcq does not list yet (a live writer's append in progress); only a writer repairs the files
(``recover_tail``). This module is also where a format-1 .log is parsed for ``kcompact
verify`` and recovery, and where its records become Kafka batches for the Kafka endpoint
(``kafka_batches``: one uncompressed batch encoded on the fly).

(Over 600 lines on purpose: every read of a format-1 segment and the checks that guard it stay
in one file, as they did in the one partition reader.)
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from . import _kernels as K
from . import batch as KB
from . import bcq as B
from .backend import Backend, _oserror
from .columns import RecordColumns, stored_records
from .errors import CorruptRecordError
from .jit import native
from .record import (HEADER, HEADER_SIZE, Record, digest_key_words, encode, field_spans, scan)
from .segment import (CHUNK_ENTRIES, DEFAULT_BLOCK_BYTES, KafkaBatches, Located, RawRange,
                      ReadPlan, Segment, Selection, corrupt, describe_files, read_fully,
                      register_format)
from .segment_desc import SegmentDesc
from .segment_list import crc32c

#: the smallest record is its header + a 1-byte topic
MIN_RECORD = HEADER_SIZE + 1

_N = native()
_verify = _N.verify_records

_EMPTY_ENTRIES = np.zeros(0, dtype=B.BCQ_DTYPE)
_EMPTY_ENTRIES.flags.writeable = False
_HEAD = 24  # a record's size (u32 at 0) and offset (u64 at 16): record.md


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
    k0, k1 = digest_key_words(secret)
    raw = np.ascontiguousarray(entries).view(np.uint8).reshape(-1)
    mode = 2 if guard else 1 if contiguous else 3 if decoded else 0
    return int(_verify(data, int(start), raw, k0, k1, mode))


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


def _head_matches(fd: int, pos: int, size: int, offset: int) -> bool:
    head = os.pread(fd, _HEAD, pos)
    return (len(head) == _HEAD and int.from_bytes(head[0:4], "little") == size
            and int.from_bytes(head[16:24], "little") == offset)


#: the fields ``kcompact verify`` compares between a record and its index entry
_CMP_FIELDS = ("offset", "timestamp", "digest_lo", "digest_hi", "position", "size", "flags")


@register_format(1)
class RecordSegment(Segment):
    """A format-1 segment (see the module docstring).

    (About 600 lines on purpose: it implements the whole ``Segment`` interface for one
    format - plan, read, select, verify, recovery, compaction's questions - and every method
    reads the same records and entries.)"""

    format = 1
    needs_rewrite = True  # a compaction rewrites it into format 2 when it meets it
    sealable = True
    appendable = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._map: np.ndarray | None = None
        self._map_size = -1
        #: the offset of the last record this process appended to this segment, valid while
        #: index_size == _appended_index_size (a writer's cache: no re-mapping of the growing
        #: .bcq to find its last offset before each append)
        self.last_appended: int | None = None
        self._appended_index_size = -1
        #: CRC32C of the first ``bcq_crc_size`` bytes of the .bcq (-1: not known): what a
        #: writer appended, for the list entry it writes when it seals or closes the segment
        self.bcq_crc = 0
        self.bcq_crc_size = -1

    def invalidate(self) -> None:
        super().invalidate()
        self._map = None
        self._map_size = -1
        self.last_appended = None

    @property
    def index_cached(self) -> bool:
        """Whether this segment's index is held in memory (mapped or read) already."""
        return self._index is not None

    # -- index -------------------------------------------------------------------------------

    def index(self) -> B.Index:
        n = self.entry_count
        size = n * B.ENTRY_SIZE
        if self._index is not None and self._index_key == (size, self.log_size):
            return self._index
        if n == 0:
            e = np.zeros(0, dtype=B.BCQ_DTYPE)
        else:
            if self._map is None or self._map_size != size:
                self._map = self.fs.map(self.bcq_path, size)
                self._map_size = size
            e = B.view(self._map)
            last = e[-1]
            if self.open_tail and int(last["position"]) + int(last["size"]) > self.log_size:
                # a writer's append in progress (its .bcq read after its .log was sized); in
                # an exact segment such entries stay, and the reader's check refuses them
                ends = e["position"].astype(np.int64) + e["size"]
                e = e[: int(np.searchsorted(ends, self.log_size, side="right"))]
        if not self.ctx.writable and self.kind == "file" and self.open_tail:
            e = self._index_unindexed_tail(e)
        self._index_key = (size, self.log_size)
        self._index = B.Index(e)
        return self._index

    def entries(self) -> np.ndarray:
        if self.entry_count == 0:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        return self.index().entries

    def _index_unindexed_tail(self, e: np.ndarray) -> np.ndarray:
        """A read-only view indexes, in memory, whole valid records of the .log that its .bcq
        does not list yet: a live writer's append in progress, or a .bcq behind its .log after
        a crash that no writer has repaired. The files are left alone (only a writer repairs)."""
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if self.log_size <= indexed_end:
            return e
        try:
            buf = self.fs.map(self.log_path, self.log_size)
        except FileNotFoundError:
            return e
        s = scan(buf, indexed_end, self.log_size, secret=self.ctx.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        if len(s) == 0 or int(s.offsets[0]) <= last:
            return e
        extra = B.entries_from_scan(s, 0, len(s), 0).copy()
        return np.concatenate([e, extra]) if e.shape[0] else extra

    def index_chunks(self, start_entry: int = 0, buf: np.ndarray | None = None,
                     chunk_entries: int = CHUNK_ENTRIES) -> Iterator[tuple[int, np.ndarray]]:
        """The .bcq streamed in chunks into ``buf`` (one sequential request on an object store;
        memory bounded whatever its size); entries a read-only view indexed in memory from a
        .log tail its .bcq does not list yet come last, from memory."""
        if buf is None or buf.shape[0] < chunk_entries * B.ENTRY_SIZE:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
        idx = self.index()
        n = idx.n
        n_file = min(n, self.entry_count)
        path = self.bcq_path
        expect = self.expected_bcq() if start_entry == 0 and not self.bcq_checked else None
        crc = 0
        if start_entry < n_file:
            try:
                with self.fs.open_read(path, start_entry * B.ENTRY_SIZE) as f:
                    for lo in range(start_entry, n_file, chunk_entries):
                        hi = min(n_file, lo + chunk_entries)
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
            self.bcq_checked = True
        for lo in range(max(start_entry, n_file), n, chunk_entries):
            yield lo, idx.entries[lo:min(n, lo + chunk_entries)]

    @classmethod
    def describe_files(cls, fs: Backend, log_path: str, bcq_path: str, base: int,
                       nxt: int | None, log_size: int, bcq_size: int,
                       chunk_entries: int = 1 << 16) -> SegmentDesc:
        """``segment.describe_files`` of a format-1 segment: its .bcq read once in chunks."""
        if bcq_size % B.ENTRY_SIZE:
            raise CorruptRecordError(f"{bcq_path}: {bcq_size} bytes is not a whole number of "
                                     f"{B.ENTRY_SIZE}-byte entries", bcq_path,
                                     bcq_size - bcq_size % B.ENTRY_SIZE)
        crc, n, first, last = 0, bcq_size // B.ENTRY_SIZE, -1, -1
        if bcq_size:
            with fs.open_read(bcq_path) as f:
                buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
                done = 0
                while done < bcq_size:
                    want = min(buf.shape[0], bcq_size - done)
                    got = read_fully(f, buf[:want])
                    if got != want:
                        raise CorruptRecordError(f"{bcq_path}: shorter than its size while "
                                                 "read", bcq_path, done + got)
                    crc = crc32c(buf[:want], crc)
                    e = buf[:want - want % B.ENTRY_SIZE].view(B.BCQ_DTYPE)
                    if e.shape[0]:
                        if first < 0 and done == 0:
                            first = int(e[0]["offset"])
                        last = int(e[-1]["offset"])
                    done += want
        return SegmentDesc(base, max(last + 1, base) if nxt is None else nxt, n, first, last,
                           log_size, bcq_size, crc)

    def current_desc(self, nxt: int | None) -> SegmentDesc:
        if self.bcq_crc_size == self.index_size:  # the writer knows what it appended
            e = self.index().entries
            if e.shape[0] != self.entry_count:
                raise CorruptRecordError(
                    f"{self.bcq_path}: entries point past the end of the .log; the segment "
                    "cannot be sealed", self.bcq_path, e.shape[0] * B.ENTRY_SIZE)
            first = int(e[0]["offset"]) if e.shape[0] else -1
            last = int(e[-1]["offset"]) if e.shape[0] else -1
            m = SegmentDesc(self.base, 0, e.shape[0], first, last, self.log_size,
                            self.index_size, self.bcq_crc)
        else:
            m = describe_files(self.fs, self.log_path, self.bcq_path, self.base, None)
            self.bcq_crc, self.bcq_crc_size = m.bcq_crc32c, m.bcq_size
        return self._closed(m, nxt)

    def index_bytes(self) -> np.ndarray:
        return np.ascontiguousarray(self.entries()).view(np.uint8)

    # -- reads -------------------------------------------------------------------------------

    def plan(self, from_offset: int, max_records: int | None,
             max_bytes: int | None) -> ReadPlan | None:
        part = self._short_index_read(from_offset, max_records)
        if part is not None:  # the manifest's bitmap placed it: no guard needed
            e, j, whole = part, 0, False
        else:
            idx = self.index()
            e = idx.entries
            # from the first entry when the offset is not past it (what a search of sorted
            # entries returns), so a damaged index further on cannot misplace a read from the
            # segment's start: the records before the damage are still read
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
            return ReadPlan(self, e[j - guard:stop], guard, whole and j == 0,
                            whole and stop == n and not self.open_tail)
        if whole:
            self._check_stepped_over(e, from_offset)
        return None

    def _short_index_read(self, from_offset: int, max_records: int | None) -> np.ndarray | None:
        """Object store: the .bcq entries of a committed segment from the first offset
        >= ``from_offset``, at most ``max_records`` and not past the cache block holding the
        first, read by range (the manifest bitmap's rank is the entry number). None when the
        whole .bcq is the better read: it is local already, no larger than a block, or the
        read wants more entries than a block holds."""
        ent = self.bitmap_desc
        fs = self.fs
        bs = int(getattr(fs, "block_size", 0) or 0)
        if ent is None or self.index_cached or max_records is None \
                or bs <= 0 or max_records * B.ENTRY_SIZE > bs or ent.bcq_size <= bs:
            return None
        path = self.bcq_path
        if fs.has_local_copy(path):
            return None
        j = ent.rank_below(from_offset)
        if j >= ent.records:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        start = j * B.ENTRY_SIZE
        hi = min(ent.records, j + max_records,
                 max(j + 1, (start // bs + 1) * bs // B.ENTRY_SIZE))
        raw = fs.read(path, start, (hi - j) * B.ENTRY_SIZE)
        e = B.view(np.frombuffer(raw, dtype=np.uint8))
        want = ent.offset_at_or_after(from_offset)
        if e.shape[0] != hi - j or int(e[0]["offset"]) != want:
            raise CorruptRecordError(
                f"{path}: entry {j} does not hold offset {want} as the manifest's bitmap says "
                "(or the index is short); run `kcompact verify`", path, start)
        return e

    def _check_stepped_over(self, e: np.ndarray, from_offset: int) -> None:
        """A segment the index search says holds nothing at or after ``from_offset``: its last
        entry's record is verified, and in an exact segment ends where the .log ends (the
        search saw that entry below ``from_offset``, so no record of the .log is at or after
        it). An empty index of an exact segment needs an empty .log."""
        n = e.shape[0]
        if n == 0:
            if not self.open_tail and self.log_size:
                raise corrupt(self.log_path, 0, "the .bcq lists no record of a .log of "
                              f"{self.log_size} bytes", None)
            return
        last = e[n - 1]
        head = np.frombuffer(self.read_log(int(last["position"]), HEADER_SIZE), np.uint8)
        self._check_guard_at(head, last, None, None if self.open_tail else self.log_size)

    def read(self, plan: ReadPlan, max_bytes: int | None) -> RecordColumns:
        sel = plan.entries.copy()
        start = int(sel[0]["position"])
        # the furthest end, not the last entry's: a damaged entry must not shorten the read
        # of the good records before it (their prefix is handed out before the error)
        end = int((sel["position"].astype(np.int64) + sel["size"]).max())
        # max(0, ..): entries damaged out of order must fail the check, not the read
        data = np.frombuffer(self.read_log(start, max(0, end - start)), np.uint8)
        return self._verified(data, start, sel, contiguous=True, guard=plan.guard,
                              at_start=plan.at_start, at_end=plan.at_end)

    def _verified(self, data: np.ndarray, start: int, sel: np.ndarray, *,
                  contiguous: bool = False, guard: int = 0, at_start: bool = False,
                  at_end: bool = False) -> RecordColumns:
        """The block of ``sel[guard:]``'s records in ``data`` (the .log from ``start``),
        verified (module docstring): every record against its entry; with ``contiguous``,
        back to back and in offset order; ``at_start``: the first is at byte 0; ``at_end``:
        the last ends where the .log ends. The guard entry before them (``guard`` = 1) is
        checked, not handed out."""
        ctx = self.ctx
        n = sel.shape[0]
        bad = verify_records(data, start, sel, ctx.secret, contiguous=contiguous,
                             guard=bool(guard))
        what = None
        if bad < 0 and at_start and int(sel[0]["position"]) != 0:
            bad, what = 0, "the first .bcq entry does not point at the start of the .log"
        if bad < 0 and at_end and start + data.shape[0] != self.log_size:
            bad = n
            what = (f"records after the last .bcq entry (the .log holds {self.log_size} bytes, "
                    f"its last entry ends at byte {start + data.shape[0]})")
        if guard:
            if bad == 0:
                g = sel[0]
                raise corrupt(self.log_path, int(g["position"]), (
                    f"the .bcq entry for offset {int(g['offset'])} does not match the record "
                    "at its position, or is not next to the records after it, so the read "
                    "cannot tell what lies between them"), None)
            gsize = int(sel[0]["size"])  # (verified: the records follow it)
            data, start, sel, n = data[gsize:], start + gsize, sel[1:], n - 1
            bad = bad - 1 if bad > 0 else bad
        rel = sel["position"].astype(np.int64) - start
        if bad < 0:
            return RecordColumns(ctx.topic, ctx.partition, data, sel, rel,
                                 int(sel[-1]["offset"]) + 1)
        prefix = None
        if bad > 0:
            prefix = RecordColumns(ctx.topic, ctx.partition, data, sel[:bad], rel[:bad],
                                   int(sel[bad - 1]["offset"]) + 1)
        if what is None:
            what = ("bytes after the last record" if bad >= n else
                    mismatch(data, start, sel[bad], ctx.secret))
        if bad < n:
            pos = int(sel[bad]["position"])
        else:
            pos = start + data.shape[0] if at_end else \
                int(sel[-1]["position"]) + int(sel[-1]["size"])
        last_good = int(sel[bad - 1]["offset"]) if bad > 0 else None
        raise corrupt(self.log_path, pos, what, last_good, prefix)

    def _check_guard_at(self, head: np.ndarray, g, next_pos: int | None,
                        log_end: int | None = None) -> int:
        """The guard (module docstring): the record at entry ``g``'s position (``head``: its
        first HEADER_SIZE bytes, fewer where the .log ends) has the entry's size and offset in
        a valid header, lies inside the .log, and ends at ``next_pos`` (the first record
        handed out) or at ``log_end``. Its body is not checked: it is not handed out, and a
        damaged body cannot make the index search step over a record. Returns its size;
        raises CorruptRecordError."""
        pos, size = int(g["position"]), int(g["size"])
        ok = size >= MIN_RECORD and head.shape[0] >= HEADER_SIZE and pos + size <= self.log_size
        if ok:
            (rsize, _crc, magic, _a, _tl, resv, _part, off, *_rest) = HEADER.unpack_from(
                memoryview(np.ascontiguousarray(head[:HEADER_SIZE])), 0)
            ok = rsize == size and magic == 1 and resv == 0 and off == int(g["offset"])
        if ok and next_pos is not None:
            ok = pos + size == next_pos
        if ok and log_end is not None:
            ok = pos + size == log_end
        if not ok:
            raise corrupt(self.log_path, pos, (
                f"the .bcq entry for offset {int(g['offset'])} does not match the record at "
                "its position, or is not next to the records after it, so the read cannot "
                "tell what lies between them"), None)
        return size

    def read_raw(self, plan: ReadPlan, max_bytes: int | None, pool) -> RawRange:
        sel, guard = plan.entries, plan.guard
        self._check_guard(sel, guard, plan.at_start)
        sel = sel[guard:]
        start = int(sel[0]["position"])
        nbytes = max(0, int(sel[-1]["position"]) + int(sel[-1]["size"]) - start)
        buf = pool.take(nbytes) if pool is not None else np.empty(nbytes, np.uint8)
        try:
            got = self.fs.read_into(self.log_path, start, buf[:nbytes])
            self._verified(buf[:got], start, sel, contiguous=True, at_end=plan.at_end)
        except BaseException:
            if pool is not None:
                pool.give(buf)
            raise
        return RawRange(buf, nbytes, sel.copy(), int(sel[-1]["offset"]) + 1)

    def _check_guard(self, sel: np.ndarray, guard: int, at_start: bool) -> None:
        """A raw range's guard (module docstring), read on its own: verified, and ending where
        the range begins; or, from the first entry, the range beginning at byte 0."""
        if at_start and int(sel[0]["position"]) != 0:
            raise corrupt(self.log_path, int(sel[0]["position"]),
                          "the first .bcq entry does not point at the start of the .log", None)
        if not guard:
            return
        g = sel[0]
        head = np.frombuffer(self.read_log(int(g["position"]), HEADER_SIZE), np.uint8)
        self._check_guard_at(head, g, int(sel[1]["position"]))

    def locate(self, plan: ReadPlan, max_bytes: int | None) -> Located:
        e, guard, at_start, at_end = plan.entries, plan.guard, plan.at_start, plan.at_end
        first = int(e[guard]["position"])
        nbytes = int(e[-1]["position"]) + int(e[-1]["size"]) - first
        rel = self.log_path
        fd = os.open(self.fs.local_path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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

    def selection(self, sequential: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                  buffer: np.ndarray | None = None) -> "RecordSelection":
        return RecordSelection(self, sequential, block_bytes, buffer)

    def kafka_batches(self, from_offset: int, max_bytes: int) -> KafkaBatches | None:
        """Its verified records from ``from_offset`` (a read: the first whole even past
        ``max_bytes``) encoded as one uncompressed Kafka batch (more when their offsets span
        over 2^31: a batch's lastOffsetDelta is an int32)."""
        plan = self.plan(from_offset, None, max(1, max_bytes))
        if plan is None:
            return None
        block = self.read(plan, max(1, max_bytes))
        if len(block) == 0:
            return None
        data, rel, _sizes, _ent = stored_records(block)
        offs = block.offsets.astype(np.int64)
        ts = block.timestamps.astype(np.int64)
        parts, total, lo, n = [], 0, 0, offs.shape[0]
        while lo < n:
            hi = int(np.searchsorted(offs, int(offs[lo]) + 0x7FFFFFFF, side="right"))
            eb = KB.encode_batch(data, rel, lo, hi, offs, ts, KB.CODEC_NONE, 0)
            parts.append(eb.data)
            total += len(eb.data)
            lo = hi
        return KafkaBatches(parts, total, int(offs[-1]) + 1)

    # -- compaction, recovery ---------------------------------------------------------------

    def kept_bytes(self, chunk: np.ndarray, keep: np.ndarray, kept: int) -> int:
        return int(chunk["size"][keep].sum())

    def write_index(self, entries: Iterator[np.ndarray], fs: Backend, path: str,
                    spill_dir: str | None) -> int:
        written = 0
        idxf = fs.open_append(path)
        try:
            for ent in entries:
                idxf.write(np.ascontiguousarray(ent).view(np.uint8))
                written += ent.nbytes
            idxf.sync()
        finally:
            idxf.close()
        return written

    def check_sealed(self, next_base: int) -> None:
        """Read only the index: entries back to back from byte 0 to the end of the .log,
        offsets increasing inside the segment's range."""
        problem = index_structure_problem(self.entries(), self.base, next_base,
                                          self.log_size, self.index_size)
        if problem is not None:
            raise CorruptRecordError(f"{self.bcq_path}: {problem}; this sealed segment is not "
                                     "repaired on open: run `kcompact verify` and rebuild the "
                                     "partition from a replica", self.bcq_path, 0)

    def recover_tail(self) -> tuple[int, int]:
        """A .bcq behind its .log (rebuilt from the .log: the records there are indexed),
        entries past the end of the .log (dropped), a torn .log tail (cut: reput re-dispatches
        it from the commit log, whose checkpoint is behind it); a missing .bcq (a writer from
        before the .bcq was created first, killed between the two) starts empty."""
        fs, ip = self.fs, self.bcq_path
        recovered = truncated = 0
        if not fs.exists(ip):
            f = fs.open_append(ip)
            f.sync()
            f.close()
            fs.sync_dir(ip.rsplit("/", 1)[0])
            self.index_size = 0
            self.invalidate()
        n = self.entry_count
        if self.index_size != n * B.ENTRY_SIZE:
            self._truncate(ip, n * B.ENTRY_SIZE)
            self.index_size = n * B.ENTRY_SIZE
        e = self.entries()
        if e.shape[0] != n:  # entries point past the end of the .log
            self._truncate(ip, e.shape[0] * B.ENTRY_SIZE)
            self.index_size = e.shape[0] * B.ENTRY_SIZE
            self.invalidate()
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if self.log_size <= indexed_end:
            return 0, 0
        buf = fs.map(self.log_path, self.log_size)
        s = scan(buf, indexed_end, self.log_size, secret=self.ctx.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        # offsets only grow: a record at or below the last indexed one is not ours to index
        good = len(s) if len(s) == 0 or int(s.offsets[0]) > last else 0
        if good:
            entries = B.entries_from_scan(s, 0, good, 0)
            f = fs.open_append(ip)
            f.write(entries.tobytes())
            f.sync()
            f.close()
            self.index_size += good * B.ENTRY_SIZE
            self.invalidate()
            recovered = good
        stop = int(s.positions[good - 1] + s.sizes[good - 1]) if good else indexed_end
        del buf
        if stop < self.log_size:
            truncated = self.log_size - stop
            self._truncate(self.log_path, stop)
            self.log_size = stop
        return recovered, truncated

    def _truncate(self, path: str, size: int) -> None:
        f = self.fs.open_append(path)
        f.truncate(size)
        f.sync()
        f.close()

    # -- verify ------------------------------------------------------------------------------

    def verify(self, secret: bytes, problem, prev_last: int, next_base: int | None
               ) -> tuple[int, int]:
        """Every record's CRC, every .bcq entry, offset order, the catalog entry; resyncing on
        the next index entry after a bad record (LevelDB's log reader). Bytes past the last
        entry of an open segment that form a torn record are an append in progress."""
        is_active = self.open_tail
        log_path, idx_path, fs = self.log_path, self.bcq_path, self.fs
        records = 0
        if self.index_size % B.ENTRY_SIZE:
            problem(idx_path, self.index_size - self.index_size % B.ENTRY_SIZE,
                    "partial index entry at the end of the .bcq")
        try:
            raw = fs.map(idx_path, self.entry_count * B.ENTRY_SIZE) if self.entry_count else \
                np.zeros(0, np.uint8)
            buf = fs.map(log_path, self.log_size) if self.log_size else np.zeros(0, np.uint8)
        except FileNotFoundError as e:
            problem(e.filename or log_path, 0, "listed by the partition manifest but missing "
                    "from the store")
            return records, prev_last
        idx = B.view(raw)
        desc = self.desc
        if self.bitmap_desc is not None:
            self._check_manifest_entry(idx, buf, problem)
        elif desc is not None and not desc.open:
            self._check_list_entry(raw, idx, problem)
        end = desc.next if desc is not None and desc.next is not None else next_base
        pos = 0
        i = 0  # next index entry expected
        log_size = min(self.log_size, int(buf.shape[0]))
        while pos < log_size:
            s = scan(buf, pos, log_size, secret=secret, verify_crc=True)
            n = len(s)
            records += n
            if n:
                exp = B.entries_from_scan(s, 0, n, 0)
                got = idx[i:i + n]
                m = min(n, got.shape[0])
                bad = np.zeros(m, dtype=bool)
                for f in _CMP_FIELDS:
                    bad |= exp[f][:m] != got[f][:m]
                for j in np.nonzero(bad)[0][:20]:
                    problem(idx_path, int(i + j) * B.ENTRY_SIZE,
                            f"index entry {int(i + j)} does not match the record at byte "
                            f"{int(exp[j]['position'])} of the .log (rebuild the .bcq)")
                if got.shape[0] < n and not is_active:
                    problem(idx_path, got.shape[0] * B.ENTRY_SIZE,
                            f"{n - got.shape[0]} records of the .log have no index entry")
                offs = s.offsets[:n]
                if offs[0] <= prev_last or np.any(np.diff(offs) <= 0):
                    problem(log_path, int(s.positions[0]), "offsets do not strictly increase")
                if offs[0] < self.base or (not is_active and end is not None
                                           and offs[-1] >= end):
                    problem(log_path, int(s.positions[0]), "offsets outside the segment's range")
                prev_last = int(offs[-1])
                i += n
            if s.status == K.SCAN_OK:
                break
            stop = int(s.stop)
            indexed_end = (int(idx[-1]["position"]) + int(idx[-1]["size"])) if idx.shape[0] else 0
            if s.status == K.SCAN_TORN and is_active and stop >= indexed_end:
                break  # an append in progress (or a torn tail the writer will cut on open)
            problem(log_path, stop, "corrupt record (CRC or header check failed)"
                    if s.status == K.SCAN_CORRUPT else "record runs past the end of the segment")
            # resynchronise on the next index entry after the bad record
            later = np.nonzero(idx["position"].astype(np.int64) > stop)[0]
            if later.size == 0:
                break
            i = int(later[0])
            pos = int(idx[i]["position"])
        if i < idx.shape[0]:
            problem(idx_path, i * B.ENTRY_SIZE, f"{idx.shape[0] - i} index entries point past "
                    "the last valid record of the .log")
        del buf, raw
        return records, prev_last

    def _check_list_entry(self, raw: np.ndarray, idx: np.ndarray, problem) -> None:
        """A local segment's segment-list entry (docs/formats/segment-list.md) against its .bcq
        (its size was compared when the partition was opened)."""
        m, idx_path = self.desc, self.bcq_path
        if m.format != 1:
            problem(idx_path, 0, f"the segment list says format {m.format}, the .bcq is not a "
                    "lean index")
            return
        if raw.shape[0] == m.bcq_size and crc32c(raw) != m.bcq_crc32c:
            problem(idx_path, 0, f"the .bcq does not match its checksum in the segment list "
                    f"(crc32c {crc32c(raw):08x}, listed {m.bcq_crc32c:08x})")
            return
        if idx.shape[0] == m.records and m.records and (
                int(idx[0]["offset"]), int(idx[-1]["offset"])) != (m.first_offset,
                                                                   m.last_offset):
            problem(idx_path, 0, "the segment list's first/last offsets do not match the .bcq")

    def _check_manifest_entry(self, idx: np.ndarray, buf: np.ndarray, problem) -> None:
        """An S3 segment's manifest entry (docs/formats/manifest.md) against its objects."""
        e, log_path, idx_path = self.bitmap_desc, self.log_path, self.bcq_path
        if buf.shape[0] != e.log_size:
            problem(log_path, int(buf.shape[0]), f"the .log object holds {buf.shape[0]} "
                    f"bytes, the manifest says {e.log_size}")
        if idx.shape[0] != e.records:
            problem(idx_path, int(idx.shape[0]) * B.ENTRY_SIZE, f"the .bcq holds "
                    f"{idx.shape[0]} entries, the manifest says {e.records} records")
            return
        if e.records and not np.array_equal(idx["offset"], e.offset_array()):
            problem(idx_path, 0, "the manifest's offset bitmap does not match the .bcq's offsets")
        elif e.records and (int(idx[0]["offset"]), int(idx[-1]["offset"])) != (e.first_offset,
                                                                               e.last_offset):
            problem(idx_path, 0, "the manifest's first/last offsets do not match the .bcq")


class RecordSelection(Selection):
    """Chosen records of a format-1 segment: spans of at most ``block_bytes`` (or one record),
    each record checked against its entry."""

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
            yield self.seg._verified(data, start, entries[i:j])
            i = j


def index_structure_problem(e: np.ndarray, base: int, next_base: int | None, log_size: int,
                            index_size: int) -> str | None:
    """What is wrong with a sealed segment's index read on its own (None: nothing): a partial
    entry, entries not back to back from byte 0 to the end of the .log, offsets not strictly
    increasing inside [base, next_base)."""
    if index_size % B.ENTRY_SIZE:
        return f"a partial entry at the end of the .bcq ({index_size} bytes)"
    n = e.shape[0]
    if n == 0:
        return None if log_size == 0 else f"no entries for a .log of {log_size} bytes"
    pos = e["position"].astype(np.int64)
    ends = pos + e["size"]
    bad = np.nonzero(pos[1:] != ends[:-1])[0]
    if int(pos[0]) != 0 or bad.size:
        i = 0 if int(pos[0]) != 0 else int(bad[0]) + 1
        return f"entry {i} does not start where the record before it ends"
    if int(ends[-1]) != log_size:
        return (f"its entries end at byte {int(ends[-1])} of a .log of {log_size} bytes")
    off = e["offset"]
    down = np.nonzero(off[1:] <= off[:-1])[0]
    if down.size:
        return f"entry {int(down[0]) + 1}'s offset does not follow the one before it"
    if int(off[0]) < base or (next_base is not None and int(off[-1]) >= next_base):
        return (f"offsets {int(off[0])}..{int(off[-1])} outside the segment's range "
                f"[{base}, {next_base if next_base is not None else ''})")
    return None


def warm_up() -> None:
    """Load the kernels a read runs (numba's cache, when the C module was not built)."""
    raw = np.frombuffer(encode([Record("t", 0, 5, 0, b"k", b"v")]), np.uint8)
    e = np.zeros(1, dtype=B.BCQ_DTYPE)
    e["offset"], e["size"] = 5, raw.shape[0]
    verify_records(raw, 0, e, bytes(16), contiguous=True)
    field_spans(raw, np.zeros(1, np.int64))


__all__ = ["MIN_RECORD", "RecordSegment", "RecordSelection", "index_structure_problem",
           "mismatch", "verify_records", "warm_up"]
