"""A single-record read by offset (``dump --from-offset O --limit 1``'s path), timed in-process.

    python bench/point_read.py [--records 1000000] [--keys 100000] [--samples 3000]
                               [--batch-bytes N] [--json]

A store of ``--records`` JSON order updates (bench/storage.py's) to ``--keys`` keys in 64 MiB
segments, force-compacted (sealed segments: format 2 since issue 28, with the topic's
``compression.batch.bytes``), then ``--samples`` reads of one record at random live offsets
(``PartitionLog.read(o, max_records=1)``, a fresh partition view: nothing cached but the index
the first read of a segment loads) after a warm-up pass; prints p50/p99/max in microseconds and
the store's bytes. Runs against whichever kcompact the interpreter imports (compare before and
after with two virtualenvs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from storage import json_updates  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--batch-bytes", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from kcompact.compaction import Compactor
    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    work = tempfile.mkdtemp(prefix="kcompact-bench-read-")
    try:
        url = os.path.join(work, "s")
        s = Store.open(url, writer="b", create=True)
        cfg = {"segment.bytes": 64 << 20}
        if args.batch_bytes:
            cfg["compression.batch.bytes"] = args.batch_bytes
        s.set_topic_config("orders", cfg)
        upd = json_updates(args.records, args.keys)
        step = 100_000
        for i in range(0, len(upd), step):
            s.append(RecordBatch.from_records("orders", [
                (0, i + j, 1_700_000_000_000 + i + j, k, v)
                for j, (k, v) in enumerate(upd[i:i + step])]))
        s.flush()
        Compactor(s).compact_partition("orders", 0, force=True)
        s.close()
        s = Store.open(url)
        pl = s.partition("orders", 0)
        live = [r.offset for r in pl.iter_records()]
        size = sum(seg.log_size + seg.index_size for seg in pl.segments)
        rng = random.Random(1)
        for o in live[:: max(1, len(live) // 200)]:  # warm: each segment's index loaded
            pl.read(o, max_records=1)
        times = []
        for _ in range(args.samples):
            o = rng.choice(live)
            t0 = time.perf_counter()
            b = pl.read(o, max_records=1)
            rec = next(b.records())
            times.append(time.perf_counter() - t0)
            assert rec.offset == o
        s.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    us = np.array(times) * 1e6
    doc = {"records": args.records, "live": len(live), "store_bytes": size,
           "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
           "max_us": float(us.max()), "batch_bytes": args.batch_bytes}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{doc['live']:,} live records, {size:,} bytes: one-record read p50 "
              f"{doc['p50_us']:.1f} us, p99 {doc['p99_us']:.1f} us, max {doc['max_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
