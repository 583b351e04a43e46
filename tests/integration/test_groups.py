"""Consumer groups resume where they were (issue 42), on a real Apache Kafka 3.9.1.

* Groups committed on the source mid-partition, at the end, and on an offset that compaction
  then removes (plus a group not named, and one with an active member on the target) are kept
  by ``kcompact mirror``, shown by ``kcompact groups``; after ``kcompact compact`` a
  ``kcompact restore --groups`` into another topic commits each named group's position so that a
  member subscribing on the target receives exactly the restored records at or after its source
  position (the model: the store's records, latest per key, in offset order); the group not
  named is not written; the group with an active member is skipped with one line.
* A restore SIGKILLed part-way and run again commits positions at which each group receives
  exactly its records (no duplicate on Kafka: transactions), and a further rerun commits the
  same offsets again. The kept positions there are written through the capture writer, as a
  mirror writes them (docs/formats/group-offsets.md).
* ``--as-of``: positions as kept at or before TIME; the restored state as of TIME against a
  dict model on random workloads (hypothesis), and a TIME compaction cleaned past refused.
* ``--groups`` with ``--repartition`` is refused with one line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, Producer
from confluent_kafka import TopicPartition as TP

from kcompact.connectors.plugins.store_source.progress import StoreProgress
from kcompact.reput import Store
from kcompact.reput.record import RecordBatch
from kcompact.replication.group_capture import CaptureWriter
from topics import read_topic, restore_job  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SLOW = ("-X", "batch.num.messages=5", "-X", "linger.ms=0", "-X", "max.in.flight=1")


def kcompact(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def commit_on(admin, group: str, topic: str, offsets: dict[int, int]) -> None:
    tps = [TP(topic, p, o) for p, o in offsets.items()]
    admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)],
                                       request_timeout=15)[group].result(30)


def committed_on(admin, group: str, topic: str, partitions: int) -> dict[int, int]:
    req = ConsumerGroupTopicPartitions(group, [TP(topic, p) for p in range(partitions)])
    res = admin.list_consumer_group_offsets([req], request_timeout=15)[group].result(30)
    return {tp.partition: tp.offset for tp in res.topic_partitions if tp.offset >= 0}


def consume_as(bootstrap: str, group: str, topic: str, partitions: int
               ) -> dict[int, list[tuple]]:
    """What a member of ``group`` subscribing to ``topic`` receives from the group's committed
    positions to the end: partition -> [(key, value)] (nothing committed back)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "auto.offset.reset": "latest", "isolation.level": "read_committed",
                  "session.timeout.ms": 6000})
    out: dict[int, list[tuple]] = {p: [] for p in range(partitions)}
    eof: set[int] = set()
    c.subscribe([topic])
    deadline = time.monotonic() + 90
    try:
        while len(eof) < partitions:
            assert time.monotonic() < deadline, f"{group} did not reach the end of {topic}"
            for m in c.consume(1000, 0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(m.partition())
                    continue
                out[m.partition()].append((m.key(), m.value()))
    finally:
        c.close()
    return out


def latest_model(url: str, topic: str) -> dict[int, list[tuple]]:
    """The records a restore of ``topic`` into an existing topic produces, from the store's
    records alone: per partition the last record of each key (a tombstone too), keyless ones
    left out, in offset order: [(offset, key, value)]."""
    out = {}
    with Store.open(url) as st:
        for p in st.partitions(topic):
            last = {}
            for r in st.iter_records(topic, p):
                if r.key is not None:
                    last[r.key] = (r.offset, r.key, r.value)
            out[p] = sorted(last.values())
    return out


def tail(model: list[tuple], position: int) -> list[tuple]:
    return [(k, v) for o, k, v in model if o >= position]


class ActiveMember:
    """A member of ``group`` subscribed to ``topic`` on the target, polling in a thread."""

    def __init__(self, bootstrap: str, group: str, topic: str):
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                           "enable.auto.commit": False, "auto.offset.reset": "latest",
                           "session.timeout.ms": 6000})
        self.c.subscribe([topic])
        self.stop = threading.Event()
        self.assigned = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.c.poll(0.2)
            if self.c.assignment():
                self.assigned.set()

    def close(self) -> None:
        self.stop.set()
        self.t.join(10)
        self.c.close()


def test_groups_resume_exactly_on_the_restored_topic(apache_kafka, make_topic, tmp_path):
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    src = make_topic(2)
    rng = random.Random(42)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    sent: dict[int, list[tuple]] = {0: [], 1: []}
    for i in range(400):
        part = i % 2
        key = b"k%d" % rng.randrange(25)
        value = None if rng.random() < 0.1 else b"v%d" % i
        p.produce(src, value, key, part)
        sent[part].append((len(sent[part]), key, value))
    assert p.flush(30) == 0
    # a position whose record a later record of its key replaces (compaction removes it)
    removed = next(o for o, k, _ in sent[0] if any(k2 == k for o2, k2, _ in sent[0] if o2 > o)
                   and o > 20)
    groups = {"g-mid": {0: 77, 1: 120}, "g-end": {0: 200, 1: 200},
              "g-removed": {0: removed, 1: 3}, "other": {0: 10, 1: 10}, "g-active": {0: 50}}
    for g, offs in groups.items():
        commit_on(admin, g, src, offs)

    url = str(tmp_path / "store")
    m = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", src, "--store", url,
                 "--engine", "local")
    assert m.returncode == 0, m.stderr
    assert "group offsets captured 2 times" in m.stderr, m.stderr

    shown = kcompact("groups", "--store", url, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    kept = {g["group"]: {r["partition"]: r["offset"] for r in g["partitions"]}
            for g in doc["groups"]}
    assert kept == groups
    lag = {(g["group"], r["partition"]): r["lag"] for g in doc["groups"]
           for r in g["partitions"]}
    assert lag[("g-mid", 0)] == 200 - 77 and lag[("g-end", 1)] == 0
    text = kcompact("groups", "--store", url, "--group", "g-m.*")
    assert text.returncode == 0 and "g-mid" in text.stdout and "g-end" not in text.stdout

    c = kcompact("compact", "--store", url, "--force")
    assert c.returncode == 0, c.stderr
    with Store.open(url) as st:
        assert removed not in {r.offset for r in st.iter_records(src, 0)}
    # the Kafka endpoint serves the captured positions as they were on the source (OffsetFetch)
    assert served_positions(url, src, ("g-mid", "g-removed"), tmp_path) == \
        {g: groups[g] for g in ("g-mid", "g-removed")}

    target = make_topic(2)
    member = ActiveMember(bootstrap, "g-active", target)
    try:
        assert member.assigned.wait(30), "the active member never joined"
        r = kcompact("restore", "--store", url, "--topic", src, "--bootstrap-servers",
                     bootstrap, "--to-topic", target, "--groups", "g-.*",
                     "--exactly-once", "required")
    finally:
        member.close()
    assert r.returncode == 0, r.stderr
    assert "group 'g-active' has 1 active member(s)" in r.stderr, r.stderr
    model = latest_model(url, src)
    got = read_topic(bootstrap, target, 2, offsets=False)
    assert {q: [(k, v) for _, k, v, _ in rows] for q, rows in got.items()} == \
        {q: [(k, v) for _, k, v in rows] for q, rows in model.items()}
    for g in ("g-mid", "g-end", "g-removed"):
        received = consume_as(bootstrap, g, target, 2)
        for q in (0, 1):
            assert received[q] == tail(model[q], groups[g][q]), (g, q)
    assert committed_on(admin, "other", target, 2) == {}
    assert committed_on(admin, "g-active", target, 2) == {}


def served_positions(url: str, topic: str, names, work: Path) -> dict[str, dict[int, int]]:
    """Each group's committed offsets on ``topic`` as ``kcompact serve --kafka-listen`` over the
    store answers a consumer's OffsetFetch."""
    with open(work / "serve.log", "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kcompact", "serve", "--store", url,
                                 "--kafka-listen", "127.0.0.1:0"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err)
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("kafka endpoint listening on 127.0.0.1:"), \
            (line, (work / "serve.log").read_text())
        out = {}
        for g in names:
            c = Consumer({"bootstrap.servers": line.rsplit(" ", 1)[1].strip(), "group.id": g,
                          "enable.auto.commit": False})
            try:
                out[g] = {tp.partition: tp.offset
                          for tp in c.committed([TP(topic, 0), TP(topic, 1)], timeout=30)
                          if tp.offset >= 0}
            finally:
                c.close()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _store_with_groups(url: str, parts: int, n: int) -> dict[str, dict[int, int]]:
    """A store of ``n`` records per partition (keys overwritten, gaps), and kept positions
    written as a mirror writes them."""
    rng = random.Random(7)
    with Store.open(url, writer="w", create=True) as st:
        for q in range(parts):
            rows, off = [], 0
            for i in range(n):
                off += rng.choice((1, 1, 1, 3))
                rows.append((q, off, 1_700_000_000_000 + off,
                             b"q%d-k%d" % (q, rng.randrange(n)), b"v%d" % off))
            st.append(RecordBatch.from_records("orders", rows))
    groups = {f"g{i}": {q: rng.randrange(0, int(n * 1.6)) for q in range(parts)}
              for i in range(5)}
    w = CaptureWriter(url, "test-capture")
    try:
        w.capture([(g, "orders", q, o, "") for g, offs in groups.items()
                   for q, o in offs.items()])
    finally:
        w.close()
    return groups


def test_sigkilled_restore_rerun_commits_the_same_positions(apache_kafka, make_topic,
                                                            tmp_path):
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    url = str(tmp_path / "store")
    groups = _store_with_groups(url, 3, 20_000)
    target = f"it-groups-kill-{uuid.uuid4().hex[:8]}"
    args = ("restore", "--store", url, "--topic", "orders", "--bootstrap-servers", bootstrap,
            "--to-topic", target, "--chunk-records", "3000", "--groups", "g.*",
            "--exactly-once", "required", *SLOW)
    try:
        job = restore_job(bootstrap, url, target)

        def seq() -> int:
            prog = StoreProgress(url, job).read()
            return prog.seq if prog else 0

        kills = 0
        for pause in (0.0, 0.5):
            # killed once this run has recorded a chunk of its own (a fixed delay killed a run
            # that had recorded nothing yet on a loaded machine, and the rerun then had no
            # progress to continue from)
            before = seq()
            p = subprocess.Popen([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while seq() <= before and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(pause)
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
            p.wait(60)
        assert kills >= 1 and seq() > 0
        final = kcompact(*args, timeout=600)
        assert final.returncode == 0, final.stderr
        assert "continued from recorded progress" in final.stderr
        first = {g: committed_on(admin, g, target, 3) for g in groups}
        model = latest_model(url, "orders")
        for g, offs in groups.items():
            received = consume_as(bootstrap, g, target, 3)
            for q, o in offs.items():
                assert received[q] == tail(model[q], o), (g, q, o)
        again = kcompact(*args, timeout=300)
        assert again.returncode == 0, again.stderr
        assert {g: committed_on(admin, g, target, 3) for g in groups} == first
    finally:
        admin.delete_topics([target], operation_timeout=10)


def test_groups_as_of_a_time(apache_kafka, tmp_path):
    """Positions as kept at or before TIME: two captures, a restore as of a time between."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    url = str(tmp_path / "store")
    with Store.open(url, writer="w", create=True) as st:
        st.append(RecordBatch.from_records("orders", [
            (0, o, 1_000_000 + o, b"k%d" % o, b"v%d" % o) for o in range(50)]))
    w = CaptureWriter(url, "test-capture")
    try:
        w.capture([("g", "orders", 0, 10, "")], now_ms=2_000_000)
        w.capture([("g", "orders", 0, 30, "")], now_ms=3_000_000)
    finally:
        w.close()
    targets = []
    try:
        for when, want in (("2500000", 10), ("3000000", 30)):
            target = f"it-groups-asof-{uuid.uuid4().hex[:8]}"
            targets.append(target)
            r = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                         bootstrap, "--to-topic", target, "--groups", "g", "--as-of", when)
            assert r.returncode == 0, r.stderr
            # every record has a timestamp before both times: offsets 0..49 land at 0..49
            assert committed_on(admin, "g", target, 1) == {0: want}
        # a rerun of a job with another time is refused
        r = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                     bootstrap, "--to-topic", targets[0], "--groups", "g", "--as-of", "2600000")
        assert r.returncode == 1 and "was restored with the state as of" in r.stderr, r.stderr
        # before any capture: nothing kept then, nothing committed
        target = f"it-groups-asof-{uuid.uuid4().hex[:8]}"
        targets.append(target)
        r = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                     bootstrap, "--to-topic", target, "--groups", "g", "--as-of",
                     "1970-01-01T00:25:00Z")  # 1 500 000
        assert r.returncode == 0, r.stderr
        assert "no kept group position of store topic 'orders' matches" in r.stderr
        assert committed_on(admin, "g", target, 1) == {}
    finally:
        admin.delete_topics(targets, operation_timeout=10)


def test_groups_with_repartition_are_refused(tmp_path):
    r = kcompact("restore", "--store", str(tmp_path), "--topic", "t", "--bootstrap-servers",
                 "127.0.0.1:1", "--to-topic", "t2", "--groups", "g.*", "--repartition")
    assert r.returncode == 2
    assert "--groups cannot go with --repartition: records change partitions" in r.stderr


def _as_of_store(url: str, seed: int) -> tuple[dict[int, list], int]:
    """Two partitions of keyed and keyless records, tombstones, timestamps out of order, the
    first half compacted (a tiny map): (records per partition, the history horizon)."""
    from kcompact.compaction import CompactionOptions, Compactor
    from kcompact.compaction import history as H
    from kcompact.reput.config import ManualClock
    from kcompact.reput.record import Record
    rng = random.Random(seed)
    clock = ManualClock(1_700_000_000_000)
    recs: dict[int, list] = {0: [], 1: []}
    with Store.open(url, writer="w", create=True, clock=clock) as st:
        st.set_topic_config("orders", {"segment.bytes": 16384, "delete.retention.ms": 0})
        for half in range(2):
            batch = []
            for _ in range(150):
                q = rng.randrange(2)
                off = len(recs[q]) * 2
                key = None if rng.random() < 0.1 else b"q%d-k%d" % (q, rng.randrange(20))
                value = None if rng.random() < 0.2 else b"v%d" % off
                r = Record("orders", q, off, clock.ms() + rng.randint(-2000, 2000), key, value,
                           ())
                batch.append(r)
                recs[q].append(r)
            st.append(RecordBatch.from_records("orders", batch))
            st.flush()
            clock.advance(10_000)
            if half == 0:
                for q in (0, 1):
                    Compactor(st, CompactionOptions(offset_map_memory=4096, max_load=0.1),
                              clock).compact_partition("orders", q, force=True)
        horizon = H.exactness([st.partition("orders", q) for q in (0, 1)], 0).earliest_ms
    return recs, horizon


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_restore_as_of_matches_the_model(kafka_bootstrap, kafka_admin, tmp_path_factory, seed):
    """restore --as-of into a new topic: per partition each key's latest record at or before
    TIME (none when a tombstone; keyless left out, as a restore of the latest state), in
    offset order; a TIME before the history horizon is refused (exit 1, naming it)."""
    url = str(tmp_path_factory.mktemp("asof") / "store")
    recs, horizon = _as_of_store(url, seed)
    stamps = sorted({r.timestamp for rs in recs.values() for r in rs if r.timestamp >= horizon})
    rng = random.Random(seed)
    t = rng.choice(stamps)
    target = f"it-groups-restore-asof-{uuid.uuid4().hex[:8]}"
    try:
        r = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                     kafka_bootstrap, "--to-topic", target, "--as-of", str(t))
        assert r.returncode == 0, r.stderr
        got = read_topic(kafka_bootstrap, target, 2, offsets=False)
        for q in (0, 1):
            last = {}
            for x in recs[q]:
                if x.timestamp <= t and x.key is not None:
                    last[x.key] = x
            want = [(x.timestamp, x.key, x.value) for x in sorted(last.values(),
                                                                   key=lambda x: x.offset)
                    if x.value is not None]
            assert [(ts, k, v) for ts, k, v, _ in got[q]] == want, q
        early = f"it-groups-restore-asof-{uuid.uuid4().hex[:8]}"
        r = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                     kafka_bootstrap, "--to-topic", early, "--as-of", str(horizon - 1))
        assert r.returncode == 1 and "earliest time answered exactly" in r.stderr, r.stderr
        assert early not in kafka_admin.list_topics(timeout=10).topics  # nothing created
    finally:
        kafka_admin.delete_topics([target], operation_timeout=10)


def test_source_without_the_group_apis_is_one_warning(tmp_path):
    """kcompact's own Kafka endpoint as the source: it serves no ListGroups, so the mirror says
    so in one line and copies the records."""
    from test_kafka_endpoint import Endpoint
    src = str(tmp_path / "src")
    with Store.open(src, writer="w", create=True) as st:
        st.append(RecordBatch.from_records("orders", [
            (0, o, 1_700_000_000_000 + o, b"k%d" % o, b"v") for o in range(20)]))
    ep = Endpoint(src, log=tmp_path / "endpoint.log").start()
    try:
        dst = str(tmp_path / "dst")
        r = kcompact("mirror", "--bootstrap-servers", ep.bootstrap, "--topic", "orders",
                     "--store", dst, "--engine", "local")
    finally:
        ep.stop()
    assert r.returncode == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "consumer group" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("mirror: warning: "), r.stderr
    assert "mirroring without group offsets" in warnings[0]
    with Store.open(dst) as st:
        assert len(list(st.iter_records("orders", 0))) == 20
    g = kcompact("groups", "--store", dst)
    assert g.returncode == 0 and "no consumer group positions kept" in g.stdout


def test_following_mirror_captures_every_interval(apache_kafka, make_topic, tmp_path):
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    src = make_topic(1)
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(30):
        p.produce(src, b"v%d" % i, b"k%d" % i)
    assert p.flush(30) == 0
    commit_on(admin, "follower", src, {0: 5})
    commit_on(admin, "left-out", src, {0: 6})
    url = str(tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "mirror", "--bootstrap-servers",
                             bootstrap, "--topic", src, "--store", url, "--follow",
                             "--exclude-groups", "left-.*",
                             "--sync-group-offsets-interval-ms", "1000"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)

    def kept() -> dict:
        r = kcompact("groups", "--store", url, "--json")
        if r.returncode != 0:
            return {}
        return {g["group"]: g["partitions"][0]["offset"] for g in json.loads(r.stdout)["groups"]}
    try:
        deadline = time.monotonic() + 60
        while kept().get("follower") != 5:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.5)
        commit_on(admin, "follower", src, {0: 25})
        while kept().get("follower") != 25:  # the next capture, a second later
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
        assert "left-out" not in kept()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
