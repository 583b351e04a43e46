"""``kcompact kv serve`` and ``kcompact kv build --follow``: a follower that answers reads.

The process holds the map (LevelDB allows one process per map): a MapBuilder follows the store
or the Kafka topic in the main thread, and the read API (:class:`ReadAPI`, aiohttp; the API is
docs/formats/kv-http.md) listens from a thread of its own (``replication.ops.AppThread``,
behind ``replication.connections``' connection limit and client timeout). ``kv serve`` listens
on ``--listen`` (loopback unless a ``--token-file`` is given; bearer tokens as ``serve``
checks them); ``kv build --follow`` on a free loopback port for this machine only. Either
leaves its address in the map directory (remote.py) so that ``kcompact kv get`` in another
process answers through it.

Reads: one key straight from the live map (LevelDB reads are atomic per key); many keys, a
scan page and the offsets each from one LevelDB snapshot. A scan's continuation token names a
snapshot kept ``CURSOR_TTL_S`` after its page was served, so every page of a scan shows the same
state of the map, however the follower writes meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import os
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from aiohttp import web

from kcompact.replication import ReplicationError
from kcompact.replication.connections import is_loopback, local_url, parse_listen, track_requests
from kcompact.replication.ops import (AppThread, Ops, Unreachable, check_listen, counter, gauge,
                                      start_ops)
from kcompact.replication.protocol import ServerLimits, check_token, error_doc, read_token_file

from ...plugins.leveldb_sink import KVError, KVLockedError
from ..output import text_or_b64
from .map import KVMap, KVSnapshot
from .follower_client import FollowerAddress

#: keys of one multi-get, items of one scan page
MAX_KEYS = 10_000
DEFAULT_LIMIT = 100
#: a multi-get's JSON body
MAX_BODY = 4 << 20
#: a scan's snapshot is kept this long after its last page, and at most MAX_CURSORS at once
CURSOR_TTL_S = 60.0
MAX_CURSORS = 256
MAX_KEY = 1 << 20


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", headers=headers,
                        text=json.dumps(error_doc(status, message)) + "\n")


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _BadRequest(400, f"{what}: not valid base64") from None


def _key_param(q: Mapping[str, str], name: str, required: bool = True) -> bytes | None:
    """``name`` (UTF-8 text) or ``name_b64`` (base64) of a query, not both."""
    text, b64 = q.get(name), q.get(f"{name}_b64")
    if text is not None and b64 is not None:
        raise _BadRequest(400, f"give {name} or {name}_b64, not both")
    if text is None and b64 is None:
        if required:
            raise _BadRequest(400, f"missing {name}= (UTF-8 text) or {name}_b64= (base64)")
        return None
    key = text.encode("utf-8") if text is not None else _b64(b64, f"{name}_b64")
    if len(key) > MAX_KEY:
        raise _BadRequest(400, f"{name}: longer than {MAX_KEY} bytes")
    return key


def _item(key: bytes, value: bytes | None) -> dict[str, Any]:
    """A key and its value as ``dump --json`` shows them (UTF-8 text, else ``*_b64``)."""
    doc: dict[str, Any] = {}
    text_or_b64("key", key, doc)
    doc["found"] = value is not None
    if value is not None:
        text_or_b64("value", value, doc)
    return doc


def _offsets(r: KVSnapshot | KVMap) -> dict[str, int]:
    return {str(p): o for p, o in sorted(r.offsets().items())}


class _Cursor:
    def __init__(self, snap: KVSnapshot):
        self.snap = snap
        self.expires = time.monotonic() + CURSOR_TTL_S


class ScanCursors:
    """The snapshots of scans under way, by id: taken out while a page is read (so an expiry
    never closes one in use), put back with a new expiry."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cursors: dict[int, _Cursor] = {}
        self._ids = itertools.count(1)

    def take(self, cid: int) -> _Cursor | None:
        with self._lock:
            return self._cursors.pop(cid, None)

    def put(self, cur: _Cursor) -> int:
        cur.expires = time.monotonic() + CURSOR_TTL_S
        with self._lock:
            cid = next(self._ids)
            self._cursors[cid] = cur
            old = []
            while len(self._cursors) > MAX_CURSORS:  # the oldest first (dicts keep order)
                old.append(self._cursors.pop(next(iter(self._cursors))))
        for c in old:
            c.snap.close()
        return cid

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [cid for cid, c in self._cursors.items() if c.expires <= now]
            dead = [self._cursors.pop(cid) for cid in gone]
        for c in dead:
            c.snap.close()

    def close(self) -> None:
        with self._lock:
            dead, self._cursors = list(self._cursors.values()), {}
        for c in dead:
            c.snap.close()

    def __len__(self) -> int:
        return len(self._cursors)


def _token(cid: int, lo: bytes, hi: bytes | None) -> str:
    doc = {"c": cid, "lo": base64.b64encode(lo).decode(),
           "hi": None if hi is None else base64.b64encode(hi).decode()}
    return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()


def _untoken(token: str) -> tuple[int, bytes, bytes | None]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
        lo = base64.b64decode(doc["lo"], validate=True)
        hi = None if doc["hi"] is None else base64.b64decode(doc["hi"], validate=True)
        return int(doc["c"]), lo, hi
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeEncodeError):
        raise _BadRequest(400, "token: not a continuation token of this server") from None


def _scan_range(q: Mapping[str, str]) -> tuple[bytes, bytes | None]:
    """[lo, hi) of user keys from prefix, start (inclusive) and stop (exclusive)."""
    from .map import _successor
    prefix, start, stop = (_key_param(q, "prefix", False), _key_param(q, "start", False),
                           _key_param(q, "stop", False))
    lo, hi = start or b"", stop
    if prefix is not None:
        lo = max(lo, prefix)
        end = _successor(prefix)
        hi = end if hi is None else (min(hi, end) if end is not None else hi)
    return lo, hi


class ReadAPI:
    """The HTTP read API over a map held by this process (docs/formats/kv-http.md).

    ``tokens``: the bearer tokens accepted (None: no token asked, for a loopback listener).
    """

    def __init__(self, kvmap: KVMap, tokens: list[bytes] | None, ops: Ops | None = None,
                 workers: int = 4, named: Any = None):
        self.map, self.tokens = kvmap, tokens
        #: --tokens-file (kcompact.replication.tokens.TokenSet): a token must allow the topic
        self.named = named
        self.cursors = ScanCursors()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcompact-kv")
        self.requests: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        if ops is not None:
            ops.add(self._metrics)

    def _metrics(self) -> Iterable:
        c = counter("kv_http_requests", "Requests to the map's read API by route and status.",
                    ["route", "code"])
        with self._lock:
            items = sorted(self.requests.items())
        for (route, code), n in items:
            c.add_metric([route, str(code)], n)
        yield c
        g = gauge("kv_scan_cursors", "Scan snapshots held for continuation tokens.")
        g.add_metric([], len(self.cursors))
        yield g

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[track_requests])
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _app) -> None:
        self.cursors.close()
        self.pool.shutdown(wait=True)

    def _headers(self) -> dict[str, str]:
        h = {"X-Kcompact-Topic": self.map.topic, "Cache-Control": "no-store"}
        if self.map.building:
            h["X-Kcompact-Building"] = "1"
        return h

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        try:
            resp = await self._answer(request)
        except _BadRequest as e:
            resp = _error(e.status, str(e))
        except KVError as e:
            resp = _error(500, str(e))
        with self._lock:
            key = (route if route in ROUTES else "other", resp.status)
            self.requests[key] = self.requests.get(key, 0) + 1
        return resp

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.named is not None:
            header = request.headers.get("Authorization")
            if not any(check_token(header, t) == 0 for t in self.tokens or ()):
                status, tok = self.named.find(header)
                if status == 401:
                    return _error(401, "no bearer token: send 'Authorization: Bearer <token>'",
                                  {"WWW-Authenticate": 'Bearer realm="kcompact"'})
                if tok is None:
                    return _error(403, "wrong bearer token")
                if not tok.allows(self.map.topic):
                    return _error(403, f"token {tok.name} may not read topic "
                                       f"{self.map.topic} (it may read "
                                       f"{', '.join(tok.patterns)})")
        elif self.tokens is not None:
            header = request.headers.get("Authorization")
            codes = {check_token(header, t) for t in self.tokens}
            if 0 not in codes:
                if 401 in codes:
                    return _error(401, "no bearer token: send 'Authorization: Bearer <token>'",
                                  {"WWW-Authenticate": 'Bearer realm="kcompact"'})
                return _error(403, "wrong bearer token")
        method = request.method
        path = request.path
        if path == "/v1/get" and method == "POST":
            return await self._multi_get(request)
        if path not in ROUTES:
            return _error(404, f"no such path {path[:200]!r}; the API: /v1/get, /v1/raw, "
                          "/v1/scan, /v1/offsets")
        if method not in ("GET", "HEAD"):
            allow = "GET, HEAD, POST" if path == "/v1/get" else "GET, HEAD"
            return _error(405, f"method {method} not allowed on {path}", {"Allow": allow})
        if request.body_exists:
            resp = _error(413, "GET requests carry no body (a multi-get is a POST to /v1/get)")
            resp.force_close()
            return resp
        q = request.query
        if path == "/v1/get":
            key = _key_param(q, "key")
            return web.json_response(_item(key, self.map.get(key)), headers=self._headers())
        if path == "/v1/raw":
            key = _key_param(q, "key")
            value = self.map.get(key)
            h = self._headers()
            if value is None:
                h["X-Kcompact-Found"] = "0"
                return _error(404, "key not found", h)
            return web.Response(body=value, content_type="application/octet-stream", headers=h)
        if path == "/v1/offsets":
            doc = await self._run(self._offsets_doc)
            return web.json_response(doc, headers=self._headers())
        return await self._scan(q)

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _offsets_doc(self) -> dict[str, Any]:
        with self.map.snapshot() as s:
            return {"topic": self.map.topic, "offsets": _offsets(s), "keys": len(s),
                    "building": s.building, "caught_up_ms": self.map.caught_up_ms(),
                    "source": self.map.source}

    async def _multi_get(self, request: web.Request) -> web.Response:
        try:
            doc = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest(400, "the body must be a JSON object {\"keys\": [...]} or "
                              "{\"keys_b64\": [...]}") from None
        if not isinstance(doc, dict) or not set(doc) <= {"keys", "keys_b64"}:
            raise _BadRequest(400, "the body must be a JSON object with keys and/or keys_b64")
        texts, b64s = doc.get("keys", []), doc.get("keys_b64", [])
        if (not isinstance(texts, list) or not isinstance(b64s, list)
                or not all(isinstance(k, str) for k in texts + b64s)):
            raise _BadRequest(400, "keys and keys_b64 are lists of strings")
        if len(texts) + len(b64s) > MAX_KEYS:
            raise _BadRequest(413, f"more than {MAX_KEYS} keys in one request")
        keys = [k.encode("utf-8") for k in texts] + [_b64(k, "keys_b64") for k in b64s]

        def read() -> dict[str, Any]:
            with self.map.snapshot() as s:
                return {"results": [_item(k, s.get(k)) for k in keys], "offsets": _offsets(s)}
        return web.json_response(await self._run(read), headers=self._headers())

    async def _scan(self, q: Mapping[str, str]) -> web.Response:
        try:
            limit = int(q.get("limit", DEFAULT_LIMIT))
        except ValueError:
            raise _BadRequest(400, f"limit: {q.get('limit')!r} is not a number") from None
        if not 1 <= limit <= MAX_KEYS:
            raise _BadRequest(400, f"limit: use 1 to {MAX_KEYS}")
        keys_only = q.get("keys_only", "0") in ("1", "true")
        token = q.get("token")
        if token is not None:
            if any(k in q for k in ("prefix", "prefix_b64", "start", "start_b64", "stop",
                                    "stop_b64")):
                raise _BadRequest(400, "a continuation token carries the scan's range: send "
                                  "token and limit only")
            cid, lo, hi = _untoken(token)
            cur = self.cursors.take(cid)
            if cur is None:
                raise _BadRequest(410, f"the scan's snapshot expired (it is kept {CURSOR_TTL_S:g}"
                                  " s after a page); start the scan again")
        else:
            lo, hi = _scan_range(q)
            cur = None
        self.cursors.expire()
        if cur is None:
            cur = _Cursor(await self._run(self.map.snapshot))

        def page() -> tuple[list, bool, bytes | None, dict]:
            out, nxt = [], None
            it = cur.snap.items(start=lo, stop=hi) if not keys_only else \
                cur.snap.keys(start=lo, stop=hi)
            for i, row in enumerate(it):
                if i == limit:
                    nxt = row[0] if not keys_only else row
                    break
                out.append(row)
            return out, nxt is not None, nxt, _offsets(cur.snap)

        try:
            rows, more, nxt, offs = await self._run(page)
        except BaseException:
            cur.snap.close()
            raise
        items = []
        for row in rows:
            d: dict[str, Any] = {}
            if keys_only:
                text_or_b64("key", row, d)
            else:
                text_or_b64("key", row[0], d)
                text_or_b64("value", row[1], d)
            items.append(d)
        doc: dict[str, Any] = {"items": items, "next": None, "offsets": offs}
        if more:
            doc["next"] = _token(self.cursors.put(cur), nxt, hi)
        else:
            cur.snap.close()
        return web.json_response(doc, headers=self._headers())


ROUTES = ("/v1/get", "/v1/raw", "/v1/scan", "/v1/offsets")


def kv_metrics(ops: Ops, kvmap: KVMap, store: str, topic: str, builder: Any,
               bootstrap_servers: str | None, kafka_config: Mapping[str, str]) -> None:
    """The map's metrics and health on ``ops``: applied offsets, lag against the source (the
    store, or the Kafka topic's high watermarks), keys, when it last caught up; a Kafka
    source unreachable for longer than the timeout makes /healthz fail."""
    kafka = Unreachable("the Kafka cluster at " + str(bootstrap_servers))
    state: dict[str, Any] = {}

    def ends(parts: list[int]) -> dict[int, int]:
        if bootstrap_servers:
            from confluent_kafka import Consumer, KafkaException, TopicPartition
            c = state.get("consumer")
            if c is None:
                conf = {"bootstrap.servers": bootstrap_servers, "group.id": "kcompact-kv-lag",
                        "enable.auto.commit": False, "logger": _quiet_logger(),
                        "error_cb": lambda _e: None}
                conf.update({k: v for k, v in kafka_config.items()
                             if k not in ("group.id", "enable.auto.commit")})
                c = state["consumer"] = Consumer(conf)
            out = {}
            try:
                for p in parts:
                    _lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
                    out[p] = hi
                kafka.up()
            except KafkaException as e:
                kafka.down(str(e.args[0].str() if e.args else e))
            return out
        from kcompact.reput import ReputError, Store
        s = state.get("store")
        try:
            if s is None:
                s = state["store"] = Store.open(store)
            return {p: s.next_offset(topic, p) for p in s.partitions(topic)}
        except (ReputError, OSError):
            return {}

    def collect() -> Iterable:
        with kvmap.snapshot() as snap:
            offs, keys, building = snap.offsets(), len(snap), snap.building
        top = [topic]
        g = gauge("kv_applied_offset", "The map's next offset to apply per partition (every "
                  "record below it is in the map).", ["topic", "partition"])
        for p, o in sorted(offs.items()):
            g.add_metric([topic, str(p)], o)
        yield g
        end = ends(sorted(offs))
        lag = gauge("kv_lag_records", "The source's end offset minus the map's next offset "
                    "(the store's, or the Kafka topic's with --bootstrap-servers).",
                    ["topic", "partition"])
        for p, e in sorted(end.items()):
            lag.add_metric([topic, str(p)], max(0, e - offs.get(p, 0)))
        yield lag
        k = gauge("kv_keys", "Live keys in the map.", ["topic"])
        k.add_metric(top, keys)
        yield k
        b = gauge("kv_building", "1 while the map's bulk build is unfinished.", ["topic"])
        b.add_metric(top, int(building))
        yield b
        cu = kvmap.caught_up_ms()
        if cu is not None:
            c = gauge("kv_caught_up_timestamp_seconds", "When the map last held everything its "
                      "source had (written at most every 10 s).", ["topic"])
            c.add_metric(top, cu / 1000)
            yield c
        a = counter("kv_applied_records", "Records applied while catching up or following "
                    "(the bulk build's are in kv_keys).", ["topic"])
        a.add_metric(top, builder.report.get("applied_records", 0))
        yield a

    ops.add(collect)
    ops.check(kafka.check)

    def close() -> None:
        c, s = state.pop("consumer", None), state.pop("store", None)
        if c is not None:
            c.close()
        if s is not None:
            s.close()
    ops.on_close(close)


def _quiet_logger():
    from ...framework.kafka_clients import kafka_logger
    return kafka_logger()


@dataclass(frozen=True)
class KVServeOptions:
    """``kcompact kv serve``'s options (``kv build --follow`` runs the same with ``listen``
    None: a free loopback port, a token of its own)."""

    store: str
    topic: str
    db: str
    listen: str | None = None
    token_file: str | None = None
    tokens_file: str | None = None      # named tokens limited to topics
    bootstrap_servers: str | None = None
    kafka_config: Mapping[str, str] = field(default_factory=dict)
    metrics: str | None = None          # --metrics HOST:PORT
    max_connections: int | None = None
    client_timeout_s: float | None = None
    command: str = "kv serve"

    def limits(self) -> ServerLimits:
        return ServerLimits.per_client(self.max_connections, self.client_timeout_s)


def _tokens(opts: KVServeOptions, local: bytes) -> list[bytes] | None:
    """The tokens the read API accepts: the operator's and the address file's; none asked for a
    ``kv serve`` on loopback without --token-file."""
    if opts.listen is None:
        return [local]
    host, _ = parse_listen(opts.listen)
    if opts.token_file:
        return [read_token_file(opts.token_file), local]
    if opts.tokens_file:
        return [local]
    if not is_loopback(host):
        raise ReplicationError(f"--listen {opts.listen}: a map served beyond this machine needs "
                               "--token-file F (its bearer token); without one, listen on "
                               "127.0.0.1 or ::1")
    return None


def follow_and_serve(opts: KVServeOptions) -> int:
    """Follow the map's source and answer reads until SIGINT/SIGTERM (0, or 130 after SIGINT
    before the bulk build finished); the follower's failure is raised."""
    prefix = opts.command
    say = lambda m: print(f"{prefix}: {m}", file=sys.stderr, flush=True)  # noqa: E731
    check_listen(opts.metrics)
    local = secrets.token_hex(32).encode()
    tokens = _tokens(opts, local)
    named = None
    if opts.tokens_file:
        from kcompact.replication.tokens import read_tokens_file
        named = read_tokens_file(opts.tokens_file)
    limits = opts.limits()
    stop = threading.Event()
    try:
        m = KVMap(opts.db, create=True)
    except KVLockedError:
        raise KVLockedError(f"{opts.db} is open in another process (a running `kcompact kv "
                            "serve` or `kv build --follow`?): one follower per map") from None
    ops = Ops(prefix)
    api = ReadAPI(m, tokens, ops, named=named)
    builder = m.builder(opts.store, opts.topic, bootstrap_servers=opts.bootstrap_servers,
                        kafka_config=opts.kafka_config, progress=say)
    kv_metrics(ops, m, opts.store, opts.topic, builder, opts.bootstrap_servers,
               opts.kafka_config)
    reader = AppThread(api.app, opts.listen or "127.0.0.1:0", limits=limits,
                       name="kcompact-kv-read", command=prefix)
    previous = {}
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        if not received:
            say(f"{signal.Signals(signum).name}: finishing the current batch")
        received.append(signum)
        stop.set()

    address = None
    metrics = None
    try:
        url = reader.start()
        address = FollowerAddress(url=local_url(url), token=local.decode(),
                                  pid=os.getpid(), command=prefix)
        address.write(opts.db)
        if opts.listen is not None:
            say(f"serving reads of {opts.db} on {url}"
                + ("" if tokens is not None else " (no token: loopback only)"))
        else:
            say(f"reads of {opts.db} answered on {url} for `kcompact kv get` (this machine)")
        metrics = start_ops(ops, opts.metrics, say)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        rep = builder.run(follow=True, stop=stop)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        if address is not None:
            address.remove(opts.db)
        reader.stop()
        if metrics is not None:
            metrics.stop()
        ops.close()
        m.close()
    offsets = ", ".join(f"{p}:{o}" for p, o in rep["offsets"].items())
    print(f"{opts.db}: {rep['keys']:,} keys of topic {opts.topic!r}, next offsets "
          f"{{{offsets}}}, {rep['seconds']:.2f}s")
    if rep["interrupted"]:
        say("interrupted before the bulk build finished; run the same command to resume")
        return 130
    return 0
