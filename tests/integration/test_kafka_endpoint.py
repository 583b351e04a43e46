"""The Kafka endpoint (``kcompact serve --kafka-listen``, issue 40) against Apache Kafka 3.9.1.

One topic (2 partitions) is produced to the real Kafka: keyed updates, tombstones, keyless records,
headers, empty values, batches from a zstd and a gzip producer, one committed and one aborted
transaction (partition 1 ends with the committed transaction's marker: a trailing gap). It is
mirrored into a store (``mirror_local``, as ``kcompact mirror``), and the store is served by
``kcompact serve --store S --kafka-listen 127.0.0.1:0`` started as a process and stopped by the
test. Then unmodified clients read both and must agree:

* confluent-kafka with ``assign`` (read_committed and read_uncommitted: the store holds what
  read_committed sees), end offsets, ListOffsets by time, earliest, latest;
* Kafka's Java tools from the cached jars: ConsoleConsumer with ``--partition`` and with
  ``--group``, GetOffsetShell (-1, -2, -3), VerifiableConsumer;
* a Java loop shaped like Kafka Streams' GlobalKTable restore (``position < endOffsets``) on the
  partition ending in a gap, which must finish;
* after a forced compaction of the store: the endpoint serves exactly the compacted store's
  records (the live state: the latest value of every key, keyless records kept), and a restore
  loop still finishes.

And: consumer groups (two confluent-kafka members rebalancing, commits kept across a restart of
the endpoint), a refused produce leaving the store unchanged, SASL/PLAIN and TLS, and bad clients
(garbage, a 2 GiB size prefix, an unknown API key, idle connections) that never take the
endpoint down. kcat runs when installed (skipped with the reason otherwise).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kcompact.compaction import CompactionOptions, compact_store
from kcompact.connectors.apps.mirror import mirror_local
from kcompact.connectors.devtools.apache_kafka import fetch as fetch_jars
from kcompact.connectors.devtools.apache_kafka import find_java, tool_command
from kcompact.reput import ManualClock, Store

sys.path.insert(0, os.path.dirname(__file__))
from topics import read_store  # noqa: E402

pytestmark = pytest.mark.integration

KCOMPACT = [sys.executable, "-m", "kcompact"]
#: the records' timestamps start here (recent: an old CreateTime would let the topic's
#: retention delete them on the Kafka side during the run)
T0 = (int(time.time()) - 3600) * 1000


# -- the workload ------------------------------------------------------------------------------


def _produce(bootstrap: str, topic: str) -> None:
    base = {"bootstrap.servers": bootstrap, "linger.ms": 5}
    for codec, part in (("zstd", 0), ("gzip", 1), ("none", 0)):
        p = Producer({**base, "compression.type": codec})
        for i in range(60):
            key = None if i % 11 == 0 else b"k%02d" % (i % 17)
            value = None if i % 13 == 5 else b"" if i % 19 == 3 else b"%s-%d-" % (
                codec.encode(), i) + b"x" * (i % 40)
            if key is None and value is None:
                value = b"keyless"
            p.produce(topic, key=key, value=value, partition=part, timestamp=T0 + i * 10,
                      headers=[("h", b"%d" % i), ("empty", b"")] if i % 3 == 0 else None)
        assert p.flush(30) == 0
    for committed, part in ((False, 0), (True, 1)):
        tp = Producer({**base, "transactional.id": f"ep-{topic}-{committed}"})
        tp.init_transactions(30)
        tp.begin_transaction()
        for i in range(5):
            tp.produce(topic, key=b"tx%d" % i, value=b"committed" if committed else b"aborted",
                       partition=part, timestamp=T0 + 5000 + i)
        tp.flush(30)
        (tp.commit_transaction if committed else tp.abort_transaction)(30)
    # each partition ends with a tombstone, which a compaction with delete.retention.ms=0
    # removes: the compacted store then ends in a gap (its end offset does not move back)
    p = Producer(base)
    for part, key in ((0, b"k00"), (1, b"tx4")):
        p.produce(topic, key=key, value=None, partition=part, timestamp=T0 + 6000)
    assert p.flush(30) == 0


def read_all(bootstrap: str, topic: str, partitions: int = 2, *, isolation: str =
             "read_committed", extra: dict | None = None) -> dict[int, list[tuple]]:
    """Every record per partition (offset, ts, key, value, headers) and, under key -1, the
    offset each partition's end-of-partition event came at."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": isolation, **(extra or {})})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: dict[int, list] = {p: [] for p in range(partitions)}
    eof: dict[int, int] = {}
    deadline = time.monotonic() + 60
    try:
        while len(eof) < partitions:
            assert time.monotonic() < deadline, f"no end of partition reached: {eof}"
            for m in c.consume(1000, 0.5):
                if m.error() is not None:
                    assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
                    eof[m.partition()] = m.offset()
                    continue
                out[m.partition()].append((m.offset(), m.timestamp()[1], m.key(), m.value(),
                                           tuple(m.headers() or ())))
    finally:
        c.close()
    out[-1] = [eof[p] for p in range(partitions)]
    return out


# -- the endpoint as a process -----------------------------------------------------------------


class Endpoint:
    def __init__(self, store: str | Path, *extra: str, log: Path):
        self.args = [*KCOMPACT, "serve", "--store", str(store), "--kafka-listen", "127.0.0.1:0",
                     *extra]
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> "Endpoint":
        err = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err)
        line = self.proc.stdout.readline().decode()
        assert line.startswith("kafka endpoint listening on 127.0.0.1:"), (
            line, self.log.read_text())
        self.port = int(line.rsplit(":", 1)[1])
        return self

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def served(apache_kafka, tmp_path_factory):
    """(kafka bootstrap, topic, store url, running Endpoint, work dir)."""
    from confluent_kafka.admin import NewTopic
    topic = f"ep-{uuid.uuid4().hex[:8]}"
    apache_kafka.admin.create_topics([NewTopic(topic, 2, 1, config={"retention.ms": "-1"})]
                                     )[topic].result()
    _produce(apache_kafka.bootstrap, topic)
    work = tmp_path_factory.mktemp("endpoint")
    url = str(work / "store")
    mirror_local(apache_kafka.bootstrap, topic, url, out=io.StringIO(), handle_signals=False)
    ep = Endpoint(url, log=work / "endpoint.log").start()
    try:
        yield apache_kafka.bootstrap, topic, url, ep, work
    finally:
        ep.stop()
        apache_kafka.admin.delete_topics([topic], operation_timeout=30)


def java(main: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(tool_command(main, list(args)), capture_output=True, text=True,
                          timeout=timeout)


# -- records, end offsets, ListOffsets -----------------------------------------------------------


def test_confluent_assign_reads_what_kafka_serves(served):
    kafka, topic, _url, ep, _ = served
    ours = read_all(ep.bootstrap, topic)
    theirs = read_all(kafka, topic)
    assert ours == theirs
    assert sum(len(ours[p]) for p in (0, 1)) > 150
    assert ours[-1] == [ours[0][-1][0] + 1, ours[1][-1][0] + 1]
    # read_uncommitted: Kafka also shows the aborted records; the store holds committed data
    uncommitted = read_all(ep.bootstrap, topic, isolation="read_uncommitted")
    assert uncommitted == theirs
    assert any(r[3] == b"aborted" for r in read_all(kafka, topic,
                                                     isolation="read_uncommitted")[0])


def test_list_offsets_agree(served):
    kafka, topic, _url, ep, _ = served
    answers = []
    for bs in (kafka, ep.bootstrap):
        c = Consumer({"bootstrap.servers": bs, "group.id": "lo"})
        try:
            wm = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in (0, 1)]
            times = [T0 - 1, T0, T0 + 15, T0 + 300, T0 + 5002, T0 + 10 ** 9]
            by_time = [[r.offset for r in c.offsets_for_times(
                [TopicPartition(topic, p, t) for p in (0, 1)], timeout=10)] for t in times]
        finally:
            c.close()
        answers.append((wm, by_time))
    (kwm, kby), (owm, oby) = answers
    assert owm == kwm
    committed = read_all(kafka, topic)
    for t, k, o in zip(times, kby, oby):
        for p in (0, 1):
            # Kafka's time index also holds aborted records (a read_committed consumer that
            # seeks there steps over them); the store holds committed records only: ours is
            # the first committed record at or after Kafka's answer
            want = k[p] if k[p] < 0 else min(
                (r[0] for r in committed[p] if r[0] >= k[p]), default=-1)
            assert o[p] == want, (t, p, k[p], o[p])
    shell = [java("org.apache.kafka.tools.GetOffsetShell", "--bootstrap-server", bs,
                  "--topic", topic, "--time", t) for bs in (kafka, ep.bootstrap)
             for t in ("-1", "-2", "-3")]
    assert all(r.returncode == 0 for r in shell), [r.stderr[-500:] for r in shell]
    assert [r.stdout for r in shell[:2]] == [r.stdout for r in shell[3:5]]
    # -3 (max timestamp): Kafka's answer is a transaction marker here (a marker's timestamp
    # is when it was written, after every record's); the store holds no marker: ours is the
    # first record holding the largest record timestamp
    ours = read_all(ep.bootstrap, topic)
    want = "".join(f"{topic}:{p}:{max(ours[p], key=lambda r: (r[1], -r[0]))[0]}\n"
                   for p in (0, 1))
    assert shell[5].stdout == want


# -- Java clients ----------------------------------------------------------------------------------


def _console(bs: str, topic: str, *args: str) -> list[str]:
    r = java("org.apache.kafka.tools.consumer.ConsoleConsumer", "--bootstrap-server", bs,
             "--topic", topic, "--timeout-ms", "20000", "--property", "print.offset=true",
             "--property", "print.key=true", "--property", "print.headers=true",
             "--property", "print.timestamp=true", *args)
    assert "Processed a total of" in r.stderr, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_console_consumer_by_partition_and_by_group(served):
    kafka, topic, _url, ep, _ = served
    counts = {p: len(v) for p, v in read_all(ep.bootstrap, topic).items() if p >= 0}
    for p in (0, 1):
        args = ("--partition", str(p), "--offset", "earliest", "--max-messages",
                str(counts[p]), "--isolation-level", "read_committed")
        ours = _console(ep.bootstrap, topic, *args)
        assert len(ours) == counts[p] and ours == _console(kafka, topic, *args)
    args = ("--from-beginning", "--max-messages", str(sum(counts.values())))
    group = _console(ep.bootstrap, topic, "--group", f"cg-{uuid.uuid4().hex[:6]}", *args)
    want = _console(kafka, topic, "--group", f"cg-{uuid.uuid4().hex[:6]}", *args,
                    "--isolation-level", "read_committed")
    assert sorted(group) == sorted(want)


def test_verifiable_consumer_consumes_and_commits(served):
    _kafka, topic, _url, ep, _ = served
    total = sum(len(v) for k, v in read_all(ep.bootstrap, topic).items() if k >= 0)
    r = java("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", ep.bootstrap,
             "--topic", topic, "--group-id", f"vc-{uuid.uuid4().hex[:6]}", "--max-messages",
             str(total), "--reset-policy", "earliest", "--session-timeout", "10000",
             timeout=120)
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    consumed = sum(e["count"] for e in events if e["name"] == "records_consumed")
    commits = [e for e in events if e["name"] == "offsets_committed"]
    assert consumed == total, r.stderr[-2000:]
    assert commits and all(e["success"] for e in commits), commits


RESTORE_JAVA = """
import java.time.Duration;
import java.util.*;
import org.apache.kafka.clients.consumer.*;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

// The loop of Kafka Streams' GlobalStateManagerImpl.restoreState: poll until the position
// reaches the end offset read at the start.
public class Restore {
  public static void main(String[] a) {
    Properties p = new Properties();
    p.put("bootstrap.servers", a[0]);
    p.put("key.deserializer", ByteArrayDeserializer.class.getName());
    p.put("value.deserializer", ByteArrayDeserializer.class.getName());
    p.put("isolation.level", "read_committed");
    try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(p)) {
      TopicPartition tp = new TopicPartition(a[1], Integer.parseInt(a[2]));
      c.assign(List.of(tp));
      c.seekToBeginning(List.of(tp));
      long end = c.endOffsets(List.of(tp)).get(tp);
      long n = 0, deadline = System.currentTimeMillis() + 30000;
      while (c.position(tp) < end) {
        if (System.currentTimeMillis() > deadline) { System.out.println("TIMEOUT " + c.position(tp) + " " + end); System.exit(2); }
        n += c.poll(Duration.ofMillis(200)).count();
      }
      System.out.println("RESTORED " + n + " " + c.position(tp) + " " + end);
    }
  }
}
"""


def _restore(bs: str, topic: str, partition: int, work: Path) -> str:
    src = work / "Restore.java"
    src.write_text(RESTORE_JAVA)
    libs = fetch_jars()
    r = subprocess.run([find_java(), "-cp", str(libs / "*"), str(src), bs, topic,
                        str(partition)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("RESTORED"), (r.stdout, r.stderr[-2000:])
    return r.stdout.split()


def test_global_ktable_restore_loop_matches_kafka(served):
    kafka, topic, _url, ep, work = served
    for p in (0, 1):
        assert _restore(ep.bootstrap, topic, p, work) == _restore(kafka, topic, p, work)


# -- compaction ------------------------------------------------------------------------------------


def test_after_compaction_the_endpoint_serves_the_compacted_store(served, tmp_path):
    kafka, topic, url, _ep, work = served
    copy = tmp_path / "compacted"
    shutil.copytree(url, copy)
    with Store.open(str(copy), writer="t") as st:
        st.set_topic_config(topic, {"cleanup.policy": "compact", "min.compaction.lag.ms": 0,
                                    "delete.retention.ms": 0})
        # a tombstone is stamped by the pass that first cleans it and dropped by a pass
        # delete.retention.ms later (as in Kafka): two passes, the clock moved between them
        clock = ManualClock(int(time.time() * 1000))
        for _ in range(2):
            compact_store(st, topic=topic, force=True, options=CompactionOptions(),
                          clock=clock)
            clock.advance(5000)
    stored = read_store(str(copy), topic)
    ep = Endpoint(copy, log=tmp_path / "ep.log").start()
    try:
        ours = read_all(ep.bootstrap, topic)
        for p in (0, 1):
            assert ours[p] == stored[p]
        full = read_all(kafka, topic)
        # the live state: the latest value of every key, every keyless record
        for p in (0, 1):
            latest: dict = {}
            for off, _ts, k, v, _h in full[p]:
                if k is not None:
                    latest[k] = (off, v)
            live = {k: ov for k, ov in latest.items() if ov[1] is not None}
            got = {r[2]: (r[0], r[3]) for r in ours[p] if r[2] is not None and r[3] is not None}
            assert got == live
            assert [r for r in ours[p] if r[2] is None] == [r for r in full[p] if r[2] is None]
        # the end offsets do not move back: each partition now ends in a gap (its last
        # record, a tombstone, was removed), which the endpoint bridges
        assert ours[-1] == full[-1]
        assert all(ours[p][-1][0] + 1 < ours[-1][p] for p in (0, 1)), (
            [ours[p][-3:] for p in (0, 1)], ours[-1])
        for p in (0, 1):  # the GlobalKTable restore loop reaches the end offset
            _, n, position, end = _restore(ep.bootstrap, topic, p, work)
            assert int(n) == len(ours[p]) and position == end == str(full[-1][p])
    finally:
        ep.stop()


# -- groups ------------------------------------------------------------------------------------------


def _member(bs: str, group: str, name: str) -> Consumer:
    return Consumer({"bootstrap.servers": bs, "group.id": group, "client.id": name,
                     "auto.offset.reset": "earliest", "enable.auto.commit": False,
                     "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})


def test_group_rebalances_and_keeps_commits_across_a_restart(served, tmp_path):
    _kafka, topic, url, ep, _ = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    a = _member(ep.bootstrap, group, "a")
    a.subscribe([topic])
    got, deadline = 0, time.monotonic() + 30
    while got < 40 and time.monotonic() < deadline:
        m = a.poll(0.5)
        got += m is not None and m.error() is None
    assert {tp.partition for tp in a.assignment()} == {0, 1}
    a.commit(asynchronous=False)
    committed = {tp.partition: tp.offset for tp in a.committed(
        [TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)}
    assert any(o >= 0 for o in committed.values())
    b = _member(ep.bootstrap, group, "b")
    b.subscribe([topic])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        a.poll(0.1)
        b.poll(0.1)
        if len(a.assignment()) == 1 and len(b.assignment()) == 1:
            break
    assert {tp.partition for tp in a.assignment() + b.assignment()} == {0, 1}
    b.close()
    a.close()
    ep.stop()
    ep.start()  # the same store, a new process: the commits are read back from the store
    c = _member(ep.bootstrap, group, "c")
    try:
        again = {tp.partition: tp.offset for tp in c.committed(
            [TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)}
    finally:
        c.close()
    assert again == committed


# -- refused produce, security, bad clients ----------------------------------------------------


def test_produce_is_refused_and_the_store_is_unchanged(served):
    _kafka, topic, url, ep, _ = served
    before = read_store(url, topic)
    errors = []
    p = Producer({"bootstrap.servers": ep.bootstrap, "message.timeout.ms": 10000,
                  "retries": 0})
    p.produce(topic, key=b"k", value=b"v", partition=0,
              on_delivery=lambda err, _m: errors.append(err))
    p.flush(15)
    assert len(errors) == 1 and errors[0] is not None
    assert errors[0].code() == KafkaError.POLICY_VIOLATION, errors[0]
    assert read_store(url, topic) == before


def _tls_files(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_sasl_plain_and_tls(served, tmp_path):
    _kafka, topic, url, _ep, _ = served
    token = "t0k3n-" + uuid.uuid4().hex
    (tmp_path / "token").write_text(token + "\n")
    cert, key = _tls_files(tmp_path)
    want = read_all(_ep.bootstrap, topic)
    ep = Endpoint(url, "--kafka-token-file", str(tmp_path / "token"), "--tls-cert", str(cert),
                  "--tls-key", str(key), log=tmp_path / "ep.log").start()
    try:
        ok = {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN",
              "sasl.username": "anyone", "sasl.password": token, "ssl.ca.location": str(cert)}
        assert read_all(ep.bootstrap, topic, extra=ok) == want
        for bad in ({**ok, "sasl.password": "wrong-" + token}, {
                "security.protocol": "SSL", "ssl.ca.location": str(cert)}):
            c = Consumer({"bootstrap.servers": ep.bootstrap, "group.id": "x", **bad})
            try:
                with pytest.raises(Exception):
                    c.list_topics(timeout=5)
            finally:
                c.close()
        assert ep.alive()
    finally:
        ep.stop()
    log = (tmp_path / "ep.log").read_text()
    assert "authentication failed" in log or "before SASL authentication" in log


def _frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def test_bad_clients_never_take_the_endpoint_down(served):
    _kafka, topic, _url, ep, work = served
    want = read_all(ep.bootstrap, topic)
    idle = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(20)]
    sends = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",            # garbage: 1.19 GB size prefix
             struct.pack(">i", 2 ** 31 - 1) + b"x" * 100,      # a 2 GiB size prefix
             _frame(struct.pack(">hhih", 9999, 0, 1, -1)),      # an unknown API key
             _frame(struct.pack(">hhih", 1, 99, 2, -1)),        # Fetch v99
             _frame(struct.pack(">hhih", 3, 12, 3, 1) + b"x"),  # a truncated Metadata v12
             _frame(b"\x00\x12\x00\x04\x00\x00\x00\x07\xff\xff\x00\x00"),  # ApiVersions v4
             ]
    answers = []
    for data in sends:
        s = socket.create_connection(("127.0.0.1", ep.port))
        s.settimeout(10)
        s.sendall(data)
        got = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if data.startswith(b"\x00\x00\x00\x0c\x00\x12") and len(got) >= 4 and \
                        len(got) >= 4 + struct.unpack(">i", got[:4])[0]:
                    break
        except socket.timeout:
            pass
        answers.append(got)
        s.close()
    # ApiVersions v4: UNSUPPORTED_VERSION (35) with a v0 body listing the versions served
    assert answers[-1][4:8] == b"\x00\x00\x00\x07" and answers[-1][8:10] == b"\x00\x23"
    assert all(a == b"" for a in answers[:-1])  # each closed with a logged reason
    assert ep.alive()
    assert read_all(ep.bootstrap, topic) == want
    for s in idle:
        s.close()
    log = ep.log.read_text()
    assert "request size of" in log and "not served" in log


def test_kcat_reads_the_endpoint(served):
    kafka, topic, _url, ep, _ = served
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        pytest.skip("kcat is not installed (Debian: apt-get install kcat)")
    out = []
    for bs in (kafka, ep.bootstrap):
        r = subprocess.run([kcat, "-b", bs, "-C", "-t", topic, "-p", "1", "-o", "beginning",
                            "-e", "-q", "-X", "isolation.level=read_committed", "-f",
                            "%o %k %s\\n"], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out.append(r.stdout)
    assert out[0] == out[1] and out[0]
