"""One source task in a thread of its own (Kafka Connect's ``WorkerSourceTask``): records from
``poll()`` are converted, produced, and their source offsets kept in
``offset.storage.file.filename`` once the producer has flushed them (Connect standalone's
at-least-once). A connector that produces and keeps its progress itself (the store source)
brings its own runner instead (``make_runners``).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any, Mapping

from ..errors import ConnectorsError
from .api import SourceRecord, SourceTask, SourceTaskContext, source_partition_key
from .converters import Converter
from .errors_handling import SKIPPED, ErrorContext, ErrorHandler, Stage, class_name
from .kafka_clients import KafkaSettings, kafka_logger
from .task_runner import TaskRunner


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


class SourceTaskRunner(TaskRunner):
    """One source task: poll, convert, produce, and keep source offsets once Kafka has them."""

    def __init__(self, *, connector: str, task_id: int, task: SourceTask, props: dict[str, Any],
                 producer_conf: dict[str, Any], key_converter: Converter,
                 value_converter: Converter, errors: ErrorHandler, offsets: FileOffsetStore,
                 flush_interval_ms: int, stop: threading.Event, settings: KafkaSettings):
        self.connector, self.task_id, self.task, self.props = connector, task_id, task, props
        self.producer_conf, self.offsets = producer_conf, offsets
        self.key_conv, self.value_conv, self.errors = key_converter, value_converter, errors
        self.flush_interval, self.stop_event, self.settings = flush_interval_ms, stop, settings
        super().__init__(f"{connector}-{task_id}")
        self._delivery_errors: list[str] = []
        self._pending: list[tuple[SourceRecord, Any]] = []
        self._key = f"{connector}"

    def kafka_conf(self) -> dict | None:
        return self.producer_conf

    def _run(self) -> None:
        from confluent_kafka import KafkaException, Producer
        producer = None
        started = False
        try:
            try:
                producer = Producer(dict(self.producer_conf, logger=kafka_logger(),
                                         error_cb=self.metrics.note_kafka_error))
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
                                list(r.headers), stage, class_name(cls))
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
        m.count_errors(self.errors)
