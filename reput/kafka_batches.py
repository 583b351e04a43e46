"""A partition's records as Kafka RecordBatch v2 batches, for the Kafka endpoint (issue 40).

TEMPORARY: the segment-format rework (branch ``arch-seg``) provides the same call on its segment
types; this module keeps the exact signature so that the endpoint
(``kcompact.replication.kafka_endpoint``), which calls only ``PartitionReader.kafka_batches`` and
the timestamp functions below, keeps working when it is swapped in, and
``tests/unit/test_kafka_batches.py`` checks either implementation against the same model.

``kafka_batches(pl, from_offset, max_bytes)``: whole batches, the first the one holding
``from_offset`` or, in a gap, the next one; the first whole even past ``max_bytes`` (KIP-74),
later ones only while whole within it; one segment at most. A sealed format-2 segment's batches
are its stored bytes (docs/formats/segment-v2.md): memoryview slices of the mapped ``.log`` on a
local store, bytes from an object store; each batch's header and CRC-32C is checked before it is
handed out (once per batch of an immutable segment, remembered). A format-1 segment's records
(the active segment, an old store's) go out as one uncompressed batch encoded on the fly from
verified records (reput/batch.py ``encode_batch``). A compaction swap under a read is retried as
every offset read is (``PartitionReader``).

Timestamps (ListOffsets): ``offset_for_timestamp`` is the first record whose timestamp is at or
after T (Kafka's ``fetchOffsetByTimestamp``), ``max_timestamp`` the first record holding the
partition's largest timestamp (Kafka 3.9's MAX_TIMESTAMP); both read the index only.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import numpy as np

from . import batch as KB
from .columns import stored_records
from .errors import CorruptRecordError


class KafkaBatches(NamedTuple):
    """``parts``: buffer objects holding whole RecordBatch v2 batches back to back (``nbytes``
    in all); ``next_offset``: the last batch's baseOffset + lastOffsetDelta + 1, or the offset
    asked for when nothing is at or after it."""

    parts: list
    nbytes: int
    next_offset: int


class TimestampOffset(NamedTuple):
    offset: int
    timestamp: int


#: batch positions of immutable sealed segments whose header and CRC were checked, per segment
#: object (a swap or a re-seal makes a new Segment) and its file sizes
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_checked_lock = threading.Lock()


def _checked_set(seg) -> set:
    key = (seg.log_size, seg.index_size)
    with _checked_lock:
        got = _checked.get(seg)
        if got is None or got[0] != key:
            got = (key, set())
            _checked[seg] = got
        return got[1]


def kafka_batches(reader, from_offset: int, max_bytes: int) -> KafkaBatches:
    """See the module docstring; ``reader`` is the partition's ``PartitionReader``."""
    from_offset = max(0, int(from_offset))
    return reader._retrying(_once, reader, from_offset, max(0, int(max_bytes)))


def _once(reader, from_offset: int, max_bytes: int) -> KafkaBatches:
    pl = reader.pl
    i = pl.segment_for(from_offset)
    while i < len(pl.segments):
        seg = pl.segments[i]
        i += 1
        listed = seg.listed()
        if listed is not None and (listed[0] == 0 or listed[2] < from_offset):
            continue
        if pl.seg_format(seg) == 2:
            got = _stored(pl, seg, from_offset, max_bytes)
        else:
            got = _encoded(reader, seg, from_offset, max_bytes)
        if got is not None:
            return got
    return KafkaBatches([], 0, from_offset)


def _stored(pl, seg, from_offset: int, max_bytes: int) -> KafkaBatches | None:
    idx = pl.index(seg)
    n = idx.n
    j = int(idx.lower_bound(from_offset))
    if j >= n:
        return None
    pos0 = int(idx.slice(j, j + 1)["position"][0])
    bpos, bsize, _ = idx.batches()
    k = int(np.searchsorted(bpos, pos0))
    if k >= bpos.shape[0] or int(bpos[k]) != pos0:
        path = pl.seg_index_path(seg)
        raise CorruptRecordError(f"{path}: an index entry names no batch of the .log; run "
                                 "`kcompact verify`", path, pos0)
    ends = np.cumsum(bsize[k:]) if bsize.shape[0] > k else np.zeros(0, np.int64)
    m = max(1, int(np.searchsorted(ends, max_bytes, side="right")))
    total = int(ends[m - 1])
    data = pl.log_bytes(seg, pos0, total)
    if data.shape[0] != total:
        path = pl.seg_log_path(seg)
        raise CorruptRecordError(f"{path}: the .log ends inside the batches its index lists "
                                 f"(byte {pos0 + data.shape[0]})", path, pos0 + data.shape[0])
    done = _checked_set(seg) if not seg.open_tail else set()
    path = pl.seg_log_path(seg)
    p, last = 0, -1
    parts = []
    for b in range(k, k + m):
        size = int(bsize[b])
        where = pos0 + p
        if where in done:
            base, delta = KB._HEAD12.unpack_from(data, p)[0], _last_delta(data, p)
            last = base + delta
        else:
            h = KB.parse_head(data, p, path, where)
            if h.size != size:
                raise CorruptRecordError(f"{path}: the batch at byte {where} holds {h.size} "
                                         f"bytes, its index lists {size}", path, where)
            last = h.last_offset
            done.add(where)
        p += size
    if last < from_offset:
        raise CorruptRecordError(f"{path}: the batch at byte {pos0} ends at offset {last}, "
                                 f"below {from_offset} its index places in it", path, pos0)
    parts.append(memoryview(data) if isinstance(data, np.ndarray) else data)
    return KafkaBatches(parts, total, last + 1)


def _last_delta(data: np.ndarray, p: int) -> int:
    return int.from_bytes(bytes(data[p + 23:p + 27]), "big", signed=True)


def _encoded(reader, seg, from_offset: int, max_bytes: int) -> KafkaBatches | None:
    """A format-1 segment: its verified records from ``from_offset`` (``read``: the first
    whole even past ``max_bytes``) encoded as one uncompressed batch (more when their offsets
    span over 2^31)."""
    block = reader._read_once(from_offset, None, max(1, max_bytes))
    if len(block) == 0:
        return None
    data, rel, _sizes, _ent = stored_records(block)
    offs = block.offsets.astype(np.int64)
    ts = block.timestamps.astype(np.int64)
    parts, total, lo, n = [], 0, 0, offs.shape[0]
    while lo < n:
        hi = int(np.searchsorted(offs, int(offs[lo]) + 0x7FFFFFFF, side="right"))
        eb = KB.encode_batch(data, rel, lo, hi, offs, ts, KB.CODEC_NONE, 0)
        parts.append(eb.data)
        total += len(eb.data)
        lo = hi
    return KafkaBatches(parts, total, int(offs[-1]) + 1)


def offset_for_timestamp(reader, timestamp: int) -> TimestampOffset | None:
    """The first record (in offset order) whose timestamp is >= ``timestamp``: its offset and
    timestamp; None when no record is that recent."""
    from .reader import IndexCursor
    pl = reader.pl
    cur = IndexCursor(pl)
    for seg in pl.segments:
        for _, e in cur.chunks(seg):
            if e.shape[0] == 0:
                continue
            hit = np.flatnonzero(e["timestamp"] >= timestamp)
            if hit.shape[0]:
                r = e[int(hit[0])]
                return TimestampOffset(int(r["offset"]), int(r["timestamp"]))
    return None


def max_timestamp(reader) -> TimestampOffset | None:
    """The first record holding the partition's largest timestamp; None when it is empty."""
    from .reader import IndexCursor
    pl = reader.pl
    cur = IndexCursor(pl)
    best: TimestampOffset | None = None
    for seg in pl.segments:
        for _, e in cur.chunks(seg):
            if e.shape[0] == 0:
                continue
            k = int(np.argmax(e["timestamp"]))
            t = int(e["timestamp"][k])
            if best is None or t > best.timestamp:
                best = TimestampOffset(int(e["offset"][k]), t)
    return best


__all__ = ["KafkaBatches", "TimestampOffset", "kafka_batches", "max_timestamp",
           "offset_for_timestamp"]
