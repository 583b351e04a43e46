"""The partition reader (reput/reader.py) against a dict/bisect model, with hypothesis.

A random partition (offsets with gaps, keys from a small set so that compaction drops many,
tombstones, keyless records, headers, values from empty to larger than a block) is written to a
store with small segments, on a local directory and on the in-memory S3, and sometimes
force-compacted (a ManualClock that never moves: tombstones stay, compaction leaves gaps). The
model is a dict offset -> Record: everything written, or after compaction the latest record
per key plus every keyless record. Then every way in to the reader must return exactly the
model's records:

* ``read(from, max_records, max_bytes)``: the first records at or after ``from`` (at least one
  when any exists, at most ``max_records``, no more than ``max_bytes`` unless one record), the
  next offset after the last; the columns (offsets, timestamps, flags, digests, keys, values,
  headers) are the records' fields;
* ``blocks``/``records`` from any offset with any limit: the model's records from there;
* a selection of random entries of each segment (``IndexCursor`` chunks, ``segment().select``,
  random access or streamed, with a random block span): exactly the selected offsets' records;
* ``read_raw``: the same records, as stored (they decode to the model's records).
"""

from __future__ import annotations

import bisect
import os
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import FLAG_KEYLESS, FLAG_TOMBSTONE, ManualClock, Store, key_digest
from kcompact.reput.config import WriterOptions
from kcompact.reput.reader import IndexCursor, PartitionReader
from kcompact.reput.record import Record, RecordBatch, decode_all

sys.path.insert(0, os.path.dirname(__file__))

from _stores import BACKENDS, backend_env, store_url  # noqa: E402

TOPIC = "t"

_record = st.tuples(
    st.integers(1, 4),                                             # offset gap
    st.one_of(st.none(), st.sampled_from([b"a", b"b", b"c", b"", b"k" * 40])),  # key
    st.one_of(st.none(), st.binary(max_size=64), st.just(b"v" * 3000)),          # value
    st.lists(st.tuples(st.sampled_from(["h", "trace-id"]),
                       st.one_of(st.none(), st.binary(max_size=8))), max_size=2),
)


def _build(backend: str, root: str, rows, compact: bool):
    clock = ManualClock()
    url = store_url(backend, root)
    # "s3-shared": the in-memory S3 with shared uploads, a flush (one shared object) per batch
    shared = backend == "s3-shared"
    st_ = Store.open(url, writer="w", create=True, clock=clock,
                     options=WriterOptions(upload="shared" if shared else "auto"))
    st_.set_topic_config(TOPIC, {"segment.bytes": 1 << 14})
    recs, off = [], 0
    for gap, key, value, headers in rows:
        off += gap
        recs.append(Record(TOPIC, 0, off, clock.ms() + off, key, value, tuple(headers)))
    for i in range(0, len(recs), 37):
        st_.append(RecordBatch.from_records(TOPIC, recs[i:i + 37]))
        if shared:
            st_.flush()
    st_.flush()
    model = {r.offset: r for r in recs}
    if compact and recs:
        res = Compactor(st_, CompactionOptions(offset_map_memory=4096), clock).compact_partition(
            TOPIC, 0, force=True)
        assert res.skipped is None
        latest = {}
        for r in recs:
            if r.key is not None:
                latest[r.key] = r.offset
        model = {o: r for o, r in model.items() if r.key is None or latest[r.key] == o}
    return st_, model


def _check_columns(block, recs, secret):
    assert block.offsets.tolist() == [r.offset for r in recs]
    assert block.timestamps.tolist() == [r.timestamp for r in recs]
    assert block.keys.to_list() == [r.key for r in recs]
    assert block.values.to_list() == [r.value for r in recs]
    assert block.header_lists() == [r.headers for r in recs]
    assert block.flags.tolist() == [(FLAG_TOMBSTONE if r.value is None else 0)
                                    | (FLAG_KEYLESS if r.key is None else 0) for r in recs]
    assert list(zip(block.digest_lo.tolist(), block.digest_hi.tolist())) == [
        (0, 0) if r.key is None else key_digest(r.key, secret) for r in recs]
    assert list(block.records()) == recs


@pytest.mark.parametrize("backend", BACKENDS + ("s3-shared",))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_record, max_size=120), compact=st.booleans(), data=st.data())
def test_reader_returns_exactly_the_models_records(backend, rows, compact, data):
    with tempfile.TemporaryDirectory() as root, backend_env(backend, root):
        st_, model = _build(backend, root, rows, compact)
        try:
            _check(st_, model, data)
        finally:
            st_.close()


def _check(st_, model, data):
    offs = sorted(model)
    end = (max(model) + 1) if model else 0
    ro = Store.open(st_.url)   # a read-only view, as dump, serve and kv build have
    try:
        for store in (st_, ro):
            pl = store.partition(TOPIC, 0)
            reader = PartitionReader(pl)
            nxt = pl.next_offset
            # offset reads
            for _ in range(6):
                frm = data.draw(st.one_of(st.integers(-3, end + 3), st.sampled_from(offs or [0])))
                max_records = data.draw(st.one_of(st.none(), st.integers(1, 50)))
                max_bytes = data.draw(st.one_of(st.none(), st.integers(0, 9000)))
                want = [model[o] for o in offs[bisect.bisect_left(offs, max(frm, 0)):]]
                b = reader.read(frm, max_records, max_bytes)
                got = list(b.records())
                if not want:
                    assert got == [] and b.next_offset == max(frm, 0, nxt)
                    continue
                assert 1 <= len(got) and got == want[:len(got)]
                assert max_records is None or len(got) <= max_records
                assert max_bytes is None or len(got) == 1 or b.nbytes <= max_bytes
                assert b.next_offset == got[-1].offset + 1
                _check_columns(b, got, store.secret)
            # iterating from anywhere, with a limit
            frm = data.draw(st.integers(-1, end + 1))
            limit = data.draw(st.one_of(st.none(), st.integers(0, 80)))
            want = [model[o] for o in offs[bisect.bisect_left(offs, max(frm, 0)):]]
            assert list(reader.records(frm, limit, block_bytes=data.draw(
                st.integers(1, 1 << 14)))) == (want if limit is None else want[:limit])
            # selections of each segment, random access or streamed
            cursor = IndexCursor(pl, chunk_entries=data.draw(st.integers(1, 64)))
            picked = []
            for seg in pl.segments:
                sequential = data.draw(st.booleans())
                span = data.draw(st.integers(1, 1 << 15))
                with reader.segment(seg, sequential=sequential, block_bytes=span) as src:
                    for _, chunk in cursor.chunks(seg):
                        mask = np.array(data.draw(st.lists(st.booleans(), min_size=chunk.shape[0],
                                                           max_size=chunk.shape[0])), bool)
                        sel = chunk[mask]
                        for blk in src.select(sel):
                            got = list(blk.records())
                            assert got == [model[int(o)] for o in blk.offsets]
                            picked += [r.offset for r in got]
                        assert [int(o) for o in sel["offset"]] == picked[len(picked) - len(sel):]
            assert set(picked) <= set(offs)
            # raw ranges (replication)
            frm = data.draw(st.integers(-1, end + 1))
            raw = reader.read_raw(max(frm, 0), data.draw(st.integers(1, 9000)))
            want = [model[o] for o in offs[bisect.bisect_left(offs, max(frm, 0)):]]
            if not want:
                assert raw.count == 0 and raw.buf is None
            else:
                got = decode_all(raw.buf[:raw.nbytes].tobytes())
                assert got and got == want[:len(got)] and raw.count == len(got)
                assert raw.next_offset == got[-1].offset + 1
    finally:
        ro.close()
