"""The sink runner's consumer positions (connectors/framework/sink_runner.py): what a bounded
mirror records as each partition's next offset.

A read_committed consumer never receives transaction markers or aborted records, so a partition
that ends in them ends at an offset past its last record: librdkafka's end-of-partition event
carries it. That event can come in the same consume() batch as the partition's last records, and
the runner handles a batch's events before its records; a record must then not move the position
back (it did: a bounded mirror of a partition ending in an aborted transaction stored next offset
12 instead of Kafka's 16, seen under load in tests/integration/test_kafka_endpoint_tails.py and
test_mirror.py::test_transaction_markers_leave_gaps).
"""

from __future__ import annotations

import threading

import numpy as np
from confluent_kafka import KafkaError

from kcompact.connectors.framework.api import SinkRecords, SinkTask, SinkTaskContext, TopicPartition
from kcompact.connectors.framework.converters import make_converter
from kcompact.connectors.framework.errors_handling import ErrorHandler
from kcompact.connectors.framework.kafka_clients import KafkaSettings
from kcompact.connectors.framework.kafka_columns import Event
from kcompact.connectors.framework.sink_runner import SinkTaskRunner

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


class Recorder(SinkTask):
    def __init__(self):
        self.offsets: list[int] = []
        self.done: list[TopicPartition] = []

    def start(self, props):
        pass

    def put(self, records: SinkRecords) -> None:
        self.offsets.extend(int(o) for o in records.offsets)

    def partition_done(self, tp):
        self.done.append(tp)

    def stop(self):
        pass


def _runner() -> tuple[SinkTaskRunner, Recorder]:
    task = Recorder()
    assignment = [A, B]
    r = SinkTaskRunner(
        connector="t", task_id=0, task=task, props={}, assignment=assignment,
        consumer_conf={}, key_converter=make_converter("ByteArrayConverter", {}, is_key=True),
        value_converter=make_converter("ByteArrayConverter", {}, is_key=False),
        errors=ErrorHandler({}, connector="t", task_id=0), follow=False, batch_max=100,
        flush_interval_ms=5000, stop=threading.Event(), startup_timeout=1.0,
        settings=KafkaSettings({}))
    task.initialize(SinkTaskContext(assignment))
    for tp in assignment:
        r.metrics.position[tp] = 0
    return r, task


def _deliver(r: SinkTaskRunner, parts: list[int], offs: list[int]) -> None:
    n = len(offs)
    r._deliver(["t"] * n, True, np.array(parts, np.int32), np.array(offs, np.int64),
               np.zeros(n, np.int64), [b"k"] * n, [b"v"] * n, [None] * n, None, None)


def _eof(tp: TopicPartition, offset: int) -> Event:
    return Event(tp.topic, tp.partition, offset, KafkaError._PARTITION_EOF, "end", False)


def test_the_end_of_partition_in_the_batch_of_the_last_records_is_kept():
    r, task = _runner()
    pending = {A, B}
    # one batch: B's records 0..11, and B's end-of-partition event at 16 (past three aborted
    # records and the abort marker); the runner handles events first
    r._events([_eof(B, 16)], pending)
    _deliver(r, [1] * 12, list(range(12)))
    assert task.offsets == list(range(12))
    assert r.metrics.position[B] == 16 and pending == {A} and task.done == [B]


def test_records_still_advance_the_position():
    r, _ = _runner()
    _deliver(r, [0] * 5, [0, 1, 2, 3, 4])
    assert r.metrics.position[A] == 5
    _deliver(r, [0, 0], [7, 9])  # a gap (a compacted source): after the last record
    assert r.metrics.position[A] == 10
    r._events([_eof(A, 12)], {A})  # a marker after it
    assert r.metrics.position[A] == 12


def test_two_topics_in_a_batch_do_not_move_back_either():
    r, _ = _runner()
    r._events([_eof(A, 9)], {A, B})
    n = 4
    r._deliver(["t", "u"] * (n // 2), False, np.zeros(n, np.int32),
               np.array([5, 0, 6, 1], np.int64), np.zeros(n, np.int64), [b"k"] * n,
               [b"v"] * n, [None] * n, None, None)
    assert r.metrics.position[A] == 9
    assert r.metrics.position[TopicPartition("u", 0)] == 2
