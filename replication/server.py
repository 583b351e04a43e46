"""`kcompact serve`: the master side of replication, an aiohttp server over a store.

Protocol: docs/formats/replication-protocol.md (paths, headers and bodies in protocol.py).

The store is opened read-only (``Store.open(url)``), so the server runs next to the mirror and
the compactor that keep writing it: every request re-lists the partition's segments, record
reads are CRC-checked and retried across a compaction swap (the partition reader's raw ranges,
reput/reader.py: the records are sent as the store holds them), and a live
computation restarts if a swap happened under it. Blocking store work runs in a thread pool;
the event loop only parses requests and moves bytes. Every path a request can name goes through
``kcompact.reput.filenames`` (topic validated by Kafka's rule, partition an integer) and the store's
backend, which refuses anything outside the store root.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from kcompact.reput import swap
from kcompact.reput.errors import CorruptRecordError, ReputError
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import BufferPool, PartitionReader, warm_up
from kcompact.reput.store import Store, StoreMeta
from kcompact.reput import filenames as fn

from .errors import ReplicationError, RequestError
from .live import digest_frames, live_offsets
from .protocol import (CT_BITMAP, CT_DIGESTS, CT_RECORDS, END_FRAME, H_HIGH_WATERMARK,
                       H_LIVE_COUNT, H_NEXT_OFFSET, H_PROTOCOL, H_RECORD_COUNT, H_STORE_ID,
                       H_UPTO, PROTOCOL_VERSION, Route, ServerLimits, check_token, parse_path,
                       parse_query, read_token_file)


#: transport write buffer high-water mark for records responses (per connection)
WRITE_BUFFER_HIGH = 16 << 20


class MasterStore:
    """Thread-safe, read-only access to the served store (all blocking calls)."""

    def __init__(self, url: str, limits: ServerLimits):
        self.store = Store.open(url)
        self.fs = self.store.fs
        self.limits = limits
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], tuple[threading.Lock, PartitionLog]] = {}
        self._live_cache: OrderedDict = OrderedDict()
        self.buffers = BufferPool()

    @property
    def store_id(self) -> str:
        return self.store.meta.store_id

    def meta(self) -> StoreMeta:
        return StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)

    def has_partition(self, topic: str, partition: int | None = None) -> bool:
        if partition is None:
            return topic in self.store.topics()
        return partition in self.store.partitions(topic)

    def _part(self, topic: str, partition: int) -> tuple[threading.Lock, PartitionLog]:
        with self._lock:
            got = self._parts.get((topic, partition))
            if got is None:
                pl = PartitionLog(self.fs, topic, partition, self.store.secret,
                                  self.store.topic_config(topic))
                got = self._parts[(topic, partition)] = (threading.Lock(), pl)
            return got

    def partition_info(self, topic: str, partition: int) -> dict[str, Any]:
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            cleaned, _ = swap.read_checkpoint(self.fs, pl.dir)
            return {"partition": partition, "first_offset": pl.first_offset,
                    "next_offset": pl.next_offset, "compaction_horizon": cleaned,
                    "segments": len(pl.segments), "bytes": pl.size_bytes()}

    def topic_doc(self, topic: str, meta: StoreMeta) -> dict[str, Any]:
        from kcompact.reput.config import TopicConfig
        return {"topic": topic, "config": TopicConfig.from_dict(meta.topics.get(topic)).to_dict(),
                "partitions": [self.partition_info(topic, p)
                               for p in self.store.partitions(topic)]}

    def store_doc(self) -> dict[str, Any]:
        meta = self.meta()
        return {"protocol": PROTOCOL_VERSION, "store_id": meta.store_id,
                "format_version": meta.format_version, "limits": self.limits.to_dict(),
                "topics": [self.topic_doc(t, meta) for t in self.store.topics()]}

    def read(self, topic: str, partition: int, from_offset: int, max_bytes: int):
        """(buffer or None, nbytes, record count, next offset, high watermark); the caller gives
        the buffer back to ``self.buffers`` once it is sent (``PartitionReader.read_raw``)."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            r = PartitionReader(pl).read_raw(from_offset, max_bytes, self.buffers)
            return r.buf, r.nbytes, r.count, r.next_offset, pl.next_offset

    def locate(self, topic: str, partition: int, from_offset: int, max_bytes: int):
        """(Located or None, next offset, high watermark): the zero-copy twin of ``read``."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            loc = PartitionReader(pl).locate(from_offset, max_bytes)
            nxt = loc.next_offset if loc is not None else max(from_offset, pl.next_offset)
            return loc, nxt, pl.next_offset

    @property
    def local(self) -> bool:
        """A store in a local directory: its .log files can be sent with sendfile."""
        return self.fs.local_path(fn.STORE_JSON) is not None

    def live(self, topic: str, partition: int, upto: int | None):
        """(BitMap64 of live offsets, upto), cached while the segments stay the same."""
        pl = PartitionLog(self.fs, topic, partition, self.store.secret)
        if upto is None:
            upto = pl.next_offset
        sig = tuple((s.base, s.log_size, s.index_size) for s in pl.segments)
        key = (topic, partition, upto, sig)
        with self._lock:
            hit = self._live_cache.get(key)
        if hit is not None:
            return hit, upto, pl
        bm, upto = live_offsets(pl, upto, self.limits.live_map_memory)
        with self._lock:
            self._live_cache[key] = bm
            while len(self._live_cache) > 8:
                self._live_cache.popitem(last=False)
        return bm, upto, pl


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", headers=headers,
                        text=json.dumps({"error": message, "status": status}) + "\n")


class Server:
    def __init__(self, master: MasterStore, token: bytes, limits: ServerLimits = ServerLimits(),
                 workers: int = 8, zero_copy: bool = True):
        self.master, self.token, self.limits = master, token, limits
        # sendfile needs a local store and a plain TCP transport (no TLS)
        self.zero_copy = zero_copy and master.local
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcompact-serve")
        self._summaries = asyncio.Semaphore(limits.max_summaries)
        self.app = web.Application(client_max_size=1024)
        self.app.router.add_route("*", "/{tail:.*}", self.dispatch)

    async def _run(self, fn_: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn_, *args)

    def _headers(self, extra: dict | None = None) -> dict:
        h = {H_PROTOCOL: str(PROTOCOL_VERSION), H_STORE_ID: self.master.store_id,
             "Cache-Control": "no-store"}
        if extra:
            h.update({k: str(v) for k, v in extra.items()})
        return h

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        if len(request.raw_path) > self.limits.max_url_bytes:
            return _error(414, f"request target longer than {self.limits.max_url_bytes} bytes")
        status = check_token(request.headers.get("Authorization"), self.token)
        if status == 401:
            return _error(401, "no bearer token: send 'Authorization: Bearer <token>'",
                          {"WWW-Authenticate": 'Bearer realm="kcompact"'})
        if status == 403:
            return _error(403, "wrong bearer token")
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"method {request.method} not allowed; use GET",
                          {"Allow": "GET, HEAD"})
        if request.body_exists:
            return _error(413, "requests carry no body")
        try:
            route = parse_path(request.raw_path)
            params = {k: v for k, v in request.query.items()}
            multi = {k: len(request.query.getall(k)) for k in request.query.keys()}
            q = parse_query(route.kind, params, self.limits, multi)
            return await self._handle(request, route, q)
        except RequestError as e:
            return _error(e.status, str(e))
        except CorruptRecordError as e:
            return _error(500, f"the master cannot serve this: {e}")
        except (ReputError, OSError) as e:
            return _error(500, f"store error: {e}")

    async def _check_exists(self, route: Route) -> None:
        exists = await self._run(self.master.has_partition, route.topic, route.partition)
        if not exists:
            what = (f"topic {route.topic!r}" if route.partition is None
                    else f"partition {route.topic}-{route.partition}")
            raise RequestError(404, f"{what} is not in this store")

    async def _handle(self, request: web.Request, route: Route, q) -> web.StreamResponse:
        if route.kind == "store":
            doc = await self._run(self.master.store_doc)
            return web.json_response(doc, headers=self._headers())
        if route.kind == "topics":
            doc = await self._run(self.master.store_doc)
            return web.json_response({"topics": [t["topic"] for t in doc["topics"]]},
                                     headers=self._headers())
        await self._check_exists(route)
        if route.kind == "topic":
            meta = await self._run(self.master.meta)
            doc = await self._run(self.master.topic_doc, route.topic, meta)
            return web.json_response(doc, headers=self._headers())
        if route.kind == "partition":
            doc = await self._run(self.master.partition_info, route.topic, route.partition)
            return web.json_response(doc, headers=self._headers())
        if route.kind == "records":
            return await self._records(request, route, q)
        if self._summaries.locked():
            return _error(503, "busy: too many live/digests computations at once; retry",
                          {"Retry-After": "1"})
        async with self._summaries:
            if route.kind == "live":
                return await self._live(route, q)
            return await self._digests(request, route, q)

    async def _records(self, request: web.Request, route: Route, q) -> web.StreamResponse:
        if self.zero_copy and not q.check:
            return await self._records_sendfile(request, route, q)
        deadline = time.monotonic() + q.wait_ms / 1000
        while True:
            buf, nbytes, count, nxt, hwm = await self._run(
                self.master.read, route.topic, route.partition, q.from_offset, q.max_bytes)
            left = deadline - time.monotonic()
            if count or left <= 0:
                break
            await asyncio.sleep(min(0.1, left))
        resp = web.StreamResponse(status=200, headers=self._headers({
            H_NEXT_OFFSET: nxt, H_RECORD_COUNT: count, H_HIGH_WATERMARK: hwm,
            "Content-Length": nbytes}))
        resp.content_type = CT_RECORDS
        try:
            if request.transport is not None:
                # let a whole response sit in the transport's buffer: with asyncio's default
                # 64 KiB high-water mark, every 64 KiB waits for the replica to catch up
                request.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
            await resp.prepare(request)
            if buf is not None:
                mv = memoryview(buf)[:nbytes]
                for i in range(0, nbytes, 1 << 20):
                    await resp.write(mv[i:i + (1 << 20)])
            await resp.write_eof()
        finally:
            if buf is not None:
                self.master.buffers.give(buf)
        return resp

    async def _records_sendfile(self, request: web.Request, route: Route, q
                                ) -> web.StreamResponse:
        deadline = time.monotonic() + q.wait_ms / 1000
        while True:
            loc, nxt, hwm = await self._run(
                self.master.locate, route.topic, route.partition, q.from_offset, q.max_bytes)
            left = deadline - time.monotonic()
            if loc is not None or left <= 0:
                break
            await asyncio.sleep(min(0.1, left))
        count, nbytes = (loc.count, loc.nbytes) if loc is not None else (0, 0)
        resp = web.StreamResponse(status=200, headers=self._headers({
            H_NEXT_OFFSET: nxt, H_RECORD_COUNT: count, H_HIGH_WATERMARK: hwm,
            "Content-Length": nbytes}))
        resp.content_type = CT_RECORDS
        try:
            await resp.prepare(request)  # sends the headers at once (StreamResponse)
            if loc is not None:
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("connection lost")
                with os.fdopen(os.dup(loc.fd), "rb", buffering=0) as f:
                    await asyncio.get_running_loop().sendfile(transport, f, loc.start,
                                                              loc.nbytes, fallback=True)
            await resp.write_eof()
        finally:
            if loc is not None:
                loc.close()
        return resp

    async def _live(self, route: Route, q) -> web.Response:
        bm, upto, _ = await self._run(self.master.live, route.topic, route.partition, q.upto)
        body = await self._run(bm.serialize)
        return web.Response(body=body, content_type=CT_BITMAP, headers=self._headers({
            H_UPTO: upto, H_LIVE_COUNT: len(bm)}))

    async def _digests(self, request: web.Request, route: Route, q) -> web.StreamResponse:
        bm, upto, pl = await self._run(self.master.live, route.topic, route.partition, q.upto)
        resp = web.StreamResponse(status=200, headers=self._headers({
            H_UPTO: upto, H_LIVE_COUNT: len(bm)}))
        resp.content_type = CT_DIGESTS
        await resp.prepare(request)
        gen = digest_frames(pl, bm, upto, q.salt)
        while True:
            # an error here cuts the body short: the client sees no end frame and fails
            frame = await self._run(next, gen, None)
            if frame is None:
                break
            await resp.write(frame)
        await resp.write(END_FRAME)
        await resp.write_eof()
        return resp


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise ReplicationError("TLS needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ReplicationError(f"cannot load TLS certificate {cert} / key {key}: {e}") from None
    return ctx


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ReplicationError(f"--listen {text!r}: use HOST:PORT, e.g. 127.0.0.1:8470 "
                               "(port 0 picks a free one)")
    return host, int(port)


async def run_server(store_url: str, listen: str, token: bytes, *,
                     ssl_context: ssl.SSLContext | None = None,
                     limits: ServerLimits = ServerLimits(),
                     ready: Callable[[str], None] | None = None,
                     stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None)."""
    host, port = parse_listen(listen)
    try:
        master = MasterStore(store_url, limits)
    except ReputError as e:
        raise ReplicationError(f"cannot serve {store_url}: {e}") from None
    server = Server(master, token, limits, zero_copy=ssl_context is None)
    await asyncio.get_running_loop().run_in_executor(server.pool, warm_up)
    runner = web.AppRunner(server.app, access_log=None, max_line_size=limits.max_url_bytes + 64,
                           handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, shutdown_timeout=5.0)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ReplicationError(f"cannot listen on {listen}: {e.strerror or e}") from None
    loop = asyncio.get_running_loop()
    own_stop = stop is None
    stop = stop or asyncio.Event()
    if own_stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if ssl_context else 'http'}://{shown}:{bound}"
    if ready:
        ready(url)
    try:
        await stop.wait()
    finally:
        if own_stop:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
        server.pool.shutdown(wait=False, cancel_futures=True)
        master.store.close()


@dataclass(frozen=True)
class ServeOptions:
    """``kcompact serve``'s options."""

    store: str
    listen: str                      # HOST:PORT
    token_file: str
    tls_cert: str | None = None
    tls_key: str | None = None


def serve(opts: ServeOptions) -> int:
    """`kcompact serve --store URL --listen HOST:PORT --token-file F [--tls-cert C --tls-key K]`."""
    token = read_token_file(opts.token_file)
    ctx = tls_context(opts.tls_cert, opts.tls_key)

    def ready(url: str) -> None:
        print(f"kcompact serve: serving {opts.store} on {url} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)

    asyncio.run(run_server(opts.store, opts.listen, token, ssl_context=ctx, ready=ready))
    print("kcompact serve: stopped", file=sys.stderr, flush=True)
    return 0
