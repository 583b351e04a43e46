"""Every exported function of the C extensions called with hostile arguments (issue 27: the C
entry points check their arguments against the buffers and against overflow): each raises
ValueError or TypeError with a message, never reads or writes outside a buffer. A crash here
kills the test process, which fails the run.

The Python callers check their arguments too; these calls are what a caller with a bug (or a
damaged file's numbers passed straight through) would make.
"""

from __future__ import annotations

import numpy as np
import pytest

from kcompact.compaction import _native as CN
from kcompact.connectors.apps.kv import _native as KN
from kcompact.reput import _native as RN

BIG = 2 ** 61 + 1
HUGE = 2 ** 70

u8 = lambda n: np.zeros(n, np.uint8)    # noqa: E731
i64 = lambda n: np.zeros(n, np.int64)   # noqa: E731
u64 = lambda n: np.zeros(n, np.uint64)  # noqa: E731
u32 = lambda n: np.zeros(n, np.uint32)  # noqa: E731
u16 = lambda n: np.zeros(n, np.uint16)  # noqa: E731


def _fill_outputs(n):
    return [i64(n), u32(n), u32(n), i64(n), i64(n), u8(n), u64(n), u64(n), u64(n), u32(n)]


def _entries(position: int, size: int) -> np.ndarray:
    from kcompact.reput import bcq as B
    e = np.zeros(1, B.BCQ_DTYPE)
    e["position"], e["size"] = position, size
    return e.view(np.uint8)


CASES = {
    # reput/_native.c
    "lower_bound_strided n past words": lambda: RN.lower_bound_strided(i64(12), 6, BIG, 1),
    "lower_bound_strided huge stride": lambda: RN.lower_bound_strided(i64(12), BIG, 2, 1),
    "lower_bound_strided zero stride": lambda: RN.lower_bound_strided(i64(12), 0, 2, 1),
    "lower_bound_strided negative n": lambda: RN.lower_bound_strided(i64(12), 1, -5, 1),
    "lower_bound_strided n over 2^64": lambda: RN.lower_bound_strided(i64(12), 1, HUGE, 1),
    "count_records end past buffer": lambda: RN.count_records(u8(10), 0, BIG, True),
    "count_records start past end": lambda: RN.count_records(u8(10), 5, 2, True),
    "count_records huge start": lambda: RN.count_records(u8(10), HUGE, HUGE, True),
    "fill_records n past outputs": lambda: RN.fill_records(u8(10), 0, BIG, 0, 0,
                                                           *_fill_outputs(2)),
    "fill_records start past buffer": lambda: RN.fill_records(u8(10), BIG, 1, 0, 0,
                                                              *_fill_outputs(2)),
    "verify_records base past 2^32": lambda: RN.verify_records(u8(64), BIG, _entries(0, 50),
                                                               0, 0, False),
    "verify_records partial entry": lambda: RN.verify_records(u8(64), 0, u8(47), 0, 0, False),
    "verify_records strided entries": lambda: RN.verify_records(u8(64), 0, u8(96)[::2], 0, 0,
                                                                False),
    "verify_records strided buf": lambda: RN.verify_records(u8(128)[::2], 0, _entries(0, 50),
                                                            0, 0, False),
    "verify_records unknown mode": lambda: RN.verify_records(u8(64), 0, _entries(0, 50), 0, 0,
                                                             4),
    "kafka_encode_plain range past the positions": lambda: RN.kafka_encode_plain(
        u8(64), i64(2), i64(2), i64(2), i64(2), 0, 3, 100, 10, 1, u8(256), i64(8)),
    "kafka_encode_plain record past buf": lambda: RN.kafka_encode_plain(
        u8(64), np.array([60], np.int64), i64(1), i64(1), i64(1), 0, 1, 100, 10, 1, u8(256),
        i64(8)),
    "kafka_encode_plain strided out": lambda: RN.kafka_encode_plain(
        u8(64), i64(1), i64(1), i64(1), i64(1), 0, 1, 100, 10, 1, u8(512)[::2], i64(8)),
    "kafka_encode_plain batch_bytes 0": lambda: RN.kafka_encode_plain(
        u8(64), i64(1), i64(1), i64(1), i64(1), 0, 1, 0, 10, 1, u8(256), i64(8)),
    "field_spans outputs short": lambda: RN.field_spans(u8(64), i64(4), *[i64(1)] * 6, u8(1)),
    "gather_ranges range past src": lambda: RN.gather_ranges(u8(8), np.array([4], np.int64),
                                                             np.array([BIG], np.int64), u8(8)),
    "gather_ranges start+len overflows": lambda: RN.gather_ranges(
        u8(8), np.array([2 ** 62], np.int64), np.array([2 ** 62], np.int64), u8(8)),
    "gather_ranges out too small": lambda: RN.gather_ranges(u8(8), np.array([0, 0], np.int64),
                                                            np.array([8, 8], np.int64), u8(8)),
    "crc32c crc beyond 32 bits": lambda: RN.crc32c(b"abc", 2 ** 40),
    "crc32c not a buffer": lambda: RN.crc32c(12, 0),
    # compaction/_native.c: insert_entries(table, cap, max_keys, count, base, offsets, dlo,
    # dhi, flags, start, stop); lookup_many(table, cap, base, dlo, dhi, out); decide(...)
    "insert_entries cap past table": lambda: CN.insert_entries(u32(16), BIG, 1, 0, 0, i64(1),
                                                               u64(1), u64(1), u16(1), 0, 1),
    "insert_entries stop past arrays": lambda: CN.insert_entries(u32(16), 4, 1, 0, 0, i64(1),
                                                                 u64(1), u64(1), u16(1), 0, BIG),
    "insert_entries full table": lambda: CN.insert_entries(u32(16), 4, 4, 0, 0, i64(1),
                                                           u64(1), u64(1), u16(1), 0, 1),
    "insert_entries base overflows": lambda: CN.insert_entries(u32(16), 4, 1, 0, 2 ** 63 - 1,
                                                               i64(1), u64(1), u64(1), u16(1),
                                                               0, 1),
    "lookup_many cap past table": lambda: CN.lookup_many(u32(16), BIG, 0, u64(1), u64(1),
                                                         i64(1)),
    "lookup_many out short": lambda: CN.lookup_many(u32(16), 4, 0, u64(3), u64(3), i64(1)),
    "decide cap past table": lambda: CN.decide(u32(16), BIG, 0, 0, 0, 0, i64(1), u64(1),
                                               u64(1), u16(1), u32(1), u8(1), u32(1)),
    "decide now beyond u32": lambda: CN.decide(u32(16), 4, 0, 0, 2 ** 40, 0, i64(1), u64(1),
                                               u64(1), u16(1), u32(1), u8(1), u32(1)),
    "decide outputs short": lambda: CN.decide(u32(16), 4, 0, 0, 0, 0, i64(3), u64(3), u64(3),
                                              u16(3), u32(3), u8(1), u32(1)),
    # connectors/apps/kv/_native.c
    "kv_upsert_latest table not 2^k": lambda: KN.kv_upsert_latest(
        np.zeros((3, 5), np.uint64), i64(1), i64(1), u64(1), u64(1), u16(1), 1, 0),
    "kv_upsert_latest end huge": lambda: KN.kv_upsert_latest(
        np.zeros((4, 5), np.uint64), i64(1), i64(1), u64(1), u64(1), u16(1), HUGE, 0),
    "kv_merge full table": lambda: KN.kv_merge(_full_table(2), _used_table(4)),
    "kv_rehash into full table": lambda: KN.kv_rehash(_used_table(4), _full_table(2)),
    "kv_gather range past src": lambda: KN.kv_gather(u8(8), np.array([4], np.int64),
                                                     np.array([BIG], np.int64), -1, u8(8), 0,
                                                     i64(2), 0),
    "kv_gather first past offs": lambda: KN.kv_gather(u8(8), np.array([0], np.int64),
                                                      np.array([1], np.int64), -1, u8(8), 0,
                                                      i64(2), BIG),
    "kv_gather pos past out": lambda: KN.kv_gather(u8(8), np.array([0], np.int64),
                                                   np.array([1], np.int64), -1, u8(8), BIG,
                                                   i64(2), 0),
    "kv_sort_rows width overflows": lambda: KN.kv_sort_rows(u8(8), np.array([0, 1, 2], np.int64),
                                                            BIG, u8(16)),
    "kv_sort_rows key past keys": lambda: KN.kv_sort_rows(u8(8), np.array([0, BIG], np.int64),
                                                          16, u8(16)),
}


def _used_table(cap: int) -> np.ndarray:
    t = np.zeros((cap, 5), np.uint64)
    t[:, 0] = np.arange(1, cap + 1)
    t[:, 4] = np.uint64(1 << 63)
    return t


def _full_table(cap: int) -> np.ndarray:
    t = _used_table(cap)
    t[:, 0] += np.uint64(1000)  # other digests: nothing of ``_used_table`` is in it
    return t


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_arguments_raise_not_crash(name):
    with pytest.raises((ValueError, TypeError)) as ei:
        CASES[name]()
    assert str(ei.value)  # a message, naming the function or the argument


def test_good_arguments_still_work():
    """The checks reject only what is wrong: edge cases that are right still pass."""
    words = np.arange(12, dtype=np.int64)
    assert RN.lower_bound_strided(words, 6, 2, 6) == 1
    assert RN.lower_bound_strided(words, 6, 2, HUGE) == 2  # past every offset
    assert RN.lower_bound_strided(words, 6, 0, 3) == 0
    assert RN.count_records(u8(10), 10, 10, True)[0] == 0
    assert RN.gather_ranges(np.arange(8, dtype=np.uint8), np.array([6], np.int64),
                            np.array([2], np.int64), u8(2)) == 2
    assert RN.crc32c(b"123456789", 0) == 0xE3069283  # the CRC32C check value
    assert RN.crc32c(b"56789", RN.crc32c(b"1234", 0)) == 0xE3069283
