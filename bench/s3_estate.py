"""Benchmark (issue 43): the S3 request bill of a writer's flushes as the partition count grows,
per-partition uploads (the baseline) next to shared upload objects, in one run.

    python bench/s3_estate.py [--partitions 8,64,512] [--flushes 6] [--per-flush 10]
                              [--split-interval 32]

The issue's shape without the Kafka side: one writer (``Store.open(url, writer=...)``) on an S3
store on a local SeaweedFS (connectors/devtools/seaweed.py, started and stopped here, every port
on 127.0.0.1), every partition given ``--per-flush`` new records per flush (2 records/s at the
store sink's ``offset.flush.interval.ms`` of 5 s = 10; unique keys, ~100-byte values),
``--flushes`` flushes after a first, unmeasured one (it creates every manifest, or rewrites
store.json to format 3), the S3 requests counted by the backend (``S3Backend.stats``: every
request it sends). Each partition count is run twice, on two fresh stores: ``upload="partition"``
(a .log, a .bcq and a manifest version per partition per flush: the baseline) and
``upload="shared"`` (one .kso and one journal entry per flush, reput/shared.py). Printed:

1. Flushes: requests per flush by kind, objects created per flush, the request rate at one flush
   per 5 s, that rate's ratio to the smallest partition count's in the same mode, and the ratio
   shared/partition at each count.
2. The split: ``compact_store(store)`` on the writer's store (as the compaction schedule of a
   following mirror runs it) with the shared parts due (KCOMPACT_S3_SHARED_SPLIT_OBJECTS set to
   ``--flushes``), block cache and spool cleared first (the parts are fetched, as by a compactor
   that did not upload them), its requests per partition, then the amortized rate of shared
   uploads including one split of every partition per ``--split-interval`` flushes (the default
   trigger: 32 shared objects) next to the per-partition upload's rate. The same
   ``compact_store`` on the per-partition store is printed for reference: the first compaction of
   its small segments, a cost the baseline's rate above does not include either.
   Then the grace period is taken as over (the writer's backend's ``grace_ms`` set to 0) and
   ``collect_shared_garbage`` deletes the split objects and their journal entries.
3. One-partition read of partition 0 in a fresh process's state (a new Store on its own backend,
   block cache and spool cleared), requests and bytes down, two ways: what `kcompact dump
   --partition 0` does (the topic and partition looked up in ``topics()`` and
   ``known_partitions``, then the records) and the partition reader alone
   (``Store.iter_records``); per-partition store, and after its compaction, vs shared store
   before the split, after it, and after the garbage collection.
4. Forced compaction stays <= 4 requests per segment: bench/s3.py, run separately (its
   ``--upload shared`` writes its stores with shared uploads; the forced compaction then splits).

Targets (issue 43): the shared flush rate at 512 partitions <= 2x the rate at 8, objects per
flush O(1); after the split a one-partition `dump` costs no more requests than on the
per-partition store (the same flushes, not compacted: "today's"; the ratio to the per-partition
store after the same compaction is printed too). The steady flush rate and the amortized rate
with the splits are different figures: both are printed, as is each flush's wall time as a
fraction of the 5 s interval. The default run (8, 64, 512 partitions, 6 flushes) takes ~5 min on
2 cores, most of it the per-partition baseline at 512 partitions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.compaction.planner import compact_store  # noqa: E402
from kcompact.connectors.apps.inspect import known_partitions  # noqa: E402
from kcompact.connectors.devtools.seaweed import SeaweedS3  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput.record import BytesColumn, RecordBatch  # noqa: E402
from kcompact.reput.s3 import S3Backend  # noqa: E402
from kcompact.reput.s3_cache import shared_cache, shared_spool  # noqa: E402

TOPIC = "estate"
FLUSH_INTERVAL_S = 5.0  # the store sink's default offset.flush.interval.ms
MODES = ("partition", "shared")
KINDS = {"PutObject": "PUT", "GetObject": "GET", "ListObjectsV2": "LIST", "HeadObject": "HEAD",
         "DeleteObjects": "DEL", "DeleteObject": "DEL", "CopyObject": "COPY"}


def flush_batch(partitions: int, per_flush: int, first_offset: int, ts_ms: int) -> RecordBatch:
    """``per_flush`` records for every partition, offsets from ``first_offset``, unique keys
    (a compaction keeps every record: reads before and after it return the same records),
    100-byte values."""
    n = partitions * per_flush
    parts = np.repeat(np.arange(partitions, dtype=np.int32), per_flush)
    offs = np.tile(np.arange(first_offset, first_offset + per_flush, dtype=np.int64), partitions)
    kb = np.frombuffer(b"".join(b"k%05d-%010d" % (p, o) for p, o in zip(parts.tolist(),
                                                                     offs.tolist())),
                       np.uint8).copy()
    vb = np.full(n * 100, ord("v"), np.uint8)
    return RecordBatch(TOPIC, parts, offs, np.full(n, ts_ms, np.int64),
                       BytesColumn(kb, np.arange(n + 1, dtype=np.int64) * 17, np.zeros(n, bool)),
                       BytesColumn(vb, np.arange(n + 1, dtype=np.int64) * 100, np.zeros(n, bool)),
                       BytesColumn.empties(n))


def cold() -> None:
    """Forget every S3 block and spooled object of this process (a fresh process's caches)."""
    shared_cache().clear()
    shared_spool().clear()


def by_kind(requests: dict) -> dict:
    out: dict = {}
    for k, v in requests.items():
        out[KINDS.get(k, k)] = out.get(KINDS.get(k, k), 0) + v
    return out


def read_partition0(url: str) -> dict:
    """Every record of partition 0 in a fresh process's state (a new Store on a new backend,
    block cache and spool cleared), two ways: ``dump`` - what `kcompact dump --partition 0` does
    (connectors/apps/inspect.py run_dump: store.json, the topic checked in ``topics()``, the
    partition in ``known_partitions``, then the records) - and ``reader`` - the partition reader
    alone (``Store.iter_records``, store.json included)."""
    out = {}
    for how in ("dump", "reader"):
        cold()
        fs = S3Backend.from_url(url)
        with Store.open(url, fs=fs) as st:
            if how == "dump":
                if TOPIC not in st.topics() or 0 not in known_partitions(st, TOPIC):
                    raise SystemExit(f"{url}: {TOPIC}-0 is not listed")
            n = sum(1 for _ in st.iter_records(TOPIC, 0))
        snap = fs.stats.snapshot()
        out[how] = {"records": n, "total": snap["total"], "kinds": by_kind(snap["requests"]),
                    "bytes_down": snap["bytes_down"]}
    return out


def measured(fs, step) -> tuple:
    """``step()``'s result and the requests it sent through ``fs``."""
    fs.stats.reset()
    got = step()
    snap = fs.stats.snapshot()
    return got, {"total": snap["total"], "kinds": by_kind(snap["requests"])}


def run_one(bucket: str, tmp: str, mode: str, partitions: int, flushes: int,
            per_flush: int) -> dict:
    url = f"s3://{bucket}/estate-{mode}-{partitions}-{uuid.uuid4().hex[:8]}"
    cl = os.path.join(tmp, "cl", uuid.uuid4().hex[:8])
    t0_ms = int(time.time() * 1000)
    row: dict = {"mode": mode, "partitions": partitions, "flushes": flushes, "reads": {}}
    with Store.open(url, writer="estate", create=True, commitlog_dir=cl,
                    options=WriterOptions(upload=mode)) as st:
        # the first flush creates every partition's first manifest (per-partition) or raises
        # store.json to format 3 (shared): measured apart (warm-up)
        st.append(flush_batch(partitions, per_flush, 0, t0_ms))
        st.flush()
        st.fs.stats.reset()
        busy = 0.0
        for f in range(1, flushes + 1):
            batch = flush_batch(partitions, per_flush, f * per_flush,
                                t0_ms + int(f * FLUSH_INTERVAL_S * 1000))
            t = time.perf_counter()
            st.append(batch)
            st.flush()
            busy += time.perf_counter() - t
        row["flush_s"] = busy / flushes
        snap = st.fs.stats.snapshot()
        req = by_kind(snap["requests"])
        row["per_flush"] = {k: v / flushes for k, v in sorted(req.items())}
        row["requests_per_flush"] = snap["total"] / flushes
        row["objects_per_flush"] = req.get("PUT", 0) / flushes
        row["requests_per_s"] = snap["total"] / flushes / FLUSH_INTERVAL_S

        row["reads"]["before"] = read_partition0(url)
        # the split (shared) / the first compaction (per-partition): what the compaction
        # schedule of the writer's process runs, caches cold
        cold()
        results, row["split"] = measured(st.fs, lambda: compact_store(st))
        done = [r for r in results if not r.skipped]
        row["split"].update(partitions=len(done),
                            parts_split=sum(r.shared_parts_split for r in done),
                            with_rounds=sum(1 for r in done if r.rounds),
                            reasons=sorted({(r.reason or "").split(",")[0] for r in done}))
        row["shared_left_p0"] = st.partition(TOPIC, 0).shared_objects
        row["reads"]["after"] = read_partition0(url)
        if mode == "shared":
            # the grace period (KCOMPACT_S3_GRACE_MS, 10 min by default) over: the split
            # objects and their journal entries collected (each writer's newest entry stays)
            row["grace_ms"] = st.fs.grace_ms
            st.fs.grace_ms = 0
            gone, row["gc"] = measured(st.fs, st.collect_shared_garbage)
            row["gc"]["deleted"] = len(gone)
            row["reads"]["gc"] = read_partition0(url)
    want = (flushes + 1) * per_flush
    for state, r in row["reads"].items():
        for how, got in r.items():
            if got["records"] != want:
                raise SystemExit(f"{mode}, {partitions} partitions, {state}, {how}: read "
                                 f"{got['records']} records of partition 0, wrote {want}")
    return row


def fmt_kinds(kinds: dict, scale: float = 1.0) -> str:
    return " ".join(f"{k} {v / scale:.{0 if scale == 1 else 1}f}"
                    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))


def table(hdr: tuple, rows: list[tuple]) -> list[str]:
    w = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    return ["  ".join(str(x).rjust(n) for x, n in zip(r, w)) for r in (hdr, *rows)]


def report(res: dict, plist: list[int], args) -> list[str]:
    out = []
    P, S = "partition", "shared"
    b0, top, iv = plist[0], plist[-1], args.split_interval
    base = {m: res[(m, b0)]["requests_per_s"] for m in MODES}

    out.append(f"1. Flushes: {args.flushes} flushes (after a first, unmeasured one) of "
               f"{args.per_flush} records per partition, one flush per {FLUSH_INTERVAL_S:.0f} s "
               "(offset.flush.interval.ms), SeaweedFS on loopback; busy = the flush's wall "
               f"time / {FLUSH_INTERVAL_S:.0f} s (> 1: the writer cannot flush that often here)")
    rows = []
    for p in plist:
        a, b = res[(P, p)], res[(S, p)]
        rows.append((p, f"{a['requests_per_flush']:.1f}", f"{a['objects_per_flush']:.1f}",
                     f"{a['requests_per_s']:.1f}", f"{a['requests_per_s'] / base[P]:.1f}x",
                     f"{a['flush_s'] / FLUSH_INTERVAL_S:.2f}",
                     f"{b['requests_per_flush']:.1f}", f"{b['objects_per_flush']:.1f}",
                     f"{b['requests_per_s']:.2f}", f"{b['requests_per_s'] / base[S]:.2f}x",
                     f"{b['flush_s'] / FLUSH_INTERVAL_S:.2f}",
                     f"{b['requests_per_s'] / a['requests_per_s']:.4f}",
                     f"{b['flush_s'] / a['flush_s']:.2f}"))
    out += table(("parts", "partition: req/flush", "objs/flush", "req/s", f"vs {b0}", "busy",
                  "shared: req/flush", "objs/flush", "req/s", f"vs {b0}", "busy",
                  "req/s shared/partition", "flush time shared/partition"), rows)
    out.append("   requests per flush by kind (partition | shared):")
    for p in plist:
        out.append(f"   {p:>5}: {fmt_kinds(res[(P, p)]['per_flush'])} | "
                   f"{fmt_kinds(res[(S, p)]['per_flush'])}")
    ratio = res[(S, top)]["requests_per_s"] / base[S]
    objs = ", ".join(f"{res[(S, p)]['objects_per_flush']:.0f}" for p in plist)
    out.append(f"   target: shared flush req/s at {top} <= 2x at {b0}: {ratio:.2f}x -> "
               f"{'MET' if ratio <= 2 else 'NOT MET'} (per-partition upload: "
               f"{res[(P, top)]['requests_per_s'] / base[P]:.1f}x); objects per shared flush "
               f"{objs} at {', '.join(map(str, plist))} partitions")

    out.append("")
    out.append(f"2. The split: compact_store(the writer's store) after {args.flushes + 1} shared "
               f"objects (KCOMPACT_S3_SHARED_SPLIT_OBJECTS={args.flushes}), caches cold; "
               f"amortized as one split of every partition per {iv} flushes x "
               f"{FLUSH_INTERVAL_S:.0f} s = {iv * FLUSH_INTERVAL_S:.0f} s (the default trigger: "
               f"{iv} shared objects)")

    def amortized(p: int) -> float:
        return res[(S, p)]["requests_per_s"] + res[(S, p)]["split"]["total"] / (
            iv * FLUSH_INTERVAL_S)
    rows = []
    for p in plist:
        a, b = res[(P, p)], res[(S, p)]
        sp = b["split"]
        rows.append((p, sp["partitions"], sp["parts_split"], sp["total"], f"{sp['total'] / p:.2f}",
                     f"{b['requests_per_s']:.2f}",
                     f"{sp['total'] / (iv * FLUSH_INTERVAL_S):.2f}", f"{amortized(p):.2f}",
                     f"{amortized(p) / amortized(b0):.1f}x", f"{a['requests_per_s']:.1f}",
                     f"{amortized(p) / a['requests_per_s']:.3f}",
                     f"{a['split']['total'] / p:.2f}"))
    out += table(("parts", "split partitions", "parts joined", "split req", "req/partition",
                  "shared flush req/s", "+ split req/s", "= amortized req/s", f"vs {b0}",
                  "partition flush req/s", "amortized/partition",
                  "partition mode first compaction req/partition"), rows)
    out.append("   split requests by kind | the same compact_store on the per-partition store "
               "(its first compaction, not in its flush rate either):")
    for p in plist:
        sp, pc = res[(S, p)]["split"], res[(P, p)]["split"]
        out.append(f"   {p:>5}: {fmt_kinds(sp['kinds'])}; compaction rounds ran in "
                   f"{sp['with_rounds']} of {sp['partitions']}; first trigger "
                   f"{', '.join(sp['reasons'])}; shared objects left under partition 0: "
                   f"{res[(S, p)]['shared_left_p0']} | {fmt_kinds(pc['kinds'])}")
    out.append("   then the grace period over, collect_shared_garbage: "
               + "; ".join(f"{p}: {res[(S, p)]['gc']['total']} requests "
                           f"({fmt_kinds(res[(S, p)]['gc']['kinds'])}), "
                           f"{res[(S, p)]['gc']['deleted']} objects deleted" for p in plist))
    out.append(f"   the steady flush rate ({res[(S, top)]['requests_per_s']:.2f} req/s at "
               f"{top}) is not the whole bill: with one split per partition every {iv} flushes "
               f"the shared store costs {amortized(top):.2f} req/s at {top} partitions, "
               f"{amortized(top) / amortized(b0):.1f}x its {b0}-partition figure (the split is "
               f"per partition), {amortized(top) / res[(P, top)]['requests_per_s']:.3f}x the "
               "per-partition upload's flush rate")

    out.append("")
    out.append("3. One-partition read of partition 0 (every record; a new Store, block cache "
               "and spool cleared: a fresh process): requests (kB down)")
    states = (("per-partition", P, "before"), ("per-partition compacted", P, "after"),
              ("shared before split", S, "before"), ("shared after split", S, "after"),
              ("shared after split+GC", S, "gc"))
    for how, title in (("dump", "`kcompact dump --partition 0` (topics, partitions, records)"),
                       ("reader", "the partition reader alone (Store.iter_records)")):
        out.append(f"   {title}:")
        rows = []
        for p in plist:
            cells = [res[(m, p)]["reads"][st][how] for _, m, st in states]
            after, pp, pc = cells[3]["total"], cells[0]["total"], cells[1]["total"]
            rows.append((p, *(f"{c['total']} ({c['bytes_down'] / 1e3:.0f} kB)" for c in cells),
                         f"{after / pp:.2f}", f"{after / pc:.2f}"))
        out += ["   " + line for line in table(
            ("parts", *(t for t, _, _ in states), "after split / per-partition",
             "after split / compacted"), rows)]
        out.append("   by kind, at " + str(top) + " partitions: " + " | ".join(
            f"{t}: {fmt_kinds(res[(m, top)]['reads'][st][how]['kinds'])}"
            for t, m, st in states))
    for how in ("dump", "reader"):
        worst = max(res[(S, p)]["reads"]["after"][how]["total"]
                    / res[(P, p)]["reads"]["before"][how]["total"] for p in plist)
        worst_c = max(res[(S, p)]["reads"]["after"][how]["total"]
                      / res[(P, p)]["reads"]["after"][how]["total"] for p in plist)
        out.append(f"   target ({how}): after the split no more requests than the per-partition "
                   f"store: worst {worst:.2f}x -> {'MET' if worst <= 1 else 'NOT MET'}; against "
                   f"the per-partition store after the same compaction: worst {worst_c:.2f}x")
    ent = res[(S, top)]["reads"]["after"]["dump"]["kinds"].get("GET", 0) - res[(S, top)][
        "reads"]["after"]["reader"]["kinds"].get("GET", 0)
    out.append(f"   dump's extra GETs over the reader's after the split (its topics()/partitions() "
               f"listing): {ent}; a split partition's reader fetches no journal entry (only the "
               "entries above its split_to), listing partitions reads none (a partition's first "
               "shared flush creates its empty manifest)")
    out.append("")
    out.append("4. Forced compaction <= 4 requests per segment: bench/s3.py (run separately).")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", default="8,64,512")
    ap.add_argument("--flushes", type=int, default=6)
    ap.add_argument("--per-flush", type=int, default=10)
    ap.add_argument("--split-interval", type=int, default=32,
                    help="flushes between two splits of a partition, for the amortized rate "
                         "(KCOMPACT_S3_SHARED_SPLIT_OBJECTS's default)")
    args = ap.parse_args(argv)
    plist = [int(x) for x in args.partitions.split(",")]
    tmp = tempfile.mkdtemp(prefix="kcompact-bench-estate-")
    res: dict = {}
    try:
        with SeaweedS3() as server:
            os.environ.update(server.env())
            os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(tmp, "cache")
            # the parts due for the split after this run's flushes (read at each assessment)
            os.environ["KCOMPACT_S3_SHARED_SPLIT_OBJECTS"] = str(args.flushes)
            bucket = server.create_bucket("kcompact-estate")
            for p in plist:
                for mode in MODES:
                    t = time.perf_counter()
                    res[(mode, p)] = run_one(bucket, tmp, mode, p, args.flushes, args.per_flush)
                    print(f"  ({mode}, {p} partitions: {time.perf_counter() - t:.0f} s)",
                          file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(report(res, plist, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
