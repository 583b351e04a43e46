"""Kernels of the store source (restore): Kafka's key partitioner, compiled for many keys at once
(with its pure-Python twin for one key), and the check that gathered records are the planned ones.

``murmur2_many`` is the Java client's ``Utils.murmur2`` (MurmurHash2, seed 0x9747b28c), the hash
of Kafka's default partitioner: a keyed record goes to ``toPositive(murmur2(key)) % partitions``
where ``toPositive(h) = h & 0x7fffffff``. The pure-Python twin, used for single keys and as the
reference in tests, is :func:`murmur2` below.

All arithmetic is on uint64 masked to 32 bits: numba would turn a uint64/int64 mix into float64,
so every constant is a np.uint64.
"""

from __future__ import annotations

import struct

import numpy as np
from kcompact.reput.jit import njit

_MASK32 = 0xFFFFFFFF
_M32 = 0x5BD1E995


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (signed 32-bit result), the default partitioner's hash."""
    n = len(data)
    h = (0x9747B28C ^ n) & _MASK32
    for (k,) in struct.iter_unpack("<I", data[: n - n % 4]):
        k = (k * _M32) & _MASK32
        k ^= k >> 24
        k = (k * _M32) & _MASK32
        h = ((h * _M32) & _MASK32) ^ k
    tail, b = n % 4, n - n % 4
    if tail == 3:
        h ^= data[b + 2] << 16
    if tail >= 2:
        h ^= data[b + 1] << 8
    if tail >= 1:
        h ^= data[b]
        h = (h * _M32) & _MASK32
    h ^= h >> 13
    h = (h * _M32) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h >= 1 << 31 else h


def default_partition(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a keyed record."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


_M = np.uint64(0x5BD1E995)
_SEED = np.uint64(0x9747B28C)
_MASK = np.uint64(0xFFFFFFFF)
_POSITIVE = np.uint64(0x7FFFFFFF)


@njit(cache=True, nogil=True)
def murmur2_many(buf, starts, lengths, out):
    """out[i] = murmur2 of buf[starts[i]:starts[i] + lengths[i]] as an unsigned 32-bit value."""
    for i in range(starts.shape[0]):
        s = starts[i]
        n = lengths[i]
        h = (_SEED ^ np.uint64(n)) & _MASK
        for w in range(n // 4):
            p = s + 4 * w
            k = (np.uint64(buf[p]) | (np.uint64(buf[p + 1]) << np.uint64(8))
                 | (np.uint64(buf[p + 2]) << np.uint64(16))
                 | (np.uint64(buf[p + 3]) << np.uint64(24)))
            k = (k * _M) & _MASK
            k ^= k >> np.uint64(24)
            k = (k * _M) & _MASK
            h = (h * _M) & _MASK
            h ^= k
        tail = n & 3
        b = s + (n - tail)
        if tail == 3:
            h ^= np.uint64(buf[b + 2]) << np.uint64(16)
        if tail >= 2:
            h ^= np.uint64(buf[b + 1]) << np.uint64(8)
        if tail >= 1:
            h ^= np.uint64(buf[b])
            h = (h * _M) & _MASK
        h ^= h >> np.uint64(13)
        h = (h * _M) & _MASK
        h ^= h >> np.uint64(15)
        out[i] = h


@njit(cache=True, nogil=True)
def murmur2_partitions(buf, starts, lengths, keyless, num_partitions, next_keyless, out):
    """Target partition of each record: Kafka's default partitioner for keyed records, and
    round-robin from ``next_keyless`` for keyless ones (``keyless[i]`` true). Returns the next
    round-robin position."""
    hashes = np.empty(starts.shape[0], np.uint64)
    murmur2_many(buf, starts, lengths, hashes)
    n = np.uint64(num_partitions)
    rr = next_keyless
    for i in range(starts.shape[0]):
        if keyless[i]:
            out[i] = rr % num_partitions
            rr += 1
        else:
            out[i] = np.int64((hashes[i] & _POSITIVE) % n)
    return rr
