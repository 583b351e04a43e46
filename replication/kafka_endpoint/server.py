"""The Kafka endpoint's listener: connections, framing, limits, SASL/PLAIN, TLS, metrics.

An asyncio server. Each connection reads one size-prefixed request at a time and answers it
before reading the next (Kafka processes a connection's requests in order too), so responses
never interleave. Against bad clients, everyone else keeps being served:

* a size prefix below the smallest header or above ``max_request_bytes`` (100 MiB, Kafka's
  socket.request.max.bytes), an API or version not served (but ApiVersions, answered
  UNSUPPORTED_VERSION with a v0 body), a request kio cannot parse: the connection is closed
  with one log line saying why (Kafka closes such connections too);
* a connection silent for ``idle_timeout_s`` between requests (Kafka's connections.max.idle.ms,
  10 min), or that takes longer than ``request_timeout_s`` to send a request it started, or to
  take its response, is closed; more than ``max_connections`` open: closed at once (one line per
  10 s);
* with a token (``--kafka-token-file``: SASL/PLAIN, any user name, the token as the password)
  or a users file (``--kafka-users-file``: SCRAM-SHA-256/512 and PLAIN, sasl.py) a client must
  authenticate before any request but ApiVersions and SaslHandshake: in SaslAuthenticate
  requests after a SaslHandshake v1, as bare size-prefixed tokens after a v0 one (Kafka's
  legacy flow); a failed authentication is answered SASL_AUTHENTICATION_FAILED with the reason
  (v1), logged and closed; the connection's ``principal`` is then ``User:NAME``;
* with ``--tls-client-ca`` the principal of a connection without SASL is its certificate's
  subject (``User:<DN>``); with ACLs every request passes the ``Gate`` (authorize.py);
* with TLS, each accepted connection's handshake runs here (``StreamWriter.start_tls``), so a
  failed or missing one is logged with its reason, not dropped silently by asyncio.

The one broker is advertised at the listener's host, or on a wildcard listener at the address
each connection reached (``advertised_host``). Metrics (``collect``, on ``--metrics``): requests
by API, response bytes, connections open and accepted, errors answered by API and error name,
connections closed by reason.
"""

from __future__ import annotations

import asyncio
import logging
import select
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from . import apis
from .apis import api_versions, sasl_authenticate, sasl_handshake
from .authorize import Gate
from .dispatch import Dispatcher
from .sasl import ANONYMOUS, Authenticator, SaslFailure, dn_of_peercert
from .wire import (SASL_AUTHENTICATION_FAILED, UNSUPPORTED_VERSION, WireError, decode_request,
                   error_name, peek_header)

MIN_FRAME = 8  # api key, version, correlation id, client id length


def client_closed(writer: asyncio.StreamWriter) -> Callable[[], bool]:
    """Whether the client has closed its side of the connection (or the transport is
    closing), even while a request it sent is still unread in the stream's buffer
    (``StreamReader.at_eof`` is only true once that is read): librdkafka's consumer sends a
    Metadata request on a broker connection while its Fetch waits there, then closes.
    ``poll(2)``'s POLLRDHUP on the transport's socket (Linux); elsewhere the transport alone."""
    def closing() -> bool:  # (the writer's transport as it is when asked)
        return writer.transport.is_closing()

    rdhup = getattr(select, "POLLRDHUP", None)
    sock = writer.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    if rdhup is None or fd < 0 or not hasattr(select, "poll"):
        return closing
    mask = rdhup | select.POLLHUP | select.POLLERR

    def closed() -> bool:
        if closing():  # (first: its socket may be closed, the fd reused)
            return True
        p = select.poll()
        p.register(fd, rdhup)
        return any(ev & mask for _, ev in p.poll(0))
    return closed


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 100 << 20
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 30.0
    max_connections: int = 1024

    @classmethod
    def given(cls, max_connections: int | None = None, request_timeout_s: float | None = None,
              idle_timeout_s: float | None = None) -> "Limits":
        """The defaults with ``kcompact serve``'s --max-connections, --client-timeout and
        --kafka-idle-timeout (None: the default); a ReplicationError for a value out of range."""
        from ..errors import ReplicationError
        d = cls()
        out = cls(max_connections=d.max_connections if max_connections is None
                  else max_connections,
                  request_timeout_s=d.request_timeout_s if request_timeout_s is None
                  else request_timeout_s,
                  idle_timeout_s=d.idle_timeout_s if idle_timeout_s is None else idle_timeout_s)
        if not 1 <= out.max_connections <= 65536:
            raise ReplicationError(f"--max-connections {out.max_connections}: use 1 to 65536")
        if not 0.1 <= out.request_timeout_s <= 3600:
            raise ReplicationError(f"--client-timeout {out.request_timeout_s:g}: use 0.1 to "
                                   "3600 seconds")
        if not 0.1 <= out.idle_timeout_s <= 86400:
            raise ReplicationError(f"--kafka-idle-timeout {out.idle_timeout_s:g}: use 0.1 to "
                                   "86400 seconds")
        return out


class Connection:
    """One client connection: ``peer`` (for log lines), ``local`` (the address it reached,
    what Metadata advertises on a wildcard listener), its SASL state."""

    __slots__ = ("peer", "local", "authenticated", "mechanism_ok", "raw_sasl", "requests",
                 "principal", "sasl", "auth_failure", "gone")

    def __init__(self, peer: str, authenticated: bool, local: str = "127.0.0.1"):
        self.peer, self.local, self.authenticated = peer, local, authenticated
        self.mechanism_ok = False
        #: Kafka's principal (User:NAME): SASL's user, a client certificate's subject, or
        #: User:ANONYMOUS (sasl.py)
        self.principal = ANONYMOUS
        self.sasl = None  # the SASL exchange under way
        #: after a SaslHandshake v0: the next frame is a bare SASL token, not a request
        self.raw_sasl = False
        #: why a SaslAuthenticate failed (its answer is sent, then the connection closed)
        self.auth_failure: str | None = None
        self.requests = 0
        #: whether the client has closed its side with no request left unread (a waiting
        #: Fetch then stops waiting; one behind which the client pipelined another request
        #: waits on, as before: asyncio says no more without a read)
        self.gone: Callable[[], bool] = lambda: False


WILDCARDS = ("", "0.0.0.0", "::")


def advertised_host(listen_host: str, local: str) -> str:
    """The host Metadata and FindCoordinator name: the listener's as given, or on a wildcard
    listener (0.0.0.0, ::) the address the client's connection reached (the one broker is
    wherever the client found it; an IPv4 client of an IPv6 wildcard gets its IPv4 form)."""
    if listen_host not in WILDCARDS:
        return listen_host
    if local.startswith("::ffff:") and "." in local:
        return local[len("::ffff:"):]
    return local.split("%", 1)[0]


class Endpoint:
    """The running endpoint: ``view`` (StoreView), ``coordinator``, ``advertised`` (host,
    port), ``run`` (blocking work in the thread pool). ``serve(listen)`` opens the socket."""

    def __init__(self, view, coordinator_factory: Callable[["Endpoint"], Any], *,
                 token: bytes | None, limits: Limits, log: logging.Logger,
                 ssl_context: ssl.SSLContext | None = None, workers: int = 8,
                 users: dict | None = None, acls=None):
        self.view, self.token, self.limits, self.log = view, token, limits, log
        self.ssl_context = ssl_context
        #: SASL mechanisms (the token's PLAIN, the users file's) and ACLs (authorize.py)
        self.auth = Authenticator(token, users)
        self.gate = Gate(acls, log) if acls is not None else None
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcompact-kafka")
        self.coordinator = coordinator_factory(self)
        self.dispatcher = Dispatcher(self)
        self.advertised = ("127.0.0.1", 0)
        self.cluster_id = f"kcompact-{view.store.meta.store_id}"
        self.open: dict[asyncio.StreamWriter, Connection] = {}
        self.accepted = 0
        self.requests: dict[str, int] = {}
        self.bytes_out = 0
        #: (API name, error name) -> how many times answered (per partition in Fetch,
        #: ListOffsets, OffsetCommit, Produce; per topic in Metadata; else per response)
        self.errors: dict[tuple[str, str], int] = {}
        self.closed: dict[str, int] = {}
        self.refused_produces = 0
        self._stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._too_many_logged = -1e9

    # -- the pool, for blocking work -----------------------------------------------------------

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def stopping(self) -> bool:
        return self._stopping

    def count_refused_produce(self) -> None:
        self.refused_produces += 1

    # -- listening -----------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (every address of a name such as localhost, on one port
        when 0 is given); TLS, when configured, is set up per connection (``_connection``)."""
        for attempt in range(5):
            server = await asyncio.start_server(self._connection, host, port, backlog=128,
                                                limit=1 << 16)
            ports = {s.getsockname()[1] for s in server.sockets}
            if len(ports) == 1 or port != 0:
                break
            # port 0 on a name with several addresses (localhost: 127.0.0.1 and ::1) gave each
            # its own port: listen again on the first one's for all of them
            first = server.sockets[0].getsockname()[1]
            server.close()
            await server.wait_closed()
            try:
                server = await asyncio.start_server(self._connection, host, first, backlog=128,
                                                    limit=1 << 16)
                break
            except OSError:
                if attempt == 4:
                    raise
        self._server = server
        bound = server.sockets[0].getsockname()[1]
        self.listen_host = host
        self.advertised = (host if host not in WILDCARDS else "127.0.0.1", bound)
        self.coordinator.start()
        return host, bound

    def advertised_for(self, conn: "Connection | None") -> tuple[str, int]:
        """(host, port) of the one broker as ``conn``'s client should reach it."""
        host, port = self.advertised
        if conn is None:
            return host, port
        return advertised_host(getattr(self, "listen_host", host), conn.local), port

    async def close(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for w in list(self.open):
            w.close()
        await self.coordinator.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- one connection ------------------------------------------------------------------------

    def _close(self, writer: asyncio.StreamWriter, conn: Connection, reason: str,
               why: str | None) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1
        if why:
            self.log.warning("closed the connection of %s: %s", conn.peer, why)
        writer.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        addr = writer.get_extra_info("peername")
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        local = writer.get_extra_info("sockname")
        conn = Connection(peer, authenticated=not self.auth.enabled,
                          local=str(local[0]) if isinstance(local, tuple) else "127.0.0.1")
        self.accepted += 1
        if len(self.open) >= self.limits.max_connections:
            now = time.monotonic()
            if now - self._too_many_logged >= 10:
                self._too_many_logged = now
                self.log.warning("refused the connection of %s: %d connections are open, the "
                                 "most this endpoint serves", peer, len(self.open))
            self.closed["too_many"] = self.closed.get("too_many", 0) + 1
            writer.close()
            return
        self.open[writer] = conn
        try:
            if self.ssl_context is not None and not await self._tls(writer, conn):
                return
            await self._serve(reader, writer, conn)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            self.closed["client_gone"] = self.closed.get("client_gone", 0) + 1
            writer.close()
        except asyncio.CancelledError:
            writer.close()  # shutting down (not re-raised: asyncio's stream callback would
            # log the cancelled task as an error)
        except Exception as e:  # noqa: BLE001 - one connection's failure is logged, not fatal
            self.log.error("closed the connection of %s after an internal error: %s: %s",
                           conn.peer, type(e).__name__, " ".join(str(e).split())[:300])
            self.closed["internal_error"] = self.closed.get("internal_error", 0) + 1
            writer.close()
        finally:
            self.open.pop(writer, None)

    async def _tls(self, writer: asyncio.StreamWriter, conn: Connection) -> bool:
        """The TLS handshake of a connection to a TLS listener; False after closing it with
        the reason logged (a client speaking plaintext, a certificate it refuses, silence)."""
        timeout = self.limits.request_timeout_s
        try:
            await writer.start_tls(self.ssl_context, ssl_handshake_timeout=timeout)
            if self.ssl_context.verify_mode == ssl.CERT_REQUIRED:
                cert = writer.get_extra_info("peercert")
                if cert:  # Kafka's default principal builder: User:<the subject's DN>
                    conn.principal = f"User:{dn_of_peercert(cert)}"
            return True
        except (ssl.SSLError, ConnectionError, OSError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                why = f"no TLS handshake within {timeout:g}s"
            else:
                why = f"TLS handshake failed ({getattr(e, 'reason', None) or e})"
                if "WRONG_VERSION_NUMBER" in str(e) or "HTTP_REQUEST" in str(e):
                    why += ("; is the client speaking without TLS (security.protocol PLAINTEXT "
                            "or SASL_PLAINTEXT)? This listener is SSL"
                            + ("/SASL_SSL" if self.auth.enabled else ""))
            self._close(writer, conn, "tls", why)
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     conn: Connection) -> None:
        lim = self.limits
        closed = client_closed(writer)
        conn.gone = lambda: reader.at_eof() or closed()
        while not self._stopping:
            try:
                head = await asyncio.wait_for(reader.readexactly(4), lim.idle_timeout_s)
            except asyncio.TimeoutError:
                if conn.requests:  # (Kafka's connections.max.idle.ms: clients reconnect)
                    self.log.info("closed the connection of %s: idle for %gs", conn.peer,
                                  lim.idle_timeout_s)
                self._close(writer, conn, "idle", None if conn.requests else
                            f"no request within {lim.idle_timeout_s:g}s of connecting")
                return
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    self._close(writer, conn, "malformed", "the connection ended inside a "
                                "request's size prefix")
                else:
                    self.closed["client_gone"] = self.closed.get("client_gone", 0) + 1
                    writer.close()
                return
            size = int.from_bytes(head, "big", signed=True)
            if size < (0 if conn.raw_sasl else MIN_FRAME) or size > lim.max_request_bytes:
                self._close(writer, conn, "malformed", (
                    f"a request size of {size} bytes (at most {lim.max_request_bytes} are "
                    "accepted; is this a Kafka client? TLS spoken to a plain listener, or "
                    "the reverse, looks like this)"))
                return
            try:
                frame = await asyncio.wait_for(reader.readexactly(size), lim.request_timeout_s)
            except asyncio.TimeoutError:
                self._close(writer, conn, "slow", f"it did not send its {size}-byte request "
                            f"within {lim.request_timeout_s:g}s")
                return
            conn.requests += 1
            if conn.raw_sasl:
                out = await self._raw_token(frame, conn, writer)
            else:
                out = await self._answer(frame, conn, writer)
            if out is None:
                return
            for b in out:
                writer.write(b)
            try:
                await asyncio.wait_for(writer.drain(), lim.request_timeout_s)
            except asyncio.TimeoutError:
                self._close(writer, conn, "slow", "it took no byte of its response for "
                            f"{lim.request_timeout_s:g}s")
                writer.transport.abort()
                return

    async def _answer(self, frame: bytes, conn: Connection,
                      writer: asyncio.StreamWriter) -> list | None:
        """The response buffers, or None after closing the connection."""
        key, version, corr = peek_header(frame)
        name = apis.name_of(key)
        self.requests[name] = self.requests.get(name, 0) + 1
        if key == api_versions.KEY and not api_versions.API.serves(version):
            self.count_errors(name, [UNSUPPORTED_VERSION])
            return self._sent([api_versions.fallback(corr)])
        if not conn.authenticated and key not in (api_versions.KEY, sasl_handshake.KEY,
                                                  sasl_authenticate.KEY):
            self._close(writer, conn, "unauthenticated",
                        f"{name} request before SASL authentication (this endpoint requires "
                        f"SASL: {', '.join(self.auth.mechanisms)})")
            return None
        try:
            apis.lookup(key, version)
            req = decode_request(frame, name)
        except WireError as e:
            self._close(writer, conn, "unsupported", str(e))
            return None
        out = await self.dispatcher.answer(req, conn)
        if conn.auth_failure is not None:  # a failed SaslAuthenticate: answered, then closed
            writer.write(out)
            self.bytes_out += len(out)
            try:
                await asyncio.wait_for(writer.drain(), 1.0)
            except (asyncio.TimeoutError, ConnectionError):
                pass
            self._close(writer, conn, "auth_failed", "SASL authentication failed: "
                        + conn.auth_failure)
            return None
        if out is None:
            self._close(writer, conn, "produce_acks0", "a produce with acks=0 (nothing can be "
                        "answered, and this endpoint is read-only)")
            return None
        return self._sent(out if isinstance(out, list) else [out])

    def _sent(self, bufs: list) -> list:
        self.bytes_out += sum(memoryview(b).nbytes for b in bufs)
        return bufs

    def count_errors(self, api: str, codes) -> None:
        """Count the error codes (0 = none, not counted) an answer of ``api`` carries."""
        for code in codes:
            if code:
                key = (api, error_name(code))
                self.errors[key] = self.errors.get(key, 0) + 1

    # -- SASL after a SaslHandshake v0 (the requests: apis/sasl_handshake.py, ------------------
    # -- apis/sasl_authenticate.py; the mechanisms: sasl.py) -----------------------------------

    async def _raw_token(self, frame: bytes, conn: Connection,
                         writer: asyncio.StreamWriter) -> list | None:
        """After a SaslHandshake v0, a bare SASL token: the server's token back, size-prefixed
        (an empty one after PLAIN, Kafka's answer), or the connection closed (v0 has no way to
        say why)."""
        try:
            out = sasl_authenticate.step(conn, frame)
        except SaslFailure as e:
            conn.raw_sasl = False
            self.count_errors(sasl_handshake.NAME, [SASL_AUTHENTICATION_FAILED])
            self._close(writer, conn, "auth_failed", f"SASL authentication failed: {e} "
                        "(SaslHandshake v0)")
            return None
        if conn.authenticated:
            conn.raw_sasl = False
        return self._sent([len(out).to_bytes(4, "big") + out])

    # -- metrics -------------------------------------------------------------------------------

    def collect(self):
        from ..ops import counter, gauge
        r = counter("kafka_requests", "Kafka requests received, by API.", ["api"])
        for name, n in sorted(self.requests.items()):
            r.add_metric([name], n)
        yield r
        b = counter("kafka_response_bytes", "Bytes of Kafka responses sent (records included).")
        b.add_metric([], self.bytes_out)
        yield b
        c = gauge("kafka_connections", "Kafka client connections open.")
        c.add_metric([], len(self.open))
        yield c
        a = counter("kafka_connections_accepted", "Kafka client connections accepted.")
        a.add_metric([], self.accepted)
        yield a
        e = counter("kafka_error_responses", "Kafka error codes answered, by API and error "
                    "(Kafka's names; each partition's in Fetch, ListOffsets, OffsetCommit and "
                    "Produce answers, each topic's in Metadata).", ["api", "error"])
        for (api, error), n in sorted(self.errors.items()):
            e.add_metric([api, error], n)
        yield e
        d = counter("kafka_connections_closed", "Kafka connections closed by the endpoint or "
                    "the client, by reason.", ["reason"])
        for why, n in sorted(self.closed.items()):
            d.add_metric([why], n)
        yield d
        p = counter("kafka_produce_refused", "Produce requests refused (the endpoint is "
                    "read-only).")
        p.add_metric([], self.refused_produces)
        yield p
        if self.gate is not None:
            yield from self.gate.collect()
