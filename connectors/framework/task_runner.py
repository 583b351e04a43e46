"""What the worker runs a task with: a :class:`TaskRunner` (the task's thread, its failure and
its :class:`TaskMetrics`: records, bytes, errors, positions and lag per partition, read by
progress printers from another thread). sink_runner.py and source_runner.py are the framework's
two; a connector may bring its own (``make_runners``: the store source's RestoreRunner).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field

from .api import TopicPartition


@functools.cache
def unreachable_codes() -> frozenset:
    """The Kafka client's error codes that mean its brokers cannot be reached (health:
    framework/metrics.py)."""
    from confluent_kafka import KafkaError
    return frozenset((KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE))


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
    by_topic: dict[str, int] = field(default_factory=dict)  # records, per topic
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    #: since when the Kafka client has reported its brokers unreachable (monotonic; the health
    #: check clears it once they answer again: framework/metrics.py), and its last such error
    unreachable_since: float | None = None
    unreachable_reason: str = ""
    #: per partition, the timestamp (ms) of the last record stored (sinks)
    last_timestamp: dict[TopicPartition, int] = field(default_factory=dict)
    #: when every broker went down (time.time()), while none answers; None while connected
    #: (a sink task that follows tracks it: SinkTaskRunner, from error_cb and stats_cb)
    disconnected_since: float | None = None
    #: topics this (sink) task stopped while the others went on, -> why (``deleted (topic id
    #: X)``...: framework/topic_watch.py, GoneTopic)
    stopped: dict[str, str] = field(default_factory=dict)
    #: partitions the task refused (damaged in the store): never assigned -> why
    refused: dict = field(default_factory=dict)

    def note_unreachable(self, reason: str) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        self.unreachable_reason = reason

    def note_kafka_error(self, err) -> None:
        """A Kafka client's error callback (``error_cb``) of the task's consumer or producer:
        notes the brokers unreachable when the error says so."""
        if err.code() in unreachable_codes():
            self.note_unreachable(err.str())

    def brokers_up(self, up: bool, now: float | None = None) -> None:
        """Record whether any broker answers (the start of an outage is kept, not moved)."""
        if up:
            self.disconnected_since = None
        elif self.disconnected_since is None:
            self.disconnected_since = time.time() if now is None else now

    def disconnected_text(self, now: float | None = None) -> str | None:
        """``disconnected since HH:MM:SS (N s)`` (local time) while no broker answers."""
        since = self.disconnected_since
        if since is None:
            return None
        now = time.time() if now is None else now
        return (f"disconnected since {time.strftime('%H:%M:%S', time.localtime(since))} "
                f"({max(0.0, now - since):.0f} s)")

    def count_errors(self, errors) -> None:
        """Take the error handler's counts (errors_handling.ErrorHandler)."""
        self.errors, self.skipped, self.retries = errors.errors, errors.skipped, errors.retries

    def count_topic(self, topic: str, n: int) -> None:
        self.by_topic[topic] = self.by_topic.get(topic, 0) + n

    def records_by_topic(self) -> dict[str, int]:
        return dict(self.by_topic)

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
        down = self.disconnected_text()
        return (f"{self.name}: {self.records} records ({self.records / dt:,.0f}/s, "
                f"{self.bytes / dt / 1e6:.1f} MB/s), "
                + (f"{down}, lag unknown" if down else f"lag {sum(lag.values())}")
                + f", errors {self.errors} (skipped {self.skipped}, dead-lettered "
                f"{self.dead_lettered})" + self.stopped_text())

    def stopped_text(self) -> str:
        """``, stopped: orders (deleted (topic id X))`` when topics were stopped, else ``""``."""
        if not self.stopped:
            return ""
        return ", stopped: " + "; ".join(f"{t} ({why})" for t, why in sorted(self.stopped.items()))


class TaskRunner:
    """The worker's view of a running task: ``start()``, ``alive``, ``thread`` (joined by the
    worker), ``failure`` (the first error, reported by the worker) and ``metrics``. A subclass
    does the task's work in ``_run``, in the thread, and sets ``failure`` instead of raising."""

    def __init__(self, name: str):
        self.metrics = TaskMetrics(name)
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"task-{name}", daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def kafka_conf(self) -> dict | None:
        """The task's Kafka client settings, for the health check's metadata probe
        (framework/metrics.py); None: it has no Kafka client to probe."""
        return None

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()
