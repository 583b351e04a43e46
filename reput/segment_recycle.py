"""A shared-upload writer's local segment files, emptied in the background and reused.

A writer with shared uploads (reput/publisher.py ``SharedPublisher``) commits every partition's
active segment at each flush, and the partition's next record starts a new local segment. Two
files deleted and two created a partition a flush (4 metadata operations of the local file
system, each waiting its turn in its journal: measured ~0.25 ms apiece on a loaded ext4) were
most of a 512-partition writer's time, on the thread that appends. Instead, the committed
segment's two files are handed here (``Spare``): a thread of the process empties them (the
.log first; their records are committed, so a crash at any point leaves committed records or
empty files, which the next open drops), and the partition's next segment takes them over by
renaming them (``take``: two renames, cheap), or, when they are not emptied yet, creates its own
while this thread deletes them.
"""

from __future__ import annotations

import os
import queue
import threading

from .backend import Backend
from .errors import ReputError

EMPTYING, READY, TAKEN, ABANDONED, GONE = range(5)


class Spare:
    """The two files of a committed local segment, on their way to the next one."""

    __slots__ = ("fs", "segment", "log_path", "bcq_path", "state", "lock", "done")

    def __init__(self, fs: Backend, segment):
        self.fs, self.segment = fs, segment
        self.log_path, self.bcq_path = segment.log_path, segment.bcq_path
        self.state = EMPTYING
        self.lock = threading.Lock()
        self.done = threading.Event()  # the background thread is finished with it

    def take(self, log_path: str, bcq_path: str) -> bool:
        """Rename the emptied files to the new segment's (the .bcq first: a crash in between
        leaves an empty .log and an empty .bcq, each dropped by the next open); False when they
        are not emptied yet (they are deleted in the background: create new ones)."""
        with self.lock:
            ready = self.state == READY
            if ready:
                self.state = TAKEN
            elif self.state == EMPTYING:
                self.state = ABANDONED  # (the background thread deletes them)
        if not ready:
            return False
        fs = self.fs
        try:
            if fs.exists(log_path) or fs.exists(bcq_path):
                raise FileExistsError(log_path)
            fs.rename(self.bcq_path, bcq_path)
            fs.rename(self.log_path, log_path)
            return True
        except (OSError, ReputError):
            self._delete()
            return False

    def drop(self, wait_s: float = 10.0) -> None:
        """Not needed any more (the partition closes): its files are deleted, once the
        background thread is done with them."""
        with self.lock:
            if self.state in (TAKEN, GONE):
                return
            self.state = ABANDONED
        if self.done.wait(wait_s):
            self._delete()

    def _delete(self) -> None:
        with self.lock:
            if self.state == GONE:
                return
            self.state = GONE
        for path in (self.log_path, self.bcq_path):
            try:
                self.fs.delete(path)
            except (OSError, ReputError):
                pass  # (committed records: the next open drops them)

    def _empty(self) -> None:
        """(the background thread) Forget what the segment mapped (before its files shrink
        under a mapping), then truncate both files, the .log first."""
        try:
            self.segment.invalidate()
            self.segment = None
            with self.lock:
                go = self.state == EMPTYING
            ok = False
            if go:
                try:
                    for path in (self.log_path, self.bcq_path):
                        f = self.fs.open_append(path)
                        try:
                            f.truncate(0)
                        finally:
                            f.close()
                    ok = True
                except (OSError, ReputError):
                    pass
            with self.lock:
                if ok and self.state == EMPTYING:
                    self.state = READY
                    return
        finally:
            self.done.set()
        self._delete()  # (abandoned while it was emptied, or it could not be)


class _Recycler:
    """One daemon thread per process (a forked child starts its own)."""

    def __init__(self):
        self._q: "queue.Queue[Spare]" = queue.Queue()
        self._lock = threading.Lock()
        self._pid = -1

    def put(self, spare: Spare) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._q = queue.Queue()
                threading.Thread(target=self._run, args=(self._q,), daemon=True,
                                 name="kcompact-recycle").start()
                self._pid = os.getpid()
            q = self._q
        q.put(spare)

    @staticmethod
    def _run(q) -> None:
        while True:
            spare = q.get()
            try:
                spare._empty()
            finally:
                q.task_done()

    def wait(self) -> None:
        with self._lock:
            q = self._q if self._pid == os.getpid() else None
        if q is not None:
            q.join()


_RECYCLER = _Recycler()


def recycle(fs: Backend, segment) -> Spare:
    """Hand a committed local segment (out of its partition's view) to the background thread
    (``Spare``)."""
    spare = Spare(fs, segment)
    _RECYCLER.put(spare)
    return spare


def drain() -> None:
    """Wait until every spare handed over so far is emptied (tests)."""
    _RECYCLER.wait()


__all__ = ["Spare", "drain", "recycle"]
