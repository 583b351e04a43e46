"""Storage backends: every byte a store reads or writes goes through one of these.

Paths are '/'-separated, relative to the backend's root (reput/filenames.py builds them).
``LocalBackend`` is a directory on disk (append + fsync, atomic rename); ``MemoryBackend`` is
its in-memory twin for unit tests. The S3 backend implements the same interface; appendable
files (``open_append``) exist only on backends with ``appendable = True``; on the others a
segment is written whole with ``write_atomic`` once sealed.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from abc import ABC, abstractmethod

import numpy as np

from .errors import CorruptRecordError, ReputError
from .filenames import COMPACTING_DIR


class BackendError(ReputError):
    """The storage under a store failed (disk full, permission, I/O error): the message says which."""


class AppendFile(ABC):
    """An open file that grows at its end: a commit-log or compaction-log segment being written."""

    size: int

    @abstractmethod
    def write(self, data) -> None: ...

    @abstractmethod
    def sync(self) -> None: ...

    @abstractmethod
    def truncate(self, size: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def start_writeback(self) -> None:
        """Start writing what was appended to the device without waiting for it, so that a
        later ``sync`` of a large file has little left to wait for. Optional (no-op here)."""

    def sync_soon(self) -> None:
        """Make what was appended so far durable in the background (no waiting, no promise):
        a later ``sync`` then finds the device's caches already flushed. Errors are left to
        that ``sync`` to report. Optional (no-op here)."""


def _libc_call(libc, name: str, *argtypes):
    """libc's function ``name`` (Linux: sync_file_range, fallocate) taking ``argtypes``
    (ctypes type names) and returning an int, or None."""
    import ctypes
    f = getattr(libc, name, None)
    if f is None:
        return None
    f.argtypes = [getattr(ctypes, t) for t in argtypes]
    f.restype = ctypes.c_int
    return f


def _libc():
    """The C library (looked up once: find_library runs ldconfig), or None."""
    try:
        import ctypes
        import ctypes.util
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_SYNC_FILE_RANGE = _libc_call(_LIBC, "sync_file_range", "c_int", "c_int64", "c_int64", "c_uint")
_SYNC_FILE_RANGE_WRITE = 2
_FALLOCATE = _libc_call(_LIBC, "fallocate", "c_int", "c_int", "c_int64", "c_int64")
_FALLOC_FL_KEEP_SIZE = 1
#: How far ahead of its end a local append file reserves disk blocks (fallocate KEEP_SIZE): as
#: much as it already holds, at most this. The file's size is unchanged (readers see only what
#: was written), and each write lands on blocks already allocated instead of going through the
#: file system's per-page delayed allocation. Measured on ext4 (4 KiB blocks), 720 MB appended in
#: 1 MiB writes to 9 files: 0.12 -> 0.07 s of kernel CPU on the writing thread (0.18 -> 0.13 s
#: machine-wide, writeback included). Given back (ftruncate to the size) when the file is
#: closed or truncated.
PREALLOCATE_BYTES = 16 << 20
#: What the open append files of a process may hold reserved at once: past it, files append
#: without reserving (a store with thousands of partitions never holds more than this).
PREALLOCATE_BUDGET = 512 << 20


class _Reservations:
    """The bytes the open append files of this process hold reserved past their ends (counted
    at each reservation's full length until the file reserves again, closes or truncates)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.held = 0
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            # a forked child gets a new lock (another thread of the parent may have held this
            # one), and keeps the count: the files it inherited give back what they hold
            os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def swap(self, give: int, want: int) -> int:
        """Give back ``give`` bytes, then take ``want`` if the budget has them: what was
        taken (``want`` or 0)."""
        with self._lock:
            self.held -= give
            got = want if self.held + want <= self.budget else 0
            self.held += got
            return got


RESERVATIONS = _Reservations(PREALLOCATE_BUDGET)


class _BackgroundSync:
    """One daemon thread that fdatasyncs files named by path, for ``sync_soon``, and queues
    byte ranges of them for writeback (sync_file_range WRITE), for ``start_writeback``.

    Why: on a virtual disk the first fsync after a stream of writes waits for the host to make
    everything written so far durable (measured here: 0.3-0.8 s after a 310 MB commit log, even
    with every byte already queued by sync_file_range); an fdatasync every few tens of MB in this
    thread spreads that wait over the stream, where it overlaps the writer's work (the final
    fsync: 0.03 s). sync_file_range itself blocks while the device's request queue is full
    (measured: ~0.1 s per 1M-record mirror on the appending thread), so it is issued here too,
    off the writer's path. The file is opened anew (read-only) for each request: the writer's own
    descriptor keeps every write error for its own fsync to report (Linux reports an error once
    per open file description), and closing the writer's file never races with this thread.
    A sync request for a path already waiting is dropped; writeback ranges of one path waiting
    together are merged. Neither is ever what makes data durable: that is the writer's fsync."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._ranges: dict[str, tuple[int, int]] = {}  # path -> [start, end) to write back
        self._wake = threading.Event()
        self._pid = -1
        self.done = 0  # sync requests served (tests)
        self.written_back = 0  # writeback requests served (tests)

    def _started(self) -> None:
        """Under the lock: start the thread on first use, or in a forked child."""
        if self._pid != os.getpid():
            self._pid, self._pending, self._ranges = os.getpid(), [], {}
            threading.Thread(target=self._run, name="kcompact-bg-sync", daemon=True).start()

    def submit(self, path: str) -> None:
        with self._lock:
            self._started()
            if path not in self._pending:
                self._pending.append(path)
        self._wake.set()

    def submit_writeback(self, path: str, start: int, length: int) -> None:
        with self._lock:
            self._started()
            have = self._ranges.get(path)
            end = start + length
            self._ranges[path] = (start, end) if have is None else \
                (min(have[0], start), max(have[1], end))
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                todo, self._pending = self._pending, []
                ranges, self._ranges = self._ranges, {}
            for path, (start, end) in ranges.items():
                fd = self._open(path)
                if fd is None:
                    continue
                try:
                    _SYNC_FILE_RANGE(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
                finally:
                    os.close(fd)
                self.written_back += 1
            for path in todo:
                fd = self._open(path)
                if fd is None:
                    continue
                try:
                    os.fdatasync(fd)
                except OSError:
                    pass  # the writer's own sync reports it
                finally:
                    os.close(fd)
                self.done += 1

    @staticmethod
    def _open(path: str) -> int | None:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None  # deleted or renamed meanwhile: nothing to do for it


BACKGROUND_SYNC = _BackgroundSync()


class Backend(ABC):
    url: str
    appendable: bool = True

    @abstractmethod
    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes: ...

    def read_into(self, path: str, start: int, out: np.ndarray) -> int:
        """Fill ``out`` (uint8) from ``path`` at ``start``; returns bytes read. Reusing one
        buffer avoids a page fault per 4 KiB of a fresh allocation on every chunk."""
        data = self.read(path, start, out.shape[0])
        out[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def open_read(self, path: str, start: int = 0) -> "io.RawIOBase":
        """A sequential reader from ``start`` (``readinto``/``read``). On object stores it is one
        streamed request for the whole rest of the object, which is how compaction keeps its
        request count per segment constant."""
        return io.BytesIO(self.read(path, start))

    @abstractmethod
    def map(self, path: str, size: int | None = None) -> np.ndarray:
        """The first ``size`` bytes (default: all) as a read-only uint8 array, zero-copy if it can."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; raises FileNotFoundError when absent."""

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
            return True
        except FileNotFoundError:
            return False

    def clock_ms(self) -> int:
        """Now, on the clock this backend's modification times are on (an object store's
        LastModified comes from its own clock): what object ages are measured against."""
        return time.time_ns() // 1_000_000

    def mtime_ms(self, path: str) -> int | None:
        """When ``path`` was last modified (ms since the epoch), or None when this backend
        cannot tell cheaply (an object store would need a request per file; nothing asks it
        there: commit logs, whose age retention checks, are always local). Raises
        FileNotFoundError when absent."""
        self.size(path)
        return None

    @abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (files and sub-directories), sorted; [] when absent."""

    @abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` so that readers see the old or the new bytes, never a mix."""

    @abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` only if absent; False if it exists (a conditional put)."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file; missing is fine."""

    @abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` over ``dst``."""

    @abstractmethod
    def open_append(self, path: str) -> AppendFile: ...

    def sync_dir(self, path: str) -> None:
        """Make renames and creations in ``path`` durable (a no-op where that has no meaning)."""

    @abstractmethod
    def remove_tree(self, path: str) -> None: ...

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` when the backend is a local directory, else None."""
        return None


# ---------------------------------------------------------------------------------------------


def _oserror(e: OSError, what: str, path: str) -> BackendError:
    reason = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
              errno.EROFS: "the file system is read-only", errno.EIO: "I/O error"}.get(
        e.errno, e.strerror or str(e))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        if f"/{COMPACTING_DIR}/" in f"/{path}":
            # A compaction's output is staged in .compacting/ and committed only once it is
            # whole (compaction-swap.md), so a failed write there leaves the partition as it was.
            reason += ("; the compaction stopped and nothing was lost: the old segments are "
                       "still in place (its partial output in .compacting/ is discarded); free "
                       "space on the disk, then run the compaction again")
        else:
            reason += "; free space on the disk, then retry"
    return BackendError(f"cannot {what} {path}: {reason}")


class _LocalAppendFile(AppendFile):
    def __init__(self, ospath: str, display: str, preallocate: bool = True):
        self._display = display
        self._ospath = ospath
        try:
            self._fd = os.open(ospath, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise _oserror(e, "open for append", display) from e
        self.size = os.fstat(self._fd).st_size
        #: disk blocks are reserved up to here (PREALLOCATE_BYTES); -1: the file system
        #: refused a reservation (none is asked for again)
        self._reserved = self.size if _FALLOCATE is not None and preallocate else -1
        self._held = 0  # this file's share of RESERVATIONS
        self._wb_pos = 0  # start_writeback has queued the bytes before this position
        #: the size at this descriptor's last fsync; -1: not synced since opened, truncated or
        #: a failed write (sync() then fsyncs whatever the size)
        self._synced = -1

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self.size + n > self._reserved >= 0:
            self._reserve(self.size + n)
        done = 0
        try:
            while done < n:
                done += os.write(self._fd, mv[done:])
        except OSError as e:
            # Leave the file as it was before this write: a partial record must not stay behind.
            self._synced = -1
            try:
                os.ftruncate(self._fd, self.size)
            except OSError:
                pass
            self._give_back()  # the truncate freed them
            raise _oserror(e, "write", self._display) from e
        self.size += n

    def _reserve(self, end: int) -> None:
        """Reserve the blocks from the end of the file to ``end`` and as much again as the
        file holds (PREALLOCATE_BYTES at most), within the process's budget. A file system
        that cannot (no fallocate, no space: the write then says so itself) is not asked
        again."""
        length = end - self.size + min(PREALLOCATE_BYTES, end)
        got = RESERVATIONS.swap(self._held, length)
        self._held = got
        if not got:
            return  # over the budget: this write goes without
        if _FALLOCATE(self._fd, _FALLOC_FL_KEEP_SIZE, self.size, got) == 0:
            self._reserved = self.size + got
        else:
            self._give_back()
            self._reserved = -1

    def _give_back(self) -> None:
        """After a truncate (which frees the blocks past the new end): nothing is reserved."""
        RESERVATIONS.swap(self._held, 0)
        self._held = 0
        if self._reserved >= 0:
            self._reserved = self.size

    def _release(self) -> None:
        """Give back the blocks reserved past the end: ftruncate to the size frees them, the
        size unchanged, and the modification time is put back (it stays the last write's: the
        commit log's retention counts a segment's age from it). Only when the file's size is
        the size this descriptor wrote: nothing is ever cut."""
        if self._reserved > self.size:
            try:
                st = os.fstat(self._fd)
                if st.st_size == self.size:
                    os.ftruncate(self._fd, self.size)
                    os.utime(self._fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            except OSError:
                pass  # the reservation stays: space, not data
        self._give_back()

    def sync(self) -> None:
        # Nothing written or truncated through this descriptor since its last fsync succeeded:
        # everything it wrote is already durable (a flush syncs every open file of every
        # partition it writes; at the end of a mirror the same files came up 3-4 times).
        if self.size == self._synced:
            return
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise _oserror(e, "fsync", self._display) from e
        self._synced = self.size

    def truncate(self, size: int) -> None:
        self._synced = -1
        os.ftruncate(self._fd, size)  # frees the reserved blocks too
        self.size = size
        self._give_back()

    def start_writeback(self) -> None:
        # SYNC_FILE_RANGE_WRITE on the bytes appended since the last call: queue them for
        # writeback, do not wait. Durability still comes only from sync(); this spreads the
        # device's work over the writes. (Measured on ext4: over a 3 s stream of 320 MB the final
        # fsync drops from 0.48 s to 0.03 s; asking for the whole file each time, 0.30 s.)
        # Issued by the background thread (_BackgroundSync): it can block while the device's
        # queue is full, which the appending thread must not wait for.
        if _SYNC_FILE_RANGE is not None and self._fd >= 0:
            start = min(self._wb_pos, self.size)
            if self.size > start:
                BACKGROUND_SYNC.submit_writeback(self._ospath, start, self.size - start)
                self._wb_pos = self.size

    def sync_soon(self) -> None:
        if self._fd >= 0:
            BACKGROUND_SYNC.submit(self._ospath)

    def close(self) -> None:
        if self._fd >= 0:
            self._release()
            os.close(self._fd)
            self._fd = -1


#: ``LocalBackend.map`` reads a file of at most this many bytes instead of mapping it
READ_NOT_MAP_BYTES = 64 << 10


class LocalBackend(Backend):
    appendable = True

    def __init__(self, root: str, *, preallocate: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        #: whether appended files reserve disk blocks ahead (``_LocalAppendFile._reserve``);
        #: off for files that live a flush interval and are emptied (a shared-upload writer's
        #: local segments: freeing reserved blocks costs ~8x an emptying's time on ext4)
        self.preallocate = preallocate

    def _p(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise BackendError(f"refusing a path outside the store: {path!r}")
        return os.path.join(self.root, path) if path else self.root

    def local_path(self, path: str) -> str:
        return self._p(path)

    def read(self, path, start=0, length=None):
        try:
            with open(self._p(path), "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _oserror(e, "read", path) from e

    def read_into(self, path, start, out):
        try:
            fd = os.open(self._p(path), os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _oserror(e, "open", path) from e
        try:
            mv = memoryview(out).cast("B")
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], start + done)
                if n == 0:
                    break
                done += n
            return done
        except OSError as e:
            raise _oserror(e, "read", path) from e
        finally:
            os.close(fd)

    def open_read(self, path, start=0):
        try:
            f = open(self._p(path), "rb", buffering=0)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _oserror(e, "open", path) from e
        if start:
            f.seek(start)
        return f

    def map(self, path, size=None):
        p = self._p(path)
        n = os.path.getsize(p) if size is None else size
        if n == 0:
            return np.zeros(0, dtype=np.uint8)
        try:
            if n <= READ_NOT_MAP_BYTES:
                # (a small file read is ~10x cheaper than a map: a shared-upload writer's
                # flush looks up the index of each of its partitions' one-record segments)
                with open(p, "rb") as f:
                    data = f.read(n)
                if len(data) < n:
                    raise ValueError("shorter than expected")
                return np.frombuffer(data, np.uint8)
            return np.memmap(p, dtype=np.uint8, mode="r", shape=(n,))
        except FileNotFoundError:
            raise  # (as every read here: removed under a reader, which re-lists and retries)
        except OSError as e:
            raise _oserror(e, "map", path) from e
        except ValueError:  # numpy: "mmap length is greater than file size"
            # shorter than its segment was when listed: replaced under a reader (a seal or a
            # compaction swap; the reader re-lists and retries) or cut short (corruption)
            raise CorruptRecordError(f"{path}: shorter than the {n} bytes expected (replaced "
                                     "while read, or cut short)", path, 0) from None

    def size(self, path):
        return os.path.getsize(self._p(path))

    def mtime_ms(self, path):
        return os.stat(self._p(path)).st_mtime_ns // 1_000_000

    def isdir(self, path):
        return os.path.isdir(self._p(path))

    def listdir(self, path):
        try:
            return sorted(os.listdir(self._p(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def write_atomic(self, path, data):
        p = self._p(path)
        tmp = p + ".tmp"
        try:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _oserror(e, "write", path) from e
        self.sync_dir(os.path.dirname(path))

    def create_exclusive(self, path, data):
        p = self._p(path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, p)  # atomic create-if-absent with full contents
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def delete(self, path):
        try:
            os.unlink(self._p(path))
        except FileNotFoundError:
            pass

    def rename(self, src, dst):
        d = self._p(dst)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        os.replace(self._p(src), d)

    def open_append(self, path):
        p = self._p(path)
        try:
            os.makedirs(os.path.dirname(p), exist_ok=True)
        except OSError as e:
            raise _oserror(e, "create directory for", path) from e
        return _LocalAppendFile(p, path, self.preallocate)

    def sync_dir(self, path):
        try:
            fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove_tree(self, path):
        import shutil
        shutil.rmtree(self._p(path), ignore_errors=True)


# ---------------------------------------------------------------------------------------------


class _MemAppendFile(AppendFile):
    def __init__(self, fs: "MemoryBackend", path: str):
        self._fs, self._store, self._path = fs, fs.files, path
        if path not in self._store:
            self._store[path] = bytearray()
            fs._touch(path)
        self.size = len(self._store[path])

    def write(self, data):
        self._store[self._path] += memoryview(data).cast("B")
        self.size = len(self._store[self._path])
        self._fs._touch(self._path)

    def sync(self):
        pass

    def truncate(self, size):
        del self._store[self._path][size:]
        self.size = size
        self._fs._touch(self._path)

    def close(self):
        pass


class MemoryBackend(Backend):
    """Everything in a dict: for unit tests that must not touch the disk.

    Modification times come from ``clock`` (anything with ``ms()``, e.g. the store's
    ``ManualClock``; default: the system time) and are kept in ``mtimes``."""

    appendable = True

    def __init__(self, clock=None):
        self.files: dict[str, bytearray] = {}
        self.mtimes: dict[str, int] = {}
        self.clock = clock
        self.url = f"memory://{id(self):x}"
        self._lock = threading.Lock()

    def _touch(self, path: str) -> None:
        self.mtimes[path] = (self.clock.ms() if self.clock is not None
                             else time.time_ns() // 1_000_000)

    def clock_ms(self):
        return self.clock.ms() if self.clock is not None else time.time_ns() // 1_000_000

    def mtime_ms(self, path):
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.mtimes.get(path)

    def read(self, path, start=0, length=None):
        data = self.files[path] if path in self.files else None
        if data is None:
            raise FileNotFoundError(path)
        end = len(data) if length is None else start + length
        return bytes(data[start:end])

    def map(self, path, size=None):
        data = self.read(path, 0, size)
        return np.frombuffer(data, dtype=np.uint8)

    def size(self, path):
        if path not in self.files:
            raise FileNotFoundError(path)
        return len(self.files[path])

    def isdir(self, path):
        pre = path.rstrip("/") + "/"
        return any(k.startswith(pre) for k in list(self.files))  # (a snapshot: see listdir)

    def listdir(self, path):
        pre = path.rstrip("/") + "/" if path else ""
        # list(): a snapshot taken at once (one C call under the GIL); iterating the dict itself
        # fails when another thread's write adds a file meanwhile (a parallel flush's seals)
        return sorted({k[len(pre):].split("/", 1)[0] for k in list(self.files)
                       if k.startswith(pre)})

    def write_atomic(self, path, data):
        self.files[path] = bytearray(data)
        self._touch(path)

    def create_exclusive(self, path, data):
        with self._lock:
            if path in self.files:
                return False
            self.files[path] = bytearray(data)
            self._touch(path)
            return True

    def delete(self, path):
        self.files.pop(path, None)
        self.mtimes.pop(path, None)

    def rename(self, src, dst):
        self.files[dst] = self.files.pop(src)
        mtime = self.mtimes.pop(src, None)  # a rename keeps the file's mtime, as on disk
        if mtime is not None:
            self.mtimes[dst] = mtime

    def open_append(self, path):
        return _MemAppendFile(self, path)

    def remove_tree(self, path):
        pre = path.rstrip("/") + "/"
        for k in [k for k in list(self.files) if k.startswith(pre)]:
            del self.files[k]
            self.mtimes.pop(k, None)
