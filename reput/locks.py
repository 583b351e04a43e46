"""Advisory file locks (flock) for local stores: one commit-log writer, one compactor per partition.

On backends without local files (S3) these are no-ops; there the manifest's conditional put is
what keeps two writers from both winning (docs/formats/manifest.md).
"""

from __future__ import annotations

import fcntl
import os

from .backend import Backend


class FileLock:
    def __init__(self, fs: Backend, path: str):
        self.fs, self.path = fs, path
        self._fd: int | None = None

    def acquire(self, blocking: bool = False) -> bool:
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
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
