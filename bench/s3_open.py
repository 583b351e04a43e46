"""Benchmark (issue 49): a reader's S3 requests to open a store, with the store catalog
(docs/formats/store-catalog.md) next to per-partition manifests (the baseline), in one run.

    python bench/s3_open.py [--partitions 8,512] [--flushes 6] [--per-flush 4]

For each partition count two stores are written on a local SeaweedFS (connectors/devtools/
seaweed.py, started and stopped here, on 127.0.0.1) by one writer with the defaults (shared
uploads, ``Store.open(url, writer=..., create=True)``), ``--flushes`` flushes of ``--per-flush``
records in every partition: ``catalog`` (a new store's default: format 4, a store catalog) and
``manifests`` (``Store.create(url, shared_uploads=True, catalog=False)``: format 3, what a new
store was before, every partition read through its own manifest: the baseline). Each store is
then opened by a **fresh reader process** (this script with ``--child``, so no cache or view of
the writer's helps it) that does what a reader serving the store does first - the Kafka
endpoint's Metadata and ListOffsets, ``kcompact dump``: open the store, list its topics and
partitions, and learn every partition's next offset - with every S3 call of that process
counted by wrapping the boto3 client the backend makes (``reput.s3.make_client``, as
bench/s3_live.py counts the Kafka endpoint's). Twice: as written (the partitions' records in
shared objects), and after ``kcompact compact --force`` (``compact_store``: every partition split
into segments of its own, a manifest version each).

Printed per partition count, state and store: the reader's requests by kind, the ratio catalog /
manifests, and whether it is within the target: **<= 10 + 2 x writers** requests at 512
partitions (here 1 writer: 12).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.reput import s3 as s3mod  # noqa: E402

TOPIC = "open"
KINDS = {"get_object": "GET", "list_objects_v2": "LIST", "put_object": "PUT",
         "head_object": "HEAD", "delete_objects": "DEL", "delete_object": "DEL"}
COUNTS: Counter = Counter()
LOCK = threading.Lock()


class Counted:
    """A boto3 S3 client whose calls are counted by kind (``COUNTS``)."""

    def __init__(self, client):
        self._c = client

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        kind = KINDS.get(name)
        if kind is None or not callable(attr):
            return attr

        def call(*a, **k):
            with LOCK:
                COUNTS[kind] += 1
            return attr(*a, **k)
        return call


def child(url: str, partitions: int) -> int:
    """A fresh reader: open, list, every partition's next offset; print the counts (JSON)."""
    make = s3mod.make_client
    s3mod.make_client = lambda *a, **k: Counted(make(*a, **k))
    from kcompact.reput import Store
    t0 = time.monotonic()
    st = Store.open(url)
    topics = st.topics()
    ps = st.partitions(TOPIC)
    offsets = [st.partition(TOPIC, p).next_offset for p in ps]
    took = time.monotonic() - t0
    st.close()
    if topics != [TOPIC] or len(ps) != partitions:
        print(f"reader saw {topics} / {len(ps)} partitions, expected {partitions}",
              file=sys.stderr)
        return 1
    print(json.dumps({"counts": dict(COUNTS), "seconds": took, "records": sum(offsets)}))
    return 0


def write(url: str, cl: str, partitions: int, flushes: int, per_flush: int, catalog: bool):
    from kcompact.reput import Store
    from kcompact.reput.record import RecordBatch
    if not catalog:
        Store.create(url, shared_uploads=True, catalog=False).close()
    with Store.open(url, writer="bench", create=True, commitlog_dir=cl) as st:
        off = 0
        for _ in range(flushes):
            rows = [(p, off + i, 1_000 + off + i, b"k%d-%d" % (p, off + i), b"v" * 100, [])
                    for p in range(partitions) for i in range(per_flush)]
            st.append(RecordBatch.from_records(TOPIC, rows))
            st.flush()
            off += per_flush
    return off


def compact(url: str) -> None:
    from kcompact.compaction.planner import compact_store
    from kcompact.reput import Store
    with Store.open(url) as st:
        compact_store(st, force=True)


def measure(url: str, partitions: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", url,
                          str(partitions)], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"reader failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(counts: dict) -> str:
    total = sum(counts.values())
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"{total:5d} requests ({kinds})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", default="8,512")
    ap.add_argument("--flushes", type=int, default=6)
    ap.add_argument("--per-flush", type=int, default=4)
    ap.add_argument("--child", nargs=2, metavar=("URL", "PARTITIONS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))
    from kcompact.connectors.devtools.seaweed import SeaweedS3
    plist = [int(p) for p in args.partitions.split(",")]
    target = 10 + 2 * 1
    rows = []
    with tempfile.TemporaryDirectory() as work, SeaweedS3() as s3:
        os.environ.update(s3.env())
        os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(work, "cache")
        s3.create_bucket("bench")
        env = dict(os.environ, KCOMPACT_CACHE_DIR=os.path.join(work, "reader-cache"))
        for p in plist:
            got = {}
            for mode in ("catalog", "manifests"):
                url = s3.url(f"open-{p}-{mode}-{uuid.uuid4().hex[:6]}", bucket="bench")
                t0 = time.monotonic()
                write(url, os.path.join(work, f"cl-{p}-{mode}"), p, args.flushes,
                      args.per_flush, mode == "catalog")
                wrote = time.monotonic() - t0
                got[(mode, "as written")] = measure(url, p, env)
                compact(url)
                got[(mode, "compacted")] = measure(url, p, env)
                print(f"{p:4d} partitions, {mode:9s}: written in {wrote:.1f} s", flush=True)
            for state in ("as written", "compacted"):
                c, m = got[("catalog", state)], got[("manifests", state)]
                ct, mt = sum(c["counts"].values()), sum(m["counts"].values())
                line = (f"{p:4d} partitions, {state:10s}: catalog {fmt(c['counts'])} in "
                        f"{c['seconds']:.2f} s | manifests (baseline) {fmt(m['counts'])} in "
                        f"{m['seconds']:.2f} s | ratio {ct / mt:.3f}x"
                        f" | target <= {target}: {'met' if ct <= target else 'NOT met'}")
                print(line, flush=True)
                rows.append(line)
    print("\nsummary (a fresh reader opening the store: topics, partitions, every next offset; "
          "1 writer):")
    for line in rows:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
