"""The connector API: Kafka Connect's model (``org.apache.kafka.connect.{connector,sink,source}``)
in Python.

A *connector* is configured once (``start(props)``) and splits its work into task configs
(``task_configs(max_tasks)``); a *task* does the work. The worker (framework/worker.py) owns
the Kafka clients, the converters and the error handling, and drives a task through Connect's
lifecycle:

    sink:    start(props) -> open(partitions) -> put(records)* / pre_commit(offsets) ... -> close -> stop
    source:  start(props) -> poll()* -> commit_record(record)* / commit() ... -> stop

Records handed to ``SinkTask.put`` come as a :class:`SinkRecords` batch: a sequence of
:class:`SinkRecord` (what Connect's ``Collection<SinkRecord>`` is), which also exposes its columns
(``offsets``, ``raw_values`` ...) so that a columnar sink, such as the store sink, never builds a
Python object per record.

Errors: :class:`DataError` (Connect's ``DataException``: this record cannot be read; subject to
``errors.tolerance``) and :class:`RetriableError` (Connect's ``RetriableException``: try again
later; retried up to ``errors.retry.timeout``).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, overload

from .config import ConfigDef
from ..errors import ConnectorsError

Headers = tuple[tuple[str, "bytes | None"], ...]

#: For ``SinkTaskContext.offset``: start at the partition's first available offset.
OFFSET_BEGINNING = -2


class DataError(ConnectorsError):
    """A record's bytes cannot be converted (bad magic byte, truncated Avro, invalid UTF-8...).

    With ``errors.tolerance=all`` the record goes to the dead-letter topic (or is skipped);
    otherwise the task stops. Fix the producer, or route such records to a DLQ.
    """


class RetriableError(ConnectorsError):
    """A transient failure (a service that does not answer): the operation may succeed later.

    The worker retries it until ``errors.retry.timeout``; then the task stops with this error.
    """


class TaskFailedError(ConnectorsError):
    """A task stopped on an error it could not tolerate; the message names task and cause."""


@dataclass(frozen=True, slots=True)
class TopicPartition:
    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}-{self.partition}"


@dataclass(frozen=True, slots=True)
class ConnectRecord:
    """One record as Connect sees it: ``key``/``value`` are the converters' output."""

    topic: str
    partition: int | None
    offset: int | None
    timestamp: int | None
    key: Any
    value: Any
    headers: Headers = field(default=())


@dataclass(frozen=True, slots=True)
class SinkRecord(ConnectRecord):
    """A record read from Kafka; ``raw_key``/``raw_value`` are its bytes as Kafka stored them."""

    raw_key: bytes | None = None
    raw_value: bytes | None = None


@dataclass(frozen=True, slots=True)
class SourceRecord(ConnectRecord):
    """A record for Kafka. ``source_partition``/``source_offset`` say where it came from, so the
    worker can hand the task its last committed position after a restart (Connect's
    ``sourcePartition``/``sourceOffset``)."""

    source_partition: Mapping[str, Any] | None = None
    source_offset: Mapping[str, Any] | None = None


class SinkRecords(Sequence[SinkRecord]):
    """A batch of records for ``SinkTask.put``, kept as parallel columns.

    Iterating (or indexing) yields :class:`SinkRecord` objects, as Connect's collection does;
    columnar sinks read the columns directly (``partitions``/``offsets``/``timestamps`` may be
    numpy int arrays, the others are lists). ``keys``/``values`` hold the converters' output,
    ``raw_keys``/``raw_values`` the bytes from Kafka (the same list objects when the converter is
    the byte-array one). ``headers[i]`` is a list of (name, bytes | None) or None.
    """

    __slots__ = ("topics", "partitions", "offsets", "timestamps", "keys", "values", "headers",
                 "raw_keys", "raw_values", "nbytes", "packed", "packed_headers")

    def __init__(self, topics: list[str], partitions: Sequence[int], offsets: Sequence[int],
                 timestamps: Sequence[int], keys: list, values: list, headers: list,
                 raw_keys: list | None = None, raw_values: list | None = None):
        n = len(offsets)
        if not (len(topics) == len(partitions) == len(timestamps) == len(keys) == len(values)
                == len(headers) == n):
            raise ValueError("SinkRecords columns have different lengths")
        self.topics, self.partitions, self.offsets = topics, partitions, offsets
        self.timestamps, self.keys, self.values, self.headers = timestamps, keys, values, headers
        self.raw_keys = keys if raw_keys is None else raw_keys
        self.raw_values = values if raw_values is None else raw_values
        #: Key + value bytes of the batch, when a task counted them while writing (metrics).
        self.nbytes: int | None = None
        #: The raw keys and values packed as columns, when the worker built them while reading
        #: the batch (framework/_rdkafka.c, message_columns): (key bytes, key starts (n+1
        #: int64), key nulls, value bytes, value starts, value nulls), each a bytearray. A
        #: columnar sink may use them instead of ``raw_keys``/``raw_values``; they describe the
        #: same bytes.
        self.packed: tuple | None = None
        #: The headers packed the same way, in the store's header encoding
        #: (kcompact.reput.record.encode_headers): (bytes, starts (n+1 int64)), or None.
        self.packed_headers: tuple | None = None

    @classmethod
    def empty(cls) -> "SinkRecords":
        return cls([], [], [], [], [], [], [])

    @classmethod
    def of(cls, records: Sequence[SinkRecord]) -> "SinkRecords":
        """From SinkRecord objects (tests, and sinks that re-batch)."""
        return cls([r.topic for r in records], [r.partition for r in records],
                   [r.offset for r in records], [r.timestamp for r in records],
                   [r.key for r in records], [r.value for r in records],
                   [list(r.headers) or None for r in records],
                   [r.raw_key for r in records], [r.raw_value for r in records])

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> SinkRecord: ...

    @overload
    def __getitem__(self, i: slice) -> "SinkRecords": ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SinkRecords(self.topics[i], self.partitions[i], self.offsets[i],
                               self.timestamps[i], self.keys[i], self.values[i], self.headers[i],
                               self.raw_keys[i], self.raw_values[i])
        h = self.headers[i]
        return SinkRecord(self.topics[i], int(self.partitions[i]), int(self.offsets[i]),
                          int(self.timestamps[i]), self.keys[i], self.values[i],
                          tuple(h) if h else (), self.raw_keys[i], self.raw_values[i])

    def __iter__(self) -> Iterator[SinkRecord]:
        return (self[i] for i in range(len(self)))


# ---------------------------------------------------------------------------------------------
# contexts: what the worker offers a task


class SinkTaskContext:
    """Given to a sink task before ``start``: its assignment, and a way to choose start offsets.

    ``offset({tp: n})`` inside ``open()`` makes the worker start that partition at ``n`` (Connect's
    ``SinkTaskContext.offset``); partitions without one start at the group's committed offset, or
    at ``auto.offset.reset`` (earliest) when there is none.

    While following, ``topic_ids`` holds the Kafka topic id (KIP-516) of each topic whose
    partitions ``open()`` is given, as the worker read it before the call (describe_topics; not
    for a broker that gives none): a task that keeps ids (the store sink) records or compares
    them there, and ``refuse_topic`` inside ``open()`` stops a topic that is not the one it has
    on record, before any of its records is fetched (kcompact's addition to Connect's API).
    """

    def __init__(self, assignment: Sequence[TopicPartition] = ()):
        self._assignment = list(assignment)
        self.requested_offsets: dict[TopicPartition, int] = {}
        self.stop_requested = False
        #: topic -> its Kafka topic id, as the worker read it before open() (while following)
        self.topic_ids: dict[str, str] = {}
        #: topic -> the id the task has on record, for the topics it refused in open()
        self.refused: dict[str, str] = {}
        #: partition -> why, for the partitions the task refused in open() (damaged)
        self.refused_partitions: dict[TopicPartition, str] = {}

    def assignment(self) -> list[TopicPartition]:
        return list(self._assignment)

    def add_assignment(self, partitions: Sequence[TopicPartition]) -> None:
        """Partitions the worker assigns while the task runs (before it ``open()``s them)."""
        self._assignment.extend(p for p in partitions if p not in self._assignment)

    def offset(self, offsets: Mapping[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            if int(off) < 0 and int(off) != OFFSET_BEGINNING:
                raise ValueError(f"{tp}: start offset must be >= 0 or OFFSET_BEGINNING, got {off}")
            self.requested_offsets[tp] = int(off)

    def request_stop(self) -> None:
        """Ask the worker to stop this task after the current batch (a bounded job is done)."""
        self.stop_requested = True

    def refuse_topic(self, topic: str, recorded_id: str) -> None:
        """Inside ``open()``: ``topic`` is not the topic the task has on record (``recorded_id``
        is not ``topic_ids[topic]``: it was deleted and created again). The worker stops it alone
        (one line naming both ids; none of its partitions is read, the other topics go on)."""
        self.refused[topic] = recorded_id

    def refuse_partition(self, tp: TopicPartition, why: str) -> None:
        """Inside ``open()``: the task cannot take records of ``tp`` (the store sink: its
        partition is damaged). The worker leaves it unassigned (none of its records is fetched,
        so none is skipped), says so in one line and goes on with the others; the app names it
        at the end (kcompact's addition to Connect's API)."""
        self.refused_partitions[tp] = why


class SourceTaskContext:
    """Given to a source task: the offsets the worker stored for its source partitions."""

    def __init__(self, offsets: Mapping[str, Mapping[str, Any]] | None = None):
        self._offsets = dict(offsets or {})

    def offset(self, source_partition: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return self._offsets.get(source_partition_key(source_partition))


def source_partition_key(source_partition: Mapping[str, Any]) -> str:
    """The canonical text of a source partition (how offsets are keyed in storage)."""
    return json.dumps(dict(source_partition), sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# connectors


class Connector(abc.ABC):
    """Base of every connector. Subclasses set ``CONFIG`` (their :class:`ConfigDef`)."""

    #: The connector's own keys; the worker adds the common ones (name, tasks.max, converters,
    #: errors.*) before validating.
    CONFIG: ConfigDef = ConfigDef()

    def __init__(self) -> None:
        self.props: dict[str, Any] = {}

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("kcompact")
        except PackageNotFoundError:
            return "unknown"

    @classmethod
    def config(cls) -> ConfigDef:
        return cls.CONFIG

    def start(self, props: Mapping[str, Any]) -> None:
        """Called once with the validated properties."""
        self.props = dict(props)

    @abc.abstractmethod
    def task_class(self) -> type["Task"]:
        ...

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        """One config per task, at most ``max_tasks`` (Connect's ``taskConfigs``). The default
        gives every task the connector's properties plus ``task.id``."""
        return [dict(self.props, **{"task.id": i}) for i in range(max(1, max_tasks))]

    # Connect's Java spelling, for people porting connectors.
    def taskConfigs(self, max_tasks: int) -> list[dict[str, Any]]:  # noqa: N802
        return self.task_configs(max_tasks)

    def stop(self) -> None:
        """Called once when the connector stops."""


class SinkConnector(Connector):
    """A connector whose tasks read Kafka topics (``topics``) and write somewhere else."""

    #: The consumer settings the worker made for this connector (``bootstrap.servers``, the
    #: worker's ``consumer.*`` and the connector's ``consumer.override.*``), set before
    #: ``start``: for a connector that talks to Kafka itself (the store sink reads its topics'
    #: configs with them).
    kafka_conf: Mapping[str, Any] | None = None

    def select_partitions(self, topic: str, partitions: Sequence[int]) -> list[int]:
        """Which of a topic's partitions this connector reads (default: all of them). Called
        for every topic before :meth:`partitions_selected`: it checks, it creates nothing."""
        return list(partitions)

    def partitions_selected(self, selected: Mapping[str, Sequence[int]]) -> None:
        """Every topic's selected partitions, once all were selected and before any task
        starts: where a connector creates what it needs for them (default: nothing)."""


class SourceConnector(Connector):
    """A connector whose tasks read somewhere else and produce records into Kafka."""


# ---------------------------------------------------------------------------------------------
# tasks


class Task(abc.ABC):
    def version(self) -> str:
        return Connector.version(self)  # type: ignore[arg-type]

    @abc.abstractmethod
    def start(self, props: Mapping[str, Any]) -> None:
        ...

    @abc.abstractmethod
    def stop(self) -> None:
        ...


class SinkTask(Task):
    """Receives batches of records from the worker. ``context`` is set before ``start``."""

    context: SinkTaskContext

    def initialize(self, context: SinkTaskContext) -> None:
        self.context = context

    def open(self, partitions: Sequence[TopicPartition]) -> None:
        """The worker assigned these partitions; call ``context.offset(...)`` to pick where each
        starts."""

    @abc.abstractmethod
    def put(self, records: SinkRecords) -> None:
        """Write (or buffer) the batch. Raise :class:`RetriableError` to get it again later."""

    def flush(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Make everything put so far durable. ``offsets`` = next offset per partition."""

    def pre_commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Flush, and return the offsets the worker may commit to the consumer group.

        Sinks that keep their own position (the store sink) return ``{}``: the worker then
        commits nothing, and the group's offsets play no part in a restart.
        """
        self.flush(offsets)
        return dict(offsets)

    def close(self, partitions: Sequence[TopicPartition]) -> None:
        """The partitions are no longer assigned (after a final flush)."""

    def partition_done(self, tp: TopicPartition) -> None:
        """Bounded runs only: ``tp`` reached the end offset seen when the run started."""


class SourceTask(Task):
    """Produces records for Kafka. ``context`` is set before ``start``."""

    context: SourceTaskContext

    def initialize(self, context: SourceTaskContext) -> None:
        self.context = context

    @abc.abstractmethod
    def poll(self) -> list[SourceRecord] | None:
        """Records to produce now; None or [] when there is nothing yet. Must not block long.
        Return None after ``stop_when_idle`` work is done to let a bounded run finish."""

    def commit(self) -> None:
        """Every record returned by poll so far has been acknowledged by Kafka."""

    def commit_record(self, record: SourceRecord, metadata: tuple[int, int] | None) -> None:
        """One record was acknowledged: ``metadata`` = (partition, offset), None when it was
        dropped by errors.tolerance=all."""

    def finished(self) -> bool:
        """Bounded sources return True once poll has returned everything."""
        return False
