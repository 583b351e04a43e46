"""Benchmark: `kcompact restore` next to the raw produce limit, in the same run.

    python bench/restore.py [--keys 1000000] [--partitions 8] [--dead 0] [--rounds 3]
                            [--bootstrap-servers B] [--json]

A store is built with K live keys (``key-%08d``, 100-byte values, partition = i % P, one record
per key, plus ``--dead`` x K overwritten records that a latest-per-key restore must skip). Then, for
--rounds rounds (the order of the sides rotates, with a 1 s pause before each), into fresh
topics of the embedded Tansu broker (or the broker named by --bootstrap-servers /
KAFKA_BOOTSTRAP_SERVERS):

* raw: one confluent-kafka producer sending the same K records (same keys, values, partitions,
  timestamps, same order) from Python lists built before the clock starts, with the restore's
  producer settings (kcompact.connectors.plugins.store_source.DEFAULT_PRODUCER_CONFIG: acks=all,
  idempotence, compression none, linger.ms, batch.size, queue size) and the same positional
  produce() call, timed from the producer's creation to flush() done, under the restore's
  garbage-collector thresholds (reput/_gc.py). The topic exists beforehand.
* restore: kcompact.connectors.apps.restore.restore (what `kcompact restore` runs) into a new topic,
  timed from the call to its return: metadata, topic creation, transactional producer and init,
  progress reads, the latest-per-key plan, reading the store, producing, a transaction commit and a
  store progress record (fsync'd) per chunk.
* restore-idempotent: the same with --exactly-once disabled (no transactions), to show what
  the transactions cost.

numba's kernels are loaded once before the first round by a small restore (a fixed ~1-3 s per
process). Target: restore throughput >= 0.8 x raw produce (median of the rounds). The CPU seconds
of this process (all its threads, librdkafka's included) are reported too: on a loaded machine
they show the cost of each side better than wall time, which the other jobs skew.
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

import numpy as np  # noqa: E402
from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from kcompact.connectors.framework.native_kafka import describe  # noqa: E402
from kcompact.connectors.devtools.broker import EmbeddedBroker  # noqa: E402
from kcompact.connectors.plugins.store_source import DEFAULT_PRODUCER_CONFIG  # noqa: E402
from kcompact.connectors.apps.restore import restore  # noqa: E402
from kcompact.connectors.framework.kafka_clients import kafka_logger  # noqa: E402
from kcompact.reput import Store  # noqa: E402
from kcompact.connectors.framework.gcmode import bulk_gc  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn  # noqa: E402

VALUE = 100
TS0 = 1_700_000_000_000
TOPIC = "bench"


def build_store(url: str, keys: int, partitions: int, dead: float) -> None:
    """K live keys, plus dead x K earlier versions of random keys (written first)."""
    rng = np.random.default_rng(7)
    n_dead = int(keys * dead)
    ids = np.concatenate([rng.integers(0, keys, n_dead), np.arange(keys)]).astype(np.int64)
    value = bytes(range(VALUE))
    with Store.open(url, writer="bench", create=True) as st:
        for p in range(partitions):
            mine = ids[ids % partitions == p]
            for lo in range(0, mine.shape[0], 200_000):
                part = mine[lo:lo + 200_000]
                m = part.shape[0]
                kbytes = b"".join(b"key-%08d" % i for i in part.tolist())
                kcol = BytesColumn.fixed(np.frombuffer(kbytes, np.uint8).copy(), 12)
                vcol = BytesColumn.fixed(np.frombuffer(value * m, np.uint8).copy(), VALUE)
                offs = np.arange(lo, lo + m, dtype=np.int64)
                st.append(RecordBatch.from_columns(TOPIC, p, offs, TS0 + offs, keys=kcol,
                                                   values=vcol))
            st.flush()


def raw_records(keys: int, partitions: int) -> tuple[list, list, list, list]:
    """The live records, in the order the restore sends them (by partition, then offset;
    chunks interleave partitions, which changes nothing for one broker)."""
    ks, vs, ps, ts = [], [], [], []
    value = bytes(range(VALUE))
    for p in range(partitions):
        ids = list(range(p, keys, partitions))
        ks.extend(b"key-%08d" % i for i in ids)
        vs.extend([value] * len(ids))
        ps.extend([p] * len(ids))
        ts.extend(TS0 + o for o in range(len(ids)))  # same timestamps when dead == 0
    return ks, vs, ps, ts


def raw_produce(bootstrap: str, topic: str, cols) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    ks, vs, ps, ts = cols
    conf = dict(DEFAULT_PRODUCER_CONFIG, **{"bootstrap.servers": bootstrap,
                                            "logger": kafka_logger()})
    t, c = time.perf_counter(), time.process_time()
    p = Producer(conf)
    # connect and learn the partition leaders first (the restore does the same): records
    # produced before that wait for a metadata round trip that librdkafka may delay ~0.5 s
    p.list_topics(topic=topic, timeout=10)
    produce, poll = p.produce, p.poll
    for k, v, part, stamp in zip(ks, vs, ps, ts):
        try:
            produce(topic, v, k, part, None, None, stamp)
        except BufferError:
            while True:
                poll(0.01)
                try:
                    produce(topic, v, k, part, None, None, stamp)
                    break
                except BufferError:
                    continue
    left = p.flush(120)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    if left:
        raise SystemExit(f"{left} records not acknowledged by the broker")
    return dt, dc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--dead", type=float, default=0.0,
                    help="overwritten records per live key (skipped by the restore)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-records", type=int, default=None,
                    help="restore.chunk.records (default: the connector's)")
    ap.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="kcompact-bench-restore-", dir=args.workdir)
    broker = None
    log = sys.stderr
    try:
        if args.bootstrap_servers:
            bootstrap = args.bootstrap_servers
        else:
            broker = EmbeddedBroker().start()
            bootstrap = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bootstrap, "logger": kafka_logger()})
        store = os.path.join(workdir, "store")
        t = time.perf_counter()
        build_store(store, args.keys, args.partitions, args.dead)
        print(f"store: {args.keys:,} live keys ({VALUE}-byte values, {args.partitions} "
              f"partitions, {int(args.keys * args.dead):,} dead records) built in "
              f"{time.perf_counter() - t:.1f} s", file=log, flush=True)
        cols = raw_records(args.keys, args.partitions)
        warm = os.path.join(workdir, "warm")
        build_store(warm, 1000, 2, 0.5)
        t = time.perf_counter()
        restore(bootstrap, warm, TOPIC, f"bench-warm-{uuid.uuid4().hex[:6]}", out=io.StringIO(),
                handle_signals=False, repartition=False)
        print(f"  warm-up restore (numba kernels loaded) in {time.perf_counter() - t:.1f} s",
              file=log, flush=True)
        print(f"  Kafka I/O: {describe()}", file=log, flush=True)
        sides = ("raw", "restore", "restore-idempotent")
        wall: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            topics = []

            def run(side: str) -> None:
                time.sleep(1.0)  # let the broker settle after the previous run
                topic = f"bench-{side}-{uuid.uuid4().hex[:8]}"
                topics.append(topic)
                if side == "raw":
                    admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result()
                    with bulk_gc():  # restore's own GC settings: only the work differs
                        w, c = raw_produce(bootstrap, topic, cols)
                else:
                    t, c0 = time.perf_counter(), time.process_time()
                    res = restore(bootstrap, store, TOPIC, topic, out=io.StringIO(),
                                  handle_signals=False, chunk_records=args.chunk_records,
                                  exactly_once="disabled" if side.endswith("idempotent")
                                  else "requested")
                    w, c = time.perf_counter() - t, time.process_time() - c0
                    if res.records != args.keys:
                        raise SystemExit(f"restore produced {res.records} records, expected "
                                         f"{args.keys}")
                wall[side].append(w)
                cpu[side].append(c)

            # rotate the order, so that no side always follows the same other one
            for side in sides[r % 3:] + sides[:r % 3]:
                run(side)
            print(f"  round {r + 1}: " + ", ".join(
                f"{side} {wall[side][-1]:.2f} s ({args.keys / wall[side][-1]:,.0f} rec/s, "
                f"CPU {cpu[side][-1]:.2f} s)" for side in sides), file=log, flush=True)
            for f in admin.delete_topics(topics).values():
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - frees broker memory only
                    pass
        med = {k: statistics.median(v) for k, v in wall.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        doc = {
            "keys": args.keys, "partitions": args.partitions, "dead_per_key": args.dead,
            "value_bytes": VALUE, "rounds": args.rounds, "bootstrap": bootstrap,
            "wall_seconds": wall, "cpu_seconds": cpu,
            "rate_median": {k: args.keys / v for k, v in med.items()},
            "ratio_of_medians": med["raw"] / med["restore"],
            "ratio_of_medians_idempotent": med["raw"] / med["restore-idempotent"],
            "cpu_ratio_of_medians": cmed["raw"] / cmed["restore"],
            "target": 0.8,
            "kafka_io": describe(),
        }
        if args.json_out:  # bench/report.py: the figures as JSON, the text as printed
            with open(args.json_out, "w") as f:
                json.dump(doc, f, indent=2)
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            for side in sides:
                print(f"{side + ':':20s} median {med[side]:.2f} s "
                      f"({doc['rate_median'][side]:,.0f} rec/s), CPU {cmed[side]:.2f} s")
            print(f"restore / raw throughput: {doc['ratio_of_medians']:.2f} (target >= 0.8); "
                  f"without transactions {doc['ratio_of_medians_idempotent']:.2f}")
            print(f"CPU seconds of this process, raw / restore: "
                  f"{doc['cpu_ratio_of_medians']:.2f} (less skewed by the machine's other load)")
        return 0
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
