"""Index-only outputs (docs/formats/compaction-swap.md): a compaction that drops nothing from a
(format-2) segment but stamps its tombstones' first clean_time rewrites that segment's .bcq
alone; the .log stays the same file. A crash at any rename of that swap reopens to the old or
new state."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import bcq2 as B2
from kcompact.reput import swap
from kcompact.reput.backend import LocalBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

T0 = 1_700_000_000_000
TOPIC = "t"


class Crash(Exception):
    pass


def _build(d: str) -> list[Record]:
    """One partition, three sealed segments of distinct keys (nothing to drop), a tombstone in
    each: compaction has only clean_time stamps to write."""
    s = Store.open(d, writer="w", create=True, clock=ManualClock(T0))
    s.set_topic_config(TOPIC, {"segment.bytes": 16384})
    rng = np.random.default_rng(7)  # incompressible values: sealed segments stay ~16 KiB,
    # so no two fit one segment and the compaction has nothing to merge
    recs = [Record(TOPIC, 0, o, T0, b"k%04d" % o, None if o % 7 == 3 else rng.bytes(50), ())
            for o in range(700)]
    for i in range(0, len(recs), 50):
        s.append(RecordBatch.from_records(TOPIC, recs[i:i + 50]))
    s.writable_partition(TOPIC, 0).roll()  # every segment sealed into format 2 at the flush
    s.flush()
    s.close()
    return recs


def _compact(d: str) -> None:
    clock = ManualClock(T0 + 5_000)
    s = Store.open(d, clock=clock)
    r = Compactor(s, CompactionOptions(offset_map_memory=1 << 20), clock) \
        .compact_partition(TOPIC, 0, force=True)
    assert r.skipped is None
    s.close()


def _segments(d: str) -> dict[int, tuple[int, bytes, np.ndarray]]:
    """base -> (.log inode, .log bytes, .bcq entries) of every non-empty segment."""
    s = Store.open(d)
    pl = s.partition(TOPIC, 0)
    out = {}
    for seg in pl.segments:
        if seg.log_size:
            path = s.fs.local_path(pl.log_path(seg.base))
            out[seg.base] = (os.stat(path).st_ino, s.fs.read(pl.log_path(seg.base)),
                             seg.entries().copy())
    s.close()
    return out


def _records(d: str) -> list[Record]:
    s = Store.open(d)
    try:
        return list(s.iter_records(TOPIC, 0))
    finally:
        s.close()


def test_stamp_only_rewrites_the_index_alone(tmp_path):
    d = str(tmp_path / "s")
    recs = _build(d)
    before = _segments(d)
    assert len(before) >= 3
    pdir = os.path.join(d, "partitions", TOPIC, "0")
    for base in before:  # sealed into format 2 when rolled (reput/seal.py)
        with open(os.path.join(pdir, "%020d.bcq" % base), "rb") as f:
            assert B2.is_lean(f.read(8))
    _compact(d)
    after = _segments(d)
    assert sorted(after) == sorted(before)
    stamped = 0
    for base, (ino, log, ent) in after.items():
        ino0, log0, ent0 = before[base]
        assert ino == ino0 and log == log0, "the .log must stay the same file"
        tomb = (ent["flags"] & 1) != 0
        assert (ent0["clean_time"] == 0).all()
        assert (ent["clean_time"][tomb] == (T0 + 5_000) // 1000).all()
        assert (ent["clean_time"][~tomb] == 0).all()
        same = [f for f in ent.dtype.names if f != "clean_time"]
        for f in same:
            assert np.array_equal(ent[f], ent0[f]), f
        stamped += int(tomb.sum())
    assert stamped == sum(1 for r in recs if r.value is None)
    assert _records(d) == recs
    s = Store.open(d)
    assert verify_store(s).ok
    s.close()


def test_crash_at_each_rename(tmp_path):
    """Crash at the 1st, 2nd, ... rename of the swap until the compaction gets through."""
    d0 = str(tmp_path / "s")
    recs = _build(d0)
    before = _segments(d0)
    ref = str(tmp_path / "ref")
    shutil.copytree(d0, ref)
    _compact(ref)
    final = _segments(ref)

    def strip(segs):
        return {b: (log, ent.tobytes()) for b, (_, log, ent) in segs.items()}
    states = (strip(before), strip(final))
    assert states[0] != states[1]
    orig = LocalBackend.rename
    crashes = 0
    for k in range(1, 100):
        d, crash_dir = str(tmp_path / f"s{k}"), str(tmp_path / f"crash{k}")
        shutil.copytree(d0, d)
        calls = {"n": 0}

        def hooked(self, src, dst):
            calls["n"] += 1
            if calls["n"] == k:
                shutil.copytree(d, crash_dir)
                raise Crash(k)
            return orig(self, src, dst)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LocalBackend, "rename", hooked)
            try:
                _compact(d)
            except Crash:
                pass
        if not os.path.isdir(crash_dir):
            break  # the compaction made fewer than k renames: every point was tried
        crashes += 1
        # a writer's open recovers (completes the committed swap or rolls back)
        s = Store.open(crash_dir, writer="w", clock=ManualClock(T0 + 5_000))
        pl = s.writable_partition(TOPIC, 0)
        assert not s.fs.isdir(swap.staging_dir(pl.dir))
        assert verify_store(s).ok
        s.close()
        assert strip(_segments(crash_dir)) in states, k
        assert _records(crash_dir) == recs
        shutil.rmtree(d)
        shutil.rmtree(crash_dir)
    assert crashes >= 3  # at least the .bcq renames of the three segments
