"""The LevelDB sink connector run by `kcompact connect standalone` against a real broker.

The connector file is examples/leveldb-sink.properties with only ``topics``, ``kv.db`` and
``follow`` replaced, so the example stays runnable. The map must equal the dict model of every
record produced (latest value per key, tombstones delete, keyless records skipped and counted);
a second run resumes from the map's own offsets and applies each record exactly once; a
following run stops cleanly on SIGTERM with everything it consumed applied.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import Producer

from kcompact.connectors.framework.config import parse_properties
from kcompact.connectors.apps.kv import KVMap

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "leveldb-sink.properties"
PARTITIONS = 3


def kcompact_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kcompact", *args]


def produce(bootstrap: str, topic: str, n: int, seed: int) -> list[tuple]:
    """n records over 40 keys (each key in one partition): puts, tombstones, keyless, empty
    values. Returns (partition, offset, key, value) as the broker stored them."""
    rng = random.Random(seed)
    got: list[tuple] = []

    def on_delivery(err, msg):
        assert err is None, err
        got.append((msg.partition(), msg.offset(), msg.key(), msg.value()))

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for i in range(n):
        k = rng.randrange(40)
        kind = rng.choices(["put", "tomb", "keyless", "empty"], [80, 12, 4, 4])[0]
        key = None if kind == "keyless" else b"user-%02d" % k
        value = None if kind == "tomb" else b"" if kind == "empty" else b"v%d-%d-%d" % (k, seed, i)
        p.produce(topic, key=key, value=value, partition=k % PARTITIONS, on_delivery=on_delivery)
        if i % 200 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    return got


def model(records) -> dict[bytes, bytes]:
    out: dict[bytes, bytes | None] = {}
    for _p, _off, k, v in sorted(records, key=lambda r: (r[0], r[1])):
        if k is not None:
            out[k] = v
    return {k: v for k, v in out.items() if v is not None}


def next_offsets(records) -> dict[int, int]:
    out: dict[int, int] = {}
    for p, off, *_ in records:
        out[p] = max(out.get(p, 0), off + 1)
    return out


def write_files(tmp_path: Path, bootstrap: str, topic: str, db: Path, follow: bool
                ) -> tuple[Path, Path]:
    props = parse_properties(EXAMPLE.read_text(), where=str(EXAMPLE))
    assert props["connector.class"] == "LevelDBSinkConnector"  # the short name
    props.update({"topics": topic, "kv.db": str(db), "follow": str(follow).lower()})
    conn = tmp_path / "leveldb-sink.properties"
    conn.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={bootstrap}\noffset.flush.interval.ms=500\n"
                      "metrics.log.interval.ms=200\n")
    return worker, conn


def check_map(db: Path, records) -> None:
    with KVMap(db) as m:
        assert dict(m.items()) == model(records)
        assert len(m) == len(model(records))
        assert m.offsets() == next_offsets(records)
        st = m.stats()
        assert st["records"] == len(records), st          # each record applied exactly once
        assert st["keyless"] == sum(1 for r in records if r[2] is None), st
        m.verify()


def test_standalone_leveldb_sink_builds_resumes_and_follows(kafka_bootstrap, make_topic,
                                                            tmp_path):
    topic = make_topic(partitions=PARTITIONS)
    db = tmp_path / "users.kv"
    first = produce(kafka_bootstrap, topic, 1500, seed=1)
    worker, conn = write_files(tmp_path, kafka_bootstrap, topic, db, follow=False)

    proc = subprocess.run(kcompact_cmd("connect", "standalone", str(worker), str(conn)),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "users-kv: 1 task(s)" in proc.stderr
    check_map(db, first)

    # kv get reads what the connector wrote
    key = sorted(model(first))[0]
    got = subprocess.run(kcompact_cmd("kv", "get", "--db", str(db), key.decode(), "--json"),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout) == {"key": key.decode(), "found": True,
                                      "value": model(first)[key].decode()}

    # a second run starts at the map's offsets: only the new records are applied
    second = produce(kafka_bootstrap, topic, 700, seed=2)
    proc = subprocess.run(kcompact_cmd("connect", "standalone", str(worker), str(conn)),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_map(db, first + second)

    # follow=true: new records are applied as they arrive; SIGTERM stops after the batch
    worker, conn = write_files(tmp_path, kafka_bootstrap, topic, db, follow=True)
    log = tmp_path / "follow.stderr"
    with open(log, "w") as err:
        p = subprocess.Popen(kcompact_cmd("connect", "standalone", str(worker), str(conn)),
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    try:
        third = produce(kafka_bootstrap, topic, 600, seed=3)
        deadline = time.monotonic() + 90
        pattern = re.compile(r"users-kv\S*: (\d+) records .*lag (\d+),")
        while True:
            assert p.poll() is None, log.read_text()
            seen = [(int(a), int(b)) for a, b in pattern.findall(log.read_text())]
            if seen and seen[-1] == (len(third), 0):
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    check_map(db, first + second + third)
