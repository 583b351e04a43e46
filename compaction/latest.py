"""The latest record per key of a partition, decided from the .bcq index alone.

Used by readers that want the compacted view without waiting for a compaction (the Spark data
source's ``mode=latest``, restore, the KV map): the compacted segments plus the dirty tail,
one record per live key, tombstoned keys and keyless records left out. With ``as_of_ms`` the
same over the records with a timestamp <= it: the state as of that time (compaction/history.py
says when that is exact).
"""

from __future__ import annotations

import numpy as np

from kcompact.reput.partition import PartitionLog, Segment
from kcompact.reput.reader import IndexCursor

from .offset_map import SLOT_BYTES, OffsetMap


def latest_selection(pl: PartitionLog, *, include_keyless: bool = False,
                     as_of_ms: int | None = None, include_tombstones: bool = False
                     ) -> list[tuple[Segment, np.ndarray]]:
    """[(segment, indices of its winning entries)] in offset order.

    A record wins when it is the last for its key digest and not a tombstone (a tombstone too
    with ``include_tombstones``). With ``as_of_ms`` only records with a timestamp <= it count
    (keyless ones included). The digest -> latest offset map is sized to the partition's keyed
    records, so one pass over the index decides everything (two passes: build, then select).
    """
    segs = [s for s in pl.segments if s.index().n]
    total = sum(s.index().n for s in segs)
    if total == 0:
        return []
    first = int(segs[0].index().entries[0]["offset"])
    m = OffsetMap(max(4096, int(total / 0.85 + 64) * SLOT_BYTES))
    m.clear(first)
    cursor = IndexCursor(pl)
    for seg in segs:
        for _, e in cursor.chunks(seg):
            if as_of_ms is not None:
                e = e[e["timestamp"] <= as_of_ms]
            _, full = m.insert_entries(e)
            if full:  # offsets span more than 2^32: fall back to sorting
                return _latest_by_sort(pl, segs, include_keyless, as_of_ms, include_tombstones)
    out = []
    for seg in segs:
        e = seg.index().entries
        keyed = (e["flags"] & 2) == 0
        latest = m.latest_of(e)
        win = keyed & (latest == e["offset"])
        if not include_tombstones:
            win &= (e["flags"] & 1) == 0
        if include_keyless:
            win |= ~keyed
        if as_of_ms is not None:
            win &= e["timestamp"] <= as_of_ms
        out.append((seg, np.nonzero(win)[0]))
    return out


def _latest_by_sort(pl: PartitionLog, segs, include_keyless: bool, as_of_ms: int | None,
                    include_tombstones: bool):
    parts = [s.index().entries for s in segs]
    seg_of = np.concatenate([np.full(p.shape[0], k) for k, p in enumerate(parts)])
    idx_of = np.concatenate([np.arange(p.shape[0]) for p in parts])
    e = np.concatenate(parts)
    counted = (np.ones(e.shape[0], bool) if as_of_ms is None
               else e["timestamp"] <= as_of_ms)
    keyed = (e["flags"] & 2) == 0
    dig = np.stack([e["digest_hi"], e["digest_lo"]], axis=1)
    cand = np.flatnonzero(counted & keyed)
    order = cand[np.lexsort((e["offset"][cand], dig[cand, 1], dig[cand, 0]))]
    d = dig[order]
    last = np.ones(order.shape[0], bool)
    last[:-1] = np.any(d[1:] != d[:-1], axis=1)
    win = np.zeros(e.shape[0], bool)
    win[order[last]] = True
    if not include_tombstones:
        win &= (e["flags"] & 1) == 0
    if include_keyless:
        win |= ~keyed & counted
    return [(s, idx_of[(seg_of == k) & win]) for k, s in enumerate(segs)]
