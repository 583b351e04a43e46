"""Store format 2's codec (reput/batch.py, reput/_kafka_native.h; the numba twins in
tests/unit/_oracle_kafka_kernels.py) and lean index (bcq2.py).

docs/formats/segment-v2.md and bcq-v2.md: the worked examples byte for byte, round trips of
format-1 records through Kafka batches against a plain-Python reference encoder of Kafka's record
grammar, every codec, and the checks a damaged batch or index chunk fails.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from kcompact.reput import batch as KB
from kcompact.reput import bcq as B
from kcompact.reput import bcq2 as B2
from kcompact.reput import codecs
from kcompact.reput import _kernels as K
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.record import Record, encode, decode_all, scan

SECRET = bytes(range(16))


def _v1(records):
    raw = np.frombuffer(encode(records), np.uint8)
    s = scan(raw, secret=SECRET)
    e = B.entries_from_scan(s, 0, len(s), 0).copy()
    return raw, e


def _encode(records, codec=KB.CODEC_NONE, level=3):
    raw, e = _v1(records)
    pos = e["position"].astype(np.int64)
    return KB.encode_batch(raw, pos, 0, len(records), e["offset"].astype(np.int64),
                           e["timestamp"].astype(np.int64), codec, level), raw, e


# -- a plain-Python reference of Kafka's record grammar ----------------------------------------


def _varint(v: int) -> bytes:
    z = (v << 1) ^ (v >> 63)
    z &= (1 << 64) - 1
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _ref_records(records, base_off, base_ts) -> bytes:
    out = bytearray()
    for r in records:
        body = bytearray(b"\x00")
        body += _varint(r.timestamp - base_ts) + _varint(r.offset - base_off)
        body += _varint(-1) if r.key is None else _varint(len(r.key)) + r.key
        body += _varint(-1) if r.value is None else _varint(len(r.value)) + r.value
        body += _varint(len(r.headers))
        for name, val in r.headers:
            nb = name.encode()
            body += _varint(len(nb)) + nb
            body += _varint(-1) if val is None else _varint(len(val)) + val
        out += _varint(len(body)) + body
    return bytes(out)


def _ref_batch(records) -> bytes:
    base_off, base_ts = records[0].offset, records[0].timestamp
    payload = _ref_records(records, base_off, base_ts)
    tail = struct.pack(">hiqqqhii", 0, records[-1].offset - base_off, base_ts,
                       max(r.timestamp for r in records), -1, -1, -1, len(records)) + payload
    crc = int(K.crc32c(np.frombuffer(tail, np.uint8), 0, len(tail), K.CRC_TABLES))
    return struct.pack(">qiibI", base_off, len(tail) + 9, -1, 2, crc) + tail


# -- the worked examples -------------------------------------------------------------------------


WORKED = bytes.fromhex(
    "000000000000002a" "0000003c" "ffffffff" "02" "6ba48e85" "0000" "00000000"
    "0000018bcfe56800" "0000018bcfe56800" "ffffffffffffffff" "ffff" "ffffffff" "00000001"
    "14" "00" "00" "00" "046b31" "047631" "00")


def test_worked_example_byte_for_byte():
    rec = Record("orders", 0, 42, 1700000000000, b"k1", b"v1")
    eb, _, _ = _encode([rec])
    assert eb.data == WORKED
    assert eb.data == _ref_batch([rec])
    assert len(eb.data) == 72


def test_worked_example_of_the_lean_index():
    rec = Record("orders", 0, 42, 1700000000000, b"k1", b"v1")
    eb, _, e = _encode([rec])
    b = B2.IndexBuilder()
    e = e.copy()
    e["position"], e["size"] = 0, len(eb.data)
    b.add_batch(0, len(eb.data), e)
    raw = b.finish(KB.CODEC_NONE)
    assert raw[:8] == B2.MAGIC and B2.is_lean(raw)
    assert int.from_bytes(raw[:8], "little", signed=True) < 0
    idx = B2.LeanIndex(lambda s, n: raw[s:s + n], "x.bcq", len(raw))
    assert idx.n == 1 and idx.log_size == 72 and int(idx.dir["chunk_pos"][0]) == 88
    got = idx.entries[0]
    assert int(got["offset"]) == 42 and int(got["position"]) == 0 and int(got["size"]) == 72
    assert int(got["digest_lo"]) == int(e[0]["digest_lo"])
    body = bytes(__import__("cramjam").zstd.decompress(raw[88:]))
    assert body[:16] == bytes.fromhex("01000000" "01000000" "01000000" "48000000")


# -- round trips ---------------------------------------------------------------------------------


_key = st.one_of(st.none(), st.binary(max_size=40))
_headers = st.lists(st.tuples(st.text(max_size=8), st.one_of(st.none(), st.binary(max_size=12))),
                    max_size=3).map(tuple)


@st.composite
def _records(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n))
    off = draw(st.integers(0, 1 << 40))
    ts0 = draw(st.integers(0, 1 << 42))
    out = []
    for i in range(n):
        off += gaps[i] if i else 0
        ts = ts0 + draw(st.integers(-10_000, 10_000))
        out.append(Record("topic-a", 3, off, ts, draw(_key),
                          draw(st.one_of(st.none(), st.binary(max_size=300))), draw(_headers)))
    return out


@settings(max_examples=150, deadline=None)
@given(_records(), st.sampled_from(sorted(KB.CODEC_NAMES)))
def test_round_trip_matches_reference_and_format_1(records, codec):
    eb, raw, e = _encode(records, codec)
    if eb.codec == KB.CODEC_NONE:
        assert eb.data == _ref_batch(records)
    else:  # the same records, compressed: decompress and compare to the reference payload
        h = KB.parse_head(np.frombuffer(eb.data, np.uint8), 0, "x", 0)
        payload = KB.decompress(h.codec, np.frombuffer(eb.data, np.uint8)[KB.HEADER_SIZE:], "x", 0)
        assert payload.tobytes() == _ref_records(records, records[0].offset,
                                                 records[0].timestamp)
    d = KB.decode_batches(np.frombuffer(eb.data, np.uint8), 0, b"topic-a", 3, "x")
    # decoded into format 1 byte for byte: the CRC each record was first written with
    assert d.data.tobytes() == raw.tobytes()
    assert d.offsets.tolist() == [r.offset for r in records]
    assert decode_all(d.data.tobytes()) == records


@pytest.mark.parametrize("codec", sorted(KB.CODEC_NAMES))
def test_every_codec_compresses_and_decodes(codec):
    recs = [Record("t", 0, i, 1000 + i, b"key-%d" % (i % 7), b'{"status": "shipped"}' * 4)
            for i in range(500)]
    eb, raw, _ = _encode(recs, codec)
    if codec != KB.CODEC_NONE:
        assert eb.codec == codec and len(eb.data) < raw.shape[0] / 3
    d = KB.decode_batches(np.frombuffer(eb.data, np.uint8), 0, b"t", 0, "x")
    assert d.data.tobytes() == raw.tobytes()


def test_snappy_uses_xerial_framing():
    recs = [Record("t", 0, i, 0, b"k", b"x" * 1000) for i in range(100)]
    eb, _, _ = _encode(recs, KB.CODEC_SNAPPY)
    assert eb.data[KB.HEADER_SIZE:KB.HEADER_SIZE + 16] == codecs.XERIAL_HEADER


def test_incompressible_batch_is_stored_uncompressed():
    rng = np.random.default_rng(1)
    recs = [Record("t", 0, i, 0, b"k%d" % i, rng.bytes(100)) for i in range(50)]
    plain, _, _ = _encode(recs, KB.CODEC_NONE)
    for codec in (KB.CODEC_ZSTD, KB.CODEC_SNAPPY, KB.CODEC_LZ4, KB.CODEC_GZIP):
        eb, _, _ = _encode(recs, codec)
        assert len(eb.data) <= len(plain.data)
        assert eb.codec == codec or eb.data == plain.data
    one = [Record("t", 0, 0, 0, b"k", rng.bytes(8))]
    eb, _, _ = _encode(one, KB.CODEC_GZIP)  # gzip's own header makes it larger: stored plain
    assert eb.codec == KB.CODEC_NONE


# -- damage --------------------------------------------------------------------------------------


def test_a_flipped_byte_fails_the_batch_crc_and_keeps_earlier_batches():
    a, _, _ = _encode([Record("t", 0, 1, 5, b"a", b"1")])
    b, _, _ = _encode([Record("t", 0, 2, 5, b"b", b"2")])
    buf = bytearray(a.data + b.data)
    buf[len(a.data) + 64] ^= 0x01
    with pytest.raises(CorruptRecordError) as ei:
        KB.decode_batches(np.frombuffer(bytes(buf), np.uint8), 100, b"t", 0, "p.log")
    assert "CRC" in str(ei.value) and ei.value.position == 100 + len(a.data)
    assert ei.value.decoded.offsets.tolist() == [1]


def test_bad_magic_and_short_batch_are_refused():
    a, _, _ = _encode([Record("t", 0, 1, 5, b"a", b"1")])
    bad = bytearray(a.data)
    bad[16] = 1
    with pytest.raises(CorruptRecordError, match="invalid batch header"):
        KB.decode_batches(np.frombuffer(bytes(bad), np.uint8), 0, b"t", 0, "p.log")
    with pytest.raises(CorruptRecordError, match="cut short|invalid"):
        KB.decode_batches(np.frombuffer(a.data[:-3], np.uint8), 0, b"t", 0, "p.log")


def _lean(n: int = 20_000, chunk_entries: int = 1000):
    """A lean index of n records (offsets 3i, batches of 333): (index, entries, the reads it
    made, its bytes, the .log's size)."""
    recs = [Record("t", 0, 3 * i, 10 * i, b"k%d" % i, None if i % 11 == 0 else b"v")
            for i in range(n)]
    _, e = _v1(recs)
    b = B2.IndexBuilder(chunk_entries=chunk_entries)
    pos = 0
    for lo in range(0, n, 333):
        hi = min(n, lo + 333)
        b.add_batch(pos, 100 + hi - lo, e[lo:hi])
        pos += 100 + hi - lo
    data = b.finish(KB.CODEC_ZSTD)
    reads = []

    def read(s, k):
        reads.append((s, k))
        return data[s:s + k]
    return B2.LeanIndex(read, "x.bcq", len(data)), e, reads, data, pos


def test_lean_index_chunks_and_lookups():
    idx, e, reads, data, pos = _lean()
    assert idx.n == 20_000 and idx.chunk_count > 10
    j = idx.lower_bound(3 * 12_345 - 1)
    assert j == 12_345
    assert len(reads) == 2  # header + directory, then one chunk
    allv = idx.entries
    assert allv["offset"].tolist() == e["offset"].tolist()
    assert (allv["digest_lo"] == e["digest_lo"]).all() and (allv["flags"] == e["flags"]).all()
    assert int(allv["size"].astype(np.int64).sum()) == pos
    assert idx.slice(999, 1002)["offset"].tolist() == [2997, 3000, 3003]
    # a damaged chunk fails its CRC
    bad = bytearray(data)
    bad[int(idx.dir["chunk_pos"][3]) + 5] ^= 0xFF
    idx2 = B2.LeanIndex(lambda s, n: bytes(bad[s:s + n]), "x.bcq", len(bad))
    with pytest.raises(CorruptRecordError, match="chunk 3"):
        idx2.chunk(3)


def test_tombstone_columns_are_the_decoded_chunks_flags_and_clean_times():
    recs = [Record("t", 0, 2 * i, 10 * i, None if i % 17 == 5 else b"k%d" % i,
                   None if i % 7 == 0 else b"v") for i in range(5_000)]
    _, e = _v1(recs)
    tomb = (e["flags"] & B.FLAG_TOMBSTONE) != 0
    e["clean_time"][tomb] = 1_700_000_000 + np.flatnonzero(tomb) % 5  # cleaned at varied times
    b = B2.IndexBuilder(chunk_entries=700)
    for lo in range(0, 5_000, 250):
        b.add_batch(lo * 10, 2_500, e[lo:lo + 250])
    data = b.finish(KB.CODEC_ZSTD)
    idx = B2.LeanIndex(lambda a, n: data[a:a + n], "x.bcq", len(data))
    assert idx.chunk_count > 3
    for i in range(idx.chunk_count):
        flags, clean = idx.tombstone_columns(i)
        full = idx.chunk(i)
        assert flags.tolist() == full["flags"].tolist()
        assert clean.tolist() == full["clean_time"].tolist()
    assert int(np.count_nonzero(np.concatenate(
        [idx.tombstone_columns(i)[1] for i in range(idx.chunk_count)]))) == int(tomb.sum())
    bad = bytearray(data)
    bad[int(idx.dir["chunk_pos"][2]) + 7] ^= 0x10
    idx2 = B2.LeanIndex(lambda a, n: bytes(bad[a:a + n]), "x.bcq", len(bad))
    with pytest.raises(CorruptRecordError, match="chunk 2"):
        idx2.tombstone_columns(2)


def test_lookups_decode_a_chunk_once_while_it_is_in_the_lookup_cache(monkeypatch):
    monkeypatch.setattr(B2, "_LOOKUPS", B2._LookupCache(64 << 20))
    idx, e, reads, _, _ = _lean()
    first = len(reads)
    # random reads by offset go back and forth between chunks 12 and 3
    a, z = (idx.dir[c][["first_offset", "last_offset"]].tolist() for c in (12, 3))
    for target in (a[0] + 5, z[0] + 1, a[1], z[1] - 2, a[0], z[0]):
        j = idx.lower_bound(target)
        assert j == int(np.searchsorted(e["offset"], target))
        assert idx.slice(j, j + 1)["offset"].tolist() == [int(e["offset"][j])]
    assert len(reads) == first + 2  # each chunk read and decoded once
    j = idx.chunk_first_entry(12) + 3
    got = idx.slice_within(j, j + 300, 200)
    assert got["offset"].tolist() == e["offset"][j:j + got.shape[0]].tolist()
    assert len(reads) == first + 2
    with pytest.raises(ValueError):  # shared: read-only
        got["clean_time"][0] = 1
    # another index object (the segment opened again) has chunks of its own
    idx2, _, reads2, _, _ = _lean()
    idx2.lower_bound(3 * 12_345)
    assert len(reads2) == first + 1  # its header and directory, and its own chunk 12


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3 * 6_000), min_size=1, max_size=60), st.integers(1, 6))
def test_lookups_under_a_small_cache_agree_with_a_search_of_every_entry(targets, chunks):
    """The lookup cache holds a few chunks (least recently used dropped): every lookup still
    gives what a search of every entry gives, and the cache never holds more than its budget."""
    per = 500
    one = per * B.BCQ_DTYPE.itemsize + per * 8  # a chunk's entries and offsets
    cache = B2._LookupCache(chunks * one)
    real = B2._LOOKUPS
    B2._LOOKUPS = cache
    try:
        idx, e, _, _, _ = _lean(6_000, per)
        offs = e["offset"].astype(np.int64)
        for t in targets:
            j = idx.lower_bound(t)
            assert j == int(np.searchsorted(offs, t))
            if j < idx.n:
                k = min(idx.n, j + 700)  # across a chunk boundary at times
                assert idx.slice(j, k)["offset"].tolist() == offs[j:k].tolist()
            assert cache._bytes <= cache.budget
            assert len(cache._chunks) <= chunks
    finally:
        B2._LOOKUPS = real


@functools.lru_cache(maxsize=1)
def _sliced() -> tuple[bytes, np.ndarray]:
    """A lean index's bytes, and its entries decoded whole by another index object (made once
    for the examples of the slice test)."""
    return _lean(6_000, 500)[3], _lean(6_000, 500)[0].entries


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5_999), st.integers(1, 7_000), st.integers(1, 40_000))
@example(0, 7_000, 433)  # (batches of 433 bytes: bounds that fall on a batch's start)
@example(400, 7_000, 5 * 433)
def test_slice_within_gives_the_entries_of_the_batches_that_start_within_the_bound(j, length,
                                                                                   max_bytes):
    """Whichever chunks a bounded slice spans (the first and last through the lookup cache, the
    ones between decoded into the result), it is what a filter of every entry gives."""
    data, ref = _sliced()
    idx = B2.LeanIndex(lambda s, n: data[s:s + n], "x.bcq", len(data))
    k = min(idx.n, j + length)
    got = idx.slice_within(j, k, max_bytes)
    pos = ref["position"].astype(np.int64)
    want = ref[j:k][pos[j:k] < pos[j] + max_bytes]
    assert got.tobytes() == want.tobytes()
    assert idx.slice_within(j, k, None).tobytes() == ref[j:k].tobytes()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_a_child_forked_while_the_lookup_cache_is_locked_looks_up():
    """Another thread holds the lookup cache's lock when the process forks: the child gets a
    lock of its own (and an empty cache), not one nobody will release."""
    import os
    import signal
    import threading
    idx, e, _, _, _ = _lean(3_000)
    idx.lower_bound(3 * 10)
    held, release = threading.Event(), threading.Event()

    def hold():
        with B2._LOOKUPS._lock:
            held.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            signal.alarm(20)  # a hang ends the child with SIGALRM
            ok = idx.lower_bound(3 * 2_500) == 2_500 and len(B2._LOOKUPS._chunks) == 1
            os._exit(0 if ok else 1)
    finally:
        release.set()
        t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


# -- the C kernels (reput/_kafka_native.h) against the numba ones -------------------------------


@settings(max_examples=60, deadline=None)
@given(_records(), st.sampled_from(sorted(KB.CODEC_NAMES)))
def test_c_and_numba_kernels_agree(records, codec):
    """Format-1 records as Kafka records: the C kernel (batch._to_kafka) writes the bytes its
    numba twin writes; a batch of them decodes back to the records on the C path. (Decoding
    itself is compared kernel by kernel below, on hostile payloads too.)"""
    import _oracle_kafka_kernels as KK
    raw, e = _v1(records)
    pos = e["position"].astype(np.int64)
    args = (raw, pos, 0, len(records), records[0].offset, records[0].timestamp)
    c = KB._to_kafka(*args)
    sizes = np.empty(1, np.int64)
    KK.v1_to_kafka_sizes(raw, pos, np.array([0, len(records)], np.int64),
                         np.array([records[0].offset], np.int64),
                         np.array([records[0].timestamp], np.int64), sizes)
    nb = np.empty(int(sizes[0]), np.uint8)
    assert KK.v1_to_kafka(*args, nb, 0) == nb.shape[0]
    assert c.tobytes() == nb.tobytes()
    eb = KB.encode_batch(raw, pos, 0, len(records), e["offset"].astype(np.int64),
                         e["timestamp"].astype(np.int64), codec, 3)
    d_c = KB.decode_batches(np.frombuffer(eb.data, np.uint8), 0, b"topic-a", 3, "x")
    assert d_c.data.tobytes() == raw.tobytes()
    assert d_c.offsets.tolist() == e["offset"].tolist()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 40))
def test_c_kernels_refuse_hostile_payloads_like_numba(payload, count):
    import _oracle_kafka_kernels as KK
    from kcompact.reput.jit import native
    n = native()
    if n is None:
        pytest.skip("the C module is not built")
    buf = np.frombuffer(payload, np.uint8)
    out = [np.zeros(count, np.int64) for _ in range(6)]
    c = n.kafka_sizes(buf, 0, buf.shape[0], count, 5, *out[:3])
    nb = KK.kafka_sizes(buf, 0, buf.shape[0], count, 5, *out[3:])
    assert tuple(c) == tuple(nb)
    if c[0] == KK.DEC_OK:
        assert [a.tolist() for a in out[:3]] == [a.tolist() for a in out[3:]]


# -- a one-record read (batch.decode_run, the kafka_find kernel) --------------------------------


@settings(max_examples=120, deadline=None)
@given(_records(), st.sampled_from(sorted(KB.CODEC_NAMES)), st.data())
def test_decode_run_gives_what_decode_batches_gives(records, codec, data):
    """The records of one batch in [lo, hi] by ``decode_run`` (one converted, the batch walked
    whole) equal ``decode_batches``' of the same range (kafka_find against its numba twin:
    below)."""
    eb, raw, e = _encode(records, codec)
    buf = np.frombuffer(eb.data, np.uint8)
    lo = data.draw(st.integers(records[0].offset - 2, records[-1].offset + 2))
    hi = data.draw(st.integers(lo, lo + 3 * (1 << 20)))
    want = KB.decode_batches(buf, 0, b"topic-a", 3, "x", lo=lo, hi=hi)
    b = KB.open_batch(buf, 0, 0, "x")
    got = [KB.decode_run(b, b"topic-a", 3, lo, hi, "x")]
    for d in got:
        if want.offsets.shape[0] > 1:
            assert d is None  # several records: decode_walked's
            continue
        assert d.data.tobytes() == want.data.tobytes()
        assert d.offsets.tolist() == want.offsets.tolist()
        assert d.timestamps.tolist() == want.timestamps.tolist()
        assert d.sizes.tolist() == want.sizes.tolist()
        assert d.positions.tolist() == want.positions.tolist()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 40), st.integers(-2, 1 << 20))
def test_kafka_find_refuses_hostile_payloads_like_numba(payload, count, lo):
    import _oracle_kafka_kernels as KK
    from kcompact.reput.jit import native
    n = native()
    if n is None:
        pytest.skip("the C module is not built")
    buf = np.frombuffer(payload, np.uint8)
    c = n.kafka_find(buf, 0, buf.shape[0], count, 5, lo, lo + 10)
    nb = KK.kafka_find(buf, 0, buf.shape[0], count, 5, lo, lo + 10)
    assert tuple(c) == tuple(nb)
    with pytest.raises(ValueError, match="kafka_find"):
        n.kafka_find(buf, 0, buf.shape[0] + 1, count, 5, lo, lo)


def _with_deltas(records, deltas):
    """An uncompressed batch of ``records`` whose records carry ``deltas`` as offset deltas
    (the header's last offset delta kept as the records' real one), its CRC made valid."""
    eb, _, _ = _encode(records)
    buf = bytearray(eb.data)
    p = KB.HEADER_SIZE
    for d in deltas:
        n, q = 0, p
        shift = 0
        while True:  # the record's length varint
            byte = buf[q]
            n |= (byte & 0x7F) << shift
            shift += 7
            q += 1
            if byte < 0x80:
                break
        body = q
        q += 1  # attributes
        while buf[q] >= 0x80:  # timestamp delta
            q += 1
        q += 1
        old = bytearray()
        while buf[q] >= 0x80:
            old.append(buf[q])
            q += 1
        old.append(buf[q])
        new = _varint(d)
        assert len(new) == len(old)
        buf[q + 1 - len(old):q + 1] = new
        p = body + ((n >> 1) ^ -(n & 1))
    struct.pack_into(">I", buf, 17, KB.crc32c(np.frombuffer(bytes(buf), np.uint8), KB.CRC_START,
                                              len(buf)))
    return np.frombuffer(bytes(buf), np.uint8)


@pytest.mark.parametrize("deltas", [[1, 2, 3], [0, 2, 2], [0, 3, 2]])
def test_decode_run_refuses_offsets_out_of_order(deltas):
    """A batch whose CRC holds but whose records' offset deltas do not start at 0 and rise is
    refused by a one-record read as by a whole walk, whichever record is asked for."""
    records = [Record("topic-a", 3, 100 + d, 5, b"k%d" % d, b"v", []) for d in (0, 1, 2)]
    buf = _with_deltas(records, deltas)
    b = KB.open_batch(buf, 0, 0, "x")
    with pytest.raises(CorruptRecordError, match="offsets of the batch at byte 0"):
        KB.walk_batch(buf, 0, 0, 7, "x")
    for o in (100, 101, 102):
        with pytest.raises(CorruptRecordError, match="offsets of the batch at byte 0"):
            KB.decode_run(b, b"topic-a", 3, o, o, "x")


@settings(max_examples=120, deadline=None)
@given(_records(), st.sampled_from(sorted(KB.CODEC_NAMES)), st.data())
def test_kafka_read_one_gives_the_general_paths_record_or_refuses(records, codec, data):
    """The C one-record read (segment_v2.KafkaSegment._one_batch's fast path) gives the bytes the general path
    (decode_run, then the reader's check against the entry) gives, and refuses an entry whose
    timestamp, flags or key digest the record does not have, or whose offset is not in the
    batch: then the general path names what fails."""
    from kcompact.reput.jit import native
    from kcompact.reput.record import digest_key_words as _secret_words
    n = native()
    if n is None:
        pytest.skip("the C module is not built")
    eb, raw, e = _encode(records, codec)
    b = KB.open_batch(np.frombuffer(eb.data, np.uint8), 0, 0, "x")
    h = b.head
    k0, k1 = _secret_words(SECRET)
    i = data.draw(st.integers(0, len(records) - 1))
    entry = e[i:i + 1].copy()
    args = (b.payload, h.count, b"topic-a", 3, h.base_offset, h.base_ts)
    st_, last, rec = n.kafka_read_one(*args, entry.view(np.uint8).reshape(-1), k0, k1)
    want = KB.decode_run(b, b"topic-a", 3, records[i].offset, records[i].offset, "x")
    assert st_ == 0 and last == h.last_offset - h.base_offset
    assert rec == want.data.tobytes() == raw[int(e[i]["position"]):][:len(rec)].tobytes()
    field = data.draw(st.sampled_from(["timestamp", "flags", "digest_lo", "digest_hi", "offset"]))
    bad = entry.copy()
    bad[field] = bad[field] + (1 if field != "offset" else
                               (records[-1].offset - records[i].offset + 1))
    st_, _, rec = n.kafka_read_one(*args, bad.view(np.uint8).reshape(-1), k0, k1)
    assert rec is None and st_ == (4 if field == "offset" else 5)
    with pytest.raises(ValueError, match="kafka_read_one"):
        n.kafka_read_one(*args, bad.view(np.uint8)[:-1], k0, k1)


# -- many batches at once (batch._decode_many on kafka_heads / scan_many / convert_many) --------


def _span(records, codecs):
    """The batches of ``records`` cut into len(codecs) runs, each encoded with its codec, back to
    back (a .log span)."""
    raw, e = _v1(records)
    pos = e["position"].astype(np.int64)
    offs, ts = e["offset"].astype(np.int64), e["timestamp"].astype(np.int64)
    cuts = np.linspace(0, len(records), len(codecs) + 1).astype(int)
    out = b""
    for (a, z), c in zip(zip(cuts[:-1], cuts[1:]), codecs):
        if z > a:
            out += KB.encode_batch(raw, pos, int(a), int(z), offs, ts, c, 3).data
    return np.frombuffer(out, np.uint8)


@settings(max_examples=120, deadline=None)
@given(_records(), st.lists(st.sampled_from(sorted(KB.CODEC_NAMES)), min_size=1, max_size=5),
       st.data())
def test_many_batches_at_once_decode_as_batch_by_batch(records, codecs, data):
    """decode_batches' C path (all the span's batches in a few calls) gives what the batch-by-batch
    path gives, for any [lo, hi], byte budget, start offset and choice of batches."""
    from kcompact.reput.jit import native
    if native() is None:
        pytest.skip("the C module is not built")
    buf = _span(records, codecs)
    start = data.draw(st.integers(0, 1 << 30))
    lo = data.draw(st.integers(records[0].offset - 1, records[-1].offset + 1))
    hi = data.draw(st.integers(lo, records[-1].offset + 2))
    budget = data.draw(st.one_of(st.none(), st.integers(1, 20_000)))
    heads = list(KB.decode_batches(buf, start, b"topic-a", 3, "x").heads)
    want = data.draw(st.one_of(st.none(), st.sets(st.sampled_from([h.position for h in heads]))))
    kw = dict(want=want, lo=lo, hi=hi, max_bytes=budget)
    fast = KB._decode_many(buf, start, b"topic-a", 3, "x", want, lo, hi, None, budget, None)
    saved = KB._decode_many
    KB._decode_many = lambda *a: None
    try:
        slow = KB.decode_batches(buf, start, b"topic-a", 3, "x", **kw)
    finally:
        KB._decode_many = saved
    if want is not None and not want:
        assert fast is None or len(fast.heads) == 0
        return
    assert fast is not None
    if budget is not None:  # the C path may stop a batch earlier (it estimates before decoding)
        n = len(fast.heads)
        assert 1 <= n <= len(slow.heads)
        assert fast.heads.table.tolist() == slow.heads.table[:n].tolist()
        keep = slow.batch_of < n
        slow = KB.Decoded(*(a[keep] if isinstance(a, np.ndarray) and a.shape == keep.shape
                            else a for a in slow))
        slow = slow._replace(data=slow.data[:int(slow.sizes.sum())])
    else:
        assert fast.heads.table.tolist() == slow.heads.table.tolist()
    assert fast.data.tobytes() == slow.data.tobytes()
    for f in ("positions", "sizes", "offsets", "timestamps", "batch_of"):
        assert getattr(fast, f).tolist() == getattr(slow, f).tolist(), f


def test_many_batches_refuse_what_one_batch_refuses():
    """A damaged byte anywhere in a span: the C path gives up (None) and decode_batches raises
    naming the batch, with the batches before it decoded."""
    from kcompact.reput.jit import native
    if native() is None:
        pytest.skip("the C module is not built")
    records = [Record("topic-a", 3, 10 + 2 * i, 7 + i, b"k%d" % i, b"v" * (i % 50), [])
               for i in range(200)]
    buf = _span(records, [KB.CODEC_ZSTD, KB.CODEC_NONE, KB.CODEC_LZ4, KB.CODEC_ZSTD])
    heads = list(KB.decode_batches(buf, 0, b"topic-a", 3, "x").heads)
    third = heads[2]
    # (the base offset and leader epoch lie outside the CRC, as in Kafka: the lean index
    # catches a changed base offset, tests/unit/test_no_silent_loss.py)
    for at in (third.position + 18, third.position + 30, third.position + KB.HEADER_SIZE + 3):
        bad = buf.copy()
        bad[at] ^= 0x40
        assert KB._decode_many(bad, 0, b"topic-a", 3, "x", None, 0, 1 << 62, None, None,
                               None) is None
        with pytest.raises(CorruptRecordError) as ei:
            KB.decode_batches(bad, 0, b"topic-a", 3, "x")
        assert ei.value.position == third.position
        assert [h.position for h in ei.value.decoded.heads] == [h.position for h in heads[:2]]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 4))
def test_kafka_heads_takes_any_bytes(payload, rows):
    """kafka_heads on arbitrary bytes: rows only for whole, CRC-valid batches, never past the
    table, and the same answer as parse_head batch by batch."""
    from kcompact.reput.jit import native
    n = native()
    if n is None:
        pytest.skip("the C module is not built")
    buf = np.frombuffer(payload, np.uint8)
    table = np.full(rows * 8 + 3, -7, np.int64)
    got, status, stop = n.kafka_heads(buf, 0, 100, table[:rows * 8])
    assert table[rows * 8:].tolist() == [-7, -7, -7]
    assert 0 <= got <= rows and 0 <= stop <= len(payload)
    p = 0
    for i in range(got):
        h = KB.parse_head(buf, p, "x", 100 + p)
        assert table[i * 8:i * 8 + 8].tolist() == list(h)
        p += h.size
    assert stop == p
    if status == 0:
        assert p == len(payload)
    elif status in (2, 3):
        with pytest.raises(CorruptRecordError):
            KB.parse_head(buf, p, "x", 100 + p)


def _numpy_lean_decode(idx, i: int, raw: bytes, pos: int) -> np.ndarray:
    """The numpy decoding of a lean index chunk that bcq2.LeanIndex had besides the C kernel
    (lean_decode) until issue 39: the reference the C one is compared with."""
    d = idx.dir[i]
    bad = idx._bad(i, pos)
    body = idx._body(i, raw, pos)
    n, b = idx._layout(i, body, pos)
    p = 8
    counts = body[p:p + 4 * b].view(np.uint32).astype(np.int64)
    p += 4 * b
    sizes = body[p:p + 4 * b].view(np.uint32).astype(np.int64)
    p += 4 * b
    od = body[p:p + 4 * n].view(np.uint32)
    p += 4 * n
    td = body[p:p + 8 * n].view(np.int64)
    p += 8 * n
    flags = body[p:p + n]
    p += n
    clean = body[p:p + 4 * n].view(np.uint32)
    p += 4 * n
    dlo = body[p:p + 8 * n].view(np.uint64)
    p += 8 * n
    dhi = body[p:p + 8 * n].view(np.uint64)
    if int(counts.sum()) != n or int(counts.min()) < 1:
        raise bad
    first_pos = int(d["first_position"])
    nxt_pos = (int(idx.dir["first_position"][i + 1]) if i + 1 < idx.chunk_count
               else idx.log_size)
    if first_pos + int(sizes.sum()) != nxt_pos:
        raise bad
    e = np.zeros(n, B.BCQ_DTYPE)
    off = np.cumsum(od.astype(np.int64)) + int(d["first_offset"])
    if int(off[-1]) != int(d["last_offset"]) or (n > 1 and int(od[1:].min()) == 0):
        raise bad
    e["offset"] = off
    e["timestamp"] = np.cumsum(td)
    e["digest_lo"] = dlo
    e["digest_hi"] = dhi
    bpos = np.empty(b, np.int64)
    bpos[0] = first_pos
    np.cumsum(sizes[:-1], out=bpos[1:])
    bpos[1:] += first_pos
    e["position"] = np.repeat(bpos, counts)
    starts = np.zeros(b, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    sz = np.zeros(n, np.uint32)
    sz[starts] = sizes
    e["size"] = sz
    e["flags"] = flags
    e["clean_time"] = clean
    return e



@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.data())
def test_lean_chunks_decode_alike_in_c_and_numpy(batches, per, data):
    """A lean index chunk decodes to the same entries through the C kernel (lean_decode) and
    the numpy path, and a body changed anywhere (then compressed again, so that only the
    decoding's own checks stand) is refused by both or decodes alike in both."""
    from kcompact.reput.jit import native
    if native() is None:
        pytest.skip("the C module is not built")
    recs, off = [], 5
    for i in range(batches * per):
        off += data.draw(st.integers(1, 3))
        recs.append(Record("t", 0, off, 7 * i - 50, None if i % 7 == 3 else b"k%d" % i,
                           None if i % 5 == 1 else b"v"))
    _, e = _v1(recs)
    e["clean_time"] = np.arange(len(recs)) % 3
    b = B2.IndexBuilder(chunk_entries=1 << 20)
    pos = 0
    for k in range(batches):
        b.add_batch(pos, 70 + k, e[k * per:(k + 1) * per])
        pos += 70 + k
    raw_index = b.finish(KB.CODEC_ZSTD)
    idx = B2.LeanIndex(lambda s, n: raw_index[s:s + n], "x.bcq", len(raw_index))
    d = idx.dir[0]
    chunk = raw_index[int(d["chunk_pos"]):int(d["chunk_pos"]) + int(d["chunk_len"])]
    body = bytearray(codecs.zstd_decompress(chunk))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] ^= data.draw(st.integers(1, 255))
    mutated = codecs.zstd_compress(bytes(body), 3)
    results = []
    for decode in (idx._decode, lambda *a: _numpy_lean_decode(idx, *a)):
        try:
            results.append(decode(0, mutated, 0).tolist())
        except CorruptRecordError:
            results.append("refused")
    assert results[0] == results[1]
    if bytes(body) == codecs.zstd_decompress(chunk):  # the record fields as given, batch positions
        got = np.array(results[0], B.BCQ_DTYPE)
        for f in ("offset", "timestamp", "digest_lo", "digest_hi", "flags", "clean_time"):
            assert got[f].tolist() == e[f].tolist(), f
        assert got["position"].tolist() == [sum(70 + j for j in range(k // per))
                                            for k in range(len(recs))]


@pytest.mark.parametrize("n, value", [(300, 40), (12_000, 120)])  # compressed; mostly stored
def test_span_entries_are_the_records_scanned(n, value):
    """span_entries (a replica's index of a shipped span, straight from the Kafka records) gives
    the offsets, timestamps, flags and key digests a scan of the decoded records gives."""
    from kcompact.reput.jit import native
    from kcompact.reput.record import digest_key_words as _secret_words
    if native() is None:
        pytest.skip("the C module is not built")
    rng = np.random.default_rng(3)
    records = [Record("topic-a", 3, 7 + 2 * i, 100 + i, None if i % 17 == 5 else b"k%d" % i,
                      None if i % 11 == 2 else rng.bytes(value), ()) for i in range(n)]
    buf = _span(records, [KB.CODEC_ZSTD, KB.CODEC_NONE] * 8)
    k0, k1 = _secret_words(SECRET)
    heads, e = KB.span_entries(buf, 0, b"topic-a", k0, k1, "x", B.BCQ_DTYPE)
    d = KB.decode_batches(buf, 0, b"topic-a", 3, "x")
    s = scan(d.data, 0, d.data.shape[0], secret=SECRET, verify_crc=True)
    want = B.entries_from_scan(s, 0, len(s), 0)
    assert heads.table.tolist() == d.heads.table.tolist()
    for f in ("offset", "timestamp", "digest_lo", "digest_hi", "flags"):
        assert e[f].tolist() == want[f].tolist(), f
    bad = buf.copy()
    bad[heads[len(heads) - 1].position + KB.HEADER_SIZE + 2] ^= 0x10  # the last batch
    assert KB.span_entries(bad, 0, b"topic-a", k0, k1, "x", B.BCQ_DTYPE) is None
