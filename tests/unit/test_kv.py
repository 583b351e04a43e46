"""The key-value map (connectors/apps/kv/, connectors/plugins/leveldb_sink.py) against a dict
model.

The model of a topic's map: within a partition the record with the highest offset is a key's
latest (Kafka semantics); a key whose latest is a tombstone is absent; keyless records never
enter. A key found in several partitions (a producer bug) takes the latest record of the partition
with the highest (timestamp, partition) - what the bulk build documents. Catch-up and follow apply
records partition by partition, so their tests keep each key in one partition, as Kafka's
partitioner does.

Exactly-once is checked through the ``records`` counter, which every batch adds to in the same
WriteBatch as its data: a lost or re-applied batch would show as a wrong count.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import plyvel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.compaction import Compactor
from kcompact.connectors import cli
from kcompact.connectors.apps.kv import (KVCorruptionError, KVError, KVLockedError, KVMap,
                                         KVNotFoundError, KVSourceMismatchError, MapBuilder,
                                         build_map)
from kcompact.connectors.devtools.demo import kv_demo_step
from kcompact.connectors.plugins.leveldb_sink import LevelDBSink, open_db
from kcompact.reput import RecordBatch, Store, WriterOptions

sys.path.insert(0, os.path.dirname(__file__))
from _stores import (BACKENDS, backend, backend_env, shared_store_at,  # noqa: E402,F401
                     store_at, store_url)

TOPIC = "kv.t"
PROC = str(Path(__file__).with_name("_kv_proc.py"))
HYP = settings(max_examples=25, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# helpers


def model(records) -> dict[bytes, bytes]:
    latest: dict[tuple[int, bytes], tuple[int, int, bytes | None]] = {}
    for p, off, ts, k, v in records:
        if k is None:
            continue
        cur = latest.get((p, k))
        if cur is None or off > cur[0]:
            latest[(p, k)] = (off, ts, v)
    best: dict[bytes, tuple[int, int, bytes | None]] = {}
    for (p, k), (_off, ts, v) in latest.items():
        b = best.get(k)
        if b is None or (ts, p) > (b[0], b[1]):
            best[k] = (ts, p, v)
    return {k: v for k, (_ts, _p, v) in best.items() if v is not None}


def gen_records(n: int, *, partitions: int = 3, keys: int = 50, seed: int = 1,
                start: dict[int, int] | None = None, disjoint: bool = True,
                value_size: int = 40):
    """Deterministic records (tombstones, re-created keys, keyless, empty values, offset gaps)."""
    rng = random.Random(seed)
    nxt = dict(start or {})
    out = []
    for i in range(n):
        p = rng.randrange(partitions)
        off = nxt.get(p, 0)
        nxt[p] = off + 1 + (rng.randrange(3) if rng.random() < 0.1 else 0)
        x = rng.random()
        k = rng.randrange(keys)
        key = None if x < 0.05 else (b"p%d-k%05d" % (p, k) if disjoint else b"k%05d" % k)
        value = None if 0.05 <= x < 0.2 else b"" if x < 0.23 else \
            (b"v%d-" % i) + rng.randbytes(value_size)
        out.append((p, off, 1_700_000_000_000 + rng.randrange(1000), key, value))
    return out


def write_store(path, records, *, segment_bytes: int = 16384, writer: str = "w",
                topic: str = TOPIC, config: dict | None = None) -> None:
    with Store.open(str(path), writer=writer, create=True,
                    options=WriterOptions(fsync="never")) as st:
        if topic not in st.meta.topics:
            st.set_topic_config(topic, {"segment.bytes": segment_bytes, **(config or {})})
        append(st, records, topic=topic)
        st.flush()


def append(st: Store, records, topic: str = TOPIC, chunk: int = 500) -> None:
    by_part: dict[int, list] = {}
    for r in records:
        by_part.setdefault(r[0], []).append(r)
    for rows in by_part.values():
        for i in range(0, len(rows), chunk):
            st.append(RecordBatch.from_records(topic, rows[i:i + chunk]))


def store_entries(path, topic: str = TOPIC) -> int:
    with Store.open(str(path)) as st:
        return sum(st.partition(topic, p).record_count() for p in st.partitions(topic))


def next_offsets(path, topic: str = TOPIC) -> dict[int, int]:
    with Store.open(str(path)) as st:
        return {p: st.next_offset(topic, p) for p in st.partitions(topic)}


def compact_all(path, topic: str = TOPIC, writer: str = "w") -> None:
    with Store.open(str(path), writer=writer) as st:
        c = Compactor(st)
        for p in st.partitions(topic):
            c.compact_partition(topic, p, force=True)


def map_contents(db) -> dict[bytes, bytes]:
    with KVMap(db) as m:
        return dict(m.items())


def check_map(db, expected: dict[bytes, bytes]) -> None:
    with KVMap(db) as m:
        got = dict(m.items())
        assert got == expected
        assert len(m) == len(expected)
        assert not m.building
        assert m.verify() == {"keys": len(expected)}
        for k, v in list(expected.items())[:50]:
            assert m.get(k) == v and k in m


workload = st.lists(
    st.tuples(st.integers(0, 2),                                   # partition
              st.integers(0, 12),                                  # key id
              st.sampled_from(["put", "put", "put", "tomb", "keyless", "empty"]),
              st.integers(0, 4),                                   # timestamp
              st.integers(0, 2)),                                  # offset gap
    max_size=250)


def to_records(ops, *, disjoint: bool):
    nxt: dict[int, int] = {}
    out = []
    for i, (p, k, kind, ts, gap) in enumerate(ops):
        off = nxt.get(p, 0) + (gap if gap == 2 else 0)
        nxt[p] = off + 1
        key = None if kind == "keyless" else (b"p%d-%d" % (p, k) if disjoint else b"%d" % k)
        value = None if kind == "tomb" else b"" if kind == "empty" else b"v%d" % i * (1 + i % 7)
        out.append((p, off, ts, key, value))
    return out


# ---------------------------------------------------------------------------------------------
# bulk build against the model


@pytest.mark.parametrize("kind", BACKENDS)
@HYP
@given(ops=workload, compact=st.booleans(), purge=st.booleans())
def test_bulk_build_equals_model(kind, ops, compact, purge):
    # Keys shared across partitions on purpose - except when tombstones are purged: a purged
    # tombstone no longer outranks another partition's older value (as in Kafka, where
    # consumers of such a topic disagree too), so the model would not hold.
    recs = to_records(ops, disjoint=compact and purge)
    with tempfile.TemporaryDirectory() as d, backend_env(kind, d):
        store, db = store_url(kind, d, "store"), os.path.join(d, "db")
        write_store(store, recs, config={"delete.retention.ms": 0} if purge else None)
        if compact:
            compact_all(store)
        entries = store_entries(store)
        rep = build_map(db, store, TOPIC)
        assert rep["mode"] == "bulk"
        check_map(db, model(recs))
        with KVMap(db) as m:
            assert m.offsets() == next_offsets(store)
            s = m.stats()
            assert s["records"] == entries
            if not compact:
                assert s["keyless"] == sum(1 for r in recs if r[3] is None)
            assert m.source["topic"] == TOPIC


@pytest.mark.parametrize("kind", BACKENDS)
@HYP
@given(ops=workload, split=st.floats(0, 1), compact=st.booleans())
def test_catch_up_after_more_appends_equals_model(kind, ops, split, compact):
    recs = to_records(ops, disjoint=True)
    cut = int(len(recs) * split)
    with tempfile.TemporaryDirectory() as d, backend_env(kind, d):
        store, db = store_url(kind, d, "store"), os.path.join(d, "db")
        write_store(store, recs[:cut])
        build_map(db, store, TOPIC)
        check_map(db, model(recs[:cut]))
        write_store(store, recs[cut:])
        if compact:
            compact_all(store)
        rep = build_map(db, store, TOPIC)
        # a map of a topic that had no partition yet holds no offsets: it is built in bulk
        assert rep["mode"] == ("catch-up" if next_offsets_of(recs[:cut]) else "bulk")
        check_map(db, model(recs))
        with KVMap(db) as m:
            assert m.offsets() == next_offsets(store)
            if not compact:
                # every record counted once: no batch lost or applied twice
                assert m.stats()["records"] == len(recs)
                assert m.stats()["keyless"] == sum(1 for r in recs if r[3] is None)


def test_large_build_several_runs_and_batches(tmp_path, store_at):
    recs = gen_records(30_000, partitions=4, keys=3000, value_size=60)
    write_store(store_at("store"), recs)
    # a tiny memory budget: several sorted runs, many batches
    build_map(tmp_path / "db", store_at("store"), TOPIC, memory=64 << 10,
              batch_bytes=16 << 10)
    check_map(tmp_path / "db", model(recs))
    with KVMap(tmp_path / "db") as m:
        assert list(m.keys()) == sorted(model(recs))


def test_winners_compacted_away_during_the_build_are_caught_up(tmp_path, monkeypatch):
    """The winners are picked from the index; before their records are read, newer records of
    their keys are appended and a compaction drops them: the bulk build counts them missing and
    the catch-up from the store applies the newer ones (the map is the model of everything)."""
    store = tmp_path / "store"
    recs = gen_records(6000, partitions=2, keys=400, value_size=60)
    write_store(store, recs)
    more = gen_records(3000, partitions=2, keys=400, seed=9, start=next_offsets(store),
                       value_size=60)
    real = MapBuilder._winners

    def winners_then_compaction(self, st, ends):
        got = real(self, st, ends)
        with Store.open(str(store), writer="w2") as w:
            append(w, more)
            w.flush()
            c = Compactor(w)
            for p in w.partitions(TOPIC):
                c.compact_partition(TOPIC, p, force=True)
        return got
    monkeypatch.setattr(MapBuilder, "_winners", winners_then_compaction)
    from kcompact.connectors.apps.kv import build as kv_build
    monkeypatch.setattr(kv_build, "READ_BYTES", 1024)  # small reads: some find no winner left
    notes = []
    build_map(tmp_path / "db", str(store), TOPIC, progress=notes.append)
    assert any("compacted away meanwhile" in n for n in notes)
    check_map(tmp_path / "db", model(recs + more))


def test_the_winners_table_is_sized_for_a_format_2_partitions_records(tmp_path, monkeypatch):
    """A compacted (format-2) partition's records, not its lean index's bytes / 48, size the
    winners table: it is never grown (rehashed) while the index is read."""
    store = tmp_path / "store"
    recs = gen_records(6000, partitions=1, keys=3000, value_size=60)
    write_store(store, recs)
    with Store.open(str(store), writer="c") as w:
        Compactor(w).compact_partition(TOPIC, 0, force=True)
        pl = w.partition(TOPIC, 0)
        assert any(s.format == 2 for s in pl.segments)
        assert sum(s.entry_count for s in pl.segments) < pl.record_count()
    from kcompact.connectors.apps.kv import kernels as KK
    grown = []
    real = KK.DigestTable.reserve

    def reserve(self, more):
        before = self.capacity
        real(self, more)
        if self.capacity != before:
            grown.append((before, self.capacity))
    monkeypatch.setattr(KK.DigestTable, "reserve", reserve)
    build_map(tmp_path / "db", str(store), TOPIC)
    assert grown == []
    check_map(tmp_path / "db", model(recs))


def test_cross_partition_key_is_resolved_by_timestamp_then_partition(tmp_path, store_at):
    recs = [(0, 0, 100, b"a", b"p0-old-ts"), (1, 0, 50, b"a", b"p1"),
            (0, 1, 10, b"a", b"p0-latest"),        # latest of p0 despite its older timestamp
            (0, 2, 7, b"b", b"p0"), (2, 0, 7, b"b", b"p2"),   # same timestamp: higher partition
            (1, 1, 9, b"c", b"p1"), (2, 1, 9, b"c", None)]    # the winner is a tombstone
    write_store(store_at("store"), recs)
    build_map(tmp_path / "db", store_at("store"), TOPIC)
    assert map_contents(tmp_path / "db") == {b"a": b"p1", b"b": b"p2"} == model(recs)
    with KVMap(tmp_path / "db") as m:
        assert m.stats()["conflicts"] == 3


def test_empty_value_is_a_value_and_keyless_records_are_counted(tmp_path, store_at):
    recs = [(0, 0, 1, b"e", b""), (0, 1, 1, None, b"x"), (0, 2, 1, None, None),
            (0, 3, 1, b"t", b"1"), (0, 4, 1, b"t", None)]
    write_store(store_at("store"), recs)
    build_map(tmp_path / "db", store_at("store"), TOPIC)
    with KVMap(tmp_path / "db") as m:
        assert m.get(b"e") == b"" and b"e" in m and b"t" not in m and m.get(b"t") is None
        assert m.get("e") == b""   # str keys are UTF-8
        assert len(m) == 1
        assert m.stats()["keyless"] == 2 and m.stats()["records"] == 5
        with pytest.raises(KeyError):
            m[b"t"]


def test_topic_with_no_records(tmp_path, store_at):
    write_store(store_at("store"), [(0, 0, 1, None, b"only keyless")])
    rep = build_map(tmp_path / "db", store_at("store"), TOPIC)
    assert rep["keys"] == 0
    with KVMap(tmp_path / "db") as m:
        assert len(m) == 0 and list(m.items()) == [] and m.offsets() == {0: 1}


# ---------------------------------------------------------------------------------------------
# read API


@HYP
@given(ops=workload, lo=st.binary(max_size=3), hi=st.binary(max_size=3),
       prefix=st.sampled_from([b"", b"1", b"p0", b"p1-1", b"\xff", b"p2-"]))
def test_items_prefix_and_range_scans_match_the_model(ops, lo, hi, prefix):
    recs = to_records(ops, disjoint=True)
    expected = model(recs)
    with tempfile.TemporaryDirectory() as d:
        write_store(os.path.join(d, "s"), recs)
        build_map(os.path.join(d, "db"), os.path.join(d, "s"), TOPIC)
        with KVMap(os.path.join(d, "db")) as m:
            want = sorted((k, v) for k, v in expected.items() if lo <= k < hi)
            assert list(m.items(start=lo, stop=hi)) == want
            want = sorted((k, v) for k, v in expected.items() if k.startswith(prefix))
            assert list(m.items(prefix=prefix)) == want
            assert list(m.items(prefix=prefix, reverse=True)) == want[::-1]
            want = sorted(k for k in expected if k.startswith(prefix) and k >= lo)
            assert list(m.keys(prefix=prefix, start=lo)) == want
            assert list(m.items(start=lo)) == sorted((k, v) for k, v in expected.items()
                                                     if k >= lo)


def test_snapshot_reads_are_isolated_from_later_updates(tmp_path):
    recs = gen_records(2000, keys=100)
    more = gen_records(2000, keys=100, seed=2, start=next_offsets_of(recs))
    write_store(tmp_path / "s", recs)
    with KVMap(tmp_path / "db", create=True) as m:
        f = m.follow(str(tmp_path / "s"), TOPIC, poll_interval=0.01)
        assert f.wait_caught_up(60)
        snap = m.snapshot()
        before = dict(snap.items()), len(snap), snap.offsets()
        write_store(tmp_path / "s", more)
        wait_until(lambda: m.offsets() == next_offsets(tmp_path / "s"))
        assert dict(m.items()) == model(recs + more)
        assert (dict(snap.items()), len(snap), snap.offsets()) == before
        assert dict(snap.items()) == model(recs)
        k = next(iter(model(recs)))
        assert snap.get(k) == model(recs)[k]
        snap.close()
        f.stop()


def next_offsets_of(recs) -> dict[int, int]:
    out: dict[int, int] = {}
    for p, off, *_ in recs:
        out[p] = max(out.get(p, 0), off + 1)
    return out


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# follow from the store


def test_follow_store_through_appends_and_compaction(tmp_path, store_at):
    store = store_at("s")
    a = gen_records(3000, keys=200, seed=1)
    b = gen_records(3000, keys=200, seed=2, start=next_offsets_of(a))
    c = gen_records(3000, keys=200, seed=3, start=next_offsets_of(a + b))
    write_store(store, a)
    with KVMap(tmp_path / "db", create=True) as m:
        f = m.follow(store, TOPIC, poll_interval=0.01)
        assert f.wait_caught_up(60)
        assert dict(m.items()) == model(a)
        with Store.open(store, writer="w", options=WriterOptions(fsync="never")) as st:
            append(st, b, chunk=97)
            st.flush()
            c_ = Compactor(st)
            for p in st.partitions(TOPIC):          # compaction while the map follows
                c_.compact_partition(TOPIC, p, force=True)
            append(st, c, chunk=113)
            st.flush()
        wait_until(lambda: m.offsets() == next_offsets(store))
        assert dict(m.items()) == model(a + b + c)
        assert len(m) == len(model(a + b + c))
        f.stop()
    check_map(tmp_path / "db", model(a + b + c))


def test_interrupted_bulk_build_resumes_exactly(tmp_path, monkeypatch, store_at):
    recs = gen_records(20_000, partitions=2, keys=4000)
    write_store(store_at("s"), recs)
    stop = threading.Event()
    calls = {"n": 0}
    orig = LevelDBSink.prepare_puts

    def counting(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            stop.set()
        return orig(self, *a, **kw)

    monkeypatch.setattr(LevelDBSink, "prepare_puts", counting)
    rep = MapBuilder(tmp_path / "db", store_at("s"), TOPIC,
                     batch_bytes=8 << 10).run(stop=stop)
    assert rep["interrupted"]
    with KVMap(tmp_path / "db") as m:
        assert m.building and 0 < sum(1 for _ in m.keys()) < len(model(recs))
        assert len(m) == 0   # count and offsets are committed with the build's last batch
        assert m.offsets() == {}
        assert m.stats()["records"] == 0          # counted once, when the build completes
    monkeypatch.setattr(LevelDBSink, "prepare_puts", orig)
    rep = build_map(tmp_path / "db", store_at("s"), TOPIC)
    assert rep["mode"] == "resume"
    check_map(tmp_path / "db", model(recs))
    with KVMap(tmp_path / "db") as m:
        assert m.stats()["records"] == len(recs)


# ---------------------------------------------------------------------------------------------
# SIGKILL


def _start(store, db, mode, batch, log: Path) -> subprocess.Popen:
    f = open(log, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, PROC, str(store), TOPIC, str(db), mode, str(batch)],
                            stdout=f, stderr=subprocess.STDOUT, env=env)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        if proc.poll() is not None:
            return text in log.read_text()
        time.sleep(0.005)
    raise AssertionError(f"{text!r} not seen: {log.read_text()[-2000:]}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_during_bulk_build_then_resume_gives_the_model(tmp_path):
    recs = gen_records(60_000, partitions=3, keys=20_000, value_size=80)
    store, db = tmp_path / "s", tmp_path / "db"
    write_store(store, recs)
    rng = random.Random(7)
    mid_build, span, trial = 0, 0.4, 0
    while trial < 4 or (mid_build == 0 and trial < 12):
        log = tmp_path / f"build{trial}.log"
        proc = _start(store, db, "build", 8 << 10, log)
        _wait_for(log, "indexed", proc)          # the write phase starts now
        time.sleep(rng.uniform(0.0, span))
        _kill(proc)
        with KVMap(db) as m:
            mid_build += m.building
        if mid_build == 0:
            # this machine finished the build before the kill: start again from no map and
            # kill sooner, so that at least one kill lands inside the bulk build
            shutil.rmtree(db)
            span /= 2
        trial += 1
    build_map(db, str(store), TOPIC)
    check_map(db, model(recs))
    with KVMap(db) as m:
        assert m.stats()["records"] == len(recs)
        assert m.offsets() == next_offsets(store)
    assert mid_build >= 1, "no kill landed inside the bulk build"


def test_sigkill_during_follow_then_resume_gives_the_model(tmp_path, shared_store_at):
    store, db = shared_store_at("s"), tmp_path / "db"
    first = gen_records(5000, keys=500, seed=1)
    write_store(store, first)
    build_map(db, str(store), TOPIC)
    all_recs = list(first)
    rng = random.Random(11)
    with Store.open(str(store), writer="w", options=WriterOptions(fsync="never")) as st:
        for trial in range(4):
            log = tmp_path / f"follow{trial}.log"
            proc = _start(store, db, "follow", 4 << 10, log)
            _wait_for(log, "following", proc)
            more = gen_records(4000, keys=500, seed=100 + trial, start=next_offsets_of(all_recs))
            all_recs += more
            deadline = time.monotonic() + rng.uniform(0.05, 0.6)
            for i in range(0, len(more), 200):   # appends while the follower applies them
                append(st, more[i:i + 200], chunk=200)
                st.flush()
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            _kill(proc)
            append(st, more[i + 200:], chunk=300)
            st.flush()
    rep = build_map(db, str(store), TOPIC)
    assert rep["mode"] == "catch-up"
    check_map(db, model(all_recs))
    with KVMap(db) as m:
        assert m.stats()["records"] == len(all_recs)
        assert m.stats()["keyless"] == sum(1 for r in all_recs if r[3] is None)


# ---------------------------------------------------------------------------------------------
# refusing to mix, corruption, locks


def test_a_map_refuses_another_store_or_topic(tmp_path, capsys):
    write_store(tmp_path / "a", gen_records(100))
    write_store(tmp_path / "b", gen_records(100))       # same topic, another store id
    write_store(tmp_path / "b", gen_records(10), topic="other")
    build_map(tmp_path / "db", str(tmp_path / "a"), TOPIC)
    before = map_contents(tmp_path / "db")
    with pytest.raises(KVSourceMismatchError, match="will not mix"):
        build_map(tmp_path / "db", str(tmp_path / "b"), TOPIC)
    with pytest.raises(KVSourceMismatchError, match="topic 'other'"):
        build_map(tmp_path / "db", str(tmp_path / "a"), "other")
    assert cli.main(["kv", "build", "--store", str(tmp_path / "b"), "--topic", "other",
                     "--db", str(tmp_path / "db")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "will not mix" in err[0] and "another --db" in err[0]
    assert map_contents(tmp_path / "db") == before


def test_a_map_refuses_another_kafka_cluster(tmp_path):
    db = open_db(str(tmp_path / "db"), create=True)
    sink = LevelDBSink(db, str(tmp_path / "db"))
    sink.bind("other", store_id="S0")       # an empty map takes any source
    sink.bind("t", store_id="S1")
    sink.bind("t", cluster_id="C1")
    sink.bind("t", store_id="S1", cluster_id="C1")
    assert sink.source["store_id"] == "S1" and sink.source["kafka_cluster_id"] == "C1"
    sink.apply([b"k"], [b"v"], {0: 1})       # from now on it holds records of that source
    with pytest.raises(KVSourceMismatchError, match="Kafka cluster C2"):
        sink.bind("t", cluster_id="C2")
    with pytest.raises(KVSourceMismatchError, match="store S2"):
        sink.bind("t", store_id="S2")
    db.close()


def test_not_a_map_directory_is_refused(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    write_store(tmp_path / "s", gen_records(10))
    with pytest.raises(KVError, match="not a LevelDB database"):
        build_map(tmp_path / "junk", str(tmp_path / "s"), TOPIC)
    assert os.listdir(tmp_path / "junk") == ["notes.txt"]
    with pytest.raises(KVNotFoundError, match="kv build"):
        KVMap(tmp_path / "nothing")
    other = plyvel.DB(str(tmp_path / "plain"), create_if_missing=True)
    other.put(b"x", b"y")
    other.close()
    with pytest.raises(KVError, match="not a kcompact key-value map"):
        KVMap(tmp_path / "plain")


def test_second_open_is_reported_as_locked(tmp_path):
    write_store(tmp_path / "s", gen_records(10))
    build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)
    with KVMap(tmp_path / "db"):
        with pytest.raises(KVLockedError, match="another process"):
            KVMap(tmp_path / "db")


def _flip(path: str, at: int, n: int = 16) -> None:
    b = bytearray(Path(path).read_bytes())
    assert len(b) > at + n, (path, len(b))
    for i in range(at, at + n):
        b[i] ^= 0x5A
    Path(path).write_bytes(bytes(b))


def _db_files(d: Path) -> dict[str, bytes]:
    """The database's own files and their bytes (LevelDB's info LOG rotates on every open)."""
    return {n: (d / n).read_bytes() for n in os.listdir(d) if n not in ("LOG", "LOG.old", "LOCK")}


def test_corrupt_log_file_is_reported_not_rebuilt(tmp_path, capsys):
    first = gen_records(500, keys=1000)
    write_store(tmp_path / "s", first)
    build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)   # a bulk build ends in tables
    write_store(tmp_path / "s", gen_records(3000, keys=1000, start=next_offsets_of(first)))
    build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)   # catch-up batches: in the log
    logs = [p for p in glob.glob(str(tmp_path / "db" / "*.log")) if os.path.getsize(p) > 4096]
    assert logs, os.listdir(tmp_path / "db")
    _flip(logs[0], os.path.getsize(logs[0]) // 2)
    files = _db_files(tmp_path / "db")
    with pytest.raises(KVCorruptionError, match="corrupt"):
        KVMap(tmp_path / "db")
    with pytest.raises(KVCorruptionError):
        build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)
    assert cli.main(["kv", "get", "--db", str(tmp_path / "db"), "p0-k00001"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt" in err[0] and "kv build" in err[0]
    assert _db_files(tmp_path / "db") == files   # nothing rebuilt or repaired


def test_corrupt_table_file_is_reported(tmp_path, capsys):
    recs = gen_records(20_000, keys=5000, value_size=200)
    write_store(tmp_path / "s", recs)
    build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)
    KVMap(tmp_path / "db").close()            # reopening moves the log into a table
    tables = sorted(glob.glob(str(tmp_path / "db" / "*.ldb")))
    assert tables
    _flip(tables[0], 64)                      # inside the first data block
    with KVMap(tmp_path / "db", verify_checksums=True) as m:
        with pytest.raises(KVCorruptionError, match="checksum"):
            m.verify()
        with pytest.raises(KVCorruptionError):
            dict(m.items())
        first = min(model(recs))
        with pytest.raises(KVCorruptionError):
            m.get(first)
    assert cli.main(["kv", "get", "--db", str(tmp_path / "db"), first.decode()]) == 1
    assert "corrupt" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# command line and demo


def test_cli_build_and_get(tmp_path, capsys, store_at):
    recs = [(0, 0, 1, b"user-1", b'{"n": 1}'), (0, 1, 2, b"user-2", b"plain"),
            (0, 2, 3, b"\xffbin", b"\xfe\x00"), (0, 3, 4, b"gone", b"x"),
            (0, 4, 5, b"gone", None)]
    write_store(store_at("s"), recs)
    db = str(tmp_path / "db")
    assert cli.main(["kv", "build", "--store", store_at("s"), "--topic", TOPIC,
                     "--db", db]) == 0
    out = capsys.readouterr()
    assert "3 keys" in out.out and "kv build:" in out.err
    assert cli.main(["kv", "get", "--db", db, "user-2"]) == 0
    assert capsys.readouterr().out == "plain\n"
    assert cli.main(["kv", "get", "--db", db, "gone"]) == 1
    assert capsys.readouterr().out == ""
    assert cli.main(["kv", "get", "--db", db, "gone", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"key": "gone", "found": False}
    assert cli.main(["kv", "get", "--db", db, "user-1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"key": "user-1", "found": True,
                                                   "value": '{"n": 1}'}
    assert cli.main(["kv", "get", "--db", db, base64.b64encode(b"\xffbin").decode(),
                     "--key-base64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["found"] and doc["value_b64"] == base64.b64encode(b"\xfe\x00").decode()
    assert doc["key_b64"] == base64.b64encode(b"\xffbin").decode()


def test_cli_get_decodes_json_values(tmp_path, capsys):
    write_store(tmp_path / "s", [(0, 0, 1, b"u", b'{"n": 1, "tags": ["a"]}')])
    db = str(tmp_path / "db")
    build_map(db, str(tmp_path / "s"), TOPIC)
    assert cli.main(["kv", "get", "--db", db, "u", "--json", "--value-converter", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["value"] == {"n": 1, "tags": ["a"]}
    with KVMap(db, value_converter="json") as m:
        assert m.get(b"u") == {"n": 1, "tags": ["a"]}
        assert dict(m.items()) == {b"u": {"n": 1, "tags": ["a"]}}


def test_kv_demo_step(tmp_path):
    from kcompact.connectors.devtools.workload import Workload
    wl = Workload(records=3000, keys=300, partitions=2)
    with Store.open(str(tmp_path / "s"), writer="demo", create=True) as st:
        for b in wl.batches("demo-users"):
            st.append(b)
        st.flush()
    looks = kv_demo_step(str(tmp_path / "s"), "demo-users", str(tmp_path / "db"))
    assert len(looks) >= 3 and looks[-1] == (b"no-such-key", None)
    assert all(v is not None for _, v in looks[:-1])
    with KVMap(tmp_path / "db") as m:
        assert all(m.get(k) == v for k, v in looks)


def test_connect_sink_task_applies_batches_and_resumes_from_the_map(tmp_path):
    from kcompact.connectors.framework import api
    from kcompact.connectors.plugins.leveldb_connector import LevelDBSinkConnector

    recs = gen_records(3000, partitions=2, keys=200)
    conn = LevelDBSinkConnector()
    conn.start({"topics": [TOPIC], "kv.db": str(tmp_path / "db")})
    (props,) = conn.task_configs(4)
    tps = [api.TopicPartition(TOPIC, 0), api.TopicPartition(TOPIC, 1)]

    def run(batch):
        task = conn.task_class()()
        ctx = api.SinkTaskContext(tps)
        task.initialize(ctx)
        task.start(props)
        task.open(tps)
        task.put(api.SinkRecords([TOPIC] * len(batch), [r[0] for r in batch],
                                 [r[1] for r in batch], [r[2] for r in batch],
                                 [r[3] for r in batch], [r[4] for r in batch],
                                 [None] * len(batch)))
        assert task.pre_commit({}) == {}
        task.stop()
        return ctx.requested_offsets

    assert run(recs[:1000]) == {tp: api.OFFSET_BEGINNING for tp in tps}
    starts = run(recs[1000:])
    assert starts == {api.TopicPartition(TOPIC, p): o
                      for p, o in next_offsets_of(recs[:1000]).items()}
    check_map(tmp_path / "db", model(recs))
    with KVMap(tmp_path / "db") as m:
        assert m.offsets() == next_offsets_of(recs) and m.stats()["records"] == len(recs)


def test_a_map_behind_longer_than_delete_retention_is_warned(tmp_path):
    store, db = str(tmp_path / "s"), str(tmp_path / "db")
    write_store(store, [(0, 0, 1, b"a", b"1")], config={"delete.retention.ms": 60_000})
    build_map(db, store, TOPIC)
    write_store(store, [(0, 1, 2, b"a", None), (0, 2, 3, b"b", b"2")])
    compact_all(store)                    # the compaction horizon passes the map's offset 1
    rep = build_map(db, store, TOPIC)     # it caught up a moment ago: nothing can be missing
    assert "deletes_may_be_missed" not in rep
    assert map_contents(db) == {b"b": b"2"}
    write_store(store, [(0, 3, 4, b"b", None)])
    compact_all(store)
    d = open_db(db, create=True)
    LevelDBSink(d, db).mark_caught_up(0)  # as if it last caught up long ago
    d.close()
    notes = []
    rep = build_map(db, store, TOPIC, progress=notes.append)
    assert rep["deletes_may_be_missed"] == [0]
    assert any("delete.retention.ms" in n for n in notes)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_follow_store_stops_cleanly_on_a_signal(tmp_path, sig, shared_store_at):
    store, db = shared_store_at("s"), str(tmp_path / "db")
    first = gen_records(2000, keys=300)
    write_store(store, first)
    err = tmp_path / "err.log"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kcompact", "kv", "build", "--store",
                                 store, "--topic", TOPIC, "--db", db, "--follow"],
                                stdout=subprocess.PIPE, stderr=f, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_until(lambda: "following" in err.read_text(), 90)
        more = gen_records(1000, keys=300, seed=5, start=next_offsets_of(first))
        write_store(store, more)
        wait_until(lambda: _applied(err) >= len(more), 60)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.read_text()
    assert "keys of topic" in out
    check_map(db, model(first + more))


def _applied(log: Path) -> int:
    """Records the follower reported applied (its "kv build: applied N records" lines)."""
    return sum(int(line.split()[3].replace(",", "")) for line in log.read_text().splitlines()
               if line.startswith("kv build: applied "))


def test_reverse_prefix_scan_when_the_next_key_lies_outside(tmp_path):
    """Regression (hypothesis found it): plyvel's reverse iterator(start=, stop=) returned nothing
    for a prefix whose last key is followed by a key outside the prefix."""
    recs = [(0, 0, 1, b"a", b"1", []), (0, 1, 2, b"b", b"2", []), (0, 2, 3, b"d", b"3", [])]
    write_store(tmp_path / "s", recs)
    build_map(tmp_path / "db", str(tmp_path / "s"), TOPIC)
    with KVMap(tmp_path / "db") as m:
        assert list(m.items(prefix=b"b", reverse=True)) == [(b"b", b"2")]
        assert list(m.keys(start=b"a", stop=b"c", reverse=True)) == [b"b", b"a"]
        assert list(m.keys(reverse=True)) == [b"d", b"b", b"a"]
        with m.snapshot() as s:
            assert list(s.keys(prefix=b"b", reverse=True)) == [b"b"]
