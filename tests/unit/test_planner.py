"""The compaction planner (compaction/planner.py), topic configs, and the CLI's JSON reports.

Kafka's LogCleanerManager rules: a partition is picked when its dirty ratio over the sealed
segments reaches min.cleanable.dirty.ratio (default 0.5), filthiest first, or when its oldest
dirty record is older than max.compaction.lag.ms; runs of small segments are merged;
cleanup.policy=compact,delete also drops segments older than retention.ms, and a delete-only
topic is never deduplicated.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kcompact.compaction import CompactionOptions, Compactor, assess, compact_store, partition_status, plan
from kcompact.reput.config import ConfigError, ManualClock, TopicConfig
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

sys.path.insert(0, os.path.dirname(__file__))
from _stores import backend, shared_store_at, store_at  # noqa: E402,F401  (by backend)

TOPIC = "t"
SEG = 16384
OPTS = CompactionOptions(offset_map_memory=1 << 16)
KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")


class Writer:
    """Appends records of ~330 bytes (about 48 per 16 KiB segment) to a partition. Values are
    random bytes: sealed segments (store format 2, compressed) keep about their size, so the
    segment counts and dirty ratios below do not depend on how well values compress."""

    def __init__(self, store: Store, clock: ManualClock):
        self.s, self.clock = store, clock
        self.next = {}

    def put(self, p: int, keys, value_len: int = 300, ts: int | None = None, tomb=False):
        off = self.next.get(p, 0)
        recs = []
        for k in keys:
            recs.append((p, off, self.clock.ms() if ts is None else ts,
                         k if k is None else (k if isinstance(k, bytes) else b"k%d" % k),
                         None if tomb else b"%d:" % off + random.Random(off).randbytes(
                             value_len)))
            off += 1
        self.next[p] = off
        self.s.append(RecordBatch.from_records(TOPIC, recs))
        self.s.flush()


def new_store(where, clock, name="s", **cfg) -> Store:
    """A store at ``where/name`` (tmp_path), or at ``where(name)`` (a ``store_at`` factory)."""
    url = where(name) if callable(where) else str(where / name)
    if url.startswith("s3://"):  # per-partition uploads: the segments these tests plan on
        Store.create(url, clock=clock).close()
    s = Store.open(url, writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": SEG, **cfg})
    return s


def sealed_dirty_ratio(s: Store, p: int) -> float:
    """Dirty bytes / bytes over the sealed segments, computed here from the .bcq entries."""
    pl = s.partition(TOPIC, p)
    cleaned = pl.checkpoint()[0]
    clean = dirty = 0
    for seg in pl.sealed_segments:
        e = seg.entries()
        d = e["offset"] > cleaned
        dirty += int(e["size"][d].sum())
        clean += int(e["size"][~d].sum())
    return dirty / (clean + dirty)


def records(s: Store, p: int = 0):
    return [(r.offset, r.key, r.value) for r in s.iter_records(TOPIC, p)]


# -- dirty ratio -------------------------------------------------------------------------------


def test_default_min_cleanable_dirty_ratio_is_half():
    assert TopicConfig().min_cleanable_dirty_ratio == 0.5
    assert TopicConfig().to_dict()["min.cleanable.dirty.ratio"] == 0.5


def test_dirty_ratio_threshold_and_filthiest_first(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock)
    w = Writer(s, clock)
    # three partitions with 8 clean segments each (unique keys, then a forced compaction)
    for p in (0, 1, 2):
        w.put(p, range(p * 1000, p * 1000 + 400))
    for r in compact_store(s, force=True, options=OPTS, clock=clock):
        assert r.rounds >= 1
    assert plan(s, clock=clock) == []
    # dirty data (updates of existing keys): p0 a little, p1 more, p2 most
    w.put(0, range(0, 120))
    w.put(1, range(1000, 1500))
    w.put(2, range(2000, 2400))
    w.put(2, range(2000, 2400))
    ratios = {p: sealed_dirty_ratio(s, p) for p in (0, 1, 2)}
    assert ratios[0] < 0.5 < ratios[1] < ratios[2]
    assert assess(s, TOPIC, 0, clock) is None
    picked = plan(s, clock=clock)
    assert [c.partition for c in picked] == [2, 1]  # filthiest first; p0 is below 0.5
    for c in picked:
        assert c.dirty_ratio == pytest.approx(ratios[c.partition])
        assert c.reason.startswith("dirty ratio")
    before0 = records(s, 0)
    results = compact_store(s, options=OPTS, clock=clock)
    assert [r.partition for r in results] == [2, 1]
    assert records(s, 0) == before0  # not picked, not touched
    for r in results:  # deduplicated up to the horizon (the active segment is not cleaned)
        keys = [k for o, k, _ in records(s, r.partition) if o <= r.cleaned_offset]
        assert len(keys) == len(set(keys))
    assert plan(s, clock=clock) == []
    # a lower threshold picks p0
    assert ratios[0] > 0.1
    s.set_topic_config(TOPIC, {"min.cleanable.dirty.ratio": 0.1})
    assert [c.partition for c in plan(s, clock=clock)] == [0]
    assert verify_store(s).ok


def test_max_compaction_lag_forces_a_pick(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock, **{"max.compaction.lag.ms": 60_000})
    w = Writer(s, clock)
    w.put(0, range(400))
    compact_store(s, force=True, options=OPTS, clock=clock)
    w.put(0, range(60))  # updates: dirty, far below the 0.5 ratio
    w.put(0, range(1000, 1060))  # ... and seal them behind fresh records
    assert 0 < sealed_dirty_ratio(s, 0) < 0.5
    assert plan(s, clock=clock) == []
    clock.advance(59_000)
    assert plan(s, clock=clock) == []
    clock.advance(1_001)
    (c,) = plan(s, clock=clock)
    assert c.reason == "max.compaction.lag.ms"
    h0 = partition_status(s, TOPIC, 0)["compaction_horizon"]
    (r,) = compact_store(s, options=OPTS, clock=clock)
    assert r.rounds >= 1 and r.cleaned_offset > h0
    keys = [k for o, k, _ in records(s, 0) if o <= r.cleaned_offset]
    assert len(keys) == len(set(keys))


# -- merging small segments ---------------------------------------------------------------------


def test_dirty_small_segments_are_merged(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock)
    w = Writer(s, clock)
    for i in range(12):  # twelve short flushes, each sealed: 12 segments of 5 records
        w.put(0, range(i * 5, i * 5 + 5))
        s.writable_partition(TOPIC, 0).roll()
    before = records(s, 0)
    (c,) = plan(s, clock=clock)
    (r,) = compact_store(s, options=OPTS, clock=clock)
    assert r.segments_after < r.segments_before
    pl = s.partition(TOPIC, 0)
    assert len(pl.segments) <= -(-pl.size_bytes() // SEG) + 1  # packed full, plus the active one
    assert records(s, 0) == before  # unique keys: nothing dropped, offsets unchanged
    assert verify_store(s).ok


def test_clean_small_segments_are_merged(store_at):
    """After segment.bytes is raised, the clean 16 KiB segments are 'small': the planner picks
    the partition for them, and the compaction it runs must merge them (not only --force)."""
    clock = ManualClock()
    s = new_store(store_at, clock)
    w = Writer(s, clock)
    w.put(0, range(500))
    compact_store(s, force=True, options=OPTS, clock=clock)
    before = records(s, 0)
    n0 = len(s.partition(TOPIC, 0).segments)
    assert n0 >= 10
    s.set_topic_config(TOPIC, {"segment.bytes": 1 << 20})
    (c,) = plan(s, clock=clock)
    assert "small segments" in c.reason
    (r,) = compact_store(s, options=OPTS, clock=clock)
    assert r.segments_after < r.segments_before == n0
    assert records(s, 0) == before
    assert plan(s, clock=clock) == []  # and it is not picked again
    assert verify_store(s).ok


# -- cleanup.policy -----------------------------------------------------------------------------


def test_compact_delete_drops_segments_older_than_retention(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock, **{"cleanup.policy": "compact,delete",
                                      "retention.ms": 3_600_000})
    w = Writer(s, clock)
    old = clock.ms() - 7_200_000
    w.put(0, range(300), ts=old)             # ~6 segments, all older than retention.ms
    w.put(0, [5, 6, 7] * 40, ts=clock.ms())  # recent, overwriting three old keys
    pl = s.partition(TOPIC, 0)
    limit = clock.ms() - 3_600_000
    expired = []
    for seg in pl.segments[:-1]:
        if int(seg.entries()["timestamp"].max()) >= limit:
            break
        expired.append(seg.base)
    assert len(expired) >= 4
    (c,) = plan(s, clock=clock)
    assert c.reason == "retention.ms"
    (r,) = compact_store(s, options=OPTS, clock=clock)
    pl = s.partition(TOPIC, 0)
    bases = [seg.base for seg in pl.segments]
    assert not set(expired) & set(bases)
    first_kept = min(o for o, _, _ in records(s, 0))
    assert first_kept >= max(expired)
    # what is left is deduplicated, and keys only in dropped segments are gone
    keys = [k for o, k, _ in records(s, 0) if o <= r.cleaned_offset]
    assert len(keys) == len(set(keys))
    assert b"k1" not in {k for _, k, _ in records(s, 0)}
    assert {k for _, k, _ in records(s, 0)} >= {b"k5", b"k6", b"k7"}
    assert verify_store(s).ok


def test_compact_only_keeps_old_segments(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock, **{"retention.ms": 1000})
    w = Writer(s, clock)
    w.put(0, range(300), ts=clock.ms() - 7_200_000)
    Compactor(s, OPTS, clock).compact_partition(TOPIC, 0, force=True)
    assert len(records(s, 0)) == 300


def test_retention_minus_one_keeps_forever(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock, **{"cleanup.policy": "compact,delete", "retention.ms": -1})
    w = Writer(s, clock)
    w.put(0, range(300), ts=0)
    Compactor(s, OPTS, clock).compact_partition(TOPIC, 0, force=True)
    assert len(records(s, 0)) == 300


def test_delete_only_policy_never_deduplicates(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock, **{"cleanup.policy": "delete"})
    w = Writer(s, clock)
    w.put(0, [1, 2, 3] * 200)
    w.put(0, [1, 2], tomb=True)
    before = records(s, 0)
    assert plan(s, clock=clock) == []
    for force in (False, True):
        r = Compactor(s, OPTS, clock).compact_partition(TOPIC, 0, force=force)
        assert r.rounds == 0 and r.records_dropped == 0
        assert records(s, 0) == before
    compact_store(s, force=True, options=OPTS, clock=clock)
    assert records(s, 0) == before
    # ... while retention.ms still applies to it
    s.set_topic_config(TOPIC, {"retention.ms": 1000})
    clock.advance(10_000)
    (c,) = plan(s, clock=clock)
    assert c.reason == "retention.ms"
    compact_store(s, options=OPTS, clock=clock)
    assert len(records(s, 0)) < len(before)
    assert verify_store(s).ok


# -- configuration errors ----------------------------------------------------------------------


def test_bad_topic_config_key_names_the_key(store_at):
    clock = ManualClock()
    s = new_store(store_at, clock)
    raw = s.fs.read("store.json")
    with pytest.raises(ConfigError, match=r"cleanup\.polcy"):
        s.set_topic_config(TOPIC, {"cleanup.polcy": "compact"})
    with pytest.raises(ConfigError, match=r"min\.cleanable\.dirty\.ratio"):
        s.set_topic_config(TOPIC, {"min.cleanable.dirty.ratio": 1.5})
    with pytest.raises(ConfigError, match=r"cleanup\.policy"):
        s.set_topic_config(TOPIC, {"cleanup.policy": "compacted"})
    with pytest.raises(ConfigError, match=r"delete\.retention\.ms"):
        s.set_topic_config(TOPIC, {"delete.retention.ms": -5})
    assert s.fs.read("store.json") == raw  # nothing written


# -- the command line --------------------------------------------------------------------------


def run_cli(*args) -> dict:
    p = subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def part_doc(doc: dict, p: int) -> dict:
    (t,) = [t for t in doc["topics"] if t["topic"] == TOPIC]
    (d,) = [d for d in t["partitions"] if d["partition"] == p]
    return d


def test_cli_compact_and_inspect_json(shared_store_at):
    clock = ManualClock()
    s = new_store(shared_store_at, clock)
    w = Writer(s, clock)
    w.put(0, list(range(50)) * 8)
    w.put(1, range(100))
    s.close()
    url = shared_store_at("s")

    d0 = part_doc(run_cli("inspect", "--store", url, "--json"), 0)
    assert d0["compaction_horizon"] == -1
    assert d0["dirty_ratio"] == pytest.approx(1.0)
    assert d0["last_compaction"] is None

    out = run_cli("compact", "--store", url, "--topic", TOPIC, "--partition", "0", "--force",
                  "--offset-map-memory", "65536", "--json")
    (r,) = out["partitions"]
    assert (r["topic"], r["partition"], r["skipped"]) == (TOPIC, 0, None)
    for k in ("bytes_read", "bytes_written", "records_kept", "records_dropped", "recopy_percent",
              "rounds", "map_utilization_max", "map_bytes_per_key", "duration_s",
              "cleaned_offset", "segments_before", "segments_after"):
        assert k in r, k
    assert r["records_kept"] == 50 and r["records_dropped"] == 350
    assert r["rounds"] >= 1 and r["cleaned_offset"] == 399

    doc = run_cli("inspect", "--store", url, "--json")
    d0, d1 = part_doc(doc, 0), part_doc(doc, 1)
    assert d0["compaction_horizon"] == 399
    assert d0["dirty_ratio"] == 0.0
    assert d0["records"] == 50
    assert d0["last_compaction"]["rounds"] == r["rounds"]
    assert d0["last_compaction"]["records_kept"] == 50
    assert d1["compaction_horizon"] == -1 and d1["last_compaction"] is None

    # the store still verifies, and reopens with the compacted contents
    s = Store.open(url)
    assert verify_store(s).ok
    assert [k for _, k, _ in records(s, 0)] == [b"k%d" % i for i in range(50)]
