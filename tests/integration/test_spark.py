"""The batch pipeline on Spark with a real PySpark ``local[2]`` (issue 5): the Spark mirror equals
the local engine's, the ``kcompact`` data source equals a dict model of the topic, ``compact
--engine spark`` equals the local compaction, a task whose Python worker is killed is retried and
leaves no duplicate, a task that fails on every attempt fails the job with one line, and
``kcompact mirror`` runs Spark by default.

One SparkSession for the module: starting the JVM takes ~20-30 s on a small loaded VM.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17", allow_module_level=True)

from kcompact.connectors import cli  # noqa: E402
from kcompact.connectors.apps.mirror import mirror_local  # noqa: E402
from kcompact.connectors.apps.spark import SparkEngineError, spark_session  # noqa: E402
from kcompact.connectors.apps.spark.mirror_job import mirror_with_spark  # noqa: E402
from kcompact.connectors.apps.spark.mirror_job import spark_writer_id  # noqa: E402
from kcompact.connectors.apps.spark.session import stage_counts  # noqa: E402
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


def test_the_driver_jvm_runs_with_kcompact_spark_java_options(spark):
    # KCOMPACT_SPARK_JAVA_OPTIONS (tests/conftest.py sets it) reaches the driver's JVM, after
    # kcompact's own log4j option
    want = os.environ["KCOMPACT_SPARK_JAVA_OPTIONS"].split()
    jvms = []  # this process's children that run Spark's driver (spark-submit execs java)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "org.apache.spark.deploy.SparkSubmit" in args:
            jvms.append(args)
    assert len(jvms) == 1, jvms
    args = jvms[0]
    assert all(w in args for w in want), args
    assert any(a.startswith("-Dlog4j.configurationFile=") for a in args), args
    conf = spark.sparkContext.getConf().get("spark.executor.extraJavaOptions")
    assert all(w in conf.split() for w in want), conf


def test_spark_mirror_of_a_topic_set(spark, kafka_bootstrap, kafka_admin, tmp_path):
    """Issue 21: one Spark task per topic-partition across every topic the regex matches (an
    internal __ topic left out), each topic's configs synced, per-topic final lines."""
    import io
    from confluent_kafka.admin import NewTopic
    prefix = f"sparkset{uuid.uuid4().hex[:8]}"
    names = {f"{prefix}-a": 2, f"{prefix}-b": 3, f"__{prefix}-internal": 1}
    for name, parts in names.items():
        kafka_admin.create_topics([NewTopic(name, parts, 1, config={
            "cleanup.policy": "compact", "delete.retention.ms": "777"})])[name].result()
    try:
        for name, parts in names.items():
            produce(kafka_bootstrap, name, keyed_records(parts, 300 * parts))
        store, out = str(tmp_path / "s"), io.StringIO()
        res = mirror_with_spark(kafka_bootstrap, None, store, spark=spark,
                                topics_regex=f"(__)?{prefix}-.*", out=out,
                                compact=False)  # offset for offset: the compaction stage has tests of its own
        a, b = f"{prefix}-a", f"{prefix}-b"
        assert read_store(store, a) == read_topic(kafka_bootstrap, a, 2)
        assert read_store(store, b) == read_topic(kafka_bootstrap, b, 3)
        assert res.records == 1500 and len(res.tasks) == 5
        # (and the driver's config history: the topics' configs are not Kafka's defaults)
        assert writers(store) == {spark_writer_id(t, p) for t, n in ((a, 2), (b, 3))
                                  for p in range(n)} | {"spark-driver-groups",
                                                        "spark-driver-configs"}
        with Store.open(store) as st:
            assert st.topics() == ["__kcompact-configs", a, b]
            assert st.topic_config(a).delete_retention_ms == 777
        text = out.getvalue()
        assert f"mirror: {a}: 600 records (2 Spark tasks)" in text
        assert f"mirror: {b}: 900 records (3 Spark tasks)" in text and ", 2 topics;" in text
    finally:
        kafka_admin.delete_topics(list(names), operation_timeout=30)


def test_spark_mirror_equals_local_mirror(spark, kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=4)
    recs = keyed_records(4, 6000)
    produce(kafka_bootstrap, topic, recs[:4000])
    produce_transaction(kafka_bootstrap, topic, recs[4000:4100])  # a gap (control marker)
    produce(kafka_bootstrap, topic, recs[4100:])

    sp, lo = str(tmp_path / "spark"), str(tmp_path / "local")
    # without the compaction stage (each task rolls its active segment when it ends, so the
    # stage would compact what the local engine leaves for `kcompact compact`)
    res = mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark, compact=False)
    mirror_local(kafka_bootstrap, topic, lo, handle_signals=False)
    want = read_topic(kafka_bootstrap, topic, 4)
    got = read_store(sp, topic)
    assert got == read_store(lo, topic)
    assert got == want
    assert sum(map(len, want.values())) == 6000
    assert res.records == 6000 and res.retried == 0 and len(res.tasks) == 4
    # one commit-log writer per topic-partition, and the driver's group-offset capture's
    # (issue 42; the tasks capture nothing)
    assert writers(sp) == {spark_writer_id(topic, p) for p in range(4)} | {"spark-driver-groups"}
    assert verified(sp)

    # a second run finds nothing to do; new records are picked up where each partition ended
    assert mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark, compact=False).records == 0
    more = keyed_records(4, 1500, seed=9)
    produce(kafka_bootstrap, topic, more)
    res = mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark, partitions=[1, 3],
                            compact=False)
    mirror_local(kafka_bootstrap, topic, lo, handle_signals=False)
    assert res.records == sum(1 for r in more if r[0] in (1, 3))
    want = read_topic(kafka_bootstrap, topic, 4)
    got = read_store(sp, topic)
    assert {p: got[p] for p in (1, 3)} == {p: want[p] for p in (1, 3)}
    assert {p: got[p] for p in (0, 2)} != {p: want[p] for p in (0, 2)}  # not selected
    mirror_with_spark(kafka_bootstrap, topic, sp, spark=spark, compact=False)
    assert read_store(sp, topic) == read_store(lo, topic) == want


def test_data_source_latest_and_all(spark, kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 5000, keys=80, seed=3))
    store = str(tmp_path / "store")
    mirror_with_spark(kafka_bootstrap, topic, store, spark=spark, compact=False)
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


def _tombstones(url: str, topic: str) -> dict[int, list[int]]:
    return {p: [r[0] for r in rows if r[2] is not None and r[3] is None]
            for p, rows in read_store(url, topic).items()}


def test_compact_engine_spark_equals_local(spark, kafka_bootstrap, make_topic, tmp_path, capsys):
    """The same records after compactions by both engines; with delete.retention.ms=0 every
    tombstone goes but each partition's last one, its last record (compaction keeps it, as
    Kafka's active segment does)."""
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, keyed_records(3, 6000, keys=40, seed=7)
            + [(p, b"key-%d" % p, None, None, TS0 + 90_000 + p) for p in range(3)])
    a, b = tmp_path / "a", tmp_path / "b"
    mirror_with_spark(kafka_bootstrap, topic, str(a), spark=spark, compact=False)
    shutil.copytree(a, b)
    before = read_store(str(a), topic)
    for url in (a, b):
        assert cli.main(["configs", "--store", str(url), "--topic", topic, "--alter",
                         "--add-config", "delete.retention.ms=0,min.compaction.lag.ms=0"]) == 0
    tails = {p: [rows[-1][0]] for p, rows in before.items()}
    for url, engine in ((a, "spark"), (b, "local")):
        # a tombstone is stamped by the pass that first cleans it and dropped by a later one,
        # a second on (clean times are in seconds): until only the last ones are left
        deadline = time.monotonic() + 60
        while True:
            assert cli.main(["compact", "--store", str(url), "--force", "--engine", engine]) == 0
            if _tombstones(str(url), topic) == tails:
                break
            assert time.monotonic() < deadline, (engine, _tombstones(str(url), topic), tails)
            time.sleep(0.3)
    assert "spark" in capsys.readouterr().out
    after = read_store(str(a), topic)
    assert after == read_store(str(b), topic)
    assert sum(map(len, after.values())) < sum(map(len, before.values()))
    assert {p: rows[-1] for p, rows in after.items()} == {p: rows[-1] for p, rows in before.items()}
    assert verified(str(a))


def test_mirror_compaction_stage(spark, kafka_bootstrap, make_topic, tmp_path, capsys):
    """The mirror's compaction stage compacts what the planner picks (the tasks rolled their
    active segments; small segment.bytes here seals more of them); --no-compact leaves every
    record."""
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


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process below ``root`` (Linux /proc)."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        procs[int(name)] = (ppid, cmd)
    below, grew = {}, True
    while grew:
        grew = False
        for pid, (ppid, cmd) in procs.items():
            if pid not in below and (ppid == root or ppid in below):
                below[pid] = (ppid, cmd)
                grew = True
    return below


def _python_workers() -> list[int]:
    """This test's Spark Python workers: the children of its pyspark daemon (a child of the
    JVM this process started), which forks one worker per task slot."""
    procs = _descendants(os.getpid())
    daemons = {pid for pid, (_, cmd) in procs.items() if "pyspark.daemon" in cmd}
    return [pid for pid, (ppid, _) in procs.items() if ppid in daemons]


def _wait_for(what: str, cond, timeout: float = 120.0) -> None:
    """Poll until ``cond()``; the timeout only bounds a hung run, the test asserts no timing."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)


def test_killed_task_is_retried_and_resumes(spark, kafka_bootstrap, make_topic, tmp_path):
    """The Python workers running the tasks of partitions 0 and 2 are SIGKILLed (nothing of
    theirs is flushed or closed); Spark retries those tasks, and each retry reopens its
    partition's commit log and resumes from the store's next offset: nothing is lost, nothing
    duplicated, and the records a first run stored are not read again.

    The kill is made deterministic from outside: this process holds the commit-log writers of
    partitions 0 and 2 (spark-<topic>-0 and -2), so their tasks wait for them (a task waits for
    a previous attempt of itself that still holds its log) while partition 1's task finishes;
    once Spark shows that state, the workers are killed, and the writers are released once
    Spark has seen both attempts fail."""
    topic = make_topic(partitions=3)
    first, second = keyed_records(3, 4500, seed=11), keyed_records(3, 4500, seed=12)
    # partition 1 gets the most new records: the driver starts the biggest task first, so
    # local[2] runs it beside one of the others, and the third once it is done
    second += [(1, *r[1:]) for r in keyed_records(3, 1500, seed=13)]
    produce(kafka_bootstrap, topic, first)
    store = str(tmp_path / "store")
    mirror_with_spark(kafka_bootstrap, topic, store, spark=spark, compact=False)
    stored = read_store(store, topic)
    produce(kafka_bootstrap, topic, second)

    held = [Store.open(store, writer=spark_writer_id(topic, p)) for p in (0, 2)]
    result: dict = {}

    def run() -> None:
        try:
            result["res"] = mirror_with_spark(kafka_bootstrap, topic, store, spark=spark,
                                              batch_max=500, compact=False)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            result["error"] = e

    job = threading.Thread(target=run, daemon=True)
    job.start()
    try:
        # partition 1's task is done; the tasks of partitions 0 and 2 wait for their writers
        _wait_for("p1 done, p0 and p2 waiting", lambda: stage_counts(spark)[:2] == (1, 2))
        workers = _python_workers()  # the two waiting tasks' and any idle one (Spark checks
        assert len(workers) >= 2, workers  # that a pooled worker is alive before reusing it)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        _wait_for("both attempts failed", lambda: stage_counts(spark)[2] >= 2)
    finally:
        for st in held:
            st.close()
    job.join(300)
    assert not job.is_alive() and "error" not in result, result.get("error")
    res = result["res"]

    by_p = {t["partition"]: t for t in res.tasks}
    assert by_p[0]["attempt"] == 1 and by_p[2]["attempt"] == 1 and by_p[1]["attempt"] == 0
    assert res.retried == 2
    want = read_topic(kafka_bootstrap, topic, 3)
    assert read_store(store, topic) == want
    for p in range(3):  # each task read only what the first run had not stored
        assert by_p[p]["start"] == stored[p][-1][0] + 1
        assert by_p[p]["records"] == len(want[p]) - len(stored[p])
    assert res.records == sum(map(len, want.values())) - sum(map(len, stored.values()))
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
    assert writers(store) == {spark_writer_id(topic, 0), spark_writer_id(topic, 1),
                              "spark-driver-groups"}
    # the compaction stage ran: each task rolled its active segment when it ended
    assert "compact: 2 partitions with Spark" in err, err
    assert latest_model(read_store(store, topic)) == latest_model(
        read_topic(kafka_bootstrap, topic, 2))

    # -X keys are checked on the driver, before any task: one line naming the key
    assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "-X", "isolation.level=read_uncommitted"]) == 1
    err = capsys.readouterr().err
    assert err.count("kcompact: error:") == 1 and "-X isolation.level" in err, err
    assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "--engine", "spark", "--follow"]) == 1
    assert "--follow needs --engine local" in capsys.readouterr().err
