"""The key-value map's bulk build kernels: C (this folder's _native.c, built as
kcompact.connectors.apps.kv._native; their numba twins are the tests' reference,
tests/unit/_oracle_kv_kernels.py). A `kv build` never loads numba and LLVM (~0.9 s of a 2 s
build, measured).

The build decides which records are the latest per key from the .bcq entries alone (offset,
timestamp, 128-bit keyed digest, flags: docs/formats/bcq.md, read with the partition reader's
IndexCursor), then gathers only those records' keys and values from the reader's columns.

The digest table is open addressing over the digest's low word (SipHash output: already
uniform), linear probing, capacity a power of two kept at most 70% full by the caller.
"""

from __future__ import annotations

import numpy as np

from . import _native as _C

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
        _C.kv_rehash(self.rows.reshape(-1), new.rows.reshape(-1))
        self.rows = new.rows

    def upsert_latest(self, entries: np.ndarray, end: int, partition: int) -> tuple[int, int, bool]:
        """Within one partition the highest offset wins. ``entries`` are .bcq entries in offset
        order; those at or after ``end`` are ignored. Returns (covered, keyless, reached_end)."""
        n = entries.shape[0]
        self.reserve(n)
        columns = (entries["offset"], entries["timestamp"], entries["digest_lo"],
                   entries["digest_hi"], entries["flags"], end, partition)
        covered, keyless, added = _C.kv_upsert_latest(self.rows.reshape(-1), *columns)
        self.n += added
        return covered, keyless, covered < n

    def merge(self, other: "DigestTable") -> int:
        """Merge another partition's winners: across partitions the highest (timestamp,
        partition) wins. Returns how many digests were in both (keys in several partitions)."""
        self.reserve(other.n)
        added, both = _C.kv_merge(self.rows.reshape(-1), other.rows.reshape(-1))
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


def gather(src, starts, lengths, prefix, out, out_pos, offs, first) -> int:
    """Append ``prefix`` (a byte, or nothing when negative) then src[starts[i]:+lengths[i]] to
    out at out_pos for each i, recording each start in offs[first + i] (offs[first + n] = the
    end). Returns the new out_pos."""
    return _C.kv_gather(src, starts, lengths, prefix, out, out_pos, offs, first)


def sort_rows(keys, koffs, width, out) -> None:
    """Fixed-width sort rows: the key bytes zero-padded to ``width - 4``, then the key length
    big-endian, so that comparing rows as unsigned bytes orders keys exactly as bytes do."""
    _C.kv_sort_rows(keys, koffs, width, out)
