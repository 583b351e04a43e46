"""Recovery of a partition's segments when a writer opens it (docs/formats/bcq.md, record.md,
segment-list.md).

Only what a writer may have been in the middle of is repaired: an interrupted compaction swap
(finished or rolled back, docs/formats/compaction-swap.md), temporary files, empty segment files
a roll left unlisted, and the segments the segment list names as open (the active one, and any
rolled since the writer's last fsync) after a crash. Records are appended first to the .log,
then to the .bcq, so such a segment can hold a .bcq behind its .log (rebuilt from the .log: the
records there are indexed), entries past the end of the .log (dropped) and a torn .log tail
(cut: reput re-dispatches it from the commit log, whose checkpoint is behind it). A new
segment's .bcq is created before its .log; an open segment found without its .bcq (a writer
from before that order, killed between the two) gets an empty one, then is rebuilt as above.

Everything else is evidence and left as it is: a closed segment (sealed, or the active one of a
store at rest) whose files disagree with the list, a file the list does not name that holds
bytes, a .bcq without its .log. Opening for write then fails naming the file; ``kcompact verify``
lists every such problem. A store written before segment lists existed gets its list here (the
sealed segments checked for a whole, ordered index first; the last one repaired as the active
segment). A read-only view never repairs: it indexes an open segment's unindexed tail in memory
(``PartitionLog.index``).

``SegmentRecovery`` is that part of ``PartitionLog`` (reput/partition.py); the object-store
variant, which also drops local segments already committed, is
``ManifestPartition._recover_local``.
"""

from __future__ import annotations

from . import filenames as fn
from .errors import CorruptRecordError
from .locks import FileLock
from .segment import Segment
from .swap import empty_trash, recover_swap


class SegmentRecovery:
    """Writer-side repair of ``PartitionLog`` (a mixin: it uses the log's attributes)."""


    def recover(self) -> None:
        """Finish or roll back an interrupted compaction swap, then repair what a crashed
        writer left (see module docstring). Writer-only. A swap that a live compactor
        (another process holding the partition's compaction lock) is running is left alone."""
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
        for name in self.fs.listdir(self.dir):
            if name.endswith(fn.TMP_SUFFIX):
                self.fs.delete(f"{self.dir}/{name}")
        if self.problems:
            raise self.problems[0]
        if self.seglist is not None:
            self._recover_listed()
        else:
            self._recover_unlisted()

    def _recover_listed(self) -> None:
        """Files agree with the list: drop empty unlisted files, repair open segments."""
        for base in self.strays:
            self.fs.delete(self.log_path(base))
            self.fs.delete(self.index_path(base))
        self.strays = []
        opened = [seg for seg in self.segments if seg.desc is None or seg.desc.open]
        for seg in opened:  # a writer crashed while they were open
            self._repair(seg)
        if opened:
            self._write_list(set())
        self._seed_active_crc()

    def _recover_unlisted(self) -> None:
        """No list (a scratch partition, or a store from before lists): the sealed segments
        must be whole; the last one is repaired as the active segment; a local store's
        partition then gets its list."""
        for base in self._orphan_indexes:
            path = self.index_path(base)
            if self.fs.size(path):
                raise CorruptRecordError(
                    f"{path}: a .bcq without its .log (the segment's records are missing); run "
                    "`kcompact verify` and rebuild this partition from a replica", path, 0)
            self.fs.delete(path)
        self._orphan_indexes = []
        for i, seg in enumerate(self.segments):
            if i < len(self.segments) - 1:
                seg.check_sealed(self.segments[i + 1].base)
            else:
                self._repair(seg)
        if self.keeps_list and self.segments:
            self._write_list(set())
            self._seed_active_crc()

    def _seed_active_crc(self) -> None:
        if self.segments and self.segments[-1].appendable and \
                self.segments[-1].desc is not None and not self.segments[-1].desc.open:
            seg, m = self.segments[-1], self.segments[-1].desc
            seg.bcq_crc, seg.bcq_crc_size = m.bcq_crc32c, m.bcq_size

    def _repair(self, seg: Segment) -> None:
        """What a crashed writer left in ``seg`` (``Segment.recover_tail``), counted."""
        recovered, truncated = seg.recover_tail()
        self.recovered_entries += recovered
        self.truncated_bytes += truncated
