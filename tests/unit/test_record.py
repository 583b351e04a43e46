"""Record codec (docs/formats/record.md): round trips, scan, bounds, topic rule, digests, CRC.

The codec is the one place where bytes from disk or the network are parsed, so besides round
trips these tests feed it crafted and mutated bytes: a decoder must answer CorruptRecordError or a
SCAN_TORN / SCAN_CORRUPT status, never an IndexError, a struct.error, or a read past the buffer.
"""

from __future__ import annotations

import random
import string
import struct

import google_crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.reput import intrinsics as _intrinsics
from kcompact.reput import _kernels as K
from kcompact.reput import bcq as B
from kcompact.reput.errors import CorruptRecordError, InvalidTopicError, ReputError
from kcompact.reput.record import (ATTR_NULL_KEY, ATTR_NULL_VALUE, HEADER, HEADER_SIZE, MAX_RECORD_SIZE,
                          Record, RecordBatch, BytesColumn, decode_all, decode_headers, decode_one,
                          Scratch, encode, encode_batch, encode_headers, encode_scanned, key_digest, scan,
                          validate_topic)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KAFKA_TOPIC_CHARS = string.ascii_letters + string.digits + "._-"
SECRET = bytes(range(16))


# -- reference implementations ----------------------------------------------------------------

_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def siphash24_128_ref(key: bytes, msg: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output, straight from the paper / veorq/SipHash siphash.c."""
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D ^ 0xEE,
         k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rnd():
        v[0] = (v[0] + v[1]) & _M64; v[1] = _rotl(v[1], 13); v[1] ^= v[0]; v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & _M64; v[3] = _rotl(v[3], 16); v[3] ^= v[2]
        v[0] = (v[0] + v[3]) & _M64; v[3] = _rotl(v[3], 21); v[3] ^= v[0]
        v[2] = (v[2] + v[1]) & _M64; v[1] = _rotl(v[1], 17); v[1] ^= v[2]; v[2] = _rotl(v[2], 32)

    n = len(msg)
    for i in range(0, n - n % 8, 8):
        m = int.from_bytes(msg[i:i + 8], "little")
        v[3] ^= m
        rnd(); rnd()
        v[0] ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(msg[n - n % 8:], "little")
    v[3] ^= b
    rnd(); rnd()
    v[0] ^= b
    v[2] ^= 0xEE
    for _ in range(4):
        rnd()
    lo = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    for _ in range(4):
        rnd()
    hi = v[0] ^ v[1] ^ v[2] ^ v[3]
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


#: vectors_sip128 of github.com/veorq/SipHash vectors.h: key 00..0f, message 00..(len-1).
SIP128_VECTORS = {
    0: "a3817f04ba25a8e66df67214c7550293",
    1: "da87c1d86b99af44347659119b22fc45",
    7: "a1f1ebbed8dbc153c0b84aa61ff08239",
    8: "3b62a9ba6258f5610f83e264f31497b4",
    9: "264499060ad9baabc47f8b02bb6d71ed",
    15: "5493e99933b0a8117e08ec0f97cfc3d9",
    16: "6ee2a4ca67b054bbfd3315bf85230577",
    63: "5150d1772f50834a503e069a973fbd7c",
}


def _valid_topic_ref(t) -> bool:
    return (isinstance(t, str) and 1 <= len(t) <= 249 and t not in (".", "..")
            and all(c in KAFKA_TOPIC_CHARS for c in t))


# -- strategies -------------------------------------------------------------------------------

topics = st.text(alphabet=KAFKA_TOPIC_CHARS, min_size=1, max_size=249).filter(
    lambda t: t not in (".", ".."))
maybe_bytes = st.one_of(st.none(), st.just(b""), st.binary(max_size=64))
header_lists = st.lists(st.tuples(st.text(max_size=12), maybe_bytes), max_size=4)
records = st.builds(
    Record,
    topic=topics,
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**63 - 1),
    timestamp=st.integers(-(2**63), 2**63 - 1),
    key=maybe_bytes,
    value=maybe_bytes,
    headers=header_lists.map(lambda hs: tuple(tuple(h) for h in hs)),
)


def _arr(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=np.uint8)


def _craft(*, size=None, magic=1, attrs=0, topic=b"t", reserved=0, partition=0, offset=0,
           timestamp=0, key=b"k", value=b"v", headers=b"", key_len=None, value_len=None,
           headers_len=None, crc=None) -> bytes:
    """A record built by hand, with any field overridable (the CRC is right unless given)."""
    kl = len(key) if key_len is None else key_len
    vl = len(value) if value_len is None else value_len
    hl = len(headers) if headers_len is None else headers_len
    body = topic + key + value + headers
    sz = HEADER_SIZE + len(body) if size is None else size
    head = HEADER.pack(sz, 0, magic, attrs, len(topic), reserved, partition, offset, timestamp,
                       kl, vl, hl)
    raw = bytearray(head + body)
    c = google_crc32c.value(bytes(raw[8:])) if crc is None else crc
    struct.pack_into("<I", raw, 4, c)
    return bytes(raw)


# -- round trips ------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(records, min_size=1, max_size=8))
def test_encode_decode_round_trip(recs):
    buf = encode(recs)
    assert decode_all(buf) == recs
    s = scan(_arr(buf), secret=SECRET)
    assert s.status == K.SCAN_OK and s.stop == len(buf) and len(s) == len(recs)
    pos = 0
    for i, r in enumerate(recs):
        assert decode_one(buf, pos) == r
        assert int(s.positions[i]) == pos
        assert int(s.offsets[i]) == r.offset
        assert int(s.partitions[i]) == r.partition
        assert int(s.timestamps[i]) == r.timestamp
        attrs = ((ATTR_NULL_KEY if r.key is None else 0)
                 | (ATTR_NULL_VALUE if r.value is None else 0))
        assert int(s.attrs[i]) == attrs
        want = (0, 0) if r.key is None else key_digest(r.key, SECRET)
        assert (int(s.digest_lo[i]), int(s.digest_hi[i])) == want
        pos += int(s.sizes[i])
    assert pos == len(buf)


@SETTINGS
@given(topics, st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2**40),
                                  st.integers(-(2**63), 2**63 - 1), maybe_bytes, maybe_bytes,
                                  header_lists), max_size=12))
def test_batch_round_trip(topic, rows):
    batch = RecordBatch.from_records(topic, rows)
    want = [Record(topic, p, o, t, k, v, tuple(tuple(x) for x in h)) for p, o, t, k, v, h in rows]
    assert list(batch.records()) == want
    buf, positions = encode_batch(batch)
    assert buf.shape[0] == int(batch.encoded_sizes().sum())
    assert [decode_one(buf, int(p)) for p in positions] == want
    assert encode(want) == buf.tobytes()  # one record at a time gives the same bytes



@SETTINGS
@given(topics, st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**40),
                                  st.integers(-(2**63), 2**63 - 1), maybe_bytes, maybe_bytes,
                                  header_lists), max_size=12), st.binary(min_size=16, max_size=16))
def test_encode_scanned_is_encode_then_scan(topic, rows, secret):
    """The writer's one-pass encode (Store.append) gives the bytes encode_batch writes and the
    columns scan reads back from them, every one of them."""
    batch = RecordBatch.from_records(topic, rows)
    want_buf, want_pos = encode_batch(batch)
    want = scan(want_buf, secret=secret, verify_crc=True)
    assert want.status == K.SCAN_OK
    buf, got = encode_scanned(batch, secret=secret, scratch=Scratch())
    assert buf.tobytes() == want_buf.tobytes()
    assert (got.status, got.stop, len(got)) == (want.status, want.stop, len(want))
    for col in ("positions", "sizes", "partitions", "offsets", "timestamps", "attrs",
                "topic_hash", "digest_lo", "digest_hi", "crcs"):
        g, w = getattr(got, col), getattr(want, col)
        assert g.dtype == w.dtype, col
        assert g.tolist() == w.tolist(), col
    assert got.positions.tolist() == want_pos.tolist()

def test_null_and_empty_are_different():
    recs = [Record("t", 0, 0, 1, None, b"v"),       # keyless
            Record("t", 0, 1, 1, b"", b"v"),        # empty key: a key
            Record("t", 0, 2, 1, b"k", None),       # tombstone
            Record("t", 0, 3, 1, b"k", b""),        # empty value: a value, not a tombstone
            Record("t", 0, 4, 1, None, None)]
    buf = encode(recs)
    back = decode_all(buf)
    assert back == recs
    assert [r.is_tombstone for r in back] == [False, False, True, False, True]
    s = scan(_arr(buf), secret=SECRET)
    assert list(s.attrs) == [ATTR_NULL_KEY, 0, ATTR_NULL_VALUE, 0, ATTR_NULL_KEY | ATTR_NULL_VALUE]
    # an empty key is hashed (it is a key); only a null key has the all-zero digest
    assert (int(s.digest_lo[1]), int(s.digest_hi[1])) == key_digest(b"", SECRET) != (0, 0)
    assert (int(s.digest_lo[0]), int(s.digest_hi[0])) == (0, 0)
    e = B.entries_from_scan(s, 0, len(s), 0)
    assert list(e["flags"]) == [B.FLAG_KEYLESS, 0, B.FLAG_TOMBSTONE, 0,
                                B.FLAG_KEYLESS | B.FLAG_TOMBSTONE]
    assert list(e["position"]) == list(s.positions)
    assert list(e["size"]) == list(s.sizes)
    assert list(e["clean_time"]) == [0] * 5


def test_headers_round_trip_with_null_and_empty_values():
    hs = (("a", None), ("a", b""), ("ü-名前", b"\x00\xff"), ("", b"x"), ("n", None))
    raw = encode_headers(hs)
    assert decode_headers(raw) == hs
    r = Record("t", 1, 2, 3, b"k", b"v", hs)
    assert decode_one(encode([r])) == r
    # no headers and an empty header list encode to nothing
    assert encode_headers(()) == b"" and decode_headers(b"") == ()
    # str values are UTF-8 encoded
    assert decode_headers(encode_headers([("s", "é")])) == (("s", "é".encode()),)
    with pytest.raises(ReputError):
        encode_headers([("x" * 65536, b"")])


def test_worked_example_of_the_spec():
    """docs/formats/record.md and bcq.md: the bytes written there are the bytes we write."""
    r = Record("orders", 3, 42, 1700000000000, b"k1", b"hi", (("src", b"x"),))
    want = bytes.fromhex(
        "44000000 47882d48 01 00 06 00 03000000 2a00000000000000 0068e5cf8b010000"
        "02000000 02000000 0e000000 6f7264657273 6b31 6869"
        "01000000 0300 737263 01000000 78".replace(" ", ""))
    assert encode([r]) == want
    assert google_crc32c.value(want[8:]) == 0x482D8847
    s = scan(_arr(want), secret=bytes(range(16)))
    e = B.entries_from_scan(s, 0, 1, 0)
    assert e.tobytes() == bytes.fromhex(
        "2a00000000000000 0068e5cf8b010000 8e778268d3a63daa d4f766340c8bd4ac"
        "00000000 44000000 0000 0000 00000000".replace(" ", ""))


def test_from_columns_matches_from_records():
    n = 6
    keys = np.arange(n * 4, dtype=np.uint8)
    b1 = RecordBatch.from_columns("t", 2, np.arange(10, 10 + n), 99,
                                  keys=BytesColumn.fixed(keys, 4), values=BytesColumn.nulls(n))
    b2 = RecordBatch.from_records("t", [(2, 10 + i, 99, keys[4 * i:4 * i + 4].tobytes(), None)
                                        for i in range(n)])
    assert encode_batch(b1)[0].tobytes() == encode_batch(b2)[0].tobytes()
    b3 = RecordBatch.from_columns("t", 0, np.arange(n), 1, keys=BytesColumn.nulls(n),
                                  values=BytesColumn.empties(n))
    assert [(r.key, r.value) for r in b3.records()] == [(None, b"")] * n
    assert [(r.key, r.value) for r in decode_all(encode_batch(b3)[0])] == [(None, b"")] * n


def test_batch_rejects_bad_columns():
    with pytest.raises(ReputError):
        RecordBatch.from_records("t", [(-1, 0, 0, b"k", b"v")])
    with pytest.raises(ReputError):
        RecordBatch.from_records("t", [(0, -1, 0, b"k", b"v")])
    with pytest.raises(ReputError):
        RecordBatch.from_columns("t", 0, np.arange(3), 0, keys=BytesColumn.nulls(2),
                                 values=BytesColumn.nulls(3))
    # a record over the maximum is refused before any byte is allocated for it
    big = BytesColumn(np.zeros(0, np.uint8), np.array([0, MAX_RECORD_SIZE], np.int64),
                     np.zeros(1, np.bool_))
    with pytest.raises(ReputError, match="maximum"):
        encode_batch(RecordBatch.from_columns("t", 0, np.arange(1), 0, keys=BytesColumn.nulls(1),
                                              values=big))


# -- scan over many records -------------------------------------------------------------------


def _sample_records(rng: random.Random, n: int, topic: str = "t") -> list[Record]:
    out = []
    for i in range(n):
        key = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 40))])
        value = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 200))])
        hs = tuple((f"h{j}", rng.choice([None, rng.randbytes(rng.randrange(0, 9))]))
                   for j in range(rng.randrange(0, 3)))
        out.append(Record(topic, rng.randrange(4), 1000 + i * 3, rng.randrange(2**41),
                          key, value, hs))
    return out


def test_scan_concatenated_batches_of_several_topics():
    rng = random.Random(7)
    batches = [RecordBatch.from_records(t, _sample_records(rng, rng.randrange(1, 20), t))
               for t in ("a", "bb", "a", "c.c-c_", "a")]
    parts = [encode_batch(b)[0].tobytes() for b in batches]
    buf = b"".join(parts)
    want = [r for b in batches for r in b.records()]
    s = scan(_arr(buf), secret=SECRET)
    assert s.status == K.SCAN_OK and len(s) == len(want) and s.stop == len(buf)
    assert [decode_one(buf, int(p)) for p in s.positions] == want
    # runs split at every topic or partition change, never inside one
    runs = K.same_topic_runs(_arr(buf), s.positions, s.topic_hash, s.partitions)
    assert runs[0] == 0 and runs[-1] == len(want)
    for a, b in zip(runs[:-1], runs[1:]):
        assert len({(want[i].topic, want[i].partition) for i in range(a, b)}) == 1
        if b < len(want):
            assert (want[b - 1].topic, want[b - 1].partition) != (want[b].topic, want[b].partition)
    # scanning from a record boundary in the middle sees the rest
    mid = int(s.positions[len(want) // 2])
    s2 = scan(_arr(buf), mid)
    assert s2.status == K.SCAN_OK and len(s2) == len(want) - len(want) // 2


def test_scan_every_truncation_point():
    rng = random.Random(3)
    recs = _sample_records(rng, 6)
    buf = encode(recs)
    bounds = [0]
    for r in recs:
        bounds.append(bounds[-1] + len(encode([r])))
    for cut in range(len(buf) + 1):
        whole = max(i for i, b in enumerate(bounds) if b <= cut)
        for arr in (_arr(buf[:cut]), _arr(buf)):
            s = scan(arr, 0, cut)
            assert len(s) == whole
            assert s.stop == bounds[whole]
            assert s.status == (K.SCAN_OK if cut == bounds[whole] else K.SCAN_TORN)
        if cut != bounds[whole]:
            with pytest.raises(CorruptRecordError):
                decode_all(buf[:cut])
            with pytest.raises(CorruptRecordError):
                decode_one(buf[:cut], bounds[whole])


def test_every_byte_flip_is_detected():
    rng = random.Random(5)
    recs = _sample_records(rng, 3)
    buf = bytearray(encode(recs))
    first = len(encode(recs[:1]))
    second_end = len(encode(recs[:2]))
    for i in range(first, second_end):          # every byte of the second record
        for mask in (0x01, 0x80, 0xFF):
            buf[i] ^= mask
            s = scan(_arr(bytes(buf)))
            assert (len(s), s.stop, s.status) == (1, first, K.SCAN_CORRUPT), (i, mask)
            with pytest.raises(CorruptRecordError):
                decode_one(bytes(buf), first)
            buf[i] ^= mask
    assert decode_all(bytes(buf)) == recs


# -- bounds: crafted lengths never read past the buffer ---------------------------------------


@pytest.mark.parametrize("fields,status", [
    (dict(key_len=2**31 - 1, size=HEADER_SIZE + 1 + (2**31 - 1) + 1), K.SCAN_CORRUPT),  # > max
    (dict(value=b"v" * 10, value_len=1000, size=HEADER_SIZE + 1 + 1 + 1000), K.SCAN_TORN),
    (dict(key_len=-5), K.SCAN_CORRUPT),
    (dict(value_len=-1, size=HEADER_SIZE + 1 + 1 - 1), K.SCAN_CORRUPT),
    (dict(headers_len=-2**31), K.SCAN_CORRUPT),
    (dict(size=HEADER_SIZE - 1), K.SCAN_CORRUPT),
    (dict(size=0), K.SCAN_CORRUPT),
    (dict(size=2**32 - 1), K.SCAN_CORRUPT),
    (dict(size=MAX_RECORD_SIZE), K.SCAN_CORRUPT),        # lengths do not add up
    (dict(size=HEADER_SIZE + 1 + 1000 + 1, key_len=1000), K.SCAN_TORN),
    (dict(topic=b""), K.SCAN_CORRUPT),
    (dict(magic=0), K.SCAN_CORRUPT),
    (dict(magic=2), K.SCAN_CORRUPT),
    (dict(attrs=4), K.SCAN_CORRUPT),
    (dict(reserved=1), K.SCAN_CORRUPT),
    (dict(attrs=ATTR_NULL_KEY), K.SCAN_CORRUPT),         # null key with a key length
    (dict(attrs=ATTR_NULL_VALUE), K.SCAN_CORRUPT),       # null value with a value length
    (dict(crc=0), K.SCAN_CORRUPT),
])
def test_crafted_header_is_refused(fields, status):
    raw = _craft(**fields)
    s = scan(_arr(raw))
    assert (len(s), s.stop, s.status) == (0, 0, status)
    with pytest.raises(CorruptRecordError):
        decode_one(raw)
    if "crc" not in fields:  # every other defect is found without the CRC
        with pytest.raises(CorruptRecordError):
            decode_one(raw, verify_crc=False)
    with pytest.raises(CorruptRecordError):
        decode_all(raw)
    # after a valid record, the crafted one stops the scan at its own position
    good = _craft()
    s = scan(_arr(good + raw))
    assert (len(s), s.stop, s.status) == (1, len(good), status)


@pytest.mark.parametrize("hdrs", [
    b"\x01",                                              # shorter than its count
    struct.pack("<I", 2**32 - 1),                          # count, nothing else
    struct.pack("<IH", 1, 500) + b"ab",                    # name runs past the end
    struct.pack("<IH", 1, 1) + b"a",                       # no value length
    struct.pack("<IH", 1, 1) + b"a" + struct.pack("<i", 100) + b"xy",    # value past the end
    struct.pack("<IH", 1, 1) + b"a" + struct.pack("<i", -2),             # bad negative length
    struct.pack("<IH", 1, 1) + b"a" + struct.pack("<i", 2**31 - 1),
    struct.pack("<IH", 1, 1) + b"a" + struct.pack("<i", -1) + b"junk",   # trailing bytes
    struct.pack("<IH", 2, 1) + b"a" + struct.pack("<i", -1),             # second header missing
])
def test_crafted_headers_section_is_refused(hdrs):
    raw = _craft(headers=hdrs)        # a valid CRC: only the headers' own lengths are wrong
    assert scan(_arr(raw)).status == K.SCAN_OK
    with pytest.raises(CorruptRecordError):
        decode_one(raw)
    with pytest.raises(CorruptRecordError):
        decode_headers(hdrs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 310))
def test_scan_and_decode_of_random_bytes_never_crash(data, start):
    arr = _arr(data)
    start = min(start, len(data))
    s = scan(arr, start)
    assert s.status in (K.SCAN_OK, K.SCAN_TORN, K.SCAN_CORRUPT)
    assert start <= s.stop <= len(data)
    assert all(start <= p and p + z <= len(data) for p, z in zip(s.positions, s.sizes))
    try:
        decode_one(data, start)
    except CorruptRecordError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_records_decode_or_raise_corrupt(data):
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    buf = bytearray(encode(_sample_records(rng, 3)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    raw = bytes(buf[:cut])
    s = scan(_arr(raw))
    assert all(p + z <= len(raw) for p, z in zip(s.positions, s.sizes))
    for verify in (True, False):
        try:
            decode_all(raw)
        except CorruptRecordError:
            pass
        try:
            decode_one(raw, 0, verify_crc=verify)
        except CorruptRecordError:
            pass


def test_scan_never_reads_past_end_argument():
    """``end`` inside the buffer is a hard limit: a record crossing it is torn, not read."""
    rec = encode([Record("t", 0, 0, 0, b"k" * 10, b"v" * 100)])
    buf = _arr(rec + rec)
    for end in range(len(rec) + 1, 2 * len(rec)):
        s = scan(buf, 0, end)
        assert (len(s), s.stop, s.status) == (1, len(rec), K.SCAN_TORN)


def test_issue_scan_end_past_the_array_reads_out_of_bounds():
    """An ``end`` (or ``start``) beyond the array must not let the kernel read past it: here the
    bytes after the 100-byte view hold the rest of a valid record, which must not be seen."""
    rec = encode([Record("t", 0, 0, 0, b"k", b"v" * 100)])
    buf = _arr(rec)[:100]
    s = scan(buf, 0, len(rec))
    assert (len(s), s.stop, s.status) == (0, 0, K.SCAN_TORN)
    s = scan(buf, 500, 1000)
    assert (len(s), s.status) == (0, K.SCAN_OK) and s.stop <= 100


# -- topic names ------------------------------------------------------------------------------


@pytest.mark.parametrize("topic", ["a", "A", "0", "...", "._-", "a.b_c-D9", "x" * 249,
                                   KAFKA_TOPIC_CHARS[:249]])
def test_valid_topics(topic):
    assert validate_topic(topic) == topic
    r = Record(topic, 0, 0, 0, b"k", b"v")
    assert decode_one(encode([r])).topic == topic


@pytest.mark.parametrize("topic", ["", ".", "..", "/", "a/b", "../x", "x" * 250, "a b", "é",
                                   "topic-ü", "名前", "a\n", "\na", "a\x00", "tab\t", "a:b",
                                   "a\u0130", "a*", "\u00b2", None, b"abc", 5])
def test_invalid_topics(topic):
    with pytest.raises(InvalidTopicError):
        validate_topic(topic)
    if isinstance(topic, str):
        with pytest.raises(InvalidTopicError):
            RecordBatch.from_records(topic, [(0, 0, 0, b"k", b"v")])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=260),
                 st.text(alphabet=KAFKA_TOPIC_CHARS + "\n/ é", max_size=255)))
def test_topic_rule_matches_kafka(topic):
    if _valid_topic_ref(topic):
        assert validate_topic(topic) == topic
    else:
        with pytest.raises(InvalidTopicError):
            validate_topic(topic)


# -- keyed digest -----------------------------------------------------------------------------


def test_siphash_reference_vectors():
    msg = bytes(range(64))
    for n, want in SIP128_VECTORS.items():
        assert siphash24_128_ref(SECRET, msg[:n]).hex() == want
        lo, hi = key_digest(msg[:n], SECRET)
        assert (lo.to_bytes(8, "little") + hi.to_bytes(8, "little")).hex() == want, n


@SETTINGS
@given(st.binary(max_size=100), st.binary(min_size=16, max_size=16))
def test_key_digest_matches_reference(key, secret):
    lo, hi = key_digest(key, secret)
    assert lo.to_bytes(8, "little") + hi.to_bytes(8, "little") == siphash24_128_ref(secret, key)


@SETTINGS
@given(st.binary(max_size=64), st.binary(min_size=16, max_size=16),
       st.binary(min_size=16, max_size=16))
def test_key_digest_is_keyed(key, s1, s2):
    if s1 != s2:
        assert key_digest(key, s1) != key_digest(key, s2)
    assert key_digest(key, s1) == key_digest(bytes(key), bytes(s1))
    # the digest in a scan is the one of the store's secret
    rec = encode([Record("t", 0, 0, 0, key, b"v")])
    s = scan(_arr(rec), secret=s1)
    assert (int(s.digest_lo[0]), int(s.digest_hi[0])) == key_digest(key, s1)


def test_key_digest_secret_must_be_16_bytes():
    for bad in (b"", bytes(15), bytes(17)):
        with pytest.raises(ReputError):
            key_digest(b"k", bad)


def test_different_keys_different_digests():
    keys = [b"", b"\x00", b"\x00\x00", b"a", b"b", b"ab", b"ba"]
    keys += [bytes([i]) * 8 for i in range(50)]
    assert len({key_digest(k, SECRET) for k in keys}) == len(keys)


# -- CRC32C -----------------------------------------------------------------------------------


def _crc_kernels():
    ks = [("table", K._crc32c_table)]
    if _intrinsics.HAVE_SSE42:
        ks.append(("sse42", K._crc32c_hw))
    return ks


@pytest.mark.parametrize("name,fn", _crc_kernels())
def test_crc32c_kernels_match_google_crc32c(name, fn):
    rng = np.random.default_rng(11)
    for n in range(0, 101):
        for _ in range(4):
            start = int(rng.integers(0, 17))
            buf = rng.integers(0, 256, start + n + int(rng.integers(0, 9)), dtype=np.uint8)
            got = int(fn(buf, start, start + n, K.CRC_TABLES))
            assert got == google_crc32c.value(buf[start:start + n].tobytes()), (name, n, start)
    for n in (1000, 4095, 4096, 65537):
        buf = rng.integers(0, 256, n + 3, dtype=np.uint8)
        assert int(fn(buf, 3, n + 3, K.CRC_TABLES)) == google_crc32c.value(buf[3:].tobytes())
    # the well-known check value of CRC-32C
    assert int(fn(_arr(b"123456789"), 0, 9, K.CRC_TABLES)) == 0xE3069283


def test_crc32c_dispatch_uses_the_cpu_instruction_when_present():
    assert K.crc32c is (K._crc32c_hw if _intrinsics.HAVE_SSE42 else K._crc32c_table)
