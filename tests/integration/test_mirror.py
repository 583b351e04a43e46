"""`kcompact mirror` and `kcompact connect standalone` against a real broker (and a real HTTP
Schema Registry): exactness offset for offset, restarts, transaction gaps, bad input, the
dead-letter topic, and SIGKILL at random moments during a 500k-record mirror."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kcompact.connectors.framework.api import SourceConnector, SourceRecord, SourceTask
from kcompact.connectors.framework import sink_runner
from kcompact.connectors.framework.converters import AvroConverter
from kcompact.connectors.framework.native_kafka import NativeConsumer
from kcompact.errors import ConfigError
from kcompact.connectors.apps.mirror import mirror_local
from kcompact.connectors.framework.worker import Worker
from kcompact.reput import Store, verify_store
from topics import read_store, read_topic  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TS0 = 1_700_000_000_000

# -- helpers -------------------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, records, *, transactional: bool = False, **conf) -> None:
    """records: (partition, key, value, headers, timestamp) tuples."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **conf})
    errors = []

    def cb(err, _msg):
        if err is not None:
            errors.append(err)
    for part, key, value, headers, ts in records:
        while True:
            try:
                p.produce(topic, key=key, value=value, headers=headers, partition=part,
                          timestamp=ts, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(60) == 0 and not errors, errors


def kcompact(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def topic_exists(bootstrap: str, topic: str) -> bool:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})  # never auto-creates
    try:
        t = c.list_topics(topic=topic, timeout=10).topics.get(topic)
        return t is not None and t.error is None
    finally:
        c.close()


def varied_records(partitions: int, n: int, seed: int = 1) -> list[tuple]:
    """Keys (null, empty, text), values (tombstone, empty, binary), headers (none, repeated
    names, null values), explicit timestamps."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        key = [None, b"", b"k%d" % (i % 17), bytes(rng.randrange(256) for _ in range(5))][i % 4]
        value = [None, b"", b"v%d" % i, bytes(rng.randrange(256) for _ in range(40))][(i // 3) % 4]
        headers = [None, [("a", b"1")], [("a", b"1"), ("a", None), ("ü", b"")]][(i // 2) % 3]
        out.append((i % partitions, key, value, headers, TS0 + i * 7))
    return out


def expected(records: list[tuple], partitions: int) -> dict[int, list[tuple]]:
    """What the topic holds for records produced in order with no transactions."""
    out: dict[int, list[tuple]] = {p: [] for p in range(partitions)}
    for part, key, value, headers, ts in records:
        out[part].append((len(out[part]), ts, key, value, tuple(headers or ())))
    return out


def _mirror(bootstrap, topic, store, **kw):
    return mirror_local(bootstrap, topic, str(store), out=io.StringIO(), handle_signals=False,
                        **kw)


# -- exactness -----------------------------------------------------------------------------------


def test_mirror_is_exact_offset_for_offset(any_broker, make_topic, tmp_path, monkeypatch):
    """kcompact's own consumer reading columns; on the session broker and on a real Apache
    Kafka."""
    kafka_bootstrap = any_broker.bootstrap
    consumers = []
    make = sink_runner.kafka_consumer
    monkeypatch.setattr(sink_runner, "kafka_consumer",
                        lambda conf: consumers.append(make(conf)) or consumers[-1])
    topic = make_topic(partitions=3)
    recs = varied_records(3, 600)
    produce(kafka_bootstrap, topic, recs)
    store = tmp_path / "store"  # does not exist yet: the mirror creates it
    res = _mirror(kafka_bootstrap, topic, store)
    assert len(consumers) == 1
    assert isinstance(consumers[0], NativeConsumer)
    assert res.records == 600 and res.partitions == 3 and res.stopped_by is None
    in_topic = read_topic(kafka_bootstrap, topic, 3)
    assert in_topic == expected(recs, 3)  # the broker kept what we produced
    assert read_store(str(store), topic) == in_topic
    assert verify_store(Store.open(str(store))).ok


def test_restart_resumes_without_duplicates(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    first = varied_records(2, 300, seed=2)
    produce(kafka_bootstrap, topic, first)
    store = str(tmp_path / "s")
    assert _mirror(kafka_bootstrap, topic, store).records == 300
    assert _mirror(kafka_bootstrap, topic, store).records == 0  # nothing new: nothing stored
    more = varied_records(2, 200, seed=3)
    produce(kafka_bootstrap, topic, more)
    assert _mirror(kafka_bootstrap, topic, store).records == 200
    stored = read_store(store, topic)
    assert stored == read_topic(kafka_bootstrap, topic, 2)
    assert sum(map(len, stored.values())) == 500


def test_restart_ignores_the_consumer_group(kafka_bootstrap, make_topic, tmp_path):
    """Committed group offsets (here: far ahead) play no part: the store decides."""
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, varied_records(1, 50))
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "connect-kcompact-mirror",
                  "enable.auto.commit": False})
    c.commit(offsets=[TopicPartition(topic, 0, 40)], asynchronous=False)
    c.close()
    store = str(tmp_path / "s")
    assert _mirror(kafka_bootstrap, topic, store).records == 50
    assert [r[0] for r in read_store(store, topic)[0]] == list(range(50))


def test_transaction_markers_leave_gaps(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"tx-{topic}"})
    p.init_transactions(15)
    for txn in range(5):
        p.begin_transaction()
        for i in range(txn + 1):
            p.produce(topic, key=b"t%d" % txn, value=b"v%d-%d" % (txn, i), partition=txn % 2,
                      timestamp=TS0 + txn)
        p.commit_transaction(15)
    in_topic = read_topic(kafka_bootstrap, topic, 2)
    offsets = [r[0] for r in in_topic[0]] + [r[0] for r in in_topic[1]]
    assert len(offsets) == 15 and max(in_topic[0])[0] >= len(in_topic[0])  # there are gaps
    store = str(tmp_path / "s")
    assert _mirror(kafka_bootstrap, topic, store).records == 15
    assert read_store(store, topic) == in_topic
    with Store.open(store) as st:  # the next offset is past the last marker, as in Kafka
        last = max(r[0] for r in in_topic[0])
        assert st.next_offset(topic, 0) == last + 2  # (the commit marker of transaction 4)
    produce(kafka_bootstrap, topic, [(0, b"after", b"x", None, TS0)])
    assert _mirror(kafka_bootstrap, topic, store).records == 1
    assert read_store(store, topic) == read_topic(kafka_bootstrap, topic, 2)


def test_partitions_subset(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=4)
    produce(kafka_bootstrap, topic, varied_records(4, 80))
    store = str(tmp_path / "s")
    assert _mirror(kafka_bootstrap, topic, store, partitions=[1, 3]).records == 40
    assert sorted(read_store(store, topic)) == [1, 3]
    with pytest.raises(ConfigError, match="--partitions: .*has no partition 7"):
        _mirror(kafka_bootstrap, topic, store, partitions=[7])


# -- the command line ------------------------------------------------------------------------------


def no_java_env(tmp_path: Path) -> dict[str, str]:
    """This environment as a machine without Java would have it: no ``java`` on PATH (only the
    virtualenv's bin/) and JAVA_HOME naming a directory that holds no Java."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable)
    env["JAVA_HOME"] = str(tmp_path / "no-java-here")
    return env


def test_cli_mirror_spark_default_falls_back_to_local(kafka_bootstrap, make_topic, tmp_path):
    """Spark unable to run (no Java): a defaulted engine says why on stderr and mirrors with
    the local engine; an explicit --engine spark fails with one line, exit 1, storing nothing."""
    topic = make_topic(partitions=2)
    produce(kafka_bootstrap, topic, varied_records(2, 100))
    env = no_java_env(tmp_path)
    store = tmp_path / "s"
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", str(store), "-X", "fetch.wait.max.ms=100", env=env)
    assert proc.returncode == 0, proc.stderr
    note = [ln for ln in proc.stderr.splitlines() if "the Spark engine cannot run" in ln]
    assert note == [f"kcompact mirror: the Spark engine cannot run (JAVA_HOME="
                    f"{env['JAVA_HOME']} has no bin/java; point JAVA_HOME at a Java 17 "
                    "installation or unset it); running with --engine local"], proc.stderr
    assert "mirror: done: 100 records" in proc.stderr
    assert read_store(str(store), topic) == read_topic(kafka_bootstrap, topic, 2)
    # the local engine's writer and its group-offset capture's (issue 42), no Spark's
    assert sorted(os.listdir(store / "commitlog")) == ["local", "local-groups"]

    store2 = tmp_path / "s2"
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", str(store2), "--engine", "spark", env=env)
    assert proc.returncode == 1, proc.stderr
    assert error_line(proc) == (f"kcompact: error: --engine spark: JAVA_HOME={env['JAVA_HOME']} "
                                "has no bin/java; point JAVA_HOME at a Java 17 installation or "
                                "unset it; or use --engine local")
    assert proc.stderr.count("\n") == 1  # that line and nothing else
    assert not store2.exists()

    env.pop("JAVA_HOME")  # no JAVA_HOME at all, and no java on PATH
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", str(store2), "--engine", "spark", env=env)
    assert proc.returncode == 1, proc.stderr
    assert error_line(proc) == ("kcompact: error: --engine spark: Java 17 is not installed "
                                "(apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME); "
                                "or use --engine local")


def test_cli_unknown_topic(kafka_bootstrap, tmp_path):
    name = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", name,
                    "--store", str(tmp_path / "s"), "--engine", "local")
    assert proc.returncode == 1
    assert error_line(proc) == (f"kcompact: error: topic '{name}' does not exist on "
                                f"{kafka_bootstrap}")
    assert not (tmp_path / "s").exists()  # nothing created for a job that cannot run
    assert not topic_exists(kafka_bootstrap, name)  # and the topic was not auto-created


def test_cli_refuses_a_foreign_directory(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", str(tmp_path / "home"), "--engine", "local")
    assert proc.returncode == 1
    assert "is a non-empty directory that is not a kcompact store" in error_line(proc)
    assert sorted(os.listdir(tmp_path / "home")) == ["notes.txt"]


def test_cli_unreachable_broker(closed_port, tmp_path):
    t = time.monotonic()
    proc = kcompact("mirror", "--bootstrap-servers", f"127.0.0.1:{closed_port}", "--topic", "t",
                    "--store", str(tmp_path / "s"), "--engine", "local")
    elapsed = time.monotonic() - t
    assert proc.returncode == 1
    assert error_line(proc).startswith(f"kcompact: error: cannot reach Kafka at "
                                       f"127.0.0.1:{closed_port} within 10 s")
    assert elapsed < 25
    assert proc.stderr.count("\n") <= 2  # no librdkafka log noise


@pytest.mark.parametrize("setting, message", [
    ("foo.bar=1", '-X foo.bar=1: invalid Kafka consumer setting: No such configuration property: '
                  '"foo.bar"'),
    ("fetch.wait.max.ms=soon", '-X fetch.wait.max.ms=soon: invalid Kafka consumer setting'),
    ("isolation.level=read_uncommitted", "-X isolation.level=read_uncommitted: "
                                         "StoreSinkConnector needs isolation.level=read_committed"),
    ("enable.auto.commit=true", "-X enable.auto.commit=true: the worker"),
    ("nonsense", "-X expects key=value; got 'nonsense'"),
])
def test_cli_bad_x_setting_names_the_key(kafka_bootstrap, make_topic, tmp_path, setting, message):
    topic = make_topic(partitions=1)
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", str(tmp_path / "s"), "--engine", "local", "-X", setting)
    assert proc.returncode == 1
    assert message in error_line(proc)


def test_cli_follow_and_sigterm_flushes(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    produce(kafka_bootstrap, topic, varied_records(2, 100, seed=5))
    store = str(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "mirror",
                             "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                             "--store", store, "--follow"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _count(store, topic) == 100, 60, proc)
        produce(kafka_bootstrap, topic, varied_records(2, 50, seed=6))
        _wait_for(lambda: _count(store, topic) == 150, 30, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err and "flushed" in err
    assert read_store(store, topic) == read_topic(kafka_bootstrap, topic, 2)


def test_cli_second_mirror_on_the_same_store_is_refused(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, varied_records(1, 10))
    store = str(tmp_path / "s")
    first = subprocess.Popen([sys.executable, "-m", "kcompact", "mirror",
                              "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                              "--store", store, "--follow"], cwd=ROOT,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _count(store, topic) == 10, 60, first)
        second = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                          "--store", store, "--engine", "local")
        assert second.returncode == 1
        assert error_line(second) == (f"kcompact: error: another process is writing to {store} "
                                      "as writer 'local' (a mirror still running?); stop it "
                                      "first: one local mirror per store at a time")
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0
    assert read_store(store, topic) == read_topic(kafka_bootstrap, topic, 1)


def test_cli_sigint_exits_130(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, varied_records(1, 10))
    store = str(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "mirror",
                             "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                             "--store", store, "--follow"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _count(store, topic) == 10, 60, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert read_store(store, topic) == read_topic(kafka_bootstrap, topic, 1)


def _count(store: str, topic: str) -> int:
    if not os.path.exists(os.path.join(store, "store.json")):
        return -1
    try:
        with Store.open(store) as st:
            return sum(st.partition(topic, p).record_count() for p in st.partitions(topic))
    except Exception:  # noqa: BLE001 - the writer may be mid-append
        return -1


def _indexed(store: str, topic: str) -> int:
    """Records indexed so far (.bcq sizes / 48): a few stat calls, so that a poll takes
    microseconds however fast the mirror writes (opening the store may scan a not-yet-indexed
    .log tail, and a fast mirror copies tens of thousands of records meanwhile)."""
    root = os.path.join(store, "partitions", topic)
    n = 0
    try:
        for p in os.listdir(root):
            d = os.path.join(root, p)
            n += sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                     if f.endswith(".bcq"))
    except OSError:  # not created yet, or a file swapped away between listdir and stat
        return -1 if not os.path.isdir(root) else 0
    return n // 48


def _wait_for(cond, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited early: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# -- connect standalone: properties, converters, errors, dead-letter topic ---------------------------


def _write(path: Path, props: dict) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    return path


USER = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"}]}


def _avro_records(sr_url: str, topic: str, n: int, bad: dict[int, bytes]) -> list[tuple]:
    conv = AvroConverter()
    conv.configure({"schema.registry.url": sr_url, "avro.schema": json.dumps(USER)},
                   is_key=False)
    out = []
    for i in range(n):
        value = bad.get(i) or conv.from_connect(topic, {"id": i, "name": f"user-{i}"})
        out.append((0, b"k%d" % i, value, [("src", b"test")], TS0 + i))
    return out


def test_standalone_avro_dead_letter_queue(kafka_bootstrap, make_topic, schema_registry,
                                           tmp_path):
    topic = make_topic(partitions=1)
    dlq = f"{topic}-dlq"
    bad = {3: b"\x01not-confluent", 7: b"\x00\x00\x00\x00\x01\xff\xff\xff\xff\xff\xff\xff\xff"
                                         b"\xff\xff\xff", 8: b"\x00\x00"}
    produce(kafka_bootstrap, topic, _avro_records(schema_registry.url, topic, 12, bad))
    store = tmp_path / "store"
    worker = _write(tmp_path / "worker.properties", {
        "bootstrap.servers": kafka_bootstrap, "offset.flush.interval.ms": 1000})
    conn = _write(tmp_path / "sink.properties", {
        "name": "avro-sink", "connector.class": "StoreSinkConnector", "topics": topic,
        "store.url": store, "follow": "false",
        "value.converter": "io.confluent.connect.avro.AvroConverter",
        "value.converter.schema.registry.url": schema_registry.url,
        "errors.tolerance": "all", "errors.log.enable": "true",
        "errors.deadletterqueue.topic.name": dlq})
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("VALUE_CONVERTER on ") == 3  # errors.log.enable
    stored = read_store(str(store), topic)[0]
    assert [r[0] for r in stored] == [i for i in range(12) if i not in bad]  # gaps where skipped
    assert all(r[4] == (("src", b"test"),) for r in stored)
    dead = read_topic(kafka_bootstrap, dlq, 1)[0]
    assert [r[3] for r in dead] == [bad[3], bad[7], bad[8]]
    for (_, ts, key, _, headers), offset in zip(dead, (3, 7, 8)):
        h = dict(headers)
        assert key == b"k%d" % offset and ts == TS0 + offset
        assert headers[0] == ("src", b"test")
        assert h["__connect.errors.topic"] == topic.encode()
        assert h["__connect.errors.partition"] == b"0"
        assert h["__connect.errors.offset"] == str(offset).encode()
        assert h["__connect.errors.connector.name"] == b"avro-sink"
        assert h["__connect.errors.stage"] == b"VALUE_CONVERTER"
        assert h["__connect.errors.class.name"] == \
            b"kcompact.connectors.framework.converters.AvroConverter"
        assert h["__connect.errors.exception.class.name"] == \
            b"kcompact.connectors.framework.api.DataError"
        assert h["__connect.errors.exception.message"].startswith(b"AvroConverter: ")
        assert b"Traceback" in h["__connect.errors.exception.stacktrace"]
    assert b"unknown magic byte 1" in dict(dead[0][4])["__connect.errors.exception.message"]
    assert b"shorter than the 5-byte" in dict(dead[2][4])["__connect.errors.exception.message"]
    # A restart finds nothing new (the DLQ'd tail is re-read only if it is after the last
    # stored record; here record 11 is stored).
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 0, proc.stderr
    assert len(read_topic(kafka_bootstrap, dlq, 1)[0]) == 3


def test_standalone_malformed_avro_without_tolerance_fails(kafka_bootstrap, make_topic,
                                                           schema_registry, tmp_path):
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, _avro_records(schema_registry.url, topic, 5,
                                                  {2: b"\x05garbage"}))
    worker = _write(tmp_path / "w.properties", {"bootstrap.servers": kafka_bootstrap})
    conn = _write(tmp_path / "c.properties", {
        "name": "strict", "connector.class": "StoreSinkConnector", "topics": topic,
        "store.url": tmp_path / "s", "follow": "false", "value.converter": "AvroConverter",
        "value.converter.schema.registry.url": schema_registry.url})
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"value converter failed on {topic}-0 offset 2: AvroConverter: unknown magic byte 5" \
        in line and "errors.tolerance=all" in line
    # Nothing after the bad record was stored; a rerun (after fixing the config) resumes there.
    assert [r[0] for r in read_store(str(tmp_path / "s"), topic)[0]] == [0, 1]


def test_standalone_schema_registry_down(kafka_bootstrap, make_topic, schema_registry, tmp_path):
    topic = make_topic(partitions=1)
    produce(kafka_bootstrap, topic, _avro_records(schema_registry.url, topic, 3, {}))
    url = schema_registry.url
    schema_registry.stop()
    worker = _write(tmp_path / "w.properties", {"bootstrap.servers": kafka_bootstrap})
    conn = _write(tmp_path / "c.properties", {
        "name": "sr-down", "connector.class": "StoreSinkConnector", "topics": topic,
        "store.url": tmp_path / "s", "follow": "false", "value.converter": "AvroConverter",
        "value.converter.schema.registry.url": url,
        "value.converter.schema.registry.max.retries": "0",
        "errors.tolerance": "all", "errors.retry.timeout": "1000"})
    t = time.monotonic()
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"Schema Registry at {url} is unreachable" in line
    assert f"at {topic}-0 offset 0" in line
    assert time.monotonic() - t < 30
    assert read_store(str(tmp_path / "s"), topic) == {}  # never tolerated: nothing skipped


@pytest.mark.parametrize("props, message", [
    ({"store.urll": "x"}, "c.properties: unknown property 'store.urll'; did you mean 'store.url'"),
    ({"value.converter": "Avro"}, "value.converter: unknown converter 'Avro'"),
    ({"value.converter": "JsonConverter", "value.converter.schema.enable": "true"},
     "unknown property 'schema.enable'; did you mean 'schemas.enable'"),
    ({"consumer.override.foo": "1"}, "consumer.override.foo=1: invalid Kafka consumer setting"),
    ({"errors.deadletterqueue.topic.name": "d"}, "errors.deadletterqueue.topic.name needs "
                                                 "errors.tolerance=all"),
])
def test_standalone_bad_connector_property_names_the_key(kafka_bootstrap, make_topic, tmp_path,
                                                         props, message):
    topic = make_topic(partitions=1)
    worker = _write(tmp_path / "w.properties", {"bootstrap.servers": kafka_bootstrap})
    conn = _write(tmp_path / "c.properties", dict({
        "name": "x", "connector.class": "StoreSinkConnector", "topics": topic,
        "store.url": tmp_path / "s", "follow": "false"}, **props))
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 1
    assert message in error_line(proc)


def test_standalone_examples_parse(tmp_path):
    """The files in examples/ are valid (validated, not run)."""
    from kcompact.connectors.framework.config import load_config_file
    from kcompact.connectors.framework.worker import WORKER_CONFIG, validate_connector
    ex = ROOT / "examples"
    WORKER_CONFIG.parse(load_config_file(ex / "worker.properties"))
    for f in sorted(ex.glob("*sink*.properties")) + sorted(ex.glob("*.json")):
        validate_connector(load_config_file(f), where=str(f))


def test_standalone_json_config_and_string_converter(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    recs = [(i % 2, b"k", ("t%d" % i).encode(), None, TS0) for i in range(20)]
    recs[5] = (1, b"k", b"\xff\xfe", None, TS0)  # not UTF-8
    produce(kafka_bootstrap, topic, recs)
    worker = tmp_path / "worker.json"
    worker.write_text(json.dumps({"bootstrap.servers": kafka_bootstrap}))
    conn = tmp_path / "conn.json"
    conn.write_text(json.dumps({"name": "json-sink", "config": {
        "connector.class": "kcompact.connectors.plugins.store_sink.StoreSinkConnector",
        "tasks.max": 2,
        "topics": topic, "store.url": str(tmp_path / "s"), "follow": False,
        "value.converter": "StringConverter", "errors.tolerance": "all"}}))
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 0, proc.stderr
    stored = read_store(str(tmp_path / "s"), topic)
    assert sum(map(len, stored.values())) == 19
    assert b"\xff\xfe" not in {r[3] for rs in stored.values() for r in rs}
    # two tasks, two writers
    assert sorted(os.listdir(tmp_path / "s" / "commitlog")) == ["connect", "connect-1",
                                                                 "connect-groups"]


# -- a source connector through the worker ---------------------------------------------------------


class CountingTask(SourceTask):
    def start(self, props):
        self.topic, self.total = props["topic"], int(props["count"])
        last = self.context.offset({"counter": "c"})
        self.next = (last or {}).get("n", -1) + 1

    def poll(self):
        if self.next >= self.total:
            return None
        batch = []
        for n in range(self.next, min(self.next + 7, self.total)):
            batch.append(SourceRecord(self.topic, 0, None, TS0 + n, b"n", str(n).encode(),
                                      (("seq", str(n).encode()),),
                                      source_partition={"counter": "c"},
                                      source_offset={"n": n}))
        self.next += len(batch)
        return batch

    def finished(self):
        return self.next >= self.total

    def stop(self):
        pass


class CountingSource(SourceConnector):
    from kcompact.connectors.framework.config import ConfigDef, Type
    CONFIG = ConfigDef().define("topic", Type.STRING).define("count", Type.INT, 10)

    def task_class(self):
        return CountingTask


def test_source_connector_resumes_from_stored_offsets(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    offsets = tmp_path / "offsets.json"

    def run(count: int) -> None:
        w = Worker({"bootstrap.servers": kafka_bootstrap,
                    "offset.storage.file.filename": str(offsets)}, log=io.StringIO())
        w.add_connector({"name": "counter", "connector.class": f"{__name__}.CountingSource",
                         "topic": topic, "count": count})
        w.run()
    run(20)
    run(20)  # resumes: produces nothing more
    run(30)
    got = read_topic(kafka_bootstrap, topic, 1)[0]
    assert [r[3] for r in got] == [str(n).encode() for n in range(30)]
    assert [dict(r[4])["seq"] for r in got] == [str(n).encode() for n in range(30)]
    assert json.loads(offsets.read_text())["offsets"]["counter"] == {
        '{"counter":"c"}': {"n": 29}}


# -- the kill test -------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_five_times_during_a_500k_mirror(kafka_bootstrap, make_topic, tmp_path):
    n, partitions = 500_000, 4
    topic = make_topic(partitions=partitions)
    seed = int(os.environ.get("KILL_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20, "batch.size": 1 << 20,
                  "queue.buffering.max.messages": 1_000_000})
    value = bytes(range(100))
    for i in range(n):
        headers = [("i", b"%d" % i)] if i % 1000 == 0 else None
        while True:
            try:
                p.produce(topic, key=b"key-%d" % (i % 50_000), value=value if i % 97 else None,
                          partition=i % partitions, timestamp=TS0 + i, headers=headers)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(120) == 0
    store = str(tmp_path / "store")
    cmd = [sys.executable, "-m", "kcompact", "mirror", "--bootstrap-servers",
           kafka_bootstrap, "--topic", topic, "--store", store, "--engine", "local"]
    counts = []
    for k in range(5):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        # Mostly kill while records are being written: after a random number (5k..60k) of
        # new records landed, whatever the speed of the machine; once during start-up and
        # recovery instead (a random moment after the process started, but before it copied
        # more than a few thousand records: a fast machine copies the whole topic in ~2 s).
        before = max(_indexed(store, topic), 0)
        target = before + rng.randrange(5_000, 60_000)
        t0 = time.monotonic()
        if k == 2:
            until = t0 + rng.uniform(0.05, 1.0)
            while time.monotonic() < until and _indexed(store, topic) < before + 5_000 \
                    and proc.poll() is None:
                time.sleep(0.002)
        else:
            while _indexed(store, topic) < target and proc.poll() is None \
                    and time.monotonic() - t0 < 60:
                time.sleep(0.002)
        finished = proc.poll() is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        counts.append((_count(store, topic), finished))
    print(f"kill test seed {seed}: records in the store at each kill: {counts}")
    final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, (seed, final.stderr)
    mid_way = [c for c, fin in counts if 0 < c < n and not fin]
    assert len(mid_way) >= 4, (seed, counts)  # the kills did land in the middle of the mirror
    stored = read_store(store, topic)
    in_topic = read_topic(kafka_bootstrap, topic, partitions)
    for part in range(partitions):
        s, t = stored[part], in_topic[part]
        assert len(s) == len(t), (seed, part, len(s), len(t))
        assert s == t, (seed, part)
    assert verify_store(Store.open(store)).ok
