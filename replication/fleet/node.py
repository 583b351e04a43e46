"""One node of a fleet: membership (pings), the ring, and the shared block cache.

``Fleet`` pings every other node of ``--peers`` (peers.py), keeps the ring of the live ones
(ring.py), answers its peers' pings and block requests (``PeerServer``), and is installed as the
S3 backends' block source (reput/s3_cache.py ``set_block_source``): a block cache miss of an
immutable object is asked of the block's owner node, which reads S3 once for the whole fleet;
when the owner is this node, or the owner fails, this node reads S3 itself. It is also the
followers' head source (``set_head_source``): the owner of ``HEADS_KEY``, the *poller*, polls
the journal's and the catalog's heads for the fleet, and the other nodes' followers ask it for
them instead of polling S3 each (when it fails, lags or answers garbage, they poll S3 themselves
for ``HEADS_RETRY_S``). The Kafka endpoint asks it who leads a partition and who coordinates a
group. Spec: docs/formats/peer-protocol.md;
user guide: docs/fleet.md.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kcompact.reput import filenames as fn
from kcompact.reput.s3_cache import BlockSource, Heads, HeadSource, block_source, \
    head_source, set_block_source, set_head_source

from ..errors import ReplicationError
from .peers import PROTOCOL_VERSION, PeerClient, PeerError, PeerServer, parse_peers
from .ring import HEADS_KEY, Ring, block_key, group_key, partition_key

PING_INTERVAL_S = 1.0
#: a peer with no good ping answer for this long leaves the ring
DEAD_AFTER_S = 4.0
WILDCARDS = ("", "0.0.0.0", "::")
#: after a failed heads request (or a stale answer) the follower polls S3 itself this long (s)
HEADS_RETRY_S = 10.0
#: a node's follower polls S3 itself at least this often (s), whatever the poller answers: a
#: poller whose answers are wrong makes it see new entries late, never miss one
OWN_POLL_S = 30.0


def heads_stale_s(asked_s: float | None = None) -> float:
    """A poller's heads older than this are a lagging poller's: the follower polls S3.
    ``asked_s``: the age the follower asked for, when longer than the follow interval (a
    reader off the live edge, reput/s3_follow.py ``IDLE_POLL_S``): that much more."""
    from kcompact.reput.s3_follow import follow_interval_s
    fast = follow_interval_s()
    return max(1.0, 4 * fast) + max(0.0, min(asked_s or 0.0, OWN_POLL_S) - fast)


@dataclass(frozen=True)
class FleetOptions:
    """``--node-id``, ``--peer-listen``, ``--peers``, ``--peer-token-file``."""

    node_id: int
    peer_listen: str
    peers: str
    token_file: str | None = None

    def check(self) -> tuple[str, int, dict[int, tuple[str, int]]]:
        """(host, port, peers); a ReplicationError saying what to fix."""
        from ..connections import parse_listen
        if self.node_id < 0:
            raise ReplicationError(f"--node-id {self.node_id}: use a number >= 0")
        host, port = parse_listen(self.peer_listen, "--peer-listen")
        peers = parse_peers(self.peers)
        if self.node_id not in peers:
            raise ReplicationError(
                f"--peers does not list this node (--node-id {self.node_id}): list every node "
                f"of the fleet, this one included ({self.node_id}@HOST:PORT)")
        return host, port, peers


class _Peer:
    def __init__(self, client: PeerClient):
        self.client = client
        self.last_ok: float | None = None
        self.kafka: tuple[str, int] | None = None
        self.error = ""
        self.skip_blocks = False
        #: its heads are not asked for before this (monotonic s): it failed or lagged
        self.skip_heads_until = 0.0


class Fleet(BlockSource, HeadSource):
    """A running node (module docstring). ``clock``: monotonic seconds (injected in tests)."""

    def __init__(self, opts: FleetOptions, store_id: str, fs, log, *,
                 tls_cert: str | None = None, clock: Callable[[], float] = time.monotonic):
        from ..protocol import read_token_file
        from .peers import client_tls_context
        self.host, self.port, addrs = opts.check()
        self.node_id = opts.node_id
        self.store_id, self.fs, self.log, self.clock = store_id, fs, log, clock
        self.token = read_token_file(opts.token_file) if opts.token_file else None
        ctx = client_tls_context(tls_cert)
        self.peers: dict[int, _Peer] = {
            nid: _Peer(PeerClient(nid, h, p, self_id=self.node_id, token=self.token,
                                  ssl_context=ctx))
            for nid, (h, p) in addrs.items() if nid != self.node_id}
        self.kafka: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ring = Ring([self.node_id])
        self._live_seen: tuple[int, ...] = (self.node_id,)
        #: when this node's follower last polled S3 itself (the head source said None)
        self._own_poll_at = clock()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kcompact-peer")
        self.server: PeerServer | None = None
        #: journal entries found absent (path -> when): the fleet's followers poll each
        #: writer's next entry, and this node answers for it at most one GET per half interval
        self._absent: dict[str, float] = {}
        from kcompact.reput.s3_follow import follow_interval_s
        self.absent_ttl_s = follow_interval_s() / 2
        #: the offsets writer's commit (offsets.FleetOffsets.write), set by the endpoint
        self.on_commit: Callable[[str, list], None] | None = None
        # metrics
        self.sent: dict[tuple[str, str], int] = {}
        self.served: dict[tuple[str, str], int] = {}
        self.block_hits = self.block_misses = 0
        self.gets_saved = 0
        self.ping_failures: dict[int, int] = {}
        self.ring_changes = 0

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, ssl_context=None) -> tuple[str, int]:
        """Listen on ``--peer-listen``, start pinging, install the block source."""
        import asyncio
        loop = asyncio.get_running_loop()
        bs = self.fs.block_size if self._is_s3 else 0
        self.server = PeerServer(self.node_id, self.token, self.ping_doc, self.read_block,
                                 lambda f, *a: loop.run_in_executor(self.pool, f, *a), bs,
                                 self.log, self._count_served, self._commit,
                                 self.heads_doc if self._is_s3 else None)
        try:
            bound = await self.server.start(self.host, self.port, ssl_context)
        except OSError as e:
            raise ReplicationError(f"cannot listen on --peer-listen {self.host}:{self.port}: "
                                   f"{e.strerror or e}") from None
        for nid, peer in self.peers.items():
            t = threading.Thread(target=self._ping_loop, args=(nid, peer), daemon=True,
                                 name=f"kcompact-ping-{nid}")
            t.start()
            self._threads.append(t)
        if self._is_s3:
            set_block_source(self)
            set_head_source(self)
        return bound

    async def close(self) -> None:
        self._stop.set()
        if block_source() is self:  # (a process running two nodes: tests)
            set_block_source(None)
        if head_source() is self:
            set_head_source(None)
        if self.server is not None:
            await self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def set_kafka(self, host: str, port: int) -> None:
        """The Kafka address this node advertises (once its Kafka listener is up)."""
        self.kafka = (host, port)

    @property
    def _is_s3(self) -> bool:
        return hasattr(self.fs, "read_block") and hasattr(self.fs, "bucket")

    # -- membership ----------------------------------------------------------------------------

    def ping_doc(self) -> dict | None:
        if self.kafka is None:
            return None
        return {"protocol": PROTOCOL_VERSION, "node_id": self.node_id,
                "store_id": self.store_id, "kafka_host": self.kafka[0],
                "kafka_port": self.kafka[1]}

    def _ping_loop(self, nid: int, peer: _Peer) -> None:
        while not self._stop.is_set():
            self.ping_once(nid, peer)
            self._stop.wait(PING_INTERVAL_S)

    def ping_once(self, nid: int, peer: _Peer) -> None:
        try:
            doc = peer.client.ping()
            if doc["node_id"] != nid:
                raise PeerError(f"{peer.client}: answers as node {doc['node_id']}, --peers "
                                f"says node {nid}: fix --peers or that node's --node-id")
            if doc["store_id"] != self.store_id:
                raise PeerError(f"{peer.client}: serves another store ({doc['store_id']}): "
                                "every node of a fleet serves the same --store")
            if doc["kafka_port"] <= 0:
                raise PeerError(f"{peer.client}: its Kafka listener is not up")
        except PeerError as e:
            self._count_sent("ping", "failed")
            with self._lock:
                self.ping_failures[nid] = self.ping_failures.get(nid, 0) + 1
                changed = e.args[0] != peer.error
                peer.error = e.args[0]
            if changed:  # a peer not up yet (this node started first) is no warning
                self.log.log(logging.WARNING if peer.last_ok is not None else logging.INFO,
                             "fleet: ping of %s failed: %s", peer.client, e)
            self._membership()
            return
        self._count_sent("ping", "ok")
        host = doc["kafka_host"] if doc["kafka_host"] not in WILDCARDS else peer.client.host
        with self._lock:
            if peer.error:
                self.log.info("fleet: %s answers again", peer.client)
            peer.error = ""
            peer.last_ok = self.clock()
            peer.kafka = (host, int(doc["kafka_port"]))
            peer.skip_blocks = False
        self._membership()

    def live(self) -> dict[int, tuple[str, int] | None]:
        """node id -> its advertised Kafka address, for every live node (this one included)."""
        now = self.clock()
        out: dict[int, tuple[str, int] | None] = {self.node_id: self.kafka}
        with self._lock:
            for nid, p in self.peers.items():
                if p.last_ok is not None and now - p.last_ok <= DEAD_AFTER_S and p.kafka:
                    out[nid] = p.kafka
        return out

    def _membership(self) -> Ring:
        nodes = tuple(sorted(self.live()))
        with self._lock:
            if nodes == self._live_seen:
                return self._ring
            old, self._live_seen = self._live_seen, nodes
            self._ring = Ring(nodes)
            self.ring_changes += 1
            ring = self._ring
        gone, came = sorted(set(old) - set(nodes)), sorted(set(nodes) - set(old))
        if self._is_s3:  # partitions move: their consumers arrive at positions another node
            # served, and this node's next poll is not one of a quiet store's (IDLE_POLL_S)
            from kcompact.reput.s3_follow import follower_for
            fol = follower_for(self.fs)
            if fol is not None:
                fol.wake()
        self.log.info("fleet: ring is now %s%s%s", list(nodes),
                      f" ({', '.join(map(str, came))} joined)" if came else "",
                      f" ({', '.join(map(str, gone))} left)" if gone else "")
        return ring

    def ring(self) -> Ring:
        """The ring of the live nodes as this node sees them now."""
        return self._membership()

    def leader(self, topic: str, partition: int) -> int:
        return self.ring().owner(partition_key(topic, partition))

    def coordinator(self, group: str) -> int:
        return self.ring().owner(group_key(group))

    # -- the shared block cache ----------------------------------------------------------------

    def _same_store(self, backend) -> bool:
        return (backend is self.fs or (
            getattr(backend, "bucket", None) == self.fs.bucket
            and getattr(backend, "prefix", None) == self.fs.prefix
            and getattr(backend, "endpoint", None) == self.fs.endpoint))

    def fetch(self, backend, path: str, block: int, from_s3: Callable[[], bytes]) -> bytes:
        """BlockSource: the block from its owner node, else from S3 (module docstring)."""
        if not self._same_store(backend):
            return from_s3()
        owner = self.ring().owner(block_key(path, block))
        if owner is None or owner == self.node_id:
            # a journal entry through this node's cache, as its peers' requests for it are
            # answered (read_block): one GET of it for the fleet, not one more for this node
            data = backend.read_block(path, block) if fn.is_journal_entry(path) else from_s3()
            if self._absent and fn.is_journal_entry(path):  # it exists now: say so to peers
                with self._lock:
                    self._absent.pop(path, None)
            return data
        peer = self.peers[owner]
        if peer.skip_blocks:
            self._count_sent("block", "skipped")
            return from_s3()
        try:
            data = peer.client.block(path, block, backend.block_size)
        except PeerError as e:
            self._count_sent("block", "failed")
            with self._lock:
                peer.skip_blocks = True
            self.log.warning("fleet: %s; reading S3 instead (and for its blocks until it "
                             "answers a ping)", e)
            return from_s3()
        if data is None:  # the owner's GET found no such object: S3's own answer
            self._count_sent("block", "not-found")
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        self._count_sent("block", "ok")
        with self._lock:
            self.gets_saved += 1
        return data

    def read_block(self, path: str, block: int) -> bytes:
        """A peer's block request (run in ``pool``)."""
        if not self._is_s3:
            raise ValueError("this node's store is not on S3: it shares no blocks")
        if not (fn.is_immutable_object(path) or fn.is_journal_entry(path)) \
                or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{path!r} is not an immutable object of the store")
        journal = fn.is_journal_entry(path)
        if journal:  # a follower's poll of a writer's next entry: one GET per half interval
            with self._lock:
                seen = self._absent.get(path)
            if seen is not None and self.clock() - seen < self.absent_ttl_s:
                with self._lock:
                    self.block_hits += 1
                raise FileNotFoundError(errno.ENOENT, "no such object", path)
        hit = self.fs.has_block(path, block)
        try:
            data = self.fs.read_block(path, block)
        except FileNotFoundError:
            if journal:
                with self._lock:
                    self._absent[path] = self.clock()
                    if len(self._absent) > 4096:
                        self._absent.clear()
            raise
        with self._lock:
            if hit:
                self.block_hits += 1
            else:
                self.block_misses += 1
        return data

    # -- the shared heads ----------------------------------------------------------------------

    def poller(self) -> int | None:
        """The node that polls the journal's and the catalog's heads for the fleet."""
        return self.ring().owner(HEADS_KEY)

    def heads(self, backend, max_age_s: float | None = None) -> Heads | None:
        """HeadSource: the poller's heads from a poll at most ``max_age_s`` old, or None (this
        node is the poller, or the poller failed, lags or answered garbage: this node's
        follower polls S3 itself)."""
        if not self._same_store(backend):
            return None
        now = self.clock()
        owner = self.poller()
        if owner is None or owner == self.node_id or now - self._own_poll_at >= OWN_POLL_S:
            self._own_poll_at = now
            return None
        peer = self.peers[owner]
        if now < peer.skip_heads_until:
            self._count_sent("heads", "skipped")
            self._own_poll_at = now
            return None
        try:
            writers, catalog, age = peer.client.heads(max_age_s)
            if age > heads_stale_s(max_age_s):
                raise PeerError(f"{peer.client}: its heads are {age:.1f} s old (its own polls "
                                "of S3 fail or stall)")
        except PeerError as e:
            self._count_sent("heads", "failed")
            with self._lock:
                peer.skip_heads_until = self.clock() + HEADS_RETRY_S
            self._own_poll_at = self.clock()
            self.log.warning("fleet: %s; polling S3 instead for %.0f s", e, HEADS_RETRY_S)
            return None
        self._count_sent("heads", "ok")
        return Heads(writers, catalog, age)

    def heads_doc(self, max_age_s: float | None = None) -> dict:
        """A peer's heads request (run in ``pool``): this node's follower polls S3 itself
        unless its last poll is younger than ``max_age_s`` (None, or less than the follow
        interval: the follow interval, whoever asks; at most ``OWN_POLL_S``) and answers what
        it found."""
        from kcompact.reput.s3_follow import follower_for
        fol = follower_for(self.fs)
        if fol is None:
            raise FileNotFoundError(errno.ENOENT, "this node follows no journal (the store "
                                    "has no shared uploads)")
        fol.poll(max_age_s=max(fol.interval_s, min(OWN_POLL_S, max_age_s or 0.0)),
                 shared=False)
        h = fol.heads()
        age = h.age_s if h.age_s != float("inf") else 1e9
        return {"writers": h.writers, "catalog": h.catalog, "age_ms": int(age * 1000)}

    def _commit(self, group: str, rows: list) -> None:
        if self.on_commit is None:
            raise ReplicationError(f"node {self.node_id} keeps no group offsets")
        from ..group_offsets import GroupOffset
        self.on_commit(group, [(t, p, GroupOffset(o, md, le, ms)) for t, p, o, md, le, ms in rows])

    # -- metrics and health --------------------------------------------------------------------

    def _count_sent(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.sent[(kind, outcome)] = self.sent.get((kind, outcome), 0) + 1

    def _count_served(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.served[(kind, outcome)] = self.served.get((kind, outcome), 0) + 1

    def health(self) -> str | None:
        """``/healthz``: None while the peer listener is up (a peer that is down makes the
        peer's node unhealthy, not this one: ``fleet_node_live`` and the log say which)."""
        if self.server is None or self.server.bound is None or self._stop.is_set():
            return "fleet: the peer listener is not up"
        return None

    def status(self) -> dict:
        live = self.live()
        return {"node_id": self.node_id, "ring": sorted(live),
                "peers": {n: {"live": n in live, "error": p.error}
                          for n, p in sorted(self.peers.items())}}

    def collect(self):
        from ..ops import counter, gauge
        with self._lock:
            sent, served = dict(self.sent), dict(self.served)
            hits, misses, saved = self.block_hits, self.block_misses, self.gets_saved
            fails, changes = dict(self.ping_failures), self.ring_changes
        live = self.live()
        g = gauge("fleet_ring_members", "Nodes on this node's ring (itself included).")
        g.add_metric([], len(live))
        yield g
        m = gauge("fleet_node_live", "1 when the node answers pings (this node: always 1).",
                  ["node"])
        for n in sorted(set(self.peers) | {self.node_id}):
            m.add_metric([str(n)], 1 if n in live else 0)
        yield m
        s = counter("fleet_peer_requests_sent", "Requests this node sent to peers, by kind "
                    "(ping, block) and outcome.", ["kind", "outcome"])
        for (k, o), n in sorted(sent.items()):
            s.add_metric([k, o], n)
        yield s
        r = counter("fleet_peer_requests_served", "Peer requests this node answered, by kind "
                    "and outcome.", ["kind", "outcome"])
        for (k, o), n in sorted(served.items()):
            r.add_metric([k, o], n)
        yield r
        h = counter("fleet_peer_block_hits", "Peers' block requests answered from this node's "
                    "cache or spool.")
        h.add_metric([], hits)
        yield h
        x = counter("fleet_peer_block_misses", "Peers' block requests this node read from S3 "
                    "(one GET each, shared by concurrent requests).")
        x.add_metric([], misses)
        yield x
        v = counter("fleet_s3_gets_saved", "Blocks this node got from their owner node instead "
                    "of a GET of its own.")
        v.add_metric([], saved)
        yield v
        f = counter("fleet_ping_failures", "Pings of a peer that got no good answer.", ["node"])
        for n, k in sorted(fails.items()):
            f.add_metric([str(n)], k)
        yield f
        c = counter("fleet_ring_changes", "Times this node's ring changed (a node joined or "
                    "left).")
        c.add_metric([], changes)
        yield c
