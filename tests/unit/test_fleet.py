"""The fleet's ring, peer protocol and shared block cache, in one process (no subprocess).

* The ring (rendezvous hashing) against its model: a node joining takes only keys it then owns,
  a node leaving moves only the keys it owned, every node with the same view agrees, and keys
  spread evenly.
* Two ``Fleet`` nodes over one in-memory S3 (``_fake_s3.FakeS3``), their peer listeners on
  loopback: both read every block of an object and S3 sees one GET per block; a peer answering
  garbage, a peer answering nothing, and a peer with the wrong token cost no read its data
  (the reader falls back to S3) and leave the ring.
tests/integration/test_fleet.py runs whole `kcompact serve` nodes over SeaweedFS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import FakeS3  # noqa: E402

from kcompact.replication.errors import ReplicationError  # noqa: E402
from kcompact.replication.fleet import Fleet, FleetOptions, Ring, parse_peers  # noqa: E402
from kcompact.replication.fleet import peers as peers_mod  # noqa: E402
from kcompact.reput.s3 import BlockCache, S3Backend, Spool  # noqa: E402
from kcompact.reput.s3_cache import block_source  # noqa: E402

LOG = logging.getLogger("test-fleet")
OBJ = "partitions/t/0/00000000000000000000-0123456789abcdef.log"
BLOCK = 1000


# -- the ring ---------------------------------------------------------------------------------

nodes_st = st.sets(st.integers(0, 50), min_size=1, max_size=8)
keys_st = st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=40, unique=True)


@settings(max_examples=200, deadline=None)
@given(nodes=nodes_st, keys=keys_st, new=st.integers(51, 60))
def test_ring_join_moves_only_keys_to_the_new_node(nodes, keys, new):
    before, after = Ring(nodes), Ring(nodes | {new})
    for k in keys:
        a = after.owner(k)
        assert a == new or a == before.owner(k)
        assert before.owner(k) in nodes
        assert after.owners(k)[0] == a and sorted(after.owners(k)) == sorted(nodes | {new})


@settings(max_examples=200, deadline=None)
@given(nodes=nodes_st, keys=keys_st, data=st.data())
def test_ring_leave_moves_only_the_leavers_keys(nodes, keys, data):
    if len(nodes) < 2:
        return
    gone = data.draw(st.sampled_from(sorted(nodes)))
    before, after = Ring(nodes), Ring(nodes - {gone})
    for k in keys:
        if before.owner(k) != gone:
            assert after.owner(k) == before.owner(k)
        else:  # the next owner takes it
            assert after.owner(k) == before.owners(k)[1]


@given(nodes=nodes_st, keys=keys_st)
def test_ring_is_the_same_whatever_the_order_of_the_view(nodes, keys):
    a, b = Ring(sorted(nodes)), Ring(sorted(nodes, reverse=True))
    assert all(a.owner(k) == b.owner(k) for k in keys)


@pytest.mark.parametrize("n", [3, 5])
def test_ring_balance(n):
    ring = Ring(range(1, n + 1))
    keys = 6000
    counts = {i: 0 for i in range(1, n + 1)}
    for i in range(keys):
        counts[ring.owner(f"b|partitions/t/{i % 32}/x.log|{i}")] += 1
    for c in counts.values():  # each within 20% of its fair share
        assert abs(c - keys / n) < 0.2 * keys / n, counts


def test_peers_flag():
    assert parse_peers("1@127.0.0.1:9001, 2@[::1]:9002") == {1: ("127.0.0.1", 9001),
                                                              2: ("::1", 9002)}
    for bad, says in (("1-127.0.0.1:9", "ID@HOST:PORT"), ("1@h:0", "cannot be 0"),
                      ("1@h:1,1@h:2", "listed twice"), ("", "empty")):
        with pytest.raises(ReplicationError, match=says):
            parse_peers(bad)
    with pytest.raises(ReplicationError, match="does not list this node"):
        FleetOptions(3, "127.0.0.1:0", "1@127.0.0.1:9001").check()


# -- two nodes in one process ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loop:
    """An asyncio loop in a thread, for the peer listeners."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.t.join(5)


@pytest.fixture
def fleet2(tmp_path):
    """Two nodes (1, 2) over one FakeS3 holding OBJ (9.5 blocks); node 1's block source is
    installed (one per process), node 2 answers its peers."""
    fake = FakeS3(buckets=("bucket",))
    data = bytes(range(256)) * 37 + b"tail"
    fake.objects["bucket"][f"s/{OBJ}"] = (data, None)
    ports = {1: free_port(), 2: free_port()}
    peers = ",".join(f"{n}@127.0.0.1:{p}" for n, p in ports.items())
    loop = Loop()
    nodes = {}
    tok = tmp_path / "tok"
    tok.write_text("s3cret-peer-token-0123\n")
    for n in (2, 1):
        fs = S3Backend("bucket", "s", client=fake, grace_ms=0, cache=BlockCache(1 << 20, BLOCK),
                       spool=Spool(1 << 20, str(tmp_path / f"spool{n}")))
        f = Fleet(FleetOptions(n, f"127.0.0.1:{ports[n]}", peers, str(tok)), "store-1", fs, LOG)
        loop.run(f.start())
        f.set_kafka("127.0.0.1", 9000 + n)
        nodes[n] = f
    for n, f in nodes.items():
        for nid, p in f.peers.items():
            f.ping_once(nid, p)
    yield fake, data, nodes, loop
    for f in nodes.values():
        loop.run(f.close())
    loop.stop()
    assert block_source() is None


def gets(fake) -> int:
    return fake.calls["GetObject"]


def test_both_nodes_read_every_block_one_get_each(fleet2):
    fake, data, nodes, _ = fleet2
    assert sorted(nodes[1].ring().nodes) == [1, 2] == sorted(nodes[2].ring().nodes)
    blocks = -(-len(data) // BLOCK)
    owners = {nodes[1].ring().owner(f"b|{OBJ}|{b}") for b in range(blocks)}
    assert owners == {1, 2}  # both own some: the test crosses the wire both ways
    assert nodes[1].fs.read(OBJ, 0, len(data)) == data
    assert gets(fake) == blocks
    # node 2's reads (no block source of its own in this process: as node 1 would serve them)
    # come from its cache, filled when it answered node 1
    for b in range(blocks):
        if nodes[1].ring().owner(f"b|{OBJ}|{b}") == 2:
            assert nodes[2].fs.has_block(OBJ, b)
    assert nodes[1].gets_saved == sum(
        1 for b in range(blocks) if nodes[1].ring().owner(f"b|{OBJ}|{b}") == 2)
    assert nodes[2].block_misses == nodes[1].gets_saved and nodes[2].block_hits == 0
    # a second reader of node 1 (cache cleared): node 2's blocks again from node 2, hits now
    nodes[1].fs.cache.clear()
    assert nodes[1].fs.read(OBJ, 0, len(data)) == data
    assert nodes[2].block_hits == nodes[1].gets_saved // 2
    assert gets(fake) == blocks + sum(
        1 for b in range(blocks) if nodes[1].ring().owner(f"b|{OBJ}|{b}") == 1)
    # the spool (a whole object mapped) goes block by block through the owners too
    before = gets(fake)
    nodes[1].fs.cache.clear()
    assert bytes(nodes[1].fs.map(OBJ)) == data
    assert gets(fake) - before == sum(
        1 for b in range(blocks) if nodes[1].ring().owner(f"b|{OBJ}|{b}") == 1)


def test_journal_entries_come_from_their_owner_and_missing_ones_say_so(fleet2):
    fake, _, nodes, _ = fleet2
    ring = nodes[1].ring()
    seq = next(s for s in range(100)
               if ring.owner(f"b|shared/w/journal/{s:020d}.json|0") == 2)
    path = f"shared/w/journal/{seq:020d}.json"
    fake.objects["bucket"][f"s/{path}"] = (b'{"entry": 1}', None)
    before = gets(fake)
    assert nodes[1].fs.read(path) == b'{"entry": 1}'
    assert nodes[1].fs.read(path) == b'{"entry": 1}'  # node 2 keeps it: one GET in all
    assert gets(fake) - before == 1
    with pytest.raises(FileNotFoundError):
        nodes[1].fs.read(f"shared/w/journal/{seq + 1000:020d}.json")


def test_metrics_name_the_ring_and_the_savings(fleet2):
    fake, data, nodes, _ = fleet2
    nodes[1].fs.read(OBJ, 0, len(data))
    fams = {m.name.removeprefix("kcompact_"): m for m in nodes[1].collect()}
    assert fams["fleet_ring_members"].samples[0].value == 2
    assert fams["fleet_s3_gets_saved"].samples[0].value == nodes[1].gets_saved > 0
    served = {tuple(s.labels.values()): s.value for s in
              next(m for m in nodes[2].collect() if m.name.endswith("fleet_peer_requests_served"))
              .samples if s.name.endswith("_total")}
    assert served[("block", "ok")] == nodes[1].gets_saved
    assert nodes[1].health() is None


class Garbage:
    """A TCP server on loopback answering every connection with ``reply`` (None: silence)."""

    def __init__(self, reply: bytes | None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns = reply, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.reply is not None:
                try:
                    c.recv(65536)
                    c.sendall(self.reply)
                    c.close()
                except OSError:
                    pass

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("reply", [b"\x00\xffnot http at all\r\n\r\n",
                                   b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
                                   None])
def test_a_peer_answering_garbage_or_nothing_costs_no_read(tmp_path, monkeypatch, reply):
    monkeypatch.setattr(peers_mod, "BLOCK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(peers_mod, "PING_TIMEOUT_S", 0.5)
    fake = FakeS3(buckets=("bucket",))
    data = os.urandom(5 * BLOCK + 7)
    fake.objects["bucket"][f"s/{OBJ}"] = (data, None)
    bad = Garbage(reply)
    loop = Loop()
    try:
        fs = S3Backend("bucket", "s", client=fake, grace_ms=0, cache=BlockCache(1 << 20, BLOCK),
                       spool=Spool(1 << 20, str(tmp_path / "spool")))
        port = free_port()
        f = Fleet(FleetOptions(1, f"127.0.0.1:{port}",
                               f"1@127.0.0.1:{port},2@127.0.0.1:{bad.port}"), "store-1", fs, LOG)
        loop.run(f.start())
        f.set_kafka("127.0.0.1", 9001)
        p2 = f.peers[2]
        f.ping_once(2, p2)
        assert sorted(f.ring().nodes) == [1] and p2.error  # garbage is no answer
        # as if node 2 had answered a moment ago: it is on the ring and owns blocks
        p2.last_ok, p2.kafka, p2.error = time.monotonic(), ("127.0.0.1", 9002), ""
        assert sorted(f.ring().nodes) == [1, 2]
        t0 = time.monotonic()
        assert fs.read(OBJ, 0, len(data)) == data
        assert gets(fake) == 6  # every block from S3 in the end
        assert p2.skip_blocks  # asked once, then skipped until it answers a ping
        assert time.monotonic() - t0 < 30  # bounded by one timeout, not one per block
        loop.run(f.close())
    finally:
        bad.close()
        loop.stop()


def test_a_wrong_token_is_refused(tmp_path):
    loop = Loop()
    fake = FakeS3(buckets=("bucket",))
    ports = {1: free_port(), 2: free_port()}
    peers = ",".join(f"{n}@127.0.0.1:{p}" for n, p in ports.items())
    nodes = []
    try:
        for n, token in ((1, "token-one-0123456789"), (2, "token-two-0123456789")):
            (tmp_path / f"t{n}").write_text(token)
            fs = S3Backend("bucket", "s", client=fake, grace_ms=0,
                           cache=BlockCache(1 << 20, BLOCK),
                           spool=Spool(1 << 20, str(tmp_path / f"spool{n}")))
            f = Fleet(FleetOptions(n, f"127.0.0.1:{ports[n]}", peers, str(tmp_path / f"t{n}")),
                      "store-1", fs, LOG)
            loop.run(f.start())
            f.set_kafka("127.0.0.1", 9000 + n)
            nodes.append(f)
        nodes[0].ping_once(2, nodes[0].peers[2])
        assert "HTTP 403" in nodes[0].peers[2].error
        assert sorted(nodes[0].ring().nodes) == [1]
    finally:
        for f in nodes:
            loop.run(f.close())
        loop.stop()


# -- the offsets writer's fence ---------------------------------------------------------------


class FakeFleet:
    """What FleetOffsets asks of a Fleet: its node id, the ring's owner, the ring's changes."""

    def __init__(self, node_id: int, view: dict):
        self.node_id, self.view, self.peers = node_id, view, {}

    @property
    def ring_changes(self) -> int:
        return self.view["changes"]

    def ring(self):
        view = self.view

        class R:
            def owner(self, key):
                return view["writer"]
        return R()


def test_the_offsets_writer_is_fenced_by_its_epoch(tmp_path, monkeypatch):
    from kcompact.replication.fleet import offsets as fo
    from kcompact.replication.group_offsets import GroupOffset, GroupOffsets, GroupOffsetsError
    from kcompact.reput import Store
    monkeypatch.setattr(fo, "LEASE_S", 0.05)
    url = str(tmp_path / "store")
    with Store.open(url, writer="w", create=True) as st:
        sid = st.meta.store_id
    view = {"writer": 1, "changes": 0}
    nodes = {}
    for n in (1, 2):
        inner = GroupOffsets(url, sid, commitlog_dir=str(tmp_path / f"cl{n}"))
        nodes[n] = fo.FleetOffsets(inner, FakeFleet(n, view), Store.open(url).fs, LOG)
        nodes[n].load()
    nodes[1].write("g", [("t", 0, GroupOffset(5))])
    assert nodes[1].epoch == 1
    # node 2 takes over (its ring says so): a new epoch, and it reads node 1's commit
    view.update(writer=2, changes=1)
    assert nodes[2].get("g")[("t", 0)].offset == 5
    nodes[2].write("g", [("t", 0, GroupOffset(7))])
    assert nodes[2].epoch == 2
    # node 1 still believes it writes (a ring that has not changed yet): fenced, nothing kept
    view["writer"] = 1
    with pytest.raises(GroupOffsetsError, match="another node writes"):
        nodes[1].write("g", [("t", 0, GroupOffset(99))])
    for n in nodes.values():
        n.close()
    check = GroupOffsets(url, sid)
    check.load()
    assert check.get("g")[("t", 0)].offset == 7
    # a node that is not the writer refuses a forwarded commit
    view["writer"] = 2
    with pytest.raises(GroupOffsetsError, match="not the offsets writer"):
        nodes[1].write("g", [("t", 0, GroupOffset(1))])


def test_peers_over_tls(tmp_path):
    import shutil
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's certificate)")
    from kcompact.replication.server import tls_context
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    fake = FakeS3(buckets=("bucket",))
    data = os.urandom(10 * BLOCK)
    fake.objects["bucket"][f"s/{OBJ}"] = (data, None)
    ports = {1: free_port(), 2: free_port()}
    peers = ",".join(f"{n}@127.0.0.1:{p}" for n, p in ports.items())
    loop, nodes = Loop(), {}
    try:
        for n in (2, 1):  # node 1's block source installed last (one per process)
            fs = S3Backend("bucket", "s", client=fake, grace_ms=0,
                           cache=BlockCache(1 << 20, BLOCK),
                           spool=Spool(1 << 20, str(tmp_path / f"spool{n}")))
            f = Fleet(FleetOptions(n, f"127.0.0.1:{ports[n]}", peers), "store-1", fs, LOG,
                      tls_cert=str(cert))
            loop.run(f.start(tls_context(str(cert), str(key))))
            f.set_kafka("127.0.0.1", 9000 + n)
            nodes[n] = f
        nodes[2].set_kafka("127.0.0.1", 9002)
        nodes[1].ping_once(2, nodes[1].peers[2])
        assert sorted(nodes[1].ring().nodes) == [1, 2], nodes[1].peers[2].error
        assert nodes[1].fs.read(OBJ, 0, len(data)) == data
        owned2 = sum(1 for b in range(10) if nodes[1].ring().owner(f"b|{OBJ}|{b}") == 2)
        assert owned2 > 0 and nodes[1].gets_saved == owned2 and gets(fake) == 10
    finally:
        for f in nodes.values():
            loop.run(f.close())
        loop.stop()


def test_an_absent_journal_entry_is_asked_of_s3_once_per_half_interval(fleet2):
    fake, _, nodes, _ = fleet2
    ring = nodes[1].ring()
    seq = next(s for s in range(100)
               if ring.owner(f"b|shared/w/journal/{s:020d}.json|0") == 2)
    path = f"shared/w/journal/{seq:020d}.json"
    now = [1000.0]
    nodes[2].clock = lambda: now[0]
    before = gets(fake)
    for _ in range(3):  # the fleet's followers polling within one half interval
        with pytest.raises(FileNotFoundError):
            nodes[1].fs.read(path)
    assert gets(fake) - before == 1
    fake.objects["bucket"][f"s/{path}"] = (b'{"entry": 2}', None)  # the writer commits it
    now[0] += nodes[2].absent_ttl_s
    assert nodes[1].fs.read(path) == b'{"entry": 2}'
    assert gets(fake) - before == 2
