"""The C kernels (reput/_native.c: records and the index; compaction/_native.c: the offset map
and the cleaner; connectors/apps/kv/_native.c: the KV map's bulk build) against the numba kernels they stand in for, on random inputs: the same table
bytes, the same counts, the same keep/clean decisions, the same verdicts on records, the same
output bytes. Both run on .bcq-shaped structured arrays whose fields are strided views (48 bytes).

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

from kcompact.compaction import _native as CN
from kcompact.compaction import offset_map as M
from kcompact.reput import _native
from kcompact.reput.bcq import BCQ_DTYPE

import _oracle_compaction_kernels as CK  # noqa: E402  (the numba twins: tests/unit/)
import _oracle_kernels as K  # noqa: E402

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
    t_c, s_c = _fill(CN.insert_entries, cap, max_keys, e, base, chunk)
    t_n, s_n = _fill(CK.insert_entries, cap, max_keys, e, base, chunk)
    assert s_c == s_n
    assert np.array_equal(t_c, t_n)
    out_c, out_n = np.empty(n, np.int64), np.empty(n, np.int64)
    CN.lookup_many(t_c, cap, base, e["digest_lo"], e["digest_hi"], out_c)
    CK.lookup_many(t_n, cap, base, e["digest_lo"], e["digest_hi"], out_n)
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
    table, _ = _fill(CK.insert_entries, cap, int(cap * 0.9), mapped, base, 1 << 20)
    res = []
    for kern in (CN.decide, CK.decide):
        keep, clean = np.empty(n, np.bool_), np.empty(n, np.uint32)
        counts = kern(table, cap, base, last_mapped, now_s, retention, e["offset"],
                      e["digest_lo"], e["digest_hi"], e["flags"], e["clean_time"], keep, clean)
        res.append((tuple(int(c) for c in counts), keep, clean))
    (cc, kc, lc), (cn, kn, ln) = res
    assert cc == cn and np.array_equal(kc, kn) and np.array_equal(lc, ln)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 500))
def test_gather_ranges_matches_numba(seed, n):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 300, n).astype(np.int64)
    src = rng.integers(0, 256, int(lengths.sum()) + 300, dtype=np.uint8)
    starts = rng.integers(0, 300, n).astype(np.int64) + np.concatenate(
        [[0], np.cumsum(lengths[:-1])]).astype(np.int64) if n else np.zeros(0, np.int64)
    outs = []
    for kern in (_native.gather_ranges, K.gather_ranges):
        out = np.zeros(int(lengths.sum()), np.uint8)
        outs.append((int(kern(src, starts, lengths, out)), out))
    assert outs[0][0] == outs[1][0] and np.array_equal(outs[0][1], outs[1][1])


def _entries_of(buf: np.ndarray) -> np.ndarray:
    from kcompact.reput.bcq import entries_from_scan
    from kcompact.reput.record import scan
    s = scan(buf)
    return entries_from_scan(s, 0, len(s), 0).copy()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 200), flip=st.floats(0, 1),
       what=st.sampled_from(["none", "byte", "offset", "position", "size", "cut", "tail",
                             "timestamp", "flags", "digest_lo", "digest_hi", "zero"]),
       contiguous=st.booleans(), pick=st.floats(0, 1))
def test_verify_records_matches_numba(seed, n, flip, what, contiguous, pick):
    """The reader's one check: the same first failing record, C and numba, on whole, damaged
    and cut buffers and on selections of the entries; every field of an entry derived from its
    record (size, offset, timestamp, flags, key digest) is compared."""
    buf = _record_buffer(seed, n).copy()
    e = _entries_of(buf)
    base = 1000
    e["position"] += base
    if not contiguous and e.shape[0]:
        e = e[np.random.default_rng(seed).random(e.shape[0]) < max(pick, 0.2)]
    m = e.shape[0]
    j = min(int(flip * m), m - 1) if m else 0
    if m and what == "byte":
        buf[int(e[j]["position"]) - base + int(flip * (int(e[j]["size"]) - 1))] ^= 0x10
    elif m and what in ("offset", "position", "size", "timestamp", "flags", "digest_lo",
                        "digest_hi"):
        e[what][j] += 1
    elif m and what == "zero":
        e[j] = np.zeros(1, BCQ_DTYPE)[0]
    elif what == "cut":
        buf = buf[:int(flip * buf.shape[0])]
    elif what == "tail":
        buf = np.concatenate([buf, np.zeros(3, np.uint8)])
    raw = np.ascontiguousarray(e).view(np.uint8)
    got = [int(k(buf, base, raw, 0, 0, contiguous))
           for k in (_native.verify_records, K.verify_records)]
    assert got[0] == got[1]
    if what == "none" and (not contiguous or m == n):
        assert got[0] == -1
    if m and what not in ("none", "cut", "tail", "byte") and not (what == "position" and
                                                                  not contiguous):
        assert 0 <= got[0] <= j


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 200))
def test_field_spans_match_numba(seed, n):
    buf = _record_buffer(seed, n)
    pos = _entries_of(buf)["position"].astype(np.int64)
    outs = []
    for k in (_native.field_spans, K.field_spans):
        cols = [np.zeros(pos.shape[0], np.int64) for _ in range(6)] + [
            np.zeros(pos.shape[0], np.uint8)]
        k(buf, pos, *cols)
        outs.append(cols)
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


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
        CN.insert_entries(table, 16, 10, 0, 0, e["offset"], e["digest_lo"],
                          e["digest_hi"], e["flags"], 0, 99)
    with pytest.raises(ValueError):  # a table shorter than its capacity
        CN.insert_entries(table, 1000, 10, 0, 0, e["offset"], e["digest_lo"],
                          e["digest_hi"], e["flags"], 0, 4)
    with pytest.raises(TypeError):  # wrong item size
        CN.lookup_many(table, 16, 0, e["offset"].astype(np.int32), e["digest_hi"],
                       np.empty(4, np.int64))
    with pytest.raises(ValueError):  # a range outside its buffer
        _native.gather_ranges(np.zeros(10, np.uint8), np.array([5], np.int64),
                              np.array([20], np.int64), np.zeros(20, np.uint8))
    with pytest.raises(ValueError):  # no record at that position
        _native.field_spans(np.zeros(10, np.uint8), np.array([0], np.int64),
                            *(np.zeros(1, np.int64) for _ in range(6)), np.zeros(1, np.uint8))
    with pytest.raises(TypeError):  # entries must be the .bcq's bytes
        _native.verify_records(np.zeros(10, np.uint8), 0, e["offset"], 0, 0, False)
    with pytest.raises(TypeError):
        CN.decide(table)


def _build_store_elsewhere(tmp_path, partitions: int) -> str:
    """A store of 5000 records of topic t (50 keys, every 9th a tombstone), written by another
    process (which loads the numba encoding kernels), so that the caller's process starts clean."""
    store = str(tmp_path / "s")
    build = (
        "import sys\n"
        "from kcompact.reput import Store\n"
        "from kcompact.reput.record import RecordBatch\n"
        "st = Store.open({store!r}, writer='w', create=True)\n"
        "st.append(RecordBatch.from_records('t', [(i % {parts}, i, 0, b'k%d' % (i % 50), None if"
        " i % 9 == 0 else b'v' * 40, []) for i in range(5000)]))\n"
        "st.flush(); st.close()\n")
    subprocess.run([sys.executable, "-c", build.format(root=ROOT, store=store, parts=partitions)],
                   check=True)
    return store


def test_a_compaction_loads_no_jit_compiler(tmp_path):
    """Build a store (numba kernels) in one process, compact it in another: the compacting
    process imports numba nowhere."""
    store = _build_store_elsewhere(tmp_path, partitions=1)
    compact = (
        "import sys\n"
        "from kcompact.reput import Store\n"
        "from kcompact.compaction import Compactor, CompactionOptions\n"
        "st = Store.open({store!r})\n"
        "r = Compactor(st, CompactionOptions(offset_map_memory=1 << 20)).compact_partition("
        "'t', 0, force=True)\n"
        "assert r.skipped is None and r.records_dropped > 4000, r\n"
        "print('numba' in sys.modules, r.records_kept)\n")
    out = subprocess.run([sys.executable, "-c", compact.format(root=ROOT, store=store)],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == "False", out
    assert int(out[1]) == 50  # one record per key (some of them tombstones kept)


# -- record scanning (count_records, fill_records) and the KV build kernels ----------------------


def _record_buffer(seed: int, n: int) -> np.ndarray:
    """n encoded records of varied topics, keys (null, empty, long), values and headers."""
    from kcompact.reput.record import RecordBatch, encode_batch
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        r = rng.random()
        key = None if r < 0.1 else b"" if r < 0.15 else bytes(rng.integers(0, 256, int(
            rng.integers(1, 40))).astype(np.uint8))
        value = None if rng.random() < 0.1 else b"v" * int(rng.integers(0, 300))
        headers = [("h", b"x" * int(rng.integers(0, 5)))] if rng.random() < 0.3 else []
        rows.append((int(rng.integers(0, 4)), i * 3, int(rng.integers(-5, 2**40)), key, value,
                     headers))
    parts = []
    for topic in ("t", "a-much-longer-topic-name.with.dots"):
        buf, _ = encode_batch(RecordBatch.from_records(topic, rows[: n // 2] if topic == "t"
                                                       else rows[n // 2:]))
        parts.append(np.frombuffer(bytes(buf), np.uint8))
    return np.concatenate(parts)


def _scan_both(buf: np.ndarray, start: int, end: int, verify: bool, secret: bytes):
    from kcompact.reput.record import secret_words
    out = []
    for kernel in ("c", "numba"):
        if kernel == "c":
            n, stop, status = _native.count_records(buf, start, end, verify)
        else:
            n, stop, status = K.count_records(buf, start, end, verify, K.CRC_TABLES)
        cols = [np.zeros(n, d) for d in (np.int64, np.int64, np.int32, np.int64, np.int64,
                                         np.uint8, np.uint64, np.uint64, np.uint64, np.uint32)]
        k0, k1 = secret_words(secret)
        (_native.fill_records if kernel == "c" else K.fill_records)(buf, start, n, k0, k1, *cols)
        out.append(((int(n), int(stop), int(status)), cols))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300), cut=st.floats(0, 1),
       corrupt=st.sampled_from(["none", "crc", "header", "size"]), verify=st.booleans(),
       secret=st.binary(min_size=16, max_size=16))
def test_record_scan_matches_numba(seed, n, cut, corrupt, verify, secret):
    """count_records + fill_records: the same count, stop, status and columns (positions, sizes,
    partitions, offsets, timestamps, attributes, topic hashes, SipHash digests, CRCs) on whole,
    torn and corrupted buffers."""
    buf = _record_buffer(seed, n).copy()
    end = int(len(buf) * cut) if corrupt == "size" else len(buf)
    if len(buf) and corrupt != "none" and corrupt != "size":
        pos = int(cut * (len(buf) - 1))
        if corrupt == "crc":
            buf[pos] ^= 0x40
        else:
            buf[min(pos, len(buf) - 1)] = 0xEE
    (sc_c, cols_c), (sc_nb, cols_nb) = _scan_both(buf, 0, end, verify, secret)
    assert sc_c == sc_nb
    for a, b in zip(cols_c, cols_nb):
        assert np.array_equal(a, b)


def test_crc_and_siphash_known_values():
    """CRC32C of "123456789" is 0xE3069283 (RFC 3720); SipHash-2-4-128 of 0..14 under key
    0..15 is the reference vector's (the numba kernel is tested against the same)."""
    from kcompact.reput.record import RecordBatch, encode_batch, scan
    buf, _ = encode_batch(RecordBatch.from_records("t", [(0, 0, 0, bytes(range(15)), b"v", [])]))
    b = np.frombuffer(bytes(buf), np.uint8)
    c = scan(b, secret=bytes(range(16)))
    lo, hi = K.siphash128(np.uint64(0x0706050403020100), np.uint64(0x0F0E0D0C0B0A0908),
                          np.frombuffer(bytes(range(15)), np.uint8), 0, 15)
    assert (int(c.digest_lo[0]), int(c.digest_hi[0])) == (int(lo), int(hi))
    data = np.frombuffer(b"123456789", np.uint8)
    assert int(K.crc32c(data, 0, 9, K.CRC_TABLES)) == 0xE3069283
    n, stop, status = _native.count_records(b, 0, len(b), True)
    assert (n, stop, status) == (1, len(b), K.SCAN_OK)


def test_record_scan_bad_arguments():
    b = _record_buffer(1, 4)
    with pytest.raises(ValueError, match="outside the buffer"):
        _native.count_records(b, 0, len(b) + 1, True)
    cols = [np.zeros(9, d) for d in (np.int64, np.int64, np.int32, np.int64, np.int64,
                                     np.uint8, np.uint64, np.uint64, np.uint64, np.uint32)]
    with pytest.raises(ValueError, match="not whole"):  # 9 records asked, 4 in the buffer
        _native.fill_records(b, 0, 9, 0, 0, *cols)
    with pytest.raises(ValueError, match="shorter than n"):
        _native.fill_records(b, 0, 10, 0, 0, *cols)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), keys=st.integers(1, 500),
       keyless=st.floats(0, 0.3), tombs=st.floats(0, 0.4), end_frac=st.floats(0, 1.2))
def test_kv_digest_table_matches_numba(seed, n, keys, keyless, tombs, end_frac):
    """upsert_latest (two partitions), merge and rehash (growth): the same table rows."""
    from kcompact.connectors.apps.kv import _native as KN
    import _oracle_kv_kernels as KK
    e0 = _entries(seed, n, keys, keyless, tombs)
    e1 = _entries(seed + 1, n // 2, keys, keyless, tombs)
    e1["timestamp"] = np.random.default_rng(seed).integers(0, 50, e1.shape[0])
    e0["timestamp"] = np.random.default_rng(seed + 2).integers(0, 50, e0.shape[0])
    end = int(e0["offset"][-1] * end_frac) if n else 0
    results = []
    for use_c in (True, False):
        def run(fn_c, fn_nb, rows, *args):
            return fn_c(rows.reshape(-1), *args) if use_c else fn_nb(rows, *args)
        t0, t1 = KK.DigestTable(16), KK.DigestTable(16)
        out = []
        for t, e, part in ((t0, e0, 0), (t1, e1, 1)):
            # reserve() grows through the rehash kernel of the run under test
            need = t.n + e.shape[0]
            if need > t.capacity * KK.MAX_LOAD:
                new = KK.DigestTable(int(need / 0.5))
                run(KN.kv_rehash, KK._rehash, t.rows, new.rows.reshape(-1) if use_c
                    else new.rows)
                t.rows = new.rows
            c, k, a = run(KN.kv_upsert_latest, KK._upsert_latest, t.rows, e["offset"],
                          e["timestamp"], e["digest_lo"], e["digest_hi"], e["flags"], end, part)
            t.n += a
            out.append((int(c), int(k), int(a)))
        grown = KK.DigestTable(int((t0.n + t1.n) / 0.5) + 16)
        run(KN.kv_rehash, KK._rehash, t0.rows, grown.rows.reshape(-1) if use_c
            else grown.rows)
        added, both = run(KN.kv_merge, KK._merge, grown.rows,
                          t1.rows.reshape(-1) if use_c else t1.rows)
        out.append((int(added), int(both)))
        results.append((out, t0.rows.copy(), t1.rows.copy(), grown.rows.copy()))
    (o_c, *rows_c), (o_nb, *rows_nb) = results
    assert o_c == o_nb
    for a, b in zip(rows_c, rows_nb):
        assert np.array_equal(a, b)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 400), prefix=st.sampled_from([-1, 7]),
       pos=st.integers(0, 5), first=st.integers(0, 3))
def test_kv_gather_and_sort_rows_match_numba(seed, n, prefix, pos, first):
    """The map's gather (keys from where the reader says they lie) and sort rows."""
    from kcompact.connectors.apps.kv import _native as KN
    import _oracle_kv_kernels as KK
    from kcompact.reput.record import field_spans, scan
    buf = _record_buffer(seed, n)
    sp = field_spans(buf, scan(buf).positions.astype(np.int64))
    ks, kl = sp.kstart, sp.klen
    m = ks.shape[0]
    outs = []
    for use_c in (True, False):
        size = pos + int(kl.sum()) + m
        out, offs = np.zeros(size, np.uint8), np.zeros(first + m + 1, np.int64)
        q = (KN.kv_gather if use_c else KK._gather)(buf, ks, kl, prefix, out, pos, offs,
                                                     first)
        koffs = np.zeros(m + 1, np.int64)
        keys = np.zeros(int(kl.sum()), np.uint8)
        (KN.kv_gather if use_c else KK._gather)(buf, ks, kl, -1, keys, 0, koffs, 0)
        width = (int(kl.max()) + 4 + 7) // 8 * 8 if m else 8
        rows = np.zeros(m * width, np.uint8)
        (KN.kv_sort_rows if use_c else KK._sort_rows)(keys, koffs, width, rows)
        outs.append((int(q), out, offs, rows))
    (q_c, out_c, offs_c, rows_c), (q_nb, out_nb, offs_nb, rows_nb) = outs
    assert q_c == q_nb
    for a, b in zip([out_c, offs_c, rows_c], [out_nb, offs_nb, rows_nb]):
        assert np.array_equal(a, b)


def test_kv_kernels_bad_arguments():
    from kcompact.connectors.apps.kv import _native as KN
    t = np.zeros((6, 5), np.uint64)  # capacity not a power of two
    z = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="2\\*\\*k, 5"):
        KN.kv_upsert_latest(t.reshape(-1), z, z, z.view(np.uint64), z.view(np.uint64),
                            np.zeros(1, np.uint16), 10, 0)
    with pytest.raises(ValueError, match="outside its"):
        KN.kv_gather(np.zeros(4, np.uint8), np.array([2], np.int64),
                     np.array([5], np.int64), -1, np.zeros(10, np.uint8), 0,
                     np.zeros(2, np.int64), 0)


def test_a_kv_build_loads_no_jit_compiler(tmp_path):
    """`kv build` from a store: the C kernels read, check and pick the records; numba is
    never imported."""
    store = _build_store_elsewhere(tmp_path, partitions=2)
    kv = (
        "import sys\n"
        "from kcompact.connectors.apps.kv import build_map, KVMap\n"
        "r = build_map({db!r}, {store!r}, 't')\n"
        "m = KVMap({db!r})\n"
        "print('numba' in sys.modules, r['keys'], m.get(b'k1'))\n")
    out = subprocess.run([sys.executable, "-c", kv.format(root=ROOT, store=store,
                                                          db=str(tmp_path / "db"))],
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == "False", out
    assert int(out[1]) > 0 and out[2] == repr(b"v" * 40)
