"""What the Kafka endpoint's integration tests share (not a test module): the endpoint as an
operator runs it (``kcompact serve --store S --kafka-listen 127.0.0.1:0`` as a process, its port
read from the line it prints), a confluent-kafka reader of every partition to its end, the SASL
client of the ACL tests (``sasl_conf``, ``read_to_end``, ``first_of_subscription``), Kafka's
Java tools from the cached jars, and a Java loop shaped like Kafka Streams' GlobalKTable restore.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kcompact.connectors.devtools.apache_kafka import fetch as fetch_jars
from kcompact.connectors.devtools.apache_kafka import find_java, tool_command

KCOMPACT = [sys.executable, "-m", "kcompact"]


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


def sasl_conf(bootstrap: str, user: str, password: str, mechanism: str = "PLAIN",
              **extra) -> dict:
    """A confluent-kafka configuration authenticating as ``user`` (SASL_PLAINTEXT)."""
    return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanisms": mechanism, "sasl.username": user, "sasl.password": password,
            **extra}


def read_to_end(conf: dict, topic: str, group: str, partition: int = 0,
                within: float = 30) -> tuple[list, KafkaError | None]:
    """(the (offset, key, value) read with assign from offset 0, in ``group``; None at the
    partition's end, else the error that stopped the read); TimeoutError if neither came."""
    c = Consumer({**conf, "group.id": group, "enable.auto.commit": False,
                  "enable.partition.eof": True})
    c.assign([TopicPartition(topic, partition, 0)])
    got, deadline = [], time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            for m in c.consume(100, 0.5):
                e = m.error()
                if e is None:
                    got.append((m.offset(), m.key(), m.value()))
                elif e.code() == KafkaError._PARTITION_EOF:
                    return got, None
                else:
                    return got, e
        raise TimeoutError(f"{topic}: neither the end nor an error within {within:g} s")
    finally:
        c.close()


def first_of_subscription(conf: dict, topic: str, group: str, commit: bool = False,
                          within: float = 30) -> KafkaError | None:
    """The error a consumer subscribing to ``topic`` in ``group`` meets, or None once it got a
    record (and, with ``commit``, committed it); TimeoutError if neither came."""
    c = Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is not None:
                return m.error()
            if commit:
                c.commit(m, asynchronous=False)
            return None
        raise TimeoutError(f"{topic}: no record and no error within {within:g} s")
    finally:
        c.close()


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


def java(main: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(tool_command(main, list(args)), capture_output=True, text=True,
                          timeout=timeout)


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


def restore(bs: str, topic: str, partition: int, work: Path) -> str:
    src = work / "Restore.java"
    src.write_text(RESTORE_JAVA)
    libs = fetch_jars()
    r = subprocess.run([find_java(), "-cp", str(libs / "*"), str(src), bs, topic,
                        str(partition)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("RESTORED"), (r.stdout, r.stderr[-2000:])
    return r.stdout.split()


@contextmanager
def serving(kafka, topic: str, url: str, work: Path):
    """The endpoint over ``url`` while the block runs (a module fixture's yield): (kafka
    bootstrap, topic, store url, Endpoint, work dir); then it stops and ``topic`` is deleted from
    ``kafka`` (the ``apache_kafka`` fixture's broker)."""
    ep = Endpoint(url, log=work / "endpoint.log").start()
    try:
        yield kafka.bootstrap, topic, url, ep, work
    finally:
        ep.stop()
        kafka.admin.delete_topics([topic], operation_timeout=30)


def raw_fetch(bootstrap: str, topic: str, partition: int, offset: int, version: int = 12
              ) -> tuple[int, bytes]:
    """(error code, records bytes) of one partition of a Fetch (read_uncommitted) of
    ``version``, asked with kio and decoded with kio: what a broker serves, batch bytes as
    they are."""
    from kio.serial import entity_reader

    from kcompact.replication.kafka_endpoint.wire import response_schema
    buf = raw_fetch_frame(bootstrap, topic, partition, offset, version)
    resp = response_schema(1, version)
    _, n = entity_reader(resp.__header_schema__)(buf[4:], 0)
    body, _ = entity_reader(resp)(buf[4:], n)
    (t,) = body.responses
    (p,) = t.partitions
    return int(p.error_code), bytes(p.records or b"")


def raw_fetch_frame(bootstrap: str, topic: str, partition: int, offset: int, version: int = 12
                    ) -> bytes:
    """The whole response frame (size prefix, header, body) of ``raw_fetch``'s request, as
    the broker sent it."""
    import socket
    import struct

    from kio.serial import entity_writer

    from kcompact.replication.kafka_endpoint.wire import _request_schema, build
    host, port = bootstrap.rsplit(":", 1)
    cls = _request_schema(1, version)
    out = io.BytesIO()
    entity_writer(cls.__header_schema__)(out, build(
        cls.__header_schema__, request_api_key=1, request_api_version=version, correlation_id=7,
        client_id="capture"))
    entity_writer(cls)(out, build(
        cls, replica_id=-1, max_wait=0, min_bytes=0, max_bytes=1 << 20, isolation_level=0,
        session_id=0, session_epoch=-1, topics=[{"topic": topic, "partitions": [{
            "partition": partition, "fetch_offset": offset, "partition_max_bytes": 1 << 20,
            "log_start_offset": -1, "current_leader_epoch": -1, "last_fetched_epoch": -1}]}],
        forgotten_topics_data=[], rack_id=""))
    with socket.create_connection((host, int(port)), timeout=20) as s:
        raw = out.getvalue()
        s.sendall(struct.pack(">i", len(raw)) + raw)
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">i", buf[:4])[0]:
            chunk = s.recv(1 << 16)
            assert chunk, "connection closed"
            buf += chunk
    return buf
