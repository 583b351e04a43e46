"""The numba twins of the key-value map's C kernels (connectors/apps/kv/_native.c): the
reference tests/unit/test_native_kernels.py and test_kv.py compare the C ones with (moved here
from connectors/apps/kv/kernels.py when the C kernels became the product's only ones, issue
39). ``rows`` is a DigestTable's (capacity, 5) uint64 table."""
# flake8: noqa: F821  (names from connectors/apps/kv/kernels.py, put in the globals below)

from __future__ import annotations

import numpy as np

from kcompact.connectors.apps.kv import kernels as _product
from kcompact.reput.intrinsics import load_u64, store_u64  # noqa: F401
from kcompact.reput.jit import njit

# the product's table and constants too (KK.DigestTable, KK.MAX_LOAD, _LO ... _USED)
globals().update({k: v for k, v in vars(_product).items() if not k.startswith("__")})


@njit(cache=True, nogil=True, inline="always")
def _probe(rows, lo, hi):
    mask = np.uint64(rows.shape[0] - 1)
    s = np.int64(lo & mask)
    while rows[s, _META] & _USED:
        if rows[s, _LO] == lo and rows[s, _HI] == hi:
            return s
        s = np.int64((np.uint64(s) + np.uint64(1)) & mask)
    return s


@njit(cache=True, nogil=True)
def _upsert_latest(rows, offsets, timestamps, dlo, dhi, flags, end, partition):
    covered = 0
    keyless = 0
    added = 0
    for i in range(offsets.shape[0]):
        if offsets[i] >= end:
            break
        covered += 1
        f = flags[i]
        if f & FLAG_KEYLESS:
            keyless += 1
            continue
        s = _probe(rows, dlo[i], dhi[i])
        if not rows[s, _META] & _USED:
            rows[s, _LO] = dlo[i]
            rows[s, _HI] = dhi[i]
            added += 1
        rows[s, _OFF] = np.uint64(offsets[i])
        rows[s, _TS] = np.uint64(timestamps[i])
        rows[s, _META] = _USED | (np.uint64(f) << np.uint64(32)) | np.uint64(partition)
    return covered, keyless, added


@njit(cache=True, nogil=True)
def _merge(rows, other):
    added = 0
    both = 0
    for j in range(other.shape[0]):
        if not other[j, _META] & _USED:
            continue
        s = _probe(rows, other[j, _LO], other[j, _HI])
        if rows[s, _META] & _USED:
            both += 1
            ts_new, ts_old = np.int64(other[j, _TS]), np.int64(rows[s, _TS])
            p_new = other[j, _META] & np.uint64(0xFFFFFFFF)
            p_old = rows[s, _META] & np.uint64(0xFFFFFFFF)
            if ts_new < ts_old or (ts_new == ts_old and p_new < p_old):
                continue
        else:
            added += 1
        for w in range(5):
            rows[s, w] = other[j, w]
    return added, both


@njit(cache=True, nogil=True)
def _rehash(rows, new):
    for j in range(rows.shape[0]):
        if rows[j, _META] & _USED:
            s = _probe(new, rows[j, _LO], rows[j, _HI])
            for w in range(5):
                new[s, w] = rows[j, w]


@njit(cache=True, nogil=True)
def _gather(src, starts, lengths, prefix, out, out_pos, offs, first):
    """Append ``prefix`` (a byte, or nothing when negative) then src[starts[i]:+lengths[i]] to
    out at out_pos for each i, recording each start in offs[first + i] (offs[first + n] = the
    end). Returns the new out_pos."""
    q = out_pos
    for i in range(starts.shape[0]):
        offs[first + i] = q
        if prefix >= 0:
            out[q] = prefix
            q += 1
        a = starts[i]
        n = lengths[i]
        j = 0
        while n - j >= 8:   # 8-byte moves: numba's slice copy is slow for short runs
            store_u64(out, q + j, load_u64(src, a + j))
            j += 8
        while j < n:
            out[q + j] = src[a + j]
            j += 1
        q += n
    offs[first + starts.shape[0]] = q
    return q


@njit(cache=True, nogil=True)
def _sort_rows(keys, koffs, width, out):
    """Fixed-width sort rows: the key bytes zero-padded to ``width - 4``, then the key length
    big-endian, so that comparing rows as unsigned bytes orders keys exactly as bytes do."""
    n = koffs.shape[0] - 1
    for i in range(n):
        a = koffs[i]
        m = koffs[i + 1] - a
        row = i * width
        for j in range(m):
            out[row + j] = keys[a + j]
        for j in range(m, width - 4):
            out[row + j] = 0
        out[row + width - 4] = (m >> 24) & 0xFF
        out[row + width - 3] = (m >> 16) & 0xFF
        out[row + width - 2] = (m >> 8) & 0xFF
        out[row + width - 1] = m & 0xFF
