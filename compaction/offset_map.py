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

Kafka's ``OffsetMap``: a small interface its callers call and never probe. The compactor and the
live-set pass ask it through ``insert_entries``, ``lookup``/``latest_of`` and ``decide`` (the
cleaner's keep/drop decision in one compiled pass); the table is this class's alone. Its kernels
are compaction/_native.c's (C; their numba twins are the tests' reference,
tests/unit/_oracle_compaction_kernels.py).
"""

from __future__ import annotations

import numpy as np

from kcompact.reput import bcq as B

from . import _native as KM

#: the largest offset delta a slot holds (offset - base), and insert_entries' "map full" status
#: (compaction/_native.c)
MAX_DELTA = 0xFFFFFFFE
MAP_FULL = 1

SLOT_BYTES = 16
DEFAULT_MAX_LOAD = 0.9


class OffsetMap:
    """Fixed-budget digest -> latest-offset map (see module docstring)."""

    def __init__(self, memory_bytes: int, max_load: float = DEFAULT_MAX_LOAD):
        if memory_bytes < SLOT_BYTES * 16:
            raise ValueError(f"offset map memory {memory_bytes} is too small (>= 256 bytes)")
        if not 0.1 <= max_load <= 0.95:
            raise ValueError("max_load must be in [0.1, 0.95]")
        self.memory_bytes = memory_bytes
        self.max_load = max_load
        self.capacity = memory_bytes // SLOT_BYTES
        self.max_keys = int(self.capacity * max_load)
        # the table is reserved whole up front (np.empty: its pages are touched only as far
        # as rounds use it); slots [0, _clean) are known empty, the rest is filled on demand
        self._table = np.empty(self.capacity * 4, dtype=np.uint32)
        self._cap, self._max = self.capacity, self.max_keys  # this round's
        self._clean = 0
        self._written = False
        self.base = 0
        self.count = 0

    def _ready(self) -> None:
        """Before this round's first probe: its slots [0, _cap) empty."""
        if self._clean < self._cap:
            self._table[self._clean * 4:self._cap * 4].fill(0xFFFFFFFF)
            self._clean = self._cap

    def clear(self, base: int, keys: int | None = None) -> None:
        """Empty the map for a round whose offsets start at ``base``. ``keys``: at most that
        many keys will be inserted (the round's entries): the round then probes only the
        smallest power-of-two prefix of the table that holds them at ``max_load``, and only
        that prefix is cleared (a small round does not clear a whole budget's table); without
        it, the whole table. Two keys are confused only if their 96 stored bits and their home
        slot agree, as before; a round's capacity is never below what its keys need, so a
        round is never cut short by it."""
        cap = self.capacity
        if keys is not None:
            want = max(16, int(keys / self.max_load) + 2)
            cap = min(cap, 1 << (want - 1).bit_length())
        if self._written:  # the last round's slots [0, _cap) hold its keys
            self._clean = 0
        self._cap, self._max = cap, int(cap * self.max_load)
        self._written = False
        self.base = base
        self.count = 0

    @property
    def nbytes(self) -> int:
        """The table's allocation: the whole budget, reserved up front."""
        return self._table.nbytes

    @property
    def bytes_per_key(self) -> float:
        """Budget divided by the keys it can hold (17.8 at the default load)."""
        return self.memory_bytes / self.max_keys

    @property
    def utilization(self) -> float:
        return self.count / self.max_keys if self.max_keys else 0.0

    def insert_entries(self, entries: np.ndarray, start: int = 0) -> tuple[int, bool]:
        """Insert .bcq entries from ``start`` in order; returns (next index, full?)."""
        self._ready()
        self._written = True
        nxt, self.count, status = KM.insert_entries(
            self._table, self._cap, self._max, self.count, self.base,
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
        """The latest offset mapped for each digest (dlo[i], dhi[i]), -1 where none is."""
        out = np.empty(dlo.shape[0], dtype=np.int64)
        self._ready()
        KM.lookup_many(self._table, self._cap, self.base, dlo, dhi, out)
        return out

    def latest_of(self, entries: np.ndarray) -> np.ndarray:
        """``lookup`` of .bcq entries' digests."""
        return self.lookup(entries["digest_lo"], entries["digest_hi"])

    def decide(self, entries: np.ndarray, last_mapped: int, now_s: int, retention_s: int,
               keep_offset: int = -1
               ) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int, int]]:
        """The cleaner's decision for .bcq entries, from this map (one compiled pass):
        (keep mask, new clean_time, (kept, dropped, tombstones dropped, tombstones stamped)).

        An entry is dropped when it is keyed, at or below ``last_mapped`` and a later offset is
        mapped for its digest, or when it is a keyed tombstone first cleaned more than
        ``retention_s`` seconds before ``now_s`` (strictly: clean_time is floored to seconds).
        A kept keyed tombstone at or below ``last_mapped`` not stamped yet gets ``now_s``.
        The entry at ``keep_offset`` (the partition's last record, which Kafka's never-cleaned
        active segment holds; -1: none) is kept whatever the rest says: only an expired
        tombstone can be that record and be dropped otherwise."""
        n = entries.shape[0]
        keep = np.empty(n, np.bool_)
        clean = np.empty(n, np.uint32)
        self._ready()
        counts = [int(c) for c in KM.decide(
            self._table, self._cap, self.base, last_mapped, now_s, retention_s,
            entries["offset"], entries["digest_lo"], entries["digest_hi"], entries["flags"],
            entries["clean_time"], keep, clean)]
        if keep_offset >= 0 and n:
            i = int(np.searchsorted(entries["offset"], keep_offset))
            if i < n and int(entries["offset"][i]) == keep_offset and not keep[i]:
                keep[i] = True
                counts[0] += 1
                counts[1] -= 1
                flags = int(entries["flags"][i])
                if flags & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS) == B.FLAG_TOMBSTONE:
                    counts[2] -= 1
        return keep, clean, tuple(counts)

    def get(self, digest: tuple[int, int]) -> int | None:
        r = self.lookup(np.array([digest[0]], np.uint64), np.array([digest[1]], np.uint64))
        return None if r[0] < 0 else int(r[0])
