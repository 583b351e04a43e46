"""The master's record reader for the wire: one range of a segment into a reusable buffer.

Same contract as ``PartitionLog.read`` (records with offset >= ``from_offset`` from one segment,
at least one record when any exists, retried across a compaction swap), but cheaper per byte,
because it only has to prove that the bytes are whole, valid records that match the index:

* the range is read into a buffer from a small pool (``Backend.read_into``: no fresh allocation,
  so no page fault per 4 KiB on every request);
* ``count_records`` walks the records checking every header and CRC32C (hardware CRC); then the
  index entries must be contiguous and cover exactly those bytes, and each record's offset and
  size (read at the entry's position) must be the entry's. No key digests are computed: the
  replica computes its own with its own secret.

A ``.log``/``.bcq`` pair caught mid-swap fails these checks; the reader re-lists the partition
and retries, and raises ``CorruptRecordError`` (file and byte) only if the mismatch persists.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from kcompact.reput._jit import njit

from kcompact.reput import _kernels as K
from kcompact.reput._intrinsics import load_u32, load_u64
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.partition import PartitionLog

#: the smallest record is its 44-byte header + a 1-byte topic
MIN_RECORD = K.HEADER_SIZE + 1


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


@njit(cache=True, nogil=True)
def _match_entries(buf, nbytes, start, offsets, positions, sizes):
    """-1 when the entries lie back to back from ``start`` and cover buf[:nbytes] exactly, with
    each record's size and offset fields equal to its entry's; else the first bad byte."""
    p = 0
    for i in range(offsets.shape[0]):
        size = np.int64(sizes[i])
        if np.int64(positions[i]) - start != p or p + size > nbytes or size < 24:
            return p
        if np.int64(load_u32(buf, p)) != size or np.int64(load_u64(buf, p + 16)) != offsets[i]:
            return p
        p += size
    return -1 if p == nbytes else p


def _read_once(pl: PartitionLog, from_offset: int, max_bytes: int, pool: BufferPool):
    i = pl.segment_for(from_offset)
    while i < len(pl.segments):
        seg = pl.segments[i]
        idx = pl.index(seg)
        e = idx.entries
        j = int(idx.lower_bound(from_offset))
        if j < e.shape[0]:
            # entries are >= MIN_RECORD bytes each: no need to look further than this
            stop = min(e.shape[0], j + max_bytes // MIN_RECORD + 1)
            ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] \
                - int(e[j]["position"])
            stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
            sel = e[j:stop]
            start = int(sel[0]["position"])
            nbytes = int(ends[stop - j - 1])
            path = pl.log_path(seg.base)
            buf = pool.take(nbytes)
            try:
                view = buf[:nbytes]
                got = pl.fs.read_into(path, start, view)
                n, bad, status = K.count_records(view, 0, got, True, K.CRC_TABLES)
                if got == nbytes and status == K.SCAN_OK and n == sel.shape[0]:
                    bad = _match_entries(view, nbytes, start, sel["offset"], sel["position"],
                                         sel["size"])
                    status = K.SCAN_OK if bad < 0 else K.SCAN_CORRUPT
                elif status == K.SCAN_OK:
                    status, bad = K.SCAN_CORRUPT, 0
                if status != K.SCAN_OK:
                    raise CorruptRecordError(
                        f"{path}: corrupt record at byte {start + int(bad)} (CRC or header check "
                        "failed, or the .bcq does not match the .log); run `kcompact verify`",
                        path, start + int(bad))
            except BaseException:
                pool.give(buf)
                raise
            return buf, nbytes, sel.shape[0], int(sel[-1]["offset"]) + 1
        i += 1
    return None, 0, 0, max(from_offset, pl.next_offset)


def read_records(pl: PartitionLog, from_offset: int, max_bytes: int, pool: BufferPool,
                 attempts: int = 4):
    """(buffer or None, nbytes, record count, next_offset): the records are
    ``buffer[:nbytes]``; give the buffer back to ``pool`` once it is sent."""
    return _across_swaps(pl, attempts, _read_once, pl, from_offset, max_bytes, pool)


def _across_swaps(pl: PartitionLog, attempts: int, fn, *args):
    """``fn(*args)``, again after re-listing the partition when a .log/.bcq pair caught in the
    middle of a compaction swap fails the checks; a mismatch that persists is raised."""
    for attempt in range(attempts):
        try:
            return fn(*args)
        except (CorruptRecordError, FileNotFoundError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.02 * (attempt + 1))
            for seg in pl.segments:
                seg.invalidate()
            pl.refresh()
    raise AssertionError("unreachable")


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


_HEAD = 24  # a record's size (u32 at 0) and offset (u64 at 16): record.md


def _head_matches(fd: int, pos: int, size: int, offset: int) -> bool:
    head = os.pread(fd, _HEAD, pos)
    return (len(head) == _HEAD and int.from_bytes(head[0:4], "little") == size
            and int.from_bytes(head[16:24], "little") == offset)


def _locate_once(pl: PartitionLog, from_offset: int, max_bytes: int) -> Located | None:
    i = pl.segment_for(from_offset)
    while i < len(pl.segments):
        seg = pl.segments[i]
        e = pl.index(seg).entries
        j = int(pl.index(seg).lower_bound(from_offset))
        if j < e.shape[0]:
            stop = min(e.shape[0], j + max_bytes // MIN_RECORD + 1)
            first = int(e[j]["position"])
            ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] - first
            stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
            nbytes = int(ends[stop - j - 1])
            path = pl.fs.local_path(pl.log_path(seg.base))
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                # The fd pins this .log (a swap renames, never rewrites). The index entries must
                # describe *this* file: a .bcq read before a swap and a .log opened after it
                # differ at the range's ends (different records at those positions) - re-list
                # and retry. The replica checks every record's CRC, offset order and count.
                last = stop - 1
                if (os.fstat(fd).st_size < first + nbytes
                        or not _head_matches(fd, first, int(e[j]["size"]), int(e[j]["offset"]))
                        or not _head_matches(fd, int(e[last]["position"]), int(e[last]["size"]),
                                             int(e[last]["offset"]))):
                    raise CorruptRecordError(
                        f"{pl.log_path(seg.base)}: the .bcq does not match the .log at byte "
                        f"{first}; run `kcompact verify`", pl.log_path(seg.base), first)
            except BaseException:
                os.close(fd)
                raise
            return Located(fd, first, nbytes, stop - j, int(e[last]["offset"]) + 1)
        i += 1
    return None


def locate_records(pl: PartitionLog, from_offset: int, max_bytes: int,
                   attempts: int = 4) -> Located | None:
    """Where the records ``read_records`` would return lie, for a local store: a Located range
    (open fd) or None when no record at or after ``from_offset`` exists. No byte is read but
    the two record headers at the ends of the range; the replica checks every record."""
    return _across_swaps(pl, attempts, _locate_once, pl, from_offset, max_bytes)


def warm_up() -> None:
    """Load the compiled kernels of this module (numba's cache) before the first request."""
    from kcompact.reput.record import Record, encode
    raw = np.frombuffer(encode([Record("t", 0, 5, 0, b"k", b"v")]), np.uint8)
    n, _, _ = K.count_records(raw, 0, raw.shape[0], True, K.CRC_TABLES)
    e = np.zeros(1, dtype=[("offset", "<i8"), ("position", "<u4"), ("size", "<u4")])
    e["offset"], e["size"] = 5, raw.shape[0]
    _match_entries(raw, raw.shape[0], 0, e["offset"], e["position"], e["size"])
