"""``kcompact restore``: re-publish a store's topic into Kafka, with a progress bar.

The job is the store source connector (connectors/plugins/store_source/) run by an in-process
worker: its runner creates the target topic, produces the store's records in chunks
(transactions when the broker has them) and records progress, so that a rerun continues where a
stopped or killed run left off (``--from-scratch`` starts over).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, TextIO

from kcompact.compaction import refusal
from kcompact.reput import ReputError, Store

from ..errors import ConnectorsError
from ..framework.worker import Worker
from ..plugins.store_source import RestoreRunner
from ..plugins.store_source.runner import RestoreStats
from .options import kafka_overrides

CONNECTOR_NAME = "kcompact-restore"
PROGRESS_INTERVAL = 1.0


# ---------------------------------------------------------------------------------------------
# `kcompact restore`


def connector_props(store: str, topic: str, to_topic: str, *, mode: str = "latest",
                    repartition: bool = False, from_scratch: bool = False,
                    exactly_once: str = "requested",
                    kafka_config: Mapping[str, str] | None = None,
                    chunk_records: int | None = None, groups: str | None = None,
                    as_of_ms: int | None = None, allow_inexact: bool = False,
                    acls: bool = False, acl_principal_map: tuple[str, ...] = (),
                    schema_registry: str | None = None, keep_schema_ids: bool = False,
                    configs: bool = False) -> dict[str, Any]:
    props: dict[str, Any] = {
        "name": CONNECTOR_NAME,
        "connector.class": "StoreSourceConnector",
        "tasks.max": 1,
        "store.url": store,
        "store.topic": topic,
        "topic": to_topic,
        "mode": mode,
        "repartition": repartition,
        "restore.from.scratch": from_scratch,
        "exactly.once.support": exactly_once,
    }
    if chunk_records:
        props["restore.chunk.records"] = chunk_records
    if groups:
        props["groups"] = groups
    if as_of_ms is not None:
        props["as.of.ms"] = as_of_ms
        props["as.of.allow.inexact"] = allow_inexact
    if acls:
        props["acls"] = True
        if acl_principal_map:
            props["acls.principal.map"] = ",".join(acl_principal_map)
    if schema_registry:
        props["schema.registry.url"] = schema_registry
        props["schema.keep.ids"] = keep_schema_ids
    if configs:
        props["configs"] = True
    props.update(kafka_overrides(kafka_config or {}, "producer.override."))
    return props


class ProgressBar:
    """A progress line on stderr: redrawn in place on a terminal, one line every few seconds
    otherwise."""

    def __init__(self, out: TextIO, interval: float = PROGRESS_INTERVAL, width: int = 24):
        self.out, self.interval, self.width = out, interval, width
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last = 0.0

    def line(self, done: int, total: int, elapsed: float) -> str:
        frac = done / total if total else 1.0
        fill = int(round(frac * self.width))
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 and total > done else 0.0
        return (f"restore: [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
                f"{done:,}/{total:,} records, {rate:,.0f} rec/s"
                + (f", ETA {eta:.0f} s" if rate > 0 and done < total else ""))

    def __call__(self, worker: Worker, *, final: bool = False) -> None:
        now = time.monotonic()
        every = self.interval if self.tty else max(self.interval, 2.0)
        if now - self.last < every and not final:
            return
        runners = [r for r in worker.runners if isinstance(r, RestoreRunner)]
        if not runners or not runners[0].stats.planned:
            return
        self.last = now
        r = runners[0]
        end = r.metrics.finished or now
        text = self.line(r.metrics.records, r.stats.total, end - r.metrics.started)
        if self.tty:
            self.out.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def finish(self, worker: Worker) -> None:
        """The bar in its final state (then the summary line follows)."""
        self(worker, final=True)


@dataclass
class RestoreResult:
    records: int
    seconds: float
    stats: RestoreStats
    stopped_by: str | None

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


def _refuse_damaged(store_url: str, topic: str) -> None:
    try:
        st = Store.open(store_url)
    except ReputError:
        return  # (the connector says what is wrong with the store, as before)
    try:
        why = refusal(st, topic, "restore") if topic in st.topics() else None
    finally:
        st.close()
    if why is not None:
        raise ConnectorsError(why)


def restore(bootstrap: str, store: str, topic: str, to_topic: str, *, mode: str = "latest",
            repartition: bool = False, from_scratch: bool = False,
            exactly_once: str = "requested", kafka_config: Mapping[str, str] | None = None,
            chunk_records: int | None = None, out: TextIO | None = None,
            handle_signals: bool = True, stop: threading.Event | None = None,
            startup_timeout_ms: int = 10_000, groups: str | None = None,
            as_of_ms: int | None = None, allow_inexact: bool = False, acls: bool = False,
            acl_principal_map: tuple[str, ...] = (), dry_run: bool = False,
            schema_registry: str | None = None, keep_schema_ids: bool = False,
            configs: bool = False) -> RestoreResult:
    """Run a restore in this process; returns when done or stopped, raises on failure. A topic
    with a damaged partition is refused before anything is produced (it could not be
    complete): compaction/damage.py ``refusal``. ``dry_run``: print the ACLs (``acls``) it
    would create, produce and change nothing."""
    out = out if out is not None else sys.stderr
    _refuse_damaged(store, topic)
    if dry_run:
        return _dry_run(bootstrap, store, topic, to_topic, kafka_config or {}, out,
                        acls=acls, acl_principal_map=acl_principal_map, as_of_ms=as_of_ms,
                        allow_inexact=allow_inexact)
    worker = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0,
                     "startup.timeout.ms": startup_timeout_ms}, where="restore", log=out)
    props = connector_props(store, topic, to_topic, mode=mode, repartition=repartition,
                            from_scratch=from_scratch, exactly_once=exactly_once,
                            kafka_config=kafka_config, chunk_records=chunk_records,
                            groups=groups, as_of_ms=as_of_ms, allow_inexact=allow_inexact,
                            acls=acls, acl_principal_map=acl_principal_map,
                            schema_registry=schema_registry, keep_schema_ids=keep_schema_ids,
                            configs=configs)
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        if not received:
            print(f"\nrestore: {signal.Signals(signum).name}: stopping after the current chunk",
                  file=out, flush=True)
        received.append(signum)
        worker.stop()

    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    bar = ProgressBar(out)
    try:
        runners = worker.add_connector(props, where="restore",
                                       producer_origin=lambda k: f"-X {k}")
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        t0 = time.monotonic()
        try:
            worker.run(on_tick=bar)
        finally:
            bar.finish(worker)
        dt = time.monotonic() - t0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    r: RestoreRunner = runners[0]
    sig = signal.Signals(received[0]).name if received else None
    res = RestoreResult(r.metrics.records, dt, r.stats, sig)
    s = r.stats
    how = f"stopped by {sig}" if sig else "done"
    guarantee = ("exactly once for read_committed consumers (transactions)" if s.transactional
                 else "at least once per chunk (idempotent producer)")
    resumed = (f", continued from recorded progress ({s.previously_produced:,} produced "
               "before)" if s.resumed else "")
    print(f"restore: {how}: {res.records:,} of {s.total:,} records produced to {to_topic} "
          f"({s.target_partitions} partitions{', created' if s.created_topic else ''}) in "
          f"{dt:.1f} s ({res.rate:,.0f} rec/s){resumed}; {guarantee}", file=out, flush=True)
    return res


def _dry_run(bootstrap: str, store: str, topic: str, to_topic: str,
             kafka_config: Mapping[str, str], out: TextIO, *, acls: bool,
             acl_principal_map: tuple[str, ...], as_of_ms: int | None,
             allow_inexact: bool) -> RestoreResult:
    """``--dry-run``: what the restore would create besides the records, nothing written."""
    from ..plugins.store_source.acls import apply_acls, parse_principal_map, plan_acls
    from ..plugins.store_source.runner import _PRODUCER_ONLY
    with Store.open(store) as st:
        if topic not in st.topics():
            raise ConnectorsError(f"store {store} has no topic {topic!r}")
        plan = plan_acls(st, topic, to_topic, parse_principal_map(acl_principal_map),
                         as_of_ms=as_of_ms, allow_inexact=allow_inexact) if acls else None
    if plan is not None:
        if not plan.bindings:
            print(f"restore: --dry-run: the store keeps no ACL binding for store topic "
                  f"{topic!r}", file=out, flush=True)
        else:
            conf = {k: v for k, v in kafka_config.items() if k not in _PRODUCER_ONLY}
            conf["bootstrap.servers"] = bootstrap
            apply_acls(plan, conf, bootstrap, 10.0, out, dry_run=True)
    print(f"restore: --dry-run: no record produced to {to_topic}, nothing changed",
          file=out, flush=True)
    return RestoreResult(0, 0.0, RestoreStats(), None)


@dataclass(frozen=True)
class RestoreOptions:
    """``kcompact restore``'s options."""

    store: str
    topic: str
    bootstrap_servers: str
    to_topic: str
    repartition: bool = False
    mode: str = "latest"                 # "latest" or "all"
    from_scratch: bool = False
    chunk_records: int | None = None
    exactly_once: str = "requested"      # "requested", "required" or "disabled"
    kafka_config: Mapping[str, str] = field(default_factory=dict)  # -X producer settings
    groups: str | None = None            # --groups RE: commit their translated positions
    as_of_ms: int | None = None          # --as-of: the state at that time
    allow_inexact: bool = False
    acls: bool = False                   # --acls: the kept ACL bindings created on the target
    acl_principal_map: tuple[str, ...] = ()  # --acl-principal-map OLD=NEW
    dry_run: bool = False
    schema_registry: str | None = None   # --schema-registry: the target's registry
    keep_schema_ids: bool = False
    configs: bool = False                # --configs: the target created with the synced configs


def run_restore(opts: RestoreOptions) -> int:
    """``kcompact restore``: exit 130 when stopped by SIGINT, else 0 (failures raise)."""
    res = restore(opts.bootstrap_servers, opts.store, opts.topic, opts.to_topic,
                  mode=opts.mode, repartition=opts.repartition, from_scratch=opts.from_scratch,
                  exactly_once=opts.exactly_once, chunk_records=opts.chunk_records,
                  kafka_config=opts.kafka_config, groups=opts.groups, as_of_ms=opts.as_of_ms,
                  allow_inexact=opts.allow_inexact, acls=opts.acls,
                  acl_principal_map=opts.acl_principal_map, dry_run=opts.dry_run,
                  schema_registry=opts.schema_registry, keep_schema_ids=opts.keep_schema_ids,
                  configs=opts.configs)
    return 130 if res.stopped_by == "SIGINT" else 0


__all__ = ["ProgressBar", "RestoreOptions", "RestoreResult", "connector_props", "restore",
           "run_restore"]
