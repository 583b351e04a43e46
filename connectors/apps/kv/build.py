"""Building the key-value map from a store, and keeping it current (``kcompact kv build``).

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

import contextlib
import os
import shutil
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
import plyvel

from kcompact.compaction import refusal
from kcompact.reput import ReputError, Store
from kcompact.connectors.framework.gcmode import bulk_gc
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.read_ahead import ReadAhead
from kcompact.reput.reader import IndexCursor

from ...plugins.leveldb_sink import KVError, LevelDBSink, open_db
from . import kernels as KK
from .kafka import KafkaCatchUp
from .runs import BatchWriter, Run, bytes_list, records_of, sort_order

DEFAULT_BUILD_MEMORY = 1 << 30   # winners' keys and values held for one sorted run
BATCH_BYTES = 16 << 20           # bytes of keys and values per bulk WriteBatch
READ_BYTES = 8 << 20             # bytes per store read
FOLLOW_BATCH_RECORDS = 50_000    # records per follow WriteBatch
FOLLOW_BATCH_BYTES = 16 << 20
POLL_INTERVAL = 0.2              # seconds between polls of a caught-up store or topic

Progress = Callable[[str], None]


def quiet(_msg: str) -> None:
    """The default progress callback: says nothing."""


class MapBuilder(KafkaCatchUp):
    """Builds a map from a store and keeps it current (``kcompact kv build``).

    ``run()``: bulk build when the map is empty (or resume an interrupted one), catch up from
    the store, then with ``bootstrap_servers`` catch up from the Kafka topic; with
    ``follow=True`` keep following (the store, or Kafka) until ``stop`` is set.
    """

    def __init__(self, db_dir: str | os.PathLike, store: str, topic: str, *,
                 bootstrap_servers: str | None = None,
                 kafka_config: Mapping[str, Any] | None = None, progress: Progress = quiet,
                 memory: int = DEFAULT_BUILD_MEMORY, batch_bytes: int = BATCH_BYTES,
                 poll_interval: float = POLL_INTERVAL, db: plyvel.DB | None = None,
                 kafka_idle_timeout: float = 30.0,
                 follow_batch_records: int = FOLLOW_BATCH_RECORDS,
                 follow_batch_bytes: int = FOLLOW_BATCH_BYTES,
                 as_of_ms: int | None = None, allow_inexact: bool = False):
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
        #: build the state as of this time (compaction/history.py): bulk only, never followed
        self.as_of_ms, self.allow_inexact = as_of_ms, allow_inexact
        if as_of_ms is not None and bootstrap_servers:
            raise KVError("--as-of builds the state at a past time from the store: it does not "
                          "catch up from Kafka (drop --bootstrap-servers)")
        self.caught_up = threading.Event()
        self.report: dict[str, Any] = {"mode": None, "bulk_keys": 0, "applied_records": 0,
                                       "interrupted": False}

    # -- top level ---------------------------------------------------------------------------

    def run(self, *, follow: bool = False, stop: threading.Event | None = None) -> dict[str, Any]:
        with bulk_gc():  # connectors/framework/gcmode.py
            return self._run_build(follow=follow, stop=stop)

    def _run_build(self, *, follow: bool, stop: threading.Event | None) -> dict[str, Any]:
        stop = stop or threading.Event()
        t0 = time.perf_counter()
        try:
            store = Store.open(self.store_url)
        except ReputError as e:
            raise KVError(f"cannot open store {self.store_url}: {e}") from None
        own_db = self._db is None
        dir_existed = os.path.isdir(self.db_dir)
        # a map this run creates: only in a missing or empty directory (open_db refuses any
        # other without a map), so removing what is there after a failure removes only ours
        new_db = own_db and (not os.path.lexists(self.db_dir)
                             or (dir_existed and not os.listdir(self.db_dir)))
        topic_missing = self.topic not in store.topics()
        db = None
        as_of = self.as_of_ms
        try:
            if topic_missing and new_db:  # before the map is created: nothing left behind
                raise self._topic_missing(store)
            if as_of is not None:
                if follow:
                    raise KVError("--as-of builds the state at a past time: it is not "
                                  "followed (drop --follow)")
                if not topic_missing:  # before the map is created: nothing left behind
                    self._check_as_of(store)
            if not topic_missing:  # a damaged partition: refused before anything is written
                why = refusal(store, self.topic, "kv build")
                if why is not None:
                    raise KVError(why)
            db = open_db(self.db_dir, create=True) if own_db else self._db
            sink = LevelDBSink(db, self.db_dir)
            # an existing map says first which source it holds (another store or topic)
            sink.check_source(self.topic, store_id=store.meta.store_id, as_of_ms=as_of)
            if topic_missing:
                raise self._topic_missing(store)
            sink.bind(self.topic, store_id=store.meta.store_id, as_of_ms=as_of)
            if sink.build_state is not None:
                ends = {int(p): int(e) for p, e in sink.build_state["ends"].items()}
                self.progress(f"resuming the interrupted bulk build of {self.db_dir}")
                self.report["mode"] = "resume"
                self._bulk(store, sink, ends, resume=True, stop=stop)
            elif not sink.offsets and sink.count == 0:
                ends = {p: store.next_offset(self.topic, p) for p in store.partitions(self.topic)}
                self.report["mode"] = "bulk"
                self._bulk(store, sink, ends, resume=False, stop=stop)
            elif as_of is not None:
                raise KVError(f"{self.db_dir} already holds the state of {self.topic!r} as of "
                              "that time; use another (empty) --db directory for a new one")
            else:
                self.report["mode"] = "catch-up"
                self._check_lag(store, sink)
            if stop.is_set():
                self.report["interrupted"] = sink.build_state is not None
                return self._finish(sink, t0)
            if as_of is not None:
                # a compaction while the build read: the answer must still be exact
                for p in store.partitions(self.topic):
                    store.release_partition(self.topic, p)
                self._check_as_of(store)
                self.caught_up.set()
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
        except BaseException:
            if own_db and db is not None:
                db.close()
                db = None
            if new_db and not self.caught_up.is_set() and not stop.is_set():
                # a map this run created and never completed: nothing of it is left behind
                self._remove_new_db(dir_existed)
            raise
        finally:
            store.close()
            if own_db and db is not None:
                db.close()

    def _check_as_of(self, store: Store) -> None:
        """AsOfInexactError unless every partition still holds the history back to the time
        (or ``allow_inexact``)."""
        from kcompact.compaction.history import check_exact
        check_exact([store.partition(self.topic, p) for p in store.partitions(self.topic)],
                    self.as_of_ms, f"topic {self.topic!r}", allow_inexact=self.allow_inexact)

    def _topic_missing(self, store: Store) -> KVError:
        return KVError(f"topic {self.topic!r} is not in store {store.url} (topics: "
                       f"{', '.join(store.topics()) or 'none'})")

    def _remove_new_db(self, dir_existed: bool) -> None:
        """Remove the LevelDB files this run created (and the directory, unless it existed
        before, empty: a new map is made only in a missing or empty directory)."""
        if not dir_existed:
            shutil.rmtree(self.db_dir, ignore_errors=True)
            return
        for name in os.listdir(self.db_dir):
            path = os.path.join(self.db_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):  # the build's own error is the one to report
                    os.unlink(path)

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
        entries = pl.record_count()  # (a lean index's size is not 48 bytes an entry)
        # sized for every entry up to 4M (no rehash); a longer history grows it as keys come
        t = KK.DigestTable(int(min(entries, 4 << 20) / KK.MAX_LOAD) + 16)
        covered = keyless = 0
        cursor = IndexCursor(pl, 1 << 16)
        for seg in list(pl.segments):
            if seg.base >= end:
                break
            done = False
            for _, e in cursor.chunks(seg):
                if self.as_of_ms is not None:  # the state as of a time: newer records ignored
                    e = e[e["timestamp"] <= self.as_of_ms]
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
            sink.begin_build(ends, self.as_of_ms)
        table, covered, keyless, conflicts = self._winners(store, ends)
        parts, offs, dead = table.winners()
        self.progress(f"indexed {covered:,} records of {len(ends)} partition(s) from their .bcq "
                      f"entries in {time.perf_counter() - t0:.2f}s: {offs.shape[0]:,} live keys, "
                      f"{dead:,} deleted, {keyless:,} keyless skipped"
                      + (f", {conflicts:,} keys in more than one partition (resolved by the "
                         "highest timestamp, then partition)" if conflicts else ""))
        writer = BatchWriter(sink)
        written = missing = 0
        last_note = time.monotonic()
        total = offs.shape[0]
        run = Run()

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
                kout = Run._grow(kout, int(kl.sum()))
                vout = Run._grow(vout, int(vl.sum()))
                # the batch's keys and values, contiguous and in key order
                KK.gather(run.kbuf, ko[idx], kl, -1, kout, 0, koo, 0)
                KK.gather(run.vbuf, vo[idx], vl, -1, vout, 0, voo, 0)
                dkeys = bytes_list(kout, koo[: m + 1])
                vals = bytes_list(vout, voo[: m + 1])
                writer.submit(sink.prepare_puts(dkeys, vals, check_existing=resume))
                written += m
                if time.monotonic() - last_note > 2:
                    last_note = time.monotonic()
                    self.progress(f"written {written:,} of {total:,} keys "
                                  f"({100 * written / max(total, 1):.0f}%)")
            run = Run()

        try:
            for p in sorted(ends):
                w = offs[np.searchsorted(parts, p, "left"):np.searchsorted(parts, p, "right")]
                if w.shape[0] == 0:
                    continue
                i = 0
                # the next block is read while this one is gathered (and a run sorted and
                # written): the first winner after a block is known once the block is read;
                # keys and values only, of the winners only (reader.read_fields)
                with ReadAhead(store.reader(self.topic, p), fields=True) as ahead:
                    ahead.prefetch(int(w[0]), max_bytes=READ_BYTES, want=w)
                    while i < w.shape[0]:
                        if stop.is_set():
                            break
                        r = ahead.take()
                        if len(r) == 0 and r.next_offset <= int(w[i]):  # nothing more
                            missing += w.shape[0] - i
                            break
                        j = int(np.searchsorted(w, r.next_offset - 1, "right"))
                        if j < w.shape[0]:
                            ahead.prefetch(int(w[j]), max_bytes=READ_BYTES, want=w[j:])
                        sel = w[i:j]
                        eo = r.offsets
                        if eo.shape[0] == 0:  # the winners of this range were compacted away
                            missing += sel.shape[0]
                            i = j
                            continue
                        idx = np.minimum(np.searchsorted(eo, sel), eo.shape[0] - 1)
                        present = eo[idx] == sel
                        missing += int(sel.shape[0] - np.count_nonzero(present))
                        if present.any():
                            run.add(r.take(idx[present]))
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
                reader = store.reader(self.topic, p)
                off = sink.offsets.get(p, 0)
                while nbytes < self.follow_batch_bytes and len(keys) < self.follow_batch_records:
                    r = reader.read(off, max_records=self.follow_batch_records - len(keys),
                                    max_bytes=min(READ_BYTES, self.follow_batch_bytes - nbytes))
                    if len(r) == 0:
                        if r.next_offset > off and p in sink.offsets:
                            nxt[p] = off = r.next_offset   # past a gap at the end
                        elif p not in sink.offsets:
                            nxt[p] = off                   # a new partition: record it
                        break
                    k, v = records_of(r)
                    keys += k
                    values += v
                    nbytes += r.nbytes
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
        from kcompact.reput.s3_follow import follow
        follow(store.fs)  # S3 with shared uploads: new data from the writers' journals
        while not stop.is_set():
            n = self._catch_up_store(store, sink, stop)
            if n:
                self.progress(f"applied {n:,} records; {sink.count:,} keys")
            else:
                stop.wait(self.poll_interval)


def build_map(db_dir: str | os.PathLike, store: str, topic: str, *, follow: bool = False,
              bootstrap_servers: str | None = None, stop: threading.Event | None = None,
              progress: Progress = quiet, **options: Any) -> dict[str, Any]:
    """Build (or resume, or catch up) the map at ``db_dir`` from ``store``; see MapBuilder."""
    return MapBuilder(db_dir, store, topic, bootstrap_servers=bootstrap_servers,
                      progress=progress, **options).run(follow=follow, stop=stop)
