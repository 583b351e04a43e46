"""A segment of a partition's compaction log, as a type: the interface every kind implements.

Kafka gives each batch magic its own ``RecordBatch`` class; RocketMQ reads every queue through
``ConsumeQueueInterface``. Here a partition's segment is an object of one class per kind of
segment, chosen ONCE, when the partition's catalog lists it (``open_segment``,
reput/segment_kinds.py: the only place that picks a segment's class), and everything above (the partition reader,
``kcompact verify``, the compactor, sealing, replication, the Kafka endpoint) calls its methods
and never asks which kind it is:

* ``RecordSegment`` (reput/segment_v1.py): store format 1, kcompact's own records
  (docs/formats/record.md) and a 48-byte entry per record (bcq.md). The active segment a writer
  appends to is one, as are the segments of a store written before format 2.
* ``KafkaSegment`` (reput/segment_v2.py): store format 2, a sealed Kafka log segment
  (RecordBatch v2, segment-v2.md) and its checksummed lean index (bcq-v2.md).

What a segment does (``Segment``'s methods; docs/architecture.md, "The segment interface"):

* **describe itself**: ``index()`` (its entries in ``bcq.BCQ_DTYPE``, whatever is stored),
  ``count``, ``describe``, ``current_desc`` (its catalog entry computed from what it holds),
  ``batches`` (its Kafka batches, None when it stores none);
* **plan and read** from an offset within a byte budget: ``plan`` then ``read`` (records as
  ``RecordColumns``), ``read_fields`` (keys and values only), ``read_raw``/``locate`` (format-1
  records back to back, what replication ships), ``kafka_batches`` (Kafka batches as stored, or
  encoded on the fly), ``offset_for_timestamp``/``max_timestamp``;
* **select** chosen records (``selection``: the compactor's kept records, a seal's input);
* **index passes** (``index_chunks``, ``tombstone_columns``, ``check_index``);
* **verify** (``verify``: every byte against its index and its catalog entry);
* **compaction's questions** (``needs_rewrite``, ``restamps_in_place``, ``kept_bytes``,
  ``write_index``), **recovery's** (``recover_tail``, ``check_sealed``) and **shipping's**
  (``ships_as_stored``, ``stored_version``: a segment replication may ship byte for byte).

A segment knows where its files are (``fs``, ``log_path``, ``bcq_path``) and whose records it
holds (``ctx``, the partition's ``PartitionContext``); its sizes are what the partition last
listed (a writer's appends move them), and what it caches from its files is dropped by
``invalidate`` when they change.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from . import bcq as B
from .bcq2 import is_lean
from .backend import Backend, _oserror
from .errors import CorruptRecordError
from .segment_desc import SegmentDesc

if TYPE_CHECKING:
    from .columns import KeyValues, RecordColumns

#: default span of one block (bytes read at once)
DEFAULT_BLOCK_BYTES = 4 << 20
#: entries an index pass reads at once when its caller gives no buffer (1.5 MiB)
CHUNK_ENTRIES = 1 << 15


class PartitionContext:
    """What a partition's segments share: whose records they hold (topic, partition, the
    store's digest secret), whether their partition is a writer's view, and the one batch the
    partition's last read of a Kafka segment decompressed (``last_batch``: a sequential
    reader's next read usually starts in it; one per partition at most)."""

    __slots__ = ("topic", "topic_bytes", "partition", "secret", "writable", "last_batch")

    def __init__(self, topic: str, partition: int, secret: bytes, writable: bool):
        self.topic, self.topic_bytes = topic, topic.encode()
        self.partition, self.secret, self.writable = partition, secret, writable
        self.last_batch = None


class ReadPlan(NamedTuple):
    """What a read from an offset reads of one segment (``Segment.plan``): its index entries
    (``guard`` of them, at the front, are only checked, not handed out), whether the first is
    the segment's first, whether the last is its last in an exact segment."""

    seg: "Segment"
    entries: np.ndarray
    guard: int
    at_start: bool
    at_end: bool


class RawRange(NamedTuple):
    """A verified run of format-1 records back to back (replication only): ``buf[:nbytes]``,
    their index entries (positions in ``buf``'s frame: the .log's for a format-1 segment), and
    where the next read starts. ``buf`` comes from the pool given to ``read_raw`` (give it back
    once sent) when it is one; None when there are no records."""

    buf: np.ndarray | None
    nbytes: int
    entries: np.ndarray
    next_offset: int

    @property
    def count(self) -> int:
        return self.entries.shape[0]

    def positions(self) -> np.ndarray:
        """Where each record starts in ``buf`` (int64)."""
        e = self.entries
        return e["position"].astype(np.int64) - (int(e[0]["position"]) if e.shape[0] else 0)


class Located:
    """A range of one segment's .log to send as it is (``os.sendfile``): ``fd`` is open on the
    .log the index entries describe (close it after sending). Records that are not a range of
    the file (a Kafka segment's) come in ``data`` (fd -1), decoded, to be written as they are."""

    __slots__ = ("fd", "start", "nbytes", "count", "next_offset", "data")

    def __init__(self, fd: int, start: int, nbytes: int, count: int, next_offset: int,
                 data: np.ndarray | None = None):
        self.fd, self.start, self.nbytes = fd, start, nbytes
        self.count, self.next_offset = count, next_offset
        self.data = data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class KafkaBatches(NamedTuple):
    """Whole Kafka RecordBatch v2 batches (``PartitionReader.kafka_batches``): ``parts``,
    buffer objects holding them back to back (memoryview slices of a mapped sealed .log on a
    local store, bytes otherwise), ``nbytes`` in all; ``next_offset``: the last batch's
    baseOffset + lastOffsetDelta + 1, or the offset asked for when nothing is at or after it;
    ``zstd``: whether any of the batches is compressed with zstd (which Kafka serves only to a
    Fetch v10+, KIP-110), so that the endpoint need not look inside them."""

    parts: list
    nbytes: int
    next_offset: int
    zstd: bool = False


class TimestampOffset(NamedTuple):
    """A record's offset and timestamp (Kafka's ListOffsets answers)."""

    offset: int
    timestamp: int


def read_fully(f, out: np.ndarray) -> int:
    """readinto until ``out`` is full or the stream ends; returns bytes read."""
    mv = memoryview(out).cast("B")
    done = 0
    while done < len(mv):
        n = f.readinto(mv[done:])
        if not n:
            break
        done += n
    return done


def corrupt(path: str, pos: int, what: str, last_good: int | None,
            prefix=None) -> CorruptRecordError:
    """The error of a read that met damage at byte ``pos`` of ``path``: what failed, the
    records read before it (``prefix``, ``last_good_offset``) and what to do."""
    after = (f"; the records up to offset {last_good} were read" if last_good is not None
             else "")
    return CorruptRecordError(
        f"{path}: corrupt record at byte {pos}: {what}{after}; run `kcompact verify` and rebuild "
        "this partition from a replica", path, pos, last_good_offset=last_good, prefix=prefix)


class Selection:
    """Chosen records of one segment, read in blocks (``Segment.selection``).

    ``select(entries)`` takes entries of the segment in position order (a subset of its index,
    possibly with clean times of the caller's; each call's entries after the previous call's
    when ``sequential``) and yields verified ``RecordColumns`` blocks of them, each read as one
    span of at most ``block_bytes`` (or one record / batch). ``sequential`` streams the .log
    front to back (one request on an object store, however many blocks). ``bytes_read``
    counts what was read. This base class is the reading; each kind says what a block is."""

    def __init__(self, seg: "Segment", sequential: bool, block_bytes: int,
                 buffer: np.ndarray | None):
        self.seg = seg
        self.sequential, self.block_bytes = sequential, block_bytes
        self.bytes_read = 0
        self._buf = buffer
        self._stream = None
        self._at = 0
        self._path = seg.log_path

    def __enter__(self) -> "Selection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def select(self, entries: np.ndarray) -> Iterator["RecordColumns"]:
        raise NotImplementedError

    def raw(self, start: int, length: int, sizes: np.ndarray | None = None) -> np.ndarray:
        """Stored batches as they are (a segment that stores Kafka batches only)."""
        raise NotImplementedError(f"{type(self.seg).__name__} stores no batches")

    def _read(self, start: int, length: int) -> np.ndarray:
        self.bytes_read += length
        seg = self.seg
        if not self.sequential:
            return np.frombuffer(seg.read_log(start, length), np.uint8)
        try:
            if self._stream is None:
                self._stream = seg.open_log()
                self._at = 0
            if start != self._at:
                self._skip(start)
            if self._buf is None or self._buf.shape[0] < length:
                self._buf = np.empty(max(length, self.block_bytes), np.uint8)
            out = self._buf[:length]
            got = read_fully(self._stream, out)
            self._at = start + got
            return out[:got]  # a short read fails the check
        except FileNotFoundError:
            raise
        except OSError as e:  # a stream's reads raise raw OSError: say which file
            raise _oserror(e, "read", self._path) from e

    def _skip(self, to: int) -> None:
        if self._stream.seekable():
            self._stream.seek(to)
            self._at = to
            return
        if to < self._at:
            raise CorruptRecordError(f"{self._path}: entries out of position order at byte {to}",
                                     self._path, to)
        junk = np.empty(min(1 << 20, to - self._at), np.uint8)
        while self._at < to:
            n = read_fully(self._stream, junk[:min(to - self._at, junk.shape[0])])
            if n == 0:
                return  # the file ends here: the read that follows is short and fails
            self._at += n


class Segment:
    """One segment of a partition (see the module docstring); a subclass per kind.

    ``kind`` says where it lives: "file" (<base>.log/.bcq in the partition directory: a local
    store's segment, or a writer's active segment on S3), "remote" (a sealed object pair the
    manifest lists), "shared" (a partition's part of a shared upload object: S3,
    docs/formats/shared-upload.md) or "staged" (a compaction output on local disk, not committed
    yet: S3).
    ``desc`` is its catalog's entry (None without one); ``open_tail`` marks a segment whose files
    may still grow or hold a crash's torn tail (the active segment of a writer, listed open;
    a writer's local segments on an object store). Every other one is exact: its index lists
    every record of its .log, the last ending where the .log ends."""

    #: the store format this kind of segment is (docs/formats/segment-v2.md); 0: none
    format = 0
    #: whether compaction rewrites it even when it drops nothing (into the store's format)
    needs_rewrite = False
    #: whether a compaction that only stamps tombstones may rewrite its index alone, leaving
    #: its .log where it is (compaction-swap.md, "index-only outputs")
    restamps_in_place = False
    #: whether a writer's seal re-encodes it into format 2 once rolled (reput/seal.py)
    sealable = False
    #: whether a writer appends records to it (the active segment's kind)
    appendable = False
    #: (min, max) of its records' timestamps when known without reading its index: a part of
    #: a shared object this process wrote (set at the commit; compaction/assessment.py)
    time_range: tuple[int, int] | None = None

    def __init__(self, ctx: PartitionContext, base: int, log_size: int, index_size: int, *,
                 fs: Backend, log_path: str, bcq_path: str, kind: str = "file",
                 desc: SegmentDesc | None = None, open_tail: bool = False):
        self.ctx, self.base = ctx, base
        self.log_size, self.index_size = log_size, index_size
        self.fs, self.log_path, self.bcq_path = fs, log_path, bcq_path
        self.kind, self.desc, self.open_tail = kind, desc, open_tail
        #: the index held in memory, for these file sizes (``_index_key``)
        self._index = None
        self._index_key: tuple[int, int] = (-1, -1)
        #: the .bcq was read whole and matched its checksum (``check_index``), until it changes
        self.bcq_checked = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.log_path}, {self.log_size} + {self.index_size} "
                f"bytes, {self.kind}{', open' if self.open_tail else ''})")

    def invalidate(self) -> None:
        """Forget what was cached from the files (they changed, or may have)."""
        self._index = None
        self._index_key = (-1, -1)
        self.bcq_checked = False

    # -- what its catalog says ---------------------------------------------------------------

    def listed(self) -> tuple[int, int, int] | None:
        """(records, first offset, last offset) as its manifest or closed segment-list entry
        says, without reading the .bcq; None when nothing says (an open segment)."""
        return self.desc.listed() if self.desc is not None else None

    def expected_bcq(self) -> tuple[int, int] | None:
        """(size, CRC32C) this segment's .bcq must have (its segment-list entry, or its
        manifest entry when that lists one); None when nothing says."""
        return self.desc.expected_bcq() if self.desc is not None else None

    @property
    def bitmap_desc(self) -> SegmentDesc | None:
        """Its manifest entry, whose offset bitmap answers offset questions without a request;
        None for any other segment."""
        d = self.desc
        return d if d is not None and d.has_bitmap else None

    # -- its bytes -------------------------------------------------------------------------

    def read_log(self, start: int, length: int) -> bytes:
        """Bytes of the .log (through the block cache for an S3 object)."""
        return self.fs.read(self.log_path, start, length)

    def log_bytes(self, start: int, length: int) -> np.ndarray:
        """``read_log`` as a uint8 array."""
        return np.frombuffer(self.read_log(start, length), np.uint8)

    def open_log(self):
        """A sequential stream of the .log (one request on an object store)."""
        return self.fs.open_read(self.log_path)

    # -- its index ---------------------------------------------------------------------------

    def index(self):
        """Its valid entries with their search view (``n``, ``lower_bound``, ``entries``,
        ``slice``), cached until the files change."""
        raise NotImplementedError

    def entries(self) -> np.ndarray:
        """Every valid index entry (``bcq.BCQ_DTYPE``)."""
        return self.index().entries

    @property
    def entry_count(self) -> int:
        """The .bcq's bytes in 48-byte entries (a format-1 index's entry count)."""
        return self.index_size // B.ENTRY_SIZE

    def count(self) -> int:
        """Its records (its manifest or closed segment-list entry's count: no read)."""
        listed = self.listed()
        if listed is not None:
            return listed[0]
        return self.index().n

    def first_last(self) -> tuple[int, int]:
        """(first, last) offset of its records, (-1, -1) when it holds none."""
        idx = self.index()
        if not idx.n:
            return -1, -1
        e = idx.entries
        return int(e[0]["offset"]), int(e[-1]["offset"])

    def codec_name(self) -> str:
        """The codec of its stored records ("none": not compressed)."""
        return "none"

    def describe(self) -> dict:
        """The segment as ``inspect`` shows it: base, store format, codec, bytes of its .log
        and .bcq, records."""
        return {"base": self.base, "format": self.format, "codec": self.codec_name(),
                "log_bytes": self.log_size, "index_bytes": self.index_size,
                "records": self.count()}

    def current_desc(self, nxt: int | None) -> SegmentDesc:
        """Its closed segment-list entry as its files are now (``nxt``: the end of its offset
        range; None: its last offset + 1)."""
        return self._closed(describe_files(self.fs, self.log_path, self.bcq_path, self.base,
                                           None), nxt)

    def _closed(self, m: SegmentDesc, nxt: int | None) -> SegmentDesc:
        """``m`` with its range's end (``nxt``, else past its last offset), bounds checked."""
        m = replace(m, next=nxt if nxt is not None else max(m.last_offset + 1, self.base))
        try:
            m.check_listed()
        except ValueError as e:
            raise CorruptRecordError(f"{self.bcq_path}: {e}", self.bcq_path, 0) from None
        return m

    def batches(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(positions, sizes, record counts) of its stored Kafka batches; None when it stores
        records one by one."""
        return None

    def index_chunks(self, start_entry: int = 0, buf: np.ndarray | None = None,
                     chunk_entries: int = CHUNK_ENTRIES) -> Iterator[tuple[int, np.ndarray]]:
        """(number of the first entry, entries) from entry ``start_entry``, in bounded chunks
        (``buf``: a reused buffer, each chunk valid until the next). A pass from entry 0 to the
        end over an index whose catalog entry gives its checksum checks it: a mismatch raises
        ``CorruptRecordError`` after the last chunk, before the caller acts on the pass."""
        raise NotImplementedError

    def tombstone_columns(self, buf: np.ndarray | None = None
                          ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(flags, clean_time) of every entry, a chunk at a time: what a look for tombstones due
        for purging reads (checked as ``index_chunks`` checks a pass from entry 0)."""
        for _, e in self.index_chunks(0, buf):
            yield e["flags"], e["clean_time"]

    def check_index(self, buf: np.ndarray | None = None) -> None:
        """The index against the size and checksum its catalog entry gives (CorruptRecordError
        otherwise; nothing when no entry gives one or it was checked since the files last
        changed)."""
        if self.expected_bcq() is None or self.bcq_checked:
            return
        for _ in self.index_chunks(0, buf):
            pass

    def offset_for_timestamp(self, timestamp: int, buf: np.ndarray | None = None
                             ) -> TimestampOffset | None:
        """Its first record (in offset order) whose timestamp is >= ``timestamp``; None: none
        (Kafka's fetchOffsetByTimestamp, from the index only)."""
        for _, e in self.index_chunks(0, buf):
            hit = np.flatnonzero(e["timestamp"] >= timestamp)
            if hit.shape[0]:
                r = e[int(hit[0])]
                return TimestampOffset(int(r["offset"]), int(r["timestamp"]))
        return None

    def max_timestamp(self, buf: np.ndarray | None = None) -> TimestampOffset | None:
        """Its first record holding its largest timestamp; None when it holds none."""
        best = None
        for _, e in self.index_chunks(0, buf):
            if e.shape[0]:
                k = int(np.argmax(e["timestamp"]))
                t = int(e["timestamp"][k])
                if best is None or t > best.timestamp:
                    best = TimestampOffset(int(e["offset"][k]), t)
        return best

    # -- reads -------------------------------------------------------------------------------

    def plan(self, from_offset: int, max_records: int | None,
             max_bytes: int | None) -> ReadPlan | None:
        """What a read from ``from_offset`` reads of this segment, None when it holds nothing at
        or after it (having checked that its index could not have stepped over a record)."""
        raise NotImplementedError

    def read(self, plan: ReadPlan, max_bytes: int | None) -> "RecordColumns":
        """The planned records, verified (reput/reader.py: what is verified)."""
        raise NotImplementedError

    def read_fields(self, plan: ReadPlan, max_bytes: int | None,
                    want: np.ndarray | None) -> "KeyValues | None":
        """The planned records' keys and values (``PartitionReader.read_fields``), or None when
        this kind has no faster way than ``read``."""
        return None

    def read_raw(self, plan: ReadPlan, max_bytes: int | None, pool) -> RawRange:
        """The planned records as format-1 records back to back (what a replica appends)."""
        raise NotImplementedError

    def locate(self, plan: ReadPlan, max_bytes: int | None) -> Located:
        """Where ``read_raw``'s records lie, for a local store's zero-copy send."""
        raise NotImplementedError

    def selection(self, sequential: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES,
                  buffer: np.ndarray | None = None) -> Selection:
        raise NotImplementedError

    def kafka_batches(self, from_offset: int, max_bytes: int) -> KafkaBatches | None:
        """Whole Kafka batches from the one holding ``from_offset`` (or, in a gap, the next
        one), the first whole even past ``max_bytes`` (KIP-74), later ones only while whole
        within it; None when this segment holds nothing at or after ``from_offset``."""
        raise NotImplementedError

    # -- compaction, recovery, verification, shipping -------------------------------------------

    def kept_bytes(self, chunk: np.ndarray, keep: np.ndarray, kept: int) -> int:
        """About how many bytes the records ``keep`` picks of ``chunk`` (``kept`` of them) take
        where they are stored (a compaction's grouping by ``segment.bytes``)."""
        raise NotImplementedError

    def write_index(self, entries: Iterator[np.ndarray], fs: Backend, path: str,
                    spill_dir: str | None) -> int:
        """Write an index of this segment's records, unmoved, at ``path`` of ``fs`` (fsynced),
        from ``entries`` (all of them, in order, e.g. with new clean times). Returns bytes."""
        raise NotImplementedError

    def recover_tail(self) -> tuple[int, int]:
        """A writer's repair of this segment after a crash (only what an append may have left:
        reput/partition_recovery.py). Returns (entries added, bytes cut)."""
        return 0, 0

    def check_sealed(self, next_base: int) -> None:
        """A sealed segment of a partition without a segment list: its index must be whole
        and in order within [base, next_base); CorruptRecordError naming it otherwise."""
        raise NotImplementedError

    def verify(self, secret: bytes, problem, prev_last: int, next_base: int | None
               ) -> tuple[int, int]:
        """``kcompact verify`` of this segment: every byte against its index and its catalog
        entry, each problem reported by ``problem(path, position, message)`` (the check goes
        on). Returns (records seen, the last offset seen, or ``prev_last``)."""
        raise NotImplementedError

    #: replication may ship its files byte for byte (docs/formats/replication-protocol.md,
    #: version 2: ``stored_version`` names the version shipped); else record by record
    ships_as_stored = False

    def stored_version(self) -> tuple[int, int] | None:
        """The version of its files as stored, read now, when it ships as stored (see
        ``ships_as_stored``): what changes when a swap replaces them under the same base."""
        return None

    def index_bytes(self) -> np.ndarray:
        """Its .bcq's bytes as an object store keeps them (an upload)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# the formats' registry (the dispatch itself, ``open_segment``: reput/segment_kinds.py)


#: the class of each store format, registered by its implementation as it loads
#: (segment_v1.py, segment_v2.py); reput/segment_kinds.py, the factory, loads them all
FORMATS: dict[int, type[Segment]] = {}


def register_format(fmt: int):
    """Class decorator: ``cls`` is the segment of store format ``fmt``."""
    def register(cls):
        FORMATS[fmt] = cls
        return cls
    return register


def sniff_format(fs: Backend, bcq_path: str, index_size: int) -> int:
    """The store format of a segment no catalog entry describes, from its .bcq's first bytes
    (a lean index's magic: format 2; anything else, or nothing: format 1)."""
    if index_size < 8:
        return 1
    try:
        head = fs.read(bcq_path, 0, 8)
    except FileNotFoundError:
        return 1
    return 2 if is_lean(head) else 1


def describe_files(fs: Backend, log_path: str, bcq_path: str, base: int,
                   nxt: int | None) -> SegmentDesc:
    """A closed segment's entry computed from its files (its index read once): records, first
    and last offsets, sizes, the .bcq's CRC32C and its format. ``nxt`` None: the last offset + 1.
    A missing file is a CorruptRecordError naming it. (The formats' classes are registered
    when reput/segment_kinds.py has loaded them.)"""
    log_size, bcq_size = _size_of_part(fs, log_path), _size_of_part(fs, bcq_path)
    return FORMATS[sniff_format(fs, bcq_path, bcq_size)].describe_files(
        fs, log_path, bcq_path, base, nxt, log_size, bcq_size)


def _size_of_part(fs: Backend, path: str) -> int:
    """The size of a segment's .log or .bcq; a missing one is a CorruptRecordError naming it."""
    try:
        return fs.size(path)
    except FileNotFoundError:
        raise CorruptRecordError(f"{path}: missing (its segment has the other file of the "
                                 "pair); run `kcompact verify` and rebuild this partition from "
                                 "a replica", path, 0) from None


__all__ = ["CHUNK_ENTRIES", "DEFAULT_BLOCK_BYTES", "KafkaBatches", "Located", "PartitionContext",
           "RawRange", "ReadPlan", "Segment", "Selection", "TimestampOffset", "corrupt",
           "FORMATS", "describe_files", "read_fully", "register_format", "sniff_format"]
