"""Who holds a partition, and who waits for it (reput/locks.py, Store.partition_lock_wait_s).

A process that opens a partition for write writes who it is into the partition's writer.lock:
``writer 'ID', pid N`` for a store opened with a writer id (a mirror, which keeps the partition
while it runs), ``pid N`` for one without (a compaction, which holds it for a while). A mirror
(partition_lock_wait_s > 0) waits for a compaction to let go, and is refused at once, with the
holder named, by a live writer. Each holder here is another Store in this process: flock locks
are per open file, so they conflict as two processes' would; the processes themselves are in
tests/unit/test_recovery.py and tests/integration/test_kafka_endpoint_live.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kcompact.reput import filenames as fn
from kcompact.reput.errors import StoreLockedError
from kcompact.reput.locks import held_by_writer, partition_holder
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store

T = "t"


def _store(tmp_path):
    url = str(tmp_path / "s")
    with Store.open(url, writer="w", create=True) as st:
        st.append(RecordBatch.from_records(T, [(0, 0, 1, b"k", b"v", [])]))
    return url


def _lock_text(url):
    with open(os.path.join(url, fn.partition_dir(T, 0), fn.LOCK_FILE)) as f:
        return f.read()


def test_a_live_writer_is_named_and_refuses_a_waiting_mirror_at_once(tmp_path):
    url = _store(tmp_path)
    with Store.open(url, writer="mirror-a") as a:
        a.writable_partition(T, 0)
        assert _lock_text(url) == f"writer 'mirror-a', pid {os.getpid()}"
        with Store.open(url, writer="mirror-b") as b:
            b.partition_lock_wait_s = 60.0
            t0 = time.monotonic()
            with pytest.raises(StoreLockedError, match=r"\(writer 'mirror-a', pid \d+\); one "
                               "writer per partition") as e:
                b.writable_partition(T, 0)
            assert e.value.by_writer and time.monotonic() - t0 < 30


def test_a_mirror_waits_for_a_compaction_to_let_go(tmp_path):
    url = _store(tmp_path)
    with Store.open(url) as compaction:
        compaction.writable_partition(T, 0)
        assert _lock_text(url) == f"pid {os.getpid()}"
        with Store.open(url, writer="mirror") as m:
            with pytest.raises(StoreLockedError) as e:  # no wait: refused at once
                m.writable_partition(T, 0)
            assert not e.value.by_writer
            m.partition_lock_wait_s = 60.0
            done = threading.Timer(0.5, compaction.release_partition, (T, 0))
            done.start()
            try:
                assert m.writable_partition(T, 0).next_offset == 1  # after the release
            finally:
                done.join()
            assert _lock_text(url) == f"writer 'mirror', pid {os.getpid()}"


def test_what_a_writer_left_at_its_exit_is_not_a_live_writer():
    assert held_by_writer(partition_holder("w"))  # this process: alive
    assert not held_by_writer(partition_holder(None))
    assert not held_by_writer("")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    assert not held_by_writer(f"writer 'w', pid {dead}")  # its text stays in the file
