"""Benchmark: the Spark engine next to the local engine, in the same run.

    python bench/spark.py [--records 2000000] [--partitions 8] [--keys 200000] [--rounds 1]
                          [--master local[2]] [--bootstrap-servers B] [--json]

A topic of N records (100-byte values, K distinct keys, default partitioner) is produced into
the embedded Tansu broker (or the broker named by --bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS).
Then:

* **start**: the JVM and SparkSession (``spark_session(master)``), and a warm-up job that starts
  the Python workers and loads kcompact and its numba kernels in them - both fixed costs of a
  process, reported apart and not counted below.
* **mirror**, alternating for --rounds rounds, each into a fresh store directory:
  ``--engine local`` (kcompact.connectors.apps.mirror.mirror_local: one process, one consumer for
  every partition) and ``--engine spark``
  (kcompact.connectors.apps.spark.mirror_job.mirror_with_spark: one Spark task per partition, each
  with its own consumer and commit-log writer; its compaction stage is off, as the local batch
  mirror has none). Timed from the call to its return.
* **read**: the Spark store's every record, ``spark.read.format("kcompact").option("mode",
  "all")...load().count()`` (and the default ``latest``) next to ``kcompact dump`` of each
  partition in turn (in this process, output counted and discarded). The session's first
  data-source query (planner workers, JVM code generation) is run once before and reported apart.

The issue's target: the Spark engine not slower than the local one at 2M records once the JVM
is up. On a 2-core machine both engines share the same two cores (Spark ``local[2]`` runs two
tasks at once), so expect the ratio to depend on how busy the machine is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from kcompact.connectors import cli  # noqa: E402
from kcompact.connectors.devtools.broker import EmbeddedBroker  # noqa: E402
from kcompact.connectors.apps.mirror import mirror_local  # noqa: E402
from kcompact.connectors.apps.spark import spark_session  # noqa: E402
from kcompact.connectors.apps.spark.mirror_job import mirror_with_spark  # noqa: E402
from kcompact.connectors.plugins.store_sink import warm_up  # noqa: E402
from kcompact.connectors.framework.kafka_clients import kafka_logger  # noqa: E402
from kcompact.reput import Store  # noqa: E402

VALUE = 100


def produce(bootstrap: str, topic: str, n: int, keys: int, partitions: int) -> float:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result()
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1 << 20,
                  "queue.buffering.max.messages": 1_000_000, "logger": kafka_logger()})
    value = bytes(range(VALUE))
    t = time.perf_counter()
    for i in range(n):
        key = b"key-%08d" % ((i * 7919) % keys)
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
    left = p.flush(120)
    if left:
        raise SystemExit(f"{left} records not acknowledged by the broker")
    return time.perf_counter() - t


def stored(store: str, topic: str) -> int:
    with Store.open(store) as st:
        return sum(st.partition(topic, p).record_count() for p in st.partitions(topic))


def _warm_task(_it):
    from kcompact.connectors.plugins.store_sink import warm_up as warm
    warm()
    yield 1


class _LineCounter(io.TextIOBase):
    def __init__(self):
        self.lines = 0

    def write(self, s: str) -> int:
        self.lines += s.count("\n")
        return len(s)


def dump_all(store: str, topic: str) -> tuple[float, int]:
    """``kcompact dump`` of every partition in turn, in this process (no interpreter start)."""
    with Store.open(store) as st:
        parts = st.partitions(topic)
    sink = _LineCounter()
    t = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        for p in parts:
            rc = cli.main(["dump", "--store", store, "--topic", topic, "--partition", str(p)])
            if rc != 0:
                raise SystemExit(f"kcompact dump failed for partition {p}")
    return time.perf_counter() - t, sink.lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="kcompact-bench-spark-", dir=args.workdir)
    broker = spark = None
    log = sys.stderr
    try:
        if args.bootstrap_servers:
            bootstrap = args.bootstrap_servers
        else:
            broker = EmbeddedBroker().start()
            bootstrap = broker.bootstrap_servers
        topic = f"bench-spark-{uuid.uuid4().hex[:8]}"
        print(f"producing {args.records:,} records ({VALUE}-byte values, {args.keys:,} keys, "
              f"{args.partitions} partitions) to {bootstrap}", file=log, flush=True)
        prod_s = produce(bootstrap, topic, args.records, args.keys, args.partitions)
        print(f"  produced in {prod_s:.1f} s", file=log, flush=True)
        t = time.perf_counter()
        warm_up()
        print(f"  numba kernels loaded in {time.perf_counter() - t:.1f} s (driver)", file=log,
              flush=True)

        t = time.perf_counter()
        spark = spark_session(args.master)
        jvm_s = time.perf_counter() - t
        cores = spark.sparkContext.defaultParallelism
        t = time.perf_counter()
        spark.sparkContext.parallelize(range(cores), cores).mapPartitions(_warm_task).count()
        workers_s = time.perf_counter() - t
        print(f"  Spark {spark.sparkContext.master}: JVM + session {jvm_s:.1f} s, Python "
              f"workers warm-up {workers_s:.1f} s", file=log, flush=True)

        locals_, sparks = [], []
        spark_store = None
        for r in range(args.rounds):
            lo = os.path.join(workdir, f"local-{r}")
            t = time.perf_counter()
            res = mirror_local(bootstrap, topic, lo, out=io.StringIO(), handle_signals=False)
            dl = time.perf_counter() - t
            if stored(lo, topic) != args.records or res.records != args.records:
                raise SystemExit(f"local mirror stored {stored(lo, topic)} records")
            shutil.rmtree(lo)
            sp = os.path.join(workdir, f"spark-{r}")
            t = time.perf_counter()
            sres = mirror_with_spark(bootstrap, topic, sp, spark=spark, compact=False,
                                     out=io.StringIO())
            ds = time.perf_counter() - t
            if stored(sp, topic) != args.records or sres.records != args.records:
                raise SystemExit(f"spark mirror stored {stored(sp, topic)} records")
            if spark_store is not None:
                shutil.rmtree(spark_store)
            spark_store = sp
            locals_.append(dl)
            sparks.append(ds)
            print(f"  round {r + 1}: mirror --engine local {dl:.2f} s "
                  f"({args.records / dl:,.0f} rec/s), --engine spark {ds:.2f} s "
                  f"({args.records / ds:,.0f} rec/s)", file=log, flush=True)

        reader = (spark.read.format("kcompact").option("store", spark_store)
                  .option("topic", topic))
        # the session's first data-source query plans through fresh Python planner workers and
        # JIT-compiles its JVM code paths: a fixed cost, reported apart (~10-30 s on 2 cores)
        t = time.perf_counter()
        reader.option("mode", "all").load().count()
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        n_all = reader.option("mode", "all").load().count()
        ds_all = time.perf_counter() - t
        t = time.perf_counter()
        n_latest = reader.option("mode", "latest").load().count()
        ds_latest = time.perf_counter() - t
        dump_s, dumped = dump_all(spark_store, topic)
        if n_all != args.records or dumped != args.records:
            raise SystemExit(f"read back {n_all} (data source) and {dumped} (dump) records, "
                             f"expected {args.records}")
        print(f"  read: first data-source query {first_s:.2f} s (warm-up); count() all "
              f"{ds_all:.2f} s, latest {ds_latest:.2f} s ({n_latest:,} keys); kcompact dump "
              f"{dump_s:.2f} s", file=log, flush=True)

        loc_s, spk_s = statistics.median(locals_), statistics.median(sparks)
        doc = {
            "records": args.records, "partitions": args.partitions, "keys": args.keys,
            "rounds": args.rounds, "master": spark.sparkContext.master, "cores": os.cpu_count(),
            "produce_s": prod_s,
            "spark_jvm_session_start_s": jvm_s, "spark_python_workers_warmup_s": workers_s,
            "mirror_local_s": locals_, "mirror_spark_s": sparks,
            "mirror_local_rec_per_s": args.records / loc_s,
            "mirror_spark_rec_per_s": args.records / spk_s,
            "mirror_ratio_local_over_spark": loc_s / spk_s,
            "datasource_first_query_s": first_s, "datasource_count_all_s": ds_all, "datasource_count_latest_s": ds_latest,
            "latest_keys": n_latest, "dump_s": dump_s,
            "read_ratio_dump_over_datasource": dump_s / ds_all,
        }
        if args.json_out:  # bench/report.py: the figures as JSON, the text as printed
            with open(args.json_out, "w") as f:
                json.dump(doc, f, indent=2)
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            print(f"\nSpark engine vs local engine, {args.records:,} records x {VALUE} B, "
                  f"{args.partitions} partitions, {os.cpu_count()} cores, "
                  f"median of {args.rounds} round(s)")
            print(f"  Spark start (not counted)   JVM+session {jvm_s:6.1f} s, Python workers "
                  f"{workers_s:.1f} s, first data-source query {first_s:.1f} s")
            print(f"  mirror --engine local       {loc_s:7.2f} s  "
                  f"{doc['mirror_local_rec_per_s']:>12,.0f} rec/s")
            print(f"  mirror --engine spark       {spk_s:7.2f} s  "
                  f"{doc['mirror_spark_rec_per_s']:>12,.0f} rec/s")
            print(f"  ratio local/spark           {doc['mirror_ratio_local_over_spark']:7.2f}"
                  f"    (>= 1.00: Spark not slower; "
                  f"{'met' if doc['mirror_ratio_local_over_spark'] >= 1 else 'NOT met'})")
            print(f"  data source count() (all)   {ds_all:7.2f} s  {n_all / ds_all:>12,.0f} rec/s"
                  f"   (latest: {ds_latest:.2f} s, {n_latest:,} keys)")
            print(f"  kcompact dump (all parts)   {dump_s:7.2f} s  {dumped / dump_s:>12,.0f} rec/s")
            print(f"  ratio dump/data source      {doc['read_ratio_dump_over_datasource']:7.2f}")
        return 0
    finally:
        if spark is not None:
            spark.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
