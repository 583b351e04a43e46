"""Operating a long-running command: Prometheus metrics and a health check over HTTP
(``--metrics HOST:PORT`` on every long-running command, the worker property ``metrics.listen``).

``GET /metrics`` is Prometheus' text exposition format, written by ``prometheus_client`` from a
registry of its own per command (process metrics, ``kcompact_info``, ``kcompact_errors_total``
by kind, and the collectors the command adds). A collector reads the command's own counters when
Prometheus scrapes (``Ops.collect``): nothing is counted twice and no hot path pays for it.

``GET /healthz`` is ``200 ok`` while every check the command added passes, else ``503`` with one
line per failing check (a partition stuck in error, a broker unreachable for longer than
``unreachable_timeout_s``...). Both answer without a token: bind ``--metrics`` to a loopback or
private address (the default examples use 127.0.0.1).

Lives in replication because every layer that runs a long-running command can import it from
here (``serve`` and ``replicate`` in replication, the others in connectors); the HTTP side is
``connections.Listening``, as ``serve`` and ``kv serve`` listen.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Iterable

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)

from .connections import Listening
from .protocol import ServerLimits

#: a broker (or master) that has not answered for this long makes /healthz answer 503
UNREACHABLE_TIMEOUT_S = 60.0

Check = Callable[[], "str | None"]

__all__ = ["AppThread", "Ops", "OpsServer", "Unreachable", "check_listen",
           "compaction_metrics", "counter", "gauge", "replica_metrics", "start_ops",
           "store_metrics", "UNREACHABLE_TIMEOUT_S", "CounterMetricFamily", "GaugeMetricFamily"]


def counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    """A counter family named ``kcompact_<name>`` (prometheus_client adds ``_total``)."""
    return CounterMetricFamily(f"kcompact_{name}", doc, labels=list(labels))


def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    """A gauge family named ``kcompact_<name>``."""
    return GaugeMetricFamily(f"kcompact_{name}", doc, labels=list(labels))


class _Collector:
    """Adapts a function yielding metric families to prometheus_client's collector protocol."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]):
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return self.fn()


class Unreachable:
    """When a peer (a Kafka broker, a master) stopped answering: ``down(reason)`` on each
    failure, ``up()`` on each success; ``check()`` is a health check failing once the peer has
    been down for ``timeout_s``."""

    def __init__(self, what: str, timeout_s: float = UNREACHABLE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.timeout_s, self.clock = what, timeout_s, clock
        self.since: float | None = None
        self.reason = ""

    def down(self, reason: str) -> None:
        if self.since is None:
            self.since = self.clock()
        self.reason = reason

    def up(self) -> None:
        self.since = None

    def check(self) -> str | None:
        since = self.since
        if since is None:
            return None
        dt = self.clock() - since
        if dt < self.timeout_s:
            return None
        return f"{self.what} unreachable for {dt:.0f}s: {self.reason}"


class Ops:
    """A command's metrics registry and health checks.

    ``add(fn)``: a function yielding metric families (``gauge``/``counter``), called on each
    scrape; ``check(fn)``: a health check returning None when fine, else the reason;
    ``error(kind)``: counts one error in ``kcompact_errors_total{kind}``.
    """

    def __init__(self, command: str):
        from kcompact import __version__
        self.command = command
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._errors = Counter("kcompact_errors", "Errors by kind (counted as they happen).",
                               ["kind"], registry=self.registry)
        self._checks: list[Check] = []
        self._closing: list[Callable[[], None]] = []
        self.started = time.time()
        self.version = __version__
        self.add(self._info)

    def _info(self) -> Iterable[Metric]:
        g = gauge("info", "The running command and kcompact's version (always 1).",
                  ["command", "version"])
        g.add_metric([self.command, self.version], 1)
        yield g
        s = gauge("start_time_seconds", "When the command started (seconds since the epoch).")
        s.add_metric([], self.started)
        yield s

    def add(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.registry.register(_Collector(fn))

    def check(self, fn: Check) -> None:
        self._checks.append(fn)

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at ``close()`` (a collector's clients, stores...)."""
        self._closing.append(fn)

    def close(self) -> None:
        for fn in reversed(self._closing):
            fn()
        self._closing.clear()

    def error(self, kind: str, n: int = 1) -> None:
        self._errors.labels(kind=kind).inc(n)

    def health(self) -> list[str]:
        """The reasons the command is unhealthy (empty: healthy)."""
        out = []
        for fn in self._checks:
            try:
                why = fn()
            except Exception as e:  # noqa: BLE001 - a failing check is itself a reason
                why = f"health check failed: {type(e).__name__}: {e}"
            if why:
                out.append(" ".join(str(why).split()))
        return out

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024)

        async def metrics(_request: web.Request) -> web.Response:
            body = await asyncio.get_running_loop().run_in_executor(None, self.exposition)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def healthz(_request: web.Request) -> web.Response:
            reasons = await asyncio.get_running_loop().run_in_executor(None, self.health)
            if reasons:
                return web.Response(status=503, text="".join(f"{r}\n" for r in reasons))
            return web.Response(text="ok\n")

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        return app


class AppThread:
    """An aiohttp application listening (``connections.Listening``) from a thread with its own
    event loop, so the command's own work keeps its thread or loop: ``start()`` returns the URL
    (a busy or invalid address is a one-line ReplicationError), ``stop()``."""

    def __init__(self, make_app: Callable[[], web.Application], listen: str, *,
                 limits: ServerLimits = ServerLimits(), flag: str = "--listen",
                 ssl_context=None, name: str = "kcompact-http", command: str = "serve"):
        self.make_app, self.listen, self.limits, self.flag = make_app, listen, limits, flag
        self.command = command  # the prefix of its log lines: kcompact <command>:
        self.ssl_context = ssl_context
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> str:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.url

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            listening = await Listening.open(self.make_app(), self.listen, self.limits,
                                             ssl_context=self.ssl_context, flag=self.flag,
                                             command=self.command)
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._error = e
            self._ready.set()
            return
        self.url = listening.url
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await listening.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._stop is not None:
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already ended
        if self._thread.is_alive():
            self._thread.join()


class OpsServer(AppThread):
    """``/metrics`` and ``/healthz`` of an :class:`Ops` (an :class:`AppThread`)."""

    def __init__(self, ops: Ops, listen: str, limits: ServerLimits = ServerLimits()):
        super().__init__(ops.app, listen, limits=limits, flag="--metrics",
                         name="kcompact-metrics", command=ops.command)
        self.ops = ops


def start_ops(ops: Ops, listen: str | None, say: Callable[[str], None] | None = None
              ) -> OpsServer | None:
    """Start serving ``ops`` on ``listen`` (None: do nothing); tells ``say`` the URL."""
    if not listen:
        return None
    server = OpsServer(ops, listen)
    url = server.start()
    if say is not None:
        say(f"metrics on {url}/metrics, health on {url}/healthz")
    return server


def check_listen(listen: str | None) -> None:
    """A ``--metrics`` address that cannot be valid fails before the command starts."""
    if listen:
        from .connections import parse_listen
        parse_listen(listen, "--metrics")




def compaction_metrics(scheduler: Any) -> Iterable[Metric]:
    """The metric families of a background compaction ``Scheduler`` (kcompact.compaction):
    runs, partitions compacted, bytes read and written, records dropped, the offset map's
    utilisation, failures, the partitions found damaged (``kcompact_uncleanable_partitions``:
    skipped, the others compacted); and each partition's dirty ratio and clean/dirty bytes as of the
    scheduler's last assessment (``Scheduler.assessments``, made on its own thread: a scrape
    takes none of the writer's locks)."""
    runs = counter("compaction_runs", "Planner runs of the background compaction.")
    runs.add_metric([], scheduler.runs)
    yield runs
    fails = counter("compaction_failures", "Background compaction runs that failed.")
    fails.add_metric([], len(scheduler.errors))
    yield fails
    lab = ["topic", "partition"]
    fam = {
        "compacted": counter("compaction_partition_runs", "Compactions of a partition.", lab),
        "read": counter("compaction_read_bytes", "Bytes compaction read.", lab),
        "written": counter("compaction_written_bytes", "Bytes compaction wrote.", lab),
        "dropped": counter("compaction_records_dropped", "Records compaction removed.", lab),
        "util": gauge("compaction_offset_map_utilization", "The offset map's highest fill "
                      "ratio in the partition's last compaction (0-1).", lab),
        "seconds": counter("compaction_seconds", "Time spent compacting.", lab),
    }
    agg: dict[tuple[str, int], list] = {}
    for r in list(scheduler.results):
        a = agg.setdefault((r.topic, r.partition), [0, 0, 0, 0, 0.0, 0.0])
        a[0] += 1
        a[1] += r.bytes_read
        a[2] += r.bytes_written
        a[3] += r.records_dropped
        a[4] = r.map_utilization_max
        a[5] += r.duration_s
    for (t, p), a in sorted(agg.items()):
        lv = [t, str(p)]
        for name, v in zip(("compacted", "read", "written", "dropped", "util", "seconds"), a):
            fam[name].add_metric(lv, v)
    yield from fam.values()
    ratio = gauge("dirty_ratio", "Dirty bytes / (clean + dirty bytes) over the cleanable "
                  "range, as the planner assessed the partition last (0-1).", lab)
    clean = gauge("clean_bytes", "Bytes at or below the compaction horizon, as last "
                  "assessed.", lab)
    dirty = gauge("dirty_bytes", "Bytes above the horizon in the cleanable range, as last "
                  "assessed.", lab)
    for (t, p), a in sorted(scheduler.assessments.items()):
        lv = [t, str(p)]
        ratio.add_metric(lv, a.dirty_ratio)
        clean.add_metric(lv, a.clean_bytes)
        dirty.add_metric(lv, a.dirty_bytes)
    yield from (ratio, clean, dirty)
    damaged = scheduler.uncleanable.snapshot()
    unc = gauge("uncleanable_partitions", "Partitions the background compaction found damaged "
                "and skips, the others being compacted (Kafka's uncleanable-partitions-count); "
                "alert on > 0 and run `kcompact repair` (docs/operations-damage.md).")
    unc.add_metric([], len(damaged))
    yield unc
    each = gauge("uncleanable_partition", "1 for each partition found damaged, with the file "
                 "of the first problem met.", lab + ["file"])
    for (t, p), d in sorted(damaged.items()):
        each.add_metric([t, str(p), d.path or ""], 1)
    yield each


def store_metrics(stores: Iterable[Any]) -> Iterable[Metric]:
    """The commit-log append and fsync durations of writer stores (``Store.write_timings``,
    histograms the writer keeps: one observation per append call or fsync), summed over
    ``stores``."""
    append = HistogramMetricFamily("kcompact_commitlog_append_seconds", "Time of each append "
                                   "of a batch to the commit log (a roll's fsync included).")
    fsync = HistogramMetricFamily("kcompact_fsync_seconds", "Time of each fsync: the commit "
                                  "log's active segment, or a flush's fsyncs of the partitions' "
                                  "files (all of them: one observation).", labels=["file"])
    merged: dict[str, tuple[list, float]] = {}
    for st in stores:
        for name, timing in st.write_timings().items():
            buckets, total, _ = timing.snapshot()
            have = merged.get(name)
            if have is not None:
                buckets = [(le, n + m) for (le, n), (_, m) in zip(buckets, have[0])]
                total += have[1]
            merged[name] = (buckets, total)
    if "append" in merged:
        append.add_metric([], *merged["append"])
    for name in ("commitlog", "partitions"):
        if name in merged:
            fsync.add_metric([name], *merged[name])
    yield append
    yield fsync


def replica_metrics(rep_of: Callable[[], Any]) -> Callable[[], Iterable[Metric]]:
    """A collector of ``replicate --follow``'s Replicator (``rep_of()``: it, or None before it
    exists): pull bytes, records, follow lag and next offset per partition while following (its
    ``follow_stats``), and its background compaction."""

    def collect() -> Iterable[Metric]:
        rep = rep_of()
        lab = ["topic", "partition"]
        pulled = counter("replication_pull_bytes", "Bytes pulled from the master while "
                         "following.", lab)
        recs = counter("replication_pull_records", "Records pulled while following.", lab)
        lag = gauge("replication_follow_lag_records", "The master's next offset minus the "
                    "replica's, as of the last pull.", lab)
        nxt = gauge("replication_next_offset", "The replica's next offset.", lab)
        stats = sorted(rep.follow_stats.items()) if rep is not None else []
        for (t, p), (b, n, off, hwm) in stats:
            lv = [t, str(p)]
            pulled.add_metric(lv, b)
            recs.add_metric(lv, n)
            lag.add_metric(lv, max(0, hwm - off))
            nxt.add_metric(lv, off)
        yield from (pulled, recs, lag, nxt)
        if rep is not None and rep.scheduler is not None:
            yield from compaction_metrics(rep.scheduler)
    return collect
