"""`kcompact restore` and the store source connector against a real broker: the restored topic
equals the store (latest value per key per partition, headers, timestamps, partition numbers),
mode=all, a target with fewer partitions, --repartition with Kafka's murmur2 placement (checked
against librdkafka's own murmur2 partitioner), bad input, standalone properties, incremental
reruns, and SIGKILL at random moments followed by restarts.

On the embedded Tansu broker read_committed consumers also see aborted transactions
(BROKER_NOTES.md), so after a SIGKILL the records of the chunk that was cut are visible twice
there; against a real Kafka (KAFKA_BOOTSTRAP_SERVERS, or testcontainers' Kafka) the test demands no
duplicate at all."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from kcompact.connectors.errors import ConnectorsError
from kcompact.connectors.framework.native_kafka import NativeProducer
from kcompact.connectors.plugins.store_source import PROGRESS_TOPIC, default_partition
from kcompact.connectors.plugins.store_source.progress import StoreProgress
from kcompact.connectors.apps.restore import restore
from kcompact.reput import Store
from kcompact.reput.record import RecordBatch
from topics import read_topic, restore_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TS0 = 1_700_000_000_000
#: A slowed producer (tiny batches, one request in flight) so that signals land mid-restore.
SLOW = ("-X", "batch.num.messages=5", "-X", "linger.ms=0", "-X", "max.in.flight=1")

# -- helpers -------------------------------------------------------------------------------------


def build_store(url: str, partitions: int, n: int, *, seed: int = 1, keys: int = 50,
                first_offset: int = 0, own_keys: bool = False, headers: bool = True) -> None:
    """n records per partition: keys from a small set (so most are overwritten), tombstones,
    keyless records, empty values and keys, headers with repeats and null values (none when
    ``headers`` is False), gaps in the offsets. ``own_keys``: each partition has its own keys
    (as Kafka's partitioner makes)."""
    rng = random.Random(seed)
    with Store.open(url, writer="w", create=True) as st:
        for p in range(partitions):
            rows, off = [], first_offset
            for i in range(n):
                off += rng.choice((1, 1, 1, 2))
                r = rng.random()
                k = rng.randrange(keys)
                key = (None if r < 0.04 else b"" if r < 0.06 else
                       (b"p%d-k%d" % (p, k) if own_keys else b"k%d" % k))
                v = rng.random()
                value = (None if v < 0.08 else b"" if v < 0.12 else
                         rng.randbytes(rng.randrange(1, 60)))
                h = rng.random() if headers else 1.0
                hs = ((("a", b"1"), ("a", None), ("\u00fc", b"")) if h < 0.2 else
                      (("trace", b"%d" % i),) if h < 0.4 else ())
                rows.append((p, off, TS0 + off * 3, key, value, hs))
            st.append(RecordBatch.from_records("orders", rows))


def store_records(url: str) -> dict[int, list[tuple]]:
    with Store.open(url) as st:
        return {p: [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers))
                    for r in st.iter_records("orders", p)] for p in st.partitions("orders")}


def latest(rows: list[tuple]) -> list[tuple]:
    """The compacted view of one partition (a dict model, independent of the .bcq code)."""
    last = {}
    for r in rows:
        if r[2] is not None:
            last[r[2]] = r
    return sorted(r for r in last.values() if r[3] is not None)


def read_back(bootstrap: str, topic: str, partitions: int) -> dict[int, list[tuple]]:
    """partition -> [(timestamp, key, value, headers)] as a read_committed consumer sees it."""
    return read_topic(bootstrap, topic, partitions, offsets=False)


def as_topic(rows: list[tuple]) -> list[tuple]:
    return [(ts, k, v, h) for _, ts, k, v, h in rows]


def kcompact(*args: str, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def partition_count(bootstrap: str, topic: str) -> int | None:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})  # never auto-creates
    try:
        t = c.list_topics(topic=topic, timeout=10).topics.get(topic)
        return None if t is None or t.error is not None else len(t.partitions)
    finally:
        c.close()


@pytest.fixture
def new_topic(request):
    """Factory of unique topic names that do not exist yet (the restore creates them);
    deleted after the test (on ``any_broker`` when the test runs on both brokers)."""
    names: list[str] = []
    kafka_admin = request.getfixturevalue("any_broker" if "any_broker" in request.fixturenames
                                          else "kafka_admin")
    kafka_admin = getattr(kafka_admin, "admin", kafka_admin)

    def make() -> str:
        name = f"it-restore-{request.node.name[:30]}-{uuid.uuid4().hex[:8]}".replace("[", "-")
        name = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in name)
        names.append(name)
        return name

    yield make
    if names:
        for f in kafka_admin.delete_topics(names, operation_timeout=10).values():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - cleanup only
                pass


def _restore(bootstrap, url, target, **kw):
    return restore(bootstrap, str(url), "orders", target, out=io.StringIO(),
                   handle_signals=False, **kw)


# -- exactness -----------------------------------------------------------------------------------


@pytest.fixture
def sent_by_columns(monkeypatch) -> list[int]:
    """Records produced as columns (NativeProducer.produce_columns), counted per call."""
    counts: list[int] = []
    real = NativeProducer.produce_columns

    def produce(self, topic, partition, partitions, keys, values, timestamps, headers=None):
        counts.append(len(timestamps))
        return real(self, topic, partition, partitions, keys, values, timestamps, headers)
    monkeypatch.setattr(NativeProducer, "produce_columns", produce)
    return counts


@pytest.mark.parametrize("headers", [True, False], ids=["headers", "no-headers"])
def test_restore_equals_the_store(any_broker, new_topic, tmp_path, headers, sent_by_columns):
    """With headers (repeated names, null values, non-ASCII names) and without, whole blocks as
    columns on kcompact's own producer; on the session broker and on a real Apache Kafka."""
    kafka_bootstrap, on_tansu = any_broker.bootstrap, not any_broker.real_kafka
    url = str(tmp_path / "store")
    build_store(url, 3, 800, headers=headers)
    target = new_topic()
    res = _restore(kafka_bootstrap, url, target, chunk_records=40)
    want = {p: latest(rows) for p, rows in store_records(url).items()}
    assert res.records == sum(map(len, want.values())) and res.stats.chunks > 3
    assert res.stats.created_topic and partition_count(kafka_bootstrap, target) == 3
    if on_tansu:
        assert res.stats.transactional
    assert sum(sent_by_columns) == res.records  # headers included, from the store's encoding
    got = read_back(kafka_bootstrap, target, 3)
    assert got == {p: as_topic(rows) for p, rows in want.items()}
    # the progress is in the store's internal topic, written through its normal append path
    prog = StoreProgress(url, restore_job(kafka_bootstrap, url, target)).read()
    assert prog is not None and prog.done and prog.produced == res.records
    with Store.open(url) as st:
        assert prog.positions == {p: st.next_offset("orders", p) for p in range(3)}
        assert PROGRESS_TOPIC in st.topics()
    # a rerun finds nothing left to do
    again = _restore(kafka_bootstrap, url, target)
    assert again.records == 0 and again.stats.resumed
    assert read_back(kafka_bootstrap, target, 3) == got


def test_mode_all_is_every_stored_record(kafka_bootstrap, new_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 2, 500, seed=2)
    target = new_topic()
    res = _restore(kafka_bootstrap, url, target, mode="all", chunk_records=333)
    stored = store_records(url)
    assert res.records == sum(map(len, stored.values()))
    got = read_back(kafka_bootstrap, target, 2)
    assert got == {p: as_topic(rows) for p, rows in stored.items()}
    assert any(v is None for rows in got.values() for _, _, v, _ in rows)  # tombstones kept
    assert any(k is None for rows in got.values() for _, k, _, _ in rows)  # keyless kept


def test_idempotent_producer_without_transactions(kafka_bootstrap, new_topic, tmp_path,
                                                  sent_by_columns):
    url = str(tmp_path / "store")
    build_store(url, 2, 300, seed=3, headers=False)
    target = new_topic()
    res = _restore(kafka_bootstrap, url, target, exactly_once="disabled", chunk_records=100)
    assert not res.stats.transactional
    assert sum(sent_by_columns) == res.records
    want = {p: latest(rows) for p, rows in store_records(url).items()}
    assert read_back(kafka_bootstrap, target, 2) == {p: as_topic(r) for p, r in want.items()}


def test_rerun_after_the_store_grew_is_incremental(kafka_bootstrap, new_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 2, 1500, seed=4, keys=300)
    target = new_topic()
    first = _restore(kafka_bootstrap, url, target)
    before = store_records(url)
    # the mirror goes on: updates and deletes of existing keys, new keys
    build_store(url, 2, 40, seed=5, keys=400, first_offset=10_000)
    after = store_records(url)
    second = _restore(kafka_bootstrap, url, target)
    assert second.stats.resumed and 0 < second.records < first.records
    got = read_back(kafka_bootstrap, target, 2)
    for p in range(2):
        # the target's latest value per key (a tombstone deletes) equals the store's
        last = {}
        for _, k, v, _ in got[p]:
            last[k] = v
        assert {k: v for k, v in last.items() if v is not None} == \
            {r[2]: r[3] for r in latest(after[p])}
        # only the records after the first run's positions were produced again
        assert len(got[p]) == len(latest(before[p])) + sum(
            1 for k in {r[2] for r in after[p][len(before[p]):] if r[2] is not None})


# -- partitions ----------------------------------------------------------------------------------


def test_target_with_fewer_partitions_is_an_error(kafka_bootstrap, make_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 3, 50)
    target = make_topic(partitions=2)
    proc = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                    kafka_bootstrap, "--to-topic", target)
    assert proc.returncode == 1
    line = error_line(proc)
    assert "has 2 partition(s)" in line and "--repartition" in line
    assert read_back(kafka_bootstrap, target, 2) == {0: [], 1: []}


def test_repartition_places_keys_like_the_java_client(kafka_bootstrap, make_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 3, 300, seed=6, own_keys=True)
    target = make_topic(partitions=2)
    proc = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                    kafka_bootstrap, "--to-topic", target, "--repartition", "--mode", "all")
    assert proc.returncode == 0, proc.stderr
    got = read_back(kafka_bootstrap, target, 2)
    placed = {}
    keyless = 0
    for part, rows in got.items():
        for _, key, _, _ in rows:
            if key is None:
                keyless += 1
                continue
            assert part == default_partition(key, 2)
            placed[key] = part
    stored = store_records(url)
    assert keyless == sum(1 for rows in stored.values() for r in rows if r[2] is None)
    # librdkafka's murmur2_random partitioner is the Java client's default: same placement
    check = make_topic(partitions=2)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    for key in placed:
        p.produce(check, key=key, value=b"x")
    assert p.flush(30) == 0
    theirs = {key: part for part, rows in read_back(kafka_bootstrap, check, 2).items()
              for _, key, _, _ in rows}
    assert theirs == placed
    # the latest value per key survives the move (each key came from one store partition)
    last = {}
    for rows in got.values():
        for _, k, v, _ in rows:
            if k is not None:
                last[k] = v
    want = {}
    for rows in stored.values():
        for r in rows:
            if r[2] is not None:
                want[r[2]] = r[3]
    assert last == want


def test_repartition_without_headers_through_columns(kafka_bootstrap, make_topic, tmp_path,
                                                     sent_by_columns):
    """--repartition with blocks produced as columns (a partition per record)."""
    url = str(tmp_path / "store")
    build_store(url, 3, 300, seed=7, own_keys=True, headers=False)
    target = make_topic(partitions=2)
    res = _restore(kafka_bootstrap, url, target, repartition=True, mode="all")
    got = read_back(kafka_bootstrap, target, 2)
    stored = store_records(url)
    assert sum(map(len, got.values())) == res.records == sum(map(len, stored.values()))
    for part, rows in got.items():
        for _, key, _, _ in rows:
            assert key is None or part == default_partition(key, 2)
    want = sorted(as_topic([r for rows in stored.values() for r in rows]),
                  key=lambda r: (r[0], r[1] or b"", r[2] or b""))
    assert sorted((r for rows in got.values() for r in rows),
                  key=lambda r: (r[0], r[1] or b"", r[2] or b"")) == want
    if res.stats.transactional:
        assert sum(sent_by_columns) == res.records


def test_record_larger_than_the_producer_limit(kafka_bootstrap, new_topic, tmp_path):
    """A record librdkafka refuses (message.max.bytes) stops the restore with the reason, and the progress does not move past it."""
    url = str(tmp_path / "store")
    with Store.open(url, writer="w", create=True) as st:
        st.append(RecordBatch.from_records("orders", [
            (0, 0, TS0, b"small", b"v", ()), (0, 1, TS0, b"big", b"x" * 5000, ())]))
    target = new_topic()
    with pytest.raises(ConnectorsError, match="(?i)too large"):
        _restore(kafka_bootstrap, url, target, kafka_config={"message.max.bytes": "2000"})
    prog = StoreProgress(url, restore_job(kafka_bootstrap, url, target)).read()
    assert prog is None or not prog.done


# -- bad input -----------------------------------------------------------------------------------


def test_cli_unreachable_broker(closed_port, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 1, 10)
    t = time.monotonic()
    proc = kcompact("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
                    f"127.0.0.1:{closed_port}", "--to-topic", "x")
    assert proc.returncode == 1 and time.monotonic() - t < 60
    assert f"cannot reach Kafka at 127.0.0.1:{closed_port}" in error_line(proc)


def test_cli_missing_store_topic_and_store(kafka_bootstrap, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 1, 10)
    proc = kcompact("restore", "--store", url, "--topic", "nope", "--bootstrap-servers",
                    kafka_bootstrap, "--to-topic", "x")
    assert proc.returncode == 1
    assert "topic 'nope' is not in store" in error_line(proc) and "orders" in error_line(proc)
    proc = kcompact("restore", "--store", str(tmp_path / "missing"), "--topic", "orders",
                    "--bootstrap-servers", kafka_bootstrap, "--to-topic", "x")
    assert proc.returncode == 1 and "not a kcompact store" in error_line(proc)
    assert partition_count(kafka_bootstrap, "x") is None  # nothing was created
    proc = kcompact("restore", "--store", url, "--topic", "orders")
    assert proc.returncode == 2  # usage


def test_cli_mode_change_needs_from_scratch(kafka_bootstrap, new_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 1, 50)
    target = new_topic()
    args = ("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
            kafka_bootstrap, "--to-topic", target)
    assert kcompact(*args).returncode == 0
    proc = kcompact(*args, "--mode", "all")
    assert proc.returncode == 1 and "--from-scratch" in error_line(proc)
    proc = kcompact(*args, "--mode", "all", "--from-scratch")
    assert proc.returncode == 0, proc.stderr
    assert "50 of 50 records" in proc.stderr


def test_standalone_properties(kafka_bootstrap, new_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 2, 200, seed=7)
    target = new_topic()
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={kafka_bootstrap}\nmetrics.log.interval.ms=0\n")
    conn = tmp_path / "store-source.properties"
    conn.write_text("name=orders-restore\nconnector.class=StoreSourceConnector\n"
                    f"store.url={url}\nstore.topic=orders\ntopic={target}\n"
                    "restore.chunk.records=100\n")
    proc = kcompact("connect", "standalone", str(worker), str(conn))
    assert proc.returncode == 0, proc.stderr
    want = {p: latest(rows) for p, rows in store_records(url).items()}
    assert read_back(kafka_bootstrap, target, 2) == {p: as_topic(r) for p, r in want.items()}


# -- SIGKILL -------------------------------------------------------------------------------------


def _committed_part(offsets: list[int]) -> tuple[list[int], int, int]:
    """Undo re-produced chunks: when a restart goes back (an offset at or below one already
    seen), what came after the place it goes back to was an aborted attempt. Returns (the
    sequence without those, records dropped, times it went back)."""
    out: list[int] = []
    dropped = rewinds = 0
    for o in offsets:
        if out and out[-1] >= o:
            rewinds += 1
        while out and out[-1] >= o:
            out.pop()
            dropped += 1
        out.append(o)
    return out, dropped, rewinds


def test_sigkill_at_random_moments_then_restart(any_broker, new_topic, tmp_path):
    """Against a real Kafka with ``--exactly-once required``: a read_committed consumer of the
    target sees every live key exactly once, in store order."""
    kafka_bootstrap, on_tansu = any_broker.bootstrap, not any_broker.real_kafka
    url = str(tmp_path / "store")
    # ~90k live records: a whole run takes several seconds even on a fast machine, so each of
    # the three runs below is killed part-way
    build_store(url, 4, 25_000, seed=8, keys=200_000)
    target = new_topic()
    chunk = 2000
    args = ("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
            kafka_bootstrap, "--to-topic", target, "--chunk-records", str(chunk), *SLOW,
            *(("--exactly-once", "required") if not on_tansu else ()))
    job = restore_job(kafka_bootstrap, url, target)

    def seq() -> int:
        prog = StoreProgress(url, job).read()
        return prog.seq if prog else 0

    rng = random.Random(11)
    kills = 0
    for _ in range(3):
        # kill at a random moment after this run has committed a chunk of its own
        before = seq()
        p = subprocess.Popen([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while seq() <= before and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.05, 0.8))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait(60)
    assert kills == 3
    final = kcompact(*args, timeout=600)
    assert final.returncode == 0, final.stderr
    want = {p: latest(rows) for p, rows in store_records(url).items()}
    total = sum(map(len, want.values()))
    done = [ln for ln in final.stderr.splitlines() if ln.startswith("restore: done:")][-1]
    planned = int(done.split(" of ")[1].split(" ")[0].replace(",", ""))
    # the last run continued from the recorded progress instead of starting over
    assert "continued from recorded progress" in done and 0 < planned < total
    got = read_back(kafka_bootstrap, target, 4)
    for p in range(4):
        by_key = {r[2]: r for r in want[p]}
        last = {}
        for _, k, v, _ in got[p]:
            last[k] = v
        # the target's latest value per key equals the store's (tombstones re-published by a
        # resumed run delete keys the store deleted)
        assert {k: v for k, v in last.items() if v is not None} == \
            {k: r[3] for k, r in by_key.items()}
        live = [(ts, k, v, h) for ts, k, v, h in got[p] if v is not None]
        offsets = [by_key[k][0] for _, k, _, _ in live]
        assert all(by_key[k][1:] == (ts, k, v, h) for ts, k, v, h in live)
        if on_tansu:
            # aborted chunks stay visible on Tansu: at most one cut chunk per kill
            committed, dropped, rewinds = _committed_part(offsets)
            print(f"partition {p}: {len(offsets)} live records read, {rewinds} rewinds, "
                  f"{dropped} aborted duplicates; kills {kills}; last run planned {planned} "
                  f"of {total}")
            assert rewinds <= kills and dropped <= kills * -(-chunk // 4)  # a chunk's share
        else:
            committed = offsets
        assert committed == [r[0] for r in want[p]]  # once each, in store order


def test_sigterm_stops_after_the_chunk_and_a_rerun_continues(kafka_bootstrap, new_topic,
                                                             tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 2, 30_000, seed=9, keys=25_000)
    target = new_topic()
    args = ("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
            kafka_bootstrap, "--to-topic", target, "--chunk-records", "2000", *SLOW)
    job = restore_job(kafka_bootstrap, url, target)
    p = subprocess.Popen([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while StoreProgress(url, job).read() is None and time.monotonic() < deadline:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "stopped by SIGTERM" in err
    stopped = StoreProgress(url, job).read()
    assert stopped is not None and not stopped.done
    final = kcompact(*args)
    assert final.returncode == 0 and "continued from recorded progress" in final.stderr
    want = {}
    for p, rows in store_records(url).items():
        pos = stopped.positions.get(p, 0)
        last = {}
        for r in rows:
            if r[2] is not None:
                last[r[2]] = r
        # before the stop: the live latest records; after it (a resumed run): tombstones too
        want[p] = sorted(r for r in last.values() if r[3] is not None or r[0] >= pos)
    # a clean stop commits its chunk: every record exactly once, on Tansu too
    assert read_back(kafka_bootstrap, target, 2) == {p: as_topic(r) for p, r in want.items()}


def test_second_run_of_the_same_job_is_refused(kafka_bootstrap, new_topic, tmp_path):
    url = str(tmp_path / "store")
    build_store(url, 2, 40_000, seed=10, keys=30_000)
    target = new_topic()
    args = ("restore", "--store", url, "--topic", "orders", "--bootstrap-servers",
            kafka_bootstrap, "--to-topic", target, "--chunk-records", "2000", *SLOW)
    job = restore_job(kafka_bootstrap, url, target)
    first = subprocess.Popen([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while StoreProgress(url, job).read() is None and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.05)
        second = kcompact(*args)
        assert second.returncode == 1
        assert "another restore of orders->" in error_line(second)
        assert first.poll() is None  # not fenced: the second one produced nothing
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0
