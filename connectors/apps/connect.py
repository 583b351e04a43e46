"""``kcompact connect standalone WORKER.properties [CONNECTOR.properties...]``

Kafka Connect's standalone mode: one process, connectors configured from files, and Connect's
REST API at the worker's ``listeners`` (default ``http://127.0.0.1:8083``, as Apache's; empty =
none; connect_rest/: list, add, reconfigure, pause, stop, restart, inspect connectors while the
worker runs). The worker file holds ``bootstrap.servers`` and the defaults (converters,
``consumer.*``, ``producer.*``, ``offset.flush.interval.ms``...); each connector file holds
``name``, ``connector.class``, ``tasks.max``, ``topics`` and the connector's own keys. Files are
Java ``.properties`` or JSON (a flat object, or Connect's REST form ``{"name":...,
"config":{...}}``). Every key of every file is validated before anything starts: an unknown or
invalid one is reported naming the file and the key.

With connector files (and ``exit.when.finished=true``, the default) the run ends once no
connector has work left (every task ended by itself: sinks with ``follow=false``; a connector
paused or stopped through the API counts as work), and a failed task of a file's connector ends
it (exit 1), as before the API; else, and without connector files, it runs until SIGINT/SIGTERM
as Apache's worker does. SIGINT/SIGTERM stop the tasks after their current batch and flush them
(exit 0 after SIGTERM, 130 after SIGINT). A followed topic deleted or recreated is stopped alone
(framework/sink_runner.py): the run goes on with the others and then exits 3
(options.EXIT_TOPICS_STOPPED), unless SIGINT ended it. The default listener's port already
taken is one warning line (the run goes on without the API); a ``listeners`` the worker file
gives that cannot be bound is an error.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from ..errors import ConfigError
from ..framework.config import load_config_file
from ..framework.worker import Worker, raise_task_failure, validate_connector
from .options import exit_code


def run_standalone(worker_file: str, connector_files: list[str], *, out: TextIO | None = None,
                   stop: threading.Event | None = None, metrics: str | None = None,
                   stopped: dict[str, str] | None = None) -> str | None:
    """Run the connectors; returns the name of the signal that stopped them, if any.
    ``metrics`` (HOST:PORT) overrides the worker file's ``metrics.listen``; ``stopped``, when
    given, receives the topics stopped while the others went on (deleted or recreated) -> why."""
    import os
    from kcompact.connectors.framework.gcmode import bulk_gc
    from .connect_rest import Herder, start_rest
    out = out if out is not None else sys.stderr
    props = load_config_file(worker_file)
    if metrics:
        props["metrics.listen"] = metrics
    worker = Worker(props, where=worker_file, log=out, command="connect standalone")
    conns = [(path, load_config_file(path)) for path in connector_files]
    listeners = worker.config["listeners"].strip()
    if not conns and not listeners:
        raise ConfigError(f"{worker_file}: no connector file given, and no REST API to add "
                          "one with (listeners is empty; e.g. listeners=http://127.0.0.1:8083)")
    for path, p in conns:  # every file's keys checked before anything starts
        validate_connector(p, where=path)
    # with connector files, the run ends when they have no work left (exit.when.finished)
    batch = bool(conns) and worker.config["exit.when.finished"]
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        print(f"connect: {signal.Signals(signum).name}: stopping tasks and flushing", file=out,
              flush=True)
        worker.stop()

    state_dir = worker.config["connectors.state.dir"] or \
        f"{os.path.splitext(os.path.abspath(worker_file))[0]}.connectors"
    herder = Herder(worker, state_dir=state_dir, log=out, fatal_failures=batch)
    rest = start_rest(worker, herder, listeners, required="listeners" in props or not conns,
                      where=worker_file, log=out) if listeners else None
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    metrics_server = None
    failed = None
    try:
        if worker.config["metrics.listen"]:
            from kcompact.replication.ops import start_ops
            metrics_server = start_ops(worker.ops, worker.config["metrics.listen"],
                                       lambda m: print(f"kcompact: {m}", file=out, flush=True))
        herder.load(conns)
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
        interval = worker.config["metrics.log.interval.ms"] / 1000
        last_log = time.monotonic()
        with bulk_gc():
            while not worker.stop_event.wait(0.2):
                if batch:
                    failed = herder.failed_file_task()
                    if failed is not None or herder.finished():
                        break
                if interval and time.monotonic() - last_log >= interval:
                    last_log = time.monotonic()
                    for r in list(worker.runners):
                        print(f"kcompact: {r.metrics.summary()}", file=out, flush=True)
    finally:
        worker.stop()
        try:
            herder.shutdown()
        finally:
            if rest is not None:
                rest.stop()
            if metrics_server is not None:
                metrics_server.stop()
            worker.close_ops()
            for s, h in previous.items():
                signal.signal(s, h)
    for r in herder.finished_runners:
        print(f"connect: {r.metrics.summary()}", file=out, flush=True)
    if failed is not None:
        raise_task_failure(failed)
    if stopped is not None:
        for r in herder.finished_runners:
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
