"""Store format 2's writer side: runs of uncompressed batches encoded in one C call
(batch.encode_plain, reput/_kafka_span.h kafka_encode_plain) byte for byte as one batch at a
time; the writer's backoff after batches that do not compress (rewrite.SegmentWriter2); the lean
index's batch table collected while its chunks are read in order (bcq2.LeanIndex.batches); the
decoded-records check without the CRC (segment_v1.verify_records(decoded=True))."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kcompact.reput import batch as KB
from kcompact.reput import bcq as B
from kcompact.reput import bcq2 as B2
import _oracle_kernels as K  # noqa: E402  (the numba twins: tests/unit/)
from kcompact.reput.backend import LocalBackend
from kcompact.reput.columns import RecordColumns
from kcompact.reput.jit import native
from kcompact.reput.segment_v1 import verify_records
from kcompact.reput.record import Record, encode, scan
from kcompact.reput.rewrite import PLAIN_RUN_MAX, SegmentWriter2

SECRET = bytes(range(16))
_N = native()
needs_c = pytest.mark.skipif(_N is None, reason="the C kernels are not built (make install)")


def _v1(records):
    raw = np.frombuffer(encode(records), np.uint8)
    s = scan(raw, secret=SECRET)
    e = B.entries_from_scan(s, 0, len(s), 0).copy()
    return raw, e


def _columns(records):
    raw, e = _v1(records)
    return RecordColumns("t", 0, raw, e, e["position"].astype(np.int64),
                         records[-1].offset + 1)


def _one_at_a_time(raw, pos, ends, offs, ts, lo, n, batch_bytes, final):
    """The batch-by-batch reference: cut_batch, then encode_batch without a codec."""
    out, sizes, counts = [], [], []
    while lo < n:
        hi = KB.cut_batch(pos, ends, offs, lo, n, batch_bytes, final)
        if hi == lo:
            break
        eb = KB.encode_batch(raw, pos, lo, hi, offs, ts, KB.CODEC_NONE, 0)
        out.append(eb.data)
        sizes.append(len(eb.data))
        counts.append(hi - lo)
        lo = hi
    return b"".join(out), sizes, counts, lo


_key = st.one_of(st.none(), st.binary(max_size=20))
_headers = st.lists(st.tuples(st.text(max_size=6), st.one_of(st.none(), st.binary(max_size=9))),
                    max_size=2).map(tuple)


@st.composite
def _records(draw):
    n = draw(st.integers(1, 80))
    # gaps up to 2^31: a batch spans at most 2^31 - 1 offsets, so some batches are cut by them
    gaps = draw(st.lists(st.one_of(st.integers(1, 5), st.integers(1 << 30, 1 << 31)),
                         min_size=n, max_size=n))
    off = draw(st.integers(0, 1 << 40))
    out = []
    for i in range(n):
        off += gaps[i] if i else 0
        out.append(Record("t", 0, off, draw(st.integers(0, 1 << 41)), draw(_key),
                          draw(st.one_of(st.none(), st.binary(max_size=200))), draw(_headers)))
    return out


@needs_c
@settings(max_examples=120, deadline=None)
@given(_records(), st.integers(1, 3000), st.booleans(), st.integers(1, 10))
def test_encode_plain_writes_what_encode_batch_writes(records, batch_bytes, final, most):
    raw, e = _v1(records)
    pos = e["position"].astype(np.int64)
    ends = pos + e["size"].astype(np.int64)
    offs, ts = e["offset"].astype(np.int64), e["timestamp"].astype(np.int64)
    n = len(records)
    data, sizes, counts, nxt = KB.encode_plain(raw, pos, ends, offs, ts, 0, n, batch_bytes,
                                               most, final)
    ref, rsizes, rcounts, rnxt = _one_at_a_time(raw, pos, ends, offs, ts, 0, n, batch_bytes,
                                                final)
    k = len(sizes)
    assert k <= most and sizes == rsizes[:k] and counts == rcounts[:k]
    assert data.tobytes() == ref[:sum(sizes)]
    assert nxt == (rnxt if k == len(rsizes) else sum(counts))
    # what it wrote decodes into the records it was given
    if k:
        d = KB.decode_batches(data, 0, b"t", 0, "x")
        assert d.offsets.tolist() == offs[:nxt].tolist()
        assert d.data.tobytes() == raw[:int(ends[nxt - 1])].tobytes()


@needs_c
def test_encode_plain_stops_at_a_batch_boundary_when_out_is_full():
    recs = [Record("t", 0, i, i, b"k%d" % i, b"v" * 50) for i in range(100)]
    raw, e = _v1(recs)
    pos = e["position"].astype(np.int64)
    ends = pos + e["size"].astype(np.int64)
    offs, ts = e["offset"].astype(np.int64), e["timestamp"].astype(np.int64)
    ref, rsizes, rcounts, _ = _one_at_a_time(raw, pos, ends, offs, ts, 0, 100, 1000, True)
    out = np.zeros(rsizes[0] + rsizes[1] + 10, np.uint8)  # room for two batches, not three
    bounds = np.empty(20, np.int64)
    k, nxt, used = _N.kafka_encode_plain(raw, pos, ends, offs, ts, 0, 100, 1000, 100, 1, out,
                                         bounds)
    assert (k, nxt, used) == (2, rcounts[0] + rcounts[1], rsizes[0] + rsizes[1])
    assert out[:used].tobytes() == ref[:used]
    with pytest.raises(ValueError, match="outside"):  # a record range past the arrays
        _N.kafka_encode_plain(raw, pos, ends, offs, ts, 0, 101, 1000, 100, 1, out, bounds)


def _written(tmp_path, blocks, codec=KB.CODEC_ZSTD, batch_bytes=2000):
    os.makedirs(tmp_path, exist_ok=True)
    fs = LocalBackend(str(tmp_path))
    w = SegmentWriter2(fs, "s.log", "s.bcq", codec=codec, level=3, batch_bytes=batch_bytes)
    for b in blocks:
        w.append(b)
    w.sync()
    w.close()
    log = os.path.join(tmp_path, "s.log")
    data = np.fromfile(log, np.uint8)
    heads = []
    p = 0
    while p < data.shape[0]:
        h = KB.parse_head(data, p, log, p)
        heads.append(h)
        p += h.size
    return data, heads


def test_writer_backs_off_trying_to_compress_incompressible_records(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    noise = [Record("t", 0, i, i, b"k%d" % i, rng.bytes(200)) for i in range(4000)]
    text = [Record("t", 0, 4000 + i, i, b"k%d" % i, b'{"status": "shipped"}' * 10)
            for i in range(4000)]
    tries = []  # batches tried (probed or compressed), by their first record's offset
    real = KB.encode_batch

    def counting(buf, positions, lo, hi, offsets, *args, **kw):
        tries.append(int(offsets[lo]))
        return real(buf, positions, lo, hi, offsets, *args, **kw)
    monkeypatch.setattr(KB, "encode_batch", counting)
    data, heads = _written(tmp_path, [_columns(noise), _columns(text)])
    codecs = [h.codec for h in heads]
    noise_batches = sum(h.base_offset < 4000 for h in heads)
    # 1, 3, 7 ... up to PLAIN_RUN_MAX batches stored untried after 1, 2, 3 ... that did not
    # compress: about one try in 64 once the run is at its longest
    noise_tries = sum(o < 4000 for o in tries)
    assert noise_tries <= 6 + noise_batches // (PLAIN_RUN_MAX + 1) + 1 < noise_batches // 8
    assert len(codecs) > 2 * PLAIN_RUN_MAX
    # every batch of the random values is stored plain; the text after them is compressed
    # again within a run of at most PLAIN_RUN_MAX batches plus the probe
    first_text = next(i for i, h in enumerate(heads) if h.base_offset >= 4000)
    assert set(codecs[:first_text]) == {KB.CODEC_NONE}
    assert KB.CODEC_ZSTD in codecs[first_text:first_text + PLAIN_RUN_MAX + 2]
    assert codecs[-1] == KB.CODEC_ZSTD
    d = KB.decode_batches(data, 0, b"t", 0, "x")
    assert d.offsets.tolist() == list(range(8000))
    assert d.data.tobytes() == _v1(noise + text)[0].tobytes()


def test_writer_without_a_codec_writes_every_batch_plain(tmp_path):
    recs = [Record("t", 0, 2 * i, i, None if i % 9 == 0 else b"k%d" % i, b"x" * (i % 300))
            for i in range(3000)]
    half = len(recs) // 2
    data, heads = _written(tmp_path, [_columns(recs[:half]), _columns(recs[half:])],
                           codec=KB.CODEC_NONE)
    assert {h.codec for h in heads} == {KB.CODEC_NONE} and len(heads) > 10
    d = KB.decode_batches(data, 0, b"t", 0, "x")
    assert d.data.tobytes() == _v1(recs)[0].tobytes()


def _lean(n=20_000, per=333, chunk_entries=1000):
    recs = [Record("t", 0, 3 * i, 10 * i, b"k%d" % i, b"v") for i in range(n)]
    _, e = _v1(recs)
    b = B2.IndexBuilder(chunk_entries=chunk_entries)
    pos, want = 0, []
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        b.add_batch(pos, 100 + hi - lo, e[lo:hi])
        want.append((pos, 100 + hi - lo, hi - lo))
        pos += 100 + hi - lo
    data = b.finish(KB.CODEC_ZSTD)
    return data, [np.array(c, np.int64) for c in zip(*want)]


def test_lean_batches_collected_by_an_in_order_pass_are_the_table():
    data, want = _lean()
    loads = []

    def read(s, k):
        loads.append(s)
        return data[s:s + k]
    idx = B2.LeanIndex(read, "x.bcq", len(data))
    for i in range(idx.chunk_count):  # a first pass, as compaction's pass 1
        idx.chunk(i)
    before = len(loads)
    got = idx.batches()
    assert len(loads) == before  # no chunk read again
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()
    # from a fresh index: out of order, part of a pass, then the table; and from all entries
    for how in ("part", "all"):
        idx = B2.LeanIndex(lambda s, k: data[s:s + k], "x.bcq", len(data))
        if how == "part":
            idx.chunk(3)
            idx.chunk(0)
            idx.chunk(1)
        else:
            idx.entries
        for g, w in zip(idx.batches(), want):
            assert g.tolist() == w.tolist()


@pytest.mark.parametrize("kernels", ["c", "numba"])
def test_decoded_check_skips_only_the_crc(kernels):
    if kernels == "c" and _N is None:
        pytest.skip("the C kernels are not built (make install)")
    recs = [Record("t", 0, 5 + i, 100 + i, b"key-%d" % i, b"value") for i in range(20)]
    raw, e = _v1(recs)
    buf = raw.copy()
    buf[int(e["position"][4]) + 4] ^= 0xFF  # record 4's stored CRC
    call = (_N.verify_records if kernels == "c" else K.verify_records)
    ent = np.ascontiguousarray(e).view(np.uint8).reshape(-1)
    from kcompact.reput.record import digest_key_words as _secret_words
    k0, k1 = _secret_words(SECRET)
    assert call(buf, 0, ent, k0, k1, 0) == 4   # the ordinary check fails it
    assert call(buf, 0, ent, k0, k1, 3) == -1  # the decoded one does not read the CRC
    assert verify_records(buf, 0, e, SECRET, decoded=True) == -1
    bad = e.copy()
    bad["digest_lo"][7] ^= 1
    assert verify_records(raw, 0, bad, SECRET, decoded=True) == 7  # the key digest still
    bad = e.copy()
    bad["offset"][9] += 1
    assert verify_records(raw, 0, bad, SECRET, decoded=True) == 9  # and the offset


def test_index_builder_spills_its_chunks_and_writes_the_same_index(tmp_path, monkeypatch):
    recs = [Record("t", 0, 2 * i, 10 * i, b"k%d" % i, b"v") for i in range(30_000)]
    _, e = _v1(recs)

    def built(spill_dir):
        b = B2.IndexBuilder(chunk_entries=500, spill_dir=spill_dir)
        for lo in range(0, len(recs), 100):
            b.add_batch(b.log_size, 700, e[lo:lo + 100])
        return b
    whole = built(None).finish(KB.CODEC_ZSTD)
    monkeypatch.setattr(B2, "SPILL_ABOVE", 2000)  # a few chunks held at a time
    b = built(str(tmp_path))
    assert b._spill is not None and b._held <= 2000 + max(map(len, b._chunks), default=0)
    out = open(tmp_path / "x.bcq", "wb")
    assert b.write_to(out, KB.CODEC_ZSTD) == len(whole)
    out.close()
    assert (tmp_path / "x.bcq").read_bytes() == whole
    assert os.listdir(tmp_path) == ["x.bcq"]  # the spill file had no name
    idx = B2.LeanIndex(lambda s, k: whole[s:s + k], "x.bcq", len(whole))
    assert idx.entries["offset"].tolist() == e["offset"].tolist()


def test_a_block_larger_than_a_slice_is_written_whole_and_in_order(tmp_path):
    from kcompact.reput.rewrite import APPEND_SLICE_BYTES
    rng = np.random.default_rng(7)
    recs = [Record("t", 0, 3 * i, i, b"k%d" % i, rng.bytes(int(rng.integers(0, 400))))
            for i in range(12_000)]
    block = _columns(recs)
    assert block.nbytes > 2 * APPEND_SLICE_BYTES
    for codec in (KB.CODEC_NONE, KB.CODEC_ZSTD):
        data, heads = _written(tmp_path / str(codec), [block], codec=codec, batch_bytes=8192)
        d = KB.decode_batches(data, 0, b"t", 0, "x")
        assert d.data.tobytes() == _v1(recs)[0].tobytes()
        assert sum(h.count for h in heads) == len(recs)
