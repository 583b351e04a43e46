"""A local partition's catalog: its directory and its segment list (docs/formats/segment-list.md).

``LocalCatalog`` is the ``SegmentCatalog`` (reput/catalog.py) of a partition on a local store:
how the segments are loaded from the files and ``segments.json``, what disagrees between the
two, and when the writer rewrites the list. Scratch partitions (a replica's ``.replicating/``,
a merge's ``.compacting/``) keep no list; an object store's catalog is its manifest
(reput/catalog_manifest.py).

Loading: every listed segment must have its .log and .bcq, each of the listed size unless the
segment is listed open (a writer is appending to it); files the list does not name are allowed
only when they hold nothing (a roll or a crash in the middle of one). A read-only view re-reads
the list and the directory a few times when they disagree (a writer or a compaction swap may be
between two steps) and then refuses the partition, naming the file. A writer's open leaves the
disagreements to recovery (reput/partition_recovery.py), which repairs only open segments.

Writing: the writer lists the active segment open before its first append of a session, lists
a new segment (open) when it rolls, and lists the sizes and checksums of the segments it
appended to once their bytes are fsynced (``sync``, ``close``); a compaction swap rewrites the
list in its apply step (reput/swap.py).
"""

from __future__ import annotations

import time

from . import filenames as fn
from . import ledger as LG
from . import segment_list as SL
from .backend import Backend
from .catalog import SegmentCatalog
from .errors import CorruptRecordError
from .locks import FileLock, partition_holder
from .segment import PartitionContext, Segment
from .segment_desc import SegmentDesc
from .swap import PLAN_NAME, read_checkpoint, recover_swap, staging_dir

#: attempts of a read-only view when the files disagree with the list (20-80 ms apart)
LOAD_ATTEMPTS = 4


class Disagreement(CorruptRecordError):
    """A partition's files disagree with its segment list (``path`` names the file)."""


class LocalCatalog(SegmentCatalog):
    """A local partition's segments and segment list (see the module docstring).

    ``keeps_list``: the partition keeps segments.json (a store's, not a scratch one's);
    ``require_list``: the store keeps one per partition (store.json says so), so a partition
    with segments and no list is refused rather than read as an old store's; ``strict=False``
    (``kcompact verify``): a read-only view that disagrees with its list, or whose list is
    damaged, still opens; ``problems`` says what is wrong."""

    def __init__(self, fs: Backend, pdir: str, ctx: PartitionContext, *, writable: bool,
                 keeps_list: bool, require_list: bool = False, strict: bool = True):
        super().__init__(fs, fs, pdir, ctx, writable=writable)
        self.keeps_list, self.require_list, self.strict = keeps_list, require_list, strict
        #: bases of the segments the list names open (a writer appends to them)
        self.listed_open: set[int] = set()
        #: the list version last found to agree with the ledger (reput/ledger.py)
        self._ledger_checked: int | None = None

    # -- loading -------------------------------------------------------------------------

    def load(self) -> None:
        self._load_local()
        if self.seglist is not None:
            self.listed_open = {m.base for m in self.seglist.segments if m.open}

    def refresh(self) -> None:
        if not self.writable:
            self.finish_committed_swap()
        self.load()

    def finish_committed_swap(self) -> None:
        """A compaction that died after its commit point leaves swap.json behind; until someone
        applies it the .log/.bcq pairs may not match. Any reader may finish it (the apply is
        idempotent and never touches the active segment) unless a live compactor holds the
        lock, in which case it is applying right now and the read retry covers it."""
        if not self.fs.exists(f"{staging_dir(self.dir)}/{PLAN_NAME}"):
            return
        lock = FileLock(self.fs, f"{self.dir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                # ... and no live writer, which rewrites the segment list as it appends
                writer = FileLock(self.fs, f"{self.dir}/{fn.LOCK_FILE}")
                if writer.acquire(blocking=False, holder=partition_holder(None)):
                    try:
                        recover_swap(self.fs, self.dir)
                    finally:
                        writer.release()
                for seg in self.segments:
                    seg.invalidate()
            finally:
                lock.release()

    def checkpoint(self) -> tuple[int, dict | None]:
        return read_checkpoint(self.fs, self.dir)

    @property
    def sealed_segments(self) -> list[Segment]:
        """All but the active one."""
        return self.segments[:-1]

    @property
    def active_base(self) -> int:
        return self.segments[-1].base if self.segments else 0

    @property
    def active_bytes(self) -> int:
        return self.segments[-1].log_size if self.segments else 0

    def next_offset_floor(self) -> int:
        return self.seglist.next_offset if self.seglist is not None else 0

    def last_compaction_ms(self) -> int | None:
        """The modification time of the compaction checkpoint (None: never compacted)."""
        try:
            return self.fs.mtime_ms(f"{self.dir}/{fn.COMPACTION_CHECKPOINT}")
        except FileNotFoundError:
            return None

    def recover(self, recovery) -> None:
        recovery.local(self)

    def _load_local(self) -> None:
        """Segments from the directory (and the list, when the partition keeps one); a
        read-only view retries and then raises the first disagreement."""
        attempts = 1 if self.writable or not self.strict else LOAD_ATTEMPTS
        for attempt in range(attempts):
            self._scan_local()
            if self.writable or not self.strict or not self.problems:
                return
            if attempt < attempts - 1:
                time.sleep(0.02 * (attempt + 1))
        raise self.problems[0]

    def _scan_local(self) -> None:
        logs, idxs = self._file_bases(self.fs)
        self.problems = []
        self.strays = []
        try:
            lst = SL.read(self.fs, self.dir) if self.keeps_list else None
        except CorruptRecordError as e:
            if self.strict or self.writable:
                raise
            self.problems.append(Disagreement(str(e), e.path, 0))  # verify: go on, files only
            lst = None
        self.seglist = lst
        old = {s.base: s for s in self.segments}
        if lst is None:
            self._scan_unlisted(logs, idxs, old)
            return
        listed = lst.by_base()
        segs = []
        for m in lst.segments:
            lp, ip = self.log_path(m.base), self.index_path(m.base)
            ls, isz = self._size_or_none(lp), self._size_or_none(ip)
            if m.open and ls is not None and isz is None:
                isz = 0  # an open segment's index is rebuilt from its .log (recovery)
            if not m.open and m.log_size == 0 and m.bcq_size == 0:
                # an empty segment (a roll's new active one): a missing file loses nothing,
                # and the writer creates it again when it appends (a crash between the two)
                ls, isz = ls or 0, isz or 0
            if ls is None or isz is None:
                missing = lp if ls is None else ip
                self._problem(missing, 0, "missing: the segment list names it (the segment's "
                              "records are gone)")
                continue
            if not m.open:
                if ls != m.log_size:
                    self._problem(lp, min(ls, m.log_size), f"holds {ls} bytes, the segment "
                                  f"list says {m.log_size}")
                if isz != m.bcq_size:
                    self._problem(ip, min(isz, m.bcq_size), f"holds {isz} bytes, the segment "
                                  f"list says {m.bcq_size} ({m.records} entries)")
            seg = old.get(m.base)
            segs.append(self._segment(m.base, ls, isz, desc=m, open_tail=m.open,
                                      reuse=seg if seg is not None and seg.desc == m else None))
        for base in sorted((logs | idxs) - listed.keys()):
            lp, ip = self.log_path(base), self.index_path(base)
            sizes = [s for s in (self._size_or_none(lp), self._size_or_none(ip)) if s]
            if sizes:
                self._problem(lp if base in logs else ip, 0, "is not in the segment list "
                              f"({SL.path(self.dir)})")
            else:
                self.strays.append(base)  # empty: a roll or its crash; holds nothing
        self.segments = segs
        self.orphan_indexes = []
        self._check_ledger(lst)

    def _check_ledger(self, lst: "SL.SegmentList | None") -> None:
        """The list (or its absence) against the partition's ledger (reput/ledger.py): a
        writer refuses at once (its recovery would otherwise take what is left for the
        partition), a reader retries and then refuses, ``verify`` lists it. Re-read only when
        the list's version moved since the last check."""
        if not self.keeps_list:
            return
        version = lst.version if lst is not None else None
        if version is not None and version == self._ledger_checked:
            return
        err = LG.check(self.fs, self.dir, SL.path(self.dir), version,
                       lst.segments if lst is not None else [],
                       lst.next_offset if lst is not None else 0)
        if err is None:
            self._ledger_checked = version
            return
        self._ledger_checked = None
        if self.writable:
            raise err
        err.what = str(err).split(": ", 1)[-1]
        self.problems.append(err)

    def _scan_unlisted(self, logs: set[int], idxs: set[int], old: dict[int, Segment]) -> None:
        """No list: a scratch partition, a store written before lists existed, or a
        partition being created (its files empty)."""
        if self.keeps_list and self.require_list and not self.problems:
            nonempty = [b for b in sorted(logs | idxs)
                        if self._size_or_none(self.log_path(b))
                        or self._size_or_none(self.index_path(b))]
            if nonempty:
                self._problem(SL.path(self.dir), 0, "missing: this store keeps a segment list "
                              "per partition, and this partition has segments")
        self._check_ledger(None)
        segs = []
        for base in sorted(logs):
            ls = self._size_or_none(self.log_path(base))
            if ls is None:
                continue  # replaced under us by a compaction swap; the next refresh sees it
            isz = (self._size_or_none(self.index_path(base)) or 0) if base in idxs else 0
            # (sealed into format 2 meanwhile? the dispatch looks again when its sizes moved)
            segs.append(self._segment(base, ls, isz, reuse=old.get(base)))
        for i, seg in enumerate(segs):
            seg.open_tail = i == len(segs) - 1  # the active segment
        self.segments = segs
        self.orphan_indexes = sorted(idxs - logs)

    def _size_or_none(self, path: str) -> int | None:
        try:
            return self.fs.size(path)
        except FileNotFoundError:
            return None

    def _problem(self, path: str, position: int, what: str) -> None:
        d = Disagreement(f"{path}: {what}; the partition's files disagree with its segment "
                         "list: run `kcompact verify` and rebuild this partition from a "
                         "replica", path, position)
        d.what = what
        self.problems.append(d)

    # -- writing -------------------------------------------------------------------------

    def _list_now(self, open_bases: set[int]) -> SL.SegmentList:
        """The list as the segments are now: those in ``open_bases`` listed open (they must
        be the last ones), every other one with its sizes and checksum (a segment's entry
        computed from what its writer knows of it, its .bcq read once when the checksum of
        what was appended is not known: ``Segment.current_desc``)."""
        metas = []
        for i, seg in enumerate(self.segments):
            nxt = self.segments[i + 1].base if i + 1 < len(self.segments) else None
            if seg.base in open_bases:
                metas.append(SegmentDesc(seg.base))
            elif seg.desc is not None and not seg.desc.open and seg.desc.log_size == \
                    seg.log_size and seg.desc.bcq_size == seg.index_size and \
                    (nxt is None or seg.desc.next <= nxt):
                metas.append(seg.desc)
            else:
                metas.append(seg.current_desc(nxt))
        prev = self.seglist.version if self.seglist is not None else 0
        return SL.SegmentList(metas, self.next_offset, prev)

    def write_list(self, open_bases: set[int]) -> None:
        """Write the list as the segments are now (``_list_now``) and take it as the
        segments' entries."""
        lst = SL.write(self.fs, self.dir, self._list_now(open_bases))
        self._take_list(lst)

    def _take_list(self, lst: SL.SegmentList) -> None:
        self.seglist = lst
        metas = lst.by_base()
        for seg in self.segments:
            seg.desc = metas.get(seg.base)
            seg.open_tail = seg.desc is not None and seg.desc.open
        self.listed_open = {m.base for m in lst.segments if m.open}

    def segment_opened(self, base: int) -> None:
        """The list names the new segment, open, once its files exist."""
        if self.keeps_list:
            self.write_list(self.listed_open | {base})

    def advance_source_next(self, offset: int) -> None:
        super().advance_source_next(offset)
        if self.keeps_list and self.writable:
            self.write_list(self.listed_open)

    def segment_dropped(self, base: int) -> None:
        """An empty active segment a roll renamed forward is no longer listed open."""
        self.listed_open.discard(base)

    def before_append(self) -> None:
        """Before a writer's append changes the active segment: list it open (once)."""
        if not self.keeps_list or not self.segments:
            return
        base = self.segments[-1].base
        if base in self.listed_open:
            return
        self.write_list(self.listed_open | {base})

    def after_sync(self, *, closing: bool) -> None:
        """After an fsync of what was appended: list the sizes of the segments appended to
        (all of them when ``closing``, else every one but the active segment)."""
        if not self.keeps_list or not self.writable or not self.listed_open:
            return
        keep = set()
        if not closing and self.segments:
            keep = self.listed_open & {self.segments[-1].base}
        if keep != self.listed_open:
            self.write_list(keep)

    def list_state(self):
        return self.seglist

    def restore_list_state(self, lst: "SL.SegmentList | None") -> None:
        """Put back a list written before (same bytes, same version), or no list: undoing a
        roll."""
        if not self.keeps_list:
            return
        # (the ledger first: the list goes back a version, and a crash between the two must
        # leave the ledger behind the list, never ahead of it: reput/ledger.py)
        if lst is None:
            LG.delete(self.fs, self.dir)
            self.fs.delete(SL.path(self.dir))
            self.seglist, self.listed_open = None, set()
            return
        LG.write(self.fs, self.dir, SL.NAME, lst.version, lst.segments, lst.next_offset)
        self.fs.write_atomic(SL.path(self.dir), lst.to_json())
        self._take_list(lst)


__all__ = ["Disagreement", "LOAD_ATTEMPTS", "LocalCatalog"]
