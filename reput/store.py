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
``~/.cache/kcompact/<store id>/``), and ``flush()`` also seals them: each partition appended
since the last flush uploads its segments and commits a manifest version, before the reput
checkpoint moves. Other processes see a writer's records once they are flushed.

(Over 600 lines on purpose: the write path's ordering, append, dispatch, flush's fsyncs, seal and
close under one lock, is the durability argument and reads as one; store.json's layers, the
readers and the partition catalog are in modules of their own.)
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from . import _kernels as K
from . import env as _env
from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from .backend import Backend, BackendError, LocalBackend, MemoryBackend
from .commitlog import CommitLog
from .config import SYSTEM_CLOCK, Clock, TopicConfig, WriterOptions
from .errors import (CorruptRecordError, OffsetOrderError, ReputError, StoreFormatError,
                     StoreNotFoundError)
from . import _native as _N
from .locks import FileLock, partition_holder
from .partition import PartitionLog
from .reader import PartitionReader, RecordColumns
from .timing import Timing
from .record import Record, RecordBatch, Scan, Scratch, encode_scanned, scan, validate_topic
from .segment_list import canonical, crc32c
from .topic_configs import TopicConfigLayers, default_config


#: store format (docs/formats/store-json.md): 2 since sealed segments may be Kafka log segments
#: (segment-v2.md); a format-1 store is raised to 2 when its first format-2 segment is written.
#: A new store is created at FORMAT_VERSION; this kcompact reads up to KNOWN_FORMAT_VERSION (3:
#: an S3 store with shared uploads, docs/formats/shared-upload.md, raised so by its first one)
FORMAT_VERSION = 2
#: (4: an S3 store holding compaction objects, docs/formats/compaction-object.md; 5: with a
#: store catalog, docs/formats/store-catalog.md)
KNOWN_FORMAT_VERSION = SC.STORE_FORMAT
#: store.json "features": what this store keeps beyond its format. "segment-list": every local
#: partition has a segment list (docs/formats/segment-list.md), so one without is refused
FEATURE_SEGMENT_LIST = "segment-list"
#: store.json "features": "source-codec": the topics' compression.type default is producer (the
#: source's codec kept); a store without it (created before) keeps zstd (reput/topic_configs.py)
FEATURE_SOURCE_CODEC = "source-codec"
#: a follower of an S3 store with shared uploads and no catalog lists a topic's partitions at
#: most this often (s); the journal names the partitions written since (Store.partitions)
PARTITIONS_RELIST_S = 30.0
SEAL_THREADS = 16  # partitions sealed at once by an S3 writer's flush
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


@dataclass
class StoreMeta:
    """Contents of store.json (docs/formats/store-json.md)."""

    store_id: str
    secret: bytes
    created_ms: int
    topics: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: each topic's synced values and local overrides (reput/topic_configs.py); ``topics``
    #: holds the effective values they give, written alongside for readers that know only it
    layers: dict[str, TopicConfigLayers] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)
    #: each topic's recorded partitions (Store.record_partitions), written only when some are
    recorded_partitions: dict[str, list[int]] = field(default_factory=dict)
    #: each topic's Kafka topic id when a mirror first copied it (Store.record_topic_id)
    topic_ids: dict[str, str] = field(default_factory=dict)

    @property
    def defaults(self) -> TopicConfig:
        """The topics' defaults in this store (topic_configs.default_config)."""
        return default_config(self.features)

    def set_layers(self, topic: str, layers: TopicConfigLayers) -> None:
        self.layers[topic] = layers
        self.topics[topic] = layers.effective(self.defaults).to_dict()

    def _body(self) -> dict:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "store_id": self.store_id,
            "digest": {"algorithm": "siphash-2-4-128", "secret": self.secret.hex()},
            "created_ms": self.created_ms,
            "topics": self.topics,
        }
        if self.layers:
            body["topic_configs"] = {t: ly.to_json() for t, ly in self.layers.items()}
        if self.features:
            body["features"] = sorted(set(self.features))
        if self.recorded_partitions:
            body["partitions"] = self.recorded_partitions
        if self.topic_ids:
            body["topic_ids"] = self.topic_ids
        return body

    def to_json(self) -> bytes:
        body = self._body()
        body["crc32c"] = f"{crc32c(canonical(body)):08x}"
        return json.dumps(body, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "StoreMeta":
        try:
            d = json.loads(raw)
            version = int(d["format_version"])
        except RecursionError:
            raise StoreFormatError(f"{where}: store.json is nested too deeply to be one; restore "
                                   "it from a backup (the digest secret is in it)") from None
        except (ValueError, KeyError, TypeError):
            raise StoreFormatError(f"{where}: store.json is truncated or not valid JSON; restore "
                                   "it from a backup (the digest secret is in it)") from None
        if version > KNOWN_FORMAT_VERSION:
            raise StoreFormatError(f"{where}: store format version {version} is newer than this "
                                   f"kcompact understands ({KNOWN_FORMAT_VERSION}); upgrade "
                                   "kcompact")
        if "crc32c" in d:  # written by a kcompact that checksums it (older ones do not)
            crc = d.pop("crc32c")
            try:
                ok = crc == f"{crc32c(canonical(d)):08x}"
            except (RecursionError, ValueError, TypeError):
                ok = False
            if not ok:
                raise StoreFormatError(f"{where}: store.json does not match its checksum; "
                                       "restore it from a backup (the digest secret is in it)")
        if version > KNOWN_FORMAT_VERSION:
            raise StoreFormatError(f"{where}: store format version {version} is newer than this "
                                   f"kcompact understands ({KNOWN_FORMAT_VERSION}); upgrade "
                                   "kcompact")
        try:
            secret = bytes.fromhex(d["digest"]["secret"])
            if len(secret) != 16 or d["digest"]["algorithm"] != "siphash-2-4-128":
                raise ValueError
            topics = d.get("topics", {})
            for t, cfg in topics.items():
                validate_topic(t)
                TopicConfig.from_dict(cfg)
            features = d.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                raise ValueError("features is not a list of names")
            if not isinstance(d["store_id"], str) or not d["store_id"]:
                raise ValueError("store_id is not a name")
            meta = cls(d["store_id"], secret, int(d.get("created_ms", 0)), topics, version,
                       features=features)
            for t, ly in (d.get("topic_configs") or {}).items():
                meta.set_layers(validate_topic(t), TopicConfigLayers.from_json(ly))
            meta.recorded_partitions = {validate_topic(t): _partition_list(ps)
                                        for t, ps in d.get("partitions", {}).items()}
            meta.topic_ids = {validate_topic(t): _topic_id(i)
                              for t, i in d.get("topic_ids", {}).items()}
            return meta
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreFormatError(f"{where}: store.json has an invalid field ({e}); restore it "
                                   "from a backup") from None


def _topic_id(tid: Any) -> str:
    if not isinstance(tid, str) or not tid or len(tid) > 64:
        raise ValueError(f"topic_ids: {tid!r} is not a topic id")
    return tid


def _partition_list(ps: Any) -> list[int]:
    """A topic's entry of store.json's ``partitions``: sorted distinct partition numbers."""
    if not isinstance(ps, list) or not all(type(p) is int and p >= 0 for p in ps):
        raise ValueError(f"partitions: {ps!r} is not a list of partition numbers")
    return sorted(set(ps))


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
    def __init__(self, fs: Backend, meta: StoreMeta, *, writer: str | None,
                 options: WriterOptions, clock: Clock, commitlog_fs: Backend | None = None):
        self.fs, self.meta, self.writer = fs, meta, writer
        self.options, self.clock = options, clock
        #: an object store: partitions are manifests, active segments live in commitlog_fs
        self.remote = not fs.appendable
        if commitlog_fs is None and self.remote:
            commitlog_fs = LocalBackend(default_commitlog_dir(meta.store_id))
        self.commitlog_fs = commitlog_fs or fs
        if self.remote and not self.commitlog_fs.appendable:
            raise ReputError(f"{fs.url}: pass a local commitlog_dir for the writer's commit log")
        self.local_fs = self.commitlog_fs if self.remote else fs
        #: this writer's flushes upload one shared object (docs/formats/shared-upload.md)
        self.shared_uploads = (self.remote and writer is not None and (
            options.upload == "shared" or (options.upload == "auto" and options.seal_format == 2
                                           and SH.FEATURE in meta.features)))
        if self.remote and SC.FEATURE in meta.features:
            # the store catalog (docs/formats/store-catalog.md): every partition's manifest
            # and the journal entries still needed, in one LIST and one GET
            SH.enable(fs)
            SC.enable(fs, clock.ms).refresh(0.0)
        if self.remote and (self.shared_uploads or SH.FEATURE in meta.features):
            SH.enable(fs).refresh(0.0)  # (a writer numbers its next object from it)
        elif self.remote:
            SH.checked(fs)  # store.json was just read: no shared uploads yet
        #: this writer's journal entries not yet folded into the store catalog (at open: those
        #: a killed process of this writer committed and never folded)
        self._unfolded: list = self._left_unfolded() if self.shared_uploads else []
        #: a follower of a store without a catalog: topic -> (its partitions listed, when)
        self._partition_listing: dict[str, tuple[set[int], float]] = {}
        self._collected: set[tuple[str, int]] = set()
        self._registered = False  # in the shared-upload writers registry (_seal_shared)
        self._partitions: dict[tuple[str, int], PartitionLog] = {}
        self._writable: set[tuple[str, int]] = set()
        self._wrote_partitions = False
        #: held while partitions are opened, appended to, swapped or released: a compactor or a
        #: replica that changes a partition this store writes takes it around each step
        self.lock = threading.RLock()
        self.commitlog: CommitLog | None = None
        self._dispatched = 0
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
            try:
                self._dispatched = self.commitlog.read_checkpoint()
                if self.commitlog.segments and self._dispatched > self.commitlog.end:
                    # The commit log lost its tail below the checkpoint (fsync=never and a
                    # power cut, or a corrupt record cut by recovery). Those records were
                    # dispatched; new appends start at the end, so dispatch continues there.
                    self._dispatched = self.commitlog.end
                self.dispatch()
                if self.remote:
                    self._take_over_local_segments()
                self.flush()
            except BaseException:
                # Release the commit-log and partition locks: the caller may fix the cause
                # (the error says how) and open the store again from this same process.
                try:
                    for pl in self._partitions.values():
                        pl.close(seal=False)
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
        """A new store. ``shared_uploads`` (an object store only): created at format 4 with
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
        cat = SC.for_store(self.fs) if self.remote else None
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
        f = S3F.follower_for(self.fs) if self.remote else None
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
        if self.remote:  # this writer's partitions that have no manifest yet
            with self.lock:
                found |= {p for (t, p), pl in self._partitions.items()
                          if t == topic and (t, p) in self._writable and pl.segments}
        return sorted(found)

    def recorded_partitions(self, topic: str) -> list[int]:
        """The partitions of ``topic`` recorded in store.json (:meth:`record_partitions`): those
        a mirror was started on, written yet or not. ``partitions()`` lists those holding data."""
        return list(self.meta.recorded_partitions.get(topic, []))

    def record_partitions(self, topic: str, partitions: list[int] | tuple[int, ...]) -> list[int]:
        """Record in store.json that ``topic`` has these partitions (added to those recorded
        before; docs/formats/store-json.md), so that a partition a mirror knows but has not
        written yet reads as empty instead of unknown. store.json is rewritten atomically, and
        only when the recorded set grows. Returns the recorded partitions."""
        want = _partition_list(list(partitions))
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
        tid = _topic_id(topic_id)
        with self.lock, FileLock(self.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)
            if validate_topic(topic) not in meta.topic_ids:
                meta.topic_ids[topic] = tid
                self.fs.write_atomic(fn.STORE_JSON, meta.to_json())
            self._adopt(meta)
            return meta.topic_ids[topic]

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
        if self.remote and SH.FEATURE in meta.features:
            SH.enable(self.fs)  # another process started shared uploads meanwhile
        for (t, _), pl in self._partitions.items():
            pl.config = self.topic_config(t)

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

    def partition(self, topic: str, partition: int) -> PartitionLog:
        """The partition's log (read-only view unless this process writes it)."""
        key = (topic, partition)
        with self.lock:
            pl = self._partitions.get(key)
            if pl is None:
                pl = PartitionLog(self.fs, topic, partition, self.secret, self.topic_config(topic),
                                  clock=self.clock, require_list=self.require_list)
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
                    if self.options.seal == "background" and not self.remote:
                        self._background_seals(pl)
                self._partitions[key] = pl
                self._writable.add(key)
                if self.shared_uploads:  # a roll, a close, a forced compaction seal so too
                    pl.catalog.seal_shared = self._seal_shared
                if self.remote and self.writer is not None and key not in self._collected \
                        and not (self.shared_uploads and SC.for_store(self.fs) is not None):
                    # (a shared-upload writer of a catalog store uploads no segment of the
                    # partition's: the compactor collects after its runs, without a LIST per
                    # partition at every writer's open)
                    # a writer's open cleans up after dead writers: orphans of an upload whose
                    # commit never came, replaced segments past the grace period
                    self._collected.add(key)
                    pl.collect_garbage()
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
                return PartitionLog(self.fs, topic, partition, self.secret,
                                    self.topic_config(topic), writable=True,
                                    local_fs=self.local_fs if self.remote else None,
                                    clock=self.clock, require_list=self.require_list,
                                    holder=holder)
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
        return not self.remote and FEATURE_SEGMENT_LIST in self.meta.features

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
            if start == self._dispatched:
                # The bytes just written are in memory, and so is their scan (one topic, the
                # batch's): dispatch them without reading or parsing them again.
                p = s.partitions
                runs = np.flatnonzero(p[1:] != p[:-1]) + 1
                n = self._dispatch_runs(buf, s, [0, *runs.tolist(), len(s)], batch.topic)
                self._dispatched = end
                self.stats["dispatched"] += n
            else:
                n = self.dispatch()
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
        """Reput: copy commit-log records after the dispatched position into partitions."""
        assert self.commitlog is not None
        total = 0
        with self.lock:
            for seg_base, view, lo, hi in self.commitlog.views(self._dispatched):
                # re-dispatch from the files (after a crash) always checks CRCs
                total += self._dispatch_view(view, lo, hi, verify_crc=True,
                                             where=fn.commitlog_segment(self.writer, seg_base))
                self._dispatched = seg_base + hi
                del view
            self.stats["dispatched"] += total
        return total

    def _dispatch_view(self, view: np.ndarray, lo: int, hi: int, *, verify_crc: bool,
                       where: str) -> int:
        s = scan(view, lo, hi, secret=self.secret, verify_crc=verify_crc, scratch=self._scratch)
        if s.status != K.SCAN_OK:
            raise CorruptRecordError(
                f"{where}: {'torn' if s.status == K.SCAN_TORN else 'corrupt'} record at byte "
                f"{s.stop} during reput", where, s.stop)
        if not len(s):
            return 0
        return self._dispatch_runs(
            view, s, K.same_topic_runs(view, s.positions, s.topic_hash, s.partitions).tolist())

    def _dispatch_runs(self, view: np.ndarray, s: Scan, runs: list[int],
                       topic: str | None = None) -> int:
        """Append each run s[runs[r]:runs[r + 1]] of records of one topic-partition to its
        partition; ``topic`` when every run is of that topic, else each run's is read from its
        first record."""
        total = 0
        for a, b in zip(runs, runs[1:]):
            t = topic
            if t is None:
                p = int(s.positions[a])
                tl = int(view[p + 10])
                t = bytes(view[p + K.HEADER_SIZE:p + K.HEADER_SIZE + tl]).decode()
            n = self.writable_partition(t, int(s.partitions[a])).append(view, s, a, b)
            total += n
            self.stats["skipped"] += (b - a) - n
        return total

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
            if self.remote:
                # seal: upload each partition's new segments and commit its manifest, before
                # the checkpoint says those records need no re-dispatch
                self._seal_all()
            if self._dispatched != self.commitlog.read_checkpoint():
                self.commitlog.write_checkpoint(self._dispatched)
            self.commitlog.delete_dispatched(self._dispatched)

    def _sync_partitions(self) -> None:
        """fsync the files of every partition this writer appended to, several partitions at
        once: concurrent fsyncs share the filesystem's journal commits and the device's cache
        flushes (measured on this VM: 16 files of 8 MiB, 0.08-0.12 s one after another, 0.06 s
        with 8 threads). Every sync ends before this returns; the first failure is raised."""
        pls = [self._partitions[key] for key in self._writable]
        if self.shared_uploads:
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

    def _seal_all(self) -> None:
        """S3: seal every writable partition, several at once (each is a few requests whose
        latency, not bandwidth, is the cost); the first failure is raised. With shared uploads
        one object and one journal entry for all of them instead (``_seal_shared``)."""
        if self.shared_uploads:
            self._seal_shared()
            return
        cat = SC.for_store(self.fs)
        if cat is not None:  # every partition's manifest commit: one catalog version
            with cat.batch(self.writer or "writer"):
                self._seal_partitions()
        else:
            self._seal_partitions()

    def _seal_partitions(self) -> None:
        pls = [self._partitions[k] for k in sorted(self._writable)]
        if len(pls) <= 1:
            for pl in pls:
                pl.seal(self.writer or "writer")
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(SEAL_THREADS, len(pls)),
                                thread_name_prefix="kcompact-seal") as ex:
            for f in [ex.submit(pl.seal, self.writer or "writer") for pl in pls]:
                f.result()

    def _seal_shared(self) -> bool:
        """S3 with shared uploads (docs/formats/shared-upload.md): the new records of every
        partition this writer appended to since the last flush, each sealed into format 2, go
        into ONE object (1 PUT) committed by ONE journal entry (a conditional PUT): 2 requests
        whatever the partition count. Each partition's local segments are dropped only after
        the commit: a crash before it leaves an orphan object (collected) and local segments
        the next open uploads again; after it, local segments the journal already covers
        (recovery drops them). Returns whether an object was committed."""
        with self.lock:
            return self._seal_shared_locked()

    def _seal_shared_locked(self) -> bool:
        writer = self.writer or "writer"
        pieces = []
        try:
            for key in sorted(self._writable):
                pl = self._partitions[key]
                got = pl.catalog.shared_pieces(pl)
                if got is not None:
                    pieces.append((key, pl, got))
            if not pieces:
                return False
            # store.json says shared uploads are in use before the first shared object
            self.require_format(SH.STORE_FORMAT, SH.FEATURE)
            if SC.for_store(self.fs) is None:  # (a store catalog lists them instead)
                for _, pl, _ in pieces:  # listed by the store (topics, partitions) from now on
                    pl.catalog.ensure_manifest(writer)
            journal = SH.enable(self.fs)
            if not self._registered:  # followers learn of this writer (reput/s3_follow.py)
                SH.register_writer(self.fs, writer, self.clock.ms())
                self._registered = True
            seq = journal.next_seq(writer)
            stage = f"{fn.SHARED_DIR}/{writer}"
            self.commitlog_fs.remove_tree(stage)  # a crashed flush's object: an orphan on S3
            tag = secrets.token_hex(8)
            ospath = self.commitlog_fs.local_path(f"{stage}/{fn.shared_object(seq, tag)}")
            os.makedirs(os.path.dirname(ospath), exist_ok=True)
            with open(ospath, "wb") as out:
                b = SH.ObjectBuilder(out, writer, seq, tag)
                for (topic, partition), pl, (_local, ups, nxt) in pieces:
                    reached = -1  # the next offset of its last part with records
                    for i, (base, log, log_size, bcq, offs) in enumerate(ups):
                        if not offs.shape[0]:
                            continue
                        reached = ups[i + 1][0] if i + 1 < len(ups) else nxt
                        b.add(topic, partition, base, log, log_size, bcq, offs, reached)
                    if reached < nxt:
                        b.advance(topic, partition, nxt)
                b.finish()
            entry = SH.commit_object(self.fs, journal, writer, b, ospath, self.clock.ms())
        except BaseException:
            for _, pl, _ in pieces:
                pl.catalog.shared_aborted()
            self.commitlog_fs.remove_tree(f"{fn.SHARED_DIR}/{writer}")
            raise
        seed = getattr(self.fs, "seed", None)
        if seed is not None:  # read back from the spool, without a request
            seed(f"{fn.SHARED_DIR}/{writer}/{b.name}", ospath)
        else:
            os.unlink(ospath)
        for _, pl, (local, ups, _nxt) in pieces:
            pl.catalog.shared_committed(local, ups)
        if SC.for_store(self.fs) is not None:
            self._unfolded.append(entry)
            if len(self._unfolded) >= SC.fold_every():
                self.fold_catalog()
        return True

    def _left_unfolded(self) -> list:
        cat = SC.for_store(self.fs) if self.remote else None
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

    def fold_catalog(self) -> None:
        """A store catalog: fold this writer's journal entries committed since the last fold
        (one PUT; docs/formats/store-catalog.md). Not a commit point: a failure is retried at
        the next fold."""
        cat = SC.for_store(self.fs)
        if cat is None or not self._unfolded:
            return
        try:
            cat.fold(self.writer or "writer", self._unfolded)
        except (OSError, ReputError):
            return  # (the entries stay readable from their keys; the next fold retries)
        self._unfolded = []

    def collect_shared_garbage(self) -> list[str]:
        """S3 with shared uploads: delete the shared objects every partition has split, and
        orphans, once the grace period has passed (reput/shared.py ``collect_garbage``)."""
        j = SH.journal_for(self.fs) if self.remote else None
        if j is None:
            return []
        from . import manifest as M

        def manifest_of(topic: str, partition: int):
            pl = self._partitions.get((topic, partition))
            if pl is not None and pl.manifest is not None:
                return pl.manifest  # (stale only errs on keeping)
            return M.read_latest(self.fs, fn.partition_dir(topic, partition))
        grace_ms = int(getattr(self.fs, "grace_ms", 0))
        gone = []
        cat = self._reconcile_catalog()
        if cat is not None:
            gone += cat.collect_garbage(grace_ms=grace_ms, now_ms=self.fs.clock_ms())
        return gone + SH.collect_garbage(self.fs, j, manifest_of, grace_ms=grace_ms,
                                         now_ms=self.clock.ms(),
                                         objects_now_ms=self.fs.clock_ms())

    def _reconcile_catalog(self):
        """A store catalog: record every partition manifest newer than the catalog's (each
        read itself: a committer killed between its manifest commit and the catalog's), so
        nothing the newest catalog lists is deleted by the collector that follows
        (docs/formats/store-catalog.md, "Lagging"). Returns the catalog (None: no catalog)."""
        cat = SC.for_store(self.fs) if self.remote else None
        if cat is None:
            return None
        from . import manifest as M
        listed = [(t, int(p)) for t in self.fs.listdir(fn.PARTITIONS_DIR)
                  for p in self.fs.listdir(fn.topic_dir(t)) if p.isdigit()]
        cat.reconcile(lambda t, p: M.read_latest(self.fs, fn.partition_dir(t, p)),
                      also=listed)
        return cat

    def compaction_batch(self):
        """S3: the batch that publishes a compaction run's outputs of every partition in one
        object (reput/compaction_object.py); None on a local store or with
        ``KCOMPACT_S3_COMPACTION_OBJECTS=partition``."""
        from . import compaction_object as CO
        if not self.remote or CO.mode() != "store":
            return None
        return CO.CompactionBatch(self.fs, self.local_fs.local_path(fn.COMPACTED_DIR),
                                  writer=self.writer or "compactor",
                                  require_format=self.require_format)

    def collect_compaction_garbage(self) -> list[str]:
        """S3: delete compaction objects no partition lists any more (nor retired less than
        the grace period ago), and those a killed run never committed, once the grace period
        has passed (reput/compaction_object.py ``collect_garbage``)."""
        if not self.remote:
            return []
        from . import compaction_object as CO
        from . import manifest as M

        def manifest_of(topic: str, partition: int):
            pl = self._partitions.get((topic, partition))
            if pl is not None and pl.manifest is not None:
                return pl.manifest  # (read by this run: stale only errs on keeping)
            return M.read_latest(self.fs, fn.partition_dir(topic, partition))
        self._reconcile_catalog()
        return CO.collect_garbage(self.fs, manifest_of,
                                  grace_ms=int(getattr(self.fs, "grace_ms", 0)),
                                  now_ms=self.clock.ms(), objects_now_ms=self.fs.clock_ms(),
                                  warn=lambda line: print(line, file=sys.stderr))

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
            self._partitions.clear()
            self._writable.clear()
            if self.remote and self.shared_uploads:
                from .partition_manifest import drain_drops
                drain_drops()  # (the local segments of its last flushes are gone)
            if self._wrote_partitions and not self.remote and not self.require_list:
                self._wrote_partitions = False
                self._maybe_require_lists()
            if self.commitlog is not None:
                self.commitlog.close()
                self.commitlog = None
            if self._sync_pool is not None:
                if self._sync_pool_pid == os.getpid():
                    self._sync_pool.shutdown()
                self._sync_pool = None

    # -- whole-store recovery ------------------------------------------------------------

    def _take_over_local_segments(self) -> None:
        """S3: local segments a dead writer left in this commit-log directory (appended, maybe
        flushed to its commit log, never sealed) are opened here, so the flush that follows
        seals them. Partitions another live process writes are left to it."""
        from .errors import StoreLockedError
        for topic in self.local_fs.listdir(fn.PARTITIONS_DIR):
            try:
                validate_topic(topic)
            except ReputError:
                continue
            for p in self.local_fs.listdir(fn.topic_dir(topic)):
                if not p.isdigit() or (topic, int(p)) in self._writable:
                    continue
                names = self.local_fs.listdir(fn.partition_dir(topic, int(p)))
                if not any(fn.parse_base(n) for n in names):
                    continue
                try:
                    self.writable_partition(topic, int(p))
                except StoreLockedError:
                    continue

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
