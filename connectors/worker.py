"""The worker: runs connectors' tasks in threads, owning their Kafka clients, converters, error
handling and metrics (Kafka Connect's ``Worker``/``WorkerSinkTask``/``WorkerSourceTask``).

Sink tasks never join a consumer group: the worker lists each topic's partitions (with a
*consumer* metadata request, which never auto-creates a topic), lets the connector pick
(``select_partitions``), spreads them round-robin over the tasks and ``assign()``s them, starting
each where the task asked in ``open()`` (``context.offset``) - else at the group's committed
offset, else the earliest. A sink runs until stopped, or with ``follow=false`` until every
partition has reached the end it had when the task started (end-of-partition events, and the
high watermark of the first fetch response - never ListOffsets, which Tansu gets wrong).

Every ``offset.flush.interval.ms`` (and at the end) the worker calls ``pre_commit``; offsets it
returns are committed to the group (the store sink returns none).

Source tasks are polled; their records are converted, produced, and their source offsets kept
in ``offset.storage.file.filename`` after the producer has flushed (Connect standalone's
at-least-once).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, Mapping, Sequence, TextIO

import numpy as np

from kcompact.reput._gc import bulk_gc
from kcompact.reput._jit import native as _jit_native

from .api import OFFSET_BEGINNING as OFFSET_BEGINNING_REQUEST
from .api import (DataError, RetriableError, SinkConnector, SinkRecords, SinkTask,
                  SinkTaskContext, SourceConnector, SourceRecord, SourceTask, SourceTaskContext,
                  TaskFailedError, TopicPartition, source_partition_key)
from .config import (ConfigDef, Importance, Type, at_least, between, load_class, non_empty)
from .converters import Converter, make_converter
from .errors import ConfigError, ConnectorsError
from .errors_handling import (ERRORS_CONFIG, SKIPPED, DeadLetterQueue, ErrorContext,
                              ErrorHandler, Stage)
from .kafka_columns import Batch, ColumnReader, Event, PackedBytes, PackedHeaders, next_offsets

WORKER_CONFIG = (
    ConfigDef()
    .define("bootstrap.servers", Type.LIST, None, None, Importance.HIGH,
            "Kafka brokers, host:port comma-separated. Required.")
    .define("key.converter", Type.CLASS, "ByteArrayConverter", None, Importance.HIGH,
            "Default key converter of the connectors.")
    .define("value.converter", Type.CLASS, "ByteArrayConverter", None, Importance.HIGH,
            "Default value converter of the connectors.")
    .define("offset.flush.interval.ms", Type.LONG, 5_000, at_least(0), Importance.MEDIUM,
            "How often tasks flush (the store sink fsyncs its commit log and partitions) and "
            "offsets are committed; 0 = after every batch.")
    .define("offset.storage.file.filename", Type.STRING, "", None, Importance.MEDIUM,
            "File that keeps source connectors' offsets (required to run a source connector).")
    .define("plugin.path", Type.LIST, [], None, Importance.LOW,
            "Directories added to the Python path, where connector.class and converter "
            "modules are looked up.")
    .define("metrics.log.interval.ms", Type.LONG, 10_000, at_least(0), Importance.LOW,
            "How often each task's metrics (records, bytes, lag, errors) are printed on "
            "stderr; 0 = never.")
    .define("startup.timeout.ms", Type.LONG, 10_000, at_least(100), Importance.LOW,
            "How long to wait for the brokers' metadata at start before giving up.")
    .with_passthrough("consumer.", "producer.", "admin.", "key.converter.", "value.converter.")
)

CONNECTOR_CONFIG = (
    ConfigDef()
    .define("name", Type.STRING, None, non_empty, Importance.HIGH,
            "Unique connector name (also names its consumer group, connect-<name>). Required.")
    .define("connector.class", Type.CLASS, None, non_empty, Importance.HIGH,
            "StoreSinkConnector, StoreSourceConnector, LevelDBSinkConnector, or a dotted Python "
            "path to a Connector subclass. Required.")
    .define("tasks.max", Type.INT, 1, at_least(1), Importance.HIGH,
            "Maximum number of tasks (threads); a sink's partitions are spread over them.")
    .define("key.converter", Type.CLASS, None, None, Importance.LOW,
            "Overrides the worker's key.converter.")
    .define("value.converter", Type.CLASS, None, None, Importance.LOW,
            "Overrides the worker's value.converter.")
    .merge(ERRORS_CONFIG)
    .with_passthrough("key.converter.", "value.converter.", "consumer.override.",
                      "producer.override.", "admin.override.")
)

SINK_CONFIG = (
    ConfigDef()
    .define("topics", Type.LIST, None, None, Importance.HIGH,
            "Topics to read, comma-separated. Required for sink connectors.")
    .define("batch.max.records", Type.INT, 10_000, between(1, 1_000_000), Importance.LOW,
            "Most records handed to put() at once (consume(num_messages=...)).")
    .define("follow", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "true: keep reading new records until stopped (Connect's behaviour). false: each "
            "task stops once its partitions reach the end offsets they had when it started.")
)

#: Short names of the built-in connectors.
BUILTIN_CONNECTORS = {
    "StoreSinkConnector": "kcompact.connectors.store_sink.StoreSinkConnector",
    "StoreSourceConnector": "kcompact.connectors.store_source.StoreSourceConnector",
    "LevelDBSinkConnector": "kcompact.connectors.leveldb_connector.LevelDBSinkConnector",
}
#: The dotted names they had before kcompact installed under one import name: still accepted in
#: connector.class (properties files written for kcompact 0.1 keep working).
BUILTIN_CONNECTORS.update({
    "connectors.store_sink.StoreSinkConnector": BUILTIN_CONNECTORS["StoreSinkConnector"],
    "connectors.store_source.StoreSourceConnector": BUILTIN_CONNECTORS["StoreSourceConnector"],
    "connectors.leveldb_connector.LevelDBSinkConnector":
        BUILTIN_CONNECTORS["LevelDBSinkConnector"],
})

#: Consumer settings every sink task needs (the worker assigns partitions and commits itself).
_REQUIRED_CONSUMER = {"enable.auto.commit": "false", "enable.partition.eof": "true"}
_DEFAULT_CONSUMER = {
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
    "isolation.level": "read_committed",
    # Measured against Tansu and librdkafka 2.16: prefetching up to 1M messages per partition
    # (bounded by queued.max.messages.kbytes, 64 MiB) reads ~1.6x faster than the default.
    "queued.min.messages": 1_000_000,
    # When that queue is over its limits (a consumer slower than the broker, as any sink is),
    # librdkafka postpones the partition's next fetch by this much: 1000 ms by default, long
    # enough for the queue to run dry. Measured on a 2M-record mirror: 0.2-0.45 s spent waiting
    # for messages that were not fetched yet, gone at 10 ms (mirror 3.1-3.7 s -> 2.3-2.5 s).
    "fetch.queue.backoff.ms": 10,
}
_TS = itemgetter(1)
_NATIVE = _jit_native()


def kafka_logger() -> logging.Logger:
    """librdkafka's log, silent unless KCOMPACT_DEBUG is set (its lines are multi-line noise
    for a CLI; errors reach us through error_cb and are reported as one line)."""
    log = logging.getLogger("kcompact.librdkafka")
    if not log.handlers:
        log.propagate = False
        if os.environ.get("KCOMPACT_DEBUG") not in (None, "", "0"):
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("librdkafka: %(message)s"))
            log.addHandler(h)
            log.setLevel(logging.DEBUG)
        else:
            log.addHandler(logging.NullHandler())
            log.setLevel(logging.CRITICAL + 1)
    return log


def kafka_error_text(exc: BaseException) -> str:
    err = exc.args[0] if getattr(exc, "args", None) else None
    if hasattr(err, "str"):
        return f"{err.str()} ({err.name()})"
    return str(exc)


def list_partitions(consumer: Any, topics: list[str], bootstrap: str, timeout: float
                    ) -> dict[str, list[int]]:
    """Partitions of each topic, by a consumer metadata request (never auto-creates)."""
    from confluent_kafka import KafkaError, KafkaException
    out = {}
    for topic in topics:
        try:
            md = consumer.list_topics(topic=topic, timeout=timeout)
        except KafkaException as e:
            raise ConnectorsError(f"cannot reach Kafka at {bootstrap} within {timeout:.0f} s "
                                  f"({kafka_error_text(e)}); check the bootstrap servers and that "
                                  "the broker is up") from None
        t = md.topics.get(topic)
        if t is None or (t.error is not None and t.error.code() in (
                KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)):
            raise ConnectorsError(f"topic {topic!r} does not exist on {bootstrap}")
        if t.error is not None:
            raise ConnectorsError(f"topic {topic!r} on {bootstrap}: {t.error.str()}")
        out[topic] = sorted(t.partitions)
    return out


@dataclass
class TaskMetrics:
    """Per-task counters (read by progress printers from another thread)."""

    name: str
    records: int = 0            # records handed to put() / produced
    bytes: int = 0              # key + value bytes of those records
    errors: int = 0             # records that failed conversion (tolerated or not)
    skipped: int = 0            # records dropped under errors.tolerance=all
    dead_lettered: int = 0      # records written to the dead-letter topic
    retries: int = 0
    position: dict[TopicPartition, int] = field(default_factory=dict)
    high_watermark: dict[TopicPartition, int] = field(default_factory=dict)
    done: set = field(default_factory=set)  # partitions that reached their end (bounded runs)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def lag(self) -> dict[TopicPartition, int]:
        out = {}
        for tp, hw in self.high_watermark.items():
            pos = self.position.get(tp)
            if hw >= 0 and pos is not None and pos >= 0:
                out[tp] = max(0, hw - pos)
        return out

    def summary(self) -> str:
        lag = self.lag()
        dt = max((self.finished or time.monotonic()) - self.started, 1e-9)
        return (f"{self.name}: {self.records} records ({self.records / dt:,.0f}/s, "
                f"{self.bytes / dt / 1e6:.1f} MB/s), lag {sum(lag.values())}, errors "
                f"{self.errors} (skipped {self.skipped}, dead-lettered {self.dead_lettered})")


# ---------------------------------------------------------------------------------------------
# connectors: validation and instantiation


def connector_class(name: str) -> type:
    path = BUILTIN_CONNECTORS.get(name.strip(), name)
    cls = load_class(path, key="connector.class", kind="connector",
                     known=[k for k in BUILTIN_CONNECTORS if "." not in k])
    from .api import Connector
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ConfigError(f"connector.class: {name!r} is not a kcompact Connector subclass")
    return cls


def connector_definition(cls: type) -> ConfigDef:
    base = CONNECTOR_CONFIG.merge(SINK_CONFIG) if issubclass(cls, SinkConnector) \
        else CONNECTOR_CONFIG
    return base.merge(cls.config())


def validate_connector(props: Mapping[str, Any], *, where: str) -> tuple[type, dict[str, Any]]:
    """Resolve connector.class and validate every property against its definition."""
    if not props.get("connector.class"):
        raise ConfigError(f"{where}: missing required property 'connector.class' (e.g. "
                          "StoreSinkConnector)")
    cls = connector_class(str(props["connector.class"]))
    values = connector_definition(cls).parse(props, where=where)
    if issubclass(cls, SinkConnector) and not values.get("topics"):
        raise ConfigError(f"{where}: missing required property 'topics' (comma-separated)")
    return cls, values


class KafkaSettings:
    """Compose librdkafka settings from defaults, the worker's ``consumer.``/``producer.`` keys
    and the connector's ``*.override.`` keys, remembering where each user value came from so an
    error can name the key as the user wrote it."""

    def __init__(self, base: Mapping[str, Any]):
        self.conf: dict[str, Any] = dict(base)
        self.origin: dict[str, str] = {}

    def update(self, values: Mapping[str, Any], origin: Callable[[str], str]) -> None:
        for k, v in values.items():
            self.conf[k] = v
            self.origin[k] = origin(k)

    def require(self, required: Mapping[str, str], who: str) -> None:
        for k, want in required.items():
            got = self.conf.get(k)
            if k in self.origin and str(got).strip().lower() != str(want).lower():
                raise ConfigError(f"{self.origin[k]}={got}: {who} needs {k}={want}")
            self.conf[k] = want

    def explain(self, exc: BaseException, client: str) -> ConfigError:
        text = kafka_error_text(exc)
        for k, where in self.origin.items():
            if f'"{k}"' in text or f" {k} " in text or text.endswith(k):
                return ConfigError(f"{where}={self.conf[k]}: invalid {client} setting: {text}")
        return ConfigError(f"invalid {client} settings: {text}")


# ---------------------------------------------------------------------------------------------
# sink tasks


class SinkTaskRunner:
    """One sink task: its consumer, converters, error handler and loop (a thread)."""

    def __init__(self, *, connector: str, task_id: int, task: SinkTask, props: dict[str, Any],
                 assignment: list[TopicPartition], consumer_conf: dict[str, Any],
                 key_converter: Converter, value_converter: Converter, errors: ErrorHandler,
                 follow: bool, batch_max: int, flush_interval_ms: int, stop: threading.Event,
                 startup_timeout: float, settings: KafkaSettings):
        self.connector, self.task_id, self.task, self.props = connector, task_id, task, props
        self.assignment, self.consumer_conf = assignment, consumer_conf
        self.key_conv, self.value_conv, self.errors = key_converter, value_converter, errors
        self.follow, self.batch_max, self.flush_interval = follow, batch_max, flush_interval_ms
        self.stop_event, self.startup_timeout, self.settings = stop, startup_timeout, settings
        self.metrics = TaskMetrics(f"{connector}-{task_id}")
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"task-{connector}-{task_id}",
                                       daemon=True)
        self.consumer: Any = None
        #: the consumer's batches as columns (connectors/kafka_columns.py), when available
        self.reader: ColumnReader | None = None
        self._end_at_start: dict[TopicPartition, int] = {}
        self._unverified: dict[TopicPartition, tuple[float, int, int]] = {}
        self._last_warning = 0.0
        self._kafka_errors: list[Any] = []

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    # -- lifecycle -----------------------------------------------------------------------------

    def _run(self) -> None:
        started = False
        try:
            ctx = SinkTaskContext(self.assignment)
            self.task.initialize(ctx)
            self.task.start(self.props)
            started = True
            self.task.open(self.assignment)
            self._open_consumer(ctx.requested_offsets)
            self._loop(ctx)
            self._commit()
        except BaseException as e:  # noqa: BLE001 - reported by the worker
            self.failure = e
        finally:
            self.metrics.finished = time.monotonic()
            self._shutdown(started)

    def _shutdown(self, started: bool) -> None:
        for step in (lambda: self.errors.flush_dlq(),
                     lambda: self.task.close(self.assignment) if started else None,
                     lambda: self.task.stop() if started else None,
                     self._close_reader,
                     lambda: self.consumer.close() if self.consumer is not None else None,
                     lambda: self.errors.dlq.producer.flush(10) if self.errors.dlq else None,
                     self._release_clients):
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - keep the first failure
                if self.failure is None:
                    self.failure = e

    def _release_clients(self) -> None:
        """Drop librdkafka clients now (not at garbage collection, which may be never for a
        reference cycle), so no client keeps reconnecting after the task ended."""
        self._close_reader()
        self.consumer = None
        if self.errors.dlq is not None:
            self.errors.dlq.producer = None

    def _close_reader(self) -> None:
        # before the consumer's close(): the reader holds a reference to its queue
        if self.reader is not None:
            reader, self.reader = self.reader, None
            reader.close()

    def _on_kafka_error(self, err: Any) -> None:
        self._kafka_errors.append(err)

    def _open_consumer(self, requested: Mapping[TopicPartition, int]) -> None:
        from confluent_kafka import OFFSET_STORED, Consumer, KafkaException
        from confluent_kafka import TopicPartition as KTP
        error_cb, logger = self._on_kafka_error, kafka_logger()
        conf = dict(self.consumer_conf, error_cb=error_cb, logger=logger)
        try:
            self.consumer = Consumer(conf)
        except KafkaException as e:
            raise self.settings.explain(e, "Kafka consumer") from None
        self.reader = ColumnReader.attach(self.consumer, error_cb, logger)
        parts = []
        deadline = time.monotonic() + self.startup_timeout
        for tp in self.assignment:
            off = requested.get(tp)
            if off is None:
                off = OFFSET_STORED
            else:
                try:
                    lo, hi = self.consumer.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                                 timeout=self.startup_timeout)
                except KafkaException as e:
                    raise ConnectorsError(f"{tp}: cannot read the partition's offsets: "
                                          f"{kafka_error_text(e)}") from None
                if off == OFFSET_BEGINNING_REQUEST:
                    # The low watermark is right on every broker (Tansu included), and asking
                    # for it here is ~0.5 s faster than librdkafka's OFFSET_BEGINNING lookup.
                    off = lo
                elif off > hi:
                    # Tansu's uncached high watermark can be low (BROKER_NOTES.md): a start past
                    # it is only suspicious, verified by the partition's first message or EOF.
                    self._unverified[tp] = (deadline + self.startup_timeout, off, hi)
            self.metrics.position[tp] = off if off >= 0 else -1
            parts.append(KTP(tp.topic, tp.partition, off))
        self.consumer.assign(parts)

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self, ctx: SinkTaskContext) -> None:
        # consume() stays on this thread: with confluent-kafka 2.16, pause() or
        # get_watermark_offsets() from one thread while another is inside consume() deadlocks
        # (measured), and a separate fetch thread gained nothing measurable under the GIL.
        # The store sink overlaps its writes with consume() in a thread of its own instead.
        from confluent_kafka import Message
        consume, batch = self.consumer.consume, self.batch_max
        error_of = Message.error
        reader = self.reader
        last_flush = time.monotonic()
        last_lag = 0.0
        pending = set() if self.follow else set(self.assignment)
        while not self.stop_event.is_set():
            if not self.follow and not pending:
                break
            if ctx.stop_requested:
                break
            if reader is not None:
                # columns straight from librdkafka (connectors/kafka_columns.py)
                cols = reader.consume(self._wanted(pending, batch), 0.2)
                if self._kafka_errors:
                    self._check_kafka_errors()
                if cols.events:
                    self._events(cols.events, pending)
                if len(cols):
                    self._process_columns(cols)
            else:
                msgs = consume(self._wanted(pending, batch), 0.2)
                if self._kafka_errors:
                    self._check_kafka_errors()
                # with the compiled pass, a batch without error events (the usual case) is
                # read in one go; one with events (end of partition ...) is split first
                if msgs and (_NATIVE is None or not self._process(msgs)):
                    errs = list(map(error_of, msgs))
                    if any(errs):
                        msgs = self._message_events(msgs, errs, pending)
                    if msgs:
                        self._process(msgs)
            now = time.monotonic()
            if self._unverified:
                self._verify_starts(now)
            if now - last_lag >= 1.0 or (not self.follow and len(pending) < 64):
                self._watermarks(pending)
                last_lag = now
            if now - last_flush >= self.flush_interval / 1000:
                self._commit()
                last_flush = now

    def _wanted(self, pending: set, batch: int) -> int:
        """How many messages to ask consume() for: ``batch``, or fewer at the end of a bounded
        run. consume() returns when it has that many or when its timeout expires, so asking
        for the whole batch when fewer records are left would wait the full timeout before
        the last of them is stored (0.2 s at the end of every run). Once every pending
        partition's end is known, ask for what is left; offset gaps (transaction markers, a
        compacted source) make that an upper bound, where the timeout still ends the wait."""
        if self.follow or not pending:
            return batch
        left = 0
        ends, pos = self._end_at_start, self.metrics.position
        for tp in pending:
            end = ends.get(tp)
            at = pos.get(tp, -1)
            if end is None or at < 0:
                return batch
            left += max(0, end - at)
            if left >= batch:
                return batch
        return left if left > 0 else batch

    def _message_events(self, msgs: list, errs: list, pending: set) -> list:
        """Handle the error messages among ``msgs`` (consume()'s path); the others, in order."""
        good, events = [], []
        for m, e in zip(msgs, errs):
            if e is None:
                good.append(m)
            else:
                events.append(Event(m.topic(), m.partition(), m.offset(), e.code(), e.str(),
                                    e.fatal()))
        self._events(events, pending)
        return good

    def _events(self, events: list[Event], pending: set) -> None:
        from confluent_kafka import KafkaError
        for ev in events:
            code = ev.code
            tp = TopicPartition(ev.topic or "", ev.partition)
            if code == KafkaError._PARTITION_EOF:
                self._unverified.pop(tp, None)
                if ev.offset > self.metrics.position.get(tp, -1):
                    self.metrics.position[tp] = ev.offset
                if tp in pending:
                    self._partition_done(tp, pending)
            elif code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                raise ConnectorsError(
                    f"{tp}: offset {self.metrics.position.get(tp)} is not in the topic any more "
                    f"({ev.reason}): records were deleted (retention) before they were mirrored, "
                    "or the topic was recreated. Mirror into a new store, or accept the gap with "
                    "auto.offset.reset=earliest (-X / consumer.override.)")
            elif ev.fatal or code in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                      KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                      KafkaError.GROUP_AUTHORIZATION_FAILED):
                raise ConnectorsError(f"{tp}: {ev.reason} ({KafkaError(code).name()})")
            else:
                self._warn(f"{tp}: {ev.reason}")

    def _partition_done(self, tp: TopicPartition, pending: set) -> None:
        from confluent_kafka import TopicPartition as KTP
        pending.discard(tp)
        self.metrics.done.add(tp)
        try:
            self.consumer.pause([KTP(tp.topic, tp.partition)])
        except Exception:  # noqa: BLE001 - pausing only saves work
            pass
        self.task.partition_done(tp)

    def _watermarks(self, pending: set) -> None:
        """Cached high watermarks (from fetch responses, right on Tansu): lag, and the end of
        a bounded run when a partition's producer never lets it reach EOF."""
        from confluent_kafka import TopicPartition as KTP
        get = self.consumer.get_watermark_offsets
        for tp in self.assignment:
            try:
                _, hi = get(KTP(tp.topic, tp.partition), cached=True)
            except Exception:  # noqa: BLE001 - nothing fetched yet
                continue
            if hi is None or hi < 0:
                continue
            self.metrics.high_watermark[tp] = hi
            if tp in pending:
                end = self._end_at_start.setdefault(tp, hi)
                if self.metrics.position.get(tp, -1) >= end:
                    self._partition_done(tp, pending)

    def _verify_starts(self, now: float) -> None:
        for tp, (deadline, off, hi) in list(self._unverified.items()):
            if now > deadline:
                raise ConnectorsError(
                    f"{tp}: nothing to read from offset {off} (the store's next offset) and no "
                    f"end-of-partition within {self.startup_timeout * 2:.0f} s; the partition "
                    f"seems to end at {hi}: was the topic deleted and recreated? Mirror into a "
                    "new store")

    def _check_kafka_errors(self) -> None:
        from confluent_kafka import KafkaError
        errs, self._kafka_errors = self._kafka_errors, []
        for err in errs:
            if err.fatal():
                raise ConnectorsError(f"Kafka client failed: {err.str()} ({err.name()})")
            if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT,
                              KafkaError._RESOLVE, KafkaError._AUTHENTICATION):
                self._warn(f"{err.str()}; retrying")

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10:
            self._last_warning = now
            print(f"kcompact: warning: {self.metrics.name}: {msg}", file=sys.stderr, flush=True)

    def _process(self, msgs: list) -> bool:
        """Hand a batch to the task; False (nothing done) when the compiled pass finds an error
        event among the messages: the caller splits them out first."""
        from confluent_kafka import Message
        n = len(msgs)
        packed = None
        if _NATIVE is not None:
            # one compiled pass: numeric columns, key/value/header lists, packed key/value
            # columns for a columnar sink (reput/_native.c, message_columns)
            parts, offs, ts = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
            cols = _NATIVE.message_columns(msgs, parts, offs, ts)
            if cols is None:
                return False
            (raw_keys, raw_values, headers, *packed) = cols
            if headers is None:
                headers = [None] * n
        else:
            # One pass per column, straight into numpy where the column is numeric.
            parts = np.fromiter(map(Message.partition, msgs), np.int32, n)
            offs = np.fromiter(map(Message.offset, msgs), np.int64, n)
            ts = np.fromiter(map(_TS, map(Message.timestamp, msgs)), np.int64, n)
            raw_keys = list(map(Message.key, msgs))
            raw_values = list(map(Message.value, msgs))
            headers = list(map(Message.headers, msgs))
        topics_assigned = {tp.topic for tp in self.assignment}
        single = len(topics_assigned) == 1
        if single:
            topics = [next(iter(topics_assigned))] * n
        else:
            topics = list(map(Message.topic, msgs))
        self._deliver(topics, single, parts, offs, ts, raw_keys, raw_values, headers,
                      tuple(packed) if packed else None, None)
        return True

    def _process_columns(self, cols: Batch) -> None:
        """Hand a batch read as columns (ColumnReader) to the task."""
        n = len(cols)
        single = cols.topic_index is None
        topics = cols.topic_column()
        kb, ko, kn, vb, vo, vn = cols.packed
        if self.key_conv.identity and self.value_conv.identity:
            # bytes objects only if the task reads them (a columnar sink reads ``packed``)
            raw_keys: Sequence = PackedBytes(kb, ko, kn)
            raw_values: Sequence = PackedBytes(vb, vo, vn)
            headers: Sequence = ([None] * n if cols.headers is None
                                 else PackedHeaders(*cols.headers))
        else:
            unpack = PackedBytes.unpacked
            raw_keys, raw_values = unpack(kb, ko, kn), unpack(vb, vo, vn)
            headers = ([None] * n if cols.headers is None
                       else list(PackedHeaders(*cols.headers)))
        self._deliver(topics, single, cols.partitions, cols.offsets, cols.timestamps, raw_keys,
                      raw_values, headers, cols.packed, cols.headers)

    def _deliver(self, topics: list, single: bool, parts: np.ndarray, offs: np.ndarray,
                 ts: np.ndarray, raw_keys: Sequence, raw_values: Sequence, headers: Sequence,
                 packed: tuple | None, packed_headers: tuple | None) -> None:
        n = len(offs)
        if self._unverified:
            for tp in {TopicPartition(t, int(p)) for t, p in zip(topics, parts)}:
                self._unverified.pop(tp, None)

        if self.key_conv.identity and self.value_conv.identity:
            records = SinkRecords(topics, parts, offs, ts, raw_keys, raw_values, headers)
            records.packed, records.packed_headers = packed, packed_headers
        else:
            records = self._convert(topics, parts, offs, ts, raw_keys, raw_values, headers)
        self._put(records)
        m = self.metrics
        m.records += len(records)
        if records.nbytes is None:  # the task may have counted them while writing
            records.nbytes = (sum(map(len, filter(None, records.raw_keys)))
                              + sum(map(len, filter(None, records.raw_values))))
        m.bytes += records.nbytes
        m.errors, m.skipped, m.retries = self.errors.errors, self.errors.skipped, self.errors.retries
        if self.errors.dlq is not None:
            m.dead_lettered = self.errors.dlq.produced
        # Position = last offset + 1 per partition (offsets increase within a partition).
        if single:
            t = topics[0]
            for p, nxt in next_offsets(parts, offs).items():
                m.position[TopicPartition(t, p)] = nxt
        else:
            for t, p, o in zip(topics, parts.tolist(), offs.tolist()):
                m.position[TopicPartition(t, p)] = o + 1

    def _convert(self, topics, parts, offs, ts, raw_keys, raw_values, headers) -> SinkRecords:
        single = topics[0] == topics[-1] and topics.count(topics[0]) == len(topics)
        if single:
            try:
                keys = self.key_conv.to_connect_many(topics[0], raw_keys)
                values = self.value_conv.to_connect_many(topics[0], raw_values)
                return SinkRecords(topics, parts, offs, ts, keys, values, headers,
                                   raw_keys, raw_values)
            except (DataError, RetriableError):
                pass  # go record by record to retry / tolerate / attribute the failure
        keep: list[int] = []
        keys, values = [], []
        kc, vc = self.key_conv, self.value_conv

        def pick(col: list) -> list:
            return [col[i] for i in keep]

        def kept() -> SinkRecords:
            if len(keep) == len(offs):
                return SinkRecords(topics, parts, offs, ts, keys, values, headers, raw_keys,
                                   raw_values)
            return SinkRecords(pick(topics), pick(parts), pick(offs), pick(ts), keys, values,
                               pick(headers), pick(raw_keys), pick(raw_values))
        try:
            for i in range(len(offs)):
                base = (topics[i], parts[i], offs[i], ts[i], raw_keys[i], raw_values[i],
                        headers[i])
                k = self.errors.execute(
                    lambda: kc.to_connect(base[0], base[4]),
                    ErrorContext(*base, Stage.KEY_CONVERTER, _qualname(type(kc))))
                if k is SKIPPED:
                    continue
                v = self.errors.execute(
                    lambda: vc.to_connect(base[0], base[5]),
                    ErrorContext(*base, Stage.VALUE_CONVERTER, _qualname(type(vc))))
                if v is SKIPPED:
                    continue
                keep.append(i)
                keys.append(k)
                values.append(v)
        except (DataError, RetriableError):
            # The task stops at this record: keep what came before it (a restart resumes
            # exactly at the record that failed).
            self.errors.flush_dlq()
            self._put(kept())
            raise
        # A skipped record must be in the dead-letter topic before anything after it can be
        # stored (and flushed): otherwise a crash could leave it in neither.
        self.errors.flush_dlq()
        return kept()

    def _put(self, records: SinkRecords) -> None:
        if not len(records):
            return
        delay = 0.3
        start = time.monotonic()
        timeout_ms = self.errors.retry_timeout_ms
        while True:
            try:
                self.task.put(records)
                return
            except RetriableError as e:
                spent = (time.monotonic() - start) * 1000
                if (timeout_ms >= 0 and spent + delay * 1000 > timeout_ms) or \
                        self.stop_event.is_set():
                    raise
                self._warn(f"put failed ({e}); retrying")
                time.sleep(delay)
                delay = min(delay * 2, self.errors.max_delay_ms / 1000)

    def _commit(self) -> None:
        from confluent_kafka import TopicPartition as KTP
        self.errors.flush_dlq()
        positions = {tp: off for tp, off in self.metrics.position.items() if off >= 0}
        offsets = self.task.pre_commit(positions)
        if offsets:
            self.consumer.commit(offsets=[KTP(tp.topic, tp.partition, off)
                                          for tp, off in offsets.items()], asynchronous=False)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------
# source tasks


class FileOffsetStore:
    """Source offsets in a JSON file, replaced atomically (Connect's FileOffsetBackingStore)."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict[str, dict[str, Any]] = {}
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            self.data = {k: v for k, v in doc.get("offsets", {}).items()}
        except FileNotFoundError:
            pass
        except (ValueError, AttributeError) as e:
            raise ConnectorsError(f"{path}: unreadable source offsets file ({e}); move it away "
                                  "to start the source connectors from scratch") from None

    def for_connector(self, name: str) -> dict[str, Any]:
        return dict(self.data.get(name, {}))

    def save(self, name: str, offsets: Mapping[str, Any]) -> None:
        self.data[name] = dict(offsets)
        d = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".offsets-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": 1, "offsets": self.data}, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class SourceTaskRunner:
    """One source task: poll, convert, produce, and keep source offsets once Kafka has them."""

    def __init__(self, *, connector: str, task_id: int, task: SourceTask, props: dict[str, Any],
                 producer_conf: dict[str, Any], key_converter: Converter,
                 value_converter: Converter, errors: ErrorHandler, offsets: FileOffsetStore,
                 flush_interval_ms: int, stop: threading.Event, settings: KafkaSettings):
        self.connector, self.task_id, self.task, self.props = connector, task_id, task, props
        self.producer_conf, self.offsets = producer_conf, offsets
        self.key_conv, self.value_conv, self.errors = key_converter, value_converter, errors
        self.flush_interval, self.stop_event, self.settings = flush_interval_ms, stop, settings
        self.metrics = TaskMetrics(f"{connector}-{task_id}")
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"task-{connector}-{task_id}",
                                       daemon=True)
        self._delivery_errors: list[str] = []
        self._pending: list[tuple[SourceRecord, Any]] = []
        self._key = f"{connector}"

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        from confluent_kafka import KafkaException, Producer
        producer = None
        started = False
        try:
            try:
                producer = Producer(dict(self.producer_conf, logger=kafka_logger()))
            except KafkaException as e:
                raise self.settings.explain(e, "Kafka producer") from None
            self.producer = producer
            stored = self.offsets.for_connector(self._key)
            self.task.initialize(SourceTaskContext(stored))
            self.task.start(self.props)
            started = True
            committed = dict(stored)
            last_flush = time.monotonic()
            while not self.stop_event.is_set():
                records = self.task.poll()
                if records:
                    for r in records:
                        self._send(producer, r)
                elif self.task.finished():
                    break
                else:
                    producer.poll(0.05)
                if time.monotonic() - last_flush >= self.flush_interval / 1000:
                    self._flush(producer, committed)
                    last_flush = time.monotonic()
            self._flush(producer, committed)
        except BaseException as e:  # noqa: BLE001
            self.failure = e
        finally:
            self.metrics.finished = time.monotonic()
            if started:
                try:
                    self.task.stop()
                except BaseException as e:  # noqa: BLE001
                    self.failure = self.failure or e
            if producer is not None:
                producer.flush(10)
            self.producer = None  # let librdkafka's client go now, not at garbage collection

    def _send(self, producer: Any, r: SourceRecord) -> None:
        def ctx(stage: Stage, cls: type) -> ErrorContext:
            return ErrorContext(r.topic, r.partition, r.offset, r.timestamp, None, None,
                                list(r.headers), stage, _qualname(cls))
        key = self.errors.execute(lambda: self.key_conv.from_connect(r.topic, r.key),
                                  ctx(Stage.KEY_CONVERTER, type(self.key_conv)))
        value = SKIPPED if key is SKIPPED else self.errors.execute(
            lambda: self.value_conv.from_connect(r.topic, r.value),
            ctx(Stage.VALUE_CONVERTER, type(self.value_conv)))
        if value is SKIPPED:
            self.task.commit_record(r, None)
            if r.source_partition is not None:
                self._pending.append((r, None))
            return
        kwargs: dict[str, Any] = {}
        if r.partition is not None:
            kwargs["partition"] = r.partition
        if r.timestamp is not None and r.timestamp > 0:
            kwargs["timestamp"] = r.timestamp
        if r.headers:
            kwargs["headers"] = list(r.headers)

        def delivered(err, msg, r=r) -> None:
            if err is not None:
                self._delivery_errors.append(f"{r.topic}: {err.str()}")
                return
            self.metrics.records += 1
            self.metrics.bytes += len(msg.key() or b"") + len(msg.value() or b"")
            self.task.commit_record(r, (msg.partition(), msg.offset()))
        while True:
            try:
                producer.produce(r.topic, key=key, value=value, on_delivery=delivered, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
        if r.source_partition is not None:
            self._pending.append((r, None))
        producer.poll(0)

    def _flush(self, producer: Any, committed: dict[str, Any]) -> None:
        left = producer.flush(30)
        if self._delivery_errors:
            raise ConnectorsError(f"could not produce to Kafka: {self._delivery_errors[0]} "
                                  f"({len(self._delivery_errors)} records)")
        if left:
            raise ConnectorsError(f"{left} records were not acknowledged by Kafka within 30 s")
        self.errors.flush_dlq()
        if self._pending:
            for r, _ in self._pending:
                committed[source_partition_key(r.source_partition)] = dict(r.source_offset or {})
            self._pending.clear()
            self.offsets.save(self._key, committed)
        self.task.commit()
        m = self.metrics
        m.errors, m.skipped, m.retries = self.errors.errors, self.errors.skipped, self.errors.retries


# ---------------------------------------------------------------------------------------------
# the worker


class Worker:
    """Runs connectors in this process until they finish or :meth:`stop` is called."""

    def __init__(self, props: Mapping[str, Any], *, where: str = "worker",
                 log: TextIO | None = None):
        self.config = WORKER_CONFIG.parse(props, where=where)
        if not self.config["bootstrap.servers"]:
            raise ConfigError(f"{where}: missing required property 'bootstrap.servers'")
        for d in self.config["plugin.path"]:
            if d not in sys.path:
                sys.path.insert(0, d)
        self.bootstrap = ",".join(self.config["bootstrap.servers"])
        self.log = log if log is not None else sys.stderr
        self.stop_event = threading.Event()
        self.runners: list[SinkTaskRunner | SourceTaskRunner] = []
        self.connectors: list[Any] = []
        self._offsets: FileOffsetStore | None = None

    # -- configuration -------------------------------------------------------------------------

    def _converter(self, role: str, values: Mapping[str, Any], props: Mapping[str, Any]
                   ) -> Converter:
        name = values.get(f"{role}.converter") or self.config[f"{role}.converter"]
        conf = ConfigDef.with_prefix(self.config, f"{role}.converter.")
        conf.update(ConfigDef.with_prefix(props, f"{role}.converter."))
        return make_converter(name, conf, is_key=role == "key")

    def _settings(self, kind: str, base: Mapping[str, Any], values: Mapping[str, Any],
                  override_origin: Callable[[str], str] | None) -> KafkaSettings:
        s = KafkaSettings(dict(base, **{"bootstrap.servers": self.bootstrap}))
        s.update(ConfigDef.with_prefix(self.config, f"{kind}."),
                 lambda k: f"{kind}.{k} (worker)")
        s.update(ConfigDef.with_prefix(values, f"{kind}.override."),
                 override_origin or (lambda k: f"{kind}.override.{k}"))
        return s

    def _errors(self, name: str, task_id: int, values: Mapping[str, Any]) -> ErrorHandler:
        dlq = None
        topic = values.get("errors.deadletterqueue.topic.name")
        if topic:
            if values.get("errors.tolerance") != "all":
                raise ConfigError("errors.deadletterqueue.topic.name needs errors.tolerance=all "
                                  "(with none, the first bad record stops the task)")
            from confluent_kafka import KafkaException, Producer
            from confluent_kafka.admin import AdminClient
            ps = self._settings("producer", {"enable.idempotence": True}, values, None)
            admin_s = self._settings("admin", {}, values, None)
            try:
                admin = AdminClient(dict(admin_s.conf, logger=kafka_logger()))
            except KafkaException as e:
                raise admin_s.explain(e, "Kafka admin") from None
            DeadLetterQueue.ensure_topic(
                admin, topic, values["errors.deadletterqueue.topic.replication.factor"],
                timeout=self.config["startup.timeout.ms"] / 1000)
            try:
                producer = Producer(dict(ps.conf, logger=kafka_logger()))
            except KafkaException as e:
                raise ps.explain(e, "Kafka producer") from None
            dlq = DeadLetterQueue(producer, topic, connector=name, task_id=task_id,
                                  context_headers=values[
                                      "errors.deadletterqueue.context.headers.enable"])
        return ErrorHandler(values, connector=name, task_id=task_id, dlq=dlq, log=self.log,
                            stop=self.stop_event)

    def add_connector(self, props: Mapping[str, Any], *, where: str = "connector",
                      consumer_origin: Callable[[str], str] | None = None,
                      producer_origin: Callable[[str], str] | None = None) -> list[Any]:
        """Validate, start the connector and create (not yet start) its task runners."""
        from confluent_kafka import Consumer, KafkaException
        cls, values = validate_connector(props, where=where)
        name = values["name"]
        if any(getattr(c, "name", None) == name for c in self.connectors):
            raise ConfigError(f"{where}: a connector named {name!r} is already defined")
        # converters are validated before anything touches Kafka or the store
        self._converter("key", values, props).close()
        self._converter("value", values, props).close()
        connector = cls()
        connector.name = name
        runners: list[Any] = []
        timeout = self.config["startup.timeout.ms"] / 1000
        flush_ms = self.config["offset.flush.interval.ms"]
        if isinstance(connector, SinkConnector):
            # Kafka first: an unknown topic or a dead broker must fail before the connector
            # creates anything (a store, a dead-letter topic).
            task_cls = connector.task_class()
            base = dict(_DEFAULT_CONSUMER, **getattr(task_cls, "DEFAULT_CONSUMER_CONFIG", {}))
            base["group.id"] = f"connect-{name}"
            settings = self._settings("consumer", base, values, consumer_origin)
            settings.require(_REQUIRED_CONSUMER, "the worker (it assigns partitions itself)")
            settings.require(getattr(task_cls, "REQUIRED_CONSUMER_CONFIG", {}), cls.__name__)
            try:
                probe = Consumer(dict(settings.conf, logger=kafka_logger()))
            except KafkaException as e:
                raise settings.explain(e, "Kafka consumer") from None
            try:
                by_topic = list_partitions(probe, values["topics"], self.bootstrap, timeout)
            finally:
                probe.close()
            connector.start(values)
            self.connectors.append(connector)
            task_props = connector.task_configs(values["tasks.max"])[:values["tasks.max"]]
            tps = [TopicPartition(t, p) for t in values["topics"]
                   for p in connector.select_partitions(t, by_topic[t])]
            n = len(task_props)
            for i, tprops in enumerate(task_props):
                assignment = tps[i::n]
                conf = dict(settings.conf, **{"client.id": f"kcompact-{name}-{i}"})
                runners.append(SinkTaskRunner(
                    connector=name, task_id=i, task=task_cls(), props=tprops,
                    assignment=assignment, consumer_conf=conf,
                    key_converter=self._converter("key", values, props),
                    value_converter=self._converter("value", values, props),
                    errors=self._errors(name, i, values), follow=values["follow"],
                    batch_max=values["batch.max.records"], flush_interval_ms=flush_ms,
                    stop=self.stop_event, startup_timeout=timeout, settings=settings))
        elif isinstance(connector, SourceConnector):
            if values.get("errors.deadletterqueue.topic.name"):
                raise ConfigError(f"{where}: errors.deadletterqueue.topic.name applies to sink "
                                  "connectors only (as in Kafka Connect)")
            make_runners = getattr(connector, "make_runners", None)
            if make_runners is not None:
                # The connector produces and keeps its progress itself (the store source:
                # transactions, progress in the store), so no offsets file is needed.
                settings = self._settings("producer", {}, values, producer_origin)
                connector.start(values)
                self.connectors.append(connector)
                runners = make_runners(name=name, props=values, settings=settings,
                                       stop=self.stop_event, startup_timeout=timeout,
                                       log=self.log)
                self.runners.extend(runners)
                return runners
            path = self.config["offset.storage.file.filename"]
            if not path:
                raise ConfigError("the worker needs offset.storage.file.filename to run source "
                                  f"connector {name!r}")
            connector.start(values)
            self.connectors.append(connector)
            task_props = connector.task_configs(values["tasks.max"])[:values["tasks.max"]]
            if self._offsets is None:
                self._offsets = FileOffsetStore(path)
            settings = self._settings("producer", {"enable.idempotence": True}, values, None)
            for i, tprops in enumerate(task_props):
                runners.append(SourceTaskRunner(
                    connector=name, task_id=i, task=connector.task_class()(), props=tprops,
                    producer_conf=settings.conf,
                    key_converter=self._converter("key", values, props),
                    value_converter=self._converter("value", values, props),
                    errors=self._errors(name, i, values), offsets=self._offsets,
                    flush_interval_ms=flush_ms, stop=self.stop_event, settings=settings))
        else:
            raise ConfigError(f"{where}: {cls.__name__} is neither a sink nor a source connector")
        self.runners.extend(runners)
        return runners

    # -- running -------------------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_event.set()

    def run(self, on_tick: Callable[["Worker"], None] | None = None, tick: float = 0.5) -> None:
        """Start every task and wait until all have ended (or one failed: the others are then
        stopped, and the failure is raised as one line naming the task). The garbage collector
        runs less often meanwhile (reput/_gc.py)."""
        with bulk_gc():
            self._run_tasks(on_tick, tick)

    def _run_tasks(self, on_tick: Callable[["Worker"], None] | None, tick: float) -> None:
        interval = self.config["metrics.log.interval.ms"] / 1000
        last_log = time.monotonic()
        for r in self.runners:
            r.start()
        try:
            while any(r.alive for r in self.runners):
                for r in self.runners:
                    r.thread.join(timeout=tick / max(1, len(self.runners)))
                if any(r.failure is not None for r in self.runners):
                    self.stop_event.set()
                if on_tick is not None:
                    on_tick(self)
                elif interval and time.monotonic() - last_log >= interval:
                    last_log = time.monotonic()
                    for r in self.runners:
                        print(f"kcompact: {r.metrics.summary()}", file=self.log, flush=True)
        finally:
            self.stop_event.set()
            for r in self.runners:
                r.thread.join()
            for c in self.connectors:
                try:
                    c.stop()
                except Exception:  # noqa: BLE001
                    pass
        for r in self.runners:
            if r.failure is not None:
                e = r.failure
                if isinstance(e, (ConnectorsError, KeyboardInterrupt)):
                    raise e
                from kcompact.reput import ReputError
                if isinstance(e, (ReputError, OSError)):
                    raise TaskFailedError(f"task {r.metrics.name}: {e}") from e
                raise TaskFailedError(f"task {r.metrics.name} failed: {type(e).__name__}: {e}"
                                      ) from e
