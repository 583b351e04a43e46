"""A loopback TCP proxy in front of one Kafka broker that counts the Fetch requests its clients
send (not a test module; test_client_matrix.py puts one in front of Apache Kafka and one in
front of the endpoint, so that both counts come from the same place).

Every Metadata and FindCoordinator response passing through has its broker addresses rewritten
to the proxy's own (kio decodes and re-encodes them), so a client's every connection goes
through the proxy; everything else passes as it is. One upstream broker (the endpoint and the
test's Apache Kafka both have one node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import struct
import threading

from kio.index import load_response_schema
from kio.serial import entity_reader, entity_writer

FETCH, METADATA, FIND_COORDINATOR = 1, 3, 10
_HEAD = struct.Struct(">hhi")
_SIZE = struct.Struct(">i")


class FetchCountingProxy:
    def __init__(self, upstream: str):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.port = 0
        self.fetches = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FetchCountingProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(asyncio.start_server(
            self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close():
            self._server.close()
            for w in list(self._conns):
                w.close()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.close()
            return
        self._conns.update((cw, uw))
        pending: dict[int, tuple[int, int]] = {}

        async def requests():
            while True:
                frame = await _frame(cr)
                key, version, corr = _HEAD.unpack_from(frame, 0)
                pending[corr] = (key, version)
                if key == FETCH:
                    self.fetches += 1
                uw.write(_SIZE.pack(len(frame)) + frame)
                await uw.drain()

        async def responses():
            while True:
                frame = await _frame(ur)
                key, version = pending.pop(_SIZE.unpack_from(frame, 0)[0], (None, None))
                if key in (METADATA, FIND_COORDINATOR):
                    frame = self._rewrite(key, version, frame)
                cw.write(_SIZE.pack(len(frame)) + frame)
                await cw.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(responses())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for w in (cw, uw):
                w.close()
                self._conns.discard(w)

    def _rewrite(self, key: int, version: int, frame: bytes) -> bytes:
        cls = load_response_schema(key, version)
        header, n = entity_reader(cls.__header_schema__)(frame, 0)
        body, _ = entity_reader(cls)(frame, n)
        here = {"host": "127.0.0.1", "port": self.port}
        if key == METADATA:
            body = dataclasses.replace(body, brokers=tuple(
                dataclasses.replace(b, **here) for b in body.brokers))
        elif hasattr(body, "coordinators"):       # FindCoordinator v4+
            body = dataclasses.replace(body, coordinators=tuple(
                dataclasses.replace(c, **here) for c in body.coordinators))
        elif body.host:
            body = dataclasses.replace(body, **here)
        out = io.BytesIO()
        entity_writer(cls.__header_schema__)(out, header)
        entity_writer(cls)(out, body)
        return out.getvalue()


async def _frame(r: asyncio.StreamReader) -> bytes:
    size = _SIZE.unpack(await r.readexactly(4))[0]
    return await r.readexactly(size)
