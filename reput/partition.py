"""A topic-partition's compaction log: .log data segments, each with its .bcq index.

Spec: docs/formats/bcq.md (index) and docs/formats/record.md (data). Segments are named by the
20-digit base offset (the first offset the segment may hold); each holds the offsets from its
base up to the next segment's base. Records are appended byte for byte as reput found them in
the commit log: first the .log bytes, then the .bcq entries, so an entry never points past its
data. Opening for write recovers (reput/partition_recovery.py). Every read goes through the
partition reader (reput/reader.py), which checks each record against its index entry and its
CRC and never serves a record that fails.

A local partition keeps a segment list (docs/formats/segment-list.md: which segments it holds,
their sizes and .bcq checksums), which readers check the files against:
reput/partition_list.py. On an object store (S3, ``fs.appendable`` false) the segments are the
partition manifest's (docs/formats/manifest.md), never a listing: reput/partition_manifest.py.
The class is split along those seams: this file is the catalog of segments, the index access and
the writer. The writer rolls its active segment at ``segment.bytes`` and by the time rules
(``roll``). The injected clock (``clock``, the store's) is the "now" of every decision about
what is kept.

(About 780 lines after that split: the catalog, the index cache and the writer's roll and append
share the segment list's invariants, kept in one place.)
"""

from __future__ import annotations

import bisect
from typing import Iterator

import numpy as np

from . import bcq as B
from . import bcq2 as B2
from . import filenames as fn
from . import manifest as M
from .backend import AppendFile, Backend
from .config import SYSTEM_CLOCK, Clock, TopicConfig
from .errors import ReputError
from .locks import FileLock
from .partition_list import ListedPartition
from .partition_manifest import ManifestPartition
from .partition_recovery import SegmentRecovery
from .columns import RecordColumns, stored_records
from .reader import PartitionReader
from .record import Record, Scan, scan
from .segment import Segment
from .segment_list import crc32c
from .swap import recover_swap

__all__ = ["PartitionLog", "Segment"]


class PartitionLog(ManifestPartition, ListedPartition, SegmentRecovery):
    """One partition of a store, read-only or as its (one) writer; see the module docstring.

    ``require_list``: the store keeps a segment list per partition (store.json says so), so a
    partition with segments and no list is refused rather than read as an old store's.
    ``strict=False`` (``kcompact verify``): a read-only view that disagrees with its segment
    list, or whose list is damaged, still opens; ``problems`` says what is wrong."""

    def __init__(self, fs: Backend, topic: str, partition: int, secret: bytes,
                 config: TopicConfig = TopicConfig(), *, writable: bool = False,
                 sub: str | None = None, local_fs: Backend | None = None,
                 clock: Clock = SYSTEM_CLOCK, require_list: bool = False,
                 strict: bool = True):
        if not fs.appendable and sub is not None:
            # a sub-directory (a replica's pull, a merge) is local scratch on an object store
            if local_fs is None:
                raise ReputError(f"{fs.url}: {sub}/ of {topic}-{partition} needs a local "
                                 "directory on an object store (pass local_fs)")
            fs = local_fs
        #: segments come from the partition manifest (an object store), not a listing
        self.manifest_mode = not fs.appendable
        if self.manifest_mode and writable and local_fs is None:
            raise ReputError(f"{fs.url}: writing {topic}-{partition} needs a local directory "
                             "for its active segment (the store's commitlog_dir)")
        self.fs, self.topic, self.partition, self.secret = fs, topic, partition, secret
        self.topic_bytes = topic.encode()
        #: where "file" segments live: the store itself, or the local directory on S3
        self.local_fs: Backend = (local_fs or fs) if self.manifest_mode else fs
        self.config = config
        self.clock = clock
        self.sub = sub
        self.dir = fn.partition_dir(topic, partition) + (f"/{sub}" if sub else "")
        self.writable = writable
        #: a local store's partition keeps segments.json (scratch partitions do not)
        self.keeps_list = not self.manifest_mode and sub is None
        self.require_list = require_list
        self.strict = strict
        self.seglist = None          # the segment list as last read or written
        self.problems: list = []     # where the files disagree with it (partition_list.py)
        self.strays: list[int] = []  # bases of empty segment files it does not name
        self._listed_open: set[int] = set()
        self.segments: list[Segment] = []
        self._log: AppendFile | None = None
        self._idx: AppendFile | None = None
        self._dirty_files: list[AppendFile] = []
        self.recovered_entries = 0
        self.truncated_bytes = 0
        self._entry_scratch = np.empty(0, np.uint8)
        self.swap_recovered = False
        self._orphan_indexes: list[int] = []
        self._before_roll = None
        self.manifest: M.Manifest | None = None
        self._staged: list[Segment] = []
        self._replaced: dict[str, M.SegmentEntry] = {}
        self._pending_cleaned: int | None = None
        self._pending_run: dict | None = None
        self._pending = False
        self._local_listed = False
        self._manifest_read_at = 0.0
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
            self._writer_lock = FileLock(self.local_fs, f"{self.dir}/{fn.LOCK_FILE}")
            if not self._writer_lock.acquire(blocking=False):
                self._writer_lock = None
                from .errors import StoreLockedError
                raise StoreLockedError(f"{self.dir} is being written by another process; one "
                                       "writer per partition at a time")
        try:
            if not writable and not self.manifest_mode:
                self._finish_committed_swap()
            self._load()
            if writable:
                self.recover()
        except BaseException:
            if self._writer_lock is not None:
                self._writer_lock.release()
                self._writer_lock = None
            raise

    # -- paths ---------------------------------------------------------------------------

    def _find(self, base: int) -> Segment | None:
        for seg in reversed(self.segments):
            if seg.base == base:
                return seg
        return None

    def log_path(self, base: int) -> str:
        """The .log of the segment based at ``base`` (a manifest's object name on S3)."""
        seg = self._find(base) if self.manifest_mode else None
        if seg is not None and seg.log_rel:
            return seg.log_rel
        return f"{self.dir}/{fn.base_name(base)}{fn.LOG_SUFFIX}"

    def index_path(self, base: int) -> str:
        seg = self._find(base) if self.manifest_mode else None
        if seg is not None and seg.bcq_rel:
            return seg.bcq_rel
        return f"{self.dir}/{fn.base_name(base)}{fn.INDEX_SUFFIX}"

    def seg_log_path(self, seg: Segment) -> str:
        return seg.log_rel or f"{self.dir}/{fn.base_name(seg.base)}{fn.LOG_SUFFIX}"

    def seg_index_path(self, seg: Segment) -> str:
        return seg.bcq_rel or f"{self.dir}/{fn.base_name(seg.base)}{fn.INDEX_SUFFIX}"

    def seg_fs(self, seg: Segment) -> Backend:
        """The backend holding a segment's files: the store's, or the local directory's."""
        return self.fs if seg.kind == "remote" else self.local_fs

    def read_log(self, seg: Segment, start: int, length: int) -> bytes:
        """Bytes of a segment's .log (through the block cache for an S3 object)."""
        return self.seg_fs(seg).read(self.seg_log_path(seg), start, length)

    def log_bytes(self, seg: Segment, start: int, length: int) -> np.ndarray:
        """``read_log`` as a uint8 array; a sealed format-2 segment on local disk is mapped once
        (its .log never changes: a seal or a compaction replaces it by rename) and sliced."""
        if seg.kind == "file" and not seg.open_tail and seg.format == 2 and seg.log_size:
            m = seg._log_map
            if m is None or m.shape[0] != seg.log_size:
                m = seg._log_map = self.seg_fs(seg).map(self.seg_log_path(seg),
                                               seg.log_size).view(np.ndarray)
            return m[start:start + length]
        return np.frombuffer(self.read_log(seg, start, length), np.uint8)

    def open_log(self, seg: Segment):
        """A sequential stream of a segment's .log (one request on an object store)."""
        return self.seg_fs(seg).open_read(self.seg_log_path(seg))

    @property
    def grace_ms(self) -> int:
        return int(getattr(self.fs, "grace_ms", 0))

    # -- load / refresh ------------------------------------------------------------------

    def _load(self) -> None:
        if self.manifest_mode:
            self._load_manifest(self.manifest)
            return
        self._load_local()
        if self.seglist is not None:
            self._listed_open = {m.base for m in self.seglist.segments if m.open}

    def _listed_bases(self, fs: Backend) -> tuple[set[int], set[int]]:
        """(bases of the .log files, bases of the .bcq files) in this partition's directory."""
        logs, idxs = set(), set()
        for name in fs.listdir(self.dir):
            parsed = fn.parse_base(name)
            if parsed:
                (logs if parsed[1] == "log" else idxs).add(parsed[0])
        return logs, idxs

    def checkpoint(self) -> tuple[int, dict | None]:
        """(cleaned_offset, last_run): the compaction horizon (-1: never compacted)."""
        if not self.manifest_mode:
            from .swap import read_checkpoint
            return read_checkpoint(self.fs, self.dir)
        m = self.manifest
        cleaned = self._pending_cleaned if self._pending_cleaned is not None else (
            m.cleaned_offset if m else -1)
        return cleaned, self._pending_run or (m.last_run if m else None)

    @property
    def sealed_segments(self) -> list[Segment]:
        """Segments that compaction may rewrite: all but the active one on a local store; on
        S3 the committed (and staged) ones, never a writer's local segments."""
        if not self.manifest_mode:
            return self.segments[:-1]
        return [s for s in self.segments if s.kind != "file"]

    @property
    def active_base(self) -> int:
        """First offset that is not in a sealed segment (where the active segment starts)."""
        if not self.manifest_mode:
            return self.segments[-1].base if self.segments else 0
        local = [s for s in self.segments if s.kind == "file"]
        return local[0].base if local else self.next_offset

    @property
    def active_bytes(self) -> int:
        if not self.manifest_mode:
            return self.segments[-1].log_size if self.segments else 0
        return sum(s.log_size for s in self.segments if s.kind == "file")

    def refresh(self) -> None:
        """Pick up what other processes appended or compacted since this object looked."""
        if not self.writable:
            self._finish_committed_swap()
            self._load()

    def _finish_committed_swap(self) -> None:
        """A compaction that died after its commit point leaves swap.json behind; until someone
        applies it the .log/.bcq pairs may not match. Any reader may finish it (the apply is
        idempotent and never touches the active segment) unless a live compactor holds the
        lock, in which case it is applying right now and the read retry covers it."""
        from .swap import PLAN_NAME, staging_dir
        if not self.fs.exists(f"{staging_dir(self.dir)}/{PLAN_NAME}"):
            return
        lock = FileLock(self.fs, f"{self.dir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                # ... and no live writer, which rewrites the segment list as it appends
                writer = FileLock(self.fs, f"{self.dir}/{fn.LOCK_FILE}")
                if writer.acquire(blocking=False):
                    try:
                        recover_swap(self.fs, self.dir)
                    finally:
                        writer.release()
                for seg in self.segments:
                    seg.invalidate()
            finally:
                lock.release()

    def reload_after_swap(self) -> None:
        """Re-list segments after a compaction swap, keeping the active segment's open files."""
        active = self.segments[-1] if self.segments else None
        for seg in self.segments:
            if seg is not active:
                seg.invalidate()
        keep_log, keep_idx = self._log, self._idx
        self._load()
        if active is not None and (not self.segments or self.segments[-1].base != active.base):
            # the active segment was replaced (a forced compaction of an idle partition)
            self._close_files()
            keep_log = keep_idx = None
        self._log, self._idx = keep_log, keep_idx

    # -- index access --------------------------------------------------------------------

    def entries(self, seg: Segment) -> np.ndarray:
        """The valid index entries of a segment (those whose record lies inside its .log)."""
        if self.seg_format(seg) == 1 and seg.entry_count == 0:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        return self.index(seg).entries

    def seg_format(self, seg: Segment) -> int:
        """The segment's store format (1 or 2, docs/formats/segment-v2.md), from the first bytes
        of its .bcq (a lean index's magic) or its manifest entry; cached until it changes."""
        if seg.format is None:
            if seg.entry is not None:  # the manifest says it (no request)
                seg.format = seg.entry.format
            elif seg.index_size < 8:
                seg.format = 1
            else:
                try:
                    head = self.seg_fs(seg).read(self.seg_index_path(seg), 0, 8)
                except FileNotFoundError:
                    head = b""
                seg.format = 2 if B2.is_lean(head) else 1
        return seg.format

    def describe_segment(self, seg: Segment) -> dict:
        """A segment as ``inspect`` shows it: base, store format, codec of its batches (format
        2; "none" for format 1), bytes of its .log and .bcq, records."""
        fmt = self.seg_format(seg)
        codec = "none"
        if fmt == 2:
            from .batch import CODEC_NAMES
            codec = CODEC_NAMES.get(self.index(seg).codec, "unknown")
        return {"base": seg.base, "format": fmt, "codec": codec, "log_bytes": seg.log_size,
                "index_bytes": seg.index_size, "records": self.seg_count(seg)}

    def seg_count(self, seg: Segment) -> int:
        """Records of a segment (its manifest or closed segment-list entry's count: no read)."""
        listed = seg.listed()
        if listed is not None:
            return listed[0]
        return self.index(seg).n

    def _index_unindexed_tail(self, seg: Segment, e: np.ndarray) -> np.ndarray:
        """A read-only view indexes, in memory, whole valid records of the .log that its .bcq
        does not list yet: a live writer's append in progress, or a .bcq behind its .log after
        a crash that no writer has repaired. The files are left alone (only a writer repairs)."""
        indexed_end = int(e[-1]["position"]) + int(e[-1]["size"]) if e.shape[0] else 0
        if seg.log_size <= indexed_end:
            return e
        try:
            buf = self.local_fs.map(self.seg_log_path(seg), seg.log_size)
        except FileNotFoundError:
            return e
        s = scan(buf, indexed_end, seg.log_size, secret=self.secret, verify_crc=True)
        last = int(e[-1]["offset"]) if e.shape[0] else -1
        if len(s) == 0 or int(s.offsets[0]) <= last:
            return e
        extra = B.entries_from_scan(s, 0, len(s), 0).copy()
        return np.concatenate([e, extra]) if e.shape[0] else extra

    def index(self, seg: Segment) -> "B.Index | B2.LeanIndex":
        """The segment's valid entries with their search view, cached until the files change.
        A format-2 segment's is its lean index (chunks decoded on demand)."""
        if self.seg_format(seg) == 2:
            if (seg._index is not None and seg._map_size == seg.index_size
                    and seg._index_log_size == seg.log_size):
                return seg._index
            fs, path = self.seg_fs(seg), self.seg_index_path(seg)
            if seg.kind == "remote":
                # an object: read whole, in one request (a compaction stays at <= 4 requests a
                # segment; a lean index is ~17 bytes a record)
                whole = fs.read(path)
                read = lambda start, length: whole[start:start + length]  # noqa: E731
            else:
                read = lambda start, length: fs.read(path, start, length)  # noqa: E731
            idx = B2.LeanIndex(read, path, seg.index_size)
            if seg.kind == "remote":  # what IndexCursor checks against the manifest entry
                idx.file_check = (len(whole), crc32c(whole))
            if idx.log_size != seg.log_size:
                from .errors import CorruptRecordError
                raise CorruptRecordError(f"{path}: the lean index describes a .log of "
                                         f"{idx.log_size} bytes, the .log holds {seg.log_size}",
                                         path, 0)
            seg._map_size = seg.index_size
            seg._index_log_size = seg.log_size
            seg._index = idx
            return idx
        n = seg.entry_count
        size = n * B.ENTRY_SIZE
        if seg._index is not None and seg._map_size == size and seg._index_log_size == seg.log_size:
            return seg._index
        if n == 0:
            e = np.zeros(0, dtype=B.BCQ_DTYPE)
        else:
            if seg._map is None or seg._map_size != size:
                seg._map = self.seg_fs(seg).map(self.seg_index_path(seg), size)
            e = B.view(seg._map)
            last = e[-1]
            if seg.open_tail and int(last["position"]) + int(last["size"]) > seg.log_size:
                # a writer's append in progress (its .bcq read after its .log was sized); in
                # an exact segment such entries stay, and the reader's check refuses them
                ends = e["position"].astype(np.int64) + e["size"]
                e = e[: int(np.searchsorted(ends, seg.log_size, side="right"))]
        if not self.writable and seg.kind == "file" and seg.open_tail:
            e = self._index_unindexed_tail(seg, e)
        seg._map_size = size
        seg._index_log_size = seg.log_size
        seg._index = B.Index(e)
        return seg._index

    @property
    def first_offset(self) -> int:
        for seg in self.segments:
            listed = seg.listed()  # a manifest or segment-list entry answers without the .bcq
            if listed is not None:
                if listed[0]:
                    return listed[1]
                continue
            e = self.entries(seg)
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
            e = self.entries(seg)
            if e.shape[0]:
                return int(e[-1]["offset"])
        return -1

    @property
    def next_offset(self) -> int:
        base = self.segments[-1].base if self.segments else 0
        n = max(self.last_offset + 1, base)
        if self.manifest is not None:
            n = max(n, self.manifest.next_offset)  # survives a compaction that empties the tail
        if self.seglist is not None:  # (and a damaged .bcq cannot move it back)
            n = max(n, self.seglist.next_offset)
        return max(n, self._next_floor)

    #: where the source goes on past the last record (``advance_next_offset``); 0: nowhere
    _next_floor = 0

    def advance_next_offset(self, offset: int) -> bool:
        """Writer: the source partition goes on at ``offset``, past the last record stored here
        (transaction markers, aborted records that a read_committed consumer stepped over).
        Make it the partition's next offset, so that readers' end offsets and a resuming
        writer's start are the source's. Call it once every record below ``offset`` is durable
        (``Store.flush`` does): a local store lists it at once (segment list), an object store
        commits it with the next seal (manifest). Returns whether it moved."""
        if offset <= self.next_offset:
            return False
        self._next_floor = offset
        if self.keeps_list and self.writable:
            self._write_list(self._listed_open)
        return True

    def record_count(self) -> int:
        return sum(self.seg_count(seg) for seg in self.segments)

    def size_bytes(self) -> int:
        return sum(s.log_size for s in self.segments)

    def segment_for(self, offset: int) -> int:
        """Index of the segment whose range holds ``offset`` (0 if before the first). On an
        object store, committed segments whose manifest entry says they hold no offset
        >= ``offset`` (a target in a gap at the end of a segment) are stepped over, so a read
        from there fetches no index it does not need (len(segments): none holds one)."""
        bases = [s.base for s in self.segments]
        i = max(0, bisect.bisect_right(bases, offset) - 1)
        if self.manifest_mode:
            while i < len(self.segments) and self.segments[i].entry is not None \
                    and self.segments[i].entry.offset_at_or_after(offset) is None:
                i += 1
        return i

    def holds(self, offset: int) -> bool:
        """Whether the partition holds a record at ``offset``; a committed segment on an
        object store answers from its manifest bitmap (no request)."""
        i = bisect.bisect_right([s.base for s in self.segments], offset) - 1
        if i < 0:
            return False
        seg = self.segments[i]
        if seg.entry is not None:
            return seg.entry.holds(offset)
        idx = self.index(seg)
        j = int(idx.lower_bound(offset))
        return j < idx.n and int(idx.entries[j]["offset"]) == offset

    def offset_at_or_after(self, offset: int) -> int | None:
        """The first offset >= ``offset`` the partition holds (None: none), where a read from
        ``offset`` starts; from the manifest bitmaps on an object store (no request)."""
        for seg in self.segments[self.segment_for(offset):]:
            if seg.entry is not None:
                nxt = seg.entry.offset_at_or_after(offset)
                if nxt is not None:
                    return nxt
                continue
            idx = self.index(seg)
            j = int(idx.lower_bound(offset))
            if j < idx.n:
                return int(idx.entries[j]["offset"])
        return None
    # -- append (writer) -----------------------------------------------------------------

    def _active_files(self) -> tuple[Segment, AppendFile, AppendFile]:
        seg = self.segments[-1]
        assert seg.kind == "file", "appending to a sealed object"
        if self._log is None:
            # a new segment's .bcq is created first: a crash between the two leaves an empty
            # .bcq without its .log (deleted on open), never a .log without its .bcq
            self._idx = self.local_fs.open_append(self.seg_index_path(seg))
            self._log = self.local_fs.open_append(self.seg_log_path(seg))
            self._dirty_files += [self._log, self._idx]
        return seg, self._log, self._idx

    def _new_segment(self, base: int) -> Segment:
        """Start an empty active segment at ``base``: its files, then (a local store) the list
        naming it, open."""
        self._close_files()
        seg = Segment(base, 0, 0, open_tail=True, bcq_crc=0, bcq_crc_size=0)
        self.segments.append(seg)
        self._active_files()
        if self.keeps_list:
            self._write_list(self._listed_open | {base})
        return seg

    def roll(self, base: int | None = None, *, writer: str = "writer", seal: bool = True) -> bool:
        """Seal the active segment and start an empty one at ``base`` (default: next offset),
        so that compaction may clean what it holds. Crash-safe: the sealed segment's files are
        fsynced before the new one is created, and the directory after, so a crash leaves
        either the old segment active or the new one, never a segment based past records that
        a re-dispatch would then append to it; the segment list names the new segment (open)
        once its files exist. On an object store (``base`` None) the writer's local segments
        are sealed instead (uploaded and committed to the manifest). Returns whether it rolled
        (``unroll`` takes a local roll back while nothing was appended).

        Called on append (``segment.bytes``, the time rule: ``_roll_cut``), by ``roll_if_due``,
        when a batch job ends, and by ``kcompact compact`` on a partition no writer holds. The
        rolled segment is re-encoded into format 2 at the next ``sync`` (reput/seal.py;
        ``seal=False``: not, e.g. when a compaction rewrites it at once)."""
        if self.manifest_mode and base is None:
            if any(s.kind == "file" and s.log_size for s in self.segments):
                self.seal(writer)
                return True
            return False
        base = self.next_offset if base is None else base
        if self.segments and self.segments[-1].base == base:
            return False
        before = (self.seglist, len(self.segments))
        self._before_roll = None
        rolled = (self.segments[-1].base if seal and self.writable and not self.manifest_mode
                  and self.segments and self.segments[-1].log_size > 0
                  and self.segments[-1].kind == "file" else None)
        if self.segments and self.segments[-1].log_size == 0 and self.segments[-1].kind == "file":
            # an empty active segment is renamed forward rather than left behind: the new
            # files, the list without it, then its files go (empty: nothing is lost between)
            self._close_files()
            old = self.segments.pop()
            self._listed_open.discard(old.base)
            self._new_segment(base)  # (nothing to take back to)
            self.local_fs.delete(self.seg_log_path(old))
            self.local_fs.delete(self.seg_index_path(old))
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
        Not on an object store, where every flush seals. Returns whether it rolled."""
        seg = self.segments[-1] if self.segments else None
        if (not self.writable or self.manifest_mode or seg is None or seg.kind != "file"
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
                own = self.entries(seg)["timestamp"]
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
        if self.keeps_list and lst is not None:
            self._restore_list(lst)
        elif self.keeps_list:
            self.fs.delete(f"{self.dir}/{fn.SEGMENT_LIST}")
            self.seglist, self._listed_open = None, set()
        self.local_fs.delete(self.seg_log_path(seg))
        self.local_fs.delete(self.seg_index_path(seg))
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
        if (tail is not None and tail.kind == "file" and tail.last_appended is not None
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
                # (on S3, after a seal, the next record starts a new local segment)
                self._new_segment(int(s.offsets[lo]))
            self._before_roll = None
            self._list_before_append()
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

    def sync(self) -> None:
        """fsync what was appended since the last sync; close sealed segments' files; list
        the sizes of the segments sealed since (a local store's segment list)."""
        active = [f for f in (self._log, self._idx) if f is not None]
        for f in self._dirty_files:
            f.sync()
            if f not in active:
                f.close()
        self._dirty_files = active
        self._list_after_sync(closing=False)
        if self._to_seal:
            bases, self._to_seal = self._to_seal, []
            if self.seal_queue is not None:
                for base in bases:
                    self.seal_queue(self, base)
                return
            from .seal import seal_segment
            for base in bases:
                seal_segment(self, base)

    def _sync_and_close_files(self) -> None:
        """fsync what was appended and close every open file (the active segment's too)."""
        self.sync()
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []

    def close(self, seal: bool = True) -> None:
        """Release the partition. An S3 writer first seals what it appended (``seal=False``:
        leave it in the local directory, for the next open to upload)."""
        if seal and self.manifest_mode and self.writable and self._writer_lock is not None:
            self.seal()
        self._sync_and_close_files()
        if self._writer_lock is not None:
            self._list_after_sync(closing=True)
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

    #: (segment, (its .log and .bcq sizes, the batch's position), batch.Walked): the format-2
    #: batch the last read of this partition walked, one at most (reput/reader.py _read_v2)
    last_batch = None

    def keep_batch(self, seg: Segment, sizes: tuple[int, int], walked) -> None:
        """Keep ``walked`` (a batch of ``seg`` just checked whole) for the next read. An
        uncompressed batch's payload is a view of the read's buffer: copied when that buffer
        is much larger (a multi-batch read), so that one batch is all that is kept."""
        pay = walked.payload
        base = pay.base
        if base is not None and memoryview(base).nbytes > 2 * pay.nbytes + (64 << 10):
            walked = walked._replace(payload=pay.copy())
        self.last_batch = (seg, sizes + (walked.head.position,), walked)

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
