"""A topic-partition's compaction log: .log data segments, each with its .bcq index.

Spec: docs/formats/bcq.md (index) and docs/formats/record.md (data). Segments are named by the
20-digit base offset (the first offset the segment may hold); each holds the offsets from its
base up to the next segment's base. Records are appended byte for byte as reput found them in
the commit log: first the .log bytes, then the .bcq entries, so an entry never points past its
data. Opening for write recovers: a .bcq behind its .log is rebuilt from the .log, entries past
the end of the .log are dropped, and a torn .log tail is cut (reput re-dispatches it from the
commit log, whose checkpoint is behind it). Reads check every record's CRC and never serve a
record that fails it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import _kernels as K
from . import bcq as B
from . import filenames as fn
from .backend import AppendFile, Backend, _oserror
from .config import TopicConfig
from .errors import CorruptRecordError
from .locks import FileLock
from .record import Record, Scan, decode_one, scan
from .swap import empty_trash, recover_swap


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


@dataclass
class Segment:
    base: int
    log_size: int
    index_size: int
    _map: np.ndarray | None = None
    _map_size: int = -1
    _index: "B.Index | None" = None
    _index_log_size: int = -1

    def invalidate(self) -> None:
        self._map = None
        self._index = None
        self._map_size = -1

    @property
    def entry_count(self) -> int:
        return self.index_size // B.ENTRY_SIZE


@dataclass
class ReadResult:
    """Records read from one partition: their bytes, their index entries, and where to go next.

    ``entries['position']`` is relative to ``data`` (the records are contiguous in it).
    """

    data: bytes
    entries: np.ndarray
    next_offset: int

    def records(self, topic_hint: str = "") -> Iterator[Record]:
        for pos in self.entries["position"]:
            yield decode_one(self.data, int(pos), verify_crc=False, where=topic_hint)


class PartitionLog:
    def __init__(self, fs: Backend, topic: str, partition: int, secret: bytes,
                 config: TopicConfig = TopicConfig(), *, writable: bool = False,
                 sub: str | None = None):
        self.fs, self.topic, self.partition, self.secret = fs, topic, partition, secret
        self.config = config
        self.sub = sub
        self.dir = fn.partition_dir(topic, partition) + (f"/{sub}" if sub else "")
        self.writable = writable
        self.segments: list[Segment] = []
        self._log: AppendFile | None = None
        self._idx: AppendFile | None = None
        self._dirty_files: list[AppendFile] = []
        self.recovered_entries = 0
        self.truncated_bytes = 0
        self._entry_scratch = np.empty(0, np.uint8)
        self.swap_recovered = False
        self._writer_lock: FileLock | None = None
        if writable:
            self._writer_lock = FileLock(fs, f"{self.dir}/{fn.LOCK_FILE}")
            if not self._writer_lock.acquire(blocking=False):
                self._writer_lock = None
                from .errors import StoreLockedError
                raise StoreLockedError(f"{self.dir} is being written by another process; one "
                                       "writer per partition at a time")
        if not writable:
            self._finish_committed_swap()
        self._load()
        if writable:
            self.recover()

    # -- paths ---------------------------------------------------------------------------

    def log_path(self, base: int) -> str:
        return f"{self.dir}/{fn.base_name(base)}{fn.LOG_SUFFIX}"

    def index_path(self, base: int) -> str:
        return f"{self.dir}/{fn.base_name(base)}{fn.INDEX_SUFFIX}"

    # -- load / refresh ------------------------------------------------------------------

    def _load(self) -> None:
        logs, idxs = set(), set()
        for name in self.fs.listdir(self.dir):
            parsed = fn.parse_base(name)
            if parsed:
                (logs if parsed[1] == "log" else idxs).add(parsed[0])
        segs = []
        old = {s.base: s for s in self.segments}
        for base in sorted(logs):
            try:
                ls = self.fs.size(self.log_path(base))
            except FileNotFoundError:
                continue  # replaced under us by a compaction swap; the next refresh sees it
            try:
                isz = self.fs.size(self.index_path(base)) if base in idxs else 0
            except FileNotFoundError:
                isz = 0
            seg = old.get(base) or Segment(base, ls, isz)
            if seg.log_size != ls or seg.index_size != isz:
                seg.log_size, seg.index_size = ls, isz
            segs.append(seg)
        self.segments = segs
        self._orphan_indexes = sorted(idxs - logs)

    def refresh(self) -> None:
        """Pick up what other processes appended or compacted since this object looked."""
        if not self.writable:
            self._finish_committed_swap()
            self._load()

    def _finish_committed_swap(self) -> None:
        """A compaction that died after its commit point leaves swap.json behind; until someone
        applies it the .log/.bcq pairs may not match. Any reader may finish it (the apply is
        idempotent and never touches the active segment) unless a live compactor holds the
        lock, in which case it is applying right now and the read retry covers it."""
        from .swap import PLAN_NAME, staging_dir
        if not self.fs.exists(f"{staging_dir(self.dir)}/{PLAN_NAME}"):
            return
        lock = FileLock(self.fs, f"{self.dir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                recover_swap(self.fs, self.dir)
                for seg in self.segments:
                    seg.invalidate()
            finally:
                lock.release()

    def reload_after_swap(self) -> None:
        """Re-list segments after a compaction swap, keeping the active segment's open files."""
        active = self.segments[-1] if self.segments else None
        for seg in self.segments:
            if seg is not active:
                seg.invalidate()
        keep_log, keep_idx = self._log, self._idx
        self._load()
        if active is not None and (not self.segments or self.segments[-1].base != active.base):
            # the active segment was replaced (a forced compaction of an idle partition)
            self._close_files()
            keep_log = keep_idx = None
        self._log, self._idx = keep_log, keep_idx

    # -- index access --------------------------------------------------------------------

    def entries(self, seg: Segment) -> np.ndarray:
        """The valid index entries of a segment (those whose record lies inside its .log)."""
        n = seg.entry_count
        if n == 0:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        return self.index(seg).entries

    def _index_unindexed_tail(self, seg: Segment, e: np.ndarray) -> np.ndarray:
        """A read-only view indexes, in memory, whole valid records of the .log that its .bcq
        does not list yet: a live writer's append in progress, or a .bcq behind its .log after
        a crash that no writer has repaired. The files are left alone (only a writer repairs)."""
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if seg.log_size <= indexed_end:
            return e
        try:
            buf = self.fs.map(self.log_path(seg.base), seg.log_size)
        except FileNotFoundError:
            return e
        s = scan(buf, indexed_end, seg.log_size, secret=self.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        if len(s) == 0 or int(s.offsets[0]) <= last:
            return e
        extra = B.entries_from_scan(s, 0, len(s), 0).copy()
        return np.concatenate([e, extra]) if e.shape[0] else extra

    def index(self, seg: Segment) -> B.Index:
        """The segment's valid entries with their search view, cached until the files change."""
        n = seg.entry_count
        size = n * B.ENTRY_SIZE
        if seg._index is not None and seg._map_size == size and seg._index_log_size == seg.log_size:
            return seg._index
        if n == 0:
            e = np.zeros(0, dtype=B.BCQ_DTYPE)
        else:
            if seg._map is None or seg._map_size != size:
                seg._map = self.fs.map(self.index_path(seg.base), size)
            e = B.view(seg._map)
            last = e[-1]
            if int(last["position"]) + int(last["size"]) > seg.log_size:
                ends = e["position"].astype(np.int64) + e["size"]
                e = e[: int(np.searchsorted(ends, seg.log_size, side="right"))]
        if not self.writable:
            e = self._index_unindexed_tail(seg, e)
        seg._map_size = size
        seg._index_log_size = seg.log_size
        seg._index = B.Index(e)
        return seg._index

    def index_chunks(self, seg: Segment, start_entry: int = 0, chunk_entries: int = 1 << 15,
                     buf: np.ndarray | None = None):
        """Yield (first entry number, entries) of a segment's valid .bcq entries in bounded
        chunks read into ``buf`` (reused: valid until the next chunk). Unlike ``entries``,
        this keeps memory bounded whatever the index size (no mapping of the whole file), and
        it reads the .bcq as one sequential stream (one request on an object store)."""
        idx = self.index(seg)
        n = idx.n
        # entries a read-only view indexed in memory from the .log tail are not in the file
        n_file = min(n, seg.entry_count)
        path = self.index_path(seg.base)
        if buf is None or buf.shape[0] < chunk_entries * B.ENTRY_SIZE:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
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
                        yield lo, buf[:want].view(B.BCQ_DTYPE)
            except FileNotFoundError:
                raise
            except OSError as e:  # the stream's reads raise raw OSError: say which file
                raise _oserror(e, "read", path) from e
        for lo in range(max(start_entry, n_file), n, chunk_entries):
            yield lo, idx.entries[lo:min(n, lo + chunk_entries)]

    @property
    def first_offset(self) -> int:
        for seg in self.segments:
            e = self.entries(seg)
            if e.shape[0]:
                return int(e[0]["offset"])
        return self.next_offset

    @property
    def last_offset(self) -> int:
        """Offset of the last indexed record, -1 when there is none."""
        for seg in reversed(self.segments):
            e = self.entries(seg)
            if e.shape[0]:
                return int(e[-1]["offset"])
        return -1

    @property
    def next_offset(self) -> int:
        base = self.segments[-1].base if self.segments else 0
        return max(self.last_offset + 1, base)

    def record_count(self) -> int:
        return sum(len(self.entries(s)) for s in self.segments)

    def size_bytes(self) -> int:
        return sum(s.log_size for s in self.segments)

    def segment_for(self, offset: int) -> int:
        """Index of the segment whose range holds ``offset`` (0 if before the first)."""
        bases = [s.base for s in self.segments]
        return max(0, bisect.bisect_right(bases, offset) - 1)

    # -- recovery ------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish or roll back an interrupted compaction swap, then make every .bcq match its
        .log (see module docstring). Writer-only. A swap that a live compactor (another
        process holding the partition's compaction lock) is running is left alone."""
        lock = FileLock(self.fs, f"{self.dir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                if recover_swap(self.fs, self.dir):
                    self.swap_recovered = True
                    for seg in self.segments:
                        seg.invalidate()
                    self._load()
                empty_trash(self.fs, self.dir)
            finally:
                lock.release()
        for base in self._orphan_indexes:
            self.fs.delete(self.index_path(base))
        self._orphan_indexes = []
        for name in self.fs.listdir(self.dir):
            if name.endswith(fn.TMP_SUFFIX):
                self.fs.delete(f"{self.dir}/{name}")
        for seg in self.segments:
            self._recover_segment(seg)

    def _recover_segment(self, seg: Segment) -> None:
        n = seg.entry_count
        if seg.index_size != n * B.ENTRY_SIZE:
            self._truncate(self.index_path(seg.base), n * B.ENTRY_SIZE)
            seg.index_size = n * B.ENTRY_SIZE
        e = self.entries(seg)
        if e.shape[0] != n:  # entries point past the end of the .log
            self._truncate(self.index_path(seg.base), e.shape[0] * B.ENTRY_SIZE)
            seg.index_size = e.shape[0] * B.ENTRY_SIZE
            seg.invalidate()
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if seg.log_size <= indexed_end:
            return
        buf = self.fs.map(self.log_path(seg.base), seg.log_size)
        s = scan(buf, indexed_end, seg.log_size, secret=self.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        # offsets only grow: a record at or below the last indexed one is not ours to index
        good = len(s) if len(s) == 0 or int(s.offsets[0]) > last else 0
        if good:
            entries = B.entries_from_scan(s, 0, good, 0)
            f = self.fs.open_append(self.index_path(seg.base))
            f.write(entries.tobytes())
            f.sync()
            f.close()
            seg.index_size += good * B.ENTRY_SIZE
            seg.invalidate()
            self.recovered_entries += good
        stop = int(s.positions[good - 1] + s.sizes[good - 1]) if good else indexed_end
        del buf
        if stop < seg.log_size:
            self.truncated_bytes += seg.log_size - stop
            self._truncate(self.log_path(seg.base), stop)
            seg.log_size = stop

    def _truncate(self, path: str, size: int) -> None:
        f = self.fs.open_append(path)
        f.truncate(size)
        f.sync()
        f.close()

    # -- append (writer) -----------------------------------------------------------------

    def _active_files(self) -> tuple[Segment, AppendFile, AppendFile]:
        seg = self.segments[-1]
        if self._log is None:
            self._log = self.fs.open_append(self.log_path(seg.base))
            self._idx = self.fs.open_append(self.index_path(seg.base))
            self._dirty_files += [self._log, self._idx]
        return seg, self._log, self._idx

    def roll(self, base: int | None = None) -> None:
        """Seal the active segment and start an empty one at ``base`` (default: next offset)."""
        base = self.next_offset if base is None else base
        if self.segments and self.segments[-1].base == base:
            return
        if self.segments and self.segments[-1].log_size == 0:
            # an empty active segment is renamed forward rather than left behind
            self._close_files()
            old = self.segments.pop()
            self.fs.delete(self.log_path(old.base))
            self.fs.delete(self.index_path(old.base))
        self._close_files()
        self.segments.append(Segment(base, 0, 0))
        self._active_files()

    def _close_files(self) -> None:
        if self._log is not None:
            self._log = self._idx = None  # kept in _dirty_files until the next sync

    def append(self, src: np.ndarray, s: Scan, lo: int, hi: int) -> int:
        """Append records lo..hi-1 of scan ``s`` (their bytes are in ``src``, contiguous).

        Records at or below the last stored offset are skipped (idempotent re-dispatch).
        Returns how many were appended.
        """
        assert self.writable
        last = self.last_offset
        if hi > lo and s.offsets[lo] <= last:
            lo += int(np.searchsorted(s.offsets[lo:hi], last, side="right"))
        appended = 0
        limit = self.config.segment_bytes
        scratch = self._entry_scratch
        while lo < hi:
            if not self.segments:
                self.segments.append(Segment(int(s.offsets[lo]), 0, 0))
            seg, logf, idxf = self._active_files()
            start_byte = int(s.positions[lo])
            ends = s.positions[lo:hi] + s.sizes[lo:hi] - start_byte
            k = int(np.searchsorted(ends, limit - seg.log_size, side="right"))
            if k == 0:
                if seg.log_size > 0:
                    self.roll(int(s.offsets[lo]))
                    continue
                k = 1
            end_byte = start_byte + int(ends[k - 1])
            if scratch.shape[0] < k * B.ENTRY_SIZE:
                scratch = self._entry_scratch = np.empty(k * B.ENTRY_SIZE, np.uint8)
            entries = B.entries_from_scan(s, lo, lo + k, seg.log_size - start_byte, scratch)
            logf.write(src[start_byte:end_byte])
            idxf.write(entries.view(np.uint8))
            seg.log_size = logf.size
            seg.index_size = idxf.size
            appended += k
            lo += k
        return appended

    def sync(self) -> None:
        """fsync what was appended since the last sync; close sealed segments' files."""
        active = [f for f in (self._log, self._idx) if f is not None]
        for f in self._dirty_files:
            f.sync()
            if f not in active:
                f.close()
        self._dirty_files = active

    def close(self) -> None:
        self.sync()
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []
        for seg in self.segments:
            seg.invalidate()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    # -- read ----------------------------------------------------------------------------

    def read(self, from_offset: int, max_records: int | None = None,
             max_bytes: int | None = None) -> ReadResult:
        """Records with offset >= from_offset, in offset order, from one segment at most.

        A missing offset continues at the next existing one. At least one record is returned
        when any exists, even if it is larger than ``max_bytes``. Every record's CRC is checked.
        A read-only reader that meets a .log/.bcq mismatch re-lists and retries, because a
        compaction swap in another process replaces the two files one after the other
        (docs/formats/compaction-swap.md); a mismatch that persists is corruption.
        """
        if max_records is not None and max_records <= 0:
            return ReadResult(b"", np.zeros(0, dtype=B.BCQ_DTYPE), from_offset)
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        attempts = 1 if self.writable else 4
        for attempt in range(attempts):
            try:
                return self._read_once(from_offset, max_records, max_bytes)
            except (CorruptRecordError, FileNotFoundError):
                if attempt == attempts - 1:
                    raise
                time.sleep(0.02 * (attempt + 1))
                for seg in self.segments:
                    seg.invalidate()
                self._load()
        raise AssertionError("unreachable")

    def _read_once(self, from_offset: int, max_records: int | None,
                   max_bytes: int | None) -> ReadResult:
        i = self.segment_for(from_offset)
        while i < len(self.segments):
            seg = self.segments[i]
            idx = self.index(seg)
            e = idx.entries
            j = int(idx.lower_bound(from_offset))
            if j < e.shape[0]:
                stop = e.shape[0] if max_records is None else min(e.shape[0], j + max_records)
                if max_bytes is not None:
                    ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] \
                        - int(e[j]["position"])
                    stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
                sel = e[j:stop].copy()
                start = int(sel[0]["position"])
                end = int(sel[-1]["position"]) + int(sel[-1]["size"])
                # max(0, ..): entries damaged out of order must fail the check below, not the read
                data = self.fs.read(self.log_path(seg.base), start, max(0, end - start))
                sel["position"] -= start
                self._check(data, sel, seg, start)
                return ReadResult(data, sel, int(sel[-1]["offset"]) + 1)
            i += 1
        return ReadResult(b"", np.zeros(0, dtype=B.BCQ_DTYPE), max(from_offset, self.next_offset))

    def _check(self, data: bytes, sel: np.ndarray, seg: Segment, file_start: int) -> None:
        buf = np.frombuffer(data, dtype=np.uint8)
        s = scan(buf, 0, len(buf), verify_crc=True)
        ok = (len(s) == sel.shape[0] and s.status == K.SCAN_OK
              and np.array_equal(s.offsets, sel["offset"])
              and np.array_equal(s.positions, sel["position"].astype(np.int64))
              and np.array_equal(s.sizes, sel["size"].astype(np.int64)))
        if not ok:
            bad = int(s.stop) if s.status != K.SCAN_OK else self._first_mismatch(s, sel)
            raise CorruptRecordError(
                f"{self.log_path(seg.base)}: corrupt record at byte {file_start + bad} "
                "(CRC or header check failed, or the .bcq does not match the .log); run "
                "`kcompact verify` and rebuild this partition from a replica",
                self.log_path(seg.base), file_start + bad)

    @staticmethod
    def _first_mismatch(s: Scan, sel: np.ndarray) -> int:
        n = min(len(s), sel.shape[0])
        diff = np.nonzero((s.offsets[:n] != sel["offset"][:n])
                          | (s.positions[:n] != sel["position"][:n].astype(np.int64))
                          | (s.sizes[:n] != sel["size"][:n].astype(np.int64)))[0]
        return int(sel[diff[0]]["position"]) if diff.size else int(s.stop)

    def iter_records(self, from_offset: int = 0, limit: int | None = None,
                     batch_bytes: int = 4 << 20) -> Iterator[Record]:
        """Decoded records from ``from_offset`` (for dump, restore and tests)."""
        off = from_offset
        n = 0
        while limit is None or n < limit:
            r = self.read(off, max_records=None if limit is None else limit - n,
                          max_bytes=batch_bytes)
            if r.entries.shape[0] == 0:
                return
            for rec in r.records(self.log_path(0)):
                yield rec
                n += 1
            off = r.next_offset
