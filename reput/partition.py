"""A topic-partition's compaction log: .log data segments, each with its .bcq index.

Spec: docs/formats/bcq.md (index) and docs/formats/record.md (data). Segments are named by the
20-digit base offset (the first offset the segment may hold); each holds the offsets from its
base up to the next segment's base. Records are appended byte for byte as reput found them in
the commit log: first the .log bytes, then the .bcq entries, so an entry never points past its
data. Opening for write recovers: a .bcq behind its .log is rebuilt from the .log, entries past
the end of the .log are dropped, and a torn .log tail is cut (reput re-dispatches it from the
commit log, whose checkpoint is behind it). Reads check every record's CRC and never serve a
record that fails it.

On an object store (S3, ``fs.appendable`` false) the segments are the partition manifest's
(docs/formats/manifest.md), never a listing: each sealed segment is an immutable object whose
manifest entry gives its record count, first and last offsets and offset bitmap, so offset
lookups and counts need no download; its .bcq is fetched whole once (``Backend.map``) and its
.log read in cached blocks. A writer's active segments stay in its local directory
(``local_fs``, the store's commitlog_dir) with the local layout until ``seal()`` uploads them
and commits a manifest version. A compaction stages its outputs locally (``stage_swap``) and
``commit_staged`` uploads them and commits one manifest version: readers see the old segment
list or the new one, never a mix.
"""

from __future__ import annotations

import bisect
import os
import secrets
import time
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from . import _kernels as K
from . import bcq as B
from . import filenames as fn
from . import manifest as M
from .backend import AppendFile, Backend, _oserror
from .config import TopicConfig
from .errors import CorruptRecordError, ReputError
from .locks import FileLock
from .record import Record, Scan, decode_one, scan
from .swap import empty_trash, recover_swap


def read_fully(f, out: np.ndarray) -> int:
    """readinto until ``out`` is full or the stream ends; returns bytes read."""
    mv = memoryview(out).cast("B")
    done = 0
    while done < len(mv):
        n = f.readinto(mv[done:])
        if not n:
            break
        done += n
    return done


@dataclass(eq=False)
class Segment:
    base: int
    log_size: int
    index_size: int
    _map: np.ndarray | None = None
    _map_size: int = -1
    _index: "B.Index | None" = None
    _index_log_size: int = -1
    #: "file": <base>.log/.bcq in the partition directory (a local store's segment, or a
    #: writer's active segment on S3); "remote": a sealed object listed by the manifest;
    #: "staged": a compaction output on local disk, not committed yet (S3 only)
    kind: str = "file"
    log_rel: str | None = None   # store-relative paths, for "remote" and "staged"
    bcq_rel: str | None = None
    entry: "M.SegmentEntry | None" = None  # the manifest's entry ("remote")
    #: the offset of the last record this process appended to this segment, valid while
    #: index_size == _appended_index_size (a writer's cache: no re-mapping of the growing .bcq
    #: to find its last offset before each append)
    last_appended: int | None = None
    _appended_index_size: int = -1

    def invalidate(self) -> None:
        self._map = None
        self._index = None
        self._map_size = -1
        self.last_appended = None

    @property
    def entry_count(self) -> int:
        return self.index_size // B.ENTRY_SIZE


@dataclass
class ReadResult:
    """Records read from one partition: their bytes, their index entries, and where to go next.

    ``entries['position']`` is relative to ``data`` (the records are contiguous in it).
    """

    data: bytes
    entries: np.ndarray
    next_offset: int

    def records(self, topic_hint: str = "") -> Iterator[Record]:
        for pos in self.entries["position"]:
            yield decode_one(self.data, int(pos), verify_crc=False, where=topic_hint)


class PartitionLog:
    def __init__(self, fs: Backend, topic: str, partition: int, secret: bytes,
                 config: TopicConfig = TopicConfig(), *, writable: bool = False,
                 sub: str | None = None, local_fs: Backend | None = None):
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
        #: where "file" segments live: the store itself, or the local directory on S3
        self.local_fs: Backend = (local_fs or fs) if self.manifest_mode else fs
        self.config = config
        self.sub = sub
        self.dir = fn.partition_dir(topic, partition) + (f"/{sub}" if sub else "")
        self.writable = writable
        self.segments: list[Segment] = []
        self._log: AppendFile | None = None
        self._idx: AppendFile | None = None
        self._dirty_files: list[AppendFile] = []
        self.recovered_entries = 0
        self.truncated_bytes = 0
        self._entry_scratch = np.empty(0, np.uint8)
        self.swap_recovered = False
        self._orphan_indexes: list[int] = []
        self.manifest: M.Manifest | None = None
        self._staged: list[Segment] = []
        self._replaced: dict[str, M.SegmentEntry] = {}
        self._pending_cleaned: int | None = None
        self._pending_run: dict | None = None
        self._pending = False
        self._local_listed = False
        self._manifest_read_at = 0.0
        self._writer_lock: FileLock | None = None
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
        self._load_files()

    def _load_files(self) -> None:
        logs, idxs = set(), set()
        for name in self.fs.listdir(self.dir):
            parsed = fn.parse_base(name)
            if parsed:
                (logs if parsed[1] == "log" else idxs).add(parsed[0])
        segs = []
        old = {s.base: s for s in self.segments}
        for base in sorted(logs):
            try:
                ls = self.fs.size(self.log_path(base))
            except FileNotFoundError:
                continue  # replaced under us by a compaction swap; the next refresh sees it
            try:
                isz = self.fs.size(self.index_path(base)) if base in idxs else 0
            except FileNotFoundError:
                isz = 0
            seg = old.get(base) or Segment(base, ls, isz)
            if seg.log_size != ls or seg.index_size != isz:
                seg.log_size, seg.index_size = ls, isz
            segs.append(seg)
        self.segments = segs
        self._orphan_indexes = sorted(idxs - logs)

    # -- manifest mode (S3) ----------------------------------------------------------------

    def _load_manifest(self, known: "M.Manifest | None", *, reread: bool = True) -> None:
        """Segments = the latest manifest's (minus what a pending compaction replaced), plus
        staged compaction outputs, plus the writer's local segments (listed from its directory
        the first time, then kept in memory)."""
        if reread:
            self.manifest = M.read_latest(self.fs, self.dir, known)
            self._manifest_read_at = time.monotonic()
        old = {s.log_rel: s for s in self.segments if s.kind == "remote"}
        remote = []
        for e in (self.manifest.segments if self.manifest else []):
            rel = f"{self.dir}/{e.log}"
            if rel in self._replaced:
                continue
            seg = old.get(rel) or Segment(e.base, e.log_size, e.bcq_size, kind="remote",
                                          log_rel=rel, bcq_rel=f"{self.dir}/{e.bcq}", entry=e)
            remote.append(seg)
        if self.writable and not self._local_listed:
            local = self._list_local()
            self._local_listed = True
        else:
            local = [s for s in self.segments if s.kind == "file"]
        self.segments = sorted(remote + self._staged, key=lambda s: s.base) + local

    def _list_local(self) -> list[Segment]:
        logs, idxs = set(), set()
        for name in self.local_fs.listdir(self.dir):
            parsed = fn.parse_base(name)
            if parsed:
                (logs if parsed[1] == "log" else idxs).add(parsed[0])
        segs = []
        for base in sorted(logs):
            d = f"{self.dir}/{fn.base_name(base)}"
            isz = self.local_fs.size(d + fn.INDEX_SUFFIX) if base in idxs else 0
            segs.append(Segment(base, self.local_fs.size(d + fn.LOG_SUFFIX), isz))
        self._orphan_indexes = sorted(idxs - logs)
        return segs

    def reload_manifest(self, max_age_s: float = 0.0) -> None:
        """Pick up manifest versions committed by other processes (one listing request),
        unless the manifest was read less than ``max_age_s`` ago."""
        if self.manifest_mode and time.monotonic() - self._manifest_read_at >= max_age_s:
            self._load_manifest(self.manifest)  # objects are immutable: cached indexes stay

    def _rebuild(self) -> None:
        """Recompute ``segments`` from the manifest held in memory (no request)."""
        self._load_manifest(self.manifest, reread=False)

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

    def _upload(self, seg: Segment, log_name: str, bcq_name: str) -> "M.SegmentEntry":
        """Upload a local segment's .log and .bcq as immutable objects (one PUT each)."""
        e = self.entries(seg)
        n = e.shape[0]
        lpath, ipath = self.seg_log_path(seg), self.seg_index_path(seg)
        llocal, ilocal = self.local_fs.local_path(lpath), self.local_fs.local_path(ipath)
        up = getattr(self.fs, "upload_file", None)
        if up is not None and llocal and ilocal:
            up(f"{self.dir}/{log_name}", llocal)
            if os.path.getsize(ilocal) != n * B.ENTRY_SIZE:
                raise CorruptRecordError(f"{ipath}: index size does not match its entries",
                                         ipath, n * B.ENTRY_SIZE)
            up(f"{self.dir}/{bcq_name}", ilocal)
        else:
            self.fs.write_atomic(f"{self.dir}/{log_name}", self.local_fs.read(lpath))
            self.fs.write_atomic(f"{self.dir}/{bcq_name}", e.tobytes())
        return M.SegmentEntry.from_entries(seg.base, log_name, bcq_name, seg.log_size,
                                           e["offset"])

    def _hand_over(self, seg: Segment, log_obj: str, bcq_obj: str) -> None:
        """After a commit: a local segment file becomes the spooled copy of its object (so it
        is read back without a request), or is deleted."""
        seed = getattr(self.fs, "seed", None)
        for rel, obj in ((self.seg_log_path(seg), log_obj), (self.seg_index_path(seg), bcq_obj)):
            lp = self.local_fs.local_path(rel)
            if seed is not None and lp and os.path.exists(lp):
                seed(obj, lp)
            else:
                self.local_fs.delete(rel)

    def seal(self, writer: str = "writer") -> bool:
        """S3: upload every local segment holding records and commit a manifest version that
        appends them (conditional create; on a lost race re-read and rebase, which fails only
        if another writer wrote offsets past ours). Returns whether a version was committed.
        The local files are dropped only after the commit, so a crash before it leaves
        orphans (deleted later by ``collect_garbage``) and local files that the next open
        uploads again."""
        if not self.manifest_mode or not self.writable:
            return False
        local = [s for s in self.segments if s.kind == "file"]
        nxt = self.next_offset
        have = self.manifest.next_offset if self.manifest else 0
        if not any(s.log_size for s in local) and nxt <= have:
            return False
        self.sync()
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []
        uploads = []
        try:
            for seg in local:
                if seg.log_size == 0:
                    continue
                tag = secrets.token_hex(8)
                ent = self._upload(seg, fn.segment_object(seg.base, tag, fn.LOG_SUFFIX),
                                   fn.segment_object(seg.base, tag, fn.INDEX_SUFFIX))
                uploads.append((seg, ent))
            new_entries = [e for _, e in uploads]

            def change(cur: M.Manifest) -> M.Manifest:
                if new_entries and new_entries[0].first_offset <= cur.last_offset:
                    raise M.ManifestConflictError(
                        f"{self.fs.url}/{self.dir}: another writer committed offsets up to "
                        f"{cur.last_offset} while this one wrote from "
                        f"{new_entries[0].first_offset}; one writer per partition at a time")
                return replace(cur, segments=cur.segments + new_entries,
                               next_offset=max(cur.next_offset, nxt))

            new = M.commit(self.fs, self.dir, self.manifest, change, writer=writer,
                           grace_ms=self.grace_ms)
        except BaseException:
            self._delete_objects([f"{self.dir}/{n}" for _, e in uploads for n in (e.log, e.bcq)])
            raise
        if new is not None:
            self.manifest = new
        for seg in local:
            ent = next((e for s, e in uploads if s is seg), None)
            if ent is not None:
                self._hand_over(seg, f"{self.dir}/{ent.log}", f"{self.dir}/{ent.bcq}")
            else:
                self.local_fs.delete(self.seg_log_path(seg))
                self.local_fs.delete(self.seg_index_path(seg))
            seg.invalidate()
        self.segments = [s for s in self.segments if s.kind != "file"]
        self._rebuild()
        return new is not None

    def _delete_objects(self, paths: list[str]) -> None:
        try:
            deleter = getattr(self.fs, "delete_many", None)
            if deleter is not None:
                deleter(paths)
            else:
                for p in paths:
                    self.fs.delete(p)
        except Exception:  # noqa: BLE001 - best effort: they are orphans for the next GC
            pass

    # -- compaction on S3: staged outputs, one manifest commit --------------------------------

    @property
    def staging_dir(self) -> str:
        return f"{self.dir}/{fn.COMPACTING_DIR}"

    def staging_paths(self, base: int) -> tuple[str, str]:
        """Local paths (on ``local_fs``) for a compaction output based at ``base``, named as
        its objects will be (a fresh random tag, so no round's output collides with another)."""
        tag = secrets.token_hex(8)
        return (f"{self.staging_dir}/{fn.segment_object(base, tag, fn.LOG_SUFFIX)}",
                f"{self.staging_dir}/{fn.segment_object(base, tag, fn.INDEX_SUFFIX)}")

    @property
    def has_staged(self) -> bool:
        return self._pending

    def stage_swap(self, inputs: list[int], outputs: list[tuple[int, str, str]],
                   cleaned_offset: int | None, last_run: dict | None = None) -> None:
        """Replace sealed segments (by base) with staged outputs (base, .log, .bcq on
        ``local_fs``) in this object's view only; ``commit_staged`` publishes all of it."""
        by_base = {s.base: s for s in self.segments if s.kind != "file"}
        for b in inputs:
            seg = by_base.get(b)
            if seg is None:
                raise ReputError(f"{self.dir}: no sealed segment at base {b} to replace")
            if seg.kind == "remote":
                self._replaced[seg.log_rel] = seg.entry
            else:
                self._staged.remove(seg)
                self.local_fs.delete(self.seg_log_path(seg))
                self.local_fs.delete(self.seg_index_path(seg))
            seg.invalidate()
        for base, lrel, irel in outputs:
            self._staged.append(Segment(base, self.local_fs.size(lrel), self.local_fs.size(irel),
                                        kind="staged", log_rel=lrel, bcq_rel=irel))
        if cleaned_offset is not None:
            self._pending_cleaned = cleaned_offset
        if last_run is not None:
            self._pending_run = last_run
        self._pending = True
        self._rebuild()

    def commit_staged(self, writer: str = "compactor", last_run: dict | None = None) -> bool:
        """Upload the staged outputs (one PUT per object) and commit one manifest version that
        replaces the inputs with them, sets the horizon and the last run, and retires the
        inputs (deleted after the grace period). On a lost race the change is rebased if
        every input is still listed; else it is abandoned (outputs deleted, view reloaded)
        and False returned."""
        if not self._pending:
            return True
        if last_run is not None:
            self._pending_run = last_run
        replaced = list(self._replaced.values())
        gone = {e.log for e in replaced}
        cleaned, run = self._pending_cleaned, self._pending_run
        uploads = []
        try:
            for seg in self._staged:
                lname = seg.log_rel.rsplit("/", 1)[1]
                iname = seg.bcq_rel.rsplit("/", 1)[1]
                if fn.parse_segment_object(lname) is None:  # staged under a plain name
                    tag = secrets.token_hex(8)
                    lname = fn.segment_object(seg.base, tag, fn.LOG_SUFFIX)
                    iname = fn.segment_object(seg.base, tag, fn.INDEX_SUFFIX)
                uploads.append((seg, self._upload(seg, lname, iname)))
            new_entries = [e for _, e in uploads]

            def change(cur: M.Manifest) -> M.Manifest:
                listed = {s.log for s in cur.segments}
                if not gone <= listed:
                    raise M.ManifestConflictError(
                        f"{self.fs.url}/{self.dir}: another compaction replaced segments this "
                        "one was rewriting; its outputs are abandoned")
                now = int(time.time() * 1000)
                return replace(cur, segments=[s for s in cur.segments if s.log not in gone]
                               + new_entries,
                               cleaned_offset=cur.cleaned_offset if cleaned is None else cleaned,
                               last_run=run if run is not None else cur.last_run,
                               retired=cur.retired + [{"log": e.log, "bcq": e.bcq,
                                                       "since_ms": now} for e in replaced])

            new = M.commit(self.fs, self.dir, self.manifest, change, writer=writer,
                           grace_ms=self.grace_ms)
        except M.ManifestConflictError:
            self._delete_objects([f"{self.dir}/{n}" for _, e in uploads for n in (e.log, e.bcq)])
            self.abort_staged()
            return False
        except BaseException:
            self._delete_objects([f"{self.dir}/{n}" for _, e in uploads for n in (e.log, e.bcq)])
            raise
        self.manifest = new
        try:
            for seg, ent in uploads:
                self._hand_over(seg, f"{self.dir}/{ent.log}", f"{self.dir}/{ent.bcq}")
                seg.invalidate()
        finally:
            # committed: the view is the new version even if the local clean-up fails (it
            # must not list staged files that were handed over; recovery removes the rest)
            self._clear_pending()
            self._rebuild()
        self.local_fs.remove_tree(self.staging_dir)
        return True

    def install_segments(self, local_dir: str, bases: list[int], last_run: dict | None,
                         writer: str = "replica", cleaned_offset: int = -1) -> bool:
        """S3: replace every segment of the partition with the local segments
        ``local_dir/<base>.log/.bcq`` (on ``local_fs``) in one manifest commit, the compaction
        horizon set to ``cleaned_offset`` (a replica's install: -1, or the horizon its pulled
        records are clean up to). The writer's own local segments are sealed first, so they
        are among the replaced ones."""
        self.seal(writer)
        self.stage_swap([s.base for s in self.sealed_segments],
                        [(b, f"{local_dir}/{fn.base_name(b)}{fn.LOG_SUFFIX}",
                          f"{local_dir}/{fn.base_name(b)}{fn.INDEX_SUFFIX}") for b in bases],
                        cleaned_offset, last_run)
        return self.commit_staged(writer)

    def _clear_pending(self) -> None:
        self._staged, self._replaced = [], {}
        self._pending_cleaned = self._pending_run = None
        self._pending = False

    def abort_staged(self) -> None:
        """Drop staged outputs and pending changes; re-read the manifest."""
        for seg in self._staged:
            seg.invalidate()
        self._clear_pending()
        self.local_fs.remove_tree(self.staging_dir)
        for seg in self.segments:
            seg.invalidate()
        self.segments = [s for s in self.segments if s.kind == "file"]
        self._load_manifest(self.manifest)

    def collect_garbage(self) -> list[str]:
        """S3: delete replaced segments, orphans and old manifest versions past the grace
        period (reput/manifest.py ``collect_garbage``). Returns the deleted paths."""
        if not self.manifest_mode:
            return []
        return M.collect_garbage(self.fs, self.dir, grace_ms=self.grace_ms,
                                 now_ms=int(time.time() * 1000), known=self.manifest)

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
                recover_swap(self.fs, self.dir)
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
        n = seg.entry_count
        if n == 0:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        return self.index(seg).entries

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

    def index(self, seg: Segment) -> B.Index:
        """The segment's valid entries with their search view, cached until the files change."""
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
            if int(last["position"]) + int(last["size"]) > seg.log_size:
                ends = e["position"].astype(np.int64) + e["size"]
                e = e[: int(np.searchsorted(ends, seg.log_size, side="right"))]
        if not self.writable and seg.kind == "file":
            e = self._index_unindexed_tail(seg, e)
        seg._map_size = size
        seg._index_log_size = seg.log_size
        seg._index = B.Index(e)
        return seg._index

    def index_chunks(self, seg: Segment, start_entry: int = 0, chunk_entries: int = 1 << 15,
                     buf: np.ndarray | None = None):
        """Yield (first entry number, entries) of a segment's valid .bcq entries in bounded
        chunks read into ``buf`` (reused: valid until the next chunk). Unlike ``entries``,
        this keeps memory bounded whatever the index size (no mapping of the whole file), and
        it reads the .bcq as one sequential stream (one request on an object store)."""
        idx = self.index(seg)
        n = idx.n
        # entries a read-only view indexed in memory from the .log tail are not in the file
        n_file = min(n, seg.entry_count)
        path = self.seg_index_path(seg)
        if buf is None or buf.shape[0] < chunk_entries * B.ENTRY_SIZE:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
        if start_entry < n_file:
            try:
                with self.seg_fs(seg).open_read(path, start_entry * B.ENTRY_SIZE) as f:
                    for lo in range(start_entry, n_file, chunk_entries):
                        hi = min(n_file, lo + chunk_entries)
                        want = (hi - lo) * B.ENTRY_SIZE
                        if read_fully(f, buf[:want]) != want:
                            raise CorruptRecordError(
                                f"{path}: index shorter than expected at entry {lo}",
                                path, lo * B.ENTRY_SIZE)
                        yield lo, buf[:want].view(B.BCQ_DTYPE)
            except FileNotFoundError:
                raise
            except OSError as e:  # the stream's reads raise raw OSError: say which file
                raise _oserror(e, "read", path) from e
        for lo in range(max(start_entry, n_file), n, chunk_entries):
            yield lo, idx.entries[lo:min(n, lo + chunk_entries)]

    @property
    def first_offset(self) -> int:
        for seg in self.segments:
            if seg.entry is not None:  # a manifest entry answers without a download
                if seg.entry.records:
                    return seg.entry.first_offset
                continue
            e = self.entries(seg)
            if e.shape[0]:
                return int(e[0]["offset"])
        return self.next_offset

    @property
    def last_offset(self) -> int:
        """Offset of the last indexed record, -1 when there is none."""
        for seg in reversed(self.segments):
            if seg.entry is not None:
                if seg.entry.records:
                    return seg.entry.last_offset
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
        return n

    def record_count(self) -> int:
        return sum(seg.entry.records if seg.entry is not None else len(self.entries(seg))
                   for seg in self.segments)

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

    # -- recovery ------------------------------------------------------------------------

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

    def _recover_local(self) -> None:
        """S3 writer: the local segments are recovered as on a local store; those a crash left
        behind after their manifest commit (all their offsets already listed) are dropped, and
        a dead compaction's local staging is removed."""
        lfs = self.local_fs
        lock = FileLock(lfs, f"{self.dir}/{fn.COMPACTION_LOCK}")
        if lock.acquire(blocking=False):
            try:
                lfs.remove_tree(self.staging_dir)
            finally:
                lock.release()
        for base in self._orphan_indexes:
            lfs.delete(f"{self.dir}/{fn.base_name(base)}{fn.INDEX_SUFFIX}")
        self._orphan_indexes = []
        for name in lfs.listdir(self.dir):
            if name.endswith(fn.TMP_SUFFIX):
                lfs.delete(f"{self.dir}/{name}")
        committed = self.manifest.last_offset if self.manifest else -1
        keep = []
        for seg in self.segments:
            if seg.kind != "file":
                keep.append(seg)
                continue
            self._recover_segment(seg)
            e = self.entries(seg)
            if (e.shape[0] and int(e[-1]["offset"]) <= committed) or \
                    (not e.shape[0] and seg.base <= committed):
                lfs.delete(self.seg_log_path(seg))     # committed before the crash
                lfs.delete(self.seg_index_path(seg))
                seg.invalidate()
                continue
            if e.shape[0] and int(e[0]["offset"]) <= committed:
                raise M.ManifestConflictError(
                    f"{self.fs.url}/{self.dir}: local segment {fn.base_name(seg.base)} "
                    f"(offsets {int(e[0]['offset'])}..{int(e[-1]['offset'])}) overlaps what the "
                    f"manifest lists (up to {committed}): another writer wrote this partition")
            keep.append(seg)
        self.segments = keep

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

    # -- append (writer) -----------------------------------------------------------------

    def _active_files(self) -> tuple[Segment, AppendFile, AppendFile]:
        seg = self.segments[-1]
        assert seg.kind == "file", "appending to a sealed object"
        if self._log is None:
            self._log = self.local_fs.open_append(self.seg_log_path(seg))
            self._idx = self.local_fs.open_append(self.seg_index_path(seg))
            self._dirty_files += [self._log, self._idx]
        return seg, self._log, self._idx

    def roll(self, base: int | None = None) -> None:
        """Seal the active segment and start an empty one at ``base`` (default: next offset)."""
        base = self.next_offset if base is None else base
        if self.segments and self.segments[-1].base == base:
            return
        if self.segments and self.segments[-1].log_size == 0 and self.segments[-1].kind == "file":
            # an empty active segment is renamed forward rather than left behind
            self._close_files()
            old = self.segments.pop()
            self.local_fs.delete(self.seg_log_path(old))
            self.local_fs.delete(self.seg_index_path(old))
        self._close_files()
        self.segments.append(Segment(base, 0, 0))
        self._active_files()

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
                self._close_files()
                self.segments.append(Segment(int(s.offsets[lo]), 0, 0))
            seg, logf, idxf = self._active_files()
            start_byte = int(s.positions[lo])
            ends = s.positions[lo:hi] + s.sizes[lo:hi] - start_byte
            k = int(np.searchsorted(ends, limit - seg.log_size, side="right"))
            if k == 0:
                if seg.log_size > 0:
                    self.roll(int(s.offsets[lo]))
                    continue
                k = 1
            end_byte = start_byte + int(ends[k - 1])
            if scratch.shape[0] < k * B.ENTRY_SIZE:
                scratch = self._entry_scratch = np.empty(k * B.ENTRY_SIZE, np.uint8)
            entries = B.entries_from_scan(s, lo, lo + k, seg.log_size - start_byte, scratch)
            if clean_upto >= 0 and clean_time_s > 0 and int(s.offsets[lo]) <= clean_upto:
                e = entries.view(B.BCQ_DTYPE)
                stamp = (e["flags"] & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS)) == B.FLAG_TOMBSTONE
                stamp &= e["offset"] <= clean_upto
                e["clean_time"][stamp] = np.uint32(clean_time_s)
            logf.write(src[start_byte:end_byte])
            idxf.write(entries.view(np.uint8))
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
        """fsync what was appended since the last sync; close sealed segments' files."""
        active = [f for f in (self._log, self._idx) if f is not None]
        for f in self._dirty_files:
            f.sync()
            if f not in active:
                f.close()
        self._dirty_files = active

    def close(self, seal: bool = True) -> None:
        """Release the partition. An S3 writer first seals what it appended (``seal=False``:
        leave it in the local directory, for the next open to upload)."""
        if seal and self.manifest_mode and self.writable and self._writer_lock is not None:
            self.seal()
        self.sync()
        for f in (self._log, self._idx):
            if f is not None:
                f.close()
        self._log = self._idx = None
        self._dirty_files = []
        for seg in self.segments:
            seg.invalidate()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    # -- read ----------------------------------------------------------------------------

    def read(self, from_offset: int, max_records: int | None = None,
             max_bytes: int | None = None) -> ReadResult:
        """Records with offset >= from_offset, in offset order, from one segment at most.

        A missing offset continues at the next existing one. At least one record is returned
        when any exists, even if it is larger than ``max_bytes``. Every record's CRC is checked.
        A read-only reader that meets a .log/.bcq mismatch re-lists and retries, because a
        compaction swap in another process replaces the two files one after the other
        (docs/formats/compaction-swap.md); a mismatch that persists is corruption.
        """
        if max_records is not None and max_records <= 0:
            return ReadResult(b"", np.zeros(0, dtype=B.BCQ_DTYPE), from_offset)
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        attempts = 1 if self.writable else 4
        for attempt in range(attempts):
            try:
                return self._read_once(from_offset, max_records, max_bytes)
            except (CorruptRecordError, FileNotFoundError):
                if attempt == attempts - 1:
                    raise
                time.sleep(0.02 * (attempt + 1))
                for seg in self.segments:
                    seg.invalidate()
                self._load()
        raise AssertionError("unreachable")

    def _read_once(self, from_offset: int, max_records: int | None,
                   max_bytes: int | None) -> ReadResult:
        i = self.segment_for(from_offset)
        while i < len(self.segments):
            seg = self.segments[i]
            if seg.entry is not None and (seg.entry.records == 0
                                          or seg.entry.last_offset < from_offset):
                i += 1  # the manifest says it holds nothing at or after from_offset
                continue
            part = self._short_index_read(seg, from_offset, max_records)
            if part is not None:
                e, j = part, 0
            else:
                idx = self.index(seg)
                e = idx.entries
                j = int(idx.lower_bound(from_offset))
            if j < e.shape[0]:
                stop = e.shape[0] if max_records is None else min(e.shape[0], j + max_records)
                if max_bytes is not None:
                    ends = e["position"][j:stop].astype(np.int64) + e["size"][j:stop] \
                        - int(e[j]["position"])
                    stop = j + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
                sel = e[j:stop].copy()
                start = int(sel[0]["position"])
                end = int(sel[-1]["position"]) + int(sel[-1]["size"])
                # max(0, ..): entries damaged out of order must fail the check below, not the read
                data = self.read_log(seg, start, max(0, end - start))
                sel["position"] -= start
                self._check(data, sel, seg, start)
                return ReadResult(data, sel, int(sel[-1]["offset"]) + 1)
            i += 1
        return ReadResult(b"", np.zeros(0, dtype=B.BCQ_DTYPE), max(from_offset, self.next_offset))

    def _short_index_read(self, seg: Segment, from_offset: int,
                          max_records: int | None) -> np.ndarray | None:
        """Object store: the .bcq entries of a committed segment from the first offset
        >= ``from_offset``, at most ``max_records`` and not past the cache block holding the
        first, read by range (the manifest bitmap's rank is the entry number). None when the
        whole .bcq is the better read: it is local already, no larger than a block, or the
        read wants more entries than a block holds."""
        ent = seg.entry
        bs = int(getattr(self.fs, "block_size", 0) or 0)
        if ent is None or seg._index is not None or max_records is None or bs <= 0 \
                or max_records * B.ENTRY_SIZE > bs or ent.bcq_size <= bs:
            return None
        path = self.seg_index_path(seg)
        if self.fs.has_local_copy(path):
            return None
        j = ent.rank_below(from_offset)
        if j >= ent.records:
            return np.zeros(0, dtype=B.BCQ_DTYPE)
        start = j * B.ENTRY_SIZE
        hi = min(ent.records, j + max_records,
                 max(j + 1, (start // bs + 1) * bs // B.ENTRY_SIZE))
        raw = self.fs.read(path, start, (hi - j) * B.ENTRY_SIZE)
        e = B.view(np.frombuffer(raw, dtype=np.uint8))
        want = ent.offset_at_or_after(from_offset)
        if e.shape[0] != hi - j or int(e[0]["offset"]) != want:
            raise CorruptRecordError(
                f"{path}: entry {j} does not hold offset {want} as the manifest's bitmap says "
                "(or the index is short); run `kcompact verify`", path, start)
        return e

    def _check(self, data: bytes, sel: np.ndarray, seg: Segment, file_start: int) -> None:
        buf = np.frombuffer(data, dtype=np.uint8)
        s = scan(buf, 0, len(buf), verify_crc=True)
        ok = (len(s) == sel.shape[0] and s.status == K.SCAN_OK
              and np.array_equal(s.offsets, sel["offset"])
              and np.array_equal(s.positions, sel["position"].astype(np.int64))
              and np.array_equal(s.sizes, sel["size"].astype(np.int64)))
        if not ok:
            bad = int(s.stop) if s.status != K.SCAN_OK else self._first_mismatch(s, sel)
            raise CorruptRecordError(
                f"{self.seg_log_path(seg)}: corrupt record at byte {file_start + bad} "
                "(CRC or header check failed, or the .bcq does not match the .log); run "
                "`kcompact verify` and rebuild this partition from a replica",
                self.seg_log_path(seg), file_start + bad)

    @staticmethod
    def _first_mismatch(s: Scan, sel: np.ndarray) -> int:
        n = min(len(s), sel.shape[0])
        diff = np.nonzero((s.offsets[:n] != sel["offset"][:n])
                          | (s.positions[:n] != sel["position"][:n].astype(np.int64))
                          | (s.sizes[:n] != sel["size"][:n].astype(np.int64)))[0]
        return int(sel[diff[0]]["position"]) if diff.size else int(s.stop)

    def iter_records(self, from_offset: int = 0, limit: int | None = None,
                     batch_bytes: int = 4 << 20) -> Iterator[Record]:
        """Decoded records from ``from_offset`` (for dump, restore and tests)."""
        off = from_offset
        n = 0
        while limit is None or n < limit:
            r = self.read(off, max_records=None if limit is None else limit - n,
                          max_bytes=batch_bytes)
            if r.entries.shape[0] == 0:
                return
            for rec in r.records(self.log_path(0)):
                yield rec
                n += 1
            off = r.next_offset
