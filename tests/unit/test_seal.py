"""Sealing a rolled segment into store format 2 (reput/seal.py, docs/formats/segment-v2.md).

A writer's rolled segments become Kafka batches + a lean index at its next flush, through the
compaction swap: the records read back are the ones appended (offsets, timestamps, keys, values,
headers, tombstones); store.json goes to format 2 first; a crash at every rename and at every
write of the seal reopens to the format-1 or the format-2 segment, never a mix, and verify is
clean; a store opened with ``seal_format=1`` keeps format 1; a compaction holding the partition
makes the seal step aside.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kcompact.reput import bcq2 as B2
from kcompact.reput.backend import LocalBackend
from kcompact.reput.config import WriterOptions
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.seal import seal_segment
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

TOPIC = "t"


class Crash(Exception):
    pass


def _records(n: int = 900) -> list[Record]:
    out = []
    for o in range(n):
        key = None if o % 41 == 7 else b"k%03d" % (o % 300)
        value = None if o % 13 == 2 and key is not None else b'{"n": %d, "s": "shipped"}' % o
        hdr = (("h", b"%d" % o),) if o % 9 == 0 else ()
        out.append(Record(TOPIC, 0, 2 * o, 1_700_000_000_000 + o, key, value, hdr))
    return out


def _formats(d: str) -> list[int]:
    pdir = os.path.join(d, "partitions", TOPIC, "0")
    out = []
    for name in sorted(os.listdir(pdir)):
        if name.endswith(".bcq") and os.path.getsize(os.path.join(pdir, name)):
            with open(os.path.join(pdir, name), "rb") as f:
                out.append(2 if B2.is_lean(f.read(8)) else 1)
    return out


def _write(d: str, recs, **opts) -> None:
    s = Store.open(d, writer="w", create=True, options=WriterOptions(**opts))
    # zstd named: a new store's default (producer) stores consumed records uncompressed
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "compression.type": "zstd"})
    for i in range(0, len(recs), 100):
        s.append(RecordBatch.from_records(TOPIC, recs[i:i + 100]))
    s.flush()
    s.close()


def _read(d: str) -> list[Record]:
    s = Store.open(d)
    try:
        assert verify_store(s).ok
        return list(s.iter_records(TOPIC, 0))
    finally:
        s.close()


def test_rolled_segments_are_sealed_into_format_2(tmp_path):
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs)
    f = _formats(d)
    assert len(f) >= 4 and f[:-1] == [2] * (len(f) - 1) and f[-1] == 1  # the active stays 1
    assert _read(d) == recs
    with open(os.path.join(d, "store.json")) as fh:
        assert json.load(fh)["format_version"] == 2
    s = Store.open(d)
    pl = s.partition(TOPIC, 0)
    assert pl.read(2 * 451, max_records=1).records().__next__() == recs[451]
    assert sum(seg.log_size for seg in pl.sealed_segments) < 16384 * (len(f) - 1) / 3
    s.close()


def test_seal_format_1_keeps_format_1(tmp_path):
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs, seal_format=1)
    assert set(_formats(d)) == {1}
    assert _read(d) == recs


@pytest.mark.parametrize("op", ["rename", "write_atomic", "sync_dir"])
def test_a_crash_at_every_step_of_the_seal_recovers(tmp_path, op):
    recs = _records()
    orig = getattr(LocalBackend, op)
    seen_v2 = seen_v1 = 0
    for k in range(1, 200):
        d, crash_dir = str(tmp_path / f"s{k}"), str(tmp_path / f"crash{k}")
        calls = {"n": 0, "armed": False}

        def hooked(self, *a, **kw):
            if calls["armed"]:
                calls["n"] += 1
                if calls["n"] == k:
                    shutil.copytree(d, crash_dir)
                    raise Crash(k)
            return orig(self, *a, **kw)

        from kcompact.reput import seal as seal_mod
        orig_seal = seal_mod.seal_segment

        def armed_seal(pl, base):
            calls["armed"] = True
            try:
                return orig_seal(pl, base)
            finally:
                calls["armed"] = False
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LocalBackend, op, hooked)
            mp.setattr(seal_mod, "seal_segment", armed_seal)
            try:
                _write(d, recs)
            except Crash:
                pass
        if not os.path.isdir(crash_dir):
            break  # every step was tried
        # a writer's open finishes or rolls back the swap; readers see every record
        s = Store.open(crash_dir, writer="w")
        s.writable_partition(TOPIC, 0)
        s.close()
        f = _formats(crash_dir)
        seen_v2 += f.count(2)
        seen_v1 += f.count(1)
        got = _read(crash_dir)
        assert got == recs[:len(got)] and len(got) >= 100 * (len(got) // 100)
    assert k > 2 and seen_v1 and seen_v2


def test_a_compaction_holding_the_partition_makes_the_seal_step_aside(tmp_path):
    from kcompact.reput import filenames as fn
    from kcompact.reput.locks import FileLock
    from kcompact.reput.seal import seal_segment
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs, seal_format=1)
    s = Store.open(d, writer="w")
    pl = s.writable_partition(TOPIC, 0)
    pl.require_format = s.require_format
    lock = FileLock(pl.local_fs, f"{pl.dir}/{fn.COMPACTION_LOCK}")
    assert lock.acquire()
    try:
        assert seal_segment(pl, pl.segments[0].base) is False
    finally:
        lock.release()
    assert seal_segment(pl, pl.segments[0].base) is True
    assert pl.segments[0].format == 2
    s.close()
    assert _read(d) == recs


def test_one_record_reads_reuse_the_batch_they_walked_and_see_a_swap(tmp_path):
    """A reader reading one record at a time through a format-2 segment reads and checks each
    batch once (the partition keeps the last batch it walked), returns exactly the records
    appended, and after a compaction swap reads the new files, not the kept batch."""
    from kcompact.compaction import Compactor
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs)
    s = Store.open(d)
    pl = s.partition(TOPIC, 0)
    sealed = [seg for seg in pl.segments if seg.format == 2]
    assert sealed
    reads = []
    for seg in pl.segments:  # each segment's reads of its .log, counted
        plain, plain_bytes = seg.read_log, seg.log_bytes
        seg.read_log = (lambda plain: lambda start, length: reads.append(start)
                        or plain(start, length))(plain)
        seg.log_bytes = (lambda plain: lambda start, n: reads.append(start)
                         or plain(start, n))(plain_bytes)
    for r in recs:
        b = pl.read(r.offset, max_records=1)
        assert list(b.records()) == [r]
    # each batch read once; the active segment's (format 1) records one read each
    batches = sum(len(seg.index().batches()[0]) for seg in sealed)
    active = sum(seg.count() for seg in pl.segments if seg.format == 1)
    assert len(reads) == batches + active < len(recs)
    s.close()
    with Store.open(d, writer="w") as w:
        Compactor(w).compact_partition(TOPIC, 0, force=True)
    s2 = Store.open(d)
    pl2 = s2.partition(TOPIC, 0)
    got = list(pl2.iter_records())
    assert got and all(x.offset in {r.offset for r in recs} for x in got)
    # the old view, refreshed, reads what the new files hold, record by record
    pl.refresh()
    assert [next(pl.read(x.offset, max_records=1).records()) for x in got] == got
    s2.close()


def test_a_reader_listing_a_segment_before_its_seal_reads_it_after(tmp_path):
    """A read-only view that listed a format-1 segment which a writer then seals (its .bcq
    replaced by a shorter lean index) re-lists and reads the format-2 segment: the same records,
    no error (the test_kv follower met this as a bare ValueError from mmap)."""
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs, seal_format=1)
    view = Store.open(d)
    pl = view.partition(TOPIC, 0)
    assert set(_formats(d)) == {1}
    before = [seg.format for seg in pl.segments]
    with Store.open(d, writer="w") as w:  # a writer that seals the rolled segments
        wp = w.partition(TOPIC, 0)
        wp.require_format = w.require_format
        for seg in wp.sealed_segments:
            assert seal_segment(wp, seg.base)
    assert 2 in _formats(d) and before[0] == 1
    got = [next(pl.read(r.offset, max_records=1).records()) for r in recs]
    assert got == recs
    view.close()


def test_a_reader_whose_listed_segments_a_compaction_removed_reads_the_new_ones(tmp_path):
    """A read-only view lists format-1 segments whose files it has not opened yet; a compaction
    replaces them (their .log/.bcq removed). Its next read re-lists and reads the compacted
    segments instead of failing on the missing file (test_kv's store follower met this as
    "cannot map ...bcq: No such file or directory")."""
    from kcompact.compaction import Compactor
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs, seal_format=1)
    view = Store.open(d)
    listed = [seg.base for seg in view.partition(TOPIC, 0).segments]
    real_map, swapped = LocalBackend.map, []

    def map_after_a_compaction(fs, path, size=None):
        # the compaction swaps the segments between the view's listing and its first map
        if path.endswith(".bcq") and not swapped:
            swapped.append(path)
            with Store.open(d, writer="w") as w:
                Compactor(w).compact_partition(TOPIC, 0, force=True)
        return real_map(fs, path, size)
    LocalBackend.map = map_after_a_compaction
    try:
        got, off = [], listed[1]  # from the view's second segment: merged away below
        while True:
            b = view.reader(TOPIC, 0).read(off, max_records=50)
            if len(b) == 0:
                break
            got += list(b.records())
            off = b.next_offset
    finally:
        LocalBackend.map = real_map
    pdir = os.path.join(d, "partitions", TOPIC, "0")
    assert swapped and not os.path.exists(os.path.join(d, swapped[0]))  # mapped after removal
    assert any(not os.path.exists(os.path.join(pdir, f"{b:020d}.bcq")) for b in listed)
    with Store.open(d) as fresh:
        want = [r for r in fresh.partition(TOPIC, 0).iter_records() if r.offset >= listed[1]]
    assert got == want and got
    view.close()


def _background_writer(d: str, recs, flush_each: bool = False) -> Store:
    """An open writer with ``seal="background"`` that appended ``recs`` in batches of 100
    (``flush_each``: each followed by a flush, which hands the segments rolled so far to the
    seal thread and does not wait for it)."""
    s = Store.open(d, writer="w", create=True, options=WriterOptions(seal="background"))
    # zstd named: a new store's default (producer) stores consumed records uncompressed
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "compression.type": "zstd"})
    for i in range(0, len(recs), 100):
        s.append(RecordBatch.from_records(TOPIC, recs[i:i + 100]))
        if flush_each:
            s.flush()
    return s


def test_a_background_sealer_seals_while_the_writer_appends(tmp_path):
    d = str(tmp_path / "s")
    recs = _records()
    s = _background_writer(d, recs, flush_each=True)
    s.drain_seals()
    f = _formats(d)
    assert len(f) >= 4 and f[:-1] == [2] * (len(f) - 1) and f[-1] == 1
    assert list(s.iter_records(TOPIC, 0)) == recs
    s.close()
    assert s.seals_left == 0
    assert _read(d) == recs


def test_a_closing_background_writer_leaves_its_last_rolls_format_1_for_the_next_writer(
        tmp_path):
    d = str(tmp_path / "s")
    recs = _records()
    s = _background_writer(d, recs)
    s.close()  # (a roll hands the segments rolled before it over; the close's flush, the last)
    assert s.seals_left >= 1
    f = _formats(d)
    assert len(f) >= 4 and f[-2:] == [1, 1]  # the last rolled one was not waited for
    assert _read(d) == recs  # format 1 is a valid store: read and verified
    with open(os.path.join(d, "store.json")) as fh:
        assert json.load(fh)["format_version"] == 2  # a format-2 store holds format-1 segments
    s = Store.open(d, writer="w2", options=WriterOptions(seal="background"))
    s.writable_partition(TOPIC, 0)  # queues what the previous writer left format 1
    s.drain_seals()
    s.close()
    f = _formats(d)
    assert f[:-1] == [2] * (len(f) - 1) and f[-1] == 1
    assert _read(d) == recs


def test_a_background_writer_closing_during_its_seals_leaves_each_segment_whole(tmp_path):
    d = str(tmp_path / "s")
    recs = _records(3000)
    s = _background_writer(d, recs)
    s.flush()
    s.close()  # while the seal thread works through the queue
    f = _formats(d)
    assert len(f) >= 10 and f[-1] == 1
    assert f.count(1) - 1 == s.seals_left  # each queued segment sealed, or left format 1
    assert _read(d) == recs


@pytest.mark.parametrize("field", ["timestamp", "flags", "digest_lo"])
def test_a_one_record_read_refuses_a_record_its_lean_index_entry_does_not_describe(tmp_path,
                                                                                     field):
    """A one-record read of a format-2 segment (the C path that walks, converts and checks in
    one pass) refuses a record whose lean index entry says another timestamp, flags or key
    digest, with the general path's line naming the file, the batch's byte and the field; the
    records around it still read. (A writer's view: a read-only one re-lists the partition and
    reads the index again from disk before it believes a mismatch, in case a compaction swapped
    the files under it; the damage here is made in memory.)"""
    from kcompact.reput.errors import CorruptRecordError
    d = str(tmp_path / "s")
    recs = _records()
    _write(d, recs)
    s = Store.open(d, writer="w")
    pl = s.writable_partition(TOPIC, 0)
    seg = next(seg for seg in pl.segments if seg.format == 2)
    e = seg.index().entries  # decoded once and kept: the read uses these
    i = e.shape[0] // 2
    target = int(e[i]["offset"])
    e[field][i] ^= 1
    with pytest.raises(CorruptRecordError, match="does not match its lean index entry") as ei:
        pl.read(target, max_records=1)
    assert seg.log_path in str(ei.value) and f"byte {int(e[i]['position'])}" in \
        str(ei.value)
    by_offset = {r.offset: r for r in recs}
    for o in (int(e[i - 1]["offset"]), int(e[i + 1]["offset"])):
        assert next(pl.read(o, max_records=1).records()) == by_offset[o]
    s.close()
