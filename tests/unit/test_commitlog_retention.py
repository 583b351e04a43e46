"""Commit-log retention (reput/commitlog.py, docs/formats/commitlog.md "Retention"): a sealed
segment is deleted once it is fully dispatched *and* older than ``commitlog_retention_ms``; a
segment that is not yet dispatched stays whatever its age, and so does the active one. The age
comes from the storage backend (``Backend.mtime_ms``) against the injected clock, on disk and in
memory alike."""

from __future__ import annotations

import os

import pytest

from kcompact.reput import filenames as fn
from kcompact.reput.backend import LocalBackend, MemoryBackend
from kcompact.reput.config import ManualClock, WriterOptions
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store

T0 = 1_700_000_000_000
HOUR = 3600 * 1000
SEG = 1 << 16  # the smallest commit-log segment


def _backend(kind: str, tmp_path, clock: ManualClock):
    if kind == "memory":
        return "memory://x", MemoryBackend(clock=clock)
    return str(tmp_path / "s"), LocalBackend(str(tmp_path / "s"))


def _set_mtime(fs, path: str, ms: int) -> None:
    """Make ``path`` look last written at ``ms`` (what aging the file would do)."""
    if isinstance(fs, MemoryBackend):
        fs.mtimes[path] = ms
    else:
        os.utime(fs.local_path(path), ns=(ms * 1_000_000, ms * 1_000_000))


def _fill(store: Store, segments: int) -> None:
    """Append ~40 KiB batches until the commit log has ``segments`` sealed segments."""
    off = 0
    while len(store.commitlog.segments) < segments + 1:
        rows = [(0, off + i, T0, b"k%d" % (off + i), b"v" * 1000) for i in range(40)]
        store.append(RecordBatch.from_records("t", rows))
        off += 40
    store.flush()


def _on_disk(fs, writer: str = "w") -> list[int]:
    names = fs.listdir(fn.writer_dir(writer))
    return sorted(b for b, kind in filter(None, map(fn.parse_base, names)) if kind == "log")


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_dispatched_segments_past_retention_are_deleted_others_stay(kind, tmp_path):
    clock = ManualClock(T0)
    url, fs = _backend(kind, tmp_path, clock)
    opts = WriterOptions(commitlog_segment_bytes=SEG, commitlog_retention_ms=HOUR)
    st = Store.open(url, fs=fs, writer="w", create=True, options=opts, clock=clock)
    _fill(st, 5)
    cl = st.commitlog
    segs = [(s.base, s.end) for s in cl.segments]
    assert len(segs) >= 6 and _on_disk(fs) == [b for b, _ in segs]
    paths = [fn.commitlog_segment("w", b) for b, _ in segs]
    # ages: the first three sealed 2 h ago, the fourth 59 min ago, the fifth 2 h ago again
    for p, age in zip(paths, [2 * HOUR, 2 * HOUR, 2 * HOUR, HOUR - 60_000, 2 * HOUR]):
        _set_mtime(fs, p, T0 - age)
    for p in paths[5:]:
        _set_mtime(fs, p, T0)

    # dispatched only up to the end of the second segment: the third is old but not
    # dispatched (as after a crash before reput caught up), so it and all after it stay
    assert cl.delete_dispatched(segs[1][1]) == 2
    assert _on_disk(fs) == [b for b, _ in segs[2:]]
    assert cl.start == segs[2][0]

    # everything dispatched (the store's flush): the third goes; the fourth is younger than
    # the retention and stops the deletion, so the (older) fifth stays too
    st.flush()
    assert _on_disk(fs) == [b for b, _ in segs[3:]]

    # an hour later the fourth and fifth are old enough; the active segment always stays
    clock.advance(HOUR)
    st.flush()
    assert _on_disk(fs) == [b for b, _ in segs[5:]]
    assert cl.segments[-1].base == segs[-1][0]
    st.close()

    # the deleted segments are gone for good, the store reopens and holds every record
    st = Store.open(url, fs=fs, writer="w", options=opts, clock=clock)
    assert _on_disk(fs) == [b for b, _ in segs[5:]]
    assert st.next_offset("t", 0) == sum(1 for _ in st.iter_records("t", 0))
    st.close()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_nothing_is_deleted_before_retention(kind, tmp_path):
    clock = ManualClock(T0)
    url, fs = _backend(kind, tmp_path, clock)
    opts = WriterOptions(commitlog_segment_bytes=SEG, commitlog_retention_ms=HOUR)
    st = Store.open(url, fs=fs, writer="w", create=True, options=opts, clock=clock)
    _fill(st, 3)
    bases = _on_disk(fs)
    for b in bases:
        _set_mtime(fs, fn.commitlog_segment("w", b), T0 - HOUR + 1)
    st.flush()
    assert _on_disk(fs) == bases  # all dispatched, none old enough
    clock.advance(1)
    st.flush()
    assert _on_disk(fs) == bases[-1:]  # now all sealed ones are exactly the retention old
    st.close()


def test_memory_backend_ages_files_with_its_clock():
    clock = ManualClock(T0)
    fs = MemoryBackend(clock=clock)
    f = fs.open_append("a")
    f.write(b"x")
    assert fs.mtime_ms("a") == T0
    clock.advance(5)
    f.write(b"y")
    assert fs.mtime_ms("a") == T0 + 5
    clock.advance(5)
    fs.rename("a", "b")  # a rename keeps the mtime, as on disk
    assert fs.mtime_ms("b") == T0 + 5
    with pytest.raises(FileNotFoundError):
        fs.mtime_ms("a")
