"""The store sink connector: Kafka topic -> kcompact store (what ``kcompact mirror`` runs).

Exactly-once without consumer-group commits: a task opens the store with its own writer id,
and for each assigned partition asks the worker to start at ``store.next_offset(topic, p)`` -
the offset after the last record the store holds. Whatever the consumer group says, and however
the previous run ended (SIGKILL included: opening the store repairs a torn commit-log tail and
re-dispatches idempotently), a restart neither loses nor repeats a record. ``pre_commit`` queues
a store flush (fsync) and returns no offsets, so the worker never commits to the group.

Appends run in a thread of their own (``_Appender``): the numba encode/dispatch kernels and the
write syscalls release the GIL, so they overlap with the next ``consume()`` on the task thread.

Records are stored as Kafka holds them: source offset (gaps from transaction markers or an
already-compacted topic stay gaps), timestamp, key and value bytes (null and empty distinct),
headers in order. ``key.converter``/``value.converter`` only decide what is *accepted* (an
AvroConverter rejects a malformed payload - to the dead-letter topic under
``errors.tolerance=all``); the bytes stored are always the original ones.

The consumer reads with ``isolation.level=read_committed`` (records of open transactions are
held back until they commit) and ``auto.offset.reset=error``: if the store's next offset is no
longer in the topic (retention deleted records that were never mirrored) the task stops and
says so instead of silently skipping; set ``consumer.override.auto.offset.reset=earliest``
(``-X auto.offset.reset=earliest``) to accept the gap.

A topic deleted and created again (its offsets start again at 0) is never mixed into the stored
one's logs. store.json records each topic's Kafka topic id (``topic_ids``) and partitions before
any record of it is stored: at start (:meth:`StoreSinkConnector.partitions_selected`) and for
what a following task picks up (:meth:`StoreSinkTask.open`). A later start on a topic recorded
under another id fails before writing anything (one line naming both ids; ``kcompact mirror``
exits 1). While following, such a topic is stopped alone and the others go on (the worker
confirms every batch's topic ids: framework/topic_watch.py), and the run exits 3 when it ends.
Brokers that give no topic ids keep only the offset checks above.
"""

from __future__ import annotations

import operator
import os
import queue
import threading
from itertools import repeat
from typing import Any, Mapping, Sequence

import numpy as np

from kcompact.reput import CorruptRecordError, Store, StoreNotFoundError, WriterOptions
from kcompact.reput.config import FSYNC_POLICIES, SYSTEM_CLOCK, UPLOAD_MODES, Clock
from kcompact.reput.record import RecordBatch, BytesColumn, encode_headers

from ..framework.api import OFFSET_BEGINNING, SinkConnector, SinkRecords, SinkTask, TopicPartition
from ..framework.config import ConfigDef, Importance, Type, at_least, non_empty, one_of
from ..errors import ConfigError, ConnectorsError
from ..framework.kafka_clients import admin_settings, kafka_logger, short_lived
from ..framework.topic_watch import describe_topic_ids
from .config_sync import SinkConfigSync
from .group_sync import DEFAULT_INTERVAL_MS, SinkGroupSync
from .acl_sync import DEFAULT_INTERVAL_MS as ACL_INTERVAL_MS, SinkAclSync

STORE_SINK_CONFIG = (
    ConfigDef()
    .define("store.url", Type.STRING, None, None, Importance.HIGH,
            "The store to write: a directory (file:// also accepted) or s3://bucket/prefix. "
            "Created when missing. Required.")
    .define("store.writer", Type.STRING, "connect", non_empty, Importance.MEDIUM,
            "Writer id (commitlog/<id>/) of task 0; task i > 0 uses <id>-<i>. One process per "
            "writer id at a time.")
    .define("store.partitions", Type.LIST, [], None, Importance.MEDIUM,
            "Only these partition numbers of each topic (comma-separated; empty = all).")
    .define("store.fsync", Type.STRING, WriterOptions.fsync, one_of(*FSYNC_POLICIES),
            Importance.LOW, "When the commit log is fsynced: on every batch, on every flush "
            "(offset.flush.interval.ms), or never (the OS decides).")
    .define("store.commitlog.dir", Type.STRING, None, None, Importance.LOW,
            "Local directory for the commit log when store.url is not a local directory (S3).")
    .define("store.upload", Type.STRING, WriterOptions.upload, one_of(*UPLOAD_MODES),
            Importance.LOW, "How a flush uploads to an S3 store: shared (one object for every "
            "partition it wrote and one journal entry), partition (a .log, .bcq and manifest "
            "version per partition), auto (shared for a new store or one that uses shared "
            "uploads).")
    .define("store.compaction.background", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Run the compaction planner in the background on the partitions this task writes "
            "(kcompact.compaction.Scheduler), as `kcompact mirror --follow` does.")
    .define("store.compaction.interval.ms", Type.LONG, 30_000, at_least(100), Importance.LOW,
            "How often the background compaction planner runs.")
    .define("store.compaction.max.bytes.per.s", Type.LONG, 0, at_least(0), Importance.LOW,
            "I/O budget of background compaction: bytes read plus written per second "
            "(Kafka's log.cleaner.io.max.bytes.per.second); 0 = unlimited.")
    .define("sync.topic.configs.enabled", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "Read each topic's compaction configs from Kafka (describe_configs) when a task "
            "opens it and, while following, every consumer topic.metadata.refresh.interval.ms "
            "(5 min by default), and store them as the topic's synced configs, as kcompact "
            "mirror does (MirrorMaker 2's name). A broker refusing describe_configs is a "
            "warning. false: the store's values and kcompact configs overrides only.")
    .define("store.codec.probe.enabled", Type.BOOLEAN, True, None, Importance.LOW,
            "For a topic whose store compression.type is producer (a new store's default: the "
            "source's codec), read the codec of the source's batches with a Fetch of a few KB "
            "(plugins/codec_watch.py) when a task opens it and every 64 MiB mirrored, and seal "
            "its records with it. false: such records are stored uncompressed.")
    .define("sync.group.offsets.enabled", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "Keep the committed offsets of the source's consumer groups on the mirrored topics "
            "in the store (Admin API: list groups, then their offsets): when the tasks open "
            "their topics, every sync.group.offsets.interval.ms while following, and at the "
            "end (MirrorMaker 2's name; `kcompact groups`, `kcompact restore --groups`). A "
            "source refusing the group APIs is one warning.")
    .define("sync.group.offsets.interval.ms", Type.LONG, DEFAULT_INTERVAL_MS, at_least(1000),
            Importance.LOW, "How often a following mirror captures the groups' offsets.")
    .define("sync.topic.acls.enabled", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "Keep the source's ACL bindings on the mirrored topics and on the groups kept with "
            "them in the store (Admin API DescribeAcls): when the tasks open their topics, "
            "every sync.topic.acls.interval.ms while following, and at the end (MirrorMaker "
            "2's name; `kcompact acls`, `kcompact restore --acls`). A source without an "
            "authorizer, or refusing DescribeAcls, is one warning.")
    .define("sync.topic.acls.interval.ms", Type.LONG, ACL_INTERVAL_MS, at_least(1000),
            Importance.LOW, "How often a following mirror captures the ACLs.")
    .define("schema.registry.url", Type.STRING, None, None, Importance.MEDIUM,
            "The source's schema registry: every schema the records' keys and values name in "
            "Confluent's wire format (magic byte 0, 4-byte id) is kept in the store once, with "
            "its subjects, versions and references (`kcompact schemas`, `kcompact restore "
            "--schema-registry`). A registry that cannot be reached stops the task before "
            "the batch is stored.")
    .define("groups", Type.STRING, ".*", None, Importance.MEDIUM,
            "The consumer groups whose offsets are kept: a regular expression matched against "
            "the whole group id (default every group that committed on a mirrored topic).")
    .define("groups.exclude", Type.STRING, None, None, Importance.LOW,
            "Groups left out: a regular expression matched against the whole group id.")
)


def _refuse_foreign_directory(url: str) -> None:
    """A store is created only in a missing or empty directory, never among someone's files."""
    if "://" in url and not url.startswith("file://"):
        return
    path = url[len("file://"):] if url.startswith("file://") else url
    if os.path.isdir(path) and os.listdir(path) and \
            not os.path.exists(os.path.join(path, "store.json")):
        raise ConfigError(f"store.url: {path} is a non-empty directory that is not a kcompact "
                          "store (no store.json); give a new or empty directory", key="store.url")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"store.url: {path} is a file, not a store directory", key="store.url")


def _partition_numbers(values: Sequence[str]) -> list[int]:
    out = []
    for v in values:
        try:
            p = int(v)
        except ValueError:
            raise ConfigError(f"store.partitions: {v!r} is not a partition number",
                              key="store.partitions") from None
        if p < 0:
            raise ConfigError(f"store.partitions: {p} is negative", key="store.partitions")
        out.append(p)
    return sorted(set(out))


class StoreSinkConnector(SinkConnector):
    """Mirrors Kafka topics into a kcompact store, resuming from the store's own offsets."""

    CONFIG = STORE_SINK_CONFIG
    #: start() dispatches what dead writers left. The Spark engine's per-partition tasks turn
    #: this off: their driver does it once before the job, and a task must not open (and so
    #: lock) another task's commit log.
    RECOVER_WRITERS = True

    #: the config sync its tasks share (``sync.topic.configs.enabled``), or None
    config_sync: SinkConfigSync | None = None
    #: the capture of the source's group offsets (``sync.group.offsets.enabled``), or None
    group_sync: SinkGroupSync | None = None
    #: the capture of the source's ACLs (``sync.topic.acls.enabled``), or None
    acl_sync: SinkAclSync | None = None
    #: the capture of the records' schemas (``schema.registry.url``), or None
    schema_sync: Any = None
    #: the probe of the source's batch codecs (``store.codec.probe.enabled``), or None
    codec_watch: Any = None

    def start(self, props: Mapping[str, Any]) -> None:
        super().start(props)
        self.config_sync = None
        if not props.get("store.url"):
            raise ConfigError("store.url: required by StoreSinkConnector (a directory for the "
                              "store; it is created when missing)", key="store.url")
        self.only = _partition_numbers(props.get("store.partitions") or [])
        _refuse_foreign_directory(props["store.url"])
        if props.get("sync.topic.configs.enabled", True) and self.kafka_conf:
            self.config_sync = SinkConfigSync(
                props["store.url"], self.kafka_conf, follow=props.get("follow", True) is not False,
                commitlog_dir=props.get("store.commitlog.dir"),
                writer=f"{props.get('store.writer') or 'connect'}-configs")
        self.group_sync = None
        if props.get("sync.group.offsets.enabled", True) and self.kafka_conf:
            import re
            for key in ("groups", "groups.exclude"):
                try:
                    re.compile(props.get(key) or "")
                except re.error as e:
                    raise ConfigError(f"{key}: {props[key]!r} is not a regular expression "
                                      f"({e})", key=key) from None
            base = props.get("store.writer") or "connect"
            self.group_sync = SinkGroupSync(
                props["store.url"], self.kafka_conf, writer=f"{base}-groups",
                follow=props.get("follow", True) is not False,
                interval_ms=int(props.get("sync.group.offsets.interval.ms")
                                or DEFAULT_INTERVAL_MS),
                groups=props.get("groups"), exclude=props.get("groups.exclude"),
                commitlog_dir=props.get("store.commitlog.dir"),
                prefix="mirror" if props.get("name") == "kcompact-mirror" else "connect")
        self.acl_sync = None
        if props.get("sync.topic.acls.enabled", True) and self.kafka_conf:
            base = props.get("store.writer") or "connect"
            self.acl_sync = SinkAclSync(
                props["store.url"], self.kafka_conf, writer=f"{base}-acls",
                follow=props.get("follow", True) is not False,
                interval_ms=int(props.get("sync.topic.acls.interval.ms") or ACL_INTERVAL_MS),
                commitlog_dir=props.get("store.commitlog.dir"),
                prefix="mirror" if props.get("name") == "kcompact-mirror" else "connect")
        self.codec_watch = None
        if props.get("store.codec.probe.enabled", True) and self.kafka_conf:
            from .codec_watch import SinkCodecWatch
            self.codec_watch = SinkCodecWatch(
                self.kafka_conf,
                prefix="mirror" if props.get("name") == "kcompact-mirror" else "connect")
        self.schema_sync = None
        if props.get("schema.registry.url"):
            from .schema_sync import SinkSchemaSync
            base = props.get("store.writer") or "connect"
            self.schema_sync = SinkSchemaSync(
                props["store.url"], props["schema.registry.url"], writer=f"{base}-schemas",
                commitlog_dir=props.get("store.commitlog.dir"),
                prefix="mirror" if props.get("name") == "kcompact-mirror" else "connect")
        if not self.RECOVER_WRITERS:
            return
        # Before any task picks its start offsets: dispatch whatever a dead writer (a killed
        # mirror or Spark task) left in its commit log, so next_offset() sees all of it. A store
        # that does not exist yet has none, and is created only once the partitions are known
        # to exist (select_partitions): a failed start leaves nothing behind.
        try:
            store = Store.open(props["store.url"],
                               commitlog_dir=props.get("store.commitlog.dir"))
        except StoreNotFoundError:
            return
        try:
            store.recover_writers()
        finally:
            store.close()

    def task_class(self) -> type[SinkTask]:
        return StoreSinkTask

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        """One per task: its writer id, and the connector's config sync (an object: the tasks
        run in this process) when it has one."""
        base = self.props.get("store.writer") or "connect"
        extra: dict[str, Any] = {"store.config.sync": self.config_sync} \
            if self.config_sync else {}
        if self.group_sync is not None:
            extra["store.group.sync"] = self.group_sync
        if self.acl_sync is not None:
            extra["store.acl.sync"] = self.acl_sync
        if self.schema_sync is not None:
            extra["store.schema.sync"] = self.schema_sync
        if self.codec_watch is not None:
            extra["store.codec.watch"] = self.codec_watch
        return [dict(self.props, **extra, **{"task.id": i,
                                             "store.writer": base if i == 0 else f"{base}-{i}"})
                for i in range(max(1, max_tasks))]

    def stop(self) -> None:
        if self.config_sync is not None:
            self.config_sync.stop()
        if self.group_sync is not None:
            gs, self.group_sync = self.group_sync, None
            gs.stop()  # the last capture: the mirror's end
        if self.acl_sync is not None:
            acls, self.acl_sync = self.acl_sync, None
            acls.stop()  # after the groups' last capture: their bindings follow them
        if self.schema_sync is not None:
            sch, self.schema_sync = self.schema_sync, None
            sch.stop()
        if self.codec_watch is not None:
            cw, self.codec_watch = self.codec_watch, None
            cw.stop()
        super().stop()

    def select_partitions(self, topic: str, partitions: Sequence[int]) -> list[int]:
        """The partitions of ``topic`` this connector mirrors (``store.partitions``, or all).
        Only checks: the store is created by :meth:`partitions_selected`, once every topic's
        partitions are known to exist, so a partition missing from any topic leaves nothing."""
        if not self.only:
            return list(partitions)
        missing = [p for p in self.only if p not in set(partitions)]
        if missing:
            raise ConfigError(f"store.partitions: topic {topic!r} has partitions "
                              f"0..{max(partitions) if partitions else -1}; it has no "
                              f"partition {', '.join(map(str, missing))}",
                              key="store.partitions")
        return [p for p in partitions if p in set(self.only)]

    def partitions_selected(self, selected: Mapping[str, Sequence[int]]) -> None:
        """Record every topic's selected partitions in the store (created here when missing)
        before any task starts: a partition the mirror knows but has not written yet then
        reads as empty, not as unknown (Store.record_partitions)."""
        ids = self._topic_ids(list(selected))
        upload = self.props.get("store.upload") or WriterOptions.upload
        store = Store.open(self.props["store.url"], create=True,
                           commitlog_dir=self.props.get("store.commitlog.dir"),
                           # a new S3 store: shared uploads unless store.upload=partition
                           shared_uploads=upload != "partition")
        try:
            for topic, tid in ids.items():  # every topic checked before any is recorded
                before = store.recorded_topic_id(topic)
                if before is not None and before != tid:
                    raise ConnectorsError(
                        f"topic {topic!r} was deleted and created again since store "
                        f"{self.props['store.url']} copied it (topic id {before} then, {tid} "
                        "now): its offsets start again and would mix with the stored ones; "
                        "mirror it into a new store, or leave it out of this store's mirrors")
            for topic, partitions in selected.items():
                store.record_partitions(topic, list(partitions))
                if topic in ids:
                    store.record_topic_id(topic, ids[topic])
        finally:
            store.close()

    def _topic_ids(self, topics: list[str]) -> dict[str, str]:
        """The topics' Kafka topic ids (one describe_topics); none from a broker that does not
        give them (then nothing is recorded or compared)."""
        if not self.kafka_conf or not topics:
            return {}
        from confluent_kafka.admin import AdminClient
        admin = AdminClient(short_lived(dict(admin_settings(self.kafka_conf),
                                             logger=kafka_logger())))
        return describe_topic_ids(admin, topics)[0]


#: how long a sink task waits for a partition another process holds for a moment (a
#: `kcompact compact` rolling or compacting it) before it gives up
PARTITION_LOCK_WAIT_S = 60.0


def _open_waiting(url: str, **kw) -> Store:
    """``Store.open`` as a writer, waiting while a partition its open recovers is held by
    another process's short step (a compaction of it); a commit log or a partition another
    writer holds is refused at once (StoreLockedError)."""
    import time
    from kcompact.reput.errors import StoreLockedError
    deadline = time.monotonic() + PARTITION_LOCK_WAIT_S
    while True:
        try:
            return Store.open(url, **kw)
        except StoreLockedError as e:
            if "one writer per partition" not in str(e) or e.by_writer or \
                    time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class StoreSinkTask(SinkTask):
    #: Consumer settings this task cannot work without (the worker rejects an override).
    REQUIRED_CONSUMER_CONFIG = {"isolation.level": "read_committed"}
    #: Defaults the user may override.
    DEFAULT_CONSUMER_CONFIG = {"auto.offset.reset": "error"}

    store: Store | None = None
    scheduler: Any = None
    #: the store's clock (Kafka's ``Time``): what the roll rules and the background compaction
    #: count time with; a subclass injects another (tests: a ManualClock)
    clock: Clock = SYSTEM_CLOCK

    def start(self, props: Mapping[str, Any]) -> None:
        self.props = dict(props)
        #: a batch job (``follow`` false: a one-shot mirror, a Spark mirror task) rolls every
        #: active segment it wrote when it stops, so the store at rest is compactable
        self.batch_job = props.get("follow", True) is False
        # rolled segments are sealed into store format 2 by a thread of the writer, off the
        # append path; what is still queued when the task stops stays format 1 (reput/seal.py)
        options = WriterOptions(fsync=props.get("store.fsync") or WriterOptions.fsync,
                                seal="background",
                                upload=props.get("store.upload") or WriterOptions.upload)
        self.store = _open_waiting(props["store.url"], writer=props["store.writer"],
                                   create=True, options=options,
                                   commitlog_dir=props.get("store.commitlog.dir"),
                                   clock=self.clock)
        # a `kcompact compact` holding a partition for a moment delays an append, never stops it
        self.store.partition_lock_wait_s = PARTITION_LOCK_WAIT_S
        self.appended = 0
        #: rolled segments the store's close left in format 1 (not sealed yet)
        self.seals_left = 0
        self.appender = _Appender(self.store)
        self.scheduler = None
        if props.get("store.compaction.background"):
            self.scheduler = _start_scheduler(self.store,
                                              props.get("store.compaction.interval.ms") or 30_000,
                                              props.get("store.compaction.max.bytes.per.s") or 0)

    def open(self, partitions: Sequence[TopicPartition]) -> None:
        """Before any record of ``partitions`` is fetched (at start, and for what a following
        task picks up: a topic that starts to match ``topics.regex``, partitions added to a
        topic): each topic's Kafka id (``SinkTaskContext.topic_ids``, while following) is
        compared with the one the store has on record, and recorded when it has none; a topic
        recorded under another id is refused (deleted and created again: the worker stops it
        alone). The others' partitions are recorded (Store.record_partitions), their configs
        synced (``store.config.sync``), and each starts at the store's next offset."""
        assert self.store is not None
        refused = self._check_topic_ids({tp.topic for tp in partitions})
        partitions = [tp for tp in partitions if tp.topic not in refused]
        by_topic: dict[str, list[int]] = {}
        for tp in partitions:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        for topic, ps in by_topic.items():
            if not set(ps) <= set(self.store.recorded_partitions(topic)):
                self.store.record_partitions(topic, ps)  # found while following
        sync = self.props.get("store.config.sync")
        if sync is not None and by_topic:  # before any record of theirs is fetched
            sync.opened(self.store, set(by_topic))
        groups = self.props.get("store.group.sync")
        if groups is not None and by_topic:
            groups.opened(set(by_topic))
        acls = self.props.get("store.acl.sync")
        if acls is not None and by_topic:  # after the groups: their bindings are kept too
            acls.opened(set(by_topic))
        start = {}
        for tp in partitions:
            why = self._damage(tp)
            if why is not None:  # not mirrored (nothing of it fetched), the others are
                self.context.refuse_partition(tp, why)
                continue
            # A partition with data resumes exactly after its last record; an empty one starts
            # at the topic's first offset (which may be > 0 after retention).
            n = self.store.next_offset(tp.topic, tp.partition)
            start[tp] = n if n > 0 else OFFSET_BEGINNING
        codecs = self.props.get("store.codec.watch")
        if codecs is not None and start:  # the source's codec, for compression.type=producer
            codecs.opened(self.store, {(tp.topic, tp.partition): o for tp, o in start.items()})
        self.context.offset(start)

    def _damage(self, tp: TopicPartition) -> str | None:
        """Why the store cannot take records of ``tp`` (its partition is damaged: it does not
        open for write), or None. Issue 44: damage stays in its partition."""
        if tp.partition not in self.store.partitions(tp.topic):
            return None
        try:
            self.store.writable_partition(tp.topic, tp.partition)
            return None
        except CorruptRecordError as e:
            self.store.release_partition(tp.topic, tp.partition)
            return (f"the store's partition is damaged ({str(e).splitlines()[0]}); repair it "
                    "(`kcompact repair`, docs/operations-damage.md), then mirror again")

    def _check_topic_ids(self, topics: set[str]) -> set[str]:
        """The topics refused (``SinkTaskContext.refuse_topic``): their id in the context is not
        the one store.json has on record. A topic without a recorded id gets this one."""
        ids = getattr(self.context, "topic_ids", None) or {}
        refused = set()
        for topic in sorted(topics):
            tid = ids.get(topic)
            if tid is None or self.store.recorded_topic_id(topic) == tid:
                continue
            recorded = self.store.record_topic_id(topic, tid)  # re-read under store.json.lock
            if recorded != tid:
                self.context.refuse_topic(topic, recorded)
                refused.add(topic)
        return refused

    def close(self, partitions: Sequence[TopicPartition]) -> None:
        sync = self.props.get("store.config.sync")
        if sync is not None and partitions:
            sync.closed(self.store, {tp.topic for tp in partitions})

    def put(self, records: SinkRecords) -> None:
        n = len(records)
        if n == 0:
            return
        schemas = self.props.get("store.schema.sync")
        if schemas is not None:  # their schemas kept before the records are
            schemas.seen(records)
        codecs = self.props.get("store.codec.watch")
        topics = records.topics
        if topics[0] == topics[-1] and topics.count(topics[0]) == n:
            batches = [_batch(topics[0], records, None)]
        else:
            batches = [_batch(topic, records, [i for i, t in enumerate(topics) if t == topic])
                       for topic in dict.fromkeys(topics)]
        for batch in batches:
            self.appender.submit(batch)
            if codecs is not None:
                codecs.appended(self.store, batch)

    def flush(self, offsets: Mapping[TopicPartition, int]) -> None:
        if self.store is not None:
            self.appender.drain()
            self.store.flush()

    def pre_commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        # Nothing is committed to the group, so the task thread need not wait for the fsync:
        # the appender thread flushes after the batches queued before this point, while the
        # task goes on consuming. stop() waits for everything.
        # ``offsets`` are the consumer's positions: past transaction markers and aborted
        # records after a partition's last record (its end-of-partition offset). The flush
        # makes them the partitions' next offsets (Store.advance_next_offset), once the
        # records before them are durable: the store's end offsets are then the source's,
        # and a restart resumes there.
        if self.store is not None:
            if offsets:
                self.appender.submit(_Positions(offsets))
            self.appender.submit(_FLUSH)
        return {}  # the store is the source of truth for positions: no group commits

    def stop(self) -> None:
        if self.scheduler is not None:
            sched, self.scheduler = self.scheduler, None
            sched.stop()  # before the store closes under it
        if self.store is not None:
            store, self.store = self.store, None
            try:
                self.appender.close()
                if self.batch_job:
                    store.roll()
            finally:
                self.appended = self.appender.appended
                store.close()  # flushes what was appended
                self.seals_left = store.seals_left


_FLUSH = object()  # queued to the appender: flush the store after the batches before it


class _Positions(dict):
    """Queued to the appender: the consumer's positions ({TopicPartition: offset}) after the
    batches before it (Store.advance_next_offset each)."""


def warm_up() -> None:
    """Compile (or load from numba's cache) the encode/scan/order-check kernels: about
    3 s on a small VM, spent here while the consumer connects and prefetches, instead of inside
    the first real append (Store.append's encode_scanned; scan re-dispatches after a crash).
    Also imports the source-codec probe's Kafka protocol library (kio: 0.15-0.35 s, the more
    with hypothesis installed), which the first topic's probe would otherwise pay."""
    from kcompact.reput.record import encode_scanned, scan

    from ..framework import codec_probe  # noqa: F401 - (imported for the reason above)
    from kcompact.reput.store import warm_up as warm_up_append
    for headers in (None, [("h", b"")]):
        recs = SinkRecords(["warm-up"], [0], [0], [0], [b"k"], [b"v"], [headers])
        buf, _ = encode_scanned(_batch("warm-up", recs, None), secret=bytes(16))
        scan(buf)
    warm_up_append()


class _Appender:
    """Appends batches to the store in a thread of its own, so that encoding and writing (numba
    kernels without the GIL, and write syscalls) overlap with the next consume() and column
    building on the task thread. At most ``depth`` batches wait; order is kept; the first
    failure is raised on the task thread by the next submit/drain."""

    def __init__(self, store: Store, depth: int = 2):
        self.store = store
        self.appended = 0
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="store-append", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warm_up()
        while True:
            batch = self._q.get()
            try:
                if batch is None:
                    return
                if self.error is None:
                    if batch is _FLUSH:
                        self.store.flush()
                    elif isinstance(batch, _Positions):
                        for tp, offset in batch.items():
                            self.store.advance_next_offset(tp.topic, tp.partition, offset)
                    else:
                        self.appended += self.store.append(batch)
            except BaseException as e:  # noqa: BLE001 - handed to the task thread
                self.error = e
            finally:
                self._q.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, batch: RecordBatch) -> None:
        self._raise()
        self._q.put(batch)

    def drain(self) -> None:
        """Wait until every submitted batch is appended."""
        self._q.join()
        self._raise()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        self._raise()


def _start_scheduler(store: Store, interval_ms: int, max_bytes_per_s: int = 0):
    """kcompact.compaction.Scheduler on this writer's store (the compactor shares the writer's lock, so
    it may rewrite sealed segments of partitions this task is appending to), within an I/O
    budget of ``max_bytes_per_s`` (0 = unlimited)."""
    from kcompact.compaction import CompactionOptions, Scheduler
    options = CompactionOptions(throttle_bytes_per_s=max_bytes_per_s or None)
    return Scheduler(store, options, interval_s=interval_ms / 1000).start()


def _column(items: list) -> BytesColumn:
    """A nullable bytes column, ~3x faster than BytesColumn.from_list for the usual case of no
    nulls (measured: 0.9 ms vs 5 ms per 10k 100-byte values)."""
    n = len(items)
    nulls = items.count(None)
    if nulls == 0:
        lens = np.fromiter(map(len, items), np.int64, n)
        null = np.zeros(n, np.bool_)
        joined = b"".join(items)
    elif nulls == n:
        return BytesColumn.nulls(n)
    else:
        null = np.fromiter(map(operator.is_, items, repeat(None)), np.bool_, n)
        filled = [b"" if x is None else x for x in items]
        lens = np.fromiter(map(len, filled), np.int64, n)
        joined = b"".join(filled)
    offs = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    # Writable, like every other column array: numba compiles one specialization per
    # (readonly, writable) combination, and a new one costs a second of GIL-held compile.
    buf = np.frombuffer(bytearray(joined), np.uint8) if joined else np.zeros(0, np.uint8)
    return BytesColumn(buf, offs, null)


def _batch(topic: str, r: SinkRecords, idx: list[int] | None) -> RecordBatch:
    """Columns of a SinkRecords batch (or of the rows ``idx``) -> RecordBatch, no per-record
    objects beyond the header encoding of records that have headers."""
    def col(values: list) -> list:
        return values if idx is None else [values[i] for i in idx]

    def num(values, dtype) -> np.ndarray:
        if idx is None:
            return np.asarray(values, dtype=dtype)
        return np.asarray(values, dtype=dtype)[idx]

    n = len(r) if idx is None else len(idx)
    if idx is None and r.packed_headers is not None:
        hb, ho = r.packed_headers
        hcol = BytesColumn(np.frombuffer(hb, np.uint8), np.frombuffer(ho, np.int64),
                          np.zeros(n, np.bool_))
    else:
        headers = col(r.headers)
        if any(headers):
            hcol = _column([encode_headers(h) if h else b"" for h in headers])
        else:
            hcol = BytesColumn.empties(n)
    if idx is None and r.packed is not None:
        # packed by the worker while it read the batch (SinkRecords.packed): no second pass
        kb, ko, kn, vb, vo, vn = r.packed
        kcol = BytesColumn(np.frombuffer(kb, np.uint8), np.frombuffer(ko, np.int64),
                          np.frombuffer(kn, np.bool_))
        vcol = BytesColumn(np.frombuffer(vb, np.uint8), np.frombuffer(vo, np.int64),
                          np.frombuffer(vn, np.bool_))
    else:
        kcol, vcol = _column(col(r.raw_keys)), _column(col(r.raw_values))
    if idx is None:
        r.nbytes = int(kcol.offs[-1]) + int(vcol.offs[-1])
    return RecordBatch(topic, num(r.partitions, np.int32), num(r.offsets, np.int64),
                       num(r.timestamps, np.int64), kcol, vcol, hcol)
