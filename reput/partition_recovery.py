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

``Recovery`` is the loader/recovery step a writable ``PartitionLog`` (reput/partition.py) holds:
its catalog (reput/catalog.py) says which segments are there and calls back the procedure for
its kind (``local``: a local store's partition; ``writer_local_segments``: a writer's local
segments on an object store, which also drops those already committed); each segment repairs
itself (``Segment.recover_tail``, ``check_sealed``: reput/segment_v1.py, segment_v2.py), and the
step counts what was repaired.
"""

from __future__ import annotations

from . import filenames as fn
from . import manifest as M
from .errors import CorruptRecordError
from .locks import FileLock
from .segment import Segment
from .swap import empty_trash, recover_swap


class Recovery:
    """A writer's open-time repair (see the module docstring), and what it did."""

    def __init__(self):
        self.recovered_entries = 0   # index entries rebuilt from .log tails
        self.truncated_bytes = 0     # torn .log tails cut
        self.swap_recovered = False  # an interrupted compaction swap was finished

    def run(self, catalog) -> None:
        """Repair ``catalog``'s partition (its kind's procedure, below)."""
        catalog.recover(self)

    def repair(self, seg: Segment) -> None:
        """What a crashed writer left in ``seg`` (``Segment.recover_tail``), counted."""
        recovered, truncated = seg.recover_tail()
        self.recovered_entries += recovered
        self.truncated_bytes += truncated

    # -- a local store's partition (reput/catalog_local.py) -------------------------------------

    def local(self, cat) -> None:
        """Finish or roll back an interrupted compaction swap, then repair what a crashed
        writer left (see module docstring). A swap that a live compactor (another process
        holding the partition's compaction lock) is running is left alone."""
        fs, pdir = cat.fs, cat.dir
        lock = FileLock(fs, f"{pdir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                if recover_swap(fs, pdir):
                    self.swap_recovered = True
                    for seg in cat.segments:
                        seg.invalidate()
                    cat.load()
                empty_trash(fs, pdir)
            finally:
                lock.release()
        _remove_temp_files(fs, pdir)
        if cat.problems:
            raise cat.problems[0]
        if cat.seglist is not None:
            self._listed(cat)
        else:
            self._unlisted(cat)

    def _listed(self, cat) -> None:
        """Files agree with the list: drop empty unlisted files, repair open segments."""
        for base in cat.strays:
            cat.fs.delete(cat.log_path(base))
            cat.fs.delete(cat.index_path(base))
        cat.strays = []
        opened = [seg for seg in cat.segments if seg.desc is None or seg.desc.open]
        for seg in opened:  # a writer crashed while they were open
            self.repair(seg)
        if opened:
            cat.write_list(set())
        _seed_active_crc(cat)

    def _unlisted(self, cat) -> None:
        """No list (a scratch partition, or a store from before lists): the sealed segments
        must be whole; the last one is repaired as the active segment; a local store's
        partition then gets its list."""
        for base in cat.orphan_indexes:
            path = cat.index_path(base)
            if cat.fs.size(path):
                raise CorruptRecordError(
                    f"{path}: a .bcq without its .log (the segment's records are missing); run "
                    "`kcompact verify` and rebuild this partition from a replica", path, 0)
            cat.fs.delete(path)
        cat.orphan_indexes = []
        segs = cat.segments
        for i, seg in enumerate(segs):
            if i < len(segs) - 1:
                seg.check_sealed(segs[i + 1].base)
            else:
                self.repair(seg)
        if cat.keeps_list and segs:
            cat.write_list(set())
            _seed_active_crc(cat)

    # -- a writer's local segments on an object store (reput/catalog_manifest.py) ---------------

    def writer_local_segments(self, cat) -> None:
        """The local segments are recovered as on a local store; those a crash left behind
        after their manifest commit (all their offsets already listed) are dropped, and a dead
        compaction's local staging is removed."""
        lfs, pdir = cat.local_fs, cat.dir
        lock = FileLock(lfs, f"{pdir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                lfs.remove_tree(cat.staging_dir)
            finally:
                lock.release()
        for base in cat.orphan_indexes:
            lfs.delete(f"{pdir}/{fn.base_name(base)}{fn.INDEX_SUFFIX}")
        cat.orphan_indexes = []
        _remove_temp_files(lfs, pdir)
        committed = cat.committed_last_offset()  # the manifest's, or a shared part's
        keep = []
        for seg in cat.segments:
            if seg.kind != "file":
                keep.append(seg)
                continue
            self.repair(seg)
            e = seg.entries()
            if (e.shape[0] and int(e[-1]["offset"]) <= committed) or \
                    (not e.shape[0] and seg.base <= committed):
                lfs.delete(seg.log_path)     # committed before the crash
                lfs.delete(seg.bcq_path)
                seg.invalidate()
                continue
            if e.shape[0] and int(e[0]["offset"]) <= committed:
                raise M.ManifestConflictError(
                    f"{cat.fs.url}/{pdir}: local segment {fn.base_name(seg.base)} "
                    f"(offsets {int(e[0]['offset'])}..{int(e[-1]['offset'])}) overlaps what the "
                    f"manifest lists (up to {committed}): another writer wrote this partition")
            keep.append(seg)
        cat.segments = keep


def _remove_temp_files(fs, pdir: str) -> None:
    for name in fs.listdir(pdir):
        if name.endswith(fn.TMP_SUFFIX):
            fs.delete(f"{pdir}/{name}")


def _seed_active_crc(cat) -> None:
    """The active segment's .bcq checksum as its list entry gives it (what its writer extends
    as it appends)."""
    seg = cat.segments[-1] if cat.segments else None
    if seg is not None and seg.appendable and seg.desc is not None and not seg.desc.open:
        seg.bcq_crc, seg.bcq_crc_size = seg.desc.bcq_crc32c, seg.desc.bcq_size


__all__ = ["Recovery"]
