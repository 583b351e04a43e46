"""The listening side of `kcompact serve`: every client connection, before aiohttp sees it.

``Connections`` is the protocol factory handed to ``loop.create_server``; it wraps aiohttp's
``web.Server`` (itself a protocol factory, aiohttp's documented low-level server), so that

* at most ``ServerLimits.max_connections`` connections are served at once; one more is answered
  ``503`` (Retry-After: 1) once its request head arrives, then closed;
* a connection that has not sent a whole request within ``client_timeout_s`` of connecting, or
  of its previous response, is closed (clients trickling bytes hold nothing), as is one whose
  response sits unsent in the write buffer without progress for as long;
* everything the server logs is one line (``OneLine``): aiohttp's own lines too (it logs a
  request its parser refuses with the exception: here its reason, after the client address).

Only public API: asyncio's Protocol and transports, aiohttp's ``web.Server`` as a factory and
its ``logger`` parameter. Server.dispatch tells a Connection when a request is being handled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import sys
import time
from typing import Awaitable, Callable

from aiohttp import web

from kcompact.reput.env import debug

from .errors import ReplicationError
from .protocol import H_PROTOCOL, PROTOCOL_VERSION, ServerLimits, error_doc


class OneLine(logging.Formatter):
    """``kcompact <command>: <message>[: <exception in one line>]``, never a traceback (aiohttp
    logs a malformed request with its exception; the client address is in its message), unless
    KCOMPACT_DEBUG is set."""

    def __init__(self, command: str = "serve"):
        super().__init__()
        self.prefix = f"kcompact {command}: "

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            msg = f"{msg}: {describe(exc)}"
        line = self.prefix + " ".join(msg.split())
        if exc is not None and debug():
            line += "\n" + self.formatException(record.exc_info)
        return line


def describe(e: BaseException) -> str:
    """An exception in one line (aiohttp's parse errors keep their reason in ``message``)."""
    text = getattr(e, "message", None)
    text = " ".join(str(text if isinstance(text, str) and text else e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def server_log(command: str = "serve") -> logging.Logger:
    """The logger of a server run by ``command`` (``serve``, or the command whose metrics
    endpoint or read API it is); ``setup_log(command)`` sends it to stderr."""
    return logging.getLogger("kcompact.serve" if command == "serve"
                             else f"kcompact.http.{command}")


#: ``kcompact serve``'s
log = server_log("serve")


def setup_log(command: str = "serve") -> logging.Logger:
    """``command``'s server logger, one line each on stderr prefixed ``kcompact <command>:``
    (set up when a server starts, so it writes to the stderr of then: --log-format json's)."""
    lg = server_log(command)
    if not lg.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(OneLine(command))
        lg.addHandler(h)
        lg.setLevel(logging.DEBUG)  # aiohttp logs a garbage first request at debug level
        lg.propagate = False
    return lg


def peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else peer[0]
        return f"{host}:{peer[1]}"
    return str(peer or "?")


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol for it (``handler``), behind the request and
    response timeouts. A request is being handled between ``request_started`` and
    ``request_done`` (Server.dispatch); otherwise the client has ``client_timeout_s`` to send a
    whole request, and a response still in the write buffer must make progress as long.

    A connection made while ``max_connections`` are open gets no handler: its request head is
    read and answered 503, then it is closed (answering before reading the request would close
    the socket with unread bytes: a reset, which can destroy the answer). The limit is checked
    here, not in the factory: asyncio calls the factory for every socket of an accept batch
    before it makes any of their connections."""

    def __init__(self, conns: "Connections"):
        self.conns = conns
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.timer: asyncio.TimerHandle | None = None
        self.received = 0   # bytes since the timer was armed
        self.unsent = 0     # the write buffer when it was armed (or last checked)
        self.requests = 0
        self.head = bytearray()  # a refused connection's request head

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = peer(transport)
        if len(self.conns.open) >= self.conns.limits.max_connections:
            self.conns.refusing.add(transport)
            self.conns.note_refused(self.peer)
        else:
            self.handler = self.conns.server()
            self.conns.open[transport] = self
            self.handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.handler is not None:
            self.handler.data_received(data)
        elif not self.transport.is_closing():
            self.head += data
            if b"\r\n\r\n" in self.head or len(self.head) > 16384:
                self._refuse()

    def eof_received(self):
        if self.handler is not None:
            return self.handler.eof_received()
        self._refuse()
        return False

    def _refuse(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.conns.busy)
            self.transport.close()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.conns.refusing.discard(self.transport)
        if self.handler is not None:
            self.conns.open.pop(self.transport, None)
            self.handler.connection_lost(exc)

    def request_started(self) -> None:
        self._disarm()
        self.requests += 1

    def request_done(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._arm()

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _arm(self) -> None:
        self._disarm()
        self.received = 0
        self.unsent = self.transport.get_write_buffer_size()
        self.timer = self.conns.loop.call_later(self.conns.limits.client_timeout_s,
                                                self._expired)

    def _expired(self) -> None:
        self.timer = None
        t = self.transport
        if t is None or t.is_closing():
            return
        timeout = self.conns.limits.client_timeout_s
        unsent = t.get_write_buffer_size()
        if self.handler is None:
            pass  # refused (logged), and its request head did not even come
        elif self.received:
            self.conns.log.warning("closed the connection of %s: its request was not whole "
                                   "after %gs (%d bytes received)", self.peer, timeout,
                                   self.received)
        elif unsent and unsent < self.unsent:
            self.unsent = unsent  # the client is still taking its response
            self.timer = self.conns.loop.call_later(timeout, self._expired)
            return
        elif unsent:
            self.conns.log.warning("closed the connection of %s: it took no byte of its "
                                   "response for %gs", self.peer, timeout)
        elif not self.requests:
            self.conns.log.warning("closed the connection of %s: no request within %gs of "
                                   "connecting", self.peer, timeout)
        # else: an idle keep-alive connection, closed quietly
        t.abort()


class Connections:
    """The protocol factory of the listening socket (``loop.create_server``): aiohttp's
    ``web.Server`` behind the connection limit and the timeouts (``Connection``)."""

    def __init__(self, server: web.Server, limits: ServerLimits,
                 logger: logging.Logger = log):
        self.server, self.limits, self.log = server, limits, logger
        self.loop = asyncio.get_running_loop()
        self.open: dict[asyncio.BaseTransport, Connection] = {}
        self.refusing: set[asyncio.BaseTransport] = set()
        body = json.dumps(error_doc(503, f"too many connections: this server serves at most "
                                         f"{limits.max_connections} at once; retry")).encode()
        self.busy = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Retry-After: 1\r\nConnection: close\r\n"
                     + f"{H_PROTOCOL}: {PROTOCOL_VERSION}\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.refused = 0
        self._refused_logged = -1e9

    def __call__(self) -> asyncio.Protocol:
        return Connection(self)

    def note_refused(self, peer: str) -> None:
        """One log line per 10 s at most, counting the refusals since the previous one."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= 10:
            self.log.warning("refused the connection of %s with a 503: %d connections are open, "
                             "the --max-connections limit (%d refused since the previous such "
                             "line)", peer, len(self.open), self.refused)
            self._refused_logged, self.refused = now, 0

    def of(self, request: web.BaseRequest) -> Connection | None:
        return self.open.get(request.transport)

    def abort_all(self) -> None:
        """At shutdown, after aiohttp closed the connections it serves: whatever is left."""
        for t in [*self.open, *self.refusing]:
            t.abort()


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of a listening flag; port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ReplicationError(f"{flag} {text!r}: use HOST:PORT, e.g. 127.0.0.1:8470 "
                               "(port 0 picks a free one)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_url(url: str) -> str:
    """The URL a process on this machine uses to reach a server listening at ``url``: a
    wildcard address (0.0.0.0, ::) becomes the loopback one."""
    return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


@web.middleware
async def track_requests(request: web.Request, handler) -> web.StreamResponse:
    """The aiohttp middleware that tells ``Connections`` when a request is being handled (for
    an application served by :class:`Listening`; ``Server.dispatch`` does the same itself)."""
    conns = request.app.get(CONNECTIONS_KEY, {}).get("connections")
    conn = conns.of(request) if conns is not None else None
    if conn is not None:
        conn.request_started()
    try:
        return await handler(request)
    finally:
        if conn is not None:
            conn.request_done()


#: where an application served by Listening finds its Connections (a dict set before the
#: application is frozen, filled once it listens)
CONNECTIONS_KEY = web.AppKey("kcompact_connections", dict)


class Listening:
    """An aiohttp application listening on ``HOST:PORT`` behind :class:`Connections` (the
    connection limit, the client timeout, one-line logging): ``await Listening.open(...)``,
    ``.url``, ``await .close()``. The listening socket is ours (aiohttp's TCPSite would hand
    its own factory to ``create_server``)."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.AbstractServer,
                 connections: Connections, url: str):
        self.runner, self.listener, self.connections, self.url = (runner, listener,
                                                                  connections, url)

    @classmethod
    async def open(cls, app: web.Application, listen: str, limits: ServerLimits, *,
                   ssl_context: ssl.SSLContext | None = None, flag: str = "--listen",
                   command: str = "serve") -> "Listening":
        """``command``: the running command, the prefix of the server's log lines."""
        host, port = parse_listen(listen, flag)
        logger = setup_log(command)
        holder: dict = app.setdefault(CONNECTIONS_KEY, {})
        runner = web.AppRunner(app, access_log=None, max_line_size=limits.max_url_bytes + 64,
                               handle_signals=False, logger=logger, shutdown_timeout=5.0)
        await runner.setup()
        conns = holder["connections"] = Connections(runner.server, limits, logger)
        loop = asyncio.get_running_loop()
        try:
            listener = await loop.create_server(
                conns, host, port, ssl=ssl_context, backlog=128,
                ssl_handshake_timeout=limits.client_timeout_s if ssl_context else None)
        except OSError as e:
            await runner.cleanup()
            raise ReplicationError(f"cannot listen on {flag} {listen}: {e.strerror or e}"
                                   ) from None
        bound = listener.sockets[0].getsockname()[1] if listener.sockets else port
        shown = f"[{host}]" if ":" in host else host
        return cls(runner, listener, conns,
                   f"{'https' if ssl_context else 'http'}://{shown}:{bound}")

    async def close(self) -> None:
        self.listener.close()
        await self.runner.cleanup()  # closes the connections aiohttp serves
        self.connections.abort_all()


async def serve_until(stop: asyncio.Event | None, body: Callable[[asyncio.Event],
                                                                  Awaitable[None]]) -> None:
    """Run ``body(stop)``; with ``stop`` None, a new event set by SIGINT/SIGTERM."""
    import signal
    loop = asyncio.get_running_loop()
    own = stop is None
    stop = stop or asyncio.Event()
    if own:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        await body(stop)
    finally:
        if own:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
