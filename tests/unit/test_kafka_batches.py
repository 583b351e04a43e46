"""``PartitionReader.kafka_batches`` and the timestamp lookups against a model (issue 40).

The Kafka endpoint serves a partition through these calls only. A random partition (offsets with
gaps, tombstones, keyless records, headers, empty and large values) is written with small
segments (sealed ones in store format 2, the active one format 1), on a local directory and on
the in-memory S3, sometimes force-compacted; the model is what the partition reader's
``records`` returns. The batches, decoded by an independent reader (``_kafka_wire``), must be:
whole, each CRC-valid; the first the one holding the offset asked for or the next one; the first
whole even past ``max_bytes``, the others within it; ``next_offset`` the last batch's last offset
+ 1; read on from there, exactly the model's records. (Written against a first implementation;
the segment kinds' own, reput/segment_v1.py and segment_v2.py, passes it unchanged.)
"""

from __future__ import annotations

import bisect
import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.reput import Store
from kcompact.reput.reader import max_timestamp, offset_for_timestamp
from kcompact.reput.reader import PartitionReader

sys.path.insert(0, os.path.dirname(__file__))

from _kafka_wire import decode_batches  # noqa: E402
from _stores import BACKENDS, backend_env  # noqa: E402
from test_reader_model import TOPIC, _build, _record  # noqa: E402


def _joined(kb) -> bytes:
    return b"".join(bytes(p) for p in kb.parts)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_record, max_size=150), compact=st.booleans(), data=st.data())
def test_kafka_batches_serve_exactly_the_models_records(backend, rows, compact, data):
    with tempfile.TemporaryDirectory() as root, backend_env(backend, root):
        st_, _ = _build(backend, root, rows, compact)
        ro = Store.open(st_.url)
        try:
            for store in (st_, ro):
                reader = PartitionReader(store.partition(TOPIC, 0))
                model = {r.offset: r for r in reader.records(0)}
                offs = sorted(model)
                end = offs[-1] + 1 if offs else 0
                for _ in range(5):
                    frm = data.draw(st.one_of(st.integers(0, end + 3),
                                              st.sampled_from(offs or [0])))
                    max_bytes = data.draw(st.integers(0, 20000))
                    kb = reader.kafka_batches(frm, max_bytes)
                    raw = _joined(kb)
                    assert len(raw) == kb.nbytes
                    batches = decode_batches(raw)
                    assert sum(b.size for b in batches) == kb.nbytes  # whole batches only
                    assert kb.zstd == any(b.attributes & 7 == 4 for b in batches)
                    rest = offs[bisect.bisect_left(offs, frm):]
                    if not rest:
                        assert batches == [] and kb.next_offset == frm
                        continue
                    assert batches, "records exist at or after the offset: a batch is due"
                    assert batches[0].base_offset <= rest[0] <= batches[0].last_offset
                    assert batches[0].last_offset >= frm
                    assert len(batches) == 1 or kb.nbytes <= max_bytes
                    assert kb.next_offset == batches[-1].last_offset + 1
                    for b in batches:
                        for r in b.records:
                            m = model[r.offset]
                            assert (r.timestamp, r.key, r.value, r.headers) == (
                                m.timestamp, m.key, m.value, tuple(m.headers))
                    got = [r.offset for b in batches for r in b.records]
                    assert got == sorted(got) and [o for o in got if o >= frm] == rest[:len(
                        [o for o in got if o >= frm])]
                # read on from anywhere to the end: exactly the model's records
                frm = data.draw(st.integers(0, end + 1))
                seen, at = [], frm
                for _ in range(10 * len(offs) + 5):
                    kb = reader.kafka_batches(at, data.draw(st.integers(0, 6000)))
                    if kb.nbytes == 0:
                        break
                    assert kb.zstd == any(b.attributes & 7 == 4 for b in decode_batches(
                        _joined(kb)))
                    assert kb.next_offset > at
                    seen += [r.offset for b in decode_batches(_joined(kb)) for r in b.records
                             if r.offset >= at]
                    at = kb.next_offset
                assert seen == offs[bisect.bisect_left(offs, frm):]
                # timestamps
                t = data.draw(st.integers(-5, (max((m.timestamp for m in model.values()),
                                                   default=0)) + 5))
                hit = offset_for_timestamp(reader, t)
                want = [o for o in offs if model[o].timestamp >= t]
                assert (hit is None) == (not want)
                if want:
                    assert hit == (want[0], model[want[0]].timestamp)
                top = max_timestamp(reader)
                if offs:
                    mt = max(model[o].timestamp for o in offs)
                    assert top == (min(o for o in offs if model[o].timestamp == mt), mt)
                else:
                    assert top is None
        finally:
            ro.close()
            st_.close()
