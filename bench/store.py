"""Benchmark: append + reput throughput, and offset lookup latency.

    python bench/store.py [--records 2000000] [--lookup-entries 10000000] [--json]

1. Append + reput of N records (16-byte keys, 100-byte values) through the batch API
   (Store.append of RecordBatches, then flush), next to the raw limit measured in the same run:
   writing the same encoded bytes with plain file writes in 1 MiB chunks. Both are run with
   fsync at the end and without fsync (the OS writes back, as Kafka does by default).
   Target: >= 2,000,000 records/s on one core.
2. Read: every record of the same N records through the partition reader
   (`PartitionReader.blocks`: each record checked against its index entry, key digest included,
   and its CRC, as every read is), and 5,000 short reads of 10 records at random offsets.
3. Offset lookup on a partition index of M entries: p50/p99 of `kcompact.reput.bcq.lower_bound` on the
   memory-mapped .bcq, next to Python's `bisect` on a list of the same offsets.
   Target: p99 <= 20 us.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import bcq as B  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn, encode_batch  # noqa: E402

KEY, VALUE, BATCH = 16, 100, 100_000


def make_batches(n: int, topic: str = "bench") -> list[RecordBatch]:
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 256, (n, KEY), dtype=np.uint8)
    vals = rng.integers(0, 256, (n, VALUE), dtype=np.uint8)
    return [RecordBatch.from_columns(topic, 0, np.arange(lo, min(lo + BATCH, n), dtype=np.int64),
                                     1_700_000_000_000,
                                     keys=BytesColumn.fixed(keys[lo:lo + BATCH], KEY),
                                     values=BytesColumn.fixed(vals[lo:lo + BATCH], VALUE))
            for lo in range(0, n, BATCH)]


def run_append(batches, workdir: str, fsync: str) -> float:
    d = tempfile.mkdtemp(dir=workdir)
    try:
        st = Store.open(d, writer="bench", create=True, options=WriterOptions(fsync=fsync))
        t = time.perf_counter()
        for b in batches:
            st.append(b)
        st.flush()
        elapsed = time.perf_counter() - t
        st.close()
        return elapsed
    finally:
        shutil.rmtree(d)


def run_raw(encoded: list[np.ndarray], workdir: str, fsync: bool) -> float:
    path = os.path.join(workdir, "raw.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        for buf in encoded:
            mv = memoryview(buf)
            for i in range(0, len(mv), 1 << 20):
                f.write(mv[i:i + (1 << 20)])
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    os.unlink(path)
    return elapsed


def bench_append(n: int, workdir: str) -> dict:
    batches = make_batches(n)
    encoded = [encode_batch(b)[0].copy() for b in batches]
    total_bytes = sum(e.shape[0] for e in encoded)
    run_append(make_batches(1000), workdir, "never")  # compile kernels outside the timing
    out = {"records": n, "encoded_bytes": total_bytes}
    for label, fsync, raw_fsync in (("no_fsync", "never", False), ("fsync", "flush", True)):
        ours = min(run_append(batches, workdir, fsync) for _ in range(2))
        raw = min(run_raw(encoded, workdir, raw_fsync) for _ in range(2))
        out[label] = {"ours_s": ours, "raw_s": raw, "ours_rps": n / ours, "raw_rps": n / raw,
                      "ratio_vs_raw": raw / ours}
    return out


def bench_read(batches, workdir: str, passes: int = 5) -> dict:
    """The read figures (module docstring, 2.), best of ``passes``."""
    from kcompact.reput.reader import PartitionReader
    d = tempfile.mkdtemp(dir=workdir)
    try:
        st = Store.open(d, writer="bench", create=True, options=WriterOptions(fsync="never"))
        for b in batches:
            st.append(b)
        st.close()
        n = sum(len(b) for b in batches)
        with Store.open(d) as st:
            pl = st.partition(batches[0].topic, 0)
            rng = np.random.default_rng(3)
            scan, short = [], []
            for _ in range(passes):
                t = time.perf_counter()
                got = sum(len(blk) for blk in PartitionReader(pl).blocks(0))
                scan.append(time.perf_counter() - t)
                assert got == n
                targets = rng.integers(0, n, 5000).tolist()
                t = time.perf_counter()
                for o in targets:
                    PartitionReader(pl).read(o, max_records=10)
                short.append(time.perf_counter() - t)
        return {"records": n, "scan_s": min(scan), "scan_rps": n / min(scan),
                "short_reads": 5000, "short_read_us": min(short) / 5000 * 1e6}
    finally:
        shutil.rmtree(d)


def bench_lookup(m: int, workdir: str, samples: int = 20_000) -> dict:
    rng = np.random.default_rng(2)
    offsets = np.cumsum(rng.integers(1, 4, m)).astype(np.int64)  # gaps, as after compaction
    e = np.zeros(m, dtype=B.BCQ_DTYPE)
    e["offset"] = offsets
    path = os.path.join(workdir, "lookup.bcq")
    e.tofile(path)
    mapped = B.Index(B.view(np.memmap(path, dtype=np.uint8, mode="r")))
    as_list = offsets.tolist()
    targets = rng.integers(0, int(offsets[-1]) + 2, samples).tolist()
    B.lower_bound(mapped, 5)

    def timeit(fn) -> np.ndarray:
        lat = np.empty(len(targets))
        pc = time.perf_counter_ns
        for i, t in enumerate(targets):
            t0 = pc()
            fn(t)
            lat[i] = pc() - t0
        return lat / 1000.0

    ours = timeit(mapped.lower_bound)
    base = timeit(lambda t: bisect.bisect_left(as_list, t))
    for t in targets[:1000]:
        assert B.lower_bound(mapped, t) == bisect.bisect_left(as_list, t)
    del mapped
    os.unlink(path)
    return {"entries": m, "ours_p50_us": float(np.percentile(ours, 50)),
            "ours_p99_us": float(np.percentile(ours, 99)),
            "bisect_p50_us": float(np.percentile(base, 50)),
            "bisect_p99_us": float(np.percentile(base, 99))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--lookup-entries", type=int, default=10_000_000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    a = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="kcompact-bench-", dir=a.workdir)
    try:
        res = {"append": bench_append(a.records, workdir),
               "read": bench_read(make_batches(a.records), workdir),
               "lookup": bench_lookup(a.lookup_entries, workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.json_out:  # bench/report.py: the figures as JSON, the text as printed
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    ap_ = res["append"]
    print(f"append + reput, {ap_['records']:,} records ({ap_['encoded_bytes'] / 1e6:.0f} MB "
          "encoded), one core:")
    for label in ("no_fsync", "fsync"):
        r = ap_[label]
        print(f"  {label:9s} ours {r['ours_rps']:>12,.0f} rec/s   raw file writes "
              f"{r['raw_rps']:>12,.0f} rec/s   ours/raw = {r['ratio_vs_raw']:.2f}"
              "   (target >= 2,000,000 rec/s)")
    rd = res["read"]
    print(f"read through the partition reader (every record checked), {rd['records']:,} "
          "records:")
    print(f"  whole partition {rd['scan_rps']:>12,.0f} rec/s   short reads of 10 records "
          f"{rd['short_read_us']:.1f} us each")
    lk = res["lookup"]
    print(f"offset lookup, {lk['entries']:,}-entry mapped .bcq:")
    print(f"  ours   p50 {lk['ours_p50_us']:.2f} us  p99 {lk['ours_p99_us']:.2f} us   "
          "(target p99 <= 20 us)")
    print(f"  bisect p50 {lk['bisect_p50_us']:.2f} us  p99 {lk['bisect_p99_us']:.2f} us   "
          f"bisect/ours p99 = {lk['bisect_p99_us'] / lk['ours_p99_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
