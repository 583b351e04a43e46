"""A test-side reader of Kafka RecordBatch v2 bytes, written from the protocol spec
(https://kafka.apache.org/documentation/#recordbatch) independently of kcompact's own codec: the
oracle the Kafka endpoint's tests decode what it serves with."""

from __future__ import annotations

import gzip
import struct
from typing import NamedTuple

import google_crc32c

HEAD = struct.Struct(">qiibIhiqqqhii")  # 61 bytes


class KRecord(NamedTuple):
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple


class KBatch(NamedTuple):
    base_offset: int
    last_offset: int
    size: int
    attributes: int
    max_timestamp: int
    records: list


def _varint(b: bytes, p: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        c = b[p]
        p += 1
        result |= (c & 0x7F) << shift
        if not c & 0x80:
            break
        shift += 7
    return (result >> 1) ^ -(result & 1), p


def _bytes(b: bytes, p: int) -> tuple[bytes | None, int]:
    n, p = _varint(b, p)
    if n < 0:
        return None, p
    return bytes(b[p:p + n]), p + n


def _decompress(codec: int, body: bytes) -> bytes:
    if codec == 0:
        return body
    if codec == 1:
        return gzip.decompress(body)
    if codec == 4:
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    import cramjam
    if codec == 2:  # snappy-java's xerial framing: a 16-byte header, then (int32 n, n bytes)*
        if body[:8] != b"\x82SNAPPY\x00":
            return bytes(cramjam.snappy.decompress_raw(body))
        out, p = b"", 16
        while p < len(body):
            n = struct.unpack_from(">i", body, p)[0]
            out += bytes(cramjam.snappy.decompress_raw(body[p + 4:p + 4 + n]))
            p += 4 + n
        return out
    if codec == 3:
        return bytes(cramjam.lz4.decompress(body))
    raise ValueError(f"codec {codec}")


def decode_batches(data: bytes) -> list[KBatch]:
    """Every whole batch of ``data``; a cut trailing batch is dropped (as clients do)."""
    data = bytes(data)
    out, p = [], 0
    while p + 12 <= len(data):
        (base, length, _epoch, magic, crc, attrs, last_delta, base_ts, max_ts, _pid, _pe,
         _seq, count) = HEAD.unpack_from(data, p) if p + 61 <= len(data) else (0, 0, 0, 0, 0,
                                                                              0, 0, 0, 0, 0,
                                                                              0, 0, 0)
        size = 12 + struct.unpack_from(">i", data, p + 8)[0]
        if p + size > len(data):
            break
        assert magic == 2, f"magic {magic} at byte {p}"
        assert google_crc32c.value(data[p + 21:p + size]) == crc, f"CRC at byte {p}"
        body = _decompress(attrs & 7, data[p + 61:p + size])
        recs, q = [], 0
        for _ in range(count):
            length, q = _varint(body, q)
            end = q + length
            q += 1  # attributes
            dts, q = _varint(body, q)
            doff, q = _varint(body, q)
            key, q = _bytes(body, q)
            value, q = _bytes(body, q)
            nh, q = _varint(body, q)
            hs = []
            for _ in range(nh):
                hk, q = _bytes(body, q)
                hv, q = _bytes(body, q)
                hs.append((hk.decode(), hv))
            assert q == end
            recs.append(KRecord(base + doff, base_ts + dts, key, value, tuple(hs)))
        out.append(KBatch(base, base + last_delta, size, attrs, max_ts, recs))
        p += size
    return out
