"""Compiled kernels of the key-value map's bulk build: C (this folder's _native.c, built as
kcompact.connectors.apps.kv._native) when built, else numba (the functions below, which stay the
reference the tests compare the C ones with). With the C kernels a `kv build` never loads numba
and LLVM (~0.9 s of a 2 s build, measured).

The build decides which records are the latest per key from the .bcq entries alone (offset,
timestamp, 128-bit keyed digest, flags: docs/formats/bcq.md, read with the partition reader's
IndexCursor), then gathers only those records' keys and values from the reader's columns.

The digest table is open addressing over the digest's low word (SipHash output: already
uniform), linear probing, capacity a power of two kept at most 70% full by the caller.
"""

from __future__ import annotations

import numpy as np
from kcompact.reput.intrinsics import load_u64, store_u64
from kcompact.reput.jit import extension, njit

FLAG_TOMBSTONE = 1
FLAG_KEYLESS = 2
MAX_LOAD = 0.7


# a table slot: one row of five 64-bit words, so that a probe touches one cache line
_LO, _HI, _OFF, _TS, _META = 0, 1, 2, 3, 4
_USED = np.uint64(1 << 63)   # in _META, with the flags in bits 32-47 and the partition in 0-31


class DigestTable:
    """digest -> (partition, offset, timestamp, flags) of the record that wins for that key."""

    __slots__ = ("rows", "n")

    def __init__(self, capacity: int = 1 << 16):
        cap = 1 << max(4, (int(capacity) - 1).bit_length())
        self.rows = np.zeros((cap, 5), np.uint64)
        self.n = 0

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def reserve(self, more: int) -> None:
        """Grow (rehash) so that ``more`` new digests still keep the load under MAX_LOAD."""
        need = self.n + more
        if need <= self.capacity * MAX_LOAD:
            return
        new = DigestTable(int(need / 0.5))
        c = native()
        if c is not None:
            c.kv_rehash(self.rows.reshape(-1), new.rows.reshape(-1))
        else:
            _rehash(self.rows, new.rows)
        self.rows = new.rows

    def upsert_latest(self, entries: np.ndarray, end: int, partition: int) -> tuple[int, int, bool]:
        """Within one partition the highest offset wins. ``entries`` are .bcq entries in offset
        order; those at or after ``end`` are ignored. Returns (covered, keyless, reached_end)."""
        n = entries.shape[0]
        self.reserve(n)
        c = native()
        columns = (entries["offset"], entries["timestamp"], entries["digest_lo"],
                   entries["digest_hi"], entries["flags"], end, partition)
        if c is not None:
            covered, keyless, added = c.kv_upsert_latest(self.rows.reshape(-1), *columns)
        else:
            covered, keyless, added = _upsert_latest(self.rows, *columns)
        self.n += added
        return covered, keyless, covered < n

    def merge(self, other: "DigestTable") -> int:
        """Merge another partition's winners: across partitions the highest (timestamp,
        partition) wins. Returns how many digests were in both (keys in several partitions)."""
        self.reserve(other.n)
        c = native()
        if c is not None:
            added, both = c.kv_merge(self.rows.reshape(-1), other.rows.reshape(-1))
        else:
            added, both = _merge(self.rows, other.rows)
        self.n += added
        return both

    def winners(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(partitions, offsets) of the live winners sorted by (partition, offset), and the
        number of keys whose winner is a tombstone (absent from the map)."""
        meta = self.rows[:, _META]
        used = (meta & _USED) != 0
        live = used & (((meta >> np.uint64(32)) & np.uint64(FLAG_TOMBSTONE)) == 0)
        dead = int(np.count_nonzero(used)) - int(np.count_nonzero(live))
        rows = self.rows[live]
        parts = (rows[:, _META] & np.uint64(0xFFFFFFFF)).astype(np.int32)
        offs = rows[:, _OFF].view(np.int64)
        if parts.shape[0] and (parts == parts[0]).all():
            return parts, np.sort(offs), dead
        order = np.lexsort((offs, parts))
        return parts[order], offs[order], dead


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


def gather(src, starts, lengths, prefix, out, out_pos, offs, first) -> int:
    """Append ``prefix`` (a byte, or nothing when negative) then src[starts[i]:+lengths[i]] to
    out at out_pos for each i, recording each start in offs[first + i] (offs[first + n] = the
    end). Returns the new out_pos."""
    c = native()
    return (c.kv_gather if c is not None else _gather)(src, starts, lengths, prefix, out,
                                                        out_pos, offs, first)


def sort_rows(keys, koffs, width, out) -> None:
    """Fixed-width sort rows: the key bytes zero-padded to ``width - 4``, then the key length
    big-endian, so that comparing rows as unsigned bytes orders keys exactly as bytes do."""
    c = native()
    (c.kv_sort_rows if c is not None else _sort_rows)(keys, koffs, width, out)


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


def native():
    """The C kernels (kcompact.connectors.apps.kv._native), or None: numba (reput/jit.py)."""
    return extension("kcompact.connectors.apps.kv._native")
