"""``PUT /connector-plugins/{class}/config/validate``: a connector config checked key by key,
in Kafka Connect's ``ConfigInfos`` shape (``name``, ``error_count``, ``groups``, ``configs``:
each key's ``definition`` and ``value`` with its ``errors``).

The checks are the ones a connector file gets (framework/worker.py's ``validate_connector``:
types, validators, required keys, a sink's ``topics``/``topics.regex``), reported for every key
instead of stopping at the first; a key no definition knows is listed with its error (the "did
you mean" included), since kcompact refuses it where Apache Connect ignores it.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import ConfigError
from ...framework.api import SinkConnector
from ...framework.config import non_empty
from ...framework.errors_handling import ERRORS_CONFIG
from ...framework.worker import CONNECTOR_CONFIG, SINK_CONFIG, connector_definition

_WIDTH = "NONE"


def _group(name: str, cls: type) -> str:
    if name in ERRORS_CONFIG:
        return "Error Handling"
    if name in CONNECTOR_CONFIG:
        return "Common"
    if issubclass(cls, SinkConnector) and name in SINK_CONFIG:
        return "Sink"
    return cls.__name__


def key_info(name: str, type_: str, required: bool, default: str | None, importance: str,
             doc: str, group: str | None, order: int) -> dict[str, Any]:
    """Connect's ``ConfigKeyInfo`` of one key (``GET /connector-plugins/{class}/config`` and
    each entry of a validation result)."""
    return {"name": name, "type": type_, "required": required, "default_value": default,
            "importance": importance, "documentation": doc, "group": group, "width": _WIDTH,
            "display_name": name, "dependents": [], "order": order}


def key_definitions(cls: type) -> list[dict[str, Any]]:
    """Every key of connector class ``cls``, as ``GET /connector-plugins/{class}/config``
    lists them (no group, order -1: Apache's answer there)."""
    return [key_info(k.name, k.type.value.upper(), k.required,
                     None if k.required else text(k.default), k.importance.value.upper(),
                     k.doc, None, -1) for k in connector_definition(cls).keys()]


def text(v: Any) -> str | None:
    """A default or a value as Connect shows it: a string (lists comma-separated)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def validate_config(cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    """Connect's validation result for ``config`` against connector class ``cls``."""
    definition = connector_definition(cls)
    configs: list[dict[str, Any]] = []
    groups: list[str] = []
    errors_total = 0
    order: dict[str, int] = {}
    for key in definition.keys():
        group = _group(key.name, cls)
        if group not in groups:
            groups.append(group)
        order[group] = order.get(group, 0) + 1
        errors: list[str] = []
        raw = config.get(key.name)
        # name and connector.class default to None and refuse it (non_empty): required
        required = key.required or (key.default is None and key.validator is non_empty)
        if raw is None:
            if required:
                errors.append(f'Missing required configuration "{key.name}" which has no '
                              "default value.")
        else:
            try:
                key.parse(raw)
            except ConfigError as e:
                errors.append(str(e))
        if key.name == "topics" and issubclass(cls, SinkConnector) and \
                not config.get("topics") and not config.get("topics.regex"):
            errors.append("Must configure one of topics or topics.regex")
        errors_total += len(errors)
        configs.append(_entry(key.name, key.type.value.upper(), required,
                              None if required else text(key.default),
                              key.importance.value.upper(), key.doc, group, order[group],
                              text(raw) if raw is not None else
                              (None if required else text(key.default)), errors))
    for name, raw in config.items():
        if name in definition or definition.is_passthrough(name):
            continue
        group = "Unknown"
        if group not in groups:
            groups.append(group)
        order[group] = order.get(group, 0) + 1
        errors_total += 1
        configs.append(_entry(name, "STRING", False, None, "LOW", "", group, order[group],
                              text(raw), [definition.unknown_key_message(name)]))
    return {"name": f"{cls.__module__}.{cls.__qualname__}", "error_count": errors_total,
            "groups": groups, "configs": configs}


def _entry(name: str, type_: str, required: bool, default: str | None, importance: str,
           doc: str, group: str, order: int, value: str | None, errors: list[str]
           ) -> dict[str, Any]:
    return {"definition": key_info(name, type_, required, default, importance, doc, group,
                                   order),
            "value": {"name": name, "value": value, "recommended_values": [],
                      "errors": errors, "visible": True}}
