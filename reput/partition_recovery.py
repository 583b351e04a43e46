"""Recovery of a partition's segments when a writer opens it (docs/formats/bcq.md, record.md).

Records are appended first to the .log, then to the .bcq, so an entry never points past its data.
A crash can leave a .bcq behind its .log (rebuilt from the .log: the records there are indexed),
entries past the end of the .log (dropped), a torn .log tail (cut: reput re-dispatches it from
the commit log, whose checkpoint is behind it), orphan indexes and temporary files (deleted), and
an interrupted compaction swap (finished or rolled back, docs/formats/compaction-swap.md). Only
a writer repairs; a read-only view indexes an unindexed tail in memory instead
(``PartitionLog.index``).

``SegmentRecovery`` is that part of ``PartitionLog`` (reput/partition.py); the object-store
variant, which also drops local segments already committed, is
``ManifestPartition._recover_local``.
"""

from __future__ import annotations

from . import bcq as B
from . import filenames as fn
from .locks import FileLock
from .record import scan
from .segment import Segment
from .swap import empty_trash, recover_swap


class SegmentRecovery:
    """Writer-side repair of ``PartitionLog`` (a mixin: it uses the log's attributes)."""


    def recover(self) -> None:
        """Finish or roll back an interrupted compaction swap, then make every .bcq match its
        .log (see module docstring). Writer-only. A swap that a live compactor (another
        process holding the partition's compaction lock) is running is left alone."""
        if self.manifest_mode:
            self._recover_local()
            return
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
            self._truncate(self.seg_index_path(seg), n * B.ENTRY_SIZE)
            seg.index_size = n * B.ENTRY_SIZE
        e = self.entries(seg)
        if e.shape[0] != n:  # entries point past the end of the .log
            self._truncate(self.seg_index_path(seg), e.shape[0] * B.ENTRY_SIZE)
            seg.index_size = e.shape[0] * B.ENTRY_SIZE
            seg.invalidate()
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if seg.log_size <= indexed_end:
            return
        buf = self.local_fs.map(self.seg_log_path(seg), seg.log_size)
        s = scan(buf, indexed_end, seg.log_size, secret=self.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        # offsets only grow: a record at or below the last indexed one is not ours to index
        good = len(s) if len(s) == 0 or int(s.offsets[0]) > last else 0
        if good:
            entries = B.entries_from_scan(s, 0, good, 0)
            f = self.local_fs.open_append(self.seg_index_path(seg))
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
            self._truncate(self.seg_log_path(seg), stop)
            seg.log_size = stop

    def _truncate(self, path: str, size: int) -> None:
        f = self.local_fs.open_append(path)
        f.truncate(size)
        f.sync()
        f.close()
