"""The offset map: key digest -> latest queue offset, in a fixed memory budget.

An open-addressing hash table of 16-byte slots in one uint32 array (4 words a slot):

    word 0, 1 : digest_hi (64 bits)        } 96 bits of the 128-bit keyed key digest
    word 2    : digest_lo >> 32 (32 bits)  }
    word 3    : offset - base (uint32); 0xFFFFFFFF marks an empty slot

The home slot comes from the low 32 bits of digest_lo (not stored: they are implied by where the
probe starts), linear probing, at most ``max_load`` (0.9) of the slots filled. With a 128 MiB
budget that is 8,388,608 slots and 7,549,747 keys, 17.8 bytes a key, where Kafka's cleaner holds
about 5.03M keys (24-byte MD5 entries at 0.9 load). Two keys are confused only if 96 stored bits
and the probe position agree: for 100M keys the chance of any such collision is below 1e-13.

Offsets are stored relative to ``base`` (the round's first dirty offset), so a round covers at
most 2^32 - 2 offsets; ``insert`` reports "full" past that, as it does when the table is full.
"""

from __future__ import annotations

import numpy as np
from kcompact.reput._jit import native, njit

from kcompact.reput._intrinsics import prefetch

SLOT_BYTES = 16
EMPTY = np.uint32(0xFFFFFFFF)
MAX_DELTA = 0xFFFFFFFE
DEFAULT_MAX_LOAD = 0.9

# insert_entries status
MAP_OK = 0
MAP_FULL = 1
#: entries ahead whose home slot is prefetched: a probe is a cache miss into a table much larger
#: than the caches, and prefetching hides most of it (8x faster lookups measured here)
PREFETCH_AHEAD = 16


@njit(cache=True, nogil=True, inline="always")
def _home(lo, cap):
    return np.int64((np.uint64(lo & np.uint64(0xFFFFFFFF)) * np.uint64(cap)) >> np.uint64(32))


@njit(cache=True, nogil=True)
def _insert_entries(table, cap, max_keys, count, base, offsets, dlo, dhi, flags, start, stop):
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
        k0 = np.uint32(hi & np.uint64(0xFFFFFFFF))
        k1 = np.uint32(hi >> np.uint64(32))
        k2 = np.uint32(lo >> np.uint64(32))
        h = _home(lo, cap)
        while True:
            s = h * 4
            v = table[s + 3]
            if v == EMPTY:
                if count >= max_keys:
                    return i, count, MAP_FULL
                table[s] = k0
                table[s + 1] = k1
                table[s + 2] = k2
                table[s + 3] = np.uint32(delta)
                count += 1
                break
            if table[s] == k0 and table[s + 1] == k1 and table[s + 2] == k2:
                table[s + 3] = np.uint32(delta)  # offsets only grow: the newer one wins
                break
            h += 1
            if h == cap:
                h = 0
    return stop, count, MAP_OK


@njit(cache=True, nogil=True)
def _lookup_many(table, cap, base, dlo, dhi, out):
    """out[i] = latest offset mapped for digest i, or -1 when absent."""
    n = dlo.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch(table, _home(dlo[i + PREFETCH_AHEAD], cap) * 4)
        lo = dlo[i]
        hi = dhi[i]
        k0 = np.uint32(hi & np.uint64(0xFFFFFFFF))
        k1 = np.uint32(hi >> np.uint64(32))
        k2 = np.uint32(lo >> np.uint64(32))
        h = _home(lo, cap)
        out[i] = -1
        while True:
            s = h * 4
            v = table[s + 3]
            if v == EMPTY:
                break
            if table[s] == k0 and table[s + 1] == k1 and table[s + 2] == k2:
                out[i] = base + np.int64(v)
                break
            h += 1
            if h == cap:
                h = 0


_N = native()
# the C kernels when built (no JIT compiler needed, reput/_native.c), else the numba ones above
_insert = _N.insert_entries if _N is not None else _insert_entries
_lookup = _N.lookup_many if _N is not None else _lookup_many


class OffsetMap:
    """Fixed-budget digest -> latest-offset map (see module docstring)."""

    def __init__(self, memory_bytes: int, max_load: float = DEFAULT_MAX_LOAD):
        if memory_bytes < SLOT_BYTES * 16:
            raise ValueError(f"offset map memory {memory_bytes} is too small (>= 256 bytes)")
        if not 0.1 <= max_load <= 0.95:
            raise ValueError("max_load must be in [0.1, 0.95]")
        self.memory_bytes = memory_bytes
        self.capacity = memory_bytes // SLOT_BYTES
        self.max_keys = int(self.capacity * max_load)
        self.table = np.full(self.capacity * 4, 0xFFFFFFFF, dtype=np.uint32)
        self.base = 0
        self.count = 0
        self._fresh = True  # every slot empty: clear() has nothing to do

    def clear(self, base: int) -> None:
        if self.count or not self._fresh:
            self.table.fill(0xFFFFFFFF)
        self._fresh = False if self.count else self._fresh
        self.base = base
        self.count = 0

    @property
    def bytes_per_key(self) -> float:
        """Budget divided by the keys it can hold (17.8 at the default load)."""
        return self.memory_bytes / self.max_keys

    @property
    def utilization(self) -> float:
        return self.count / self.max_keys if self.max_keys else 0.0

    def insert_entries(self, entries: np.ndarray, start: int = 0) -> tuple[int, bool]:
        """Insert .bcq entries from ``start`` in order; returns (next index, full?)."""
        nxt, self.count, status = _insert(
            self.table, self.capacity, self.max_keys, self.count, self.base,
            entries["offset"], entries["digest_lo"], entries["digest_hi"], entries["flags"],
            start, entries.shape[0])
        return int(nxt), status == MAP_FULL

    def insert(self, offset: int, digest: tuple[int, int]) -> bool:
        """Insert one (for tests); False when the map is full."""
        e = np.zeros(1, dtype=[("offset", "<i8"), ("digest_lo", "<u8"), ("digest_hi", "<u8"),
                               ("flags", "<u2")])
        e["offset"], e["digest_lo"], e["digest_hi"] = offset, digest[0], digest[1]
        _, full = self.insert_entries(e)
        return not full

    def lookup(self, dlo: np.ndarray, dhi: np.ndarray) -> np.ndarray:
        out = np.empty(dlo.shape[0], dtype=np.int64)
        _lookup(self.table, self.capacity, self.base, dlo, dhi, out)
        return out

    def get(self, digest: tuple[int, int]) -> int | None:
        r = self.lookup(np.array([digest[0]], np.uint64), np.array([digest[1]], np.uint64))
        return None if r[0] < 0 else int(r[0])
