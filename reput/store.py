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
store.json's contents (``StoreMeta``, reput/store_meta.py) and its rewrites (topic configs,
recorded partitions, the format version: ``StoreConfigs``, reput/store_configs.py); the
partition registry (listings, the one door to a partition, the partitions open:
``PartitionRegistry``, reput/partition_registry.py); the write path (append, flush, roll:
``WritePath``, reput/write_path.py) with reput (``Reput``, reput/reput_service.py: RocketMQ's
ReputMessageService); how writes are published (one publisher per kind of backend,
reput/publisher.py); recovery (a writer's open, dead writers' commit logs:
reput/store_recovery.py); the read-only views a server shares (reput/partition_views.py).
``Store`` is what a caller opens: it makes them and delegates each public method to its room.
Each room is handed the store it serves and imports nothing of this module (no import circle).
"""

from __future__ import annotations

import os
import secrets
import threading
import uuid
from typing import Any, Iterator

from . import env as _env
from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from . import store_recovery
from .backend import Backend, BackendError, LocalBackend, MemoryBackend
from .catalog_upkeep import CatalogUpkeep
from .commitlog import CommitLog
from .config import SYSTEM_CLOCK, Clock, TopicConfig, WriterOptions
from .errors import ReputError, StoreFormatError, StoreNotFoundError
from .partition import PartitionLog
from .partition_registry import PartitionRegistry
from .publisher import publisher_for
from .reader import PartitionReader, RecordColumns
from .record import Record, RecordBatch, validate_topic
from .reput_service import Reput
from .store_configs import StoreConfigs
from .store_meta import (FEATURE_SEGMENT_LIST, FEATURE_SOURCE_CODEC, FORMAT_VERSION,  # noqa: F401
                         KNOWN_FORMAT_VERSION, StoreMeta)
from .timing import Timing
from .topic_configs import TopicConfigLayers
from .write_path import SyncPacer, WritePath, warm_up  # noqa: F401 (SyncPacer, warm_up: as before)


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


class Store:
    """One store as a process opens it: read-only, or with a writer's commit log.

    The facade every caller opens: it makes the store's rooms (``configs``, ``registry``,
    ``writes``, ``upkeep``, ``publisher``; the module docstring) and its public methods delegate
    to them, so callers never changed when the rooms were split out. (About 420 lines, mostly
    those methods' docstrings: the API's reference stays where callers look.)"""

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
        #: the store catalog's upkeep (reput/catalog_upkeep.py): this writer's folds, GC
        self.upkeep = CatalogUpkeep(self)
        #: the partition registry (reput/partition_registry.py): listings, the one door to a
        #: partition, the partitions open; store.json's rewrites (reput/store_configs.py)
        self.registry = PartitionRegistry(self)
        self.configs = StoreConfigs(self)
        #: held while partitions are opened, appended to, swapped or released: a compactor or a
        #: replica that changes a partition this store writes takes it around each step
        self.lock = threading.RLock()
        #: the write path (reput/write_path.py): the writer's commit log, reput, flush
        self.writes = WritePath(self)
        if writer is not None:
            self.writes.open_commitlog()
            store_recovery.recover_on_open(self)

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

    # -- topics and configs (reput/partition_registry.py, reput/store_configs.py) ---------

    def topics(self) -> list[str]:
        return self.registry.topics()

    def partitions(self, topic: str) -> list[int]:
        return self.registry.partitions(topic)

    def recorded_partitions(self, topic: str) -> list[int]:
        """The partitions of ``topic`` recorded in store.json (:meth:`record_partitions`): those
        a mirror was started on, written yet or not. ``partitions()`` lists those holding data."""
        return list(self.meta.recorded_partitions.get(topic, []))

    def record_partitions(self, topic: str, partitions: list[int] | tuple[int, ...]) -> list[int]:
        """Record in store.json that ``topic`` has these partitions (added to those recorded
        before; docs/formats/store-json.md), so that a partition a mirror knows but has not
        written yet reads as empty instead of unknown. store.json is rewritten atomically, and
        only when the recorded set grows. Returns the recorded partitions."""
        return self.configs.record_partitions(topic, partitions)

    def recorded_topic_id(self, topic: str) -> str | None:
        """The Kafka topic id ``topic`` had when a mirror first copied it (None: not recorded,
        a store written before ids were recorded, or a broker that gave none)."""
        return self.meta.topic_ids.get(topic)

    def record_topic_id(self, topic: str, topic_id: str) -> str:
        """Record ``topic``'s Kafka topic id in store.json unless one is recorded already;
        returns the recorded id, which differs from ``topic_id`` when the topic was deleted
        and created again since (the caller refuses to mix the two: docs/formats/store-json.md).
        Under store.json.lock, as :meth:`record_partitions`."""
        return self.configs.record_topic_id(topic, topic_id)

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
        return self.configs.record_source_codecs(topic, codecs)

    def topic_config(self, topic: str) -> TopicConfig:
        """The effective config: default < synced from Kafka < local override."""
        return self.configs.topic_config(topic)

    # Topic configs by source (reput/topic_configs.py, docs/formats/store-json.md): every
    # change is a read-modify-write of store.json under store.json.lock (reput/store_configs.py).

    def topic_config_layers(self, topic: str) -> TopicConfigLayers:
        return self.configs.topic_config_layers(topic)

    def alter_topic_config(self, topic: str, add: dict[str, Any] | None = None,
                           delete: list[str] | tuple[str, ...] = ()) -> TopicConfig:
        """Set (``add``) and remove (``delete``) local overrides of ``topic``; they win over
        synced values and survive later mirrors. Returns the effective config."""
        return self.configs.alter_topic_config(topic, add, delete)

    def set_topic_config(self, topic: str, overrides: dict[str, Any]) -> TopicConfig:
        """Validate and persist local overrides in store.json (``alter_topic_config``)."""
        return self.alter_topic_config(topic, overrides)

    def sync_topic_config(self, topic: str, values: dict[str, Any], *,
                          origin: str | None = None) -> TopicConfig:
        """Replace the values synced from Kafka for ``topic`` (store.json is written only when
        they change). Returns the effective config."""
        return self.configs.sync_topic_config(topic, values, origin=origin)

    def reload_topic_configs(self) -> None:
        """Re-read store.json's topic configs (changed by another process: `kcompact configs`)
        and hand them to the partitions this store has open."""
        self.configs.reload()

    def _adopt(self, meta: StoreMeta) -> None:
        self.configs.adopt(meta)

    def require_format(self, version: int, feature: str | None = None) -> None:
        """Raise store.json's format_version to ``version`` (and list ``feature``) before
        something of that format is written (a kcompact that knows only older formats then
        refuses the store with one line naming both versions instead of misreading it)."""
        self.configs.require_format(version, feature)

    # -- partitions (reput/partition_registry.py) -----------------------------------------

    def open_view(self, topic: str, partition: int, *, strict: bool = True) -> PartitionLog:
        """A new read-only view of the partition: the one door every reader comes through
        (this store's ``partition``, the replication master, the Kafka endpoint, replication's
        verify), with the store's topic config, clock and strictness, so a partition one
        command refuses (a segment list gone, a ledger that disagrees) every other refuses
        with the same line. ``strict=False``: `kcompact verify`, which opens what disagrees
        with its list to report it (``PartitionLog.problems``)."""
        return self.registry.open_view(topic, partition, strict=strict)

    @property
    def views(self) -> "PartitionViews":
        """Read-only views shared by a server's threads, each under its own lock, opened by
        ``open_view`` (reput/partition_views.py)."""
        return self.registry.views

    def partition(self, topic: str, partition: int) -> PartitionLog:
        """The partition's log (read-only view unless this process writes it)."""
        return self.registry.partition(topic, partition)

    def writable_partition(self, topic: str, partition: int) -> PartitionLog:
        """The partition opened for this store's writer (its lock taken; the publisher told)."""
        return self.registry.writable_partition(topic, partition)

    #: how long ``writable_partition`` waits for a partition another process holds (0: it
    #: raises StoreLockedError at once, what a compactor wants: it skips the partition). A
    #: mirror sets it, so that a `kcompact compact` compacting a partition for a moment when
    #: the mirror starts or appends delays the mirror instead of stopping it. A partition held
    #: by another writer (which keeps it while it runs) is refused at once all the same.
    partition_lock_wait_s = 0.0

    # (the registry's state, as the publisher and the write path walk it)
    @property
    def _partitions(self) -> dict[tuple[str, int], PartitionLog]:
        return self.registry.open

    @property
    def _writable(self) -> set[tuple[str, int]]:
        return self.registry.writable

    @property
    def _wrote_partitions(self) -> bool:
        return self.registry.wrote

    @_wrote_partitions.setter
    def _wrote_partitions(self, value: bool) -> None:
        self.registry.wrote = value

    def drain_seals(self) -> None:
        """Wait until the writer's seal thread (``WriterOptions(seal="background")``) has sealed
        every segment rolled before the last flush; raise its first failure."""
        self.writes.drain_seals()

    def _background_seals(self, pl: PartitionLog) -> None:
        """Seal ``pl``'s rolled segments in the writer's seal thread (the publisher's step when
        a partition is opened for write; ``WritePath.background_seals``)."""
        self.writes.background_seals(pl)

    @property
    def require_list(self) -> bool:
        """Whether every local partition of this store has a segment list (store.json's
        features say so), so that one without is refused."""
        return self.registry.require_list

    def _maybe_require_lists(self) -> None:
        """Once every partition of a store from before segment lists has one, store.json says
        so (``PartitionRegistry.maybe_require_lists``)."""
        self.registry.maybe_require_lists()

    def release_partition(self, topic: str, partition: int) -> None:
        """Forget a cached partition (after another component rewrote its files)."""
        self.registry.release(topic, partition)

    def next_offset(self, topic: str, partition: int) -> int:
        return self.partition(topic, partition).next_offset

    def advance_next_offset(self, topic: str, partition: int, offset: int) -> None:
        """Writer: the source partition goes on at ``offset`` (a consumer's position after
        transaction markers or aborted records that follow the last record appended). The next
        ``flush``, once the records appended before this call are durable, makes it the
        partition's next offset (``PartitionLog.advance_next_offset``): the store's end offset
        is then the source's, and a mirror resumes there. Never moves a next offset back."""
        self.writes.advance_next_offset(topic, partition, offset)

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

    # -- write path (reput/write_path.py) -------------------------------------------------

    # (the write path's state, as the store's users read it)
    @property
    def commitlog(self) -> CommitLog | None:
        """The writer's commit log (None: a read-only store)."""
        return self.writes.commitlog

    @commitlog.setter
    def commitlog(self, value: CommitLog | None) -> None:
        self.writes.commitlog = value

    @property
    def reput(self) -> Reput | None:
        """The writer's reput (reput/reput_service.py; None: a read-only store)."""
        return self.writes.reput

    @property
    def stats(self) -> dict[str, int]:
        """Records ``appended`` to the commit log, ``dispatched`` and ``skipped`` by reput."""
        return self.writes.stats

    @property
    def seals_left(self) -> int:
        """Rolled segments the seal thread's close left format 1."""
        return self.writes.seals_left

    @property
    def partition_fsync_time(self) -> Timing:
        """Each flush's fsyncs of the partitions' files (all of them: one observation)."""
        return self.writes.partition_fsync_time

    def _check_order(self, batch: RecordBatch) -> list[int]:
        """Offsets must strictly increase within each partition of ``batch`` (else
        OffsetOrderError). Returns the batch's partition numbers, ascending. One compiled pass
        (offset_order, without the GIL) when the partition numbers are in
        [0, ORDER_KERNEL_MAX_PARTITION], as Kafka's always are; else an argsort."""
        return self.writes.check_order(batch)

    def append(self, batch: RecordBatch) -> int:
        """Append a batch to this writer's commit log and dispatch it. Returns records appended
        to compaction logs (records at or below a partition's last offset are skipped)."""
        return self.writes.append(batch)

    def write_timings(self) -> dict[str, Timing]:
        """A writer's durations (reput/timing.py) for metrics: ``append`` (commit-log append
        calls), ``commitlog`` (its fsyncs), ``partitions`` (each flush's fsyncs of the
        partitions' files); empty for a read-only store."""
        return self.writes.write_timings()

    def dispatch(self) -> int:
        """Reput: copy commit-log records after the dispatched position into partitions
        (``Reput.dispatch``, reput/reput_service.py)."""
        return self.writes.dispatch()

    def flush(self) -> None:
        """Make everything appended so far durable, then advance the reput checkpoint
        (``WritePath.flush``: commit log, partitions, publisher, checkpoint)."""
        self.writes.flush()

    def roll(self, *, only_due: bool = False) -> int:
        """Roll the active segment of every partition this process writes, so that compaction
        may clean what it holds (``PartitionLog.roll``): at the end of a batch job (a one-shot
        mirror, a Spark mirror task). ``only_due``: only those open longer than their topic's
        roll time (``PartitionLog.roll_if_due``), what a following writer does while its topic
        is idle. Returns how many were rolled."""
        return self.writes.roll(only_due=only_due)

    # -- the store catalog and shared objects --------------------------------------------

    def collect_shared_garbage(self) -> list[str]:
        """S3 with shared uploads: delete the shared objects every partition has split, and
        orphans, once the grace period has passed (reput/shared.py ``collect_garbage``); a
        store catalog is reconciled first and its old versions collected."""
        return self.upkeep.collect_shared_garbage()

    def left_unfolded(self) -> list:
        """This writer's journal entries above the store catalog's ``folded`` (a killed process
        of it committed them and never folded them)."""
        return self.upkeep.left_unfolded()

    def shared_committed(self, entry) -> None:
        """A shared upload's journal entry is committed (reput/publisher.py): with a store
        catalog, fold this writer's entries every ``fold_every()`` commits."""
        self.upkeep.shared_committed(entry)

    def fold_catalog(self) -> None:
        """A store catalog: fold this writer's journal entries committed since the last fold
        (one PUT; docs/formats/store-catalog.md). Not a commit point: a failure is retried at
        the next fold."""
        self.upkeep.fold()

    def compaction_batch(self):
        """S3: the batch that publishes a compaction run's outputs of every partition in one
        object (reput/compaction_object.py); None on a local store, and on an S3 store without
        shared uploads unless ``KCOMPACT_S3_COMPACTION_OBJECTS=store`` (the publisher's)."""
        return self.publisher.compaction_batch()

    def collect_compaction_garbage(self) -> list[str]:
        """S3: delete compaction objects no partition lists any more (nor retired less than
        the grace period ago), and those a killed run never committed, once the grace period
        has passed (reput/compaction_object.py ``collect_garbage``; the publisher's)."""
        return self.upkeep.collect_compaction_garbage()

    def close(self) -> None:
        self.writes.close_sealer()  # (outside the lock, which the seal under way takes)
        with self.lock:
            if self.commitlog is not None:
                self.flush()
                self.fold_catalog()  # (a reader opening the store then GETs no entry)
            self.writes.forget_sealer()
            for pl in self._partitions.values():
                pl.close()
            if self.shared_uploads:
                from .catalog_manifest import drain_drops
                drain_drops()  # (the local segments of its last flushes are gone)
            self._partitions.clear()
            self._writable.clear()
            self.publisher.closed()
            self.writes.close()

    # -- whole-store recovery (reput/store_recovery.py) -----------------------------------

    def recover_writers(self) -> list[str]:
        """Re-dispatch every other writer's commit log that no live process holds.

        Used by jobs that take over partitions a dead writer left behind (a killed Spark task,
        a crashed mirror): each free commit log is opened, its tail repaired and dispatched.
        """
        return store_recovery.recover_writers(self)
