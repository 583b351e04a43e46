"""Benchmark: requests and bytes of a forced compaction on S3, next to the same on local disk.

    python bench/s3.py [--records 1000000] [--partitions 1,16,64] [--segment-bytes 512KiB]
                       [--upload partition|shared]

Stores with 1, 16 and 64 partitions and the same total records (N records, N/10 distinct keys,
~100-byte values, 5% tombstones), written once to an S3 store on a local SeaweedFS
(connectors/devtools/seaweed.py, started and stopped here, every port on 127.0.0.1) and once to a
local directory, with the same segment.bytes, so both hold the same segments. Then a forced
compaction of each, with cold caches (the S3 block cache and spool cleared), printing per store: S3
requests by kind, requests per input segment, the requests left once 2 per input
segment and 2 per output are taken off (the per-partition overhead: manifest list/get/put and
the garbage listing), bytes down and up, and the S3 time next to the local-disk time of the
same compaction (the ratio). A last row repeats the 16-partition store with 4x fewer, 4x larger
records (the same bytes and segments): its request count must be the same.

``--upload shared`` writes the S3 stores with shared upload objects (issue 43: the one flush
uploads one object holding every partition's segments); the forced compaction then splits each
partition's parts first, and "segs in" counts those parts. The default is the per-partition
upload (``partition``), the figure the target was set on.

Targets: requests per segment independent of the record count; <= 4 per segment plus a few
per partition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.compaction import compact_store  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn  # noqa: E402
from kcompact.connectors.devtools.seaweed import SeaweedS3  # noqa: E402

TOPIC = "bench"
BATCH = 100_000


def _size(text: str) -> int:
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def batches(records: int, partitions: int, value_bytes: int, seed: int = 7):
    """Columns of N records spread round-robin over partitions (offsets per partition dense),
    each batch grouped by partition, as a consumer's fetch delivers them."""
    rng = np.random.default_rng(seed)
    keys = max(1, records // 10)
    for lo in range(0, records, BATCH):
        n = min(BATCH, records - lo)
        idx = np.arange(lo, lo + n, dtype=np.int64)
        idx = idx[np.argsort(idx % partitions, kind="stable")]
        parts = (idx % partitions).astype(np.int32)
        offs = idx // partitions
        k = rng.integers(0, keys, n)
        kb = np.frombuffer(b"".join(b"key-%012d" % x for x in k), np.uint8).copy()
        koffs = np.arange(n + 1, dtype=np.int64) * 16
        tomb = rng.random(n) < 0.05
        vlen = np.where(tomb, 0, value_bytes).astype(np.int64)
        voffs = np.zeros(n + 1, np.int64)
        np.cumsum(vlen, out=voffs[1:])
        vb = rng.integers(97, 123, int(voffs[-1]), dtype=np.uint8)
        yield RecordBatch(TOPIC, parts, offs, np.full(n, 1_700_000_000_000, np.int64),
                          BytesColumn(kb, koffs, np.zeros(n, bool)),
                          BytesColumn(vb, voffs, tomb), BytesColumn.empties(n))


def write(url: str, records: int, partitions: int, value_bytes: int, segment_bytes: int,
          commitlog_dir: str | None = None, upload: str = "partition") -> None:
    with Store.open(url, writer="bench", create=True, commitlog_dir=commitlog_dir,
                    options=WriterOptions(upload=upload)) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": segment_bytes})
        for b in batches(records, partitions, value_bytes):
            st.append(b)
        st.flush()  # one flush: on S3 the writer's rolled segments are sealed as they are


def compact_s3(url: str) -> dict:
    with Store.open(url) as st:
        fs = st.fs
        fs.cache.clear()
        fs.spool.clear()
        fs.stats.reset()
        t = time.perf_counter()
        res = compact_store(st, force=True)
        dt = time.perf_counter() - t
        snap = fs.stats.snapshot()
    seg_in = sum(r.segments_before for r in res)
    seg_out = sum(r.segments_after for r in res)
    return {"seconds": dt, "segments_in": seg_in, "segments_out": seg_out,
            "partitions": len(res), "kept": sum(r.records_kept for r in res), **snap}


def compact_local(path: str) -> dict:
    with Store.open(path) as st:
        t = time.perf_counter()
        res = compact_store(st, force=True)
        dt = time.perf_counter() - t
    return {"seconds": dt, "kept": sum(r.records_kept for r in res)}


def warm_up(tmp: str) -> None:
    """Load the compiled kernels once, outside every measurement."""
    p = os.path.join(tmp, "warm")
    write(p, 2000, 2, 10, 1 << 16)
    compact_local(p)


def run_one(server: SeaweedS3, bucket: str, tmp: str, records: int, partitions: int,
            value_bytes: int, segment_bytes: int, upload: str = "partition") -> dict:
    url = f"s3://{bucket}/bench-{uuid.uuid4().hex[:8]}"
    local = os.path.join(tmp, f"local-{uuid.uuid4().hex[:8]}")
    t = time.perf_counter()
    write(url, records, partitions, value_bytes, segment_bytes,
          commitlog_dir=os.path.join(tmp, "cl", uuid.uuid4().hex[:8]), upload=upload)
    write_s = time.perf_counter() - t
    write(local, records, partitions, value_bytes, segment_bytes)
    s3 = compact_s3(url)
    loc = compact_local(local)
    assert s3["kept"] == loc["kept"], (s3["kept"], loc["kept"])
    overhead = s3["total"] - 2 * s3["segments_in"] - 2 * s3["segments_out"]
    return {"records": records, "partitions": partitions, "value_bytes": value_bytes,
            "write_s3_s": round(write_s, 2), **s3,
            "requests_per_segment": round(s3["total"] / max(1, s3["segments_in"]), 2),
            "overhead_per_partition": round(overhead / max(1, partitions), 2),
            "local_seconds": loc["seconds"],
            "time_ratio": round(s3["seconds"] / max(loc["seconds"], 1e-9), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", default="1,16,64")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--segment-bytes", default="512KiB")
    ap.add_argument("--upload", choices=("partition", "shared"), default="partition",
                    help="how the S3 stores are written (WriterOptions.upload; issue 43)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    args = ap.parse_args(argv)
    seg = _size(args.segment_bytes)
    tmp = tempfile.mkdtemp(prefix="kcompact-bench-s3-")
    rows = []
    with SeaweedS3() as server:
        os.environ.update(server.env())
        os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(tmp, "cache")
        bucket = server.create_bucket("kcompact-bench")
        warm_up(tmp)
        plist = [int(p) for p in args.partitions.split(",")]
        for p in plist:
            rows.append(run_one(server, bucket, tmp, args.records, p, args.value_bytes, seg,
                                args.upload))
        mid = plist[len(plist) // 2]
        # 4x fewer records, each 4x larger on disk: the same bytes, the same segments
        one = next(batches(1, 1, args.value_bytes))
        from kcompact.reput.record import encode_batch
        rec = int(encode_batch(one)[0].shape[0])
        rows.append(run_one(server, bucket, tmp, args.records // 4, mid,
                            4 * rec - (rec - args.value_bytes), seg, args.upload))
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json_out:  # bench/report.py: the figures as JSON, the text as printed
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"forced compaction, S3 (SeaweedFS on loopback, {args.upload} uploads) vs local disk; "
          f"segment.bytes {seg >> 10} KiB, cold caches")
    hdr = ("records", "parts", "segs in", "segs out", "GET", "PUT", "LIST", "DEL", "total",
           "req/seg", "ovh/part", "MB down", "MB up", "S3 s", "local s", "ratio")
    out = []
    for r in rows:
        q = r["requests"]
        out.append((f"{r['records']:,}", r["partitions"], r["segments_in"], r["segments_out"],
                    q.get("GetObject", 0), q.get("PutObject", 0), q.get("ListObjectsV2", 0),
                    q.get("DeleteObjects", 0) + q.get("DeleteObject", 0), r["total"],
                    f"{r['requests_per_segment']:.2f}", f"{r['overhead_per_partition']:.1f}",
                    f"{r['bytes_down'] / 1e6:.1f}", f"{r['bytes_up'] / 1e6:.1f}",
                    f"{r['seconds']:.2f}", f"{r['local_seconds']:.2f}", f"{r['time_ratio']:.1f}x"))
    w = [max(len(str(x)) for x in col) for col in zip(hdr, *out)]
    for row in (hdr, *out):
        print("  ".join(str(x).rjust(n) for x, n in zip(row, w)))
    last = rows[-1]
    ref = next(r for r in rows if r["partitions"] == last["partitions"])
    if (ref["segments_in"], ref["segments_out"]) == (last["segments_in"], last["segments_out"]):
        verdict = "the same" if ref["requests"] == last["requests"] else "DIFFERENT"
        print(f"last row: the {last['partitions']}-partition store with 4x fewer, 4x larger "
              f"records, the same segments: {verdict} requests")
    else:
        print(f"last row: the {last['partitions']}-partition store with 4x fewer, 4x larger "
              f"records: {last['requests_per_segment']:.2f} requests per segment vs "
              f"{ref['requests_per_segment']:.2f} ({last['segments_in']} vs "
              f"{ref['segments_in']} segments)")
    worst = max((r["total"] - r["overhead_per_partition"] * r["partitions"]) / r["segments_in"]
                for r in rows)
    print(f"requests per input segment net of the per-partition overhead: at most {worst:.2f} "
          "(target <= 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
