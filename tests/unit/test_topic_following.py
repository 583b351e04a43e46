"""A following sink task and topic ids (connectors/framework/topic_watch.py, TopicFollowing;
issue 21).

* Every batch is stored only after its topics' ids were confirmed by a lookup made after it was
  fetched: back-to-back full batches included (an earlier version skipped the lookup for a full
  batch right behind another, a window a recreated topic could slip through). The runner is the
  real one, its watcher the real TopicWatcher with the id lookup (describe_topics) replaced by a
  counter over a dict, so no broker is needed; the end-to-end behaviour is tested on Apache Kafka
  in tests/integration/test_estate.py.
* The store sink's ``open()`` records the ids and partitions of what it is given (a topic picked
  up while following), and refuses a topic recorded under another id.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from kcompact.connectors.framework.api import (SinkRecords, SinkTask, SinkTaskContext,
                                               TopicPartition)
from kcompact.connectors.framework.converters import make_converter
from kcompact.connectors.framework.errors_handling import ErrorHandler
from kcompact.connectors.framework.kafka_clients import KafkaSettings
from kcompact.connectors.framework.sink_runner import SinkTaskRunner
from kcompact.connectors.framework.topic_watch import TopicWatcher
from kcompact.connectors.plugins.store_sink import StoreSinkTask
from kcompact.reput import Store

BATCH = 100


class Recorder(SinkTask):
    def __init__(self):
        self.batches: list[tuple[str, int]] = []
        self.closed: list[TopicPartition] = []

    def start(self, props):
        pass

    def put(self, records: SinkRecords) -> None:
        self.batches.append((records.topics[0], len(records)))

    def close(self, partitions):
        self.closed.extend(partitions)

    def stop(self):
        pass


class CountingWatcher(TopicWatcher):
    """The real watcher; its id lookup answers from ``current`` and counts the calls."""

    def __init__(self, ids: dict[str, str]):
        super().__init__({"bootstrap.servers": "127.0.0.1:9"}, {t: 1 for t in ids},
                         connector="t")
        self.current = dict(ids)
        self.ids = dict(ids)  # what start() records
        self.lookups = 0

    def _topic_ids(self, topics):
        self.lookups += 1
        return ({t: self.current[t] for t in topics if t in self.current},
                {t for t in topics if t not in self.current})


def _runner(topics: list[str]) -> tuple[SinkTaskRunner, Recorder, CountingWatcher]:
    task = Recorder()
    assignment = [TopicPartition(t, 0) for t in topics]
    r = SinkTaskRunner(
        connector="t", task_id=0, task=task, props={}, assignment=assignment,
        consumer_conf={}, key_converter=make_converter("ByteArrayConverter", {}, is_key=True),
        value_converter=make_converter("ByteArrayConverter", {}, is_key=False),
        errors=ErrorHandler({}, connector="t", task_id=0), follow=True, batch_max=BATCH,
        flush_interval_ms=5000, stop=threading.Event(), startup_timeout=1.0,
        settings=KafkaSettings({}))
    task.initialize(SinkTaskContext(assignment))
    r.watcher = CountingWatcher({t: f"id-{t}" for t in topics})
    return r, task, r.watcher


def _deliver(r: SinkTaskRunner, topics: list[str], start: int) -> None:
    """One full batch (``BATCH`` records) as the consumer hands it to the runner."""
    n = len(topics)
    offs = np.arange(start, start + n, dtype=np.int64)
    r._deliver(list(topics), len(set(topics)) == 1, np.zeros(n, np.int32), offs,
               np.zeros(n, np.int64), [b"k"] * n, [b"v"] * n, [None] * n, None, None)


def test_every_full_batch_is_confirmed_back_to_back():
    r, task, w = _runner(["orders"])
    for i in range(20):  # full batches, one right behind the other
        _deliver(r, ["orders"] * BATCH, i * BATCH)
    assert len(task.batches) == 20
    assert w.lookups == 20  # one id lookup per batch, none skipped
    # the topic is recreated between two full batches: the next one is dropped, the topic stopped
    w.current["orders"] = "id-new"
    _deliver(r, ["orders"] * BATCH, 20 * BATCH)
    assert len(task.batches) == 20
    assert w.lookups == 21
    assert r.metrics.stopped == {
        "orders": "deleted and created again (topic id id-orders -> id-new)"}
    assert task.closed == [TopicPartition("orders", 0)]


def test_a_batch_of_two_topics_confirms_both_and_keeps_the_other():
    r, task, w = _runner(["a", "b"])
    for i in range(5):
        _deliver(r, ["a", "b"] * (BATCH // 2), i * BATCH)
    assert w.lookups == 5 and len(task.batches) == 5
    w.current["a"] = "id-a2"
    _deliver(r, ["a", "b"] * (BATCH // 2), 5 * BATCH)
    assert w.lookups == 6
    assert list(r.metrics.stopped) == ["a"]
    assert task.batches[-1] == ("b", BATCH // 2)  # a's records dropped, b's stored
    _deliver(r, ["b"] * BATCH, 6 * BATCH)
    assert w.lookups == 7 and task.batches[-1] == ("b", BATCH)


def test_store_sink_open_records_ids_and_partitions_and_refuses_another_id(tmp_path):
    url = str(tmp_path / "store")
    Store.open(url, create=True).close()

    def task_with(ids: dict[str, str], writer: str) -> tuple[StoreSinkTask, SinkTaskContext]:
        task, ctx = StoreSinkTask(), SinkTaskContext()
        task.initialize(ctx)
        ctx.topic_ids.update(ids)
        task.start({"store.url": url, "store.writer": writer})
        return task, ctx

    task, ctx = task_with({"b": "id-1"}, "w1")
    try:
        task.open([TopicPartition("b", 0), TopicPartition("b", 1)])  # picked up while following
        assert ctx.refused == {}
        assert set(ctx.requested_offsets) == {TopicPartition("b", 0), TopicPartition("b", 1)}
    finally:
        task.stop()
    doc = json.loads((tmp_path / "store" / "store.json").read_text())
    assert doc["topic_ids"] == {"b": "id-1"}
    assert doc["partitions"] == {"b": [0, 1]}

    task, ctx = task_with({"b": "id-2", "c": "id-c"}, "w2")
    try:
        task.open([TopicPartition("b", 0), TopicPartition("c", 0)])
        assert ctx.refused == {"b": "id-1"}  # the worker stops b alone
        assert set(ctx.requested_offsets) == {TopicPartition("c", 0)}
    finally:
        task.stop()
    doc = json.loads((tmp_path / "store" / "store.json").read_text())
    assert doc["topic_ids"] == {"b": "id-1", "c": "id-c"}
    assert doc["partitions"] == {"b": [0, 1], "c": [0]}
