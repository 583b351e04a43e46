"""The numba twins of reput/_native.c's record and index kernels, the reference the tests compare
the C ones with (test_native_kernels.py, test_read_fields.py, ...): moved here from
reput/_kernels.py when the C kernels became the product's only ones (issue 39). The helpers and
constants they share with the product's remaining numba kernels come from reput/_kernels.py,
whose names this module also holds.
"""
# flake8: noqa: F821  (names from reput/_kernels.py, put in this module's globals below)

from __future__ import annotations

import numpy as np

from kcompact.reput import _kernels as _product
from kcompact.reput.jit import njit

# the product's kernels, helpers and constants too, so that a test reads every numba kernel of
# the record layer from here (K.crc32c, K.CRC_TABLES, K.count_records, ...)
globals().update({k: v for k, v in vars(_product).items() if not k.startswith("__")})


# ---------------------------------------------------------------------------------------------
# SipHash-2-4 with 128-bit output (Aumasson & Bernstein), the keyed key digest: the reference
# of the C one (reput/_native.c siphash128, kcompact's only one since issue 48).

@njit(cache=True, nogil=True, inline="always")
def _rotl(x, b):
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


@njit(cache=True, nogil=True, inline="always")
def _sipround(v0, v1, v2, v3):
    v0 = v0 + v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 = v2 + v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 = v0 + v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 = v2 + v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(cache=True, nogil=True)
def siphash128(k0, k1, buf, start, length):
    """SipHash-2-4-128 of ``buf[start:start+length]`` under key (k0, k1); returns (lo, hi)."""
    v0 = np.uint64(0x736F6D6570736575) ^ k0
    v1 = np.uint64(0x646F72616E646F6D) ^ k1 ^ np.uint64(0xEE)
    v2 = np.uint64(0x6C7967656E657261) ^ k0
    v3 = np.uint64(0x7465646279746573) ^ k1
    end = start + length
    p = start
    while end - p >= 8:
        m = _rd_u64(buf, p)
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
        p += 8
    b = np.uint64(length & 0xFF) << np.uint64(56)
    i = 0
    while p + i < end:
        b |= np.uint64(buf[p + i]) << np.uint64(8 * i)
        i += 1
    v3 ^= b
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= b
    v2 ^= np.uint64(0xEE)
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    lo = v0 ^ v1 ^ v2 ^ v3
    v1 ^= np.uint64(0xDD)
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    hi = v0 ^ v1 ^ v2 ^ v3
    return lo, hi


@njit(cache=True, nogil=True)
def _check_header(buf, p, end):
    """Return the record size at p if its header is self-consistent, 0 if torn, -1 if invalid."""
    if end - p < HEADER_SIZE:
        return 0
    size = np.int64(_rd_u32(buf, p))
    if size < HEADER_SIZE or size > MAX_RECORD_SIZE:
        return -1
    if buf[p + 8] != MAGIC or (buf[p + 9] & ~ATTR_MASK) != 0 or buf[p + 11] != 0:
        return -1
    tl = np.int64(buf[p + 10])
    kl = np.int64(_rd_i32(buf, p + 32))
    vl = np.int64(_rd_i32(buf, p + 36))
    hl = np.int64(_rd_i32(buf, p + 40))
    if tl < 1 or kl < 0 or vl < 0 or hl < 0:
        return -1
    if HEADER_SIZE + tl + kl + vl + hl != size:
        return -1
    if (buf[p + 9] & ATTR_NULL_KEY) and kl != 0:
        return -1
    if (buf[p + 9] & ATTR_NULL_VALUE) and vl != 0:
        return -1
    if size > end - p:
        return 0
    return size


@njit(cache=True, nogil=True)
def count_records(buf, start, end, verify_crc, tables):
    """Walk records in buf[start:end]. Returns (count, stop, status)."""
    p = start
    n = 0
    while p < end:
        size = _check_header(buf, p, end)
        if size == 0:
            return n, p, SCAN_TORN
        if size < 0:
            return n, p, SCAN_CORRUPT
        if verify_crc and crc32c(buf, p + 8, p + size, tables) != _rd_u32(buf, p + 4):
            return n, p, SCAN_CORRUPT
        p += size
        n += 1
    return n, p, SCAN_OK


@njit(cache=True, nogil=True)
def fill_records(buf, start, n, k0, k1, positions, sizes, partitions, offsets, timestamps,
                 attrs, topic_hash, digest_lo, digest_hi, crcs):
    """Fill per-record columns for the first n records from start (already validated)."""
    p = start
    for i in range(n):
        size = np.int64(_rd_u32(buf, p))
        positions[i] = p
        sizes[i] = size
        crcs[i] = _rd_u32(buf, p + 4)
        a = buf[p + 9]
        attrs[i] = a
        tl = np.int64(buf[p + 10])
        partitions[i] = _rd_i32(buf, p + 12)
        offsets[i] = _rd_i64(buf, p + 16)
        timestamps[i] = _rd_i64(buf, p + 24)
        kl = np.int64(_rd_i32(buf, p + 32))
        # to group records by partition without decoding names
        topic_hash[i] = topic_fnv(buf[p + HEADER_SIZE:p + HEADER_SIZE + tl])
        if a & ATTR_NULL_KEY:
            digest_lo[i] = 0
            digest_hi[i] = 0
        else:
            lo, hi = siphash128(k0, k1, buf, p + HEADER_SIZE + tl, kl)
            digest_lo[i] = lo
            digest_hi[i] = hi
        p += size


@njit(cache=True, nogil=True)
def lower_bound_strided(words, stride, n, target):
    """First i in [0, n) with words[i*stride] >= target (n if none): index offset search."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if words[mid * stride] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def gather_ranges(src, starts, lengths, out):
    """Concatenate src[starts[i]:starts[i]+lengths[i]] into out; returns bytes written."""
    q = 0
    for i in range(starts.shape[0]):
        n = lengths[i]
        _copy(out, q, src, starts[i], n)
        q += n
    return q


@njit(cache=True, nogil=True)
def field_spans(buf, positions, kstart, klen, vstart, vlen, hstart, hlen, attrs):
    """Where each record's key, value and headers lie in buf (records already validated)."""
    for i in range(positions.shape[0]):
        p = positions[i]
        tl = np.int64(buf[p + 10])
        kl = np.int64(_rd_i32(buf, p + 32))
        vl = np.int64(_rd_i32(buf, p + 36))
        hl = np.int64(_rd_i32(buf, p + 40))
        kstart[i] = p + HEADER_SIZE + tl
        klen[i] = kl
        vstart[i] = p + HEADER_SIZE + tl + kl
        vlen[i] = vl
        hstart[i] = p + HEADER_SIZE + tl + kl + vl
        hlen[i] = hl
        attrs[i] = buf[p + 9]


@njit(cache=True, nogil=True)
def verify_records(buf, base, entries, k0, k1, mode):
    """Index of the first record that does not match its index entry, or -1 (reput/_native.c's
    verify_records: ``entries`` the bytes of n 48-byte .bcq entries; header valid, CRC32C, and
    the entry's size, offset, timestamp, flags and key digest; mode 1 (contiguous): the records
    lie back to back from buf[0] to its end in increasing offset order, else ``n``; mode 2: as
    1 with the first record a guard, only its header checked; mode 3: as 0 without the CRC, for
    records store format 2's decoder has just written). The caller checks the arguments."""
    blen = buf.shape[0]
    expect = np.int64(0)
    n = entries.shape[0] // 48
    contiguous = mode == 1 or mode == 2
    guard = mode == 2
    check_crc = mode != 3
    u0 = np.uint64(k0)  # (a Python int comes in as int64: XOR with uint64 would make a float)
    u1 = np.uint64(k1)
    prev_off = np.int64(0)
    for i in range(n):
        q = i * 48
        p = np.int64(_rd_u32(entries, q + 32)) - base
        size = np.int64(_rd_u32(entries, q + 36))
        off = np.int64(_rd_u64(entries, q))
        if size < HEADER_SIZE or p < 0 or p > blen:
            return i
        if contiguous and (p != expect or (i > 0 and off <= prev_off)):
            return i
        if _check_header(buf, p, blen) != size:
            return i
        prev_off = off
        if _rd_u64(buf, p + 16) != _rd_u64(entries, q):
            return i
        if guard and i == 0:
            expect = p + size
            continue
        if _rd_u64(buf, p + 24) != _rd_u64(entries, q + 8):
            return i
        flags = np.uint32(entries[q + 40]) | (np.uint32(entries[q + 41]) << np.uint32(8))
        if flags != np.uint32(buf[p + 9]):
            return i
        if check_crc and crc32c(buf, p + 8, p + size, CRC_TABLES) != _rd_u32(buf, p + 4):
            return i
        lo = np.uint64(0)
        hi = np.uint64(0)
        if not (buf[p + 9] & ATTR_NULL_KEY):
            lo, hi = siphash128(u0, u1, buf, p + HEADER_SIZE + np.int64(buf[p + 10]),
                                np.int64(_rd_i32(buf, p + 32)))
        if lo != _rd_u64(entries, q + 16) or hi != _rd_u64(entries, q + 24):
            return i
        expect = p + size
    if contiguous and expect != blen:
        return n
    return -1


@njit(cache=True, nogil=True)
def crc32c_update(crc, buf):
    """CRC32C of ``buf`` continuing from ``crc`` (0 to start): reput/_native.c's crc32c."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    t0 = CRC_TABLES[0]
    for i in range(buf.shape[0]):
        c = t0[(c ^ np.uint32(buf[i])) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
    return c ^ np.uint32(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def offset_order(partitions, offsets, max_partition):
    """One pass over a batch: is every partition's offset sequence strictly increasing?

    Partitions must lie in [0, max_partition]. Returns (i, seen): i is the index of the first
    record whose offset is not above the previous offset of its partition in the batch (-1 when
    none), and ``seen`` a uint8 array over 0..max_partition marking the partitions present.
    O(n), without the argsort of a general check (Store._check_order).
    """
    last = np.empty(max_partition + 1, dtype=np.int64)
    seen = np.zeros(max_partition + 1, dtype=np.uint8)
    for i in range(partitions.shape[0]):
        p = partitions[i]
        o = np.int64(offsets[i])
        if seen[p] and o <= last[p]:
            return i, seen
        seen[p] = 1
        last[p] = o
    return -1, seen
