"""Kafka client helpers shared by the framework, the connectors and the applications.

librdkafka's logger (quiet unless KCOMPACT_DEBUG is set), the one-line text of a client error, a
topic's partitions read without creating it, the consumer settings a sink task runs with, and
:class:`KafkaSettings`, which composes librdkafka settings from several places and names the key
the user wrote when librdkafka refuses one. Settings stay a dict of librdkafka keys, passed
through as confluent-kafka does (STYLE.md).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Callable, Mapping

from kcompact.reput.env import debug

from ..errors import ConfigError, ConnectorsError

#: Consumer settings every sink task needs (the worker assigns partitions and commits itself).
SINK_CONSUMER_REQUIRED = {"enable.auto.commit": "false", "enable.partition.eof": "true"}
SINK_CONSUMER_DEFAULTS = {
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


#: Settings for a client made for a request or two (the worker's probe, an admin client that
#: reads topic ids or configs), under the user's: librdkafka >= 2.10 drops the bootstrap
#: connection once the first metadata response names the brokers, failing a request still in
#: flight on it, and the retry waits out the sparse-connection suppression, half of
#: reconnect.backoff.ms (50 ms with librdkafka's 100). Measured against Tansu with librdkafka
#: 2.16: a fresh client's list_topics took 53 ms in about one call in three, 1 ms otherwise;
#: at 10 ms the wait is librdkafka's floor, 11 ms. Long-lived clients keep the default.
SHORT_LIVED_CLIENT_DEFAULTS = {"reconnect.backoff.ms": 10}


def short_lived(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` for a client that makes a request or two and closes: SHORT_LIVED_CLIENT_DEFAULTS
    under the settings given (a value the user set wins)."""
    return dict(SHORT_LIVED_CLIENT_DEFAULTS, **conf)


def kafka_logger() -> logging.Logger:
    """librdkafka's log, silent unless KCOMPACT_DEBUG is set (its lines are multi-line noise
    for a CLI; errors reach us through error_cb and are reported as one line)."""
    log = logging.getLogger("kcompact.librdkafka")
    if not log.handlers:
        log.propagate = False
        if debug():
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("librdkafka: %(message)s"))
            log.addHandler(h)
            log.setLevel(logging.DEBUG)
        else:
            log.addHandler(logging.NullHandler())
            log.setLevel(logging.CRITICAL + 1)
    return log


def kafka_error(exc: BaseException) -> Any:
    """The KafkaError a KafkaException carries (its ``code()``, ``str()``...), or None."""
    err = exc.args[0] if getattr(exc, "args", None) else None
    return err if hasattr(err, "code") else None


def kafka_error_text(exc: BaseException) -> str:
    """``<reason> (<error name>)`` for a KafkaException, else the exception's text."""
    err = kafka_error(exc)
    if err is not None:
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


#: Settings only a consumer takes, left out of an admin client's (plugins/config_sync.py,
#: topic_watch.py): the rest (security, timeouts, client.id...) applies to any client.
_CONSUMER_ONLY = ("group.", "auto.offset.reset", "isolation.level", "enable.auto",
                  "fetch.", "queued.", "enable.partition.eof", "max.poll", "session.timeout",
                  "heartbeat.", "partition.assignment", "check.crcs", "auto.commit",
                  "error_cb", "logger", "on_commit", "stats_cb")


def admin_settings(conf: Mapping[str, Any], bootstrap: str | None = None) -> dict[str, Any]:
    """An admin client's settings from a consumer's (or ``-X`` settings): the consumer-only
    keys left out; ``bootstrap`` when given."""
    out = {k: v for k, v in conf.items() if not k.startswith(_CONSUMER_ONLY)}
    if bootstrap is not None:
        out["bootstrap.servers"] = bootstrap
    return out


def list_topic_names(consumer: Any, bootstrap: str, timeout: float) -> list[str]:
    """Every topic of the cluster (one metadata request for all topics)."""
    from confluent_kafka import KafkaException
    try:
        md = consumer.list_topics(timeout=timeout)
    except KafkaException as e:
        raise ConnectorsError(f"cannot reach Kafka at {bootstrap} within {timeout:.0f} s "
                              f"({kafka_error_text(e)}); check the bootstrap servers and that "
                              "the broker is up") from None
    return sorted(t for t, m in md.topics.items() if m.error is None)


class ClientReports:
    """What a Kafka client's callbacks report (client errors, failed deliveries, the brokers'
    connection state), in an object of its own, not in the client's owner.

    A client holds its callbacks from C, and so does every record in flight (the delivery
    callback rides with each message until its report is served); the garbage collector does
    not see those references (a Consumer does not even report its error_cb and stats_cb to it).
    Callbacks bound to the owner (a task runner) kept the owner alive after a failed run, and
    with it the failure, its traceback's frames and every Kafka client in them, which kept
    reconnecting to a broker long gone: the "Connection refused" lines at the end of a test
    session. This object refers only to its lists and to the task's metrics.

    ``metrics`` (a TaskMetrics) hears of every client error (``note_kafka_error``: unreachable
    brokers, for the health check: framework/metrics.py); with ``disconnects`` (a task that
    follows, whose consumer also sends statistics) it is also told when every broker is down and
    when one is up again (``brokers_up``, for "disconnected since" in progress lines)."""

    __slots__ = ("errors", "delivery_errors", "metrics", "disconnects")

    def __init__(self, metrics: Any = None, *, disconnects: bool = False):
        self.errors: list[Any] = []            # KafkaErrors from error_cb, oldest first
        self.delivery_errors: list[str] = []   # "topic-partition: reason" of failed deliveries
        self.metrics = metrics
        self.disconnects = disconnects

    def on_error(self, err: Any) -> None:
        """error_cb: kept for the owner; unreachable brokers also go to the metrics."""
        if self.metrics is not None:
            from confluent_kafka import KafkaError
            self.metrics.note_kafka_error(err)
            if self.disconnects and err.code() == KafkaError._ALL_BROKERS_DOWN:
                self.metrics.brokers_up(False)
        self.errors.append(err)

    def on_delivery(self, err: Any, msg: Any) -> None:
        """on_delivery: the failed ones are kept."""
        if err is not None:
            self.delivery_errors.append(f"{msg.topic()}-{msg.partition()}: {err.str()}")

    def on_stats(self, raw: str) -> None:
        """stats_cb (librdkafka's statistics JSON): connected again once any broker's connection
        is UP, disconnected while none is."""
        try:
            brokers = json.loads(raw).get("brokers") or {}
        except ValueError:
            return
        if brokers and self.metrics is not None and self.disconnects:
            self.metrics.brokers_up(any(b.get("state") == "UP" for b in brokers.values()))

    def take_errors(self) -> list[Any]:
        """The client errors reported since the last call."""
        errs, self.errors = self.errors, []
        return errs


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
