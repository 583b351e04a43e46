"""Issue 25 against a real broker: compaction without --force.

* The issue's transcript: `kcompact mirror` (one-shot, local engine) rolls the active segment
  when it ends, `inspect` then shows the partition 1.00 dirty with its trigger, and a plain
  `kcompact compact` compacts it to one record per key.
* A followed small topic (the store sink with background compaction, what `mirror --follow` and
  `connect standalone` run) converges to one record per key within ``max.compaction.lag.ms`` plus
  one scheduler run, with an injected clock (a ManualClock in the task: the roll rule and the
  planner count time with it), on the session broker and on a real Apache Kafka.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import Producer

from kcompact.connectors.apps.options import mirror_props
from kcompact.connectors.framework.worker import Worker
from kcompact.connectors.plugins.store_sink import StoreSinkConnector, StoreSinkTask
from kcompact.reput import ManualClock, Store, verify_store

ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 120.0  # how long the mirror may take to get somewhere before the test gives up
LAG_MS = 60_000


def produce(bootstrap: str, topic: str, rows, ts: int | None = None) -> None:
    """rows: (key, value); one partition; timestamps ``ts`` (None: the producer's)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    errors: list = []
    for key, value in rows:
        p.produce(topic, key=key, value=value, partition=0, timestamp=ts or 0,
                  on_delivery=lambda err, _m: errors.append(err) if err else None)
        p.poll(0)
    assert p.flush(60) == 0 and not errors, errors


def kcompact(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.05)


def latest(rows: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    return dict(rows)


def stored(url: str, topic: str) -> list[tuple[int, bytes, bytes]]:
    with Store.open(url) as st:
        return [(r.offset, r.key, r.value) for r in st.iter_records(topic, 0)]


def test_mirror_then_plain_compact_compacts(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(1)
    rows = [(b"k%d" % (i % 200), b"%d:" % i + b"v" * 100) for i in range(2000)]
    produce(kafka_bootstrap, topic, rows)
    url = str(tmp_path / "s2")
    kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
             "--engine", "local")
    (part,) = json.loads(kcompact("inspect", "--store", url, "--json").stdout)[
        "topics"][0]["partitions"]
    assert part["records"] == 2000 and part["active_bytes"] == 0
    assert part["dirty_ratio"] == 1.0 and part["compaction_due"] == ["dirty ratio 1.00"]
    out = kcompact("compact", "--store", url, "--topic", topic).stdout
    assert out.startswith(f"{topic}-0 (dirty ratio 1.00): ")
    assert "kept 200 dropped 1,800 records" in out
    (part,) = json.loads(kcompact("inspect", "--store", url, "--json").stdout)[
        "topics"][0]["partitions"]
    assert part["records"] == 200 and part["dirty_ratio"] == 0.0
    assert part["compaction_horizon"] == 1999 and part["compaction_due"] == []
    assert part["last_compaction"]["reason"] == "dirty ratio 1.00"
    assert {k: v for _, k, v in stored(url, topic)} == latest(rows)
    text = kcompact("inspect", "--store", url).stdout.splitlines()
    assert text[2][text[1].index("DIRTY"):].split()[0] == "0.00"
    # a second one-shot mirror with nothing new leaves no empty segment behind
    kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
             "--engine", "local")
    assert "nothing to compact" in kcompact("compact", "--store", url).stdout


CLOCK = ManualClock()


class ClockedTask(StoreSinkTask):
    """The store sink task on the test's ManualClock."""

    clock = CLOCK


class ClockedSink(StoreSinkConnector):
    def task_class(self):
        return ClockedTask


def test_followed_small_topic_converges_within_max_compaction_lag(any_broker, make_topic,
                                                                   tmp_path):
    topic = make_topic(1)
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as st:
        st.set_topic_config(topic, {"max.compaction.lag.ms": LAG_MS})
    t0 = int(time.time() * 1000)
    CLOCK.now_ms = t0
    rows = [(b"k%d" % (i % 20), b"%d" % i) for i in range(200)]
    produce(any_broker.bootstrap, topic, rows, ts=t0)

    props = mirror_props(topic, url, partitions=None, follow=True, kafka_config={})
    props.update({"connector.class": f"{__name__}.ClockedSink",
                  "store.compaction.interval.ms": 100})
    worker = Worker({"bootstrap.servers": any_broker.bootstrap, "metrics.log.interval.ms": 0},
                    where="test", log=io.StringIO())
    worker.add_connector(props, where="mirror")
    thread = threading.Thread(target=worker.run, name="follow", daemon=True)
    thread.start()
    try:
        wait_until(lambda: worker.runners[0].task.store is not None
                   and len(stored(url, topic)) == 200, "the mirror to store every record")
        sched = worker.runners[0].task.scheduler
        runs = sched.runs
        wait_until(lambda: sched.runs >= runs + 2, "two scheduler runs")
        # the clock has not moved: the active segment is not due, nothing is compacted
        assert len(stored(url, topic)) == 200 and sched.results == []
        CLOCK.advance(LAG_MS + 1)
        runs = sched.runs
        wait_until(lambda: len(stored(url, topic)) == 20 and sched.results,
                   "the partition compacted to one record per key")
        # the run going when the clock moved may have read it before; the next one compacts
        assert sched.runs <= runs + 2
        (r,) = sched.results
        assert "max.compaction.lag.ms" in r.reason and sched.errors == []
        assert {k: v for _, k, v in stored(url, topic)} == latest(rows)
        # more updates after the roll land in the new active segment, and converge again
        produce(any_broker.bootstrap, topic, [(b"k0", b"new")], ts=CLOCK.ms())
        wait_until(lambda: len(stored(url, topic)) == 21, "the update mirrored")
        CLOCK.advance(LAG_MS + 1)
        wait_until(lambda: len(stored(url, topic)) == 20, "the update compacted")
        assert dict((k, v) for _, k, v in stored(url, topic))[b"k0"] == b"new"
    finally:
        worker.stop()
        thread.join(LIVENESS_S)
    assert not thread.is_alive()
    with Store.open(url) as st:
        assert verify_store(st).ok
