"""The live state of a partition, the same on a master and on a replica whatever each compacted.

Two stores holding the same data can differ in their raw segments: one compacted more recently,
one still keeps tombstones the other purged (``delete.retention.ms`` runs from each store's own
compaction), one has not yet dropped superseded records. What they must agree on is the
*live state* below an offset bound ``upto``:

* for each key, its **latest** record below ``upto``, unless that record is a tombstone (then the
  key is deleted: whether the tombstone is still stored is a retention detail);
* every **keyless** record below ``upto`` (compaction never drops one, tombstone or not).

``live_offsets`` returns the offsets of those records as a roaring ``BitMap64``;
``digest_frames`` then streams, in offset order, one digest per live record (protocol.py).
Compaction never removes a live record and never changes one, so this is a function of the
data the master served, not of when either side compacted.

Memory is bounded like the compactor's: ``OffsetMap`` (key digest -> latest offset, fixed
budget) over as many rounds as the keys need. A round maps the entries from ``start`` until the
map is full (``end``); every keyed entry after ``end`` that hits the map *kills* the mapped
offset (a later record of that key exists); then an entry in [start, end) is live when it is
keyless, or the map's latest for its key, not killed, and not a tombstone. Each round reads the
indexes only (48 bytes a record), never record data.
"""

from __future__ import annotations

import array
import time
from typing import Iterator

import numpy as np
from pyroaring import BitMap64

from kcompact.compaction.offset_map import OffsetMap
from kcompact.reput import bcq as B
from kcompact.reput.errors import CorruptRecordError, ReputError
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import IndexCursor, PartitionReader

from .protocol import digest_frame

CHUNK_ENTRIES = 1 << 16
DEFAULT_MAP_MEMORY = 64 << 20


class _Changed(Exception):
    """The partition's segments changed under the pass (a compaction swap): start again."""


def _bitmap_add(bm: BitMap64, offsets: np.ndarray) -> None:
    if offsets.shape[0]:
        a = array.array("Q")
        a.frombytes(np.ascontiguousarray(offsets, dtype=np.uint64).tobytes())
        bm.update(a)


def bitmap_array(bm: BitMap64) -> np.ndarray:
    """The offsets of a BitMap64 as a sorted int64 numpy array."""
    return np.frombuffer(bm.to_array(), dtype=np.uint64).astype(np.int64)


def bitmap_slice(bm: BitMap64, lo: int, hi: int) -> np.ndarray:
    """Sorted offsets of ``bm`` in [lo, hi] as int64."""
    if hi < lo or len(bm) == 0:
        return np.zeros(0, np.int64)
    a = bm.rank(lo - 1) if lo > 0 else 0
    b = bm.rank(hi)
    if b <= a:
        return np.zeros(0, np.int64)
    return bitmap_array(bm[a:b])


class _Pass:
    """Ordered iteration over a partition's valid index entries below ``upto``, from a
    position (segment number, entry number), checking that offsets strictly increase.

    Entries come from the partition reader's ``IndexCursor`` (the .bcq, plus, on a read-only
    view, the records of a .log tail its .bcq does not list yet), in chunks of
    ``CHUNK_ENTRIES``: the same entries the reader serves, so the live set and the records
    agree. A chunk is valid until the next one."""

    def __init__(self, pl: PartitionLog, upto: int):
        self.pl, self.upto = pl, upto
        self.segs = list(pl.segments)
        self.cursor = IndexCursor(pl, CHUNK_ENTRIES)

    def chunks(self, si0: int, ei0: int, stop: tuple[int, int] | None = None
               ) -> Iterator[tuple[int, int, np.ndarray]]:
        try:
            yield from self._chunks(si0, ei0, stop)
        except (FileNotFoundError, ReputError, ValueError, OSError):
            raise _Changed() from None

    def _chunks(self, si0: int, ei0: int, stop: tuple[int, int] | None
                ) -> Iterator[tuple[int, int, np.ndarray]]:
        last = -1
        for si in range(si0, len(self.segs)):
            seg = self.segs[si]
            for lo, entries in self.cursor.chunks(seg, ei0 if si == si0 else 0):
                if stop is not None and (si, lo) >= stop:
                    return
                hi = entries.shape[0]
                if stop is not None and si == stop[0]:
                    hi = min(hi, stop[1] - lo)
                e = entries[:hi]
                offs = e["offset"]
                if e.shape[0] and (int(offs[0]) <= last or (e.shape[0] > 1 and bool(
                        np.any(offs[1:] <= offs[:-1])))):
                    raise _Changed()
                cut = int(np.searchsorted(offs, self.upto))
                if cut < e.shape[0]:
                    if cut:
                        yield si, lo, e[:cut]
                    return
                if e.shape[0]:
                    last = int(offs[-1])
                    yield si, lo, e


def _live_once(pl: PartitionLog, upto: int, omap: OffsetMap) -> BitMap64:
    p = _Pass(pl, upto)
    live = BitMap64()
    start = (0, 0)
    while True:
        # 1. map from start until the map is full (end) or the entries run out (end = None)
        end = None
        base = None
        for si, lo, e in p.chunks(*start):
            if base is None:
                base = int(e["offset"][0])
                omap.clear(base)
            j, full = omap.insert_entries(e)
            if full:
                end = (si, lo + j)
                break
        if base is None:
            return live  # nothing (left) below upto
        if end == start:
            raise CorruptRecordError(f"{pl.dir}: offset map too small for one key")
        # 2. kill: a keyed entry after end whose key is mapped supersedes the mapped offset
        killed = []
        if end is not None:
            for _, _, e in p.chunks(*end):
                keyed = (e["flags"] & B.FLAG_KEYLESS) == 0
                found = omap.lookup(e["digest_lo"][keyed], e["digest_hi"][keyed])
                found = found[found >= 0]
                if found.shape[0]:
                    killed.append(np.unique(found))
        dead = np.unique(np.concatenate(killed)) if killed else np.zeros(0, np.int64)
        # 3. decide the entries in [start, end)
        for _, _, e in p.chunks(*start, stop=end):
            offs = e["offset"]
            flags = e["flags"]
            keyless = (flags & B.FLAG_KEYLESS) != 0
            latest = omap.lookup(e["digest_lo"], e["digest_hi"])
            keep = (latest == offs) & ((flags & B.FLAG_TOMBSTONE) == 0) & ~keyless
            if dead.shape[0]:
                keep &= ~np.isin(offs, dead, assume_unique=False)
            keep |= keyless
            _bitmap_add(live, offs[keep])
        if end is None:
            return live
        start = end


def _signature(pl: PartitionLog) -> list[tuple[int, int, int]]:
    return [(s.base, s.log_size, s.index_size) for s in pl.segments]


def live_offsets(pl: PartitionLog, upto: int | None = None,
                 map_memory: int = DEFAULT_MAP_MEMORY, omap: OffsetMap | None = None,
                 attempts: int = 5) -> tuple[BitMap64, int]:
    """(live offsets below ``upto``, upto). ``upto`` defaults to the partition's next offset.

    On a read-only view next to a live compactor, a pass that meets a segment swap (a file
    gone, offsets not increasing, or the segment list different at the end) starts again.
    """
    pl.refresh()
    if upto is None:
        upto = pl.next_offset
    omap = omap or OffsetMap(map_memory)
    for attempt in range(attempts):
        before = _signature(pl)
        try:
            live = _live_once(pl, upto, omap)
        except _Changed:
            live = None
        pl.refresh()
        if live is not None and _signature(pl) == before:
            return live, upto
        for seg in pl.segments:
            seg.invalidate()
        time.sleep(0.02 * (attempt + 1))
    raise CorruptRecordError(f"{pl.dir}: its segments kept changing while the live offsets were "
                             "computed (compaction running continuously?); try again")


def digest_frames(pl: PartitionLog, live: BitMap64, upto: int, salt: bytes,
                  read_bytes: int = 4 << 20) -> Iterator[bytes]:
    """Digests frames (protocol.py) of the live records below ``upto``, in offset order.

    A digest covers a record's bytes as the master stores them, so they are read as raw ranges
    (``PartitionReader.read_raw``: verified, retried across a compaction swap); the reader skips
    straight to the next live offset, so a sparse live set reads little."""
    reader = PartitionReader(pl)
    off = 0
    while off < upto and len(live):
        nxt = live.next_set_bit(off) if off <= live.max() else None
        if nxt is None or nxt >= upto:
            return
        off = int(nxt)
        r = reader.read_raw(off, read_bytes)
        e = r.entries
        if e.shape[0] == 0:
            return
        offs = e["offset"]
        cand = bitmap_slice(live, int(offs[0]), min(int(offs[-1]), upto - 1))
        mask = np.isin(offs, cand) & (offs < upto)
        if bool(mask.any()):
            frame = digest_frame(r.buf[:r.nbytes], r.positions()[mask],
                                 e["size"][mask].astype(np.int64), offs[mask], salt)
            if frame:
                yield frame
        off = r.next_offset
