"""The standalone herder: the connectors of one ``kcompact connect standalone`` worker, as the
REST API (server.py) sees and changes them (Kafka Connect's ``StandaloneHerder``).

Each connector has a *target state* (``STARTED``, ``PAUSED``, ``STOPPED``: what the user asked)
and, while started, its task runners in the :class:`~kcompact.connectors.framework.worker.Worker`
under a stop event of its own, so one connector can be paused, stopped, restarted, reconfigured
or deleted while the others run. Pausing stops the tasks after their current batch and flushes
them (a store sink's tasks resume from the store's next offsets, so nothing is lost or repeated);
STOPPED also forgets the task configs, as KIP-875 has it.

A connector created or changed through the API is validated as a file is (``add_connector``: a
:class:`~kcompact.errors.ConfigError` is a 400 naming the key and changes nothing), and kept in
the worker's ``connectors.state.dir`` (docs/formats/connect-state.md), so a restart brings it back
with its target state; Apache's standalone worker forgets it. The connectors named on the command
line are loaded from their files at every start; a state file of the same name is ignored.

Every operation runs under one lock (the API's requests are handled in a thread pool); a start
that fails other than on its config leaves the connector ``FAILED`` with the error's trace, as
Connect does.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TextIO

from ...errors import ConfigError, ConnectorsError
from ...framework.api import SinkConnector, SourceConnector
from ...framework.worker import Worker, connector_class, validate_connector

#: Version of a connector's state file (docs/formats/connect-state.md).
STATE_FORMAT_VERSION = 1
TARGET_STATES = ("STARTED", "PAUSED", "STOPPED")


class ConnectRestError(ConnectorsError):
    """A request the API refuses: the HTTP status and Connect's message
    (``{"error_code": status, "message": ...}``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(name: str) -> ConnectRestError:
    return ConnectRestError(404, f"Connector {name} not found")


@dataclass
class Managed:
    """One connector of the herder."""

    name: str
    config: dict[str, str]
    type: str = "unknown"                 # sink | source | unknown (class not loadable)
    target: str = "STARTED"
    from_file: str | None = None          # the command-line file it came from
    stop: threading.Event | None = None   # while its runners exist
    runners: list = field(default_factory=list)
    task_configs: list[dict[str, str]] = field(default_factory=list)
    trace: str | None = None              # the connector's start failure
    restarting: set = field(default_factory=set)   # task ids (and -1: the connector)
    topics: set = field(default_factory=set)       # KIP-558's active topics


def _strings(props: Mapping[str, Any]) -> dict[str, str]:
    """Connect's configs are strings: JSON numbers and booleans become their text."""
    out = {}
    for k, v in props.items():
        if isinstance(v, bool):
            out[str(k)] = "true" if v else "false"
        elif v is None:
            out[str(k)] = ""
        else:
            out[str(k)] = str(v)
    return out


def _trace(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def connector_type(config: Mapping[str, Any]) -> str:
    try:
        cls = connector_class(str(config.get("connector.class") or ""))
    except ConfigError:
        return "unknown"
    return "sink" if issubclass(cls, SinkConnector) else \
        "source" if issubclass(cls, SourceConnector) else "unknown"


class Herder:
    """The connectors of ``worker`` and their lifecycle (module docstring)."""

    def __init__(self, worker: Worker, *, state_dir: str | None, log: TextIO,
                 worker_id: str | None = None, fatal_failures: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.worker = worker
        self.state_dir = state_dir
        #: Connect's worker id: the REST listener's host:port (start_rest sets it)
        self.worker_id = worker_id or default_worker_id("127.0.0.1", 8083)
        #: a failed task of a command line's connector ends the run (exit.when.finished)
        self.fatal_failures = fatal_failures
        self.log = log
        self.lock = threading.RLock()
        self.connectors: dict[str, Managed] = {}
        self._clock = clock
        #: the runners stopped at shutdown (their summaries, the topics they stopped)
        self.finished_runners: list = []

    def say(self, message: str) -> None:
        print(f"connect: {message}", file=self.log, flush=True)

    # -- loading -------------------------------------------------------------------------------

    def load(self, files: list[tuple[str, dict[str, Any]]]) -> None:
        """Start the command line's connectors (an error is fatal, as without the API), then
        those kept in the state directory (an error leaves that one FAILED)."""
        with self.lock:
            for path, props in files:
                name = str(props.get("name") or "")
                m = Managed(name=name, config=_strings(props), from_file=path,
                            type=connector_type(props))
                self._start(m, where=path, fatal=True)
                self.connectors[m.name] = m
            for m in self._read_state():
                if m.name in self.connectors:
                    self.say(f"{m.name}: defined by {self.connectors[m.name].from_file} on the "
                             "command line; its state file (an earlier API change) is ignored")
                    continue
                self.connectors[m.name] = m
                if m.target != "STOPPED":
                    self._start(m, where=f"connector {m.name}", fatal=False,
                                run=m.target == "STARTED")
                self.say(f"{m.name}: loaded from {self._state_path(m.name)} ({m.target})")

    # -- state files ---------------------------------------------------------------------------

    def _state_path(self, name: str) -> str:
        assert self.state_dir is not None
        return os.path.join(self.state_dir, urllib.parse.quote(name, safe="") + ".json")

    def _persist(self, m: Managed) -> None:
        if not self.state_dir:
            return
        os.makedirs(self.state_dir, exist_ok=True)
        path = self._state_path(m.name)
        doc = {"format": STATE_FORMAT_VERSION, "name": m.name, "config": m.config,
               "target_state": m.target}
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.state_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _unpersist(self, name: str) -> None:
        if self.state_dir:
            try:
                os.unlink(self._state_path(name))
            except FileNotFoundError:
                pass

    def _read_state(self) -> list[Managed]:
        if not self.state_dir or not os.path.isdir(self.state_dir):
            return []
        out = []
        for fn in sorted(os.listdir(self.state_dir)):
            if not fn.endswith(".json"):
                continue
            path = os.path.join(self.state_dir, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                if doc.get("format") != STATE_FORMAT_VERSION:
                    raise ValueError(f"format {doc.get('format')!r}, expected "
                                     f"{STATE_FORMAT_VERSION}")
                config, target = _strings(doc["config"]), doc.get("target_state", "STARTED")
                if target not in TARGET_STATES:
                    raise ValueError(f"target_state {target!r}")
                name = str(doc["name"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConnectorsError(f"{path}: not a connector state file ({e}); move it out "
                                      "of connectors.state.dir") from None
            out.append(Managed(name=name, config=config, target=target,
                               type=connector_type(config)))
        return out

    # -- running a connector -------------------------------------------------------------------

    def _start(self, m: Managed, *, where: str, fatal: bool, run: bool = True) -> None:
        """Add the connector's runners to the worker and start them (``run`` false: only make
        its task configs, for a PAUSED connector). A ConfigError is raised (nothing changed);
        another error is raised when ``fatal``, else leaves it FAILED."""
        stop = threading.Event()
        m.trace = None
        try:
            runners = self.worker.add_connector(m.config, where=where, stop=stop)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - Connect's FAILED connector, with its trace
            if fatal:
                raise
            m.trace = _trace(e)
            m.runners, m.stop, m.task_configs = [], None, []
            self.say(f"{m.name}: failed to start: {e}")
            return
        m.stop, m.runners = stop, runners
        m.task_configs = [_strings({k: v for k, v in r.props.items()
                                    if isinstance(v, (str, int, float, bool, type(None)))})
                          for r in runners]
        for r in runners:
            m.topics.update(getattr(r, "connector_topics", ()) or ())
        if not run:
            self.worker.remove_connector(m.name)  # never started: nothing to flush
            m.stop, m.runners = None, []
            return
        for r in runners:
            r.start()
        parts = sum(len(getattr(r, "assignment", ())) for r in runners)
        self.say(f"{m.name}: {len(runners)} task(s)" + (f", {parts} partitions" if parts else ""))

    def _halt(self, m: Managed) -> None:
        """Stop the connector's tasks (flushing them) and the connector."""
        if m.stop is not None:
            for r in m.runners:
                m.topics.update(r.metrics.by_topic)
            self.worker.remove_connector(m.name)
        m.stop, m.runners = None, []

    def get(self, name: str) -> Managed:
        m = self.connectors.get(name)
        if m is None:
            raise not_found(name)
        return m

    # -- the API's operations ------------------------------------------------------------------

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.connectors)

    def create(self, name: str, config: Mapping[str, Any]) -> Managed:
        config = _strings(config)
        config.setdefault("name", name)
        with self.lock:
            if name in self.connectors:
                raise ConnectRestError(409, f"Connector {name} already exists")
            m = Managed(name=name, config=config, type=connector_type(config))
            self._start(m, where=f"connector {name}", fatal=False)
            self.connectors[name] = m
            self._persist(m)
            return m

    def put_config(self, name: str, config: Mapping[str, Any]) -> tuple[Managed, bool]:
        """(connector, created)."""
        config = _strings(config)
        if "name" in config and config["name"] != name:
            raise ConnectRestError(400, f"Connector name configuration ({config['name']}) "
                                   f"doesn't match connector name in the URL ({name})")
        config["name"] = name
        with self.lock:
            m = self.connectors.get(name)
            if m is None:
                return self.create(name, config), True
            where = f"connector {name}"
            validate_connector(config, where=where)  # a bad key: 400 before anything stops
            old = m.config
            self._halt(m)
            m.config, m.type = config, connector_type(config)
            if m.target == "STARTED":
                try:
                    self._start(m, where=where, fatal=False)
                except ConfigError:
                    m.config, m.type = old, connector_type(old)
                    self._start(m, where=where, fatal=False)
                    raise
            self._persist(m)
            return m, False

    def delete(self, name: str) -> None:
        with self.lock:
            m = self.get(name)
            self._halt(m)
            del self.connectors[name]
            self._unpersist(name)
            self.say(f"{name}: deleted")

    def set_target(self, name: str, target: str) -> None:
        """PAUSED, STOPPED (the tasks stop), or STARTED (they start again)."""
        with self.lock:
            m = self.connectors.get(name)
            if m is None:
                raise ConnectRestError(404, f"Unknown connector {name}")
            if m.target == target:
                return
            if target == "STARTED":
                m.target = target
                self._start(m, where=f"connector {name}", fatal=False)
            else:
                n = len(m.runners)
                self._halt(m)
                if target == "PAUSED" and m.target == "STARTED":
                    m.task_configs = m.task_configs[:n] or m.task_configs
                if target == "STOPPED":
                    m.task_configs = []
                if target == "PAUSED" and m.target == "STOPPED":
                    self._start(m, where=f"connector {name}", fatal=False, run=False)
                m.target = target
            self._persist(m)
            self.say(f"{name}: {target}")

    def restart(self, name: str, *, include_tasks: bool, only_failed: bool
                ) -> dict[str, Any] | None:
        """KIP-745: with ``include_tasks``, the status with what restarts as RESTARTING (the
        restart goes on in the background); else the connector restarts now, None."""
        with self.lock:
            m = self.get(name)
            failed = self._failed(m)
            if not include_tasks:
                if only_failed and -1 not in failed:
                    return None
                self._restart_now(m)
                return None
            picked = {i for i in failed} if only_failed else \
                {-1, *range(len(m.runners))}
            if m.target != "STARTED" or not picked:
                return self.status(name)
            m.restarting = picked
            status = self.status(name)
            threading.Thread(target=self._restart_later, args=(m,), daemon=True,
                             name=f"restart-{name}").start()
            return status

    def _failed(self, m: Managed) -> set[int]:
        out = {i for i, r in enumerate(m.runners) if r.failure is not None}
        if m.target == "STARTED" and m.trace is not None:
            out.add(-1)
        return out

    def _restart_now(self, m: Managed) -> None:
        if m.target != "STARTED":
            return
        self._halt(m)
        try:
            self._start(m, where=f"connector {m.name}", fatal=False)
        except ConfigError as e:
            m.trace = _trace(e)

    def _restart_later(self, m: Managed) -> None:
        with self.lock:
            try:
                if self.connectors.get(m.name) is m:
                    self._restart_now(m)
            finally:
                m.restarting = set()

    def restart_task(self, name: str, task: int) -> None:
        """Only that task restarts (after its current batch, flushed; same config and
        partitions), the connector's other tasks going on; a connector that makes its own
        runners (the store source: one task) restarts whole."""
        with self.lock:
            m = self.get(name)
            if not 0 <= task < len(m.task_configs):
                raise ConnectRestError(404, f"Task {name}-{task} not found")
            if m.target != "STARTED":
                return
            if m.stop is None or task >= len(m.runners):
                self._restart_now(m)  # not running (failed to start): start it all again
                return
            new = self.worker.restart_task(name, task)
            if new is None:
                self._restart_now(m)
                return
            m.topics.update(m.runners[task].metrics.by_topic)
            m.runners[task] = new
            new.start()
            self.say(f"{name}: task {task} restarted")

    # -- views ---------------------------------------------------------------------------------

    def _task_state(self, m: Managed, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"id": i}
        if i in m.restarting:
            out["state"] = "RESTARTING"
        elif m.target == "PAUSED":
            out["state"] = "PAUSED"
        elif i >= len(m.runners):
            out["state"] = "UNASSIGNED"
        else:
            r = m.runners[i]
            if r.failure is not None:
                out["state"] = "FAILED"
                out["trace"] = _trace(r.failure)
            elif r.alive:
                out["state"] = "RUNNING"
            else:  # not started yet, or a bounded task (follow=false) that ended
                out["state"] = "UNASSIGNED"
        out["worker_id"] = self.worker_id
        return out

    def connector_state(self, m: Managed) -> dict[str, Any]:
        if -1 in m.restarting:
            state = "RESTARTING"
        elif m.target in ("PAUSED", "STOPPED"):
            state = m.target
        elif m.trace is not None:
            state = "FAILED"
        elif m.runners:
            state = "RUNNING"
        else:
            state = "UNASSIGNED"
        out: dict[str, Any] = {"state": state, "worker_id": self.worker_id}
        if state == "FAILED":
            out["trace"] = m.trace
        return out

    def status(self, name: str) -> dict[str, Any]:
        with self.lock:
            m = self.connectors.get(name)
            if m is None:
                raise ConnectRestError(404, f"No status found for connector {name}")
            n = 0 if m.target == "STOPPED" else len(m.task_configs)
            return {"name": name, "connector": self.connector_state(m),
                    "tasks": [self._task_state(m, i) for i in range(n)], "type": m.type}

    def task_status(self, name: str, task: int) -> dict[str, Any]:
        with self.lock:
            m = self.get(name)
            n = 0 if m.target == "STOPPED" else len(m.task_configs)
            if not 0 <= task < n:
                raise ConnectRestError(404, f"No status found for task {name}-{task}")
            return self._task_state(m, task)

    def info(self, name: str) -> dict[str, Any]:
        with self.lock:
            m = self.get(name)
            return {"name": name, "config": dict(m.config),
                    "tasks": [{"connector": name, "task": i}
                              for i in range(len(m.task_configs))], "type": m.type}

    def tasks(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            m = self.get(name)
            return [{"id": {"connector": name, "task": i}, "config": dict(c)}
                    for i, c in enumerate(m.task_configs)]

    def active_topics(self, name: str) -> list[str]:
        with self.lock:
            m = self.get(name)
            topics = set(m.topics)
            for r in m.runners:
                topics.update(r.metrics.by_topic)
            return sorted(topics)

    def reset_topics(self, name: str) -> None:
        with self.lock:
            self.get(name).topics.clear()

    def states(self) -> list[tuple[str, str, str, list[str]]]:
        """(connector, type, its state, its tasks' states), for the metrics."""
        with self.lock:
            out = []
            for name in sorted(self.connectors):
                st = self.status(name)
                out.append((name, st["type"], st["connector"]["state"],
                            [t["state"] for t in st["tasks"]]))
            return out

    # -- the loop ------------------------------------------------------------------------------

    def finished(self) -> bool:
        """No connector has work left: every started connector's tasks ended by themselves
        (none restarting); a paused or stopped connector counts as work (it may be resumed)."""
        with self.lock:
            for m in self.connectors.values():
                if m.target != "STARTED" or m.restarting:
                    return False
                if any(r.alive or (r.thread.ident is None and r.failure is None)
                       for r in m.runners):
                    return False
            return True

    def failed_file_task(self):
        """A failed task runner of a command line's connector, if any (``fatal_failures``)."""
        if not self.fatal_failures:
            return None
        with self.lock:
            for m in self.connectors.values():
                if m.from_file is not None:
                    for r in m.runners:
                        if r.failure is not None:
                            return r
            return None

    def shutdown(self) -> None:
        """Stop every connector (after the worker's stop event is set)."""
        with self.lock:
            for m in self.connectors.values():
                if m.stop is not None:
                    self.finished_runners.extend(m.runners)
                    self._halt(m)


def default_worker_id(host: str, port: int) -> str:
    """Connect's worker id: the REST listener's host:port (the host name when it listens on
    every address)."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"
