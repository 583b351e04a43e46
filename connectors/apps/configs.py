"""``kcompact configs``: a store's topic configs, in kafka-configs.sh's spelling.

``--describe`` lists every key with its effective value and where it comes from: ``default``
(reput/config.py), ``synced`` (read from the source topic by ``kcompact mirror``) or
``override`` (set here, or through the Python API). ``--alter --add-config k=v[,k=v]`` sets local
overrides, ``--alter --delete-config k[,k]`` removes them; overrides win over synced values and
survive later mirrors (reput/topic_configs.py has the precedence, docs/formats/store-json.md the
fields). A change is a locked read-modify-write of store.json, safe while a mirror or a
compaction runs on the same store: a following mirror applies it at its next metadata refresh,
a compaction started afterwards at once.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from kcompact.reput import Store
from kcompact.reput.topic_configs import OVERRIDE, SYNCED, known_key

from ..errors import ConfigError, ConnectorsError
from .output import print_json

#: How a replica's synced_from starts (replication/replica.py: ``master URL``).
MASTER_ORIGIN = "master "
_SOURCE_TEXT = {"default": "default", SYNCED: "synced from Kafka", OVERRIDE: "local override"}


@dataclass(frozen=True)
class ConfigsOptions:
    """``kcompact configs``'s options: one of describe / alter."""

    store: str
    topic: str
    describe: bool = False
    alter: bool = False
    add_config: str | None = None     # "k=v[,k=v]" (a value with commas in [brackets])
    delete_config: str | None = None  # "k[,k]"
    json: bool = False
    as_of_ms: int | None = None       # --describe --as-of: the synced values as of then
    allow_inexact: bool = False


def split_top_level(text: str) -> list[str]:
    """``a=1,b=[x,y],c=2`` -> ``['a=1', 'b=[x,y]', 'c=2']``: commas inside brackets stay."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_add_config(text: str) -> dict[str, str]:
    """``--add-config``: ``k=v[,k=v]``, kafka-configs.sh's syntax (``cleanup.policy=[compact,
    delete]`` for a value with commas). Keys are checked here, values by the store."""
    out: dict[str, str] = {}
    for item in split_top_level(text):
        k, sep, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not k:
            raise ConfigError(f"--add-config: {item!r} is not key=value (a value with commas "
                              "goes in brackets: cleanup.policy=[compact,delete])")
        known_key(k)
        if v.startswith("[") and v.endswith("]"):
            v = v[1:-1]
        out[k] = v
    if not out:
        raise ConfigError("--add-config: give key=value[,key=value]")
    return out


def parse_delete_config(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise ConfigError("--delete-config: give key[,key]")
    for k in keys:
        known_key(k)
    return keys


def describe_doc(store: Store, topic: str, as_of_ms: int | None = None,
                 allow_inexact: bool = False) -> dict:
    """``--describe --json``: the effective configs of ``topic`` and where each comes from;
    ``as_of_ms``: with the values synced from the source as they were then (the store's config
    history, replication/config_capture.py; local overrides as they are now)."""
    extra: dict = {}
    if as_of_ms is None:
        ly = store.topic_config_layers(topic)
    else:
        from kcompact.replication.config_capture import layers_as_of
        ly, source = layers_as_of(store, topic, as_of_ms, allow_inexact=allow_inexact)
        extra = {"as_of_ms": as_of_ms, "as_of_source": source}
    return {"store": store.url, "topic": topic, "synced_ms": ly.synced_ms,
            "synced_from": ly.synced_from, **extra,
            "configs": [e.to_dict() for e in ly.describe(store.meta.defaults)]}


def _print_describe(doc: dict) -> None:
    when = ""
    origin = doc["synced_from"] or ""
    # a replica's synced values come from its master (synced_from "master URL")
    source_text = dict(_SOURCE_TEXT, **({SYNCED: "synced from master"}
                                        if origin.startswith(MASTER_ORIGIN) else {}))
    if doc["synced_ms"] is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(doc["synced_ms"] / 1000))
        src = origin if origin.startswith(MASTER_ORIGIN) else f"Kafka {origin}"
        when = f" (synced from {src} {stamp})".replace("  ", " ")
    if "as_of_ms" in doc:
        stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(doc["as_of_ms"] / 1000))
        when += f" as of {stamp}" + {
            "defaults": " (none synced then)",
            "current": " (the store keeps no config history of it: current values)",
        }.get(doc["as_of_source"], "")
    print(f"Configs for topic {doc['topic']} in store {doc['store']}{when}:")
    width = max(len(f"{c['name']}={c['value']}") for c in doc["configs"])
    for c in doc["configs"]:
        kv = f"{c['name']}={c['value']}"
        extra = (f"; synced value {c['synced_value']}" if "synced_value" in c else "")
        print(f"  {kv.ljust(width)}  {source_text[c['source']]}{extra}")


def run_configs(opts: ConfigsOptions) -> int:
    if opts.describe == opts.alter:
        raise ConfigError("configs: give --describe or --alter")
    if opts.as_of_ms is not None and not opts.describe:
        raise ConfigError("--as-of goes with --describe (an --alter changes today's overrides)")
    if opts.describe and (opts.add_config or opts.delete_config):
        raise ConfigError("--add-config and --delete-config go with --alter, not --describe")
    if opts.alter and not (opts.add_config or opts.delete_config):
        raise ConfigError("--alter needs --add-config k=v[,k=v] or --delete-config k[,k]")
    if opts.alter:
        # parsed before the store is opened: a typo changes nothing
        add = parse_add_config(opts.add_config) if opts.add_config else {}
        delete = parse_delete_config(opts.delete_config) if opts.delete_config else []
    store = Store.open(opts.store)
    try:
        known = store.topics()
        if opts.describe:
            if opts.topic not in known:
                raise ConnectorsError(f"topic {opts.topic!r} is not in store {store.url}; "
                                      "topics: " + (", ".join(known) or "(none)"))
            doc = describe_doc(store, opts.topic, opts.as_of_ms, opts.allow_inexact)
            print_json(doc) if opts.json else _print_describe(doc)
            return 0
        before = store.topic_config_layers(opts.topic)
        absent = [k for k in delete if k not in before.overrides]
        store.alter_topic_config(opts.topic, add, delete)
        for k in absent:
            print(f"kcompact configs: {k} had no local override in {opts.topic}; its value is "
                  "unchanged", file=sys.stderr)
        if opts.json:
            print_json(describe_doc(store, opts.topic))
        else:
            print(f"Completed updating config for topic {opts.topic}."
                  + ("" if opts.topic in known else " (the store holds no data of it yet)"))
        return 0
    finally:
        store.close()


__all__ = ["ConfigsOptions", "describe_doc", "parse_add_config", "parse_delete_config",
           "run_configs"]
