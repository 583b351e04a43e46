"""The read side of the key-value map: :class:`KVMap` (``get``, ``in``, ``items`` with prefix and
range scans, ``len``, ``snapshot()``, ``offsets()``), its consistent :class:`KVSnapshot`, and
:class:`Following`, a builder keeping the map current in a background thread (``KVMap.follow``).
Values are bytes as Kafka holds them, or decoded by a value converter (``json``, ``avro``...).
The map's layout on disk: docs/formats/kv-map.md.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator, Mapping

import plyvel

from ...framework.converters import make_converter
from ...plugins.leveldb_sink import (DATA, DATA_END, K_BUILD, K_CAUGHT_UP, K_SOURCE,
                                     KVCorruptionError,
                                     corruption, open_db, read_count, read_json, read_offsets,
                                     read_stats)
from .build import POLL_INTERVAL, MapBuilder, Progress, quiet

#: LevelDB block cache of a KVMap (filled on demand; tables LevelDB maps into memory, up to
#: 1000 of them, are read through the mapping instead).
DEFAULT_CACHE_SIZE = 64 << 20


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
        if reverse:
            yield from self._iter_reverse(lo, hi, include_value)
            return
        it = self._r.iterator(start=lo, stop=hi, include_value=include_value,
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

    def _iter_reverse(self, lo: bytes, hi: bytes, include_value: bool):
        """[lo, hi) from the last key down, on a raw iterator: plyvel 1.5's reverse
        ``iterator(start=, stop=)`` returns nothing when the key after the range's last key lies
        outside it (``[b"b", b"c")`` of {a, b, d}: none), as a hypothesis test found."""
        it = self._r.raw_iterator(verify_checksums=True, fill_cache=False)
        try:
            it.seek(hi)  # the first key >= hi, the one after the range
            if it.valid():
                it.prev()
            else:
                it.seek_to_last()
            while it.valid():
                k = it.key()
                if k < lo:
                    break
                if include_value:
                    v = it.value()
                    yield k[1:], (v if self._conv is None else self._decode(v))
                else:
                    yield k[1:]
                it.prev()
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
               kafka_config: Mapping[str, Any] | None = None, progress: Progress = quiet,
               poll_interval: float = POLL_INTERVAL) -> "Following":
        """Build (if empty) and keep this map current in a background thread, from the store
        or, with ``bootstrap_servers``, from the Kafka topic. Stop it with ``.stop()``."""
        f = Following(self.builder(store, topic, bootstrap_servers=bootstrap_servers,
                                   kafka_config=kafka_config, progress=progress,
                                   poll_interval=poll_interval))
        self._following.append(f)
        if not self.topic:
            self.topic = topic
        return f.start()

    def builder(self, store: str, topic: str, **options: Any) -> MapBuilder:
        """A MapBuilder writing this map through this process's handle (LevelDB allows one
        process per map: the builder and the reads share it); MapBuilder's options."""
        if not self.topic:
            self.topic = topic
        return MapBuilder(self.path, store, topic, db=self._db, **options)

    def caught_up_ms(self) -> int | None:
        """When the map last held everything its source had (ms since the epoch; written at
        most every 10 s while following), None before the first time."""
        raw = self._db.get(K_CAUGHT_UP)
        return int.from_bytes(raw, "little", signed=True) if raw else None

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

    @property
    def alive(self) -> bool:
        """True while the follower's thread runs (it ends on stop() or a failure)."""
        return self._thread.is_alive()

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
