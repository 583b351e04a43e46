"""Corruption on purpose (LevelDB's log_test.cc style) on stores in tmp_path.

(a) torn tails of the commit log and of partition logs, cut at every byte of the last record;
(b) a flipped byte in a sealed partition segment is reported with its file and position and
    never served; (c) a damaged or missing .bcq is rebuilt identical; (d) a bad store.json is
    refused; (e) a second process cannot take a writer id that is in use.

A "crash" is taken as a copy of the store directory while the writer is still open: every byte
the writer wrote is in the copy (as after a SIGKILL), the reput checkpoint is the one of the
last flush.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kcompact.reput import bcq as B
from kcompact.reput import filenames as fn
from kcompact.reput import segment_list as SL
from kcompact.reput.backend import LocalBackend
from kcompact.reput.config import WriterOptions
from kcompact.reput.errors import (CorruptRecordError, StoreFormatError, StoreLockedError,
                          StoreNotFoundError)
from kcompact.reput.record import Record, RecordBatch, encode, scan
from kcompact.reput.segment import describe_files
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

TOPIC = "t"
SEGMENT_BYTES = 16384


# -- helpers ----------------------------------------------------------------------------------


def _gen(rng: random.Random, p: int, off: int, big: bool = False) -> Record:
    key = rng.choice([None, b"", b"key-%d" % rng.randrange(40)])
    size = rng.randrange(300, 1500) if big else rng.randrange(0, 60)
    value = rng.choice([None, b"", rng.randbytes(max(size, 1))])
    hs = rng.choice([(), (("h", None),), (("h", b"x"), ("trace", b""))])
    return Record(TOPIC, p, off, off * 1000 + p, key, value, hs)


def _append(s: Store, recs: list[Record]) -> None:
    assert s.append(RecordBatch.from_records(TOPIC, recs)) == len(recs)


def _contents(s: Store) -> dict[int, list[Record]]:
    return {p: list(s.iter_records(TOPIC, p)) for p in s.partitions(TOPIC)}


def _model(recs: list[Record]) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for r in recs:
        out.setdefault(r.partition, []).append(r)
    return out


def _files(root: Path, sub: str) -> dict[str, bytes]:
    base = root / sub
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(base.rglob("*"))
            if p.is_file() and p.suffix != ".lock"}


def _segment_files(root: Path) -> dict[str, bytes]:
    """The partitions' .log and .bcq files. (Their segment lists differ from a crash
    snapshot's by design: a crashed writer's list names its active segment open, a closed
    store's lists it with its sizes; each is checked by the store's strict open. So do their
    ledgers, which follow the lists: reput/ledger.py.)"""
    return {k: v for k, v in _files(root, fn.PARTITIONS_DIR).items()
            if not k.endswith(fn.SEGMENT_LIST) and not k.endswith("/ledger.json")}


def _last(root: Path, rel: str, suffix: str) -> Path:
    return sorted((root / rel).glob(f"*{suffix}"))[-1]


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip(path: Path, pos: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ mask]))


def _copy(src: Path, dst: Path) -> Path:
    """Make ``dst`` a copy of ``src`` (lock files aside), rewriting only what differs."""
    want = _files(src, "")
    have = {str(p.relative_to(dst)): p for p in dst.rglob("*") if p.is_file()} \
        if dst.exists() else {}
    for rel, p in have.items():
        if rel not in want and p.suffix != ".lock":
            p.unlink()
    for rel, data in want.items():
        p = dst / rel
        if rel in have and p.stat().st_size == len(data) and p.read_bytes() == data:
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return dst


def _crash_snapshot(root: Path, *, flush_last: bool = False):
    """A store with two partitions; the last record R (partition 1) is appended after the last
    flush (unless ``flush_last``); returns (copy of the store as the crash leaves it, records
    before R, R)."""
    rng = random.Random(42)
    orig = root / "orig"
    Store.create(str(orig)).close()
    s = Store.open(str(orig), writer="w")
    s.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES})
    before = []
    nxt = {0: 0, 1: 100}
    for _ in range(6):
        batch = []
        for _ in range(rng.randrange(3, 12)):
            p = rng.choice([0, 1])
            batch.append(_gen(rng, p, nxt[p], big=True))
            nxt[p] += rng.choice([1, 1, 2])
        _append(s, batch)
        before += batch
    s.flush()
    last = Record(TOPIC, 1, nxt[1] + 3, 77, b"last-key", b"the last value",
                  (("h", None), ("g", b"x")))
    _append(s, [last])
    if flush_last:
        s.flush()
    snap = _copy(orig, root / "snap")
    s.close()
    return snap, before, last


def _commitlog_segment(root: Path) -> Path:
    return _last(root, fn.writer_dir("w"), fn.LOG_SUFFIX)


def _partition_dir(p: int) -> str:
    return fn.partition_dir(TOPIC, p)


def _drop_last_from_partition(root: Path, size: int, *, keep_bytes: int = 0,
                              keep_entry: bool = False) -> None:
    """Cut the last record of partition 1 (``size`` bytes) from its .log, leaving
    ``keep_bytes`` of it, and drop its .bcq entry unless ``keep_entry``."""
    log = _last(root, _partition_dir(1), fn.LOG_SUFFIX)
    idx = log.with_suffix(fn.INDEX_SUFFIX)
    _truncate(log, log.stat().st_size - size + keep_bytes)
    if not keep_entry:
        _truncate(idx, idx.stat().st_size - B.ENTRY_SIZE)


# -- (a) torn tails ---------------------------------------------------------------------------


def test_torn_commit_log_tail_at_every_byte(tmp_path):
    """The crash hit while the last record was being written to the commit log, before reput
    dispatched it: the store opens with exactly the records before it, and takes it again."""
    snap, before, last = _crash_snapshot(tmp_path)
    size = len(encode([last]))
    seg_size = _commitlog_segment(snap).stat().st_size
    for cut in range(size):
        work = _copy(snap, tmp_path / "work")
        _truncate(_commitlog_segment(work), seg_size - size + cut)
        _drop_last_from_partition(work, size, keep_bytes=cut if cut % 2 else 0)
        with Store.open(str(work), writer="w") as s:
            assert _contents(s) == _model(before), cut
            assert s.stats == {"appended": 0, "dispatched": 0, "skipped": 0}
            assert _commitlog_segment(work).stat().st_size == seg_size - size  # tail cut
            if cut % 9 == 0:
                _append(s, [last])
        if cut % 9 == 0:
            with Store.open(str(work), writer="w") as s:
                assert _contents(s) == _model(before + [last])
                assert s.stats["dispatched"] == 0
            # byte for byte what the uncrashed writer had
            assert _segment_files(work) == _segment_files(snap)


@pytest.mark.parametrize("keep_entry", [False, True], ids=["entry-dropped", "entry-past-end"])
def test_torn_partition_tail_is_redispatched_at_every_byte(tmp_path, keep_entry):
    """The commit log holds the last record whole; the partition .log holds only a prefix of it
    (its .bcq entry missing, or pointing past the end of the .log): reopening re-dispatches it
    from the commit log, exactly once, to the same bytes."""
    snap, before, last = _crash_snapshot(tmp_path)
    size = len(encode([last]))
    want_files = _segment_files(snap)
    for cut in range(size):
        work = _copy(snap, tmp_path / "work")
        _drop_last_from_partition(work, size, keep_bytes=cut, keep_entry=keep_entry)
        with Store.open(str(work), writer="w") as s:
            assert _contents(s) == _model(before + [last]), cut
            assert s.stats == {"appended": 0, "dispatched": 1, "skipped": 0}
        assert _segment_files(work) == want_files, cut


def test_whole_record_in_partition_log_but_not_indexed(tmp_path):
    """Killed between the .log write and the .bcq write: the record is indexed from the .log
    and its re-dispatch from the commit log is skipped."""
    snap, before, last = _crash_snapshot(tmp_path)
    want_files = _segment_files(snap)
    idx = _last(snap, _partition_dir(1), fn.INDEX_SUFFIX)
    _truncate(idx, idx.stat().st_size - B.ENTRY_SIZE)
    with Store.open(str(snap), writer="w") as s:
        assert _contents(s) == _model(before + [last])
        assert s.stats == {"appended": 0, "dispatched": 0, "skipped": 1}
    assert _segment_files(snap) == want_files


def test_read_only_open_of_a_crashed_store_changes_nothing(tmp_path):
    snap, before, last = _crash_snapshot(tmp_path)
    size = len(encode([last]))
    _truncate(_commitlog_segment(snap), _commitlog_segment(snap).stat().st_size - size // 2)
    _drop_last_from_partition(snap, size, keep_bytes=size // 3)
    files = _files(snap, "")
    with Store.open(str(snap)) as s:
        assert _contents(s) == _model(before)   # the torn bytes are never served
    assert _files(snap, "") == files


@pytest.mark.parametrize("partition_has_it", [False, True])
def test_issue_checkpoint_past_the_end_of_the_commit_log(tmp_path, partition_has_it):
    """The reput checkpoint survived but the commit log lost its tail (fsync=never and a power
    cut, or a corrupt last record cut by recovery). Appends after the reopen land at the new
    end of the commit log and must be dispatched from there: none may be lost."""
    snap, before, last = _crash_snapshot(tmp_path, flush_last=True)
    size = len(encode([last]))
    seg_size = _commitlog_segment(snap).stat().st_size
    have = before + ([last] if partition_has_it else [])
    more = [Record(TOPIC, 1, last.offset + i, 5, b"k%d" % i, b"v" * (30 + i)) for i in range(1, 6)]
    more += [Record(TOPIC, 0, 10_000 + i, 5, None, b"w" * i) for i in range(4)]
    NO_FSYNC = WriterOptions(fsync="never")  # the setting under which this really happens
    for cut in range(size):
        work = _copy(snap, tmp_path / "work")
        _truncate(_commitlog_segment(work), seg_size - size + cut)
        if not partition_has_it:
            _drop_last_from_partition(work, size)
        with Store.open(str(work), writer="w", options=NO_FSYNC) as s:
            assert _contents(s) == _model(have), cut
            if not partition_has_it:
                assert s.append(RecordBatch.from_records(TOPIC, [last])) == 1, cut
                assert _contents(s) == _model(before + [last]), cut
            if cut % (3 if partition_has_it else 9):
                continue
            _append(s, more[:3])
            _append(s, more[3:])
            assert _contents(s) == _model(before + [last] + more)
        with Store.open(str(work), writer="w", options=NO_FSYNC) as s:
            assert _contents(s) == _model(before + [last] + more)
            assert s.stats["dispatched"] == 0


def test_torn_tail_across_commit_log_segments(tmp_path):
    """Small commit-log segments: the torn record is in the newest of several segments, and the
    older segments' records are all dispatched."""
    rng = random.Random(9)
    root = tmp_path / "orig"
    Store.create(str(root)).close()
    opts = WriterOptions(commitlog_segment_bytes=1 << 16)
    recs = []
    with Store.open(str(root), writer="w", options=opts) as s:
        for i in range(40):
            batch = [_gen(rng, 0, len(recs) + j, big=True) for j in range(10)]
            _append(s, batch)
            recs += batch
            if i == 20:
                s.flush()
        snap = _copy(root, tmp_path / "snap")
    segs = sorted((snap / fn.writer_dir("w")).glob("*.log"))
    assert len(segs) >= 3
    last_size = len(encode([recs[-1]]))
    _truncate(segs[-1], segs[-1].stat().st_size - last_size // 2)
    _drop_last_from_partition_p0(snap, recs)
    with Store.open(str(snap), writer="w", options=opts) as s:
        assert _contents(s) == _model(recs[:-1])


def _drop_last_from_partition_p0(root: Path, recs: list[Record]) -> None:
    """Remove every record after the last checkpoint from partition 0 (never dispatched)."""
    log = _last(root, _partition_dir(0), fn.LOG_SUFFIX)
    size = len(encode([recs[-1]]))
    _truncate(log, log.stat().st_size - size)
    idx = log.with_suffix(fn.INDEX_SUFFIX)
    _truncate(idx, idx.stat().st_size - B.ENTRY_SIZE)


def test_issue_failed_writer_open_releases_its_locks(tmp_path):
    """A writer open that fails during recovery must not keep the commit-log (or partition)
    locks: following the error's advice and opening again from the same process works."""
    snap, before, last = _crash_snapshot(tmp_path)
    cp = snap / fn.reput_checkpoint("w")
    cp.write_text("{not json")
    with pytest.raises(CorruptRecordError, match="delete it"):
        Store.open(str(snap), writer="w")
    cp.unlink()                                   # what the message says to do
    with Store.open(str(snap), writer="w") as s:  # re-dispatches everything: all skipped
        assert _contents(s) == _model(before + [last])
        assert s.stats["dispatched"] == 0 and s.stats["skipped"] == len(before) + 1
    # a corrupt record in a sealed commit-log segment stops the re-dispatch half-way
    root = tmp_path / "two"
    Store.create(str(root)).close()
    opts = WriterOptions(commitlog_segment_bytes=1 << 16)
    rng = random.Random(8)
    recs = [_gen(rng, p, i, big=True) for i in range(200) for p in (0, 1)]
    with Store.open(str(root), writer="w", options=opts) as s:
        _append(s, recs)
    (root / fn.reput_checkpoint("w")).unlink()
    # in the second segment: the first one is dispatched (its partitions opened for write,
    # their locks taken) before the bad header stops the re-dispatch
    second = sorted((root / fn.writer_dir("w")).glob("*.log"))[1]
    magic = int(scan(np.fromfile(second, np.uint8)).positions[10]) + 8
    _flip(second, magic)
    with pytest.raises(CorruptRecordError):
        Store.open(str(root), writer="w", options=opts)
    _flip(second, magic)
    with Store.open(str(root), writer="w", options=opts) as s:
        assert _contents(s) == _model(recs)


# -- (b) a flipped byte in a sealed segment ---------------------------------------------------


#: these tests damage format-1 segments (records and 48-byte entries where they lie; a format-1
#: .bcq is rebuilt from its .log): rolled segments stay format 1. Format 2's checks:
#: test_segment_v2.py, test_seal.py, test_cli.py's verify of a damaged batch and lean index
F1 = WriterOptions(seal_format=1)


def _sealed_store(root: Path) -> tuple[Path, list[Record]]:
    rng = random.Random(3)
    Store.create(str(root)).close()
    recs = [_gen(rng, 0, 10 + 2 * i, big=True) for i in range(80)]
    recs = [Record(r.topic, r.partition, r.offset, r.timestamp, r.key,
                   r.value if r.value else b"x" * 500, r.headers) for r in recs]
    with Store.open(str(root), writer="w", options=F1) as s:
        s.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES})
        for i in range(0, 80, 8):
            _append(s, recs[i:i + 8])
        assert len(s.partition(TOPIC, 0).segments) >= 3
    return root, recs


def _segment_entries(root: Path, rel_log: str) -> np.ndarray:
    raw = (root / rel_log).with_suffix(fn.INDEX_SUFFIX).read_bytes()
    return B.view(np.frombuffer(raw, np.uint8)).copy()


def test_flipped_byte_in_sealed_segment_is_reported_never_served(tmp_path):
    root, recs = _sealed_store(tmp_path / "s")
    with Store.open(str(root)) as s:
        pl = s.partition(TOPIC, 0)
        seg = pl.segments[1]                           # sealed: segments follow it
        rel = pl.log_path(seg.base)
    e = _segment_entries(root, rel)
    j = len(e) // 2
    bad = next(i for i, r in enumerate(recs) if r.offset == int(e[j]["offset"]))
    pos, size = int(e[j]["position"]), int(e[j]["size"])
    # every header field, the topic, the key, the value, the headers (a read-only reader
    # retries a mismatch a few times, in case a compaction swap is under way: keep this short)
    hdr = [0, 3, 4, 7, 8, 9, 10, 11, 12, 15, 16, 23, 24, 31, 32, 35, 36, 39, 40, 43, 44]
    body = hdr + [45, size // 2, size - 1]
    for writer, where in ((None, body), ("w", [0, 9, 44, size // 2])):
        with Store.open(str(root), writer=writer) as s:
            for k, i in enumerate(where):
                _flip(root / rel, pos + i)
                with pytest.raises(CorruptRecordError) as ei:
                    s.read(TOPIC, 0, recs[bad].offset)
                err = ei.value
                assert err.path == rel and err.position == pos, i
                assert rel in str(err) and f"byte {pos}" in str(err)
                # everything before it is readable (up to the record before), and after it;
                # unless its header is damaged: then a read from the next offset cannot tell
                # that the damaged record is not at or after that offset (the reader's guard,
                # reput/reader.py), and refuses too, naming the same file
                assert list(s.iter_records(TOPIC, 0, 0, limit=bad)) == recs[:bad]
                try:
                    after = list(s.iter_records(TOPIC, 0, recs[bad].offset + 1))
                except CorruptRecordError as e2:
                    assert i < 45 and e2.path == rel, i
                else:
                    assert after == recs[bad + 1:]
                if k % 4 == 0:  # a missing offset right before the bad one does not skip it
                    with pytest.raises(CorruptRecordError):
                        s.read(TOPIC, 0, recs[bad].offset - 1, max_records=1)
                _flip(root / rel, pos + i)             # undo
            assert list(s.iter_records(TOPIC, 0)) == recs


@pytest.mark.parametrize("field,width", [("offset", 8), ("position", 4), ("size", 4)])
def test_flipped_index_entry_is_reported(tmp_path, field, width):
    """A .bcq entry that no longer matches its .log (wrong offset, position or size) makes the
    read fail; it never returns another record's bytes under the entry's offset."""
    root, recs = _sealed_store(tmp_path / "s")
    with Store.open(str(root)) as s:
        rel = s.partition(TOPIC, 0).log_path(s.partition(TOPIC, 0).segments[0].base)
    idx = (root / rel).with_suffix(fn.INDEX_SUFFIX)
    n = idx.stat().st_size // B.ENTRY_SIZE
    field_at = B.BCQ_DTYPE.fields[field][1]
    for j in (0, n // 2, n - 1):
        for b in sorted({0, 1, width - 1}):
            at = j * B.ENTRY_SIZE + field_at + b
            _flip(idx, at, 0x01)
            with Store.open(str(root)) as s:
                try:
                    got = list(s.read(TOPIC, 0, -(2**63)).records())
                except CorruptRecordError as e:
                    assert e.path == rel
                else:
                    # Only the last entry may instead look torn (pointing past the end of the
                    # .log, bcq.md: readers ignore it, as after a crash): then it is left out,
                    # and a read-only reader indexes the .log tail itself (in memory), so what
                    # is served is exactly the true records, with or without the last one.
                    assert j == n - 1 and field != "offset", (j, b)
                    assert got == recs[:len(got)] and len(got) in (n - 1, n)
            _flip(idx, at, 0x01)
    with Store.open(str(root)) as s:
        assert list(s.iter_records(TOPIC, 0)) == recs


# -- (c) .bcq damaged or missing --------------------------------------------------------------


def _bcq_damages(path: Path, rng: random.Random):
    size = path.stat().st_size
    yield "mid-entry", lambda: _truncate(path, max(0, size - rng.randrange(1, B.ENTRY_SIZE)))
    yield "half", lambda: _truncate(path, (size // B.ENTRY_SIZE // 2) * B.ENTRY_SIZE + 17)
    yield "empty", lambda: _truncate(path, 0)
    yield "deleted", lambda: path.unlink()


def test_damaged_bcq_of_an_open_segment_is_rebuilt_identical_on_writer_open(tmp_path):
    """After a crash, the writer's reopen re-dispatches into the partition and rebuilds a
    damaged or missing .bcq of a segment its segment list names open (the writer was appending
    to it), byte for byte as the writer had written it. A damaged .bcq of a closed segment is
    evidence: the open refuses, naming it, and changes nothing (issue 27)."""
    rng = random.Random(1)
    orig = tmp_path / "orig"
    Store.create(str(orig)).close()
    s = Store.open(str(orig), writer="w", options=F1)
    s.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES})
    recs = [_gen(rng, 0, i, big=True) for i in range(120)]
    _append(s, recs[:100])
    s.flush()
    _append(s, recs[100:])                            # not flushed: re-dispatched on open
    snap = _copy(orig, tmp_path / "snap")
    s.close()
    want = _segment_files(snap)
    bcqs = sorted((snap / _partition_dir(0)).glob("*.bcq"))
    assert len(bcqs) >= 3
    listed = SL.read(LocalBackend(str(snap)), _partition_dir(0)).by_base()
    opened = {k for k, p in enumerate(bcqs) if listed[int(p.stem)].open}
    assert opened and len(opened) < len(bcqs)
    for k, _ in enumerate(bcqs):
        for name, _damage in _bcq_damages(bcqs[k], rng):
            work = _copy(snap, tmp_path / "work")
            target = sorted((work / _partition_dir(0)).glob("*.bcq"))[k]
            dict(_bcq_damages(target, rng))[name]()
            if k in opened:
                with Store.open(str(work), writer="w", options=F1) as s2:
                    assert _contents(s2) == _model(recs), (k, name)
                assert _segment_files(work) == want, (k, name)
            else:
                damaged = _files(work, "")
                with pytest.raises(CorruptRecordError) as ei:
                    with Store.open(str(work), writer="w", options=F1) as s2:
                        _contents(s2)
                assert target.name in str(ei.value), (k, name)
                assert _files(work, "") == damaged, (k, name)


def test_damaged_bcq_of_a_closed_store_is_refused_not_rebuilt(tmp_path):
    """A .bcq damaged in a cleanly closed store: readers and a writer's open refuse the
    partition naming the .bcq (its size disagrees with the segment list), nothing is rebuilt
    or cut, and verify reports it; the undamaged copy still takes appends."""
    rng = random.Random(2)
    root = tmp_path / "s"
    Store.create(str(root)).close()
    recs = [_gen(rng, 0, i, big=True) for i in range(60)]
    with Store.open(str(root), writer="w", options=F1) as s:
        s.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES})
        _append(s, recs)
    extra = [Record(TOPIC, 0, 60 + i, 1, b"e", b"extra") for i in range(3)]
    bcqs = sorted((root / _partition_dir(0)).glob("*.bcq"))
    for k in (0, len(bcqs) - 1):
        for name, _ in _bcq_damages(bcqs[k], rng):
            work = _copy(root, tmp_path / "work")
            target = sorted((work / _partition_dir(0)).glob("*.bcq"))[k]
            dict(_bcq_damages(target, rng))[name]()
            damaged = _files(work, "")
            for writer in (None, "w"):
                with pytest.raises(CorruptRecordError) as ei:
                    with Store.open(str(work), writer=writer, options=F1) as s:
                        _contents(s)
                        s.append(RecordBatch.from_records(TOPIC, extra))
                assert target.name in str(ei.value), (k, name, writer)
            assert _files(work, "") == damaged, (k, name)
            with Store.open(str(work)) as s:
                report = verify_store(s)
            assert not report.ok and any(target.name in p.path for p in report.problems)
    with Store.open(str(root), writer="w", options=F1) as s:
        assert s.append(RecordBatch.from_records(TOPIC, recs[-5:] + extra)) == 3
        assert _contents(s) == _model(recs + extra)


# -- (d) store.json ---------------------------------------------------------------------------


def _store_json(root: Path) -> bytes:
    Store.create(str(root)).close()
    return (root / fn.STORE_JSON).read_bytes()


class _Killed(BaseException):
    """Raised by a hooked backend call: the writer dies there (the store copied first)."""


def _pairs_whole(root: Path) -> None:
    """Every segment file of every partition has the other file of its pair."""
    top = root / fn.PARTITIONS_DIR / TOPIC
    for pdir in top.iterdir() if top.is_dir() else ():
        logs = {p.stem for p in pdir.glob("*" + fn.LOG_SUFFIX)}
        bcqs = {p.stem for p in pdir.glob("*" + fn.INDEX_SUFFIX)}
        assert logs == bcqs, (pdir.name, sorted(logs ^ bcqs))


def test_a_kill_at_every_file_creation_of_a_writer_reopens_every_flushed_record(tmp_path):
    """The writer killed at each file it creates (its commit log's, each partition's first
    segment, each roll's new segment): the store as the kill left it opens for write, every
    partition with a .bcq next to each .log, holding a prefix of what was appended (a record
    in the commit log is re-dispatched) and at least what was flushed; verify is clean. A writer killed between creating a new segment's
    .log and its .bcq used to leave a .log without its .bcq, and every later open failed with
    a bare ENOENT on it (the five-SIGKILL mirror test, KILL_TEST_SEED=171849641)."""
    rng = random.Random(7)
    nxt = {0: 0, 1: 0}
    batches = []
    for r in range(8):
        batch = []
        for p in ([0] if r < 2 else [0, 1]):  # partition 1 starts later, as in a mirror
            for _ in range(8):
                batch.append(_gen(rng, p, nxt[p], big=True))
                nxt[p] += 1
        batches.append(batch)
    orig_open = LocalBackend.open_append
    kills = 0
    for k in range(1, 1000):
        root, snap = tmp_path / f"s{k}", tmp_path / f"kill{k}"
        Store.create(str(root)).close()
        calls = {"n": 0}
        flushed: list[Record] = []

        def hooked(self, path, k=k, root=root, snap=snap, calls=calls):
            calls["n"] += 1
            if calls["n"] == k:
                _copy(root, snap)
                raise _Killed(path)
            return orig_open(self, path)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LocalBackend, "open_append", hooked)
            try:
                s = Store.open(str(root), writer="w")
                s.set_topic_config(TOPIC, {"segment.bytes": SEGMENT_BYTES})
                for i, batch in enumerate(batches):
                    _append(s, batch)
                    if i % 3 == 2:
                        s.flush()
                        flushed = [r for b in batches[:i + 1] for r in b]
                s.close()
            except _Killed:
                pass
        if not snap.exists():
            break  # every creation was tried
        kills += 1
        with Store.open(str(snap), writer="w") as s:
            for p in s.partitions(TOPIC):
                s.writable_partition(TOPIC, p)
            got = _contents(s)
        _pairs_whole(snap)
        want, least = _model([r for b in batches for r in b]), _model(flushed)
        for p in (0, 1):
            have = got.get(p, [])
            assert have == want.get(p, [])[:len(have)], (k, p)
            assert len(have) >= len(least.get(p, [])), (k, p)
        with Store.open(str(snap)) as s:
            assert verify_store(s).ok, k
    assert kills >= 6  # both partitions' first segments and the rolls' were among them


@pytest.mark.parametrize("listed,tail", [(False, b""), (True, b""), (True, b"torn")],
                         ids=["first-segment", "rolled-segment", "rolled-segment-torn"])
def test_an_open_segments_log_without_its_bcq_is_indexed_on_writer_open(tmp_path, listed,
                                                                        tail):
    """What a writer killed between creating a new segment's .log and its .bcq left (before
    the .bcq was created first): a partition's first segment (no segment list yet) or a roll's
    new segment (listed open), its .log empty (or, listed, a torn record), no .bcq. The open
    gives it an empty .bcq (a torn record is cut), the partition takes appends, verify is
    clean."""
    rng = random.Random(11)
    root = tmp_path / "s"
    Store.create(str(root)).close()
    s = Store.open(str(root), writer="w")
    recs = [_gen(rng, 0, i, big=True) for i in range(20)]
    _append(s, recs)
    s.flush()
    if listed:
        assert s.roll() == 1  # partition 0's new active segment, empty, listed open
        s.flush()
    snap = _copy(root, tmp_path / "snap")
    s.close()
    p = 0 if listed else 1
    pdir = snap / _partition_dir(p)
    base = fn.base_name(20 if listed else 0)
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / f"{base}{fn.INDEX_SUFFIX}").unlink(missing_ok=True)
    if tail:
        tail = encode([_gen(rng, p, 20 if listed else 0, big=True)])[:-7]
    (pdir / f"{base}{fn.LOG_SUFFIX}").write_bytes(tail)
    if listed:
        assert SL.read(LocalBackend(str(snap)), _partition_dir(0)).by_base()[20].open
    more = [_gen(rng, p, 20 if listed else 0, big=True)]
    with Store.open(str(snap), writer="w") as s2:
        pl = s2.writable_partition(TOPIC, p)
        assert pl.next_offset == (20 if listed else 0)
        assert (pdir / f"{base}{fn.INDEX_SUFFIX}").stat().st_size == 0
        assert (pdir / f"{base}{fn.LOG_SUFFIX}").stat().st_size == 0
        _append(s2, more)
        s2.flush()
    with Store.open(str(snap)) as s3:
        assert verify_store(s3).ok
        assert _contents(s3) == _model(recs + more)


def test_describing_a_segment_without_its_bcq_names_the_file(tmp_path):
    """A segment-list entry computed from a pair whose .bcq is missing: a CorruptRecordError
    naming the file and what to do, not a bare FileNotFoundError."""
    fs = LocalBackend(str(tmp_path))
    fs.write_atomic("p/00000000000000000000.log", encode([_gen(random.Random(1), 0, 0)]))
    with pytest.raises(CorruptRecordError, match=r"00000000000000000000\.bcq: missing.*verify"):
        describe_files(fs, "p/00000000000000000000.log", "p/00000000000000000000.bcq", 0, None)


def test_truncated_store_json_at_every_byte(tmp_path):
    root = tmp_path / "s"
    raw = _store_json(root)
    whole = len(raw.rstrip())
    for cut in range(len(raw)):
        (root / fn.STORE_JSON).write_bytes(raw[:cut])
        if cut >= whole:
            Store.open(str(root)).close()
            continue
        for writer in (None, "w"):
            with pytest.raises(StoreFormatError):
                Store.open(str(root), writer=writer)
    # a refused store.json was not touched, and no writer directory was made
    assert not (root / fn.COMMITLOG_DIR).exists()


def _edit(raw: bytes, fn_):
    d = json.loads(raw)
    fn_(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize("mangle", [
    lambda raw: b"",
    lambda raw: b"\x00\xff\xfe garbage",
    lambda raw: b"[]",
    lambda raw: b"null",
    lambda raw: b'"store"',
    lambda raw: b"42",
    lambda raw: _edit(raw, lambda d: d.pop("format_version")),
    lambda raw: _edit(raw, lambda d: d.update(format_version="one")),
    lambda raw: _edit(raw, lambda d: d.update(format_version=None)),
    lambda raw: _edit(raw, lambda d: d.pop("digest")),
    lambda raw: _edit(raw, lambda d: d.update(digest="x")),
    lambda raw: _edit(raw, lambda d: d["digest"].update(secret="00" * 15)),
    lambda raw: _edit(raw, lambda d: d["digest"].update(secret="zz" * 16)),
    lambda raw: _edit(raw, lambda d: d["digest"].update(secret=None)),
    lambda raw: _edit(raw, lambda d: d["digest"].update(algorithm="md5")),
    lambda raw: _edit(raw, lambda d: d.pop("store_id")),
    lambda raw: _edit(raw, lambda d: d.update(topics=[])),
    lambda raw: _edit(raw, lambda d: d.update(topics=["orders"])),
    lambda raw: _edit(raw, lambda d: d.update(topics="orders")),
    lambda raw: _edit(raw, lambda d: d.update(topics={"bad/topic": {}})),
    lambda raw: _edit(raw, lambda d: d.update(topics={"ok": {"segment.bytes": 1}})),
    lambda raw: _edit(raw, lambda d: d.update(topics={"ok": {"no.such.key": 1}})),
    lambda raw: _edit(raw, lambda d: d.update(topics={"ok": ["segment.bytes"]})),
    lambda raw: _edit(raw, lambda d: d.update(created_ms="yesterday")),
])
def test_invalid_store_json_is_refused(tmp_path, mangle):
    root = tmp_path / "s"
    (root / fn.STORE_JSON).parent.mkdir(parents=True, exist_ok=True)
    raw = _store_json(root)
    bad = mangle(raw)
    (root / fn.STORE_JSON).write_bytes(bad)
    for writer in (None, "w"):
        with pytest.raises(StoreFormatError):
            Store.open(str(root), writer=writer)
    assert (root / fn.STORE_JSON).read_bytes() == bad
    assert not (root / fn.COMMITLOG_DIR).exists()


def test_newer_format_version_says_upgrade(tmp_path):
    root = tmp_path / "s"
    raw = _store_json(root)
    (root / fn.STORE_JSON).write_bytes(_edit(raw, lambda d: d.update(format_version=99)))
    for writer in (None, "w"):
        with pytest.raises(StoreFormatError, match="upgrade"):
            Store.open(str(root), writer=writer)


def test_not_a_store(tmp_path):
    with pytest.raises(StoreNotFoundError):
        Store.open(str(tmp_path))                       # empty directory
    (tmp_path / "something").write_text("x")
    with pytest.raises(StoreNotFoundError, match="not empty"):
        Store.open(str(tmp_path), writer="w")
    with pytest.raises(StoreNotFoundError):
        Store.open(str(tmp_path / "missing"))
    assert sorted(os.listdir(tmp_path)) == ["something"]
    (tmp_path / "d" / fn.STORE_JSON).mkdir(parents=True)
    with pytest.raises(StoreFormatError):
        Store.open(str(tmp_path / "d"))
    # create=True makes one; creating it twice is refused
    Store.open(str(tmp_path / "new"), create=True).close()
    assert (tmp_path / "new" / fn.STORE_JSON).exists()
    with pytest.raises(Exception, match="already exists"):
        Store.create(str(tmp_path / "new"))


# -- (e) one process per writer id ------------------------------------------------------------


_HOLDER = textwrap.dedent("""
    import sys
    from kcompact.reput.store import Store
    s = Store.open(sys.argv[1], writer="w")
    print("open", flush=True)
    sys.stdin.read()
    s.close()
""")


def test_second_process_with_the_same_writer_is_refused(tmp_path):
    root = tmp_path / "s"
    Store.create(str(root)).close()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError, match="another process"):
            Store.open(str(root), writer="w")
        with Store.open(str(root), writer="other") as s:  # another writer id is fine
            _append(s, [Record(TOPIC, 0, 0, 0, b"k", b"v")])
        with Store.open(str(root)) as s:                   # and so is a reader
            assert s.next_offset(TOPIC, 0) == 1
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    with Store.open(str(root), writer="w") as s:           # released at close
        assert s.next_offset(TOPIC, 0) == 1


def test_writer_lock_is_released_when_the_holder_is_killed(tmp_path):
    root = tmp_path / "s"
    Store.create(str(root)).close()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError):
            Store.open(str(root), writer="w")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    Store.open(str(root), writer="w").close()


def test_same_writer_twice_in_one_process_is_refused(tmp_path):
    root = tmp_path / "s"
    Store.create(str(root)).close()
    with Store.open(str(root), writer="w"):
        with pytest.raises(StoreLockedError):
            Store.open(str(root), writer="w")
