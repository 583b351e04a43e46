"""A partition on an object store: its segments come from the partition manifest.

Spec: docs/formats/manifest.md. Each sealed segment is an immutable object pair whose manifest
entry gives its record count, first and last offsets and offset bitmap, so offset lookups and
counts need no download; its .bcq is fetched whole once (``Backend.map``) and its .log read in
cached blocks. A writer's active segments stay in its local directory (``local_fs``, the store's
commitlog_dir) with the local layout until ``publish()`` uploads them and commits a manifest version.
A compaction stages its outputs locally (``stage_swap``) and ``commit_staged`` uploads them and
commits one manifest version: readers see the old segment list or the new one, never a mix.
Replaced objects retire with the injected clock's "now" of the commit (``clock``, the store's)
and are deleted by ``collect_garbage`` once the grace period has passed on that clock and,
for the object's own age, on the object store's (``Backend.clock_ms``: LastModified is its).

``ManifestCatalog`` is the ``SegmentCatalog`` (reput/catalog.py) of such a partition; the
writer's steps that publish (``publish``, ``install_segments``) take the writing ``PartitionLog``,
whose open files they close first and whose topic config the upload follows.
"""

from __future__ import annotations

import os
import queue
import random
import secrets
import threading
import time
from dataclasses import replace

import numpy as np

from . import filenames as fn
from . import manifest as M
from . import s3_follow as S3F
from . import shared as SH
from . import store_catalog as SC
from .backend import Backend
from .catalog import SegmentCatalog
from .config import Clock
from .errors import CorruptRecordError, ReputError
from .segment import PartitionContext, Segment
from .segment_kinds import open_segment
from .segment_desc import SegmentDesc
from .segment_list import crc32c


class _Dropper:
    """One daemon thread per process that unmaps and deletes a writer's local segments after
    their shared upload's commit (``ManifestCatalog.shared_committed``)."""

    def __init__(self):
        self._q: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._pid = -1

    def put(self, fs: Backend, segs: list) -> None:
        with self._lock:
            if self._pid != os.getpid():  # (a forked child has the queue, not the thread)
                self._q = queue.Queue()
                threading.Thread(target=self._run, args=(self._q,), daemon=True,
                                 name="kcompact-drop").start()
                self._pid = os.getpid()
            q = self._q
        q.put((fs, segs))

    @staticmethod
    def _run(q) -> None:
        while True:
            fs, segs = q.get()
            try:
                for seg in segs:
                    seg.invalidate()
                    for path in (seg.log_path, seg.bcq_path):
                        try:
                            fs.delete(path)
                        except (OSError, ReputError):
                            pass  # (left for the next open, which drops what the journal holds)
            finally:
                q.task_done()

    def wait(self) -> None:
        with self._lock:
            q = self._q if self._pid == os.getpid() else None
        if q is not None:
            q.join()


_DROPPER = _Dropper()


def drop_later(fs: Backend, segs: list) -> None:
    _DROPPER.put(fs, segs)


def drain_drops() -> None:
    """Wait until every local segment handed to ``drop_later`` is deleted."""
    _DROPPER.wait()


#: a writer's local segment at most this large is encoded into its shared object in memory
#: (larger ones are sealed into a local file first, as per-partition uploads are)
SHARED_ENCODE_IN_MEMORY = 64 << 20


class ManifestCatalog(SegmentCatalog):
    """A partition's segments on an object store (see the module docstring).

    (About 650 lines on purpose: the manifest, a compaction's staged outputs, the parts of
    shared objects and a writer's local segments make one view, and every method that changes
    one of them keeps the others consistent with it; the publishing that drives it is
    reput/publisher.py's.)"""

    seals_rolled = False  # a writer's segments are encoded into format 2 as they are uploaded
    rolls_by_time = False  # every flush publishes

    def __init__(self, fs: Backend, local_fs: Backend, pdir: str, ctx: PartitionContext, *,
                 writable: bool, clock: Clock):
        super().__init__(fs, local_fs, pdir, ctx, writable=writable)
        self.clock = clock
        self.manifest: M.Manifest | None = None
        self._staged: list[Segment] = []
        self._replaced: dict[str, SegmentDesc] = {}
        self._pending_cleaned: int | None = None
        self._pending_run: dict | None = None
        self._pending = False
        self._local_listed = False
        self._manifest_read_at = 0.0
        #: the manifest version last found to agree with the ledger (reput/ledger.py)
        self._ledger_checked: int | None = None
        #: shared uploads (docs/formats/shared-upload.md): the partition's parts above its
        #: manifest (records or not) and those a pending split or compaction replaces (by key)
        self.parts: list[SH.Part] = []
        self._replaced_parts: dict[tuple, SH.Part] = {}
        #: (split_to, parts, their segments) of the last ``_shared_segments``: the next one
        #: builds segments only for the parts added since
        self._shared_memo: tuple | None = None
        #: whether a crashed flush's ``sealing/`` was looked for (once per open: this process's
        #: own failed flushes remove theirs, ``shared_aborted``)
        self._sealing_looked = False
        #: base -> (min, max) record timestamp of each part of the flush under way, given to
        #: its shared segment at the commit (``Segment.time_range``)
        self._part_times: dict[int, tuple[int, int]] = {}
        #: (parts, manifest, next_offset_floor()) as last computed
        self._floor_memo: tuple | None = None
        #: a writer with shared uploads: its publisher's ``publish_shared`` (``publish`` calls
        #: it; reput/publisher.py ``SharedPublisher``)
        self.publish_shared = None
        #: following a store with shared uploads (``refresh``): the journal generation the
        #: parts were last computed at, and how often the manifest is re-read (jittered, so
        #: the partitions of a process do not all re-read at once)
        self._seen_generation = -1
        self._read_directly = False
        self._recheck_s = S3F.manifest_recheck_s() * (0.5 + 0.5 * random.random())

    @property
    def grace_ms(self) -> int:
        return int(getattr(self.fs, "grace_ms", 0))

    def load(self) -> None:
        self._load_manifest(self.manifest)

    def log_path(self, base: int) -> str:
        """A committed or staged segment's object (or local file), else the local layout's."""
        seg = self.find(base)
        return seg.log_path if seg is not None and seg.kind != "file" else \
            super().log_path(base)

    def index_path(self, base: int) -> str:
        seg = self.find(base)
        return seg.bcq_path if seg is not None and seg.kind != "file" else \
            super().index_path(base)

    def checkpoint(self) -> tuple[int, dict | None]:
        m = self.manifest
        cleaned = self._pending_cleaned if self._pending_cleaned is not None else (
            m.cleaned_offset if m else -1)
        return cleaned, self._pending_run or (m.last_run if m else None)

    @property
    def sealed_segments(self) -> list[Segment]:
        """The committed (and staged) ones, never a writer's local segments."""
        return [s for s in self.segments if s.kind != "file"]

    @property
    def active_base(self) -> int:
        local = [s for s in self.segments if s.kind == "file"]
        return local[0].base if local else self.next_offset

    @property
    def active_bytes(self) -> int:
        return sum(s.log_size for s in self.segments if s.kind == "file")

    def next_offset_floor(self) -> int:
        memo = self._floor_memo
        if memo is not None and memo[0] is self.parts and memo[1] is self.manifest:
            return memo[2]  # (asked several times an append: parts and manifest unchanged)
        have = self.manifest.next_offset if self.manifest is not None else 0
        got = max([have] + [p.next_offset for p in self.parts])
        self._floor_memo = (self.parts, self.manifest, got)
        return got

    @property
    def journal(self) -> "SH.Journal | None":
        """The store's shared-upload journal (None: the store uses none)."""
        return SH.journal_in_use(self.fs)

    def committed_last_offset(self) -> int:
        """The highest offset committed (listed by the manifest or a shared part)."""
        m = self.manifest.last_offset if self.manifest else -1
        return max([m] + [p.desc.last_offset for p in self.parts if p.records])

    @property
    def shared_objects(self) -> int:
        """How many shared objects the partition's reads depend on (inspect)."""
        return len({p.object for p in self.parts if p.records})

    def oldest_part_ms(self) -> int | None:
        return min((p.created_ms for p in self.parts if p.records), default=None)

    def recover(self, recovery) -> None:
        recovery.writer_local_segments(self)

    def roll_by_publishing(self, part, writer: str) -> bool | None:
        """A writer's local segments are published (uploaded and committed) instead."""
        if any(s.kind == "file" and s.log_size for s in self.segments):
            self.publish(part, writer)
            return True
        return False


    def _manifest_from_catalog(self, cat: "SC.StoreCatalog", known: "M.Manifest | None",
                               *, refresh: bool = True) -> bool:
        """The partition's manifest from the store catalog (docs/formats/store-catalog.md: no
        request of its own; the catalog is its second record, so no ledger read either);
        False when the catalog does not list the partition (read the manifest itself)."""
        if refresh:
            cat.refresh()
        listed, m = cat.manifest(self.ctx.topic, self.ctx.partition)
        if not listed:
            return False
        if known is not None and (m is None or m.version < known.version):
            m = known  # (a view never goes back)
        self.manifest = m
        self._manifest_read_at = time.monotonic()
        return True

    def _unstored(self, cat: "SC.StoreCatalog", known: "M.Manifest | None") -> bool:
        """A partition the catalog does not list (its records, if any, all in journal entries
        it has not folded yet: a new store's first flushes): when the store holds no object of
        its own for it (``StoreCatalog.unstored``: one listing of the topic's directory for
        every partition), it has no manifest and no ledger, and costs no request of its own.
        False when it has a directory (a committer killed before its catalog commit: the
        manifest is read itself, and recorded)."""
        if known is not None or not cat.unstored(self.ctx.topic, self.ctx.partition):
            return False
        self.manifest = None
        self._manifest_read_at = time.monotonic()
        return True

    def _catch_catalog_up(self, cat: "SC.StoreCatalog") -> None:
        """The manifest just read is newer than the catalog's (a committer killed between its
        manifest commit and the catalog's): record it."""
        m = self.manifest
        listed, cm = cat.manifest(self.ctx.topic, self.ctx.partition)
        if m is not None and (not listed or cm is None or cm.version < m.version):
            try:
                cat.record({(self.ctx.topic, self.ctx.partition): m}, "reconcile")
            except (OSError, ReputError):
                pass  # the collector reconciles it

    def _load_manifest(self, known: "M.Manifest | None", *, reread: bool = True,
                       direct: bool = False) -> None:
        """Segments = the latest manifest's (minus what a pending compaction replaced), plus
        staged compaction outputs, plus the writer's local segments (listed from its directory
        the first time, then kept in memory)."""
        if reread:
            # (a writer and a compactor too: a catalog behind a manifest only makes their
            # conditional commits rebase, or abandon a split another committer made)
            cat = SC.for_reading(self.fs)
            if cat is not None and not direct and (self._manifest_from_catalog(cat, known)
                                                   or self._unstored(cat, known)):
                pass
            else:
                self.manifest = M.read_latest(self.fs, self.dir, known)
                self._manifest_read_at = time.monotonic()
                self._check_ledger()
                if cat is not None:
                    self._catch_catalog_up(cat)
        old = {s.log_path: s for s in self.segments if s.kind == "remote"}
        remote = []
        for e in (self.manifest.segments if self.manifest else []):
            rel = f"{self.dir}/{e.log}"
            if rel in self._replaced:
                continue
            seg = old.get(rel) or self._manifest_segment(e, rel)
            remote.append(seg)
        shared = self._shared_segments(refresh=reread)
        if self.writable and not self._local_listed:
            local = self._list_local()
            self._local_listed = True
        else:
            local = [s for s in self.segments if s.kind == "file"]
        self.segments = sorted(remote + self._staged + shared, key=lambda s: s.base) + local

    def _manifest_segment(self, e: SegmentDesc, rel: str) -> Segment:
        """A manifest entry as a segment: its own object pair, or two byte ranges of a
        compaction object (docs/formats/compaction-object.md) read through a ``RangeView``, so
        partitions packed into one object share its cached blocks."""
        brel = f"{self.dir}/{e.bcq}"
        if e.object is None:
            return self._segment(e.base, e.log_size, e.bcq_size, kind="remote", log_rel=rel,
                                 bcq_rel=brel, desc=e)
        view = SH.RangeView(self.fs)
        view.add(rel, e.object, e.log_pos, e.log_size)
        view.add(brel, e.object, e.bcq_pos, e.bcq_size)
        return open_segment(self.ctx, e.base, e.log_size, e.bcq_size, fs=view, log_path=rel,
                            bcq_path=brel, kind="remote", desc=e)

    def _check_ledger(self) -> None:
        """The manifest read (or its absence) against the partition's ledger (reput/ledger.py),
        when its version moved since the last check; a ledger ahead of the manifest is read
        again once (a commit between the listing and the ledger's read). Raises
        ``LedgerMismatchError``: the partition is refused, never served short."""
        from . import ledger as LG
        m = self.manifest
        version = m.version if m is not None else None
        if version is not None and (version == self._ledger_checked
                                    or getattr(m, "ledger_written", False)):
            self._ledger_checked = version  # (checked, or committed by this process)
            return
        for again in (True, False):
            err = LG.check(self.fs, self.dir, fn.manifest_dir(self.dir), version,
                           m.segments if m is not None else [], m.next_offset if m else 0)
            if err is None:
                self._ledger_checked = version
                return
            if not again:
                break
            m = self.manifest = M.read_latest(self.fs, self.dir, self.manifest)
            version = m.version if m is not None else None
        self._ledger_checked = None
        raise err

    @staticmethod
    def _part_key(p: SH.Part) -> tuple:
        return (p.writer, p.seq, p.desc.base if p.desc is not None else -1)

    def _shared_segments(self, *, refresh: bool) -> list[Segment]:
        """The parts of shared objects above the manifest, as segments (after the manifest is
        read: a split committed in between only hides parts, whose objects outlive it by the
        grace period)."""
        j = self.journal
        if j is None:
            self.parts = []
            return []
        if refresh:
            j.refresh()
        split_to = self.manifest.split_to if self.manifest else {}
        parts = self.parts = j.parts(self.ctx.topic, self.ctx.partition, split_to)
        view = SH.RangeView(self.fs)  # for the parts new here (the others keep theirs)
        memo, self._shared_memo = self._shared_memo, None
        if memo is not None and not self._replaced_parts and memo[0] == split_to:
            # (the common case, a flush's new parts after the ones seen: only those are new;
            # parts are kept in offset order and only ever added while split_to stays)
            seen, out = memo[1], memo[2]
            n = len(seen)
            if len(parts) >= n and (n == 0 or (parts[0] is seen[0] and parts[n - 1] is seen[-1])):
                out = list(out)
                for p in parts[n:]:
                    seg = self._shared_segment(p, view)
                    if seg is not None:
                        out.append(seg)
                self._shared_memo = (dict(split_to), parts, out)
                return out
        old = {s.log_path: s for s in self.segments if s.kind == "shared"}
        out = []
        for p in parts:
            d = p.desc
            if d is None or self._part_key(p) in self._replaced_parts:
                continue
            out.append(old.get(f"{self.dir}/{d.log}") or self._shared_segment(p, view))
        if not self._replaced_parts:
            self._shared_memo = (dict(split_to), parts, out)
        return out

    def _shared_segment(self, p: SH.Part, view: SH.RangeView) -> Segment | None:
        """A part new to this view, as a segment (None: a part that only moves the next
        offset)."""
        d = p.desc
        if d is None:
            return None
        lrel, brel = f"{self.dir}/{d.log}", f"{self.dir}/{d.bcq}"
        view.add(lrel, p.object, p.log_pos, d.log_size)
        view.add(brel, p.object, p.bcq_pos, d.bcq_size)
        seg = open_segment(self.ctx, d.base, d.log_size, d.bcq_size, fs=view,
                           log_path=lrel, bcq_path=brel, kind="shared", desc=d)
        seg.part = p
        return seg

    def _list_local(self) -> list[Segment]:
        logs, idxs = self._file_bases(self.local_fs)
        segs = []
        for base in sorted(logs):
            d = f"{self.dir}/{fn.base_name(base)}"
            isz = self.local_fs.size(d + fn.INDEX_SUFFIX) if base in idxs else 0
            segs.append(self._segment(base, self.local_fs.size(d + fn.LOG_SUFFIX), isz))
        self.orphan_indexes = sorted(idxs - logs)
        return segs

    def refresh(self) -> None:
        """A read-only view picks up new data. On a store with shared uploads whose partition
        takes its new records from the journal, that costs no request of its own: the store's
        follower (reput/s3_follow.py: one GET per writer per interval, for every partition of
        the process) finds new entries, and the manifest is re-read only every
        KCOMPACT_S3_MANIFEST_RECHECK_S (one GET of its next version). Otherwise (a store
        without shared uploads, a partition still written by per-partition uploads): the
        manifest is listed again, as ``load``."""
        f = S3F.follower_for(self.fs)
        cat = SC.for_reading(self.fs)
        if f is not None and cat is not None:
            # a store catalog: new manifests come with its next version (the follower's
            # poll), new parts with the journal's entries: no request of this partition's
            gen = f.poll()
            if gen != self._seen_generation:
                self._seen_generation = gen
                if not self._manifest_from_catalog(cat, self.manifest, refresh=False) \
                        and not self._read_directly:
                    self._read_directly = True  # (once: not listed yet, e.g. not folded)
                    if not self._unstored(cat, self.manifest):
                        self._load_manifest(self.manifest, direct=True)
                        return
                self._rebuild()
            return
        m = self.manifest
        if f is None or (m is not None and not (self.parts or m.split_to or not m.segments)):
            self._seen_generation = -1
            self.load()
            return
        changed = False
        if time.monotonic() - self._manifest_read_at >= self._recheck_s:
            changed = self._recheck_manifest()
        gen = f.poll()
        if changed or gen != self._seen_generation:
            self._seen_generation = gen
            self._rebuild()

    def _recheck_manifest(self) -> bool:
        """One GET of the manifest's next version; when it exists, the versions above it are
        listed (a LIST, rare: a split or a compaction committed). Whether it changed."""
        self._manifest_read_at = time.monotonic()
        m = self.manifest
        try:
            nxt = M.read_version(self.fs, self.dir, (m.version if m is not None else 0) + 1)
        except FileNotFoundError:
            return False
        if nxt is None:  # an aborted upload at that version: list past it
            nxt = m
        self.manifest = M.read_latest(self.fs, self.dir, nxt)
        return self.manifest is not m

    def reread(self) -> None:
        """A read that failed is retried on the manifest listed again (a follower's view may
        predate a collected split)."""
        self.reload()

    def reload(self, max_age_s: float = 0.0) -> None:
        """Pick up manifest versions committed by other processes (one listing request),
        unless the manifest was read less than ``max_age_s`` ago."""
        if time.monotonic() - self._manifest_read_at >= max_age_s:
            # (the manifest itself, not the catalog: a read found an object gone)
            self._load_manifest(self.manifest, direct=True)  # cached indexes stay

    def _rebuild(self) -> None:
        """Recompute ``segments`` from the manifest held in memory (no request)."""
        self._load_manifest(self.manifest, reread=False)

    def _upload(self, seg: Segment, log_name: str, bcq_name: str) -> SegmentDesc:
        """Upload a local segment's .log and .bcq as immutable objects (one PUT each)."""
        e = seg.entries()
        lpath, ipath = seg.log_path, seg.bcq_path
        llocal, ilocal = self.local_fs.local_path(lpath), self.local_fs.local_path(ipath)
        ibytes = seg.index_bytes()  # the .bcq as it is stored (a format-1 one's valid entries)
        crc = crc32c(ibytes)
        up = getattr(self.fs, "upload_file", None)
        if up is not None and llocal and ilocal:
            up(f"{self.dir}/{log_name}", llocal)
            if os.path.getsize(ilocal) != ibytes.shape[0]:
                raise CorruptRecordError(f"{ipath}: index size does not match its entries",
                                         ipath, ibytes.shape[0])
            up(f"{self.dir}/{bcq_name}", ilocal)
        else:
            self.fs.write_atomic(f"{self.dir}/{log_name}", self.local_fs.read(lpath))
            self.fs.write_atomic(f"{self.dir}/{bcq_name}", ibytes.tobytes())
        return SegmentDesc.from_entries(seg.base, log_name, bcq_name, seg.log_size,
                                        e["offset"], crc, ibytes.shape[0], seg.format)

    def _encode_for_upload(self, part, seg: Segment, sealing: str) -> Segment:
        """The segment to upload for local segment ``seg``: sealed into format 2 first (in
        ``sealing/`` on the local disk; reput/seal.py) when the store writes format 2, else
        ``seg`` itself."""
        if part.require_format is None or not seg.sealable:
            return seg
        from .seal import encode_segment
        part.require_format(2)
        name = fn.base_name(seg.base)
        log_out, idx_out = (f"{sealing}/{name}{fn.LOG_SUFFIX}",
                            f"{sealing}/{name}{fn.INDEX_SUFFIX}")
        encode_segment(seg, part.config, self.local_fs, log_out, idx_out,
                       getattr(part, "source_codec", None))
        return self._segment(seg.base, self.local_fs.size(log_out), self.local_fs.size(idx_out),
                             kind="staged", log_rel=log_out, bcq_rel=idx_out)

    def _hand_over(self, seg: Segment, log_obj: str, bcq_obj: str) -> None:
        """After a commit: a local segment file becomes the spooled copy of its object (so it
        is read back without a request), or is deleted."""
        seed = getattr(self.fs, "seed", None)
        for rel, obj in ((seg.log_path, log_obj), (seg.bcq_path, bcq_obj)):
            lp = self.local_fs.local_path(rel)
            if seed is not None and lp and os.path.exists(lp):
                seed(obj, lp)
            else:
                self.local_fs.delete(rel)

    def publish(self, part, writer: str = "writer") -> bool:
        """Upload every local segment holding records and commit a manifest version that
        appends them (conditional create; on a lost race re-read and rebase, which fails only
        if another writer wrote offsets past ours). Returns whether a version was committed.
        The local files are dropped only after the commit, so a crash before it leaves
        orphans (deleted later by ``collect_garbage``) and local files that the next open
        uploads again. ``part``: the writing partition (its open files are closed first).
        A writer with shared uploads (``publish_shared``, set by its Store) publishes through the
        store's one shared object instead: every partition it writes at once, never a
        manifest version of this one's."""
        if not self.writable:
            return False
        if self.publish_shared is not None:
            return self.publish_shared()
        local = [s for s in self.segments if s.kind == "file"]
        nxt = self.next_offset
        have = self.next_offset_floor()  # (the manifest's, or a shared part's above it)
        if not any(s.log_size for s in local) and nxt <= have:
            return False
        part._sync_and_close_files()
        uploads = []
        sealing = f"{self.dir}/{fn.SEALING_DIR}"
        try:
            self.local_fs.remove_tree(sealing)
            for seg in local:
                if seg.log_size == 0:
                    continue
                up = self._encode_for_upload(part, seg, sealing)
                tag = secrets.token_hex(8)
                ent = self._upload(up, fn.segment_object(seg.base, tag, fn.LOG_SUFFIX),
                                   fn.segment_object(seg.base, tag, fn.INDEX_SUFFIX))
                uploads.append((seg, ent, up))
            new_entries = [e for _, e, _ in uploads]

            def change(cur: M.Manifest) -> M.Manifest:
                if new_entries and new_entries[0].first_offset <= cur.last_offset:
                    raise M.ManifestConflictError(
                        f"{self.fs.url}/{self.dir}: another writer committed offsets up to "
                        f"{cur.last_offset} while this one wrote from "
                        f"{new_entries[0].first_offset}; one writer per partition at a time")
                return replace(cur, segments=cur.segments + new_entries,
                               next_offset=max(cur.next_offset, nxt))

            new = M.commit(self.fs, self.dir, self.manifest, change, writer=writer,
                           grace_ms=self.grace_ms, clock_ms=self.clock.ms)
        except BaseException:
            self._delete_objects([f"{self.dir}/{n}" for _, e, _ in uploads
                                  for n in (e.log, e.bcq)])
            self.local_fs.remove_tree(sealing)
            raise
        if new is not None:
            self.manifest = new
        for seg in local:
            hit = next(((e, up) for s, e, up in uploads if s is seg), None)
            if hit is not None:
                ent, up = hit
                self._hand_over(up, f"{self.dir}/{ent.log}", f"{self.dir}/{ent.bcq}")
            if hit is None or up is not seg:
                self.local_fs.delete(seg.log_path)
                self.local_fs.delete(seg.bcq_path)
            seg.invalidate()
        self.local_fs.remove_tree(sealing)
        self.segments = [s for s in self.segments if s.kind != "file"]
        self._rebuild()
        return new is not None

    def _delete_objects(self, paths: list[str]) -> None:
        try:
            M.delete_all(self.fs, paths)
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

    @property
    def staged_segments(self) -> list[Segment]:
        """A pending compaction's outputs (local files), not yet uploaded."""
        return list(self._staged)

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
                self._replaced[seg.log_path] = seg.desc
            elif seg.kind == "shared":  # a split (or a compaction of a part): split_to rises
                self._replaced_parts[self._part_key(seg.part)] = seg.part
            else:
                self._staged.remove(seg)
                self.local_fs.delete(seg.log_path)
                self.local_fs.delete(seg.bcq_path)
            seg.invalidate()
        for base, lrel, irel in outputs:
            self._staged.append(self._segment(base, self.local_fs.size(lrel),
                                              self.local_fs.size(irel), kind="staged",
                                              log_rel=lrel, bcq_rel=irel))
        if cleaned_offset is not None:
            self._pending_cleaned = cleaned_offset
        if last_run is not None:
            self._pending_run = last_run
        self._pending = True
        self._rebuild()

    def commit_staged(self, writer: str = "compactor", last_run: dict | None = None,
                      placed: "dict[int, SegmentDesc] | None" = None) -> bool:
        """Upload the staged outputs (one PUT per object) and commit one manifest version that
        replaces the inputs with them, sets the horizon and the last run, and retires the
        inputs (deleted after the grace period). On a lost race the change is rebased if
        every input is still listed; else it is abandoned (outputs deleted, view reloaded)
        and False returned. ``placed``: the staged outputs (by base) already uploaded inside
        a compaction object (reput/compaction_object.py), their entries as given; nothing of
        them is uploaded or deleted here (the object holds other partitions' too)."""
        if not self._pending:
            return True
        if last_run is not None:
            self._pending_run = last_run
        replaced = list(self._replaced.values())
        gone = {e.log for e in replaced}
        cleaned, run = self._pending_cleaned, self._pending_run
        split, split_next = self._split_marks()
        now = self.clock.ms()  # one "now" for the commit: when the replaced objects retire
        uploads = []
        try:
            for seg in self._staged:
                if placed is not None and seg.base in placed:
                    uploads.append((seg, placed[seg.base]))
                    continue
                lname = seg.log_path.rsplit("/", 1)[1]
                iname = seg.bcq_path.rsplit("/", 1)[1]
                if fn.parse_segment_object(lname) is None:  # staged under a plain name
                    tag = secrets.token_hex(8)
                    lname = fn.segment_object(seg.base, tag, fn.LOG_SUFFIX)
                    iname = fn.segment_object(seg.base, tag, fn.INDEX_SUFFIX)
                uploads.append((seg, self._upload(seg, lname, iname)))
            new_entries = [e for _, e in uploads]

            def change(cur: M.Manifest) -> M.Manifest:
                listed = {s.log for s in cur.segments}
                if not gone <= listed or any(cur.split_to.get(w, -1) >= q
                                             for w, q in split.items()):
                    raise M.ManifestConflictError(
                        f"{self.fs.url}/{self.dir}: another compaction replaced segments this "
                        "one was rewriting; its outputs are abandoned")
                return replace(cur, segments=[s for s in cur.segments if s.log not in gone]
                               + new_entries,
                               cleaned_offset=cur.cleaned_offset if cleaned is None else cleaned,
                               last_run=run if run is not None else cur.last_run,
                               retired=cur.retired + [_retired(e, now) for e in replaced],
                               split_to={**cur.split_to, **split},
                               split_log=cur.with_split(split, now, self.grace_ms) if split
                               else cur.split_log,
                               next_offset=max(cur.next_offset, split_next))

            new = M.commit(self.fs, self.dir, self.manifest, change, writer=writer,
                           grace_ms=self.grace_ms, clock_ms=lambda: now)
        except M.ManifestConflictError:
            self._delete_objects([f"{self.dir}/{n}" for _, e in uploads if e.object is None
                                  for n in (e.log, e.bcq)])
            self.abort_staged()
            return False
        except BaseException:
            self._delete_objects([f"{self.dir}/{n}" for _, e in uploads if e.object is None
                                  for n in (e.log, e.bcq)])
            raise
        self.manifest = new
        try:
            for seg, ent in uploads:
                if ent.object is None:
                    self._hand_over(seg, f"{self.dir}/{ent.log}", f"{self.dir}/{ent.bcq}")
                seg.invalidate()  # (placed: the object's local copy is spooled whole)
        finally:
            # committed: the view is the new version even if the local clean-up fails (it
            # must not list staged files that were handed over; recovery removes the rest)
            self._clear_pending()
            self._rebuild()
        self.local_fs.remove_tree(self.staging_dir)
        return True

    def install_segments(self, part, local_dir: str, bases: list[int], last_run: dict | None,
                         writer: str = "replica", cleaned_offset: int = -1) -> bool:
        """S3: replace every segment of the partition with the local segments
        ``local_dir/<base>.log/.bcq`` (on ``local_fs``) in one manifest commit, the compaction
        horizon set to ``cleaned_offset`` (a replica's install: -1, or the horizon its pulled
        records are clean up to). The writer's own local segments are published first, so they
        are among the replaced ones."""
        self.publish(part, writer)
        self.stage_swap([s.base for s in self.sealed_segments],
                        [(b, f"{local_dir}/{fn.base_name(b)}{fn.LOG_SUFFIX}",
                          f"{local_dir}/{fn.base_name(b)}{fn.INDEX_SUFFIX}") for b in bases],
                        cleaned_offset, last_run)
        return self.commit_staged(writer)

    def _split_marks(self) -> tuple[dict[str, int], int]:
        """What a commit replacing parts of shared objects records: per writer the highest
        journal entry replaced (and, when every part with records is replaced, those without
        records), and the next offset the parts it covers reach. The replaced parts must be
        the partition's first ones (a prefix by offset)."""
        split: dict[str, int] = {}
        for p in self._replaced_parts.values():
            split[p.writer] = max(split.get(p.writer, -1), p.seq)
        if split and all(self._part_key(p) in self._replaced_parts
                         for p in self.parts if p.records):
            for p in self.parts:  # every record taken: the parts without records go too
                if not p.records:
                    split[p.writer] = max(split.get(p.writer, -1), p.seq)
        covered = [p for p in self.parts if p.seq <= split.get(p.writer, -1)]
        missed = [p for p in covered if p.records and self._part_key(p) not in self._replaced_parts]
        if missed:
            raise ReputError(f"{self.dir}: a split must replace the partition's first parts of "
                             f"shared objects; {missed[0].object} is left out")
        return split, max((p.next_offset for p in covered), default=0)

    def stage_split(self, segments: list[Segment] | None = None,
                    max_bytes: int | None = None) -> int:
        """The split (docs/formats/shared-upload.md): the partition's parts of shared objects
        (``segments``: those listed when it started, default all) joined into per-partition
        format-2 segments - batches copied as they are, one lean index built over them - and
        staged in their place; ``commit_staged`` publishes them with ``split_to`` raised.
        Returns how many parts it joined. (A process whose writer flushes meanwhile joins
        without the store's lock and stages under it: ``join_parts``, then ``stage_swap``, as
        ``Compactor._split`` does.)"""
        shared = [s for s in (segments if segments is not None else self.segments)
                  if s.kind == "shared"]
        if not shared:
            return 0
        outputs = self.join_parts(shared, max_bytes)
        self.stage_swap([s.base for s in shared], outputs, None)
        return len(shared)

    def join_parts(self, shared: list[Segment], max_bytes: int | None = None
                   ) -> list[tuple[int, str, str]]:
        """Local segments (base, .log, .bcq in the staging directory) holding ``shared``'s
        batches in order, one per run of parts with the same codec and at most ``max_bytes``
        of .log (the topic's segment.bytes; a larger part is a segment of its own)."""
        from . import bcq2 as B2
        groups: list[list[Segment]] = []
        size = 0
        codecs, targets = {}, {}
        for seg in shared:
            codec = codecs[seg.base] = seg.index().codec
            targets[seg.base] = seg.index().target
            if groups and codecs[groups[-1][0].base] == codec and (
                    max_bytes is None or size + seg.log_size <= max_bytes):
                groups[-1].append(seg)
                size += seg.log_size
            else:
                groups.append([seg])
                size = seg.log_size
        outputs = []
        for group in groups:
            lrel, irel = self.staging_paths(group[0].base)
            builder = B2.IndexBuilder(spill_dir=self.local_fs.local_path(self.staging_dir))
            out = self.local_fs.open_append(lrel)
            try:
                for seg in group:
                    idx = seg.index()
                    _, bsize, bcount = idx.batches()
                    if int(bsize.sum()) != seg.log_size:
                        raise CorruptRecordError(f"{seg.log_path}: its lean index covers "
                                                 f"{int(bsize.sum())} of its {seg.log_size} "
                                                 "bytes; run `kcompact verify`", seg.log_path, 0)
                    builder.add_batches(builder.log_size, bsize, bcount, idx.entries)
                    out.write(seg.read_log(0, seg.log_size))
                out.sync()
            finally:
                out.close()
            idxf = self.local_fs.open_append(irel)
            try:
                builder.write_to(idxf, codecs[group[0].base], targets[group[0].base])
                idxf.sync()
            finally:
                idxf.close()
            outputs.append((group[0].base, lrel, irel))
        return outputs

    # -- a writer's flush with shared uploads (reput/publisher.py ``SharedPublisher``) -------

    def shared_piece(self, part) -> "SharedPiece | None":
        """What this partition adds to the writer's shared object (``SharedPiece``: its local
        segments, the parts to write for those holding records, its next offset); None when
        nothing changed since the last flush. Each part is (base, log, log_size, bcq, offsets):
        ``log`` the format-2 ``.log`` bytes encoded in memory (no local file, no fsync: the
        commit log is the durable copy until the journal commit), or the OS path of a local
        format-2 ``.log`` (a segment already sealed, or one larger than
        ``SHARED_ENCODE_IN_MEMORY``, sealed into ``sealing/`` first)."""
        if not self.writable:
            return None
        local = [s for s in self.segments if s.kind == "file"]
        nxt = self.next_offset
        if not any(s.log_size for s in local) and nxt <= self.next_offset_floor():
            return None
        part._sync_and_close_files(fsync=False)
        sealing = f"{self.dir}/{fn.SEALING_DIR}"
        ups = []
        if not self._sealing_looked:
            self._sealing_looked = True
            if os.path.isdir(self.local_fs.local_path(sealing) or "-"):
                self.local_fs.remove_tree(sealing)  # (a crashed flush's)
        times = self._part_times = {}
        try:
            for seg in local:
                if seg.log_size:
                    ups.append(self._shared_part(part, seg, sealing))
                    ts = seg.entries()["timestamp"]
                    if ts.shape[0]:
                        times[seg.base] = (int(ts.min()), int(ts.max()))
        except BaseException:
            self.local_fs.remove_tree(sealing)
            raise
        return SharedPiece(self, local, ups, nxt)

    def _shared_part(self, part, seg: Segment, sealing: str) -> tuple:
        if (part.require_format is not None and seg.sealable
                and seg.log_size <= SHARED_ENCODE_IN_MEMORY):
            from .seal import encode_segment_bytes
            part.require_format(2)
            log, bcq, offs = encode_segment_bytes(seg, part.config,
                                                  getattr(part, "source_codec", None))
            return seg.base, log, len(log), np.frombuffer(bcq, np.uint8), offs
        up = self._encode_for_upload(part, seg, sealing)
        return (up.base, self.local_fs.local_path(up.log_path), up.log_size, up.index_bytes(),
                up.entries()["offset"])

    def ensure_manifest(self, writer: str) -> None:
        """A partition's first shared upload: an empty manifest version first (one PUT, once),
        so that listing the store's partitions finds it without reading the journal."""
        if self.manifest is not None:
            return
        new = M.commit(self.fs, self.dir, None, lambda cur: cur if cur.version == 0 else None,
                       writer=writer, grace_ms=self.grace_ms, clock_ms=self.clock.ms)
        self.manifest = new if new is not None else M.read_latest(self.fs, self.dir)

    def shared_aborted(self) -> None:
        self._part_times = {}
        if os.path.isdir(self.local_fs.local_path(f"{self.dir}/{fn.SEALING_DIR}") or "-"):
            self.local_fs.remove_tree(f"{self.dir}/{fn.SEALING_DIR}")

    def shared_committed(self, local: list[Segment], ups: list) -> None:
        """The journal entry holding this partition's part is committed: its local segments
        are dropped and the part is listed from the journal. Those holding records are
        unmapped and deleted by the process's dropper thread (``drop_later``), off the
        flush's path: their names are never used again (the next segment starts past their
        records), and a crash before they are gone leaves segments the journal covers, which
        the next open drops."""
        later = []
        for seg in local:
            if seg.log_size and seg.fs is self.local_fs:
                later.append(seg)
                continue
            seg.fs.delete(seg.log_path)  # (empty, or in memory: reput/active_memory.py)
            seg.fs.delete(seg.bcq_path)
            seg.invalidate()
        if later:
            drop_later(self.local_fs, later)
        if any(isinstance(u[1], str) for u in ups):  # (a large part sealed into sealing/)
            self.local_fs.remove_tree(f"{self.dir}/{fn.SEALING_DIR}")
        self.segments = [s for s in self.segments if s.kind != "file"]
        self._rebuild()
        times, self._part_times = self._part_times, {}
        for seg in reversed(self.segments):  # (the new parts are the last shared segments)
            if not times:
                break
            if seg.kind == "shared":
                got = times.pop(seg.base, None)
                if got is not None:
                    seg.time_range = got

    def _clear_pending(self) -> None:
        self._staged, self._replaced = [], {}
        self._replaced_parts = {}
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
        self._shared_memo = None
        self._load_manifest(self.manifest)

    def collect_garbage(self) -> list[str]:
        """Delete replaced segments, orphans and old manifest versions past the grace period
        (reput/manifest.py ``collect_garbage``). Returns the deleted paths."""
        return M.collect_garbage(self.fs, self.dir, grace_ms=self.grace_ms,
                                 now_ms=self.clock.ms(), known=self.manifest,
                                 objects_now_ms=self.fs.clock_ms())


def _retired(e: SegmentDesc, now: int) -> dict:
    """A replaced segment's ``retired`` entry (manifest.md); one inside a compaction object
    names it, so the object outlives the replacement by the grace period."""
    r = {"log": e.log, "bcq": e.bcq, "since_ms": now}
    if e.object is not None:
        r["object"] = e.object
    return r



class SharedPiece:
    """One partition's share of a writer's shared object: its local segments (``local``),
    the parts to write for those holding records (``uploads``: (base, log, log_size, bcq,
    offsets)), its next offset; and what the publisher tells the partition of the commit."""

    __slots__ = ("catalog", "local", "uploads", "next_offset")

    def __init__(self, catalog: ManifestCatalog, local: list, uploads: list, next_offset: int):
        self.catalog, self.local, self.uploads = catalog, local, uploads
        self.next_offset = next_offset

    def ensure_manifest(self, writer: str) -> None:
        self.catalog.ensure_manifest(writer)

    def aborted(self) -> None:
        self.catalog.shared_aborted()

    def committed(self) -> None:
        self.catalog.shared_committed(self.local, self.uploads)


__all__ = ["ManifestCatalog", "SharedPiece"]
