"""Benchmark: forced compaction of one partition, next to `cp -r` of the same directory.

    python bench/compaction.py [--records 10000000] [--keys 1000000] [--map-memory 128MiB]

One partition of N records (K distinct 16-byte keys, 100-byte values, 10% tombstones), forced
compaction with the default 128 MiB offset map, in a subprocess whose peak RSS is measured, next
to `cp -r` of the same partition directory in the same run (the cost of reading and writing the
bytes once). Targets: compaction time <= 1.5 x copy time; peak RSS <= map budget + 100 MiB.
The RSS of a process that only imports kcompact is printed too.

The compaction runs on the C kernels (compaction/_native.c, reput/_native.c: the process loads
no JIT compiler; their numba twins, which a second run used for comparison, are the tests'
reference since issue 39). Each child first compacts a tiny prebuilt store, so that loading
kernels is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn  # noqa: E402

TOPIC = "bench"
BATCH = 200_000

_CHILD = r"""
import json, sys, time

def hwm_kib():
    # VmHWM is per address space (reset by exec); ru_maxrss would include the parent's peak
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
sys.path.insert(0, {root!r})
from kcompact.reput import Store
from kcompact.compaction import Compactor, CompactionOptions
mode = sys.argv[1]
if mode == "baseline":
    import kcompact.compaction.compactor, kcompact.reput.verify  # everything the compaction imports
    print(json.dumps({{"maxrss_kib": hwm_kib()}}))
    sys.exit(0)
# load the kernels on a tiny prebuilt store first (numba: its cache; C: nothing to load)
t = time.perf_counter()
warm = Store.open(sys.argv[4])
Compactor(warm, CompactionOptions(offset_map_memory=1 << 16)).compact_partition({topic!r}, 0, force=True)
warm.close()
jit_s = time.perf_counter() - t
st = Store.open(sys.argv[2])
c = Compactor(st, CompactionOptions(offset_map_memory=int(sys.argv[3])))
c.delete_delay_s = 3600  # as Kafka's file.delete.delay.ms: replaced files are unlinked later
t = time.perf_counter()
r = c.compact_partition({topic!r}, 0, force=True)
elapsed = time.perf_counter() - t
from kcompact.reput import swap
t = time.perf_counter()
swap.empty_trash(st.fs, st.partition({topic!r}, 0).dir)
unlink_s = time.perf_counter() - t
st.close()
d = r.to_dict()
d["elapsed_s"] = elapsed
d["unlink_s"] = unlink_s
d["jit_load_s"] = jit_s
d["maxrss_kib"] = hwm_kib()
d["numba_loaded"] = "numba" in sys.modules
d["kernels"] = "C"
print(json.dumps(d))
"""


def build_store(path: str, n: int, keys: int, seed: int = 3) -> int:
    rng = np.random.default_rng(seed)
    key_bytes = rng.integers(0, 256, (keys, 16), dtype=np.uint8)
    st = Store.open(path, writer="bench", create=True,
                    options=WriterOptions(fsync="never", commitlog_retention_ms=0))
    for lo in range(0, n, BATCH):
        hi = min(n, lo + BATCH)
        m = hi - lo
        ids = rng.integers(0, keys, m)
        tomb = rng.random(m) < 0.10
        vals = rng.integers(0, 256, (m, 100), dtype=np.uint8)
        vlen = np.where(tomb, 0, 100)
        voffs = np.zeros(m + 1, np.int64)
        np.cumsum(vlen, out=voffs[1:])
        values = BytesColumn(vals[~tomb].reshape(-1), voffs, tomb)
        st.append(RecordBatch.from_columns(TOPIC, 0, np.arange(lo, hi, dtype=np.int64),
                                           1_700_000_000_000,
                                           keys=BytesColumn.fixed(key_bytes[ids], 16),
                                           values=values))
    st.flush()
    st.close()
    shutil.rmtree(os.path.join(path, "commitlog"))  # not part of the partition being measured
    return sum(os.path.getsize(os.path.join(dp, f))
               for dp, _, fs in os.walk(os.path.join(path, "partitions")) for f in fs)


def child(mode: str, *args: str) -> dict:
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT, topic=TOPIC), mode,
                          *args], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_caches_if_root() -> None:
    """Same cache state for both runs: write back dirty pages (no cache drop: needs root)."""
    os.sync()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--map-memory", default="128MiB")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    ap.add_argument("--no-numba-run", action="store_true",
                    help="accepted for old command lines: there is no numba run any more")
    a = ap.parse_args(argv)
    from kcompact.connectors.cli import parse_size as _size
    map_bytes = _size(a.map_memory)
    work = tempfile.mkdtemp(prefix="kcompact-bench-compaction-", dir=a.workdir)
    try:
        store = os.path.join(work, "store")
        t = time.perf_counter()
        size = build_store(store, a.records, a.keys)
        build_s = time.perf_counter() - t
        warm = os.path.join(work, "warm")
        build_store(warm, 1000, 100)
        pdir = os.path.join(store, "partitions", TOPIC, "0")
        child("baseline")  # compile/cache kernels in a first process
        base = child("baseline")
        # warm the page cache the same way for both: read the partition once
        subprocess.run(["cat", *[os.path.join(pdir, f) for f in os.listdir(pdir)
                                 if os.path.isfile(os.path.join(pdir, f))]],
                       stdout=subprocess.DEVNULL, check=True)  # (not the seal's .deleted/)
        drop_caches_if_root()
        t = time.perf_counter()
        subprocess.run(["cp", "-r", pdir, os.path.join(work, "copy")], check=True)
        os.sync()
        copy_s = time.perf_counter() - t
        shutil.rmtree(os.path.join(work, "copy"))
        drop_caches_if_root()
        t = time.perf_counter()
        r = child("compact", store, str(map_bytes), warm)
        os.sync()
        compact_s = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"records": a.records, "keys": a.keys, "partition_bytes": size, "build_s": build_s,
           "copy_s": copy_s, "process_s": compact_s, "compact_s": r["elapsed_s"],
           "unlink_old_s": r["unlink_s"], "jit_load_s": r["jit_load_s"],
           "ratio_vs_copy": r["elapsed_s"] / copy_s,
           "process_ratio_vs_copy": compact_s / copy_s, "records_per_s": a.records / r["elapsed_s"],
           "mb_per_s": size / 1e6 / r["elapsed_s"],
           "peak_rss_mib": r["maxrss_kib"] / 1024, "baseline_rss_mib": base["maxrss_kib"] / 1024,
           "map_mib": map_bytes / 2**20, "rounds": r["rounds"], "kept": r["records_kept"],
           "dropped": r["records_dropped"], "map_keys": r["map_keys_max"],
           "bytes_per_key": r["map_bytes_per_key"], "kernels": r["kernels"],
           "numba_loaded": r["numba_loaded"]}
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"forced compaction of one partition: {a.records:,} records, {a.keys:,} keys, "
          f"{size / 1e6:.0f} MB (store built in {build_s:.1f}s)")
    print(f"  cp -r            {copy_s:7.2f} s")
    print(f"  compaction       {r['elapsed_s']:7.2f} s   compaction/copy = "
          f"{res['ratio_vs_copy']:.2f}   (target <= 1.5)")
    print(f"  + unlinking the replaced segment {r['unlink_s']:.2f} s (deferred, as Kafka's "
          f"file.delete.delay.ms); loading the compiled kernels {r['jit_load_s']:.2f} s once per "
          f"process; whole process {compact_s:.2f} s: process/copy = "
          f"{res['process_ratio_vs_copy']:.2f}")
    print(f"  {res['records_per_s']:,.0f} records/s, {res['mb_per_s']:.0f} MB/s, {r['rounds']} "
          f"round(s), kept {r['records_kept']:,}, dropped {r['records_dropped']:,}, map "
          f"{r['map_keys_max']:,} keys at {r['map_bytes_per_key']:.1f} B/key")
    print(f"  peak RSS {res['peak_rss_mib']:.0f} MiB = map {res['map_mib']:.0f} MiB + "
          f"{res['peak_rss_mib'] - res['map_mib']:.0f} MiB   (target <= map + 100 MiB; a process "
          f"that only imports kcompact: {res['baseline_rss_mib']:.0f} MiB; {r['kernels']} "
          f"kernels, numba {'loaded' if r['numba_loaded'] else 'not loaded'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
