"""The .bcq queue-offset index: one fixed 48-byte little-endian entry per record of a .log.

Spec: docs/formats/bcq.md. An entry is (offset, timestamp, digest_lo, digest_hi, position, size,
flags, reserved, clean_time); the file is a sorted array of them, viewed without parsing as a
numpy structured array (``BCQ_DTYPE``). Lookup by offset is a binary search for the first entry
with offset >= target. Like Kafka's OffsetIndex it carries no checksum: it is derived from its
.log and rebuilt from it after a crash (``entries_for_log``); the digests let the compactor's
first pass read only indexes, never data.
"""

from __future__ import annotations

import numpy as np

from . import _kernels as K
from . import _native as _N
from .record import Scan

FORMAT_VERSION = 1
ENTRY_SIZE = 48
FLAG_TOMBSTONE = 1   # value is null
FLAG_KEYLESS = 2     # key is null: never deduplicated

BCQ_DTYPE = np.dtype([
    ("offset", "<i8"),      # queue offset = source Kafka offset
    ("timestamp", "<i8"),   # record timestamp, ms since the epoch
    ("digest_lo", "<u8"),   # keyed 128-bit key digest (SipHash-2-4-128), low word
    ("digest_hi", "<u8"),   # high word; both 0 for a keyless record
    ("position", "<u4"),    # byte position of the record in the .log
    ("size", "<u4"),        # record size in bytes
    ("flags", "<u2"),       # FLAG_TOMBSTONE | FLAG_KEYLESS
    ("reserved", "<u2"),    # 0
    ("clean_time", "<u4"),  # tombstones: seconds since the epoch when first compacted; 0 = never
])
assert BCQ_DTYPE.itemsize == ENTRY_SIZE
_WORDS = ENTRY_SIZE // 8  # the offset is word 0 of each entry, read as int64 with this stride


def view(buf: np.ndarray) -> np.ndarray:
    """The whole entries of a .bcq byte buffer as a structured array (no copy)."""
    n = buf.shape[0] // ENTRY_SIZE
    # a plain ndarray view: numpy subclasses such as np.memmap make every later view slow
    return buf[: n * ENTRY_SIZE].view(np.ndarray).view(BCQ_DTYPE)


class Index:
    """Entries of one .bcq plus the int64 word view the offset search runs on (both cached)."""

    __slots__ = ("entries", "words", "n")

    def __init__(self, entries: np.ndarray):
        self.entries = entries
        self.n = entries.shape[0]
        self.words = entries.view(np.int64) if self.n else np.zeros(0, np.int64)

    def lower_bound(self, target: int) -> int:
        """Index of the first entry with offset >= target (n if none)."""
        if self.n == 0:
            return 0
        return _lower_bound(self.words, _WORDS, self.n, target)


_lower_bound = _N.lower_bound_strided  # reput/_native.c


def lower_bound(entries: "np.ndarray | Index", target: int) -> int:
    """Index of the first entry with offset >= target (len(entries) if none)."""
    idx = entries if isinstance(entries, Index) else Index(entries)
    return int(idx.lower_bound(target))


def entries_from_scan(s: Scan, lo: int, hi: int, position_base: int,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Index entries for records lo..hi-1 of a scan, positioned at their place in a .log.

    ``position_base`` is added to each record's scan position (the .log position of the scan
    buffer's byte 0 minus where the records' bytes start in it).
    """
    n = hi - lo
    raw = out[: n * ENTRY_SIZE] if out is not None else np.empty(n * ENTRY_SIZE, np.uint8)
    K.fill_entries(raw, lo, hi, position_base, s.offsets, s.timestamps, s.digest_lo,
                   s.digest_hi, s.positions, s.sizes, s.attrs)
    return raw.view(BCQ_DTYPE)
