"""Kafka Connect's REST API on ``kcompact connect standalone`` (the worker's ``listeners``):
herder.py keeps the connectors and their states, server.py serves Connect's paths and shapes,
validate.py and offsets.py answer config validation and KIP-875's offsets, auth.py checks
HTTP Basic credentials (docs/connectors.md, "The REST API")."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, TextIO

from ...errors import ConfigError
from .herder import ConnectRestError, Herder, default_worker_id

__all__ = ["ConnectRestError", "Herder", "RestServer", "start_rest", "parse_listeners"]


def parse_listeners(text: str) -> tuple[str, int]:
    """``http://HOST:PORT`` -> (host, port); one URL (Connect's key may list several)."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if len(urls) != 1:
        raise ConfigError(f"listeners: give one URL, e.g. http://127.0.0.1:8083; got {text!r}",
                          key="listeners")
    u = urllib.parse.urlsplit(urls[0])
    if u.scheme == "https":
        raise ConfigError("listeners: https is not served by kcompact yet; listen on loopback "
                          "(http://127.0.0.1:8083) behind a TLS-terminating proxy",
                          key="listeners")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "http" or port is None or u.path not in ("", "/"):
        raise ConfigError(f"listeners: {urls[0]!r} is not http://HOST:PORT (e.g. "
                          "http://127.0.0.1:8083; port 0 picks a free one)", key="listeners")
    return u.hostname or "0.0.0.0", port


@dataclass
class RestServer:
    herder: Herder
    url: str
    thread: Any

    def stop(self) -> None:
        self.thread.stop()


def _cluster_id(worker) -> Any:
    """The Kafka cluster's id for ``GET /``, asked once in the background at start (null
    until the brokers answer, so the API never waits for them)."""
    cache: dict[str, str] = {}

    def ask() -> None:
        from confluent_kafka.admin import AdminClient
        from ...framework.kafka_clients import kafka_logger, short_lived
        try:
            s = worker._settings("admin", {}, {}, None)
            admin = AdminClient(short_lived(dict(s.conf, logger=kafka_logger())))
            while not worker.stop_event.is_set() and "id" not in cache:
                try:
                    cid = admin.list_topics(timeout=5).cluster_id
                except Exception:  # noqa: BLE001 - asked again
                    cid = None
                if cid:
                    cache["id"] = cid
        except Exception:  # noqa: BLE001 - the id is informative only
            pass

    import threading
    threading.Thread(target=ask, daemon=True, name="connect-cluster-id").start()
    return lambda: cache.get("id")


def start_rest(worker, *, state_dir: str | None, log: TextIO) -> RestServer:
    """Serve the REST API at the worker's ``listeners``; the connectors are loaded after
    (``herder.load``)."""
    from kcompact import __version__
    from kcompact.replication.connections import is_loopback
    from kcompact.replication.ops import AppThread
    from .auth import BasicAuth
    from .server import make_app
    host, port = parse_listeners(worker.config["listeners"])
    users = worker.config["rest.basic.auth.users.file"]
    if not is_loopback(host) and not users:
        raise ConfigError(f"listeners: {worker.config['listeners']} is not a loopback address: "
                          "anyone who reaches it could change the connectors; set "
                          "rest.basic.auth.users.file (hashed passwords), or listen on "
                          "http://127.0.0.1:PORT", key="listeners")
    auth = BasicAuth(users) if users else None
    herder = Herder(worker, state_dir=state_dir, worker_id=default_worker_id(host, port),
                    log=log)
    app = make_app(herder, version=__version__, commit=_commit(), cluster_id=_cluster_id(worker),
                   auth=auth)
    shown = f"[{host}]" if ":" in host else host
    thread = AppThread(lambda: app, f"{shown}:{port}", flag="listeners",
                       name="kcompact-connect-rest", command="connect standalone")
    url = thread.start()
    bound = int(url.rsplit(":", 1)[1])
    herder.worker_id = default_worker_id(host, bound)
    print(f"connect: REST API on {url}", file=log, flush=True)
    if worker.config["metrics.listen"]:
        worker.ops.add(_state_metrics(herder))
    return RestServer(herder, url, thread)


def _commit() -> str:
    try:
        from importlib.metadata import distribution
        d = distribution("kcompact")
        text = d.read_text("direct_url.json") or ""
        import json
        return str(json.loads(text).get("vcs_info", {}).get("commit_id", "")) if text else ""
    except Exception:  # noqa: BLE001 - the commit is informative only
        return ""


CONNECTOR_STATES = ("UNASSIGNED", "RUNNING", "PAUSED", "STOPPED", "FAILED", "RESTARTING")


def _state_metrics(herder: Herder):
    from kcompact.replication.ops import gauge

    def collect():
        c = gauge("connector_state", "1 for the connector's Connect state (UNASSIGNED, "
                  "RUNNING, PAUSED, STOPPED, FAILED, RESTARTING), 0 for the others.",
                  ["connector", "type", "state"])
        t = gauge("connector_task_state", "1 for each task's Connect state, 0 for the others.",
                  ["connector", "task", "state"])
        for name, kind, state, tasks in herder.states():
            for s in CONNECTOR_STATES:
                c.add_metric([name, kind, s], int(s == state))
            for i, ts in enumerate(tasks):
                for s in CONNECTOR_STATES:
                    if s != "STOPPED":
                        t.add_metric([name, str(i), s], int(s == ts))
        yield c
        yield t
    return collect
