"""A shared-upload writer's active segments, held in memory instead of local files.

A writer with shared uploads (reput/publisher.py ``SharedPublisher``) commits every partition's
active segment at each flush (docs/formats/shared-upload.md, "A writer's flush"). Its local
segment files are not a durable copy of anything: until the journal commit the commit log is
(it is fsynced by the flush, and the reput checkpoint moves only after the commit), and after
the commit the journal is. On disk they cost, per partition and per flush, two opens, two
renames (reput/segment_recycle.py), a write of every record, a read of it back to encode the
part and a thread emptying the files: most of a 512-partition writer's appending thread.

``ActiveMemory`` keeps them in memory instead, up to a budget of bytes for the whole writer
(``KCOMPACT_S3_ACTIVE_MEMORY_MB``): a partition's next segment starts in memory while the
writer holds less than the budget, on the local disk otherwise (the two kinds mix freely in
one partition and one flush). A crash loses only what the commit log still holds: the next
open dispatches it again, as after a power cut.
"""

from __future__ import annotations

import threading

from . import env as _env
from .backend import AppendFile, MemoryBackend


def budget_bytes() -> int:
    """The writer's budget for active segments in memory (0: always on the local disk)."""
    return int(_env.value("KCOMPACT_S3_ACTIVE_MEMORY_MB")) << 20


class _CountedAppendFile(AppendFile):
    """An append file of ``ActiveMemory``: every byte written or truncated is counted."""

    __slots__ = ("_fs", "_path", "size")

    def __init__(self, fs: "ActiveMemory", path: str):
        self._fs, self._path = fs, path
        with fs._lock:
            if path not in fs.files:
                fs.files[path] = bytearray()
            self.size = len(fs.files[path])

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        with self._fs._lock:
            buf = self._fs.files[self._path]
            buf += view
            self.size = len(buf)
            self._fs.used += view.nbytes

    def sync(self) -> None:
        pass

    def truncate(self, size: int) -> None:
        with self._fs._lock:
            buf = self._fs.files[self._path]
            if size < len(buf):
                self._fs.used -= len(buf) - size
                del buf[size:]
            self.size = len(buf)

    def close(self) -> None:
        pass


class ActiveMemory(MemoryBackend):
    """The active segments of one writer, in memory, with the bytes they hold counted
    (``used``) against ``limit``. Paths are the partitions' local paths (``<dir>/<base>.log``):
    a segment's files are either here or on the local disk, never both."""

    def __init__(self, limit: int):
        super().__init__()
        self.url = f"memory-active://{id(self):x}"
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def has_room(self) -> bool:
        return self.used < self.limit

    def _touch(self, path: str) -> None:
        pass  # (no modification times: nothing lists these files)

    def open_append(self, path):
        return _CountedAppendFile(self, path)

    def write_atomic(self, path, data):
        with self._lock:
            old = self.files.get(path)
            self.used += len(data) - (len(old) if old is not None else 0)
            self.files[path] = bytearray(data)

    def delete(self, path):
        with self._lock:
            old = self.files.pop(path, None)
            if old is not None:
                self.used -= len(old)

    def remove_tree(self, path):
        pre = path.rstrip("/") + "/"
        with self._lock:
            for k in [k for k in self.files if k.startswith(pre)]:
                self.used -= len(self.files.pop(k))

    def sync_dir(self, path) -> None:
        pass


__all__ = ["ActiveMemory", "budget_bytes"]
