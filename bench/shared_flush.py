"""Benchmark (issue 49): a shared-upload writer's append and flush at the live edge, many
partitions, one record each between flushes - its active segments in memory (the default,
reput/active_memory.py), against local segment files reused (``KCOMPACT_S3_ACTIVE_MEMORY_MB=0``)
and deleted and created anew with blocks reserved ahead (the path before both), in one run.

    python bench/shared_flush.py [--partitions 512] [--rounds 40]

On the in-memory S3 of the unit tests (tests/unit/_fake_s3.py: no network, so the figure is the
writer's own work) and a commit-log directory on the local disk: a store with shared uploads,
then ``--rounds`` rounds of one record appended to every partition (``Store.append``), a
``Store.flush`` and 50 ms of rest (the background thread empties the committed files
meanwhile, as between a mirror's flushes). Printed: the mean append and flush times per round
(the first 5 rounds left out), for each path, and their ratios to the in-memory path.
``before`` emulates the oldest
path in this process: a committed local segment is handed to the deleting thread
(catalog_manifest.drop_later) and the local files reserve disk blocks (LocalBackend's
preallocation).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))

from _stores import backend_env, store_url  # noqa: E402

from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import partition as P  # noqa: E402
from kcompact.reput.catalog_manifest import drop_later  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402


def run(parts: int, rounds: int, mode: str, work: str) -> tuple[float, float]:
    """mode: "memory" (the default), "reuse" (files reused) or "before" (deleted, created)."""
    reuse = P.PartitionLog.reuse_files_of
    before = mode == "before"
    saved = os.environ.get("KCOMPACT_S3_ACTIVE_MEMORY_MB")
    if mode != "memory":
        os.environ["KCOMPACT_S3_ACTIVE_MEMORY_MB"] = "0"
    if before:
        P.PartitionLog.reuse_files_of = lambda self, seg: drop_later(self.local_fs, [seg])
    try:
        with backend_env("s3", work):
            url = store_url("s3", work, mode)
            with Store.open(url, writer="w", create=True, options=WriterOptions(upload="shared"),
                            commitlog_dir=os.path.join(work, f"cl-{mode}")
                            ) as st:
                if before:
                    st.local_fs.preallocate = True
                appends = flushes = 0.0
                for r in range(rounds):
                    b = RecordBatch.from_records("t", [(p, r, 1_000 + r, b"k%d" % p, b"v" * 100,
                                                        []) for p in range(parts)])
                    t0 = time.perf_counter()
                    st.append(b)
                    t1 = time.perf_counter()
                    st.flush()
                    t2 = time.perf_counter()
                    if r >= 5:
                        appends += t1 - t0
                        flushes += t2 - t1
                    time.sleep(0.05)
        n = max(1, rounds - 5)
        return appends / n, flushes / n
    finally:
        P.PartitionLog.reuse_files_of = reuse
        if saved is None:
            os.environ.pop("KCOMPACT_S3_ACTIVE_MEMORY_MB", None)
        else:
            os.environ["KCOMPACT_S3_ACTIVE_MEMORY_MB"] = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        got = {m: run(args.partitions, args.rounds, m, work)
               for m in ("memory", "reuse", "before")}
    print(f"{args.partitions} partitions, one record each a round, {args.rounds} rounds:")
    names = {"memory": "in memory (now)", "reuse": "files reused",
             "before": "deleted and created"}
    for m, (a, f) in got.items():
        print(f"  {names[m] + ':':<22} append {a * 1000:7.1f} ms, flush {f * 1000:7.1f} ms")
    now = got["memory"]
    for m in ("reuse", "before"):
        print(f"  in memory / {names[m]}: append {now[0] / got[m][0]:.3f} x, "
              f"flush {now[1] / got[m][1]:.3f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
