"""The store source connector's runner (what the worker runs for ``StoreSourceConnector``).

The runner (:class:`RestoreRunner`, what the worker runs for ``StoreSourceConnector``) owns the
Kafka side: it creates the target topic with the store's partition count when it is missing
(explicitly: never through a broker's auto-creation), picks the producer, and writes progress.

Progress (docs/formats/restore-progress.md): one record per chunk, key = the job id
``<store topic>-><target cluster id>/<target topic>``, value = JSON with a sequence number and the
position reached in each store partition. It is written to two compacted topics named
``__kcompact-restore-offsets``: the store's own (appended through the store's normal write path
by the writer ``restore-<job hash>``, as Connect keeps ``connect-offsets``) and one on the target
cluster. A restart takes the record with the highest sequence number of the two and continues
from its positions; ``restore.from.scratch`` starts over.

Each chunk, with transactions (the broker supports them and ``exactly.once.support`` is not
``disabled``)::

    begin_transaction; produce the chunk; flush; produce progress(k) to Kafka's progress topic;
    commit_transaction; then, in a thread of its own (the fsyncs overlap the next chunk),
    append progress(k) to the store's progress topic and fsync

The chunk and its Kafka progress record commit atomically, and a restart first calls
``init_transactions`` with the job's transactional id (which aborts a dead run's open
transaction) and then reads the Kafka progress record with ``read_committed``. So against Kafka:

* killed before the commit: the chunk is aborted, both progress records say k-1 or less, the
  chunk is produced again: a ``read_committed`` consumer sees every record once.
* killed after the commit, before the store write: the store is behind (k-1 or less) but Kafka
  says k, the higher sequence wins, nothing is produced twice.

Exactly once for ``read_committed`` consumers (``read_uncommitted`` ones also see aborted
chunks, as with any Kafka transaction). On a broker that does not hide aborted records from
``read_committed`` consumers (the embedded Tansu broker, tests/integration/BROKER_NOTES.md) the
records of a chunk cut by a crash stay visible and the chunk is produced again: they appear
twice. The flush before the Kafka progress record makes an aborted-but-visible progress record
harmless there: when it is visible, its whole chunk was acknowledged before it.

Without transactions (``exactly.once.support=disabled``, or a broker without them under
``requested``) the idempotent producer sends the same sequence, flushing instead of committing:
at least once per chunk (a chunk cut by a crash is produced again, so up to one chunk of
duplicates per crash); the latest value per key of the target still converges to the store's,
because every duplicate is re-produced in its original order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Callable, Mapping, TextIO

import numpy as np

from ...framework.api import SourceTaskContext, TopicPartition, source_partition_key
from ...framework.kafka_clients import (ClientReports, KafkaSettings, kafka_error, kafka_error_text,
                                        kafka_logger)
from ...framework.native_kafka import NativeProducer, kafka_producer
from ...framework.task_runner import TaskRunner
from .errors import RestoreError
from .kafka import (AUTH_CODES, UNSUPPORTED_CODES, delete_topic, ensure_topic, kafka_failure,
                    load_codes)
from .progress import (PROBE_CONSUMER_CONFIG, PROGRESS_TOPIC, Progress, RestoreJob, StoreProgress,
                       encode_progress, newest, read_kafka_progress)
from .task import (INCLUDE_TOMBSTONES, TARGET_PARTITIONS, TARGET_TOPIC, StoreSourceTask,
                   open_store_topic, partition_count)
from .threads import LatestWriter, Prefetch
from .translation import AckRanges, chunk_pieces, encode_piece

#: Producer settings of a restore, under the user's (the bench's raw baseline uses the same).
DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "acks": "all",
    "enable.idempotence": True,
    "compression.type": "none",
    "linger.ms": 20,
    "batch.size": 1 << 20,
    "queue.buffering.max.messages": 1_000_000,
}
#: Settings the restore cannot work without.
REQUIRED_PRODUCER_CONFIG = {"enable.idempotence": "true"}
#: How long a flush or a commit may wait for the brokers' acknowledgements.
ACK_TIMEOUT_S = 120.0
#: How long a progress write waits for another restore that is writing the store's progress.
STORE_LOCK_WAIT_S = 30.0

#: Producer-only keys not passed to the admin client and the metadata consumer.
_PRODUCER_ONLY = {"acks", "enable.idempotence", "compression.type", "compression.codec",
                  "linger.ms", "queue.buffering.max.ms", "batch.size", "batch.num.messages",
                  "queue.buffering.max.messages", "queue.buffering.max.kbytes",
                  "transactional.id", "transaction.timeout.ms", "message.timeout.ms",
                  "delivery.timeout.ms", "partitioner", "retries", "message.send.max.retries",
                  "retry.backoff.ms", "request.required.acks", "delivery.report.only.error",
                  "sticky.partitioning.linger.ms", "max.in.flight.requests.per.connection",
                  "max.in.flight", "enable.gapless.guarantee", "compression.level"}


@dataclass
class RestoreStats:
    total: int = 0             # records this run plans to produce
    resumed: bool = False      # continued from recorded progress
    previously_produced: int = 0
    transactional: bool = False
    created_topic: bool = False
    target_partitions: int = 0
    chunks: int = 0
    planned: bool = False      # the task has made its plan (total is known)
    notes: list[str] = field(default_factory=list)
    groups_committed: list[str] = field(default_factory=list)  # --groups
    groups_skipped: list[str] = field(default_factory=list)
    acls_created: int = 0      # --acls
    acls_present: int = 0


class RestoreRunner(TaskRunner):
    """Runs one StoreSourceTask against Kafka, in the worker as its task runner."""

    def __init__(self, *, connector: Any, name: str, props: Mapping[str, Any],
                 settings: KafkaSettings, stop: threading.Event, startup_timeout: float,
                 log: TextIO):
        self.connector, self.name, self.props = connector, name, dict(props)
        self.settings, self.stop_event, self.log = settings, stop, log
        self.timeout = startup_timeout
        super().__init__(f"{name}-0")
        self.stats = RestoreStats()
        self.task: StoreSourceTask | None = None
        self.producer: Any = None
        self._reports = ClientReports(self.metrics)  # the callbacks' state, apart from the runner
        self._error_cb = self._reports.on_error
        #: deliveries counted per partition (offset map records, translation.py) unless the
        #: records are repartitioned (kcompact's producer, the only one since arch-build,
        #: counts acks in C)
        self._map = not bool(self.props.get("repartition"))
        self._acks = AckRanges(self._reports)
        self._dr_cb = self._acks.on_delivery if self._map else self._reports.on_delivery
        self._interleaved: set[int] = set()
        self._in_txn = False
        self._store_progress: StoreProgress | None = None
        #: the target topic when this run created it, and whether any record may have reached
        #: it (a committed transaction, or a produce without one): a run that fails before that
        #: deletes the topic it created, leaving the cluster as it found it
        self._created_target: str | None = None
        self._wrote_target = False

    def kafka_conf(self) -> dict | None:
        return dict(self.settings.conf)

    @property
    def bootstrap(self) -> str:
        return str(self.settings.conf.get("bootstrap.servers"))

    def _run(self) -> None:
        try:
            self._restore()
        except BaseException as e:  # noqa: BLE001 - reported by the worker
            self.failure = e
        finally:
            self.metrics.finished = time.monotonic()
            self._shutdown(self._store_progress)  # aborts an open transaction first
            if self.failure is not None:
                self._drop_created_target()

    def _drop_created_target(self) -> None:
        """A failed run deletes the target topic it created when nothing reached it (damage
        found in the store mid-stream, a refused write...): a rerun creates it again."""
        topic = self._created_target
        if topic is None or self._wrote_target:
            return
        conf = {k: v for k, v in self.settings.conf.items() if k not in _PRODUCER_ONLY}
        why = delete_topic(conf, topic, self.timeout)
        if why is None:
            self.stats.created_topic = False
            print(f"restore: deleted topic {topic!r}: this run created it and wrote nothing to "
                  "it", file=self.log, flush=True)
        else:
            self._warn(f"topic {topic!r}, created by this run, is empty and could not be "
                       f"deleted ({why}); delete it, or let the next restore fill it")

    def _shutdown(self, store_progress: StoreProgress | None) -> None:
        if self._in_txn and self.producer is not None:
            try:
                self.producer.abort_transaction(10)
            except Exception:  # noqa: BLE001 - a restart aborts it anyway
                pass
        for step in ((lambda: self.task.stop()) if self.task is not None else None,
                     (lambda: store_progress.close()) if store_progress is not None else None):
            if step is None:
                continue
            try:
                step()
            except BaseException as e:  # noqa: BLE001
                self.failure = self.failure or e
        self.producer = None  # let librdkafka's client go now

    def _warn(self, msg: str) -> None:
        self.stats.notes.append(msg)
        print(f"kcompact: warning: {msg}", file=self.log, flush=True)

    # -- setup ---------------------------------------------------------------------------------

    def _clients(self) -> tuple[Any, Any]:
        from confluent_kafka import Consumer, KafkaException
        from confluent_kafka.admin import AdminClient
        conf = {k: v for k, v in self.settings.conf.items() if k not in _PRODUCER_ONLY}
        try:
            admin = AdminClient(dict(conf, logger=kafka_logger()))
            consumer = Consumer(dict(conf, **PROBE_CONSUMER_CONFIG, logger=kafka_logger()))
        except KafkaException as e:
            raise self.settings.explain(e, "Kafka client") from None
        return admin, consumer

    def _producer_conf(self) -> dict[str, Any]:
        conf = dict(DEFAULT_PRODUCER_CONFIG)
        conf.update(self.settings.conf)
        self.settings.require(REQUIRED_PRODUCER_CONFIG, "the store source")
        conf["enable.idempotence"] = True
        conf.update({"delivery.report.only.error": not self._map, "on_delivery": self._dr_cb,
                     "error_cb": self._error_cb, "logger": kafka_logger()})
        return conf

    def _new_producer(self, conf: Mapping[str, Any]) -> Any:
        from confluent_kafka import KafkaException
        try:
            p = kafka_producer(dict(conf))
        except KafkaException as e:
            raise self.settings.explain(e, "Kafka producer") from None
        if self._map and isinstance(p, NativeProducer):
            p.track_deliveries()
        return p

    def _delivered(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """Deliveries acknowledged since the last call, per (topic, partition)."""
        if isinstance(self.producer, NativeProducer):
            return self.producer.delivered()
        return self._acks.delivered()

    def _init_transactions(self, p: Any, eos: str) -> tuple[Any, bool]:
        """``init_transactions`` (which aborts a dead run's open transaction), or, when the
        broker has no transactions and eos is "requested", the idempotent producer instead."""
        from confluent_kafka import KafkaException
        load_codes()
        try:
            p.init_transactions(self.timeout)
            return p, True
        except KafkaException as e:
            err = kafka_error(e)
            code = err.code() if err is not None else None
            if eos == "required":
                raise kafka_failure("start a transaction (exactly.once.support=required)", e,
                                    self.bootstrap, timeout=self.timeout) from None
            # "requested": no transaction coordinator, an old broker, or no ACL for the
            # transactional id -> the idempotent producer; anything else is an error
            if code not in UNSUPPORTED_CODES and code not in AUTH_CODES:
                raise kafka_failure("initialize the transactional producer", e,
                                    self.bootstrap, timeout=self.timeout) from None
            self._warn(f"transactions are not available on {self.bootstrap} "
                       f"({kafka_error_text(e)}): restoring with the idempotent producer, "
                       "at least once per chunk")
        self._reports.take_errors()
        conf = self._producer_conf()
        conf.pop("transactional.id", None)
        return self._new_producer(conf), False

    def _check_errors(self) -> None:
        from confluent_kafka import KafkaException
        delivery_errors = self._reports.delivery_errors
        if delivery_errors:
            first = delivery_errors[0]
            hint = ""
            if "too large" in first.lower():
                hint = "; raise -X message.max.bytes (and the topic's max.message.bytes)"
            raise RestoreError(f"Kafka rejected {len(delivery_errors)} record(s): {first}"
                               f"{hint}; run the same restore again to continue from the last "
                               "recorded progress")
        fatal = [e for e in self._reports.errors if e.fatal()]
        if fatal:
            raise kafka_failure("produce", KafkaException(fatal[0]), self.bootstrap)
        self._reports.take_errors()

    # -- the restore ---------------------------------------------------------------------------

    def _restore(self) -> None:
        props = self.props
        url, topic = props["store.url"], props["store.topic"]
        target = props.get("topic") or topic
        mode = props.get("mode") or "latest"
        eos = props.get("exactly.once.support") or "requested"
        progress_topic = props.get("progress.topic") or PROGRESS_TOPIC
        as_of = props.get("as.of.ms")
        as_of = None if as_of is None else int(as_of)
        allow_inexact = bool(props.get("as.of.allow.inexact"))
        groups_re = props.get("groups") or None
        with open_store_topic(url, topic) as st:
            store_id = st.meta.store_id
            needed = partition_count(st, topic)
            policy = st.topic_config(topic).cleanup_policy
            synced = {k: str(v) for k, v in st.topic_config_layers(topic).synced.items()}
            if as_of is not None:  # before anything is created on the cluster
                from kcompact.compaction.history import check_exact
                from kcompact.replication.config_capture import layers_as_of, synced_as_of
                check_exact([st.partition(topic, p) for p in st.partitions(topic)], as_of,
                            f"store topic {topic!r}", allow_inexact=allow_inexact)
                # the cleanup.policy synced from the source as of then (the config history)
                ly, _ = layers_as_of(st, topic, as_of, allow_inexact=allow_inexact)
                policy = ly.effective(st.meta.defaults).cleanup_policy
                synced, _ = synced_as_of(st, topic, as_of, allow_inexact=allow_inexact)
            # --configs: the target created with the source's configs too (as of then)
            target_config = dict(synced, **{"cleanup.policy": policy}) \
                if props.get("configs") else {"cleanup.policy": policy}
            self._acl_plan = None
            if props.get("acls"):
                from .acls import parse_principal_map, plan_acls
                self._acl_plan = plan_acls(
                    st, topic, target, parse_principal_map(props.get("acls.principal.map")
                                                           or []),
                    as_of_ms=as_of, allow_inexact=allow_inexact)
            schema_plan = None
            if props.get("schema.registry.url"):
                schema_plan = self._schema_plan(st, topic, as_of, allow_inexact)
            self._group_plan = None
            if groups_re:
                from .groups import plan_groups
                self._group_plan = plan_groups(st, topic, groups_re, as_of_ms=as_of,
                                               allow_inexact=allow_inexact)
        self._idmap = None
        if schema_plan is not None:  # registered before anything is produced
            from .. import schema_sync
            try:
                ids = schema_sync.register_all(
                    schema_sync.Registry(props["schema.registry.url"]), schema_plan,
                    keep_ids=bool(props.get("schema.keep.ids")), log=self.log)
            except schema_sync.SchemaRegistryError as e:
                raise RestoreError(str(e)) from None
            self._idmap = schema_sync.IdMap(ids, topic)
        self.task = StoreSourceTask()
        self.task.open(props)  # the latest-per-key selection runs meanwhile, without the GIL
        admin, consumer = self._clients()
        try:
            try:
                md = consumer.list_topics(timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - KafkaException
                raise kafka_failure("read the cluster metadata", e, self.bootstrap,
                                    timeout=self.timeout) from None
            cluster_id = md.cluster_id or self.bootstrap
            job = RestoreJob(store_id, topic, cluster_id, target)
            store_progress = StoreProgress(url, job, topic=progress_topic,
                                           commitlog_dir=props.get("store.commitlog.dir"))
            self._store_progress = store_progress
            store_progress.open_writer()
            conf = self._producer_conf()
            if eos != "disabled":
                conf.setdefault("transactional.id", job.transactional_id)
            else:
                conf.pop("transactional.id", None)
            self.producer = self._new_producer(conf)
            # connect it now (a metadata request for all topics creates none): its transaction
            # coordinator lookup then finds a broker up (0.003 s instead of 0.05-0.5 s)
            try:
                self.producer.list_topics(timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - KafkaException
                raise kafka_failure("connect the producer", e, self.bootstrap,
                                    timeout=self.timeout) from None
            rf = int(props.get("target.replication.factor") or -1)
            have, created = ensure_topic(admin, consumer, target, needed, self.bootstrap,
                                         config=target_config,
                                         replication_factor=rf, timeout=self.timeout)
            self._created_target = target if created else None
            if props.get("configs"):
                shown = ", ".join(f"{k}={v}" for k, v in sorted(target_config.items()))
                print(f"restore: configs: {target} created with {shown}" if created else
                      f"restore: configs: {target} exists; its configs are left as they are",
                      file=self.log, flush=True)
            if have < needed and not props.get("repartition"):
                raise RestoreError(
                    f"target topic {target!r} has {have} partition(s) but store topic {topic!r} "
                    f"has partitions up to {needed - 1}: create the target with at least "
                    f"{needed} partitions, or pass --repartition (repartition=true) to place "
                    "records by key with Kafka's default partitioner (murmur2)")
            ensure_topic(admin, consumer, progress_topic, 1, self.bootstrap,
                         config={"cleanup.policy": "compact"}, replication_factor=rf,
                         timeout=self.timeout)
            txn = False
            if "transactional.id" in conf:
                # first: a dead run's open transaction is aborted before progress is read
                self.producer, txn = self._init_transactions(self.producer, eos)
            kafka_maps: dict = {}
            kafka_p = read_kafka_progress(consumer, progress_topic, job, self.bootstrap,
                                          max(self.timeout, 30.0), kafka_maps)
        finally:
            consumer.close()
            del admin  # its threads are not needed any more
        self.stats.created_topic, self.stats.target_partitions = created, have
        self.stats.transactional = txn
        store_p = store_progress.read()
        last = newest(store_p, kafka_p)
        for p in (store_p, kafka_p):
            if p is not None and p.store_id != store_id and \
                    not props.get("restore.from.scratch"):
                raise RestoreError(f"progress of {job.key} was recorded for store {p.store_id}, "
                                   f"not {store_id}; restore with --from-scratch")
        if props.get("restore.from.scratch"):
            # a reset record first: a crash before the first chunk must not resume the old run
            progress = Progress.start(job, mode, last.seq if last else 0, as_of).advance(
                {}, 0, False, txn)
            self._send(None, progress, txn, progress_topic)
            store_progress.write(progress)
        elif last is not None:
            if last.mode != mode:
                raise RestoreError(f"{job.key} was restored with mode={last.mode}; rerun with "
                                   f"mode={last.mode}, or with --from-scratch to start over in "
                                   f"mode={mode}")
            if last.as_of_ms != as_of:
                from kcompact.compaction.history import format_time
                was = "the latest state" if last.as_of_ms is None else \
                    f"the state as of {format_time(last.as_of_ms)}"
                raise RestoreError(f"{job.key} was restored with {was}; rerun with the same "
                                   "--as-of, or with --from-scratch to start over")
            if self._group_plan is not None and not last.mapped:
                raise RestoreError(
                    f"{job.key} produced records without an offset map (by a kcompact before "
                    "it, or on confluent-kafka's producer without --groups), so group "
                    "positions cannot be translated: restore with --from-scratch --groups")
            progress = last
            self.stats.resumed = bool(last.positions)
            self.stats.previously_produced = last.produced
            if store_p is None or last.seq > store_p.seq:
                # the Kafka record is ahead: catch the store up (the chunks' offset maps too)
                behind = store_p.seq if store_p is not None else last.run_seq
                missing = [(k, v) for k, v in sorted(kafka_maps.items()) if v is not None
                           and behind < _map_seq(k) <= last.seq]
                store_progress.write(last, missing)
        else:
            progress = Progress.start(job, mode, 0, as_of)
        offsets = {source_partition_key({"partition": p}): {"position": n}
                   for p, n in progress.positions.items()}
        self.task.initialize(SourceTaskContext(offsets))
        self.task.start(dict(props, **{TARGET_TOPIC: target, TARGET_PARTITIONS: have,
                                       INCLUDE_TOMBSTONES: not created}))
        self.stats.total = self.task.total
        self.stats.planned = True
        for p, pp in self.task.plans.items():
            tp = TopicPartition(topic, p)
            self.metrics.high_watermark[tp] = pp.total
            self.metrics.position[tp] = 0
        reader = Prefetch(self.task.poll, self.stop_event)
        writer = LatestWriter(store_progress.write)
        failed = True
        try:
            while not self.stop_event.is_set():
                chunk = reader.get()
                if chunk is None:
                    break
                progress = progress.advance(chunk.positions, len(chunk), chunk.done, txn,
                                            mapped=self._map or len(chunk) == 0)
                maps = self._send(chunk, progress, txn, progress_topic,
                                  on_produced=None if chunk.done else reader.prepare)
                writer.submit(progress, maps)
                m = self.metrics
                m.records += len(chunk)
                m.bytes += chunk.nbytes
                self.stats.chunks += 1
                for p, n in chunk.taken.items():
                    m.position[TopicPartition(topic, p)] = n
            failed = False
        finally:
            reader.close()
            try:
                writer.close()  # waits for the last progress record to be durable in the store
            except BaseException:
                if not failed:
                    raise  # else the first failure is the one to report
        if self._interleaved:
            self._warn(f"records of another producer landed between this restore's records in "
                       f"{target} partition(s) {sorted(self._interleaved)}: a group position "
                       "inside such a chunk maps to the chunk's first record (at least once)")
        if self._group_plan is not None and not self.stop_event.is_set() and \
                self.task.finished():
            self._commit_groups(store_progress, kafka_maps, progress, target)
        if self._acl_plan is not None and not self.stop_event.is_set() and \
                self.task.finished():
            self._create_acls()

    def _schema_plan(self, st: Any, topic: str, as_of: int | None,
                     allow_inexact: bool) -> list | None:
        """The kept schemas the topic's records use, references first (None: the store keeps
        none for it, its records go as they are). RestoreError for an id the source registry
        did not know."""
        from kcompact.replication.schema_capture import kept_schemas
        kept = kept_schemas(st, as_of_ms=as_of, allow_inexact=allow_inexact)
        ts = kept.topics.get(topic)
        if ts is None:
            print(f"restore: schemas: the store keeps none for store topic {topic!r} (mirrored "
                  "without --schema-registry?): its records are restored as they are",
                  file=self.log, flush=True)
            return None
        if ts.missing:
            raise RestoreError(f"store topic {topic!r} has records naming schema id(s) "
                               f"{', '.join(map(str, sorted(ts.missing)))} that the source "
                               "registry did not know when they were mirrored: their schemas "
                               "are not kept, so they cannot be registered; nothing was "
                               "produced")
        try:
            return kept.closure(ts.ids)
        except KeyError as e:
            raise RestoreError(f"store topic {topic!r}: {e.args[0]}; nothing was produced"
                               ) from None

    def _create_acls(self) -> None:
        """``--acls``: the kept bindings of the restored topic created on the target
        (acls.py); a target that cannot take them is one warning."""
        from .acls import apply_acls
        plan = self._acl_plan
        if not plan.bindings:
            print(f"restore: ACLs: the store keeps no ACL binding for store topic "
                  f"{self.props['store.topic']!r}"
                  + ("" if plan.captured_ms else " (the mirror captured none: mirrored "
                     "with --no-acls, or from a source without an authorizer)"),
                  file=self.log, flush=True)
            return
        conf = {k: v for k, v in self.settings.conf.items() if k not in _PRODUCER_ONLY}
        self.stats.acls_created, self.stats.acls_present = apply_acls(
            plan, conf, self.bootstrap, self.timeout, self.log)

    def _commit_groups(self, store_progress: StoreProgress, kafka_maps: dict,
                       progress: Progress, target: str) -> None:
        """``--groups``: translate the kept positions through the job's offset map records
        and commit them (groups.py)."""
        from .groups import restore_groups
        raw = dict(kafka_maps)
        raw.update(store_progress.read_maps())
        conf = {k: v for k, v in self.settings.conf.items() if k not in _PRODUCER_ONLY}
        committed, skipped = restore_groups(
            self._group_plan, raw, progress, conf, target, self.bootstrap, self.timeout,
            self.log, self._warn, str(self.props.get("groups")))
        self.stats.groups_committed, self.stats.groups_skipped = committed, skipped

    def _send(self, chunk: Any, progress: Progress, txn: bool, progress_topic: str,
              on_produced: Callable[[], None] | None = None) -> list[tuple[bytes, bytes]]:
        """One chunk and its Kafka progress record: a transaction, or flushes. With the
        offset map (no repartition) the chunk's map records go before the progress record;
        they are returned for the store's copy. ``on_produced`` runs once the chunk is
        handed to librdkafka (before the flush)."""
        from confluent_kafka import KafkaException
        p = self.producer
        maps: list[tuple[bytes, bytes]] = []
        try:
            if txn:
                p.begin_transaction()
                self._in_txn = True
            if chunk is not None and len(chunk):
                if not txn:
                    self._wrote_target = True  # what a produce sends may land: it is kept
                self._produce(chunk)
                if on_produced is not None:
                    on_produced()
                left = p.flush(ACK_TIMEOUT_S)
                self._acked(left)
                if self._map:
                    pieces, interleaved = chunk_pieces(progress.job, progress.seq, chunk.topic,
                                                       chunk, self._delivered())
                    self._interleaved.update(interleaved)
                    maps = [(m.key.encode(), encode_piece(m)) for m in pieces]
                    for k, v in maps:
                        p.produce(progress_topic, v, k, 0)
            p.produce(progress_topic, encode_progress(progress), progress.job.encode(), 0)
            if txn:
                if chunk is not None and len(chunk):
                    self._wrote_target = True  # a commit that fails may still have landed
                p.commit_transaction(ACK_TIMEOUT_S)
                self._in_txn = False
            else:
                self._acked(p.flush(ACK_TIMEOUT_S))
            self._check_errors()
            if self._map:
                self._delivered()  # the progress and map records' own: not a chunk's
        except KafkaException as e:
            self._check_errors()
            raise kafka_failure("produce the restore" if not txn else
                                "commit the restore's transaction", e, self.bootstrap,
                                topic=progress.target_topic, timeout=ACK_TIMEOUT_S) from None
        return maps

    def _acked(self, left: int) -> None:
        self._check_errors()
        if left:
            raise RestoreError(f"{left} records were not acknowledged by Kafka at "
                               f"{self.bootstrap} within {ACK_TIMEOUT_S:.0f} s (broker down?); "
                               "run the same restore again to continue from the last recorded "
                               "progress")

    def _produce(self, chunk: Any) -> None:
        """The hot loop, on kcompact's own producer (framework/native_kafka.py): blocks go as
        columns (no Python object per record, headers straight from the store's encoding, the
        GIL released; a failed delivery reaches the delivery callback as with produce()). A
        block without columns (materialized): positional produce() calls, one block at a time,
        without the partition or headers column when the block has none."""
        p = self.producer
        produce, topic = p.produce, chunk.topic
        blocked = self._produce_blocked
        idmap = getattr(self, "_idmap", None)
        # every block first: an unknown id fails the chunk before any of it is produced
        remapped = None if idmap is None else self._remap(chunk, idmap)
        for i, b in enumerate(chunk.blocks):
            cols = b.ranges() if remapped is None else remapped[i]
            if cols is not None:
                parts = (None if b.partitions is None
                         else np.asarray(b.partitions, np.int32))
                keys, values, ts = cols
                p.produce_columns(topic, -1 if b.partition is None else b.partition, parts,
                                  keys, values, ts, b.hspans)
                continue
            b.materialize()
            if b.headers is None and b.partitions is None:  # the common case
                part = b.partition
                for k, v, ts in zip(b.keys, b.values, b.timestamps):
                    try:
                        produce(topic, v, k, part, None, None, ts)
                    except BufferError:
                        blocked(topic, v, k, part, ts, None)
                continue
            parts = repeat(b.partition) if b.partitions is None else b.partitions
            headers = repeat(None) if b.headers is None else b.headers
            for k, v, part, ts, h in zip(b.keys, b.values, parts, b.timestamps, headers):
                try:
                    produce(topic, v, k, part, None, None, ts, h)
                except BufferError:
                    blocked(topic, v, k, part, ts, h)
        p.poll(0)

    @staticmethod
    def _remap(chunk: Any, idmap: Any) -> list:
        """The chunk's keys and values with the target's schema ids (schema_sync.IdMap), from
        the store's bytes: per block its rewritten columns, or None for a materialized block
        (its lists rewritten in place)."""
        out: list = []
        for b in chunk.blocks:
            cols = b.ranges()
            if cols is not None:
                keys, values, ts = cols
                out.append((idmap.column(keys), idmap.column(values), ts))
            else:
                keys, values = idmap.values(b.keys), idmap.values(b.values)
                out.append(None)
                b.keys, b.values = keys, values
        return out

    def _produce_blocked(self, topic: str, v: Any, k: Any, part: int, ts: int, h: Any) -> None:
        """librdkafka's queue is full: serve delivery reports until the record fits."""
        p = self.producer
        while True:
            p.poll(0.01)
            try:
                p.produce(topic, v, k, part, None, None, ts, h)
                return
            except BufferError:
                continue


def _map_seq(key: bytes) -> int:
    """The seq of an offset map record's key (<job>@map/<seq>/<partition>/<piece>)."""
    try:
        return int(key.rsplit(b"@map/", 1)[1].split(b"/", 1)[0])
    except (IndexError, ValueError):
        return -1
