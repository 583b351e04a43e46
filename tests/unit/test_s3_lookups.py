"""Offset lookups on an S3 store answer from the manifest's bitmaps (docs/formats/manifest.md,
"Reads and the block cache"), counted in requests against the in-memory S3 (``_fake_s3``).

Each check opens a cold reader (its own empty block cache and spool), loads the partition's
manifest, resets the request counters, and then does one lookup. The expected counts are the
objects the lookup cannot do without:

* record counts, first/next offsets, ``holds(o)`` and ``offset_at_or_after(o)``: none;
* a read from a target inside a gap at the end of a segment (compaction left it, or the
  writer skipped offsets): the .bcq and .log of the *next* segment only, never the .bcq of the
  segment whose range holds the target; past the end: none. The same for the replication
  server's raw reads (``PartitionReader.read_raw``), which start at ``PartitionLog.segment_for``;
* a read of a few records from a segment whose .bcq is larger than a cache block: the one
  block of the .bcq holding the entries (the bitmap's rank says which), not the whole .bcq.

The same lookups on a local store give the same answers (local behaviour is unchanged).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import FakeS3  # noqa: E402

from kcompact.compaction import CompactionOptions, compact_store  # noqa: E402
from kcompact.reput import bcq as B  # noqa: E402
from kcompact.reput.config import WriterOptions  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3 import BlockCache, S3Backend, Spool  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402

#: these tests are about per-partition uploads (a new S3 store uses shared ones by default)
PARTITION = WriterOptions(upload="partition")

TOPIC = "t"
BLOCK = 4096                     # a small cache block, so that a .bcq spans many of them


@pytest.fixture
def fake():
    return FakeS3(buckets=("bucket",))


@pytest.fixture
def make_fs(fake, tmp_path, monkeypatch):
    """A fresh S3Backend on the fake: its own empty cache and spool, its own counters."""
    monkeypatch.setenv("KCOMPACT_CACHE_DIR", str(tmp_path / "cache"))

    def make(block: int = BLOCK) -> S3Backend:
        return S3Backend("bucket", "s", client=fake, grace_ms=0,
                         cache=BlockCache(64 << 20, block),
                         spool=Spool(1 << 30, str(tmp_path / f"spool-{time.monotonic_ns()}")))
    return make


def _rows(offsets, keys=None, vlen=40):
    return [(0, int(o), 1_000 + int(o), b"k%d" % (int(o) if keys is None else keys(int(o))),
             b"v%d." % int(o) * (vlen // 4)) for o in offsets]


def _gapped_store(url: str, fs=None, seal_format: int = 2) -> dict[int, list[int]]:
    """Three flushed segments with gaps at their ends: [0..49] base 0, [100..149] base 100,
    [200..1199] base 200 (1000 records: in format 1 a .bcq of 48000 bytes, 12 cache blocks).
    Returns {segment base: offsets}."""
    segs = {0: list(range(0, 50)), 100: list(range(100, 150)), 200: list(range(200, 1200))}
    with Store.open(url, fs=fs, writer="w", create=True,
                    options=WriterOptions(seal_format=seal_format, upload="partition")) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 1 << 20})
        for offs in segs.values():
            if st.fs.appendable and offs[0]:  # a local store rolls; on S3 a flush seals
                st.writable_partition(TOPIC, 0).roll(offs[0])
            st.append(RecordBatch.from_records(TOPIC, _rows(offs)))
            st.flush()
    return segs


def _cold(make_fs, url: str = "s3://bucket/s", block: int = BLOCK):
    """A reader with nothing cached: (store, partition, fs) with the manifest loaded."""
    fs = make_fs(block)
    st = Store.open(url, fs=fs)
    pl = st.partition(TOPIC, 0)
    fs.stats.reset()
    return st, pl, fs


def _requests(fs) -> dict:
    return fs.stats.snapshot()["requests"]


def test_counts_and_bounds_need_no_request(make_fs):
    segs = _gapped_store("s3://bucket/s", make_fs())
    every = sorted(o for v in segs.values() for o in v)
    st, pl, fs = _cold(make_fs)
    assert [s.base for s in pl.segments] == [0, 100, 200]
    assert pl.record_count() == len(every)
    assert (pl.first_offset, pl.last_offset, pl.next_offset) == (0, 1199, 1200)
    have = set(every)
    for o in range(-3, 1210):
        assert pl.holds(o) == (o in have), o
        nxt = next((x for x in every if x >= o), None)
        assert pl.offset_at_or_after(o) == nxt, o
    assert _requests(fs) == {}
    st.close()


@pytest.mark.parametrize("target,segment", [(50, 100), (99, 100), (150, 200), (170, 200)])
def test_read_from_a_gap_at_the_end_of_a_segment_skips_it(make_fs, target, segment):
    """The target lies in the range of the segment before ``segment`` but after its last
    offset: only ``segment``'s .bcq and .log are fetched."""
    _gapped_store("s3://bucket/s", make_fs())
    st, pl, fs = _cold(make_fs, block=1 << 20)  # one cache block per object
    r = pl.read(target, max_records=1)
    assert int(r.offsets[0]) == segment
    assert _requests(fs) == {"GetObject": 2}
    st.close()
    # the replication server's reader starts at the same segment
    from kcompact.reput.reader import BufferPool, PartitionReader
    st, pl, fs = _cold(make_fs, block=1 << 20)
    raw = PartitionReader(pl).read_raw(target, 256, BufferPool())
    assert raw.count >= 1 and raw.next_offset > segment
    assert _requests(fs) == {"GetObject": 2}
    st.close()


def test_read_past_the_end_needs_no_request(make_fs):
    _gapped_store("s3://bucket/s", make_fs())
    st, pl, fs = _cold(make_fs)
    for target in (1200, 1500, 10**12):
        r = pl.read(target, max_records=5)
        assert len(r) == 0 and r.next_offset == max(target, 1200)
    from kcompact.reput.reader import BufferPool, PartitionReader
    assert PartitionReader(pl).read_raw(1200, 1 << 20, BufferPool()).buf is None
    assert _requests(fs) == {}
    st.close()


def test_a_short_read_fetches_one_block_of_a_large_bcq(make_fs):
    """Segment 200 has a 48000-byte .bcq (12 blocks of 4 KiB): reading 3 records from the
    middle fetches the block of the .bcq that holds their entries, and the .log block(s)
    of their bytes; never the whole .bcq. (A format-1 store: a lean index is read whole, one
    request, see the next test.)"""
    _gapped_store("s3://bucket/s", make_fs(), seal_format=1)
    st, pl, fs = _cold(make_fs)
    seg = pl.segments[2]
    assert seg.desc.bcq_size == 1000 * B.ENTRY_SIZE > 10 * BLOCK
    r = pl.read(700, max_records=3)
    assert r.offsets.tolist() == [700, 701, 702]
    assert [x.offset for x in r.records()] == [700, 701, 702]
    snap = fs.stats.snapshot()
    assert snap["requests"]["GetObject"] <= 1 + 2  # one .bcq block, at most two .log blocks
    assert snap["bytes_down"] <= 3 * BLOCK
    # a read of the whole rest of the segment takes the .bcq whole (one request)
    fs.stats.reset()
    r = pl.read(205)
    assert len(r) == 995
    assert _requests(fs)["GetObject"] >= 1
    st.close()


def test_a_short_read_of_a_format_2_segment_is_two_requests(make_fs):
    """A sealed format-2 segment on S3: its lean index whole (one request, its entries
    compressed) and the .log block of the batch holding the records (a cache block larger
    than the batch, as the default 4 MiB is larger than a 1 MiB batch)."""
    _gapped_store("s3://bucket/s", make_fs())
    st, pl, fs = _cold(make_fs, block=1 << 20)
    seg = pl.segments[2]
    assert seg.desc.format == 2 and seg.desc.bcq_size < 1000 * B.ENTRY_SIZE / 2
    r = pl.read(700, max_records=3)
    assert [x.offset for x in r.records()] == [700, 701, 702]
    assert _requests(fs) == {"GetObject": 2}
    st.close()


def test_lookups_after_a_compaction(make_fs):
    """After a compaction the bitmaps hold exactly the kept offsets, and a read that starts
    in a gap the compaction left goes straight to the next kept record."""
    url = "s3://bucket/s"
    with Store.open(url, fs=make_fs(), writer="w", create=True,
                    options=PARTITION) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 16384})
        # keys 0..99 twice: the second round overwrites the first (offsets 0..99 go away),
        # then 300 unique keys
        st.append(RecordBatch.from_records(TOPIC, _rows(range(0, 200), keys=lambda o: o % 100)))
        st.flush()
        st.append(RecordBatch.from_records(TOPIC, _rows(range(200, 500))))
        st.flush()
    with Store.open(url, fs=make_fs()) as st:
        compact_store(st, force=True, options=CompactionOptions(offset_map_memory=1 << 20))
    kept = list(range(100, 500))
    st, pl, fs = _cold(make_fs, url)
    assert pl.record_count() == len(kept) and pl.first_offset == 100
    assert [o for o in range(0, 510) if pl.holds(o)] == kept
    assert pl.offset_at_or_after(0) == 100 and pl.offset_at_or_after(500) is None
    assert _requests(fs) == {}
    r = pl.read(30, max_records=2)
    assert r.offsets.tolist() == [100, 101]
    st.close()


def test_local_store_gives_the_same_answers(tmp_path):
    url = str(tmp_path / "local")
    segs = _gapped_store(url)
    every = sorted(o for v in segs.values() for o in v)
    have = set(every)
    with Store.open(url) as st:
        pl = st.partition(TOPIC, 0)
        assert pl.record_count() == len(every)
        for o in range(-3, 1210, 7):
            assert pl.holds(o) == (o in have)
            assert pl.offset_at_or_after(o) == next((x for x in every if x >= o), None)
        for target in (50, 99, 150, 700, 1199, 1200):
            want = [x for x in every if x >= target][:3]
            assert pl.read(target, max_records=3).offsets.tolist() == want
            assert np.array_equal(
                pl.read(target, max_records=3).offsets,
                np.asarray(want, np.int64))


def test_short_reads_match_the_local_store(make_fs, tmp_path):
    """Every target, a few read sizes: the S3 store (by-range .bcq reads, 4 KiB blocks)
    returns the same records as the local store (whole indexes)."""
    local = str(tmp_path / "local")
    _gapped_store(local)
    _gapped_store("s3://bucket/s", make_fs())
    st, pl, fs = _cold(make_fs)
    with Store.open(local) as lst:
        lpl = lst.partition(TOPIC, 0)
        for target in range(-1, 1205, 13):
            for n in (1, 3, 85, 86, 200):
                got, want = pl.read(target, max_records=n), lpl.read(target, max_records=n)
                assert got.offsets.tolist() == want.offsets.tolist()
                assert list(got.records()) == list(want.records())
                assert got.next_offset == want.next_offset
    assert fs.stats.snapshot()["bytes_down"] < 2 * 48000 + 200_000  # no .bcq fetched twice
    st.close()
