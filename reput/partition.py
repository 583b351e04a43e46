"""A topic-partition's compaction log: its segments, their catalog, and its one writer.

Spec: docs/formats/bcq.md (index) and docs/formats/record.md (data); a sealed segment may be a
Kafka log segment (docs/formats/segment-v2.md). Segments are named by the 20-digit base offset
(the first offset the segment may hold); each holds the offsets from its base up to the next
segment's base. Records are appended byte for byte as reput found them in the commit log:
first the .log bytes, then the .bcq entries, so an entry never points past its data. Every read
goes through the partition reader (reput/reader.py) and the segments themselves
(reput/segment.py), which check each record and never serve one that fails.

A ``PartitionLog`` HOLDS (Kafka's ``LocalLog`` / ``LogSegments`` / ``LogLoader``):

* a **catalog** (reput/catalog.py): a local store's directory and segment list
  (``LocalCatalog``, reput/catalog_local.py) or an object store's partition manifest
  (``ManifestCatalog``, reput/catalog_manifest.py), picked here once by whether the store's
  files can be appended to; it lists the segments, each an object of its kind;
* a **recovery step** (``Recovery``, reput/partition_recovery.py), run when a writer opens;
* the **writer** (this file): the active segment's open files, ``append``, ``roll`` (at
  ``segment.bytes`` and by the time rules), ``sync``, ``close``. The injected clock
  (``clock``, the store's) is the "now" of every decision about what is kept.

(Over 600 lines: the writer's roll, append and sync keep the catalog's invariants in one place.)
"""

from __future__ import annotations

import bisect
from typing import Iterator

import numpy as np

from . import bcq as B
from . import filenames as fn
from .backend import AppendFile, Backend
from .catalog import SegmentCatalog
from .config import SYSTEM_CLOCK, Clock, TopicConfig
from .errors import ReputError
from .locks import FileLock, held_by_writer
from .catalog_local import LocalCatalog
from .catalog_manifest import ManifestCatalog
from .partition_recovery import Recovery
from .columns import RecordColumns, stored_records
from .reader import PartitionReader
from .record import Record, Scan, scan
from .segment import PartitionContext, Segment
from .segment_v1 import RecordSegment
from .segment_list import crc32c

__all__ = ["PartitionLog", "Segment"]


class PartitionLog:
    """One partition of a store, read-only or as its (one) writer; see the module docstring.

    (About 600 lines on purpose: the writer - append, roll, sync, close - keeps the catalog's
    invariants in one place; the catalog, the segments, recovery and the reader are their own
    classes.)

    ``require_list``: the store keeps a segment list per partition (store.json says so), so a
    partition with segments and no list is refused rather than read as an old store's.
    ``strict=False`` (``kcompact verify``): a read-only view that disagrees with its segment
    list, or whose list is damaged, still opens; ``problems`` says what is wrong."""

    def __init__(self, fs: Backend, topic: str, partition: int, secret: bytes,
                 config: TopicConfig = TopicConfig(), *, writable: bool = False,
                 sub: str | None = None, local_fs: Backend | None = None,
                 clock: Clock = SYSTEM_CLOCK, require_list: bool = False,
                 strict: bool = True, holder: str | None = None):
        if not fs.appendable and sub is not None:
            # a sub-directory (a replica's pull, a merge) is local scratch on an object store
            if local_fs is None:
                raise ReputError(f"{fs.url}: {sub}/ of {topic}-{partition} needs a local "
                                 "directory on an object store (pass local_fs)")
            fs = local_fs
        if not fs.appendable and writable and local_fs is None:
            raise ReputError(f"{fs.url}: writing {topic}-{partition} needs a local directory "
                             "for its active segment (the store's commitlog_dir)")
        self.fs, self.topic, self.partition, self.secret = fs, topic, partition, secret
        self.topic_bytes = topic.encode()
        #: what its segments share (reput/segment.py)
        self.ctx = PartitionContext(topic, partition, secret, writable)
        self.config = config
        #: the codec the source's batches of this partition have (Store.source_codec; None:
        #: unknown): what ``compression.type=producer`` seals format-1 records with
        self.source_codec: int | None = None
        self.clock = clock
        self.sub = sub
        self.dir = fn.partition_dir(topic, partition) + (f"/{sub}" if sub else "")
        self.writable = writable
        #: which segments it holds: its segment list, or (files that cannot be appended to:
        #: an object store) its manifest, with a writer's active segments in ``local_fs``.
        #: Private: callers go through this class's methods (docs/architecture.md)
        self._catalog: SegmentCatalog = (
            LocalCatalog(fs, self.dir, self.ctx, writable=writable, keeps_list=sub is None,
                         require_list=require_list, strict=strict) if fs.appendable else
            ManifestCatalog(fs, local_fs or fs, self.dir, self.ctx, writable=writable,
                            clock=clock))
        #: where "file" segments live: the store itself, or the local directory on S3
        self.local_fs: Backend = self._catalog.local_fs
        #: the writer's open-time repair (and what it repaired)
        self.recovery = Recovery()
        self._log: AppendFile | None = None
        self._idx: AppendFile | None = None
        self._dirty_files: list[AppendFile] = []
        #: a shared-upload writer's last committed local segment's files, which the next
        #: segment takes over (``reuse_files_of``; reput/segment_recycle.py ``Spare``)
        self._spare = None
        #: a shared-upload writer's active segments in memory (reput/active_memory.py; set by
        #: its publisher): a new segment starts there while it has room, else on local_fs
        self.active_memory = None
        self._entry_scratch = np.empty(0, np.uint8)
        self._before_roll = None
        self._writer_lock: FileLock | None = None
        #: (active segment base, first record timestamp) and (base, writer clock at its first
        #: append): the roll rules' memory (``_roll_cut``, ``roll_if_due``)
        self._first_ts: tuple[int, int] | None = None
        self._active_since: tuple[int, int] | None = None
        #: the store's ``require_format`` (set by Store): called before a format-2 segment is
        #: written; segments rolled by this writer, sealed into format 2 at the next sync
        self.require_format = None
        self._to_seal: list[int] = []
        #: set by a Store whose writer seals in the background (reput/seal.py's Sealer): sync
        #: hands it each rolled segment (``seal_queue(self, base)``) instead of sealing inline
        self.seal_queue = None
        if writable:
            lock = FileLock(self.local_fs, f"{self.dir}/{fn.LOCK_FILE}")
            if not lock.acquire(blocking=False, holder=holder):
                from .errors import StoreLockedError
                by = lock.holder()
                raise StoreLockedError(
                    f"{self.dir} is being written by another process"
                    f"{f' ({by})' if by else ''}; one writer per partition at a time",
                    by_writer=held_by_writer(by))
            self._writer_lock = lock
        try:
            if writable:
                self._catalog.load()
                self.recovery.run(self._catalog)
            else:
                self._catalog.refresh()
        except BaseException:
            if self._writer_lock is not None:
                self._writer_lock.release()
                self._writer_lock = None
            raise

    # -- what its catalog and recovery step say -------------------------------------------------

    @property
    def segments(self) -> list[Segment]:
        return self._catalog.segments

    @segments.setter
    def segments(self, segs: list[Segment]) -> None:
        self._catalog.segments = segs

    @property
    def manifest(self):
        """The partition manifest as last read (an object store's; None otherwise)."""
        return self._catalog.manifest

    @property
    def seglist(self):
        """The segment list as last read or written (a local store's; None otherwise)."""
        return self._catalog.seglist

    @property
    def problems(self) -> list:
        """Where the files disagree with the segment list (``strict=False``)."""
        return self._catalog.problems

    @property
    def strays(self) -> list[int]:
        return self._catalog.strays

    @property
    def keeps_list(self) -> bool:
        return self._catalog.keeps_list

    @property
    def recovered_entries(self) -> int:
        return self.recovery.recovered_entries

    @property
    def truncated_bytes(self) -> int:
        return self.recovery.truncated_bytes

    @property
    def swap_recovered(self) -> bool:
        return self.recovery.swap_recovered

    def log_path(self, base: int) -> str:
        """The .log of the segment based at ``base`` (a manifest's object name on S3)."""
        return self._catalog.log_path(base)

    def index_path(self, base: int) -> str:
        return self._catalog.index_path(base)

    @property
    def grace_ms(self) -> int:
        return int(getattr(self.fs, "grace_ms", 0))

    def checkpoint(self) -> tuple[int, dict | None]:
        """(cleaned_offset, last_run): the compaction horizon (-1: never compacted)."""
        return self._catalog.checkpoint()

    @property
    def sealed_segments(self) -> list[Segment]:
        """Segments that compaction may rewrite: all but the active one on a local store; on
        S3 the committed (and staged) ones, never a writer's local segments."""
        return self._catalog.sealed_segments

    @property
    def active_base(self) -> int:
        """First offset that is not in a sealed segment (where the active segment starts)."""
        return self._catalog.active_base

    @property
    def active_bytes(self) -> int:
        return self._catalog.active_bytes

    def refresh(self) -> None:
        """Pick up what other processes appended or compacted since this object looked."""
        if not self.writable:
            self._catalog.refresh()

    def reread(self) -> None:
        """A read failed (a compaction swap or a split under it): list the segments again
        (a read-only view; the partition reader's retry)."""
        if not self.writable:
            self._catalog.reread()

    def reload_after_swap(self) -> None:
        """Re-list segments after a compaction swap, keeping the active segment's open files."""
        active = self.segments[-1] if self.segments else None
        for seg in self.segments:
            if seg is not active:
                seg.invalidate()
        keep_log, keep_idx = self._log, self._idx
        self._catalog.load()
        if active is not None and (not self.segments or self.segments[-1].base != active.base):
            # the active segment was replaced (a forced compaction of an idle partition)
            self._close_files()
            keep_log = keep_idx = None
        self._log, self._idx = keep_log, keep_idx

    # -- an object store's publishing (ManifestCatalog; the compactor, a replica's install) -----

    def reload_manifest(self, max_age_s: float = 0.0, *, from_first: bool = False) -> None:
        """Pick up manifest versions committed by other processes (one listing request),
        unless the manifest was read less than ``max_age_s`` ago (an object store).
        ``from_first``: the partition's own manifest objects listed from the first version,
        nothing assumed (`kcompact verify`: not the store catalog's copy of the newest, so a
        lost version is damage); a local store has nothing to reload."""
        if from_first:
            self._catalog.manifest = None
        self._catalog.reload(max_age_s)

    def publish(self, writer: str = "writer") -> bool:
        """S3: upload the writer's local segments and commit them (``ManifestCatalog.publish``);
        whether a manifest version was committed (a local store: nothing to publish)."""
        return self._catalog.publish(self, writer) if self.writable else False

    def publish_through(self, publish_shared) -> None:
        """A writer with shared uploads: every publish of this partition (a roll, a close, a
        forced compaction) is ``publish_shared()``, the store's one object for all its
        partitions (reput/publisher.py ``SharedPublisher``)."""
        self._catalog.publish_shared = publish_shared

    def shared_piece(self):
        """What this partition adds to its writer's next shared object (None: nothing;
        reput/catalog_manifest.py ``SharedPiece``)."""
        return self._catalog.shared_piece(self)

    def join_parts(self, shared: list[Segment], max_bytes: int | None = None
                   ) -> list[tuple[int, str, str]]:
        """The split of shared objects (docs/formats/shared-upload.md): ``shared``'s batches
        joined into staged local segments (base, .log, .bcq), for ``stage_swap``."""
        return self._catalog.join_parts(shared, max_bytes)

    @property
    def shared_objects(self) -> int:
        """How many shared objects the partition's reads depend on (inspect)."""
        return self._catalog.shared_objects

    def oldest_part_ms(self) -> int | None:
        """When its oldest part of a shared object was written (None: none)."""
        return self._catalog.oldest_part_ms()

    def last_compaction_ms(self) -> int | None:
        """When the last compaction's result was recorded (None: unknown, e.g. an object
        store, which keeps the last run in its manifest)."""
        return self._catalog.last_compaction_ms()

    def collect_garbage(self) -> list[str]:
        """S3: delete replaced segments, orphans and old manifest versions past the grace
        period. Returns the deleted paths."""
        return self._catalog.collect_garbage()

    @property
    def has_staged(self) -> bool:
        return self._catalog.has_staged

    @property
    def staging_dir(self) -> str:
        return self._catalog.staging_dir

    def staging_paths(self, base: int) -> tuple[str, str]:
        return self._catalog.staging_paths(base)

    def stage_swap(self, inputs: list[int], outputs: list[tuple[int, str, str]],
                   cleaned_offset: int | None, last_run: dict | None = None) -> None:
        self._catalog.stage_swap(inputs, outputs, cleaned_offset, last_run)

    @property
    def staged_segments(self) -> list[Segment]:
        """A pending compaction's outputs (local files, not yet uploaded; an object store)."""
        return self._catalog.staged_segments

    def commit_staged(self, writer: str = "compactor", last_run: dict | None = None, *,
                      placed: dict | None = None) -> bool:
        """Publish what ``stage_swap`` staged (one manifest version; an object store).
        ``placed``: the staged outputs (by base) already uploaded in a compaction object
        (reput/compaction_object.py)."""
        return self._catalog.commit_staged(writer, last_run, placed=placed)

    def abort_staged(self) -> None:
        self._catalog.abort_staged()

    def install_segments(self, local_dir: str, bases: list[int], last_run: dict | None,
                         writer: str = "replica", cleaned_offset: int = -1) -> bool:
        return self._catalog.install_segments(self, local_dir, bases, last_run, writer,
                                             cleaned_offset)

    # -- index access --------------------------------------------------------------------

    @property
    def first_offset(self) -> int:
        return self._catalog.first_offset

    @property
    def last_offset(self) -> int:
        """Offset of the last indexed record, -1 when there is none."""
        return self._catalog.last_offset

    @property
    def next_offset(self) -> int:
        """The log end offset (a catalog's own record of it survives a compaction that empties
        the tail, and a damaged .bcq cannot move it back)."""
        return self._catalog.next_offset

    def advance_next_offset(self, offset: int) -> bool:
        """Writer: the source partition goes on at ``offset``, past the last record stored here
        (transaction markers, aborted records that a read_committed consumer stepped over).
        Make it the partition's next offset, so that readers' end offsets and a resuming
        writer's start are the source's. Call it once every record below ``offset`` is durable
        (``Store.flush`` does): a local store lists it at once (segment list), an object store
        commits it with the next publish (manifest). Returns whether it moved."""
        if offset <= self.next_offset:
            return False
        self._catalog.advance_source_next(offset)
        return True

    def record_count(self) -> int:
        return sum(seg.count() for seg in self.segments)

    def size_bytes(self) -> int:
        return sum(s.log_size for s in self.segments)

    def segment_for(self, offset: int) -> int:
        """Index of the segment whose range holds ``offset`` (``SegmentCatalog.segment_for``)."""
        return self._catalog.segment_for(offset)

    def holds(self, offset: int) -> bool:
        """Whether the partition holds a record at ``offset``; a committed segment on an
        object store answers from its manifest bitmap (no request)."""
        i = bisect.bisect_right([s.base for s in self.segments], offset) - 1
        if i < 0:
            return False
        seg = self.segments[i]
        if seg.bitmap_desc is not None:
            return seg.bitmap_desc.holds(offset)
        idx = seg.index()
        j = int(idx.lower_bound(offset))
        return j < idx.n and int(idx.entries[j]["offset"]) == offset

    def offset_at_or_after(self, offset: int) -> int | None:
        """The first offset >= ``offset`` the partition holds (None: none), where a read from
        ``offset`` starts; from the manifest bitmaps on an object store (no request)."""
        for seg in self.segments[self.segment_for(offset):]:
            if seg.bitmap_desc is not None:
                nxt = seg.bitmap_desc.offset_at_or_after(offset)
                if nxt is not None:
                    return nxt
                continue
            idx = seg.index()
            j = int(idx.lower_bound(offset))
            if j < idx.n:
                return int(idx.entries[j]["offset"])
        return None

    # -- append (writer) -----------------------------------------------------------------

    def _active_files(self) -> tuple[Segment, AppendFile, AppendFile]:
        seg = self.segments[-1]
        assert seg.kind == "file", "appending to a sealed object"
        if not seg.appendable:
            raise ReputError(f"{seg.log_path}: a sealed {type(seg).__name__} is never appended "
                             "to; roll the partition first")
        if self._log is None:
            # a new segment's .bcq is created first: a crash between the two leaves an empty
            # .bcq without its .log (deleted on open), never a .log without its .bcq
            self._idx = seg.fs.open_append(seg.bcq_path)
            self._log = seg.fs.open_append(seg.log_path)
            self._dirty_files += [self._log, self._idx]
        return seg, self._log, self._idx

    def _new_segment(self, base: int) -> Segment:
        """Start an empty active segment at ``base``: its files, then (a local store) the list
        naming it, open."""
        self._close_files()
        name = fn.base_name(base)
        log_path = f"{self.dir}/{name}{fn.LOG_SUFFIX}"
        bcq_path = f"{self.dir}/{name}{fn.INDEX_SUFFIX}"
        mem = self.active_memory
        if mem is not None and mem.has_room():
            fs = mem  # (no file: the commit log holds these records until the journal commit)
            self._drop_spare()
        else:
            fs = self.local_fs
            self._take_spare(log_path, bcq_path)
        seg = RecordSegment(self.ctx, base, 0, 0, fs=fs, log_path=log_path,
                            bcq_path=bcq_path, open_tail=True)
        seg.bcq_crc, seg.bcq_crc_size = 0, 0
        self.segments.append(seg)
        self._active_files()
        self._catalog.segment_opened(base)
        return seg

    def reuse_files_of(self, seg: Segment) -> None:
        """A shared-upload writer's local segment just committed (its records are in the
        journal, it is out of the view): its two files are emptied in the background and the
        partition's next segment takes them over (reput/segment_recycle.py), instead of 2
        deletes and 2 creates a partition a flush."""
        from .segment_recycle import recycle
        self._drop_spare()
        if seg.fs is not self.local_fs:  # (in memory: nothing to reuse)
            seg.fs.delete(seg.log_path)
            seg.fs.delete(seg.bcq_path)
            seg.invalidate()
            return
        self._spare = recycle(self.local_fs, seg)

    def _take_spare(self, log_path: str, bcq_path: str) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.take(log_path, bcq_path)

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.drop()

    def roll(self, base: int | None = None, *, writer: str = "writer", seal: bool = True) -> bool:
        """Seal the active segment and start an empty one at ``base`` (default: next offset),
        so that compaction may clean what it holds. Crash-safe: the sealed segment's files are
        fsynced before the new one is created, and the directory after, so a crash leaves
        either the old segment active or the new one, never a segment based past records that
        a re-dispatch would then append to it; the segment list names the new segment (open)
        once its files exist. On an object store (``base`` None) the writer's local segments
        are published instead (uploaded and committed to the manifest). Returns whether it rolled
        (``unroll`` takes a local roll back while nothing was appended).

        Called on append (``segment.bytes``, the time rule: ``_roll_cut``), by ``roll_if_due``,
        when a batch job ends, and by ``kcompact compact`` on a partition no writer holds. The
        rolled segment is re-encoded into format 2 at the next ``sync`` (reput/seal.py;
        ``seal=False``: not, e.g. when a compaction rewrites it at once)."""
        if base is None:
            published = self._catalog.roll_by_publishing(self, writer)
            if published is not None:
                return published
        base = self.next_offset if base is None else base
        if self.segments and self.segments[-1].base == base:
            return False
        before = (self._catalog.list_state(), len(self.segments))
        self._before_roll = None
        rolled = (self.segments[-1].base if seal and self.writable and self._catalog.seals_rolled
                  and self.segments and self.segments[-1].log_size > 0
                  and self.segments[-1].kind == "file" else None)
        if self.segments and self.segments[-1].log_size == 0 and self.segments[-1].kind == "file":
            # an empty active segment is renamed forward rather than left behind: the new
            # files, the list without it, then its files go (empty: nothing is lost between)
            self._close_files()
            old = self.segments.pop()
            self._catalog.segment_dropped(old.base)
            self._new_segment(base)  # (nothing to take back to)
            old.fs.delete(old.log_path)
            old.fs.delete(old.bcq_path)
            self.local_fs.sync_dir(self.dir)
            return True
        self.sync()
        self._new_segment(base)
        self.local_fs.sync_dir(self.dir)
        if rolled is not None:  # sealed at the next sync (this one ran before the roll)
            self._to_seal.append(rolled)
        self._before_roll = before + (self.seglist.version if self.seglist else None,)
        return True

    def roll_if_due(self, now_ms: int | None = None) -> bool:
        """Roll the active segment when it has been open for longer than the topic's roll time
        (``TopicConfig.roll_ms``: min(segment.ms, max.compaction.lag.ms) for a compacted topic)
        by the writer's clock, counted from its first append in this process: what a long-
        running writer calls while its topic is idle (Kafka rolls only on the next append).
        Not on an object store, where every flush publishes. Returns whether it rolled."""
        seg = self.segments[-1] if self.segments else None
        if (not self.writable or not self._catalog.rolls_by_time or seg is None
                or seg.kind != "file"
                or seg.log_size == 0):
            return False
        now = self.clock.ms() if now_ms is None else now_ms
        if self._active_since is None or self._active_since[0] != seg.base:
            # opened with records in it: its age is unknown, so it counts from now
            self._active_since = (seg.base, now)
        if now - self._active_since[1] <= self.config.roll_ms:
            return False
        self.roll()
        return True

    def _roll_cut(self, seg: Segment, s: Scan, lo: int, hi: int) -> int:
        """How many of records lo..hi-1 may still join the active segment by Kafka's time rule:
        a record whose timestamp is more than ``roll_ms`` past the segment's first record's
        starts a new segment. Timestamps below 0 (none) never roll."""
        roll_ms = self.config.roll_ms
        ts = s.timestamps[lo:hi]
        if self._first_ts is None or self._first_ts[0] != seg.base:
            first = None
            if seg.log_size:
                own = seg.entries()["timestamp"]
                i = np.flatnonzero(own >= 0)
                first = int(own[i[0]]) if i.size else None
            if first is None:
                i = np.flatnonzero(ts >= 0)
                if not i.size:
                    return hi - lo
                first = int(ts[i[0]])
            self._first_ts = (seg.base, first)
        first = self._first_ts[1]
        if roll_ms >= (1 << 63) - 1 - max(first, 0):
            return hi - lo
        over = ts > first + roll_ms
        i = int(np.argmax(over))
        return i if over[i] else hi - lo

    def unroll(self) -> bool:
        """Undo the last ``roll`` while the segment it started is still empty (a forced
        compaction that was refused): the list as it was, the empty segment's files gone.
        Returns whether it did."""
        prev = getattr(self, "_before_roll", None)
        self._before_roll = None
        if prev is None or not self.segments or self.segments[-1].log_size \
                or self.segments[-1].index_size or len(self.segments) != prev[1] + 1 \
                or (self.seglist.version if self.seglist else None) != prev[2]:
            return False  # appended to, or the list changed since (a swap)
        lst = prev[0]
        self.sync()  # (lists nothing: the empty segment is the one open)
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []
        seg = self.segments.pop()
        self._catalog.restore_list_state(lst)
        seg.fs.delete(seg.log_path)
        seg.fs.delete(seg.bcq_path)
        return True

    def _close_files(self) -> None:
        if self._log is not None:
            self._log = self._idx = None  # kept in _dirty_files until the next sync

    def append(self, src: np.ndarray, s: Scan, lo: int, hi: int, *,
               clean_upto: int = -1, clean_time_s: int = 0) -> int:
        """Append records lo..hi-1 of scan ``s`` (their bytes are in ``src``, contiguous).

        Records at or below the last stored offset are skipped (idempotent re-dispatch).
        Returns how many were appended. ``clean_upto``/``clean_time_s``: keyed tombstones at or
        below offset ``clean_upto`` are indexed as first cleaned at ``clean_time_s`` (a replica
        pulling what its master already compacted; bcq.md, ``clean_time``).
        """
        assert self.writable
        tail = self.segments[-1] if self.segments else None
        if (tail is not None and tail.kind == "file" and tail.appendable
                and tail.last_appended is not None
                and tail._appended_index_size == tail.index_size):
            last = tail.last_appended
        else:
            last = self.last_offset
        if hi > lo and s.offsets[lo] <= last:
            lo += int(np.searchsorted(s.offsets[lo:hi], last, side="right"))
        appended = 0
        limit = self.config.segment_bytes
        scratch = self._entry_scratch
        while lo < hi:
            if not self.segments or self.segments[-1].kind != "file":
                # (on S3, after a publish, the next record starts a new local segment)
                self._new_segment(int(s.offsets[lo]))
            self._before_roll = None
            self._catalog.before_append()
            seg, logf, idxf = self._active_files()
            start_byte = int(s.positions[lo])
            ends = s.positions[lo:hi] + s.sizes[lo:hi] - start_byte
            k = int(np.searchsorted(ends, limit - seg.log_size, side="right"))
            k = min(k, self._roll_cut(seg, s, lo, hi))
            if k == 0:
                if seg.log_size > 0:
                    self.roll(int(s.offsets[lo]))
                    continue
                k = 1
            if seg.log_size == 0:
                self._active_since = (seg.base, self.clock.ms())
            end_byte = start_byte + int(ends[k - 1])
            if scratch.shape[0] < k * B.ENTRY_SIZE:
                scratch = self._entry_scratch = np.empty(k * B.ENTRY_SIZE, np.uint8)
            entries = B.entries_from_scan(s, lo, lo + k, seg.log_size - start_byte, scratch)
            if clean_upto >= 0 and clean_time_s > 0 and int(s.offsets[lo]) <= clean_upto:
                e = entries.view(B.BCQ_DTYPE)
                stamp = (e["flags"] & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS)) == B.FLAG_TOMBSTONE
                stamp &= e["offset"] <= clean_upto
                e["clean_time"][stamp] = np.uint32(clean_time_s)
            raw = entries.view(np.uint8)
            if seg.bcq_crc_size == seg.index_size:  # the list's checksum of this .bcq
                seg.bcq_crc = crc32c(raw, seg.bcq_crc)
                seg.bcq_crc_size += raw.shape[0]
            logf.write(src[start_byte:end_byte])
            idxf.write(raw)
            seg.log_size = logf.size
            seg.index_size = idxf.size
            seg.last_appended = int(s.offsets[lo + k - 1])
            seg._appended_index_size = seg.index_size
            appended += k
            lo += k
        return appended

    def start_writeback(self) -> None:
        """Queue what was appended for writeback to the device without waiting (a bulk
        writer calls it as it goes, so that its final ``sync`` is short)."""
        for f in self._dirty_files:
            f.start_writeback()

    def sync_soon(self) -> None:
        """fdatasync what was appended so far in the background (backend.AppendFile.sync_soon):
        a later ``sync`` finds little left to wait for."""
        for f in self._dirty_files:
            f.sync_soon()

    def sync(self, fsync: bool = True) -> None:
        """fsync what was appended since the last sync; close sealed segments' files; list
        the sizes of the segments sealed since (a local store's segment list). ``fsync``
        False: close without the fsync (an S3 writer with shared uploads: its local segments
        are a cache of the commit log until the journal commit, docs/formats/shared-upload.md)."""
        active = [f for f in (self._log, self._idx) if f is not None]
        for f in self._dirty_files:
            if fsync:
                f.sync()
            if f not in active:
                f.close()
        self._dirty_files = active
        self._catalog.after_sync(closing=False)
        if self._to_seal:
            bases, self._to_seal = self._to_seal, []
            if self.seal_queue is not None:
                for base in bases:
                    self.seal_queue(self, base)
                return
            from .seal import seal_segment
            for base in bases:
                seal_segment(self, base)

    def _sync_and_close_files(self, fsync: bool = True) -> None:
        """fsync what was appended and close every open file (the active segment's too)."""
        self.sync(fsync)
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []

    def close(self, publish: bool = True) -> None:
        """Release the partition. An S3 writer first publishes what it appended (``publish=False``:
        leave it in the local directory, for the next open to upload)."""
        if publish and self.writable and self._writer_lock is not None:
            self.publish()  # (an object store's writer publishes what it appended)
        self._drop_spare()
        self._sync_and_close_files()
        if self._writer_lock is not None:
            self._catalog.after_sync(closing=True)
        for seg in self.segments:
            seg.invalidate()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def append_block(self, block: RecordColumns) -> int:
        """Append the records of a block read from a partition of this topic, byte for byte,
        indexed with this partition's secret (a replica's merge). Returns records appended."""
        data, rel, sizes, _ = stored_records(block)
        if not len(block):
            return 0
        from .record import gather
        buf = gather(data, rel, sizes)
        s = scan(buf, 0, buf.shape[0], secret=self.secret, verify_crc=False)
        if len(s) != len(block):
            raise ReputError(f"{self.dir}: a block of {len(block)} records scanned as {len(s)}")
        return self.append(buf, s, 0, len(s))

    # -- read: reput/reader.py -------------------------------------------------------------

    def read(self, from_offset: int, max_records: int | None = None,
             max_bytes: int | None = None) -> RecordColumns:
        """Records with offset >= from_offset, from one segment at most (``PartitionReader.read``:
        a missing offset continues at the next existing one; at least one record when any
        exists; every record checked; retried across a compaction swap)."""
        return PartitionReader(self).read(from_offset, max_records, max_bytes)

    def iter_records(self, from_offset: int = 0, limit: int | None = None,
                     batch_bytes: int = 4 << 20) -> Iterator[Record]:
        """Decoded records from ``from_offset`` (for dump, restore and tests)."""
        return PartitionReader(self).records(from_offset, limit, batch_bytes)
