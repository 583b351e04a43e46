"""Store format 2's sealed segment: Kafka RecordBatch v2, compressed with the topic's codec.

Spec: docs/formats/segment-v2.md. ``BatchEncoder`` turns verified format-1 records (what the
partition reader hands out) into batches; ``decode_batches`` turns a run of batches read from a
``.log`` back into format-1 records in memory, checking each batch's CRC-32C, so that everything
above the reader sees one record layout whatever the segment's format. The record loops run in
C (reput/_kafka_native.h and _kafka_span.h, built into kcompact.reput._native); this module
loops over batches only (one compressor call each).
The codecs, as Kafka frames them, are reput/codecs.py's.
"""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

import numpy as np

from . import _native as _N
from . import parallel
from .codecs import (CODEC_BY_NAME, CODEC_GZIP, CODEC_LZ4, CODEC_NAMES, CODEC_NONE,
                     CODEC_SNAPPY, CODEC_ZSTD, codec_of, compress, decompress, zstd_compress,
                     zstd_decompress)  # (the codec names re-exported: __all__)
from .errors import CorruptRecordError, ReputError
from .record import HEADER_SIZE as V1_HEADER_SIZE

_tls = threading.local()  # a thread's decompression buffer (_scratch)

FORMAT_VERSION = 2
MAGIC = 2
#: baseOffset batchLength partitionLeaderEpoch magic crc attributes lastOffsetDelta
#: baseTimestamp maxTimestamp producerId producerEpoch baseSequence recordCount (big-endian)
BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = BATCH_HEADER.size   # 61
LOG_OVERHEAD = 12                 # baseOffset + batchLength: bytes before what batchLength counts
CRC_START = 21                    # the CRC covers [attributes, end)
#: the smallest Kafka record: length, attributes, timestamp delta, offset delta, key length,
#: value length and header count, one byte each (a count is bounded by the bytes before use)
MIN_KAFKA_RECORD = 7
_HEAD12 = struct.Struct(">qi")
#: the C kernels' decode statuses (reput/_kafka_native.h): every record whole / a length or
#: varint runs past the payload / a value out of range; kafka_find: offset deltas not rising
DEC_OK, DEC_TRUNCATED, DEC_INVALID, DEC_ORDER = 0, 1, 2, 3

ATTR_CODEC_MASK = 0x07
#: bits kcompact never writes and refuses to read: transactional (4), control (5), delete
#: horizon (6), and the unused rest
ATTR_REFUSED = ~0x0F & 0xFFFF


def crc32c(buf: np.ndarray, start: int, end: int) -> int:
    """CRC-32C (Castagnoli) of buf[start:end]."""
    return int(_N.crc32c_range(buf, start, end))



#: attributes of a control batch as Kafka writes a transaction marker: transactional (bit 4)
#: and control (bit 5), no codec
ATTR_TRANSACTIONAL, ATTR_CONTROL = 0x10, 0x20
#: control record types (the key's second int16): Kafka's ControlRecordType
CONTROL_ABORT, CONTROL_COMMIT = 0, 1
#: the producer id of the endpoint's end-of-log marker: no batch kcompact serves carries it (its
#: data batches all carry -1, no producer), and Kafka allocates producer ids upwards from 0
MARKER_PRODUCER_ID = 0x7FFF_FFFF_FFFF_FFFF


def control_batch(offset: int, *, producer_id: int = MARKER_PRODUCER_ID, producer_epoch: int = 0,
                  timestamp: int = -1, commit: bool = True, coordinator_epoch: int = 0) -> bytes:
    """A transaction marker at ``offset`` as Kafka 3.9 writes one (``EndTransactionMarker``,
    ``MemoryRecords.withEndTransactionMarker``): a RecordBatch v2 with the transactional and
    control attributes, producer id and epoch, baseSequence -1, one record at offset delta 0
    whose key is (version 0, type COMMIT or ABORT) and value (version 0, coordinator epoch).
    The Kafka endpoint ends a partition's trailing gap with a COMMIT marker of a producer id
    no data carries (docs/formats/kafka-endpoint-fetch.md): every client steps over a control
    batch, and a commit of a producer with no open transaction changes nothing."""
    key = struct.pack(">hh", 0, CONTROL_COMMIT if commit else CONTROL_ABORT)
    value = struct.pack(">hi", 0, coordinator_epoch)
    body = (b"\x00"            # record attributes
            + b"\x00"          # timestampDelta 0 (zigzag varint)
            + b"\x00"          # offsetDelta 0
            + bytes([len(key) << 1]) + key
            + bytes([len(value) << 1]) + value
            + b"\x00")         # no header
    rec = bytes([len(body) << 1]) + body
    out = np.zeros(HEADER_SIZE + len(rec), np.uint8)
    BATCH_HEADER.pack_into(out, 0, offset, HEADER_SIZE - LOG_OVERHEAD + len(rec), -1, MAGIC, 0,
                           ATTR_TRANSACTIONAL | ATTR_CONTROL, 0, timestamp, timestamp,
                           producer_id, producer_epoch, -1, 1)
    out[HEADER_SIZE:] = np.frombuffer(rec, np.uint8)
    struct.pack_into(">I", out, 17, crc32c(out, CRC_START, out.shape[0]))
    return out.tobytes()


def _to_kafka(buf, pos, lo: int, hi: int, base_off: int, base_ts: int) -> np.ndarray:
    """Records pos[lo:hi] of ``buf`` (verified format-1 records) as Kafka records."""
    out = np.empty(_N.v1_to_kafka(buf, pos, lo, hi, base_off, base_ts, None, 0), np.uint8)
    _N.v1_to_kafka(buf, pos, lo, hi, base_off, base_ts, out, 0)
    return out


def _walk(payload, count: int, tl: int, sizes, starts, deltas):
    return _N.kafka_sizes(payload, 0, payload.shape[0], count, tl, sizes, starts, deltas)


def _to_v1(payload, start, count, base_off, base_ts, topic, partition, out, q, offsets,
           timestamps) -> None:
    _N.kafka_to_v1(payload, start, count, base_off, base_ts, topic, partition, out, q,
                   offsets, timestamps)


# -- encoding ----------------------------------------------------------------------------------


class EncodedBatch(NamedTuple):
    data: bytes          # the whole batch, header included
    count: int
    codec: int           # what was written (CODEC_NONE when compressing did not pay)


#: a payload this large is compressed only when a sample of it shrinks (segment-v2.md)
PROBE_ABOVE = 64 << 10
PROBE_BYTES = 16 << 10
PROBE_RATIO = 0.97


#: after a batch that did not compress, a small payload is probed with this many bytes
PROBE_SMALL_BYTES = 1 << 10


def _worth_compressing(codec: int, payload: np.ndarray, probe_small: bool = False) -> bool:
    """False for a payload that would not shrink (random or already compressed values): its
    middle ``PROBE_BYTES`` compressed at zstd's fastest level do not go below ``PROBE_RATIO``.
    Compressing incompressible bytes costs as much as compressing text and is thrown away. A
    payload of at most ``PROBE_ABOVE`` bytes is compressed without a probe, unless
    ``probe_small`` (the writer's previous batch did not compress): then its middle
    ``PROBE_SMALL_BYTES`` are the probe."""
    n = payload.shape[0]
    if n <= PROBE_ABOVE:
        if not probe_small or n < 2 * PROBE_SMALL_BYTES:
            return True
        probe = PROBE_SMALL_BYTES
    else:
        probe = PROBE_BYTES
    mid = (n - probe) // 2
    sample = payload[mid:mid + probe]
    return len(zstd_compress(sample, 1)) < PROBE_RATIO * probe


def encode_batch(buf: np.ndarray, positions: np.ndarray, lo: int, hi: int, offsets: np.ndarray,
                 timestamps: np.ndarray, codec: int, level: int,
                 probe_small: bool = False) -> EncodedBatch:
    """One batch of the verified format-1 records positions[lo:hi] of ``buf`` (their offsets and
    timestamps given, strictly increasing offsets). ``probe_small``: the writer's previous
    batch did not compress, so a small payload is probed first (``_worth_compressing``)."""
    n = hi - lo
    if n <= 0:
        raise ReputError("a batch needs at least one record")
    base_off = int(offsets[lo])
    base_ts = int(timestamps[lo])
    last_delta = int(offsets[hi - 1]) - base_off
    if last_delta > 0x7FFFFFFF:
        raise ReputError(f"offsets {base_off}..{int(offsets[hi - 1])} do not fit one batch")
    payload = _to_kafka(buf, np.ascontiguousarray(positions, dtype=np.int64), lo, hi, base_off,
                        base_ts)
    body = payload
    written = CODEC_NONE
    if codec != CODEC_NONE and _worth_compressing(codec, payload, probe_small):
        packed = compress(codec, payload, level)
        # kept compressed when it saves at least 3 %: a batch that hardly shrinks costs every
        # reader a decompression for nothing
        if len(packed) < PROBE_RATIO * payload.shape[0]:
            body, written = np.frombuffer(packed, np.uint8), codec
    max_ts = int(timestamps[lo:hi].max())
    total = HEADER_SIZE + body.shape[0]
    out = np.empty(total, np.uint8)
    BATCH_HEADER.pack_into(out, 0, base_off, total - LOG_OVERHEAD, -1, MAGIC, 0, written,
                           last_delta, base_ts, max_ts, -1, -1, -1, n)
    out[HEADER_SIZE:] = body
    struct.pack_into(">I", out, 17, crc32c(out, CRC_START, total))
    return EncodedBatch(out.tobytes(), n, written)


def cut_batch(pos: np.ndarray, ends: np.ndarray, offsets: np.ndarray, lo: int, n: int,
              batch_bytes: int, final: bool) -> int:
    """Where the batch of records ``lo..`` ends (exclusive), as SegmentWriter2 cuts them: once
    its format-1 records (``pos``/``ends``, ascending) hold ``batch_bytes``, and at most
    2^31 - 1 offsets after its first (lastOffsetDelta is an int32); ``lo`` when the records
    left do not fill a batch and this is not the ``final`` one."""
    done = int(pos[lo])
    hi = min(n, int(np.searchsorted(ends[:n], done + batch_bytes, side="left")) + 1)
    if hi == n and not final and int(ends[n - 1]) - done < batch_bytes:
        return lo
    return min(hi, int(np.searchsorted(offsets[:n], int(offsets[lo]) + 0x7FFFFFFF,
                                       side="right")))


def encode_plain(buf: np.ndarray, pos: np.ndarray, ends: np.ndarray, offsets: np.ndarray,
                 timestamps: np.ndarray, lo: int, n: int, batch_bytes: int, max_batches: int,
                 final: bool) -> "tuple[np.ndarray, list[int], list[int], int]":
    """Up to ``max_batches`` uncompressed batches of the records ``lo..n`` (cut by
    ``cut_batch``), back to back: (their bytes, each one's size, each one's record count, the
    first record left). One C call for all of them (kafka_encode_plain)."""
    left = int(ends[n - 1] - pos[lo]) if n > lo else 0
    cap = left + HEADER_SIZE * (left // batch_bytes + 2) + 4096
    while True:
        bounds = np.empty(2 * max(1, min(max_batches, n - lo, left // batch_bytes + 2)),
                          np.int64)
        out = np.empty(cap, np.uint8)
        k, nxt, used = _N.kafka_encode_plain(buf, pos, ends, offsets, timestamps, lo, n,
                                             batch_bytes, max_batches, int(final), out,
                                             bounds)
        if k or cut_batch(pos, ends, offsets, lo, n, batch_bytes, final) == lo \
                or max_batches == 0 or lo >= n:
            break
        cap *= 2  # (records whose many headers grow as Kafka records: rare)
    ends_k = bounds[0:2 * k:2].tolist()
    sizes = bounds[1:2 * k:2].tolist()
    counts = [e - s for s, e in zip([lo] + ends_k, ends_k)]
    return out[:used], sizes, counts, int(nxt)


# -- decoding ----------------------------------------------------------------------------------


class BatchHead(NamedTuple):
    position: int        # in the .log
    size: int            # LOG_OVERHEAD + batchLength
    base_offset: int
    last_offset: int
    base_ts: int
    max_ts: int
    count: int
    codec: int


def batch_size_at(head12: bytes, where: str, pos: int) -> int:
    """The size of the batch whose first 12 bytes are ``head12``."""
    if len(head12) < LOG_OVERHEAD:
        raise CorruptRecordError(f"{where}: batch header cut at byte {pos}", where, pos)
    _, length = _HEAD12.unpack_from(head12, 0)
    if length < HEADER_SIZE - LOG_OVERHEAD:
        raise CorruptRecordError(f"{where}: invalid batch length {length} at byte {pos}",
                                 where, pos)
    return LOG_OVERHEAD + length


def parse_head(buf: np.ndarray, p: int, where: str, pos: int, *, check_crc: bool = True
               ) -> BatchHead:
    """The header of the batch at buf[p:] (the .log's byte ``pos``), its CRC checked."""
    if buf.shape[0] - p < HEADER_SIZE:
        raise CorruptRecordError(f"{where}: batch at byte {pos} is cut short", where, pos)
    (base, length, _epoch, magic, crc, attrs, last_delta, base_ts, max_ts, _pid, _pe, _seq,
     count) = BATCH_HEADER.unpack_from(buf, p)
    size = LOG_OVERHEAD + length
    if (magic != MAGIC or length < HEADER_SIZE - LOG_OVERHEAD or size > buf.shape[0] - p
            or attrs & ATTR_REFUSED or count < 1 or last_delta < 0 or base < 0):
        raise CorruptRecordError(f"{where}: invalid batch header at byte {pos}", where, pos)
    if check_crc and crc32c(buf, p + CRC_START, p + size) != crc:
        raise CorruptRecordError(f"{where}: batch CRC mismatch at byte {pos}", where, pos)
    return BatchHead(pos, size, base, base + last_delta, base_ts, max_ts, count,
                     attrs & ATTR_CODEC_MASK)


class Heads:
    """The batches a ``Decoded`` came from: a sequence of ``BatchHead`` kept as an int64 table
    (one row a batch, BatchHead's fields in order), with its columns as arrays."""

    __slots__ = ("table",)

    def __init__(self, table: np.ndarray):
        self.table = table

    @classmethod
    def of(cls, heads: list) -> "Heads":
        return cls(np.array(heads, np.int64).reshape(-1, len(BatchHead._fields)))

    def __len__(self) -> int:
        return self.table.shape[0]

    def __getitem__(self, i: int) -> BatchHead:
        return BatchHead(*self.table[i].tolist())

    def __iter__(self):
        return (BatchHead(*row) for row in self.table.tolist())

    @property
    def positions(self) -> np.ndarray:
        return self.table[:, 0]

    @property
    def counts(self) -> np.ndarray:
        return self.table[:, 6]


class Decoded(NamedTuple):
    """Format-1 records decoded from batches: ``data[positions[i]:+sizes[i]]`` is record i."""

    data: np.ndarray
    positions: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray
    timestamps: np.ndarray
    heads: Heads           # each batch decoded
    batch_of: np.ndarray   # int64: the batch number (in ``heads``) of each record


class Opened(NamedTuple):
    """One batch accepted by its header and CRC-32C, its payload decompressed (its records not
    walked yet): what a partition keeps of the batch its last read decoded."""

    head: BatchHead
    payload: np.ndarray


class Walked(NamedTuple):
    """One batch checked whole (CRC-32C, decompressed, every record walked, offsets against its
    header): its payload and each record's size, start in the payload and offset delta."""

    head: BatchHead
    payload: np.ndarray
    sizes: np.ndarray
    starts: np.ndarray
    deltas: np.ndarray


def open_batch(buf: np.ndarray, p: int, pos: int, where: str) -> Opened:
    """The batch at buf[p:] (the .log's byte ``pos``): header and CRC-32C checked, payload
    decompressed; raises CorruptRecordError naming what fails."""
    h = parse_head(buf, p, where, pos)
    body = buf[p + HEADER_SIZE:p + h.size]
    return Opened(h, decompress(h.codec, body, where, pos) if h.codec else body)


def walk_batch(buf: np.ndarray, p: int, pos: int, tl: int, where: str) -> Walked:
    """The batch at buf[p:] (the .log's byte ``pos``), checked whole (``Walked``); raises
    CorruptRecordError naming what fails."""
    return walk_opened(open_batch(buf, p, pos, where), tl, where)


def walk_opened(b: Opened, tl: int, where: str) -> Walked:
    """``walk_batch`` of a batch already opened."""
    h, payload = b
    pos = h.position
    if h.count > payload.shape[0] // MIN_KAFKA_RECORD:  # (before allocating for the claim)
        raise CorruptRecordError(f"{where}: the batch at byte {pos} claims {h.count} records "
                                 f"in {payload.shape[0]} bytes", where, pos)
    sz = np.empty(h.count, np.int64)
    starts = np.empty(h.count, np.int64)
    deltas = np.empty(h.count, np.int64)
    st, walked, _stop = _walk(payload, h.count, tl, sz, starts, deltas)
    if st != DEC_OK:
        raise CorruptRecordError(f"{where}: record {walked} of the batch at byte {pos} "
                                 "is invalid or cut short", where, pos)
    if (int(deltas[0]) != 0 or int(deltas[-1]) != h.last_offset - h.base_offset
            or (h.count > 1 and bool(np.any(deltas[1:] <= deltas[:-1])))):
        raise CorruptRecordError(f"{where}: the offsets of the batch at byte {pos} "
                                 "do not match its header", where, pos)
    return Walked(h, payload, sz, starts, deltas)


def decode_run(b: Opened, topic: bytes, partition: int, lo: int, hi: int, where: str
               ) -> Decoded | None:
    """The records of batch ``b`` with offsets in [lo, hi] as format-1 records, the batch
    checked whole as ``walk_batch`` checks it (every record walked, offsets against its header)
    but only those records converted; None when they are more than one (``decode_walked``
    takes those). A one-record read by offset."""
    h, payload = b
    tl = len(topic)
    args = (payload, 0, payload.shape[0], h.count, tl, lo - h.base_offset, hi - h.base_offset)
    st, walked, _stop, a, z, start, nbytes, last = (
        _N.kafka_find(*args))
    if st != DEC_OK and st != DEC_ORDER:
        raise CorruptRecordError(f"{where}: record {walked} of the batch at byte {h.position} "
                                 "is invalid or cut short", where, h.position)
    if st == DEC_ORDER or last != h.last_offset - h.base_offset:
        raise CorruptRecordError(f"{where}: the offsets of the batch at byte {h.position} "
                                 "do not match its header", where, h.position)
    n = z - a if a >= 0 else 0
    if n > 1:
        return None
    data = np.empty(nbytes, np.uint8)
    if not n:
        return Decoded(data, _NONE, _NONE, _NONE, _NONE, Heads.of([h]), _NONE)
    ot = np.empty(2, np.int64)  # the record's offset and timestamp
    _to_v1(payload, start, 1, h.base_offset, h.base_ts, np.frombuffer(topic, np.uint8),
           partition, data, 0, ot[:1], ot[1:])
    return Decoded(data, _ZERO, np.array([nbytes], np.int64), ot[:1], ot[1:], Heads.of([h]),
                   _ZERO)


_NONE = np.zeros(0, np.int64)
_ZERO = np.zeros(1, np.int64)
_NONE.flags.writeable = False
_ZERO.flags.writeable = False


def _part(w: Walked, lo: int, hi: int) -> tuple:
    """What ``_assemble`` converts of a walked batch: its records with offsets in [lo, hi]."""
    h = w.head
    a = int(np.searchsorted(w.deltas, lo - h.base_offset))
    z = int(np.searchsorted(w.deltas, hi - h.base_offset, side="right"))
    return (h, w.payload, w.sizes[a:z], int(w.starts[a]) if a < z else 0, z - a)


def decode_walked(walked: list, topic: bytes, partition: int, *, lo: int = 0,
                  hi: int = (1 << 63) - 1) -> Decoded:
    """``decode_batches`` of batches already walked (``walk_batch``)."""
    return _assemble([_part(w, lo, hi) for w in walked], np.frombuffer(topic, np.uint8),
                     partition)


def decode_batches(buf: np.ndarray, start_pos: int, topic: bytes, partition: int, where: str,
                   *, want: "set[int] | None" = None, lo: int = 0, hi: int = (1 << 63) - 1,
                   keep=None, max_bytes: int | None = None, first: Opened | None = None
                   ) -> Decoded:
    """Decode the batches of ``buf`` (the .log from byte ``start_pos``; whole batches back to
    back) into format-1 records. With ``want`` (batch positions), other batches are skipped
    unchecked. Every decoded batch is checked whole (CRC-32C, every record walked, offsets
    against its header), but only its records with offsets in [lo, hi] are converted (a read
    of one record converts one). With ``max_bytes``, no batch is decoded once the records
    converted reach it (a read by offset bounded in format-1 bytes reads about that much of the
    .log, compressed: what it would decode past the bound it would throw away). ``first``: the
    batch at ``start_pos`` already opened (a reader's last batch), not read again. Raises
    CorruptRecordError at the first batch that fails a check, carrying ``decoded``: what the
    batches before it gave (a Decoded, or None). ``keep(opened)`` is called with the last batch
    walked (a reader keeps it for the next read)."""
    d = _decode_many(buf, start_pos, topic, partition, where, want, lo, hi, keep, max_bytes,
                     first)
    if d is not None:
        return d
    topic_arr = np.frombuffer(topic, np.uint8)
    tl = topic_arr.shape[0]
    p, total = 0, buf.shape[0]
    parts: list = []
    w = None
    got = 0
    try:
        while p < total and (max_bytes is None or got < max_bytes):
            pos = start_pos + p
            if want is not None and pos not in want:
                p += batch_size_at(bytes(buf[p:p + LOG_OVERHEAD]), where, pos)
                continue
            if p == 0 and first is not None and first.head.position == pos:
                w = walk_opened(first, tl, where)
            else:
                w = walk_batch(buf, p, pos, tl, where)
            part = _part(w, lo, hi)
            parts.append(part)
            got += int(part[2].sum())
            p += w.head.size
    except CorruptRecordError as e:
        e.decoded = _assemble(parts, topic_arr, partition) if parts else None
        raise
    if keep is not None and w is not None:
        keep(Opened(w.head, w.payload))
    return _assemble(parts, topic_arr, partition)


#: rows of kafka_heads' table asked for at once (grown while a span holds more batches)
_HEADS_ROWS = 1024


def _span_heads(buf: np.ndarray, start_pos: int) -> np.ndarray | None:
    """The heads (kafka_heads rows) of the batches lying back to back in ``buf`` (the .log from
    byte ``start_pos``), each header and CRC-32C checked; None when one fails or there is none."""
    rows = _HEADS_ROWS
    table = np.empty(rows * 8, np.int64)
    n, p = 0, 0
    while True:
        got, status, p = _N.kafka_heads(buf, p, start_pos, table[n * 8:])
        n += got
        if status != 1:  # KHEAD_MORE
            break
        rows *= 2
        table = np.concatenate([table[:n * 8], np.empty((rows - n) * 8, np.int64)])
    if status != 0 or n == 0:
        return None
    return table[:n * 8].reshape(n, 8)


def _payload_sizes(buf: np.ndarray, start_pos: int, heads: np.ndarray) -> np.ndarray | None:
    """Each of ``heads``' batches' payload size once decompressed, from their headers and zstd
    frame headers alone; None when one is not known so (another codec: no C path)."""
    if not heads[:, 7].any():
        return heads[:, 1] - HEADER_SIZE
    sizes = np.empty(heads.shape[0], np.int64)
    flat = np.ascontiguousarray(heads).reshape(-1)
    if _N.kafka_payload_sizes(buf, flat, start_pos, sizes) != sizes.shape[0]:
        return None
    return sizes


def _open_span(buf: np.ndarray, start_pos: int, tl: int, where: str, want, max_bytes,
               first: Opened | None, fresh: bool = False, heads: np.ndarray | None = None):
    """The batches of ``buf`` (the .log from byte ``start_pos``) opened on the C kernels: every
    header and CRC-32C (kafka_heads), the wanted ones' payloads decompressed back to back (one C
    call, else one codec call a batch; in place when none is compressed), no more than
    ``max_bytes`` of records' worth: (heads table, the buffer they lie in, their (start, end)
    pairs flat), or None when a batch fails (the batch-by-batch path names it). ``fresh``: the
    payloads are decompressed into a buffer of their own (handed out with the records), not the
    thread's reused one. ``heads``: the span's heads (``_span_heads``), when the caller has
    them."""
    if heads is None:
        heads = _span_heads(buf, start_pos)
        if heads is None:
            return None
    n = heads.shape[0]
    if want is not None:
        heads = heads[np.fromiter((int(q) in want for q in heads[:, 0].tolist()), bool, n)]
    if heads.shape[0] and not heads[:, 7].any():  # nothing compressed: the payloads in place
        heads = heads[:_within(heads, heads[:, 1] - HEADER_SIZE, tl, max_bytes)]
        spans = np.empty((heads.shape[0], 2), np.int64)
        spans[:, 0] = heads[:, 0] - start_pos + HEADER_SIZE
        spans[:, 1] = heads[:, 0] - start_pos + heads[:, 1]
        return heads, buf, spans.reshape(-1)
    unpacked = _unpack(buf, start_pos, heads, tl, max_bytes, first, fresh)
    if unpacked is not None:
        return unpacked
    pays, lens = [], []  # a codec or frame the C path does not size: one call a batch
    est = 0
    try:
        for k, (pos, size, _b, _l, _t, _m, count, codec) in enumerate(heads.tolist()):
            q = pos - start_pos
            if k == 0 and first is not None and first.head.position == pos:
                pay = first.payload
            elif codec:
                pay = decompress(codec, buf[q + HEADER_SIZE:q + size], where, pos)
            else:
                pay = buf[q + HEADER_SIZE:q + size]
            pays.append(pay)
            lens.append(pay.shape[0])
            # no more once the records reach the budget (as _within)
            est += pay.shape[0] + count * (V1_HEADER_SIZE + tl)
            if max_bytes is not None and est >= max_bytes:
                heads = heads[:k + 1]
                break
    except CorruptRecordError:
        return None
    m = heads.shape[0]
    pay = (np.concatenate(pays) if m > 1 else np.ascontiguousarray(pays[0]) if m
           else np.zeros(0, np.uint8))
    return heads, pay, _spans(np.asarray(lens, np.int64))


def _spans(sizes: np.ndarray) -> np.ndarray:
    """(start, end) pairs, flat, of payloads of ``sizes`` bytes back to back."""
    out = np.empty((sizes.shape[0], 2), np.int64)
    np.cumsum(sizes, out=out[:, 1])
    out[:, 0] = out[:, 1] - sizes
    return out.reshape(-1)


def _decode_many(buf: np.ndarray, start_pos: int, topic: bytes, partition: int, where: str,
                 want, lo: int, hi: int, keep, max_bytes: int | None,
                 first: Opened | None) -> Decoded | None:
    """``decode_batches`` on the C kernels, a few calls for all the batches of ``buf`` instead
    of a few each (``_open_span``), then every record walked and checked (kafka_scan_many) and
    the ones in [lo, hi] converted (kafka_convert_many). None when anything fails a check: the
    caller's batch-by-batch path then names it (and hands out what precedes it)."""
    tl = len(topic)
    span = _open_span(buf, start_pos, tl, where, want, max_bytes, first)
    if span is None:
        return None
    heads, pay, spans = span
    m = heads.shape[0]
    if m == 0:  # no batch wanted
        return _assemble([], np.frombuffer(topic, np.uint8), partition)
    flat = np.ascontiguousarray(heads).reshape(-1)
    # a large span in two halves at once (reput/parallel.py): batches [0, k) and [k, m)
    k = _halfway(spans, m)
    parts = [(0, k)] + ([(k, m)] if k < m else [])

    def scan(a, z):
        return _N.kafka_scan_many(pay, spans[2 * a:2 * z], flat[8 * a:8 * z], tl, lo, hi)
    found = (list(parallel.both(lambda: scan(*parts[0]), lambda: scan(*parts[1])))
             if len(parts) == 2 else [scan(0, m)])
    if any(f[0] != DEC_OK for f in found):
        return None
    nsel = sum(f[3] for f in found)
    data = np.empty(sum(f[4] for f in found), np.uint8)
    offsets = np.empty(nsel, np.int64)
    timestamps = np.empty(nsel, np.int64)
    sizes = np.empty(nsel, np.int64)
    positions = np.empty(nsel, np.int64)
    batch_of = np.empty(nsel, np.int64)
    r0, b0 = found[0][3], found[0][4]  # the first half's records and bytes

    def convert(a, z, r, n, q):  # batches [a, z): n records from record r, byte q of data
        return _N.kafka_convert_many(pay, spans[2 * a:2 * z], flat[8 * a:8 * z], topic, partition,
                                     lo, hi, data[q:], offsets[r:r + n], timestamps[r:r + n],
                                     sizes[r:r + n], positions[r:r + n], batch_of[r:r + n])
    if len(parts) == 2:
        parallel.both(lambda: convert(0, k, 0, r0, 0), lambda: convert(k, m, r0, nsel - r0, b0))
        positions[r0:] += b0  # (each half counts from its own start)
        batch_of[r0:] += k
    else:
        convert(0, m, 0, nsel, 0)
    hd = Heads(np.ascontiguousarray(heads))
    if keep is not None:  # (a copy: pay may be a reused buffer or the whole span read)
        keep(Opened(hd[m - 1], pay[spans[2 * m - 2]:spans[2 * m - 1]].copy()))
    return Decoded(data, positions, sizes, offsets, timestamps, hd, batch_of)


def _halfway(spans: np.ndarray, m: int) -> int:
    """Where a span of ``m`` batches (their payloads' (start, end) pairs) splits in two halves
    of about equal payload bytes, or ``m`` when it is not worth splitting."""
    lens = spans[1::2] - spans[0::2]
    total = int(lens.sum())
    if m < 2 or not parallel.worth_splitting(total):
        return m
    return min(m - 1, int(np.searchsorted(np.cumsum(lens), total // 2)) + 1)


def span_entries(buf: np.ndarray, start_pos: int, topic: bytes, k0: int, k1: int, where: str,
                 entry_dtype: np.dtype) -> "tuple[Heads, np.ndarray] | None":
    """The batches of ``buf`` (the .log from ``start_pos``) checked as ``decode_batches`` checks
    them, and the index entries (``entry_dtype``: bcq.BCQ_DTYPE) of all their records with key
    digests under (k0, k1), straight from the Kafka records (kafka_entries_many): what a replica
    indexes a shipped segment with. None when a batch fails a check (``decode_batches`` names
    it)."""
    span = _open_span(buf, start_pos, len(topic), where, None, None, None)
    if span is None or span[0].shape[0] == 0:
        return None
    heads, pay, spans = span
    flat = np.ascontiguousarray(heads).reshape(-1)
    st, _b, _r, n, _nbytes = _N.kafka_scan_many(pay, spans, flat, len(topic), 0, (1 << 63) - 1)
    if st != DEC_OK:
        return None
    e = np.empty(n, entry_dtype)
    _N.kafka_entries_many(pay, spans, flat, k0, k1, e.view(np.uint8).reshape(-1))
    return Heads(np.ascontiguousarray(heads)), e


class SpanFields(NamedTuple):
    """Keys and values of a span's records straight from their Kafka records (``span_fields``):
    where they lie in ``pay`` (length -1: null). ``count``: the entries given that lie in the
    batches decoded; ``picked``: those handed out (all, or the wanted ones), their numbers."""
    pay: np.ndarray
    count: int
    picked: np.ndarray
    kstart: np.ndarray
    klen: np.ndarray
    vstart: np.ndarray
    vlen: np.ndarray


def span_fields(buf: np.ndarray, start_pos: int, tl: int, entries: np.ndarray, k0: int, k1: int,
                max_bytes: int | None, want: np.ndarray | None = None) -> SpanFields | None:
    """The keys and values of ``entries``' records (index entries, offsets rising, of the
    batches of ``buf``: the .log from ``start_pos``), the batches checked as ``decode_batches``
    checks them and each record against its entry (kafka_fields_many), no format-1 record
    written; with ``max_bytes``, only the batches a read bounded so decodes, and the entries of
    those; with ``want`` (offsets, rising), only the records at those offsets are checked
    against their entries and handed out, and only the batches that hold one are decompressed
    and walked (the span read is the same: every batch's header and CRC-32C is checked, as a
    record read by offset is verified by its batch's, segment-v2.md). None without the C
    kernels or when anything fails a check (``decode_batches`` and the reader's check name
    it)."""
    if entries.shape[0] == 0:
        return None
    heads = _span_heads(buf, start_pos)
    if heads is None:
        return None
    positions = entries["position"].astype(np.int64)
    last = None  # the last batch the read covers, when only some of them are decoded
    hit = None  # which entries are wanted (None: all)
    if want is not None:
        offs = entries["offset"].astype(np.int64)
        # the wanted offsets in this span's range: every one of its records (a compacted
        # partition's winners), or a few
        win = want[np.searchsorted(want, offs[0]):np.searchsorted(want, offs[-1], "right")]
        if not (win.shape[0] == offs.shape[0] and bool(np.array_equal(win, offs))):
            at = np.minimum(np.searchsorted(win, offs), max(0, win.shape[0] - 1))
            hit = (win[at] == offs) if win.shape[0] else np.zeros(offs.shape[0], bool)
        # only the batches holding a wanted record are decompressed: an uncompacted history's
        # early batches mostly hold none, and decompressing them was most of a KV build's read
        sizes = None if hit is None else _payload_sizes(buf, start_pos, heads)
        if sizes is not None:
            heads = heads[:_within(heads, sizes, tl, max_bytes)]  # what the read covers
            last, max_bytes = int(heads[-1, 0]), None
            heads = heads[np.isin(heads[:, 0], np.unique(positions[hit]), assume_unique=True)]
            if heads.shape[0] == 0:  # none of the read's batches holds a wanted record
                none = np.zeros(0, np.int64)
                return SpanFields(np.zeros(0, np.uint8),
                                  int(np.searchsorted(positions, last, side="right")),
                                  none, none, none, none, none)
    span = _open_span(buf, start_pos, tl, "", None, max_bytes, None, fresh=True, heads=heads)
    if span is None or span[0].shape[0] == 0:
        return None
    heads, pay, spans = span
    flat = np.ascontiguousarray(heads).reshape(-1)
    st, _b, _r, _n, _nbytes = _N.kafka_scan_many(pay, spans, flat, tl, 0, (1 << 63) - 1)
    if st != DEC_OK:
        return None
    n = int(np.searchsorted(positions, int(heads[-1, 0]) if last is None else last,
                            side="right"))
    picked = None if hit is None else np.flatnonzero(hit[:n])  # (None: all n)
    if picked is None:
        picked = np.arange(n)
        e = np.ascontiguousarray(entries[:n])
    else:
        e = np.ascontiguousarray(entries[picked])
    m = e.shape[0]
    ks, kl, vs, vl = (np.empty(m, np.int64) for _ in range(4))
    if _N.kafka_fields_many(pay, spans, flat, e.view(np.uint8).reshape(-1), k0, k1,
                            ks, kl, vs, vl) >= 0:
        return None
    return SpanFields(pay, n, picked, ks, kl, vs, vl)


def _within(heads: np.ndarray, sizes: np.ndarray, tl: int, max_bytes: int | None) -> int:
    """How many of ``heads``' batches (their payloads ``sizes`` bytes) a read bounded to
    ``max_bytes`` of records decodes: up to the one that brings them to it. A format-1 record
    is at most its Kafka record plus a header and the topic name (``tl`` bytes)."""
    m = heads.shape[0]
    if max_bytes is None or m == 0:
        return m
    est = np.cumsum(sizes + heads[:, 6] * (V1_HEADER_SIZE + tl))
    return min(m, int(np.searchsorted(est, max_bytes, side="left")) + 1)


def _unpack(buf: np.ndarray, start_pos: int, heads: np.ndarray, tl: int,
            max_bytes: int | None, first: Opened | None, fresh: bool = False):
    """The payloads of ``heads``' batches (kafka_heads rows) back to back, decompressed in one C
    call (threads for a large span): (the rows kept under ``max_bytes``, payloads, their spans),
    or None when the C module has no libzstd or a batch is not uncompressed or one zstd frame of
    declared size."""
    if heads.shape[0] == 0:
        return None
    sizes = _payload_sizes(buf, start_pos, heads)
    if sizes is None:
        return None
    m = _within(heads, sizes, tl, max_bytes)
    heads, sizes = heads[:m], sizes[:m]
    flat = np.ascontiguousarray(heads).reshape(-1)
    starts = np.zeros(sizes.shape[0] + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    out = np.empty(int(starts[-1]), np.uint8) if fresh else _scratch(int(starts[-1]))
    skip = 0
    if first is not None and first.head.position == int(heads[0, 0]) \
            and first.payload.shape[0] == int(sizes[0]):
        out[:starts[1]] = first.payload
        skip = 1
    threads = 2 if parallel.worth_splitting(int(starts[-1])) else 1
    if _N.kafka_unpack_many(buf, flat, start_pos, out, starts, skip, threads) >= 0:
        return None  # a frame that does not decode: the batch-by-batch path names it
    return heads, out, _spans(sizes)


def _scratch(n: int) -> np.ndarray:
    """``n`` bytes of this thread's buffer for decompressed payloads, reused from one span to
    the next (a fresh one costs a page fault every 4 KiB); valid until the thread's next span."""
    if n > SCRATCH_KEPT:  # not kept: a thread holds no more than this between reads
        return np.empty(n, np.uint8)
    buf = getattr(_tls, "scratch", None)
    if buf is None or buf.shape[0] < n:
        buf = _tls.scratch = np.empty(max(n, 1 << 20), np.uint8)
    return buf[:n]


#: the largest decompression buffer a thread keeps for its next span
SCRATCH_KEPT = 16 << 20


def _assemble(parts, topic_arr, partition) -> Decoded:
    sizes = (np.concatenate([sz for _, _, sz, _, _ in parts]) if parts
             else np.zeros(0, np.int64))
    n = sizes.shape[0]
    positions = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(sizes[:-1], out=positions[1:])
    data = np.empty(int(sizes.sum()), np.uint8)
    offsets = np.empty(n, np.int64)
    timestamps = np.empty(n, np.int64)
    batch_of = np.empty(n, np.int64)
    heads = []
    i = 0
    for b, (h, payload, _, start, count) in enumerate(parts):
        heads.append(h)
        if count:
            _to_v1(payload, start, count, h.base_offset, h.base_ts, topic_arr, partition, data,
                   int(positions[i]), offsets[i:i + count], timestamps[i:i + count])
        batch_of[i:i + count] = b
        i += count
    return Decoded(data, positions, sizes, offsets, timestamps, Heads.of(heads), batch_of)


__all__ = ["BATCH_HEADER", "BatchHead", "CODEC_BY_NAME", "CODEC_GZIP", "CODEC_LZ4", "CODEC_NAMES",
           "CODEC_NONE", "CODEC_SNAPPY", "CODEC_ZSTD", "Decoded", "EncodedBatch", "FORMAT_VERSION",
           "HEADER_SIZE", "Heads", "LOG_OVERHEAD", "Opened", "batch_size_at", "codec_of", "compress",
           "SpanFields", "cut_batch", "decode_batches", "decode_run", "decompress",
           "control_batch", "encode_batch",
           "encode_plain", "open_batch", "parse_head", "span_entries", "span_fields", "walk_opened",
           "zstd_compress", "zstd_decompress"]
