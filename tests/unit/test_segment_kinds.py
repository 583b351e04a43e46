"""The segment interface's new surface against models (issue 39): Kafka batches, timestamps, and
both kinds of segment agreeing on the same records.

* ``PartitionReader.kafka_batches`` (what the Kafka endpoint serves) on random partitions (gaps,
  tombstones, keyless records, headers, empty and large values; small segments, sealed ones in
  format 2 and the active one in format 1; local and the in-memory S3; sometimes
  force-compacted), decoded by the independent RecordBatch v2 reader written from Kafka's spec
  (tests/unit/_kafka_wire.py: google-crc32c for the CRC, zstandard for the codec): whole batches, each CRC-valid; the
  first the one holding the offset asked for or the next one; the first whole even past
  ``max_bytes``, later ones within it; ``next_offset`` the last batch's last offset + 1; read on
  from anywhere, exactly the model's records. A sealed segment's batches are its stored bytes.
* ``offset_for_timestamp`` / ``max_timestamp`` against the model (Kafka's ListOffsets).
* The same records written as format-1 segments only (``seal_format=1``) and as format-2 ones:
  every read (by offset, fields, raw ranges, Kafka batches, timestamps, counts, verify) answers
  the same through either kind.
* The batch and timestamp models also run on the in-memory S3 with shared uploads (a flush,
  one shared object, per 37 records: the sealed segments are parts of shared objects,
  docs/formats/shared-upload.md), as test_reader_model.py's reads do.
"""

from __future__ import annotations

import bisect
import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.reput import ManualClock, Store
from kcompact.reput.config import WriterOptions
from kcompact.reput.reader import PartitionReader
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.verify import verify_store

sys.path.insert(0, os.path.dirname(__file__))

from _stores import BACKENDS, backend_env, store_url  # noqa: E402
from _kafka_wire import decode_batches  # noqa: E402
from test_reader_model import TOPIC, _build, _record  # noqa: E402

pytest.importorskip("google_crc32c", reason="the independent reader's CRC-32C")
pytest.importorskip("zstandard", reason="the independent reader's zstd")


# -- an independent RecordBatch v2 reader (Kafka's spec, KIP-98) --------------------------------

def decode_kafka(raw: bytes) -> list[dict]:
    """Whole batches of ``raw`` (the shared independent reader, tests/unit/_kafka_wire.py): each
    as a dict (base, last, size, records: (offset, timestamp, key, value, headers));
    AssertionError on anything that is not a run of whole, valid batches."""
    out = []
    for b in decode_batches(raw):
        recs = [tuple(r) for r in b.records]
        assert recs and recs[-1][0] == b.last_offset, "the batch's lastOffsetDelta"
        assert max(r[1] for r in recs) == b.max_timestamp, "the batch's maxTimestamp"
        out.append({"base": b.base_offset, "last": b.last_offset, "size": b.size,
                    "records": recs})
    assert sum(b["size"] for b in out) == len(raw), "a cut or invalid batch"
    return out


def _joined(kb) -> bytes:
    return b"".join(bytes(x) for x in kb.parts)


def _as_tuple(r: Record) -> tuple:
    return (r.offset, r.timestamp, r.key, r.value, tuple(r.headers))


# -- Kafka batches and timestamps against the model ----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS + ("s3-shared",))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_record, max_size=150), compact=st.booleans(), data=st.data())
def test_kafka_batches_are_exactly_the_models_records(backend, rows, compact, data):
    with tempfile.TemporaryDirectory() as root, backend_env(backend, root):
        st_, model = _build(backend, root, rows, compact)
        ro = Store.open(st_.url)
        try:
            for store in (st_, ro):
                pl = store.partition(TOPIC, 0)
                reader = PartitionReader(pl)
                offs = sorted(model)
                end = offs[-1] + 1 if offs else 0
                for _ in range(5):
                    frm = data.draw(st.one_of(st.integers(0, end + 3),
                                              st.sampled_from(offs or [0])))
                    max_bytes = data.draw(st.integers(0, 20000))
                    kb = reader.kafka_batches(frm, max_bytes)
                    raw = _joined(kb)
                    assert len(raw) == kb.nbytes
                    batches = decode_kafka(raw)
                    rest = offs[bisect.bisect_left(offs, frm):]
                    if not rest:
                        assert batches == [] and kb.next_offset == frm
                        continue
                    first = batches[0]
                    assert first["base"] <= rest[0] <= first["last"] and first["last"] >= frm
                    assert len(batches) == 1 or kb.nbytes <= max_bytes
                    assert kb.next_offset == batches[-1]["last"] + 1
                    got = [r for b in batches for r in b["records"]]
                    assert all(r == _as_tuple(model[r[0]]) for r in got)
                    mine = [r[0] for r in got if r[0] >= frm]
                    assert mine == rest[:len(mine)]
                    seg = pl.segments[pl.segment_for(rest[0])]
                    if seg.batches() is not None:  # a sealed segment's batches: as stored
                        bpos, _, _ = seg.batches()
                        idx = seg.index()
                        p0 = int(idx.entries[idx.lower_bound(rest[0])]["position"])
                        assert raw == seg.read_log(p0, kb.nbytes)
                        assert p0 in bpos.tolist()
                # read on from anywhere to the end: exactly the model's records
                frm = data.draw(st.integers(0, end + 1))
                seen, at = [], frm
                for _ in range(10 * len(offs) + 5):
                    kb = reader.kafka_batches(at, data.draw(st.integers(0, 6000)))
                    if kb.nbytes == 0:
                        assert kb.next_offset == at
                        break
                    assert kb.next_offset > at
                    seen += [r[0] for b in decode_kafka(_joined(kb)) for r in b["records"]
                             if r[0] >= at]
                    at = kb.next_offset
                assert seen == offs[bisect.bisect_left(offs, frm):]
                # timestamps (ListOffsets)
                t = data.draw(st.integers(-5, max((m.timestamp for m in model.values()),
                                                  default=0) + 5))
                want = [o for o in offs if model[o].timestamp >= t]
                hit = reader.offset_for_timestamp(t)
                assert hit == ((want[0], model[want[0]].timestamp) if want else None)
                top = reader.max_timestamp()
                if offs:
                    mt = max(m.timestamp for m in model.values())
                    assert top == (min(o for o in offs if model[o].timestamp == mt), mt)
                else:
                    assert top is None
        finally:
            ro.close()
            st_.close()


# -- both kinds of segment agree ----------------------------------------------------------------

def _write(url: str, recs: list[Record], seal_format: int) -> Store:
    st_ = Store.open(url, writer="w", create=True, clock=ManualClock(),
                     options=WriterOptions(seal_format=seal_format))
    st_.set_topic_config(TOPIC, {"segment.bytes": 1 << 14})
    for i in range(0, len(recs), 41):
        st_.append(RecordBatch.from_records(TOPIC, recs[i:i + 41]))
    st_.flush()
    return st_


def _answers(store: Store, probes: list[tuple[int, int]], times: list[int]) -> dict:
    """What every read path of the partition answers (the records and offsets only: a kind's
    layout, sizes and batch boundaries may differ)."""
    pl = store.partition(TOPIC, 0)
    reader = PartitionReader(pl)
    out = {"records": [_as_tuple(r) for r in reader.records(0)],
           "count": pl.record_count(), "first": pl.first_offset, "next": pl.next_offset,
           "max_ts": reader.max_timestamp(),
           "by_ts": [reader.offset_for_timestamp(t) for t in times]}
    reads = []
    for frm, max_bytes in probes:
        b = reader.read(frm, max_bytes=max_bytes)
        kv = reader.read_fields(frm, max_bytes=max_bytes)
        raw = reader.read_raw(frm, max_bytes)
        kb = reader.kafka_batches(frm, max_bytes)
        first = [r for b_ in decode_kafka(_joined(kb)) for r in b_["records"] if r[0] >= frm][:1]
        reads.append((b.offsets[:1].tolist(), kv.offsets[:1].tolist(),
                      raw.entries["offset"][:1].tolist(), first and first[0],
                      len(b) == 0, len(kv) == 0, raw.count == 0, kb.nbytes == 0))
        # within one kind, the ways in agree record for record
        assert kv.offsets.tolist() == b.offsets.tolist()[:len(kv)] or \
            b.offsets.tolist() == kv.offsets.tolist()[:len(b)]
    out["reads"] = reads
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_record, min_size=1, max_size=200), data=st.data())
def test_both_kinds_of_segment_answer_the_same(backend, rows, data):
    recs, off = [], 0
    for gap, key, value, headers in rows:
        off += gap
        recs.append(Record(TOPIC, 0, off, 1_700_000_000_000 + (off * 7919) % 1000, key, value,
                           tuple(headers)))
    probes = [(data.draw(st.integers(0, off + 2)), data.draw(st.integers(1, 30000)))
              for _ in range(6)]
    times = [data.draw(st.integers(1_700_000_000_000 - 5, 1_700_000_001_005)) for _ in range(4)]
    with tempfile.TemporaryDirectory() as root, backend_env(backend, root):
        answers = {}
        for fmt in (1, 2):
            st_ = _write(store_url(backend, root, f"f{fmt}"), recs, fmt)
            try:
                ro = Store.open(st_.url)
                kinds = {seg.format for seg in ro.partition(TOPIC, 0).segments}
                assert kinds <= {fmt, 1} and (fmt == 1 or len(ro.partition(TOPIC, 0).segments)
                                              == 1 or 2 in kinds)
                answers[fmt] = _answers(ro, probes, times)
                assert verify_store(ro).ok
                ro.close()
            finally:
                st_.close()
        assert answers[1] == answers[2]
        assert answers[1]["records"] == [_as_tuple(r) for r in recs]


def test_stored_batches_are_sent_as_they_lie_and_checked_by_the_reader():
    """A sealed local segment's batches go out as slices of its mapped .log; the test's reader
    is a check, not an echo: a flipped payload byte fails its CRC."""
    with tempfile.TemporaryDirectory() as root:
        recs = [Record(TOPIC, 0, i, 1000 + i, b"k%d" % i, b"v" * 50) for i in range(300)]
        st_ = _write(store_url("local", root), recs, 2)
        try:
            pl = st_.partition(TOPIC, 0)
            seg = pl.segments[0]
            assert seg.format == 2 and seg.batches() is not None
            kb = PartitionReader(pl).kafka_batches(0, 1 << 20)
            # a sealed local segment's batches: slices of its mapped .log, as stored
            assert len(kb.parts) == 1 and isinstance(kb.parts[0], memoryview)
            assert bytes(kb.parts[0]) == seg.read_log(0, kb.nbytes)
            raw = bytearray(_joined(kb))
            assert [r[0] for b in decode_kafka(bytes(raw)) for r in b["records"]][:1] == [0]
            raw[70] ^= 1
            with pytest.raises(AssertionError, match="CRC"):
                decode_kafka(bytes(raw))
        finally:
            st_.close()
