"""``kcompact serve``: the Kafka endpoint (``--kafka-listen``), the HTTP replication server
(``--listen``), or both in one process and one event loop, with one ``--metrics``.

Prints ``kafka endpoint listening on HOST:PORT`` (the port bound when 0 is given) on stdout
once the Kafka listener accepts connections. Without a Kafka token the listener binds a
loopback address only, unless ``--allow-unauthenticated``.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from ..connections import is_loopback, parse_listen, serve_until, setup_log
from ..errors import ReplicationError
from ..group_offsets import GroupOffsets
from ..protocol import read_token_file
from ..acls import Authorizer, load_captured_bindings
from .authorize import AclSource
from .groups import Coordinator
from .sasl import read_users_file
from .server import Endpoint, Limits
from .store_view import StoreView


@dataclass(frozen=True)
class KafkaEndpointOptions:
    """The Kafka listener's options."""

    listen: str                         # HOST:PORT
    token_file: str | None = None       # SASL/PLAIN: the token is the password
    tls_cert: str | None = None
    tls_key: str | None = None
    allow_unauthenticated: bool = False
    limits: Limits = Limits()
    users_file: str | None = None       # SASL/SCRAM and PLAIN users (sasl.py)
    tls_client_ca: str | None = None    # mTLS: a client certificate signed by this CA
    acls_file: str | None = None        # kafka-acls --list output (authorize.py)
    acls_from_store: bool = False       # the ACLs mirror captured
    allow_everyone_if_no_acl_found: bool = False
    fleet: object | None = None         # replication.fleet.FleetOptions: a node of a fleet

    def check(self) -> tuple[str, int]:
        """(host, port); a ReplicationError saying what to do when the options do not fit."""
        host, port = parse_listen(self.listen, "--kafka-listen")
        if self.token_file is None and self.users_file is None and self.tls_client_ca is None \
                and not self.allow_unauthenticated and not is_loopback(host):
            raise ReplicationError(
                f"--kafka-listen {self.listen}: a non-loopback address needs "
                "--kafka-token-file F (SASL/PLAIN with that token), --kafka-users-file F, "
                "--tls-client-ca F, or --allow-unauthenticated")
        if self.tls_client_ca and not self.tls_cert:
            raise ReplicationError("--tls-client-ca needs TLS on the Kafka listener: add "
                                   "--tls-cert and --tls-key")
        if self.acls_file and self.acls_from_store:
            raise ReplicationError("--acls-file and --acls-from-store: give one of them")
        if self.fleet is not None:
            self.fleet.check()
        return host, port


@dataclass(frozen=True)
class ServeAllOptions:
    """``kcompact serve``'s options: ``kafka`` and/or ``http`` (replication.ServeOptions)."""

    store: str
    kafka: KafkaEndpointOptions | None = None
    http: object | None = None          # replication.server.ServeOptions
    metrics: str | None = None


async def run_kafka_endpoint(store_url: str, opts: KafkaEndpointOptions, *,
                             stop: asyncio.Event | None = None, ops=None,
                             ready=None) -> None:
    """Serve the Kafka endpoint until ``stop`` is set (SIGINT/SIGTERM when None)."""
    from ..server import tls_context
    host, port = opts.check()
    token = read_token_file(opts.token_file) if opts.token_file else None
    ctx = tls_context(opts.tls_cert, opts.tls_key)
    if opts.tls_client_ca:
        require_client_certs(ctx, opts.tls_client_ca)
    users = read_users_file(opts.users_file) if opts.users_file else None
    log = setup_log("serve")
    acls = AclSource.from_file(opts.acls_file, log, opts.allow_everyone_if_no_acl_found) \
        if opts.acls_file else None
    loop = asyncio.get_running_loop()
    try:
        view = await loop.run_in_executor(None, StoreView, store_url)
    except ReplicationError:
        raise
    except Exception as e:  # noqa: BLE001 - a store that cannot be opened, one line
        from kcompact.reput import ReputError
        if isinstance(e, (ReputError, OSError)):
            raise ReplicationError(f"cannot serve {store_url}: {e}") from None
        raise
    if opts.acls_from_store:
        try:
            acls = AclSource(Authorizer(load_captured_bindings(view.store),
                                        allow_everyone_if_no_acl_found=(
                                            opts.allow_everyone_if_no_acl_found)), log)
        except BaseException:
            view.close()
            raise
    offsets = GroupOffsets(store_url, view.store.meta.store_id)
    try:
        n = await loop.run_in_executor(None, offsets.load)
        if n:
            log.info("read %d group offset records from the store", n)

        fleet, kept = None, offsets
        if opts.fleet is not None:
            from ..fleet import Fleet
            from ..fleet.offsets import FleetOffsets
            fleet = Fleet(opts.fleet, view.store.meta.store_id, view.store.fs, log,
                          tls_cert=opts.tls_cert)
            kept = FleetOffsets(offsets, fleet, view.store.fs, log)
            fleet.on_commit = kept.write

        def coordinator(ep: Endpoint) -> Coordinator:
            return Coordinator(kept, ep.run, log, view.has)

        ep = Endpoint(view, coordinator, token=token, limits=opts.limits, log=log,
                      ssl_context=ctx, users=users, acls=acls)
        if ops is not None:
            ops.add(ep.collect)
        try:
            if fleet is not None:
                ep.fleet = fleet
                peer_host, peer_port = await fleet.start(tls_context(opts.tls_cert,
                                                                     opts.tls_key))
                print(f"fleet node {fleet.node_id} peer listener on {peer_host}:{peer_port}",
                      flush=True)
                if ops is not None:
                    ops.add(fleet.collect)
                    ops.check(fleet.health)
            try:
                bound_host, bound = await ep.start(host, port)
            except OSError as e:
                raise ReplicationError(f"cannot listen on --kafka-listen {opts.listen}: "
                                       f"{e.strerror or e}") from None
            if fleet is not None:
                from .server import WILDCARDS
                fleet.set_kafka("" if bound_host in WILDCARDS else bound_host, bound)
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            print(f"kafka endpoint listening on {shown}:{bound}", flush=True)
            if ready is not None:
                ready(bound_host, bound)
            await serve_until(stop, lambda ev: ev.wait())
        finally:
            await ep.close()
            if fleet is not None:
                await fleet.close()
    finally:
        offsets.close()
        view.close()


def require_client_certs(ctx, ca_file: str) -> None:
    """Make the TLS listener require a client certificate signed by ``ca_file``."""
    import ssl
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ReplicationError(f"cannot load --tls-client-ca {ca_file}: "
                               f"{getattr(e, 'strerror', None) or e}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED


def serve_all(opts: ServeAllOptions) -> int:
    """Run what ``opts`` asks for in one event loop until SIGINT/SIGTERM."""
    from ..ops import Ops, check_listen, start_ops
    from ..server import run_server, tls_context
    check_listen(opts.metrics)
    if opts.kafka is not None:
        opts.kafka.check()
        if opts.kafka.acls_file:  # a listing that cannot be parsed stops the start
            from ..acls import read_acls_file
            read_acls_file(opts.kafka.acls_file)
        if opts.kafka.users_file:
            read_users_file(opts.kafka.users_file)
    http = opts.http
    if http is not None:
        from ..protocol import serve_protocols
        token, tokens = http.read_tokens()
        http_ctx = tls_context(http.tls_cert, http.tls_key)
    ops = Ops("serve") if opts.metrics else None
    metrics = start_ops(ops, opts.metrics, lambda m: print(
        f"kcompact serve: {m}", file=sys.stderr, flush=True)) if ops is not None else None

    async def main() -> None:
        async def both(ev: asyncio.Event) -> None:
            tasks = []
            if http is not None:
                def ready(url: str) -> None:
                    print(f"kcompact serve: serving {opts.store} on {url} (Ctrl-C to stop)",
                          file=sys.stderr, flush=True)
                tasks.append(asyncio.ensure_future(run_server(
                    opts.store, http.listen, token, ssl_context=http_ctx, limits=http.limits(),
                    ready=ready, stop=ev, ops=ops, protocols=serve_protocols(),
                    tokens=tokens)))
            if opts.kafka is not None:
                tasks.append(asyncio.ensure_future(run_kafka_endpoint(
                    opts.store, opts.kafka, stop=ev, ops=ops)))
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if t.exception() is not None:
                        ev.set()
                        await asyncio.gather(*tasks, return_exceptions=True)
                        raise t.exception()
            finally:
                for t in tasks:
                    t.cancel()

        await serve_until(None, both)

    try:
        asyncio.run(main())
    finally:
        if metrics is not None:
            metrics.stop()
    print("kcompact serve: stopped", file=sys.stderr, flush=True)
    return 0
