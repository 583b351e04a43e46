"""The peer listener and client of a fleet (spec: docs/formats/peer-protocol.md).

``PeerServer``: an aiohttp application on ``--peer-listen`` answering ``/peer/v1/ping``,
``/peer/v1/block`` (blocks of immutable objects, from this node's spool, block cache or one S3
GET), ``/peer/v1/heads`` (the journal's and the catalog's heads, polled for the whole fleet)
and ``/peer/v1/commit``. ``PeerClient``: the blocking side, used from the endpoint's reader threads; one persistent
``http.client`` connection per peer and thread, short timeouts, and every failure raised as a
``PeerError`` (the caller then reads S3 itself).
"""

from __future__ import annotations

import socket
import http.client
import json
import ssl
import threading
from typing import Callable
from urllib.parse import quote

from aiohttp import web

from kcompact.reput.batch import crc32c
from ..errors import ReplicationError
from ..protocol import check_token

PROTOCOL_VERSION = 2
PING_PATH = "/peer/v1/ping"
BLOCK_PATH = "/peer/v1/block"
COMMIT_PATH = "/peer/v1/commit"
HEADS_PATH = "/peer/v1/heads"
PEER_HEADER = "X-Kcompact-Peer"
DIGEST_HEADER = "X-Kcompact-Crc32c"
BLOCK_SIZE_HEADER = "X-Kcompact-Block-Size"
#: seconds: connecting to a peer, a ping's answer, a block's answer
CONNECT_TIMEOUT_S = 1.0
PING_TIMEOUT_S = 1.0
BLOCK_TIMEOUT_S = 5.0
HEADS_TIMEOUT_S = 1.0
COMMIT_TIMEOUT_S = 15.0


class PeerError(ReplicationError):
    """A peer that did not answer, or answered something this node cannot use."""


def digest(data: bytes) -> str:
    """A block's check: its CRC-32C (Kafka's batch checksum), 8 hex digits. It catches a
    damaged or foreign answer; peers are authenticated by the token, not by this. (Protocol 1
    used BLAKE2b-128: 6 ms of CPU a 4 MiB block on each side, against 0.4 ms.)"""
    return "%08x" % crc32c(data, 0, len(data))


def parse_peers(text: str) -> dict[int, tuple[str, int]]:
    """``1@HOST:PORT,2@HOST:PORT`` (Kafka's controller.quorum.voters spelling) -> {id: (host,
    port)}; a ReplicationError naming the bad entry."""
    from ..connections import parse_listen
    out: dict[int, tuple[str, int]] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        nid, sep, addr = item.partition("@")
        if not sep or not nid.strip().isdigit():
            raise ReplicationError(f"--peers {item!r}: use ID@HOST:PORT, e.g. "
                                   "1@10.0.0.1:9190,2@10.0.0.2:9190")
        host, port = parse_listen(addr.strip(), "--peers")
        if port == 0:
            raise ReplicationError(f"--peers {item!r}: a peer's port cannot be 0")
        if int(nid) in out:
            raise ReplicationError(f"--peers: node {int(nid)} is listed twice")
        out[int(nid)] = (host, port)
    if not out:
        raise ReplicationError("--peers is empty: list every node, e.g. 1@HOST:PORT,2@HOST:PORT")
    return out


# ---------------------------------------------------------------------------------------------
# the listener


class PeerServer:
    """Answers peers. ``ping_doc()``: this node's ping answer (None: not ready, 503);
    ``read_block(path, block)``: the block's bytes (blocking, run in ``run``); FileNotFoundError
    -> 404, ValueError -> 400, any other error -> 503."""

    def __init__(self, node_id: int, token: bytes | None, ping_doc: Callable[[], dict | None],
                 read_block: Callable[[str, int], bytes], run: Callable, block_size: int,
                 log, on_request: Callable[[str, str], None] = lambda kind, outcome: None,
                 commit: Callable[[str, list], None] | None = None,
                 heads: Callable[[float | None], dict] | None = None):
        self.node_id, self.token, self.log = node_id, token, log
        self.ping_doc, self.read_block, self.run = ping_doc, read_block, run
        self.block_size = block_size
        self.on_request = on_request
        self.commit = commit
        self.heads = heads
        self._runner: web.AppRunner | None = None
        self.bound: tuple[str, int] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        app.router.add_get(PING_PATH, self._ping)
        app.router.add_get(BLOCK_PATH, self._block)
        app.router.add_post(COMMIT_PATH, self._commit)
        app.router.add_get(HEADS_PATH, self._heads)
        return app

    def _auth(self, request: web.Request) -> web.Response | None:
        if self.token is None:
            return None
        status = check_token(request.headers.get("Authorization"), self.token)
        if status:
            self.on_request(request.path.rsplit("/", 1)[-1], "refused")
            return web.Response(status=status, text="a peer token is needed "
                                "(--peer-token-file)\n" if status == 401 else "wrong peer token\n")
        return None

    async def _ping(self, request: web.Request) -> web.Response:
        refused = self._auth(request)
        if refused is not None:
            return refused
        doc = self.ping_doc()
        if doc is None:
            self.on_request("ping", "not-ready")
            return web.Response(status=503, text="not ready\n")
        self.on_request("ping", "ok")
        return web.json_response(doc)

    async def _block(self, request: web.Request) -> web.Response:
        refused = self._auth(request)
        if refused is not None:
            return refused
        path = request.query.get("path", "")
        raw = request.query.get("block", "")
        if not raw.isdigit():
            self.on_request("block", "bad-request")
            return web.Response(status=400, text="block must be a number >= 0\n")
        try:
            data = await self.run(self.read_block, path, int(raw))
        except FileNotFoundError:
            self.on_request("block", "not-found")
            return web.Response(status=404, text=f"no such object: {path}\n")
        except ValueError as e:
            self.on_request("block", "bad-request")
            return web.Response(status=400, text=f"{e}\n")
        except Exception as e:  # noqa: BLE001 - S3 failed: the asking node reads it itself
            self.on_request("block", "failed")
            return web.Response(status=503, text=" ".join(str(e).split()) + "\n")
        self.on_request("block", "ok")
        return web.Response(body=data, headers={DIGEST_HEADER: digest(data),
                                                BLOCK_SIZE_HEADER: str(self.block_size),
                                                "Content-Type": "application/octet-stream"})

    async def _heads(self, request: web.Request) -> web.Response:
        refused = self._auth(request)
        if refused is not None:
            return refused
        if self.heads is None:
            self.on_request("heads", "not-found")
            return web.Response(status=404, text="this node follows no journal\n")
        raw = request.query.get("max_age_ms")
        if raw is not None and not raw.isdigit():
            self.on_request("heads", "bad-request")
            return web.Response(status=400, text="max_age_ms must be a number >= 0\n")
        try:
            doc = await self.run(self.heads, int(raw) / 1000.0 if raw is not None else None)
        except FileNotFoundError as e:
            self.on_request("heads", "not-found")
            return web.Response(status=404, text=f"{e}\n")
        except Exception as e:  # noqa: BLE001 - S3 failed: the asking node polls it itself
            self.on_request("heads", "failed")
            return web.Response(status=503, text=" ".join(str(e).split()) + "\n")
        self.on_request("heads", "ok")
        return web.json_response(doc)

    async def _commit(self, request: web.Request) -> web.Response:
        refused = self._auth(request)
        if refused is not None:
            return refused
        try:
            doc = await request.json()
            group = doc["group"]
            rows = [(str(r["topic"]), int(r["partition"]), int(r["offset"]),
                     str(r.get("metadata") or ""), int(r.get("leader_epoch", -1)),
                     int(r.get("commit_ms", 0))) for r in doc["offsets"]]
            if not isinstance(group, str):
                raise ValueError("group")
        except (ValueError, KeyError, TypeError) as e:
            self.on_request("commit", "bad-request")
            return web.Response(status=400, text=f"not a commit: {e}\n")
        if self.commit is None:
            self.on_request("commit", "not-writer")
            return web.Response(status=409, text="this node keeps no group offsets\n")
        try:
            await self.run(self.commit, group, rows)
        except Exception as e:  # noqa: BLE001 - the coordinator answers its client
            self.on_request("commit", "failed")
            return web.Response(status=503, text=" ".join(str(e).split()) + "\n")
        self.on_request("commit", "ok")
        return web.json_response({"ok": True})

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None
                    ) -> tuple[str, int]:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            await self._runner.cleanup()
            raise
        site = web.SockSite(self._runner, sock, ssl_context=ssl_context, backlog=128)
        await site.start()
        self.bound = (host, sock.getsockname()[1])
        return self.bound

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# ---------------------------------------------------------------------------------------------
# the client


class PeerClient:
    """Blocking requests to one peer. Thread-safe: one connection per thread, kept open."""

    def __init__(self, node_id: int, host: str, port: int, *, self_id: int,
                 token: bytes | None = None, ssl_context: ssl.SSLContext | None = None):
        self.node_id, self.host, self.port = node_id, host, port
        self.self_id, self.token, self.ssl_context = self_id, token, ssl_context
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"node {self.node_id} at {self.host}:{self.port}"

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            if self.ssl_context is not None:
                c = http.client.HTTPSConnection(self.host, self.port, timeout=CONNECT_TIMEOUT_S,
                                                context=self.ssl_context)
            else:
                c = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT_S)
            c.connect()
            self._local.conn = c
        c.sock.settimeout(timeout)
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    def _get(self, path: str, timeout: float, body: bytes | None = None
             ) -> tuple[int, dict, bytes]:
        headers = {PEER_HEADER: str(self.self_id)}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.token is not None:
            headers["Authorization"] = "Bearer " + self.token.decode("ascii")
        for attempt in (0, 1):  # a kept connection the peer closed meanwhile: once more
            fresh = getattr(self._local, "conn", None) is None
            try:
                c = self._conn(timeout)
                c.request("GET" if body is None else "POST", path, body=body, headers=headers)
                r = c.getresponse()
                body = r.read()
                hdrs = {k.lower(): v for k, v in r.getheaders()}
                if r.will_close:
                    self._drop()
                return r.status, hdrs, body
            except (OSError, http.client.HTTPException, ValueError) as e:
                self._drop()
                if attempt == 0 and not fresh and isinstance(
                        e, (http.client.RemoteDisconnected, ConnectionResetError,
                            BrokenPipeError)):
                    continue
                raise PeerError(f"{self}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def ping(self) -> dict:
        status, _, body = self._get(PING_PATH, PING_TIMEOUT_S)
        if status != 200:
            raise PeerError(f"{self}: ping answered HTTP {status}")
        try:
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            for k, t in (("protocol", int), ("node_id", int), ("store_id", str),
                         ("kafka_host", str), ("kafka_port", int)):
                if not isinstance(doc.get(k), t):
                    raise ValueError(f"no {k}")
        except ValueError as e:
            raise PeerError(f"{self}: ping answer is not a kcompact peer's ({e})") from None
        if doc["protocol"] != PROTOCOL_VERSION:
            raise PeerError(f"{self}: speaks peer protocol {doc['protocol']}, this node "
                            f"{PROTOCOL_VERSION}: run one kcompact version over the fleet")
        return doc

    def commit(self, group: str, rows) -> None:
        """Forward a group's commit to the offsets writer; returns once it is durable there."""
        status, _, body = self._get(COMMIT_PATH, COMMIT_TIMEOUT_S, _commit_doc(group, rows))
        if status != 200:
            raise PeerError(f"{self}: commit answered HTTP {status}: "
                            f"{body[:300].decode('utf-8', 'replace').strip()}")

    def heads(self, max_age_s: float | None = None
              ) -> tuple[dict[str, int], int | None, float]:
        """The journal's and the catalog's heads as the peer polled them, in a poll at most
        ``max_age_s`` old (None: its follow interval): (writer -> its next seq, the catalog's
        newest version or None, seconds since that poll)."""
        path = HEADS_PATH if max_age_s is None else \
            f"{HEADS_PATH}?max_age_ms={max(0, int(max_age_s * 1000))}"
        status, _, body = self._get(path, HEADS_TIMEOUT_S)
        if status != 200:
            raise PeerError(f"{self}: heads answered HTTP {status}: "
                            f"{body[:200].decode('utf-8', 'replace').strip()}")
        try:
            doc = json.loads(body)
            writers, catalog, age = doc["writers"], doc["catalog"], doc["age_ms"]
            if not isinstance(writers, dict) or not all(
                    isinstance(w, str) and w and type(s) is int and s >= 0
                    for w, s in writers.items()):
                raise ValueError("writers is not an object of writer -> seq >= 0")
            if catalog is not None and (type(catalog) is not int or catalog < 0):
                raise ValueError("catalog is not a version >= 0 or null")
            if type(age) is not int or age < 0:
                raise ValueError("age_ms is not a number >= 0")
        except (ValueError, KeyError, TypeError) as e:
            raise PeerError(f"{self}: heads answer is not a kcompact peer's ({e})") from None
        return writers, catalog, age / 1000.0

    def block(self, path: str, block: int, block_size: int) -> bytes | None:
        """The block's bytes; None when the peer says the object does not exist."""
        status, hdrs, body = self._get(f"{BLOCK_PATH}?path={quote(path, safe='')}"
                                       f"&block={int(block)}", BLOCK_TIMEOUT_S)
        if status == 404:
            return None
        if status != 200:
            raise PeerError(f"{self}: block {block} of {path} answered HTTP {status}: "
                            f"{body[:200].decode('utf-8', 'replace').strip()}")
        if hdrs.get(BLOCK_SIZE_HEADER.lower()) != str(block_size):
            raise PeerError(f"{self}: answers blocks of {hdrs.get(BLOCK_SIZE_HEADER.lower())} "
                            f"bytes, this node uses {block_size}")
        if len(body) > block_size or hdrs.get(DIGEST_HEADER.lower()) != digest(body):
            raise PeerError(f"{self}: block {block} of {path} arrived damaged (digest)")
        return body


def _commit_doc(group: str, rows) -> bytes:
    return json.dumps({"group": group, "offsets": [
        {"topic": t, "partition": int(p), "offset": int(o.offset), "metadata": o.metadata,
         "leader_epoch": int(o.leader_epoch), "commit_ms": int(o.commit_ms)}
        for t, p, o in rows]}).encode()


def client_tls_context(cert: str | None) -> ssl.SSLContext | None:
    """The context a node asks its peers with when it serves TLS itself: the fleet's
    certificate (``--tls-cert``) is trusted as well as the system's CAs."""
    if not cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=cert)
    except (OSError, ssl.SSLError) as e:
        raise ReplicationError(f"cannot trust --tls-cert {cert} for peers: {e}") from None
    return ctx
