"""Per-task metrics of the Connect-style worker (``TaskMetrics``,
connectors/framework/task_runner.py) against a real broker: records, bytes (key + value) and lag per
partition (high watermark - position), mid-run and at the end, and the metrics line the worker
prints every ``metrics.log.interval.ms``.

To look at a run mid-way without depending on timing, the store sink's task is wrapped so that
its second ``put()`` waits for the test: the worker has then counted exactly the first batch,
and the rest of the topic is lag."""

from __future__ import annotations

import io
import threading
import time

from confluent_kafka import Producer

from kcompact.connectors.framework.api import TopicPartition
from kcompact.connectors.plugins.store_sink import StoreSinkConnector, StoreSinkTask
from kcompact.connectors.framework.worker import Worker
from kcompact.reput import Store

N = 1000
BATCH = 100
LIVENESS_S = 60.0

entered = threading.Event()   # the task's second put() started
release = threading.Event()   # the test is done looking


class GatedTask(StoreSinkTask):
    puts = 0

    def put(self, records) -> None:
        GatedTask.puts += 1
        if GatedTask.puts == 2:
            entered.set()
            release.wait(LIVENESS_S)
        super().put(records)


class GatedStoreSink(StoreSinkConnector):
    def task_class(self):
        return GatedTask


def _records():
    """(key, value) of offsets 0..N-1: keys of 0-9 bytes or null, values of 0-199 bytes or
    null (tombstones), so the byte count is not a multiple of anything."""
    out = []
    for i in range(N):
        key = None if i % 13 == 0 else b"k" * (i % 10)
        value = None if i % 17 == 0 else bytes([i % 251]) * (i % 200)
        out.append((key, value))
    return out


def _size(rows) -> int:
    return sum(len(k or b"") + len(v or b"") for k, v in rows)


def test_task_metrics_report_records_bytes_and_lag(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    rows = _records()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for key, value in rows:
        p.produce(topic, key=key, value=value, partition=0)
    assert p.flush(30) == 0

    GatedTask.puts = 0
    entered.clear()
    release.clear()
    log = io.StringIO()
    w = Worker({"bootstrap.servers": kafka_bootstrap, "metrics.log.interval.ms": 50}, log=log)
    w.add_connector({"name": "metrics", "connector.class": f"{__name__}.GatedStoreSink",
                     "topics": topic, "store.url": str(tmp_path / "store"),
                     "follow": "false", "batch.max.records": str(BATCH)})
    failure: list[BaseException] = []

    def run() -> None:
        try:
            w.run()
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failure.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    tp = TopicPartition(topic, 0)
    try:
        assert entered.wait(LIVENESS_S), (failure, log.getvalue())
        (runner,) = w.runners
        m = runner.metrics
        # exactly the first batch is counted: records from offset 0, their key + value bytes
        first = m.records
        assert 0 < first <= BATCH
        assert m.position[tp] == first
        assert m.bytes == _size(rows[:first])
        # the high watermark came with the fetch; the rest of the topic is lag
        assert m.high_watermark[tp] == N
        assert m.lag() == {tp: N - first}
        assert m.errors == 0 and m.skipped == 0
        # ... and the worker prints it (the line is printed while the task waits)
        deadline = time.monotonic() + LIVENESS_S
        want = f"kcompact: metrics-0: {first} records ("
        while not any(ln.startswith(want) and f"lag {N - first}, errors 0" in ln
                      for ln in log.getvalue().splitlines()):
            assert time.monotonic() < deadline, log.getvalue()
            time.sleep(0.02)
    finally:
        release.set()
        t.join(LIVENESS_S)
    assert not t.is_alive() and failure == [], failure

    # at the end: every record and byte, no lag
    assert m.records == N and m.position[tp] == N
    assert m.bytes == _size(rows)
    assert m.lag() == {tp: 0}
    assert tp in m.done
    summary = m.summary()
    assert summary.startswith(f"metrics-0: {N} records (") and "lag 0, errors 0" in summary
    with Store.open(str(tmp_path / "store")) as s:
        assert [(r.key, r.value) for r in s.iter_records(topic, 0)] == rows
