"""The numba kernels of the record and index hot paths that have no C twin: the writer's encode
(``encode_records``, ``encode_scan_records``), the writer's topic runs (``topic_fnv``, ``same_topic_runs``) and the .bcq
entries of scanned records (``fill_entries``). Every other record and index kernel is C only
(reput/_native.c: scan, fill, verify, field spans, gather, the index search, offset order); their
numba versions are the reference the tests compare the C ones with (tests/unit/_oracle_kernels.py,
issue 39: one kernel per job).

Everything here works on flat ``uint8`` buffers and plain numpy arrays so that a batch of
millions of records is encoded, checksummed and hashed without a Python-level loop.
The byte layout these kernels read and write is specified in docs/formats/record.md and
docs/formats/bcq.md; the constants live in reput/record.py and reput/bcq.py.

Integers in records are little-endian and unaligned, so they are assembled from bytes.
"""

from __future__ import annotations

import numpy as np
from kcompact.reput.jit import njit

from .intrinsics import (HAVE_SSE42, crc32_u8, crc32_u64, load_u32, load_u64, store_u32,
                          store_u64)

# ---------------------------------------------------------------------------------------------
# CRC32C (Castagnoli), slicing-by-8.  Same function as google-crc32c / iSCSI / ext4.

_CRC_POLY = 0x82F63B78


def _crc_tables() -> np.ndarray:
    t = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _CRC_POLY if c & 1 else c >> 1
        t[0, i] = c
    for i in range(256):
        c = int(t[0, i])
        for k in range(1, 8):
            c = int(t[0, c & 0xFF]) ^ (c >> 8)
            t[k, i] = c
    return t


CRC_TABLES = _crc_tables()


@njit(cache=True, nogil=True, inline="always")
def _rd_u32(b, p):
    return load_u32(b, p)


@njit(cache=True, nogil=True, inline="always")
def _rd_i32(b, p):
    return np.int32(load_u32(b, p))


@njit(cache=True, nogil=True, inline="always")
def _rd_u64(b, p):
    return load_u64(b, p)


@njit(cache=True, nogil=True, inline="always")
def _rd_i64(b, p):
    return np.int64(load_u64(b, p))


@njit(cache=True, nogil=True, inline="always")
def _wr_u32(b, p, v):
    store_u32(b, p, np.uint32(v))


@njit(cache=True, nogil=True, inline="always")
def _wr_u64(b, p, v):
    store_u64(b, p, np.uint64(v))


@njit(cache=True, nogil=True, inline="always")
def _copy(dst, d, src, s, n):
    """dst[d:d+n] = src[s:s+n] in 8-byte moves (numba's slice copy is slow for short runs)."""
    i = 0
    while n - i >= 8:
        store_u64(dst, d + i, load_u64(src, s + i))
        i += 8
    while i < n:
        dst[d + i] = src[s + i]
        i += 1


@njit(cache=True, nogil=True)
def _crc32c_hw(buf, start, end, tables):
    c = np.uint64(0xFFFFFFFF)
    p = start
    while end - p >= 8:
        c = crc32_u64(c, load_u64(buf, p))
        p += 8
    c32 = np.uint32(c)
    while p < end:
        c32 = crc32_u8(c32, buf[p])
        p += 1
    return c32 ^ np.uint32(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def _crc32c_table(buf, start, end, tables):
    """CRC32C of ``buf[start:end]`` (portable slicing-by-8)."""
    crc = np.uint32(0xFFFFFFFF)
    p = start
    t0 = tables[0]
    t1 = tables[1]
    t2 = tables[2]
    t3 = tables[3]
    t4 = tables[4]
    t5 = tables[5]
    t6 = tables[6]
    t7 = tables[7]
    while end - p >= 8:
        one = crc ^ _rd_u32(buf, p)
        crc = (t7[one & np.uint32(0xFF)] ^ t6[(one >> np.uint32(8)) & np.uint32(0xFF)]
               ^ t5[(one >> np.uint32(16)) & np.uint32(0xFF)] ^ t4[one >> np.uint32(24)]
               ^ t3[buf[p + 4]] ^ t2[buf[p + 5]] ^ t1[buf[p + 6]] ^ t0[buf[p + 7]])
        p += 8
    while p < end:
        crc = t0[(crc ^ np.uint32(buf[p])) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
        p += 1
    return crc ^ np.uint32(0xFFFFFFFF)


#: CRC32C of buf[start:end]: the CPU's CRC32 instruction when it has one (~6 GB/s), else tables.
crc32c = _crc32c_hw if HAVE_SSE42 else _crc32c_table


# ---------------------------------------------------------------------------------------------
# Records.  Header layout (docs/formats/record.md), HEADER_SIZE = 44:
#   0 size u32 | 4 crc u32 | 8 magic u8 | 9 attributes u8 | 10 topic_len u8 | 11 reserved u8
#  12 partition i32 | 16 offset i64 | 24 timestamp i64 | 32 key_len i32 | 36 value_len i32
#  40 headers_len i32 | 44 topic | key | value | headers

HEADER_SIZE = 44
MAGIC = 1
ATTR_NULL_VALUE = 1
ATTR_NULL_KEY = 2
ATTR_MASK = 3
MAX_RECORD_SIZE = 256 * 1024 * 1024

# scan status codes
SCAN_OK = 0          # stopped at `end` exactly, every record whole and valid
SCAN_TORN = 1        # the last record runs past `end` (a torn tail, or a record cut by the range)
SCAN_CORRUPT = 2     # invalid header or CRC mismatch at `stop`


@njit(cache=True, nogil=True, inline="always")
def write_header(out, p, size, attrs, tlen, partition, offset, timestamp, kl, vl, hl):
    """The 44-byte header of a record at out[p:] (record.md), its CRC left to the caller."""
    _wr_u32(out, p, size)
    out[p + 8] = MAGIC
    out[p + 9] = attrs
    out[p + 10] = tlen
    out[p + 11] = 0
    _wr_u32(out, p + 12, np.uint32(np.int64(partition) & 0xFFFFFFFF))
    _wr_u64(out, p + 16, np.uint64(offset))
    _wr_u64(out, p + 24, np.uint64(timestamp))
    _wr_u32(out, p + 32, kl)
    _wr_u32(out, p + 36, vl)
    _wr_u32(out, p + 40, hl)


@njit(cache=True, nogil=True, inline="always")
def write_front(out, p, size, attrs, tlen, partition, offset, timestamp, topic, kbuf, ks, kl,
                vbuf, vs, vl, hl):
    """A record's header, topic, key and value at out[p:] (record.md); returns where its
    headers go (they and the CRC are the caller's). Null keys and values have length 0 here
    (their attribute bit says null)."""
    write_header(out, p, size, attrs, tlen, partition, offset, timestamp, kl, vl, hl)
    q = p + HEADER_SIZE
    _copy(out, q, topic, 0, tlen)
    q += tlen
    _copy(out, q, kbuf, ks, kl)
    q += kl
    _copy(out, q, vbuf, vs, vl)
    return q + vl


@njit(cache=True, nogil=True, inline="always")
def _encode_one(out, p, i, topic, partitions, offsets, timestamps, kbuf, koffs, knull, vbuf,
                voffs, vnull, hbuf, hoffs, tables):
    """Record i of the columns at out[p:] (its size precomputed by the caller); returns its
    attributes byte and CRC."""
    tlen = topic.shape[0]
    ks = koffs[i]
    kl = koffs[i + 1] - ks
    vs = voffs[i]
    vl = voffs[i + 1] - vs
    hs = hoffs[i]
    hl = hoffs[i + 1] - hs
    size = HEADER_SIZE + tlen + kl + vl + hl
    attrs = 0
    if vnull[i]:
        attrs |= ATTR_NULL_VALUE
    if knull[i]:
        attrs |= ATTR_NULL_KEY
    q = write_front(out, p, size, attrs, tlen, partitions[i], offsets[i], timestamps[i],
                    topic, kbuf, ks, kl, vbuf, vs, vl, hl)
    _copy(out, q, hbuf, hs, hl)
    crc = crc32c(out, p + 8, p + size, tables)
    _wr_u32(out, p + 4, crc)
    return attrs, crc


@njit(cache=True, nogil=True)
def encode_records(out, positions, topic, partitions, offsets, timestamps,
                   kbuf, koffs, knull, vbuf, voffs, vnull, hbuf, hoffs, tables):
    """Write records i = 0..n-1 at out[positions[i]:] (sizes precomputed by the caller)."""
    for i in range(positions.shape[0]):
        _encode_one(out, positions[i], i, topic, partitions, offsets, timestamps, kbuf, koffs,
                    knull, vbuf, voffs, vnull, hbuf, hoffs, tables)


@njit(cache=True, nogil=True)
def encode_scan_records(out, positions, topic, partitions, offsets, timestamps,
                        kbuf, koffs, knull, vbuf, voffs, vnull, hbuf, hoffs, tables,
                        attrs_out, crcs):
    """encode_records, which also fills the columns fill_records would read back from what it
    wrote (attributes, CRCs; the key digests are the C SipHash's, record.key_digests): the
    writer dispatches a batch it has just encoded without parsing it again."""
    for i in range(positions.shape[0]):
        attrs, crc = _encode_one(out, positions[i], i, topic, partitions, offsets, timestamps,
                                 kbuf, koffs, knull, vbuf, voffs, vnull, hbuf, hoffs, tables)
        attrs_out[i] = attrs
        crcs[i] = crc


@njit(cache=True, nogil=True, inline="always")
def topic_fnv(topic):
    """FNV-1a 64 of a topic name's bytes (fill_records' topic_hash)."""
    h = np.uint64(0xCBF29CE484222325)
    for j in range(topic.shape[0]):
        h ^= np.uint64(topic[j])
        h *= np.uint64(0x100000001B3)
    return h


@njit(cache=True, nogil=True)
def same_topic_runs(buf, positions, topic_hash, partitions):
    """Boundaries of runs of consecutive records with the same (topic, partition).

    Returns an int64 array of run start indices plus a final n. Topic names are compared
    byte for byte inside a run, so a hash collision between two topics splits the run
    instead of merging two topics (the caller decodes each run's topic name).
    """
    n = positions.shape[0]
    out = np.empty(n + 1, dtype=np.int64)
    r = 0
    for i in range(n):
        if i == 0:
            out[r] = 0
            r += 1
            continue
        same = topic_hash[i] == topic_hash[i - 1] and partitions[i] == partitions[i - 1]
        if same:
            pa = positions[i - 1]
            pb = positions[i]
            tl = buf[pa + 10]
            if buf[pb + 10] != tl:
                same = False
            else:
                for j in range(tl):
                    if buf[pa + HEADER_SIZE + j] != buf[pb + HEADER_SIZE + j]:
                        same = False
                        break
        if not same:
            out[r] = i
            r += 1
    out[r] = n
    return out[: r + 1]


@njit(cache=True, nogil=True)
def fill_entries(out, lo, hi, position_base, offsets, timestamps, digest_lo, digest_hi,
                 positions, sizes, attrs):
    """Write 48-byte .bcq entries for scanned records lo..hi-1 into out (docs/formats/bcq.md)."""
    q = 0
    for i in range(lo, hi):
        store_u64(out, q, np.uint64(offsets[i]))
        store_u64(out, q + 8, np.uint64(timestamps[i]))
        store_u64(out, q + 16, digest_lo[i])
        store_u64(out, q + 24, digest_hi[i])
        store_u32(out, q + 32, np.uint32(positions[i] + position_base))
        store_u32(out, q + 36, np.uint32(sizes[i]))
        a = attrs[i]
        flags = np.uint32(0)
        if a & ATTR_NULL_VALUE:
            flags |= np.uint32(1)
        if a & ATTR_NULL_KEY:
            flags |= np.uint32(2)
        store_u32(out, q + 40, flags)   # flags u16 + reserved u16 (0)
        store_u32(out, q + 44, np.uint32(0))  # clean_time
        q += 48


