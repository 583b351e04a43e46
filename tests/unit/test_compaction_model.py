"""Compaction against a plain-dict model (Kafka's LogCleanerTest, as a hypothesis state machine).

A store with several partitions gets random batches (keys from a small pool plus None = keyless
and b"" = the empty key; values None = tombstone, b"" = an empty value, which is NOT a tombstone,
or up to 400 bytes; headers; offset gaps; record timestamps behind the clock), interleaved with
forced and unforced compactions of one partition (``Compactor.compact_partition``) or of the
store (``compact_store``, the planner), with offset maps as small as 25 keys (so every compaction
runs many rounds), and an injected ManualClock (started off a second boundary) that moves across
``delete.retention.ms`` and ``min.compaction.lag.ms``; the machine runs under four
(delete.retention.ms, min.compaction.lag.ms) settings, in memory and on disk. ``segment.bytes``
is 16 KiB, so partitions have many segments.

After every compaction, for every partition, with H the compaction horizon (checkpoint):

(a) each live key's latest offset and value equal the model's (and a key whose latest record is
    a tombstone never shows an older value);
(b) at offsets <= H each key has exactly one record, the model's latest at or below H (none when
    that is a tombstone whose delete.retention.ms ran out, unless it is the partition's last
    record: that one is never removed, as Kafka never cleans the active segment holding it);
(c) every keyless record is kept;
(d) offsets never change: each record read equals what was appended at its offset (timestamp,
    key, value, headers), offsets strictly increase, and nothing after H is ever dropped;
(e) a tombstone is kept until delete.retention.ms after the compaction that first cleaned it
    (its .bcq clean_time is that compaction's time, in seconds), and is gone after the first
    compaction that runs 2 s past that (clean_time has 1 s resolution) while it is not the
    partition's last record;
(f) H stops before the first sealed segment holding a record younger than min.compaction.lag.ms
    (segment-granular, as in Kafka) and otherwise reaches the end of the cleanable range:
    rounds chain until nothing dirty is left;
(g) without force, the active segment's files are byte-identical before and after;
(h) ``verify_store`` is clean.

Plus deterministic cases (regressions named test_issue_*), and the issue's test: many records
over many distinct keys with a small map leave exactly one record per key (checked with numpy
over the .bcq entries): 2M records / 600k keys / 4 MiB map, and the issue's full
10M / 3M / 16 MiB (marked ``slow``, about 30 s; it runs in every full run).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, rule,
                                 run_state_machine_as_test)

from kcompact.compaction import CompactionOptions, Compactor, compact_store, partition_status
from kcompact.reput import bcq as B
from kcompact.reput import swap
from kcompact.reput.backend import LocalBackend, MemoryBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import Record, RecordBatch, BytesColumn
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

TOPIC = "t"
PARTS = (0, 1, 2)
SEGMENT_BYTES = 16384
KEY_POOL = [None, b""] + [b"key-%02d" % i for i in range(80)]
T0 = 1_700_000_000_000
# clean_time has 1 s resolution: a tombstone must be gone once this much past delete.retention.ms
TOMBSTONE_SLACK_MS = 2000


def _value(off: int, kind: int, length: int) -> bytes | None:
    if kind == 0:
        return None
    if kind == 1:
        return b""
    stem = b"v%d." % off
    return (stem * (length // len(stem) + 1))[:max(length, len(stem))]


# -- the state machine ------------------------------------------------------------------------


class CompactionMachine(RuleBasedStateMachine):
    local = False
    retention = 1000  # delete.retention.ms
    lag = 0           # min.compaction.lag.ms

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kcompact-cmodel-",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
            if self.local else None
        self.fs = LocalBackend(self.tmp) if self.local else MemoryBackend()
        self.url = self.tmp if self.local else "memory://x"
        self.store: Store | None = None
        self.appended: dict[int, dict[int, Record]] = {p: {} for p in PARTS}
        self.next_off = {p: 0 for p in PARTS}
        self.horizon = {p: -1 for p in PARTS}
        self.first_clean: dict[int, dict[int, int]] = {p: {} for p in PARTS}
        self.compactions = 0

    def teardown(self):
        if self.store is not None:
            self.store.close()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @initialize(jitter=st.one_of(st.sampled_from([999, 998, 500, 1]), st.integers(0, 999)),
                bases=st.lists(st.integers(0, 5000), min_size=3, max_size=3))
    def setup(self, jitter, bases):
        self.clock = ManualClock(T0 + jitter)  # not on a second boundary: clean_time rounds
        self.store = Store.open(self.url, fs=self.fs, writer="w", create=True, clock=self.clock)
        self.cfg = self.store.set_topic_config(TOPIC, {
            "segment.bytes": SEGMENT_BYTES, "delete.retention.ms": self.retention,
            "min.compaction.lag.ms": self.lag})
        for p, b in zip(PARTS, bases):
            self.next_off[p] = b

    # -- rules ----------------------------------------------------------------------------

    @rule(seed=st.integers(0, 2**32 - 1),
          n=st.one_of(st.integers(1, 20), st.integers(150, 400)),
          parts=st.sampled_from([(0,), (1,), (0, 1), (0, 1, 2)]),
          nkeys=st.sampled_from([3, 30, len(KEY_POOL)]),
          tombstones=st.sampled_from([0.0, 0.05, 0.3]), keyless=st.sampled_from([0.0, 0.05, 0.3]),
          vmax=st.sampled_from([0, 60, 400, 1500]), flush=st.booleans())
    def append(self, seed, n, parts, nkeys, tombstones, keyless, vmax, flush):
        """A batch over some partitions; record contents come from a seeded generator so that a
        step stays small for hypothesis while batches span several segments."""
        rng = random.Random(seed)
        recs = []
        for _ in range(n):
            p = rng.choice(parts)
            off = self.next_off[p] + rng.choice([1, 1, 1, 1, 2, 7, 40]) - 1
            key = None if rng.random() < keyless else KEY_POOL[1 + rng.randrange(nkeys - 1)]
            x = rng.random()
            kind = 0 if x < tombstones else (1 if x < tombstones + 0.05 else 2)
            ts = self.clock.ms() - rng.choice([0, 0, 10, 900, 3000])
            hdr = rng.choice([(), (), (("h", b"x"),), (("trace", None), ("h", b""))])
            r = Record(TOPIC, p, off, ts, key, _value(off, kind, rng.randint(0, vmax)), hdr)
            recs.append(r)
            self.appended[p][off] = r
            self.next_off[p] = off + 1
        self.store.append(RecordBatch.from_records(TOPIC, recs))
        if flush:
            self.store.flush()

    @rule(ms=st.sampled_from([1, 2, 499, 501, 998, 999, 1000, 1001, 1500, 2500, 4000, 7000,
                              12_000]))
    def advance(self, ms):
        self.clock.advance(ms)

    @rule(p=st.sampled_from(PARTS), force=st.booleans(),
          budget=st.sampled_from([(4096, 0.1), (4096, 0.1), (4096, 0.9), (1 << 16, 0.5)]))
    def compact_partition(self, p, force, budget):
        if p not in self.store.partitions(TOPIC):
            return
        pre = self.snapshot()
        c = Compactor(self.store, CompactionOptions(offset_map_memory=budget[0],
                                                    max_load=budget[1]), self.clock)
        res = c.compact_partition(TOPIC, p, force=force)
        assert res.skipped is None
        if res.map_keys_max:
            assert res.map_keys_max <= c.offset_map.max_keys
        self.after_compaction(pre, {p: res}, force)

    @rule(force=st.booleans())
    def compact_store(self, force):
        pre = self.snapshot()
        results = compact_store(self.store, force=force, clock=self.clock,
                                options=CompactionOptions(offset_map_memory=4096, max_load=0.2))
        done = {r.partition: r for r in results}
        assert len(done) == len(results)
        if force:
            assert set(done) == set(self.store.partitions(TOPIC))
        self.after_compaction(pre, done, force)

    # -- checks ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Per partition: segments (base, log bytes, max timestamp, offsets) and the active
        segment's file bytes, before a compaction."""
        out = {}
        for p in self.store.partitions(TOPIC):
            pl = self.store.partition(TOPIC, p)
            segs = []
            for seg in pl.segments:
                e = seg.entries()
                segs.append((seg.base, seg.log_size,
                             int(e["timestamp"].max()) if e.shape[0] else None,
                             e["offset"].copy()))
            act = pl.segments[-1]
            out[p] = {"segs": segs, "active": (act.base, self.fs.read(pl.log_path(act.base)),
                                               self.fs.read(pl.index_path(act.base)))}
        return out

    def expected_horizon(self, p: int, pre: dict, force: bool) -> int:
        segs = pre["segs"]
        h0 = self.horizon[p]
        sealed = segs if (force and segs[-1][1] > 0) else segs[:-1]
        lag = self.cfg.min_compaction_lag_ms
        end = None
        if lag > 0:
            limit = self.clock.ms() - lag
            for base, _, tmax, _ in sealed:
                if tmax is not None and tmax > limit:
                    end = base
                    break
        cand = [int(o) for base, _, _, offs in sealed if end is None or base < end
                for o in offs if o > h0]
        return max(cand) if cand else h0

    def after_compaction(self, pre: dict, done: dict, force: bool) -> None:
        self.compactions += 1
        now = self.clock.ms()
        for p in self.store.partitions(TOPIC):
            pl = self.store.partition(TOPIC, p)
            h = partition_status(self.store, TOPIC, p)["compaction_horizon"]
            assert h == swap.read_checkpoint(self.fs, pl.dir)[0]
            if p in done:
                # (f): the horizon is exactly the end of the cleanable range
                assert h == self.expected_horizon(p, pre[p], force), (p, h)
                if not force:
                    self.check_active_untouched(pl, pre[p])  # (g)
            else:
                assert h == self.horizon[p]
            # tombstones cleaned for the first time by this compaction
            for o, r in self.appended[p].items():
                if self.horizon[p] < o <= h and r.value is None and r.key is not None:
                    self.first_clean[p][o] = now
            self.horizon[p] = h
            n = self.check_partition(p, now, compacted=p in done)
            if p in done:
                assert done[p].records_kept == n
                r = done[p]
                event(f"rounds: {min(r.rounds, 5)}{'+' if r.rounds >= 5 else ''}")
                event(f"segments before: {min(r.segments_before, 8)}"
                      f"{'+' if r.segments_before >= 8 else ''}")
                if r.tombstones_dropped:
                    event("tombstones dropped")
                if r.segments_after < r.segments_before:
                    event("segments merged")
                if h < max(self.appended[p], default=-1) and force:
                    event("forced, horizon held back by min.compaction.lag.ms")
        rep = verify_store(self.store)
        assert rep.ok, [str(x) for x in rep.problems]  # (h)

    def check_active_untouched(self, pl, pre: dict) -> None:
        """(g): the active segment is untouched."""
        base, logb, idxb = pre["active"]
        assert pl.segments[-1].base == base
        assert self.fs.read(pl.log_path(base)) == logb
        assert self.fs.read(pl.index_path(base)) == idxb

    def check_partition(self, p: int, now: int, compacted: bool) -> int:
        A = self.appended[p]
        h = self.horizon[p]
        tail = max(A, default=-1)  # the partition's last record: compaction never removes it
        retention = self.cfg.delete_retention_ms
        recs = list(self.store.iter_records(TOPIC, p))
        offs = [r.offset for r in recs]
        assert offs == sorted(set(offs))
        S = {}
        for r in recs:  # (d) offsets never change, contents are what was appended there
            assert A.get(r.offset) == r, (p, r.offset)
            S[r.offset] = r
        # (c) keyless records all kept; (d) nothing after the horizon dropped
        missing = [o for o, r in A.items() if (r.key is None or o > h) and o not in S]
        assert not missing, (p, h, missing[:5])
        # (b) + (e) the cleaned range: one record per key, the latest at or below h
        latest_le_h: dict[bytes, int] = {}
        for o in sorted(A):
            if o <= h and A[o].key is not None:
                latest_le_h[A[o].key] = o
        got_le_h: dict[bytes, list[int]] = {}
        for o, r in S.items():
            if o <= h and r.key is not None:
                got_le_h.setdefault(r.key, []).append(o)
        assert set(got_le_h) <= set(latest_le_h)
        for k, L in latest_le_h.items():
            got = got_le_h.get(k, [])
            if A[L].value is not None:
                assert got == [L], (p, k, L, got)
                continue
            t = self.first_clean[p][L]
            if L == tail:
                assert got == [L], (p, k, L, "the partition's last record was removed", got)
                event("the last record, a tombstone, kept")
                continue
            if got == [L]:
                if compacted:
                    assert now - t < retention + TOMBSTONE_SLACK_MS, \
                        (p, k, L, "tombstone outlived delete.retention.ms", now - t)
            else:
                assert got == [], (p, k, L, got)
                assert now - t >= retention, \
                    (p, k, L, "tombstone dropped before delete.retention.ms", now - t)
        # (e) clean_time stamps: the time (s) of the compaction that first cleaned the tombstone
        for seg in self.store.partition(TOPIC, p).segments:
            e = seg.entries()
            for o, fl, ct in zip(e["offset"].tolist(), e["flags"].tolist(),
                                 e["clean_time"].tolist()):
                if fl & B.FLAG_TOMBSTONE and not fl & B.FLAG_KEYLESS:
                    want = self.first_clean[p][o] // 1000 if o <= h else 0
                    assert ct == want, (p, o, ct, want)
        # (a) live keys: latest offset and value
        model_latest: dict[bytes, int] = {}
        for o in sorted(A):
            if A[o].key is not None:
                model_latest[A[o].key] = o
        store_latest: dict[bytes, int] = {}
        for o in offs:
            if S[o].key is not None:
                store_latest[S[o].key] = o
        live = {k: (o, A[o].value) for k, o in model_latest.items() if A[o].value is not None}
        got_live = {k: (o, S[o].value) for k, o in store_latest.items()
                    if S[o].value is not None}
        assert got_live == live
        for k, o in store_latest.items():
            assert o == model_latest[k]  # a dead key shows its tombstone or nothing
        return len(recs)


def machine(retention: int, lag: int, local: bool = False) -> type:
    return type(f"CompactionMachine_{retention}_{lag}_{'disk' if local else 'mem'}",
                (CompactionMachine,), {"retention": retention, "lag": lag, "local": local})


MODEL_SETTINGS = settings(max_examples=20, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])


@pytest.mark.parametrize("retention,lag", [(1000, 0), (2500, 1500), (0, 6000), (10_000, 0)])
def test_compaction_matches_model_in_memory(retention, lag):
    run_state_machine_as_test(machine(retention, lag), settings=MODEL_SETTINGS)


def test_compaction_matches_model_on_disk():
    run_state_machine_as_test(machine(1000, 1500, local=True),
                              settings=settings(MODEL_SETTINGS, max_examples=12))


# -- deterministic cases ----------------------------------------------------------------------


def _store(tmp_path, clock, **cfg) -> Store:
    st_ = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock)
    st_.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES, **cfg})
    return st_


def _compact(st_, clock, force=True, memory=4096, load=0.9, p=0):
    return Compactor(st_, CompactionOptions(offset_map_memory=memory, max_load=load),
                     clock).compact_partition(TOPIC, p, force=force)


def _kv(st_, p=0):
    return [(r.offset, r.key, r.value) for r in st_.iter_records(TOPIC, p)]


def test_issue_tombstone_dropped_before_delete_retention_ms(tmp_path):
    """clean_time has 1 s resolution: a tombstone first cleaned at x.999 s must not count as
    a whole second old 1 ms later (it was dropped 1 ms after cleaning with a 1000 ms
    delete.retention.ms)."""
    clock = ManualClock(T0 + 999)
    s = _store(tmp_path, clock, **{"delete.retention.ms": 1000})
    s.append(RecordBatch.from_records(TOPIC, [(0, 0, clock.ms(), b"a", b"1"),
                                              (0, 1, clock.ms(), b"a", None),
                                              (0, 2, clock.ms(), b"b", b"x")]))
    _compact(s, clock)
    assert _kv(s) == [(1, b"a", None), (2, b"b", b"x")]
    for step in (1, 500, 498):  # 999 ms after the first cleaning
        clock.advance(step)
        r = _compact(s, clock)
        assert r.tombstones_dropped == 0
        assert _kv(s) == [(1, b"a", None), (2, b"b", b"x")]
    clock.advance(TOMBSTONE_SLACK_MS + 1)  # well past delete.retention.ms: gone
    r = _compact(s, clock)
    assert r.tombstones_dropped == 1
    assert _kv(s) == [(2, b"b", b"x")]
    assert verify_store(s).ok


def test_issue_keyless_null_value_is_kept(tmp_path):
    """A keyless record with a null value is keyless first: never deduplicated, never expired
    as a tombstone (it was dropped once delete.retention.ms ran out)."""
    clock = ManualClock()
    s = _store(tmp_path, clock, **{"delete.retention.ms": 0})
    s.append(RecordBatch.from_records(TOPIC, [(0, 0, clock.ms(), None, None),
                                              (0, 1, clock.ms(), None, None),
                                              (0, 2, clock.ms(), b"k", None),
                                              (0, 3, clock.ms(), b"z", b"last")]))
    for _ in range(3):
        _compact(s, clock)
        clock.advance(60_000)
    assert _kv(s) == [(0, None, None), (1, None, None), (3, b"z", b"last")]
    pl = s.partition(TOPIC, 0)
    assert all(int(e["clean_time"]) == 0 for seg in pl.segments for e in seg.entries())


def test_empty_value_is_not_a_tombstone_and_empty_key_is_a_key(tmp_path):
    clock = ManualClock()
    s = _store(tmp_path, clock, **{"delete.retention.ms": 0})
    s.append(RecordBatch.from_records(TOPIC, [
        (0, 0, clock.ms(), b"", b"first"), (0, 1, clock.ms(), b"e", b"x"),
        (0, 2, clock.ms(), b"e", b""), (0, 3, clock.ms(), b"", b"second"),
        (0, 4, clock.ms(), None, b""), (0, 5, clock.ms(), None, None)]))
    _compact(s, clock)
    clock.advance(60_000)
    _compact(s, clock)
    assert _kv(s) == [(2, b"e", b""), (3, b"", b"second"), (4, None, b""), (5, None, None)]


def test_recreated_key_after_tombstone(tmp_path):
    clock = ManualClock(T0 + 250)
    s = _store(tmp_path, clock, **{"delete.retention.ms": 1000})
    s.append(RecordBatch.from_records(TOPIC, [(0, 0, clock.ms(), b"k", b"1"),
                                              (0, 1, clock.ms(), b"k", None)]))
    _compact(s, clock)
    clock.advance(5000)
    s.append(RecordBatch.from_records(TOPIC, [(0, 2, clock.ms(), b"k", b"again")]))
    _compact(s, clock)
    assert _kv(s) == [(2, b"k", b"again")]
    s.append(RecordBatch.from_records(TOPIC, [(0, 10, clock.ms(), b"k", None)]))
    _compact(s, clock)
    assert _kv(s) == [(10, b"k", None)]
    clock.advance(999)
    _compact(s, clock)
    assert _kv(s) == [(10, b"k", None)]


def test_min_compaction_lag_is_segment_granular(tmp_path):
    """A sealed segment holding one record younger than the lag stops the cleanable range, even
    though older records after it would otherwise be cleanable (Kafka's rule)."""
    clock = ManualClock(T0)
    s = _store(tmp_path, clock, **{"min.compaction.lag.ms": 10_000})
    old, young = clock.ms() - 60_000, clock.ms()
    off = 0
    for seg in range(6):
        recs = []
        while sum(len(r[4]) + 60 for r in recs) < SEGMENT_BYTES - 600:
            ts = young if (seg == 3 and not recs) else old
            recs.append((0, off, ts, b"k%d" % (off % 7), b"v" * 200))
            off += 1
        s.append(RecordBatch.from_records(TOPIC, recs))
    s.flush()
    pl = s.partition(TOPIC, 0)
    segs = [(sg.base, sg.entries()) for sg in pl.segments]
    blocker = next(base for base, e in segs if int(e["timestamp"].max()) > clock.ms() - 10_000)
    r = _compact(s, clock, force=False)
    assert r.cleaned_offset == max(int(o) for base, e in segs if base < blocker
                                   for o in e["offset"])
    # nothing at or after the blocking segment was touched
    after = [(x.offset, x.value) for x in s.iter_records(TOPIC, 0, blocker)]
    assert after == [(int(o), b"v" * 200) for base, e in segs if base >= blocker
                     for o in e["offset"]]
    clock.advance(10_001)
    r = _compact(s, clock, force=True)
    assert len([x for x in s.iter_records(TOPIC, 0)]) == 7


def test_active_segment_untouched_without_force(tmp_path):
    clock = ManualClock()
    s = _store(tmp_path, clock)
    s.append(RecordBatch.from_records(TOPIC, [(0, i, clock.ms(), b"k%d" % (i % 3), b"v" * 300)
                                              for i in range(200)]))
    s.flush()
    pl = s.partition(TOPIC, 0)
    act = pl.segments[-1]
    before = (act.base, s.fs.read(pl.log_path(act.base)), s.fs.read(pl.index_path(act.base)))
    assert len(before[1]) > 0
    r = _compact(s, clock, force=False)
    assert r.rounds >= 1
    pl = s.partition(TOPIC, 0)
    assert pl.segments[-1].base == before[0]
    assert (s.fs.read(pl.log_path(before[0])), s.fs.read(pl.index_path(before[0]))) == before[1:]
    # the active segment still holds its duplicates; a forced run rolls it and cleans them
    r = _compact(s, clock, force=True)
    assert [(o, k) for o, k, _ in _kv(s)] == [(197, b"k2"), (198, b"k0"), (199, b"k1")]


# -- the issue's test: exact rounds for many keys with a small map ----------------------------


def _many_keys(tmp_path, n: int, distinct: int, map_bytes: int, tombstone_every: int = 10):
    """n records over `distinct` keys (8-byte ids), built with from_columns, one forced
    compaction with a `map_bytes` offset map; then, with numpy over every .bcq entry: exactly
    one record per key, the key's last offset, its latest value."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, distinct, n, dtype=np.int64)
    ids[:distinct] = rng.permutation(distinct)  # every key occurs
    rng.shuffle(ids)
    offsets = np.arange(n, dtype=np.int64) * 2 + 5  # gaps in the source offsets
    kbytes = ids.astype("<u8").view(np.uint8).reshape(n, 8)
    vbytes = offsets.astype("<u8").view(np.uint8).reshape(n, 8)  # value = the offset
    tomb = (np.arange(n) % tombstone_every) == 3 if tombstone_every else np.zeros(n, bool)
    clock = ManualClock()
    s = Store.open(str(tmp_path / "big"), writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": 256 << 20})
    step = 1 << 20
    t = time.perf_counter()
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        null = tomb[lo:hi]
        voffs = np.zeros(hi - lo + 1, np.int64)
        np.cumsum(np.where(null, 0, 8), out=voffs[1:])
        vals = BytesColumn(np.ascontiguousarray(vbytes[lo:hi][~null]).reshape(-1), voffs,
                          null.copy())
        s.append(RecordBatch.from_columns(TOPIC, 0, offsets[lo:hi], clock.ms(),
                                          keys=BytesColumn.fixed(kbytes[lo:hi], 8), values=vals))
    s.flush()
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    res = Compactor(s, CompactionOptions(offset_map_memory=map_bytes), clock).compact_partition(
        TOPIC, 0, force=True)
    compact_s = time.perf_counter() - t
    max_keys = Compactor(s, CompactionOptions(offset_map_memory=map_bytes)).offset_map.max_keys
    assert res.rounds >= -(-distinct // max_keys)  # the map could not hold them in one round

    pl = s.partition(TOPIC, 0)
    e = np.concatenate([seg.entries() for seg in pl.segments])
    # exactly one record per key: as many entries as keys, all digests distinct
    assert e.shape[0] == distinct
    assert np.all(np.diff(e["offset"]) > 0)
    d = np.empty(e.shape[0], dtype=[("hi", "<u8"), ("lo", "<u8")])
    d["hi"], d["lo"] = e["digest_hi"], e["digest_lo"]
    assert np.unique(d).shape[0] == distinct
    # ... and the one kept is each key's last occurrence
    last = np.full(distinct, -1, np.int64)
    last[ids] = np.arange(n)  # later assignments win: the last index of each id
    want = np.sort(offsets[last])
    assert np.array_equal(e["offset"], want)
    assert np.array_equal((e["flags"] & B.FLAG_TOMBSTONE) != 0, tomb[(want - 5) // 2])
    assert not np.any(e["flags"] & B.FLAG_KEYLESS)
    # spot-check decoded records: key and value are the ones appended at that offset
    for o in rng.choice(want, 200, replace=False):
        i = (int(o) - 5) // 2
        r = next(s.iter_records(TOPIC, 0, int(o), limit=1))
        assert r.offset == o and r.key == kbytes[i].tobytes()
        assert r.value == (None if tomb[i] else vbytes[i].tobytes())
    s.close()
    return res, build_s, compact_s


def test_exact_rounds_2m_records_600k_keys_4mib_map(tmp_path):
    res, build_s, compact_s = _many_keys(tmp_path, 2_000_000, 600_000, 4 << 20)
    print(f"2M/600k/4MiB: build {build_s:.1f}s compact {compact_s:.1f}s rounds {res.rounds}")


@pytest.mark.slow
def test_exact_rounds_10m_records_3m_keys_16mib_map(tmp_path):
    res, build_s, compact_s = _many_keys(tmp_path, 10_000_000, 3_000_000, 16 << 20)
    print(f"10M/3M/16MiB: build {build_s:.1f}s compact {compact_s:.1f}s rounds {res.rounds}")
