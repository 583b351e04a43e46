"""Benchmark: `kcompact mirror --engine local` next to the raw consume limit, in the same run.

    python bench/mirror.py [--records 2000000] [--partitions 8] [--keys 200000] [--rounds 3]
                           [--bootstrap-servers B] [--json]

A topic of N records (100-byte values, K distinct keys, default partitioner) is produced into
the embedded Tansu broker (or the broker named by --bootstrap-servers / KAFKA_BOOTSTRAP_SERVERS).
Then, alternating for --rounds rounds:

* raw: a confluent-kafka consumer that assigns every partition and calls
  consume(num_messages=10000, or what is left when fewer) until it has read every record,
  discarding the messages. It uses exactly the consumer settings the mirror uses (read_committed,
  queued.min.messages=1M ...) and the same garbage-collector thresholds (reput/_gc.py), so
  the two differ only in what happens to the messages.
* mirror: kcompact.connectors.apps.mirror.mirror_local into a fresh store directory, timed from the
  call to its return (metadata, store creation, consume, append, final fsync'd flush).

numba's kernels and the source-codec probe's protocol library are loaded once before the first
round (store_sink.warm_up: a fixed ~1-3 s per process that every `kcompact` process pays at
start-up, whatever the topic size). Target: mirror throughput
>= 1.0 x raw consume (median of the rounds; issue 19 raised it from 0.8).
"""

from __future__ import annotations

import argparse
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

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from kcompact.connectors.framework.native_kafka import describe  # noqa: E402
from kcompact.connectors.devtools.broker import EmbeddedBroker  # noqa: E402
from kcompact.connectors.apps.mirror import mirror_local  # noqa: E402
from kcompact.connectors.plugins.store_sink import warm_up  # noqa: E402
from kcompact.connectors.framework.kafka_clients import SINK_CONSUMER_DEFAULTS  # noqa: E402
from kcompact.connectors.framework.kafka_clients import kafka_logger  # noqa: E402
from kcompact.reput import Store  # noqa: E402
from kcompact.connectors.framework.gcmode import bulk_gc  # noqa: E402

TARGET = 1.0   # mirror / raw consume (issue 19)

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


def raw_consume(bootstrap: str, topic: str, partitions: int, records: int
                ) -> tuple[float, int]:
    conf = dict(SINK_CONSUMER_DEFAULTS, **{"bootstrap.servers": bootstrap,
                                           "group.id": "bench-raw", "enable.auto.commit": False,
                                           "enable.partition.eof": True,
                                           "logger": kafka_logger()})
    t = time.perf_counter()
    c = Consumer(conf)
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    eof, n = set(), 0
    # It stops at the last record: asking for no more than what is left, so that the last
    # consume() returns with it instead of waiting out its timeout for messages that will not
    # come (until 2026-11-23 this consumer waited for every partition's end-of-partition event,
    # which added a whole timeout, 1 s, to the raw time and flattered the ratio).
    while len(eof) < partitions and n < records:
        for m in c.consume(num_messages=min(10_000, records - n), timeout=1.0):
            e = m.error()
            if e is None:
                n += 1
            elif e.code() == KafkaError._PARTITION_EOF:
                eof.add(m.partition())
    c.close()
    return time.perf_counter() - t, n


def mirror(bootstrap: str, topic: str, workdir: str) -> tuple[float, int]:
    store = os.path.join(workdir, f"store-{uuid.uuid4().hex[:6]}")
    t = time.perf_counter()
    res = mirror_local(bootstrap, topic, store, out=io.StringIO(), handle_signals=False)
    dt = time.perf_counter() - t
    with Store.open(store) as st:
        stored = sum(st.partition(topic, p).record_count() for p in st.partitions(topic))
    if stored != res.records:
        raise SystemExit(f"mirror reported {res.records} records but the store holds {stored}")
    shutil.rmtree(store)
    return dt, stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="kcompact-bench-mirror-", dir=args.workdir)
    broker = None
    try:
        if args.bootstrap_servers:
            bootstrap = args.bootstrap_servers
        else:
            broker = EmbeddedBroker().start()
            bootstrap = broker.bootstrap_servers
        topic = f"bench-mirror-{uuid.uuid4().hex[:8]}"
        log = sys.stderr
        print(f"producing {args.records:,} records ({VALUE}-byte values, {args.keys:,} keys, "
              f"{args.partitions} partitions) to {bootstrap}", file=log, flush=True)
        prod_s = produce(bootstrap, topic, args.records, args.keys, args.partitions)
        print(f"  produced in {prod_s:.1f} s", file=log, flush=True)
        t = time.perf_counter()
        warm_up()
        print(f"  numba kernels loaded in {time.perf_counter() - t:.1f} s", file=log, flush=True)
        print(f"  Kafka I/O: {describe()}", file=log, flush=True)
        raws, mirrors = [], []
        for r in range(args.rounds):
            with bulk_gc():  # the mirror's own GC settings: only the work differs
                dt, n = raw_consume(bootstrap, topic, args.partitions, args.records)
            if n != args.records:
                raise SystemExit(f"raw consumer read {n} records, expected {args.records}")
            raws.append(dt)
            dm, m = mirror(bootstrap, topic, workdir)
            if m != args.records:
                raise SystemExit(f"mirror stored {m} records, expected {args.records}")
            mirrors.append(dm)
            print(f"  round {r + 1}: raw {dt:.2f} s ({n / dt:,.0f} rec/s), mirror {dm:.2f} s "
                  f"({m / dm:,.0f} rec/s)", file=log, flush=True)
        raw_s, mir_s = statistics.median(raws), statistics.median(mirrors)
        doc = {
            "records": args.records, "partitions": args.partitions, "keys": args.keys,
            "rounds": args.rounds,
            "raw_consume_s": raws, "mirror_s": mirrors,
            "raw_consume_rec_per_s": args.records / raw_s,
            "mirror_rec_per_s": args.records / mir_s,
            "ratio": raw_s / mir_s, "target_ratio": TARGET,
            "kafka_io": describe(),
        }
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(doc, f, indent=2)
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            print(f"\nmirror --engine local vs raw consume, {args.records:,} records x "
                  f"{VALUE} B, {args.partitions} partitions, median of {args.rounds} rounds")
            print(f"  raw consume (discard)  {raw_s:7.2f} s  {doc['raw_consume_rec_per_s']:>12,.0f} rec/s")
            print(f"  mirror (into a store)  {mir_s:7.2f} s  {doc['mirror_rec_per_s']:>12,.0f} rec/s")
            print(f"  ratio mirror/raw       {doc['ratio']:7.2f}    (target >= {TARGET:.2f}: "
                  f"{'met' if doc['ratio'] >= TARGET else 'NOT met'})")
        return 0
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
