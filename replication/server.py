"""`kcompact serve`: the master side of replication, an aiohttp server over a store.

Protocol: docs/formats/replication-protocol.md (paths, headers and bodies in protocol.py). The
store side (read-only access, symlink refusal, the live-record cache) is master_store.py.

The store is opened read-only (``Store.open(url)``), so the server runs next to the mirror and
the compactor that keep writing it: every request re-lists the partition's segments, record
reads are CRC-checked and retried across a compaction swap (the partition reader's raw ranges,
reput/reader.py: the records are sent as the store holds them), and a live
computation restarts if a swap happened under it. Blocking store work runs in a thread pool;
the event loop only parses requests and moves bytes. Every path a request can name goes through
``kcompact.reput.filenames`` (topic validated by Kafka's rule, partition an integer) and the store's
backend, which refuses anything outside the store root; and since a directory or file of a local
store can be a symlink, the root is resolved once and a topic or partition any of whose paths
resolves outside it is not served (404, one log line), nor listed.

Against bad clients (limits in ``ServerLimits``): every connection goes through
``connections.Connections`` (the connection limit, the request timeout, one-line logging), and a
response being sent must make progress within ``client_timeout_s`` (``Server._send``).

A failure after a response's status line was sent can no longer be a 500: a digests body then ends
with an error frame (protocol.py, the JSON document a 500 would carry), and a records body, whose
length is in its headers, is cut by closing the connection, so the client asks again with
``check=1`` and gets the 500. The handler then returns the response it prepared: a second response
would be written into the first one's body (the hang of issue 26).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from kcompact.reput.env import debug as env_debug
from kcompact.reput.errors import CorruptRecordError, ReputError
from kcompact.reput.reader import Located, warm_up
from kcompact.reput import filenames as fn

from .connections import (Connections, Listening, describe, log, parse_listen, peer,
                          serve_until, setup_log)
from .errors import ReplicationError, RequestError
from .live import digest_frames
from .master_store import MasterStore
from .protocol import (CT_BITMAP, CT_DIGESTS, CT_RECORDS, CT_SEGMENT_FILE, END_FRAME,
                       H_FILE_SIZE, H_HIGH_WATERMARK, H_LIVE_COUNT, H_NEXT_OFFSET, H_PROTOCOL,
                       H_RECORD_COUNT, H_SEGMENT_ID, H_STORE_ID, H_UPTO, PROTOCOL_VERSION,
                       PROTOCOL_VERSIONS, SEGMENTS_VERSION, Route, ServerLimits, check_token,
                       error_doc, error_frame, parse_path, parse_query, read_token_file,
                       serve_protocols)


#: transport write buffer high-water mark for records responses (per connection)
WRITE_BUFFER_HIGH = 16 << 20
#: a records range is handed to sendfile in slices of this size: a client that takes less than
#: one slice in client_timeout_s is disconnected (sendfile shows no progress until it returns).
#: One slice is a whole default-sized request: 1 MiB slices cost ~4x the event-loop turns and
#: ~45% more of the server's CPU on a pull (cProfile, bench master of 512 MiB)
SEND_SLICE = 8 << 20


def _error(status: int, message: str, headers: dict | None = None, *, path: str | None = None,
           position: int | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", headers=headers,
                        text=json.dumps(error_doc(status, message, path, position)) + "\n")


def _failure(e: Exception) -> dict:
    """The error document (500) of a failure of the store or of the server itself."""
    if isinstance(e, CorruptRecordError):
        return error_doc(500, f"the master's store is damaged: {e}", e.path, e.position)
    if isinstance(e, (ReputError, OSError)):
        return error_doc(500, f"store error: {e}")
    return error_doc(500, f"internal error: {describe(e)}")


class _Gone(Exception):
    """The connection of a response already started was closed (the client left or stalled)."""

    def __init__(self, resp: web.StreamResponse):
        super().__init__()
        self.resp = resp


class Server:
    def __init__(self, master: MasterStore, token: bytes | None,
                 limits: ServerLimits = ServerLimits(), workers: int = 8,
                 zero_copy: bool = True, tokens: Any = None):
        self.master, self.token, self.limits = master, token, limits
        #: --tokens-file (tokens.TokenSet): named tokens limited to topic patterns
        self.tokens = tokens
        # sendfile needs a local store and a plain TCP transport (no TLS)
        self.zero_copy = zero_copy and master.local
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcompact-serve")
        self._summaries = asyncio.Semaphore(limits.max_summaries)
        self.connections: Connections | None = None  # set by run_server
        self.sent: dict[tuple[str, int], int] = {}  # records bytes per partition (metrics)
        self.app = web.Application(client_max_size=1024)
        self.app.router.add_route("*", "/{tail:.*}", self.dispatch)

    def collect(self):
        """Metric families (replication/ops.py): records bytes sent per partition, client
        connections open and refused."""
        from .ops import counter, gauge
        sent = counter("serve_sent_bytes", "Records bytes sent to replicas.",
                       ["topic", "partition"])
        for (t, p), n in sorted(self.sent.items()):
            sent.add_metric([t, str(p)], n)
        yield sent
        conns = self.connections
        c = gauge("serve_connections", "Client connections open.")
        c.add_metric([], len(conns.open) if conns is not None else 0)
        yield c

    def _count_sent(self, route: Route, nbytes: int) -> None:
        key = (route.topic, route.partition)
        self.sent[key] = self.sent.get(key, 0) + nbytes

    async def _run(self, fn_: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn_, *args)

    def _headers(self, extra: dict | None = None, version: int = PROTOCOL_VERSION) -> dict:
        h = {H_PROTOCOL: str(version), H_STORE_ID: self.master.store_id,
             "Cache-Control": "no-store"}
        if extra:
            h.update({k: str(v) for k, v in extra.items()})
        return h

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        conn = self.connections.of(request) if self.connections is not None else None
        if conn is not None:
            conn.request_started()
        try:
            return await self._answer(request)
        except _Gone as e:
            return e.resp  # prepared: aiohttp must not write a second response after it
        finally:
            if conn is not None:
                conn.request_done()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if len(request.raw_path) > self.limits.max_url_bytes:
            return _error(414, f"request target longer than {self.limits.max_url_bytes} bytes")
        tok = None
        if self.tokens is not None:
            status, tok = self.tokens.find(request.headers.get("Authorization"))
        else:
            status = check_token(request.headers.get("Authorization"), self.token or b"\0")
        if status == 401:
            return _error(401, "no bearer token: send 'Authorization: Bearer <token>'",
                          {"WWW-Authenticate": 'Bearer realm="kcompact"'})
        if status == 403:
            return _error(403, "wrong bearer token")
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"method {request.method} not allowed; use GET",
                          {"Allow": "GET, HEAD"})
        if request.body_exists:
            resp = _error(413, "requests carry no body")
            resp.force_close()  # the body is not read: do not wait for it
            return resp
        try:
            route = parse_path(request.raw_path)
            params = {k: v for k, v in request.query.items()}
            multi = {k: len(request.query.getall(k)) for k in request.query.keys()}
            q = parse_query(route.kind, params, self.limits, multi)
            if tok is not None and route.topic is not None and not tok.allows(route.topic):
                return _error(403, f"token {tok.name} may not read topic {route.topic} "
                                   f"(it may read {', '.join(tok.patterns)})")
            return await self._handle(request, route, q, tok)
        except RequestError as e:
            return _error(e.status, str(e))
        except _Gone:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a one-line 500, logged
            doc = _failure(e)
            self._log_failure(request, doc, e)
            return _error(500, doc["error"], path=doc.get("path"), position=doc.get("position"))

    @staticmethod
    def _log_failure(request: web.Request, doc: dict, e: Exception, what: str = "500") -> None:
        # the message has the error; an unexpected one's traceback only with KCOMPACT_DEBUG
        debug = env_debug()
        log.error("%s to %s for %s: %s", what, peer(request.transport), request.path_qs[:200],
                  doc["error"], exc_info=e if debug and not isinstance(e, ReputError) else None)

    async def _send(self, request: web.Request, resp: web.StreamResponse, aw):
        """Await one write of a response whose status line was sent. A client that takes no
        byte of it for client_timeout_s (while sendfile runs: not one slice) is disconnected,
        as is one that has gone: _Gone."""
        transport = request.transport
        task = asyncio.ensure_future(aw)
        try:
            if transport is None:
                raise ConnectionResetError("connection lost")
            last = transport.get_write_buffer_size()
            while True:
                done, _ = await asyncio.wait((task,), timeout=self.limits.client_timeout_s)
                if done:
                    return task.result()
                size = transport.get_write_buffer_size()
                if size >= last:
                    break
                last = size
        except ConnectionError:
            raise _Gone(resp) from None
        finally:
            if not task.done():
                task.cancel()
        log.warning("closed the connection of %s: it took no byte of its response for %gs",
                    peer(transport), self.limits.client_timeout_s)
        transport.abort()
        raise _Gone(resp)

    async def _check_exists(self, route: Route) -> None:
        why = await self._run(self.master.has_partition, route.topic, route.partition)
        if why:
            raise RequestError(404, why)

    async def _handle(self, request: web.Request, route: Route, q, tok: Any = None
                      ) -> web.StreamResponse:
        if route.kind == "store":
            doc = await self._run(self.master.store_doc)
            if tok is not None:  # a token limited to topics sees only those
                doc = {**doc, "topics": [t for t in doc.get("topics", [])
                                         if tok.allows(t["topic"])]}
            return web.json_response(doc, headers=self._headers())
        if route.kind == "topics":
            topics = await self._run(self.master.topics)
            if tok is not None:
                topics = [t for t in topics if tok.allows(t)]
            return web.json_response({"topics": topics}, headers=self._headers())
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
        if route.kind in ("segments", "segment_file"):
            if SEGMENTS_VERSION not in self.master.protocols:
                raise RequestError(404, f"this master serves replication protocol "
                                        f"{', '.join(map(str, self.master.protocols))} only: "
                                        "no segments resources")
            if route.kind == "segments":
                doc = await self._run(self.master.segments, route.topic, route.partition)
                return web.json_response(doc, headers=self._headers(version=SEGMENTS_VERSION))
            return await self._segment_file(request, route, q)
        if self._summaries.locked():
            return _error(503, "busy: too many live/digests computations at once; retry",
                          {"Retry-After": "1"})
        async with self._summaries:
            if route.kind == "live":
                return await self._live(route, q)
            return await self._digests(request, route, q)

    def _cut(self, request: web.Request, resp: web.StreamResponse, e: Exception) -> _Gone:
        """A records body that cannot be finished: its length is in the headers, so the only
        honest end is to close the connection short of it (the client asks again with check=1
        and gets the 500)."""
        self._log_failure(request, _failure(e), e, "records response cut")
        if request.transport is not None:
            request.transport.abort()
        return _Gone(resp)

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
        self._count_sent(route, nbytes)
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
            try:
                if buf is not None:
                    mv = memoryview(buf)[:nbytes]
                    for i in range(0, nbytes, 1 << 20):
                        piece = mv[i:i + (1 << 20)]
                        t = request.transport
                        if t is not None and (t.get_write_buffer_size() + len(piece)
                                              < WRITE_BUFFER_HIGH):
                            await resp.write(piece)  # below the high-water mark: cannot wait
                        else:
                            await self._send(request, resp, resp.write(piece))
                await self._send(request, resp, resp.write_eof())
            except _Gone:
                raise
            except ConnectionError:  # the client went away
                raise _Gone(resp) from None
            except Exception as e:  # noqa: BLE001 - after the status line: cut, logged
                raise self._cut(request, resp, e) from None
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
        self._count_sent(route, nbytes)
        resp = web.StreamResponse(status=200, headers=self._headers({
            H_NEXT_OFFSET: nxt, H_RECORD_COUNT: count, H_HIGH_WATERMARK: hwm,
            "Content-Length": nbytes}))
        resp.content_type = CT_RECORDS

        async def body():
            if loc is not None and loc.data is not None:  # a format-2 segment's, decoded
                await self._send(request, resp, resp.write(memoryview(loc.data)))
            elif loc is not None:
                await self._sendfile(request, resp, loc, route, "a range its index lists")
        try:
            await self._respond(request, resp, body)
        finally:
            if loc is not None:
                loc.close()
        return resp

    async def _respond(self, request: web.Request, resp: web.StreamResponse, body) -> None:
        """Send ``resp``'s headers at once (StreamResponse), then ``await body()``, then its end;
        a failure after the status line cuts the connection (``_cut``)."""
        await resp.prepare(request)
        try:
            await body()
            await self._send(request, resp, resp.write_eof())
        except _Gone:
            raise
        except Exception as e:  # noqa: BLE001 - after the status line: cut, logged
            raise self._cut(request, resp, e) from None

    async def _sendfile(self, request: web.Request, resp: web.StreamResponse, loc,
                        route: Route, what: str) -> None:
        """Send ``loc``'s range of its file with sendfile, a slice at a time (SEND_SLICE)."""
        transport = request.transport
        if transport is None:
            raise _Gone(resp)
        loop = asyncio.get_running_loop()
        with os.fdopen(os.dup(loc.fd), "rb", buffering=0) as f:
            pos, end = loc.start, loc.start + loc.nbytes
            while pos < end:
                n = min(SEND_SLICE, end - pos)
                sent = await self._send(request, resp, loop.sendfile(
                    transport, f, pos, n, fallback=True))
                if sent != n:  # the file ended early: cut under us
                    where = fn.partition_dir(route.topic, route.partition)
                    raise CorruptRecordError(
                        f"{where}: a file ended at byte {pos + sent} of {what}; run "
                        "`kcompact verify`")
                pos += n

    async def _segment_file(self, request: web.Request, route: Route, q
                            ) -> web.StreamResponse:
        """Version 2: a byte range of a sealed format-2 segment's .log or lean index, as
        stored (the replica checks every batch's CRC and the index's CRCs); from a local
        store with sendfile, as records are."""
        got, size = await self._run(self.master.segment_file, route.topic, route.partition,
                                    route.base, route.file, q.segment_id, q.from_offset,
                                    q.max_bytes, self.zero_copy)
        headers = self._headers({H_SEGMENT_ID: q.segment_id, H_FILE_SIZE: size},
                                version=SEGMENTS_VERSION)
        if not isinstance(got, Located):
            self._count_sent(route, len(got))
            return web.Response(body=got, content_type=CT_SEGMENT_FILE, headers=headers)
        try:
            self._count_sent(route, got.nbytes)
            headers["Content-Length"] = str(got.nbytes)
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_type = CT_SEGMENT_FILE
            await self._respond(request, resp, lambda: self._sendfile(
                request, resp, got, route, "a segment's listed size"))
        finally:
            got.close()
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
        try:
            while True:
                frame = await self._run(next, gen, None)
                if frame is None:
                    break
                await self._send(request, resp, resp.write(frame))
            tail = END_FRAME
        except _Gone:
            raise
        except Exception as e:  # noqa: BLE001 - after the status line: the error frame says it
            doc = _failure(e)
            self._log_failure(request, doc, e, "error frame")
            tail = error_frame(doc)
        await self._send(request, resp, resp.write(tail))
        await self._send(request, resp, resp.write_eof())
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


async def run_server(store_url: str, listen: str, token: bytes | None, *,
                     ssl_context: ssl.SSLContext | None = None,
                     limits: ServerLimits = ServerLimits(),
                     ready: Callable[[str], None] | None = None,
                     stop: asyncio.Event | None = None, ops: Any = None,
                     protocols: tuple[int, ...] = PROTOCOL_VERSIONS, tokens: Any = None
                     ) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None); ``ops``
    (replication/ops.py) gets the server's metrics; ``protocols``: the versions served
    (``KCOMPACT_SERVE_PROTOCOLS``, default all this kcompact speaks)."""
    parse_listen(listen)
    setup_log()
    try:
        master = MasterStore(store_url, limits, protocols)
    except ReputError as e:
        raise ReplicationError(f"cannot serve {store_url}: {e}") from None
    server = Server(master, token, limits, zero_copy=ssl_context is None, tokens=tokens)
    if ops is not None:
        ops.add(server.collect)
    try:
        await asyncio.get_running_loop().run_in_executor(server.pool, warm_up)
        listening = await Listening.open(server.app, listen, limits, ssl_context=ssl_context)
        server.connections = listening.connections
        if ready:
            ready(listening.url)
        try:
            await serve_until(stop, lambda ev: ev.wait())
        finally:
            await listening.close()
    finally:
        server.pool.shutdown(wait=False, cancel_futures=True)
        master.store.close()


@dataclass(frozen=True)
class ServeOptions:
    """``kcompact serve``'s options."""

    store: str
    listen: str                      # HOST:PORT
    token_file: str | None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_connections: int | None = None     # None: ServerLimits' default (256)
    client_timeout_s: float | None = None  # None: ServerLimits' default (30 s)
    metrics: str | None = None             # --metrics HOST:PORT
    tokens_file: str | None = None         # --tokens-file: named tokens, topic patterns

    def read_tokens(self) -> tuple[bytes | None, Any]:
        """(the --token-file token, the TokenSet of --tokens-file plus that token; None
        without --tokens-file)."""
        token = read_token_file(self.token_file) if self.token_file else None
        if not self.tokens_file:
            if token is None:
                raise ReplicationError("--listen needs --token-file F or --tokens-file F")
            return token, None
        from .tokens import TokenSet, read_tokens_file
        tokens = read_tokens_file(self.tokens_file)
        return token, tokens + TokenSet.single(token) if token is not None else tokens

    def limits(self) -> ServerLimits:
        """The server limits these options set (bounds checked there, one-line errors)."""
        return ServerLimits.per_client(self.max_connections, self.client_timeout_s)


def serve(opts: ServeOptions) -> int:
    """`kcompact serve --store URL --listen HOST:PORT --token-file F [--tls-cert C --tls-key K]
    [--max-connections N] [--client-timeout S]`."""
    token, tokens = opts.read_tokens()
    ctx = tls_context(opts.tls_cert, opts.tls_key)
    limits = opts.limits()
    protocols = serve_protocols()

    def ready(url: str) -> None:
        print(f"kcompact serve: serving {opts.store} on {url} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)

    from .ops import Ops, check_listen, start_ops
    check_listen(opts.metrics)
    ops = Ops("serve") if opts.metrics else None
    metrics = start_ops(ops, opts.metrics, lambda m: print(
        f"kcompact serve: {m}", file=sys.stderr, flush=True)) if ops is not None else None
    try:
        asyncio.run(run_server(opts.store, opts.listen, token, ssl_context=ctx, limits=limits,
                               ready=ready, ops=ops, protocols=protocols, tokens=tokens))
    finally:
        if metrics is not None:
            metrics.stop()
    print("kcompact serve: stopped", file=sys.stderr, flush=True)
    return 0
