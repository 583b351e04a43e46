"""Kafka Connect's REST API (Apache Kafka 3.9's paths, JSON shapes, status codes and error
bodies ``{"error_code": N, "message": "..."}``) over a :class:`~.herder.Herder`, served by
aiohttp from a thread of its own (kcompact.replication.ops.AppThread) at the worker's
``listeners``.

A request that changes a connector runs in a thread pool (it may wait for tasks to flush or for
Kafka's metadata) under the herder's lock. Binding an address other than loopback needs
``rest.basic.auth.users.file`` (auth.py): every request must then carry HTTP Basic credentials
of one of its users (401 otherwise, as Connect's BasicAuthSecurityRestExtension).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from aiohttp import web

from ...errors import ConfigError, ConnectorsError
from ...framework.worker import BUILTIN_CONNECTORS, connector_class
from .herder import ConnectRestError, Herder, not_found
from .offsets import alter_offsets, connector_offsets, reset_offsets
from .validate import key_definitions, validate_config

HERDER_KEY = web.AppKey("herder", Herder)


def _json(status: int, doc: Any, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", headers=headers,
                        text=json.dumps(doc))


def error(status: int, message: str) -> web.Response:
    return _json(status, {"error_code": status, "message": message})


_REASONS = {404: "Not Found", 405: "Method Not Allowed", 415: "Unsupported Media Type",
            401: "Unauthorized"}


@web.middleware
async def connect_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as Connect's error body."""
    try:
        return await handler(request)
    except ConnectRestError as e:
        return error(e.status, e.message)
    except ConfigError as e:
        return error(400, str(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error(e.status, f"HTTP {e.status} {_REASONS.get(e.status, e.reason)}")
    except ConnectorsError as e:
        return error(500, str(e))
    except Exception as e:  # noqa: BLE001 - a one-line 500, as Connect's
        return error(500, f"{type(e).__name__}: {e}")


async def _call(request: web.Request, fn: Callable, *args, **kw) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: fn(*args, **kw))


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw or b"null")
    except ValueError as e:
        raise ConnectRestError(400, f"Request body is not valid JSON: {e}") from None


def _flag(request: web.Request, name: str) -> bool:
    v = request.query.get(name, "false").strip().lower()
    if v not in ("true", "false"):
        raise ConnectRestError(400, f"query parameter {name} must be true or false; got {v!r}")
    return v == "true"


def _task_id(request: web.Request) -> int:
    try:
        return int(request.match_info["task"])
    except ValueError:
        raise ConnectRestError(404, "HTTP 404 Not Found") from None


def _config_of(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ConnectRestError(400, "Request body must be a JSON object of connector configs")
    for k, v in doc.items():
        if isinstance(v, (dict, list)):
            raise ConnectRestError(400, f"Connector config {k!r} must be a string, number or "
                                   "boolean")
    return doc


def make_app(herder: Herder, *, version: str, commit: str, cluster_id: Callable[[], str],
             auth: Callable[[web.Request], bool] | None = None) -> web.Application:
    middlewares = [connect_errors]
    if auth is not None:
        @web.middleware
        async def basic_auth(request: web.Request, handler) -> web.StreamResponse:
            if not auth(request):
                return web.Response(status=401, headers={"WWW-Authenticate":
                                                         'Basic realm="kcompact-connect"'},
                                    content_type="application/json", text=json.dumps(
                                        {"error_code": 401, "message": "Unauthorized"}))
            return await handler(request)
        middlewares.insert(0, basic_auth)
    app = web.Application(middlewares=middlewares)
    app[HERDER_KEY] = herder
    h = herder
    r = app.router

    async def root(request):
        cid = await _call(request, cluster_id)
        return _json(200, {"version": version, "commit": commit, "kafka_cluster_id": cid})

    async def list_connectors(request):
        expand = request.query.getall("expand", [])
        names = await _call(request, h.names)
        if not expand:
            return _json(200, names)
        out: dict[str, dict] = {}
        for n in names:
            entry = {}
            try:
                if "status" in expand:
                    entry["status"] = await _call(request, h.status, n)
                if "info" in expand:
                    entry["info"] = await _call(request, h.info, n)
            except ConnectRestError:
                continue  # deleted meanwhile
            out[n] = entry
        return _json(200, out)

    async def create(request):
        doc = await _body(request)
        if not isinstance(doc, dict):
            raise ConnectRestError(400, "Request body must be a JSON object with name and "
                                   "config")
        config = _config_of(doc.get("config") if doc.get("config") is not None else {})
        name = doc.get("name") if doc.get("name") is not None else config.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ConnectRestError(400, "Connector name must not be empty")
        if name != name.strip():
            raise ConnectRestError(400, "Connector name should not contain leading or trailing "
                                   "whitespaces")
        if "name" in config and config["name"] != name:
            raise ConnectRestError(400, f"Connector name configuration ({config['name']}) "
                                   f"doesn't match connector name in the URL ({name})")
        await _call(request, h.create, name, config)
        info = await _call(request, h.info, name)
        return _json(201, info, {"Location": f"/connectors/{name}"})

    async def get_connector(request):
        return _json(200, await _call(request, h.info, request.match_info["name"]))

    async def get_config(request):
        info = await _call(request, h.info, request.match_info["name"])
        return _json(200, info["config"])

    async def put_config(request):
        name = request.match_info["name"]
        config = _config_of(await _body(request))
        _m, created = await _call(request, h.put_config, name, config)
        info = await _call(request, h.info, name)
        if created:
            return _json(201, info, {"Location": f"/connectors/{name}"})
        return _json(200, info)

    async def status(request):
        return _json(200, await _call(request, h.status, request.match_info["name"]))

    async def tasks(request):
        return _json(200, await _call(request, h.tasks, request.match_info["name"]))

    async def task_status(request):
        return _json(200, await _call(request, h.task_status, request.match_info["name"],
                                      _task_id(request)))

    async def delete(request):
        await _call(request, h.delete, request.match_info["name"])
        return web.Response(status=204)

    async def restart(request):
        include, only = _flag(request, "includeTasks"), _flag(request, "onlyFailed")
        out = await _call(request, h.restart, request.match_info["name"],
                          include_tasks=include, only_failed=only)
        if out is None:
            return web.Response(status=204)
        return _json(202, out)

    async def restart_task(request):
        await _call(request, h.restart_task, request.match_info["name"], _task_id(request))
        return web.Response(status=204)

    def target(state: str, code: int):
        async def handler(request):
            await _call(request, h.set_target, request.match_info["name"], state)
            return web.Response(status=code)
        return handler

    async def topics(request):
        name = request.match_info["name"]
        return _json(200, {name: {"topics": await _call(request, h.active_topics, name)}})

    async def reset_topics(request):
        await _call(request, h.reset_topics, request.match_info["name"])
        return web.Response(status=202)

    async def get_offsets(request):
        return _json(200, await _call(request, connector_offsets, h,
                                      request.match_info["name"]))

    async def patch_offsets(request):
        doc = await _body(request)
        return _json(200, await _call(request, alter_offsets, h, request.match_info["name"],
                                      doc))

    async def delete_offsets(request):
        return _json(200, await _call(request, reset_offsets, h, request.match_info["name"]))

    async def plugins(request):
        only = request.query.get("connectorsOnly", "true").strip().lower() != "false"
        return _json(200, plugin_list(version, connectors_only=only))

    async def plugin_config(request):
        return _json(200, key_definitions(_plugin(request.match_info["plugin"])))

    async def validate(request):
        plugin = request.match_info["plugin"]
        config = _config_of(await _body(request))
        given = config.get("connector.class")
        if given is not None and not _same_plugin(str(given), plugin):
            raise ConnectRestError(400, f"Included connector type {given} does not match "
                                   f"request type {plugin}")
        cls = _plugin(plugin)
        return _json(200, await _call(request, validate_config, cls, config))

    async def loggers(request):
        return _json(200, logger_levels())

    async def get_logger(request):
        name = request.match_info["logger"]
        levels = logger_levels()
        if name not in levels:
            raise ConnectRestError(404, f"Logger {name} not found.")
        return _json(200, levels[name])

    async def put_logger(request):
        name = request.match_info["logger"]
        doc = await _body(request)
        level = doc.get("level") if isinstance(doc, dict) else None
        if not isinstance(level, str) or not level:
            raise ConnectRestError(400, "Desired 'level' parameter was not specified in the "
                                   "request.")
        scope = request.query.get("scope", "worker").lower()
        if scope not in ("worker", "cluster"):
            raise ConnectRestError(400, f"Invalid scope '{scope}'; must be worker or cluster")
        changed = set_logger_level(name, level)
        if scope == "cluster":
            return web.Response(status=204)
        return _json(200, changed)

    r.add_get("/", root)
    r.add_get("/connectors", list_connectors)
    r.add_post("/connectors", create)
    r.add_get("/connectors/{name}", get_connector)
    r.add_delete("/connectors/{name}", delete)
    r.add_get("/connectors/{name}/config", get_config)
    r.add_put("/connectors/{name}/config", put_config)
    r.add_get("/connectors/{name}/status", status)
    r.add_get("/connectors/{name}/tasks", tasks)
    r.add_get("/connectors/{name}/tasks/{task}/status", task_status)
    r.add_post("/connectors/{name}/tasks/{task}/restart", restart_task)
    r.add_post("/connectors/{name}/restart", restart)
    r.add_put("/connectors/{name}/pause", target("PAUSED", 202))
    r.add_put("/connectors/{name}/resume", target("STARTED", 202))
    r.add_put("/connectors/{name}/stop", target("STOPPED", 204))
    r.add_get("/connectors/{name}/topics", topics)
    r.add_put("/connectors/{name}/topics/reset", reset_topics)
    r.add_get("/connectors/{name}/offsets", get_offsets)
    r.add_patch("/connectors/{name}/offsets", patch_offsets)
    r.add_delete("/connectors/{name}/offsets", delete_offsets)
    r.add_get("/connector-plugins", plugins)
    r.add_get("/connector-plugins/{plugin}/config", plugin_config)
    r.add_put("/connector-plugins/{plugin}/config/validate", validate)
    r.add_get("/admin/loggers", loggers)
    r.add_get("/admin/loggers/{logger}", get_logger)
    r.add_put("/admin/loggers/{logger}", put_logger)
    return app


def _same_plugin(given: str, plugin: str) -> bool:
    def norm(s: str) -> str:
        return BUILTIN_CONNECTORS.get(s.strip(), s.strip())
    return norm(given) == norm(plugin) or norm(given).endswith("." + plugin) or \
        norm(plugin).endswith("." + given)


def _plugin(name: str) -> type:
    try:
        return connector_class(name)
    except ConfigError as e:
        raise ConnectRestError(400, f"Failed to find any class that implements Connector and "
                               f"which name matches {name}: {e}") from None


def plugin_list(version: str, *, connectors_only: bool) -> list[dict[str, str]]:
    from ...framework.api import SinkConnector
    out = []
    for short in sorted(k for k in BUILTIN_CONNECTORS if "." not in k):
        cls = connector_class(short)
        out.append({"class": BUILTIN_CONNECTORS[short],
                    "type": "sink" if issubclass(cls, SinkConnector) else "source",
                    "version": version})
    if not connectors_only:
        from ...framework import converters
        for c in (converters.ByteArrayConverter, converters.StringConverter,
                  converters.JsonConverter, converters.AvroConverter):
            out.append({"class": f"{c.__module__}.{c.__qualname__}", "type": "converter",
                        "version": version})
    return out


# -- loggers: Python's logging, with Connect's level names -------------------------------------

_TO_CONNECT = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN",
               logging.ERROR: "ERROR", logging.CRITICAL: "FATAL"}
_FROM_CONNECT = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
                 "WARN": logging.WARNING, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
                 "FATAL": logging.CRITICAL, "OFF": logging.CRITICAL + 10}
_MODIFIED: dict[str, int] = {}


def _level_name(level: int) -> str:
    if level >= logging.CRITICAL + 10:
        return "OFF"
    if level <= 5:
        return "TRACE"
    return _TO_CONNECT.get(level, logging.getLevelName(level))


def logger_levels() -> dict[str, dict[str, Any]]:
    """The root logger and every logger with a level of its own, as Connect lists them."""
    out = {"root": {"level": _level_name(logging.getLogger().level),
                    "last_modified": _MODIFIED.get("root")}}
    for name, lg in sorted(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET:
            out[name] = {"level": _level_name(lg.level), "last_modified": _MODIFIED.get(name)}
    return out


def set_logger_level(name: str, level: str) -> list[str]:
    """Set ``name`` and the loggers under it; returns the names changed (Connect's answer)."""
    import time
    lv = _FROM_CONNECT.get(level.strip().upper())
    if lv is None:
        raise ConnectRestError(400, f"Invalid log level '{level}'.")
    now = int(time.time() * 1000)
    if name == "root":
        logging.getLogger().setLevel(lv)
        _MODIFIED["root"] = now
        return ["root"]
    changed = [name]
    logging.getLogger(name).setLevel(lv)
    for other, lg in list(logging.root.manager.loggerDict.items()):
        if other.startswith(name + ".") and isinstance(lg, logging.Logger) and \
                lg.level != logging.NOTSET:
            lg.setLevel(lv)
            changed.append(other)
    for n in changed:
        _MODIFIED[n] = now
    return sorted(changed)


__all__ = ["make_app", "plugin_list", "not_found"]
