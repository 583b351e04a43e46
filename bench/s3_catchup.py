"""Benchmark (issue 49): the GETs of one consumer reading a whole S3 store from the beginning
through the Kafka endpoint, as the partition count grows - shared objects as written, and after
`kcompact compact --force` into one compaction object per run (docs/formats/compaction-object.md)
beside the per-partition segment objects of before (``KCOMPACT_S3_COMPACTION_OBJECTS=partition``)
and the per-partition uploads as written, in one run.

    python bench/s3_catchup.py [--partitions 8,512] [--updates 60000] [--keys 20000]
                               [--value-bytes 400] [--flushes 6] [--no-partition-uploads]
                               [--no-catalog-baseline] [--by-key]

The issue's shape, everything on 127.0.0.1: SeaweedFS (connectors/devtools/seaweed.py) started
here; for each partition count, ``--updates`` updates of ``--keys`` keys (``--value-bytes``
random values; the key decides the partition, so every count holds the same records) are
written by one writer (``Store.open(url, writer=...)``) in ``--flushes`` flushes, into:

* ``shared``: the defaults of a new S3 store (``upload`` ``auto``: shared uploads and the store
  catalog, format 5), read as written, then compacted with ``compact_store(force=True)`` (what
  `kcompact compact --force` runs) into one object;
* ``shared/partition-objects``: the same writes, compacted the old way (one .log and one .bcq
  object per partition: the baseline after the split);
* ``shared, no catalog``: shared uploads on a store without the catalog (format 3,
  ``Store.create(url, shared_uploads=True, catalog=False)``: a new store before the catalog;
  what ``upload="shared"`` made of a new store until this round), as written and after the split:
  the baseline of the catalog (a manifest LIST and GET a partition);
* ``partition-uploads``: per-partition uploads as written (the baseline before the split;
  ``--no-partition-uploads`` skips it: slow at 512 partitions).

Each read is the Kafka endpoint (``run_kafka_endpoint``, in this process, a fresh block cache
and spool) and one confluent-kafka consumer assigned every partition from the beginning,
reading until it has every record. Every S3 call of this process is counted by wrapping the
boto3 client the backend makes (``reput.s3.make_client``), as bench/s3_live.py does, by kind
and by what the key is (metadata: manifests, ledgers, journal; data: objects).

Printed: per count and layout the GETs (data and metadata apart), LISTs, bytes; then each
figure's ratio to the same layout at the smallest count and beside its baseline. Target: GETs
at 512 partitions <= 1.5x those at 8, before and after the split.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: E402

from kcompact.compaction.planner import compact_store  # noqa: E402
from kcompact.connectors.devtools.seaweed import SeaweedS3  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import s3 as s3mod  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3_cache import shared_cache, shared_spool  # noqa: E402

TOPIC = "catchup"
KINDS = {"get_object": "GET", "list_objects_v2": "LIST", "put_object": "PUT",
         "head_object": "HEAD", "delete_objects": "DEL", "delete_object": "DEL"}
COUNTS: Counter = Counter()
LOCK = threading.Lock()


class Counted:
    """A boto3 S3 client whose calls are counted by kind and by what the key is."""

    def __init__(self, client):
        self._c = client

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        kind = KINDS.get(name)
        if kind is None or not callable(attr):
            return attr

        def call(*a, **k):
            key = k.get("Key") or k.get("Prefix") or ""
            with LOCK:
                COUNTS[kind] += 1
                COUNTS[f"{kind} {what_of(key)}"] += 1
                COUNTS[f"{kind} {detail_of(key)}"] += 1
                COUNTS[f"K {kind} {shape_of(key)}"] += 1
            return attr(*a, **k)
        return call


def shape_of(key: str) -> str:
    """The key with its store prefix cut, partition numbers as N and versions as V
    (``--by-key``)."""
    key = key.split("/", 1)[1] if "/" in key else key
    key = re.sub(r"\d{20}", "V", key)
    return re.sub(r"/\d+(?=/|$)", "/N", key)


def what_of(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    if name.endswith((".kso", ".kco", ".log", ".bcq")):
        return "data"
    return "metadata"


def detail_of(key: str) -> str:
    """The metadata's kind, for the breakdown."""
    bits = key.split("/")
    if "manifest" in bits:
        return "m:manifest"
    if bits[-1] == "ledger.json":
        return "m:ledger"
    if "journal" in bits or bits[-1] == "writers.json":
        return "m:journal"
    return "m:data" if what_of(key) == "data" else "m:other"


_make_client = s3mod.make_client
s3mod.make_client = lambda *a, **k: Counted(_make_client(*a, **k))


def snapshot() -> Counter:
    with LOCK:
        return Counter(COUNTS)


# -- writing -------------------------------------------------------------------------------------


def updates(n: int, keys: int, value_bytes: int, seed: int = 7) -> list[tuple[bytes, bytes]]:
    rnd = random.Random(seed)
    return [(b"key-%08d" % rnd.randrange(keys), rnd.randbytes(value_bytes)) for _ in range(n)]


def partition_of(key: bytes, partitions: int) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") % partitions


def write(url: str, cl: str, ups, partitions: int, flushes: int, upload: str) -> int:
    """``upload``: "auto" (the defaults), "partition", or "no-catalog" (shared uploads into a
    format-3 store)."""
    nxt = [0] * partitions
    per = -(-len(ups) // flushes)
    want = {"auto": {"shared-upload", "store-catalog"}, "no-catalog": {"shared-upload"},
            "partition": set()}[upload]
    if upload == "no-catalog":
        Store.create(url, shared_uploads=True, catalog=False).close()
        upload = "auto"  # (the store uses shared uploads: auto follows it)
    with Store.open(url, writer="bench", create=True, options=WriterOptions(upload=upload),
                    commitlog_dir=cl) as st:
        got = set(st.meta.features) & {"shared-upload", "store-catalog"}
        if got != want:
            raise SystemExit(f"{url}: made with features {sorted(got)}, not {sorted(want)}")
        for i in range(0, len(ups), per):
            rows = []
            for k, v in ups[i:i + per]:
                p = partition_of(k, partitions)
                rows.append((p, nxt[p], int(time.time() * 1000), k, v, []))
                nxt[p] += 1
            st.append(RecordBatch.from_records(TOPIC, rows))
            st.flush()
    return len(ups)


def compact(url: str, cl: str, mode: str) -> None:
    old = os.environ.get("KCOMPACT_S3_COMPACTION_OBJECTS")
    os.environ["KCOMPACT_S3_COMPACTION_OBJECTS"] = mode
    try:
        with Store.open(url, commitlog_dir=cl) as st:
            compact_store(st, force=True)
    finally:
        if old is None:
            os.environ.pop("KCOMPACT_S3_COMPACTION_OBJECTS", None)
        else:
            os.environ["KCOMPACT_S3_COMPACTION_OBJECTS"] = old


# -- reading through the Kafka endpoint -------------------------------------------------------------


class Endpoint(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.port = url, 0
        self.ready = threading.Event()
        self.loop = self.stop_ev = self.error = None

    def run(self) -> None:
        from kcompact.replication.kafka_endpoint.command import (KafkaEndpointOptions,
                                                                  run_kafka_endpoint)

        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_ev = asyncio.Event()

            def ready(_host, port):
                self.port = port
                self.ready.set()
            await run_kafka_endpoint(self.url, KafkaEndpointOptions("127.0.0.1:0"),
                                     stop=self.stop_ev, ready=ready)
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e
            self.ready.set()

    def close(self) -> None:
        if self.loop is not None and self.stop_ev is not None:
            self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.join(30)


def read_all(url: str, partitions: int, want: int) -> dict:
    """A fresh endpoint on ``url``; one consumer reads every partition from the beginning until
    it has ``want`` records. Returns the requests it cost and the records read."""
    shared_cache().clear()
    shared_spool().clear()
    c0 = snapshot()
    ep = Endpoint(url)
    ep.start()
    ep.ready.wait(120)
    if ep.error is not None:
        raise ep.error
    c = Consumer({"bootstrap.servers": f"127.0.0.1:{ep.port}", "group.id": f"b-{uuid.uuid4()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 52428800,
                  "max.partition.fetch.bytes": 1048576})
    got = 0
    t0 = time.monotonic()
    try:
        c.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in range(partitions)])
        last = time.monotonic()
        while got < want:
            msgs = c.consume(10_000, 1.0)
            got += sum(1 for m in msgs if m.error() is None)
            if msgs:
                last = time.monotonic()
            elif time.monotonic() - last > 60:
                break
    finally:
        c.close()
        ep.close()
    d = snapshot() - c0
    return {"records": got, "want": want, "seconds": time.monotonic() - t0,
            "GET": d["GET"], "GET data": d["GET data"], "GET metadata": d["GET metadata"],
            "LIST": d["LIST"], "HEAD": d["HEAD"],
            "detail": {k[6:]: v for k, v in sorted(d.items()) if k.startswith("GET m:")},
            "keys": {k[2:]: v for k, v in d.items() if k.startswith("K ")}}


def live_records(url: str) -> int:
    with Store.open(url) as st:
        return sum(st.partition(TOPIC, p).record_count() for p in st.partitions(TOPIC))


# -- the run ----------------------------------------------------------------------------------------


def run_count(s3: SeaweedS3, work: str, partitions: int, args) -> dict:
    ups = updates(args.updates, args.keys, args.value_bytes)
    tag = uuid.uuid4().hex[:6]
    out = {}
    a = s3.url(f"catchup-{partitions}-a-{tag}", bucket="bench")
    b = s3.url(f"catchup-{partitions}-b-{tag}", bucket="bench")
    d = s3.url(f"catchup-{partitions}-d-{tag}-no-catalog", bucket="bench")
    n = write(a, os.path.join(work, f"cl-{partitions}-a"), ups, partitions, args.flushes, "auto")
    write(b, os.path.join(work, f"cl-{partitions}-b"), ups, partitions, args.flushes, "auto")
    out["shared as written"] = read_all(a, partitions, n)
    if args.no_catalog:
        write(d, os.path.join(work, f"cl-{partitions}-d"), ups, partitions, args.flushes,
              "no-catalog")
        out["shared, no catalog, as written (baseline)"] = read_all(d, partitions, n)
    if args.partition_uploads:
        c = s3.url(f"catchup-{partitions}-c-{tag}", bucket="bench")
        write(c, os.path.join(work, f"cl-{partitions}-c"), ups, partitions, args.flushes,
              "partition")
        out["partition uploads as written (baseline)"] = read_all(c, partitions, n)
    compact(a, os.path.join(work, f"cc-{partitions}-a"), "store")
    compact(b, os.path.join(work, f"cc-{partitions}-b"), "partition")
    live = live_records(a)
    out["compacted: one object per run"] = read_all(a, partitions, live)
    out["compacted: partition objects (baseline)"] = read_all(b, partitions, live)
    if args.no_catalog:
        compact(d, os.path.join(work, f"cc-{partitions}-d"), "store")
        out["compacted, no catalog (baseline)"] = read_all(d, partitions, live)
    for k, r in out.items():
        print(f"  {partitions:>4} partitions, {k:<44}: GET {r['GET']:>5} (data {r['GET data']:>4}"
              f", metadata {r['GET metadata']:>5}), LIST {r['LIST']:>4}, HEAD {r['HEAD']:>3}; "
              f"{r['records']}/{r['want']} records in {r['seconds']:.1f} s\n"
              f"        GETs by what: " + ", ".join(f"{k} {v}" for k, v in r["detail"].items()),
              flush=True)
        if args.by_key:
            for shape, v in sorted(r["keys"].items(), key=lambda kv: -kv[1])[:12]:
                print(f"          {v:>5} {shape}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", default="8,512")
    ap.add_argument("--updates", type=int, default=60_000)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--value-bytes", type=int, default=400)
    ap.add_argument("--flushes", type=int, default=6)
    ap.add_argument("--no-partition-uploads", dest="partition_uploads", action="store_false")
    ap.add_argument("--by-key", action="store_true",
                    help="also print each read's most requested keys (partitions as N)")
    ap.add_argument("--no-catalog-baseline", dest="no_catalog", action="store_false",
                    help="skip the stores without a catalog (format 3)")
    args = ap.parse_args()
    counts = [int(x) for x in args.partitions.split(",")]
    res = {}
    with tempfile.TemporaryDirectory() as work, SeaweedS3() as s3:
        os.environ.update(s3.env())
        os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(work, "cache")
        s3.create_bucket("bench")
        for n in counts:
            print(f"{n} partitions: {args.updates} updates of {args.keys} keys, "
                  f"{args.value_bytes}-byte values, {args.flushes} flushes", flush=True)
            res[n] = run_count(s3, work, n, args)
    lo, hi = counts[0], counts[-1]
    print(f"\nsummary: GETs at {hi} partitions / GETs at {lo} (target <= 1.5x), same run:")
    for layout in res[lo]:
        a, b = res[lo][layout], res[hi].get(layout)
        if b is None:
            continue
        print(f"  {layout:<44}: {a['GET']:>5} -> {b['GET']:>5} GETs = {b['GET'] / max(1, a['GET']):5.2f}x"
              f"  (data {a['GET data']} -> {b['GET data']} = "
              f"{b['GET data'] / max(1, a['GET data']):.2f}x; metadata {a['GET metadata']} -> "
              f"{b['GET metadata']} = {b['GET metadata'] / max(1, a['GET metadata']):.2f}x; "
              f"LIST {a['LIST']} -> {b['LIST']})")
    for n in counts:
        new, old = (res[n]["compacted: one object per run"],
                    res[n]["compacted: partition objects (baseline)"])
        print(f"  {n:>4} partitions after the split: {new['GET']} GETs beside the baseline's "
              f"{old['GET']} ({new['GET'] / max(1, old['GET']):.2f}x); data {new['GET data']} "
              f"beside {old['GET data']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
