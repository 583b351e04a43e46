"""Kafka Connect's REST API on ``kcompact connect standalone`` (the worker's ``listeners``):
herder.py keeps the connectors and their states, server.py serves Connect's paths and shapes,
validate.py and offsets.py answer config validation and KIP-875's offsets, auth.py checks
HTTP Basic credentials, tls.py makes an https listener's context (docs/connectors.md, "The
REST API")."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, TextIO

from ...errors import ConfigError
from .herder import ConnectRestError, Herder, default_worker_id

__all__ = ["ConnectRestError", "Herder", "RestServer", "start_rest", "parse_listeners"]


def parse_listeners(text: str) -> tuple[str, str, int]:
    """``http://HOST:PORT`` or ``https://HOST:PORT`` -> (scheme, host, port); one URL
    (Connect's key may list several)."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if len(urls) != 1:
        raise ConfigError(f"listeners: give one URL, e.g. http://127.0.0.1:8083; got {text!r}",
                          key="listeners")
    u = urllib.parse.urlsplit(urls[0])
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or port is None or u.path not in ("", "/"):
        raise ConfigError(f"listeners: {urls[0]!r} is not http://HOST:PORT or "
                          "https://HOST:PORT (e.g. http://127.0.0.1:8083; port 0 picks a free "
                          "one)", key="listeners")
    return u.scheme, u.hostname or "0.0.0.0", port


@dataclass
class RestServer:
    herder: Herder
    url: str
    thread: Any

    def stop(self) -> None:
        self.thread.stop()


def _cluster_id(worker) -> Any:
    """The Kafka cluster's id for ``GET /``: asked of the brokers at the first such request
    (5 s at most; null if they do not answer, asked again next time), then kept."""
    import threading
    cache: dict[str, str] = {}
    lock = threading.Lock()

    def ask() -> str | None:
        with lock:
            if "id" not in cache:
                try:
                    from confluent_kafka.admin import AdminClient
                    from ...framework.kafka_clients import kafka_logger, short_lived
                    s = worker._settings("admin", {}, {}, None)
                    admin = AdminClient(short_lived(dict(s.conf, logger=kafka_logger())))
                    cid = admin.list_topics(timeout=5).cluster_id
                    if cid:
                        cache["id"] = cid
                except Exception:  # noqa: BLE001 - the id is informative only
                    pass
            return cache.get("id")
    return ask


def start_rest(worker, herder: Herder, listeners: str, *, required: bool, where: str,
               log: TextIO) -> RestServer | None:
    """Serve the REST API at ``listeners`` over ``herder`` (whose connectors are loaded after).
    Its port already taken: an error when ``required`` (the worker file names it, or nothing
    else would run), else one warning line and None (the worker runs without the API)."""
    from kcompact import __version__
    from kcompact.replication.connections import is_loopback
    from kcompact.replication.errors import ReplicationError
    from kcompact.replication.ops import AppThread
    from .auth import BasicAuth
    from .server import make_app
    scheme, host, port = parse_listeners(listeners)
    users = worker.config["rest.basic.auth.users.file"]
    ssl_context = None
    if scheme == "https":
        from .tls import server_context
        ssl_context = server_context(worker.config)
    elif worker.config["listeners.https.ssl.client.auth"] != "none":
        raise ConfigError(f"listeners.https.ssl.client.auth: needs an https listener; got "
                          f"listeners={listeners}", key="listeners.https.ssl.client.auth")
    certified = ssl_context is not None and \
        worker.config["listeners.https.ssl.client.auth"] == "required"
    if not is_loopback(host) and not users and not certified:
        raise ConfigError(f"listeners: {listeners} is not a loopback address: "
                          "anyone who reaches it could change the connectors; set "
                          "rest.basic.auth.users.file (hashed passwords) or "
                          "listeners.https.ssl.client.auth=required (client certificates), "
                          "or listen on http://127.0.0.1:PORT", key="listeners")
    auth = BasicAuth(users) if users else None
    app = make_app(herder, version=__version__, commit=_commit(), cluster_id=_cluster_id(worker),
                   auth=auth)
    shown = f"[{host}]" if ":" in host else host
    thread = AppThread(lambda: app, f"{shown}:{port}", flag="listeners",
                       ssl_context=ssl_context, name="kcompact-connect-rest",
                       command="connect standalone")
    try:
        url = thread.start()
    except ReplicationError as e:
        if required:
            raise ConfigError(f"{where}: {e} (set listeners to a free port, e.g. "
                              "http://127.0.0.1:0 for any)", key="listeners") from None
        print(f"connect: warning: REST API not served: {e} (the default listeners; set "
              f"listeners=http://127.0.0.1:PORT in {where} for another port, or listeners= for "
              "none)", file=log, flush=True)
        return None
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
