"""The key-value map following a real Kafka-compatible broker (``kafka_bootstrap`` fixture).

The store holds the first part of a topic (as a mirror would: same partitions, offsets and
timestamps); the map is built from it, then catches up and follows straight from the topic,
tombstones and keyless records included, and must equal the dict model of every record.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from confluent_kafka import Producer

from kcompact.connectors.apps.kv import KVMap, build_map
from kcompact.reput import RecordBatch, Store, WriterOptions


def model(records) -> dict[bytes, bytes]:
    """Keys live in one partition each here: the last record of a key wins, tombstones delete."""
    out: dict[bytes, bytes | None] = {}
    for _p, _off, _ts, k, v in sorted(records, key=lambda r: (r[0], r[1])):
        if k is not None:
            out[k] = v
    return {k: v for k, v in out.items() if v is not None}


def produce(bootstrap: str, topic: str, rows, partitions: int) -> list[tuple]:
    """Produce (key id, kind) rows; returns (partition, offset, timestamp, key, value) as the
    broker stored them (from the delivery reports)."""
    got: list[tuple] = []

    def on_delivery(err, msg):
        assert err is None, err
        got.append((msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(), msg.value()))

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for i, (k, kind) in enumerate(rows):
        part = k % partitions
        key = None if kind == "keyless" else b"user-%04d" % k
        value = None if kind == "tomb" else b"" if kind == "empty" else b"v%d-%d" % (k, i)
        p.produce(topic, value=value, key=key, partition=part, on_delivery=on_delivery)
        if i % 500 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    return got


def rows(n: int, keys: int, seed: int):
    rng = random.Random(seed)
    return [(rng.randrange(keys), rng.choices(["put", "tomb", "keyless", "empty"],
                                              [80, 12, 4, 4])[0]) for _ in range(n)]


def mirror_into_store(path: str, topic: str, records) -> None:
    """What `kcompact mirror` would have stored: the records, with their Kafka offsets."""
    with Store.open(path, writer="m", create=True, options=WriterOptions(fsync="never")) as st:
        by_part: dict[int, list] = {}
        for r in sorted(records, key=lambda r: (r[0], r[1])):
            by_part.setdefault(r[0], []).append(r)
        for part_rows in by_part.values():
            st.append(RecordBatch.from_records(topic, part_rows))
        st.flush()


def ends(records) -> dict[int, int]:
    out: dict[int, int] = {}
    for p, off, *_ in records:
        out[p] = max(out.get(p, 0), off + 1)
    return out


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_build_from_store_then_catch_up_from_kafka(any_broker, make_topic, tmp_path):
    """The Kafka part read as columns by kcompact's own consumer; on the session broker and a
    real Kafka."""
    kafka_bootstrap = any_broker.bootstrap
    topic = make_topic(partitions=3)
    first = produce(kafka_bootstrap, topic, rows(3000, 300, 1), 3)
    second = produce(kafka_bootstrap, topic, rows(2000, 300, 2), 3)
    store, db = str(tmp_path / "store"), str(tmp_path / "db")
    mirror_into_store(store, topic, first)
    rep = build_map(db, store, topic, bootstrap_servers=kafka_bootstrap)
    assert rep["mode"] == "bulk"
    with KVMap(db) as m:
        assert dict(m.items()) == model(first + second)
        assert len(m) == len(model(first + second))
        assert m.offsets() == ends(first + second)
        assert m.stats()["records"] == len(first) + len(second)
        assert m.stats()["keyless"] == sum(1 for r in first + second if r[3] is None)
        assert m.source["kafka_cluster_id"] and m.source["store_id"]


def test_follow_kafka_topic_with_tombstones(any_broker, make_topic, tmp_path):
    kafka_bootstrap = any_broker.bootstrap
    topic = make_topic(partitions=2)
    first = produce(kafka_bootstrap, topic, rows(1000, 100, 3), 2)
    store, db = str(tmp_path / "store"), str(tmp_path / "db")
    mirror_into_store(store, topic, first[: len(first) // 2])
    with KVMap(db, create=True) as m:
        f = m.follow(store, topic, bootstrap_servers=kafka_bootstrap)
        assert f.wait_caught_up(60)
        assert dict(m.items()) == model(first)
        live = sorted(model(first))
        # delete half the live keys, re-create a few, update others
        more = [(int(k[5:]), "tomb") for k in live[::2]] + [(int(k[5:]), "put") for k in live[:6]]
        more += rows(500, 100, 4)
        second = produce(kafka_bootstrap, topic, more, 2)
        wait_until(lambda: m.offsets() == ends(first + second))
        assert dict(m.items()) == model(first + second)
        assert len(m) == len(model(first + second))
        f.stop()
    with KVMap(db) as m:
        assert m.stats()["records"] == len(first) + len(second)


def test_cli_follow_kafka_stops_cleanly_on_sigterm(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    first = produce(kafka_bootstrap, topic, rows(500, 50, 5), 2)
    store, db = str(tmp_path / "store"), str(tmp_path / "db")
    mirror_into_store(store, topic, first)
    log = open(tmp_path / "err.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kcompact", "kv", "build", "--store", store, "--topic", topic,
         "--db", db, "--follow", "--bootstrap-servers", kafka_bootstrap],
        stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_until(lambda: "following" in (tmp_path / "err.log").read_text(), 90)
        second = produce(kafka_bootstrap, topic, rows(300, 50, 6) + [(1, "tomb"), (2, "tomb")], 2)
        want = ends(first + second)
        wait_until(lambda: _applied(tmp_path) >= len(second), 60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "err.log").read_text()
    assert "keys of topic" in out
    with KVMap(db) as m:
        assert m.offsets() == want
        assert dict(m.items()) == model(first + second)


def _applied(tmp_path) -> int:
    n = 0
    for line in (tmp_path / "err.log").read_text().splitlines():
        if line.startswith("kv build: applied "):
            n += int(line.split()[3].replace(",", ""))
    return n
