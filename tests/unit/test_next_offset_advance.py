"""A partition's next offset past its last record: where the source goes on after transaction
markers or aborted records (``Store.advance_next_offset``, the store sink's positions).

A mirror reads read_committed: a partition of the source that ends in a commit or an abort marker
(or aborted records) ends past the last record the store holds. The mirror's consumer position
(its end-of-partition offset) is handed to the store sink's ``pre_commit``; the next flush makes
it the partition's next offset, durable in the segment list (local) or the manifest (S3), so the
store's end offset is the source's and a restarted mirror resumes there. Checked on both
backends: not before the flush, kept across a reopen, a compaction that empties the tail and a
roll, never moved back, and new records append after it.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from kcompact.compaction import CompactionOptions, compact_store
from kcompact.reput import ManualClock, Store
from kcompact.reput.record import RecordBatch

sys.path.insert(0, os.path.dirname(__file__))
from _stores import backend, store_at  # noqa: E402,F401


def _rows(offsets, key=b"k", value=b"v"):
    return RecordBatch.from_records("t", [(0, o, 1000 + o, key, value) for o in offsets])


def _next(url: str) -> int:
    with Store.open(url) as ro:
        return ro.next_offset("t", 0)


def test_the_flush_makes_it_the_next_offset_and_it_lasts(store_at):
    url = store_at()
    with Store.open(url, writer="w", create=True) as s:
        s.append(_rows(range(10)))
        s.flush()
        s.advance_next_offset("t", 0, 12)   # a commit marker at 10, then an abort marker at 11
        assert _next(url) == 10              # not before the records below are durable
        s.flush()
        assert s.next_offset("t", 0) == 12 and _next(url) == 12
        s.advance_next_offset("t", 0, 11)   # never back
        s.flush()
        assert _next(url) == 12
    assert _next(url) == 12
    with Store.open(url, writer="w") as s:  # a writer resumes there, and appends after it
        assert s.next_offset("t", 0) == 12
        assert s.append(_rows([12, 13], key=b"k2")) == 2
        s.flush()
        s.advance_next_offset("t", 0, 20)
    assert _next(url) == 20                 # (the close flushed it)
    with Store.open(url) as ro:
        assert [r.offset for r in ro.iter_records("t", 0)] == [*range(10), 12, 13]


def test_a_compaction_and_a_roll_keep_it(store_at):
    url = store_at()
    with Store.open(url, writer="w", create=True) as s:
        s.set_topic_config("t", {"cleanup.policy": "compact", "min.compaction.lag.ms": 0,
                                 "delete.retention.ms": 0})
        s.append(_rows(range(5)))
        s.append(RecordBatch.from_records("t", [(0, 5, 1005, b"k", None)]))  # a tombstone
        s.advance_next_offset("t", 0, 9)
    clock = ManualClock(int(time.time() * 1000))
    with Store.open(url, writer="c") as s:
        for _ in range(2):  # the tombstone is stamped, then past delete.retention.ms
            compact_store(s, topic="t", force=True, options=CompactionOptions(), clock=clock)
            clock.advance(5000)
    with Store.open(url) as ro:
        # the partition's last record, a tombstone, stays (compaction never removes it); the
        # gap after it to the source's next offset too
        assert [r.offset for r in ro.iter_records("t", 0)] == [5]
        assert ro.next_offset("t", 0) == 9
    with Store.open(url, writer="w") as s:
        pl = s.writable_partition("t", 0)
        if s.publisher.kind == "local":  # (on S3 a roll publishes local segments: none left)
            pl.roll()
            assert pl.segments[-1].base == 9
        s.append(_rows([9]))
    with Store.open(url) as ro:
        assert [r.offset for r in ro.iter_records("t", 0)] == [5, 9]
        assert ro.next_offset("t", 0) == 10


def test_an_empty_partition_starts_where_the_source_does(store_at):
    url = store_at()
    with Store.open(url, writer="w", create=True) as s:
        s.append(_rows([0]))                 # the topic exists in the store
        s.advance_next_offset("t", 1, 100)   # partition 1: retention left nothing below 100
    with Store.open(url) as ro:
        assert ro.next_offset("t", 1) == 100 and list(ro.iter_records("t", 1)) == []
    with Store.open(url, writer="w") as s:
        s.append(RecordBatch.from_records("t", [(1, 100, 1, b"a", b"b")]))
    with Store.open(url) as ro:
        assert [r.offset for r in ro.iter_records("t", 1)] == [100]
        assert ro.first_offset("t", 1) == 100 and ro.next_offset("t", 1) == 101


def test_a_read_only_store_refuses_it(tmp_path):
    Store.create(str(tmp_path)).close()
    with Store.open(str(tmp_path)) as ro:
        with pytest.raises(Exception, match="read-only"):
            ro.advance_next_offset("t", 0, 5)


def test_the_store_sink_records_the_consumers_positions(tmp_path):
    """pre_commit's offsets (the runner's positions: past markers at the end of a partition)
    become the partitions' next offsets after the records before them."""
    from kcompact.connectors.framework.api import SinkRecords, TopicPartition
    from kcompact.connectors.plugins.store_sink import STORE_SINK_CONFIG, StoreSinkTask
    url = str(tmp_path / "s")
    task = StoreSinkTask()
    task.start(STORE_SINK_CONFIG.parse({"store.url": url, "store.writer": "w"}))
    try:
        recs = SinkRecords(["t"] * 3, [0, 0, 0], [0, 1, 2], [5, 6, 7], [b"a", b"b", b"c"],
                           [b"1", b"2", b"3"], [None] * 3)
        task.put(recs)
        tp = TopicPartition("t", 0)
        assert task.pre_commit({tp: 3}) == {}       # the position after the last record
        task.flush({})
        assert _next(url) == 3
        assert task.pre_commit({tp: 5}) == {}       # a commit marker at 3, an abort at 4
        task.flush({})
        assert _next(url) == 5
    finally:
        task.stop()
    assert _next(url) == 5
