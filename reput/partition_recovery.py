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

import numpy as np

from . import bcq as B
from . import filenames as fn
from .errors import CorruptRecordError
from .locks import FileLock
from .record import scan
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
            self._recover_segment(seg)
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
                self._check_sealed(seg, self.segments[i + 1].base)
            else:
                self._recover_segment(seg)
        if self.keeps_list and self.segments:
            self._write_list(set())
            self._seed_active_crc()

    def _seed_active_crc(self) -> None:
        if self.segments and self.segments[-1].desc is not None \
                and not self.segments[-1].desc.open:
            seg, m = self.segments[-1], self.segments[-1].desc
            seg.bcq_crc, seg.bcq_crc_size = m.bcq_crc32c, m.bcq_size

    def _check_sealed(self, seg: Segment, next_base: int) -> None:
        """A sealed segment of a store without a list: its index must be whole and in order
        (entries back to back from byte 0 to the end of the .log, offsets increasing inside
        the segment's range); reading only the index. Raises CorruptRecordError naming it.
        A format-2 segment's lean index checks itself when opened (header, directory CRCs,
        the .log's size): a replica's pull (``.replicating/``) installs shipped ones."""
        path = self.seg_index_path(seg)
        if self.seg_format(seg) == 2:
            idx = self.index(seg)  # raises CorruptRecordError naming the .bcq
            d = idx.dir
            if idx.n and (int(d["first_offset"][0]) < seg.base
                          or int(d["last_offset"][-1]) >= next_base):
                raise CorruptRecordError(f"{path}: offsets outside the segment's range; this "
                                         "sealed segment is not repaired on open: run `kcompact "
                                         "verify` and rebuild the partition from a replica",
                                         path, 0)
            return
        problem = index_structure_problem(self.entries(seg), seg.base, next_base,
                                          seg.log_size, seg.index_size)
        if problem is not None:
            raise CorruptRecordError(f"{path}: {problem}; this sealed segment is not repaired "
                                     "on open: run `kcompact verify` and rebuild the partition "
                                     "from a replica", path, 0)

    def _recover_segment(self, seg: Segment) -> None:
        if self.seg_format(seg) == 2:
            return  # written whole when sealed (through a swap), never appended to
        ip = self.seg_index_path(seg)
        if not self.local_fs.exists(ip):
            # a writer killed between creating a new segment's .log and its .bcq (or an open
            # segment's .bcq lost): the index is rebuilt from the .log, starting empty here so
            # that the segment has its .bcq even when its .log holds no whole record yet
            f = self.local_fs.open_append(ip)
            f.sync()
            f.close()
            self.local_fs.sync_dir(self.dir)
            seg.index_size = 0
            seg.invalidate()
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

