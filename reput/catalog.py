"""A partition's segment catalog: which segments it holds and where they live (one interface).

Kafka splits a log into ``LocalLog`` (the files), ``LogSegments`` (the catalog) and ``LogLoader``
(recovery); a ``PartitionLog`` (reput/partition.py) likewise HOLDS a catalog and a recovery step
(reput/partition_recovery.py) rather than being them. Two catalogs implement this interface:

* ``LocalCatalog`` (reput/catalog_local.py): a local store's partition directory and its
  segment list (docs/formats/segment-list.md), which the files are checked against; scratch
  partitions (a replica's ``.replicating/``) keep no list.
* ``ManifestCatalog`` (reput/catalog_manifest.py): an object store's partition manifest
  (docs/formats/manifest.md), plus a writer's active segments in its local directory and a
  compaction's staged outputs until they are committed.

The partition picks one when it opens (``PartitionLog.__init__``: by whether the store's files
can be appended to) and asks it, never which one it is: the segments (``segments``: objects of
their kind, reput/segment.py, made by ``open_segment`` when listed), the compaction horizon
(``checkpoint``), what compaction may rewrite (``sealed_segments``, ``active_base``), the offsets
the partition spans (``first_offset``, ``last_offset``, ``next_offset``: a listed entry answers
without reading an index; a catalog's own log end offset survives a compaction that empties the
tail), and what a writer's steps change in it (``segment_opened``, ``before_append``,
``after_sync``, ``list_state``/``restore_list_state`` to take a roll back, ``publish``). Each
behaviour that differs between the two is a method or a named flag of the catalog.
"""

from __future__ import annotations

import bisect

from . import filenames as fn
from .backend import Backend
from .segment import PartitionContext, Segment
from .segment_kinds import open_segment
from .segment_desc import SegmentDesc


class SegmentCatalog:
    """The interface (see the module docstring) and what both catalogs share."""

    #: a writer's rolled segments are re-encoded into format 2 where they are, at its next sync
    #: (reput/seal.py); False: they are encoded as they are uploaded
    seals_rolled = True
    #: a writer rolls its active segment by time while idle (``PartitionLog.roll_if_due``);
    #: False: every flush publishes it anyway
    rolls_by_time = True
    #: it keeps a segment list (segments.json) the writer rewrites as it appends
    keeps_list = False

    def __init__(self, fs: Backend, local_fs: Backend, pdir: str, ctx: PartitionContext, *,
                 writable: bool):
        #: the store's backend; ``local_fs``: where "file" segments live (the store itself, or
        #: the local directory of a writer on an object store)
        self.fs, self.local_fs, self.dir, self.ctx = fs, local_fs, pdir, ctx
        self.writable = writable
        self.segments: list[Segment] = []
        #: where the files disagree with the catalog (a local list: catalog_local.py)
        self.problems: list = []
        #: bases of empty segment files nothing names; .bcq files without their .log
        self.strays: list[int] = []
        self.orphan_indexes: list[int] = []
        #: the catalog files as last read or written (None: none)
        self.seglist = None
        self.manifest = None

    # -- what it lists ------------------------------------------------------------------------

    def load(self) -> None:
        """List the segments (again)."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Pick up what other processes appended or compacted since it looked (a read-only
        view)."""
        self.load()

    def checkpoint(self) -> tuple[int, dict | None]:
        """(cleaned_offset, last_run): the compaction horizon (-1: never compacted)."""
        raise NotImplementedError

    def log_path(self, base: int) -> str:
        """The .log of the segment based at ``base`` (in the partition's directory)."""
        return f"{self.dir}/{fn.base_name(base)}{fn.LOG_SUFFIX}"

    def index_path(self, base: int) -> str:
        return f"{self.dir}/{fn.base_name(base)}{fn.INDEX_SUFFIX}"

    @property
    def sealed_segments(self) -> list[Segment]:
        """Segments that compaction may rewrite."""
        raise NotImplementedError

    @property
    def active_base(self) -> int:
        """First offset that is not in a sealed segment (where the active segment starts)."""
        raise NotImplementedError

    @property
    def active_bytes(self) -> int:
        raise NotImplementedError

    def next_offset_floor(self) -> int:
        """The log end offset its catalog file records (0: none): what survives a compaction
        that empties the tail, and what a damaged index cannot move back."""
        return 0

    # -- offsets, from the segments --------------------------------------------------------------

    @property
    def first_offset(self) -> int:
        for seg in self.segments:
            listed = seg.listed()  # a manifest or segment-list entry answers without the .bcq
            if listed is not None:
                if listed[0]:
                    return listed[1]
                continue
            e = seg.entries()
            if e.shape[0]:
                return int(e[0]["offset"])
        return self.next_offset

    @property
    def last_offset(self) -> int:
        """Offset of the last indexed record, -1 when there is none."""
        for seg in reversed(self.segments):
            listed = seg.listed()
            if listed is not None:
                if listed[0]:
                    return listed[2]
                continue
            e = seg.entries()
            if e.shape[0]:
                return int(e[-1]["offset"])
        return -1

    @property
    def next_offset(self) -> int:
        base = self.segments[-1].base if self.segments else 0
        return max(self.last_offset + 1, base, self.next_offset_floor(), self.source_next)

    #: where the source goes on past the last record (``PartitionLog.advance_next_offset``:
    #: transaction markers, aborted records); 0: nowhere. Recorded by the next list or manifest.
    source_next = 0

    def advance_source_next(self, offset: int) -> None:
        """The source goes on at ``offset`` (``PartitionLog.advance_next_offset``): an object
        store's next manifest records it; a local list records it at once (LocalCatalog)."""
        self.source_next = offset

    def segment_for(self, offset: int) -> int:
        """Index of the segment whose range holds ``offset`` (0 if before the first). Segments
        whose manifest bitmap says they hold no offset >= ``offset`` (a target in a gap at the
        end of a segment) are stepped over, so a read from there fetches no index it does not
        need (len(segments): none holds one)."""
        segs = self.segments
        i = max(0, bisect.bisect_right([s.base for s in segs], offset) - 1)
        while i < len(segs) and segs[i].bitmap_desc is not None \
                and segs[i].bitmap_desc.offset_at_or_after(offset) is None:
            i += 1
        return i

    def find(self, base: int) -> Segment | None:
        for seg in reversed(self.segments):
            if seg.base == base:
                return seg
        return None

    # -- a writer's steps (nothing to record, by default) ------------------------------------------

    def segment_opened(self, base: int) -> None:
        """A writer started an empty active segment at ``base`` (its files exist)."""

    def segment_dropped(self, base: int) -> None:
        """An empty active segment a roll renamed forward is gone."""

    def before_append(self) -> None:
        """A writer is about to change its active segment."""

    def after_sync(self, *, closing: bool) -> None:
        """A writer fsynced what it appended (``closing``: and closes the partition)."""

    def list_state(self):
        """What ``restore_list_state`` puts back (a roll taken back)."""
        return None

    def restore_list_state(self, state) -> None:
        pass

    def roll_by_publishing(self, part, writer: str) -> bool | None:
        """A writer's roll to the next offset (``PartitionLog.roll`` without a base): None when
        the catalog rolls by starting a new segment, else whether it published instead."""
        return None

    def publish(self, part, writer: str) -> bool:
        """Publish a writer's segments (an object store); whether anything was committed."""
        return False

    #: a compaction's outputs are staged in this view, to be published (an object store)
    has_staged = False

    def reload(self, max_age_s: float = 0.0) -> None:
        """Re-read the catalog file unless it was read less than ``max_age_s`` ago."""

    def reread(self) -> None:
        """A read-only view's read failed (a swap or a split under it): list again."""
        self.refresh()

    def shared_piece(self, part):
        """What this partition adds to a writer's shared object (an object store with shared
        uploads: reput/catalog_manifest.py); None: nothing."""
        return None

    def join_parts(self, shared: list, max_bytes: int | None = None) -> list:
        """Local segments holding the parts of shared objects ``shared`` (none here)."""
        return []

    @property
    def shared_objects(self) -> int:
        """How many shared objects the partition's reads depend on."""
        return 0

    def oldest_part_ms(self) -> int | None:
        """When its oldest part of a shared object was written (None: it has none)."""
        return None

    def last_compaction_ms(self) -> int | None:
        """When the last compaction's result was recorded (None: unknown)."""
        return None

    def collect_garbage(self) -> list[str]:
        """Delete what no reader can need any more; the deleted paths."""
        return []

    def recover(self, recovery) -> None:
        """A writer's open: repair what a crashed writer left (``recovery``: the partition's
        recovery step, reput/partition_recovery.py)."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------

    def _segment(self, base: int, log_size: int, index_size: int, *, kind: str = "file",
                 log_rel: str | None = None, bcq_rel: str | None = None,
                 desc: SegmentDesc | None = None, open_tail: bool = False,
                 reuse: Segment | None = None) -> Segment:
        """A listed segment as an object of its kind (``segment.open_segment``): "file" in the
        partition's directory (on ``local_fs``), "remote" an object of the store's, "staged" a
        local file at ``log_rel``/``bcq_rel``."""
        name = fn.base_name(base)
        return open_segment(self.ctx, base, log_size, index_size,
                            fs=self.fs if kind == "remote" else self.local_fs,
                            log_path=log_rel or f"{self.dir}/{name}{fn.LOG_SUFFIX}",
                            bcq_path=bcq_rel or f"{self.dir}/{name}{fn.INDEX_SUFFIX}",
                            kind=kind, desc=desc, open_tail=open_tail, reuse=reuse)

    def _file_bases(self, fs: Backend) -> tuple[set[int], set[int]]:
        """(bases of the .log files, bases of the .bcq files) in the partition's directory."""
        logs, idxs = set(), set()
        for name in fs.listdir(self.dir):
            parsed = fn.parse_base(name)
            if parsed:
                (logs if parsed[1] == "log" else idxs).add(parsed[0])
        return logs, idxs


__all__ = ["SegmentCatalog"]
