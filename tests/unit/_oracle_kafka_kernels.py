"""The numba twins of store format 2's C kernels (reput/_kafka_native.h): format-1 records <->
Kafka RecordBatch v2 records. The reference the tests compare the C ones with (moved here from
reput/_kafka_kernels.py when the C kernels became the product's only ones, issue 39).

Spec: docs/formats/segment-v2.md (Kafka's record grammar) and docs/formats/record.md (format 1).
A sealed segment is encoded from format-1 records (what reput appended, CRC-checked by the
reader first) and decoded back into format-1 records in memory, so that every reader of a block
(``RecordColumns``: its field spans, ``records()``, a replica's append, the restore) sees one
layout whatever the segment's format. Each kernel walks many records without a Python-level loop;
the Python side (reput/batch.py) only loops over batches (about 1 MiB of records each) to call
the compressor.

Varints are Kafka's: zigzag, then 7 bits a byte, low group first.
"""

from __future__ import annotations

import numpy as np

from kcompact.reput.jit import njit

from kcompact.reput._kernels import (ATTR_NULL_KEY, ATTR_NULL_VALUE, CRC_TABLES, HEADER_SIZE, _copy, _rd_i32,
                       _rd_i64, _rd_u32, _wr_u32, crc32c, write_front)

#: decode statuses (``kafka_to_v1``): every record whole / a length or varint runs past the
#: payload / a value out of range (negative length other than -1, too many records, ...)
DEC_OK, DEC_TRUNCATED, DEC_INVALID = 0, 1, 2
DEC_ORDER = 3  # kafka_find: offset deltas not 0, then rising


@njit(cache=True, nogil=True, inline="always")
def _varint_size(v):
    """Bytes of zigzag varint ``v`` (int64)."""
    z = np.uint64((v << 1) ^ (v >> 63))
    n = 1
    while z >= np.uint64(0x80):
        z >>= np.uint64(7)
        n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _put_varint(out, q, v):
    z = np.uint64((np.int64(v) << 1) ^ (np.int64(v) >> 63))
    while z >= np.uint64(0x80):
        out[q] = np.uint8((z & np.uint64(0x7F)) | np.uint64(0x80))
        z >>= np.uint64(7)
        q += 1
    out[q] = np.uint8(z)
    return q + 1


@njit(cache=True, nogil=True, inline="always")
def _get_field(buf, q, rend):
    """(length, start, next position) of a record's key or value at ``q`` (length -1: null);
    next position -1 when it is invalid or runs past ``rend``."""
    n, q = _get_varint(buf, q, rend)
    if q < 0 or n < -1 or (n > 0 and q + n > rend):
        return np.int64(0), np.int64(0), np.int64(-1)
    return n, np.int64(q), np.int64(q + (n if n > 0 else 0))


@njit(cache=True, nogil=True, inline="always")
def _put_field(out, q, buf, s, length, null):
    """A key or value as a Kafka record holds it: varint length and bytes, or -1 when null."""
    if null:
        return _put_varint(out, q, -1)
    q = _put_varint(out, q, length)
    _copy(out, q, buf, s, length)
    return q + length


@njit(cache=True, nogil=True, inline="always")
def _get_varint(buf, p, end):
    """(value, next position); next position -1 when the varint runs past ``end`` or is longer
    than 10 bytes."""
    z = np.uint64(0)
    shift = 0
    while True:
        if p >= end or shift > 63:
            return np.int64(0), -1
        b = np.uint64(buf[p])
        p += 1
        z |= (b & np.uint64(0x7F)) << np.uint64(shift)
        if b < np.uint64(0x80):
            break
        shift += 7
    v = np.int64(z >> np.uint64(1)) ^ -np.int64(z & np.uint64(1))
    return v, p


@njit(cache=True, nogil=True, inline="always")
def _v1_fields(buf, p):
    """(topic length, offset, timestamp, key length, value length, headers length, attributes)
    of the format-1 record at p (record.md)."""
    return (np.int64(buf[p + 10]), _rd_i64(buf, p + 16), _rd_i64(buf, p + 24),
            np.int64(_rd_i32(buf, p + 32)), np.int64(_rd_i32(buf, p + 36)),
            np.int64(_rd_i32(buf, p + 40)), buf[p + 9])


@njit(cache=True, nogil=True)
def _kafka_body_size(buf, p, base_offset, base_ts):
    """Size of the Kafka record body (after its length varint) of the format-1 record at p."""
    tl, off, ts, kl, vl, hl, a = _v1_fields(buf, p)
    n = 1 + _varint_size(ts - base_ts) + _varint_size(off - base_offset)
    n += _varint_size(-1) if a & ATTR_NULL_KEY else _varint_size(kl) + kl
    n += _varint_size(-1) if a & ATTR_NULL_VALUE else _varint_size(vl) + vl
    if hl == 0:
        return n + 1
    h = p + HEADER_SIZE + tl + kl + vl
    count = np.int64(_rd_u32(buf, h))
    n += _varint_size(count)
    q = h + 4
    for _ in range(count):
        nl = np.int64(buf[q]) | (np.int64(buf[q + 1]) << 8)
        q += 2 + nl
        hv = np.int64(_rd_i32(buf, q))
        q += 4
        n += _varint_size(nl) + nl
        if hv < 0:
            n += _varint_size(-1)
        else:
            n += _varint_size(hv) + hv
            q += hv
    return n


@njit(cache=True, nogil=True)
def v1_to_kafka_sizes(buf, positions, batch_starts, base_offsets, base_ts, out_sizes):
    """Uncompressed payload bytes of each batch: records positions[batch_starts[k]:
    batch_starts[k+1]] of ``buf`` (verified format-1 records) as Kafka records relative to
    base_offsets[k] / base_ts[k]."""
    for k in range(batch_starts.shape[0] - 1):
        total = np.int64(0)
        for i in range(batch_starts[k], batch_starts[k + 1]):
            body = _kafka_body_size(buf, positions[i], base_offsets[k], base_ts[k])
            total += _varint_size(body) + body
        out_sizes[k] = total


@njit(cache=True, nogil=True)
def v1_to_kafka(buf, positions, lo, hi, base_offset, base_ts, out, q):
    """Write records positions[lo:hi] of ``buf`` as Kafka records at out[q:]; returns the end."""
    for i in range(lo, hi):
        p = positions[i]
        tl, off, ts, kl, vl, hl, a = _v1_fields(buf, p)
        body = _kafka_body_size(buf, p, base_offset, base_ts)
        q = _put_varint(out, q, body)
        out[q] = 0
        q += 1
        q = _put_varint(out, q, ts - base_ts)
        q = _put_varint(out, q, off - base_offset)
        s = p + HEADER_SIZE + tl
        q = _put_field(out, q, buf, s, kl, a & ATTR_NULL_KEY)
        s += kl
        q = _put_field(out, q, buf, s, vl, a & ATTR_NULL_VALUE)
        s += vl
        if hl == 0:
            out[q] = 0
            q += 1
            continue
        count = np.int64(_rd_u32(buf, s))
        q = _put_varint(out, q, count)
        s += 4
        for _ in range(count):
            nl = np.int64(buf[s]) | (np.int64(buf[s + 1]) << 8)
            s += 2
            q = _put_varint(out, q, nl)
            _copy(out, q, buf, s, nl)
            q += nl
            s += nl
            hv = np.int64(_rd_i32(buf, s))
            s += 4
            if hv < 0:
                q = _put_varint(out, q, -1)
            else:
                q = _put_varint(out, q, hv)
                _copy(out, q, buf, s, hv)
                q += hv
                s += hv
    return q


@njit(cache=True, nogil=True)
def _walk_record(buf, p, end):
    """Parse the Kafka record at p (bounds-checked). Returns (status, next position, ts delta,
    offset delta, key start, key len (-1 null), value start, value len (-1 null), headers start,
    header count, v1 header-section bytes)."""
    z = np.int64(0)
    length, q = _get_varint(buf, p, end)
    if q < 0:
        return DEC_TRUNCATED, p, z, z, z, z, z, z, z, z, z
    if length < 1:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    rend = q + length
    if rend > end:
        return DEC_TRUNCATED, p, z, z, z, z, z, z, z, z, z
    q += 1  # attributes
    tsd, q = _get_varint(buf, q, rend)
    if q < 0:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    od, q = _get_varint(buf, q, rend)
    if q < 0 or od < 0 or od > 0x7FFFFFFF:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    kl, ks, q = _get_field(buf, q, rend)
    if q < 0:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    vl, vs, q = _get_field(buf, q, rend)
    if q < 0:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    hc, q = _get_varint(buf, q, rend)
    if q < 0 or hc < 0 or hc > length:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    hs = q
    hbytes = np.int64(4) if hc > 0 else np.int64(0)
    for _ in range(hc):
        nl, q = _get_varint(buf, q, rend)
        if q < 0 or nl < 0 or nl > 0xFFFF or q + nl > rend:
            return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
        q += nl
        hv, q = _get_varint(buf, q, rend)
        if q < 0 or hv < -1 or (hv > 0 and q + hv > rend):
            return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
        if hv > 0:
            q += hv
        hbytes += 2 + nl + 4 + max(hv, 0)
    if q != rend:
        return DEC_INVALID, p, z, z, z, z, z, z, z, z, z
    return DEC_OK, rend, tsd, od, ks, kl, vs, vl, hs, hc, hbytes


@njit(cache=True, nogil=True)
def kafka_sizes(buf, start, end, count, tl, sizes, starts, deltas):
    """Walk ``count`` Kafka records of buf[start:end]; sizes[i] = the format-1 size of record i
    (topic name of ``tl`` bytes), starts[i] where it starts in ``buf``, deltas[i] its offset
    delta. Returns (status, records walked, stop position); status DEC_OK needs exactly
    ``count`` records ending exactly at ``end``."""
    p = start
    for i in range(count):
        st, nxt, tsd, od, ks, kl, vs, vl, hs, hc, hb = _walk_record(buf, p, end)
        if st != DEC_OK:
            return st, i, p
        sizes[i] = HEADER_SIZE + tl + max(kl, 0) + max(vl, 0) + hb
        starts[i] = p
        deltas[i] = od
        p = nxt
    if p != end:
        return DEC_INVALID, count, p
    return DEC_OK, count, p


@njit(cache=True, nogil=True)
def kafka_find(buf, start, end, count, tl, lo, hi):
    """``kafka_sizes`` without per-record arrays, also checking that the offset deltas start at 0
    and rise strictly (else status DEC_ORDER): (status, walked, stop, a, z, start_a, nbytes,
    last_delta), records a..z-1 being those whose delta lies in [lo, hi] (a = z = -1 when
    none), start_a where record a starts, nbytes their format-1 size together."""
    p = start
    first = -1
    last = -1
    start_a = 0
    nbytes = 0
    prev = -1
    for i in range(count):
        st, nxt, tsd, od, ks, kl, vs, vl, hs, hc, hb = _walk_record(buf, p, end)
        if st == DEC_OK and (od != 0 if i == 0 else od <= prev):
            st = DEC_ORDER
        if st != DEC_OK:
            return st, i, p, first, (last + 1 if first >= 0 else -1), start_a, nbytes, prev
        if lo <= od <= hi:
            if first < 0:
                first = i
                start_a = p
            last = i
            nbytes += HEADER_SIZE + tl + max(kl, 0) + max(vl, 0) + hb
        prev = od
        p = nxt
    st = DEC_OK if p == end else DEC_INVALID
    return st, count, p, first, (last + 1 if first >= 0 else -1), start_a, nbytes, prev


@njit(cache=True, nogil=True)
def kafka_to_v1(buf, start, count, base_offset, base_ts, topic, partition, out, q0,
                offsets, timestamps, tables):
    """Write the ``count`` Kafka records at buf[start:] (walked by ``kafka_sizes`` first) as
    format-1 records at out[q0:], CRC included; offsets[i], timestamps[i] get each record's.
    Returns the end position in ``out``."""
    tlen = topic.shape[0]
    p = start
    q = q0
    end = buf.shape[0]
    for i in range(count):
        st, nxt, tsd, od, ks, kl, vs, vl, hs, hc, hb = _walk_record(buf, p, end)
        klen = max(kl, 0)
        vlen = max(vl, 0)
        size = HEADER_SIZE + tlen + klen + vlen + hb
        off = base_offset + od
        ts = base_ts + tsd
        offsets[i] = off
        timestamps[i] = ts
        attrs = 0
        if vl < 0:
            attrs |= ATTR_NULL_VALUE
        if kl < 0:
            attrs |= ATTR_NULL_KEY
        w = write_front(out, q, size, attrs, tlen, partition, off, ts, topic, buf, ks, klen,
                        buf, vs, vlen, hb)
        if hc > 0:
            _wr_u32(out, w, hc)
            w += 4
            r = hs
            for _ in range(hc):
                nl, r = _get_varint(buf, r, nxt)
                out[w] = np.uint8(nl & 0xFF)
                out[w + 1] = np.uint8((nl >> 8) & 0xFF)
                w += 2
                _copy(out, w, buf, r, nl)
                w += nl
                r += nl
                hv, r = _get_varint(buf, r, nxt)
                _wr_u32(out, w, np.uint32(np.int64(hv) & 0xFFFFFFFF))
                w += 4
                if hv > 0:
                    _copy(out, w, buf, r, hv)
                    w += hv
                    r += hv
        _wr_u32(out, q + 4, crc32c(out, q + 8, q + size, tables))
        q += size
        p = nxt
    return q


__all__ = ["CRC_TABLES", "DEC_INVALID", "DEC_OK", "DEC_ORDER", "DEC_TRUNCATED", "kafka_find",
           "kafka_sizes", "kafka_to_v1", "v1_to_kafka", "v1_to_kafka_sizes"]
