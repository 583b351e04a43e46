"""A fleet of `kcompact serve --kafka-listen` nodes over one S3 store (SeaweedFS; issue 50,
docs/fleet.md), with unmodified clients.

* three nodes: kcat -L lists the three brokers; confluent-kafka assigned every partition (at
  node 1) and a subscribing group (at node 2) each read exactly the store's records; the group's
  commits are kept; the owners' shared blocks spare S3 GETs, and the nodes that do not poll the
  journal's heads ask the poller for them;
* one node SIGKILLed while three consumers read: every consumer still ends with every record
  (re-reads allowed) within 30 s, the survivors' ring drops it, and restarted it rejoins;
* groups committed through the fleet keep their offsets when the node coordinating them is
  SIGKILLed (the new coordinator reads them from the store), and commit again after it;
* a "peer" answering garbage stalls no client and never joins the ring;
* a fleet of one serves what a plain `serve` serves;
* two nodes with TLS on both listeners and a peer token: clients read every record, and the
  nodes share blocks and the polled heads over TLS;
* two Kafka ConsoleConsumers of one group at two nodes print every record (skipped without
  Kafka's Java tools).

Nodes are `kcompact serve` subprocesses (stdout names their ports); every wait is on a
condition. The store is built once per module. Takes ~90 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kcompact.reput import Store, WriterOptions
from kcompact.reput.record import RecordBatch

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: E402

KCOMPACT = [sys.executable, "-m", "kcompact"]
TOPIC = "fleet"
PARTS = 8
PER = 250  # records per partition
HEADS_OK = 'kcompact_fleet_peer_requests_sent_total{kind="heads",outcome="ok"}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, within: float, what: str):
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {within:g} s")
        time.sleep(0.1)


class Node:
    """One `kcompact serve` node; ``start()`` returns once its Kafka listener is up."""

    def __init__(self, url: str, nid: int | None, peers: str | None, peer_port: int | None,
                 log: Path, extra: list[str] = ()):
        self.metrics = free_port()
        self.args = [*KCOMPACT, "serve", "--store", url, "--kafka-listen", "127.0.0.1:0",
                     "--metrics", f"127.0.0.1:{self.metrics}", *extra]
        if peers is not None:
            self.args += ["--node-id", str(nid), "--peer-listen", f"127.0.0.1:{peer_port}",
                          "--peers", peers]
        self.nid, self.log, self.proc, self.port = nid, log, None, 0

    def start(self) -> "Node":
        err = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err)
        for raw in self.proc.stdout:
            line = raw.decode()
            if line.startswith("kafka endpoint listening on "):
                self.port = int(line.rsplit(":", 1)[1])
                break
        else:
            raise AssertionError(f"node {self.nid} did not start: {self.log.read_text()}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        return self

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics",
                                          timeout=2).read().decode()
        except OSError:
            return None
        total = None
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    def __init__(self, url: str, n: int, work: Path, extra_peers: dict[int, int] | None = None,
                 extra: list[str] = ()):
        self.extra = list(extra)
        self.ports = {i: free_port() for i in range(1, n + 1)}
        allp = {**self.ports, **(extra_peers or {})}
        self.peers = ",".join(f"{i}@127.0.0.1:{p}" for i, p in sorted(allp.items()))
        self.url, self.work = url, work
        self.nodes = {i: self.make(i) for i in self.ports}

    def make(self, i: int) -> Node:
        return Node(self.url, i, self.peers, self.ports[i], self.work / f"node{i}.log",
                    self.extra)

    def start(self, want_ring: int | None = None) -> "Fleet":
        for node in self.nodes.values():
            node.start()
        n = want_ring or len(self.nodes)
        wait_for(lambda: all(x.metric("kcompact_fleet_ring_members") == n
                             for x in self.nodes.values()), 30, f"a ring of {n}")
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture(scope="module")
def store(s3_store_url, tmp_path_factory):
    """An S3 store of PARTS x PER records (shared uploads, 5 flushes) and its dump."""
    url = s3_store_url()
    cl = tmp_path_factory.mktemp("fleet-cl")
    with Store.open(url, writer="w", create=True, commitlog_dir=str(cl),
                    options=WriterOptions(upload="shared")) as st:
        step = PER // 5
        for lo in range(0, PER, step):
            st.append(RecordBatch.from_records(TOPIC, [
                (p, o, 1_700_000_000_000 + o, b"k%d-%d" % (p, o), os.urandom(200))
                for p in range(PARTS) for o in range(lo, lo + step)]))
            st.flush()
    with Store.open(url) as st:
        dump = {(r.partition, r.offset): (r.key, r.value)
                for p in range(PARTS) for r in st.iter_records(TOPIC, p)}
    assert len(dump) == PARTS * PER
    return url, dump


def read_assigned(bootstrap: str, want: int, got: dict, within: float = 60,
                  extra: dict | None = None, pace: float = 0.0) -> dict:
    """Every partition from the beginning into ``got`` until it holds ``want`` records;
    ``pace``: seconds between polls of at most 20 records (a slow reader)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused",
                  "enable.auto.commit": False, "topic.metadata.refresh.interval.ms": 1000,
                  **(extra or {})})
    try:
        c.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in range(PARTS)])
        deadline = time.monotonic() + within
        while len(got) < want and time.monotonic() < deadline:
            for m in c.consume(20 if pace else 500, 0.5):
                if m.error() is None:
                    got[(m.partition(), m.offset())] = (m.key(), m.value())
            if pace:
                time.sleep(pace)
    finally:
        c.close()
    return got


def test_three_nodes_serve_every_record_to_assign_subscribe_and_kcat(store, tmp_path):
    url, dump = store
    fleet = Fleet(url, 3, tmp_path).start()
    try:
        n1, n2, _ = fleet.nodes.values()
        if shutil.which("kcat"):
            out = subprocess.run(["kcat", "-L", "-b", n1.bootstrap], capture_output=True,
                                 text=True, timeout=30).stdout
            assert " 3 brokers:" in out, out
            for node in fleet.nodes.values():
                assert f"broker {node.nid} at {node.bootstrap}" in out, out
            leaders = {ln.split("leader ")[1].split(",")[0] for ln in out.splitlines()
                       if "leader " in ln}
            assert len(leaders) >= 2, out  # leadership is spread
        assert read_assigned(n1.bootstrap, len(dump), {}) == dump
        # a group at node 2: its coordinator is the group's owner on the ring
        c = Consumer({"bootstrap.servers": n2.bootstrap, "group.id": "fleet-group",
                      "auto.offset.reset": "earliest", "enable.auto.commit": False})
        got = {}
        try:
            c.subscribe([TOPIC])
            deadline = time.monotonic() + 60
            while len(got) < len(dump) and time.monotonic() < deadline:
                for m in c.consume(500, 0.5):
                    if m.error() is None:
                        got[(m.partition(), m.offset())] = (m.key(), m.value())
            c.commit(asynchronous=False)
            committed = c.committed([TopicPartition(TOPIC, p) for p in range(PARTS)], 10)
        finally:
            c.close()
        assert got == dump
        assert [tp.offset for tp in committed] == [PER] * PARTS
        # the blocks came once from S3: some node got some from their owner
        assert sum(x.metric("kcompact_fleet_s3_gets_saved_total") or 0
                   for x in fleet.nodes.values()) > 0
        assert sum(x.metric(HEADS_OK) or 0 for x in fleet.nodes.values()) > 0
    finally:
        fleet.stop()
    # the commits are in the store, for any node (or a plain serve) after the fleet
    from kcompact.replication.group_offsets import GroupOffsets
    with Store.open(url) as st:
        sid = st.meta.store_id
    go = GroupOffsets(url, sid)
    go.load()
    assert {p: o.offset for (_, p), o in go.get("fleet-group").items()} == \
        {p: PER for p in range(PARTS)}


def test_a_node_killed_mid_read_and_restarted(store, tmp_path):
    url, dump = store
    fleet = Fleet(url, 3, tmp_path).start()
    try:
        got = [{} for _ in range(3)]
        threads = [threading.Thread(target=read_assigned, args=(
            node.bootstrap, len(dump), got[i], 120, None, 0.02), daemon=True)
            for i, node in enumerate(fleet.nodes.values())]  # consumer i at node i
        for t in threads:
            t.start()
        wait_for(lambda: all(len(g) > 50 for g in got), 60, "every consumer reading")
        assert not all(len(g) == len(dump) for g in got)  # killed mid-read
        fleet.nodes[2].kill()
        wait_for(lambda: all(len(g) == len(dump) for g in got), 30,
                 "every consumer ending with every record after the kill")
        for t in threads:
            t.join(10)
        assert all(g == dump for g in got)
        wait_for(lambda: fleet.nodes[1].metric("kcompact_fleet_ring_members") == 2, 15,
                 "node 2 leaving the ring")
        fleet.nodes[2] = fleet.make(2).start()
        wait_for(lambda: all(x.metric("kcompact_fleet_ring_members") == 3
                             for x in fleet.nodes.values()), 20, "node 2 rejoining")
        assert read_assigned(fleet.nodes[3].bootstrap, len(dump), {}) == dump
    finally:
        fleet.stop()


class Garbage:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                c.recv(65536)
                c.sendall(b"\x16\x03\x01garbage, not a peer\r\n\r\n" * 10)
            except OSError:
                pass
            c.close()

    def close(self):
        self.sock.close()


def test_a_peer_answering_garbage_stalls_no_client(store, tmp_path):
    url, dump = store
    bad = Garbage()
    fleet = Fleet(url, 2, tmp_path, extra_peers={3: bad.port})
    try:
        fleet.start(want_ring=2)
        n1 = fleet.nodes[1]
        assert read_assigned(n1.bootstrap, len(dump), {}, within=60) == dump
        assert n1.metric("kcompact_fleet_ring_members") == 2
        assert n1.metric('kcompact_fleet_node_live{node="3"}') == 0
        assert n1.metric("kcompact_fleet_ping_failures_total") > 0
    finally:
        fleet.stop()
        bad.close()


def test_a_fleet_of_one_serves_what_serve_serves(store, tmp_path):
    url, dump = store
    plain = Node(url, None, None, None, tmp_path / "plain.log").start()
    try:
        assert read_assigned(plain.bootstrap, len(dump), {}) == dump
    finally:
        plain.stop()
    one = Fleet(url, 1, tmp_path).start()
    try:
        n = one.nodes[1]
        assert read_assigned(n.bootstrap, len(dump), {}) == dump
        if shutil.which("kcat"):
            out = subprocess.run(["kcat", "-L", "-b", n.bootstrap], capture_output=True,
                                 text=True, timeout=30).stdout
            assert " 1 brokers:" in out and f"broker 1 at {n.bootstrap}" in out, out
    finally:
        one.stop()


def test_two_nodes_over_tls_with_a_peer_token(store, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's certificate)")
    cert, key, tok = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "peer.token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    tok.write_text("fleet-peer-token-0123456789abcdef\n")
    url, dump = store
    fleet = Fleet(url, 2, tmp_path, extra=["--tls-cert", str(cert), "--tls-key", str(key),
                                           "--peer-token-file", str(tok)])
    try:
        fleet.start()  # (the ring forms only over good pings: TLS and the token work)
        tls = {"security.protocol": "SSL", "ssl.ca.location": str(cert)}
        for node in fleet.nodes.values():
            assert read_assigned(node.bootstrap, len(dump), {}, extra=tls) == dump
        assert sum(x.metric("kcompact_fleet_s3_gets_saved_total") or 0
                   for x in fleet.nodes.values()) > 0
        assert sum(x.metric(HEADS_OK) or 0 for x in fleet.nodes.values()) > 0
    finally:
        fleet.stop()


def test_java_console_consumers_in_one_group_spread_over_the_fleet(store, tmp_path):
    """Two Kafka ConsoleConsumers of one group, bootstrapped at different nodes: together
    they print every record once they have rebalanced (the group's partitions are led by
    several nodes, its coordinator is one of them)."""
    from kcompact.connectors.devtools.apache_kafka import ApacheKafkaError, tool_command
    try:
        cmd = lambda bs: tool_command(  # noqa: E731
            "org.apache.kafka.tools.consumer.ConsoleConsumer",
            ["--bootstrap-server", bs, "--topic", TOPIC, "--group", "java-fleet",
             "--from-beginning", "--timeout-ms", "15000", "--property", "print.offset=true",
             "--property", "print.partition=true", "--property", "print.key=true",
             "--property", "print.value=false"])
        cmd("x")
    except ApacheKafkaError as e:
        pytest.skip(f"Kafka's Java tools are not available: {e}")
    url, dump = store
    fleet = Fleet(url, 3, tmp_path).start()
    try:
        procs = [subprocess.Popen(cmd(fleet.nodes[i].bootstrap), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in (1, 3)]
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        fleet.stop()
    seen = set()
    for out, err in outs:
        assert "Processed a total of" in err, err[-2000:]
        for line in out.splitlines():
            bits = dict(b.split(":", 1) for b in line.split("\t") if ":" in b)
            seen.add((int(bits["Partition"]), int(bits["Offset"])))
    assert seen == set(dump)


def committed_via(bootstrap: str, group: str) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "enable.auto.commit": False})
    try:
        return [tp.offset for tp in c.committed(
            [TopicPartition(TOPIC, p) for p in range(PARTS)], 20)]
    finally:
        c.close()


def test_committed_offsets_survive_the_coordinator_and_writer_being_killed(store, tmp_path):
    """Groups committed through the fleet, then the node coordinating most of them (and maybe
    writing the offsets) SIGKILLed: a new consumer of each group, at another node, finds its
    commits (the new coordinator reads them from the store)."""
    url, dump = store
    fleet = Fleet(url, 3, tmp_path).start()
    try:
        groups = [f"kill-g{i}" for i in range(6)]
        for i, g in enumerate(groups):
            c = Consumer({"bootstrap.servers": fleet.nodes[1 + i % 3].bootstrap,
                          "group.id": g, "enable.auto.commit": False})
            try:
                c.commit(offsets=[TopicPartition(TOPIC, p, 10 + i + p) for p in range(PARTS)],
                         asynchronous=False)
            finally:
                c.close()
        want = {g: [10 + i + p for p in range(PARTS)] for i, g in enumerate(groups)}
        assert {g: committed_via(fleet.nodes[3].bootstrap, g) for g in groups} == want
        fleet.nodes[2].kill()
        wait_for(lambda: all(fleet.nodes[n].metric("kcompact_fleet_ring_members") == 2
                             for n in (1, 3)), 15, "node 2 leaving the ring")
        assert {g: committed_via(fleet.nodes[1].bootstrap, g) for g in groups} == want
        # and a commit after the change is kept too (the offsets writer may have moved)
        c = Consumer({"bootstrap.servers": fleet.nodes[3].bootstrap, "group.id": groups[0],
                      "enable.auto.commit": False})
        try:
            c.commit(offsets=[TopicPartition(TOPIC, p, 100 + p) for p in range(PARTS)],
                     asynchronous=False)
        finally:
            c.close()
        assert committed_via(fleet.nodes[1].bootstrap, groups[0]) == \
            [100 + p for p in range(PARTS)]
    finally:
        fleet.stop()
