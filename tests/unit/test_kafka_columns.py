"""connectors.kafka_columns' packed columns read back as Message.key()/value()/headers() do."""

from __future__ import annotations

import numpy as np
import pytest

from connectors.kafka_columns import PackedBytes, PackedHeaders, _module
from reput.record import encode_headers

pytestmark = pytest.mark.skipif(_module() is None, reason="connectors._rdkafka is not built")


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
