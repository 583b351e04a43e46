"""Looking at a store without changing it: ``kcompact inspect`` (per-partition segments, records,
sizes, the active segment's bytes, offsets, dirty ratio, the compaction triggers that fire now
(``compaction_due``: the planner's own assessment), last compaction; ``--plot``), ``kcompact dump`` (a partition's
records) and ``kcompact verify`` (every record and index entry checked; exit 1 on a problem).
``verify --against`` compares with a master instead: kcompact.replication's ``verify_against``.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kcompact.compaction import REPAIR_HINT, Damage, partition_status
from kcompact.compaction.damage import recorded, remember
from kcompact.reput import (FLAG_KEYLESS, FLAG_TOMBSTONE, CorruptRecordError, Store,
                            verify_store)
from kcompact.reput.verify import VerifyReport, verify_partition
from kcompact.reput.shared import FEATURE as SHARED_FEATURE
from kcompact.reput.record import Record

from ..errors import ConnectorsError
from ..extras import require
from .output import human_bytes, print_json, text_or_b64


def partition_summary(store: Store, topic: str, partition: int, *,
                      verify: bool = False) -> dict[str, Any]:
    """The partition's row of `inspect`. ``damaged`` (null when none): file, byte, reason
    (and who found it when: ``found_by``, ``found_ms``) of damage recorded beside the
    partition by whatever met it (compaction, verify, a reader: reput/damage_record.py), or of
    damage that shows without reading records (compaction/damage.py); a partition that cannot
    be opened says only that. ``verify``: every record read as `kcompact verify` reads it
    (``"verify": {"ok", "records", "problems"}``), its first problem recorded and shown as the
    damage."""
    try:
        doc = _partition_summary(store, topic, partition)
    except CorruptRecordError as e:
        store.release_partition(topic, partition)
        doc = {"partition": partition, "damaged": Damage.of(topic, partition, e).to_dict()}
    if verify:
        rep = VerifyReport()
        verify_partition(store, topic, partition, rep, found_by="inspect --verify")
        store.release_partition(topic, partition)
        doc["verify"] = {"ok": rep.ok, "records": rep.records,
                         "problems": [str(p) for p in rep.problems]}
    rec = recorded(store, topic, partition)
    if rec is not None and not doc.get("damaged"):
        doc["damaged"] = rec.to_dict()
    elif rec is not None:
        doc["damaged"].update(found_by=rec.found_by, found_ms=rec.found_ms)
    return doc


def _partition_summary(store: Store, topic: str, partition: int) -> dict[str, Any]:
    pl = store.partition(topic, partition)
    records = tombstones = keyless = 0
    for seg in pl.segments:
        e = seg.entries()
        records += e.shape[0]
        if e.shape[0]:
            flags = e["flags"]
            tombstones += int(np.count_nonzero(flags & FLAG_TOMBSTONE))
            keyless += int(np.count_nonzero(flags & FLAG_KEYLESS))
    doc: dict[str, Any] = {
        "partition": partition, "segments": len(pl.segments), "records": records,
        "tombstones": tombstones, "keyless": keyless, "bytes": pl.size_bytes(),
        "first_offset": pl.first_offset, "next_offset": pl.next_offset,
        "index_bytes": sum(seg.index_size for seg in pl.segments),
        # each segment's store format and codec (docs/formats/segment-v2.md)
        "segment_list": [seg.describe() for seg in pl.segments],
        # S3 with shared uploads: the shared objects its reads depend on until it is split
        # (docs/s3-shared-uploads.md); 0 everywhere else
        "shared_objects": pl.shared_objects,
        "damaged": None,
    }
    # compaction adds the horizon, the dirty ratio and the last run
    doc.update(partition_status(store, topic, partition))
    # (the compaction checkpoint's modification time; None on S3: the manifest keeps the run)
    doc["last_compaction_ms"] = pl.last_compaction_ms() if doc.get("last_compaction") else None
    return doc


def known_partitions(store: Store, topic: str) -> list[int]:
    """The partitions of ``topic`` that hold data, and those a mirror recorded in store.json
    when it started (Store.record_partitions), written yet or not."""
    return sorted(set(store.partitions(topic)) | set(store.recorded_partitions(topic)))


def _check_topic(store: Store, topic: str) -> None:
    if topic not in store.topics():
        raise ConnectorsError(f"topic {topic!r} is not in store {store.url}; topics: "
                              + (", ".join(store.topics()) or "(none)"))


def store_summary(store: Store, topic: str | None = None, *,
                  verify: bool = False) -> dict[str, Any]:
    if topic:
        _check_topic(store, topic)
    # the internal topics (the estate's captures, restore progress) after the user's
    topics = [topic] if topic else sorted(store.topics(),
                                          key=lambda t: (t.startswith("__kcompact-"), t))
    estate = estate_times(store, topics)
    return {
        "store": store.url, "store_id": store.meta.store_id,
        "format_version": store.meta.format_version,
        "topics": [{"topic": t, "config": store.topic_config(t).to_dict(),
                    "config_source": {e.name: e.source
                                      for e in store.topic_config_layers(t).describe(
                                          store.meta.defaults)},
                    "partitions": [partition_summary(store, t, p, verify=verify)
                                   for p in known_partitions(store, t)],
                    **({"captured": estate[t]} if t in estate else {})}
                   for t in topics],
    }


#: what a mirror keeps beside each topic's records, in inspect's order
ESTATE = ("configs", "acls", "groups", "schemas")


def estate_times(store: Store, topics: list[str]) -> dict[str, dict[str, int | None]]:
    """Per (non-internal) topic, when each part of its estate was last captured (epoch ms, or
    None): configs (their synced values last changed), ACLs (the last capture), group offsets
    (the latest position kept from the source), schemas (the last capture)."""
    from kcompact.replication.acl_capture import kept_acls
    from kcompact.replication.group_capture import kept_offsets
    wanted = [t for t in topics if not t.startswith("__kcompact-")]
    if not wanted:
        return {}
    acls = kept_acls(store).captured_ms
    groups: dict[str, int] = {}
    for (_g, t, _p), k in kept_offsets(store).items():
        if k.origin == "source":
            groups[t] = max(groups.get(t, 0), k.commit_ms)
    schemas = _schema_times(store)
    return {t: {"configs": store.topic_config_layers(t).synced_ms, "acls": acls.get(t),
                "groups": groups.get(t), "schemas": schemas.get(t)} for t in wanted}


def _schema_times(store: Store) -> dict[str, int]:
    try:
        from kcompact.replication.schema_capture import kept_schemas
    except ImportError:
        return {}
    return kept_schemas(store).captured_ms


def plot_store(doc: dict[str, Any], path: str) -> None:
    """Per-partition stacked bars of live (clean), dirty and reclaimed bytes, as a PNG."""
    matplotlib = require("matplotlib", "inspect --plot", "plots", "matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, clean, dirty, reclaimed = [], [], [], []
    for t in doc["topics"]:
        for p in t["partitions"]:
            if p.get("damaged"):
                continue  # (listed below the table of `inspect`)
            labels.append(f"{t['topic']}-{p['partition']}")
            d = (p.get("dirty_bytes", 0) + p.get("uncleanable_bytes", 0)
                 + p.get("active_bytes", 0))
            dirty.append(d / 2**20)
            clean.append(max(0, p["bytes"] - d) / 2**20)
            reclaimed.append(p.get("reclaimed_bytes", 0) / 2**20)
    if not labels:
        raise ConnectorsError("nothing to plot: the store has no partitions")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.6))
    y = range(len(labels))
    ax.barh(y, clean, color="#2b8a3e", label="live (compacted)")
    ax.barh(y, dirty, left=clean, color="#f08c00", label="dirty (not yet compacted)")
    ax.barh(y, reclaimed, left=[c + d for c, d in zip(clean, dirty)], color="#ced4da",
            hatch="//", label="reclaimed by compaction")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title(f"kcompact store {doc['store']}")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# the commands


@dataclass(frozen=True)
class InspectOptions:
    """``kcompact inspect``'s options."""

    store: str
    topic: str | None = None
    json: bool = False
    plot: str | None = None          # a PNG to write
    verify: bool = False             # --verify: read every record too


@dataclass(frozen=True)
class DumpOptions:
    """``kcompact dump``'s options."""

    store: str
    topic: str
    partition: int
    from_offset: int = 0
    limit: int | None = None
    json: bool = False
    as_of_ms: int | None = None     # --as-of: the partition's state at that time
    allow_inexact: bool = False


@dataclass(frozen=True)
class VerifyOptions:
    """``kcompact verify``'s options (``--against`` is replication's VerifyAgainstOptions)."""

    store: str
    json: bool = False


def run_inspect(opts: InspectOptions) -> int:
    """Every partition, a damaged one marked with its reason; exit 1 (after the whole table or
    document) when any is damaged."""
    store = Store.open(opts.store)
    doc = store_summary(store, opts.topic, verify=opts.verify)
    damaged = [Damage(**p["damaged"]) for t in doc["topics"] for p in t["partitions"]
               if p.get("damaged")]
    if opts.plot:
        plot_store(doc, opts.plot)
        print(f"wrote {opts.plot}", file=sys.stderr)
    if opts.json:
        print_json(doc)
        return _damage_exit(damaged)
    print(f"store {doc['store']}  id {doc['store_id']}  format {doc['format_version']}")
    hdr = ("TOPIC", "PART", "SEGS", "FORMATS", "RECORDS", "TOMBS", "KEYLESS", "SIZE", "INDEX",
           "ACTIVE", "FIRST", "NEXT", "HORIZON", "DIRTY", "DUE", "LAST RUN")
    # a store with shared uploads (S3): how many shared objects each partition depends on
    shared = SHARED_FEATURE in store.meta.features
    if shared:
        hdr = hdr[:3] + ("SHARED",) + hdr[3:]
    if opts.verify:
        hdr = hdr + ("VERIFIED",)
    rows = []
    for t in doc["topics"]:
        for p in t["partitions"]:
            checked = ()
            if opts.verify:
                v = p["verify"]
                checked = ((f"ok ({v['records']} records)" if v["ok"] else
                            f"{len(v['problems'])} problems"),)
            if p.get("damaged") and "segments" not in p:
                # the reason goes below the table, where a long line does not widen it
                rows.append((t["topic"], p["partition"],
                             *(["?"] * (len(hdr) - 3 - len(checked))), "DAMAGED (below)",
                             *checked))
                continue
            row = (t["topic"], p["partition"], p["segments"], _formats_text(p),
                   p["records"], p["tombstones"], p["keyless"], human_bytes(p["bytes"]),
                   human_bytes(p["index_bytes"]), human_bytes(p.get("active_bytes", 0)),
                   p["first_offset"],
                   p["next_offset"], p.get("compaction_horizon", -1),
                   f"{p.get('dirty_ratio', 0.0):.2f}",
                   ", ".join(p.get("compaction_due") or []) or "-",
                   "DAMAGED (below)" if p.get("damaged") else _last_run_text(p))
            row = row[:3] + (p.get("shared_objects", 0),) + row[3:] if shared else row
            rows.append(row + checked)
    widths = ([max(len(str(x)) for x in col) for col in zip(hdr, *rows)] if rows
              else [len(h) for h in hdr])
    for row in (hdr, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    if not rows:
        print("(no partitions)")
    for d in damaged:
        print(f"{d.name}: DAMAGED: {d.where()}{d.found()}")
    _print_estate(doc)
    return _damage_exit(damaged)


def _print_estate(doc: dict[str, Any]) -> None:
    """When each topic's configs, ACLs, group offsets and schemas were last captured, below
    the partitions, for a store that keeps ACLs or schemas (``--json``: each topic's
    ``captured``)."""
    from kcompact.compaction.history import format_time
    cap = [(t["topic"], t["captured"]) for t in doc["topics"] if "captured" in t]
    if not any(c["acls"] or c["schemas"] for _, c in cap):
        return  # (the table's lines stay as they were for a store that keeps neither)
    rows = [(name, *[format_time(c[k]).split(" ")[0] if c[k] else "-" for k in ESTATE])
            for name, c in cap if any(c.values())]
    hdr = ("TOPIC", "CONFIGS SYNCED", "ACLS CAPTURED", "GROUPS KEPT", "SCHEMAS CAPTURED")
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    for row in (hdr, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def _damage_exit(damaged: list[Damage]) -> int:
    if not damaged:
        return 0
    more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
    raise ConnectorsError(f"{damaged[0].name} is damaged{more}: {damaged[0].where()}; "
                          f"{REPAIR_HINT}")


def _formats_text(p: dict[str, Any]) -> str:
    """The FORMATS column: how many segments of each store format and codec, e.g.
    ``v2/zstd:3,v1:1`` (the active segment is always format 1)."""
    counts: dict[str, int] = {}
    for s in p["segment_list"]:
        k = f"v{s['format']}/{s['codec']}" if s["format"] == 2 else f"v{s['format']}"
        counts[k] = counts.get(k, 0) + 1
    return ",".join(f"{k}:{n}" for k, n in sorted(counts.items(), reverse=True)) or "-"


def _last_run_text(p: dict[str, Any]) -> str:
    """The LAST RUN column of `inspect`: when the last compaction ended (UTC, when the store
    knows it) and what it did: the records it kept and dropped, or, on a replica, the master
    store it was replicated from (a replica installs the master's compacted segments instead of
    compacting them again: replication/replica.py); ``never`` before the first one."""
    run = p.get("last_compaction")
    if not run:
        return "never"
    if "records_kept" in run:
        what = f"kept {run['records_kept']} dropped {run.get('records_dropped', 0)}"
    elif "replicated_from" in run:
        what = f"replicated from store {run['replicated_from']}"
    else:  # written by a newer kcompact: the time is still worth showing
        what = "compacted"
    when = p.get("last_compaction_ms")
    if when is None:
        return what
    return time.strftime("%Y-%m-%d %H:%M:%SZ ", time.gmtime(when / 1000)) + what


def record_json(r: Record) -> dict[str, Any]:
    """The `dump --json` object of one record (DESIGN.md)."""
    d: dict[str, Any] = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                         "timestamp": r.timestamp}
    text_or_b64("key", r.key, d)
    text_or_b64("value", r.value, d)
    hs = []
    for name, value in r.headers:
        h: dict[str, Any] = {"key": name}
        text_or_b64("value", value, h)
        hs.append(h)
    d["headers"] = hs
    return d


#: Characters of a key or value (and of a header value) that text `dump` shows.
DUMP_TEXT_CUT = 60
DUMP_HEADER_CUT = 20


def dump_field(data: bytes | None, limit: int = DUMP_TEXT_CUT) -> str:
    """A key, value or header value as text `dump` prints it: ``null`` when there is none (a
    keyless record's key, a tombstone's value), ``"text"`` in double quotes when it is
    printable UTF-8 (so the key ``null`` prints as ``"null"``), else ``b64:`` and its base64.
    Beyond ``limit`` characters it is cut, and says so with its whole size:
    ``"abc..."... (cut: 472 bytes)``; ``dump --json`` prints every byte."""
    if data is None:
        return "null"
    try:
        s = data.decode("utf-8")
        if not s.isprintable():
            raise UnicodeDecodeError("utf-8", data, 0, 1, "unprintable")
        quote = '"'
    except UnicodeDecodeError:
        s, quote = "b64:" + base64.b64encode(data).decode(), ""
    if len(s) <= limit:
        return f"{quote}{s}{quote}"
    return f"{quote}{s[:limit]}{quote}... (cut: {len(data):,} bytes)"


def _header_name(name: str) -> str:
    """A header name as text `dump` prints it: as it is, or in double quotes when it would be
    hard to read (empty, or with spaces, '=', quotes or unprintable characters)."""
    plain = name and name.isprintable() and not any(c in name for c in ' ="')
    return name if plain else '"' + name.encode("unicode_escape").decode() + '"'


def dump_line(r: Record) -> str:
    """One record of text `dump`: offset, timestamp (ms), key, value and headers
    (``name=value`` separated by spaces), tab-separated (README, "Commands")."""
    line = f"{r.offset}\t{r.timestamp}\t{dump_field(r.key)}\t{dump_field(r.value)}"
    if r.headers:
        line += "\t" + " ".join(f"{_header_name(k)}={dump_field(v, DUMP_HEADER_CUT)}"
                                 for k, v in r.headers)
    return line + "\n"


def run_dump(opts: DumpOptions) -> int:
    store = Store.open(opts.store)
    _check_topic(store, opts.topic)
    known = known_partitions(store, opts.topic)
    if opts.partition not in known:  # a recorded partition with no record yet dumps as empty
        raise ConnectorsError(f"{opts.topic}-{opts.partition} is not in store {store.url}; "
                              f"partitions of {opts.topic!r}: "
                              f"{', '.join(map(str, known)) or '(none)'}")
    out = sys.stdout
    try:
        if opts.as_of_ms is not None:
            return _dump_as_of(store, opts)
        for r in store.iter_records(opts.topic, opts.partition, opts.from_offset, opts.limit):
            out.write(json.dumps(record_json(r)) + "\n" if opts.json else dump_line(r))
    except CorruptRecordError as e:  # (the records before it are printed) remembered, then
        remember(store, Damage.of(opts.topic, opts.partition, e), "dump")  # said
        raise
    return 0


def _dump_as_of(store: Store, opts: DumpOptions) -> int:
    """``dump --as-of``: the partition's state at that time (compaction/history.py), checked
    exact before (and again after: a compaction meanwhile) unless ``--allow-inexact``."""
    from kcompact.compaction import history
    what = f"{opts.topic}-{opts.partition}"
    if opts.partition not in store.partitions(opts.topic):
        return 0  # recorded, nothing written yet: the state is empty at any time
    check = lambda: history.check_exact(  # noqa: E731
        [store.partition(opts.topic, opts.partition)], opts.as_of_ms, what,
        allow_inexact=opts.allow_inexact)
    check()
    out = sys.stdout
    for r in history.iter_as_of(store, opts.topic, opts.partition, opts.as_of_ms,
                                from_offset=opts.from_offset, limit=opts.limit):
        out.write(json.dumps(record_json(r)) + "\n" if opts.json else dump_line(r))
    store.release_partition(opts.topic, opts.partition)
    check()
    return 0


def run_verify(opts: VerifyOptions) -> int:
    """Exit 1 when any problem is found (each named with its file and position)."""
    store = Store.open(opts.store)
    report = verify_store(store)
    if opts.json:
        print_json(report.to_dict())
    else:
        for p in report.problems:
            print(str(p))
        print(f"{'OK' if report.ok else 'CORRUPT'}: {report.partitions} partitions, "
              f"{report.segments} segments, {report.records} records, "
              f"{human_bytes(report.bytes)}, {report.commitlog_segments} commit-log segments, "
              f"{len(report.problems)} problems")
    return 0 if report.ok else 1
