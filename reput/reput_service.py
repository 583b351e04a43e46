"""Reput: commit-log records dispatched into the partitions' compaction logs.

RocketMQ's ``ReputMessageService`` reads its commit log from a position and dispatches each
message into its queue; ``Reput`` is that service of a writer's store (reput/store.py): from
``position`` (the commit-log byte every record before which is in its partition) it scans what
follows (``dispatch``: every CRC checked, after a crash or when a batch was appended behind),
or takes a batch the writer has just encoded and scanned (``dispatch_scanned``: no read, no
parse), and appends each run of records of one topic-partition to the writer's partition
(``Store.writable_partition``). Records at or below a partition's last offset are skipped
(``PartitionLog.append``), so dispatching again from an older position is harmless: that is
why the checkpoint (``CommitLog.write_checkpoint``) may lag ``position``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import _kernels as K
from . import filenames as fn
from .commitlog import CommitLog
from .errors import CorruptRecordError
from .record import Scan, Scratch, scan


class Reput:
    """One writer's dispatch (see the module docstring). ``partition(topic, p)``: the writer's
    partition to append to; ``stats``: the store's counters ("dispatched", "skipped")."""

    def __init__(self, commitlog: CommitLog, writer: str, secret: bytes,
                 partition: Callable, stats: dict[str, int]):
        self.commitlog, self.writer, self.secret = commitlog, writer, secret
        self.partition, self.stats = partition, stats
        #: the commit-log byte every record before which has been dispatched
        self.position = 0
        self._scratch = Scratch()

    def dispatch(self) -> int:
        """Copy commit-log records after ``position`` into partitions (the caller holds the
        store's lock). Returns records appended."""
        total = 0
        for seg_base, view, lo, hi in self.commitlog.views(self.position):
            # re-dispatch from the files (after a crash) always checks CRCs
            total += self._dispatch_view(view, lo, hi,
                                         where=fn.commitlog_segment(self.writer, seg_base))
            self.position = seg_base + hi
            del view
        self.stats["dispatched"] += total
        return total

    def dispatch_scanned(self, buf: np.ndarray, s: Scan, topic: str, end: int) -> int:
        """The batch just appended at ``position`` (its bytes ``buf`` and their scan ``s``, one
        topic, in memory): dispatched without reading or parsing it again; ``end``: the
        commit-log byte after it."""
        p = s.partitions
        runs = np.flatnonzero(p[1:] != p[:-1]) + 1
        n = self._dispatch_runs(buf, s, [0, *runs.tolist(), len(s)], topic)
        self.position = end
        self.stats["dispatched"] += n
        return n

    def _dispatch_view(self, view: np.ndarray, lo: int, hi: int, *, where: str) -> int:
        s = scan(view, lo, hi, secret=self.secret, verify_crc=True, scratch=self._scratch)
        if s.status != K.SCAN_OK:
            raise CorruptRecordError(
                f"{where}: {'torn' if s.status == K.SCAN_TORN else 'corrupt'} record at byte "
                f"{s.stop} during reput", where, s.stop)
        if not len(s):
            return 0
        return self._dispatch_runs(
            view, s, K.same_topic_runs(view, s.positions, s.topic_hash, s.partitions).tolist())

    def _dispatch_runs(self, view: np.ndarray, s: Scan, runs: list[int],
                       topic: str | None = None) -> int:
        """Append each run s[runs[r]:runs[r + 1]] of records of one topic-partition to its
        partition; ``topic`` when every run is of that topic, else each run's is read from its
        first record."""
        total = 0
        for a, b in zip(runs, runs[1:]):
            t = topic
            if t is None:
                p = int(s.positions[a])
                tl = int(view[p + 10])
                t = bytes(view[p + K.HEADER_SIZE:p + K.HEADER_SIZE + tl]).decode()
            n = self.partition(t, int(s.partitions[a])).append(view, s, a, b)
            total += n
            self.stats["skipped"] += (b - a) - n
        return total


__all__ = ["Reput"]
