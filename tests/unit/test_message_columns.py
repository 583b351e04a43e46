"""The store sink stores the same bytes whether a batch comes with packed key/value columns (what
kcompact's consumer hands a columnar sink: ``SinkRecords.packed``) or with lists of bytes only,
on random batches: nulls and empty bytes, headers on some records or none, any partition, offset
and timestamp. (The compiled pass over confluent-kafka Message objects that this file also tested
went with confluent-kafka's consume path, issue 39.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.framework.api import SinkRecords
from kcompact.connectors.plugins.store_sink import _batch
from kcompact.reput.record import encode_batch

blobs = st.one_of(st.none(), st.binary(max_size=40))
headers = st.one_of(st.none(), st.lists(st.tuples(st.text(max_size=5), st.one_of(
    st.none(), st.binary(max_size=5))), min_size=1, max_size=3))
rows_st = st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(-1, 2**62), blobs, blobs,
                             headers), max_size=60)


def _pack(col: list) -> tuple:
    """(bytes, starts (n+1 int64), nulls (uint8)), each a bytearray, as SinkRecords.packed."""
    starts = np.zeros(len(col) + 1, np.int64)
    np.cumsum([len(x or b"") for x in col], out=starts[1:])
    nulls = np.array([x is None for x in col], np.uint8)
    return (bytearray(b"".join(x or b"" for x in col)), bytearray(starts.tobytes()),
            bytearray(nulls.tobytes()))


@settings(max_examples=60, deadline=None)
@given(rows=rows_st)
def test_store_sink_encodes_the_same_bytes_from_packed_columns(rows):
    # strictly increasing offsets per partition, as a consumer delivers them
    n = len(rows)
    parts = np.array([p % 3 for p, *_ in rows], np.int32)
    offs = np.arange(n, dtype=np.int64)
    ts = np.array([t for _, t, *_ in rows], np.int64)
    keys, values = [r[2] for r in rows], [r[3] for r in rows]
    hdrs = [r[4] for r in rows] if any(r[4] for r in rows) else [None] * n
    plain = SinkRecords(["t"] * n, parts, offs, ts, keys, values, hdrs)
    fast = SinkRecords(["t"] * n, parts, offs, ts, keys, values, hdrs)
    fast.packed = _pack(keys) + _pack(values)
    a, _ = encode_batch(_batch("t", plain, None))
    b, _ = encode_batch(_batch("t", fast, None))
    assert bytes(a) == bytes(b)
