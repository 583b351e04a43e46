"""``kcompact mirror``: copy Kafka topics into a store, exactly once; the engine is chosen here.

The topics: ``--topic`` (repeatable) and those ``--topics-regex`` matches whole, internal ones
and ``--exclude-regex`` matches left out (framework/topic_sets.py). Before any record of a topic
is copied its configs are synced from Kafka into the store (plugins/config_sync.py;
``--no-sync-configs``): by the store sink's task when it opens the topic (at start, and when a
``--follow`` mirror picks a topic up), then again at each metadata refresh.

The job is the store sink connector (connectors/plugins/store_sink.py). With the local engine
(:func:`mirror_local`) an in-process worker runs it with one task and the writer id ``local``:
it mirrors every partition (or ``--partitions``) up to the end offsets seen at start, or keeps
following with ``--follow`` (with background compaction: ``kcompact.compaction.Scheduler`` on
the mirror's own store; new partitions and newly matching topics are picked up, configs synced
again at each metadata refresh; a followed topic deleted or recreated is stopped alone, the
others going on, and the run then exits 3: options.EXIT_TOPICS_STOPPED). Each partition resumes
from the store's own next offset, so killing and rerunning the command at any moment ends with
every record stored exactly once.

``--engine spark`` (the default without ``--follow``) runs the same store sink in one Spark task
per topic-partition with writer ``spark-<topic>-<partition>``, then a compaction stage
(apps/spark/mirror_job.py). When Spark cannot run here (no Java) a defaulted engine falls back to
the local one, with a note on stderr; an explicit ``--engine spark`` says why it cannot run.

Signals: SIGINT/SIGTERM stop consuming, flush the store and exit (0 after SIGTERM, 130 after
SIGINT). Progress (records/s and per-partition lag) goes to stderr every
``PROGRESS_INTERVAL`` seconds.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TextIO

from kcompact.reput import StoreLockedError

from ..errors import ConfigError, ConnectorsError
from ..framework.api import TaskFailedError
from ..framework.worker import Worker
from ..plugins.config_sync import ConfigFollower
from .options import LOCAL_WRITER, MirrorOptions, add_mirror, exit_code, lag_text, mirror_props

PROGRESS_INTERVAL = 2.0


@dataclass
class MirrorResult:
    records: int
    seconds: float
    partitions: int
    stopped_by: str | None  # signal name, or None when the run reached its end
    #: topics stopped while the others went on (deleted or recreated) -> why
    stopped_topics: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


class _Progress:
    def __init__(self, out: TextIO, interval: float = PROGRESS_INTERVAL):
        self.out, self.interval = out, interval
        self.t0 = time.monotonic()
        self.last_t, self.last_n = self.t0, 0

    def __call__(self, worker: Worker) -> None:
        now = time.monotonic()
        if now - self.last_t < self.interval:
            return
        n = sum(r.metrics.records for r in worker.runners)
        rate = (n - self.last_n) / (now - self.last_t)
        self.last_t, self.last_n = now, n
        lag: dict = {}
        for r in worker.runners:
            lag.update(r.metrics.lag())
        total = sum(lag.values())
        errs = sum(r.metrics.errors for r in worker.runners)
        stopped = worker.stopped_topics()
        down = [r.metrics for r in worker.runners if r.metrics.disconnected_since is not None]
        if down:  # while no broker answers, the lag is unknown (not 0)
            first = min(down, key=lambda m: m.disconnected_since)
            state = f"{first.disconnected_text()}: no broker answers, retrying; lag unknown"
        else:
            state = f"lag {total:,}" + (f" [{lag_text(lag)}]" if lag else "")
        print(f"mirror: {n:,} records, {rate:,.0f} rec/s, {state}"
              + (f", {errs} errors" if errs else "") + stopped_text(stopped),
              file=self.out, flush=True)


def stopped_text(stopped: Mapping[str, str]) -> str:
    """``, 1 topic stopped (orders)`` (progress and final lines), or ``""``."""
    if not stopped:
        return ""
    n = len(stopped)
    return f", {n} topic{'s' if n > 1 else ''} stopped ({', '.join(sorted(stopped))})"


def live_topics(worker: Worker) -> list[str]:
    """The topics the worker's tasks mirror, less those stopped (whose configs are no longer
    synced: a recreated topic's are not the stored one's)."""
    stopped = worker.stopped_topics()
    return sorted({tp.topic for r in worker.runners for tp in r.assignment} - set(stopped))


def _per_topic(worker: Worker) -> dict[str, list[int]]:
    """Records read and partitions of each topic the worker's tasks mirror."""
    out: dict[str, list[int]] = {}
    for r in worker.runners:
        for tp in r.assignment:
            out.setdefault(tp.topic, [0, 0])[1] += 1
        for topic, n in r.metrics.records_by_topic().items():
            out.setdefault(topic, [0, 0])[0] += n
    return out


def _unsealed_text(worker: Worker) -> str:
    """The final line's note on rolled segments the mirror left in store format 1 (sealed in
    the background, not waited for at the end: reput/seal.py)."""
    n = sum(getattr(r.task, "seals_left", 0) for r in worker.runners)
    return (f"; {n} rolled segment{'s' if n != 1 else ''} left in store format 1 (readable; "
            "the next mirror, or `kcompact compact` once past min.compaction.lag.ms, seals "
            "them)" if n else "")


def _task_stores(worker: Worker) -> list:
    return [r.task.store for r in worker.runners if getattr(r.task, "store", None) is not None]


#: a mirror's flush interval into an S3 store with shared uploads (2 requests a flush whatever
#: the partition count: the live edge within about a second), and into any other store
SHARED_FLUSH_MS = 500
FLUSH_MS = 5_000


def default_flush_interval_ms(store: str, upload: str = "auto") -> int:
    """500 ms for an S3 store whose flushes are shared uploads (``upload`` shared, or auto on
    a new store or one that uses them: store.json is read to tell), else 5 s (Kafka Connect's
    offset.flush.interval.ms: a flush of per-partition uploads costs requests per partition)."""
    if not store.startswith("s3://") or upload == "partition":
        return FLUSH_MS
    if upload == "shared":
        return SHARED_FLUSH_MS
    from kcompact.reput import shared as SH
    from kcompact.reput.store import backend_for
    try:
        raw = backend_for(store).read("store.json")
    except FileNotFoundError:
        return SHARED_FLUSH_MS  # created by this mirror, with shared uploads
    except Exception:  # noqa: BLE001 - the store's open reports it
        return FLUSH_MS
    try:
        import json
        return SHARED_FLUSH_MS if SH.FEATURE in (json.loads(raw).get("features") or []) \
            else FLUSH_MS
    except (ValueError, AttributeError):
        return FLUSH_MS


def mirror_local(bootstrap: str, topic: str | Sequence[str] | None, store: str, *,
                 partitions: tuple[int, ...] | list[int] | None = None,
                 follow: bool = False, kafka_config: Mapping[str, str] | None = None,
                 out: TextIO | None = None, handle_signals: bool = True,
                 stop: threading.Event | None = None, metrics: str | None = None,
                 topics_regex: str | None = None, exclude_regex: str | None = None,
                 sync_configs: bool = True, sync_groups: bool = True,
                 groups: str | None = None, exclude_groups: str | None = None,
                 groups_interval_ms: int | None = None, upload: str = "auto",
                 sync_acls: bool = True, acls_interval_ms: int | None = None,
                 schema_registry: str | None = None,
                 flush_interval_ms: int | None = None) -> MirrorResult:
    """Run the mirror of ``topic`` (one name or several) and the topics ``topics_regex``
    matches in this process; returns when done, stopped, or raises on failure.
    ``metrics``: HOST:PORT of its Prometheus metrics and health check. ``flush_interval_ms``:
    how often the store is flushed (default: ``default_flush_interval_ms``)."""
    out = out if out is not None else sys.stderr
    kafka_config = dict(kafka_config or {})
    if flush_interval_ms is None:
        flush_interval_ms = default_flush_interval_ms(store, upload)
    worker = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0,
                     "metrics.listen": metrics or "",
                     "offset.flush.interval.ms": flush_interval_ms}, where="mirror", log=out)
    props = mirror_props(topic, store, partitions=partitions, follow=follow,
                         kafka_config=kafka_config, topics_regex=topics_regex,
                         exclude_regex=exclude_regex, sync_configs=sync_configs,
                         sync_groups=sync_groups, groups=groups, exclude_groups=exclude_groups,
                         groups_interval_ms=groups_interval_ms, upload=upload,
                         sync_acls=sync_acls, acls_interval_ms=acls_interval_ms,
                         schema_registry=schema_registry)
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        if not received:
            print(f"mirror: {signal.Signals(signum).name}: stopping after the current batch and "
                  "flushing the store", file=out, flush=True)
        received.append(signum)
        worker.stop()

    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        add_mirror(worker, props)
        connector = worker.connectors[-1]
        if getattr(connector, "config_sync", None) is not None:
            # the tasks sync each topic when they open it, and while following a thread of
            # the connector syncs again at each metadata refresh; its lines are the mirror's
            connector.config_sync.prefix = "mirror"
        group_sync = getattr(connector, "group_sync", None)
        acl_sync = getattr(connector, "acl_sync", None)
        schema_sync = getattr(connector, "schema_sync", None)
        topics = list(connector.props["topics"])
        n_parts = sum(len(r.assignment) for r in worker.runners)
        what = topics[0] if len(topics) == 1 else f"{len(topics)} topics"
        print(f"mirror: {what} ({n_parts} partitions) from {bootstrap} into {store}"
              + (" (following)" if follow else ""), file=out, flush=True)
        if len(topics) > 1:
            print(f"mirror: topics: {', '.join(topics)}", file=out, flush=True)
        ticks = [_Progress(out)]
        if follow and not sync_configs:
            # no sync: the tasks' stores still re-read store.json at each metadata refresh,
            # so a `kcompact configs --alter` reaches the background compaction
            ticks.append(ConfigFollower(
                bootstrap, lambda: live_topics(worker), store, kafka_config, out=out,
                sync=False,
                on_synced=lambda: [s.reload_topic_configs() for s in _task_stores(worker)]))
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        t0 = time.monotonic()
        try:
            worker.run(on_tick=lambda w: [tick(w) for tick in ticks])
        except TaskFailedError as e:
            if isinstance(e.__cause__, StoreLockedError):
                raise ConnectorsError(
                    f"another process is writing to {store} as writer '{LOCAL_WRITER}' (a "
                    "mirror still running?); stop it first: one local mirror per store at a "
                    "time") from None
            raise
        dt = time.monotonic() - t0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    records = sum(r.metrics.records for r in worker.runners)
    skipped = sum(r.metrics.skipped for r in worker.runners)
    sig = signal.Signals(received[0]).name if received else None
    stopped = worker.stopped_topics()
    res = MirrorResult(records, dt, n_parts, sig, stopped)
    how = f"stopped by {sig}" if sig else "done"
    per = _per_topic(worker)
    if len(per) > 1:
        for t, (n, parts) in sorted(per.items()):
            print(f"mirror: {t}: {n:,} records ({parts} partitions)"
                  + (f", stopped: {stopped[t]}" if t in stopped else ""), file=out, flush=True)
    kept = ""
    if group_sync is not None and group_sync.captures:
        kept = (f", group offsets captured {group_sync.captures} time"
                f"{'s' if group_sync.captures > 1 else ''} ({group_sync.kept:,} positions kept)")
    if acl_sync is not None and acl_sync.captures:
        n = len(acl_sync.writer.kept())
        kept += f", ACLs captured ({n} binding{'' if n == 1 else 's'} kept)"
    if schema_sync is not None:
        kept += f", {schema_sync.kept} new schema{'' if schema_sync.kept == 1 else 's'} kept"
    print(f"mirror: {how}: {records:,} records in {dt:.1f} s ({res.rate:,.0f} rec/s)"
          + kept + (f", {len(per)} topics" if len(per) > 1 else "")
          + (f", {skipped} skipped" if skipped else "") + stopped_text(stopped)
          + f"; store {store} flushed" + _unsealed_text(worker), file=out, flush=True)
    refused = worker.refused_partitions()
    if refused:  # the others were mirrored; the run is not complete (issue 44)
        (tp, why), more = sorted(refused.items(), key=lambda kv: (kv[0].topic,
                                                                   kv[0].partition))[0], \
            len(refused) - 1
        raise ConnectorsError(f"{tp.topic}-{tp.partition}"
                              + (f" (and {more} more partitions)" if more else "")
                              + f" was not mirrored: {why}")
    return res


def run_mirror(opts: MirrorOptions) -> int:
    """``kcompact mirror``: the engine ``opts`` names (or the default one), then the exit code."""
    engine = opts.engine or ("local" if opts.follow or opts.schema_registry else "spark")
    if engine == "spark":
        if opts.follow:
            raise ConfigError("--follow needs --engine local: the Spark engine runs batch mirrors "
                              "(to the end offsets seen at start)")
        from .spark.session import spark_available
        why = spark_available()
        if why is None:
            from .spark.mirror_job import run_spark_mirror
            return run_spark_mirror(opts)
        if opts.engine == "spark":
            from .spark.errors import SparkEngineError
            raise SparkEngineError(f"--engine spark: {why}; or use --engine local")
        print(f"kcompact mirror: the Spark engine cannot run ({why}); running with --engine "
              "local", file=sys.stderr, flush=True)
    if opts.spark_master:
        raise ConfigError("--spark-master applies to --engine spark only")
    if opts.metrics and not opts.follow:
        raise ConfigError("--metrics applies to mirror --follow (a long-running mirror) only")
    res = mirror_local(opts.bootstrap_servers, opts.named_topics, opts.store,
                       partitions=opts.partitions, follow=opts.follow,
                       kafka_config=opts.kafka_config, metrics=opts.metrics,
                       topics_regex=opts.topics_regex, exclude_regex=opts.exclude_regex,
                       sync_configs=opts.sync_configs, sync_groups=opts.sync_groups,
                       groups=opts.groups, exclude_groups=opts.exclude_groups,
                       groups_interval_ms=opts.groups_interval_ms, upload=opts.upload,
                       sync_acls=opts.sync_acls, acls_interval_ms=opts.acls_interval_ms,
                       schema_registry=opts.schema_registry,
                       flush_interval_ms=opts.flush_interval_ms)
    return exit_code(res.stopped_by, res.stopped_topics)


__all__ = ["MirrorOptions", "MirrorResult", "live_topics", "mirror_local", "run_mirror"]
