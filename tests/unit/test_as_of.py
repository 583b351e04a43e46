"""The state as of a time against a plain-dict model, across compactions (compaction/history.py).

A hypothesis state machine appends batches with timestamps out of order (CreateTime is not
monotonic), tombstones, keyless records and offset gaps to a store, and compacts with tiny offset
maps (many rounds), ``min.compaction.lag.ms`` and ``delete.retention.ms`` on an injected clock.
After every step, for every distinct record timestamp T (and its neighbours):

* when the store says T is answered exactly (T >= every partition's history horizon), the
  store's state as of T (``as_of_selection``: per key the highest-offset record with a
  timestamp <= T, tombstones absent; keyless records with timestamp <= T) equals the model's,
  computed from every record ever appended;
* otherwise ``check_exact`` refuses with AsOfInexactError naming the horizon, and the horizon
  itself is answered exactly (the earliest time it names is right);
* the horizon never exceeds the highest timestamp of a keyed record appended (it is not
  invented), and is -1 until a compaction maps something.

Plus the horizon's bookkeeping: old checkpoints read as unknown, and unknown is sticky.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.compaction import history as H
from kcompact.reput import swap
from kcompact.reput.backend import MemoryBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store

TOPIC = "t"
PARTS = (0, 1)
T0 = 1_700_000_000_000
KEYS = [None] + [b"k%02d" % i for i in range(12)]


def model_as_of(records: dict[int, Record], t: int) -> list[tuple[int, bytes | None, bytes]]:
    """(offset, key, value) of the state as of ``t``, in offset order."""
    latest: dict[bytes, Record] = {}
    keyless = []
    for off in sorted(records):
        r = records[off]
        if r.timestamp > t:
            continue
        if r.key is None:
            keyless.append(r)
        else:
            latest[r.key] = r
    out = [r for r in latest.values() if r.value is not None] + keyless
    return sorted((r.offset, r.key, r.value) for r in out)


def store_as_of(store: Store, p: int, t: int, by: dict[int, Record]
                ) -> list[tuple[int, bytes | None, bytes]]:
    """The store's state as of ``t`` (``by``: the partition's records by offset)."""
    pl = store.partition(TOPIC, p)
    offsets = [int(seg.index().entries["offset"][i])
               for seg, sel in H.as_of_selection(pl, t) for i in sel]
    return [(o, by[o].key, by[o].value) for o in offsets]


class AsOfMachine(RuleBasedStateMachine):
    lag = 0

    def __init__(self):
        super().__init__()
        self.fs = MemoryBackend()
        self.store: Store | None = None
        self.appended: dict[int, dict[int, Record]] = {p: {} for p in PARTS}
        self.next_off = {p: 0 for p in PARTS}
        self.compacted = False

    def teardown(self):
        if self.store is not None:
            self.store.close()

    @initialize(retention=st.sampled_from([0, 1000, 60_000]))
    def setup(self, retention):
        self.clock = ManualClock(T0 + 123)
        self.store = Store.open("memory://x", fs=self.fs, writer="w", create=True,
                                clock=self.clock)
        self.store.set_topic_config(TOPIC, {"segment.bytes": 16384,
                                            "delete.retention.ms": retention,
                                            "min.compaction.lag.ms": self.lag})

    @rule(seed=st.integers(0, 2**32 - 1), n=st.one_of(st.integers(1, 30), st.integers(200, 500)),
          tombstones=st.sampled_from([0.0, 0.2, 0.5]), keyless=st.sampled_from([0.0, 0.2]),
          jitter=st.sampled_from([0, 50, 5000]))
    def append(self, seed, n, tombstones, keyless, jitter):
        rng = random.Random(seed)
        recs = []
        for _ in range(n):
            p = rng.choice(PARTS)
            off = self.next_off[p] + rng.choice([1, 1, 1, 3]) - 1
            key = None if rng.random() < keyless else rng.choice(KEYS[1:])
            value = None if rng.random() < tombstones else b"v%d" % off
            # out of order: up to ``jitter`` ms either side of the clock
            ts = self.clock.ms() + rng.randint(-jitter, jitter)
            r = Record(TOPIC, p, off, ts, key, value, ())
            recs.append(r)
            self.appended[p][off] = r
            self.next_off[p] = off + 1
        self.store.append(RecordBatch.from_records(TOPIC, recs))
        self.store.flush()

    @rule(ms=st.sampled_from([1, 100, 1000, 3000, 20_000]))
    def advance(self, ms):
        self.clock.advance(ms)

    @rule(p=st.sampled_from(PARTS), force=st.booleans(), memory=st.sampled_from([4096, 1 << 16]))
    def compact(self, p, force, memory):
        if p not in self.store.partitions(TOPIC):
            return
        res = Compactor(self.store, CompactionOptions(offset_map_memory=memory, max_load=0.1),
                        self.clock).compact_partition(TOPIC, p, force=force)
        assert res.skipped is None
        self.compacted = True

    @invariant()
    def as_of_is_exact_when_it_says_so(self):
        if self.store is None:
            return
        for p in self.store.partitions(TOPIC):
            pl = self.store.partition(TOPIC, p)
            A = self.appended[p]
            h = H.partition_horizon(pl)
            assert h is not None  # every checkpoint here was written by this kcompact
            keyed_ts = [r.timestamp for r in A.values() if r.key is not None]
            assert h <= max(keyed_ts, default=-1)
            by = {r.offset: r for r in self.store.iter_records(TOPIC, p)}
            stamps = sorted({r.timestamp for r in A.values()})
            # the horizon, its neighbours, and a spread of the record timestamps +-1
            pick = stamps[::max(1, len(stamps) // 6)] + stamps[-1:]
            times = {t + d for t in pick for d in (-1, 0, 1)} | {h - 1, h, h + 1}
            for t in sorted(times):
                ex = H.exactness([pl], t)
                if ex.exact:
                    if h > -1:
                        event("exact over a compacted partition")
                    assert store_as_of(self.store, p, t, by) == model_as_of(A, t), (p, t, h)
                else:
                    event("inexact, refused")
                    assert t < h
                    with pytest.raises(H.AsOfInexactError) as e:
                        H.check_exact([pl], t, "the test")
                    assert e.value.earliest_ms == h
                    assert H.format_time(h) in str(e.value)
                    H.check_exact([pl], t, "the test", allow_inexact=True)  # no raise


def machine(lag: int) -> type:
    return type(f"AsOfMachine_{lag}", (AsOfMachine,), {"lag": lag})


SETTINGS = settings(max_examples=10, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.mark.parametrize("lag", [0, 2500])
def test_as_of_matches_model_across_compactions(lag):
    run_state_machine_as_test(machine(lag), settings=SETTINGS)


# -- the horizon's bookkeeping ------------------------------------------------------------------


def _store(tmp_path, clock, **cfg) -> Store:
    s = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "delete.retention.ms": 0, **cfg})
    return s


def _compact(s, clock):
    return Compactor(s, CompactionOptions(offset_map_memory=4096), clock).compact_partition(
        TOPIC, 0, force=True)


def test_horizon_is_the_highest_mapped_timestamp_not_the_last(tmp_path):
    """CreateTime out of order: a record with a later timestamp at a lower offset makes the
    horizon; nothing before a compaction, -1 when nothing was cleaned."""
    clock = ManualClock(T0)
    s = _store(tmp_path, clock)
    s.append(RecordBatch.from_records(TOPIC, [(0, 0, 5000, b"a", b"1"), (0, 1, 9000, b"a", b"2"),
                                              (0, 2, 7000, b"b", b"3"), (0, 3, 100, None, b"x"),
                                              (0, 4, 9500, None, b"y")]))
    s.flush()
    assert H.partition_horizon(s.partition(TOPIC, 0)) == -1
    _compact(s, clock)
    pl = s.partition(TOPIC, 0)
    assert H.partition_horizon(pl) == 9000  # keyless 9500 supersedes nothing
    assert swap.read_checkpoint(s.fs, pl.dir)[1][H.HISTORY_KEY] == 9000
    with pytest.raises(H.AsOfInexactError, match="earliest time answered exactly is "
                       r"1970-01-01T00:00:09.000Z \(9000\)"):
        H.check_exact([pl], 8999, "orders")
    H.check_exact([pl], 9000, "orders")
    s.close()


def test_old_checkpoint_reads_as_unknown_and_stays_unknown(tmp_path):
    """A checkpoint from before the field (cleaned_offset >= 0, no cleaned_timestamp) is
    unknown: no time is exact, and later compactions keep it unknown."""
    clock = ManualClock(T0)
    s = _store(tmp_path, clock)
    s.append(RecordBatch.from_records(TOPIC, [(0, i, 1000 + i, b"k", b"v") for i in range(4)]))
    s.flush()
    _compact(s, clock)
    pl = s.partition(TOPIC, 0)
    swap.write_checkpoint(s.fs, pl.dir, 3, {"records_kept": 1})  # what an old kcompact wrote
    assert H.partition_horizon(pl) is None
    with pytest.raises(H.AsOfInexactError, match="without a record of how much history"):
        H.check_exact([pl], 10**13, "t")
    s.append(RecordBatch.from_records(TOPIC, [(0, 4 + i, 2000 + i, b"k", b"v") for i in range(4)]))
    s.flush()
    _compact(s, clock)
    assert H.partition_horizon(s.partition(TOPIC, 0)) is None
    s.close()


def test_horizon_helpers():
    assert H.horizon_of(-1, None) == -1
    assert H.horizon_of(5, None) is None
    assert H.horizon_of(5, {"cleaned_timestamp": 7}) == 7
    assert H.horizon_of(-1, {"cleaned_timestamp": None}) is None  # a replica's merge
    assert H.horizon_of(5, {"cleaned_timestamp": "x"}) is None
    assert H.combine(3, 9) == 9 and H.combine(None, 9) is None
    assert H.parse_time("1764340140000") == 1764340140000
    assert H.parse_time("2025-11-28T14:29:00Z") == 1764340140000
    assert H.parse_time("2025-11-28T15:29:00+01:00") == 1764340140000
    assert H.parse_time("2025-11-28T14:29:00.250Z") == 1764340140250
    with pytest.raises(ValueError, match="not a time"):
        H.parse_time("yesterday")
    assert H.format_time(1764340140250) == "2025-11-28T14:29:00.250Z (1764340140250)"
