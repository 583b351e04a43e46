"""Kafka's ConsumerPerformance reading a topic from Apache Kafka and from kcompact's Kafka endpoint.

    python bench/kafka_endpoint.py [--records 2000000] [--partitions 8] [--rounds 2]

One run, one machine: Apache Kafka 3.9.1 (connectors/devtools/apache_kafka.py) gets a compacted
topic of ``--records`` records (8-byte keys, all distinct so that both sides hold every record;
100-byte values; ``--partitions`` partitions); ``kcompact mirror`` copies it into a store, which
is force-compacted (its segments sealed as Kafka batches) and served by ``kcompact serve
--kafka-listen``. Then ``org.apache.kafka.tools.ConsumerPerformance`` (kafka-consumer-perf-test,
a consumer group) reads the whole topic from each, alternating, ``--rounds`` times each. Prints
each side's best ``fetch.nMsg.sec`` (records a second after the group join) and the ratio
endpoint / broker (target >= 1.0x), and the endpoint's CPU seconds per GB of responses it sent
(its process's user + system time over its ``kcompact_kafka_response_bytes`` counter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from confluent_kafka.admin import AdminClient  # noqa: E402

from kafka_peers import consumer_perf, create, mirror, produce  # noqa: E402
from kcompact.compaction import CompactionOptions, compact_store  # noqa: E402
from kcompact.connectors.devtools.apache_kafka import ApacheKafkaBroker  # noqa: E402
from kcompact.reput import Store  # noqa: E402


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sent_bytes(metrics: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("kcompact_kafka_response_bytes_total"):
            return float(line.split()[-1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work, ApacheKafkaBroker() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        topic = f"bench-ep-{time.monotonic_ns()}"
        create(admin, topic, args.partitions, {"cleanup.policy": "compact",
                                               "min.compaction.lag.ms": "3600000"})
        produce(broker.bootstrap_servers, topic, args.records, args.records, args.partitions)
        url = os.path.join(work, "store")
        n, secs = mirror(broker.bootstrap_servers, topic, url)
        assert n == args.records, (n, args.records)
        with Store.open(url, writer="bench") as st:
            # the mirror synced Kafka's lag of an hour: lift it so that every segment is sealed
            st.set_topic_config(topic, {"cleanup.policy": "compact",
                                        "min.compaction.lag.ms": 0})
            compact_store(st, topic=topic, force=True, options=CompactionOptions())
        metrics = "127.0.0.1:%d" % _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "kcompact", "serve", "--store", url,
                                 "--kafka-listen", "127.0.0.1:0", "--metrics", metrics],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            line = proc.stdout.readline().decode()
            assert line.startswith("kafka endpoint listening on"), line
            endpoint = line.rsplit(" ", 1)[1].strip()
            time.sleep(1.0)
            cpu0, bytes0 = cpu_seconds(proc.pid), sent_bytes(metrics)
            ours, theirs = [], []
            for _ in range(args.rounds):
                theirs.append(consumer_perf(broker.bootstrap_servers, topic, args.records))
                ours.append(consumer_perf(endpoint, topic, args.records))
            sent = sent_bytes(metrics) - bytes0
            cpu_all = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(30)
    best_o = max(r["fetch_rec_per_s"] for r in ours)
    best_t = max(r["fetch_rec_per_s"] for r in theirs)
    out = {"records": args.records, "partitions": args.partitions, "rounds": args.rounds,
           "endpoint_fetch_rec_per_s": best_o, "kafka_fetch_rec_per_s": best_t,
           "ratio": best_o / best_t, "endpoint_cpu_s": cpu_all, "endpoint_bytes_sent": sent,
           "endpoint_cpu_s_per_gb": cpu_all / (sent / 1e9) if sent else None,
           "runs": {"endpoint": ours, "kafka": theirs}}
    print(f"ConsumerPerformance, {args.records:,} records x {args.partitions} partitions: "
          f"endpoint {best_o:,.0f} rec/s, Apache Kafka {best_t:,.0f} rec/s, "
          f"ratio {best_o / best_t:.2f}x (target >= 1.0x); endpoint CPU "
          f"{out['endpoint_cpu_s_per_gb'] or 0:.2f} s per GB sent ({sent / 1e9:.2f} GB)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
