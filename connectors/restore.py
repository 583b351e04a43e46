"""Restore: the store source connector's runner, its progress records, and ``kcompact restore``.

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

import hashlib
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from itertools import repeat
from typing import Any, Callable, Mapping, TextIO

import numpy as np

from kcompact.reput import Store, StoreLockedError
from kcompact.reput.record import RecordBatch, key_digest

from .framework.api import SourceTaskContext, TopicPartition, source_partition_key
from .framework.config import parse_kv_pairs
from .errors import ConfigError, ConnectorsError
from .framework.kafka_columns import ColumnSender
from .store_source import (INCLUDE_TOMBSTONES, PROGRESS_TOPIC, TARGET_PARTITIONS, TARGET_TOPIC,
                           StoreSourceTask, open_store_topic, partition_count)
from .framework.kafka_clients import KafkaSettings, kafka_error_text, kafka_logger
from .framework.metrics import TaskMetrics
from .framework.worker import Worker

#: Version of the progress record's JSON (docs/formats/restore-progress.md).
PROGRESS_FORMAT_VERSION = 1
CONNECTOR_NAME = "kcompact-restore"
PROGRESS_INTERVAL = 1.0

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
_OWN_FLAGS = {"bootstrap.servers": "--bootstrap-servers", "metadata.broker.list":
              "--bootstrap-servers"}


class RestoreError(ConnectorsError):
    """A restore cannot go on; the message names the cause and what to do."""


class ProgressFormatError(RestoreError):
    """A progress record cannot be read: move on with ``--from-scratch`` (everything is
    produced again) after checking why it is damaged."""


# ---------------------------------------------------------------------------------------------
# the job and its progress record


@dataclass(frozen=True)
class RestoreJob:
    """What a restore is: a store topic into a topic of one Kafka cluster."""

    store_id: str
    store_topic: str
    cluster_id: str
    target_topic: str

    @property
    def key(self) -> str:
        """The progress records' key."""
        return f"{self.store_topic}->{self.cluster_id}/{self.target_topic}"

    @property
    def token(self) -> str:
        raw = f"{self.store_id}|{self.key}".encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    @property
    def transactional_id(self) -> str:
        return f"kcompact-restore-{self.token}"

    @property
    def writer(self) -> str:
        """The store writer id that appends this job's progress."""
        return f"restore-{self.token}"


@dataclass
class Progress:
    """One progress record (docs/formats/restore-progress.md)."""

    job: str
    store_id: str
    store_topic: str
    cluster_id: str
    target_topic: str
    mode: str
    seq: int
    positions: dict[int, int]
    produced: int = 0
    done: bool = False
    transactional: bool = False
    updated_ms: int = 0
    version: int = PROGRESS_FORMAT_VERSION

    @classmethod
    def start(cls, job: RestoreJob, mode: str, seq: int = 0) -> "Progress":
        return cls(job.key, job.store_id, job.store_topic, job.cluster_id, job.target_topic,
                   mode, seq, {})

    def advance(self, positions: Mapping[int, int], produced: int, done: bool,
                transactional: bool) -> "Progress":
        return Progress(self.job, self.store_id, self.store_topic, self.cluster_id,
                        self.target_topic, self.mode, self.seq + 1,
                        {int(p): int(o) for p, o in positions.items()}, self.produced + produced,
                        done, transactional, int(time.time() * 1000))


def encode_progress(p: Progress) -> bytes:
    d = asdict(p)
    d["positions"] = {str(k): int(v) for k, v in sorted(p.positions.items())}
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def decode_progress(raw: bytes | None, *, where: str) -> Progress:
    if raw is None:
        raise ProgressFormatError(f"{where}: the progress record is a tombstone")
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        version = int(d["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise ProgressFormatError(f"{where}: unreadable progress record ({e}); restore with "
                                  "--from-scratch to produce everything again") from None
    if version > PROGRESS_FORMAT_VERSION:
        raise ProgressFormatError(f"{where}: progress format {version} is newer than this "
                                  f"kcompact understands ({PROGRESS_FORMAT_VERSION}); upgrade")
    try:
        positions = {int(k): int(v) for k, v in d["positions"].items()}
        if any(p < 0 or o < 0 for p, o in positions.items()):
            raise ValueError("negative partition or position")
        p = Progress(str(d["job"]), str(d["store_id"]), str(d["store_topic"]),
                     str(d["cluster_id"]), str(d["target_topic"]), str(d["mode"]),
                     int(d["seq"]), positions, int(d.get("produced", 0)),
                     bool(d.get("done", False)), bool(d.get("transactional", False)),
                     int(d.get("updated_ms", 0)), version)
        if p.mode not in ("latest", "all") or p.seq < 0:
            raise ValueError(f"mode {p.mode!r}, seq {p.seq}")
        return p
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProgressFormatError(f"{where}: progress record has an invalid field ({e}); "
                                  "restore with --from-scratch to produce everything "
                                  "again") from None


def newest(*candidates: Progress | None) -> Progress | None:
    """The progress record with the highest sequence number (the store's on a tie)."""
    best = None
    for c in candidates:
        if c is not None and (best is None or c.seq > best.seq):
            best = c
    return best


# ---------------------------------------------------------------------------------------------
# progress in the store


class StoreProgress:
    """The job's progress records in the store's internal topic (partition 0)."""

    def __init__(self, url: str, job: RestoreJob, *, topic: str = PROGRESS_TOPIC,
                 commitlog_dir: str | None = None, lock_wait_s: float = STORE_LOCK_WAIT_S):
        self.url, self.job, self.topic = url, job, topic
        self.commitlog_dir, self.lock_wait_s = commitlog_dir, lock_wait_s
        self._writer: Store | None = None

    def read(self) -> Progress | None:
        with Store.open(self.url, commitlog_dir=self.commitlog_dir) as st:
            if self.topic not in st.topics() or 0 not in st.partitions(self.topic):
                return None
            pl = st.partition(self.topic, 0)
            lo, hi = key_digest(self.job.key.encode(), st.secret)
            last = -1
            for seg in pl.segments:
                e = pl.index(seg).entries
                if e.shape[0] == 0:
                    continue
                hit = (e["digest_lo"] == lo) & (e["digest_hi"] == hi)
                if hit.any():
                    last = max(last, int(e["offset"][hit][-1]))
            if last < 0:
                return None
            for rec in pl.iter_records(last, 1):
                if rec.key != self.job.key.encode() or rec.value is None:
                    return None  # a digest collision, or a reset by tombstone
                return decode_progress(rec.value, where=f"{self.url} {self.topic}-0@{rec.offset}")
            return None

    def open_writer(self) -> None:
        """Take the job's commit log (one run per job: a second one fails here, before it
        produces anything or fences the first's transactions)."""
        if self._writer is None:
            try:
                self._writer = Store.open(self.url, writer=self.job.writer,
                                          commitlog_dir=self.commitlog_dir)
            except StoreLockedError:
                raise RestoreError(f"another restore of {self.job.key} is running (its progress "
                                   f"writer {self.job.writer} in {self.url} is locked); stop "
                                   "it first") from None
            # opening re-dispatched what a killed run left in the commit log; let other
            # restores of this store write their progress meanwhile
            self._writer.release_partition(self.topic, 0)

    def write(self, p: Progress) -> None:
        """Append the record and make it durable (fsync), holding the partition only meanwhile
        so that restores of other topics can write their progress too."""
        self.open_writer()
        st = self._writer
        assert st is not None
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                pl = st.writable_partition(self.topic, 0)
                break
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise RestoreError(f"{self.url}: {self.topic}-0 stayed locked by another "
                                       f"process for {self.lock_wait_s:.0f} s; cannot record "
                                       "restore progress") from None
                time.sleep(0.05)
        try:
            batch = RecordBatch.from_records(self.topic, [
                (0, pl.next_offset, p.updated_ms or int(time.time() * 1000),
                 self.job.key.encode(), encode_progress(p))])
            st.append(batch)
            st.flush()
        finally:
            st.release_partition(self.topic, 0)

    def close(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.close()


# ---------------------------------------------------------------------------------------------
# Kafka: errors, topics, progress


_AUTH_CODES: set[int] = set()
_UNSUPPORTED_CODES: set[int] = set()


def _codes() -> None:
    from confluent_kafka import KafkaError as E
    if not _AUTH_CODES:
        _AUTH_CODES.update({E.TOPIC_AUTHORIZATION_FAILED, E.CLUSTER_AUTHORIZATION_FAILED,
                            E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                            E.GROUP_AUTHORIZATION_FAILED, E._AUTHENTICATION,
                            E.SASL_AUTHENTICATION_FAILED})
        _UNSUPPORTED_CODES.update({E._UNSUPPORTED_FEATURE, E.UNSUPPORTED_VERSION,
                                   E._NOT_IMPLEMENTED, E.UNSUPPORTED_FOR_MESSAGE_FORMAT,
                                   E.COORDINATOR_NOT_AVAILABLE, E._TIMED_OUT})


def _error_of(exc: BaseException) -> Any:
    err = exc.args[0] if getattr(exc, "args", None) else None
    return err if hasattr(err, "code") else None


def kafka_failure(what: str, exc: BaseException, bootstrap: str, *, topic: str | None = None,
                  timeout: float | None = None) -> RestoreError:
    """One line for a Kafka failure: authorization, an unreachable broker, or the error text."""
    from confluent_kafka import KafkaError as E
    _codes()
    err = _error_of(exc)
    code = err.code() if err is not None else None
    text = kafka_error_text(exc)
    if code in _AUTH_CODES:
        acl = {E.TOPIC_AUTHORIZATION_FAILED: f"DESCRIBE, CREATE and WRITE on topic {topic}"
               if topic else "the topic ACLs",
               E.CLUSTER_AUTHORIZATION_FAILED: "CREATE on the cluster (or create the topic "
               "yourself)",
               E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "WRITE and DESCRIBE on the "
               "transactional id (or restore with exactly.once.support=disabled)"}.get(
                   code, "valid credentials (-X sasl.* / ssl.*)")
        return RestoreError(f"not authorized to {what} on {bootstrap} ({text}); the principal "
                            f"needs {acl}")
    if code in (E._FENCED, E.PRODUCER_FENCED, E.INVALID_PRODUCER_EPOCH):
        return RestoreError(f"cannot {what} on {bootstrap}: another restore of the same job "
                            f"took over its transactional id ({text}); one run per job at a "
                            "time")
    if code in (E._TRANSPORT, E._ALL_BROKERS_DOWN, E._RESOLVE) or (
            code == E._TIMED_OUT and timeout is not None):
        wait = f" within {timeout:.0f} s" if timeout else ""
        return RestoreError(f"cannot reach Kafka at {bootstrap}{wait} to {what} ({text}); check "
                            "--bootstrap-servers and that the broker is up")
    return RestoreError(f"cannot {what} on {bootstrap}: {text}")


def _describe(consumer: Any, topic: str, bootstrap: str, timeout: float) -> int | None:
    """Partition count of a topic, None when it does not exist (a consumer metadata request,
    which never auto-creates the topic)."""
    from confluent_kafka import KafkaError, KafkaException
    try:
        md = consumer.list_topics(topic=topic, timeout=timeout)
    except KafkaException as e:
        raise kafka_failure(f"read the metadata of topic {topic!r}", e, bootstrap, topic=topic,
                            timeout=timeout) from None
    t = md.topics.get(topic)
    if t is None or (t.error is not None and t.error.code() in (
            KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)):
        return None
    if t.error is not None:
        from confluent_kafka import KafkaException as KE
        raise kafka_failure(f"describe topic {topic!r}", KE(t.error), bootstrap, topic=topic)
    return len(t.partitions)


def ensure_topic(admin: Any, consumer: Any, topic: str, partitions: int, bootstrap: str, *,
                 config: Mapping[str, str], replication_factor: int, timeout: float
                 ) -> tuple[int, bool]:
    """(partition count, created now): creates the topic when missing, and waits until the
    metadata shows every partition with a leader."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic
    have = _describe(consumer, topic, bootstrap, timeout)
    if have is not None:
        return have, False
    new = NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor,
                   config=dict(config))
    try:
        admin.create_topics([new], operation_timeout=timeout,
                            request_timeout=timeout)[topic].result()
    except KafkaException as e:
        err = _error_of(e)
        if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise kafka_failure(f"create topic {topic!r} ({partitions} partitions)", e,
                                bootstrap, topic=topic, timeout=timeout) from None
        created = False
    else:
        created = True
    deadline = time.monotonic() + timeout
    while True:
        md = consumer.list_topics(topic=topic, timeout=timeout).topics.get(topic)
        if md is not None and md.error is None and md.partitions and \
                all(p.leader >= 0 for p in md.partitions.values()):
            return len(md.partitions), created
        if time.monotonic() > deadline:
            raise RestoreError(f"topic {topic!r} was created on {bootstrap} but its partitions "
                               f"got no leader within {timeout:.0f} s; check the brokers")
        time.sleep(0.05)


#: Consumer settings of the metadata probe, which then reads the progress topic: offset 0 with
#: auto.offset.reset=earliest (a compacted topic may start later) rather than OFFSET_BEGINNING,
#: a short fetch wait, and a consumer that is connected already: ~0.01 s instead of ~1 s.
PROBE_CONSUMER_CONFIG = {"group.id": "kcompact-restore", "enable.auto.commit": False,
                         "enable.partition.eof": True, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10}


def read_kafka_progress(c: Any, topic: str, job: RestoreJob, bootstrap: str,
                        timeout: float) -> Progress | None:
    """The job's last committed progress record in the cluster's progress topic, read to its
    end with ``c`` (a consumer with PROBE_CONSUMER_CONFIG, read_committed: an open transaction
    of another job is waited for, up to ``timeout``)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka import TopicPartition as KTP
    key = job.key.encode()
    found: Progress | None = None
    try:
        c.assign([KTP(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise RestoreError(f"could not read {topic} on {bootstrap} to its end within "
                                   f"{timeout:.0f} s (a transaction left open by another "
                                   "restore?); try again")
            for m in c.consume(1000, 0.02):  # returns at 1000 messages or the timeout
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return found
                    raise kafka_failure(f"read {topic}", KafkaException(err), bootstrap,
                                        topic=topic)
                if m.key() == key:
                    found = None if m.value() is None else decode_progress(
                        m.value(), where=f"{bootstrap} {topic}-0@{m.offset()}")
    finally:
        c.unassign()


# ---------------------------------------------------------------------------------------------
# the runner


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


class RestoreRunner:
    """Runs one StoreSourceTask against Kafka (the worker's task-runner interface: ``start``,
    ``alive``, ``thread``, ``failure``, ``metrics``)."""

    def __init__(self, *, connector: Any, name: str, props: Mapping[str, Any],
                 settings: KafkaSettings, stop: threading.Event, startup_timeout: float,
                 log: TextIO):
        self.connector, self.name, self.props = connector, name, dict(props)
        self.settings, self.stop_event, self.log = settings, stop, log
        self.timeout = startup_timeout
        self.metrics = TaskMetrics(f"{name}-0")
        self.stats = RestoreStats()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"task-{name}-0", daemon=True)
        self.task: StoreSourceTask | None = None
        self.producer: Any = None
        #: the error_cb object the producers are configured with (ColumnSender checks it)
        self._error_cb = self._on_error
        self._dr_cb = self._on_delivery  # one object, carried by ColumnSender's records
        self._column_sender: tuple[Any, ColumnSender | None] | None = None
        self._delivery_errors: list[str] = []
        self._kafka_errors: list[Any] = []
        self._in_txn = False
        self._store_progress: StoreProgress | None = None

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

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
            self._shutdown(self._store_progress)

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
        self._column_sender = None

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
        conf.update({"delivery.report.only.error": True, "on_delivery": self._on_delivery,
                     "error_cb": self._error_cb, "logger": kafka_logger()})
        return conf

    def _new_producer(self, conf: Mapping[str, Any]) -> Any:
        from confluent_kafka import KafkaException, Producer
        try:
            return Producer(dict(conf))
        except KafkaException as e:
            raise self.settings.explain(e, "Kafka producer") from None

    def _init_transactions(self, p: Any, eos: str) -> tuple[Any, bool]:
        """``init_transactions`` (which aborts a dead run's open transaction), or, when the
        broker has no transactions and eos is "requested", the idempotent producer instead."""
        from confluent_kafka import KafkaException
        _codes()
        try:
            p.init_transactions(self.timeout)
            return p, True
        except KafkaException as e:
            err = _error_of(e)
            code = err.code() if err is not None else None
            if eos == "required":
                raise kafka_failure("start a transaction (exactly.once.support=required)", e,
                                    self.bootstrap, timeout=self.timeout) from None
            # "requested": no transaction coordinator, an old broker, or no ACL for the
            # transactional id -> the idempotent producer; anything else is an error
            if code not in _UNSUPPORTED_CODES and code not in _AUTH_CODES:
                raise kafka_failure("initialize the transactional producer", e,
                                    self.bootstrap, timeout=self.timeout) from None
            self._warn(f"transactions are not available on {self.bootstrap} "
                       f"({kafka_error_text(e)}): restoring with the idempotent producer, "
                       "at least once per chunk")
        self._kafka_errors.clear()
        conf = self._producer_conf()
        conf.pop("transactional.id", None)
        return self._new_producer(conf), False

    def _sender(self, producer: Any) -> ColumnSender | None:
        """The ColumnSender of ``producer`` (attached once per producer), or None."""
        if self._column_sender is None or self._column_sender[0] is not producer:
            self._column_sender = (producer, ColumnSender.attach(producer, self._error_cb,
                                                                 kafka_logger()))
        return self._column_sender[1]

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._delivery_errors.append(f"{msg.topic()}-{msg.partition()}: {err.str()}")

    def _on_error(self, err: Any) -> None:
        self._kafka_errors.append(err)

    def _check_errors(self) -> None:
        from confluent_kafka import KafkaException
        if self._delivery_errors:
            first = self._delivery_errors[0]
            hint = ""
            if "too large" in first.lower():
                hint = "; raise -X message.max.bytes (and the topic's max.message.bytes)"
            raise RestoreError(f"Kafka rejected {len(self._delivery_errors)} record(s): {first}"
                               f"{hint}; run the same restore again to continue from the last "
                               "recorded progress")
        fatal = [e for e in self._kafka_errors if e.fatal()]
        if fatal:
            raise kafka_failure("produce", KafkaException(fatal[0]), self.bootstrap)
        self._kafka_errors.clear()

    # -- the restore ---------------------------------------------------------------------------

    def _restore(self) -> None:
        props = self.props
        url, topic = props["store.url"], props["store.topic"]
        target = props.get("topic") or topic
        mode = props.get("mode") or "latest"
        eos = props.get("exactly.once.support") or "requested"
        progress_topic = props.get("progress.topic") or PROGRESS_TOPIC
        with open_store_topic(url, topic) as st:
            store_id = st.meta.store_id
            needed = partition_count(st, topic)
            policy = st.topic_config(topic).cleanup_policy
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
                                         config={"cleanup.policy": policy},
                                         replication_factor=rf, timeout=self.timeout)
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
            kafka_p = read_kafka_progress(consumer, progress_topic, job, self.bootstrap,
                                          max(self.timeout, 30.0))
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
            progress = Progress.start(job, mode, last.seq if last else 0).advance({}, 0, False,
                                                                                  txn)
            self._send(None, progress, txn, progress_topic)
            store_progress.write(progress)
        elif last is not None:
            if last.mode != mode:
                raise RestoreError(f"{job.key} was restored with mode={last.mode}; rerun with "
                                   f"mode={last.mode}, or with --from-scratch to start over in "
                                   f"mode={mode}")
            progress = last
            self.stats.resumed = bool(last.positions)
            self.stats.previously_produced = last.produced
            if store_p is None or last.seq > store_p.seq:
                store_progress.write(last)  # the Kafka record is ahead: catch the store up
        else:
            progress = Progress.start(job, mode)
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
        reader = _Prefetch(self.task.poll, self.stop_event)
        writer = _LatestWriter(store_progress.write)
        failed = True
        try:
            while not self.stop_event.is_set():
                chunk = reader.get()
                if chunk is None:
                    break
                progress = progress.advance(chunk.positions, len(chunk), chunk.done, txn)
                self._send(chunk, progress, txn, progress_topic,
                           on_produced=None if chunk.done else reader.prepare)
                writer.submit(progress)
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

    def _send(self, chunk: Any, progress: Progress, txn: bool, progress_topic: str,
              on_produced: Callable[[], None] | None = None) -> None:
        """One chunk and its Kafka progress record: a transaction, or flushes.
        ``on_produced`` runs once the chunk is handed to librdkafka (before the flush)."""
        from confluent_kafka import KafkaException
        p = self.producer
        try:
            if txn:
                p.begin_transaction()
                self._in_txn = True
            if chunk is not None and len(chunk):
                self._produce(chunk)
                if on_produced is not None:
                    on_produced()
                left = p.flush(ACK_TIMEOUT_S)
                self._acked(left)
            p.produce(progress_topic, encode_progress(progress), progress.job.encode(), 0)
            if txn:
                p.commit_transaction(ACK_TIMEOUT_S)
                self._in_txn = False
            else:
                self._acked(p.flush(ACK_TIMEOUT_S))
            self._check_errors()
        except KafkaException as e:
            self._check_errors()
            raise kafka_failure("produce the restore" if not txn else
                                "commit the restore's transaction", e, self.bootstrap,
                                topic=progress.target_topic, timeout=ACK_TIMEOUT_S) from None

    def _acked(self, left: int) -> None:
        self._check_errors()
        if left:
            raise RestoreError(f"{left} records were not acknowledged by Kafka at "
                               f"{self.bootstrap} within {ACK_TIMEOUT_S:.0f} s (broker down?); "
                               "run the same restore again to continue from the last recorded "
                               "progress")

    def _produce(self, chunk: Any) -> None:
        """The hot loop. Blocks go through the ColumnSender (connectors/framework/kafka_columns.py: no
        Python object per record, headers straight from the store's encoding; each record
        carries ``_on_delivery`` as produce() would, so a failed delivery is reported the same
        way, with or without a transaction). Without it (not built, or turned off): positional
        produce() calls (about 1.5x faster than keywords), one block at a time, without the
        partition or headers column when the block has none."""
        p = self.producer
        produce, topic = p.produce, chunk.topic
        blocked = self._produce_blocked
        sender = self._sender(p)
        for b in chunk.blocks:
            cols = b.ranges() if sender is not None else None
            if cols is not None:
                parts = (None if b.partitions is None
                         else np.asarray(b.partitions, np.int32))
                keys, values, ts = cols
                sender.produce(topic, -1 if b.partition is None else b.partition, parts,
                               keys, values, ts, self._dr_cb, b.hspans)
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


class _Prefetch:
    """Calls ``poll`` in a thread of its own while the producer thread waits in librdkafka
    (flush, commit: without the GIL): ``prepare()`` starts the next chunk, ``get()`` returns
    it (starting it first if nobody did). Reading ahead during the produce loop instead only
    made the two threads take turns with the GIL (measured: more CPU, no faster); the reading
    itself is mostly numba kernels and file reads, and the Python objects are built by the
    producer's thread (``RecordBlock.materialize``)."""

    def __init__(self, poll: Callable[[], Any], stop: threading.Event):
        self._poll, self._stop = poll, stop
        self._cond = threading.Condition()
        self._wanted = True
        self._busy = False
        self._ready: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="restore-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._wanted, self._busy = False, True
            try:
                item: Any = self._poll()
            except BaseException as e:  # noqa: BLE001 - raised by get()
                item = _Failed(e)
            with self._cond:
                self._ready.append(item)
                self._busy = False
                self._cond.notify_all()
            if item is None or isinstance(item, _Failed):
                return

    def prepare(self) -> None:
        with self._cond:
            if not self._ready and not self._busy:
                self._wanted = True
                self._cond.notify_all()

    def get(self) -> Any:
        """The next chunk; None at the end, or once stopped."""
        with self._cond:
            if not self._ready and not self._busy and self._thread.is_alive():
                self._wanted = True
                self._cond.notify_all()
            while not self._ready:
                if self._stop.is_set() or not self._thread.is_alive():
                    return None
                self._cond.wait(0.1)
            item = self._ready.pop(0)
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()


@dataclass
class _Failed:
    error: BaseException


class _LatestWriter:
    """Writes progress records in a thread of its own, keeping only the newest pending one:
    the store's fsyncs then overlap with the next chunk. The Kafka progress record, written
    with each chunk, is never behind the store's, so a restart loses nothing by it."""

    def __init__(self, write: Callable[[Progress], None]):
        self._write = write
        self._cond = threading.Condition()
        self._pending: Progress | None = None
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="restore-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
                if item is None:
                    return
            try:
                self._write(item)
            except BaseException as e:  # noqa: BLE001 - raised by submit()/close()
                self.error = e
                return

    def submit(self, p: Progress) -> None:
        if self.error is not None:
            raise self.error
        with self._cond:
            self._pending = p
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------------------------
# `kcompact restore`


def connector_props(store: str, topic: str, to_topic: str, *, mode: str = "latest",
                    repartition: bool = False, from_scratch: bool = False,
                    exactly_once: str = "requested",
                    kafka_config: Mapping[str, str] | None = None,
                    chunk_records: int | None = None) -> dict[str, Any]:
    props: dict[str, Any] = {
        "name": CONNECTOR_NAME,
        "connector.class": "StoreSourceConnector",
        "tasks.max": 1,
        "store.url": store,
        "store.topic": topic,
        "topic": to_topic,
        "mode": mode,
        "repartition": repartition,
        "restore.from.scratch": from_scratch,
        "exactly.once.support": exactly_once,
    }
    if chunk_records:
        props["restore.chunk.records"] = chunk_records
    for k, v in (kafka_config or {}).items():
        if k in _OWN_FLAGS:
            raise ConfigError(f"-X {k}: use {_OWN_FLAGS[k]} instead")
        props[f"producer.override.{k}"] = v
    return props


class ProgressBar:
    """A progress line on stderr: redrawn in place on a terminal, one line every few seconds
    otherwise."""

    def __init__(self, out: TextIO, interval: float = PROGRESS_INTERVAL, width: int = 24):
        self.out, self.interval, self.width = out, interval, width
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last = 0.0

    def line(self, done: int, total: int, elapsed: float) -> str:
        frac = done / total if total else 1.0
        fill = int(round(frac * self.width))
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 and total > done else 0.0
        return (f"restore: [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
                f"{done:,}/{total:,} records, {rate:,.0f} rec/s"
                + (f", ETA {eta:.0f} s" if rate > 0 and done < total else ""))

    def __call__(self, worker: Worker, *, final: bool = False) -> None:
        now = time.monotonic()
        every = self.interval if self.tty else max(self.interval, 2.0)
        if now - self.last < every and not final:
            return
        runners = [r for r in worker.runners if isinstance(r, RestoreRunner)]
        if not runners or not runners[0].stats.planned:
            return
        self.last = now
        r = runners[0]
        end = r.metrics.finished or now
        text = self.line(r.metrics.records, r.stats.total, end - r.metrics.started)
        if self.tty:
            self.out.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def finish(self, worker: Worker) -> None:
        """The bar in its final state (then the summary line follows)."""
        self(worker, final=True)


@dataclass
class RestoreResult:
    records: int
    seconds: float
    stats: RestoreStats
    stopped_by: str | None

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


def restore(bootstrap: str, store: str, topic: str, to_topic: str, *, mode: str = "latest",
            repartition: bool = False, from_scratch: bool = False,
            exactly_once: str = "requested", kafka_config: Mapping[str, str] | None = None,
            chunk_records: int | None = None, out: TextIO | None = None,
            handle_signals: bool = True, stop: threading.Event | None = None,
            startup_timeout_ms: int = 10_000) -> RestoreResult:
    """Run a restore in this process; returns when done or stopped, raises on failure."""
    out = out if out is not None else sys.stderr
    worker = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0,
                     "startup.timeout.ms": startup_timeout_ms}, where="restore", log=out)
    props = connector_props(store, topic, to_topic, mode=mode, repartition=repartition,
                            from_scratch=from_scratch, exactly_once=exactly_once,
                            kafka_config=kafka_config, chunk_records=chunk_records)
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        if not received:
            print(f"\nrestore: {signal.Signals(signum).name}: stopping after the current chunk",
                  file=out, flush=True)
        received.append(signum)
        worker.stop()

    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    bar = ProgressBar(out)
    try:
        runners = worker.add_connector(props, where="restore",
                                       producer_origin=lambda k: f"-X {k}")
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        t0 = time.monotonic()
        try:
            worker.run(on_tick=bar)
        finally:
            bar.finish(worker)
        dt = time.monotonic() - t0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    r: RestoreRunner = runners[0]
    sig = signal.Signals(received[0]).name if received else None
    res = RestoreResult(r.metrics.records, dt, r.stats, sig)
    s = r.stats
    how = f"stopped by {sig}" if sig else "done"
    guarantee = ("exactly once for read_committed consumers (transactions)" if s.transactional
                 else "at least once per chunk (idempotent producer)")
    resumed = (f", continued from recorded progress ({s.previously_produced:,} produced "
               "before)" if s.resumed else "")
    print(f"restore: {how}: {res.records:,} of {s.total:,} records produced to {to_topic} "
          f"({s.target_partitions} partitions{', created' if s.created_topic else ''}) in "
          f"{dt:.1f} s ({res.rate:,.0f} rec/s){resumed}; {guarantee}", file=out, flush=True)
    return res


def cmd_restore(args) -> int:
    """The ``kcompact restore`` command (connectors/cli.py)."""
    res = restore(args.bootstrap_servers, args.store, args.topic, args.to_topic,
                  mode=getattr(args, "mode", "latest"), repartition=args.repartition,
                  from_scratch=getattr(args, "from_scratch", False),
                  exactly_once=getattr(args, "exactly_once", "requested"),
                  chunk_records=getattr(args, "chunk_records", None),
                  kafka_config=parse_kv_pairs(args.kafka_config, flag="-X"))
    return 130 if res.stopped_by == "SIGINT" else 0


__all__ = ["DEFAULT_PRODUCER_CONFIG", "Progress", "ProgressFormatError", "RestoreError",
           "RestoreJob", "RestoreResult", "RestoreRunner", "StoreProgress", "cmd_restore",
           "connector_props", "decode_progress", "encode_progress", "kafka_failure", "newest",
           "read_kafka_progress", "restore"]
