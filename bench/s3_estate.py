"""Benchmark (issue 43): the S3 request bill of a writer's flushes as the partition count grows.

    python bench/s3_estate.py [--partitions 8,64,512] [--flushes 6] [--per-flush 10]

The issue's shape without the Kafka side: one writer (Store.open(..., writer=)) on an S3 store on
a local SeaweedFS (connectors/devtools/seaweed.py, started and stopped here, 127.0.0.1), every
partition given ``--per-flush`` new records per flush (2 records/s at the store sink's
``offset.flush.interval.ms`` of 5 s = 10), ``--flushes`` flushes (6 = 30 s of a following mirror),
the S3 requests counted by the store's backend (S3Backend.stats: every request it sends). Printed
per partition count: requests per flush by kind, objects created per flush (PUTs), the request
rate at one flush per 5 s, and the ratio to the smallest partition count.

Target (issue 43, shared upload objects): the rate at 512 partitions <= 2x the rate at 8, objects
per flush O(1). Only today's per-partition upload is measured: shared upload objects are specified
(docs/formats/shared-upload.md) but not implemented, so there is no second column yet.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.reput import Store  # noqa: E402
from kcompact.reput.record import BytesColumn, RecordBatch  # noqa: E402
from kcompact.connectors.devtools.seaweed import SeaweedS3  # noqa: E402

TOPIC = "estate"
FLUSH_INTERVAL_S = 5.0  # the store sink's default offset.flush.interval.ms


def flush_batch(partitions: int, per_flush: int, first_offset: int, ts_ms: int) -> RecordBatch:
    """``per_flush`` records for every partition, offsets from ``first_offset``, 100-byte values."""
    n = partitions * per_flush
    parts = np.repeat(np.arange(partitions, dtype=np.int32), per_flush)
    offs = np.tile(np.arange(first_offset, first_offset + per_flush, dtype=np.int64), partitions)
    kb = np.frombuffer(b"".join(b"key-%012d" % (i % 1000) for i in range(n)), np.uint8).copy()
    vb = np.full(n * 100, ord("v"), np.uint8)
    return RecordBatch(TOPIC, parts, offs, np.full(n, ts_ms, np.int64),
                       BytesColumn(kb, np.arange(n + 1, dtype=np.int64) * 16, np.zeros(n, bool)),
                       BytesColumn(vb, np.arange(n + 1, dtype=np.int64) * 100, np.zeros(n, bool)),
                       BytesColumn.empties(n))


def run_one(bucket: str, tmp: str, partitions: int, flushes: int, per_flush: int) -> dict:
    url = f"s3://{bucket}/estate-{uuid.uuid4().hex[:8]}"
    cl = os.path.join(tmp, "cl", uuid.uuid4().hex[:8])
    with Store.open(url, writer="estate", create=True, commitlog_dir=cl) as st:
        # the first flush creates every partition's first manifest: measured apart (warm-up)
        st.append(flush_batch(partitions, per_flush, 0, 1_700_000_000_000))
        st.flush()
        st.fs.stats.reset()
        for f in range(1, flushes + 1):
            st.append(flush_batch(partitions, per_flush, f * per_flush,
                                  1_700_000_000_000 + int(f * FLUSH_INTERVAL_S * 1000)))
            st.flush()
        snap = st.fs.stats.snapshot()
    req = snap["requests"]
    return {"partitions": partitions, "flushes": flushes,
            "per_flush": {k: v / flushes for k, v in sorted(req.items())},
            "requests_per_flush": snap["total"] / flushes,
            "objects_per_flush": sum(v for k, v in req.items() if "put" in k.lower()) / flushes,
            "requests_per_s": snap["total"] / flushes / FLUSH_INTERVAL_S}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", default="8,64,512")
    ap.add_argument("--flushes", type=int, default=6)
    ap.add_argument("--per-flush", type=int, default=10)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kcompact-bench-estate-")
    rows = []
    try:
        with SeaweedS3() as server:
            os.environ.update(server.env())
            os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(tmp, "cache")
            bucket = server.create_bucket("kcompact-estate")
            for p in (int(x) for x in args.partitions.split(",")):
                rows.append(run_one(bucket, tmp, p, args.flushes, args.per_flush))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows[0]["requests_per_s"]
    print(f"per-partition upload (today), {args.flushes} flushes of {args.per_flush} records per "
          f"partition, one flush per {FLUSH_INTERVAL_S:.0f} s, SeaweedFS on loopback")
    print(f"{'parts':>6} {'req/flush':>10} {'objects/flush':>14} {'req/s':>8} "
          f"{'x vs ' + str(rows[0]['partitions']):>8}  by kind (per flush)")
    for r in rows:
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["per_flush"].items())
        print(f"{r['partitions']:>6} {r['requests_per_flush']:>10.1f} {r['objects_per_flush']:>14.1f} "
              f"{r['requests_per_s']:>8.1f} {r['requests_per_s'] / base:>8.1f}  {kinds}")
    print("target (shared upload objects, not implemented): req/s at 512 <= 2x req/s at 8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
