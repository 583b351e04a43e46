"""reput/read_ahead.py: reads made in a thread one ahead give what the reader gives, in order,
and hand a failed read's error to the caller that takes it."""

from __future__ import annotations

import os

import pytest

from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.read_ahead import ReadAhead
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store


def _store(path: str) -> list[Record]:
    recs = [Record("t", 0, 3 * i, 1000 + i, b"k%d" % (i % 97), b"v" * (i % 40))
            for i in range(3000)]
    with Store.open(path, writer="w", create=True) as s:
        s.set_topic_config("t", {"segment.bytes": 32 << 10})
        for i in range(0, len(recs), 500):
            s.append(RecordBatch.from_records("t", recs[i:i + 500]))
        s.flush()
    return recs


def test_read_ahead_gives_what_the_reader_gives(tmp_path):
    recs = _store(str(tmp_path / "s"))
    s = Store.open(str(tmp_path / "s"))
    got = []
    with ReadAhead(s.reader("t", 0)) as ahead:
        ahead.prefetch(0, max_bytes=4096)
        while True:
            b = ahead.take()
            if len(b) == 0:
                break
            ahead.prefetch(b.next_offset, max_bytes=4096)
            got.extend(b.records())
        with pytest.raises(RuntimeError, match="in flight"):
            ahead.prefetch(0)
            ahead.prefetch(0)
    assert got == recs
    with pytest.raises(RuntimeError, match="nothing prefetched"):
        ReadAhead(s.reader("t", 0)).take()
    s.close()


def test_a_failed_read_is_raised_by_take(tmp_path):
    _store(str(tmp_path / "s"))
    pdir = tmp_path / "s" / "partitions" / "t" / "0"
    first = sorted(p for p in os.listdir(pdir) if p.endswith(".log"))[0]
    with open(pdir / first, "r+b") as f:  # a byte of the first batch's records
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0x55]))
    s = Store.open(str(tmp_path / "s"))
    with ReadAhead(s.reader("t", 0)) as ahead:
        ahead.prefetch(0)
        with pytest.raises(CorruptRecordError, match=first):
            ahead.take()
    s.close()
