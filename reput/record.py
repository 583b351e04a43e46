"""Record codec: one length-prefixed, CRC32C-checked record per source Kafka message.

Spec: docs/formats/record.md. A record carries topic, partition, queue offset (the source Kafka
offset), timestamp, key (nullable), value (nullable = tombstone) and headers. Records are written
once by a commit-log writer and then copied byte for byte into compaction logs (never
re-encoded), so the CRC that the writer computed is the one every later reader checks.

Batch APIs (``RecordBatch``, ``encode_batch``, ``scan``) run in compiled kernels; ``Record`` and
``decode_one`` exist for the places where a record must be built or shown one at a time.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from . import _kernels as K
from . import _native as _N
from .errors import CorruptRecordError, InvalidTopicError, ReputError

FORMAT_VERSION = K.MAGIC
#: ``scan`` statuses: every record whole and valid / the last one runs past the end / an invalid
#: header or CRC at ``stop``
SCAN_OK, SCAN_TORN, SCAN_CORRUPT = K.SCAN_OK, K.SCAN_TORN, K.SCAN_CORRUPT
HEADER_SIZE = K.HEADER_SIZE
MAX_RECORD_SIZE = K.MAX_RECORD_SIZE
ATTR_NULL_VALUE = K.ATTR_NULL_VALUE
ATTR_NULL_KEY = K.ATTR_NULL_KEY

#: size, crc, magic, attributes, topic_len, reserved, partition, offset, timestamp,
#: key_len, value_len, headers_len
HEADER = struct.Struct("<IIBBBBiqqiii")
assert HEADER.size == HEADER_SIZE
_HCOUNT = struct.Struct("<I")
_HNAME = struct.Struct("<H")
_HVAL = struct.Struct("<i")

_TOPIC_RE = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")

Headers = Sequence[tuple[str, "bytes | None"]]


def validate_topic(topic: str) -> str:
    """Kafka's topic-name rule: 1-249 chars of [a-zA-Z0-9._-], not '.' or '..'."""
    # fullmatch, not match: "$" would also accept a name that ends in a newline
    if not isinstance(topic, str) or not _TOPIC_RE.fullmatch(topic) or topic in (".", ".."):
        raise InvalidTopicError(
            f"invalid topic name {topic!r}: use 1-249 characters of a-z A-Z 0-9 . _ - "
            "(and not '.' or '..'), as Kafka does")
    return topic


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = field(default=())

    @property
    def is_tombstone(self) -> bool:
        return self.value is None


def encode_headers(headers: Headers | None) -> bytes:
    """Headers section: u32 count, then (u16 name_len, name, i32 value_len (-1 = null), value)."""
    if not headers:
        return b""
    parts = [_HCOUNT.pack(len(headers))]
    for name, value in headers:
        nb = name.encode("utf-8") if isinstance(name, str) else bytes(name)
        if len(nb) > 0xFFFF:
            raise ReputError(f"header name longer than 65535 bytes: {nb[:40]!r}...")
        parts.append(_HNAME.pack(len(nb)))
        parts.append(nb)
        if value is None:
            parts.append(_HVAL.pack(-1))
        else:
            vb = value.encode("utf-8") if isinstance(value, str) else bytes(value)
            parts.append(_HVAL.pack(len(vb)))
            parts.append(vb)
    return b"".join(parts)


def decode_headers(buf: bytes | memoryview) -> tuple[tuple[str, bytes | None], ...]:
    if len(buf) == 0:
        return ()
    mv = memoryview(buf)
    if len(mv) < 4:
        raise CorruptRecordError("headers section shorter than its count field")
    (count,) = _HCOUNT.unpack_from(mv, 0)
    p = 4
    out = []
    for _ in range(count):
        if p + 2 > len(mv):
            raise CorruptRecordError("header name length runs past the headers section")
        (nl,) = _HNAME.unpack_from(mv, p)
        p += 2
        if p + nl + 4 > len(mv):
            raise CorruptRecordError("header name runs past the headers section")
        name = bytes(mv[p:p + nl]).decode("utf-8", errors="replace")
        p += nl
        (vl,) = _HVAL.unpack_from(mv, p)
        p += 4
        if vl == -1:
            out.append((name, None))
            continue
        if vl < 0 or p + vl > len(mv):
            raise CorruptRecordError("header value runs past the headers section")
        out.append((name, bytes(mv[p:p + vl])))
        p += vl
    if p != len(mv):
        raise CorruptRecordError("trailing bytes after the last header")
    return tuple(out)


class BytesColumn:
    """A nullable variable-length bytes column: one buffer, n+1 offsets, a null mask.

    Item i is ``buf[offs[i]:offs[i+1]]``, or None where ``null[i]`` (its length is then 0). The
    key, value and header columns of a ``RecordBatch`` (what a writer appends) and of a
    ``reader.RecordColumns`` block (what a reader gets back) are this type.
    """

    __slots__ = ("buf", "offs", "null")

    def __init__(self, buf: np.ndarray, offs: np.ndarray, null: np.ndarray):
        self.buf, self.offs, self.null = buf, offs, null

    @classmethod
    def from_list(cls, items: Sequence[bytes | None]) -> "BytesColumn":
        n = len(items)
        null = np.fromiter((x is None for x in items), dtype=np.bool_, count=n)
        lens = np.fromiter((0 if x is None else len(x) for x in items), dtype=np.int64, count=n)
        offs = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=offs[1:])
        joined = b"".join(x for x in items if x)
        return cls(np.frombuffer(joined, dtype=np.uint8) if joined else np.zeros(0, np.uint8),
                   offs, null)

    @classmethod
    def fixed(cls, data: np.ndarray, width: int) -> "BytesColumn":
        """n values of exactly ``width`` bytes each, packed in ``data``."""
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        n = data.shape[0] // width if width else 0
        return cls(data, np.arange(0, (n + 1) * width, width, dtype=np.int64) if width
                   else np.zeros(n + 1, np.int64), np.zeros(n, np.bool_))

    @classmethod
    def nulls(cls, n: int) -> "BytesColumn":
        return cls(np.zeros(0, np.uint8), np.zeros(n + 1, np.int64), np.ones(n, np.bool_))

    @classmethod
    def empties(cls, n: int) -> "BytesColumn":
        return cls(np.zeros(0, np.uint8), np.zeros(n + 1, np.int64), np.zeros(n, np.bool_))

    def __len__(self) -> int:
        return self.null.shape[0]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offs)

    def to_list(self) -> list[bytes | None]:
        """The items as bytes objects (None for a null)."""
        n = len(self)
        if n == 0:
            return []
        a = int(self.offs[0])
        data = self.buf[a:int(self.offs[n])].tobytes()
        o = (self.offs[:n + 1] - a).tolist()
        return [None if z else data[o[i]:o[i + 1]] for i, z in enumerate(self.null.tolist())]

    def get(self, i: int) -> bytes | None:
        if self.null[i]:
            return None
        return self.buf[self.offs[i]:self.offs[i + 1]].tobytes()


class RecordBatch:
    """Columnar batch of records of one topic: the unit the commit log appends.

    Build it from columns (``from_columns``, no per-record Python work) or from ``Record``
    objects / tuples (``from_records``).
    """

    __slots__ = ("topic", "partitions", "offsets", "timestamps", "keys", "values", "headers")

    def __init__(self, topic: str, partitions: np.ndarray, offsets: np.ndarray,
                 timestamps: np.ndarray, keys: BytesColumn, values: BytesColumn,
                 headers: BytesColumn):
        self.topic = validate_topic(topic)
        n = offsets.shape[0]
        self.partitions = np.ascontiguousarray(partitions, dtype=np.int32)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.timestamps = np.ascontiguousarray(timestamps, dtype=np.int64)
        if not (self.partitions.shape[0] == self.timestamps.shape[0] == n
                == keys.null.shape[0] == values.null.shape[0] == headers.null.shape[0]):
            raise ReputError("record batch columns have different lengths")
        if n and (self.partitions.min() < 0 or self.offsets.min() < 0):
            raise ReputError("record batch has a negative partition or offset")
        self.keys, self.values, self.headers = keys, values, headers

    def __len__(self) -> int:
        return self.offsets.shape[0]

    @classmethod
    def from_records(cls, topic: str, records: Iterable) -> "RecordBatch":
        """From ``Record`` objects or tuples (partition, offset, timestamp, key, value[, headers])."""
        rows = [(r.partition, r.offset, r.timestamp, r.key, r.value, r.headers)
                if isinstance(r, Record) else (tuple(r) + ((),))[:6] for r in records]
        n = len(rows)
        parts = np.fromiter((r[0] for r in rows), dtype=np.int32, count=n)
        offs = np.fromiter((r[1] for r in rows), dtype=np.int64, count=n)
        ts = np.fromiter((r[2] for r in rows), dtype=np.int64, count=n)
        keys = BytesColumn.from_list([r[3] for r in rows])
        values = BytesColumn.from_list([r[4] for r in rows])
        hdrs = [encode_headers(r[5]) for r in rows]
        headers = BytesColumn.from_list(hdrs) if any(hdrs) else BytesColumn.empties(n)
        return cls(topic, parts, offs, ts, keys, values, headers)

    @classmethod
    def from_columns(cls, topic: str, partitions, offsets, timestamps, *,
                     keys: BytesColumn, values: BytesColumn,
                     headers: BytesColumn | None = None) -> "RecordBatch":
        n = len(offsets)
        return cls(topic, np.broadcast_to(np.asarray(partitions, np.int32), (n,)), offsets,
                   np.broadcast_to(np.asarray(timestamps, np.int64), (n,)), keys, values,
                   headers if headers is not None else BytesColumn.empties(n))

    def encoded_sizes(self) -> np.ndarray:
        tl = len(self.topic.encode())
        return (HEADER_SIZE + tl + self.keys.lengths() + self.values.lengths()
                + self.headers.lengths())

    def records(self) -> Iterable[Record]:
        for i in range(len(self)):
            hb = self.headers.get(i)
            yield Record(self.topic, int(self.partitions[i]), int(self.offsets[i]),
                         int(self.timestamps[i]), self.keys.get(i), self.values.get(i),
                         decode_headers(hb) if hb else ())


def _layout(batch: RecordBatch, scratch: "Scratch | None"):
    """(sizes, positions, output buffer, topic bytes) of a batch about to be encoded."""
    sizes = np.asarray(batch.encoded_sizes(), dtype=np.int64)
    if sizes.size and sizes.max() > MAX_RECORD_SIZE:
        raise ReputError(f"a record is larger than the {MAX_RECORD_SIZE}-byte maximum")
    positions = np.zeros(sizes.shape[0], dtype=np.int64)
    if sizes.shape[0] > 1:
        np.cumsum(sizes[:-1], out=positions[1:])
    total = int(sizes.sum())
    out = scratch.get("encode", total, np.uint8) if scratch else np.empty(total, dtype=np.uint8)
    return sizes, positions, out, np.frombuffer(batch.topic.encode(), dtype=np.uint8)


def encode_batch(batch: RecordBatch, scratch: "Scratch | None" = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Encode a batch; returns (bytes as uint8 array, int64 start position of each record).

    With ``scratch`` the output lives in a reused buffer (valid until its next use): fresh
    memory costs a page fault per 4 KiB on first touch, which would dominate the encode.
    """
    _, positions, out, topic = _layout(batch, scratch)
    K.encode_records(out, positions, topic, batch.partitions, batch.offsets, batch.timestamps,
                     batch.keys.buf, batch.keys.offs, batch.keys.null,
                     batch.values.buf, batch.values.offs, batch.values.null,
                     batch.headers.buf, batch.headers.offs, K.CRC_TABLES)
    return out, positions


def encode_scanned(batch: RecordBatch, *, secret: bytes, scratch: "Scratch | None" = None
                   ) -> tuple[np.ndarray, "Scan"]:
    """``encode_batch``, and the ``Scan`` that ``scan(out, secret=secret, verify_crc=False)``
    would read back from its bytes, filled in the same pass (sizes, CRCs and key digests are
    known while each record is written): the writer's dispatch of a batch it has just encoded
    (Store.append) parses nothing again."""
    sizes, positions, out, topic = _layout(batch, scratch)
    n = sizes.shape[0]
    new = scratch.get if scratch is not None else (lambda _name, m, dt: np.empty(m, dt))
    s = Scan()
    s.positions, s.sizes = positions, sizes
    s.partitions = new("partitions", n, np.int32)
    s.partitions[:] = batch.partitions
    s.offsets = new("offsets", n, np.int64)
    s.offsets[:] = batch.offsets
    s.timestamps = new("timestamps", n, np.int64)
    s.timestamps[:] = batch.timestamps
    s.attrs = new("attrs", n, np.uint8)
    s.topic_hash = new("topic_hash", n, np.uint64)
    s.topic_hash[:] = K.topic_fnv(topic)
    s.digest_lo = new("digest_lo", n, np.uint64)
    s.digest_hi = new("digest_hi", n, np.uint64)
    s.crcs = new("crcs", n, np.uint32)
    k0, k1 = secret_words(secret)
    K.encode_scan_records(out, positions, topic, s.partitions, s.offsets, s.timestamps,
                          batch.keys.buf, batch.keys.offs, batch.keys.null,
                          batch.values.buf, batch.values.offs, batch.values.null,
                          batch.headers.buf, batch.headers.offs, K.CRC_TABLES,
                          s.attrs, s.crcs)
    key_digests(batch.keys, k0, k1, s.digest_lo, s.digest_hi)
    s.stop, s.status = int(out.shape[0]), K.SCAN_OK
    return out, s


def encode(records: Iterable[Record]) -> bytes:
    """Encode Record objects (any topics) into one buffer, in order."""
    parts = []
    for r in records:
        buf, _ = encode_batch(RecordBatch.from_records(r.topic, [r]))
        parts.append(buf.tobytes())
    return b"".join(parts)


class Scan:
    """Per-record columns of a scanned buffer (positions are relative to the buffer start)."""

    __slots__ = ("positions", "sizes", "partitions", "offsets", "timestamps", "attrs",
                 "topic_hash", "digest_lo", "digest_hi", "crcs", "stop", "status")

    def __len__(self) -> int:
        return self.positions.shape[0]


class Scratch:
    """Named reusable arrays that grow as needed (one per writer; not thread-safe)."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None or a.shape[0] < n or a.dtype != np.dtype(dtype):
            a = np.empty(max(n, 1024, int(n * 1.25) if a is not None else n), dtype=dtype)
            self._arrays[name] = a
        return a[:n]


def scan(buf: np.ndarray, start: int = 0, end: int | None = None, *, secret: bytes = bytes(16),
         verify_crc: bool = True, scratch: Scratch | None = None) -> Scan:
    """Parse every whole record in buf[start:end] (bounds- and CRC-checked).

    Stops at the first torn or corrupt record: ``status`` says which (SCAN_OK, SCAN_TORN,
    SCAN_CORRUPT) and ``stop`` is its position; all records before it are returned.
    """
    # the kernels do no bounds checks of their own: never let them past the array
    end = buf.shape[0] if end is None else max(0, min(int(end), buf.shape[0]))
    start = max(0, min(int(start), end))
    # the C kernels (reput/_native.c): no numba needed to read a store
    n, stop, status = _N.count_records(buf, start, end, verify_crc)
    s = Scan()
    new = scratch.get if scratch is not None else (lambda _name, m, dt: np.empty(m, dt))
    s.positions = new("positions", n, np.int64)
    s.sizes = new("sizes", n, np.int64)
    s.partitions = new("partitions", n, np.int32)
    s.offsets = new("offsets", n, np.int64)
    s.timestamps = new("timestamps", n, np.int64)
    s.attrs = new("attrs", n, np.uint8)
    s.topic_hash = new("topic_hash", n, np.uint64)
    s.digest_lo = new("digest_lo", n, np.uint64)
    s.digest_hi = new("digest_hi", n, np.uint64)
    s.crcs = new("crcs", n, np.uint32)
    k0, k1 = secret_words(secret)
    _N.fill_records(
        buf, start, n, k0, k1, s.positions, s.sizes, s.partitions, s.offsets, s.timestamps,
        s.attrs, s.topic_hash, s.digest_lo, s.digest_hi, s.crcs)
    s.stop, s.status = int(stop), int(status)
    return s


class FieldSpans(NamedTuple):
    """Where each record's key, value and headers lie in a buffer (int64 starts and lengths),
    and its attributes byte (ATTR_NULL_KEY | ATTR_NULL_VALUE)."""

    kstart: np.ndarray
    klen: np.ndarray
    vstart: np.ndarray
    vlen: np.ndarray
    hstart: np.ndarray
    hlen: np.ndarray
    attrs: np.ndarray


def field_spans(buf: np.ndarray, positions: np.ndarray) -> FieldSpans:
    """The fields of the records at ``positions`` of ``buf`` (records already verified; each
    header is checked against the buffer again)."""
    n = positions.shape[0]
    out = FieldSpans(*(np.empty(n, np.int64) for _ in range(6)), np.empty(n, np.uint8))
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    _N.field_spans(buf, pos, *out)
    return out


def gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           out: np.ndarray | None = None) -> np.ndarray:
    """``src[starts[i]:starts[i]+lengths[i]]`` back to back (into ``out`` when given, which
    must be large enough); returns the filled array."""
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    out = np.empty(total, np.uint8) if out is None else out[:total]
    _N.gather_ranges(src, starts, lengths, out)
    return out


def hash_ranges(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """SipHash-2-4-128 under the 16-byte ``key`` of each ``buf[starts[i]:+lengths[i]]``, as
    (lo, hi) uint64 arrays (the key digest's function, over any ranges)."""
    k0, k1 = secret_words(key)
    n = starts.shape[0]
    lo, hi = np.empty(n, np.uint64), np.empty(n, np.uint64)
    if n:
        _N.siphash_ranges(int(k0), int(k1), buf, np.ascontiguousarray(starts, dtype=np.int64),
                          np.ascontiguousarray(lengths, dtype=np.int64), lo, hi)
    return lo, hi


def key_digests(keys: "BytesColumn", k0, k1, lo: np.ndarray, hi: np.ndarray) -> None:
    """The key digests of a keys column into ``lo``/``hi`` (0, 0 for a null key): the C
    SipHash (reput/_native.c ``siphash_keys``), kcompact's only one."""
    if keys.null.shape[0]:
        _N.siphash_keys(int(k0), int(k1), keys.buf, keys.offs, keys.null.view(np.uint8), lo, hi)


@functools.lru_cache(maxsize=64)
def digest_key_words(secret: bytes) -> tuple[int, int]:
    """The store secret as the key digest's two 64-bit key words, as Python ints (cached: the
    readers' verify calls pass them to the C kernels)."""
    k0, k1 = secret_words(secret)
    return int(k0), int(k1)


def secret_words(secret: bytes) -> tuple[np.uint64, np.uint64]:
    if len(secret) != 16:
        raise ReputError("the digest secret must be 16 bytes")
    return (np.uint64(int.from_bytes(secret[:8], "little")),
            np.uint64(int.from_bytes(secret[8:], "little")))


def key_digest(key: bytes, secret: bytes) -> tuple[int, int]:
    """The keyed 128-bit digest of one key (SipHash-2-4-128), as (lo, hi)."""
    arr = np.frombuffer(key, dtype=np.uint8) if key else np.zeros(0, np.uint8)
    lo, hi = hash_ranges(arr, np.zeros(1, np.int64), np.array([len(key)], np.int64), secret)
    return int(lo[0]), int(hi[0])


def decode_one(buf, pos: int = 0, *, verify_crc: bool = True, where: str = "buffer") -> Record:
    """Decode the record at ``pos`` (bounds-checked; raises CorruptRecordError)."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf)
    if len(mv) - pos < HEADER_SIZE:
        raise CorruptRecordError(f"{where}: truncated record header at byte {pos}")
    (size, crc, magic, attrs, tl, resv, part, off, ts, kl, vl, hl) = HEADER.unpack_from(mv, pos)
    if (magic != FORMAT_VERSION or size < HEADER_SIZE or size > len(mv) - pos or resv
            or attrs & ~3 or min(kl, vl, hl) < 0 or tl < 1
            or HEADER_SIZE + tl + kl + vl + hl != size
            or (attrs & ATTR_NULL_KEY and kl) or (attrs & ATTR_NULL_VALUE and vl)):
        raise CorruptRecordError(f"{where}: invalid record header at byte {pos}")
    if verify_crc:
        arr = np.frombuffer(mv, dtype=np.uint8)
        if int(_N.crc32c_range(arr, pos + 8, pos + size)) != crc:
            raise CorruptRecordError(f"{where}: CRC mismatch in record at byte {pos}")
    p = pos + HEADER_SIZE
    topic = bytes(mv[p:p + tl]).decode("utf-8", errors="replace")
    p += tl
    key = None if attrs & ATTR_NULL_KEY else bytes(mv[p:p + kl])
    p += kl
    value = None if attrs & ATTR_NULL_VALUE else bytes(mv[p:p + vl])
    p += vl
    headers = decode_headers(mv[p:p + hl])
    return Record(topic, part, off, ts, key, value, headers)


def decode_all(buf, *, where: str = "buffer") -> list[Record]:
    """Decode every record of a buffer that must hold only whole, valid records."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    s = scan(arr)
    if s.status != K.SCAN_OK:
        raise CorruptRecordError(f"{where}: {'torn' if s.status == K.SCAN_TORN else 'corrupt'} "
                                 f"record at byte {s.stop}")
    return [decode_one(arr, int(p), verify_crc=False, where=where) for p in s.positions]
