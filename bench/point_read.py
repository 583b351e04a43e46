"""A single-record read by offset (``dump --from-offset O --limit 1``'s path), timed in-process,
next to a baseline measured in the same run.

    python bench/point_read.py [--records 1000000] [--keys 100000] [--samples 3000]
                               [--rounds 3] [--batch-bytes N] [--baseline-python PY] [--json]

Each side builds a store of ``--records`` JSON order updates (bench/storage.py's) to ``--keys``
keys in 64 MiB segments, then times ``--samples`` reads of one record at random live offsets
(``PartitionLog.read(o, max_records=1)`` and its ``Record``, on a fresh partition view: nothing
cached but the index the first read of a segment loads, after a warm-up pass), in a process of
its own. The sides alternate for ``--rounds`` rounds; the figure is the median over the rounds
of each side's p50 and p99, and the ratio ours / baseline.

* ours: this interpreter's kcompact, the store force-compacted (its segments sealed in store
  format 2 with the topic's ``compression.batch.bytes``, ``--batch-bytes`` to set it);
* the baseline: by default the same kcompact reading the same records left in store format 1
  (a writer with ``WriterOptions(seal_format=1)``, rolled, not compacted: the live offsets are
  read, each a record of its own); with ``--baseline-python PY``, another installation's
  interpreter (a checkout from before store format 2, in its own virtualenv) building and reading
  its own force-compacted store: "today" against "before".

The target (issue 28): p99 within 20 % of the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TARGET = 1.2  # p99 ours / baseline


def _measure(records: int, keys: int, samples: int, batch_bytes: int | None,
             fmt: int) -> dict:
    """One side in this process: build the store (``fmt`` 2: force-compacted; 1: left format 1),
    then time the reads."""
    from storage import json_updates

    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    work = tempfile.mkdtemp(prefix="kcompact-bench-read-")
    try:
        url = os.path.join(work, "s")
        opts = {}
        if fmt == 1:
            from kcompact.reput.config import WriterOptions
            opts["options"] = WriterOptions(seal_format=1)
        s = Store.open(url, writer="b", create=True, **opts)
        cfg = {"segment.bytes": 64 << 20}
        if batch_bytes:
            cfg["compression.batch.bytes"] = batch_bytes
        s.set_topic_config("orders", cfg)
        upd = json_updates(records, keys)
        step = 100_000
        latest = {}
        for i in range(0, len(upd), step):
            s.append(RecordBatch.from_records("orders", [
                (0, i + j, 1_700_000_000_000 + i + j, k, v)
                for j, (k, v) in enumerate(upd[i:i + step])]))
            latest.update((k, i + j) for j, (k, _) in enumerate(upd[i:i + step]))
        s.flush()
        if fmt == 2:
            from kcompact.compaction import Compactor
            Compactor(s).compact_partition("orders", 0, force=True)
        else:
            s.partition("orders", 0).roll()
            s.flush()
        s.close()
        s = Store.open(url)
        pl = s.partition("orders", 0)
        live = sorted(latest.values())
        size = sum(seg.log_size + seg.index_size for seg in pl.segments)
        rng = random.Random(1)
        for o in live[:: max(1, len(live) // 200)]:  # warm: each segment's index loaded
            pl.read(o, max_records=1)
        times = []
        for _ in range(samples):
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
    return {"live": len(live), "store_bytes": size, "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "max_us": float(us.max())}


def _side(python: str, args, fmt: int) -> dict:
    cmd = [python, os.path.abspath(__file__), "--worker", str(fmt), "--records",
           str(args.records), "--keys", str(args.keys), "--samples", str(args.samples)]
    if args.batch_bytes and fmt == 2:
        cmd += ["--batch-bytes", str(args.batch_bytes)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-bytes", type=int, default=None)
    ap.add_argument("--baseline-python", default=None,
                    help="the interpreter of another kcompact installation (a checkout from "
                         "before store format 2) to measure as the baseline")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, choices=(1, 2), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_measure(args.records, args.keys, args.samples, args.batch_bytes,
                                  args.worker)))
        return 0
    base_py = args.baseline_python or sys.executable
    base_fmt = 2 if args.baseline_python else 1
    base_name = (f"{args.baseline_python} (its own store)" if args.baseline_python
                 else "store format 1, this kcompact")
    ours, base = [], []
    for _ in range(args.rounds):
        ours.append(_side(sys.executable, args, 2))
        base.append(_side(base_py, args, base_fmt))

    def med(rows, k):
        return statistics.median(r[k] for r in rows)

    doc = {"records": args.records, "live": ours[0]["live"], "batch_bytes": args.batch_bytes,
           "rounds": args.rounds, "baseline": base_name,
           "p50_us": med(ours, "p50_us"), "p99_us": med(ours, "p99_us"),
           "store_bytes": ours[0]["store_bytes"],
           "baseline_p50_us": med(base, "p50_us"), "baseline_p99_us": med(base, "p99_us"),
           "baseline_store_bytes": base[0]["store_bytes"],
           "rounds_p99_us": [r["p99_us"] for r in ours],
           "rounds_baseline_p99_us": [r["p99_us"] for r in base]}
    doc["p50_ratio"] = doc["p50_us"] / doc["baseline_p50_us"]
    doc["p99_ratio"] = doc["p99_us"] / doc["baseline_p99_us"]
    doc["target_p99_ratio"] = TARGET
    doc["met"] = doc["p99_ratio"] <= TARGET
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{doc['live']:,} live records of {args.records:,}, medians of {args.rounds} "
              f"rounds of {args.samples:,} reads:")
        print(f"  store format 2 ({doc['store_bytes']:,} bytes): one-record read p50 "
              f"{doc['p50_us']:.1f} us, p99 {doc['p99_us']:.1f} us")
        print(f"  baseline: {base_name} ({doc['baseline_store_bytes']:,} bytes): p50 "
              f"{doc['baseline_p50_us']:.1f} us, p99 {doc['baseline_p99_us']:.1f} us")
        print(f"  ratio ours / baseline: p50 {doc['p50_ratio']:.2f}, p99 {doc['p99_ratio']:.2f} "
              f"(target p99 <= {TARGET}: {'met' if doc['met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
