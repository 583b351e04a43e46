"""The Kafka endpoint following a live mirror on S3 (SeaweedFS; issue 49, reput/s3_follow.py).

``kcompact mirror --follow`` (a process, the defaults: the store is new, so shared uploads,
flushed every 500 ms) copies a topic into an S3 store that ``kcompact serve --kafka-listen``
(a process) serves; a confluent-kafka consumer of the endpoint reads every partition from the
start. Records are produced in waves; each wave must reach the consumer before a generous
deadline (15 s: "works" against "broken"; the latency is printed, not asserted); in the middle
the mirror is stopped and started again (a writer restart: it goes on at its next journal
entry, which the endpoint is polling). Every record received is the one produced at its offset.
New writers and dropped requests: tests/unit/test_s3_follow.py.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import pytest
from confluent_kafka import Producer

from kcompact.reput import Store
from kcompact.reput import shared as SH

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import Endpoint  # noqa: E402
from test_kafka_endpoint_live import Mirror, Reader  # noqa: E402

pytestmark = pytest.mark.integration

DEADLINE_S = 15.0
PARTITIONS = 2


def test_the_endpoint_follows_a_live_mirror_on_s3(kafka_bootstrap, make_topic, s3_store_url,
                                                   tmp_path):
    topic = make_topic(partitions=PARTITIONS)
    url = s3_store_url()
    log = open(tmp_path / "processes.log", "ab")
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    model: dict[tuple[int, int], tuple[bytes, bytes, float]] = {}

    def produce(wave: int, n: int = 20) -> set:
        sent: set = set()

        def done(err, msg) -> None:
            assert err is None, err
            model[(msg.partition(), msg.offset())] = (msg.key(), msg.value(), time.monotonic())
            sent.add((msg.partition(), msg.offset()))

        for i in range(n):
            p = i % PARTITIONS
            producer.produce(topic, key=b"k%d" % i, value=b"w%d-%d" % (wave, i), partition=p,
                             on_delivery=done)
        assert producer.flush(30) == 0
        return sent

    mirror = Mirror(kafka_bootstrap, topic, url, log)
    produce(0)
    mirror.start()
    deadline = time.monotonic() + 90
    while True:  # the mirror created the store (shared uploads: it was new) and flushed
        try:
            with Store.open(url) as st:
                if SH.FEATURE in st.meta.features and st.partitions(topic):
                    break
        except Exception:  # noqa: BLE001 - not created yet
            pass
        assert time.monotonic() < deadline, (tmp_path / "processes.log").read_text()[-3000:]
        time.sleep(0.2)
    ep = Endpoint(url, log=tmp_path / "endpoint.log").start()
    reader = Reader(ep.bootstrap, topic)
    reader.start()
    latencies: list[float] = []
    try:
        for wave in range(1, 6):
            if wave == 3:  # a writer restart
                mirror.stop()
                mirror.start()
            sent = produce(wave)
            deadline = time.monotonic() + DEADLINE_S + (30 if wave == 3 else 0)
            while True:
                seen = {(p, o): t for p, o, _k, _v, t in reader.got}
                if sent <= seen.keys() or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            missing = sent - seen.keys()
            assert not missing, (wave, sorted(missing)[:10], reader.errors,
                                 (tmp_path / "endpoint.log").read_text()[-2000:],
                                 (tmp_path / "processes.log").read_text()[-2000:])
            if wave != 3:
                latencies += [seen[po] - model[po][2] for po in sent]
    finally:
        reader.stop_event.set()
        reader.join(30)
        try:
            mirror.stop()
        finally:
            ep.stop()
            log.close()
    assert reader.errors == []
    received = {(p, o) for p, o, *_ in reader.got}
    assert set(model) <= received, sorted(set(model) - received)[:10]
    for p, o, k, v, _t in reader.got:
        assert model[(p, o)][:2] == (k, v), (p, o, k, v)
    with Store.open(url) as st:
        assert SH.read_writers(st.fs) == {"local"}
    print(f"\nS3 live edge through the endpoint over {len(latencies)} records: median "
          f"{statistics.median(latencies):.3f} s, max {max(latencies):.3f} s")
