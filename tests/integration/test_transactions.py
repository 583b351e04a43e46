"""Kafka semantics that only a real broker shows, on the session broker and on a real Apache
Kafka in turn (``any_broker``): a transactional producer commits and aborts batches in turn, and
the mirror, ``kv build --follow --bootstrap-servers`` and the store sink under
``connect standalone`` keep exactly the committed records, with the control records and the
aborted offsets as gaps. On Tansu, which delivers aborted records as committed
(BROKER_NOTES.md), the same tests pin that quirk instead.

Real Kafka only (``apache_kafka``): a restored topic's configs read back with describe_configs,
a topic deleted and recreated between two mirrors (a partition added while ``--follow`` runs,
and topics deleted or recreated under it: test_estate.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import ConfigResource

from kcompact.connectors.apps.kv import KVMap
from kcompact.connectors.apps.mirror import mirror_local
from kcompact.reput import RecordBatch, Store
from topics import read_store, read_topic  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TS0 = 1_700_000_000_000


def kcompact(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def transactions(bootstrap: str, topic: str, partitions: int, txns: int, *, per_txn: int = 6,
                 keys: int = 5, tag: str = "t", first_aborted: bool = False,
                 last_aborted: bool = True) -> tuple[list[tuple], list[tuple]]:
    """``txns`` transactions, committed and aborted in turn (the last one aborted unless
    ``last_aborted`` is False), each
    writing ``per_txn`` records over every partition; values say which transaction wrote them.
    Returns (committed, aborted) as (partition, offset, timestamp, key, value) from the delivery
    reports. librdkafka 2.16 can fail ``abort_transaction`` right after a commit with
    INVALID_TXN_STATE (librdkafka issue 4849): ``flush()`` before aborting avoids it."""
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}-{tag}",
                  "linger.ms": 2})
    p.init_transactions(60)
    committed: list[tuple] = []
    aborted: list[tuple] = []
    for t in range(txns):
        abort = (t % 2 == 0) == first_aborted or (last_aborted and t == txns - 1)
        sent: list[tuple] = []

        def cb(err, msg, sent=sent):
            assert err is None, err
            sent.append((msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(),
                         msg.value()))
        p.begin_transaction()
        for i in range(per_txn):
            # a key lives in one partition, as the partitioner makes (the sentinel in 0)
            k = (t * 3 + i) % keys if tag != "z" else 0
            key = b"k%d" % k if tag != "z" else b"sentinel"
            p.produce(topic, key=key, value=b"%s%d-%s-%d" % (tag.encode(), t,
                                                              b"A" if abort else b"C", i),
                      partition=k % partitions, timestamp=TS0 + t * 100 + i, on_delivery=cb)
        p.flush(60)
        if abort:
            p.abort_transaction(60)
            aborted += sent
        else:
            p.commit_transaction(60)
            committed += sent
    return committed, aborted


def by_partition(rows: list[tuple], partitions: int) -> dict[int, list[tuple]]:
    """(partition, offset, ts, key, value) rows -> partition: [(offset, ts, key, value, ())]."""
    out: dict[int, list[tuple]] = {p: [] for p in range(partitions)}
    for part, off, ts, k, v in sorted(rows, key=lambda r: (r[0], r[1])):
        out[part].append((off, ts, k, v, ()))
    return out


def latest(rows: list[tuple]) -> dict[bytes, bytes]:
    last: dict[bytes, bytes | None] = {}
    for _p, _off, _ts, k, v in sorted(rows, key=lambda r: (r[0], r[1])):
        last[k] = v
    return {k: v for k, v in last.items() if v is not None}


def wait_until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:.0f}s"
        time.sleep(0.05)


# -- the mirror ------------------------------------------------------------------------------------


def test_mirror_keeps_exactly_the_committed_records(any_broker, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    committed, aborted = transactions(any_broker.bootstrap, topic, 2, 7)
    store = str(tmp_path / "s")
    res = mirror_local(any_broker.bootstrap, topic, store, out=io.StringIO(),
                       handle_signals=False)
    stored = read_store(store, topic)
    delivered = read_topic(any_broker.bootstrap, topic, 2)
    assert stored == delivered  # the store holds what a read_committed consumer sees
    if any_broker.real_kafka:
        assert stored == by_partition(committed, 2) and res.records == len(committed)
        offsets = {(r[0], r[1]) for r in committed + aborted}
        for p, rows in stored.items():
            # gaps: every aborted record's offset, and a control record after each transaction
            held = [r[0] for r in rows]
            assert not {(p, o) for o in held} & {(r[0], r[1]) for r in aborted}
            assert len(held) < max(o for q, o in offsets if q == p) + 1 - sum(
                1 for r in aborted if r[0] == p)
        # the store's next offsets are the mirror's positions: past the trailing markers and
        # aborted records it stepped over (at most Kafka's end offsets: a marker that Kafka
        # had not written yet when the mirror ran is stepped over by the next run)
        def ends() -> list[tuple[int, int]]:
            c = Consumer({"bootstrap.servers": any_broker.bootstrap, "group.id": "ends",
                          "isolation.level": "read_committed"})
            try:
                return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                        for p in range(2)]
            finally:
                c.close()

        with Store.open(store) as st:
            for p in range(2):
                last = max(r[1] for r in committed if r[0] == p)
                assert last + 1 <= st.next_offset(topic, p) <= ends()[p]
        wait_until(lambda: ends() == [max(o for q, o in offsets if q == p) + 2
                                      for p in range(2)], what="the last markers written")
        # a rerun resumes there: nothing stored again, and the store ends where Kafka does
        assert mirror_local(any_broker.bootstrap, topic, store, out=io.StringIO(),
                            handle_signals=False).records == 0
        assert read_store(store, topic) == stored
        with Store.open(store) as st:
            assert [st.next_offset(topic, p) for p in range(2)] == ends()
    else:  # Tansu's quirk: aborted records are delivered, so they are mirrored
        assert res.records == len(committed) + len(aborted)
        assert stored == by_partition(committed + aborted, 2)


# -- the key-value map following Kafka -------------------------------------------------------


def test_kv_follow_from_kafka_applies_only_committed_records(any_broker, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    bootstrap = any_broker.bootstrap
    first_c, first_a = transactions(bootstrap, topic, 2, 4, tag="a")
    store, db = str(tmp_path / "store"), str(tmp_path / "db")
    mirror_local(bootstrap, topic, store, out=io.StringIO(), handle_signals=False)
    # what `kv build --follow --bootstrap-servers` runs: the map from the store, then Kafka
    with KVMap(db, create=True) as m:
        f = m.follow(store, topic, bootstrap_servers=bootstrap)
        try:
            assert f.wait_caught_up(60)
            more_c, more_a = transactions(bootstrap, topic, 2, 7, tag="b")
            # a committed sentinel last: once applied, everything before it was read
            end_c, _ = transactions(bootstrap, topic, 2, 2, per_txn=1, tag="z",
                                    first_aborted=True, last_aborted=False)
            wait_until(lambda: m.get(b"sentinel") == end_c[-1][4], 60, "the sentinel")
            got = dict(m.items())
        finally:
            f.stop()
    if any_broker.real_kafka:
        assert got == latest(first_c + more_c + end_c)
        assert not set(got.values()) & {r[4] for r in first_a + more_a}
    else:  # Tansu: the aborted records were delivered, and applied
        assert set(got.values()) & {r[4] for r in first_a + more_a}


# -- the store sink under connect standalone -------------------------------------------------


def test_standalone_store_sink_keeps_exactly_the_committed_records(any_broker, make_topic,
                                                                   tmp_path):
    topic = make_topic(partitions=3)
    committed, aborted = transactions(any_broker.bootstrap, topic, 3, 6, per_txn=9)
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={any_broker.bootstrap}\n")
    conn = tmp_path / "sink.properties"
    conn.write_text(f"name=tx-sink\nconnector.class=StoreSinkConnector\ntopics={topic}\n"
                    f"store.url={tmp_path / 's'}\nfollow=false\ntasks.max=2\n")
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 0, proc.stderr
    stored = read_store(str(tmp_path / "s"), topic)
    want = by_partition(committed if any_broker.real_kafka else committed + aborted, 3)
    assert stored == want


# -- restore: the target's configs, read back with describe_configs --------------------------------


def test_restore_creates_the_target_with_the_store_topic_configs(any_broker, tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, writer="w", create=True) as st:
        st.append(RecordBatch.from_records("orders", [
            (0, i, TS0 + i, b"k%d" % (i % 3), b"v%d" % i, ()) for i in range(10)]))
        st.set_topic_config("orders", {"cleanup.policy": "compact"})
    target = f"it-restore-configs-{time.monotonic_ns()}"
    try:
        res = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                       any_broker.bootstrap, "--to-topic", target)
        assert res.returncode == 0, res.stderr
        r = ConfigResource(ConfigResource.Type.TOPIC, target)
        configs = any_broker.admin.describe_configs([r])[r].result(timeout=30)
        assert configs["cleanup.policy"].value == "compact"
        if any_broker.real_kafka:  # Kafka describes every config, defaults included
            assert configs["delete.retention.ms"].value == "86400000"
            assert configs["delete.retention.ms"].is_default
        rows = read_topic(any_broker.bootstrap, target, 1, offsets=False)[0]
        assert sorted((k, v) for _, k, v, _ in rows) == [(b"k0", b"v9"), (b"k1", b"v7"),
                                                         (b"k2", b"v8")]
    finally:
        any_broker.admin.delete_topics([target], operation_timeout=10)


# -- real Kafka only: topics that change under the mirror ------------------------------------------


def _produce(bootstrap: str, topic: str, n: int, partition: int = 0, tag: bytes = b"v") -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    for i in range(n):
        p.produce(topic, key=b"k%d" % i, value=tag + b"%d" % i, partition=partition)
    assert p.flush(60) == 0


@pytest.mark.parametrize("ids", ["recorded", "before topic ids"])
def test_topic_deleted_and_recreated_under_the_mirror_is_a_clear_error(apache_kafka, make_topic,
                                                                       tmp_path, ids):
    """A mirror restarted on a topic deleted and created again refuses it and loses nothing:
    by its topic id (recorded in store.json by the first mirror), or, in a store written before
    topic ids were recorded, because the topic no longer holds the store's next offset."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    topic = make_topic(partitions=1)
    _produce(bootstrap, topic, 50)
    store = str(tmp_path / "s")
    assert kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic, "--store",
                    store, "--engine", "local").returncode == 0
    if ids == "before topic ids":
        path = os.path.join(store, "store.json")
        with open(path) as f:
            doc = json.load(f)
        assert topic in doc.pop("topic_ids")
        doc.pop("crc32c", None)  # as a kcompact before both wrote it
        with open(path, "w") as f:
            json.dump(doc, f)
    admin.delete_topics([topic], operation_timeout=30)[topic].result()
    from confluent_kafka.admin import NewTopic
    wait_until(lambda: _create(admin, NewTopic(topic, 1, 1)), 60, "the topic's re-creation")
    _produce(bootstrap, topic, 10, tag=b"new")
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic, "--store",
                   store, "--engine", "local")
    assert res.returncode == 1
    line = error_line(res)
    if ids == "recorded":
        assert f"topic '{topic}' was deleted and created again since store" in line, line
    else:
        assert "offset 50 is not in the topic any more" in line and "recreated" in line, line
    assert [r[0] for r in read_store(store, topic)[0]] == list(range(50))  # nothing lost
    again = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic, "--store",
                     store, "--engine", "local")  # the refusal recorded nothing that lets it in
    assert again.returncode == 1 and error_line(again) == line


def _create(admin, new) -> bool:
    try:
        admin.create_topics([new], operation_timeout=30)[new.topic].result()
        return True
    except Exception as e:  # noqa: BLE001 - the deletion is still in progress
        if "marked for deletion" in str(e) or "TOPIC_ALREADY_EXISTS" in str(e):
            time.sleep(0.5)
            return False
        raise
