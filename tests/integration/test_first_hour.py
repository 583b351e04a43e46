"""Issue 26, the first hour with kcompact, for what needs a broker or a master: `inspect` of a
replica, a partition a starting `mirror --follow` knows but has not written, nothing left behind
by a `mirror --partitions` or a `restore` that failed, `mirror --follow` saying it is
disconnected, and a Spark mirror without the JVM's incubator warning. Each test drives the
installed ``kcompact`` command as a user does; every server is started and stopped here."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from kcompact.connectors.devtools.broker import EmbeddedBroker
from kcompact.reput import RecordBatch, Store

from test_mirror import topic_exists

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from _stores import flip_byte_in_the_middle  # noqa: E402

KCOMPACT = str(Path(sys.executable).parent / "kcompact")
TIMEOUT = 180
LIVENESS_S = 120.0   # how long a test waits for a line it expects (never a timing assertion)


def kcompact(*args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]


class Running:
    """A kcompact command in the background, its stderr collected line by line."""

    def __init__(self, *args):
        self.p = subprocess.Popen([KCOMPACT, *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self._threads = [threading.Thread(target=lambda s=s, b=b: b.extend(s), daemon=True)
                         for s, b in ((self.p.stderr, self.err), (self.p.stdout, self.out))]
        for t in self._threads:
            t.start()

    def wait_for(self, text: str) -> str:
        deadline = time.monotonic() + LIVENESS_S
        while time.monotonic() < deadline:
            for line in list(self.err):
                if text in line:
                    return line
            assert self.p.poll() is None, f"exited {self.p.returncode}:\n{''.join(self.err)}"
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in {LIVENESS_S:.0f} s:\n{''.join(self.err)}")

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(30)
        for t in self._threads:
            t.join(10)
        return self.p.returncode


@pytest.fixture
def running():
    started: list[Running] = []

    def start(*args) -> Running:
        r = Running(*args)
        started.append(r)
        return r
    yield start
    for r in started:
        r.stop(signal.SIGKILL)


def produce(bootstrap: str, topic: str, rows) -> None:
    """rows: (partition, key, value)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for part, key, value in rows:
        p.produce(topic, key=key, value=value, partition=part)
    assert p.flush(60) == 0


# -- inspect of a replica -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_issue_inspect_text_of_a_replica(tmp_path, running):
    master, replica = str(tmp_path / "master"), str(tmp_path / "replica")
    with Store.open(master, writer="w", create=True) as st:
        st.append(RecordBatch.from_records("orders", [
            (p, i, 1_700_000_000_000 + i, b"k%d" % (i % 7), b"v%d" % i, [])
            for p in range(2) for i in range(100)]))
        st.flush()
        master_id = st.meta.store_id
    assert kcompact("compact", "--store", master, "--force").returncode == 0
    token = tmp_path / "token"
    token.write_text(uuid.uuid4().hex + "\n")
    port = free_port()
    serve = running("serve", "--store", master, "--listen", f"127.0.0.1:{port}",
                    "--token-file", token)
    serve.wait_for("serving")
    proc = kcompact("replicate", "--from", f"http://127.0.0.1:{port}", "--token-file", token,
                    "--store", replica)
    assert proc.returncode == 0, proc.stderr

    proc = kcompact("inspect", "--store", replica)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    header, *rows = proc.stdout.splitlines()[1:]
    col = header.index("LAST RUN")
    assert len(rows) == 2
    for row in rows:  # when, and that the compacted state came from the master
        when, what = row[col:col + 20], row[col + 21:]
        assert time.strptime(when, "%Y-%m-%d %H:%M:%SZ")
        assert what == f"replicated from store {master_id}"


# -- a partition the mirror knows but has not written yet ----------------------------------------


def test_issue_dump_of_a_partition_a_starting_mirror_knows(kafka_bootstrap, make_topic,
                                                           tmp_path, running):
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, [(0, b"k%d" % i, b"v%d" % i) for i in range(5)])
    store = tmp_path / "store"
    mirror = running("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                     "--store", store, "--follow", "--partitions", "0,1")
    mirror.wait_for("(following)")
    # partition 1 has no record (in Kafka nor in the store) but the mirror knows it
    proc = kcompact("dump", "--store", store, "--topic", topic, "--partition", "1")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    # partition 2 is the topic's, but not mirrored: not in the store
    proc = kcompact("dump", "--store", store, "--topic", topic, "--partition", "2")
    assert proc.returncode == 1
    assert error_lines(proc) == [f"kcompact: error: {topic}-2 is not in store {store}; "
                                 f"partitions of '{topic}': 0, 1"]
    assert mirror.stop(signal.SIGTERM) == 0
    proc = kcompact("dump", "--store", store, "--topic", topic, "--partition", "0")
    assert len(proc.stdout.splitlines()) == 5


# -- nothing left behind by a command that failed -------------------------------------------------


@pytest.mark.parametrize("engine", [[], ["--engine", "local"]], ids=["default", "local"])
def test_issue_mirror_with_a_partition_the_topic_lacks_creates_nothing(
        kafka_bootstrap, make_topic, tmp_path, engine):
    topic = make_topic(partitions=3)
    store = tmp_path / "store"
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", store, "--partitions", "0,2-3", *engine)
    assert proc.returncode == 1
    assert error_lines(proc) == [f"kcompact: error: --partitions: topic '{topic}' has "
                                 "partitions 0..2; it has no partition 3"]
    assert not store.exists()


def test_issue_mirror_of_several_topics_one_lacking_a_partition_creates_nothing(
        kafka_bootstrap, make_topic, tmp_path):
    """Every topic's partitions are checked before the store is created for the first one."""
    wide, narrow = make_topic(partitions=4), make_topic(partitions=2)
    store = tmp_path / "store"
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", wide,
                    "--topic", narrow, "--store", store, "--partitions", "1,3")
    assert proc.returncode == 1
    assert error_lines(proc) == [f"kcompact: error: --partitions: topic '{narrow}' has "
                                 "partitions 0..1; it has no partition 3"]
    assert not store.exists()


def _store_of(tmp_path, topic: str, records: int) -> str:
    """A store holding ``records`` distinct keys of ~200 bytes in partitions 0 and 1."""
    url = str(tmp_path / "store")
    with Store.open(url, writer="w", create=True) as st:
        st.append(RecordBatch.from_records(topic, [
            (p, i, 1_700_000_000_000 + i, b"key-%d-%d" % (p, i), b"v" * 200, [])
            for p in range(2) for i in range(records)]))
        st.flush()
    return url


@pytest.mark.parametrize("exactly_once", ["requested", "disabled"])
def test_issue_restore_from_a_damaged_store_leaves_no_topic(kafka_bootstrap, tmp_path,
                                                             exactly_once):
    url = _store_of(tmp_path, "orders", 300)
    where = flip_byte_in_the_middle(url, "orders", 0)
    target = f"restored-{uuid.uuid4().hex[:8]}"
    proc = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                    kafka_bootstrap, "--to-topic", target, "--exactly-once", exactly_once)
    assert proc.returncode == 1
    errors = error_lines(proc)
    assert len(errors) == 1 and where in errors[0], proc.stderr
    assert f"restore: deleted topic '{target}': this run created it and wrote nothing to it" \
        in proc.stderr
    assert not topic_exists(kafka_bootstrap, target)


def test_restore_keeps_a_topic_it_committed_records_to(kafka_bootstrap, tmp_path):
    """Damage met after the first chunks were committed: the topic stays, and holds exactly
    what the recorded progress says was produced."""
    url = _store_of(tmp_path, "orders", 300)
    flip_byte_in_the_middle(url, "orders", 1)   # met in the 4th chunk (50 records a partition)
    target = f"restored-{uuid.uuid4().hex[:8]}"
    proc = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                    kafka_bootstrap, "--to-topic", target, "--chunk-records", "100")
    assert proc.returncode == 1 and len(error_lines(proc)) == 1, proc.stderr
    assert "deleted topic" not in proc.stderr
    assert topic_exists(kafka_bootstrap, target)


# -- mirror --follow with the broker down ---------------------------------------------------------


def test_issue_mirror_follow_says_it_is_disconnected(tmp_path, running):
    broker = EmbeddedBroker().start()
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        admin.create_topics([NewTopic("followed", 2, 1)])["followed"].result(30)
        del admin
        mirror = running("mirror", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
                         "followed", "--store", tmp_path / "store", "--follow")
        mirror.wait_for("lag 0")   # connected, caught up
    finally:
        broker.stop()
    line = mirror.wait_for("disconnected since")
    # "mirror: N records, R rec/s, disconnected since HH:MM:SS (N s): ...; lag unknown"
    when = line.split("disconnected since ", 1)[1].split(" ", 1)[0]
    assert time.strptime(when, "%H:%M:%S")
    assert "lag unknown" in line and "lag 0" not in line
    assert mirror.stop(signal.SIGINT) == 130


# -- Spark without the JVM's incubator warning ----------------------------------------------------


def test_issue_a_spark_mirror_prints_no_incubator_warning(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    produce(kafka_bootstrap, topic, [(i % 2, b"k%d" % i, b"v%d" % i) for i in range(200)])
    proc = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                    "--store", tmp_path / "store", "--engine", "spark", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "mirror: done: 200 records" in proc.stderr
    assert "jdk.incubator.vector" not in proc.stderr + proc.stdout
    assert "WARNING:" not in proc.stderr


# -- a quiet end of session -----------------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[2]


def test_issue_no_kafka_client_outlives_the_session_broker():
    """A restore that fails on a record Kafka refuses kept its producer alive for good (the
    delivery callback each record carries from C was bound to the runner, which held the
    failure and its traceback), and the traceback's frames kept the test's arguments, the
    session admin client among them: after the session's broker stopped it printed "Connection
    refused" every second, after the test summary. A pytest session of that one test, in a
    subprocess with its own broker, now ends without a line from librdkafka."""
    test = "tests/integration/test_restore.py::test_record_larger_than_the_producer_limit"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout
    summary = next(i for i, ln in enumerate(proc.stdout.splitlines()) if " passed" in ln)
    after = proc.stdout.splitlines()[summary + 1:]
    assert not [ln for ln in after if "Connection refused" in ln], proc.stdout
    assert "rdkafka#" not in proc.stdout, proc.stdout


# -- a newcomer's 2 MB record on the real Kafka (issue 41) -----------------------------------------


TWO_MB = 2 << 20


def _produce_big(bootstrap: str, topic: str, value: bytes) -> str | None:
    """Produce one record of ``value``; None when Kafka took it, else the delivery error."""
    errors: list[str] = []
    p = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 4 << 20,
                  "compression.type": "none"})
    p.produce(topic, key=b"big", value=value,
              on_delivery=lambda err, msg: errors.append(str(err)) if err else None)
    assert p.flush(60) == 0
    return errors[0] if errors else None


def test_issue_broker_override_takes_a_two_megabyte_record(apache_kafka, tmp_path, running):
    """Kafka's default message.max.bytes (~1 MiB) refuses a 2 MB record; `kcompact broker
    --engine kafka --override message.max.bytes=4194304` (kafka-server-start.sh's flag) raises
    it, and the record is produced, mirrored and dumped whole."""
    if apache_kafka.process is None:
        pytest.skip("needs a real Apache Kafka this session starts (its launcher's jars)")
    value = os.urandom(TWO_MB)
    topic = f"big-{uuid.uuid4().hex[:8]}"
    admin = apache_kafka.admin
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    refused = _produce_big(apache_kafka.bootstrap, topic, value)
    assert refused is not None and "MSG_SIZE_TOO_LARGE" in refused, refused

    port = free_port()
    broker = running("broker", "--engine", "kafka", "--port", port,
                     "--override", "message.max.bytes=4194304")
    deadline = time.monotonic() + LIVENESS_S
    while not any("listening on" in ln for ln in broker.out):
        assert broker.p.poll() is None, "".join(broker.err)
        assert time.monotonic() < deadline, "".join(broker.err)
        time.sleep(0.1)
    bootstrap = f"127.0.0.1:{port}"
    big_admin = AdminClient({"bootstrap.servers": bootstrap})
    big_admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    assert _produce_big(bootstrap, topic, value) is None
    store = tmp_path / "store"
    mirror = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic,
                      "--store", store, "--engine", "local")
    assert mirror.returncode == 0, mirror.stderr
    dump = kcompact("dump", "--store", store, "--topic", topic, "--partition", 0, "--json")
    assert dump.returncode == 0, dump.stderr
    (row,) = [json.loads(ln) for ln in dump.stdout.splitlines()]
    assert base64.b64decode(row["value_b64"]) == value
    del big_admin
    assert broker.stop(signal.SIGTERM) == 0
