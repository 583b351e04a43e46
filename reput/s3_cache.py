"""The S3 backend's process-wide caches and request counters (split out of s3.py, which uses them).

* ``RequestStats``: requests by S3 operation and bytes each way, per backend.
* ``BlockCache``: 4 MiB aligned blocks of immutable (sealed) objects, an LRU bounded in bytes
  (``KCOMPACT_S3_CACHE_MB``, default 256) that merges concurrent fetches of one block.
* ``Spool``: whole immutable objects (``.bcq`` indexes, segments this process uploaded) as local
  files in a per-process temporary directory, LRU-bounded on disk (``KCOMPACT_S3_SPOOL_MB``,
  default 4096); directories of dead processes are swept on first use.
* ``set_block_source``: a hook through which a block cache miss on an immutable object is
  fetched from elsewhere first (a fleet's owner node, replication/fleet/), never S3 directly.
* ``set_head_source``: a hook through which a follower (reput/s3_follow.py) learns the
  journal's and the store catalog's heads from elsewhere (a fleet's poller node) instead of
  polling S3 itself.

Spec: docs/formats/manifest.md (reads). Nothing here talks to S3: the backend passes a fetch or
download function in.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import weakref
from collections import Counter, OrderedDict
from concurrent.futures import Future
from typing import Callable, NamedTuple

from . import env as _env

BLOCK_SIZE = 4 << 20
DEFAULT_CACHE_MB = _env.ENV["KCOMPACT_S3_CACHE_MB"].default
DEFAULT_SPOOL_MB = _env.ENV["KCOMPACT_S3_SPOOL_MB"].default

# ---------------------------------------------------------------------------------------------
# request counting


class RequestStats:
    """Requests by S3 operation, plus bytes down and up (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()
        self.bytes_down = 0
        self.bytes_up = 0

    def count(self, kind: str, down: int = 0, up: int = 0) -> None:
        with self._lock:
            if kind:
                self.requests[kind] += 1
            self.bytes_down += down
            self.bytes_up += up

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "total": sum(self.requests.values()),
                    "bytes_down": self.bytes_down, "bytes_up": self.bytes_up}

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_down = self.bytes_up = 0


# ---------------------------------------------------------------------------------------------
# the block cache


class BlockCache:
    """LRU of fixed-size aligned blocks of immutable objects, bounded in bytes, thread-safe.

    ``get(key, block, fetch)`` returns block ``block`` of object ``key``: from the cache, or by
    calling ``fetch()`` once however many threads ask for it at the same time (the others wait
    for that one request: ``merged`` counts them). A failed fetch is raised in every waiter and
    not cached.
    """

    def __init__(self, capacity_bytes: int, block_size: int = BLOCK_SIZE):
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.capacity = max(0, int(capacity_bytes))
        self.block_size = block_size
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._inflight: dict[tuple[str, int], Future] = {}
        self.used = 0
        self.hits = self.misses = self.merged = self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: str, block: int, fetch: Callable[[], bytes]) -> bytes:
        k = (key, block)
        with self._lock:
            data = self._lru.get(k)
            if data is not None:
                self._lru.move_to_end(k)
                self.hits += 1
                return data
            fut = self._inflight.get(k)
            owner = fut is None
            if owner:
                fut = self._inflight[k] = Future()
                self.misses += 1
            else:
                self.merged += 1
        if not owner:
            return fut.result()
        try:
            data = bytes(fetch())
        except BaseException as e:
            with self._lock:
                del self._inflight[k]
            fut.set_exception(e)
            raise
        with self._lock:
            del self._inflight[k]
            if len(data) <= self.capacity:
                self._lru[k] = data
                self.used += len(data)
                while self.used > self.capacity and self._lru:
                    _, old = self._lru.popitem(last=False)
                    self.used -= len(old)
                    self.evictions += 1
        fut.set_result(data)
        return data

    def has(self, key: str, block: int) -> bool:
        """Whether the block is cached (no fetch would be sent now)."""
        with self._lock:
            return (key, block) in self._lru

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self.used = 0


# ---------------------------------------------------------------------------------------------
# the spool: whole immutable objects as local files


_SPOOL_PREFIX = "kcompact-s3-spool-"


def _sweep_dead_spools() -> None:
    """Remove spool directories of processes that died without cleaning up (killed, or left
    through os._exit as Spark's Python workers are): ``kcompact-s3-spool-<pid>-*`` whose pid
    is gone."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        if not name.startswith(_SPOOL_PREFIX):
            continue
        pid = name[len(_SPOOL_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal: then not ours to delete either)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        except OSError:
            continue


class Spool:
    """Whole immutable objects in local files (a temporary directory removed at exit), LRU
    bounded in bytes. Concurrent fetches of one object are merged. Evicting unlinks the file;
    a mapping of it stays valid until it is dropped (POSIX)."""

    def __init__(self, capacity_bytes: int, root: str | None = None):
        self.capacity = max(0, int(capacity_bytes))
        self._root = root
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()
        self._files: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self.used = 0
        self.hits = self.misses = self.merged = 0

    def _dir(self) -> str:
        with self._dir_lock:
            if self._root is None:
                _sweep_dead_spools()
                self._root = tempfile.mkdtemp(prefix=f"{_SPOOL_PREFIX}{os.getpid()}-")
                weakref.finalize(self, shutil.rmtree, self._root, True)
            os.makedirs(self._root, exist_ok=True)
            return self._root

    def _path(self, key: str) -> str:
        return os.path.join(self._dir(), hashlib.sha1(key.encode()).hexdigest())

    def get(self, key: str) -> tuple[str, int] | None:
        with self._lock:
            hit = self._files.get(key)
            if hit is not None:
                if not os.path.exists(hit[0]):  # removed behind our back
                    self.used -= hit[1]
                    del self._files[key]
                    return None
                self._files.move_to_end(key)
                self.hits += 1
            return hit

    def fetch(self, key: str, download: Callable[[str], int]) -> tuple[str, int]:
        """The local copy of ``key``; ``download(path)`` writes it there and returns its size."""
        hit = self.get(key)
        if hit is not None:
            return hit
        with self._lock:
            fut = self._inflight.get(key)
            owner = fut is None
            if owner:
                fut = self._inflight[key] = Future()
                self.misses += 1
            else:
                self.merged += 1
        if not owner:
            return fut.result()
        final = self._path(key)
        tmp = f"{final}.{threading.get_ident()}.part"
        try:
            size = download(tmp)
            os.replace(tmp, final)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._lock:
                del self._inflight[key]
            fut.set_exception(e)
            raise
        res = self._insert(key, final, size)
        with self._lock:
            del self._inflight[key]
        fut.set_result(res)
        return res

    def seed(self, key: str, src: str) -> None:
        """Move the local file ``src`` (the object's exact bytes) into the spool as ``key``."""
        final = self._path(key)
        try:
            os.replace(src, final)
        except OSError:
            shutil.copyfile(src, final)
            os.unlink(src)
        self._insert(key, final, os.path.getsize(final))

    def clear(self) -> None:
        """Forget (and unlink) every spooled object."""
        with self._lock:
            files, self._files = list(self._files.values()), OrderedDict()
            self.used = 0
        for p, _ in files:
            try:
                os.unlink(p)
            except OSError:
                pass

    def _insert(self, key: str, path: str, size: int) -> tuple[str, int]:
        with self._lock:
            old = self._files.pop(key, None)
            if old is not None:
                self.used -= old[1]
            self._files[key] = (path, size)
            self.used += size
            while self.used > self.capacity and len(self._files) > 1:
                k, (p, n) = self._files.popitem(last=False)
                if k == key:  # never evict what was just inserted
                    self._files[k] = (p, n)
                    self._files.move_to_end(k, last=False)
                    break
                self.used -= n
                try:
                    os.unlink(p)
                except OSError:
                    pass
        return path, size


# ---------------------------------------------------------------------------------------------
# the block source hook


class BlockSource:
    """Where a miss of an immutable object's block is fetched: ``fetch(backend, path, block,
    from_s3)`` returns block ``block`` of ``path`` (the store-relative name) of ``backend``;
    ``from_s3()`` is the one GET the backend would send itself. The default sends it. A fleet
    (replication/fleet/) installs one that asks the block's owner node. Also asked for block
    0 of a journal entry (small, written once; not kept in the block cache of the reader);
    FileNotFoundError when the object does not exist."""

    def fetch(self, backend, path: str, block: int, from_s3: Callable[[], bytes]) -> bytes:
        return from_s3()


_source: list[BlockSource | None] = [None]


def set_block_source(source: BlockSource | None) -> None:
    """Install ``source`` for every S3 backend of this process (None: S3 directly)."""
    _source[0] = source


def block_source() -> BlockSource | None:
    return _source[0]


# ---------------------------------------------------------------------------------------------
# the head source hook


class Heads(NamedTuple):
    """What a follower's poll of S3 found (reput/s3_follow.py ``Follower.heads``): ``writers``:
    writer -> the seq its next journal entry will have (every entry below it exists or was
    collected); ``catalog``: the store catalog's newest version (None: no catalog);
    ``age_s``: how long ago the poll that found them ended with every request answered."""

    writers: dict[str, int]
    catalog: int | None
    age_s: float


class HeadSource:
    """Where a follower gets ``Heads`` instead of polling S3 itself: ``heads(backend,
    max_age_s)`` returns another process's poll of the store on ``backend``, one that ended at
    most about ``max_age_s`` ago (None: the follow interval), or None to poll S3 (the default;
    any error counts as None). A fleet (replication/fleet/) installs one that asks the node
    that polls for the whole fleet."""

    def heads(self, backend, max_age_s: float | None = None) -> Heads | None:
        return None


_heads: list[HeadSource | None] = [None]


def set_head_source(source: HeadSource | None) -> None:
    """Install ``source`` for every follower of this process (None: each polls S3)."""
    _heads[0] = source


def head_source() -> HeadSource | None:
    return _heads[0]


_shared_lock = threading.Lock()
_shared: dict[str, object] = {}


def shared_cache() -> BlockCache:
    """The process-wide block cache (``KCOMPACT_S3_CACHE_MB``)."""
    with _shared_lock:
        c = _shared.get("cache")
        if c is None:
            mb = _env.value("KCOMPACT_S3_CACHE_MB")
            c = _shared["cache"] = BlockCache(mb << 20)
        return c  # type: ignore[return-value]


def shared_spool() -> Spool:
    """The process-wide spool (``KCOMPACT_S3_SPOOL_MB``)."""
    with _shared_lock:
        s = _shared.get("spool")
        if s is None:
            s = _shared["spool"] = Spool(_env.value("KCOMPACT_S3_SPOOL_MB") << 20)
        return s  # type: ignore[return-value]
