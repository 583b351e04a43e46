"""The batch pipeline on Spark with a real PySpark ``local[2]`` (issue 5): the Spark mirror equals
the local engine's, the ``kcompact`` data source equals a dict model of the topic, ``compact
--engine spark`` equals the local compaction, a task that fails once (an exception, or its Python
worker killed) and is retried leaves no duplicate, and ``kcompact mirror`` runs Spark by default.

One SparkSession for the module: starting the JVM takes ~20-30 s on a small loaded VM.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17", allow_module_level=True)

from kcompact.connectors import cli  # noqa: E402
from kcompact.connectors.mirror import mirror_local  # noqa: E402
from kcompact.connectors.spark_engine import (FAIL_ENV, SparkEngineError, mirror_with_spark,  # noqa: E402
                                     spark_session, spark_writer_id)
from kcompact.reput import Store, verify_store  # noqa: E402
from topics import read_store, read_topic  # noqa: E402

TS0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def spark():
    s = spark_session("local[2]")
    yield s
    s.stop()


# -- helpers -------------------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, records, **conf) -> None:
    """records: (partition, key, value, headers, timestamp) tuples, produced in order."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **conf})
    errors = []
    for part, key, value, headers, ts in records:
        while True:
            try:
                p.produce(topic, key=key, value=value, headers=headers, partition=part,
                          timestamp=ts, on_delivery=lambda e, _m: e and errors.append(e))
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(60) == 0 and not errors, errors


def produce_transaction(bootstrap: str, topic: str, records) -> None:
    """One committed transaction: its control marker leaves a gap in the source offsets."""
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": uuid.uuid4().hex})
    p.init_transactions(30)
    p.begin_transaction()
    for part, key, value, headers, ts in records:
        p.produce(topic, key=key, value=value, headers=headers, partition=part, timestamp=ts)
    p.commit_transaction(30)


def verified(url: str) -> bool:
    with Store.open(url) as st:
        report = verify_store(st)
    assert report.ok, report.problems
    return True


def writers(url: str) -> set[str]:
    return {d.name for d in (Path(url) / "commitlog").iterdir()}


def keyed_records(partitions: int, n: int, *, keys: int = 50, seed: int = 5) -> list[tuple]:
    """Updates of a few keys per partition with tombstones, empty values, keyless records,
    null/empty keys, headers (repeated names, null values) and explicit timestamps."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        key = None if r < 0.05 else b"" if r < 0.07 else b"key-%d" % rng.randrange(keys)
        v = rng.random()
        value = None if v < 0.15 else b"" if v < 0.2 else b"value-%d-" % i + bytes(
            rng.randrange(256) for _ in range(rng.randrange(40)))
        headers = [None, [("h", b"1")], [("h", b"1"), ("h", None), ("ü", b"")]][i % 3]
        out.append((rng.randrange(partitions), key, value, headers, TS0 + i * 11))
    return out


def latest_model(topic_records: dict[int, list[tuple]]) -> dict[tuple[int, bytes], tuple]:
    """Kafka compaction's view: the latest record per (partition, key); tombstoned keys and
    keyless records absent."""
    out: dict[tuple[int, bytes], tuple] = {}
    for p, recs in topic_records.items():
        for off, ts, key, value, headers in recs:
            if key is None:
                continue
            if value is None:
                out.pop((p, key), None)
            else:
                out[(p, key)] = (off, ts, value, headers)
    return out


def rows_by_key(rows) -> dict[tuple[int, bytes], tuple]:
    out = {}
    for r in rows:
        key = (r["partition"], bytes(r["key"]))
        assert key not in out, f"two rows for {key}"
        out[key] = (r["offset"], int(r["timestamp"].timestamp() * 1000), bytes(r["value"]),
                    tuple((h["key"], None if h["value"] is None else bytes(h["value"]))
                          for h in r["headers"]))
    return out


# -- tests ---------------------------------------------------------------------------------------


def test_spark_mirror_equals_local_mirror(spark, kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=4)
    recs = keyed_records(4, 6000)
    produce(kafka_bootstrap, topic, recs[:4000])
    produce_transaction(kafka_bootstrap, topic, recs[4000:4100])  # a gap (control marker)
    produce(kafka_bootstrap, topic, recs[4100:])

    sp, lo = str(tmp_path / "spark"), str(tmp_path / "local")
    res = mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark)
    mirror_local(kafka_bootstrap, topic, lo, handle_signals=False)
    want = read_topic(kafka_bootstrap, topic, 4)
    got = read_store(sp, topic)
    assert got == read_store(lo, topic)
    assert got == want
    assert sum(map(len, want.values())) == 6000
    assert res.records == 6000 and res.retried == 0 and len(res.tasks) == 4
    # one commit-log writer per topic-partition, nothing else
    assert writers(sp) == {spark_writer_id(topic, p) for p in range(4)}
    assert verified(sp)

    # a second run finds nothing to do; new records are picked up where each partition ended
    assert mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark).records == 0
    more = keyed_records(4, 1500, seed=9)
    produce(kafka_bootstrap, topic, more)
    res = mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark, partitions=[1, 3])
    mirror_local(kafka_bootstrap, topic, lo, handle_signals=False)
    assert res.records == sum(1 for r in more if r[0] in (1, 3))
    want = read_topic(kafka_bootstrap, topic, 4)
    got = read_store(sp, topic)
    assert {p: got[p] for p in (1, 3)} == {p: want[p] for p in (1, 3)}
    assert {p: got[p] for p in (0, 2)} != {p: want[p] for p in (0, 2)}  # not selected
    mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark)
    assert read_store(sp, topic) == read_store(lo, topic) == want


def test_data_source_latest_and_all(spark, kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 5000, keys=80, seed=3))
    store = str(tmp_path / "store")
    mirror_with_spark(kafka_bootstrap, topic, store, spark=spark)
    everything = read_topic(kafka_bootstrap, topic, 3)
    model = latest_model(everything)

    def load(mode=None):
        r = spark.read.format("kcompact").option("store", store).option("topic", topic)
        if mode:
            r = r.option("mode", mode)
        return r.load()

    df = load()
    assert df.rdd.getNumPartitions() == 3  # one input partition per topic-partition
    assert [f.name for f in df.schema.fields] == ["topic", "partition", "offset", "timestamp",
                                                   "key", "value", "headers"]
    rows = df.collect()
    assert {r["topic"] for r in rows} == {topic}
    assert rows_by_key(rows) == model

    rows = load("all").collect()
    got = {p: [] for p in range(3)}
    for r in sorted(rows, key=lambda r: (r["partition"], r["offset"])):
        got[r["partition"]].append((
            r["offset"], int(r["timestamp"].timestamp() * 1000),
            None if r["key"] is None else bytes(r["key"]),
            None if r["value"] is None else bytes(r["value"]),
            tuple((h["key"], None if h["value"] is None else bytes(h["value"]))
                  for h in r["headers"])))
    assert got == everything

    # after a forced compaction (Spark), `latest` is unchanged and `all` holds fewer records
    assert cli.main(["compact", "--store", store, "--force", "--engine", "spark"]) == 0
    assert rows_by_key(load().collect()) == model
    assert load("all").count() < sum(map(len, everything.values()))


def test_compact_engine_spark_equals_local(spark, kafka_bootstrap, make_topic, tmp_path, capsys):
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 6000, keys=40, seed=7))
    a, b = tmp_path / "a", tmp_path / "b"
    mirror_with_spark(kafka_bootstrap, topic, str(a), spark=spark, compact=False)
    shutil.copytree(a, b)
    before = read_store(str(a), topic)
    assert cli.main(["compact", "--store", str(a), "--force", "--engine", "spark"]) == 0
    assert "spark" in capsys.readouterr().out
    assert cli.main(["compact", "--store", str(b), "--force", "--engine", "local"]) == 0
    after = read_store(str(a), topic)
    assert after == read_store(str(b), topic)
    assert sum(map(len, after.values())) < sum(map(len, before.values()))
    assert verified(str(a))


def test_mirror_compaction_stage(spark, kafka_bootstrap, make_topic, tmp_path, capsys):
    """With sealed segments (small segment.bytes) the mirror's compaction stage compacts what
    the planner picks; --no-compact leaves every record."""
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 4500, keys=30, seed=13))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for url in (a, b):
        Store.create(url, topics={topic: {"segment.bytes": 16384}}).close()
    argv = ["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store"]
    assert cli.main(argv + [a]) == 0
    err = capsys.readouterr().err
    assert "compact: 3 partitions with Spark" in err and "dropped" in err, err
    assert cli.main(argv + [b, "--no-compact"]) == 0
    assert "compact:" not in capsys.readouterr().err
    want = read_topic(kafka_bootstrap, topic, 3)
    assert read_store(b, topic) == want
    got = read_store(a, topic)
    assert sum(map(len, got.values())) < sum(map(len, want.values()))
    assert latest_model(got) == latest_model(want)
    assert verified(a)


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_retried_task_leaves_no_duplicate(spark, kafka_bootstrap, make_topic, tmp_path,
                                          monkeypatch, mode):
    """The first attempt of the tasks of partitions 0 and 2 fails after appending 1500 records
    (``raise``: an exception, the store is closed; ``exit``: the Python worker dies with nothing
    flushed); Spark retries them, they resume from the store's next offset."""
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 9000, seed=11))
    store = str(tmp_path / "store")
    monkeypatch.setenv(FAIL_ENV, f"{mode}:1500:0,{mode}:1500:2")
    res = mirror_with_spark(kafka_bootstrap, topic, store, spark=spark, batch_max=500,
                            kafka_config={"fetch.max.bytes": "1048576"})
    by_p = {t["partition"]: t for t in res.tasks}
    assert by_p[0]["attempt"] == 1 and by_p[2]["attempt"] == 1 and by_p[1]["attempt"] == 0
    assert res.retried == 2
    assert by_p[0]["records"] < by_p[1]["records"] + 1500  # the retry did not start over
    want = read_topic(kafka_bootstrap, topic, 3)
    assert read_store(store, topic) == want
    assert res.records == sum(map(len, want.values())) - 2 * 1500
    assert verified(store)


def test_task_error_is_one_line(spark, kafka_bootstrap, make_topic, tmp_path):
    """A task that fails on every attempt (its partition is held by another writer) fails the
    job with one line naming the topic-partition."""
    topic = make_topic(partitions=2)
    produce(kafka_bootstrap, topic, keyed_records(2, 200))
    store = str(tmp_path / "store")
    with Store.open(store, writer="someone-else", create=True) as st:
        st.writable_partition(topic, 1)  # holds the partition's writer lock
        with pytest.raises(SparkEngineError) as e:
            mirror_with_spark(kafka_bootstrap, topic, store, spark=spark)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"mirror task {topic}-1 " in msg and "one writer per partition" in msg, msg
    assert "Traceback" not in msg and "org.apache" not in msg


def test_cli_mirror_defaults_to_spark(spark, kafka_bootstrap, make_topic, tmp_path, capsys):
    topic = make_topic(partitions=2)
    produce(kafka_bootstrap, topic, keyed_records(2, 3000, seed=2))
    store = str(tmp_path / "store")
    assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "-X", "fetch.wait.max.ms=100"]) == 0
    err = capsys.readouterr().err
    assert "with Spark" in err and "mirror: done: 3,000 records" in err, err
    assert writers(store) == {spark_writer_id(topic, 0), spark_writer_id(topic, 1)}
    assert read_store(store, topic) == read_topic(kafka_bootstrap, topic, 2)

    # -X keys are checked on the driver, before any task: one line naming the key
    assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "-X", "isolation.level=read_uncommitted"]) == 1
    err = capsys.readouterr().err
    assert err.count("kcompact: error:") == 1 and "-X isolation.level" in err, err
    assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "--engine", "spark", "--follow"]) == 1
    assert "--follow needs --engine local" in capsys.readouterr().err
