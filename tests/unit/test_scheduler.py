"""kcompact.compaction.Scheduler: the planner in the background of a long-running process, one partition
at a time, within an I/O budget (compaction/planner.py); and the store sink's property that sets
that budget. Time is injected: the budget's pace is checked against a fake clock whose only way
forward is the budget's own wait, never against wall-clock timings. Liveness (a thread that
finishes) is awaited with generous deadlines."""

from __future__ import annotations

import time

import pytest

from kcompact.compaction import (CompactionError, CompactionOptions, CompactionStopped, IOBudget,
                                 Scheduler)
from kcompact.reput.config import ManualClock
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

TOPIC = "t"
SEG = 16384
MAP = 1 << 16
LIVENESS_S = 60.0  # how long a thread may take to get somewhere before the test gives up


def key(i: int) -> bytes:
    """Offsets 0-199 each have a key of their own, then 200-399 update keys k0-k19: the live
    records are spread over every segment, so compaction copies some of each."""
    return b"k%d" % (i if i < 200 else i % 20)


def dirty_store(tmp_path) -> Store:
    """Partition 0: 400 records of ~330 bytes (200 keys) in ~8 sealed 16 KiB segments and an
    active one, never compacted (dirty ratio 1.0). Partition 1: 10 records in its active
    segment (nothing cleanable)."""
    clock = ManualClock()
    s = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": SEG})
    s.append(RecordBatch.from_records(TOPIC, [
        (0, i, clock.ms(), key(i), b"%d:" % i + b"v" * 300) for i in range(400)]))
    s.append(RecordBatch.from_records(TOPIC, [
        (1, i, clock.ms(), b"k%d" % (i % 3), b"x") for i in range(10)]))
    s.flush()
    return s


def contents(s: Store, p: int) -> list[tuple]:
    return [(r.offset, r.key, r.value) for r in s.iter_records(TOPIC, p)]


def compacted(rows: list[tuple], horizon: int) -> list[tuple]:
    """Kafka's rule for a compaction up to ``horizon`` (the end of the sealed segments): the
    latest record of each key among offsets <= horizon, and every record after it."""
    last = {}
    for off, k, v in rows:
        if off <= horizon:
            last[k] = (off, k, v)
    return sorted(last.values()) + [r for r in rows if r[0] > horizon]


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.01)


class FakeTime:
    """A monotonic clock that moves only when the budget waits."""

    def __init__(self):
        self.now = 100.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False  # not stopped


# -- the scheduler ------------------------------------------------------------------------------


def test_compacts_a_dirty_partition_in_the_background(tmp_path):
    s = dirty_store(tmp_path)
    before0, before1 = contents(s, 0), contents(s, 1)
    sched = Scheduler(s, CompactionOptions(offset_map_memory=MAP), interval_s=0.01).start()
    try:
        wait_until(lambda: sched.runs >= 1, "the first background run")
    finally:
        assert sched.stop(timeout=LIVENESS_S)
    assert sched.errors == []
    (r,) = sched.results[:1]
    assert (r.topic, r.partition, r.skipped) == (TOPIC, 0, None)
    assert {(x.topic, x.partition) for x in sched.results} == {(TOPIC, 0)}  # never partition 1
    horizon = s.partition(TOPIC, 0).checkpoint()[0]
    assert horizon == r.cleaned_offset and 300 < horizon < 399  # the active segment stays dirty
    assert contents(s, 0) == compacted(before0, horizon)
    assert r.records_dropped == len(before0) - len(contents(s, 0)) > 100
    assert contents(s, 1) == before1
    assert verify_store(s).ok
    s.close()


def test_io_budget_paces_the_compaction(tmp_path):
    s = dirty_store(tmp_path)
    before = contents(s, 0)
    ft = FakeTime()
    bps = 100_000
    sched = Scheduler(s, CompactionOptions(offset_map_memory=MAP, throttle_bytes_per_s=bps),
                      monotonic=ft.monotonic, wait=ft.wait)
    (r,) = sched.run_once()  # in this thread: no background needed to check the pace
    assert contents(s, 0) == compacted(before, r.cleaned_offset)
    # every byte both passes read (index reads included: pass 1's, which bytes_read counts,
    # and the planning re-reads, which it does not) and wrote was charged, and paid for at
    # exactly the budget's rate
    charged = sched.budget.bytes
    assert charged >= r.bytes_read + r.bytes_written > 0
    assert len(ft.waits) >= 2
    assert sum(ft.waits) == pytest.approx(charged / bps)
    assert ft.now - 100.0 == pytest.approx(charged / bps)

    # unlimited (None or 0): the bytes are counted, nothing waits
    s2 = dirty_store(tmp_path / "2")
    ft2 = FakeTime()
    sched2 = Scheduler(s2, CompactionOptions(offset_map_memory=MAP, throttle_bytes_per_s=0),
                       monotonic=ft2.monotonic, wait=ft2.wait)
    (r2,) = sched2.run_once()
    assert sched2.budget.bytes == charged and ft2.waits == []
    s.close()
    s2.close()


def test_stop_is_prompt_during_a_throttled_compaction(tmp_path):
    s = dirty_store(tmp_path)
    before = contents(s, 0)
    pl = s.partition(TOPIC, 0)
    segments = [(seg.base, seg.log_size) for seg in pl.segments]
    # 1 byte/s: this compaction would take days; stop() must not wait for it
    sched = Scheduler(s, CompactionOptions(offset_map_memory=MAP, throttle_bytes_per_s=1),
                      interval_s=0.01).start()
    wait_until(lambda: sched.busy == (TOPIC, 0) and sched.budget.waited_s > 0,
               "the scheduler waiting on its I/O budget")
    assert sched.stop(timeout=LIVENESS_S), "stop() did not end the compaction thread"
    assert sched.busy is None and sched.results == [] and sched.errors == []
    # abandoned before its commit point: the partition is exactly as it was
    assert [(seg.base, seg.log_size) for seg in pl.segments] == segments
    assert contents(s, 0) == before and pl.checkpoint()[0] == -1
    assert verify_store(s).ok
    s.close()
    s = Store.open(str(tmp_path / "s"), writer="w")  # recovery discards the staged output
    assert contents(s, 0) == before and verify_store(s).ok
    s.close()


def test_stop_is_prompt_between_runs(tmp_path):
    s = dirty_store(tmp_path)
    sched = Scheduler(s, interval_s=24 * 3600.0).start()
    assert sched.stop(timeout=LIVENESS_S)
    assert sched.runs == 0
    s.close()


# -- the budget ---------------------------------------------------------------------------------


def test_io_budget_counts_the_work_time_and_pays_the_first_charge_in_full():
    ft = FakeTime()
    b = IOBudget(1000, monotonic=ft.monotonic, wait=ft.wait)
    b.charge(1000)
    assert ft.waits == [1.0]           # first charge of a run: 1000 B at 1000 B/s
    ft.now += 0.5                      # the next chunk took 0.5 s of work
    b.charge(1000)
    assert ft.waits[-1] == pytest.approx(0.5)
    ft.now += 3.0                      # slower than the budget: no wait at all
    b.charge(1000)
    assert len(ft.waits) == 2
    b.charge(500)                      # straight after: paced from the last charge
    assert ft.waits[-1] == pytest.approx(0.5)
    ft.now += 600.0                    # idle between runs is no credit for the next run
    b.restart()
    b.charge(2000)
    assert ft.waits[-1] == pytest.approx(2.0)
    assert b.bytes == 5500


def test_io_budget_stop_and_bounds():
    b = IOBudget(10, monotonic=lambda: 0.0, wait=lambda s: True)  # the wait was interrupted
    with pytest.raises(CompactionStopped, match="old segments are still in place"):
        b.charge(100)
    free = IOBudget(None, wait=lambda s: pytest.fail("an unlimited budget waited"))
    free.charge(1 << 30)
    assert free.bytes == 1 << 30
    with pytest.raises(CompactionError, match="0 = unlimited"):
        IOBudget(-1)


# -- the store sink's property ------------------------------------------------------------------


def test_store_sink_passes_its_budget_to_the_scheduler(tmp_path):
    from kcompact.connectors.errors import ConfigError
    from kcompact.connectors.plugins.store_sink import STORE_SINK_CONFIG, StoreSinkTask

    props = STORE_SINK_CONFIG.parse({
        "store.url": str(tmp_path / "s"), "store.writer": "w",
        "store.compaction.background": "true", "store.compaction.interval.ms": "3600000",
        "store.compaction.max.bytes.per.s": "8388608"})
    task = StoreSinkTask()
    task.start(props)
    try:
        assert task.scheduler.options.throttle_bytes_per_s == 8 << 20
        assert task.scheduler.budget.bytes_per_s == 8 << 20
    finally:
        task.stop()
    assert STORE_SINK_CONFIG.parse({"store.url": "x"})["store.compaction.max.bytes.per.s"] == 0
    with pytest.raises(ConfigError, match="store.compaction.max.bytes.per.s"):
        STORE_SINK_CONFIG.parse({"store.url": "x", "store.compaction.max.bytes.per.s": "-1"})
