"""The C kernels (reput/_native.c) against the numba kernels they stand in for, on random
inputs: the same table bytes, the same counts, the same keep/clean decisions, the same output
bytes. Both run on .bcq-shaped structured arrays whose fields are strided views (48 bytes).

Also: importing the packages and running a whole compaction loads no numba (the point of the C
kernels: a compaction's memory is its map budget plus a small constant, not a JIT compiler).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction import compactor as C
from compaction import offset_map as M
from reput import _kernels as K
from reput import _native
from reput.bcq import BCQ_DTYPE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _entries(seed: int, n: int, keys: int, keyless: float, tombs: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = np.zeros(n, BCQ_DTYPE)
    e["offset"] = np.cumsum(rng.integers(1, 4, n)) + rng.integers(0, 1000)
    ids = rng.integers(0, max(keys, 1), n).astype(np.uint64)
    # digests: a fixed random 128-bit value per key id (low words collide on purpose sometimes)
    lo_tab = rng.integers(0, 2**63, max(keys, 1), dtype=np.uint64) * np.uint64(2)
    hi_tab = rng.integers(0, 2**63, max(keys, 1), dtype=np.uint64)
    lo_tab[::7] = lo_tab[0] & np.uint64(0xFFFFFFFF)  # same home slot for every 7th key
    e["digest_lo"], e["digest_hi"] = lo_tab[ids], hi_tab[ids]
    kl = rng.random(n) < keyless
    e["digest_lo"][kl] = e["digest_hi"][kl] = 0
    e["flags"] = (rng.random(n) < tombs).astype(np.uint16) | (kl.astype(np.uint16) << 1)
    e["clean_time"] = np.where(rng.random(n) < 0.5, rng.integers(1, 2000, n), 0)
    e["size"] = rng.integers(24, 200, n)
    e["position"] = np.concatenate([[0], np.cumsum(e["size"][:-1])])
    return e


def _fill(kernel, cap: int, max_keys: int, e: np.ndarray, base: int, chunk: int):
    table = np.full(cap * 4, 0xFFFFFFFF, np.uint32)
    count, i, steps = 0, 0, []
    while i < e.shape[0]:
        stop = min(e.shape[0], i + chunk)
        nxt, count, status = kernel(table, cap, max_keys, count, base, e["offset"],
                                    e["digest_lo"], e["digest_hi"], e["flags"], i, stop)
        steps.append((int(nxt), int(count), int(status)))
        if status == M.MAP_FULL:
            break
        i = int(nxt)
    return table, steps


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), keys=st.integers(1, 2000),
       cap=st.integers(16, 4096), load=st.floats(0.1, 0.95), chunk=st.integers(1, 700),
       keyless=st.sampled_from([0.0, 0.1, 1.0]), base_shift=st.integers(-5, 5))
def test_insert_and_lookup_match_numba(seed, n, keys, cap, load, chunk, keyless, base_shift):
    e = _entries(seed, n, keys, keyless, 0.1)
    base = (int(e["offset"][0]) if n else 0) + base_shift  # a negative delta is "full"
    max_keys = int(cap * load)
    t_c, s_c = _fill(_native.insert_entries, cap, max_keys, e, base, chunk)
    t_n, s_n = _fill(M._insert_entries, cap, max_keys, e, base, chunk)
    assert s_c == s_n
    assert np.array_equal(t_c, t_n)
    out_c, out_n = np.empty(n, np.int64), np.empty(n, np.int64)
    _native.lookup_many(t_c, cap, base, e["digest_lo"], e["digest_hi"], out_c)
    M._lookup_many(t_n, cap, base, e["digest_lo"], e["digest_hi"], out_n)
    assert np.array_equal(out_c, out_n)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), keys=st.integers(1, 500),
       tombs=st.floats(0, 1), keyless=st.sampled_from([0.0, 0.2]),
       last_frac=st.floats(0, 1.2), now_s=st.integers(0, 3000), retention=st.integers(0, 2500))
def test_decide_matches_numba(seed, n, keys, tombs, keyless, last_frac, now_s, retention):
    e = _entries(seed, n, keys, keyless, tombs)
    cap = 4096
    base = int(e["offset"][0]) if n else 0
    last_mapped = base + int((int(e["offset"][-1]) - base) * last_frac) if n else -1
    mapped = e[e["offset"] <= last_mapped]
    table, _ = _fill(M._insert_entries, cap, int(cap * 0.9), mapped, base, 1 << 20)
    res = []
    for kern in (_native.decide, C._decide):
        keep, clean = np.empty(n, np.bool_), np.empty(n, np.uint32)
        counts = kern(table, cap, base, last_mapped, now_s, retention, e["offset"],
                      e["digest_lo"], e["digest_hi"], e["flags"], e["clean_time"], keep, clean)
        res.append((tuple(int(c) for c in counts), keep, clean))
    (cc, kc, lc), (cn, kn, ln) = res
    assert cc == cn and np.array_equal(kc, kn) and np.array_equal(lc, ln)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 500), base_out=st.integers(0, 10**9))
def test_gather_kept_matches_numba(seed, n, base_out):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, n).astype(np.int64)
    positions = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64) if n else \
        np.zeros(0, np.int64)
    src = rng.integers(0, 256, int(sizes.sum()) + 7, dtype=np.uint8)
    keep = rng.random(n) < 0.6
    outs = []
    for kern in (_native.gather_kept, C._gather_kept):
        out = np.zeros(int(sizes[keep].sum()), np.uint8)
        pos = np.full(int(keep.sum()), -1, np.int64)
        q, k = kern(src, positions, sizes, keep, out, pos, base_out)
        outs.append((int(q), int(k), out, pos))
    (q1, k1, o1, p1), (q2, k2, o2, p2) = outs
    assert (q1, k1) == (q2, k2) and np.array_equal(o1, o2) and np.array_equal(p1, p2)


@settings(max_examples=100, deadline=None)
@given(offsets=st.lists(st.integers(-2**40, 2**40), max_size=300, unique=True),
       target=st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-2**80, 2**80)))
def test_lower_bound_matches_bisect(offsets, target):
    e = np.zeros(len(offsets), BCQ_DTYPE)
    e["offset"] = sorted(offsets)
    words = e.view(np.int64) if len(offsets) else np.zeros(0, np.int64)
    got = _native.lower_bound_strided(words, 6, len(offsets), target)
    want = int(np.searchsorted(e["offset"], target)) if -2**63 <= target < 2**63 else \
        (0 if target < 0 else len(offsets))
    assert got == want
    if len(offsets) and -2**63 <= target < 2**63:
        assert got == int(K.lower_bound_strided(words, 6, len(offsets), target))


def test_bad_arguments_are_errors_not_crashes():
    table = np.full(64, 0xFFFFFFFF, np.uint32)
    e = np.zeros(4, BCQ_DTYPE)
    with pytest.raises(ValueError):  # stop beyond the arrays
        _native.insert_entries(table, 16, 10, 0, 0, e["offset"], e["digest_lo"],
                               e["digest_hi"], e["flags"], 0, 99)
    with pytest.raises(ValueError):  # a table shorter than its capacity
        _native.insert_entries(table, 1000, 10, 0, 0, e["offset"], e["digest_lo"],
                               e["digest_hi"], e["flags"], 0, 4)
    with pytest.raises(TypeError):  # wrong item size
        _native.lookup_many(table, 16, 0, e["offset"].astype(np.int32), e["digest_hi"],
                            np.empty(4, np.int64))
    with pytest.raises(ValueError):  # a record outside its buffer
        _native.gather_kept(np.zeros(10, np.uint8), np.array([5], np.int64),
                            np.array([20], np.int64), np.array([True]), np.zeros(20, np.uint8),
                            np.zeros(1, np.int64), 0)
    with pytest.raises(TypeError):
        _native.decide(table)


def test_a_compaction_loads_no_jit_compiler(tmp_path):
    """Build a store (numba kernels) in one process, compact it in another: the compacting
    process imports numba nowhere."""
    store = str(tmp_path / "s")
    build = (
        "import sys; sys.path.insert(0, {root!r})\n"
        "from reput import Store\n"
        "from reput.record import RecordBatch\n"
        "st = Store.open({store!r}, writer='w', create=True)\n"
        "st.append(RecordBatch.from_records('t', [(0, i, 0, b'k%d' % (i % 50), None if i % 9 == 0"
        " else b'v' * 40, []) for i in range(5000)]))\n"
        "st.flush(); st.close()\n")
    compact = (
        "import sys; sys.path.insert(0, {root!r})\n"
        "from reput import Store\n"
        "from compaction import Compactor, CompactionOptions\n"
        "st = Store.open({store!r})\n"
        "r = Compactor(st, CompactionOptions(offset_map_memory=1 << 20)).compact_partition("
        "'t', 0, force=True)\n"
        "assert r.skipped is None and r.records_dropped > 4000, r\n"
        "print('numba' in sys.modules, r.records_kept)\n")
    subprocess.run([sys.executable, "-c", build.format(root=ROOT, store=store)], check=True)
    out = subprocess.run([sys.executable, "-c", compact.format(root=ROOT, store=store)],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == "False", out
    assert int(out[1]) == 50  # one record per key (some of them tombstones kept)
