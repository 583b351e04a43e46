"""The store sink connector: Kafka topic -> kcompact store (what ``kcompact mirror`` runs).

Exactly-once without consumer-group commits: a task opens the store with its own writer id,
and for each assigned partition asks the worker to start at ``store.next_offset(topic, p)`` -
the offset after the last record the store holds. Whatever the consumer group says, and however
the previous run ended (SIGKILL included: opening the store repairs a torn commit-log tail and
re-dispatches idempotently), a restart neither loses nor repeats a record. ``pre_commit`` flushes
the store and returns no offsets, so the worker never commits to the group.

Records are stored as Kafka holds them: source offset (gaps from transaction markers or an
already-compacted topic stay gaps), timestamp, key and value bytes (null and empty distinct),
headers in order. ``key.converter``/``value.converter`` only decide what is *accepted* (an
AvroConverter rejects a malformed payload - to the dead-letter topic under
``errors.tolerance=all``); the bytes stored are always the original ones.

The consumer reads with ``isolation.level=read_committed`` (records of open transactions are
held back until they commit) and ``auto.offset.reset=error``: if the store's next offset is no
longer in the topic (retention deleted records that were never mirrored, or the topic was
recreated) the task stops and says so instead of silently skipping; set
``consumer.override.auto.offset.reset=earliest`` (``-X auto.offset.reset=earliest``) to accept
the gap.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from reput import Store, WriterOptions
from reput.record import RecordBatch, _VarColumn, encode_headers

from .api import SinkConnector, SinkRecords, SinkTask, TopicPartition
from .config import ConfigDef, Importance, Type, at_least, non_empty, one_of
from .errors import ConfigError

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
    .define("store.fsync", Type.STRING, "flush", one_of("always", "flush", "never"),
            Importance.LOW, "When the commit log is fsynced: on every batch, on every flush "
            "(offset.flush.interval.ms), or never (the OS decides).")
    .define("store.commitlog.dir", Type.STRING, None, None, Importance.LOW,
            "Local directory for the commit log when store.url is not a local directory (S3).")
)


def _partition_numbers(values: Sequence[str]) -> list[int]:
    out = []
    for v in values:
        try:
            p = int(v)
        except ValueError:
            raise ConfigError(f"store.partitions: {v!r} is not a partition number") from None
        if p < 0:
            raise ConfigError(f"store.partitions: {p} is negative")
        out.append(p)
    return sorted(set(out))


class StoreSinkConnector(SinkConnector):
    """Mirrors Kafka topics into a kcompact store, resuming from the store's own offsets."""

    CONFIG = STORE_SINK_CONFIG

    def start(self, props: Mapping[str, Any]) -> None:
        super().start(props)
        if not props.get("store.url"):
            raise ConfigError("store.url: required by StoreSinkConnector (a directory for the "
                              "store; it is created when missing)")
        self.only = _partition_numbers(props.get("store.partitions") or [])
        # Before any task picks its start offsets: dispatch whatever a dead writer (a killed
        # mirror or Spark task) left in its commit log, so next_offset() sees all of it.
        store = Store.open(props["store.url"], create=True,
                           commitlog_dir=props.get("store.commitlog.dir"))
        try:
            store.recover_writers()
        finally:
            store.close()

    def task_class(self) -> type[SinkTask]:
        return StoreSinkTask

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        base = self.props.get("store.writer") or "connect"
        return [dict(self.props, **{"task.id": i,
                                    "store.writer": base if i == 0 else f"{base}-{i}"})
                for i in range(max(1, max_tasks))]

    def select_partitions(self, topic: str, partitions: Sequence[int]) -> list[int]:
        if not self.only:
            return list(partitions)
        missing = [p for p in self.only if p not in set(partitions)]
        if missing:
            raise ConfigError(f"store.partitions: topic {topic!r} has partitions "
                              f"0..{max(partitions) if partitions else -1}; it has no partition "
                              f"{', '.join(map(str, missing))}")
        return [p for p in partitions if p in set(self.only)]


class StoreSinkTask(SinkTask):
    #: Consumer settings this task cannot work without (the worker rejects an override).
    REQUIRED_CONSUMER_CONFIG = {"isolation.level": "read_committed"}
    #: Defaults the user may override.
    DEFAULT_CONSUMER_CONFIG = {"auto.offset.reset": "error"}

    store: Store | None = None

    def start(self, props: Mapping[str, Any]) -> None:
        self.props = dict(props)
        options = WriterOptions(fsync=props.get("store.fsync") or "flush")
        self.store = Store.open(props["store.url"], writer=props["store.writer"], create=True,
                                options=options, commitlog_dir=props.get("store.commitlog.dir"))
        self.appended = 0

    def open(self, partitions: Sequence[TopicPartition]) -> None:
        assert self.store is not None
        start = {}
        for tp in partitions:
            # An empty partition starts at the topic's beginning (which may be > 0 after
            # retention); a partition with data resumes exactly after its last record.
            n = self.store.next_offset(tp.topic, tp.partition)
            if n > 0 or tp.partition in self.store.partitions(tp.topic):
                start[tp] = n
        self.context.offset(start)

    def put(self, records: SinkRecords) -> None:
        n = len(records)
        if n == 0:
            return
        assert self.store is not None
        topics = records.topics
        if topics[0] == topics[-1] and topics.count(topics[0]) == n:
            self.appended += self.store.append(_batch(topics[0], records, None))
            return
        for topic in dict.fromkeys(topics):
            idx = [i for i, t in enumerate(topics) if t == topic]
            self.appended += self.store.append(_batch(topic, records, idx))

    def flush(self, offsets: Mapping[TopicPartition, int]) -> None:
        if self.store is not None:
            self.store.flush()

    def pre_commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        self.flush(offsets)
        return {}  # the store is the source of truth for positions: no group commits

    def stop(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            store.close()  # flushes


def _batch(topic: str, r: SinkRecords, idx: list[int] | None) -> RecordBatch:
    """Columns of a SinkRecords batch (or of the rows ``idx``) -> RecordBatch, no per-record
    objects beyond the header encoding of records that have headers."""
    def col(values: list) -> list:
        return values if idx is None else [values[i] for i in idx]

    parts, offs, ts = col(r.partitions), col(r.offsets), col(r.timestamps)
    keys, values, headers = col(r.raw_keys), col(r.raw_values), col(r.headers)
    n = len(offs)
    if any(headers):
        hcol = _VarColumn.from_list([encode_headers(h) if h else b"" for h in headers])
    else:
        hcol = _VarColumn.empties(n)
    return RecordBatch(topic, np.fromiter(parts, np.int32, n), np.fromiter(offs, np.int64, n),
                       np.fromiter(ts, np.int64, n), _VarColumn.from_list(keys),
                       _VarColumn.from_list(values), hcol)
