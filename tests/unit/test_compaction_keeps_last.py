"""Compaction never removes a partition's last record (docs/compaction.md, "What is kept").

Kafka never cleans a partition's active segment, so a Kafka partition's last record is always
there, even a tombstone past ``delete.retention.ms``: a consumer reaching the end reads a record
at the high watermark - 1. kcompact rolls its active segment at the end of a batch job and under
``compact --force``, so the rule is stated on its own: the highest-offset record stays until a
later record is written (only an expired tombstone can be that record and be dropped otherwise;
a later record of its key or an expired tombstone never is the last one).

* the decision (``OffsetMap.decide(keep_offset=...)``) on the C kernels and on their numba
  twins (tests/unit/_oracle_compaction_kernels.py), hypothesis against the rule's model: the
  same decision as without the rule but the last record kept, counts to match;
* a partition ending in a tombstone past delete.retention.ms keeps it through forced
  compactions, on a local store and on S3 (compaction objects), with no "tombstones expired"
  trigger firing for it (the planner does not compact it again and again), and drops it once a
  later record comes;
* the compaction model (test_compaction_model.py) states the rule for every partition after
  every compaction. The Spark engine runs the same Compactor per task
  (connectors/apps/spark/compact_job.py; tests/integration/test_spark.py compares it with the
  local one).

About 5 s.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend, store_at  # noqa: E402,F401
import _oracle_compaction_kernels as CK  # noqa: E402

from kcompact.compaction import CompactionOptions, compact_store  # noqa: E402
from kcompact.compaction import offset_map as M  # noqa: E402
from kcompact.compaction import partition_status  # noqa: E402
from kcompact.reput import bcq as B  # noqa: E402
from kcompact.reput.bcq import BCQ_DTYPE  # noqa: E402
from kcompact.reput.config import ManualClock  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402
from kcompact.reput.verify import verify_store  # noqa: E402

TOPIC = "t"
T0 = 1_700_000_000_250


def _entries(rng, n: int, keys: int, tombs: float, keyless: float) -> np.ndarray:
    e = np.zeros(n, BCQ_DTYPE)
    e["offset"] = np.cumsum(rng.integers(1, 4, n)) + int(rng.integers(0, 1000))
    ids = rng.integers(0, keys, n)
    lo = rng.integers(0, 2**63, keys, dtype=np.uint64) * np.uint64(2)
    hi = rng.integers(0, 2**63, keys, dtype=np.uint64)
    e["digest_lo"], e["digest_hi"] = lo[ids], hi[ids]
    kl = rng.random(n) < keyless
    e["digest_lo"][kl] = e["digest_hi"][kl] = 0
    e["flags"] = (rng.random(n) < tombs).astype(np.uint16) | (kl.astype(np.uint16) << 1)
    e["clean_time"] = np.where(rng.random(n) < 0.6, rng.integers(1, 2000, n), 0)
    return e


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 800), keys=st.integers(1, 300),
       tombs=st.floats(0, 1), keyless=st.sampled_from([0.0, 0.2]), last_frac=st.floats(0, 1.2),
       now_s=st.integers(0, 3000), retention=st.integers(0, 2500),
       pick=st.sampled_from(["last", "any", "none", "absent"]),
       kernel=st.sampled_from(["c", "numba"]))
def test_decide_keeps_the_given_offset(seed, n, keys, tombs, keyless, last_frac, now_s,
                                       retention, pick, kernel):
    """keep_offset changes the decision at that entry only: kept, with its clean time as the
    kernel set it, and the counts moved by one (a tombstone dropped counted back)."""
    with pytest.MonkeyPatch.context() as mp:
        if kernel == "numba":
            mp.setattr(M, "KM", CK)
        _decide_case(seed, n, keys, tombs, keyless, last_frac, now_s, retention, pick)


def _decide_case(seed, n, keys, tombs, keyless, last_frac, now_s, retention, pick):
    rng = np.random.default_rng(seed)
    e = _entries(rng, n, keys, tombs, keyless)
    base = int(e["offset"][0])
    last_mapped = base + int((int(e["offset"][-1]) - base) * last_frac)
    m = M.OffsetMap(1 << 16)
    m.clear(base)
    m.insert_entries(e[e["offset"] <= last_mapped])
    keep_at = {"last": int(e["offset"][-1]), "any": int(e["offset"][int(rng.integers(0, n))]),
               "none": -1, "absent": int(e["offset"][-1]) + 1}[pick]
    keep0, clean0, c0 = m.decide(e, last_mapped, now_s, retention)
    keep, clean, c = m.decide(e, last_mapped, now_s, retention, keep_at)
    # the rule's model
    want = keep0.copy()
    want[e["offset"] == keep_at] = True
    assert np.array_equal(keep, want)
    assert np.array_equal(clean, clean0)
    changed = np.flatnonzero(keep != keep0)
    tomb = (e["flags"] & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS)) == B.FLAG_TOMBSTONE
    assert c == (c0[0] + changed.size, c0[1] - changed.size,
                 c0[2] - int(tomb[changed].sum()), c0[3])
    assert c[0] == int(keep.sum()) and c[0] + c[1] == n


def _kv(st_, p=0):
    return [(r.offset, r.key, r.value) for r in st_.iter_records(TOPIC, p)]


def _forced(st_, clock):
    """A forced compaction of the store, as `kcompact compact --force` runs it (on S3, its
    outputs in one compaction object: Store.compaction_batch)."""
    res = compact_store(st_, force=True, clock=clock,
                        options=CompactionOptions(offset_map_memory=4096))
    assert [r.skipped for r in res] == [None]
    return res[0]


def test_an_expired_tombstone_ending_the_partition_stays_until_a_later_record(store_at):
    clock = ManualClock(T0)
    url = store_at("tail")
    with Store.open(url, writer="w", create=True, clock=clock) as s:
        s.set_topic_config(TOPIC, {"delete.retention.ms": 1000, "segment.bytes": 16384})
        s.append(RecordBatch.from_records(TOPIC, [
            (0, 0, clock.ms(), b"a", b"1"), (0, 1, clock.ms(), b"b", b"x"),
            (0, 2, clock.ms(), b"b", None), (0, 3, clock.ms(), b"a", None)]))
        s.flush()
        r = _forced(s, clock)
        assert _kv(s) == [(2, b"b", None), (3, b"a", None)]  # stamped, not expired yet
        for _ in range(3):
            clock.advance(5000)  # both past delete.retention.ms: only the last one stays
            r = _forced(s, clock)
            assert _kv(s) == [(3, b"a", None)]
        assert r.records_kept == 1
        # nothing left to do for the planner: the kept tombstone triggers no compaction
        assert partition_status(s, TOPIC, 0)["compaction_due"] == []
        assert compact_store(s, clock=clock) == []
        assert s.next_offset(TOPIC, 0) == 4
        # a later record: the tombstone is an ordinary expired one again
        s.append(RecordBatch.from_records(TOPIC, [(0, 4, clock.ms(), b"c", b"y")]))
        s.flush()
        r = _forced(s, clock)
        assert r.tombstones_dropped == 1
        assert _kv(s) == [(4, b"c", b"y")]
        assert verify_store(s).ok


def test_the_planner_drops_a_tombstone_that_stopped_being_the_last(tmp_path):
    """Unforced: the record after the kept tombstone is in the active segment; the tombstone,
    expired, triggers "tombstones expired" and the planner drops it."""
    clock = ManualClock(T0)
    with Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock) as s:
        s.set_topic_config(TOPIC, {"delete.retention.ms": 0, "segment.bytes": 16384})
        s.append(RecordBatch.from_records(TOPIC, [(0, 0, clock.ms(), b"a", b"1"),
                                                  (0, 1, clock.ms(), b"a", None)]))
        s.flush()
        _forced(s, clock)
        clock.advance(3000)
        _forced(s, clock)
        assert _kv(s) == [(1, b"a", None)]
        s.append(RecordBatch.from_records(TOPIC, [(0, 2, clock.ms(), b"z", b"1")]))
        s.flush()
        assert "tombstones expired" in partition_status(s, TOPIC, 0)["compaction_due"]
        res = compact_store(s, clock=clock)
        assert [r.tombstones_dropped for r in res] == [1]
        assert _kv(s) == [(2, b"z", b"1")]


@pytest.mark.parametrize("kind", ["keyless", "value"])
def test_a_last_record_compaction_would_keep_anyway_is_unchanged(tmp_path, kind):
    """The rule changes nothing where the last record is no tombstone (the latest of its key,
    or keyless): the compaction keeps exactly what it kept before."""
    clock = ManualClock(T0)
    last = (0, 3, clock.ms(), None if kind == "keyless" else b"a", b"v")
    with Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock) as s:
        s.set_topic_config(TOPIC, {"delete.retention.ms": 0})
        s.append(RecordBatch.from_records(TOPIC, [
            (0, 0, clock.ms(), b"a", b"1"), (0, 1, clock.ms(), b"b", None),
            (0, 2, clock.ms(), b"a", b"2"), last]))
        s.flush()
        for _ in range(3):
            _forced(s, clock)
            clock.advance(3000)
        want = [(2, b"a", b"2"), (3, None, b"v")] if kind == "keyless" else [(3, b"a", b"v")]
        assert _kv(s) == want
