"""kcompact.connectors.framework._rdkafka.message_columns (the consumer path's one compiled pass over a batch of
confluent_kafka Message objects) against the Python code it replaces, on random batches:
nulls and empty bytes, headers on some messages or none, any partition/offset/timestamp.
And the store sink stores the same bytes whether a batch comes with packed columns or not."""

from __future__ import annotations

import operator

import numpy as np
import pytest
from confluent_kafka import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.framework.api import SinkRecords
from kcompact.connectors.plugins.store_sink import _batch
from kcompact.connectors.framework import _rdkafka as _native
from kcompact.reput.record import encode_batch

blobs = st.one_of(st.none(), st.binary(max_size=40))
headers = st.one_of(st.none(), st.lists(st.tuples(st.text(max_size=5), st.one_of(
    st.none(), st.binary(max_size=5))), min_size=1, max_size=3))
messages = st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1),
                              st.integers(-1, 2**62), blobs, blobs, headers), max_size=60)


def _make(rows) -> list:
    return [Message(topic="t", partition=p, offset=o, timestamp=(1, ts), key=k, value=v,
                    headers=h) for p, o, ts, k, v, h in rows]


def _python_columns(msgs):
    n = len(msgs)
    return (np.fromiter(map(Message.partition, msgs), np.int32, n),
            np.fromiter(map(Message.offset, msgs), np.int64, n),
            np.fromiter(map(operator.itemgetter(1), map(Message.timestamp, msgs)), np.int64, n),
            list(map(Message.key, msgs)), list(map(Message.value, msgs)),
            list(map(Message.headers, msgs)))


def _unpack(buf, offs, nulls) -> list:
    o = np.frombuffer(offs, np.int64)
    z = np.frombuffer(nulls, np.bool_)
    b = bytes(buf)
    return [None if z[i] else b[o[i]:o[i + 1]] for i in range(z.shape[0])]


@settings(max_examples=150, deadline=None)
@given(rows=messages)
def test_message_columns_match_the_python_path(rows):
    msgs = _make(rows)
    n = len(msgs)
    parts, offs, ts = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
    keys, values, hdrs, kb, ko, kn, vb, vo, vn = _native.message_columns(msgs, parts, offs, ts)
    p2, o2, t2, k2, v2, h2 = _python_columns(msgs)
    assert np.array_equal(parts, p2) and np.array_equal(offs, o2) and np.array_equal(ts, t2)
    assert keys == k2 and values == v2
    assert hdrs == (h2 if any(h2) else None)
    assert _unpack(kb, ko, kn) == k2 and _unpack(vb, vo, vn) == v2


class _Lookalike:
    """Not a Message: message_columns must take the method path for it."""

    def __init__(self, p, o, ts, k, v, h):
        self._row = (p, o, ts, k, v, h)

    def error(self):
        return None

    def partition(self):
        return self._row[0]

    def offset(self):
        return self._row[1]

    def timestamp(self):
        return (1, self._row[2])

    def key(self):
        return self._row[3]

    def value(self):
        return self._row[4]

    def headers(self):
        return self._row[5]


@settings(max_examples=60, deadline=None)
@given(rows=messages, cut=st.integers(0, 60))
def test_a_list_mixing_messages_and_other_objects_reads_the_same(rows, cut):
    cut = min(cut, len(rows))
    msgs = _make(rows[:cut]) + [_Lookalike(*r) for r in rows[cut:]]
    n = len(msgs)
    parts, offs, ts = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
    keys, values, hdrs, kb, ko, kn, vb, vo, vn = _native.message_columns(msgs, parts, offs, ts)
    want = _python_columns(_make(rows))
    assert np.array_equal(parts, want[0]) and np.array_equal(offs, want[1])
    assert np.array_equal(ts, want[2])
    assert keys == want[3] and values == want[4] and hdrs == (want[5] if any(want[5]) else None)
    assert _unpack(kb, ko, kn) == want[3] and _unpack(vb, vo, vn) == want[4]


@settings(max_examples=60, deadline=None)
@given(rows=messages)
def test_store_sink_encodes_the_same_bytes_from_packed_columns(rows):
    # strictly increasing offsets per partition, as a consumer delivers them
    rows = [(p % 3, i, ts, k, v, h) for i, (p, _, ts, k, v, h) in enumerate(rows)]
    msgs = _make(rows)
    n = len(msgs)
    parts, offs, ts = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int64)
    keys, values, hdrs, *packed = _native.message_columns(msgs, parts, offs, ts)
    hdrs = hdrs or [None] * n
    plain = SinkRecords(["t"] * n, parts, offs, ts, keys, values, hdrs)
    fast = SinkRecords(["t"] * n, parts, offs, ts, keys, values, hdrs)
    fast.packed = tuple(packed)
    a, _ = encode_batch(_batch("t", plain, None))
    b, _ = encode_batch(_batch("t", fast, None))
    assert bytes(a) == bytes(b)


def test_an_error_event_in_the_batch_gives_none():
    from confluent_kafka import KafkaError
    msgs = _make([(0, i, 0, b"k", b"v", None) for i in range(5)])
    msgs.insert(3, Message(topic="t", partition=0, offset=5,
                           error=KafkaError(KafkaError._PARTITION_EOF)))
    parts = np.full(6, -7, np.int32)
    assert _native.message_columns(msgs, parts, np.empty(6, np.int64),
                                   np.empty(6, np.int64)) is None
    assert (parts == -7).all()  # nothing was filled


def test_bad_input_is_an_error():
    with pytest.raises(TypeError):
        _native.message_columns((), np.empty(0, np.int32), np.empty(0, np.int64),
                                np.empty(0, np.int64))
    with pytest.raises(ValueError):
        _native.message_columns(_make([(0, 0, 0, None, None, None)]), np.empty(0, np.int32),
                                np.empty(1, np.int64), np.empty(1, np.int64))
    with pytest.raises(AttributeError):  # not Message objects
        _native.message_columns([object()], np.empty(1, np.int32), np.empty(1, np.int64),
                                np.empty(1, np.int64))
