"""Background fdatasync of the commit log under ``fsync=flush`` (reput/backend.py
``_BackgroundSync``, reput/write_path.py ``BACKGROUND_SYNC_BYTES``): every so many appended bytes the
active commit-log segment is fdatasynced by a thread of its own, on a descriptor of its own; the
writer's ``flush`` still fsyncs everything itself, so durability never depends on it. What is
checked: the requests happen (and only under fsync=flush), they name the active segment, a path
that vanished or an fdatasync that fails leaves the thread serving later requests, and the store
reads back every record."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kcompact.reput import backend as B
from kcompact.reput import filenames as fn
from kcompact.reput import write_path as S
from kcompact.reput.config import WriterOptions
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store

T0 = 1_700_000_000_000


@pytest.fixture
def synced(monkeypatch):
    """Record the paths the background thread fdatasyncs (and still sync them)."""
    seen: list[str] = []
    real = os.fdatasync

    def spy(fd):
        if threading.current_thread().name == "kcompact-bg-sync":
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(B.os, "fdatasync", spy)
    monkeypatch.setattr(S, "WRITEBACK_BYTES", 16 << 10)
    monkeypatch.setattr(S, "BACKGROUND_SYNC_BYTES", 64 << 10)
    return seen


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("the background sync thread did not serve the request")
        time.sleep(0.01)


def _append(st: Store, n_batches: int) -> int:
    off = 0
    for _ in range(n_batches):
        rows = [(off % 3, off + i, T0, b"k%d" % (off + i), b"v" * 500) for i in range(40)]
        st.append(RecordBatch.from_records("t", rows))
        off += 40
    return off


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_commit_log_is_synced_in_the_background_as_the_stream_goes(tmp_path, synced):
    st = Store.open(str(tmp_path / "s"), writer="w", create=True,
                    options=WriterOptions(fsync="flush"))
    served = B.BACKGROUND_SYNC.done
    n = _append(st, 30)  # ~600 KiB: several 64 KiB periods
    _wait(lambda: B.BACKGROUND_SYNC.done > served)
    active = os.path.realpath(st.fs.local_path(
        fn.commitlog_segment("w", st.commitlog.segments[-1].base)))
    assert synced and set(synced) <= {active}, synced
    st.close()
    with Store.open(str(tmp_path / "s")) as ro:
        got = sum(ro.partition("t", p).record_count() for p in ro.partitions("t"))
    assert got == n


def test_no_background_sync_without_fsync_at_flush(tmp_path, synced):
    st = Store.open(str(tmp_path / "s"), writer="w", create=True,
                    options=WriterOptions(fsync="never"))
    _append(st, 30)
    st.close()
    time.sleep(0.2)
    assert synced == []


def test_vanished_path_and_failed_sync_leave_the_thread_serving(tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.write_bytes(b"x")
    real = os.fdatasync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(bad):
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(B.os, "fdatasync", failing)
    good = tmp_path / "good"
    good.write_bytes(b"y")
    start = B.BACKGROUND_SYNC.done
    B.BACKGROUND_SYNC.submit(str(tmp_path / "gone"))  # never existed: skipped
    B.BACKGROUND_SYNC.submit(str(bad))                 # fdatasync fails: ignored
    _wait(lambda: B.BACKGROUND_SYNC.done >= start + 1)
    B.BACKGROUND_SYNC.submit(str(good))
    _wait(lambda: B.BACKGROUND_SYNC.done >= start + 2)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_partition_sync_soon_syncs_its_open_files(tmp_path, synced):
    # what a replica's pull calls every BACKGROUND_SYNC_BYTES (replication/replica.py)
    st = Store.open(str(tmp_path / "s"), writer="w", create=True,
                    options=WriterOptions(fsync="never"))
    _append(st, 3)
    pl = st.writable_partition("t", 0)
    served = B.BACKGROUND_SYNC.done
    pl.sync_soon()
    _wait(lambda: B.BACKGROUND_SYNC.done >= served + 2)  # its .log and its .bcq
    pdir = os.path.realpath(st.fs.local_path(pl.dir))
    assert len(synced) == 2 and all(os.path.dirname(p) == pdir for p in synced), synced
    st.close()


def test_sync_pacer_counts():
    """SyncPacer: writeback every ``writeback_every`` bytes, a background sync once the queued
    bytes reach ``sync_every``; reset() after a full sync starts both counts over."""
    from kcompact.reput.store import SyncPacer
    p = SyncPacer(writeback_every=10, sync_every=25)
    assert [p.add(4) for _ in range(3)] == [(False, False), (False, False), (True, False)]
    assert p.add(10) == (True, False)   # 22 queued
    assert p.add(10) == (True, True)    # 32 >= 25: sync, count starts over
    assert p.add(9) == (False, False)
    p.reset()
    assert p.add(9) == (False, False) and p.add(1) == (True, False)
    every_chunk = SyncPacer(writeback_every=0, sync_every=8)
    assert [every_chunk.add(3) for _ in range(3)] == [(True, False), (True, False), (True, True)]


@pytest.mark.skipif(B._SYNC_FILE_RANGE is None, reason="needs Linux's sync_file_range")
def test_writeback_is_queued_by_the_background_thread(tmp_path, monkeypatch):
    """start_writeback (fsync=flush, every WRITEBACK_BYTES) hands the bytes appended since its
    last call to the background thread, which issues sync_file_range on a descriptor of its
    own: the appending thread never waits for a full device queue. Ranges follow each other
    without gaps or overlaps, and the call succeeds on that read-only descriptor."""
    calls: list[tuple[str, str, int, int, int]] = []
    real = B._SYNC_FILE_RANGE

    def spy(fd, start, length, flags):
        rc = real(fd, start, length, flags)
        calls.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}"),
                      start, length, rc))
        return rc

    monkeypatch.setattr(B, "_SYNC_FILE_RANGE", spy)
    f = B._LocalAppendFile(str(tmp_path / "f"), "f")
    served = B.BACKGROUND_SYNC.written_back
    f.write(b"a" * 5000)
    f.start_writeback()
    _wait(lambda: B.BACKGROUND_SYNC.written_back > served)
    f.write(b"b" * 3000)
    f.start_writeback()
    f.start_writeback()  # nothing new: no request
    _wait(lambda: sum(c[3] for c in calls) >= 8000)
    f.close()
    assert {c[0] for c in calls} == {"kcompact-bg-sync"}
    assert {c[1] for c in calls} == {str(tmp_path / "f")}
    assert all(c[4] == 0 for c in calls), calls
    spans = sorted((c[2], c[2] + c[3]) for c in calls)
    assert spans[0][0] == 0 and spans[-1][1] == 8000
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans


def test_sync_skips_a_file_unchanged_since_its_last_fsync(tmp_path, monkeypatch):
    """_LocalAppendFile.sync fsyncs only when something was written (or truncated) through the
    descriptor since its last successful fsync: a flush syncs every open file of every partition
    it writes, and the end of a mirror (flush, roll, close) came to the same files 3-4 times.
    A file just opened is always fsynced once; a failed fsync is retried by the next sync."""
    count = {"n": 0, "fail": False}
    real = os.fsync

    def spy(fd):
        count["n"] += 1
        if count["fail"]:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(B.os, "fsync", spy)
    f = B._LocalAppendFile(str(tmp_path / "f"), "f")
    f.sync()
    f.sync()
    assert count["n"] == 1  # opened (created): synced once, then nothing changed
    f.write(b"abc")
    f.sync()
    f.sync()
    assert count["n"] == 2
    f.truncate(1)
    f.sync()
    assert count["n"] == 3
    f.write(b"x")
    count["fail"] = True
    with pytest.raises(B.BackendError, match="fsync"):
        f.sync()
    count["fail"] = False
    f.sync()  # the failed one did not count as synced
    assert count["n"] == 5
    f.close()
    g = B._LocalAppendFile(str(tmp_path / "f"), "f")  # reopened: synced once again
    g.sync()
    assert count["n"] == 6
    g.close()
