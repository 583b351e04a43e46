"""A live store through the Kafka endpoint: a following mirror appends, compactions swap segments,
a consumer of the endpoint keeps up (issue 40, "Live stores").

On the session broker (Tansu) and on Apache Kafka 3.9.1 (``any_broker``): ``kcompact mirror
--engine local --follow`` runs as a process into a store that ``kcompact serve --kafka-listen``
serves, and a confluent-kafka consumer of the endpoint reads both partitions from the start for
the whole test. Records are produced to the source in waves (updates of a few keys,
tombstones); each wave's records must reach the consumer before a generous deadline
(15 s: it separates "works" from "broken"; the measured latency, from the producer's delivery
report to the consumer's receipt, is printed). Meanwhile ``kcompact compact --store S --force``
runs again and again: while the mirror holds the partitions it skips them, so the mirror is also
stopped (SIGTERM) between waves, the store force-compacted under the endpoint's readers (segments
swapped), and the mirror started again (it resumes where it was: nothing stored twice).

Against a model of what was produced (the source's offsets from the delivery reports): every
record the consumer receives is the one produced at its offset, offsets only grow, and at the end
the consumer has seen the latest record of every key (compaction may only have removed, before the consumer reached them, records that a later one of the same key
replaced). The store itself ends equal to the source's live state.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kcompact.reput import Store

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import KCOMPACT, Endpoint  # noqa: E402

pytestmark = pytest.mark.integration

#: what separates "works" from "broken": a wave's records reach the endpoint's consumer by then
DEADLINE_S = 15.0
PARTITIONS = 2


class Mirror:
    """``kcompact mirror --engine local --follow`` as a process."""

    def __init__(self, bootstrap: str, topic: str, store: str, log):
        self.args = [*KCOMPACT, "mirror", "--bootstrap-servers", bootstrap, "--topic", topic,
                     "--store", store, "--engine", "local", "--follow",
                     "-X", "topic.metadata.refresh.interval.ms=1000"]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc is None or self.proc.returncode in (0, -signal.SIGTERM), \
            self.proc.returncode


class Reader(threading.Thread):
    """A consumer of the endpoint for the whole test: every record it receives, when."""

    def __init__(self, bootstrap: str, topic: str):
        super().__init__(daemon=True)
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"live-{uuid.uuid4()}",
                           "enable.auto.commit": False, "fetch.wait.max.ms": 500,
                           "isolation.level": "read_committed"})
        self.c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.got: list[tuple[int, int, bytes | None, bytes | None, float]] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                for m in self.c.consume(500, 0.2):
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            self.errors.append(str(m.error()))
                        continue
                    self.got.append((m.partition(), m.offset(), m.key(), m.value(),
                                     time.monotonic()))
        finally:
            self.c.close()


def _compact_forever(url: str, stop: threading.Event, runs: list) -> None:
    """``kcompact compact --force`` again and again until ``stop``: what each run printed."""
    while not stop.is_set():
        r = subprocess.run([*KCOMPACT, "compact", "--store", url, "--force"],
                           capture_output=True, text=True, timeout=300)
        runs.append((r.returncode, r.stdout + r.stderr[-500:]))
        stop.wait(0.5)


def test_a_following_mirror_and_compactions_under_a_live_consumer(any_broker, make_topic,
                                                                   tmp_path):
    topic = make_topic(partitions=PARTITIONS, config={"cleanup.policy": "compact"})
    url = str(tmp_path / "store")
    log = open(tmp_path / "processes.log", "ab")
    producer = Producer({"bootstrap.servers": any_broker.bootstrap, "linger.ms": 5})
    model: dict[tuple[int, int], tuple[bytes | None, bytes | None, float]] = {}

    def produce(wave: int, n: int = 40) -> set[tuple[int, int]]:
        sent: set[tuple[int, int]] = set()

        def done(err, msg) -> None:
            assert err is None, err
            model[(msg.partition(), msg.offset())] = (msg.key(), msg.value(), time.monotonic())
            sent.add((msg.partition(), msg.offset()))

        for i in range(n):
            key = b"k%d" % (i % 7)  # (Kafka refuses keyless records in a compacted topic)
            value = None if i % 11 == 3 else b"w%d-%d" % (wave, i)
            producer.produce(topic, key=key, value=value, partition=i % PARTITIONS,
                             on_delivery=done)
        assert producer.flush(30) == 0
        return sent

    mirror = Mirror(any_broker.bootstrap, topic, url, log)
    produce(0)
    mirror.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(url, "store.json")):  # the mirror created it
        assert time.monotonic() < deadline, (tmp_path / "processes.log").read_text()[-3000:]
        time.sleep(0.2)
    ep = Endpoint(url, log=tmp_path / "endpoint.log").start()
    reader = Reader(ep.bootstrap, topic)
    reader.start()
    stop, runs = threading.Event(), []
    compactor = threading.Thread(target=_compact_forever, args=(url, stop, runs), daemon=True)
    compactor.start()
    latencies: list[float] = []
    try:
        for wave in range(1, 9):
            if wave in (3, 6):  # the mirror stopped: compact --force swaps segments for real
                mirror.stop()
                before = len(runs)
                deadline = time.monotonic() + 120
                while not any(rc == 0 and "kept" in out for rc, out in runs[before + 1:]):
                    assert time.monotonic() < deadline, runs[-3:]
                    time.sleep(0.2)
                mirror.start()
            sent = produce(wave)
            deadline = time.monotonic() + DEADLINE_S
            while True:
                seen = {(p, o): t for p, o, _k, _v, t in reader.got}
                if sent <= seen.keys() or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            missing = sent - seen.keys()
            assert not missing, (wave, sorted(missing)[:10], reader.errors,
                                 (tmp_path / "endpoint.log").read_text()[-2000:])
            if wave not in (3, 6):  # (those include the mirror's start)
                latencies += [seen[po] - model[po][2] for po in sent]
    finally:
        stop.set()
        reader.stop_event.set()
        reader.join(30)
        compactor.join(300)
        try:
            mirror.stop()  # (asserts how the mirror ended)
        finally:
            ep.stop()  # stopped whatever the mirror did: no endpoint left behind
            log.close()
    assert reader.errors == []
    compacted = [out for rc, out in runs if rc == 0 and "kept" in out]
    assert len(compacted) >= 2 and all(rc == 0 for rc, _ in runs), runs[-3:]
    # every record received is the one produced at its offset; offsets only grow
    last: dict[int, int] = {}
    for p, o, k, v, _t in reader.got:
        assert (p, o) in model and model[(p, o)][:2] == (k, v), (p, o, k, v)
        assert o > last.get(p, -1), (p, o, last.get(p))
        last[p] = o
    # the live records: the latest of each key
    latest: dict[tuple[int, bytes], int] = {}
    for (p, o), (k, _v, _t) in sorted(model.items()):
        latest[(p, k)] = o
    live = {(p, o) for (p, _k), o in latest.items()}
    received = {(p, o) for p, o, *_ in reader.got}
    assert live <= received, sorted(live - received)[:10]
    with Store.open(url) as st:  # and the store holds the source's live state at least
        stored = {(p, r.offset) for p in range(PARTITIONS) for r in st.iter_records(topic, p)}
    assert live <= stored and stored <= model.keys()
    print(f"\n[{any_broker.kind}] produce -> endpoint consumer latency over "
          f"{len(latencies)} records: median {statistics.median(latencies):.3f} s, "
          f"max {max(latencies):.3f} s; {len(compacted)} forced compactions swapped segments")
