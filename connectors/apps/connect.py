"""``kcompact connect standalone WORKER.properties CONNECTOR.properties...``

Kafka Connect's standalone mode: one process, connectors configured from files and, when the
worker file sets ``listeners``, Connect's REST API (connect_rest/: list, add, reconfigure, pause,
stop, restart, inspect connectors while the worker runs; it then runs until stopped). The worker
file holds ``bootstrap.servers`` and the defaults (converters, ``consumer.*``,
``producer.*``, ``offset.flush.interval.ms``...); each connector file holds ``name``,
``connector.class``, ``tasks.max``, ``topics`` and the connector's own keys. Files are Java
``.properties`` or JSON (a flat object, or Connect's REST form ``{"name":..., "config":{...}}``).
Every key is validated before anything starts: an unknown or invalid one is reported naming the
file and the key.

Runs until every task has finished (sinks with ``follow=false``) or SIGINT/SIGTERM, which stop
the tasks after their current batch and flush them (exit 0 after SIGTERM, 130 after SIGINT). A
followed topic deleted or recreated is stopped alone (framework/sink_runner.py): the run goes on
with the others and then exits 3 (options.EXIT_TOPICS_STOPPED), unless SIGINT ended it.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from ..errors import ConfigError
from ..framework.config import load_config_file
from ..framework.worker import Worker
from .options import exit_code


def run_standalone(worker_file: str, connector_files: list[str], *, out: TextIO | None = None,
                   stop: threading.Event | None = None, metrics: str | None = None,
                   stopped: dict[str, str] | None = None) -> str | None:
    """Run the connectors; returns the name of the signal that stopped them, if any.
    ``metrics`` (HOST:PORT) overrides the worker file's ``metrics.listen``; ``stopped``, when
    given, receives the topics stopped while the others went on (deleted or recreated) -> why."""
    out = out if out is not None else sys.stderr
    props = load_config_file(worker_file)
    if metrics:
        props["metrics.listen"] = metrics
    worker = Worker(props, where=worker_file, log=out, command="connect standalone")
    conns = [(path, load_config_file(path)) for path in connector_files]
    received: list[int] = []
    if worker.config["listeners"]:
        return _run_rest(worker, worker_file, conns, out=out, stop=stop, stopped=stopped)
    if not conns:
        raise ConfigError(f"{worker_file}: no connector file given, and no REST API to add "
                          "one with (set listeners, e.g. listeners=http://127.0.0.1:8083)")

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        print(f"connect: {signal.Signals(signum).name}: stopping tasks and flushing", file=out,
              flush=True)
        worker.stop()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for path, p in conns:
            runners = worker.add_connector(p, where=path)
            name = p.get("name")
            parts = sum(len(getattr(r, "assignment", ())) for r in runners)
            print(f"connect: {name}: {len(runners)} task(s)"
                  + (f", {parts} partitions" if parts else ""), file=out, flush=True)
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        worker.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for r in worker.runners:
        print(f"connect: {r.metrics.summary()}", file=out, flush=True)
    if stopped is not None:
        stopped.update(worker.stopped_topics())
    return signal.Signals(received[0]).name if received else None


def _run_rest(worker: Worker, worker_file: str, conns: list, *, out: TextIO,
              stop: threading.Event | None, stopped: dict[str, str] | None) -> str | None:
    """The worker with Connect's REST API: runs until SIGINT/SIGTERM (or ``stop``)."""
    import os
    from kcompact.connectors.framework.gcmode import bulk_gc
    from .connect_rest import start_rest
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        print(f"connect: {signal.Signals(signum).name}: stopping tasks and flushing", file=out,
              flush=True)
        worker.stop()

    state_dir = worker.config["connectors.state.dir"] or \
        f"{os.path.splitext(os.path.abspath(worker_file))[0]}.connectors"
    rest = start_rest(worker, state_dir=state_dir, log=out)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics = None
    try:
        if worker.config["metrics.listen"]:
            from kcompact.replication.ops import start_ops
            metrics = start_ops(worker.ops, worker.config["metrics.listen"],
                                lambda m: print(f"kcompact: {m}", file=out, flush=True))
        rest.herder.load(conns)
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        interval = worker.config["metrics.log.interval.ms"] / 1000
        with bulk_gc():
            while not worker.stop_event.wait(interval or 3600):
                for r in list(worker.runners):
                    print(f"kcompact: {r.metrics.summary()}", file=out, flush=True)
    finally:
        worker.stop()
        try:
            rest.herder.shutdown()
        finally:
            rest.stop()
            if metrics is not None:
                metrics.stop()
            worker.close_ops()
            for s, h in previous.items():
                signal.signal(s, h)
    for r in rest.herder.finished_runners:
        print(f"connect: {r.metrics.summary()}", file=out, flush=True)
    if stopped is not None:
        for r in rest.herder.finished_runners:
            stopped.update(r.metrics.stopped)
    return signal.Signals(received[0]).name if received else None


@dataclass(frozen=True)
class ConnectOptions:
    """``kcompact connect standalone``'s options: the worker's file and the connectors' files."""

    worker: str
    connectors: tuple[str, ...]
    metrics: str | None = None       # --metrics HOST:PORT (else the worker's metrics.listen)


def run_connect(opts: ConnectOptions) -> int:
    """``kcompact connect standalone``: 130 when stopped by SIGINT, 3 when topics were stopped
    (deleted or recreated while followed), else 0."""
    stopped: dict[str, str] = {}
    stopped_by = run_standalone(opts.worker, list(opts.connectors), metrics=opts.metrics,
                                stopped=stopped)
    return exit_code(stopped_by, stopped)
