"""Consume a compacted topic as a local key-value map (LevelDB via plyvel).

The GlobalKTable / faust Table / quixstreams State use case, built from compacted data instead of
replaying history:

* **Bulk build** (``kcompact kv build``): decides which record is the latest per key from the
  ``.bcq`` entries alone (offset, timestamp, keyed digest, flags), without decoding any record;
  then reads only the winners' bytes, sorts them by key and writes them in large WriteBatches
  (sorted batches become non-overlapping LevelDB tables: no merge work afterwards). Keys whose
  latest record is a tombstone are simply absent. Keyless records are skipped and counted.
* **Catch-up and follow**: from the map's own offsets, record by record from the store (as the
  mirror appends) or straight from the Kafka topic (``assign()`` at the map's offsets,
  ``isolation.level=read_committed``), one WriteBatch per batch of records with the new offsets
  inside it (connectors/plugins/leveldb_sink.py): a restart neither loses nor repeats an update.
* **Read API**: :class:`KVMap` (``get``, ``in``, ``items`` with prefix/range scans, ``len``,
  ``snapshot()``, ``offsets()``); ``kcompact kv get``.

A key in several partitions of a topic is a producer bug (Kafka orders a key only within its
partition). The bulk build resolves it deterministically: within a partition the highest offset
wins (Kafka semantics), across partitions the highest (timestamp, partition) of each partition's
latest record wins, and ``stats()['conflicts']`` counts such keys. Catch-up and follow apply
records in the order they read them (partition by partition, offset order within each), so a key
written by two partitions while following holds the last one applied.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import plyvel

from kcompact.reput import ReputError, Store
from kcompact.reput._gc import bulk_gc
from kcompact.reput.errors import CorruptRecordError

from . import _kv_kernels as KK
from .plugins.leveldb_sink import (DATA, DATA_END, K_BUILD, K_SOURCE, KVCorruptionError, KVError,
                                   KVLockedError, KVNotFoundError, KVSourceMismatchError,
                                   LevelDBSink, corruption, open_db, read_count, read_json,
                                   read_offsets, read_stats)

__all__ = ["KVMap", "KVSnapshot", "MapBuilder", "Following", "build_map", "kv_demo_step",
           "KVError", "KVNotFoundError", "KVSourceMismatchError", "KVCorruptionError",
           "KVLockedError", "cmd_kv_build", "cmd_kv_get"]

DEFAULT_BUILD_MEMORY = 1 << 30   # winners' keys and values held for one sorted run
BATCH_BYTES = 16 << 20           # bytes of keys and values per bulk WriteBatch
READ_BYTES = 8 << 20             # bytes per store read
FOLLOW_BATCH_RECORDS = 50_000    # records per follow WriteBatch
FOLLOW_BATCH_BYTES = 16 << 20
POLL_INTERVAL = 0.2              # seconds between polls of a caught-up store or topic
#: LevelDB block cache of a KVMap (filled on demand; tables LevelDB maps into memory, up to
#: 1000 of them, are read through the mapping instead).
DEFAULT_CACHE_SIZE = 64 << 20
_D = DATA[0]

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# read API


def _key_bytes(key: bytes | str) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    return bytes(key) if not isinstance(key, bytes) else key


def _successor(prefix: bytes) -> bytes | None:
    """The first byte string after every string that starts with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


def _make_converter(name: str | Any, configs: Mapping[str, Any] | None):
    if name is None or not isinstance(name, str):
        return name
    short = {"json": "JsonConverter", "avro": "AvroConverter", "string": "StringConverter",
             "bytes": "ByteArrayConverter", "bytearray": "ByteArrayConverter"}
    try:
        from .framework.converters import make_converter
    except ImportError as e:
        raise KVError(f"value converters are not available in this kcompact: {e}") from None
    return make_converter(short.get(name.lower(), name), dict(configs or {}), is_key=False)


class _Reader:
    """Reads shared by the live map and its snapshots (``_r`` is a plyvel DB or Snapshot)."""

    _r: Any
    path: str
    topic: str
    _conv: Any = None
    verify_checksums = False

    def _decode(self, v: bytes | None):
        if v is None or self._conv is None:
            return v
        return self._conv.to_connect(self.topic, v)

    def get(self, key: bytes | str, default: Any = None) -> Any:
        """The latest value of ``key`` (bytes, or decoded by the value converter), else
        ``default``."""
        try:
            v = self._r.get(DATA + _key_bytes(key), verify_checksums=self.verify_checksums)
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None
        if v is None:
            return default
        return v if self._conv is None else self._decode(v)

    def __getitem__(self, key: bytes | str) -> Any:
        v = self.get(key)
        if v is None:
            raise KeyError(key)
        return v

    def __contains__(self, key: bytes | str) -> bool:
        try:
            v = self._r.get(DATA + _key_bytes(key), verify_checksums=self.verify_checksums)
            return v is not None
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None

    def __len__(self) -> int:
        """Live keys, kept in the map's metadata (O(1))."""
        try:
            return read_count(self._r)
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None

    def _iter(self, prefix, start, stop, reverse, include_value):
        lo = DATA + (_key_bytes(start) if start is not None else b"")
        hi = DATA + _key_bytes(stop) if stop is not None else DATA_END
        if prefix is not None:
            lo = max(lo, DATA + _key_bytes(prefix))
            hi = min(hi, _successor(DATA + _key_bytes(prefix)) or DATA_END)
        if lo >= hi:
            return
        it = self._r.iterator(start=lo, stop=hi, reverse=reverse, include_value=include_value,
                              verify_checksums=True, fill_cache=False)
        try:
            if include_value:
                for k, v in it:
                    yield k[1:], (v if self._conv is None else self._decode(v))
            else:
                for k in it:
                    yield k[1:]
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None
        finally:
            it.close()

    def items(self, prefix: bytes | str | None = None, start: bytes | str | None = None,
              stop: bytes | str | None = None, *, reverse: bool = False
              ) -> Iterator[tuple[bytes, Any]]:
        """(key, value) in key order: keys starting with ``prefix``, and/or in
        [``start``, ``stop``) (start inclusive, stop exclusive)."""
        return self._iter(prefix, start, stop, reverse, True)

    def keys(self, prefix: bytes | str | None = None, start: bytes | str | None = None,
             stop: bytes | str | None = None, *, reverse: bool = False) -> Iterator[bytes]:
        return self._iter(prefix, start, stop, reverse, False)

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def offsets(self) -> dict[int, int]:
        """{partition: next offset to apply}: every record below it is in the map (Kafka's
        committed-offset convention)."""
        return read_offsets(self._r)

    def stats(self) -> dict[str, int]:
        d = read_stats(self._r)
        d["keys"] = read_count(self._r)
        return d

    def verify(self) -> dict[str, int]:
        """Read every key and value with LevelDB's block checksums and check the key count kept
        in the metadata. Raises KVCorruptionError on any damage; returns {"keys": n}."""
        n = sum(1 for _ in self._iter(None, None, None, False, True))
        count = len(self)
        if n != count:
            raise KVCorruptionError(f"{self.path}: the metadata counts {count:,} keys but the map "
                                    f"holds {n:,}; delete the directory and run `kcompact kv "
                                    "build` again")
        return {"keys": n}

    @property
    def building(self) -> bool:
        """True while a bulk build is unfinished (the map is partial until it completes)."""
        return self._r.get(K_BUILD) is not None


class KVSnapshot(_Reader):
    """A consistent point-in-time view of a map (a LevelDB snapshot): values, len and offsets
    all as of the same batch. Release it with ``close()`` or a ``with`` block."""

    def __init__(self, kvmap: "KVMap"):
        self.path, self.topic, self._conv = kvmap.path, kvmap.topic, kvmap._conv
        self.verify_checksums = kvmap.verify_checksums
        self._r = kvmap._db.snapshot()

    def close(self) -> None:
        if self._r is not None:
            self._r.close()
            self._r = None

    def __enter__(self) -> "KVSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVMap(_Reader):
    """A topic's latest value per key, from a map directory built by ``kcompact kv build``.

    ::

        with KVMap("/data/users.kv") as m:
            m.get(b"user-1")                 # bytes, or None
            b"user-1" in m, len(m)
            for k, v in m.items(prefix=b"user-"): ...
            with m.snapshot() as s: ...      # consistent reads while a follower writes

    ``value_converter`` ("json", "avro", "string", a converter class name, or a Converter)
    decodes values as the connectors do (``converter_config``: its settings, e.g.
    ``{"schema.registry.url": ...}`` for Avro). ``verify_checksums=True`` makes ``get`` and
    ``in`` check the CRC of the table block they read: LevelDB reads tables through mmap, which
    bypasses its block cache, so that is a CRC of a 4 KiB block on every lookup (measured +2.5 us
    at p50, several times that at p99); scans (``items``, ``keys``) and :meth:`verify` always
    check, and so does ``kcompact kv get``. ``cache_size``: LevelDB's block cache in bytes (for
    blocks read without mmap). ``create=True`` makes an empty map to
    :meth:`follow` in this process (LevelDB allows one process per map: another process that has
    it open makes this raise KVLockedError).
    """

    def __init__(self, path: str | os.PathLike, *, value_converter: Any = None,
                 converter_config: Mapping[str, Any] | None = None, create: bool = False,
                 verify_checksums: bool = False, cache_size: int = DEFAULT_CACHE_SIZE):
        self.path = os.fspath(path)
        self._db = open_db(self.path, create=create, options={"lru_cache_size": cache_size})
        self._r = self._db
        self.verify_checksums = verify_checksums
        try:
            src = read_json(self._db, K_SOURCE) or {}
        except plyvel.CorruptionError as e:
            self._db.close()
            raise corruption(self.path, e) from None
        self.topic = src.get("topic") or ""
        try:
            self._conv = _make_converter(value_converter, converter_config)
        except Exception:
            self._db.close()
            raise
        self._following: list[Following] = []
        if self._conv is None:
            self.get = self._fast_get()   # the hot path: one closure, no attribute lookups

    def _fast_get(self):
        db_get, data, path, slow = self._db.get, DATA, self.path, _Reader.get.__get__(self)
        corrupt = plyvel.CorruptionError
        if self.verify_checksums:
            def get(key, default=None):
                try:
                    v = db_get(data + key, verify_checksums=True)
                except TypeError:       # a str (or bytearray...) key
                    return slow(key, default)
                except corrupt as e:
                    raise corruption(path, e) from None
                return default if v is None else v
        else:
            def get(key, default=None):
                try:
                    v = db_get(data + key)
                except TypeError:
                    return slow(key, default)
                except corrupt as e:
                    raise corruption(path, e) from None
                return default if v is None else v
        get.__doc__ = _Reader.get.__doc__
        return get

    @property
    def source(self) -> dict[str, Any]:
        """Where the map's records come from: topic, store id, Kafka cluster id."""
        return read_json(self._db, K_SOURCE) or {}

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(self)

    def verify(self) -> dict[str, int]:
        with self.snapshot() as s:   # a follower may be writing: count and scan the same state
            return s.verify()

    def follow(self, store: str, topic: str, *, bootstrap_servers: str | None = None,
               kafka_config: Mapping[str, Any] | None = None, progress: Progress = _quiet,
               poll_interval: float = POLL_INTERVAL) -> "Following":
        """Build (if empty) and keep this map current in a background thread, from the store
        or, with ``bootstrap_servers``, from the Kafka topic. Stop it with ``.stop()``."""
        f = Following(MapBuilder(self.path, store, topic, bootstrap_servers=bootstrap_servers,
                                 kafka_config=kafka_config, progress=progress,
                                 poll_interval=poll_interval, db=self._db))
        self._following.append(f)
        if not self.topic:
            self.topic = topic
        return f.start()

    def close(self) -> None:
        for f in self._following:
            f.stop()
        self._following.clear()
        if self._db is not None and not self._db.closed:
            self._db.close()

    def __enter__(self) -> "KVMap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVMap({self.path!r}, topic={self.topic!r})"


class Following:
    """A MapBuilder running in a background thread (``KVMap.follow``)."""

    def __init__(self, builder: "MapBuilder"):
        self.builder = builder
        self._stop = threading.Event()
        self.caught_up = builder.caught_up
        self.error: BaseException | None = None
        self.report: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="kv-follow", daemon=True)

    def _run(self) -> None:
        try:
            self.report = self.builder.run(follow=True, stop=self._stop)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of wait()/stop()
            self.error = e
            self.caught_up.set()

    def start(self) -> "Following":
        self._thread.start()
        return self

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Block until the map has caught up once (built and up to date); re-raise a failure."""
        ok = self.caught_up.wait(timeout)
        if self.error is not None:
            raise self.error
        return ok

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise err


# ---------------------------------------------------------------------------------------------
# building and following


class _BatchWriter:
    """Writes prepared WriteBatches in order in a background thread (LevelDB releases the GIL
    while it writes, so the next batch is prepared meanwhile)."""

    def __init__(self, sink: LevelDBSink):
        self.sink = sink
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            wb = self.q.get()
            if wb is None:
                return
            if self.error is None:
                try:
                    self.sink.write(wb)
                except BaseException as e:  # noqa: BLE001 - re-raised by submit/close
                    self.error = e

    def submit(self, wb) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(wb)

    def close(self) -> None:
        self.q.put(None)
        self.t.join()
        if self.error is not None:
            raise self.error


def _spans(data: bytes, positions: np.ndarray):
    n = positions.shape[0]
    ks, kl, vs, vl = (np.empty(n, np.int64) for _ in range(4))
    attrs = np.empty(n, np.uint8)
    KK.record_spans(np.frombuffer(data, np.uint8), positions.astype(np.int64), ks, kl, vs, vl,
                    attrs)
    return ks, kl, vs, vl, attrs


def records_of(data: bytes, entries: np.ndarray) -> tuple[list, list]:
    """Keys and values (None for a null key / a tombstone) of a ReadResult's records."""
    ks, kl, vs, vl, attrs = _spans(data, entries["position"])
    a = attrs.tolist()
    kend = (ks + kl).tolist()
    vend = (vs + vl).tolist()
    keys = [None if f & 2 else data[s:e] for f, s, e in zip(a, ks.tolist(), kend)]
    values = [None if f & 1 else data[s:e] for f, s, e in zip(a, vs.tolist(), vend)]
    return keys, values


def _bytes_list(buf: np.ndarray, offs: np.ndarray) -> list[bytes]:
    """bytes objects of buf[offs[i]:offs[i+1]] (contiguous items). Items of one width come out
    of numpy's fixed-width bytes dtype in one C loop, several times faster than slicing."""
    n = offs.shape[0] - 1
    if n <= 0:
        return []
    lens = np.diff(offs)
    width = int(lens[0])
    a, b = int(offs[0]), int(offs[-1])
    if width > 0 and bool((lens == width).all()):
        rows = buf[a:b].reshape(n, width)
        out = rows.view(f"S{width}").ravel().tolist()
        for i in np.flatnonzero(rows[:, -1] == 0).tolist():
            out[i] = rows[i].tobytes()   # numpy's S dtype drops trailing NUL bytes
        return out
    data = buf[a:b].tobytes()
    o = (offs - a).tolist()
    return [data[o[i]:o[i + 1]] for i in range(n)]


def sort_order(kbuf: np.ndarray, koffs: np.ndarray) -> np.ndarray:
    """Indices that sort the keys kbuf[koffs[i]:koffs[i+1]] in bytes order (what LevelDB uses):
    fixed-width rows (key zero-padded, then its length big-endian) sorted as big-endian 64-bit
    columns with numpy's lexsort; Python's sort for keys longer than 60 bytes."""
    n = koffs.shape[0] - 1
    if n <= 1:
        return np.arange(n)
    lens = np.diff(koffs)
    width = (int(lens.max()) + 4 + 7) // 8 * 8
    if width > 64:
        kb = kbuf.tobytes()
        starts, ends = koffs[:-1].tolist(), koffs[1:].tolist()
        return np.array(sorted(range(n), key=lambda i: kb[starts[i]:ends[i]]), np.int64)
    rows = np.empty(n * width, np.uint8)
    KK.sort_rows(kbuf, koffs, width, rows)
    cols = rows.reshape(n, width).view(">u8")
    ncol = width // 8
    # columns that are the same in every row do not change the order
    keys = [c for c in (cols[:, j].astype(np.uint64) for j in range(ncol - 1, -1, -1))
            if c.shape[0] and not (c == c[0]).all()]
    if not keys:
        return np.arange(n)
    return np.lexsort(keys)


class _Run:
    """Winners' keys (with the data prefix) and values gathered for one sorted run."""

    def __init__(self, capacity: int = 1 << 20):
        self.kbuf = np.empty(capacity, np.uint8)
        self.vbuf = np.empty(capacity * 4, np.uint8)
        self.koffs = np.zeros(1 << 12, np.int64)
        self.voffs = np.zeros(1 << 12, np.int64)
        self.n = 0
        self.kpos = 0
        self.vpos = 0

    @property
    def nbytes(self) -> int:
        return self.kpos + self.vpos

    @staticmethod
    def _grow(a: np.ndarray, need: int) -> np.ndarray:
        if need <= a.shape[0]:
            return a
        b = np.empty(max(need, a.shape[0] * 2), a.dtype)
        b[: a.shape[0]] = a
        return b

    def add(self, data: bytes, positions: np.ndarray) -> None:
        ks, kl, vs, vl, _ = _spans(data, positions)
        m = positions.shape[0]
        src = np.frombuffer(data, np.uint8)
        self.koffs = self._grow(self.koffs, self.n + m + 1)
        self.voffs = self._grow(self.voffs, self.n + m + 1)
        self.kbuf = self._grow(self.kbuf, self.kpos + int(kl.sum()) + m)
        self.vbuf = self._grow(self.vbuf, self.vpos + int(vl.sum()))
        self.kpos = KK.gather(src, ks, kl, _D, self.kbuf, self.kpos, self.koffs, self.n)
        self.vpos = KK.gather(src, vs, vl, -1, self.vbuf, self.vpos, self.voffs, self.n)
        self.n += m


class MapBuilder:
    """Builds a map from a store and keeps it current (``kcompact kv build``).

    ``run()``: bulk build when the map is empty (or resume an interrupted one), catch up from
    the store, then with ``bootstrap_servers`` catch up from the Kafka topic; with
    ``follow=True`` keep following (the store, or Kafka) until ``stop`` is set.
    """

    def __init__(self, db_dir: str | os.PathLike, store: str, topic: str, *,
                 bootstrap_servers: str | None = None,
                 kafka_config: Mapping[str, Any] | None = None, progress: Progress = _quiet,
                 memory: int = DEFAULT_BUILD_MEMORY, batch_bytes: int = BATCH_BYTES,
                 poll_interval: float = POLL_INTERVAL, db: plyvel.DB | None = None,
                 kafka_idle_timeout: float = 30.0,
                 follow_batch_records: int = FOLLOW_BATCH_RECORDS,
                 follow_batch_bytes: int = FOLLOW_BATCH_BYTES):
        self.db_dir = os.fspath(db_dir)
        self.store_url, self.topic = store, topic
        self.bootstrap_servers = bootstrap_servers
        self.kafka_config = dict(kafka_config or {})
        self.progress = progress
        self.memory, self.batch_bytes = memory, batch_bytes
        self.poll_interval = poll_interval
        self.kafka_idle_timeout = kafka_idle_timeout
        self.follow_batch_records = follow_batch_records
        self.follow_batch_bytes = follow_batch_bytes
        self._db = db
        self.caught_up = threading.Event()
        self.report: dict[str, Any] = {"mode": None, "bulk_keys": 0, "applied_records": 0,
                                       "interrupted": False}

    # -- top level ---------------------------------------------------------------------------

    def run(self, *, follow: bool = False, stop: threading.Event | None = None) -> dict[str, Any]:
        with bulk_gc():  # reput/_gc.py
            return self._run_build(follow=follow, stop=stop)

    def _run_build(self, *, follow: bool, stop: threading.Event | None) -> dict[str, Any]:
        stop = stop or threading.Event()
        t0 = time.perf_counter()
        try:
            store = Store.open(self.store_url)
        except ReputError as e:
            raise KVError(f"cannot open store {self.store_url}: {e}") from None
        own_db = self._db is None
        db = open_db(self.db_dir, create=True) if own_db else self._db
        try:
            sink = LevelDBSink(db, self.db_dir)
            sink.check_source(self.topic, store_id=store.meta.store_id)
            if self.topic not in store.topics():
                raise KVError(f"topic {self.topic!r} is not in store {store.url} (topics: "
                              f"{', '.join(store.topics()) or 'none'})")
            sink.bind(self.topic, store_id=store.meta.store_id)
            if sink.build_state is not None:
                ends = {int(p): int(e) for p, e in sink.build_state["ends"].items()}
                self.progress(f"resuming the interrupted bulk build of {self.db_dir}")
                self.report["mode"] = "resume"
                self._bulk(store, sink, ends, resume=True, stop=stop)
            elif not sink.offsets and sink.count == 0:
                ends = {p: store.next_offset(self.topic, p) for p in store.partitions(self.topic)}
                self.report["mode"] = "bulk"
                self._bulk(store, sink, ends, resume=False, stop=stop)
            else:
                self.report["mode"] = "catch-up"
                self._check_lag(store, sink)
            if stop.is_set():
                self.report["interrupted"] = sink.build_state is not None
                return self._finish(sink, t0)
            n = self._catch_up_store(store, sink, stop)
            self.progress(f"caught up with the store: {n:,} more records applied; "
                          f"{sink.count:,} keys")
            if self.bootstrap_servers:
                self._kafka(sink, stop, follow)
            else:
                self.caught_up.set()
                if follow:
                    self._follow_store(store, sink, stop)
            return self._finish(sink, t0)
        finally:
            store.close()
            if own_db:
                db.close()

    def _check_lag(self, store: Store, sink: LevelDBSink) -> None:
        """Warn when deletes may have been compacted away before the map saw them.

        A tombstone the map has not applied was appended after the map last caught up, so
        compaction can purge it no sooner than delete.retention.ms after that moment, and only
        once the compaction horizon passed the map's offset (Kafka consumers have the same
        limit: a consumer that lags more than delete.retention.ms can miss deletes)."""
        if sink.caught_up_ms is None:
            return
        lag_ms = int(time.time() * 1000) - sink.caught_up_ms
        retention = store.topic_config(self.topic).delete_retention_ms
        if lag_ms <= retention:
            return
        from kcompact.reput.swap import read_checkpoint
        behind = []
        for p, off in sorted(sink.offsets.items()):
            try:
                cleaned = read_checkpoint(store.fs, store.partition(self.topic, p).dir)[0]
            except (OSError, ValueError, ReputError):
                cleaned = -1
            if cleaned >= off:
                behind.append(p)
        if behind:
            self.report["deletes_may_be_missed"] = behind
            self.progress(f"warning: the map last caught up {lag_ms / 3_600_000:.1f} h ago, more "
                          f"than delete.retention.ms ({retention / 3_600_000:.1f} h), and "
                          f"partitions {behind} were compacted past its offsets since: deletes "
                          "purged meanwhile cannot reach it; delete the map and build it again "
                          "for an exact copy")

    def _mark_caught_up(self, sink: LevelDBSink) -> None:
        now = int(time.time() * 1000)
        if sink.caught_up_ms is None or now - sink.caught_up_ms >= 10_000:
            sink.mark_caught_up(now)

    def _finish(self, sink: LevelDBSink, t0: float) -> dict[str, Any]:
        self.report.update(keys=sink.count, offsets=dict(sorted(sink.offsets.items())),
                           stats=dict(sink.stats), seconds=time.perf_counter() - t0)
        return self.report

    # -- bulk build --------------------------------------------------------------------------

    def _winners(self, store: Store, ends: Mapping[int, int]):
        table = None
        covered = keyless = conflicts = 0
        for p in sorted(ends):
            for attempt in range(5):
                try:
                    t, c, k = self._partition_table(store, p, ends[p])
                    break
                except (FileNotFoundError, CorruptRecordError):
                    # a compaction swap replaced the segments under us: list them again
                    if attempt == 4:
                        raise
                    store.release_partition(self.topic, p)
                    time.sleep(0.05)
            covered += c
            keyless += k
            if table is None:
                table = t
            else:
                conflicts += table.merge(t)
        if table is None:
            table = KK.DigestTable(16)
        return table, covered, keyless, conflicts

    def _partition_table(self, store: Store, p: int, end: int):
        pl = store.partition(self.topic, p)
        entries = sum(seg.entry_count for seg in pl.segments)
        # sized for every entry up to 4M (no rehash); a longer history grows it as keys come
        t = KK.DigestTable(int(min(entries, 4 << 20) / KK.MAX_LOAD) + 16)
        covered = keyless = 0
        for seg in list(pl.segments):
            if seg.base >= end:
                break
            done = False
            for _, e in pl.index_chunks(seg, 0, 1 << 16):
                c, k, done = t.upsert_latest(e, end, p)
                covered += c
                keyless += k
                if done:
                    break
            if done:
                break
        return t, covered, keyless

    def _bulk(self, store: Store, sink: LevelDBSink, ends: dict[int, int], *, resume: bool,
              stop: threading.Event) -> None:
        t0 = time.perf_counter()
        if resume:
            sink.resume_build()
        else:
            sink.begin_build(ends)
        table, covered, keyless, conflicts = self._winners(store, ends)
        parts, offs, dead = table.winners()
        self.progress(f"indexed {covered:,} records of {len(ends)} partition(s) from their .bcq "
                      f"entries in {time.perf_counter() - t0:.2f}s: {offs.shape[0]:,} live keys, "
                      f"{dead:,} deleted, {keyless:,} keyless skipped"
                      + (f", {conflicts:,} keys in more than one partition (resolved by the "
                         "highest timestamp, then partition)" if conflicts else ""))
        writer = _BatchWriter(sink)
        written = missing = 0
        last_note = time.monotonic()
        total = offs.shape[0]
        run = _Run()

        def flush_run() -> None:
            nonlocal written, last_note, run
            if run.n == 0:
                return
            ko, vo = run.koffs[: run.n + 1], run.voffs[: run.n + 1]
            order = sort_order(run.kbuf[: run.kpos], ko)
            klen, vlen = np.diff(ko), np.diff(vo)
            per = max(1000, int(self.batch_bytes * run.n / max(1, run.nbytes)))
            kout, vout = np.empty(0, np.uint8), np.empty(0, np.uint8)
            koo, voo = np.empty(per + 1, np.int64), np.empty(per + 1, np.int64)
            for lo in range(0, run.n, per):
                if stop.is_set():
                    return
                idx = order[lo:lo + per]
                m = idx.shape[0]
                kl, vl = klen[idx], vlen[idx]
                kout = _Run._grow(kout, int(kl.sum()))
                vout = _Run._grow(vout, int(vl.sum()))
                # the batch's keys and values, contiguous and in key order
                KK.gather(run.kbuf, ko[idx], kl, -1, kout, 0, koo, 0)
                KK.gather(run.vbuf, vo[idx], vl, -1, vout, 0, voo, 0)
                dkeys = _bytes_list(kout, koo[: m + 1])
                vals = _bytes_list(vout, voo[: m + 1])
                writer.submit(sink.prepare_puts(dkeys, vals, check_existing=resume))
                written += m
                if time.monotonic() - last_note > 2:
                    last_note = time.monotonic()
                    self.progress(f"written {written:,} of {total:,} keys "
                                  f"({100 * written / max(total, 1):.0f}%)")
            run = _Run()

        try:
            for p in sorted(ends):
                w = offs[np.searchsorted(parts, p, "left"):np.searchsorted(parts, p, "right")]
                if w.shape[0] == 0:
                    continue
                pl = store.partition(self.topic, p)
                i = 0
                while i < w.shape[0]:
                    if stop.is_set():
                        break
                    r = pl.read(int(w[i]), max_bytes=READ_BYTES)
                    e = r.entries
                    if e.shape[0] == 0:
                        missing += w.shape[0] - i
                        break
                    eo = e["offset"]
                    j = int(np.searchsorted(w, eo[-1], "right"))
                    sel = w[i:j]
                    idx = np.minimum(np.searchsorted(eo, sel), eo.shape[0] - 1)
                    present = eo[idx] == sel
                    missing += int(sel.shape[0] - np.count_nonzero(present))
                    if present.any():
                        run.add(r.data, e["position"][idx[present]])
                    if run.nbytes >= self.memory:
                        flush_run()
                    i = j
                if stop.is_set():
                    break
            if not stop.is_set():
                self.progress(f"read {run.n:,} winning records in "
                              f"{time.perf_counter() - t0:.2f}s; sorting and writing")
                flush_run()
        finally:
            writer.close()
        if stop.is_set():
            self.progress(f"interrupted after {written:,} of {total:,} keys; run the same "
                          "command to resume")
            return
        sink.finish_build(ends, records=covered, keyless=keyless, conflicts=conflicts,
                          missing=missing)
        self.report["bulk_keys"] = written
        self.progress(f"bulk build done: {sink.count:,} keys in {time.perf_counter() - t0:.2f}s"
                      + (f" ({missing:,} winning records were compacted away meanwhile: "
                         "their newer records follow)" if missing else ""))

    # -- record-wise catch-up and follow from the store ---------------------------------------

    def _catch_up_store(self, store: Store, sink: LevelDBSink, stop: threading.Event) -> int:
        """Apply everything the store holds after the map's offsets; returns records applied."""
        total = 0
        while not stop.is_set():
            keys: list = []
            values: list = []
            nxt: dict[int, int] = {}
            nbytes = 0
            for p in store.partitions(self.topic):
                pl = store.partition(self.topic, p)
                off = sink.offsets.get(p, 0)
                while nbytes < self.follow_batch_bytes and len(keys) < self.follow_batch_records:
                    r = pl.read(off, max_records=self.follow_batch_records - len(keys),
                                max_bytes=min(READ_BYTES, self.follow_batch_bytes - nbytes))
                    if r.entries.shape[0] == 0:
                        if r.next_offset > off and p in sink.offsets:
                            nxt[p] = off = r.next_offset   # past a gap at the end
                        elif p not in sink.offsets:
                            nxt[p] = off                   # a new partition: record it
                        break
                    k, v = records_of(r.data, r.entries)
                    keys += k
                    values += v
                    nbytes += len(r.data)
                    nxt[p] = off = r.next_offset
            if not keys and all(sink.offsets.get(p) == o for p, o in nxt.items()):
                if not self.bootstrap_servers:
                    self._mark_caught_up(sink)
                return total
            sink.apply(keys, values, nxt)
            total += len(keys)
            self.report["applied_records"] += len(keys)
        return total

    def _follow_store(self, store: Store, sink: LevelDBSink, stop: threading.Event) -> None:
        self.progress(f"following topic {self.topic!r} of store {store.url} (stop with Ctrl-C)")
        while not stop.is_set():
            n = self._catch_up_store(store, sink, stop)
            if n:
                self.progress(f"applied {n:,} records; {sink.count:,} keys")
            else:
                stop.wait(self.poll_interval)

    # -- Kafka ---------------------------------------------------------------------------------

    def _start(self, consumer: Any, sink: LevelDBSink, partition: int) -> int:
        """Where a partition's consumption starts: after the map's last record, or at the
        partition's low watermark for a new map (asked for here: ~0.5 s sooner than
        librdkafka's own OFFSET_BEGINNING lookup, as in connectors/framework/worker.py)."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
        if partition in sink.offsets:
            return sink.offsets[partition]
        try:
            lo, _ = consumer.get_watermark_offsets(TopicPartition(self.topic, partition),
                                                   timeout=15)
        except KafkaException:
            return OFFSET_BEGINNING  # let librdkafka look it up
        return lo if lo is not None and lo >= 0 else OFFSET_BEGINNING

    def _kafka(self, sink: LevelDBSink, stop: threading.Event, follow: bool) -> None:
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        from .framework.kafka_columns import ColumnReader
        from .framework.kafka_clients import kafka_logger

        def error_cb(err: Any) -> None:
            return None
        logger = kafka_logger()
        conf = {"bootstrap.servers": self.bootstrap_servers,
                "group.id": f"kcompact-kv-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False, "enable.auto.offset.store": False,
                "isolation.level": "read_committed", "auto.offset.reset": "error",
                "enable.partition.eof": True, "error_cb": error_cb, "logger": logger,
                # a map builds slower than Kafka serves: without this, librdkafka's prefetch
                # queue goes over its limit and the next fetch waits 1 s (connectors/framework/worker.py)
                "fetch.queue.backoff.ms": 10}
        conf.update(self.kafka_config)
        conf["isolation.level"] = "read_committed"
        try:
            consumer = Consumer(conf)
        except KafkaException as e:
            raise KVError(f"invalid Kafka consumer settings: {e}") from None
        # batches as columns, without Message objects (connectors/framework/kafka_columns.py), when built
        reader = ColumnReader.attach(consumer, error_cb, logger)
        try:
            try:
                md = consumer.list_topics(self.topic, timeout=15)
            except KafkaException as e:
                raise KVError(f"cannot reach Kafka at {self.bootstrap_servers}: {e}") from None
            tmd = md.topics.get(self.topic)
            if tmd is None or tmd.error is not None or not tmd.partitions:
                raise KVError(f"topic {self.topic!r} is not on the Kafka cluster at "
                              f"{self.bootstrap_servers}"
                              + (f" ({tmd.error})" if tmd is not None and tmd.error else ""))
            sink.bind(self.topic, cluster_id=md.cluster_id)
            parts = sorted(tmd.partitions)
            consumer.assign([TopicPartition(self.topic, p, self._start(consumer, sink, p))
                             for p in parts])
            self.progress(f"consuming {self.topic!r} from {self.bootstrap_servers} at the map's "
                          f"offsets {dict(sorted((p, sink.offsets.get(p, 0)) for p in parts))}")
            at_end: set[int] = set()
            idle_since = time.monotonic()
            while not stop.is_set():
                if reader is not None:
                    keys, values, nxt = self._columns(reader, at_end)
                else:
                    keys, values, nxt = self._messages(consumer, at_end)
                if keys:
                    sink.apply(keys, values, nxt)
                    self.report["applied_records"] += len(keys)
                    idle_since = time.monotonic()
                    if follow and self.caught_up.is_set():
                        self.progress(f"applied {len(keys):,} records; {sink.count:,} keys")
                if at_end >= set(parts):
                    self._mark_caught_up(sink)
                if at_end >= set(parts) and not self.caught_up.is_set():
                    self.caught_up.set()
                    self.progress(f"caught up with Kafka: {sink.count:,} keys")
                    if not follow:
                        return
                    self.progress(f"following {self.topic!r} on {self.bootstrap_servers} "
                                  "(stop with Ctrl-C)")
                if (not follow and not keys
                        and time.monotonic() - idle_since > self.kafka_idle_timeout):
                    missing = sorted(set(parts) - at_end)
                    raise KVError(f"Kafka partitions {missing} of {self.topic!r} sent neither "
                                  f"records nor their end for {self.kafka_idle_timeout:.0f}s "
                                  "(is the map ahead of the topic? it may have been recreated)")
        finally:
            if reader is not None:
                reader.close()  # before the consumer's close: it holds the consumer's queue
            consumer.close()

    def _kafka_error(self, code: int, text: str, fatal: bool, retriable: bool) -> None:
        from confluent_kafka import KafkaError
        if fatal or not retriable:
            raise KVError(f"Kafka consumer of {self.topic!r}: {text}"
                          + (" (the map's next offset is no longer in the topic: delete the "
                             "map and build it again)"
                             if code == KafkaError._AUTO_OFFSET_RESET else ""))

    def _messages(self, consumer: Any, at_end: set) -> tuple[list, list, dict]:
        """One consume(): keys, values and next offsets per partition; ends seen into at_end."""
        from confluent_kafka import KafkaError
        keys: list = []
        values: list = []
        nxt: dict[int, int] = {}
        for m in consumer.consume(num_messages=self.follow_batch_records, timeout=0.2):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition())
                else:
                    self._kafka_error(err.code(), err.str(), err.fatal(), err.retriable())
                continue
            p = m.partition()
            at_end.discard(p)
            keys.append(m.key())
            values.append(m.value())
            nxt[p] = m.offset() + 1
        return keys, values, nxt

    def _columns(self, reader: Any, at_end: set) -> tuple[list, list, dict]:
        """The same from a ColumnReader batch. Its end-of-partition events come apart from the
        records, so a partition is at its end when its event's offset is past every record of
        it in the batch (a record after the event means the partition grew again)."""
        from confluent_kafka import KafkaError

        from .framework.kafka_columns import PackedBytes, next_offsets
        b = reader.consume(self.follow_batch_records, 0.2)
        eof: dict[int, int] = {}
        for ev in b.events:
            if ev.code == KafkaError._PARTITION_EOF:
                eof[ev.partition] = ev.offset
            else:
                # not retriable: as for a Message's error, whose KafkaError never says so
                self._kafka_error(ev.code, ev.reason, ev.fatal, False)
        nxt = next_offsets(b.partitions, b.offsets)
        for p in nxt:
            at_end.discard(p)
        for p, off in eof.items():
            if nxt.get(p, -1) <= off:
                at_end.add(p)
        if not nxt:
            return [], [], nxt
        kb, ko, kn, vb, vo, vn = b.packed
        return PackedBytes.unpacked(kb, ko, kn), PackedBytes.unpacked(vb, vo, vn), nxt


def build_map(db_dir: str | os.PathLike, store: str, topic: str, *, follow: bool = False,
              bootstrap_servers: str | None = None, stop: threading.Event | None = None,
              progress: Progress = _quiet, **options: Any) -> dict[str, Any]:
    """Build (or resume, or catch up) the map at ``db_dir`` from ``store``; see MapBuilder."""
    return MapBuilder(db_dir, store, topic, bootstrap_servers=bootstrap_servers,
                      progress=progress, **options).run(follow=follow, stop=stop)


# ---------------------------------------------------------------------------------------------
# the demo


def kv_demo_step(store_path: str, topic: str, db_dir: str) -> list[tuple[bytes, bytes | None]]:
    """Build the map of ``topic`` from the store at ``store_path`` into ``db_dir`` and look a
    few keys up: the first two and the last key of the map, one from the middle, and a key that
    is not there (value None). Returns the (key, value) lookups."""
    build_map(db_dir, store_path, topic)
    with KVMap(db_dir) as m:
        keys = list(m.keys())
        picks = keys[:2] + keys[len(keys) // 2: len(keys) // 2 + 1] + keys[-1:]
        picks.append(b"no-such-key")
        return [(k, m.get(k)) for k in dict.fromkeys(picks)]


# ---------------------------------------------------------------------------------------------
# command line (wired in connectors/cli.py)


def _kv_config(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise KVError(f"{what}: expected KEY=VALUE, got {item!r}")
        out[k.strip()] = v
    return out


def cmd_kv_build(args) -> int:
    stop = threading.Event()

    def progress(m: str) -> None:
        print(f"kv build: {m}", file=sys.stderr, flush=True)

    previous = {}

    def on_signal(signum, _frame) -> None:
        if not stop.is_set():
            print(f"kv build: {signal.Signals(signum).name}: finishing the current batch",
                  file=sys.stderr, flush=True)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        b = MapBuilder(args.db, args.store, args.topic,
                       bootstrap_servers=getattr(args, "bootstrap_servers", None),
                       kafka_config=_kv_config(getattr(args, "kafka_config", None), "-X"),
                       progress=progress)
        rep = b.run(follow=bool(args.follow), stop=stop)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    offsets = ", ".join(f"{p}:{o}" for p, o in rep["offsets"].items())
    print(f"{args.db}: {rep['keys']:,} keys of topic {args.topic!r} "
          f"({rep['stats']['records']:,} records covered, {rep['stats']['keyless']:,} keyless "
          f"skipped), next offsets {{{offsets}}}, {rep['seconds']:.2f}s")
    if rep["interrupted"]:
        print("kv build: interrupted before the bulk build finished; run the same command to "
              "resume", file=sys.stderr)
        return 130
    return 0


def cmd_kv_get(args) -> int:
    if getattr(args, "key_base64", False):
        try:
            key = base64.b64decode(args.key, validate=True)
        except ValueError:
            raise KVError(f"--key-base64: {args.key!r} is not valid base64") from None
    else:
        key = args.key.encode("utf-8")
    conv = getattr(args, "value_converter", None)
    with KVMap(args.db, value_converter=conv, verify_checksums=True,
               converter_config=_kv_config(getattr(args, "converter_config", None),
                                           "--converter-config")) as m:
        if m.building:
            print(f"kv get: warning: the bulk build of {args.db} is unfinished; the map is "
                  "partial", file=sys.stderr)
        value = m.get(key)
    found = value is not None
    if args.json:
        doc: dict[str, Any] = {}
        _text_or_b64("key", key, doc)
        doc["found"] = found
        if found:
            if conv is None:
                _text_or_b64("value", value, doc)
            else:
                doc["value"] = value
        json.dump(doc, sys.stdout, default=_json_default)
        sys.stdout.write("\n")
    elif found:
        if isinstance(value, bytes):
            sys.stdout.buffer.write(value + b"\n")
        else:
            sys.stdout.write(json.dumps(value, default=_json_default) + "\n")
    sys.stdout.flush()
    return 0 if found else 1


def _text_or_b64(name: str, data: bytes, out: dict[str, Any]) -> None:
    try:
        out[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[name] = None
        out[f"{name}_b64"] = base64.b64encode(data).decode()


def _json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray)):
        return base64.b64encode(bytes(o)).decode()
    return str(o)

