"""Benchmark: `kcompact restore` next to the raw produce limit, in the same run.

    python bench/restore.py [--keys 1000000] [--partitions 8] [--dead 0] [--rounds 3]
                            [--bootstrap-servers B] [--json]

A store is built with K live keys (``key-%08d``, 100-byte values, partition = i % P, one record
per key, plus ``--dead`` x K overwritten records that a latest-per-key restore must skip). Then, for
--rounds rounds (which side goes first alternates, with a 1 s pause before each), into fresh
topics of the embedded Tansu broker (or the broker named by --bootstrap-servers /
KAFKA_BOOTSTRAP_SERVERS):

* raw: one confluent-kafka producer sending the same K records (same keys, values, partitions,
  timestamps, same order) from Python lists built before the clock starts, with the restore's
  producer settings (connectors.restore.DEFAULT_PRODUCER_CONFIG: acks=all, idempotence,
  compression none, linger.ms, batch.size, queue size) and the same positional produce() call,
  timed from the producer's creation to flush() done. The topic exists beforehand.
* restore: connectors.restore.restore (what `kcompact restore` runs) into a new topic, timed from
  the call to its return: metadata, topic creation, transactional producer and init, progress
  reads, the latest-per-key plan, reading the store, producing, a transaction commit and a store
  progress record (fsync'd) per chunk.

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

from connectors.broker import EmbeddedBroker  # noqa: E402
from connectors.restore import DEFAULT_PRODUCER_CONFIG, restore  # noqa: E402
from connectors.worker import kafka_logger  # noqa: E402
from reput import Store  # noqa: E402
from reput.record import RecordBatch, _VarColumn  # noqa: E402

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
                kcol = _VarColumn.fixed(np.frombuffer(kbytes, np.uint8).copy(), 12)
                vcol = _VarColumn.fixed(np.frombuffer(value * m, np.uint8).copy(), VALUE)
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
        raws, restores, raw_cpu, restore_cpu = [], [], [], []
        for r in range(args.rounds):
            raw_topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
            admin.create_topics([NewTopic(raw_topic, args.partitions, 1)])[raw_topic].result()
            target = f"bench-restore-{uuid.uuid4().hex[:8]}"

            def run_raw() -> None:
                time.sleep(1.0)  # let the broker settle after the previous run
                dr, cr = raw_produce(bootstrap, raw_topic, cols)
                raws.append(dr)
                raw_cpu.append(cr)

            def run_restore() -> None:
                time.sleep(1.0)
                t, c = time.perf_counter(), time.process_time()
                res = restore(bootstrap, store, TOPIC, target, out=io.StringIO(),
                              handle_signals=False, chunk_records=args.chunk_records)
                ds, cs = time.perf_counter() - t, time.process_time() - c
                if res.records != args.keys:
                    raise SystemExit(f"restore produced {res.records} records, expected "
                                     f"{args.keys}")
                restores.append(ds)
                restore_cpu.append(cs)

            # alternate which side goes first, so that neither always follows the other
            for step in ((run_raw, run_restore) if r % 2 == 0 else (run_restore, run_raw)):
                step()
            dr, ds, cr, cs = raws[-1], restores[-1], raw_cpu[-1], restore_cpu[-1]
            print(f"  round {r + 1}: raw {dr:.2f} s ({args.keys / dr:,.0f} rec/s, CPU {cr:.2f} s), "
                  f"restore {ds:.2f} s ({args.keys / ds:,.0f} rec/s, CPU {cs:.2f} s), ratio "
                  f"{dr / ds:.2f}", file=log, flush=True)
            for f in admin.delete_topics([raw_topic, target]).values():
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - frees broker memory only
                    pass
        raw_med, res_med = statistics.median(raws), statistics.median(restores)
        doc = {
            "keys": args.keys, "partitions": args.partitions, "dead_per_key": args.dead,
            "value_bytes": VALUE, "rounds": args.rounds, "bootstrap": bootstrap,
            "raw_seconds": raws, "restore_seconds": restores,
            "raw_rate_median": args.keys / raw_med, "restore_rate_median": args.keys / res_med,
            "ratio_of_medians": raw_med / res_med, "target": 0.8,
            "raw_cpu_seconds": raw_cpu, "restore_cpu_seconds": restore_cpu,
            "cpu_ratio_of_medians": statistics.median(raw_cpu) / statistics.median(restore_cpu),
        }
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            print(f"raw produce: median {raw_med:.2f} s ({doc['raw_rate_median']:,.0f} rec/s)")
            print(f"restore:     median {res_med:.2f} s ({doc['restore_rate_median']:,.0f} rec/s)")
            print(f"restore / raw throughput: {doc['ratio_of_medians']:.2f} (target >= 0.8)")
            print(f"CPU seconds of this process, raw / restore: "
                  f"{doc['cpu_ratio_of_medians']:.2f} (the machine's load does not bias it)")
        return 0
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
