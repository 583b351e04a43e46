"""``kcompact mirror``: copy a Kafka topic into a store, exactly once, with the local engine.

The job is the store sink connector (connectors/plugins/store_sink.py) run by an in-process worker with
one task and the writer id ``local``: it mirrors every partition (or ``--partitions``) up to the
end offsets seen at start, or keeps following with ``--follow`` (with background compaction:
``kcompact.compaction.Scheduler`` on the mirror's own store). Each partition resumes from the
store's own next offset, so killing and rerunning the command at any moment ends with every
record stored exactly once.

``--engine spark`` (the default without ``--follow``) runs ``kcompact.connectors.spark_engine.run_mirror``:
the same store sink, one Spark task per partition with writer ``spark-<topic>-<partition>``, then
a compaction stage. When Spark cannot run here (no pyspark or no Java) a defaulted engine falls
back to this local one, with a note on stderr.

Signals: SIGINT/SIGTERM stop consuming, flush the store and exit (0 after SIGTERM, 130 after
SIGINT). Progress (records/s and per-partition lag) goes to stderr every
``PROGRESS_INTERVAL`` seconds.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, TextIO

from .framework.config import parse_kv_pairs
from kcompact.reput import StoreLockedError

from .framework.api import TaskFailedError
from .errors import ConfigError, ConnectorsError
from .framework.worker import Worker

LOCAL_WRITER = "local"
CONNECTOR_NAME = "kcompact-mirror"
PROGRESS_INTERVAL = 2.0
#: -X keys that have their own flag (or that the mirror owns).
_OWN_FLAGS = {"bootstrap.servers": "--bootstrap-servers", "metadata.broker.list":
              "--bootstrap-servers"}


@dataclass
class MirrorResult:
    records: int
    seconds: float
    partitions: int
    stopped_by: str | None  # signal name, or None when the run reached its end

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


def parse_partitions(text: str | None) -> list[int] | None:
    if text is None or not text.strip():
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"--partitions: {part!r} is not a partition number or range "
                              "(examples: 0,2,5 or 0-3)") from None
    if any(p < 0 for p in out):
        raise ConfigError("--partitions: partition numbers are >= 0")
    return sorted(set(out))


def connector_props(topic: str, store: str, *, partitions: list[int] | None, follow: bool,
                    kafka_config: Mapping[str, str], writer: str = LOCAL_WRITER
                    ) -> dict[str, Any]:
    props: dict[str, Any] = {
        "name": CONNECTOR_NAME,
        "connector.class": "StoreSinkConnector",
        "tasks.max": 1,
        "topics": topic,
        "store.url": store,
        "store.writer": writer,
        "follow": follow,
        "store.compaction.background": follow,
    }
    if partitions:
        props["store.partitions"] = ",".join(map(str, partitions))
    for k, v in kafka_config.items():
        if k in _OWN_FLAGS:
            raise ConfigError(f"-X {k}: use {_OWN_FLAGS[k]} instead")
        props[f"consumer.override.{k}"] = v
    return props


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
        worst = sorted(lag.items(), key=lambda kv: (-kv[1], kv[0].partition))[:8]
        per = " ".join(f"p{tp.partition}={v:,}" for tp, v in sorted(
            worst, key=lambda kv: kv[0].partition))
        more = f" (+{len(lag) - len(worst)} more)" if len(lag) > len(worst) else ""
        errs = sum(r.metrics.errors for r in worker.runners)
        print(f"mirror: {n:,} records, {rate:,.0f} rec/s, lag {total:,}"
              + (f" [{per}{more}]" if lag else "") + (f", {errs} errors" if errs else ""),
              file=self.out, flush=True)


def mirror_local(bootstrap: str, topic: str, store: str, *, partitions: list[int] | None = None,
                 follow: bool = False, kafka_config: Mapping[str, str] | None = None,
                 out: TextIO | None = None, handle_signals: bool = True,
                 stop: threading.Event | None = None) -> MirrorResult:
    """Run the mirror in this process; returns when done, stopped, or raises on failure."""
    out = out if out is not None else sys.stderr
    worker = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0},
                    where="mirror", log=out)
    props = connector_props(topic, store, partitions=partitions, follow=follow,
                            kafka_config=kafka_config or {})
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
        worker.add_connector(props, where="mirror",
                             consumer_origin=lambda k: f"-X {k}")
        n_parts = sum(len(r.assignment) for r in worker.runners)
        print(f"mirror: {topic} ({n_parts} partitions) from {bootstrap} into {store}"
              + (" (following)" if follow else ""), file=out, flush=True)
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        t0 = time.monotonic()
        try:
            worker.run(on_tick=_Progress(out))
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
    res = MirrorResult(records, dt, n_parts, sig)
    how = f"stopped by {sig}" if sig else "done"
    print(f"mirror: {how}: {records:,} records in {dt:.1f} s ({res.rate:,.0f} rec/s)"
          + (f", {skipped} skipped" if skipped else "") + f"; store {store} flushed",
          file=out, flush=True)
    return res


def cmd_mirror(args) -> int:
    """The ``kcompact mirror`` command (connectors/cli.py)."""
    engine = args.engine or ("local" if args.follow else "spark")
    if engine == "spark":
        try:
            from . import spark_engine  # type: ignore[attr-defined]
            run = getattr(spark_engine, "run_mirror", None)
        except ImportError:
            run = None
        if run is not None:
            return int(run(args) or 0)
        print("kcompact mirror: the Spark engine cannot mirror in this build; running with "
              "--engine local", file=sys.stderr, flush=True)
    elif args.spark_master:
        raise ConfigError("--spark-master applies to --engine spark only")
    kafka_config = parse_kv_pairs(args.kafka_config, flag="-X")
    res = mirror_local(args.bootstrap_servers, args.topic, args.store,
                       partitions=parse_partitions(args.partitions), follow=args.follow,
                       kafka_config=kafka_config)
    if res.stopped_by == "SIGINT":
        return 130
    return 0


__all__ = ["MirrorResult", "cmd_mirror", "connector_props", "mirror_local", "parse_partitions"]
