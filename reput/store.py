"""The store: store.json, commit-log writers, reput, and per-partition compaction logs.

``Store.open(url)`` opens a store read-only (safe next to a live writer: nothing is modified).
``Store.open(url, writer="w")`` also takes the commit log ``commitlog/w/``: it truncates a torn
commit-log tail, then re-dispatches from the reput checkpoint (idempotent: offsets at or below a
partition's last indexed offset are skipped), recovering each partition it writes to.

``append(batch)`` encodes the batch into the commit log and dispatches it at once into the
partitions' compaction logs (reput), so reads see it immediately; ``flush()`` makes it durable:
commit log fsync, partition fsync, then the reput checkpoint. Every flushed record survives a
crash exactly once.

On S3 (``s3://bucket/prefix``, docs/formats/manifest.md) the commit log and each partition's
active segments live in a local directory (``commitlog_dir``, default
``~/.cache/kcompact/<store id>/``), and ``flush()`` also publishes them: each partition appended
since the last flush uploads its segments and commits a manifest version, before the reput
checkpoint moves. Other processes see a writer's records once they are flushed.

The store's jobs, each in its room (docs/architecture.md, "The rooms of the storage layer"):
store.json (``StoreMeta``, reput/store_meta.py), how writes are published (one publisher per
kind of backend, reput/publisher.py), reput (``Reput``, reput/reput_service.py: RocketMQ's
ReputMessageService), the read-only views a server shares (reput/partition_views.py). ``Store``
keeps the rest (see its docstring for why it is over 400 lines).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import uuid
from typing import Any, Iterator

import numpy as np

from . import env as _env
from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from .backend import Backend, BackendError, LocalBackend, MemoryBackend
from .commitlog import CommitLog
from .config import SYSTEM_CLOCK, Clock, TopicConfig, WriterOptions
from .errors import (OffsetOrderError, ReputError, StoreFormatError,
                     StoreNotFoundError)
from . import _native as _N
from .locks import FileLock, partition_holder
from .partition import PartitionLog
from .publisher import publisher_for
from .reader import PartitionReader, RecordColumns
from .timing import Timing
from .record import Record, RecordBatch, Scratch, encode_scanned, validate_topic
from .reput_service import Reput
from .store_meta import (FEATURE_SEGMENT_LIST, FEATURE_SOURCE_CODEC, FORMAT_VERSION,  # noqa: F401
                         KNOWN_FORMAT_VERSION, StoreMeta, partition_numbers, topic_id_of)
from .topic_configs import TopicConfigLayers


SYNC_THREADS = 8  # partitions fsynced at once by a flush
WRITEBACK_BYTES = 8 << 20  # fsync=flush: queue appended bytes for writeback this often
BACKGROUND_SYNC_BYTES = 8 << 20  # ... and fdatasync the commit log in the background this often
# (8 MiB measured better than 32 on this VM: store bench with fsync 2.09M vs 1.85-1.89M rec/s,
# mirror 1.34 s vs 1.52 s, a Spark task's final flush 0.02 s vs 0.09 s; one-off A/B runs)
#: a batch whose partition numbers are all in [0, this] has its offset order checked in one
#: compiled pass (Store._check_order); a larger one (never from Kafka) with an argsort
ORDER_KERNEL_MAX_PARTITION = 1 << 16


def _offset_order(partitions: np.ndarray, offsets: np.ndarray, max_partition: int):
    """(i, seen) of the C offset_order (reput/_native.c)."""
    seen = np.empty(max_partition + 1, np.uint8)
    return _N.offset_order(partitions, offsets, max_partition, seen), seen


def warm_up() -> None:
    """Load the kernel of Store.append's offset-order check (numba's cache when the C module is
    not built: ~15 ms on its first call in a process, which a writer can pay while it starts
    instead of in its first append)."""
    _offset_order(np.zeros(2, np.int32), np.arange(2, dtype=np.int64), 0)


class SyncPacer:
    """When a writer under ``fsync=flush`` queues what it appended for writeback
    (sync_file_range) and when it asks for a background fdatasync: ``add(nbytes)`` returns
    (writeback, sync). Used by the store's writer and by a replica's pull."""

    __slots__ = ("writeback_every", "sync_every", "_unqueued", "_unsynced")

    def __init__(self, writeback_every: int | None = None, sync_every: int | None = None):
        # None: the module's WRITEBACK_BYTES / BACKGROUND_SYNC_BYTES, read at each add()
        self.writeback_every, self.sync_every = writeback_every, sync_every
        self._unqueued = self._unsynced = 0

    def add(self, nbytes: int) -> tuple[bool, bool]:
        self._unqueued += nbytes
        every = WRITEBACK_BYTES if self.writeback_every is None else self.writeback_every
        if self._unqueued < every:
            return False, False
        self._unsynced += self._unqueued
        self._unqueued = 0
        if self._unsynced < (BACKGROUND_SYNC_BYTES if self.sync_every is None
                             else self.sync_every):
            return True, False
        self._unsynced = 0
        return True, True

    def reset(self) -> None:
        """Everything so far was made durable (a full sync)."""
        self._unqueued = self._unsynced = 0


def default_commitlog_dir(store_id: str) -> str:
    """Where a writer keeps its commit log (and active segments) for a store that is not a
    local directory: ``$KCOMPACT_CACHE_DIR`` or ``$XDG_CACHE_HOME/kcompact`` or
    ``~/.cache/kcompact``, then ``/<store id>``."""
    return os.path.join(_env.cache_dir(), store_id)


def backend_for(url: str) -> Backend:
    """A backend for a store URL: a local path, ``file://``, ``memory://`` or ``s3://``."""
    if url.startswith("s3://"):
        try:
            from .s3 import S3Backend  # noqa: WPS433 (optional, needs boto3)
        except ImportError as e:
            raise ReputError(f"S3 stores need the S3 backend: {e}") from None
        return S3Backend.from_url(url)
    if url.startswith("memory://"):
        return MemoryBackend()
    if url.startswith("file://"):
        url = url[len("file://"):]
    return LocalBackend(url)


#: a follower of an S3 store with shared uploads and no catalog lists a topic's partitions at
#: most this often (s); the journal names the partitions written since (Store.partitions)
PARTITIONS_RELIST_S = 30.0

class Store:
    """One store as a process opens it: read-only, or with a writer's commit log.

    (About 640 lines on purpose: what stays here is the partition registry - the one door to a
    partition, ``open_view``/``partition``/``writable_partition`` - and the write path, append,
    flush's fsyncs, the publisher's step and the checkpoint, close, under one lock, whose
    ordering is the durability argument and reads as one; store.json's topic configs are
    rewritten here under store.json.lock. store.json's contents, publishing, reput and the
    servers' views are the rooms named in the module docstring.)"""

    def __init__(self, fs: Backend, meta: StoreMeta, *, writer: str | None,
                 options: WriterOptions, clock: Clock, commitlog_fs: Backend | None = None):
        self.fs, self.meta, self.writer = fs, meta, writer
        self.options, self.clock = options, clock
        #: how this store's writes are published: one implementation per kind of backend
        #: (local, S3 per partition, S3 shared; reput/publisher.py), chosen here once
        self.publisher = publisher_for(fs, meta, writer=writer, options=options,
                                       commitlog_fs=commitlog_fs,
                                       default_commitlog_dir=default_commitlog_dir)
        self.publisher.bind(self)
        #: the writer's commit log's directory; where partitions' active segments live (the
        #: store itself, or the commit log's local directory on an object store)
        self.commitlog_fs, self.local_fs = self.publisher.commitlog_fs, self.publisher.local_fs
        self.publisher.opened(meta)
        if not fs.appendable and SC.FEATURE in meta.features:
            # the store catalog (docs/formats/store-catalog.md): every partition's manifest
            # and the journal entries still needed, in one LIST and one GET
            SH.enable(fs)
            SC.enable(fs, clock.ms).refresh(0.0)
        #: this writer's journal entries not yet folded into the store catalog (at open: those
        #: a killed process of this writer committed and never folded)
        self._unfolded: list = self.left_unfolded() if self.shared_uploads else []
        #: a follower of a store without a catalog: topic -> (its partitions listed, when)
        self._partition_listing: dict[str, tuple[set[int], float]] = {}
        self._partitions: dict[tuple[str, int], PartitionLog] = {}
        self._views: Any = None  # (``views``, made when a server first asks)
        self._writable: set[tuple[str, int]] = set()
        self._wrote_partitions = False
        #: held while partitions are opened, appended to, swapped or released: a compactor or a
        #: replica that changes a partition this store writes takes it around each step
        self.lock = threading.RLock()
        self.commitlog: CommitLog | None = None
        #: the writer's reput (reput/reput_service.py), made with its commit log
        self.reput: Reput | None = None
        self._scratch = Scratch()
        self._pacer = SyncPacer()
        self._sync_pool: Any = None  # flush's fsync threads (_sync_partitions), made when needed
        self._sync_pool_pid = -1
        #: the writer's seal thread (WriterOptions(seal="background"); reput/seal.py), made when
        #: a partition is opened for write; ``seals_left``: rolled segments its close left format 1
        self._sealer: Any = None
        self.seals_left = 0
        self.stats = {"appended": 0, "dispatched": 0, "skipped": 0}
        #: (topic, partition) -> where the source goes on past the last record appended
        #: (``advance_next_offset``), made the partitions' next offsets by the next flush
        self._advances: dict[tuple[str, int], int] = {}
        #: each flush's fsyncs of the partitions' files (all of them: one observation)
        self.partition_fsync_time = Timing()
        if writer is not None:
            self.commitlog = CommitLog(self.commitlog_fs, writer, options, clock)
            self.reput = Reput(self.commitlog, writer, self.secret, self.writable_partition,
                               self.stats)
            try:
                self.reput.position = self.commitlog.read_checkpoint()
                if self.commitlog.segments and self.reput.position > self.commitlog.end:
                    # The commit log lost its tail below the checkpoint (fsync=never and a
                    # power cut, or a corrupt record cut by recovery). Those records were
                    # dispatched; new appends start at the end, so dispatch continues there.
                    self.reput.position = self.commitlog.end
                self.dispatch()
                self.publisher.take_over_local_segments()
                self.flush()
            except BaseException:
                # Release the commit-log and partition locks: the caller may fix the cause
                # (the error says how) and open the store again from this same process.
                try:
                    for pl in self._partitions.values():
                        pl.close(publish=False)
                finally:
                    self._partitions.clear()
                    self._writable.clear()
                    self.commitlog.close()
                    self.commitlog = None
                raise

    # -- open / create -------------------------------------------------------------------

    @classmethod
    def create(cls, url: str, *, topics: dict[str, dict[str, Any]] | None = None,
               fs: Backend | None = None, clock: Clock = SYSTEM_CLOCK,
               shared_uploads: bool = False, catalog: bool = True) -> "Store":
        """A new store. ``shared_uploads`` (an object store only): created at format 5 with
        the ``shared-upload`` and ``store-catalog`` features (docs/formats/store-catalog.md),
        so its writers with ``upload`` ``auto`` use them; ``catalog`` False: at format 3,
        without a store catalog (as kcompact made them before; tests and benchmarks)."""
        fs = fs or backend_for(url)
        features = [FEATURE_SEGMENT_LIST] if fs.appendable else (
            [SH.FEATURE] + ([SC.FEATURE] if catalog else []) if shared_uploads else [])
        meta = StoreMeta(str(uuid.uuid4()), secrets.token_bytes(16), clock.ms(), {},
                         features=features + [FEATURE_SOURCE_CODEC])
        if SH.FEATURE in features:
            meta.format_version = SC.STORE_FORMAT if catalog else SH.STORE_FORMAT
        for t, cfg in (topics or {}).items():
            meta.set_layers(validate_topic(t), TopicConfigLayers().altered(add=cfg))
        if not fs.create_exclusive(fn.STORE_JSON, meta.to_json()):
            raise ReputError(f"{fs.url}: a store already exists here")
        if SC.FEATURE in features:  # catalog version 1: no partition yet
            SC.StoreCatalog(fs, clock.ms).commit("create", lambda new: True)
        return cls(fs, meta, writer=None, options=WriterOptions(), clock=clock)

    @classmethod
    def open(cls, url: str, *, writer: str | None = None, create: bool = False,
             options: WriterOptions = WriterOptions(), clock: Clock = SYSTEM_CLOCK,
             fs: Backend | None = None, commitlog_dir: str | None = None,
             shared_uploads: bool | None = None) -> "Store":
        """``create``: make the store when it does not exist; on an object store it then uses
        shared uploads (format 3) when ``shared_uploads`` says so, by default when ``writer``
        is given with ``options.upload`` "auto" (docs/formats/shared-upload.md)."""
        fs = fs or backend_for(url)
        try:
            raw = fs.read(fn.STORE_JSON)
        except FileNotFoundError:
            if not create:
                hint = (" (it is not empty)" if fs.listdir("") else "")
                raise StoreNotFoundError(f"{fs.url} is not a kcompact store{hint}: no store.json; "
                                         "create one with `kcompact mirror` or Store.create") from None
            try:
                # a new store on S3 written with upload "auto": shared uploads from the start
                cls.create(url, fs=fs, clock=clock, shared_uploads=(
                    writer is not None and options.upload == "auto"
                    and options.seal_format == 2) if shared_uploads is None
                    else shared_uploads)
            except ReputError:
                pass  # another process created it first
            raw = fs.read(fn.STORE_JSON)
        except (IsADirectoryError, BackendError):
            if not fs.appendable or not fs.isdir(fn.STORE_JSON):
                raise
            raise StoreFormatError(f"{fs.url}/store.json is a directory") from None
        meta = StoreMeta.from_json(raw, fs.url)
        if fs.appendable and fs.local_path("") is not None and fs.isdir(fn.REPAIR_DIR):
            from .quarantine import finish_repairs
            finish_repairs(fs)  # a `kcompact repair` killed after its commit point
        if commitlog_dir is None and not fs.appendable:
            commitlog_dir = default_commitlog_dir(meta.store_id)
        clfs = LocalBackend(commitlog_dir) if commitlog_dir else None
        return cls(fs, meta, writer=writer, options=options, clock=clock, commitlog_fs=clfs)

    @property
    def url(self) -> str:
        return self.fs.url

    @property
    def secret(self) -> bytes:
        return self.meta.secret

    @property
    def shared_uploads(self) -> bool:
        """This writer's flushes upload one shared object (docs/formats/shared-upload.md)."""
        return self.publisher.shared

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- topics and configs --------------------------------------------------------------

    def _cataloged(self) -> dict[str, set[int]] | None:
        """A store with a catalog: its topics and partitions, from the catalog and the journal
        entries it has not folded yet (no LIST of ``partitions/``); None for other stores."""
        # (also under KCOMPACT_S3_FOLLOW=list: a catalog store's partitions not split yet
        # have no manifest, so no directory to list)
        cat = SC.for_store(self.fs) if not self.fs.appendable else None
        if cat is None:
            return None
        from . import s3_follow as S3F
        f = S3F.follower_for(self.fs)
        j = SH.journal_for(self.fs)
        if f is not None:
            f.poll()
        else:
            cat.refresh()
            if j is not None:
                j.refresh()
        out: dict[str, set[int]] = {t: cat.partitions(t) for t in cat.topics()}
        for t, p in (j.partition_keys() if j is not None else ()):
            out.setdefault(t, set()).add(p)
        return out

    def _listed_partitions(self, topic: str) -> set[int]:
        """The topic's partition directories (one LIST). A process that follows an S3 store
        with shared uploads but no catalog (reput/s3_follow.py; ``kv build --follow`` asks at
        every poll round) lists them at most every ``PARTITIONS_RELIST_S``, and adds the
        partitions the journal's entries name (no request)."""
        from . import s3_follow as S3F
        f = S3F.follower_for(self.fs) if not self.fs.appendable else None
        if f is None:
            return {int(p) for p in self.fs.listdir(fn.topic_dir(topic)) if p.isdigit()}
        now = time.monotonic()
        got = self._partition_listing.get(topic)
        if got is None or now - got[1] >= PARTITIONS_RELIST_S:
            got = ({int(p) for p in self.fs.listdir(fn.topic_dir(topic)) if p.isdigit()}, now)
            self._partition_listing[topic] = got
        f.poll()
        return got[0] | {p for t, p in f.journal.partition_keys() if t == topic}

    def topics(self) -> list[str]:
        names = set(self.meta.topics) | set(self.meta.recorded_partitions)
        cataloged = self._cataloged()
        if cataloged is not None:
            return sorted(names | {t for t, ps in cataloged.items() if ps})
        for name in self.fs.listdir(fn.PARTITIONS_DIR):
            try:
                names.add(validate_topic(name))
            except ReputError:
                continue
        return sorted(names)

    def partitions(self, topic: str) -> list[int]:
        cataloged = self._cataloged()
        if cataloged is not None:
            found = set(cataloged.get(topic, ()))
        else:
            found = self._listed_partitions(topic)
        return sorted(found | self.publisher.unlisted_partitions(topic))

    def recorded_partitions(self, topic: str) -> list[int]:
        """The partitions of ``topic`` recorded in store.json (:meth:`record_partitions`): those
        a mirror was started on, written yet or not. ``partitions()`` lists those holding data."""
        return list(self.meta.recorded_partitions.get(topic, []))

    def record_partitions(self, topic: str, partitions: list[int] | tuple[int, ...]) -> list[int]:
        """Record in store.json that ``topic`` has these partitions (added to those recorded
        before; docs/formats/store-json.md), so that a partition a mirror knows but has not
        written yet reads as empty instead of unknown. store.json is rewritten atomically, and
        only when the recorded set grows. Returns the recorded partitions."""
        want = partition_numbers(list(partitions))
        with self.lock, FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)  # as a topic config change (store-json.md)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            have = meta.recorded_partitions.get(validate_topic(topic), [])
            if not set(want) <= set(have):
                meta.recorded_partitions[topic] = sorted(set(have) | set(want))
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self._adopt(meta)
            return list(meta.recorded_partitions.get(topic, []))

    def recorded_topic_id(self, topic: str) -> str | None:
        """The Kafka topic id ``topic`` had when a mirror first copied it (None: not recorded,
        a store written before ids were recorded, or a broker that gave none)."""
        return self.meta.topic_ids.get(topic)

    def record_topic_id(self, topic: str, topic_id: str) -> str:
        """Record ``topic``'s Kafka topic id in store.json unless one is recorded already;
        returns the recorded id, which differs from ``topic_id`` when the topic was deleted
        and created again since (the caller refuses to mix the two: docs/formats/store-json.md).
        Under store.json.lock, as :meth:`record_partitions`."""
        tid = topic_id_of(topic_id)
        with self.lock, FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            if validate_topic(topic) not in meta.topic_ids:
                meta.topic_ids[topic] = tid
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self._adopt(meta)
            return meta.topic_ids[topic]

    def source_codec(self, topic: str, partition: int) -> int | None:
        """The codec id a mirror last read ``topic``-``partition``'s source batches with
        (:meth:`record_source_codecs`), or None: never read. ``compression.type=producer``
        seals that partition's records with it (reput/seal.py)."""
        return self.meta.source_codecs.get(topic, {}).get(partition)

    def record_source_codecs(self, topic: str, codecs: dict[int, int]) -> bool:
        """Record in store.json the codec the source's batches of each partition of ``topic``
        have now (codec ids; docs/formats/store-json.md ``source_codecs``), so that a seal or
        a compaction in any process seals their records with it under
        ``compression.type=producer``. store.json is rewritten only when one changed (under
        store.json.lock, as :meth:`record_partitions`); returns whether it was."""
        want = {int(p): int(c) for p, c in codecs.items()}
        with self.lock, FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            have = meta.source_codecs.get(validate_topic(topic), {})
            changed = any(have.get(p) != c for p, c in want.items())
            if changed:
                meta.source_codecs[topic] = {**have, **want}
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self._adopt(meta)
            return changed

    def topic_config(self, topic: str) -> TopicConfig:
        """The effective config: default < synced from Kafka < local override."""
        return self.meta.defaults.with_overrides(self.meta.topics.get(topic) or {})

    # Topic configs by source (reput/topic_configs.py, docs/formats/store-json.md): every
    # change is a read-modify-write of store.json under store.json.lock (flock; on S3 the
    # object is replaced whole by one PUT), so a mirror's sync and `kcompact configs --alter`
    # from another process never write over each other's keys.

    def topic_config_layers(self, topic: str) -> TopicConfigLayers:
        ly = self.meta.layers.get(topic)
        return ly if ly is not None else TopicConfigLayers.from_legacy(
            self.meta.topics.get(topic), self.meta.defaults)

    def alter_topic_config(self, topic: str, add: dict[str, Any] | None = None,
                           delete: list[str] | tuple[str, ...] = ()) -> TopicConfig:
        """Set (``add``) and remove (``delete``) local overrides of ``topic``; they win over
        synced values and survive later mirrors. Returns the effective config."""
        validate_topic(topic)
        return self._update_layers(topic, lambda ly: ly.altered(add or {}, delete))

    def set_topic_config(self, topic: str, overrides: dict[str, Any]) -> TopicConfig:
        """Validate and persist local overrides in store.json (``alter_topic_config``)."""
        return self.alter_topic_config(topic, overrides)

    def sync_topic_config(self, topic: str, values: dict[str, Any], *,
                          origin: str | None = None) -> TopicConfig:
        """Replace the values synced from Kafka for ``topic`` (store.json is written only when
        they change). Returns the effective config."""
        validate_topic(topic)
        return self._update_layers(
            topic, lambda ly: ly.with_synced(values, ms=self.clock.ms(), origin=origin))

    def reload_topic_configs(self) -> None:
        """Re-read store.json's topic configs (changed by another process: `kcompact configs`)
        and hand them to the partitions this store has open."""
        with self.lock:
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            self._adopt(meta)

    def _update_layers(self, topic: str, change) -> TopicConfig:
        with self.lock, FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            before = meta.layers.get(topic)
            current = before if before is not None else TopicConfigLayers.from_legacy(
                meta.topics.get(topic), meta.defaults)
            new = change(current)
            if new != before:
                meta.set_layers(topic, new)
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self._adopt(meta)
            return self.topic_config(topic)

    def _adopt(self, meta: StoreMeta) -> None:
        self.meta = meta
        self.publisher.adopted(meta)
        for (t, p), pl in self._partitions.items():
            pl.config = self.topic_config(t)
            pl.source_codec = self.source_codec(t, p)

    def require_format(self, version: int, feature: str | None = None) -> None:
        """Raise store.json's format_version to ``version`` (and list ``feature``) before
        something of that format is written (a kcompact that knows only older formats then
        refuses the store with one line naming both versions instead of misreading it)."""
        def done(meta: StoreMeta) -> bool:
            return meta.format_version >= version and (feature is None
                                                        or feature in meta.features)
        if done(self.meta):
            return
        with self.lock:
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            if not done(meta):
                meta.format_version = max(meta.format_version, version)
                if feature is not None:
                    meta.features = sorted(set(meta.features) | {feature})
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self.meta = meta

    # -- partitions ----------------------------------------------------------------------

    def open_view(self, topic: str, partition: int, *, strict: bool = True) -> PartitionLog:
        """A new read-only view of the partition: the one door every reader comes through
        (this store's ``partition``, the replication master, the Kafka endpoint, replication's
        verify), with the store's topic config, clock and strictness, so a partition one
        command refuses (a segment list gone, a ledger that disagrees) every other refuses
        with the same line. ``strict=False``: `kcompact verify`, which opens what disagrees
        with its list to report it (``PartitionLog.problems``)."""
        pl = PartitionLog(self.fs, topic, partition, self.secret, self.topic_config(topic),
                          clock=self.clock, require_list=self.require_list, strict=strict)
        pl.source_codec = self.source_codec(topic, partition)
        return pl

    @property
    def views(self) -> "PartitionViews":
        """Read-only views shared by a server's threads, each under its own lock, opened by
        ``open_view`` (reput/partition_views.py)."""
        with self.lock:
            if self._views is None:
                from .partition_views import PartitionViews
                self._views = PartitionViews(self.open_view)
            return self._views

    def partition(self, topic: str, partition: int) -> PartitionLog:
        """The partition's log (read-only view unless this process writes it)."""
        key = (topic, partition)
        with self.lock:
            pl = self._partitions.get(key)
            if pl is None:
                pl = self.open_view(topic, partition)
                self._partitions[key] = pl
            elif key not in self._writable:
                pl.refresh()
            return pl

    def writable_partition(self, topic: str, partition: int) -> PartitionLog:
        key = (topic, partition)
        with self.lock:
            if key not in self._writable:
                old = self._partitions.pop(key, None)
                if old is not None:
                    old.close()
                pl = self._open_writable(topic, partition)
                self._wrote_partitions = True
                if self.options.seal_format == 2:  # else rolled segments stay format 1
                    pl.require_format = self.require_format
                self._partitions[key] = pl
                self._writable.add(key)
                self.publisher.writable_opened(pl, key)
            return self._partitions[key]

    #: how long ``writable_partition`` waits for a partition another process holds (0: it
    #: raises StoreLockedError at once, what a compactor wants: it skips the partition). A
    #: mirror sets it, so that a `kcompact compact` compacting a partition for a moment when
    #: the mirror starts or appends delays the mirror instead of stopping it. A partition held
    #: by another writer (which keeps it while it runs) is refused at once all the same.
    partition_lock_wait_s = 0.0

    def _open_writable(self, topic: str, partition: int) -> PartitionLog:
        from .errors import StoreLockedError
        deadline = self.clock.monotonic() + self.partition_lock_wait_s
        holder = partition_holder(self.writer)
        while True:
            try:
                pl = PartitionLog(self.fs, topic, partition, self.secret,
                                  self.topic_config(topic), writable=True,
                                  local_fs=self.local_fs,
                                  clock=self.clock, require_list=self.require_list,
                                  holder=holder)
                pl.source_codec = self.source_codec(topic, partition)
                return pl
            except StoreLockedError as e:
                if e.by_writer or self.clock.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def drain_seals(self) -> None:
        """Wait until the writer's seal thread (``WriterOptions(seal="background")``) has sealed
        every segment rolled before the last flush; raise its first failure."""
        if self._sealer is not None:
            self._sealer.drain()
            self._sealer.check()

    def _background_seals(self, pl: PartitionLog) -> None:
        """Seal ``pl``'s rolled segments in the writer's seal thread: those it rolls from now
        on, and (in a format-2 store) those a previous writer left format 1."""
        from .seal import Sealer
        if self._sealer is None:
            self._sealer = Sealer(self.lock)
        pl.seal_queue = self._sealer.submit
        if self.meta.format_version >= 2:
            self._sealer.submit(pl, None)

    @property
    def require_list(self) -> bool:
        """Whether every local partition of this store has a segment list (store.json's
        features say so), so that one without is refused."""
        return self.publisher.requires_lists(self.meta.features, FEATURE_SEGMENT_LIST)

    def _maybe_require_lists(self) -> None:
        """A store from before segment lists: once every partition has its list (each gets
        one the first time it is opened for write), store.json says so, and from then on a
        partition without a list is refused."""
        for t in self.topics():
            for p in self.partitions(t):
                pdir = fn.partition_dir(t, p)
                if not self.fs.exists(f"{pdir}/{fn.SEGMENT_LIST}") and any(
                        fn.parse_base(n) for n in self.fs.listdir(pdir)):
                    return
        with FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:  # (as _update_layers)
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            if FEATURE_SEGMENT_LIST not in meta.features:
                meta.features = meta.features + [FEATURE_SEGMENT_LIST]
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
        self.meta = meta

    def release_partition(self, topic: str, partition: int) -> None:
        """Forget a cached partition (after another component rewrote its files)."""
        with self.lock:
            pl = self._partitions.pop((topic, partition), None)
            self._writable.discard((topic, partition))
            if pl is not None:
                pl.close()

    def next_offset(self, topic: str, partition: int) -> int:
        return self.partition(topic, partition).next_offset

    def advance_next_offset(self, topic: str, partition: int, offset: int) -> None:
        """Writer: the source partition goes on at ``offset`` (a consumer's position after
        transaction markers or aborted records that follow the last record appended). The next
        ``flush``, once the records appended before this call are durable, makes it the
        partition's next offset (``PartitionLog.advance_next_offset``): the store's end offset
        is then the source's, and a mirror resumes there. Never moves a next offset back."""
        if self.commitlog is None:
            raise ReputError("this store was opened read-only; open it with a writer id to append")
        with self.lock:
            key = (topic, int(partition))
            if offset > self._advances.get(key, -1):
                self._advances[key] = int(offset)

    def first_offset(self, topic: str, partition: int) -> int:
        return self.partition(topic, partition).first_offset

    def read(self, topic: str, partition: int, from_offset: int = 0, *,
             max_records: int | None = None, max_bytes: int | None = None) -> RecordColumns:
        """One block of records from ``from_offset`` (``reader.PartitionReader.read``)."""
        return self.partition(topic, partition).read(from_offset, max_records, max_bytes)

    def reader(self, topic: str, partition: int) -> PartitionReader:
        """The partition reader of a topic-partition (reput/reader.py)."""
        return PartitionReader(self.partition(topic, partition))

    def iter_records(self, topic: str, partition: int, from_offset: int = 0,
                     limit: int | None = None) -> Iterator[Record]:
        return self.partition(topic, partition).iter_records(from_offset, limit)

    # -- write path ----------------------------------------------------------------------

    def _check_order(self, batch: RecordBatch) -> list[int]:
        """Offsets must strictly increase within each partition of ``batch`` (else
        OffsetOrderError). Returns the batch's partition numbers, ascending. One compiled pass
        (offset_order, without the GIL) when the partition numbers are in
        [0, ORDER_KERNEL_MAX_PARTITION], as Kafka's always are; else an argsort."""
        parts, offs = batch.partitions, batch.offsets
        if len(batch) == 0:
            return []
        lo, hi = int(parts.min()), int(parts.max())
        if lo >= 0 and hi <= ORDER_KERNEL_MAX_PARTITION:
            i, seen = _offset_order(parts, offs, hi)
            if i >= 0:
                p = parts[i]
                prev = int(offs[:i][parts[:i] == p][-1])
                raise OffsetOrderError(
                    f"{batch.topic}-{int(p)}: offset {int(offs[i])} follows {prev} in the "
                    "batch; offsets must strictly increase")
            return np.flatnonzero(seen).tolist()
        order = np.argsort(parts, kind="stable")
        p, o = parts[order], offs[order]
        bad = np.nonzero((p[1:] == p[:-1]) & (o[1:] <= o[:-1]))[0]
        if bad.size:
            i = int(bad[0]) + 1
            raise OffsetOrderError(f"{batch.topic}-{int(p[i])}: offset {int(o[i])} follows "
                                   f"{int(o[i - 1])} in the batch; offsets must strictly increase")
        return np.unique(parts).tolist()

    def append(self, batch: RecordBatch) -> int:
        """Append a batch to this writer's commit log and dispatch it. Returns records appended
        to compaction logs (records at or below a partition's last offset are skipped)."""
        if self.commitlog is None:
            raise ReputError("this store was opened read-only; open it with a writer id to append")
        if len(batch) == 0:
            return 0
        partitions = self._check_order(batch)
        with self.lock:
            # take every partition this batch writes before the commit log gets a byte of it:
            # a partition held by another writer fails the append with nothing written
            for p in partitions:
                self.writable_partition(batch.topic, p)
            buf, s = encode_scanned(batch, secret=self.secret, scratch=self._scratch)
            start, end = self.commitlog.append(buf, s.positions)
            self.stats["appended"] += len(batch)
            if start == self.reput.position:
                # The bytes just written are in memory, and so is their scan (one topic, the
                # batch's): dispatch them without reading or parsing them again.
                n = self.reput.dispatch_scanned(buf, s, batch.topic, end)
            else:
                n = self.reput.dispatch()
            self._maybe_start_writeback(end - start)
            return n

    def write_timings(self) -> dict[str, Timing]:
        """A writer's durations (reput/timing.py) for metrics: ``append`` (commit-log append
        calls), ``commitlog`` (its fsyncs), ``partitions`` (each flush's fsyncs of the
        partitions' files); empty for a read-only store."""
        cl = self.commitlog
        if cl is None:
            return {}
        return {"append": cl.append_time, "commitlog": cl.fsync_time,
                "partitions": self.partition_fsync_time}

    def dispatch(self) -> int:
        """Reput: copy commit-log records after the dispatched position into partitions
        (``Reput.dispatch``, reput/reput_service.py)."""
        assert self.reput is not None
        with self.lock:
            return self.reput.dispatch()

    def _maybe_start_writeback(self, nbytes: int) -> None:
        """Under ``fsync=flush``, queue what was appended for writeback every
        ``WRITEBACK_BYTES`` (sync_file_range, no waiting), so that the fsyncs of ``flush`` find
        little left to write: the disk works while the writer goes on, instead of all at once
        when a flush (or the end of a mirror) waits for it."""
        if self.options.fsync != "flush":
            return
        writeback, sync = self._pacer.add(nbytes)
        if not writeback:
            return
        self.commitlog.start_writeback()
        for key in self._writable:
            self._partitions[key].start_writeback()
        if sync:
            # An fdatasync of the commit log, in a thread of its own: the device's cache is then
            # flushed as the stream goes (the compaction logs' bytes queued just above with it),
            # instead of all at once in the fsyncs of the next flush (backend._BackgroundSync).
            self.commitlog.sync_soon()

    def flush(self) -> None:
        """Make everything appended so far durable, then advance the reput checkpoint."""
        if self.commitlog is None:
            return
        with self.lock:
            if self._sealer is not None:
                self._sealer.check()  # a seal that failed (its segment left format 1)
            if self.options.fsync != "never":
                self.commitlog.sync()
                t0 = self.clock.monotonic()
                self._sync_partitions()
                self.partition_fsync_time.observe(self.clock.monotonic() - t0)
            advances, self._advances = self._advances, {}
            for (topic, partition), offset in sorted(advances.items()):
                self.writable_partition(topic, partition).advance_next_offset(offset)
            # publish (S3: each partition's new segments uploaded and its manifest committed,
            # or one shared object for all of them), before the checkpoint says those records
            # need no re-dispatch
            self.publisher.publish_all()
            done = self.reput.position
            if done != self.commitlog.read_checkpoint():
                self.commitlog.write_checkpoint(done)
            self.commitlog.delete_dispatched(done)

    def _sync_partitions(self) -> None:
        """fsync the files of every partition this writer appended to, several partitions at
        once: concurrent fsyncs share the filesystem's journal commits and the device's cache
        flushes (measured on this VM: 16 files of 8 MiB, 0.08-0.12 s one after another, 0.06 s
        with 8 threads). Every sync ends before this returns; the first failure is raised."""
        pls = [self._partitions[key] for key in self._writable]
        if not self.publisher.fsyncs_partitions:
            # the commit log (fsynced above) is the durable copy until the journal commit,
            # after which the local segments are dropped: no fsync of 2 files a partition
            for pl in pls:
                pl.sync(fsync=False)
            return
        if len(pls) <= 1:
            for pl in pls:
                pl.sync()
            return
        if self._sync_pool is None or self._sync_pool_pid != os.getpid():
            # (a forked child has the pool object but none of its threads: a new pool)
            from concurrent.futures import ThreadPoolExecutor
            self._sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="kcompact-fsync")
            self._sync_pool_pid = os.getpid()
        futures = [self._sync_pool.submit(pl.sync) for pl in pls]
        for f in futures:
            f.exception()  # wait for all of them before raising any
        for f in futures:
            f.result()

    def roll(self, *, only_due: bool = False) -> int:
        """Roll the active segment of every partition this process writes, so that compaction
        may clean what it holds (``PartitionLog.roll``): at the end of a batch job (a one-shot
        mirror, a Spark mirror task). ``only_due``: only those open longer than their topic's
        roll time (``PartitionLog.roll_if_due``), what a following writer does while its topic
        is idle. Returns how many were rolled."""
        n = 0
        with self.lock:
            now = self.clock.ms()
            for key in sorted(self._writable):
                pl = self._partitions[key]
                if only_due:
                    n += pl.roll_if_due(now)
                elif any(s.kind == "file" and s.log_size for s in pl.segments[-1:]):
                    pl.roll(writer=self.writer or "writer")
                    n += 1
        return n

    def collect_shared_garbage(self) -> list[str]:
        """S3 with shared uploads: delete the shared objects every partition has split, and
        orphans, once the grace period has passed (reput/shared.py ``collect_garbage``); a
        store catalog is reconciled first and its old versions collected."""
        gone = []
        cat = self._reconcile_catalog()
        if cat is not None:
            gone += cat.collect_garbage(grace_ms=int(getattr(self.fs, "grace_ms", 0)),
                                        now_ms=self.fs.clock_ms())
        return gone + self.publisher.collect_shared_garbage()

    def _reconcile_catalog(self):
        """A store catalog: record every partition manifest newer than the catalog's (each
        read itself: a committer killed between its manifest commit and the catalog's), so
        nothing the newest catalog lists is deleted by the collector that follows
        (docs/formats/store-catalog.md, "Lagging"). Returns the catalog (None: no catalog)."""
        cat = SC.for_store(self.fs) if not self.fs.appendable else None
        if cat is None:
            return None
        from . import manifest as M
        listed = [(t, int(p)) for t in self.fs.listdir(fn.PARTITIONS_DIR)
                  for p in self.fs.listdir(fn.topic_dir(t)) if p.isdigit()]
        cat.reconcile(lambda t, p: M.read_latest(self.fs, fn.partition_dir(t, p)),
                      also=listed)
        return cat

    def left_unfolded(self) -> list:
        """This writer's journal entries above the store catalog's ``folded`` (a killed process
        of it committed them and never folded them)."""
        cat = SC.for_store(self.fs) if not self.fs.appendable else None
        j = SH.journal_for(self.fs)
        if cat is None or cat.latest is None or j is None or self.writer is None:
            return []
        folded = cat.latest.folded.get(self.writer, -1)
        out = []
        for w, seq in j.listed_keys():
            if w == self.writer and seq > folded:
                try:
                    e = j.fetch_entry(w, seq)
                except FileNotFoundError:
                    continue
                if e is not None:
                    out.append(e)
        return out

    def shared_committed(self, entry) -> None:
        """A shared upload's journal entry is committed (reput/publisher.py): with a store
        catalog, fold this writer's entries every ``fold_every()`` commits."""
        if SC.for_store(self.fs) is None:
            return
        self._unfolded.append(entry)
        if len(self._unfolded) >= SC.fold_every():
            self.fold_catalog()

    def fold_catalog(self) -> None:
        """A store catalog: fold this writer's journal entries committed since the last fold
        (one PUT; docs/formats/store-catalog.md). Not a commit point: a failure is retried at
        the next fold."""
        cat = SC.for_store(self.fs) if not self.fs.appendable else None
        if cat is None or not self._unfolded:
            return
        try:
            cat.fold(self.writer or "writer", self._unfolded)
        except (OSError, ReputError):
            return  # (the entries stay readable from their keys; the next fold retries)
        self._unfolded = []

    def compaction_batch(self):
        """S3: the batch that publishes a compaction run's outputs of every partition in one
        object (reput/compaction_object.py); None on a local store, and on an S3 store without
        shared uploads unless ``KCOMPACT_S3_COMPACTION_OBJECTS=store`` (the publisher's)."""
        return self.publisher.compaction_batch()

    def collect_compaction_garbage(self) -> list[str]:
        """S3: delete compaction objects no partition lists any more (nor retired less than
        the grace period ago), and those a killed run never committed, once the grace period
        has passed (reput/compaction_object.py ``collect_garbage``; the publisher's)."""
        self._reconcile_catalog()
        return self.publisher.collect_compaction_garbage()

    def close(self) -> None:
        if self._sealer is not None:
            # (outside the lock, which the seal under way takes to swap its segment in)
            self._sealer.close()  # what the flush below hands it is left format 1 too
        with self.lock:
            if self.commitlog is not None:
                self.flush()
                self.fold_catalog()  # (a reader opening the store then GETs no entry)
            if self._sealer is not None:
                self.seals_left += self._sealer.left
                self._sealer = None
            for pl in self._partitions.values():
                pl.close()
            if self.shared_uploads:
                from .catalog_manifest import drain_drops
                drain_drops()  # (the local segments of its last flushes are gone)
            self._partitions.clear()
            self._writable.clear()
            self.publisher.closed()
            if self.commitlog is not None:
                self.commitlog.close()
                self.commitlog = None
            if self._sync_pool is not None:
                if self._sync_pool_pid == os.getpid():
                    self._sync_pool.shutdown()
                self._sync_pool = None

    # -- whole-store recovery ------------------------------------------------------------

    def recover_writers(self) -> list[str]:
        """Re-dispatch every other writer's commit log that no live process holds.

        Used by jobs that take over partitions a dead writer left behind (a killed Spark task,
        a crashed mirror): each free commit log is opened, its tail repaired and dispatched.
        """
        done = []
        from .errors import StoreLockedError
        for w in self.commitlog_fs.listdir(fn.COMMITLOG_DIR):
            if w == self.writer:
                continue
            try:
                other = Store(self.fs, self.meta, writer=w, options=self.options,
                              clock=self.clock, commitlog_fs=self.commitlog_fs)
            except StoreLockedError:
                continue
            other.close()
            done.append(w)
        with self.lock:
            for key in list(self._partitions):
                if key not in self._writable:
                    self._partitions.pop(key).close()
        return done
