"""Error handling for tasks: retries, tolerance, the error log and the dead-letter queue.

Kafka Connect's ``RetryWithToleranceOperator`` and ``DeadLetterQueueReporter`` (KIP-298), with
the same property names:

* ``errors.retry.timeout`` / ``errors.retry.delay.max.ms``: a
  :class:`~kcompact.connectors.framework.api.RetriableError` (a Schema Registry that does not
  answer) is retried with exponential back-off (300 ms, doubling, capped at the max delay) until the
  timeout; ``-1`` retries forever, ``0`` (the default) never. When retries run out the task stops
  with that error. Unlike Connect, kcompact never *tolerates* an exhausted retriable error: skipping
  every record while a registry is down would punch holes in a mirror.
* ``errors.tolerance``: ``none`` (default) stops the task at the first record a converter cannot
  read (:class:`~kcompact.connectors.framework.api.DataError`); ``all`` skips it - to the
  dead-letter topic when one is named - and goes on.
* ``errors.deadletterqueue.topic.name``: the record's key, value, headers and timestamp are
  produced there as they were read, plus ``__connect.errors.*`` headers (original topic,
  partition, offset, connector, task, stage, class, exception class, message and stack trace),
  UTF-8 text as Connect writes them. The topic is created (1 partition) when missing.
* ``errors.log.enable`` / ``errors.log.include.messages``: one line per failure on stderr.

Only conversion is subject to tolerance (as in Connect): a failure in the task itself (a disk
full under the store) always stops the task.
"""

from __future__ import annotations

import enum
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TextIO, TypeVar

from .api import DataError, RetriableError
from .config import ConfigDef, Importance, Type, at_least, one_of
from ..errors import ConnectorsError

T = TypeVar("T")

ERRORS_CONFIG = (
    ConfigDef()
    .define("errors.tolerance", Type.STRING, "none", one_of("none", "all"), Importance.MEDIUM,
            "none: a record that cannot be converted stops the task. all: it is skipped (and "
            "sent to the dead-letter topic when one is set).")
    .define("errors.retry.timeout", Type.LONG, 0, at_least(-1), Importance.MEDIUM,
            "How long (ms) to retry an operation that failed with a retriable error (e.g. the "
            "Schema Registry is unreachable); -1 = forever, 0 = no retries.")
    .define("errors.retry.delay.max.ms", Type.LONG, 60_000, at_least(1), Importance.LOW,
            "Upper bound of the exponential back-off between retries.")
    .define("errors.log.enable", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Log every tolerated or fatal record error on stderr, with its topic, partition and "
            "offset.")
    .define("errors.log.include.messages", Type.BOOLEAN, False, None, Importance.LOW,
            "Include the record's key and value (truncated) in that log.")
    .define("errors.deadletterqueue.topic.name", Type.STRING, "", None, Importance.MEDIUM,
            "Topic that receives records skipped under errors.tolerance=all (empty: none).")
    .define("errors.deadletterqueue.topic.replication.factor", Type.INT, -1, at_least(-1),
            Importance.LOW, "Replication factor when the dead-letter topic is created; -1 = "
            "the broker's default (Connect's default is 3).")
    .define("errors.deadletterqueue.context.headers.enable", Type.BOOLEAN, True, None,
            Importance.LOW, "Add the __connect.errors.* headers to dead-letter records "
            "(Connect's default is false).")
)

#: Kafka Connect's header names (DeadLetterQueueReporter).
HEADER_PREFIX = "__connect.errors."
H_TOPIC = HEADER_PREFIX + "topic"
H_PARTITION = HEADER_PREFIX + "partition"
H_OFFSET = HEADER_PREFIX + "offset"
H_CONNECTOR = HEADER_PREFIX + "connector.name"
H_TASK = HEADER_PREFIX + "task.id"
H_STAGE = HEADER_PREFIX + "stage"
H_CLASS = HEADER_PREFIX + "class.name"
H_EXC_CLASS = HEADER_PREFIX + "exception.class.name"
H_EXC_MESSAGE = HEADER_PREFIX + "exception.message"
H_EXC_STACKTRACE = HEADER_PREFIX + "exception.stacktrace"

INITIAL_RETRY_DELAY_MS = 300


class Stage(str, enum.Enum):
    KEY_CONVERTER = "KEY_CONVERTER"
    VALUE_CONVERTER = "VALUE_CONVERTER"
    HEADER_CONVERTER = "HEADER_CONVERTER"
    TASK_PUT = "TASK_PUT"
    TASK_POLL = "TASK_POLL"
    KAFKA_PRODUCE = "KAFKA_PRODUCE"


@dataclass
class ErrorContext:
    """Where a failure happened: the original record and the stage that failed on it."""

    topic: str
    partition: int | None
    offset: int | None
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: list | None
    stage: Stage
    executing_class: str

    def where(self) -> str:
        return f"{self.topic}-{self.partition} offset {self.offset}"


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"


#: Returned by :meth:`ErrorHandler.execute` when a tolerated failure dropped the record.
SKIPPED: Any = _Skipped()


def class_name(cls: type) -> str:
    """A class's dotted name, as the ``__connect.errors.*`` headers carry it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _preview(data: bytes | None, limit: int = 64) -> str:
    if data is None:
        return "null"
    text = repr(bytes(data[:limit]))
    return text + (f"...({len(data)} bytes)" if len(data) > limit else "")


class DeadLetterQueue:
    """Produces skipped records, with their error context, to a dead-letter topic."""

    def __init__(self, producer: Any, topic: str, *, connector: str, task_id: int,
                 context_headers: bool = True):
        self.producer, self.topic = producer, topic
        self.connector, self.task_id, self.context_headers = connector, task_id, context_headers
        self._failed: list[str] = []
        self._lock = threading.Lock()
        self.produced = 0

    @staticmethod
    def ensure_topic(admin: Any, topic: str, replication_factor: int, timeout: float = 15.0
                     ) -> None:
        """Create the topic with one partition unless it exists. (Never list it with the
        AdminClient first: that would auto-create it on brokers that allow it.)"""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import NewTopic
        fut = admin.create_topics([NewTopic(topic, 1, replication_factor)],
                                  operation_timeout=timeout, request_timeout=timeout)[topic]
        try:
            fut.result()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError):
                raise ConnectorsError(f"cannot create the dead-letter topic {topic!r}: {exc}"
                                      ) from None
            if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise ConnectorsError(f"cannot create the dead-letter topic {topic!r}: "
                                      f"{err.str()}") from None

    def headers_for(self, ctx: ErrorContext, exc: BaseException) -> list[tuple[str, bytes]]:
        stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        items = [
            (H_TOPIC, ctx.topic), (H_PARTITION, str(ctx.partition)), (H_OFFSET, str(ctx.offset)),
            (H_CONNECTOR, self.connector), (H_TASK, str(self.task_id)),
            (H_STAGE, ctx.stage.value), (H_CLASS, ctx.executing_class),
            (H_EXC_CLASS, class_name(type(exc))), (H_EXC_MESSAGE, str(exc)),
            (H_EXC_STACKTRACE, stack),
        ]
        return [(k, v.encode("utf-8", "replace")) for k, v in items]

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            with self._lock:
                self._failed.append(err.str())

    def report(self, ctx: ErrorContext, exc: BaseException) -> None:
        headers = list(ctx.headers or [])
        if self.context_headers:
            headers += self.headers_for(ctx, exc)
        kwargs: dict[str, Any] = {}
        if ctx.timestamp is not None and ctx.timestamp > 0:
            kwargs["timestamp"] = ctx.timestamp
        while True:
            try:
                self.producer.produce(self.topic, key=ctx.key, value=ctx.value, headers=headers,
                                      on_delivery=self._on_delivery, **kwargs)
                break
            except BufferError:
                self.producer.poll(0.1)
        self.produced += 1
        self.producer.poll(0)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every reported record is acknowledged; raise if one was not."""
        left = self.producer.flush(timeout)
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            raise ConnectorsError(f"could not write to the dead-letter topic {self.topic!r}: "
                                  f"{failed[0]} ({len(failed)} records)")
        if left:
            raise ConnectorsError(f"{left} records for the dead-letter topic {self.topic!r} were "
                                  f"not acknowledged within {timeout:.0f} s; is the broker up?")


class ErrorHandler:
    """Runs conversions with Connect's retry and tolerance rules (RetryWithToleranceOperator)."""

    def __init__(self, config: dict[str, Any], *, connector: str, task_id: int,
                 dlq: DeadLetterQueue | None = None, log: TextIO | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 stop: threading.Event | None = None):
        self.tolerance_all = config.get("errors.tolerance", "none") == "all"
        self.retry_timeout_ms = int(config.get("errors.retry.timeout", 0))
        self.max_delay_ms = int(config.get("errors.retry.delay.max.ms", 60_000))
        self.log_enabled = bool(config.get("errors.log.enable", False))
        self.log_messages = bool(config.get("errors.log.include.messages", False))
        self.connector, self.task_id, self.dlq = connector, task_id, dlq
        self.log = log if log is not None else sys.stderr
        self.sleep, self.clock, self.stop = sleep, clock, stop
        self.errors = 0          # records that failed (tolerated or not)
        self.skipped = 0         # records dropped under errors.tolerance=all
        self.retries = 0
        self.pending_dlq = 0     # reported to the DLQ since the last flush_dlq()

    def execute(self, operation: Callable[[], T], ctx: ErrorContext) -> T:
        """``operation()``, retried on RetriableError; a DataError is tolerated (returns
        :data:`SKIPPED`) or raised as the task's failure."""
        start = self.clock()
        delay_ms = INITIAL_RETRY_DELAY_MS
        while True:
            try:
                return operation()
            except RetriableError as e:
                elapsed_ms = (self.clock() - start) * 1000
                forever = self.retry_timeout_ms < 0
                if not forever and elapsed_ms + delay_ms > self.retry_timeout_ms:
                    self._log(ctx, e, "failed")
                    self.errors += 1
                    spent = f"after retrying for {elapsed_ms / 1000:.1f} s" if self.retries else \
                        "(errors.retry.timeout=0: no retries)" if self.retry_timeout_ms == 0 \
                        else f"within errors.retry.timeout={self.retry_timeout_ms} ms"
                    raise RetriableError(f"{e} {spent}; at {ctx.where()} ({ctx.stage.value})"
                                         ) from None
                if self.stop is not None and self.stop.is_set():
                    raise RetriableError(f"{e}; stopped while retrying at {ctx.where()}") from None
                self.retries += 1
                self.sleep(delay_ms / 1000)
                delay_ms = min(delay_ms * 2, self.max_delay_ms)
            except DataError as e:
                return self._tolerate(ctx, e)

    def _tolerate(self, ctx: ErrorContext, exc: DataError) -> Any:
        self.errors += 1
        if not self.tolerance_all:
            self._log(ctx, exc, "failed")
            hint = ("set errors.tolerance=all (with errors.deadletterqueue.topic.name) to route "
                    "such records to a dead-letter topic")
            raise DataError(f"{ctx.stage.value.lower().replace('_', ' ')} failed on "
                            f"{ctx.where()}: {exc}; {hint}") from None
        self._log(ctx, exc, "skipped" if self.dlq is None else
                  f"sent to dead-letter topic {self.dlq.topic}")
        if self.dlq is not None:
            self.dlq.report(ctx, exc)
            self.pending_dlq += 1
        self.skipped += 1
        return SKIPPED

    def flush_dlq(self) -> None:
        if self.dlq is not None and self.pending_dlq:
            self.dlq.flush()
            self.pending_dlq = 0

    def _log(self, ctx: ErrorContext, exc: BaseException, outcome: str) -> None:
        if not self.log_enabled:
            return
        msg = (f"kcompact: error: {self.connector}-{self.task_id}: {ctx.stage.value} on "
               f"{ctx.where()}: {type(exc).__name__}: {exc} ({outcome})")
        if self.log_messages:
            msg += f" key={_preview(ctx.key)} value={_preview(ctx.value)}"
        print(msg, file=self.log, flush=True)
