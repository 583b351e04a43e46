"""PartitionLog.append(clean_upto=, clean_time_s=): a replica indexes the tombstones its master
already compacted as cleaned when it pulls them (bcq.md, clean_time), so its forced compaction
has nothing to restamp below the master's horizon (it only seals what it pulled into format 2)."""

from __future__ import annotations

import time

import numpy as np

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import MemoryBackend, Store
from kcompact.reput.partition import PartitionLog
from kcompact.reput.record import RecordBatch, encode_batch, scan

TOPIC = "t"


def _batch(n: int) -> RecordBatch:
    # every 5th record a keyed tombstone, every 7th keyless (a keyless tombstone when both)
    return RecordBatch.from_records(TOPIC, [
        (0, i, 1_700_000_000_000 + i, None if i % 7 == 0 else b"k%d" % i,
         None if i % 5 == 0 else b"v", []) for i in range(n)])


def test_tombstones_at_or_below_clean_upto_are_stamped_keyless_and_later_ones_not():
    st = Store.open("memory://s", fs=MemoryBackend(), writer="w", create=True)
    buf, _ = encode_batch(_batch(100))
    s = scan(buf, secret=st.secret)
    pl = st.writable_partition(TOPIC, 0)
    pl.append(buf, s, 0, len(s), clean_upto=60, clean_time_s=1_700_000_123)
    e = np.concatenate([seg.entries() for seg in pl.segments])
    keyed_tomb = (e["flags"] & 3) == 1
    upto = e["offset"] <= 60
    assert (e["clean_time"][keyed_tomb & upto] == 1_700_000_123).all()
    assert (e["clean_time"][~(keyed_tomb & upto)] == 0).all()
    assert (keyed_tomb & upto).sum() > 5 and (keyed_tomb & ~upto).sum() > 3


def test_forced_compaction_after_a_stamped_pull_rewrites_nothing_that_was_clean():
    st = Store.open("memory://s", fs=MemoryBackend(), writer="w", create=True)
    buf, _ = encode_batch(_batch(100))
    s = scan(buf, secret=st.secret)
    pl = st.writable_partition(TOPIC, 0)
    # stamped now: well inside delete.retention.ms (24 h), so every tombstone is kept
    pl.append(buf, s, 0, len(s), clean_upto=99, clean_time_s=int(time.time()))
    st.flush()
    before = np.concatenate([seg.entries() for seg in pl.segments])
    res = Compactor(st, CompactionOptions(offset_map_memory=1 << 16)).compact_partition(
        TOPIC, 0, force=True)
    assert res.skipped is None and res.records_dropped == 0
    # the one rewrite is the active format-1 segment sealed into format 2 (segment-v2.md):
    # no record dropped, no clean time restamped
    assert res.segments_rewritten == 1
    pl = st.partition(TOPIC, 0)
    after = np.concatenate([seg.entries() for seg in pl.segments])
    assert all(seg.format == 2 for seg in pl.segments if seg.log_size)
    assert after["offset"].tolist() == before["offset"].tolist()
    assert after["clean_time"].tolist() == before["clean_time"].tolist()
    # without the stamp the same compaction must rewrite the index to stamp the tombstones
    st2 = Store.open("memory://s2", fs=MemoryBackend(), writer="w", create=True)
    s2 = scan(buf, secret=st2.secret)
    st2.writable_partition(TOPIC, 0).append(buf, s2, 0, len(s2))
    st2.flush()
    res2 = Compactor(st2, CompactionOptions(offset_map_memory=1 << 16)).compact_partition(
        TOPIC, 0, force=True)
    assert res2.segments_rewritten >= 1 and res2.bytes_written > 0
