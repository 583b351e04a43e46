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
import json
import logging
import os
import socket
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
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
        self.reply, self.conns, self.requests = reply, [], []
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
                    self.requests.append(c.recv(65536))
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
                                   # a block answer in form whose CRC-32C is not its body's
                                   b"HTTP/1.1 200 OK\r\nX-Kcompact-Block-Size: %d\r\n"
                                   b"X-Kcompact-Crc32c: %s\r\nContent-Length: 5\r\n\r\nhello"
                                   % (BLOCK, peers_mod.digest(b"hellp").encode()),
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


def test_a_journal_entry_is_fetched_once_for_its_owner_and_its_peers(fleet2):
    """The owner of an entry reads it itself through its cache, where its peers' requests for
    it are answered: one GET for the fleet (it was one for the owner and one for the peers)."""
    fake, _, nodes, _ = fleet2
    ring = nodes[1].ring()
    seq = next(s for s in range(100)
               if ring.owner(f"b|shared/w/journal/{s:020d}.json|0") == 1)
    path = f"shared/w/journal/{seq:020d}.json"
    fake.objects["bucket"][f"s/{path}"] = (b'{"entry": 1}', None)
    before = gets(fake)
    assert nodes[1].fs.read(path) == b'{"entry": 1}'  # node 1's own read (it owns the entry)
    assert nodes[2].peers[1].client.block(path, 0, nodes[1].fs.block_size) == b'{"entry": 1}'
    assert gets(fake) - before == 1


# -- the shared heads: one node polls the journal and the catalog for the fleet ------------------


from _stores import backend_env, store_url  # noqa: E402

from kcompact.replication.fleet import node as node_mod  # noqa: E402
from kcompact.replication.fleet.ring import HEADS_KEY  # noqa: E402
from kcompact.reput import Store  # noqa: E402
from kcompact.reput import s3_follow as S3F  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3_cache import head_source  # noqa: E402

PARTS = 3


def _ids() -> tuple[int, int]:
    """(asker, poller): two node ids, the second the ring's owner of HEADS_KEY."""
    return (1, 2) if Ring([1, 2]).owner(HEADS_KEY) == 2 else (2, 1)


class Writer:
    """A writer with shared uploads (and a store catalog: a new S3 store's default), one
    record per partition per flush."""

    def __init__(self, url, root):
        self.st = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl-w")
        self.flushes = 0

    def flush(self):
        o = self.flushes
        self.st.append(RecordBatch.from_records(
            "t", [(p, o, 1_000 + o, b"k%d" % o, b"v%d-%d" % (p, o), []) for p in range(PARTS)]))
        self.st.flush()
        self.flushes += 1


class Reader:
    """A node's read-only store following ``url`` (as the Kafka endpoint does); ``round``: one
    poll of its follower (through its head source, when one is installed), then a refresh of
    every partition."""

    def __init__(self, url):
        self.st = Store.open(url)
        S3F.follow(self.st.fs)
        self.pls = [self.st.partition("t", p) for p in range(PARTS)]
        self.follower = S3F.follower_for(self.st.fs)
        self.follower.interval_s = 3600.0  # polls only when the test asks

    def round(self):
        self.follower.poll(0.0)
        for pl in self.pls:
            pl.refresh()
        return [pl.next_offset for pl in self.pls]

    def records(self):
        return [[(r.offset, r.value) for r in self.st.iter_records("t", p)]
                for p in range(PARTS)]

    def gets(self):
        return self.st.fs.stats.requests["GetObject"]


@pytest.fixture
def s3_store(tmp_path, monkeypatch):
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "1")  # a catalog version every flush
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "10")
    with backend_env("s3", str(tmp_path)) as fake:
        url = store_url("s3", tmp_path)
        w = Writer(url, tmp_path)
        w.flush()
        yield fake, url, w
        w.st.close()


class HF:
    """What ``heads_fleet`` yields."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def heads_fleet(s3_store):
    """Two nodes of one fleet following the store, each with its own backend: ``poller``
    (the owner of HEADS_KEY) and ``asker``, whose block and head sources are this process's."""
    fake, url, w = s3_store
    asker, poller = _ids()
    ports = {1: free_port(), 2: free_port()}
    peers = ",".join(f"{n}@127.0.0.1:{p}" for n, p in ports.items())
    loop = Loop()
    readers, nodes = {}, {}
    for n in (poller, asker):  # the asker's sources installed last (one per process)
        readers[n] = Reader(url)
        f = Fleet(FleetOptions(n, f"127.0.0.1:{ports[n]}", peers),
                  readers[n].st.meta.store_id, readers[n].st.fs, LOG)
        loop.run(f.start())
        f.set_kafka("127.0.0.1", 9000 + n)
        nodes[n] = f
    for f in nodes.values():
        for nid, p in f.peers.items():
            f.ping_once(nid, p)
    assert nodes[asker].poller() == poller == nodes[poller].poller()
    assert head_source() is nodes[asker]
    readers[poller].follower.interval_s = 0.0  # it polls S3 at every request (no rate limit)
    for f in nodes.values():  # (and so remembers no absent entry for half an interval)
        f.absent_ttl_s = 0.0
    yield HF(fake=fake, w=w, loop=loop, asker=readers[asker], poller=readers[poller],
             fa=nodes[asker], fp=nodes[poller])
    for f in nodes.values():
        loop.run(f.close())
    for r in readers.values():
        r.st.close()
    loop.stop()
    assert head_source() is None


def _catalog_version(reader) -> int:
    from kcompact.reput import store_catalog as SC
    return SC.for_store(reader.st.fs).latest.version  # (a Reader or a Writer)


def _expected(flushes):
    return [[(o, b"v%d-%d" % (p, o)) for o in range(flushes)] for p in range(PARTS)]


def test_the_poller_polls_for_the_fleet_and_the_others_converge(heads_fleet):
    h = heads_fleet
    assert h.asker.round() == [1] * PARTS  # (its first poll lists shared/ itself)
    misses, shared = h.asker.follower.stats["get_miss"], h.asker.follower.stats["shared"]
    ok, served = h.fa.sent.get(("heads", "ok"), 0), h.fp.served.get(("heads", "ok"), 0)
    for _ in range(4):  # nothing new: only the poller asks S3 for the writer's next entry
        before, mine, its = h.fake.calls["GetObject"], h.asker.gets(), h.poller.gets()
        assert h.asker.round() == [1] * PARTS
        # the poller's GETs (the writer's next entry, the catalog's next version: 404s)
        assert 1 <= h.fake.calls["GetObject"] - before == h.poller.gets() - its <= 2
        assert h.asker.gets() == mine
    assert h.asker.follower.stats["shared"] - shared == 4
    assert h.fa.sent[("heads", "ok")] - ok == 4 == h.fp.served[("heads", "ok")] - served
    for n in range(2, 5):  # the writer flushes: the asker reads the new entry
        h.w.flush()
        assert h.asker.round() == [n] * PARTS
    assert h.asker.records() == _expected(4)
    # and the catalog's newest version (the poller GETs its next one at most every 10 ms)
    newest = _catalog_version(h.w)
    deadline = time.monotonic() + 10
    while _catalog_version(h.asker) < newest and time.monotonic() < deadline:
        time.sleep(0.02)
        h.asker.round()
    assert _catalog_version(h.asker) == newest
    assert h.asker.follower.stats["get_miss"] == misses  # never a GET of an absent key


def test_a_dead_poller_stalls_nobody(heads_fleet):
    h = heads_fleet
    h.asker.round()
    h.loop.run(h.fp.close())  # the poller's listener is gone: its heads are refused
    h.w.flush()
    shared = h.asker.follower.stats["shared"]
    assert h.asker.round() == [2] * PARTS  # its own poll of S3
    assert h.fa.sent[("heads", "failed")] == 1
    h.w.flush()
    assert h.asker.round() == [3] * PARTS
    assert h.fa.sent[("heads", "skipped")] == 1  # not asked again for HEADS_RETRY_S
    assert h.asker.follower.stats["shared"] == shared
    assert h.asker.records() == _expected(3)


def _http(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
            % (status.encode(), ctype.encode(), len(body)) + body)


class LoneAsker:
    """A node whose poller (the owner of HEADS_KEY) is a ``Garbage`` server, on the ring as if
    it had answered its pings; ``now``: the node's clock."""

    def __init__(self, url, reply: bytes | None):
        asker, poller = _ids()
        self.bad = Garbage(reply)
        self.loop = Loop()
        self.reader = Reader(url)
        self.now = [1000.0]
        port = free_port()
        self.f = Fleet(FleetOptions(asker, f"127.0.0.1:{port}",
                                    f"{asker}@127.0.0.1:{port},{poller}@127.0.0.1:{self.bad.port}"),
                       self.reader.st.meta.store_id, self.reader.st.fs, LOG,
                       clock=lambda: self.now[0])
        self.loop.run(self.f.start())
        self.f.set_kafka("127.0.0.1", 9000 + asker)
        self.p = self.f.peers[poller]
        self.alive()
        assert self.f.poller() == poller

    def alive(self):
        self.p.last_ok, self.p.kafka, self.p.error = self.now[0], ("127.0.0.1", 9002), ""

    def close(self):
        self.loop.run(self.f.close())
        self.reader.st.close()
        self.bad.close()
        self.loop.stop()


@pytest.mark.parametrize("reply", [
    b"\x00\xffnot http at all\r\n\r\n",
    _http("200 OK", b"hello", "text/plain"),
    _http("200 OK", json.dumps({"writers": {"w": -1}, "catalog": None, "age_ms": 0}).encode()),
    _http("200 OK", json.dumps({"writers": {"w": 5}, "catalog": "7", "age_ms": 0}).encode()),
    _http("200 OK", json.dumps({"writers": ["w"], "catalog": None, "age_ms": 0}).encode()),
    _http("503 Service Unavailable", b"S3 is down\n", "text/plain"),
    # a lagging poller: its own polls have failed for a minute
    _http("200 OK", json.dumps({"writers": {"w": 1}, "catalog": 1, "age_ms": 60_000}).encode()),
    None,  # silence: the request times out
], ids=["not-http", "not-json", "bad-seq", "bad-catalog", "bad-writers", "503", "stale",
        "silent"])
def test_a_poller_answering_garbage_lagging_or_nothing_stalls_nobody(s3_store, monkeypatch,
                                                                    reply):
    monkeypatch.setattr(peers_mod, "HEADS_TIMEOUT_S", 0.3)
    monkeypatch.setattr(peers_mod, "BLOCK_TIMEOUT_S", 0.3)
    fake, url, w = s3_store
    a = LoneAsker(url, reply)
    try:
        w.flush()
        t0 = time.monotonic()
        assert a.reader.round() == [2] * PARTS  # its own poll of S3
        assert time.monotonic() - t0 < 30  # one timeout at most, not one per request
        assert a.f.sent[("heads", "failed")] == 1
        w.flush()
        assert a.reader.round() == [3] * PARTS
        assert a.f.sent[("heads", "skipped")] == 1 and a.f.sent[("heads", "failed")] == 1
        a.now[0] += node_mod.HEADS_RETRY_S  # then it asks again (and falls back again)
        a.alive()
        w.flush()
        assert a.reader.round() == [4] * PARTS
        assert a.f.sent[("heads", "failed")] == 2
        assert a.reader.records() == _expected(4)
    finally:
        a.close()


def test_a_poller_whose_answers_lag_delays_a_node_by_own_poll_s_at_most(s3_store):
    fake, url, w = s3_store
    # well formed and fresh, but it has never seen a writer (as a poller stuck in the past)
    a = LoneAsker(url, _http("200 OK", json.dumps(
        {"writers": {}, "catalog": None, "age_ms": 0}).encode()))
    try:
        w.flush()
        assert a.reader.round() == [1] * PARTS  # the poller said nothing is new
        assert a.f.sent[("heads", "ok")] == 1
        a.now[0] += node_mod.OWN_POLL_S
        a.alive()
        assert a.reader.round() == [2] * PARTS  # its own poll of S3 (at least every 30 s)
        assert a.f.sent[("heads", "ok")] == 1
        w.flush()
        assert a.reader.round() == [2] * PARTS  # the poller's answers again
        assert a.f.sent[("heads", "ok")] == 2
        assert a.reader.records() == _expected(2)
    finally:
        a.close()


# -- the Kafka endpoint's checks, in order -------------------------------------------------------


def test_a_fetch_naming_a_denied_topic_still_says_not_leader_for_the_others(monkeypatch):
    """A Fetch of a topic the ACLs deny and one they allow, at a node that leads neither: the
    allowed topic's partition is NOT_LEADER_OR_FOLLOWER (the client moves), not read here."""
    from types import SimpleNamespace as NS

    from kcompact.replication.kafka_endpoint import authorize
    from kcompact.replication.kafka_endpoint.apis import fetch
    from kcompact.replication.kafka_endpoint.cluster import NOT_LEADER_OR_FOLLOWER
    from kcompact.replication.kafka_endpoint.wire import TOPIC_AUTHORIZATION_FAILED

    class View:
        def partitions(self, topic, partition=None):
            return [0]

        def zstd_topic(self, topic):
            return False

        def bounds(self, topic, partition):
            raise AssertionError(f"{topic}/{partition} read at a node that does not lead it")

    class Gate:
        def fetch_denied(self, req, conn):
            return {"secret"}

        async def fetch_with_denied(self, ep, req, denied, leads=None):
            return await authorize.Gate.fetch_with_denied(self, ep, req, denied, leads)

    async def run(f, *a):
        return f(*a)

    answered = {}
    monkeypatch.setattr(authorize, "encode_fetch",
                        lambda version, cid, topics: answered.update(topics) or [])
    ep = NS(gate=Gate(), view=View(), run=run, count_errors=lambda *a: None, stopping=lambda: False,
            fleet=NS(node_id=1, leader=lambda t, p: 2))
    part = NS(partition=0, fetch_offset=0, partition_max_bytes=1 << 20)
    req = NS(version=11, correlation_id=7, body=NS(max_bytes=1 << 20, topics=[
        NS(topic="secret", partitions=[part]), NS(topic="open", partitions=[part])]))
    asyncio.run(fetch.handle(ep, req, None))
    assert [r.error for r in answered["secret"]] == [TOPIC_AUTHORIZATION_FAILED]
    assert [r.error for r in answered["open"]] == [NOT_LEADER_OR_FOLLOWER]


heads_doc_st = st.fixed_dictionaries({
    "writers": st.dictionaries(st.sampled_from(["w", "w2", "gone"]), st.integers(0, 12),
                               max_size=3),
    "catalog": st.none() | st.integers(0, 12),
    "age_ms": st.sampled_from([0, 200, 60_000])})


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=st.lists(st.tuples(st.booleans(), heads_doc_st), min_size=1, max_size=5))
def test_whatever_the_poller_answers_a_node_reads_only_what_was_written(s3_store, steps,
                                                                       monkeypatch):
    """A model check of the heads: a poller answering any well-formed heads (ahead of the
    store, behind it, naming writers that do not exist, stale) never makes a node read a record
    that was not written, nor lose one: its own polls (every OWN_POLL_S) read the store. (The
    writer folds no entry into the catalog here: every record is found through the journal.)"""
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "100000")
    fake, url, w = s3_store
    a = LoneAsker(url, None)
    try:
        for flush, doc in steps:
            a.bad.reply = _http("200 OK", json.dumps(doc).encode())
            if flush:
                w.flush()
            offsets = a.reader.round()
            assert all(o <= w.flushes for o in offsets)
            got = a.reader.records()
            assert got == [_expected(w.flushes)[p][:len(got[p])] for p in range(PARTS)]
        for _ in range(len(steps) + 1):  # its own polls of S3, at least every OWN_POLL_S
            # (each reads the next entries up to a recent one: a writer that flushed twice
            # within an interval is read in two polls)
            a.now[0] += node_mod.OWN_POLL_S
            a.alive()
            if a.reader.round() == [w.flushes] * PARTS:
                break
        assert a.reader.records() == _expected(w.flushes)
    finally:
        a.close()


# -- polls off the live edge (reput/s3_follow.py IDLE_POLL_S, EDGE_S) ----------------------------


def _gets(fake) -> int:
    return fake.calls["GetObject"]


def test_readers_off_the_live_edge_cost_no_poll_and_a_waiting_fetch_gets_new_records_at_once(
        s3_store, monkeypatch):
    """The Kafka endpoint's reads below the high watermark, its Metadata and its Fetches'
    first looks reuse an older poll while nothing is new and no Fetch waits (no GET at all
    here); a Fetch that waits at the high watermark polls at the follow interval and returns a
    flush's records before its wait ends; a ListOffsets LATEST polls as at the edge."""
    from types import SimpleNamespace as NS

    from kcompact.replication.kafka_endpoint.apis import fetch as F
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    monkeypatch.setattr(S3F, "IDLE_POLL_S", 3600.0)
    monkeypatch.setattr(F, "encode_fetch", lambda version, correlation_id, seen: seen)
    fake, url, w = s3_store
    w.flush()  # two records a partition
    view = StoreView(url)
    try:
        fol = S3F.follower_for(view.store.fs)
        fol.interval_s = 0.0  # every poll at the edge is due: only IDLE_POLL_S holds one back
        assert view.partitions("t") == list(range(PARTS))
        assert [view.bounds("t", p).high_watermark for p in range(PARTS)] == [2] * PARTS
        before = _gets(fake)
        for _ in range(3):  # nothing new, nobody at the edge: no poll
            assert view.topics() == ["t"] and view.partitions("t") == list(range(PARTS))
            assert [view.bounds("t", p).high_watermark for p in range(PARTS)] == [2] * PARTS
            assert view.fetch("t", 1, 0, 1 << 20).nbytes > 0
            view.changes()
        assert _gets(fake) == before
        w.flush()
        assert view.bounds("t", 0).high_watermark == 2  # (not polled: up to IDLE_POLL_S late)
        assert view.bounds("t", 0, fresh=True).high_watermark == 3  # ListOffsets LATEST

        async def run(fn, *args):
            return fn(*args)

        def request(offset, wait_ms):
            return NS(topics=[NS(topic="t", partitions=[
                NS(partition=p, fetch_offset=offset, partition_max_bytes=1 << 20)
                for p in range(PARTS)])], max_wait=wait_ms, min_bytes=1, max_bytes=1 << 24)

        async def flush_while_waiting():
            waiting = asyncio.ensure_future(
                F.handle_fetch(view, run, 12, 1, request(3, 20_000), lambda: False))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(w.flush)
            return await asyncio.wait_for(waiting, 15)  # far less than its 20 s wait
        seen = asyncio.run(flush_while_waiting())
        assert [r.bounds.high_watermark for _, rs in seen for r in rs] == [4] * PARTS
        assert all(r.nbytes > 0 for _, rs in seen for r in rs)
        before = _gets(fake)  # a Fetch waited within EDGE_S: every read polls as at the edge
        w.flush()
        assert view.bounds("t", 2).high_watermark == 5 and _gets(fake) > before
    finally:
        view.close()


def test_a_node_off_the_live_edge_asks_the_poller_for_an_older_poll(s3_store, monkeypatch):
    """The heads request carries the age the asking node is content with (``max_age_ms``):
    the poller answers from its last poll while it is younger than that (no GET of its own),
    and the asker takes an answer that old; at the follow interval the same answer is a
    lagging poller's."""
    fake, url, w = s3_store
    a = LoneAsker(url, _http("200 OK", json.dumps(
        {"writers": {"w": 1}, "catalog": None, "age_ms": 3000}).encode()))
    try:
        got = a.f.heads(a.reader.st.fs, 5.0)  # off the edge: a 3 s old poll will do
        assert got is not None and got.writers == {"w": 1}
        assert a.f.sent[("heads", "ok")] == 1
        # (the node's pings reach the same peer meanwhile: the heads request is not the last)
        (heads,) = [r for r in a.bad.requests if r.startswith(b"GET /peer/v1/heads")]
        assert b"max_age_ms=5000" in heads
        a.now[0] += 1
        assert a.f.heads(a.reader.st.fs, 0.25) is None  # at the edge: 3 s is too old
        assert a.f.sent[("heads", "failed")] == 1
    finally:
        a.close()


def test_the_poller_answers_an_older_poll_without_a_get(heads_fleet):
    h = heads_fleet
    h.asker.round()
    before = h.fake.calls["GetObject"]
    doc = h.fp.heads_doc(60.0)  # its own poll of a moment ago will do
    assert h.fake.calls["GetObject"] == before and doc["age_ms"] < 60_000
    h.fp.heads_doc(0.0)  # at its follow interval (0 here): it polls S3
    assert h.fake.calls["GetObject"] > before


def test_a_store_without_a_catalog_is_polled_off_the_edge_as_rarely(tmp_path, monkeypatch):
    """The same on a store without a catalog (each partition refreshes through the journal
    and its own manifest): off the edge no poll; once a Fetch waits, every read polls."""
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    monkeypatch.setattr(S3F, "IDLE_POLL_S", 3600.0)
    with backend_env("s3", str(tmp_path)):
        url = store_url("s3", tmp_path)
        Store.create(url, shared_uploads=True, catalog=False).close()
        w = Writer(url, tmp_path)
        for _ in range(3):
            w.flush()
        view = StoreView(url)
        try:
            fol = S3F.follower_for(view.store.fs)
            fol.interval_s = 0.0
            assert view.partitions("t") == list(range(PARTS))  # (its first poll lists them)
            view.bounds("t", 0)  # (and the one after finds nothing new)
            polls = fol.stats["polls"]
            for _ in range(3):
                assert [view.bounds("t", p).high_watermark for p in range(PARTS)] == [3] * PARTS
                assert all(view.fetch("t", p, 0, 1 << 20).nbytes > 0 for p in range(PARTS))
                view.changes()
            assert fol.stats["polls"] == polls
            view.at_edge()  # a Fetch waits: every read polls again
            view.bounds("t", 0)
            assert fol.stats["polls"] == polls + 1
        finally:
            view.close()
            w.st.close()


def test_an_off_edge_read_does_not_wait_behind_a_poll_for_the_live_edge(s3_store, monkeypatch):
    """A poll at the follow interval in flight (here: through a head source whose answer
    hangs, as a fleet's poller under load) holds the follower: a reader content with the last
    finished poll (off the live edge: a Fetch catching up, a ListOffsets EARLIEST) gets its
    answer without waiting for it; a reader at the edge still waits, and then sees what the
    poll found."""
    from kcompact.reput.s3_cache import HeadSource, set_head_source
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    monkeypatch.setattr(S3F, "IDLE_POLL_S", 3600.0)
    fake, url, w = s3_store
    view = StoreView(url)
    release, asked = threading.Event(), threading.Event()

    class Hanging(HeadSource):
        def heads(self, backend, max_age_s=None):
            asked.set()
            assert release.wait(30)
            return None  # (the follower then polls S3 itself)

    try:
        fol = S3F.follower_for(view.store.fs)
        fol.interval_s = 0.0
        for _ in range(2):  # (finished polls, the last of which found nothing new)
            assert view.bounds("t", 0).high_watermark == 1
        w.flush()
        set_head_source(Hanging())
        edge = threading.Thread(target=lambda: fol.poll(max_age_s=0.0), daemon=True)
        edge.start()
        assert asked.wait(30)
        got: list = []
        off = threading.Thread(target=lambda: got.append(view.bounds("t", 0)), daemon=True)
        off.start()
        off.join(30)
        assert got == [view._bounds(view._part("t", 0)[1])] and got[0].high_watermark == 1
        assert edge.is_alive()  # the poll for the edge is still in flight
        release.set()
        edge.join(30)
        assert not edge.is_alive()
        assert view.bounds("t", 0, fresh=True).high_watermark == 2  # what that poll found
    finally:
        release.set()
        set_head_source(None)
        view.close()
