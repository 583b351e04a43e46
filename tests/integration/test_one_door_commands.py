"""One door to a partition (issue 48), through the commands a user runs: a partition whose
segment list (segments.json) is gone is refused by ``kcompact dump``, ``kcompact kv build``,
``kcompact serve`` (its replication API, what ``kcompact replicate`` reads) and its Kafka
endpoint (``serve --kafka-listen``: what a real Kafka client gets) alike, with the same one
line, while the other partition is served whole.

Every command is a ``kcompact`` process (DESIGN.md's command-line contract); the Kafka clients
are confluent-kafka (librdkafka) and kcat. tests/unit/test_one_door.py checks the same in one
process, through the layers' own objects. About 15 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))

from test_issue51_damage import N, TOPIC, build, pdir  # noqa: E402

from kcompact.reput import filenames as fn  # noqa: E402

KCOMPACT = str(Path(sys.executable).parent / "kcompact")
TIMEOUT = 120


def kc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=TIMEOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, *ports: int) -> None:
    deadline = time.monotonic() + 60
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"kcompact serve did not start: {proc.stdout.read()}")
                time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.stdout.read()


def _latest(dumped: str) -> dict[str, tuple[int, str]]:
    """Each key's last (offset, value) in a ``dump --json``."""
    out = {}
    for r in map(json.loads, dumped.splitlines()):
        out[r["key"]] = (r["offset"], r["value"])
    return out


def _error_line(p: subprocess.CompletedProcess) -> str:
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("kcompact: error: ")]
    return line[len("kcompact: error: "):]


def test_a_partition_without_its_segment_list_is_refused_alike_by_every_command(tmp_path):
    ck = pytest.importorskip("confluent_kafka", reason="confluent-kafka (the test extra) "
                             "reads the Kafka endpoint")
    url = str(tmp_path / "s")
    build(url)  # partitions 0 and 1, N records each
    os.remove(os.path.join(pdir(url, 0), fn.SEGMENT_LIST))

    # kcompact dump: the store's one line; partition 1 dumps whole
    p = kc("dump", "--store", url, "--topic", TOPIC, "--partition", "0")
    assert p.returncode == 1 and p.stdout == "", p.stderr
    line = _error_line(p)
    assert "\n" not in line and f"{fn.partition_dir(TOPIC, 0)}/segments.json" in line, line
    p = kc("dump", "--store", url, "--topic", TOPIC, "--partition", "1", "--json")
    assert p.returncode == 0 and len(p.stdout.splitlines()) == N, p.stderr
    latest1 = _latest(p.stdout)

    # kcompact kv build: the same line, naming the partition
    p = kc("kv", "build", "--store", url, "--topic", TOPIC, "--db", str(tmp_path / "db"))
    assert p.returncode == 1 and f"partition t-0 is damaged ({line})" in _error_line(p), \
        p.stderr

    token = tmp_path / "token"
    token.write_text("one-door-token-0123456789abcdef")
    token.chmod(0o600)
    http, kafka = _free_port(), _free_port()
    serve = subprocess.Popen([KCOMPACT, "serve", "--store", url, "--listen",
                              f"127.0.0.1:{http}", "--token-file", str(token),
                              "--kafka-listen", f"127.0.0.1:{kafka}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(serve, http, kafka)

        # kcompact replicate from kcompact serve: partition 0 refused with the line (exit 1),
        # partition 1 replicated
        replica = str(tmp_path / "replica")
        p = kc("replicate", "--from", f"http://127.0.0.1:{http}", "--token-file", str(token),
               "--store", replica)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"holds t-0 but does not serve it: damaged on the master: {line};" in \
            _error_line(p), p.stderr
        p = kc("dump", "--store", replica, "--topic", TOPIC, "--partition", "1", "--json")
        assert p.returncode == 0 and _latest(p.stdout) == latest1, p.stderr  # (compacted)

        # the Kafka endpoint: a Kafka client asking for partition 0 gets KAFKA_STORAGE_ERROR
        # (the protocol carries a code, not a line); partition 1 is read to its end
        c = ck.Consumer({"bootstrap.servers": f"127.0.0.1:{kafka}", "group.id": "one-door",
                         "enable.auto.commit": False})
        try:
            with pytest.raises(ck.KafkaException) as got:
                c.get_watermark_offsets(ck.TopicPartition(TOPIC, 0), timeout=30)
            assert got.value.args[0].code() == ck.KafkaError.KAFKA_STORAGE_ERROR, got.value
            assert c.get_watermark_offsets(ck.TopicPartition(TOPIC, 1), timeout=30) == (0, N)
            c.assign([ck.TopicPartition(TOPIC, 1, 0)])
            n, deadline = 0, time.monotonic() + 60
            while n < N and time.monotonic() < deadline:
                m = c.poll(1.0)
                if m is not None and not m.error():
                    n += 1
            assert n == N
        finally:
            c.close()
        if shutil.which("kcat"):  # (kcat: the same answer, in its own words)
            q = subprocess.run(["kcat", "-b", f"127.0.0.1:{kafka}", "-Q", "-t",
                                f"{TOPIC}:0:-1"], capture_output=True, text=True,
                               timeout=TIMEOUT)
            assert "Disk error when trying to access log file" in q.stdout + q.stderr, q
    finally:
        log = _stop(serve)
    assert "Traceback" not in log, log

    # what the endpoint refused it with is recorded beside the partition: the same line,
    # which `kcompact inspect` shows
    p = kc("inspect", "--store", url)
    assert f"t-0: DAMAGED: {line} (found by " in p.stdout, p.stdout + p.stderr
