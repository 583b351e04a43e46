"""How a store's writes become what readers see: one publisher per kind of backend.

A store is a local directory, an S3 prefix whose writers upload each partition on its own, or an
S3 prefix whose writers upload one object for all their partitions (docs/formats/manifest.md,
docs/formats/shared-upload.md). What differs between the three is how a writer's and a
compactor's work is published, so that is one implementation per kind, picked once where the
store opens (``publisher_for``, called by ``Store.__init__``), the way Kafka's
``RemoteStorageManager`` is an interface:

=====================  ==========================  ===========================  ===========================
step                   ``LocalPublisher``          ``ManifestPublisher``        ``SharedPublisher``
=====================  ==========================  ===========================  ===========================
a flush                (fsync and the segment      each partition: uploads and  one object for every
                       list: the partition's sync) a manifest version           partition + one journal entry
compaction's swap      the swap plan, applied at   staged; one manifest         as per partition
                       once (reput/swap.py)        version at the run's end
a replica's install    the swap plan               one manifest version         as per partition
=====================  ==========================  ===========================  ===========================

Flush (``Store.flush``), a roll (``PartitionLog.roll``: on S3 a roll publishes), compaction's
swap (compaction/compactor.py), a replica's install (replication/replica.py) and the store's
listings call the store's publisher and never ask which kind it is (tests/unit/test_sealing.py
keeps it so). A partition's own catalog (reput/catalog_local.py, reput/catalog_manifest.py) is
the per-partition half of the same implementation: the publisher drives it through the
partition's methods.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING, Any

from . import filenames as fn
from . import shared as SH
from . import swap
from .backend import Backend, LocalBackend
from .errors import ReputError

if TYPE_CHECKING:
    from .partition import PartitionLog

PUBLISH_THREADS = 16  # partitions published at once by an S3 writer's flush


class Publisher:
    """The interface; a local store's publisher (every step is the partition's own sync)."""

    #: whether the partitions' files can be appended to where they are (a local directory)
    kind = "local"
    #: the partitions' writers keep their active segments in the store itself
    writes_in_place = True
    #: this writer's flushes upload one shared object (docs/formats/shared-upload.md)
    shared = False
    #: a compaction round's swap is committed at once (so a run checks its inputs before it
    #: writes anything, and a failed run takes back the roll it made); else it is staged and
    #: published at the run's end
    commits_each_round = True
    #: a compaction's inputs may be deleted under it by another compactor (a replaced object
    #: past the grace period)
    inputs_may_vanish = False
    #: a flush fsyncs the partitions' files (else the commit log, fsynced, is the durable copy
    #: until the publish commits, after which the local segments are dropped)
    fsyncs_partitions = True

    def __init__(self, fs: Backend, commitlog_fs: Backend, local_fs: Backend):
        #: the store's backend, the writer's commit log's, and where active segments live
        self.fs, self.commitlog_fs, self.local_fs = fs, commitlog_fs, local_fs
        self.store: Any = None

    def bind(self, store) -> None:
        """The store this publisher publishes for (its lock, writer, clock, partitions)."""
        self.store = store

    # -- the store ------------------------------------------------------------------------

    def opened(self, meta) -> None:
        """store.json was read (the store's open)."""

    def adopted(self, meta) -> None:
        """store.json was read again (another process may have changed its features)."""

    #: reading a partition's metadata costs no request (a local file), so what is recorded
    #: beside every partition can be read again at each pass
    cheap_metadata = True
    #: a partition's compaction horizon is a file of its own (compaction.checkpoint), read and
    #: checked on its own; else it is the manifest's, validated with it
    checkpoint_file = True

    def requires_lists(self, features: list[str], feature: str) -> bool:
        """Whether every partition must have a segment list (store.json's features say so)."""
        return feature in features

    def store_catalog(self):
        """The store's catalog (docs/formats/store-catalog.md), or None: a local store has
        none (its directory listing is the catalog)."""
        return None

    def follower(self):
        """The process's follower of the store's shared uploads (reput/s3_follow.py), or None:
        a local store's readers look at its files."""
        return None

    def unlisted_partitions(self, topic: str) -> set[int]:
        """Partitions this writer holds that the store's listing does not show yet."""
        return set()

    def writable_opened(self, pl: "PartitionLog", key: tuple[str, int]) -> None:
        """A partition was opened for write by this store."""
        st = self.store
        if st.options.seal_format == 2 and st.options.seal == "background":
            st._background_seals(pl)

    def take_over_local_segments(self) -> None:
        """After a writer's open dispatched its commit log: local segments a dead writer left
        that the next flush must publish (an object store)."""

    def publish_all(self) -> None:
        """A flush, after the partitions' fsyncs and before the reput checkpoint moves:
        publish every partition this writer appended to (a local store: their sync did)."""

    def collect_shared_garbage(self) -> list[str]:
        """Shared objects no partition needs any more, deleted past the grace period."""
        return []

    def compaction_batch(self):
        """The batch that publishes a compaction run's outputs of every partition in one
        object (reput/compaction_object.py); None: each partition publishes its own."""
        return None

    def collect_compaction_garbage(self) -> list[str]:
        """Compaction objects no partition lists any more, deleted past the grace period."""
        return []

    def closed(self) -> None:
        """The store's writer closed its partitions."""
        st = self.store
        if st._wrote_partitions and not st.require_list:
            st._wrote_partitions = False
            st._maybe_require_lists()

    # -- a compaction of one partition (compaction/compactor.py) --------------------------

    def begin_compaction(self, pl: "PartitionLog") -> None:
        """Before a run reads anything (under the store's lock)."""

    def compaction_roll(self, pl: "PartitionLog", writer: str) -> bool:
        """A forced compaction takes the active segment too: roll it (not re-encoded: this
        compaction writes it in format 2). Returns whether it rolled (taken back on failure)."""
        if pl.segments and pl.segments[-1].log_size > 0:
            return pl.roll(seal=False)
        return False

    def output_paths(self, pl: "PartitionLog", base: int) -> tuple[str, str]:
        """Where a compaction output based at ``base`` is staged (.log, .bcq on
        ``pl.local_fs``)."""
        sdir = swap.staging_dir(pl.dir)
        name = fn.base_name(base)
        return f"{sdir}/{name}{fn.LOG_SUFFIX}", f"{sdir}/{name}{fn.INDEX_SUFFIX}"

    def begin_outputs(self, pl: "PartitionLog") -> None:
        """Before a round stages its outputs: nothing left of an earlier round's staging."""
        self.fs.remove_tree(swap.staging_dir(pl.dir))

    @property
    def restamps_in_place(self) -> bool:
        """An output may be a new index beside the input's .log (compaction-swap.md,
        "index-only outputs"); not where each output is a new object pair."""
        return True

    def swap(self, pl: "PartitionLog", plan: swap.SwapPlan,
             staged: list[tuple[int, str, str]]) -> None:
        """Replace a round's inputs with its staged outputs (reput/swap.py: committed, then
        applied under the store's lock)."""
        fs = self.fs
        fs.sync_dir(swap.staging_dir(pl.dir)) if fs.isdir(swap.staging_dir(pl.dir)) else None
        swap.commit(fs, pl.dir, plan)
        with self.store.lock:
            swap.apply(fs, pl.dir, plan)
            pl.reload_after_swap()

    def abort_compaction(self, pl: "PartitionLog", rolled: bool) -> None:
        """A run that failed (under the store's lock): staged outputs not committed are
        deleted, and the roll it made taken back while the new active segment is empty."""
        if not self.fs.exists(f"{swap.staging_dir(pl.dir)}/{swap.PLAN_NAME}"):
            swap.abort(self.fs, pl.dir)
        if rolled:
            pl.unroll()

    def published_last_run(self, pl: "PartitionLog") -> dict | None:
        """The last run as published (what the next run's totals add to)."""
        return pl.checkpoint()[1]

    def finish_compaction(self, pl: "PartitionLog", run: dict | None, writer: str,
                          delete_delay_s: float = 0.0) -> bool:
        """The run's end: its result recorded, replaced segments deleted (after
        ``delete_delay_s``). Whether it was published (False: another compaction won)."""
        if run is not None:
            swap.write_checkpoint(self.fs, pl.dir, None, run)
        if delete_delay_s <= 0:
            swap.empty_trash(self.fs, pl.dir)
        else:
            swap.empty_trash_later(self.fs, pl.dir, delete_delay_s)
        return True

    # -- a replica's install (replication/replica.py) -------------------------------------

    def install(self, pl: "PartitionLog", staged_dir: str, bases: list[int],
                last_run: dict | None, cleaned_offset: int, writer: str = "replica") -> None:
        """Replace every segment of ``pl`` with the segments ``staged_dir/<base>.log/.bcq``
        (the swap's staging directory on a local store) in one commit, the horizon set to
        ``cleaned_offset``; the store's cached partition is released."""
        if staged_dir != swap.staging_dir(pl.dir):
            raise ReputError(f"{pl.dir}: an install stages in {swap.staging_dir(pl.dir)}")
        plan = swap.SwapPlan([s.base for s in pl.segments], bases, cleaned_offset, last_run)
        swap.commit(self.fs, pl.dir, plan)
        with self.store.lock:
            swap.apply(self.fs, pl.dir, plan)
            # reopened: the active segment may have been replaced by a pulled one
            self.store.release_partition(pl.topic, pl.partition)

    def installed(self, pl: "PartitionLog") -> None:
        """After an install's marker says it is done: what it replaced is deleted."""
        swap.empty_trash(self.fs, pl.dir)


LocalPublisher = Publisher


class ManifestPublisher(Publisher):
    """An object store whose writers upload each partition on its own: every flush uploads each
    partition's new segments and commits its manifest (reput/catalog_manifest.py)."""

    kind = "s3"
    writes_in_place = False
    commits_each_round = False
    inputs_may_vanish = True

    def __init__(self, fs: Backend, commitlog_fs: Backend, local_fs: Backend):
        super().__init__(fs, commitlog_fs, local_fs)
        #: partitions whose garbage this writer collected when it opened them
        self._collected: set[tuple[str, int]] = set()

    def opened(self, meta) -> None:
        if SH.FEATURE in meta.features:  # a reader (or a per-partition writer) of such a store
            SH.enable(self.fs).refresh(0.0)
        else:
            SH.checked(self.fs)  # store.json was just read: no shared uploads yet

    def adopted(self, meta) -> None:
        if SH.FEATURE in meta.features:
            SH.enable(self.fs)  # another process started shared uploads meanwhile

    cheap_metadata = False
    checkpoint_file = False

    def requires_lists(self, features: list[str], feature: str) -> bool:
        return False  # (a manifest lists every partition's segments)

    def store_catalog(self):
        from . import store_catalog as SC
        return SC.for_store(self.fs)

    def follower(self):
        from . import s3_follow as S3F
        return S3F.follower_for(self.fs)

    def unlisted_partitions(self, topic: str) -> set[int]:
        st = self.store
        with st.lock:  # this writer's partitions that have no manifest yet
            return {p for (t, p), pl in st._partitions.items()
                    if t == topic and (t, p) in st._writable and pl.segments}

    def writable_opened(self, pl: "PartitionLog", key: tuple[str, int]) -> None:
        st = self.store
        from . import store_catalog as SC
        if self.shared and SC.for_store(self.fs) is not None:
            return  # (a shared-upload writer of a catalog store uploads no segment of the
            # partition's: the compactor collects after its runs, with no LIST a partition)
        if st.writer is not None and key not in self._collected:
            # a writer's open cleans up after dead writers: orphans of an upload whose commit
            # never came, replaced segments past the grace period
            self._collected.add(key)
            pl.collect_garbage()

    def take_over_local_segments(self) -> None:
        """Local segments a dead writer left in this commit-log directory (appended, maybe
        flushed to its commit log, never published) are opened here, so the flush that follows
        publishes them. Partitions another live process writes are left to it."""
        from .errors import StoreLockedError
        from .record import validate_topic
        st = self.store
        for topic in self.local_fs.listdir(fn.PARTITIONS_DIR):
            try:
                validate_topic(topic)
            except ReputError:
                continue
            for p in self.local_fs.listdir(fn.topic_dir(topic)):
                if not p.isdigit() or (topic, int(p)) in st._writable:
                    continue
                names = self.local_fs.listdir(fn.partition_dir(topic, int(p)))
                if not any(fn.parse_base(n) for n in names):
                    continue
                try:
                    st.writable_partition(topic, int(p))
                except StoreLockedError:
                    continue

    def publish_all(self) -> None:
        """Every writable partition, several at once (each is a few requests whose latency,
        not bandwidth, is the cost); the first failure is raised."""
        from contextlib import nullcontext

        from . import store_catalog as SC
        cat = SC.for_store(self.fs)
        # (a store catalog: every partition's manifest commit recorded as one version)
        with cat.batch(self.store.writer or "writer") if cat is not None else nullcontext():
            self._publish_partitions()

    def _publish_partitions(self) -> None:
        st = self.store
        writer = st.writer or "writer"
        pls = [st._partitions[k] for k in sorted(st._writable)]
        if len(pls) <= 1:
            for pl in pls:
                pl.publish(writer)
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(PUBLISH_THREADS, len(pls)),
                                thread_name_prefix="kcompact-publish") as ex:
            for f in [ex.submit(pl.publish, writer) for pl in pls]:
                f.result()

    def collect_shared_garbage(self) -> list[str]:
        """Shared objects every partition has split, and orphans, once the grace period has
        passed (reput/shared.py ``collect_garbage``)."""
        j = SH.journal_for(self.fs)
        if j is None:
            return []
        from . import manifest as M
        st = self.store

        def manifest_of(topic: str, partition: int):
            pl = st._partitions.get((topic, partition))
            if pl is not None and pl.manifest is not None:
                return pl.manifest  # (stale only errs on keeping)
            return M.read_latest(self.fs, fn.partition_dir(topic, partition))
        return SH.collect_garbage(self.fs, j, manifest_of,
                                  grace_ms=int(getattr(self.fs, "grace_ms", 0)),
                                  now_ms=st.clock.ms(), objects_now_ms=self.fs.clock_ms())

    def compaction_batch(self):
        from . import compaction_object as CO
        if CO.mode(self.store.meta.features) != "store":  # KCOMPACT_S3_COMPACTION_OBJECTS
            return None
        st = self.store
        return CO.CompactionBatch(self.fs, self.local_fs.local_path(fn.COMPACTED_DIR),
                                  writer=st.writer or "compactor",
                                  require_format=st.require_format)

    def collect_compaction_garbage(self) -> list[str]:
        import sys
        from . import compaction_object as CO
        from . import manifest as M
        st = self.store

        def manifest_of(topic: str, partition: int):
            pl = st._partitions.get((topic, partition))
            if pl is not None and pl.manifest is not None:
                return pl.manifest  # (read by this run: stale only errs on keeping)
            return M.read_latest(self.fs, fn.partition_dir(topic, partition))
        return CO.collect_garbage(self.fs, manifest_of,
                                  grace_ms=int(getattr(self.fs, "grace_ms", 0)),
                                  now_ms=st.clock.ms(), objects_now_ms=self.fs.clock_ms(),
                                  warn=lambda line: print(line, file=sys.stderr))

    def closed(self) -> None:
        pass

    # -- compaction: staged in this partition's view, one manifest version at the end ------

    def begin_compaction(self, pl: "PartitionLog") -> None:
        # nothing pending from an earlier, failed compaction; a fresh manifest
        pl.abort_staged() if pl.has_staged else pl.reload_manifest(max_age_s=1.0)

    def compaction_roll(self, pl: "PartitionLog", writer: str) -> bool:
        pl.publish(writer)  # the writer's local segments, published (nothing to take back)
        return False

    def output_paths(self, pl: "PartitionLog", base: int) -> tuple[str, str]:
        return pl.staging_paths(base)

    def begin_outputs(self, pl: "PartitionLog") -> None:
        pass  # (each output has a fresh name)

    @property
    def restamps_in_place(self) -> bool:
        return False  # a manifest names a new object pair per output

    def swap(self, pl: "PartitionLog", plan: swap.SwapPlan,
             staged: list[tuple[int, str, str]]) -> None:
        # only this object's view changes now; finish_compaction publishes every round
        with self.store.lock:
            pl.stage_swap(plan.inputs, staged or [], plan.cleaned_offset, plan.last_run)

    def abort_compaction(self, pl: "PartitionLog", rolled: bool) -> None:
        pl.abort_staged()

    def published_last_run(self, pl: "PartitionLog") -> dict | None:
        return pl.manifest.last_run if pl.manifest else pl.checkpoint()[1]

    def finish_compaction(self, pl: "PartitionLog", run: dict | None, writer: str,
                          delete_delay_s: float = 0.0) -> bool:
        """The staged rounds as one manifest version, then garbage collected."""
        ok = True
        with self.store.lock:
            if pl.has_staged:
                ok = pl.commit_staged(writer, run)
        pl.collect_garbage()
        return ok

    def install(self, pl: "PartitionLog", staged_dir: str, bases: list[int],
                last_run: dict | None, cleaned_offset: int, writer: str = "replica") -> None:
        # the staged segments replace every live one in one manifest commit
        with self.store.lock:
            pl.install_segments(staged_dir, bases, last_run, writer, cleaned_offset)
            self.store.release_partition(pl.topic, pl.partition)

    def installed(self, pl: "PartitionLog") -> None:
        pass  # (the replaced objects retire with the commit)


class SharedPublisher(ManifestPublisher):
    """An object store whose writer uploads ONE object per flush for every partition it
    appended to, committed by ONE journal entry (docs/formats/shared-upload.md)."""

    kind = "s3-shared"
    shared = True
    fsyncs_partitions = False

    def __init__(self, fs: Backend, commitlog_fs: Backend, local_fs: Backend):
        super().__init__(fs, commitlog_fs, local_fs)
        self._registered = False  # in the shared-upload writers registry
        from .active_memory import ActiveMemory, budget_bytes
        limit = budget_bytes()
        #: the partitions' active segments, in memory up to the budget (reput/active_memory.py)
        self.active = ActiveMemory(limit) if limit > 0 else None

    def opened(self, meta) -> None:
        SH.enable(self.fs).refresh(0.0)  # (a writer numbers its next object from it)

    def writable_opened(self, pl: "PartitionLog", key: tuple[str, int]) -> None:
        pl.publish_through(self.publish_shared)  # a roll, a close, a forced compaction too
        pl.active_memory = self.active
        super().writable_opened(pl, key)

    def publish_all(self) -> None:
        self.publish_shared()

    def publish_shared(self) -> bool:
        """The new records of every partition this writer appended to since the last flush,
        each sealed into format 2, go into ONE object (1 PUT) committed by ONE journal entry (a
        conditional PUT): 2 requests whatever the partition count. Each partition's local
        segments are dropped only after the commit: a crash before it leaves an orphan object
        (collected) and local segments the next open uploads again; after it, local segments
        the journal already covers (recovery drops them). Returns whether an object was
        committed."""
        with self.store.lock:
            return self._publish_shared_locked()

    def _publish_shared_locked(self) -> bool:
        st = self.store
        writer = st.writer or "writer"
        pieces = []
        try:
            for key in sorted(st._writable):
                piece = st._partitions[key].shared_piece()
                if piece is not None:
                    pieces.append((key, piece))
            if not pieces:
                return False
            # store.json says shared uploads are in use before the first shared object
            st.require_format(SH.STORE_FORMAT, SH.FEATURE)
            from . import store_catalog as SC
            if SC.for_store(self.fs) is None:  # (a store catalog lists them instead)
                for _, piece in pieces:  # listed by the store (topics, partitions) from now on
                    piece.ensure_manifest(writer)
            journal = SH.enable(self.fs)
            if not self._registered:  # followers learn of this writer (reput/s3_follow.py)
                SH.register_writer(self.fs, writer, st.clock.ms())
                self._registered = True
            seq = journal.next_seq(writer)
            stage = f"{fn.SHARED_DIR}/{writer}"
            self.commitlog_fs.remove_tree(stage)  # a crashed flush's object: an orphan on S3
            tag = secrets.token_hex(8)
            ospath = self.commitlog_fs.local_path(f"{stage}/{fn.shared_object(seq, tag)}")
            os.makedirs(os.path.dirname(ospath), exist_ok=True)
            with open(ospath, "wb") as out:
                b = SH.ObjectBuilder(out, writer, seq, tag)
                for (topic, partition), piece in pieces:
                    ups, nxt = piece.uploads, piece.next_offset
                    reached = -1  # the next offset of its last part with records
                    for i, (base, log, log_size, bcq, offs) in enumerate(ups):
                        if not offs.shape[0]:
                            continue
                        reached = ups[i + 1][0] if i + 1 < len(ups) else nxt
                        b.add(topic, partition, base, log, log_size, bcq, offs, reached)
                    if reached < nxt:
                        b.advance(topic, partition, nxt)
                b.finish()
            entry = SH.commit_object(self.fs, journal, writer, b, ospath, st.clock.ms())
        except BaseException:
            for _, piece in pieces:
                piece.aborted()
            self.commitlog_fs.remove_tree(f"{fn.SHARED_DIR}/{writer}")
            raise
        seed = getattr(self.fs, "seed", None)
        if seed is not None:  # read back from the spool, without a request
            seed(f"{fn.SHARED_DIR}/{writer}/{b.name}", ospath)
        else:
            os.unlink(ospath)
        for key, piece in pieces:
            # the active segment's files are taken over by the partition's next segment
            # (emptied and renamed: PartitionLog.reuse_files_of), not deleted and created anew
            spare = next((s for s in reversed(piece.local) if s.log_size), None)
            if spare is not None:
                piece.local.remove(spare)
            piece.committed()
            if spare is not None:
                st._partitions[key].reuse_files_of(spare)
        st.shared_committed(entry)  # (a store catalog: the writer's fold)
        return True


def publisher_for(fs: Backend, meta, *, writer: str | None, options,
                  commitlog_fs: Backend | None, default_commitlog_dir) -> Publisher:
    """The publisher of a store opened on ``fs`` (store.json's ``meta``): local when its files
    can be appended to; on an object store shared uploads when this writer makes them (the
    options say "shared", or "auto" in a store that has the feature), else per partition.
    ``commitlog_fs``: the writer's local directory (default ``default_commitlog_dir(store
    id)`` on an object store)."""
    if fs.appendable:
        return Publisher(fs, commitlog_fs or fs, fs)
    clfs = commitlog_fs or LocalBackend(default_commitlog_dir(meta.store_id))
    if not clfs.appendable:
        raise ReputError(f"{fs.url}: pass a local commitlog_dir for the writer's commit log")
    shared = writer is not None and (
        options.upload == "shared" or (options.upload == "auto" and options.seal_format == 2
                                       and SH.FEATURE in meta.features))
    if shared:
        # (the local segments live a flush interval: no blocks reserved for them ahead,
        # which emptying them would free again: reput/segment_recycle.py)
        local = LocalBackend(clfs.root, preallocate=False) if isinstance(clfs, LocalBackend) \
            else clfs
        return SharedPublisher(fs, clfs, local)
    return ManifestPublisher(fs, clfs, clfs)


__all__ = ["LocalPublisher", "ManifestPublisher", "PUBLISH_THREADS", "Publisher",
           "SharedPublisher", "publisher_for"]
