"""The latest record per key of a partition, decided from the .bcq index alone.

Used by readers that want the compacted view without waiting for a compaction (the Spark data
source's ``mode=latest``, restore, the KV map): the compacted segments plus the dirty tail,
one record per live key, tombstoned keys and keyless records left out.
"""

from __future__ import annotations

import numpy as np

from kcompact.reput.partition import PartitionLog, Segment
from kcompact.reput.reader import IndexCursor

from .offset_map import SLOT_BYTES, OffsetMap


def latest_selection(pl: PartitionLog, *, include_keyless: bool = False
                     ) -> list[tuple[Segment, np.ndarray]]:
    """[(segment, indices of its winning entries)] in offset order.

    A record wins when it is the last for its key digest and not a tombstone. The digest ->
    latest offset map is sized to the partition's keyed records, so one pass over the index
    decides everything (two passes: build, then select).
    """
    segs = [s for s in pl.segments if pl.index(s).n]
    total = sum(pl.index(s).n for s in segs)
    if total == 0:
        return []
    first = int(pl.index(segs[0]).entries[0]["offset"])
    m = OffsetMap(max(4096, int(total / 0.85 + 64) * SLOT_BYTES))
    m.clear(first)
    cursor = IndexCursor(pl)
    for seg in segs:
        for _, e in cursor.chunks(seg):
            _, full = m.insert_entries(e)
            if full:  # offsets span more than 2^32: fall back to sorting
                return _latest_by_sort(pl, segs, include_keyless)
    out = []
    for seg in segs:
        e = pl.index(seg).entries
        keyed = (e["flags"] & 2) == 0
        latest = m.latest_of(e)
        win = keyed & (latest == e["offset"]) & ((e["flags"] & 1) == 0)
        if include_keyless:
            win |= ~keyed
        out.append((seg, np.nonzero(win)[0]))
    return out


def _latest_by_sort(pl: PartitionLog, segs, include_keyless: bool):
    parts = [pl.index(s).entries for s in segs]
    seg_of = np.concatenate([np.full(p.shape[0], k) for k, p in enumerate(parts)])
    idx_of = np.concatenate([np.arange(p.shape[0]) for p in parts])
    e = np.concatenate(parts)
    keyed = (e["flags"] & 2) == 0
    dig = np.stack([e["digest_hi"], e["digest_lo"]], axis=1)
    order = np.lexsort((e["offset"], dig[:, 1], dig[:, 0]))
    d = dig[order]
    last = np.ones(order.shape[0], bool)
    last[:-1] = np.any(d[1:] != d[:-1], axis=1)
    win = np.zeros(e.shape[0], bool)
    win[order[last]] = True
    win &= keyed & ((e["flags"] & 1) == 0)
    if include_keyless:
        win |= ~keyed
    return [(s, idx_of[(seg_of == k) & win]) for k, s in enumerate(segs)]
