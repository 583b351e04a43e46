"""Run every benchmark in bench/ at one size and write bench/REPORT.md with PNG plots.

    python bench/report.py [--scale 0.1] [--only store,compaction,...] [--out bench]

``--scale`` multiplies each benchmark's record count (1.0 = the sizes the issues name). Each
benchmark prints its own figures next to its baseline measured in the same run; the report
quotes that output verbatim, so every number in it is a ratio against a same-run baseline.
Plots (matplotlib): compaction throughput vs record count, and offset-map memory per key vs key
count against the reference figures for Kafka's cleaner (24-byte MD5 entries at load factor 0.9)
and WarpStream (41 bytes per key).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

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
}

KAFKA_BYTES_PER_KEY = 24 / 0.9      # MD5 (16 B) + offset (8 B) per slot, load factor 0.9
WARPSTREAM_BYTES_PER_KEY = 41.0


def scaled(args, scale: float) -> list[str]:
    out = []
    for flag, value in args:
        if isinstance(value, int):
            value = max(1000, int(value * scale))
        elif isinstance(value, str) and value.endswith("GiB"):
            value = f"{max(16, int(float(value[:-3]) * 1024 * scale))}MiB"
        out += [flag, str(value)]
    return out


def run_bench(name: str, scale: float, timeout: int) -> tuple[int, str, float]:
    script, args = BENCHES[name]
    cmd = [sys.executable, os.path.join(HERE, script), *scaled(args, scale)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out = p.stdout + (("\n[stderr]\n" + p.stderr[-2000:]) if p.returncode else "")
        return p.returncode, f"$ {' '.join(cmd[1:])}\n{out.strip()}", time.perf_counter() - t
    except subprocess.TimeoutExpired:
        return 124, f"$ {' '.join(cmd[1:])}\n(timed out after {timeout}s)", timeout


def plot_compaction(out_dir: str, scale: float) -> tuple[str, list[dict]]:
    """Compaction throughput (records/s) vs record count, from bench/compaction.py --json."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = []
    for n in sorted({max(20_000, int(x * scale)) for x in (1e6, 3e6, 10e6)}):
        p = subprocess.run([sys.executable, os.path.join(HERE, "compaction.py"), "--records",
                            str(n), "--keys", str(max(1000, n // 10)), "--json"],
                           capture_output=True, text=True, cwd=ROOT)
        if p.returncode == 0:
            points.append(json.loads(p.stdout))
    path = os.path.join(out_dir, "compaction-throughput.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [d["records"] for d in points]
    ax.plot(xs, [d["records_per_s"] / 1e6 for d in points], "o-", label="kcompact compaction")
    ax.plot(xs, [d["records"] / d["copy_s"] / 1e6 for d in points], "s--",
            label="cp -r of the same partition (same run)")
    ax.set_xscale("log")
    ax.set_xlabel("records in the partition")
    ax.set_ylabel("million records / s")
    ax.set_title("Forced compaction throughput (128 MiB offset map)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, points


def plot_map_memory(out_dir: str) -> tuple[str, list[tuple[int, float]]]:
    """Offset-map bytes per key vs key count: measured (a map sized for N keys, filled with N
    random digests) against Kafka's cleaner and WarpStream's published figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from compaction.offset_map import DEFAULT_MAX_LOAD, SLOT_BYTES, OffsetMap
    measured = []
    rng = np.random.default_rng(5)
    for n in (10_000, 100_000, 1_000_000, 7_500_000):
        mem = int(np.ceil(n / DEFAULT_MAX_LOAD)) * SLOT_BYTES
        m = OffsetMap(mem)
        e = np.zeros(n, dtype=[("offset", "<i8"), ("digest_lo", "<u8"), ("digest_hi", "<u8"),
                               ("flags", "<u2")])
        e["offset"] = np.arange(n)
        e["digest_lo"] = rng.integers(0, 2**63, n, dtype=np.uint64)
        e["digest_hi"] = rng.integers(0, 2**63, n, dtype=np.uint64)
        _, full = m.insert_entries(e)
        if not full and m.count == n:
            measured.append((n, m.table.nbytes / n))
    path = os.path.join(out_dir, "map-memory-per-key.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [n for n, _ in measured]
    ax.plot(xs, [b for _, b in measured], "o-", label="kcompact (measured: 96-bit digest + "
            "32-bit offset, 0.9 load)")
    ax.hlines(KAFKA_BYTES_PER_KEY, xs[0], xs[-1], colors="tab:red", linestyles="--",
              label=f"Kafka cleaner ({KAFKA_BYTES_PER_KEY:.1f} B: 24-byte MD5 slots, 0.9 load)")
    ax.hlines(WARPSTREAM_BYTES_PER_KEY, xs[0], xs[-1], colors="tab:gray", linestyles=":",
              label="WarpStream (41 B/key)")
    ax.set_xscale("log")
    ax.set_ylim(0, 45)
    ax.set_xlabel("distinct keys")
    ax.set_ylabel("offset-map bytes per key")
    ax.set_title("Offset map memory per key")
    ax.legend(fontsize="small", loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.1,
                    help="multiplier of each benchmark's size (1.0 = the sizes in the issues)")
    ap.add_argument("--only", default=None, help="comma-separated benchmark names")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per benchmark")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    os.makedirs(a.out, exist_ok=True)
    sections = []
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rc, text, secs = run_bench(name, a.scale, a.timeout)
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        sections.append(f"## {name} — {status}, {secs:.0f}s\n\n```\n{text}\n```\n")
    print("plotting ...", file=sys.stderr, flush=True)
    cpath, cpoints = plot_compaction(a.out, a.scale)
    mpath, mpoints = plot_map_memory(a.out)
    head = [
        "# kcompact benchmark report",
        "",
        f"Generated by `python bench/report.py --scale {a.scale}` on {time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. "
        "Every figure below is printed by its benchmark next to a baseline measured in the same "
        "run; absolute times depend on the machine and its load, the ratios much less.",
        "",
        f"![compaction throughput]({os.path.basename(cpath)})",
        "",
        f"![offset map memory per key]({os.path.basename(mpath)})",
        "",
        "| distinct keys | kcompact bytes/key (measured) | Kafka cleaner | WarpStream |",
        "|---:|---:|---:|---:|",
        *[f"| {n:,} | {b:.1f} | {KAFKA_BYTES_PER_KEY:.1f} | {WARPSTREAM_BYTES_PER_KEY:.0f} |"
          for n, b in mpoints],
        "",
    ]
    if cpoints:
        head += ["| records | compaction s | cp -r s | compaction/copy | records/s |",
                 "|---:|---:|---:|---:|---:|",
                 *[f"| {d['records']:,} | {d['compact_s']:.2f} | {d['copy_s']:.2f} | "
                   f"{d['ratio_vs_copy']:.2f} | {d['records_per_s']:,.0f} |" for d in cpoints],
                 ""]
    path = os.path.join(a.out, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n" + "\n".join(sections))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
