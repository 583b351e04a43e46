"""Issue 25: compaction that keeps its promises without --force.

* Rolls by the partition's writer: Kafka's ``segment.ms`` by record timestamp, for a compacted
  topic ``min(segment.ms, max.compaction.lag.ms)`` (KIP-354); beyond Kafka, when a writer's
  active segment has been open that long by its clock (an idle followed topic), at the end of a
  batch job (``Store.roll``), and by `kcompact compact` on a partition no writer holds. A roll is
  crash-safe.
* One assessment (compaction/assessment.py) for the planner and `inspect`, honouring
  ``min.compaction.lag.ms``, with the active segment's bytes apart.
* Triggers with reasons: dirty ratio, ``max.compaction.lag.ms``, tombstones expired.
* The I/O budget of `kcompact compact --max-bytes-per-sec`, on an injected clock.

Time is a ManualClock everywhere: no sleeps, no timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kcompact.compaction import (CompactionOptions, IOBudget, Scheduler, assess, compact_store,
                                 partition_status, plan)
from kcompact.reput import filenames as fn
from kcompact.reput.config import ConfigError, ManualClock, TopicConfig
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

sys.path.insert(0, os.path.dirname(__file__))
from test_scheduler import FakeTime  # noqa: E402  (a clock that moves only when the budget waits)

TOPIC = "t"
DAY = 86_400_000
OPTS = CompactionOptions(offset_map_memory=1 << 16)
KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")


def open_store(tmp_path, clock, name="s", **cfg) -> Store:
    s = Store.open(str(tmp_path / name), writer="w", create=True, clock=clock)
    if cfg:
        s.set_topic_config(TOPIC, cfg)
    return s


def put(s: Store, rows, p: int = 0) -> None:
    """rows: (offset, timestamp, key, value) of partition ``p``."""
    s.append(RecordBatch.from_records(TOPIC, [(p, o, ts, k, v) for o, ts, k, v in rows]))
    s.flush()


def bases(s: Store, p: int = 0) -> list[int]:
    return [seg.base for seg in s.partition(TOPIC, p).segments]


def contents(s: Store, p: int = 0) -> list[tuple]:
    return [(r.offset, r.key, r.value) for r in s.iter_records(TOPIC, p)]


def latest_per_key(rows: list[tuple]) -> list[tuple]:
    last = {}
    for off, k, v in rows:
        last[k] = (off, k, v)
    return sorted(r for r in last.values() if r[2] is not None)


# -- segment.ms ---------------------------------------------------------------------------------


def test_segment_ms_is_a_topic_config_and_the_roll_time_follows_kip_354():
    assert TopicConfig().segment_ms == 7 * DAY
    assert TopicConfig().to_dict()["segment.ms"] == 7 * DAY
    assert TopicConfig().roll_ms == 7 * DAY  # max.compaction.lag.ms defaults to "never"
    lag = TopicConfig.from_dict({"max.compaction.lag.ms": 60_000})
    assert lag.roll_ms == 60_000
    assert lag.with_overrides({"segment.ms": 1000}).roll_ms == 1000
    # a topic that is not compacted rolls at segment.ms alone
    assert lag.with_overrides({"cleanup.policy": "delete"}).roll_ms == 7 * DAY
    with pytest.raises(ConfigError, match=r"segment\.ms"):
        TopicConfig.from_dict({"segment.ms": 0})
    # a store.json written before segment.ms existed reads with the default
    old = TopicConfig().to_dict()
    del old["segment.ms"]
    assert TopicConfig.from_dict(old).segment_ms == 7 * DAY


@pytest.mark.parametrize("batched", [True, False])
def test_a_record_segment_ms_past_the_first_rolls(tmp_path, batched):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"segment.ms": 1000})
    t0 = clock.ms()
    rows = [(0, t0, b"a", b"0"), (1, t0 + 500, b"b", b"1"), (2, t0 + 1000, b"c", b"2"),
            (3, t0 + 1001, b"d", b"3"), (4, t0 + 1500, b"e", b"4"), (5, t0 + 2002, b"f", b"5")]
    if batched:
        put(s, rows)
    else:
        for r in rows:
            put(s, [r])
    # 1000 ms is allowed, 1001 past the first record rolls; the new segment counts from its own
    assert bases(s) == [0, 3, 5]
    s.close()
    # the rule survives a reopen (the active segment's first timestamp comes from its index)
    s = open_store(tmp_path, clock)
    put(s, [(6, t0 + 2500, b"g", b"6"), (7, t0 + 3003, b"h", b"7")])
    assert bases(s) == [0, 3, 5, 7]
    assert [o for o, _, _ in contents(s)] == list(range(8))
    assert verify_store(s).ok
    s.close()


def test_a_compacted_topic_rolls_at_max_compaction_lag(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"max.compaction.lag.ms": 1000})
    t0 = clock.ms()
    put(s, [(i, t0 + i * 400, b"k", b"%d" % i) for i in range(6)])  # 0 .. 2000 ms
    assert bases(s) == [0, 3]  # 1200 > 1000 past offset 0
    s.set_topic_config(TOPIC, {"cleanup.policy": "delete"})  # max.compaction.lag.ms no longer
    put(s, [(i, t0 + i * 400, b"k", b"%d" % i) for i in range(6, 10)])
    assert bases(s) == [0, 3]
    s.close()


def test_records_without_a_timestamp_never_roll(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"segment.ms": 1000})
    put(s, [(0, -1, b"a", b"0"), (1, clock.ms(), b"b", b"1"), (2, -1, b"c", b"2"),
            (3, clock.ms() + 900, b"d", b"3")])
    assert bases(s) == [0]
    s.close()


def test_roll_if_due_counts_the_active_segment_age_on_the_writers_clock(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"max.compaction.lag.ms": 60_000})
    put(s, [(0, clock.ms() - 10 * DAY, b"a", b"old timestamp")])  # its age is the writer's
    pl = s.writable_partition(TOPIC, 0)
    assert not pl.roll_if_due() and s.roll(only_due=True) == 0
    clock.advance(60_000)
    assert s.roll(only_due=True) == 0  # not past the roll time yet
    clock.advance(1)
    assert s.roll(only_due=True) == 1
    assert bases(s) == [0, 1]
    clock.advance(DAY)
    assert not pl.roll_if_due()  # an empty active segment is never rolled
    assert bases(s) == [0, 1]
    s.close()


def test_a_batch_jobs_roll_and_the_empty_active_segment(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock)
    put(s, [(i, clock.ms(), b"k%d" % (i % 3), b"%d" % i) for i in range(9)])
    assert s.roll() == 1 and bases(s) == [0, 9]
    assert s.roll() == 0 and bases(s) == [0, 9]  # nothing appended since: no pile-up
    s.close()
    s = open_store(tmp_path, clock)
    put(s, [(9, clock.ms(), b"k0", b"9")])
    assert bases(s) == [0, 9]
    assert verify_store(s).ok
    s.close()


def test_a_roll_interrupted_between_its_files_recovers(tmp_path):
    """A crash after the new segment's .log was created and before its .bcq: the next writer
    finds an empty active segment without an index and goes on appending after it."""
    clock = ManualClock()
    s = open_store(tmp_path, clock)
    put(s, [(i, clock.ms(), b"k%d" % i, b"v") for i in range(5)])
    s.roll()
    s.close()
    pdir = tmp_path / "s" / fn.partition_dir(TOPIC, 0)
    (pdir / (fn.base_name(5) + fn.INDEX_SUFFIX)).unlink()
    s = open_store(tmp_path, clock)
    put(s, [(i, clock.ms(), b"k%d" % i, b"w") for i in range(5, 8)])
    assert bases(s) == [0, 5]
    assert [o for o, _, _ in contents(s)] == list(range(8))
    assert verify_store(s).ok
    s.close()


# -- plain compact on a store at rest ------------------------------------------------------------


def written_before_rolls(tmp_path, clock) -> str:
    """A store whose only segment is its active one (what kcompact wrote before rolls):
    300 updates of 30 keys."""
    s = open_store(tmp_path, clock)
    put(s, [(i, clock.ms(), b"k%d" % (i % 30), b"%d:" % i + b"v" * 100) for i in range(300)])
    s.close()
    return str(tmp_path / "s")


def test_compact_rolls_an_active_segment_no_writer_holds(tmp_path):
    clock = ManualClock()
    url = written_before_rolls(tmp_path, clock)
    ro = Store.open(url, clock=clock)
    before = contents(ro)
    st = partition_status(ro, TOPIC, 0)
    assert st["dirty_ratio"] == 0.0 and st["active_bytes"] > 0 and st["compaction_due"] == []
    assert plan(ro, clock=clock) == []
    (r,) = compact_store(ro, options=OPTS, clock=clock)
    assert r.reason == "dirty ratio 1.00" and r.records_kept == 30 and r.cleaned_offset == 299
    assert contents(ro) == latest_per_key(before)
    st = partition_status(ro, TOPIC, 0)
    assert (st["dirty_ratio"], st["active_bytes"], st["compaction_horizon"]) == (0.0, 0, 299)
    assert compact_store(ro, options=OPTS, clock=clock) == []  # nothing new: nothing to do
    assert verify_store(ro).ok


def test_compact_leaves_a_partition_a_live_writer_holds(tmp_path):
    clock = ManualClock()
    url = written_before_rolls(tmp_path, clock)
    w = Store.open(url, writer="w", clock=clock)
    w.writable_partition(TOPIC, 0)  # a live mirror holds it
    ro = Store.open(url, clock=clock)
    assert compact_store(ro, options=OPTS, clock=clock) == []
    assert bases(ro) == [0] and len(contents(ro)) == 300
    w.close()


def test_after_a_batch_roll_the_partition_is_all_dirty_and_compacts(tmp_path):
    """The issue's transcript in one process: a batch job ends (its roll), inspect says 1.00
    dirty and why it is due, and plain compaction compacts it."""
    clock = ManualClock()
    s = open_store(tmp_path, clock)
    put(s, [(i, clock.ms(), b"k%d" % (i % 30), b"%d:" % i + b"v" * 100) for i in range(300)])
    s.roll()
    s.close()
    ro = Store.open(str(tmp_path / "s"), clock=clock)
    st = partition_status(ro, TOPIC, 0)
    assert st["dirty_ratio"] == 1.0 and st["active_bytes"] == 0
    assert st["compaction_due"] == ["dirty ratio 1.00"]
    (c,) = plan(ro, clock=clock)
    assert c.dirty_ratio == st["dirty_ratio"] and c.reasons == st["compaction_due"]
    (r,) = compact_store(ro, options=OPTS, clock=clock)
    assert r.records_kept == 30 and r.reason == "dirty ratio 1.00"


# -- one assessment: min.compaction.lag.ms, triggers and their reasons -----------------------------


def test_min_compaction_lag_keeps_young_bytes_out_of_the_dirty_ratio(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"min.compaction.lag.ms": 60_000})
    put(s, [(i, clock.ms(), b"k%d" % (i % 5), b"v" * 100) for i in range(50)])
    s.roll()
    st = partition_status(s, TOPIC, 0)
    assert st["dirty_bytes"] == 0 and st["uncleanable_bytes"] > 0 and st["dirty_ratio"] == 0.0
    assert st["compaction_due"] == [] and plan(s, clock=clock) == []
    clock.advance(60_001)
    st = partition_status(s, TOPIC, 0)
    assert st["uncleanable_bytes"] == 0 and st["dirty_ratio"] == 1.0
    (c,) = plan(s, clock=clock)
    assert c.reason == "dirty ratio 1.00"
    s.close()


def test_expired_tombstones_trigger_a_compaction(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"delete.retention.ms": 60_000})
    put(s, [(i, clock.ms(), b"k%d" % i, b"v") for i in range(10)]
        + [(10 + i, clock.ms(), b"k%d" % i, None) for i in range(5)])
    s.roll()
    (r,) = compact_store(s, options=OPTS, clock=clock)
    assert r.reason == "dirty ratio 1.00" and r.tombstones_dropped == 0  # stamped, kept
    assert sum(v is None for _, _, v in contents(s)) == 5
    assert plan(s, clock=clock) == [] and partition_status(s, TOPIC, 0)["compaction_due"] == []
    clock.advance(61_000)  # delete.retention.ms has run out since the first clean
    assert partition_status(s, TOPIC, 0)["compaction_due"] == ["tombstones expired"]
    (c,) = plan(s, clock=clock)
    assert c.reasons == ["tombstones expired"]
    (r,) = compact_store(s, options=OPTS, clock=clock)
    # (the partition's last record, a tombstone, stays: compaction never removes it)
    assert r.reason == "tombstones expired" and r.tombstones_dropped == 4
    assert contents(s) == [(i, b"k%d" % i, b"v") for i in range(5, 10)] + [(14, b"k4", None)]
    assert plan(s, clock=clock) == []
    assert verify_store(s).ok
    s.close()


def test_every_trigger_that_fires_is_a_reason(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"max.compaction.lag.ms": 60_000})
    put(s, [(i, clock.ms(), b"k%d" % (i % 3), b"v") for i in range(30)])
    s.roll()
    clock.advance(60_001)
    c = assess(s, TOPIC, 0, clock)
    assert c.reasons == ["dirty ratio 1.00", "max.compaction.lag.ms"]
    assert partition_status(s, TOPIC, 0)["compaction_due"] == c.reasons
    (r,) = compact_store(s, options=OPTS, clock=clock)
    assert r.reason == "dirty ratio 1.00, max.compaction.lag.ms"
    s.close()


# -- a long-running writer: rolls when due, then compacts (the Scheduler) --------------------------


def test_scheduler_converges_within_max_compaction_lag(tmp_path):
    """A followed small topic: its only segment is active, far under segment.bytes. Once the
    active segment has been open for max.compaction.lag.ms, one scheduler run rolls it and
    compacts the partition to one record per key, without --force."""
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"max.compaction.lag.ms": 60_000})
    rows = [(i, clock.ms(), b"k%d" % (i % 4), b"%d" % i) for i in range(40)]
    put(s, rows)
    sched = Scheduler(s, OPTS, clock=clock)
    assert sched.run_once() == [] and bases(s) == [0]
    clock.advance(30_000)
    put(s, [(40, clock.ms(), b"k0", b"40")])  # still appended to: the age counts from the first
    clock.advance(30_001)
    (r,) = sched.run_once()
    assert "max.compaction.lag.ms" in r.reason
    expected = latest_per_key([(o, k, v) for o, _, k, v in rows] + [(40, b"k0", b"40")])
    assert contents(s) == expected and len(expected) == 4
    assert sched.run_once() == []
    assert verify_store(s).ok
    s.close()


def test_scheduler_of_a_replica_rolls_the_partitions_it_pulls_into(tmp_path):
    """`replicate --follow`: a store without a commit-log writer appends pulled records to the
    live partitions it holds (``PartitionLog.append``); its Scheduler rolls them when due too."""
    from kcompact.reput.record import encode_batch, scan
    clock = ManualClock()
    s = Store.open(str(tmp_path / "replica"), create=True, clock=clock)
    s.set_topic_config(TOPIC, {"max.compaction.lag.ms": 60_000})
    rows = [(0, i, clock.ms(), b"k%d" % (i % 4), b"%d" % i) for i in range(40)]
    buf, _ = encode_batch(RecordBatch.from_records(TOPIC, rows))
    with s.lock:
        live = s.writable_partition(TOPIC, 0)
        live.append(buf, scan(buf, secret=s.secret), 0, len(rows))
        live.sync()
    sched = Scheduler(s, OPTS, clock=clock)
    assert sched.run_once() == []
    clock.advance(60_001)
    (r,) = sched.run_once()
    assert "max.compaction.lag.ms" in r.reason
    assert contents(s) == latest_per_key([(o, k, v) for _, o, _, k, v in rows])
    s.close()


# -- the I/O budget --------------------------------------------------------------------------------


def test_compact_is_paced_by_its_budget_index_reads_included(tmp_path):
    clock = ManualClock()
    s = open_store(tmp_path, clock, **{"delete.retention.ms": 60_000, "segment.bytes": 16384})
    put(s, [(i, clock.ms(), b"k%d" % (i % 50), b"v" * 300) for i in range(400)]
        + [(400 + i, clock.ms(), b"k%d" % i, None) for i in range(10)])
    s.roll()
    ft = FakeTime()
    bps = 50_000
    budget = IOBudget(bps, monotonic=ft.monotonic, wait=ft.wait)
    (r,) = compact_store(s, options=OPTS, clock=clock, budget=budget)
    assert budget.bytes >= r.bytes_read + r.bytes_written > 0
    assert sum(ft.waits) == pytest.approx(budget.bytes / bps)
    assert ft.now - 100.0 == pytest.approx(budget.bytes / bps)
    # a purge of expired tombstones reads indexes first: those reads are charged as well
    clock.advance(61_000)
    before = budget.bytes
    (r,) = compact_store(s, options=OPTS, clock=clock, budget=budget)
    # (the last, the partition's last record, stays)
    assert r.reason == "tombstones expired" and r.tombstones_dropped == 9
    assert budget.bytes - before > r.bytes_written
    s.close()


def test_cli_compact_max_bytes_per_sec_and_inspect(tmp_path):
    clock = ManualClock()
    url = written_before_rolls(tmp_path, clock)
    p = subprocess.run([KCOMPACT, "inspect", "--store", url], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    header, row = p.stdout.splitlines()[1:3]
    assert "ACTIVE" in header and "DUE" in header
    assert row[header.index("DIRTY"):].split()[0] == "0.00"
    assert row[header.index("DUE"):].split()[0] == "-"
    p = subprocess.run([KCOMPACT, "compact", "--store", url, "--max-bytes-per-sec", "1g"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "rolled the active segment of t-0" in p.stderr
    assert p.stdout.startswith("t-0 (dirty ratio 1.00): ")
    doc = json.loads(subprocess.run([KCOMPACT, "inspect", "--store", url, "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    (part,) = doc["topics"][0]["partitions"]
    assert part["records"] == 30 and part["dirty_ratio"] == 0.0
    assert part["compaction_due"] == [] and part["last_compaction"]["reason"] == "dirty ratio 1.00"
