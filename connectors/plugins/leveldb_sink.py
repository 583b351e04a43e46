"""The LevelDB sink: the latest value of each key of one topic, in a local LevelDB (plyvel).

Layout (spec: docs/formats/kv-map.md). Every user key is stored as ``b"d" + key`` -> the value's
bytes as the record holds them; metadata lives under ``b"m"``, so no user key can ever reach it:

    msource                JSON: format version, topic, store id, Kafka cluster id
    moffset/<u32 BE p>     int64: the next offset of partition p to apply (Kafka's committed-offset
                           convention: everything below it is in the map)
    mcount                 int64: live keys (len() is one read)
    mstats                 int64 counters (STATS)
    mbuild                 JSON: the end offsets of an unfinished bulk build
    mcaughtup              int64: when (ms) the map last held everything its source had

Exactly once: every WriteBatch that changes data also writes the new offsets, the key count and
the counters. LevelDB applies a batch atomically (its log holds all of a batch or none of it),
so after a crash, SIGKILL included, the offsets describe exactly the data: a restart resumes
from them and neither loses nor re-applies an update. Batches are written without fsync: a
process crash loses nothing; an OS crash can take the map back to an earlier batch, offsets
included, and it catches up again.

A map remembers where it came from (store id, Kafka cluster id, topic) and refuses records of
another source. Corruption (plyvel.CorruptionError: a damaged .ldb/.log/MANIFEST) is reported,
never repaired or rebuilt behind the user's back. LevelDB allows one process per database.
"""

from __future__ import annotations

import collections
import json
import os
import struct
import time
from typing import Any, Iterable, Mapping, Sequence

import plyvel

from ..errors import ConnectorsError

FORMAT_VERSION = 1
DATA = b"d"
DATA_END = b"e"     # the first key after every data key
META = b"m"
META_END = b"n"
K_SOURCE = b"msource"
K_COUNT = b"mcount"
K_STATS = b"mstats"
K_BUILD = b"mbuild"
K_CAUGHT_UP = b"mcaughtup"
K_OFFSET = b"moffset/"

#: counters kept in ``mstats``: source records covered by the offsets, keyless records skipped,
#: values written, keys deleted by a tombstone, keys found in more than one partition by a bulk
#: build, winning records a bulk build did not find (compacted away while it ran; follow applies
#: their newer records). puts/deletes count writes after merging the updates of one batch.
STATS = ("records", "keyless", "puts", "deletes", "conflicts", "missing")
_I64 = struct.Struct("<q")
_PART = struct.Struct(">I")
_STATS = struct.Struct("<" + "q" * len(STATS))

#: plyvel options. The bloom filter makes a lookup of an absent key (kv get, the existence
#: check of each update) skip tables without reading them; paranoid checks make LevelDB report a
#: damaged log or table instead of skipping it. No block compression: snappy halved the bulk
#: build's LevelDB throughput (1M 100-byte values: 3.7 s -> 1.8 s without it) and adds a
#: decompression to every block read; values are usually already as compact as the producer
#: made them (Avro, compressed payloads), and the store keeps the history anyway. 16 MiB
#: memtables: flushed in the background while the next batches are written.
DB_OPTIONS = dict(bloom_filter_bits=10, paranoid_checks=True, max_open_files=1000,
                  compression=None)
WRITER_OPTIONS = dict(DB_OPTIONS, write_buffer_size=16 << 20, lru_cache_size=32 << 20)
READER_OPTIONS = dict(DB_OPTIONS, lru_cache_size=64 << 20)


class KVError(ConnectorsError):
    """Root of the key-value map's errors."""


class KVNotFoundError(KVError):
    """No map at that directory: build one with
    `kcompact kv build --store URL --topic T --db DIR`."""


class KVSourceMismatchError(KVError):
    """The map was built from another topic, store or Kafka cluster: use another --db directory
    (or delete this one to rebuild it from the new source)."""


class KVCorruptionError(KVError):
    """A LevelDB file of the map is damaged. kcompact does not repair or rebuild it silently:
    delete the directory and run `kcompact kv build` again (the store holds everything)."""


class KVLockedError(KVError):
    """Another process has the map open (LevelDB allows one process at a time): stop it, or read
    the map inside that process through KVMap."""


def _message(e: BaseException) -> str:
    """plyvel's errors carry LevelDB's status as bytes."""
    arg = e.args[0] if e.args else ""
    text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)
    text = text.strip()
    return text.splitlines()[0] if text else type(e).__name__


def corruption(path: str, e: BaseException) -> KVCorruptionError:
    detail = _message(e)
    return KVCorruptionError(
        f"{path}: the map's LevelDB files are corrupt ({detail}); it is not rebuilt automatically: "
        "delete the directory and run `kcompact kv build` again")


def open_db(path: str, *, create: bool, options: Mapping[str, Any] | None = None) -> plyvel.DB:
    """Open (or create) the LevelDB of a map, turning LevelDB's errors into one-line KVErrors."""
    path = os.fspath(path)
    has_db = os.path.isfile(os.path.join(path, "CURRENT"))
    if not has_db:
        if not create:
            raise KVNotFoundError(f"{path} is not a kcompact key-value map (no LevelDB files); "
                                  "build one with `kcompact kv build --store URL --topic T --db "
                                  f"{path}`")
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise KVError(f"{path} exists and is not a LevelDB database; choose a new or empty "
                          "directory for the map")
    opts = dict(READER_OPTIONS if not create else WRITER_OPTIONS)
    opts.update(options or {})
    try:
        db = plyvel.DB(path, create_if_missing=create, **opts)
    except plyvel.CorruptionError as e:
        raise corruption(path, e) from None
    except plyvel.IOError as e:
        if "lock" in str(e).lower():
            raise KVLockedError(f"{path} is open in another process (LevelDB allows one process "
                                "at a time): stop it (a running `kcompact kv build --follow`?) or "
                                "read the map inside that process through KVMap") from None
        raise KVError(f"{path}: cannot open the map: {_message(e)}") from None
    except plyvel.Error as e:
        raise KVError(f"{path}: cannot open the map: {_message(e)}") from None
    try:
        raw = db.get(K_SOURCE)
        if raw is None and has_db and next(db.iterator(include_value=False), None) is not None:
            db.close()
            raise KVError(f"{path} is a LevelDB database but not a kcompact key-value map "
                          "(no msource key); choose another directory")
        if raw is not None:
            version = int(json.loads(raw).get("format_version", 0))
            if version > FORMAT_VERSION:
                db.close()
                raise KVError(f"{path}: map format version {version} is newer than this kcompact "
                              f"understands ({FORMAT_VERSION}); upgrade kcompact")
    except plyvel.CorruptionError as e:
        db.close()
        raise corruption(path, e) from None
    except (ValueError, AttributeError):
        db.close()
        raise corruption(path, ValueError("the msource metadata is not valid JSON")) from None
    return db


def read_offsets(reader) -> dict[int, int]:
    """{partition: next offset} from a DB or snapshot."""
    out = {}
    for k, v in reader.iterator(prefix=K_OFFSET):
        out[_PART.unpack(k[len(K_OFFSET):])[0]] = _I64.unpack(v)[0]
    return out


def read_count(reader) -> int:
    raw = reader.get(K_COUNT)
    return _I64.unpack(raw)[0] if raw else 0


def read_stats(reader) -> dict[str, int]:
    raw = reader.get(K_STATS)
    return dict(zip(STATS, _STATS.unpack(raw))) if raw else dict.fromkeys(STATS, 0)


def read_json(reader, key: bytes) -> dict | None:
    raw = reader.get(key)
    return json.loads(raw) if raw else None


def describe_source(src: Mapping[str, Any]) -> str:
    parts = [f"topic {src.get('topic')!r}"]
    if src.get("store_id"):
        parts.append(f"store {src['store_id']}")
    if src.get("kafka_cluster_id"):
        parts.append(f"Kafka cluster {src['kafka_cluster_id']}")
    return ", ".join(parts)


class LevelDBSink:
    """Applies a topic's records to a map. One sink (one writer) per database at a time."""

    def __init__(self, db: plyvel.DB, path: str):
        self.db, self.path = db, path
        try:
            self.source = read_json(db, K_SOURCE)
            self.offsets = read_offsets(db)
            self.count = read_count(db)
            self.stats = read_stats(db)
            self.build_state = read_json(db, K_BUILD)
            raw = db.get(K_CAUGHT_UP)
            self.caught_up_ms = _I64.unpack(raw)[0] if raw else None
        except plyvel.CorruptionError as e:
            raise corruption(path, e) from None

    # -- source ----------------------------------------------------------------------------

    def bind(self, topic: str, *, store_id: str | None = None,
             cluster_id: str | None = None, as_of_ms: int | None = None) -> None:
        """Record (or check) where the map's records come from. Refuses another topic, store
        or Kafka cluster than the one the map already holds records of, and any other state
        than the map's: a map of the state as of a time (``as_of_ms``) is never followed, and
        a followed map never becomes one."""
        src = self.check_source(topic, store_id=store_id, cluster_id=cluster_id,
                                as_of_ms=as_of_ms)
        if src != self.source:
            self._guard(self.db.put, K_SOURCE, json.dumps(src, sort_keys=True).encode(),
                        sync=True)
            self.source = src

    def check_source(self, topic: str, *, store_id: str | None = None,
                     cluster_id: str | None = None,
                     as_of_ms: int | None = None) -> dict[str, Any]:
        """Raise KVSourceMismatchError if the map holds records of another source; return the
        source record that binding to this one would write. A map that holds nothing yet (no
        offsets, no unfinished build) takes any source."""
        empty = not self.offsets and self.build_state is None and self.count == 0
        fresh = {"format_version": FORMAT_VERSION, "topic": topic, "store_id": None,
                 "kafka_cluster_id": None, "created_ms": int(time.time() * 1000)}
        src = dict(self.source or fresh)
        if as_of_ms is not None:
            fresh["as_of_ms"] = int(as_of_ms)
        if empty and (src.get("topic") != topic or src.get("as_of_ms") != as_of_ms):
            src = fresh
        clash = None
        if src.get("as_of_ms") != as_of_ms and not empty:
            from kcompact.compaction.history import format_time
            have = src.get("as_of_ms")
            raise KVSourceMismatchError(
                f"{self.path} holds " + (
                    f"topic {src.get('topic')!r} as of {format_time(have)}: a map of a past "
                    "state is not followed or caught up" if have is not None else
                    f"the followed map of topic {src.get('topic')!r}, not a state as of a time")
                + "; build it in another (empty) --db directory")
        if src.get("topic") != topic:
            clash = f"topic {topic!r}"
        elif store_id and src.get("store_id") not in (None, store_id):
            clash = f"store {store_id}"
        elif cluster_id and src.get("kafka_cluster_id") not in (None, cluster_id):
            clash = f"Kafka cluster {cluster_id}"
        if clash and not empty:
            raise KVSourceMismatchError(
                f"{self.path} holds the map of {describe_source(src)}; it will not mix in records "
                f"of {clash}: use another --db directory (or delete this one to rebuild it)")
        if store_id:
            src["store_id"] = store_id
        if cluster_id:
            src["kafka_cluster_id"] = cluster_id
        return src

    # -- record-wise apply (follow, catch-up) ----------------------------------------------

    def apply(self, keys: Sequence[bytes | None], values: Sequence[bytes | None],
              next_offsets: Mapping[int, int]) -> None:
        """Apply records in order (a None key is a keyless record: skipped and counted; a None
        value is a tombstone: the key is deleted) and move the partitions to ``next_offsets``,
        all in one atomic WriteBatch."""
        latest: dict[bytes, bytes | None] = {}
        keyless = 0
        for k, v in zip(keys, values):
            if k is None:
                keyless += 1
            else:
                latest[k] = v
        wb = self.db.write_batch()
        get = self.db.get
        count, puts, deletes = self.count, 0, 0
        try:
            for k, v in latest.items():
                dk = DATA + k
                had = get(dk) is not None
                if v is None:
                    if had:
                        wb.delete(dk)
                        count -= 1
                        deletes += 1
                else:
                    wb.put(dk, v)
                    puts += 1
                    count += not had
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None
        stats = dict(self.stats)
        stats["records"] += len(keys)
        stats["keyless"] += keyless
        stats["puts"] += puts
        stats["deletes"] += deletes
        offsets = dict(self.offsets)
        offsets.update(next_offsets)
        self._put_meta(wb, next_offsets, count, stats)
        self._guard(wb.write)
        self.count, self.stats, self.offsets = count, stats, offsets

    def mark_caught_up(self, now_ms: int | None = None) -> None:
        """Record that the map holds everything its source had at ``now_ms`` (see MapBuilder:
        a map that stays behind longer than delete.retention.ms may miss a purged tombstone)."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        self._guard(self.db.put, K_CAUGHT_UP, _I64.pack(now_ms))
        self.caught_up_ms = now_ms

    # -- bulk build ------------------------------------------------------------------------

    def begin_build(self, ends: Mapping[int, int], as_of_ms: int | None = None) -> None:
        """Start a bulk build into an empty map: its end offsets (and the time of a state as of
        a time) are written first, so that an interrupted build resumes with the same ones."""
        state: dict[str, Any] = {"ends": {str(p): int(e) for p, e in sorted(ends.items())},
                                 "started_ms": int(time.time() * 1000)}
        if as_of_ms is not None:
            state["as_of_ms"] = int(as_of_ms)
        self._guard(self.db.put, K_BUILD, json.dumps(state).encode(), sync=True)
        self.build_state = state
        # flush the metadata written so far into a table of its own: in the first data table it
        # would widen that table's key range over every later one (see prepare_puts)
        self._guard(self.db.compact_range, start=META, stop=META_END)

    def resume_build(self) -> None:
        """Before resuming an interrupted bulk build: count the keys it already wrote (bulk
        batches carry no metadata, see prepare_puts)."""
        try:
            self.count = sum(1 for _ in self.db.iterator(start=DATA, stop=DATA_END,
                                                          include_value=False))
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None

    def prepare_puts(self, dkeys: list[bytes], values: list[bytes], *,
                     check_existing: bool) -> plyvel.WriteBatch:
        """A WriteBatch of puts of keys that hold no other update in this build (``dkeys``
        already carry the data prefix), sorted, for the caller to write in order (possibly in
        another thread). ``check_existing``: count only keys not in the map yet (resuming an
        interrupted build); otherwise every key is new.

        Bulk batches carry no metadata: the count and offsets are written once, by
        finish_build, and until then ``mbuild`` marks the map as partial. So each batch holds
        one key range after the previous one, and the tables LevelDB makes of them do not
        overlap: it moves them between levels instead of merging them (no write amplification).
        """
        if check_existing:
            get = self.db.get
            try:
                new = sum(1 for k in dkeys if get(k) is None)
            except plyvel.CorruptionError as e:
                raise corruption(self.path, e) from None
        else:
            new = len(dkeys)
        wb = self.db.write_batch()
        collections.deque(map(wb.put, dkeys, values), maxlen=0)
        self.count += new
        self.stats["puts"] += len(dkeys)
        return wb

    def finish_build(self, ends: Mapping[int, int], *, records: int, keyless: int,
                     conflicts: int, missing: int) -> None:
        """Commit a bulk build: count, counters and offsets in one batch that also drops
        ``mbuild``; then flush LevelDB's memtable into a table, so that the next open does not
        have to replay the log (the map is ready as soon as this returns)."""
        stats = dict(self.stats)
        stats["records"] += records
        stats["keyless"] += keyless
        stats["conflicts"] += conflicts
        stats["missing"] += missing
        wb = self.db.write_batch(sync=True)
        self._put_meta(wb, ends, self.count, stats)
        wb.delete(K_BUILD)
        self._guard(wb.write)
        self.stats = stats
        self.offsets.update(ends)
        self.build_state = None
        # a manual compaction of the metadata range first flushes the memtable; it then rewrites
        # only the tables holding metadata keys (the last one)
        self._guard(self.db.compact_range, start=META, stop=META_END)

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _put_meta(wb, next_offsets: Mapping[int, int], count: int,
                  stats: Mapping[str, int]) -> None:
        for p, off in next_offsets.items():
            wb.put(K_OFFSET + _PART.pack(p), _I64.pack(int(off)))
        wb.put(K_COUNT, _I64.pack(count))
        wb.put(K_STATS, _STATS.pack(*(int(stats[s]) for s in STATS)))

    def write(self, wb: plyvel.WriteBatch) -> None:
        self._guard(wb.write)

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except plyvel.CorruptionError as e:
            raise corruption(self.path, e) from None
        except plyvel.IOError as e:
            raise KVError(f"{self.path}: LevelDB write failed: {_message(e)}") from None


def apply_records(sink: LevelDBSink, records: Iterable[tuple[int, int, bytes | None,
                                                             bytes | None]]) -> int:
    """Apply (partition, offset, key, value) tuples in order as one batch; the next offset of
    each partition becomes its last offset + 1. Returns the number of records."""
    keys, values, nxt = [], [], {}
    for p, off, k, v in records:
        keys.append(k)
        values.append(v)
        nxt[p] = off + 1
    if keys:
        sink.apply(keys, values, nxt)
    return len(keys)

