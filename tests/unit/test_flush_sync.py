"""Store.flush fsyncs the partitions' files several partitions at once (reput/store.py
``_sync_partitions``), after the commit log's: every file appended to is fsynced before flush
returns, and a failed fsync in any partition fails the flush before the reput checkpoint moves."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kcompact.reput import backend as B
from kcompact.reput.backend import BackendError
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store

T0 = 1_700_000_000_000


def _rows(parts: int, per: int, base: int = 0) -> list:
    return [(p, base + i, T0, b"k%d" % i, b"v" * 100) for i in range(per) for p in range(parts)]


@pytest.fixture
def fsyncs(monkeypatch):
    """(path, thread name) of every fsync; paths in ``fail`` raise EIO."""
    seen: list[tuple[str, str]] = []
    fail: set[str] = set()
    real = os.fsync

    def spy(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        seen.append((path, threading.current_thread().name))
        if any(path.startswith(f) for f in fail):
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(B.os, "fsync", spy)
    return seen, fail


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_flush_syncs_every_partition_file_it_appended_to(tmp_path, fsyncs):
    seen, _ = fsyncs
    with Store.open(str(tmp_path / "s"), writer="w", create=True) as st:
        st.append(RecordBatch.from_records("t", _rows(5, 20)))
        seen.clear()
        st.flush()
        logs = {p for p, _ in seen if p.endswith((".log", ".bcq")) and "/partitions/t/" in p}
        assert len(logs) == 10, seen  # 5 partitions x (.log, .bcq)
        assert {t for p, t in seen if p in logs} <= {f"kcompact-fsync_{i}" for i in range(8)}
        assert any("commitlog" in p for p, _ in seen)
        seen.clear()
        st.flush()  # nothing appended since: no partition file is fsynced again
        assert not [p for p, _ in seen if "/partitions/t/" in p], seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_failed_partition_fsync_fails_the_flush_before_the_checkpoint(tmp_path, fsyncs):
    _, fail = fsyncs
    st = Store.open(str(tmp_path / "s"), writer="w", create=True)
    st.append(RecordBatch.from_records("t", _rows(4, 10)))
    st.flush()
    before = st.commitlog.read_checkpoint()
    st.append(RecordBatch.from_records("t", _rows(4, 10, base=10)))
    fail.add(os.path.realpath(st.fs.local_path(st.writable_partition("t", 2).dir)))
    with pytest.raises(BackendError, match="fsync"):
        st.flush()
    assert st.commitlog.read_checkpoint() == before
    fail.clear()
    st.close()  # the retried flush syncs what failed
    with Store.open(str(tmp_path / "s")) as ro:
        assert all(ro.partition("t", p).record_count() == 20 for p in range(4))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_flush_in_a_forked_child_gets_threads_of_its_own(tmp_path):
    """A child forked after a flush has the parent's pool object without its threads: its own
    flush must not wait on them forever."""
    st = Store.open(str(tmp_path / "s"), writer="w", create=True)
    st.append(RecordBatch.from_records("t", _rows(3, 5)))
    st.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        signal.alarm(30)  # a flush waiting on threads that do not exist: killed, the test fails
        try:
            st.append(RecordBatch.from_records("t", _rows(3, 5, base=5)))
            st.flush()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    st.close()
