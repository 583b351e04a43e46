"""PartitionReader.read_fields (reput/reader.py): keys and values taken where they lie in a
format-2 segment's decompressed batches (reput/_kafka_span.h kafka_fields_many) are the ones
``read`` gives, from any offset and under any byte bound, across format-2 and format-1
segments; a damaged batch or an entry its record does not match is refused as ``read`` refuses
it."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kcompact.reput import batch as KB
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.jit import native
from kcompact.reput.read_ahead import ReadAhead
from kcompact.reput.record import digest_key_words as _secret_words
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store, WriterOptions

TOPIC = "t"
_N = native()


def _records(n: int = 1500) -> list[Record]:
    out = []
    for o in range(n):
        key = None if o % 41 == 7 else b"k%03d" % (o % 300)
        value = None if o % 13 == 2 and key is not None else b'{"n": %d, "s": "shipped"}' % o
        hdr = (("h", b"%d" % o),) if o % 9 == 0 else ()
        out.append(Record(TOPIC, 0, 2 * o + (o > 700) * 50, 1_700_000_000_000 + o, key, value,
                          hdr))
    return out


def _write(d: str, recs) -> None:
    """Small segments (sealed into format 2 as they roll) of small batches."""
    s = Store.open(d, writer="w", create=True, options=WriterOptions(fsync="never"))
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "compression.batch.bytes": 2048})
    for i in range(0, len(recs), 100):
        s.append(RecordBatch.from_records(TOPIC, recs[i:i + 100]))
    s.flush()
    s.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fields") / "s")
    recs = _records()
    _write(d, recs)
    s = Store.open(d)
    pl = s.partition(TOPIC, 0)
    formats = [seg.format for seg in pl.segments]
    assert formats.count(2) >= 3 and formats[-1] == 1  # sealed segments, then the active one
    yield s, recs
    s.close()


def _fields(kv):
    def col(sp):
        return [None if sp.null[i] else sp.buf[sp.starts[i]:sp.starts[i] + sp.lengths[i]]
                .tobytes() for i in range(len(kv))]
    return kv.offsets.tolist(), col(kv.key_spans()), col(kv.value_spans())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3200), st.one_of(st.none(), st.integers(1, 20_000)))
def test_read_fields_gives_what_read_gives(store, start, max_bytes):
    s, _ = store
    r = s.reader(TOPIC, 0)
    kv = r.read_fields(start, max_bytes)
    block = r.read(start, None, max_bytes)
    offs, keys, values = _fields(kv)
    # a bound in bytes decodes whole batches: the keys and values may go a little further
    n = len(block)
    assert offs[:n] == block.offsets.tolist() and len(offs) >= n
    assert keys[:n] == block.keys.to_list() and values[:n] == block.values.to_list()
    if len(kv):
        assert kv.next_offset == offs[-1] + 1
    else:
        assert n == 0


def test_read_fields_to_the_end_and_through_read_ahead(store):
    s, recs = store
    got = []
    with ReadAhead(s.reader(TOPIC, 0), fields=True) as ahead:
        ahead.prefetch(0, max_bytes=3000)
        while True:
            kv = ahead.take()
            if len(kv) == 0:
                break
            ahead.prefetch(kv.next_offset, max_bytes=3000)
            o, k, v = _fields(kv)
            got += list(zip(o, k, v))
        with pytest.raises(ValueError, match="bytes only"):
            ahead.prefetch(0, max_records=5)
    assert got == [(r.offset, r.key, r.value) for r in recs]
    part = s.reader(TOPIC, 0).read_fields(0).take(np.array([2, 0]))
    assert _fields(part)[0] == [recs[2].offset, recs[0].offset]


@pytest.mark.skipif(_N is None, reason="the C kernels are not built (make install)")
def test_an_entry_its_record_does_not_match_is_refused(store):
    s, _ = store
    pl = s.partition(TOPIC, 0)
    seg = next(g for g in pl.segments if g.format == 2)
    idx = seg.index()
    e = idx.entries.copy()
    bpos, bsize, _ = idx.batches()
    end = int(bpos[-1] + bsize[-1])
    data = seg.log_bytes(0, end)
    k0, k1 = _secret_words(pl.secret)
    tl = len(pl.topic_bytes)
    ok = KB.span_fields(data, 0, tl, e, k0, k1, None)
    assert ok is not None and ok.count == e.shape[0]
    for field, delta in (("digest_hi", 1), ("timestamp", 1), ("flags", 1), ("offset", 1),
                         ("position", int(bsize[0]))):
        bad = e.copy()
        bad[field][10] = bad[field][10] + delta if field != "flags" else bad[field][10] ^ 1
        assert KB.span_fields(data, 0, tl, bad, k0, k1, None) is None, field
    # one byte of a batch flipped: its CRC-32C refuses it
    flipped = data.copy()
    flipped[int(bpos[1]) + 70] ^= 0x20
    assert KB.span_fields(flipped, 0, tl, e, k0, k1, None) is None
    # wanting the first batch's records only: those, the read's count the whole span; the
    # damaged second batch (not decompressed then) is still refused by its CRC-32C
    first = np.flatnonzero(e["position"] == bpos[0])
    want = e["offset"][first].astype(np.int64)
    got = KB.span_fields(data, 0, tl, e, k0, k1, None, want)
    assert got is not None and got.count == e.shape[0]
    assert got.picked.tolist() == first.tolist()
    assert KB.span_fields(flipped, 0, tl, e, k0, k1, None, want) is None


def test_a_damaged_batch_is_named_as_read_names_it(tmp_path):
    d = str(tmp_path / "s")
    _write(d, _records(800))
    pdir = os.path.join(d, "partitions", TOPIC, "0")
    first = sorted(p for p in os.listdir(pdir) if p.endswith(".log"))[0]
    with open(os.path.join(pdir, first), "r+b") as f:
        f.seek(300)
        b = f.read(1)
        f.seek(300)
        f.write(bytes([b[0] ^ 0x55]))
    s = Store.open(d)
    with pytest.raises(CorruptRecordError, match=first) as fields_err:
        s.reader(TOPIC, 0).read_fields(0)
    with pytest.raises(CorruptRecordError) as read_err:
        s.reader(TOPIC, 0).read(0)
    assert str(fields_err.value) == str(read_err.value)
    s.close()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3200), st.one_of(st.none(), st.integers(1, 20_000)),
       st.lists(st.integers(0, 1499), max_size=200))
def test_read_fields_of_wanted_offsets_gives_those_records(store, start, max_bytes, picks):
    s, recs = store
    want = np.unique(np.array([recs[i].offset for i in picks], np.int64))
    r = s.reader(TOPIC, 0)
    full = r.read_fields(start, max_bytes)
    kv = r.read_fields(start, max_bytes, want=want)
    assert kv.next_offset == full.next_offset
    offs, keys, values = _fields(full)
    got = list(zip(*_fields(kv)))
    pl = s.partition(TOPIC, 0)
    if len(full) and pl.segments[pl.segment_for(offs[0])].format == 1:
        assert got == list(zip(offs, keys, values))  # a format-1 block gives them all
    else:
        assert got == [t for t in zip(offs, keys, values) if t[0] in set(want.tolist())]
