"""What the estate captures share: an internal compacted store topic (partition 0) that a mirror
appends small JSON records to through the store's normal write path, and reads back now or as
of a time (replication/acl_capture.py, schema_capture.py, config_capture.py;
docs/formats/acls.md, schemas.md, configs.md).

* :func:`read_records` yields a topic's records, every one now, or those with a timestamp at or
  before TIME (compaction/history.py: AsOfInexactError when compaction cleaned its history past
  TIME, unless ``allow_inexact``); nothing when the store does not have the topic.
* :class:`InternalTopicWriter` opens the store with the mirror's writer id (created when
  missing), holds the partition only while it appends (so that other writers, such as the Spark
  engine's tasks, interleave), and flushes before :meth:`~InternalTopicWriter.append` returns.
  :meth:`~InternalTopicWriter.locked` hands the partition to a read-modify-append: what other
  writers appended is visible under it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Iterator

from kcompact.compaction import history
from kcompact.reput import Store, StoreLockedError
from kcompact.reput.record import RecordBatch

#: how long an append waits for another process appending to the topic
LOCK_WAIT_S = 10.0


def read_records(store: Store, topic: str, *, as_of_ms: int | None, allow_inexact: bool,
                 what: str) -> Iterator:
    """The records of ``topic``-0 (module docstring); ``what`` names them in an
    AsOfInexactError ("the kept ACLs")."""
    if topic not in store.topics() or 0 not in store.partitions(topic):
        return iter(())
    if as_of_ms is None:
        return store.iter_records(topic, 0)
    history.check_exact([store.partition(topic, 0)], as_of_ms, what,
                        allow_inexact=allow_inexact)
    return history.iter_as_of(store, topic, 0, as_of_ms)


class InternalTopicWriter:
    """Appends to one internal topic of a store (module docstring). ``error`` is the error
    class raised (with a message saying what to do) when the writer or the partition stays
    locked; ``what`` names what was not kept ("the ACLs")."""

    topic: str = ""

    def __init__(self, url: str, writer: str, *, commitlog_dir: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S, error: type[Exception] = RuntimeError,
                 what: str = "the records"):
        self.url, self.writer_id, self.commitlog_dir = url, writer, commitlog_dir
        self.lock_wait_s, self.error, self.what = lock_wait_s, error, what
        self._store: Store | None = None

    def store(self) -> Store:
        if self._store is None:
            try:
                self._store = Store.open(self.url, writer=self.writer_id, create=True,
                                         commitlog_dir=self.commitlog_dir)
            except StoreLockedError:
                raise self.error(f"{self.url}: the writer {self.writer_id} ({self.what}) is "
                                 "locked by another process (a second mirror with the same "
                                 "writer id?)") from None
            # appends re-dispatched on open; let the other writers append meanwhile
            self._store.release_partition(self.topic, 0)
        return self._store

    def _partition(self, st: Store):
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                return st.writable_partition(self.topic, 0)
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise self.error(f"{self.url}: {self.topic}-0 stayed locked by another "
                                     f"process for {self.lock_wait_s:.0f} s; {self.what} were "
                                     "not kept (the next capture tries again)") from None
                time.sleep(0.02)

    @contextlib.contextmanager
    def locked(self) -> Iterator[Callable[[Iterable[tuple[bytes, bytes | None]], int], int]]:
        """``with w.locked() as append: ...; append(records, now_ms)``: the partition held
        for the block (reads in it see every writer's appends); ``append`` writes (key, value)
        records with timestamp ``now_ms``, flushed when it returns, and returns how many."""
        st = self.store()
        pl = self._partition(st)
        try:
            def append(recs: Iterable[tuple[bytes, bytes | None]], now_ms: int) -> int:
                recs = list(recs)
                if not recs:
                    return 0
                nxt = pl.next_offset
                st.append(RecordBatch.from_records(self.topic, [
                    (0, nxt + i, now_ms, k, v) for i, (k, v) in enumerate(recs)]))
                st.flush()
                return len(recs)
            yield append
        finally:
            st.release_partition(self.topic, 0)

    def append(self, recs: Iterable[tuple[bytes, bytes | None]], now_ms: int) -> int:
        with self.locked() as append:
            return append(recs, now_ms)

    def close(self) -> None:
        if self._store is not None:
            st, self._store = self._store, None
            st.close()


__all__ = ["LOCK_WAIT_S", "InternalTopicWriter", "read_records"]
