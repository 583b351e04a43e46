"""The one partition reader: every read of partition data goes through here.

RocketMQ's ``ConsumeQueueInterface.iterateFrom``: one index iterator serves every reader. A
partition's records are found through its segments' indexes and read through the segments
themselves (reput/segment.py: one class per kind of segment, which knows how its records are
stored and checks them); this module walks the partition's segments, plans each read and
retries it across a compaction swap. Five ways in:

* **By offset** (``PartitionReader.read``, ``blocks``, ``records``, ``read_fields``): the
  records with offset >= ``from_offset`` in offset order, one segment per block; a missing
  offset continues at the next existing one; at least one record per block when any exists,
  even one larger than ``max_bytes``. ``dump``, restore's progress, the KV map's catch-up, the
  replica's merge.
* **A selection** (``PartitionReader.segment(seg).select(entries)``): chosen entries of one
  segment (what ``IndexCursor`` and a decision over them picked: the compactor's kept records,
  the latest record per key of a partition), read in blocks whose span is at most
  ``block_bytes``; ``sequential=True`` streams the .log front to back (one request on an object
  store, however many blocks).
* **Raw ranges, for replication only** (``read_raw``, ``locate``): format-1 records back to
  back, which the master ships as they are (``kcompact serve``); a format-1 segment's are a
  range of its file (``locate``: sent with sendfile).
* **Kafka batches, for the Kafka endpoint** (``kafka_batches``): whole RecordBatch v2 batches
  from the one holding an offset; a sealed format-2 segment's as stored, the active segment's
  encoded on the fly. ``offset_for_timestamp`` and ``max_timestamp`` answer ListOffsets.
* **The index alone** (``IndexCursor``): a segment's entries in bounded chunks read into a
  reused buffer (compaction's first pass, the planner, the KV map's winner pass, the live-set
  computation), never the data.

A block is a ``RecordColumns`` (reput/columns.py): offsets, timestamps, flags (tombstone,
keyless), key digests and clean times (from the index), key, value and header columns
(``BytesColumn``: one buffer, n+1 offsets, a null mask; headers encoded, decoded on demand by
``header_lists``), and ``Record`` objects for the slow paths (``records()``: dump, tests).

**What is verified.** Every record handed out passed its segment's check (segment_v1.py's
``verify_records`` at the position its index entry names: a valid header, a CRC32C that matches,
the entry's size, offset, timestamp, attributes and key digest under the store's secret; a
format-2 segment's batch CRC-32C, its records walked, each checked against its entry the same
way): nothing the index says about a record handed out can differ from the record. An offset
read also checks that the index search could not have stepped over a record (the segment
modules say how), so a read returns every record at or after the offset asked for, or fails.
The check returns the first record that fails, so a reader can hand out the verified prefix of
a block: the ``CorruptRecordError`` it raises carries it (``prefix``, ``last_good_offset``) and
names the file, the byte position and what did not match; ``blocks``/``records`` yield the
prefix before they raise.

Index-only consumers read entries they do not verify against records: ``IndexCursor`` checks
an index it reads whole against the checksum its segment-list or manifest entry gives (once per
segment, until the files change), and raises at the end of that pass when it differs, before
its caller acts on what it read.

**Across a compaction swap.** A read-only reader next to a compactor in another process can meet
a .log and a .bcq from different sides of a swap (docs/formats/compaction-swap.md: the two are
replaced one after the other): the check fails. Reads by offset, raw ranges and Kafka batches
then re-list the partition and try again (4 attempts, 20-80 ms apart); a mismatch that persists
is corruption and is raised. A writer's view (the compactor's own) has no one swapping under
it: one attempt.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import numpy as np

from . import bcq as B
from .columns import KeyValues, RecordColumns, Spans
from .errors import CorruptRecordError
from .record import Record
from .segment import (DEFAULT_BLOCK_BYTES, KafkaBatches, Located, RawRange, ReadPlan,
                      Selection, TimestampOffset, read_fully)
from .segment_v1 import warm_up  # noqa: F401 (the kernels a read runs)

#: attempts of a read-only view's offset read across a compaction swap
SWAP_ATTEMPTS = 4

_EMPTY_ENTRIES = np.zeros(0, dtype=B.BCQ_DTYPE)

#: a selection of one segment's records (``PartitionReader.segment``)
SegmentRecords = Selection


class BufferPool:
    """Reusable uint8 buffers (a few per server): take() / give()."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.shape[0] >= n:
                    return self._free.pop(i)
        return np.empty(max(n, 1 << 20), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


class PartitionReader:
    """Reads one partition (a ``PartitionLog``); see the module docstring."""

    def __init__(self, pl, *, attempts: int | None = None):
        self.pl = pl
        self.attempts = attempts or (1 if pl.writable else SWAP_ATTEMPTS)

    # -- by offset -------------------------------------------------------------------------

    def read(self, from_offset: int, max_records: int | None = None,
             max_bytes: int | None = None) -> RecordColumns:
        """Records with offset >= ``from_offset``, from one segment at most (module docstring).
        Raises ``CorruptRecordError`` when a record fails its check (carrying the verified
        records before it)."""
        pl = self.pl
        if max_records is not None and max_records <= 0:
            return RecordColumns.empty(pl.topic, pl.partition, from_offset)
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        return self._retrying(self._read_once, from_offset, max_records, max_bytes)

    def read_fields(self, from_offset: int, max_bytes: int | None = None,
                    want: np.ndarray | None = None) -> KeyValues:
        """``read``'s records as their keys and values only (with offsets), for a reader that
        needs nothing else (the KV map's build). A segment that can take them where they lie
        (a format-2 segment: in the decompressed batches) does so, each batch and each record
        checked as ``read`` checks them, without writing format-1 records; anything that fails
        goes through ``read``, which names it. ``max_bytes`` bounds the batches decoded (about
        that many bytes of records). ``want`` (offsets, rising): only those records are handed
        out (and checked against their entries; every batch is still checked whole),
        ``next_offset`` still the read's; a format-1 segment's block gives them all."""
        from_offset = max(0, min(int(from_offset), (1 << 63) - 1))
        if want is not None:
            want = np.asarray(want, np.int64)
        return self._retrying(self._fields_once, from_offset, max_bytes, want)

    def _fields_once(self, from_offset: int, max_bytes: int | None,
                     want: np.ndarray | None) -> KeyValues:
        plan = self._plan(from_offset, None, max_bytes)
        if plan is not None:
            got = plan.seg.read_fields(plan, max_bytes, want)
            if got is not None:
                return got
        return KeyValues.of(self._planned(from_offset, plan, max_bytes))

    def blocks(self, from_offset: int = 0, *, max_bytes: int | None = DEFAULT_BLOCK_BYTES,
               limit: int | None = None) -> Iterator[RecordColumns]:
        """Blocks from ``from_offset`` to the end (at most ``limit`` records). When a record
        fails its check, the verified records before it are yielded, then the error raised."""
        off, n = from_offset, 0
        while limit is None or n < limit:
            try:
                b = self.read(off, None if limit is None else limit - n, max_bytes)
            except CorruptRecordError as e:
                err = e
            else:
                if len(b) == 0:
                    return
                yield b
                n += len(b)
                off = b.next_offset
                continue
            if err.prefix is not None and len(err.prefix):
                yield err.prefix
            raise err

    def records(self, from_offset: int = 0, limit: int | None = None,
                block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Record]:
        """``Record`` objects from ``from_offset`` (dump, restore's progress, tests)."""
        for b in self.blocks(from_offset, max_bytes=block_bytes, limit=limit):
            yield from b.records()

    def _read_once(self, from_offset: int, max_records: int | None,
                   max_bytes: int | None) -> RecordColumns:
        return self._planned(from_offset, self._plan(from_offset, max_records, max_bytes),
                             max_bytes)

    def _planned(self, from_offset: int, plan: ReadPlan | None,
                 max_bytes: int | None) -> RecordColumns:
        if plan is None:
            return RecordColumns.empty(self.pl.topic, self.pl.partition,
                                       max(from_offset, self.pl.next_offset))
        return plan.seg.read(plan, max_bytes)

    def _plan(self, from_offset: int, max_records: int | None,
              max_bytes: int | None) -> ReadPlan | None:
        """What a read from ``from_offset`` reads (``Segment.plan`` of the first segment that
        holds a record at or after it), or None when no such record exists."""
        pl = self.pl
        for seg in pl.segments[pl.segment_for(from_offset):]:
            ent = seg.bitmap_desc
            if ent is not None and (ent.records == 0 or ent.last_offset < from_offset):
                continue  # the manifest says it holds nothing at or after from_offset
            plan = seg.plan(from_offset, max_records, max_bytes)
            if plan is not None:
                return plan
        return None

    def _retrying(self, fn, *args):
        """``fn(*args)``, again after re-listing the partition when a .log/.bcq pair caught in
        the middle of a compaction swap fails the checks; a mismatch that persists is raised."""
        pl = self.pl
        for attempt in range(self.attempts):
            try:
                return fn(*args)
            except (CorruptRecordError, FileNotFoundError):
                if attempt == self.attempts - 1:
                    raise
                time.sleep(0.02 * (attempt + 1))
                for seg in pl.segments:
                    seg.invalidate()
                pl.reread()
        raise AssertionError("unreachable")

    # -- a selection ---------------------------------------------------------------------------

    def segment(self, seg, *, sequential: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                buffer: np.ndarray | None = None) -> Selection:
        """Selected records of segment ``seg``: ``with reader.segment(seg) as s:
        for block in s.select(entries): ...`` (module docstring)."""
        return seg.selection(sequential, block_bytes, buffer)

    # -- raw ranges: replication only ------------------------------------------------------------

    def read_raw(self, from_offset: int, max_bytes: int, pool: BufferPool | None = None
                 ) -> RawRange:
        """The records ``read`` would return, as format-1 records back to back, in a buffer from
        ``pool``: the master's records response (``kcompact serve``). Verified and contiguous
        (module docstring)."""
        return self._retrying(self._read_raw_once, int(from_offset), max_bytes, pool)

    def _read_raw_once(self, from_offset: int, max_bytes: int, pool: BufferPool | None
                       ) -> RawRange:
        plan = self._plan(from_offset, None, max_bytes)
        if plan is None:
            return RawRange(None, 0, _EMPTY_ENTRIES, max(from_offset, self.pl.next_offset))
        return plan.seg.read_raw(plan, max_bytes, pool)

    def locate(self, from_offset: int, max_bytes: int) -> Located | None:
        """Where the records ``read_raw`` would return lie, for a local store: a Located range
        (open fd) or None when no record at or after ``from_offset`` exists. No byte of a
        format-1 range is read but the record headers at its ends and before it; the replica
        checks every record."""
        return self._retrying(self._locate_once, int(from_offset), max_bytes)

    def _locate_once(self, from_offset: int, max_bytes: int) -> Located | None:
        plan = self._plan(from_offset, None, max_bytes)
        if plan is None:
            return None
        return plan.seg.locate(plan, max_bytes)

    # -- Kafka batches and timestamps: the Kafka endpoint ---------------------------------------

    def kafka_batches(self, from_offset: int, max_bytes: int) -> KafkaBatches:
        """Whole Kafka RecordBatch v2 batches, the first the one holding ``from_offset`` or, in
        a gap, the next one; the first whole even past ``max_bytes`` (KIP-74), later ones only
        while whole within it; from one segment at most. ``next_offset``: the last batch's
        baseOffset + lastOffsetDelta + 1, or ``from_offset`` when nothing is at or after it. A
        sealed format-2 segment's batches are its stored bytes (checked once, never decoded or
        re-encoded); a format-1 segment's verified records are encoded on the fly."""
        return self._retrying(self._kafka_once, max(0, int(from_offset)), max(0, int(max_bytes)))

    def _kafka_once(self, from_offset: int, max_bytes: int) -> KafkaBatches:
        pl = self.pl
        for seg in pl.segments[pl.segment_for(from_offset):]:
            listed = seg.listed()
            if listed is not None and (listed[0] == 0 or listed[2] < from_offset):
                continue  # its catalog entry says it holds nothing at or after from_offset
            got = seg.kafka_batches(from_offset, max_bytes)
            if got is not None:
                return got
        return KafkaBatches([], 0, from_offset)

    def offset_for_timestamp(self, timestamp: int) -> TimestampOffset | None:
        """The first record (in offset order) whose timestamp is >= ``timestamp`` (Kafka's
        ``fetchOffsetByTimestamp``), from the indexes only; None when no record is that
        recent."""
        return self._retrying(self._for_timestamp_once, int(timestamp))

    def _for_timestamp_once(self, timestamp: int) -> TimestampOffset | None:
        cur = IndexCursor(self.pl)
        for seg in self.pl.segments:
            hit = seg.offset_for_timestamp(timestamp, cur.buf)
            if hit is not None:
                return hit
        return None

    def max_timestamp(self) -> TimestampOffset | None:
        """The first record holding the partition's largest timestamp (Kafka 3.9's
        MAX_TIMESTAMP), from the indexes only; None when the partition is empty."""
        return self._retrying(self._max_timestamp_once)

    def _max_timestamp_once(self) -> TimestampOffset | None:
        cur = IndexCursor(self.pl)
        best = None
        for seg in self.pl.segments:
            top = seg.max_timestamp(cur.buf)
            if top is not None and (best is None or top.timestamp > best.timestamp):
                best = top
        return best


def offset_for_timestamp(reader: PartitionReader, timestamp: int) -> TimestampOffset | None:
    """``reader.offset_for_timestamp(timestamp)``."""
    return reader.offset_for_timestamp(timestamp)


def max_timestamp(reader: PartitionReader) -> TimestampOffset | None:
    """``reader.max_timestamp()``."""
    return reader.max_timestamp()


class IndexCursor:
    """A partition's index entries, segment by segment, in bounded chunks read into one reused
    buffer (each chunk valid until the next). Memory stays bounded whatever the index size (no
    mapping of the whole file), and an index is read as one sequential stream (one request on
    an object store); each segment says how (``Segment.index_chunks``)."""

    def __init__(self, pl, chunk_entries: int = 1 << 15, buf: np.ndarray | None = None):
        self.pl = pl
        self.chunk_entries = chunk_entries
        if buf is None or buf.shape[0] < chunk_entries * B.ENTRY_SIZE:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
        self.buf = buf

    def count(self, seg) -> int:
        """Valid entries of ``seg``."""
        return seg.index().n

    def lower_bound(self, seg, offset: int) -> int:
        """Number of the first entry of ``seg`` with offset >= ``offset``."""
        return int(seg.index().lower_bound(offset))

    def chunks(self, seg, start_entry: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """(number of the first entry, entries) of ``seg`` from entry ``start_entry``. A pass
        from entry 0 to the end over an index whose segment-list or manifest entry gives its
        checksum checks it (module docstring): a mismatch raises ``CorruptRecordError`` after
        the last chunk, before the caller acts on the pass."""
        return seg.index_chunks(start_entry, self.buf, self.chunk_entries)

    def tombstone_columns(self, seg) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(flags, clean_time) of every entry of ``seg``, a chunk at a time: what a look for
        tombstones due for purging reads; checked as ``chunks`` checks a pass from entry 0."""
        return seg.tombstone_columns(self.buf)

    def check(self, seg) -> None:
        """``seg``'s index against the size and checksum its segment-list or manifest entry
        gives (CorruptRecordError otherwise; nothing when no entry gives one or it was checked
        since the files last changed)."""
        seg.check_index(self.buf)


__all__ = ["BufferPool", "DEFAULT_BLOCK_BYTES", "IndexCursor", "KafkaBatches", "Located",
           "PartitionReader", "RawRange", "RecordColumns", "SegmentRecords", "Spans",
           "TimestampOffset", "max_timestamp", "offset_for_timestamp", "read_fully", "warm_up"]
