"""Run every benchmark in bench/ at one size and write REPORT.md with PNG plots.

    python bench/report.py [--scale 0.1] [--only store,compaction,...] [--out bench]
                           [--map-budget SIZE] [--timeout 3600]

``--scale`` multiplies each benchmark's record count (1.0 = the sizes the issues name). Each
benchmark measures its figure next to a baseline in the same run; the report reads the figures
from the benchmark's JSON document (``--json-out FILE``, or ``--json`` on stdout for a benchmark
without it) into one table, headline next to baseline as a ratio, and quotes each benchmark's
printed output in full below. The plots are measurements too:

* **offset-map memory per key**: for one fixed budget (128 MiB at ``--scale 1``, scaled down
  with it; ``--map-budget`` to choose), n distinct random digests are inserted into a real
  ``compaction.OffsetMap`` for n from 1% to 4x its capacity, each n in a fresh process, and the
  bytes per key *held* are plotted: the table's nbytes / keys held and the process RSS delta
  around building the map / keys held, against Kafka's cleaner (24-byte MD5 entries at load
  factor 0.9 = 26.7 B/key) and WarpStream (41 B/key). Beyond capacity the map holds the same
  keys and the compactor needs more rounds: a second panel shows the rounds of real forced
  compactions (``compaction.Compactor``) of partitions holding 0.5x to 4x the capacity of a small
  map, next to ceil(distinct keys / keys held);
* **compaction throughput vs record count**: ``bench/compaction.py --json`` at three sizes.

A benchmark or a plot that fails is named in REPORT.md and makes the exit status 1; a plot
without any data is not written.

Why one file of ~800 lines: it is a script, run as ``python bench/report.py`` from a checkout (no
package to import helpers from), and it re-executes itself (``_child``) to take each memory
measurement in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# name -> (script, arguments at scale 1.0 as (flag, value))
BENCHES = {
    "store": ("store.py", [("--records", 2_000_000), ("--lookup-entries", 10_000_000)]),
    "compaction": ("compaction.py", [("--records", 10_000_000), ("--keys", 1_000_000)]),
    "mirror": ("mirror.py", [("--records", 2_000_000)]),
    "spark": ("spark.py", [("--records", 2_000_000)]),
    "replication": ("replication.py", [("--size", "1GiB")]),
    "kv": ("kv.py", [("--keys", 1_000_000), ("--updates", 10_000_000)]),
    "s3": ("s3.py", [("--records", 1_000_000)]),
    "restore": ("restore.py", [("--keys", 1_000_000)]),
    "kafka_peers": ("kafka_peers.py", [("--records", 1_000_000)]),
    "storage": ("storage.py", [("--updates", 1_000_000), ("--keys", 100_000),
                               ("--random-records", 3_000_000)]),
    "point_read": ("point_read.py", [("--records", 1_000_000), ("--keys", 100_000)]),
}

KAFKA_BYTES_PER_KEY = 24 / 0.9      # MD5 (16 B) + offset (8 B) per slot, load factor 0.9
WARPSTREAM_BYTES_PER_KEY = 41.0
DEFAULT_MAP_BUDGET = 128 << 20      # compaction's default --offset-map-memory
#: keys offered to the map, as multiples of its capacity (keys held when full)
MAP_FRACTIONS = (0.01, 0.03, 0.1, 0.3, 0.6, 1.0, 1.5, 2.0, 4.0)
#: the rounds panel: real compactions with a small map, at these multiples of its capacity
ROUNDS_BUDGET = 256 << 10
ROUNDS_FRACTIONS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
#: compaction throughput plot sizes at scale 1.0 (keys = records / 10)
COMPACTION_SIZES = (1_000_000, 3_000_000, 10_000_000)
STDERR_LINES = 60                   # stderr lines quoted for a benchmark that succeeded


def scaled(args, scale: float) -> list[str]:
    out = []
    for flag, value in args:
        if isinstance(value, int):
            value = max(1000, int(value * scale))
        elif isinstance(value, str) and value.endswith("GiB"):
            value = f"{max(16, int(float(value[:-3]) * 1024 * scale))}MiB"
        out += [flag, str(value)]
    return out


# ---------------------------------------------------------------------------------------------
# running the benchmarks


@dataclass
class BenchResult:
    """One benchmark run: its command, exit status, printed output and JSON document."""
    name: str
    cmd: list[str]
    rc: int
    secs: float
    stdout: str = ""
    stderr: str = ""
    doc: Any = None
    error: str | None = None       # why the run counts as failed, None when it succeeded

    @property
    def ok(self) -> bool:
        return self.error is None


def _supports_json_out(script: str) -> bool:
    with open(os.path.join(HERE, script)) as f:
        return "--json-out" in f.read()


def _json_from_stdout(text: str) -> Any:
    """The JSON document a benchmark printed with --json (anything before it is skipped)."""
    text = text.strip()
    for i, c in enumerate(text):
        if c in "{[" and (i == 0 or text[i - 1] == "\n"):
            try:
                return json.loads(text[i:])
            except ValueError:
                continue
    raise ValueError("no JSON document on stdout")


def run_bench(name: str, scale: float, timeout: int, tmp: str) -> BenchResult:
    script, args = BENCHES[name]
    cmd = [sys.executable, os.path.join(HERE, script), *scaled(args, scale)]
    json_out = os.path.join(tmp, f"{name}.json") if _supports_json_out(script) else None
    cmd += ["--json-out", json_out] if json_out else ["--json"]
    shown = ["python", os.path.relpath(cmd[1], ROOT), *cmd[2:]]
    if json_out:
        shown = shown[:-2]   # the report's own temporary file is not part of the command to read
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return BenchResult(name, shown, 124, timeout, out or "", err or "",
                           error=f"timed out after {timeout}s")
    res = BenchResult(name, shown, p.returncode, time.perf_counter() - t, p.stdout, p.stderr)
    if p.returncode != 0:
        res.error = f"exit {p.returncode}"
        return res
    try:
        if json_out:
            with open(json_out) as f:
                res.doc = json.load(f)
        else:
            res.doc = _json_from_stdout(p.stdout)
    except (OSError, ValueError) as e:
        res.error = f"exit 0 but no JSON document ({e})"
    return res


# ---------------------------------------------------------------------------------------------
# headline figures: each benchmark's figure next to its same-run baseline


@dataclass
class Headline:
    figure: str
    ours: str
    baseline: str                  # "name value" of the same-run baseline, or "-"
    ratio: float | None = None
    ratio_means: str = ""          # e.g. "ours / cp -r"
    target: str = "-"
    met: bool | None = None        # None: no target


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M rec/s" if x >= 1e5 else f"{x:,.0f} rec/s"


def _s(x: float) -> str:
    return f"{x:.2f} s"


def _us(x: float) -> str:
    return f"{x:.2f} us"


def _store(d: dict) -> list[Headline]:
    out = []
    for label, what in (("fsync", "fsync at flush"), ("no_fsync", "no fsync")):
        r = d["append"][label]
        out.append(Headline(f"append + reput, {d['append']['records']:,} records, {what}",
                            _rate(r["ours_rps"]), f"raw file writes {_rate(r['raw_rps'])}",
                            r["ratio_vs_raw"], "ours / raw", ">= 2M rec/s",
                            r["ours_rps"] >= 2e6))
    lk = d["lookup"]
    out.append(Headline(f".bcq offset lookup p99, {lk['entries']:,} entries",
                        _us(lk["ours_p99_us"]), f"bisect on a list {_us(lk['bisect_p99_us'])}",
                        lk["bisect_p99_us"] / lk["ours_p99_us"], "bisect / ours",
                        "p99 <= 20 us", lk["ours_p99_us"] <= 20))
    return out


def _compaction(d: dict) -> list[Headline]:
    limit = d["map_mib"] + 100
    return [
        Headline(f"forced compaction, {d['records']:,} records / {d['keys']:,} keys",
                 _s(d["compact_s"]), f"cp -r {_s(d['copy_s'])}", d["ratio_vs_copy"],
                 "ours / cp -r", "<= 1.5", d["ratio_vs_copy"] <= 1.5),
        Headline(f"compaction peak RSS, {d['map_mib']:.0f} MiB map",
                 f"{d['peak_rss_mib']:.0f} MiB",
                 f"process that only imports kcompact {d['baseline_rss_mib']:.0f} MiB",
                 d["peak_rss_mib"] / d["baseline_rss_mib"], "ours / import-only",
                 f"<= map + 100 MiB ({limit:.0f} MiB)", d["peak_rss_mib"] <= limit),
    ]


def _mirror(d: dict) -> list[Headline]:
    target = d.get("target_ratio", 0.8)
    return [Headline(f"mirror --engine local, {d['records']:,} records, {d['partitions']} "
                     "partitions", _rate(d["mirror_rec_per_s"]),
                     f"raw consume {_rate(d['raw_consume_rec_per_s'])}", d["ratio"],
                     "ours / raw (throughput)", f">= {target}", d["ratio"] >= target)]


def _spark(d: dict) -> list[Headline]:
    r = d["mirror_ratio_local_over_spark"]
    return [
        Headline(f"mirror --engine spark, {d['records']:,} records, {d['partitions']} "
                 "partitions", _rate(d["mirror_spark_rec_per_s"]),
                 f"--engine local {_rate(d['mirror_local_rec_per_s'])}", r,
                 "spark / local (throughput)", ">= 1.0 (not slower)", r >= 1.0),
        Headline("read every record: Spark data source count()",
                 _s(d["datasource_count_all_s"]), f"kcompact dump {_s(d['dump_s'])}",
                 d["read_ratio_dump_over_datasource"], "dump time / data source time"),
    ]


def _replication(d: dict) -> list[Headline]:
    return [
        Headline(f"replica rebuild, {d['bytes'] / 1e6:,.0f} MB, {d['partitions']} partitions",
                 _s(d["rebuild_s"]), f"cp -r {_s(d['cp_s'])}", d["ratio_rebuild_vs_cp"],
                 "ours / cp -r", "<= 2.0", d["ratio_rebuild_vs_cp"] <= 2.0),
    ] + ([
        Headline("replica rebuild (durable: fsynced) vs a durable copy",
                 _s(d["rebuild_s"]), f"cp -r + sync {_s(d['cp_sync_s'])}",
                 d["ratio_rebuild_vs_cp_sync"], "ours / (cp -r + sync)"),
    ] if "ratio_rebuild_vs_cp_sync" in d else []) + [
        Headline("verify --against the master", "EQUAL" if d["verify_equal"] else "DIFFERENT",
                 "-", target="equal", met=bool(d["verify_equal"])),
    ]


def _kv(d: dict) -> list[Headline]:
    what = f"time to a ready map, {d['keys']:,} keys / {d['updates']:,} updates"
    out = []
    if "quix_latest" in d:
        r = d["ratio_quix_latest"]
        out.append(Headline(what, _s(d["ours_s"]), "quixstreams, latest-per-key topic "
                            f"{_s(d['quix_latest']['ready_wall_s'])}", r,
                            "quixstreams / ours (x sooner)", ">= 10", r >= 10))
    else:
        out.append(Headline(what, _s(d["ours_s"]), "quixstreams not run", target=">= 10"))
    if "quix_full" in d:
        out.append(Headline(what, _s(d["ours_s"]), "quixstreams, full-history topic "
                            f"{_s(d['quix_full']['ready_wall_s'])}", d["ratio_quix_full"],
                            "quixstreams / ours (x sooner)"))
    g = d["get"]
    out.append(Headline("KVMap.get p99 (hit), in-process", _us(g["hit_p99_us"]), "-",
                        target="<= 10 us", met=g["hit_p99_us"] <= 10))
    return out


def _s3(rows: list) -> list[Headline]:
    # bench/s3.py's figure, from its unrounded per-partition overhead (the JSON rounds it to
    # 0.01, enough to turn an exact 4.00 into 4.001): total - overhead = 2 x (segments in + out)
    worst = max((r["total"] - (r["total"] - 2 * r["segments_in"] - 2 * r["segments_out"]))
                / r["segments_in"] for r in rows)
    ovh = max((r["total"] - 2 * r["segments_in"] - 2 * r["segments_out"]) / r["partitions"]
              for r in rows)
    out = [Headline("S3 requests per input segment, net of the per-partition overhead",
                    f"{worst:.2f}", "-", target="<= 4", met=worst <= 4 + 1e-9),
           Headline("S3 requests of that per-partition overhead (list, manifest, ...)",
                    f"{ovh:.2f} per partition", "-")]
    main_rows = rows[:-1] if len(rows) > 1 else rows   # the last row re-checks 4x larger records
    r = max(main_rows, key=lambda r: r["partitions"])
    out.append(Headline(f"forced compaction on S3, {r['records']:,} records, {r['partitions']} "
                        "partitions", _s(r["seconds"]), f"local disk {_s(r['local_seconds'])}",
                        r["time_ratio"], "S3 / local disk (time)"))
    return out


def _restore(d: dict) -> list[Headline]:
    target = d.get("target", 0.8)
    return [Headline(f"restore, {d['keys']:,} live keys, {d['partitions']} partitions",
                     _rate(d["rate_median"]["restore"]),
                     f"raw confluent-kafka producer {_rate(d['rate_median']['raw'])}",
                     d["ratio_of_medians"], "ours / raw (throughput)", f">= {target}",
                     d["ratio_of_medians"] >= target)]


def _kafka_peers(d: dict) -> list[Headline]:
    """kcompact next to Apache Kafka's own tools on a real Kafka (bench/kafka_peers.py)."""
    m, r, c = d["mirror"], d["restore"], d["compaction"]
    where = f"Apache Kafka {d['kafka_version']}, {d['records']:,} records"
    return [
        Headline(f"mirror on {where}", _rate(m["rec_per_s"]),
                 f"Kafka's ConsumerPerformance {_rate(m['peer_fetch_rec_per_s'])}", m["ratio"],
                 "ours / Java consumer (throughput)", ">= 1.0", m["ratio"] >= 1.0),
        Headline(f"restore on {where}", _rate(r["rec_per_s"]),
                 f"Kafka's ProducerPerformance {_rate(r['peer_rec_per_s'])}", r["ratio"],
                 "ours / Java producer (throughput)", ">= 1.0", r["ratio"] >= 1.0),
        Headline(f"compaction of {d['records']:,} records / {d['keys']:,} keys",
                 _rate(c["ours"]["rec_per_s"]),
                 f"Kafka's log cleaner {_rate(c['kafka']['rec_per_s'])} "
                 f"({c['kafka']['mb_per_s']:.1f} MB/s)", c["ratio"],
                 "ours / Kafka's cleaner (records/s)", ">= 3", c["ratio"] >= 3)
        if "rec_per_s" in c["ours"] else  # a run from before records/s was measured
        Headline(f"compaction of {d['records']:,} records / {d['keys']:,} keys",
                 f"{c['ours']['mb_per_s']:.1f} MB/s",
                 f"Kafka's log cleaner {c['kafka']['mb_per_s']:.1f} MB/s", c["ratio"],
                 "ours / Kafka's cleaner (MB/s)", ">= 3", c["ratio"] >= 3),
    ]


def _storage(d: dict) -> list[Headline]:
    """Bytes at rest next to Kafka's own log of the same live records (bench/storage.py)."""
    out = []
    for key, label, codec, target in (("json_zstd", "JSON, zstd", "zstd", 2.0),
                                      ("json_none", "JSON, uncompressed", "uncompressed", 1.25),
                                      ("random", "random 100 B values", "uncompressed", 1.15)):
        w = d[key]
        k, ours = w["kafka"], w["kcompact"][codec]
        out.append(Headline(f"bytes at rest, {w['live']:,} live records ({label})",
                            f"{ours['total'] / 1e6:.2f} MB ({ours['per_record']:.1f} B/rec)",
                            f"Kafka {d['kafka_version']} .log+indexes {k['total'] / 1e6:.2f} MB",
                            ours["ratio"], "ours / Kafka (bytes)", f"<= {target}",
                            ours["ratio"] <= target))
    return out


def _point_read(d: dict) -> list[Headline]:
    """A one-record read by offset in store format 2 next to a baseline (bench/point_read.py)."""
    target = d.get("target_p99_ratio", 1.2)
    return [Headline(f"one-record read by offset p99, {d['live']:,} live records",
                     _us(d["p99_us"]), f"{d['baseline']} {_us(d['baseline_p99_us'])}",
                     d["p99_ratio"], "ours / baseline (p99)", f"<= {target}",
                     d["p99_ratio"] <= target)]


HEADLINES: dict[str, Callable[[Any], list[Headline]]] = {
    "store": _store, "compaction": _compaction, "mirror": _mirror, "spark": _spark,
    "replication": _replication, "kv": _kv, "s3": _s3, "restore": _restore,
    "kafka_peers": _kafka_peers, "storage": _storage, "point_read": _point_read,
}


def headlines(res: BenchResult) -> list[Headline]:
    """The benchmark's headline rows; a document without the expected fields marks the run
    failed (the report would otherwise silently miss its figure)."""
    if not res.ok:
        return []
    try:
        return HEADLINES[res.name](res.doc)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError) as e:
        res.error = f"its JSON lacks a headline field ({type(e).__name__}: {e})"
        return []


def headline_table(results: list[BenchResult]) -> list[str]:
    lines = ["| benchmark | figure | kcompact | baseline (same run) | ratio | target | met |",
             "|---|---|---:|---:|---:|---|---|"]
    for res in results:
        rows = headlines(res)
        if not res.ok:
            lines.append(f"| {res.name} | **FAILED: {res.error}** (output below) | | | | | |")
            continue
        for h in rows:
            ratio = f"{h.ratio:.2f} ({h.ratio_means})" if h.ratio is not None else "-"
            met = "-" if h.met is None else ("yes" if h.met else "**no**")
            lines.append(f"| {res.name} | {h.figure} | {h.ours} | {h.baseline} | {ratio} | "
                         f"{h.target} | {met} |")
    return lines


def bench_section(res: BenchResult) -> list[str]:
    status = "ok" if res.ok else f"FAILED ({res.error})"
    out = [f"### {res.name}: {status}, {res.secs:.0f} s", "", "```",
           f"$ {shlex.join(res.cmd)}"]
    if res.stdout.strip():
        out.append(res.stdout.rstrip())
    err = res.stderr.rstrip().splitlines()
    if err:
        keep = err if not res.ok or len(err) <= STDERR_LINES else err[-STDERR_LINES:]
        out.append(f"[stderr{'' if keep is err else f', last {len(keep)} of {len(err)} lines'}]")
        out += keep
    out += ["```", ""]
    return out


# ---------------------------------------------------------------------------------------------
# the offset map: memory per key held, and compaction rounds beyond capacity

_ENTRY = [("offset", "<i8"), ("digest_lo", "<u8"), ("digest_hi", "<u8"), ("flags", "<u2")]


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def measure_map_point(budget: int, keys: int, chunk: int = 1 << 16, seed: int = 5) -> dict:
    """Insert ``keys`` distinct random digests into a fresh OffsetMap(budget) in .bcq-sized
    chunks until it is full; the RSS delta is measured from before the map is allocated to after
    the last insert. Run it in a fresh process (``_child map``) so no earlier map is resident."""
    import gc

    import numpy as np

    from kcompact.compaction.offset_map import OffsetMap

    rng = np.random.default_rng(seed)

    def entries(lo: int, hi: int) -> np.ndarray:
        e = np.zeros(hi - lo, _ENTRY)
        e["offset"] = np.arange(lo, hi)
        e["digest_lo"] = np.frombuffer(rng.bytes(8 * (hi - lo)), np.uint64)
        e["digest_hi"] = np.frombuffer(rng.bytes(8 * (hi - lo)), np.uint64)
        return e

    # load the compiled kernel and size the allocator for one chunk before the baseline
    warm = OffsetMap(1 << 16)
    e = entries(0, chunk)
    warm.insert_entries(e[:warm.max_keys])
    del warm, e
    gc.collect()
    rss0 = _rss()
    m = OffsetMap(budget)
    rss_alloc = _rss()
    full, lo = False, 0
    while lo < keys and not full:
        hi = min(keys, lo + chunk)
        _, full = m.insert_entries(entries(lo, hi))
        lo = hi
    rss1 = _rss()
    return {"budget": budget, "keys_offered": keys, "keys_held": m.count,
            "max_keys": m.max_keys, "full": bool(full or m.count >= m.max_keys),
            "table_nbytes": int(m.nbytes),
            "rss_delta": None if rss0 is None else rss1 - rss0,
            "rss_delta_at_alloc": None if rss0 is None else rss_alloc - rss0}


def measure_rounds(budget: int, fractions=ROUNDS_FRACTIONS) -> list[dict]:
    """Forced compactions of one partition holding n distinct keys, each written twice in a row
    (so half the records are dropped), with an offset map of ``budget`` bytes; n at
    ``fractions`` of the map's capacity. Returns the rounds each compaction ran."""
    import shutil

    import numpy as np

    from kcompact.compaction import CompactionOptions, Compactor
    from kcompact.compaction.offset_map import OffsetMap
    from kcompact.reput import Store, WriterOptions
    from kcompact.reput.record import RecordBatch, BytesColumn

    capacity = OffsetMap(budget).max_keys
    out = []
    for f in fractions:
        n = max(1, int(round(f * capacity)))
        work = tempfile.mkdtemp(prefix="kcompact-report-rounds-")
        try:
            key_ids = np.repeat(np.arange(n, dtype=">u8"), 2)            # k0 k0 k1 k1 ...
            keys = np.zeros((2 * n, 16), np.uint8)
            keys[:, 8:] = key_ids.view(np.uint8).reshape(-1, 8)
            values = np.full((2 * n, 10), 7, np.uint8)
            with Store.open(work, writer="report", create=True,
                            options=WriterOptions(fsync="never")) as st:
                st.append(RecordBatch.from_columns(
                    "rounds", 0, np.arange(2 * n, dtype=np.int64), 1_700_000_000_000,
                    keys=BytesColumn.fixed(keys, 16), values=BytesColumn.fixed(values, 10)))
                st.flush()
                r = Compactor(st, CompactionOptions(offset_map_memory=budget)) \
                    .compact_partition("rounds", 0, force=True)
            out.append({"budget": budget, "capacity": capacity, "keys": n, "records": 2 * n,
                        "rounds": r.rounds, "records_kept": r.records_kept,
                        "map_keys_max": r.map_keys_max})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _child(kind: str, *args: str, timeout: int = 900) -> tuple[Any, str | None]:
    """Run a measurement in a fresh interpreter: (its JSON result, None) or (None, error)."""
    cmd = [sys.executable, os.path.abspath(__file__), "_child", kind, *args]
    # glibc: a fixed mmap threshold, so the freed chunks of digests go back to the system at
    # once instead of staying in the heap and showing up as part of the map's RSS growth
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                           env=env)
    except subprocess.TimeoutExpired:
        return None, f"{kind} {' '.join(args)}: timed out after {timeout}s"
    if p.returncode != 0:
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        return None, f"{kind} {' '.join(args)}: exit {p.returncode}: {tail}"
    try:
        return json.loads(p.stdout.strip().splitlines()[-1]), None
    except (ValueError, IndexError) as e:
        return None, f"{kind} {' '.join(args)}: no JSON result ({e})"


def map_budget_for(scale: float) -> int:
    return max(1 << 20, int(DEFAULT_MAP_BUDGET * min(scale, 1.0)) // 16 * 16)


def measure_map_memory(budget: int) -> tuple[list[dict], list[dict], list[str]]:
    """(memory points, rounds points, errors), each measurement in its own process."""
    # the capacity without allocating a map in this process: slots x load, as OffsetMap does
    from kcompact.compaction.offset_map import DEFAULT_MAX_LOAD, SLOT_BYTES
    capacity = int((budget // SLOT_BYTES) * DEFAULT_MAX_LOAD)
    points, errors = [], []
    for f in MAP_FRACTIONS:
        doc, err = _child("map", str(budget), str(max(1, int(round(f * capacity)))))
        if err:
            errors.append(err)
        else:
            points.append(doc)
    rounds, err = _child("rounds", str(ROUNDS_BUDGET))
    if err:
        errors.append(err)
    return points, rounds or [], errors


def rounds_needed(keys: int, keys_held: int) -> int:
    """Rounds for a dirty range of ``keys`` distinct keys when a full map holds ``keys_held``."""
    return max(1, math.ceil(keys / keys_held)) if keys_held else 0


def plot_map_memory(points: list[dict], rounds: list[dict], path: str) -> dict | None:
    """Two panels (see the module docstring). Returns the plotted series {label: (xs, ys)}, or
    None (and no file) when there is nothing measured to plot."""
    if os.path.exists(path):
        os.remove(path)   # never leave an earlier run's plot next to this run's report
    points = [p for p in points if p.get("keys_held")]
    if not points:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["keys_offered"])
    budget = points[0]["budget"]
    held_full = max(p["keys_held"] for p in points)
    series: dict[str, tuple[list, list]] = {}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 7.5), height_ratios=(3, 2))
    xs = [p["keys_offered"] for p in points]
    ys = [p["table_nbytes"] / p["keys_held"] for p in points]
    ax.plot(xs, ys, "o-", label="kcompact: table bytes (the budget) / keys held")
    series["table"] = (xs, ys)
    rss = [p for p in points if p.get("rss_delta") is not None]
    if rss:
        rx = [p["keys_offered"] for p in rss]
        ry = [max(p["rss_delta"], 1) / p["keys_held"] for p in rss]
        ax.plot(rx, ry, "x:", color="tab:green", label="kcompact: RSS delta / keys held")
        series["rss"] = (rx, ry)
    lo, hi = min(xs), max(xs)
    ax.hlines(KAFKA_BYTES_PER_KEY, lo, hi, colors="tab:red", linestyles="--",
              label=f"Kafka cleaner, when full ({KAFKA_BYTES_PER_KEY:.1f} B: 24-byte MD5 "
                    "entries, 0.9 load)")
    ax.hlines(WARPSTREAM_BYTES_PER_KEY, lo, hi, colors="tab:gray", linestyles=":",
              label=f"WarpStream ({WARPSTREAM_BYTES_PER_KEY:.0f} B/key)")
    ax.axvline(held_full, color="black", lw=0.8, alpha=0.5)
    ax.annotate(f"full: {held_full:,} keys\n= {budget / held_full:.1f} B/key", (held_full, 0.3),
                xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points",
                fontsize="small")
    labelled = 1
    for p in points:
        k = rounds_needed(p["keys_offered"], held_full)
        if k > labelled:   # one label per rounds count: neighbours on a log axis would overlap
            labelled = k
            ax.annotate(f"{k} rounds", (p["keys_offered"], p["table_nbytes"] / p["keys_held"]),
                        xytext=(0, 8), textcoords="offset points", ha="center",
                        fontsize="x-small")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct keys offered to the map")
    ax.set_ylabel("bytes per key held")
    ax.set_title(f"Offset map, fixed {budget / 2**20:g} MiB budget: memory per key held")
    ax.legend(fontsize="x-small", loc="upper right")
    if rounds:
        cap = rounds[0]["capacity"]
        fx = [r["keys"] / cap for r in rounds]
        ax2.plot(fx, [r["rounds"] for r in rounds], "o", ms=7,
                 label=f"measured: forced compaction, {rounds[0]['budget'] >> 10} KiB map "
                       f"({cap:,} keys), each key twice")
        series["rounds_measured"] = (fx, [r["rounds"] for r in rounds])
        top = max(1, math.ceil(max(fx)))
        ax2.stairs(range(1, top + 1), range(0, top + 1), baseline=None, color="tab:orange",
                   label="ceil(distinct keys / keys held)")
        ax2.set_xlabel("distinct keys in the dirty range / keys a full map holds")
        ax2.set_ylabel("compaction rounds")
        ax2.set_ylim(0, max(r["rounds"] for r in rounds) + 1)
        ax2.legend(fontsize="x-small", loc="upper left")
        ax2.set_title("Beyond capacity: more rounds, same memory", fontsize="medium")
    else:
        ax2.text(0.5, 0.5, "rounds not measured (the compaction run failed)",
                 ha="center", va="center", transform=ax2.transAxes)
        ax2.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def map_memory_section(points: list[dict], rounds: list[dict], png: str | None,
                       errors: list[str]) -> list[str]:
    out = ["## Offset map memory per key", ""]
    if not points:
        out += ["**Not measured**: " + "; ".join(errors or ["no data"]), ""]
        return out
    points = sorted(points, key=lambda p: p["keys_offered"])
    budget = points[0]["budget"]
    held_full = max(p["keys_held"] for p in points)
    out += [f"One fixed budget of {budget / 2**20:g} MiB (`OffsetMap({budget})`, "
            f"{budget // 16:,} 16-byte slots). For each n, a fresh process inserts n distinct "
            "random 128-bit digests until the map is full; *bytes per key held* is the table's "
            "nbytes (the budget, allocated up front) and the process's RSS growth from before "
            "the map was allocated to after the last insert, each divided by the keys the map "
            f"holds. Full, it holds {held_full:,} keys: {budget / held_full:.1f} B/key, against "
            f"{KAFKA_BYTES_PER_KEY:.1f} for Kafka's cleaner ({int(budget / KAFKA_BYTES_PER_KEY):,}"
            f" keys in the same budget) and {WARPSTREAM_BYTES_PER_KEY:.0f} for WarpStream "
            f"({int(budget / WARPSTREAM_BYTES_PER_KEY):,}). Below capacity the budget is still "
            "reserved, so the bytes per key held are higher; beyond it the map holds the same "
            "keys and a compaction runs more rounds (rounds column: ceil(n / keys held), "
            "computed).", ""]
    if png:
        out += [f"![offset map memory per key]({png})", ""]
    out += ["| keys offered | keys held | full | table B / key held | RSS delta B / key held "
            "| rounds (computed) |", "|---:|---:|---|---:|---:|---:|"]
    for p in points:
        rss = "n/a" if p.get("rss_delta") is None else f"{p['rss_delta'] / p['keys_held']:.1f}"
        out.append(f"| {p['keys_offered']:,} | {p['keys_held']:,} | "
                   f"{'yes' if p['full'] else 'no'} | {p['table_nbytes'] / p['keys_held']:.1f} | "
                   f"{rss} | {rounds_needed(p['keys_offered'], held_full)} |")
    out.append("")
    if rounds:
        cap = rounds[0]["capacity"]
        out += [f"Rounds measured by real forced compactions (`compaction.Compactor`) of one "
                f"partition: n distinct keys, each written twice in a row, with a "
                f"{rounds[0]['budget'] >> 10} KiB map ({cap:,} keys when full); small, so that "
                "the partitions stay small. Rounds depend on n / capacity, not on the budget.", "",
                "| distinct keys | x capacity | records | rounds (measured) | ceil(n / held) "
                "| records kept |", "|---:|---:|---:|---:|---:|---:|"]
        for r in rounds:
            out.append(f"| {r['keys']:,} | {r['keys'] / cap:.2f} | {r['records']:,} | "
                       f"{r['rounds']} | {rounds_needed(r['keys'], cap)} | "
                       f"{r['records_kept']:,} |")
        out.append("")
    if errors:
        out += ["**Measurements that failed**: " + "; ".join(errors), ""]
    return out


# ---------------------------------------------------------------------------------------------
# compaction throughput vs record count


def compaction_points(scale: float, timeout: int, reuse: BenchResult | None
                      ) -> tuple[list[dict], list[str]]:
    """bench/compaction.py --json at COMPACTION_SIZES x scale (keys = records / 10); the
    compaction benchmark's own run is reused for the size it already measured."""
    points, errors = [], []
    have = {}
    if reuse is not None and reuse.ok and isinstance(reuse.doc, dict):
        have[reuse.doc.get("records")] = reuse.doc
    for n in sorted({max(20_000, int(x * scale)) for x in COMPACTION_SIZES}):
        keys = max(1000, n // 10)
        if n in have and have[n].get("keys") == keys:
            points.append(have[n])
            continue
        cmd = [sys.executable, os.path.join(HERE, "compaction.py"), "--records", str(n),
               "--keys", str(keys), "--json"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            errors.append(f"{n:,} records: timed out after {timeout}s")
            continue
        if p.returncode != 0:
            tail = " | ".join(p.stderr.strip().splitlines()[-3:])
            errors.append(f"{n:,} records: exit {p.returncode}: {tail}")
            continue
        try:
            points.append(_json_from_stdout(p.stdout))
        except ValueError as e:
            errors.append(f"{n:,} records: {e}")
    return points, errors


_COMPACTION_FIELDS = ("records", "records_per_s", "copy_s", "compact_s", "ratio_vs_copy")


def plot_compaction(points: list[dict], errors: list[str], path: str) -> dict | None:
    """Records/s of compaction and of cp -r vs records. Returns the plotted series, or None
    (and no file) when no run produced a point."""
    if os.path.exists(path):
        os.remove(path)
    usable = []
    for d in points:
        missing = [k for k in _COMPACTION_FIELDS if not isinstance(d.get(k), (int, float))]
        if missing or not d["copy_s"]:
            errors.append(f"{d.get('records', '?')} records: JSON lacks {', '.join(missing)}")
        else:
            usable.append(d)
    if not usable:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    usable.sort(key=lambda d: d["records"])
    xs = [d["records"] for d in usable]
    ours = [d["records_per_s"] / 1e6 for d in usable]
    copy = [d["records"] / d["copy_s"] / 1e6 for d in usable]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ours, "o-", label="kcompact forced compaction")
    ax.plot(xs, copy, "s--", label="cp -r of the same partition (same run)")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("records in the partition (keys = records / 10)")
    ax.set_ylabel("million records / s")
    mib = usable[0].get("map_mib")
    title = "Forced compaction throughput" + (f" ({mib:.0f} MiB offset map)" if mib else "")
    if errors:
        title += f"\n{len(errors)} size(s) failed: see REPORT.md"
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"kcompact": (xs, ours), "cp": (xs, copy)}


def compaction_section(points: list[dict], png: str | None, errors: list[str]) -> list[str]:
    out = ["## Compaction throughput vs record count", ""]
    if png:
        out += [f"![compaction throughput]({png})", ""]
    else:
        out += ["**Plot not produced**: no compaction run succeeded.", ""]
    ok = [d for d in points if all(isinstance(d.get(k), (int, float)) for k in _COMPACTION_FIELDS)]
    if ok:
        out += ["| records | compaction s | cp -r s | compaction / cp -r | records/s |",
                "|---:|---:|---:|---:|---:|"]
        out += [f"| {d['records']:,} | {d['compact_s']:.2f} | {d['copy_s']:.2f} | "
                f"{d['ratio_vs_copy']:.2f} | {d['records_per_s']:,.0f} |"
                for d in sorted(ok, key=lambda d: d["records"])]
        out.append("")
    if errors:
        out += ["**Runs that failed**: " + "; ".join(errors), ""]
    return out


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class Report:
    command: str
    scale: float | None = None
    results: list[BenchResult] = field(default_factory=list)
    compaction: list[dict] = field(default_factory=list)
    compaction_errors: list[str] = field(default_factory=list)
    compaction_png: str | None = None
    map_points: list[dict] = field(default_factory=list)
    map_rounds: list[dict] = field(default_factory=list)
    map_errors: list[str] = field(default_factory=list)
    map_png: str | None = None

    def failures(self) -> list[str]:
        out = [f"{r.name} ({r.error})" for r in self.results if not r.ok]
        if self.compaction_errors or not self.compaction_png:
            out.append("compaction throughput plot"
                       + (f" ({len(self.compaction_errors)} run(s) failed)"
                          if self.compaction_errors else " (no data)"))
        if self.map_errors or not self.map_png:
            out.append("offset map memory plot"
                       + (f" ({len(self.map_errors)} measurement(s) failed)"
                          if self.map_errors else " (no data)"))
        return out

    def render(self) -> str:
        table = headline_table(self.results)     # may mark a run failed: before failures()
        failed = self.failures()
        head = [
            "# kcompact benchmark report", "",
            f"Generated by `{self.command}` on {time.strftime('%Y-%m-%d')} at commit "
            f"{source_commit()}, {platform.machine()} ({cpu_model()}), {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}. Each figure is measured next to a baseline in "
            "the same run; absolute times depend on the machine and its load, the ratios much "
            "less.", "",
        ]
        if self.scale is not None and self.scale < 1:
            head += [f"At `--scale {self.scale:g}` every benchmark runs at that fraction of the "
                     "sizes its issue names, and the targets are for those sizes: a met or "
                     "missed target here says little about the full-size run.", ""]
        if failed:
            head += ["**FAILED: " + "; ".join(failed) + ".** Their output is below.", ""]
        head += ["## Headline figures", "", *table, ""]
        body = map_memory_section(self.map_points, self.map_rounds, self.map_png,
                                  self.map_errors)
        body += compaction_section(self.compaction, self.compaction_png,
                                   self.compaction_errors)
        body += ["## Output of each benchmark", ""]
        for r in self.results:
            body += bench_section(r)
        return "\n".join(head + body)


def source_commit() -> str:
    """The commit the benchmarks ran on (``-dirty`` with uncommitted changes), or ``unknown``
    outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_child"]:          # a measurement in a fresh process (see _child)
        kind, *rest = argv[1:]
        doc = measure_map_point(int(rest[0]), int(rest[1])) if kind == "map" \
            else measure_rounds(int(rest[0]))
        print(json.dumps(doc))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.1,
                    help="multiplier of each benchmark's size (1.0 = the sizes in the issues)")
    ap.add_argument("--only", default=None, help="comma-separated benchmark names")
    ap.add_argument("--out", default=HERE, help="directory of REPORT.md and the plots")
    ap.add_argument("--map-budget", default=None,
                    help="offset-map budget of the memory plot (default: 128MiB x scale, "
                         "at least 1MiB)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per benchmark")
    a = ap.parse_args(argv)
    if a.scale <= 0:
        ap.error("--scale must be positive")
    names = a.only.split(",") if a.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    if a.map_budget:
        from kcompact.connectors.cli import parse_size as _size
        budget = _size(a.map_budget) // 16 * 16
    else:
        budget = map_budget_for(a.scale)
    os.makedirs(a.out, exist_ok=True)
    rep = Report(command="python bench/report.py " + shlex.join(argv) if argv
                 else "python bench/report.py", scale=a.scale)
    with tempfile.TemporaryDirectory(prefix="kcompact-report-") as tmp:
        for name in names:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            res = run_bench(name, a.scale, a.timeout, tmp)
            print(f"  {name}: {'ok' if res.ok else 'FAILED: ' + str(res.error)} "
                  f"({res.secs:.0f} s)", file=sys.stderr, flush=True)
            rep.results.append(res)
    print("measuring the offset map ...", file=sys.stderr, flush=True)
    rep.map_points, rep.map_rounds, rep.map_errors = measure_map_memory(budget)
    mpath = os.path.join(a.out, "map-memory-per-key.png")
    if plot_map_memory(rep.map_points, rep.map_rounds, mpath) is not None:
        rep.map_png = os.path.basename(mpath)
    print("compaction throughput runs ...", file=sys.stderr, flush=True)
    reuse = next((r for r in rep.results if r.name == "compaction"), None)
    rep.compaction, rep.compaction_errors = compaction_points(a.scale, a.timeout, reuse)
    cpath = os.path.join(a.out, "compaction-throughput.png")
    if plot_compaction(rep.compaction, rep.compaction_errors, cpath) is not None:
        rep.compaction_png = os.path.basename(cpath)
    text = rep.render()
    path = os.path.join(a.out, "REPORT.md")
    with open(path, "w") as f:
        f.write(text + "\n")
    failed = rep.failures()
    print(f"wrote {path}" + (f"; FAILED: {'; '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
