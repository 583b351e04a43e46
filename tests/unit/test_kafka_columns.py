"""kcompact.connectors.framework.kafka_columns' packed columns read back as
Message.key()/value()/headers() do."""

from __future__ import annotations

import numpy as np
import pytest

from kcompact.connectors.framework.kafka_columns import PackedBytes, PackedHeaders
from kcompact.reput.record import encode_headers


def _pack(items):
    starts = np.zeros(len(items) + 1, np.int64)
    starts[1:] = np.cumsum([0 if x is None else len(x) for x in items])
    nulls = np.array([x is None for x in items], np.bool_)
    return bytearray(b"".join(x for x in items if x)), starts.tobytes(), nulls.tobytes()


def test_packed_bytes_reads_back():
    items = [None, b"", b"abc", b"\x00\xff", None, b"z" * 1000]
    col = PackedBytes(*_pack(items))
    assert len(col) == 6 and col._items is None  # len() builds nothing
    assert list(col) == items and col[2] == b"abc" and col[1:3] == [b"", b"abc"]
    assert col.count(None) == 2
    assert PackedBytes(*_pack([])).unpacked(*_pack([])) == []


def test_unpack_rejects_starts_out_of_range():
    buf, starts, nulls = _pack([b"ab", b"cd"])
    bad = np.frombuffer(starts, np.int64).copy()
    bad[2] = 99
    with pytest.raises(ValueError, match="out of range"):
        PackedBytes.unpacked(buf, bad.tobytes(), nulls)
    with pytest.raises(ValueError, match="len\\(nulls\\) \\+ 1"):
        PackedBytes.unpacked(buf, starts[:8], nulls)


def test_packed_headers_read_back():
    rows = [None, [("a", b"1")], [("a", b"1"), ("a", None), ("ü", b"")], None]
    enc = [encode_headers(h) for h in rows]
    starts = np.zeros(len(rows) + 1, np.int64)
    starts[1:] = np.cumsum([len(e) for e in enc])
    col = PackedHeaders(b"".join(enc), starts.tobytes())
    assert len(col) == 4 and list(col) == rows and col[2][2] == ("ü", b"")


def test_kv_columns_end_of_partition_order():
    """MapBuilder._columns: an end-of-partition event at or after a partition's last record in
    the batch marks it at its end; a record past the event (the partition grew again) does
    not, whatever order the batch lists them in."""
    from types import SimpleNamespace

    from kcompact.connectors.framework.kafka_columns import Batch, Event
    from kcompact.connectors.apps.kv import MapBuilder

    def batch(parts, offs, events):
        n = len(parts)
        keys = [b"k%d" % o for o in offs]
        packed = (*_pack(keys), *_pack([b"v"] * n))
        return Batch(np.array(parts, np.int32), np.array(offs, np.int64),
                     np.zeros(n, np.int64), ["t"], None, packed, None,
                     [Event("t", p, o, -191, "end", False) for p, o in events])

    reader = SimpleNamespace(consume_columns=lambda n, t: reader.next)
    me = SimpleNamespace(follow_batch_records=100)
    at_end: set = {2}
    reader.next = batch([0, 1, 0, 2], [5, 7, 6, 9], [(0, 7), (1, 7), (3, 0)])
    keys, values, nxt = MapBuilder._columns(me, reader, at_end)
    assert nxt == {0: 7, 1: 8, 2: 10}
    # 0: its records end at 6, its end is 7; 1: record 7 is past its end event at 7; 2: a new
    # record; 3: no records, at its end
    assert at_end == {0, 3}
    assert keys == [b"k5", b"k7", b"k6", b"k9"] and values == [b"v"] * 4
    reader.next = batch([], [], [])
    assert MapBuilder._columns(me, reader, at_end) == ([], [], {}) and at_end == {0, 3}
