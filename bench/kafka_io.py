"""Benchmark: kcompact's own Kafka consumer next to confluent-kafka's, in the same run.

    python bench/kafka_io.py [--records 1000000] [--partitions 8] [--rounds 3]

A topic of N records (100-byte values) is produced into the embedded Tansu broker. Then, alternating
for --rounds rounds, each side assigns every partition from offset 0 and reads to every partition's
end, keeping nothing: confluent-kafka's Consumer.consume(10000, 0.2) (Message objects), and
NativeConsumer.consume_columns(10000, 0.2) (connectors/framework/native_kafka.py: columns, the GIL
released). Both with the sink tasks' consumer settings (SINK_CONSUMER_DEFAULTS). Prints the median
of each side and native/confluent throughput: the Kafka I/O alone, without the store that
bench/mirror.py adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from kcompact.connectors.devtools.broker import EmbeddedBroker  # noqa: E402
from kcompact.connectors.framework.kafka_clients import SINK_CONSUMER_DEFAULTS  # noqa: E402
from kcompact.connectors.framework.native_kafka import NativeConsumer  # noqa: E402
from mirror import produce  # noqa: E402


def read_all(consumer, topic: str, partitions: int) -> int:
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got = ends = 0
    while ends < partitions:
        if isinstance(consumer, NativeConsumer):
            b = consumer.consume_columns(10000, 0.2)
            got, ends = got + len(b), ends + len(b.events)
        else:
            for m in consumer.consume(10000, 0.2):
                if m.error() is None:
                    got += 1
                else:
                    ends += 1
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with EmbeddedBroker() as broker:
        bootstrap = broker.bootstrap_servers
        topic = f"bench-io-{uuid.uuid4().hex[:8]}"
        produce(bootstrap, topic, args.records, max(1, args.records // 5), args.partitions)
        conf = dict(SINK_CONSUMER_DEFAULTS, **{"bootstrap.servers": bootstrap,
                                               "enable.partition.eof": True,
                                               "enable.auto.commit": False})
        times: dict[str, list[float]] = {"confluent": [], "native": []}
        for r in range(args.rounds):
            for side, make in (("confluent", Consumer), ("native", NativeConsumer)):
                c = make(dict(conf, **{"group.id": f"bench-io-{uuid.uuid4().hex[:8]}"}))
                t = time.perf_counter()
                got = read_all(c, topic, args.partitions)
                dt = time.perf_counter() - t
                c.close()
                if got != args.records:
                    raise SystemExit(f"{side} read {got} records, not {args.records}")
                times[side].append(dt)
                print(f"  round {r + 1}: {side} {dt:.2f} s ({args.records / dt:,.0f} rec/s)",
                      file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["confluent"] / med["native"]
    print(f"consume to the end, {args.records:,} records, {args.partitions} partitions, median of "
          f"{args.rounds} rounds: confluent-kafka {med['confluent']:.2f} s, native "
          f"{med['native']:.2f} s, native/confluent throughput {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
