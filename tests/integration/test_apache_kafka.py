"""The real Apache Kafka launcher (connectors/devtools/apache_kafka.py) against real JVMs:
``kcompact broker --engine kafka`` prints the listening line, serves, and on SIGTERM stops and
removes its data; a busy port, a missing ``java`` or ``mvn`` (PATH manipulation), a release that
is not on Maven Central and a broker that exits at start are one line each; a fetch cut short
is redone; the session's real broker answers with its own cluster id.

These tests start their own brokers (a few seconds each), with the jars of the session's cache.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from brokers import apache_kafka_unavailable
from kcompact.connectors.devtools import apache_kafka
from kcompact.connectors.devtools.apache_kafka import ApacheKafkaBroker, ApacheKafkaError

ROOT = Path(__file__).resolve().parents[2]
#: the cache the session fetched into (conftest.py reads it before any fixture changes it)
CACHE = apache_kafka.cache_dir()

pytestmark = pytest.mark.skipif(apache_kafka_unavailable() is not None,
                                reason=str(apache_kafka_unavailable()))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, KCOMPACT_CACHE_DIR=str(CACHE))
    env.pop("KCOMPACT_KAFKA_VERSION", None)
    env.update(extra)
    return env


def kcompact(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only the virtualenv's bin/ and links to the named tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        import shutil
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return f"{os.path.dirname(sys.executable)}:{bin_dir}"


def _roundtrip(bootstrap: str) -> None:
    topic = f"roundtrip-{time.monotonic_ns()}"
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(topic, key=b"k", value=b"v")  # the broker auto-creates it (Kafka's default)
    assert p.flush(60) == 0
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "rt", "enable.partition.eof": True})
    c.assign([TopicPartition(topic, 0, 0)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is not None and m.error() is None:
                assert (m.key(), m.value()) == (b"k", b"v")
                return
        raise AssertionError("the record did not come back")
    finally:
        c.close()


def test_cli_broker_listens_serves_and_cleans_up_on_sigterm(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "broker", "--engine", "kafka"],
                            cwd=ROOT, env=_env(TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 150)
        assert ready, "no listening line within 150 s"
        line = proc.stdout.readline().strip()
        assert line.startswith("kcompact broker listening on 127.0.0.1:"), line
        bootstrap = line.rsplit(" ", 1)[1]
        data = list(tmp.glob("kcompact-kafka-*"))
        assert len(data) == 1 and (data[0] / "data" / "meta.properties").is_file()
        assert (data[0] / "logs" / "log-cleaner.log").exists()
        _roundtrip(bootstrap)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "kcompact broker stopping (SIGTERM)" in err
    assert list(tmp.iterdir()) == []  # data and logs removed
    host, port = bootstrap.split(":")
    with socket.socket() as s:  # nothing listens there any more
        assert s.connect_ex((host, int(port))) != 0


def test_busy_port_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = kcompact("broker", "--engine", "kafka", "--port", str(port), env=_env())
    assert res.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in error_line(res)


def test_missing_java_is_one_line(tmp_path):
    res = kcompact("broker", "--engine", "kafka", env=_env(PATH=_path_with(tmp_path)))
    assert res.returncode == 1
    assert "no `java` on PATH" in error_line(res) and "install Java 17" in error_line(res)


def test_missing_mvn_is_one_line_when_the_jars_are_not_cached(tmp_path):
    res = kcompact("broker", "--engine", "kafka",
                   env=_env(PATH=_path_with(tmp_path, "java"),
                            KCOMPACT_CACHE_DIR=str(tmp_path / "empty-cache")))
    assert res.returncode == 1
    assert "no `mvn` on PATH" in error_line(res)


def test_cached_jars_need_no_mvn(tmp_path):
    """Once fetched, the jars are used offline: no mvn on PATH, the broker still starts."""
    env = _env(PATH=_path_with(tmp_path, "java"))
    res = subprocess.run([sys.executable, "-m", "kcompact.connectors.devtools.apache_kafka",
                          "path"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == CACHE / f"kafka-{apache_kafka.KAFKA_VERSION}" / "libs"


def test_a_release_not_on_maven_central_names_the_artifact(tmp_path):
    res = kcompact("broker", "--engine", "kafka",
                   env=_env(KCOMPACT_CACHE_DIR=str(tmp_path / "c"),
                            KCOMPACT_KAFKA_VERSION="3.0.99"))
    assert res.returncode == 1
    line = error_line(res)
    assert "fetching Apache Kafka 3.0.99's jars failed: cannot resolve org.apache.kafka:" \
        "kafka_2.13:jar:3.0.99 (is the version on Maven Central" in line, line
    assert not (tmp_path / "c" / "kafka-3.0.99" / apache_kafka.MARKER).exists()


def test_a_malformed_version_is_refused(tmp_path):
    res = kcompact("broker", "--engine", "kafka", env=_env(KCOMPACT_KAFKA_VERSION="latest"))
    assert res.returncode == 1
    assert "KCOMPACT_KAFKA_VERSION='latest' is not a Kafka release number" in error_line(res)


def test_a_fetch_cut_short_is_redone(tmp_path):
    """No marker: whatever a killed fetch left is thrown away and the jars fetched again
    (from Maven's local repository here, which the session's fetch filled)."""
    vdir = tmp_path / f"kafka-{apache_kafka.KAFKA_VERSION}"
    (vdir / "libs").mkdir(parents=True)
    (vdir / "libs" / "half-a-jar.jar").write_bytes(b"PK")
    libs = apache_kafka.fetch(apache_kafka.KAFKA_VERSION, cache=tmp_path)
    assert (vdir / apache_kafka.MARKER).is_file()
    names = {p.name for p in libs.iterdir()}
    assert "half-a-jar.jar" not in names
    assert f"kafka_2.13-{apache_kafka.KAFKA_VERSION}.jar" in names
    assert "kafka-tools-" + apache_kafka.KAFKA_VERSION + ".jar" in names


def test_a_broker_that_exits_at_start_names_the_cause(tmp_path):
    broker = ApacheKafkaBroker(cache=CACHE, broker_config={"log.cleaner.threads": "not-a-number"})
    with pytest.raises(ApacheKafkaError) as info:
        broker.start()
    msg = str(info.value)
    assert "\n" not in msg and "log.cleaner.threads" in msg, msg
    assert not broker.is_running() and broker.data_dir is None


def test_a_broker_that_dies_is_one_line_with_its_log(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "broker", "--engine", "kafka"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 150)
        assert ready and "listening" in proc.stdout.readline()
        java = subprocess.run(["pgrep", "-P", str(proc.pid), "java"], capture_output=True,
                              text=True).stdout.split()
        assert len(java) == 1, java
        os.kill(int(java[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    line = [ln for ln in err.splitlines() if ln.startswith("kcompact: error:")]
    assert len(line) == 1 and "exited unexpectedly; restart it (last lines of its log:" in line[0]


def test_api_context_manager(tmp_path):
    with ApacheKafkaBroker(cache=CACHE, log_dir=tmp_path / "logs") as broker:
        assert broker.is_running() and broker.bootstrap_servers.startswith("127.0.0.1:")
        c = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": "x"})
        try:
            assert c.list_topics(timeout=20).cluster_id == broker.cluster_id
        finally:
            c.close()
        data = broker.data_dir
        assert data is not None and data.is_dir()
    assert not broker.is_running() and not data.exists()
    assert (tmp_path / "logs" / "server.log").is_file()  # a log_dir of the caller's is kept
    with pytest.raises(ApacheKafkaError, match="not running"):
        broker.bootstrap_servers


def test_session_broker_is_a_real_kafka(apache_kafka):
    """The tier's session broker: describe_configs returns Kafka's defaults too (Tansu returns
    only the configs set)."""
    from confluent_kafka.admin import ConfigResource
    res = ConfigResource(ConfigResource.Type.BROKER, "1")
    if apache_kafka.kind != "kafka":
        pytest.skip("the session's real Kafka is not one this launcher started")
    configs = apache_kafka.admin.describe_configs([res])[res].result(timeout=30)
    assert configs["log.cleaner.enable"].value == "true"
    assert configs["log.cleaner.backoff.ms"].value == "1000"
