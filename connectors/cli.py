"""The ``kcompact`` command line (the contract in DESIGN.md, "Command line").

Exit codes: 0 success; 1 a runtime error, printed as one line naming what is wrong (``verify``
also exits 1 when it finds corruption or a difference); 2 a usage error. ``--json`` prints one
JSON document on stdout (``dump --json``: one object per line). Progress goes to stderr.
Set KCOMPACT_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import traceback
from typing import Any, Callable

from kcompact.reput import ReputError, Store, verify_store
from kcompact.reput._gc import bulk_gc
from kcompact.reput.record import Record

from .errors import ConnectorsError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

# Errors from any package root that a user can act on: printed as one line, exit 1.
_USER_ERRORS: tuple[type[BaseException], ...] = (ReputError, ConnectorsError, OSError)


def _register_optional_roots() -> tuple[type[BaseException], ...]:
    """The user-error roots, with those of compaction/ and replication/ when installed. Called
    only once an error needs classifying: importing replication costs ~0.5 s at start-up."""
    global _USER_ERRORS
    from importlib import import_module
    for mod, name in (("kcompact.compaction", "CompactionError"),
                      ("kcompact.replication", "ReplicationError")):
        try:
            m = import_module(mod)
            root = getattr(m, name, None)
            if root is not None and root not in _USER_ERRORS:
                _USER_ERRORS = _USER_ERRORS + (root,)
        except ImportError:
            pass
    return _USER_ERRORS


# ---------------------------------------------------------------------------------------------
# output helpers


def _text_or_b64(name: str, data: bytes | None, out: dict[str, Any]) -> None:
    if data is None:
        out[name] = None
        return
    try:
        out[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[name] = None
        out[f"{name}_b64"] = base64.b64encode(data).decode()


def record_json(r: Record) -> dict[str, Any]:
    """The `dump --json` object of one record (DESIGN.md)."""
    d: dict[str, Any] = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                         "timestamp": r.timestamp}
    _text_or_b64("key", r.key, d)
    _text_or_b64("value", r.value, d)
    hs = []
    for name, value in r.headers:
        h: dict[str, Any] = {"key": name}
        _text_or_b64("value", value, h)
        hs.append(h)
    d["headers"] = hs
    return d


def _show(data: bytes | None, limit: int = 60) -> str:
    if data is None:
        return "null"
    try:
        s = data.decode("utf-8")
        if not s.isprintable():
            raise UnicodeDecodeError("utf-8", data, 0, 1, "unprintable")
    except UnicodeDecodeError:
        s = "b64:" + base64.b64encode(data).decode()
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------------
# commands


def inspect_doc(store: Store, topic: str | None) -> dict[str, Any]:
    from .inspect import store_summary
    return store_summary(store, topic)


def cmd_inspect(args) -> int:
    store = Store.open(args.store)
    doc = inspect_doc(store, args.topic)
    if args.plot:
        from .inspect import plot_store
        plot_store(doc, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        _print_json(doc)
        return EXIT_OK
    print(f"store {doc['store']}  id {doc['store_id']}  format {doc['format_version']}")
    hdr = ("TOPIC", "PART", "SEGS", "RECORDS", "TOMBS", "KEYLESS", "SIZE", "FIRST", "NEXT",
           "HORIZON", "DIRTY", "LAST RUN")
    rows = []
    for t in doc["topics"]:
        for p in t["partitions"]:
            rows.append((t["topic"], p["partition"], p["segments"], p["records"], p["tombstones"],
                         p["keyless"], _human_bytes(p["bytes"]), p["first_offset"],
                         p["next_offset"], p.get("compaction_horizon", -1),
                         f"{p.get('dirty_ratio', 0.0):.2f}", _last_run_text(p)))
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)] if rows else [len(h) for h in hdr]
    for row in (hdr, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    if not rows:
        print("(no partitions)")
    return EXIT_OK


def _last_run_text(p: dict[str, Any]) -> str:
    """The LAST RUN column of `inspect`: when the last compaction ended (UTC, when the store
    knows it) and how many records it kept and dropped; ``never`` before the first one."""
    run = p.get("last_compaction")
    if not run:
        return "never"
    what = f"kept {run['records_kept']} dropped {run['records_dropped']}"
    when = p.get("last_compaction_ms")
    if when is None:
        return what
    import time
    return time.strftime("%Y-%m-%d %H:%M:%SZ ", time.gmtime(when / 1000)) + what


def cmd_dump(args) -> int:
    store = Store.open(args.store)
    if args.partition not in store.partitions(args.topic):
        raise ConnectorsError(f"{args.topic}-{args.partition} is not in store {store.url}; "
                              "see `kcompact inspect`")
    out = sys.stdout
    for r in store.iter_records(args.topic, args.partition, args.from_offset, args.limit):
        if args.json:
            out.write(json.dumps(record_json(r)) + "\n")
        else:
            hdrs = " ".join(f"{k}={_show(v, 20)}" for k, v in r.headers)
            out.write(f"{r.offset}\t{r.timestamp}\t{_show(r.key)}\t{_show(r.value)}"
                      + (f"\t{hdrs}" if hdrs else "") + "\n")
    return EXIT_OK


def cmd_verify(args) -> int:
    if args.against:
        from kcompact.replication import verify_against  # noqa: WPS433 (replication is optional here)
        return verify_against(args)
    store = Store.open(args.store)
    report = verify_store(store)
    if args.json:
        _print_json(report.to_dict())
    else:
        for p in report.problems:
            print(str(p))
        print(f"{'OK' if report.ok else 'CORRUPT'}: {report.partitions} partitions, "
              f"{report.segments} segments, {report.records} records, "
              f"{_human_bytes(report.bytes)}, {report.commitlog_segments} commit-log segments, "
              f"{len(report.problems)} problems")
    return EXIT_OK if report.ok else EXIT_ERROR


def cmd_compact(args) -> int:
    from kcompact.compaction import CompactionOptions, compact_store
    if args.engine == "spark":
        # An explicit engine is never swapped for another: say why Spark cannot run, before
        # anything is opened (as `mirror --engine spark` does).
        from .spark_engine import SparkEngineError, compact_with_spark, spark_available
        why = spark_available()
        if why is not None:
            raise SparkEngineError(f"--engine spark: {why}; or use --engine local")
        return compact_with_spark(args)
    store = Store.open(args.store)
    if args.topic and args.topic not in store.topics():
        raise ConnectorsError(f"topic {args.topic!r} is not in store {store.url}")
    if args.partition is not None and not args.topic:
        raise ConnectorsError("--partition needs --topic")
    results = compact_store(store, topic=args.topic, partition=args.partition, force=args.force,
                            options=CompactionOptions(offset_map_memory=args.offset_map_memory),
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    store.close()
    if args.json:
        _print_json({"store": args.store, "partitions": [r.to_dict() for r in results]})
        return EXIT_OK
    if not results:
        print("nothing to compact (no partition reached min.cleanable.dirty.ratio, "
              "max.compaction.lag.ms or the small-segment limit; use --force)")
    for r in results:
        if r.skipped:
            print(f"{r.topic}-{r.partition}: skipped: {r.skipped}")
            continue
        print(f"{r.topic}-{r.partition}: {r.rounds} rounds, kept {r.records_kept:,} dropped "
              f"{r.records_dropped:,} records ({r.tombstones_dropped:,} tombstones), "
              f"{_human_bytes(r.size_before)} -> {_human_bytes(r.size_after)}, "
              f"read {_human_bytes(r.bytes_read)} wrote {_human_bytes(r.bytes_written)} "
              f"(recopy {r.recopy_percent:.0f}%), segments {r.segments_before} -> "
              f"{r.segments_after}, map {r.map_utilization_max:.0%} full at "
              f"{r.map_bytes_per_key:.1f} B/key, {r.duration_s:.2f}s")
    return EXIT_OK


def cmd_broker(args) -> int:
    from .broker import run_foreground
    return run_foreground(args.port)


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args)


def cmd_kv_build(args) -> int:
    from .kv import cmd_kv_build as run
    return run(args)


def cmd_kv_get(args) -> int:
    from .kv import cmd_kv_get as run
    return run(args)


def cmd_mirror(args) -> int:
    from .mirror import cmd_mirror as run
    return run(args)


def cmd_serve(args) -> int:
    from kcompact.replication import serve  # noqa: WPS433
    return serve(args)


def cmd_replicate(args) -> int:
    from kcompact.replication import replicate  # noqa: WPS433
    return replicate(args)


def cmd_restore(args) -> int:
    from .restore import cmd_restore as run
    return run(args)


def cmd_connect_standalone(args) -> int:
    from .standalone import cmd_standalone
    return cmd_standalone(args)


def _not_yet(name: str) -> Callable[[Any], int]:
    def run(_args) -> int:
        raise ConnectorsError(f"`kcompact {name}` is not available in this version of kcompact")
    return run


# ---------------------------------------------------------------------------------------------
# parser


def _size(text: str) -> int:
    """'128MiB', '64m', '1g', '1048576' -> bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 128MiB, 64m, 1g)")


def _verify_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`verify`'s flags that only make sense together: a usage error (exit 2) otherwise."""
    def check(args) -> None:
        if args.against and not args.token_file:
            parser.error("--against needs --token-file F (the file holding the master's "
                         "bearer token)")
        if args.token_file and not args.against:
            parser.error("--token-file applies to --against only")
    return check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kcompact", description=(
        "Keep a compacted copy of Kafka topics in RocketMQ-style storage."))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("demo", help="broker + sample data + mirror + compact + replica + KV")
    s.add_argument("--workdir", default=None, help="where the demo keeps its stores "
                   "(default: a new temporary directory)")
    s.add_argument("--records", type=int, default=20_000)
    s.add_argument("--s3", action="store_true", help="run on a SeaweedFS-backed S3 store")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("broker", help="embedded Kafka-compatible broker, in the foreground")
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(func=cmd_broker)

    s = sub.add_parser("mirror", help="mirror a Kafka topic into a store")
    s.add_argument("--bootstrap-servers", required=True)
    s.add_argument("--topic", required=True)
    s.add_argument("--store", required=True)
    s.add_argument("--engine", choices=("spark", "local"), default=None,
                   help="spark (the default without --follow): one Spark task per partition, "
                   "then a compaction stage; local: this process")
    s.add_argument("--spark-master", default=None,
                   help="Spark master URL (default local[*]); the store must be reachable from "
                   "every executor")
    s.add_argument("--follow", action="store_true")
    s.add_argument("--no-compact", action="store_true",
                   help="--engine spark: skip the compaction stage after the mirror (the store "
                   "then holds every record, as after a batch --engine local)")
    s.add_argument("--partitions", default=None, help="comma-separated partition numbers")
    s.add_argument("-X", dest="kafka_config", action="append", default=[], metavar="KEY=VALUE",
                   help="librdkafka consumer setting (repeatable)")
    s.set_defaults(func=cmd_mirror)

    s = sub.add_parser("compact", help="compact partitions of a store")
    s.add_argument("--store", required=True)
    s.add_argument("--topic", default=None)
    s.add_argument("--partition", type=int, default=None)
    s.add_argument("--force", action="store_true")
    s.add_argument("--offset-map-memory", type=_size, default=128 << 20)
    s.add_argument("--engine", choices=("spark", "local"), default="local")
    s.add_argument("--spark-master", default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_compact)

    s = sub.add_parser("inspect", help="show topics, partitions, segments and dirty ratios")
    s.add_argument("--store", required=True)
    s.add_argument("--topic", default=None)
    s.add_argument("--json", action="store_true")
    s.add_argument("--plot", default=None, metavar="FILE.png")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("dump", help="print a partition's records")
    s.add_argument("--store", required=True)
    s.add_argument("--topic", required=True)
    s.add_argument("--partition", type=int, required=True)
    s.add_argument("--from-offset", type=int, default=0)
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_dump)

    s = sub.add_parser("verify", help="check every record and index entry (exit 1 on problems)")
    s.add_argument("--store", required=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--against", default=None, metavar="URL",
                   help="compare with a master served by `kcompact serve` (needs --token-file)")
    s.add_argument("--token-file", default=None, help="the master's bearer token (--against)")
    s.set_defaults(func=cmd_verify, check_usage=_verify_usage(s))

    s = sub.add_parser("serve", help="serve a store to replicas over HTTP")
    s.add_argument("--store", required=True)
    s.add_argument("--listen", required=True, metavar="HOST:PORT")
    s.add_argument("--token-file", required=True)
    s.add_argument("--tls-cert", default=None)
    s.add_argument("--tls-key", default=None)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("replicate", help="rebuild a replica from a serving master")
    s.add_argument("--from", dest="from_url", required=True, metavar="URL")
    s.add_argument("--token-file", required=True)
    s.add_argument("--store", required=True)
    s.add_argument("--follow", action="store_true")
    s.set_defaults(func=cmd_replicate)

    s = sub.add_parser("restore", help="re-publish a store's topic into Kafka")
    s.add_argument("--store", required=True)
    s.add_argument("--topic", required=True)
    s.add_argument("--bootstrap-servers", required=True)
    s.add_argument("--to-topic", required=True)
    s.add_argument("--repartition", action="store_true",
                   help="place records by key with Kafka's default partitioner (murmur2)")
    s.add_argument("--mode", choices=("latest", "all"), default="latest",
                   help="latest value per key (default), or every stored record")
    s.add_argument("--from-scratch", action="store_true",
                   help="ignore recorded progress and produce everything again")
    s.add_argument("--chunk-records", type=int, default=None, metavar="N",
                   help="records per transaction and progress record (default 250000)")
    s.add_argument("--exactly-once", choices=("requested", "required", "disabled"),
                   default="requested", help="transactions: when the broker has them "
                   "(default), always, or never (idempotent producer)")
    s.add_argument("-X", dest="kafka_config", action="append", default=[], metavar="KEY=VALUE",
                   help="librdkafka producer setting (repeatable)")
    s.set_defaults(func=cmd_restore)

    kv = sub.add_parser("kv", help="the local key-value map (LevelDB)")
    kvs = kv.add_subparsers(dest="kv_command", metavar="COMMAND")
    kvs.required = True
    s = kvs.add_parser("build", help="build (and follow) a map from a store")
    s.add_argument("--store", required=True)
    s.add_argument("--topic", required=True)
    s.add_argument("--db", required=True)
    s.add_argument("--follow", action="store_true")
    s.add_argument("--bootstrap-servers", default=None,
                   help="after the store, catch up (and with --follow, follow) from this Kafka")
    s.add_argument("-X", dest="kafka_config", action="append", default=[], metavar="KEY=VALUE",
                   help="librdkafka consumer setting for --bootstrap-servers (repeatable)")
    s.set_defaults(func=cmd_kv_build)
    s = kvs.add_parser("get", help="look a key up (exit 1 when it is absent)")
    s.add_argument("--db", required=True)
    s.add_argument("key")
    s.add_argument("--json", action="store_true")
    s.add_argument("--key-base64", action="store_true", help="KEY is base64 (binary keys)")
    s.add_argument("--value-converter", default=None, metavar="NAME",
                   help="decode the value: json, avro, string, or a converter class name")
    s.add_argument("--converter-config", action="append", default=[], metavar="KEY=VALUE",
                   help="value converter setting, e.g. schema.registry.url=URL (repeatable)")
    s.set_defaults(func=cmd_kv_get)

    c = sub.add_parser("connect", help="run Connect-style connectors")
    cs = c.add_subparsers(dest="connect_command", metavar="MODE")
    cs.required = True
    s = cs.add_parser("standalone", help="WORKER.properties CONNECTOR.properties...")
    s.add_argument("worker")
    s.add_argument("connectors", nargs="+")
    s.set_defaults(func=cmd_connect_standalone)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_usage = getattr(args, "check_usage", None)
    if check_usage is not None:
        check_usage(args)  # exits 2 with argparse's usage message
    debug = os.environ.get("KCOMPACT_DEBUG") not in (None, "", "0")
    try:
        with bulk_gc():  # a command is one bulk job (reput/_gc.py)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kcompact: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except _register_optional_roots() as e:
        if debug:
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kcompact: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # an unexpected failure is still one line, with its type
        if debug:
            traceback.print_exc()
        print(f"kcompact: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set KCOMPACT_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
