"""Advisory file locks (flock) for local stores: one commit-log writer, one compactor per partition.

On backends without local files (S3) these are no-ops; there the manifest's conditional put is
what keeps two writers from both winning (docs/formats/manifest.md).
"""

from __future__ import annotations

import fcntl
import os

from .backend import Backend


#: the longest holder text read back
HOLDER_MAX = 256
#: how a writer's holder text starts (``partition_holder``)
WRITER_HOLDER = "writer "


def held_by_writer(holder: str) -> bool:
    """Whether a partition's holder text (``FileLock.holder``) names a writer that is alive
    (the text a process left when it released the lock stays until the next taker writes)."""
    if not holder.startswith(WRITER_HOLDER):
        return False
    _, _, pid = holder.rpartition("pid ")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, OSError):
        pass  # not ours to signal: alive
    return True


def partition_holder(writer: str | None) -> str:
    """The holder text of a partition's writer.lock: ``writer 'ID', pid N`` for a store opened
    with a writer id (a mirror, which keeps the partition while it runs), ``pid N`` for one
    without (a compaction, which holds it for a while)."""
    pid = f"pid {os.getpid()}"
    return f"{WRITER_HOLDER}{writer!r}, {pid}" if writer is not None else pid


class FileLock:
    def __init__(self, fs: Backend, path: str):
        self.fs, self.path = fs, path
        self._fd: int | None = None

    def acquire(self, blocking: bool = False, holder: str | None = None) -> bool:
        """Take the lock; False if another process holds it (``blocking``: wait instead).
        ``holder``: who takes it, written into the file for the one refused
        (``holder()``), e.g. ``writer 'local', pid 12`` (``partition_holder``)."""
        lp = self.fs.local_path(self.path)
        if lp is None:
            return True
        os.makedirs(os.path.dirname(lp), exist_ok=True)
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        if holder is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        return True

    def holder(self) -> str:
        """What the process holding the lock wrote into its file ('' when nothing: a taker
        that names none, or one that has not written yet)."""
        lp = self.fs.local_path(self.path)
        try:
            with open(lp, "rb") as f:
                return f.read(HOLDER_MAX).decode("utf-8", "replace").strip()
        except (OSError, TypeError):
            return ""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
