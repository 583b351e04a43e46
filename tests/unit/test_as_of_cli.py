"""``kcompact dump --as-of`` and ``kcompact kv build --as-of`` against a dict model, and their
refusals (the command line run in this process: connectors.cli.main).

Random workloads: keys from a small pool, tombstones, keyless records, timestamps out of order
(CreateTime), offset gaps, over two partitions, sometimes compacted (with a tiny offset map and
``min.compaction.lag.ms``). For a random TIME the model is, per partition, each key's
highest-offset record with a timestamp <= TIME (absent when a tombstone) and keyless records with
a timestamp <= TIME; across partitions the map keeps one value per key (a producer that writes a
key to two partitions is resolved by the build's rule, so the workload keeps keys to one
partition). When compaction already cleaned history past TIME both commands exit 1 with one line
naming the earliest time answered exactly, and leave no map behind; ``--allow-inexact`` answers.
"""

from __future__ import annotations

import json
import random

import plyvel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.compaction import history as H
from kcompact.connectors.cli import main
from kcompact.reput.config import ManualClock
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store

TOPIC = "t"
T0 = 1_700_000_000_000


def build(url: str, seed: int, n: int, compact: bool, lag: int) -> dict[int, list[Record]]:
    rng = random.Random(seed)
    clock = ManualClock(T0)
    out: dict[int, list[Record]] = {0: [], 1: []}
    with Store.open(url, writer="w", create=True, clock=clock) as s:
        s.set_topic_config(TOPIC, {"segment.bytes": 16384, "min.compaction.lag.ms": lag,
                                   "delete.retention.ms": 0})
        nxt = {0: 0, 1: 0}
        for step in range(3):
            recs = []
            for _ in range(n):
                p = rng.randrange(2)
                off = nxt[p] + rng.choice((0, 0, 0, 4))
                nxt[p] = off + 1
                key = None if rng.random() < 0.1 else b"p%d-k%d" % (p, rng.randrange(15))
                value = None if rng.random() < 0.25 else b"v%d-%d" % (p, off)
                ts = clock.ms() + rng.randint(-3000, 3000)
                r = Record(TOPIC, p, off, ts, key, value, ())
                recs.append(r)
                out[p].append(r)
            s.append(RecordBatch.from_records(TOPIC, recs))
            s.flush()
            clock.advance(10_000)
            if compact and step < 2:
                for p in (0, 1):
                    Compactor(s, CompactionOptions(offset_map_memory=4096, max_load=0.1),
                              clock).compact_partition(TOPIC, p, force=True)
    return out


def model(records: list[Record], t: int) -> list[Record]:
    latest, keyless = {}, []
    for r in records:
        if r.timestamp <= t:
            if r.key is None:
                keyless.append(r)
            else:
                latest[r.key] = r
    return sorted([r for r in latest.values() if r.value is not None] + keyless,
                  key=lambda r: r.offset)


def earliest(url: str, parts=(0, 1)) -> int:
    with Store.open(url) as s:
        return H.exactness([s.partition(TOPIC, p) for p in parts], 0).earliest_ms


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(5, 80), compact=st.booleans(),
       lag=st.sampled_from([0, 15_000]), pick=st.integers(0, 10**6), data=st.data())
def test_dump_and_kv_build_as_of_match_the_model(tmp_path_factory, capsys, seed, n, compact,
                                                 lag, pick, data):
    tmp = tmp_path_factory.mktemp("asof")
    url = str(tmp / "store")
    recs = build(url, seed, n, compact, lag)
    stamps = sorted({r.timestamp for rs in recs.values() for r in rs})
    t = stamps[pick % len(stamps)] + data.draw(st.sampled_from([-1, 0, 1]))
    capsys.readouterr()
    for p in (0, 1):
        first = earliest(url, (p,))  # dump: that partition's history
        exact = t >= first
        code = main(["dump", "--store", url, "--topic", TOPIC, "--partition", str(p),
                     "--as-of", str(t), "--json"])
        out, err = capsys.readouterr()
        if not exact:
            assert code == 1
            assert H.format_time(first) in err and "earliest time answered exactly" in err
            assert len(err.strip().splitlines()) == 1
            code = main(["dump", "--store", url, "--topic", TOPIC, "--partition", str(p),
                         "--as-of", str(t), "--allow-inexact", "--json"])
            out, err = capsys.readouterr()
            assert code == 0
            continue
        assert code == 0, err
        got = [json.loads(line) for line in out.splitlines()]
        want = model(recs[p], t)
        assert [(d["offset"], d["key"], d["value"], d["timestamp"]) for d in got] == \
            [(r.offset, None if r.key is None else r.key.decode(),
              None if r.value is None else r.value.decode(), r.timestamp) for r in want]
    exact = t >= earliest(url)  # kv build: every partition's
    db = tmp / "map"
    code = main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", str(db),
                 "--as-of", str(t)])
    _, err = capsys.readouterr()
    if not exact:
        assert code == 1 and "earliest time answered exactly" in err
        assert not db.exists()  # nothing left behind
        return
    assert code == 0, err
    want = {r.key: r.value for p in (0, 1) for r in model(recs[p], t) if r.key is not None}
    d = plyvel.DB(str(db))
    try:
        got = {k[1:]: v for k, v in d.iterator(prefix=b"d")}
    finally:
        d.close()
    assert got == want


def test_as_of_map_is_never_followed_and_a_followed_map_never_becomes_one(tmp_path, capsys):
    url = str(tmp_path / "store")
    build(url, 3, 50, False, 0)
    db = str(tmp_path / "map")
    assert main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", db,
                 "--as-of", str(T0)]) == 0
    capsys.readouterr()
    assert main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", db]) == 1
    err = capsys.readouterr().err
    assert "as of 2023-11-14T22:13:20.000Z" in err and "not followed or caught up" in err
    assert main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", db,
                 "--as-of", str(T0 + 5)]) == 1
    db2 = str(tmp_path / "map2")
    assert main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", db2]) == 0
    capsys.readouterr()
    assert main(["kv", "build", "--store", url, "--topic", TOPIC, "--db", db2,
                 "--as-of", str(T0)]) == 1
    assert "not a state as of a time" in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["kv", "build", "--store", "s", "--topic", "t", "--db", "d", "--as-of", "x"],
     "is not a time"),
    (["kv", "build", "--store", "s", "--topic", "t", "--db", "d", "--as-of", "0", "--follow"],
     "not with --follow"),
    (["dump", "--store", "s", "--topic", "t", "--partition", "0", "--allow-inexact"],
     "--allow-inexact goes with --as-of"),
])
def test_as_of_usage_errors(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err
