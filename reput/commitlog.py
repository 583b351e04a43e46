"""One writer's commit log: append-only segments of encoded records (RocketMQ's CommitLog).

Spec: docs/formats/commitlog.md. A segment is named by the 20-digit global byte position of its
first byte; the next segment starts where the previous one ended, so a position (the reput
checkpoint) names one byte in the whole log. Segments roll when a batch would take the active one
past ``commitlog_segment_bytes``; a record never spans two segments. Opening the log truncates a
torn tail at the last record whose CRC checks. Segments that are fully dispatched and older than
the retention are deleted.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass

import numpy as np

from . import _kernels as K
from . import _native as _N
from . import filenames as fn
from .backend import AppendFile, Backend
from .config import SYSTEM_CLOCK, Clock, WriterOptions
from .errors import CorruptRecordError, StoreLockedError
from .timing import Timing

CHECKPOINT_VERSION = 1


@dataclass
class _Segment:
    base: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size


class CommitLog:
    def __init__(self, fs: Backend, writer: str, options: WriterOptions = WriterOptions(),
                 clock: Clock = SYSTEM_CLOCK, lock: bool = True):
        self.fs, self.writer, self.options, self.clock = fs, writer, options, clock
        self.dir = fn.writer_dir(writer)
        self._lock_fd: int | None = None
        if lock:
            self._take_lock()
        self.segments: list[_Segment] = []
        self._active: AppendFile | None = None
        self.truncated_bytes = 0
        #: durations of append() calls and of the active segment's fsyncs (reput/timing.py)
        self.append_time = Timing()
        self.fsync_time = Timing()
        self._load()

    # -- locking: one process per writer directory ------------------------------------------

    def _take_lock(self) -> None:
        path = self.fs.local_path(fn.writer_lock(self.writer))
        if path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"commit log {self.dir} is in use by another process; stop it or use another "
                "writer id") from None
        self._lock_fd = fd

    # -- open and recover --------------------------------------------------------------------

    def _load(self) -> None:
        bases = sorted(b for b, kind in filter(None, map(fn.parse_base, self.fs.listdir(self.dir)))
                       if kind == "log")
        for b in bases:
            self.segments.append(_Segment(b, self.fs.size(fn.commitlog_segment(self.writer, b))))
        if self.segments:
            self._recover_tail()

    def _recover_tail(self) -> None:
        """Truncate the last segment after its last whole record with a valid CRC."""
        seg = self.segments[-1]
        path = fn.commitlog_segment(self.writer, seg.base)
        if seg.size:
            buf = self.fs.map(path, seg.size)
            _, stop, status = _N.count_records(buf, 0, seg.size, True)
            del buf
            if status != K.SCAN_OK:
                f = self.fs.open_append(path)
                f.truncate(int(stop))
                f.sync()
                f.close()
                self.truncated_bytes = seg.size - int(stop)
                seg.size = int(stop)

    @property
    def start(self) -> int:
        return self.segments[0].base if self.segments else 0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    # -- append ------------------------------------------------------------------------------

    def _open_active(self) -> AppendFile:
        if self._active is None:
            if not self.segments:
                self.segments.append(_Segment(self.read_checkpoint(), 0))
            seg = self.segments[-1]
            self._active = self.fs.open_append(fn.commitlog_segment(self.writer, seg.base))
        return self._active

    def _roll(self) -> None:
        if self._active is not None:
            self._sync_active()  # a sealed segment is durable before the next one exists
            self._active.close()
            self._active = None
        self.segments.append(_Segment(self.end, 0))
        self.fs.sync_dir(self.dir)

    def append(self, buf: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
        """Append encoded records (``positions`` = where each starts in ``buf``).

        Returns the global [start, end) positions of the appended bytes. A batch that does not
        fit in the active segment is split at record boundaries across new segments.
        """
        t0 = self.clock.monotonic()
        start = self.end if self.segments else self.read_checkpoint()
        total = buf.shape[0]
        limit = self.options.commitlog_segment_bytes
        done = 0
        i = 0
        n = positions.shape[0]
        while done < total:
            f = self._open_active()
            room = limit - f.size
            # largest prefix of whole records (from record i) that fits in `room`
            ends = np.append(positions[i + 1:], total) - done
            k = int(np.searchsorted(ends, room, side="right"))
            if k == 0:
                if f.size > 0:
                    self._roll()
                    continue
                k = 1  # a single record larger than a segment gets a segment of its own
            cut = int(ends[k - 1]) + done
            f.write(buf[done:cut])
            self.segments[-1].size = f.size
            done = cut
            i += k
            if done < total:
                self._roll()
        self.append_time.observe(self.clock.monotonic() - t0)
        if self.options.fsync == "always":
            self.sync()
        assert i == n
        return start, self.end

    def sync(self) -> None:
        if self._active is not None:
            self._sync_active()

    def _sync_active(self) -> None:
        t0 = self.clock.monotonic()
        self._active.sync()
        self.fsync_time.observe(self.clock.monotonic() - t0)

    def start_writeback(self) -> None:
        """Queue the active segment's appended bytes for writeback (no waiting)."""
        if self._active is not None:
            self._active.start_writeback()

    def sync_soon(self) -> None:
        """fdatasync the active segment in the background (backend.AppendFile.sync_soon)."""
        if self._active is not None:
            self._active.sync_soon()

    # -- read --------------------------------------------------------------------------------

    def views(self, start: int, end: int | None = None):
        """Yield (global_position_of_view_byte_0, uint8 view) covering [start, end) by segment."""
        end = self.end if end is None else end
        for seg in self.segments:
            if seg.end <= start or seg.base >= end or seg.size == 0:
                continue
            lo = max(start, seg.base) - seg.base
            hi = min(end, seg.end) - seg.base
            m = self.fs.map(fn.commitlog_segment(self.writer, seg.base), hi)
            yield seg.base, m, lo, hi

    # -- checkpoint and retention ------------------------------------------------------------

    def read_checkpoint(self) -> int:
        path = fn.reput_checkpoint(self.writer)
        try:
            raw = self.fs.read(path)
        except FileNotFoundError:
            return self.segments[0].base if self.segments else 0
        try:
            d = json.loads(raw)
            pos = int(d["position"])
            if d.get("version") != CHECKPOINT_VERSION or pos < 0:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise CorruptRecordError(f"{path}: unreadable reput checkpoint; delete it to "
                                     "re-dispatch the whole commit log (re-dispatch is idempotent)",
                                     path, 0) from None
        return pos

    def write_checkpoint(self, position: int) -> None:
        self.fs.write_atomic(fn.reput_checkpoint(self.writer),
                             json.dumps({"version": CHECKPOINT_VERSION,
                                         "position": position}).encode())

    def delete_dispatched(self, checkpoint: int) -> int:
        """Delete sealed segments that end at or before ``checkpoint`` and are past retention.

        A segment's age is the injected clock's now minus its modification time (the moment it
        was sealed: nothing writes a sealed segment), asked of the backend, which for a commit
        log is always a local one (a local directory, or memory in tests). A backend that
        cannot tell an age keeps its segments unless the retention is 0."""
        now = self.clock.ms()
        retention = self.options.commitlog_retention_ms
        removed = 0
        while len(self.segments) > 1 and self.segments[0].end <= checkpoint:
            seg = self.segments[0]
            path = fn.commitlog_segment(self.writer, seg.base)
            if retention > 0:
                mtime_ms = self.fs.mtime_ms(path)
                if mtime_ms is None or now - mtime_ms < retention:
                    break
            self.fs.delete(path)
            self.segments.pop(0)
            removed += 1
        return removed

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
