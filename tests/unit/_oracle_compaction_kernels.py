"""The numba twins of the offset map's and the cleaner's C kernels (compaction/_native.c): the
same algorithms, the reference tests/unit/test_native_kernels.py compares the C ones with (moved
here from compaction/_kernels.py when the C kernels became the product's only ones, issue 39).

In the product only ``offset_map.OffsetMap`` calls the C ones: the compactor asks the map (``insert_entries``,
``lookup``, ``decide``) and never reads its table. The table layout is in offset_map.py's
docstring. ``prefetch`` hides the cache miss of a probe into a table much larger than the
caches: the home slot of the entry ``PREFETCH_AHEAD`` ahead is requested while this one probes.
"""

from __future__ import annotations

import numpy as np

from kcompact.reput.intrinsics import prefetch
from kcompact.reput.jit import njit

EMPTY = np.uint32(0xFFFFFFFF)
MAX_DELTA = 0xFFFFFFFE
# insert_entries status
MAP_OK = 0
MAP_FULL = 1
#: entries ahead whose home slot is prefetched (8x faster lookups measured here)
PREFETCH_AHEAD = 16


@njit(cache=True, nogil=True, inline="always")
def _home(lo, cap):
    return np.int64((np.uint64(lo & np.uint64(0xFFFFFFFF)) * np.uint64(cap)) >> np.uint64(32))


@njit(cache=True, nogil=True, inline="always")
def _find_slot(table, cap, lo, hi):
    """The slot of digest (lo, hi): the one holding it, else the empty slot where it would go.
    The one probe loop of insert_entries and _probe, as compaction/_native.c's find_slot. The
    map keeps max_keys < cap, so an empty slot always ends it (the C twin, which also takes
    tables from outside, gives up after cap probes; a probe counter here costs ~15 %)."""
    k0 = np.uint32(hi & np.uint64(0xFFFFFFFF))
    k1 = np.uint32(hi >> np.uint64(32))
    k2 = np.uint32(lo >> np.uint64(32))
    h = _home(lo, cap)
    while True:
        s = h * 4
        if table[s + 3] == EMPTY:
            return h
        if table[s] == k0 and table[s + 1] == k1 and table[s + 2] == k2:
            return h
        h += 1
        if h == cap:
            h = 0


@njit(cache=True, nogil=True, inline="always")
def _probe(table, cap, base, lo, hi):
    """The offset mapped for digest (lo, hi), or -1."""
    h = _find_slot(table, cap, lo, hi)
    if table[h * 4 + 3] == EMPTY:
        return np.int64(-1)
    return base + np.int64(table[h * 4 + 3])


@njit(cache=True, nogil=True)
def insert_entries(table, cap, max_keys, count, base, offsets, dlo, dhi, flags, start, stop):
    """Insert entries start..stop-1 (keyless ones skipped). Stops before the first key that
    does not fit. Returns (next index, keys count, status)."""
    for i in range(start, stop):
        if i + PREFETCH_AHEAD < stop:
            prefetch(table, _home(dlo[i + PREFETCH_AHEAD], cap) * 4)
        if flags[i] & 2:  # keyless: never deduplicated, not in the map
            continue
        delta = offsets[i] - base
        if delta < 0 or delta > MAX_DELTA:
            return i, count, MAP_FULL
        lo = dlo[i]
        hi = dhi[i]
        s = _find_slot(table, cap, lo, hi) * 4
        if table[s + 3] == EMPTY:
            if count >= max_keys:
                return i, count, MAP_FULL
            table[s] = np.uint32(hi & np.uint64(0xFFFFFFFF))
            table[s + 1] = np.uint32(hi >> np.uint64(32))
            table[s + 2] = np.uint32(lo >> np.uint64(32))
            count += 1
        table[s + 3] = np.uint32(delta)  # a key already there: offsets only grow, newer wins
    return stop, count, MAP_OK


@njit(cache=True, nogil=True)
def lookup_many(table, cap, base, dlo, dhi, out):
    """out[i] = latest offset mapped for digest i, or -1 when absent."""
    n = dlo.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch(table, _home(dlo[i + PREFETCH_AHEAD], cap) * 4)
        out[i] = _probe(table, cap, base, dlo[i], dhi[i])


@njit(cache=True, nogil=True)
def decide(table, cap, base, last_mapped, now_s, retention_s, offsets, dlo, dhi, flags,
           clean_time, keep, new_clean):
    """keep[i], new_clean[i] for entries i. Returns (kept, dropped, tombstones dropped, stamped)."""
    kept = 0
    dropped = 0
    tdropped = 0
    stamped = 0
    n = offsets.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch(table, _home(dlo[i + PREFETCH_AHEAD], cap) * 4)
        off = offsets[i]
        f = flags[i]
        ct = clean_time[i]
        k = True
        if (f & 2) == 0 and off <= last_mapped:
            if _probe(table, cap, base, dlo[i], dhi[i]) > off:
                k = False
        if k and (f & 3) == 1:  # a keyed tombstone still the latest for its key (keyless: kept)
            # clean_time is whole seconds (floored): only a strict '>' guarantees that
            # delete.retention.ms has really passed since the tombstone was first cleaned
            if ct != 0 and now_s - np.int64(ct) > retention_s:
                k = False
                tdropped += 1
            elif ct == 0 and off <= last_mapped:
                ct = np.uint32(now_s)
                stamped += 1
        keep[i] = k
        new_clean[i] = ct
        if k:
            kept += 1
        else:
            dropped += 1
    return kept, dropped, tdropped, stamped
