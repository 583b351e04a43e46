"""``kcompact kv build`` and ``kcompact kv get``: their options and what they print."""

from __future__ import annotations

import base64
import json
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...plugins.leveldb_sink import KVError, KVLockedError
from ..output import text_or_b64
from .build import MapBuilder
from .map import KVMap, _make_converter
from .follower_client import get_through_follower


@dataclass(frozen=True)
class KVBuildOptions:
    """``kcompact kv build``'s options."""

    store: str
    topic: str
    db: str
    follow: bool = False
    bootstrap_servers: str | None = None
    kafka_config: Mapping[str, str] = field(default_factory=dict)  # -X consumer settings
    metrics: str | None = None      # --metrics HOST:PORT (with --follow)
    as_of_ms: int | None = None     # --as-of: the state at that time (never followed)
    allow_inexact: bool = False


@dataclass(frozen=True)
class KVGetOptions:
    """``kcompact kv get``'s options."""

    db: str
    key: str
    json: bool = False
    key_base64: bool = False
    value_converter: str | None = None
    converter_config: Mapping[str, str] = field(default_factory=dict)


def parse_settings(items: list[str] | None, what: str) -> dict[str, str]:
    """``KEY=VALUE`` items of a repeatable flag (``-X``, ``--converter-config``) as a dict."""
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise KVError(f"{what}: expected KEY=VALUE, got {item!r}")
        out[k.strip()] = v
    return out


def kv_build(opts: KVBuildOptions) -> int:
    """``kcompact kv build``: 130 when interrupted before the bulk build finished, else 0.
    With ``follow`` the process answers reads too (serve.py), for ``kv get`` elsewhere."""
    if opts.follow:
        from .serve import KVServeOptions, follow_and_serve
        return follow_and_serve(KVServeOptions(
            store=opts.store, topic=opts.topic, db=opts.db,
            bootstrap_servers=opts.bootstrap_servers, kafka_config=opts.kafka_config,
            metrics=opts.metrics, command="kv build"))
    if opts.metrics:
        raise KVError("--metrics applies to kv build --follow (a long-running build) only")
    stop = threading.Event()

    def progress(m: str) -> None:
        print(f"kv build: {m}", file=sys.stderr, flush=True)

    previous = {}

    def on_signal(signum, _frame) -> None:
        if not stop.is_set():
            print(f"kv build: {signal.Signals(signum).name}: finishing the current batch",
                  file=sys.stderr, flush=True)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        b = MapBuilder(opts.db, opts.store, opts.topic, bootstrap_servers=opts.bootstrap_servers,
                       kafka_config=opts.kafka_config, progress=progress,
                       as_of_ms=opts.as_of_ms, allow_inexact=opts.allow_inexact)
        rep = b.run(follow=opts.follow, stop=stop)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    offsets = ", ".join(f"{p}:{o}" for p, o in rep["offsets"].items())
    when = ""
    if opts.as_of_ms is not None:
        from kcompact.compaction.history import format_time
        when = f" as of {format_time(opts.as_of_ms)}"
    print(f"{opts.db}: {rep['keys']:,} keys of topic {opts.topic!r}{when} "
          f"({rep['stats']['records']:,} records covered, {rep['stats']['keyless']:,} keyless "
          f"skipped), next offsets {{{offsets}}}, {rep['seconds']:.2f}s")
    if rep["interrupted"]:
        print("kv build: interrupted before the bulk build finished; run the same command to "
              "resume", file=sys.stderr)
        return 130
    return 0


def kv_get(opts: KVGetOptions) -> int:
    """``kcompact kv get``: prints the value; 1 when the key is absent, saying so on stderr."""
    if opts.key_base64:
        try:
            key = base64.b64decode(opts.key, validate=True)
        except ValueError:
            raise KVError(f"--key-base64: {opts.key!r} is not valid base64") from None
    else:
        key = opts.key.encode("utf-8")
    conv = opts.value_converter
    try:
        with KVMap(opts.db, value_converter=conv, verify_checksums=True,
                   converter_config=opts.converter_config) as m:
            building = m.building
            value = m.get(key)
    except KVLockedError as e:  # a follower holds it: ask it (remote.py)
        got = get_through_follower(opts.db, key, e)
        building, value = got.building, got.value
        if conv is not None and value is not None:
            value = _make_converter(conv, opts.converter_config).to_connect(got.topic, value)
    if building:
        print(f"kv get: warning: the bulk build of {opts.db} is unfinished; the map is "
              "partial", file=sys.stderr)
    found = value is not None
    if opts.json:
        doc: dict[str, Any] = {}
        text_or_b64("key", key, doc)
        doc["found"] = found
        if found:
            if conv is None:
                text_or_b64("value", value, doc)
            else:
                doc["value"] = value
        json.dump(doc, sys.stdout, default=_json_default)
        sys.stdout.write("\n")
    elif found:
        if isinstance(value, bytes):
            sys.stdout.buffer.write(value + b"\n")
        else:
            sys.stdout.write(json.dumps(value, default=_json_default) + "\n")
    sys.stdout.flush()
    if not found:
        shown = f"(base64) {opts.key}" if opts.key_base64 else f'"{opts.key}"'
        print(f"kv get: key {shown} is not in {opts.db} (never written, or deleted by a "
              "tombstone)", file=sys.stderr, flush=True)
    return 0 if found else 1


def _json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray)):
        return base64.b64encode(bytes(o)).decode()
    return str(o)
