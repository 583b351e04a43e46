"""`kcompact replicate`: rebuild a replica from a serving master, then optionally follow it.

The way RocketMQ rebuilds a compaction-topic replica: a compacted log cannot be rebuilt by
copying files that compaction keeps replacing, so each partition is pulled as *messages* from
queue offset 0 and compacted locally. Per partition:

1. **Pull** from offset 0 into ``partitions/<t>/<p>/.replicating/`` (a writable PartitionLog in
   that sub-directory: records appended byte for byte, ``.bcq`` digests computed with the
   replica's *own* secret) until the master's next offset seen at the start. A restarted
   rebuild resumes at ``.replicating/``'s next offset (``source.json`` there names the master
   store, so data of another master is never mixed in).
2. **Install** atomically with reput/swap.py: with no local records, the pulled segments are
   renamed into ``.compacting/``; with local records, the two logs are merged by offset (the
   master wins on equal offsets) into ``.compacting/``; then one ``swap.json`` commits the plan
   (inputs: the local segments; outputs: the new ones; compaction horizon: after a rename, the
   master's horizon the pulled records are clean up to - ``_note_horizon`` - after a merge -1) and
   ``swap.apply`` puts it in place. ``.replicating/install.json`` records the step, so a crash
   anywhere resumes: before the commit the moved files are put back (or the pull restarts), after
   it the swap completes on open.
3. **Force-compact** (compaction.Compactor: its rounds map only the offsets past that
   horizon, which the master had not compacted yet), and roll the active segment to the
   master's next offset when the master's is beyond the last record (so a mirror or a follower
   resumes at the same offset as on the master). Then ``.replicating/`` is removed.

``--follow`` then pulls new records straight into the live partitions (long-polling the master),
with kcompact.compaction.Scheduler compacting in the background, until SIGINT/SIGTERM.

A rebuild must finish within the master's ``delete.retention.ms``: as for any Kafka consumer, a
tombstone the master purges before the replica has pulled it cannot delete the older value the
replica pulled earlier.

Why one file of ~700 lines: ``Replicator`` is one state machine (pull, install, force-compact,
follow) whose crash-resume rules are written against each other (what ``.replicating/`` and
``install.json`` hold at each step); read apart, a change to one step breaks another's resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kcompact.compaction import CompactionOptions, Compactor, Scheduler
from kcompact.compaction import history
from kcompact.compaction.compactor import DEFAULT_MAP_MEMORY
from kcompact.reput import filenames as fn
from kcompact.reput.env import ENV, value
from kcompact.reput import swap
from kcompact.reput.errors import ReputError, StoreLockedError
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import BufferPool, PartitionReader, RecordColumns
from kcompact.reput.record import Scratch
from kcompact.reput.config import TopicConfig
from kcompact.reput.store import Store, SyncPacer

from .client import Chunk, MasterClient, check_master_url, negotiate, unavailable_partitions
from .errors import ProtocolError, ReplicaError, ReplicationError
from .progress import Progress
from .protocol import PROTOCOL_VERSIONS, SEGMENTS_VERSION, check_records, read_token_file
from .shipped import (Incoming, ShippedInstall, ShippedSegmentError, master_path,
                      roll_past_shipped)

INSTALL_MARKER = "install.json"
SOURCE_FILE = "source.json"
MIB = 1 << 20


@dataclass(frozen=True)
class ReplicaOptions:
    max_bytes: int = ENV["KCOMPACT_REPLICATION_MAX_BYTES"].default  # per records request
    parallel: int = ENV["KCOMPACT_REPLICATION_PARALLEL"].default    # partitions rebuilt at once
    retry_s: float | None = None         # master outage tolerated mid-rebuild (None: env/120 s)
    follow_wait_ms: int = 1000           # long-poll of a follow request
    follow_refresh_s: float = 10.0       # how often follow looks for new partitions
    compaction_interval_s: float = 30.0  # background compaction while following
    offset_map_memory: int = DEFAULT_MAP_MEMORY
    sync_every_bytes: int = 256 * MIB    # fsync .replicating/ this often during a pull
    max_bytes_per_s: float = ENV["KCOMPACT_REPLICATION_RATE"].default  # pull rate, 0: no limit
    protocol: int | None = None          # highest protocol version to use (None: the best)

    def __post_init__(self):
        if not 64 * 1024 <= self.max_bytes <= 1 << 30:
            raise ReplicationError("max_bytes must be in [64 KiB, 1 GiB]")
        if not 1 <= self.parallel <= 64:
            raise ReplicationError("parallel must be in [1, 64]")
        if self.max_bytes_per_s < 0:
            raise ReplicationError("max_bytes_per_s must be >= 0")
        if self.protocol is not None and self.protocol not in PROTOCOL_VERSIONS:
            raise ReplicationError(f"KCOMPACT_REPLICATION_PROTOCOL={self.protocol}: this kcompact "
                                   f"speaks {' and '.join(map(str, PROTOCOL_VERSIONS))}")

    @classmethod
    def from_env(cls, env=None) -> "ReplicaOptions":
        """Options from the KCOMPACT_REPLICATION_* variables (the CLI has no flags for them;
        reput/env.py says what each does)."""
        return cls(max_bytes=value("KCOMPACT_REPLICATION_MAX_BYTES", env),
                   parallel=value("KCOMPACT_REPLICATION_PARALLEL", env),
                   max_bytes_per_s=value("KCOMPACT_REPLICATION_RATE", env),
                   retry_s=value("KCOMPACT_REPLICATION_RETRY_S", env),
                   protocol=value("KCOMPACT_REPLICATION_PROTOCOL", env))


@dataclass
class PartitionResult:
    topic: str
    partition: int
    records: int = 0
    bytes: int = 0
    resumed_from: int = 0
    master_next_offset: int = 0
    next_offset: int = 0
    merged: bool = False
    shipped_segments: int = 0     # sealed format-2 segments pulled as stored (version 2)
    shipped_bytes: int = 0        # their bytes (.log + lean index), part of ``bytes``
    duration_s: float = 0.0
    pull_s: float = 0.0
    install_s: float = 0.0
    compact_s: float = 0.0
    compaction: dict = field(default_factory=dict)


class Interrupted(ReplicationError):
    """SIGINT/SIGTERM during the rebuild: run `kcompact replicate` again to resume."""


class Replicator:
    def __init__(self, client: MasterClient, store: Store, options: ReplicaOptions = ReplicaOptions(),
                 progress: Progress | None = None):
        self.client, self.store, self.options = client, store, options
        self.progress = progress or Progress(enabled=False)
        # .replicating/ and .compacting/ staging: the store's directory, or on S3 the local one
        self.fs = getattr(store, "local_fs", store.fs)
        self.pool = ThreadPoolExecutor(max_workers=3 * options.parallel + 2,
                                       thread_name_prefix="kcompact-replica")
        self.max_bytes = options.max_bytes
        self.bodies = BufferPool(keep=options.parallel)  # segment downloads' response bodies
        self.results: list[PartitionResult] = []
        self._follow_sync: dict[tuple[str, int], float] = {}
        self.master_doc: dict | None = None
        self._rate_t0: float | None = None
        self._rate_bytes = 0
        #: following: (topic, partition) -> [bytes pulled, records, next offset, master's
        #: next offset], read by the metrics (replication/ops.py)
        self.follow_stats: dict[tuple[str, int], list[int]] = {}
        self.scheduler: Scheduler | None = None
        self.last_pull = time.monotonic()  # when a records response last arrived
        #: the protocol version spoken with the master (connect: the best both speak)
        self.protocol = 1

    async def _run(self, fn_, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn_, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- whole store ---------------------------------------------------------------------------

    async def connect(self) -> dict:
        # load the compiled kernels (numba's cache) while the first request is on the wire
        self._warm = asyncio.get_running_loop().run_in_executor(self.pool, warm_up)
        doc = await self.client.store_doc()
        if doc.get("store_id") == self.store.meta.store_id:
            raise ReplicaError(f"{self.store.url} is the master's own store (same store id); "
                               "replicate into another directory")
        self.use_document(doc, "replicate")
        await self._run(self._sync_configs, doc)
        await self._warm
        return doc

    def use_document(self, doc: dict, name: str) -> None:
        """Speak with the master whose ``/v1/store`` is ``doc``: the best protocol both speak
        and its request size limit (``name``: whose note a version 1 master gets)."""
        self.protocol, note = negotiate(doc, self.client.url, self.options.protocol)
        if note:
            self.progress.note(name, note)
        limit = int(doc.get("limits", {}).get("max_bytes", self.max_bytes))
        self.max_bytes = max(64 * 1024, min(self.max_bytes, limit))
        self.master_doc = doc

    async def pull_into(self, staging: PartitionLog, topic: str, partition: int,
                        info: dict) -> PartitionResult:
        """Pull the master's ``topic``-``partition`` (``info``: its entry of ``/v1/store``)
        from offset 0 to its next offset into ``staging``, an empty writable log whose files
        are on ``self.fs`` (version 2: sealed segments as stored): what `kcompact repair
        --from` rebuilds a damaged partition from. Keyed tombstones up to the master's horizon
        are stamped as cleaned now, as a rebuild's are."""
        target = int(info["next_offset"])
        res = PartitionResult(topic, partition, master_next_offset=target)
        name = f"{topic}-{partition}"
        t0 = time.monotonic()
        self.progress.start(name, min(int(info.get("first_offset", 0)), target), target, 0)
        await self._pull(topic, partition, staging, 0, target, name,
                         int(info.get("compaction_horizon", -1)), res)
        res.pull_s = res.duration_s = time.monotonic() - t0
        res.next_offset = staging.next_offset
        return res

    def _sync_configs(self, doc: dict) -> None:
        """The master's topic configs (its effective values, those not at the default) become
        this store's *synced* configs, from ``master URL`` (``kcompact configs --describe``:
        "synced from master"), so local overrides set on the replica stay apart, win, and
        survive. A replica written before kept the master's values as local overrides: on its
        first sync (no synced layer yet) the overrides equal to the master's are dropped."""
        default = self.store.meta.defaults.to_dict()  # (this store's: the master's may differ)
        origin = f"master {self.client.url}"
        for t in doc.get("topics", []):
            topic = t["topic"]
            cfg = {k: v for k, v in (t.get("config") or {}).items() if default.get(k) != v}
            layers = self.store.topic_config_layers(topic)
            if dict(layers.synced) == cfg and layers.synced_from == origin:
                continue  # unchanged: store.json is not read again
            if layers.synced_from is None and layers.overrides:
                copied = [k for k, v in layers.overrides.items() if cfg.get(k, default.get(k)) == v]
                if copied:
                    self.store.alter_topic_config(topic, delete=copied)
            self.store.sync_topic_config(topic, cfg, origin=origin)

    @staticmethod
    def _partitions(doc: dict) -> list[tuple[str, int, dict]]:
        return [(t["topic"], int(p["partition"]), p) for t in doc.get("topics", [])
                for p in t.get("partitions", [])]

    async def rebuild(self) -> list[PartitionResult]:
        doc = self.master_doc or await self.connect()
        # ``parallel`` partitions pull at once, and as many install and compact at once: the
        # next partition's pull starts as soon as one's pull ends, not once its compaction ends
        # (a wave of pulls no longer waits for the tail of the one before)
        gates = (asyncio.Semaphore(self.options.parallel),
                 asyncio.Semaphore(self.options.parallel))

        async def one(t, p, info):
            return await self.rebuild_partition(t, p, info, gates)

        tasks = [asyncio.ensure_future(one(t, p, info)) for t, p, info in self._partitions(doc)]
        if not tasks:
            return []
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            self.results = [t.result() for t in tasks]
            return self.results
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one partition -------------------------------------------------------------------------

    async def rebuild_partition(self, topic: str, partition: int, info: dict,
                                gates: tuple | None = None) -> PartitionResult:
        """Pull, install and force-compact one partition. ``gates``: (pulls, installs), the
        semaphores that bound how many partitions do each at once (rebuild)."""
        pulls, installs = gates or (contextlib.nullcontext(), contextlib.nullcontext())
        name = f"{topic}-{partition}"
        async with pulls:
            t0 = time.monotonic()
            target = int(info["next_offset"])
            res = PartitionResult(topic, partition, master_next_offset=target)
            state, staging = await self._run(self._prepare, topic, partition)
            if state == "pull":
                start = staging.next_offset if staging.record_count() else 0
                res.resumed_from = start
                first = int(info.get("first_offset", 0))
                self.progress.start(name, min(first, target), target, start)
                # what the master already compacted: its tombstones count as cleaned from now
                horizon = int(info.get("compaction_horizon", -1))
                # the history the master's compaction cleaned (None: it does not say)
                cleaned_ts = info.get(history.HISTORY_KEY)
                await self._run(self._note_horizon, topic, partition, start, horizon,
                                cleaned_ts if isinstance(cleaned_ts, int) else None)
                try:
                    await self._pull(topic, partition, staging, start, target, name, horizon,
                                     res)
                except BaseException:
                    await self._run(staging.close)
                    raise
                t1 = time.monotonic()
                res.pull_s = t1 - t0
        async with installs:
            if state == "pull":
                t1 = time.monotonic()
                res.merged = await self._run(self._install, topic, partition, staging)
                res.install_s = time.monotonic() - t1
            else:
                self.progress.note(name, "pull already installed; finishing")
            t2 = time.monotonic()
            comp = await self._run(self._finish, topic, partition, target)
            res.compact_s = time.monotonic() - t2
        res.compaction = comp.to_dict()
        res.next_offset = await self._run(self._live_next, topic, partition)
        res.duration_s = time.monotonic() - t0
        shipped = (f" ({res.shipped_segments} segments as stored, "
                   f"{res.shipped_bytes / 1e6:,.1f} MB)" if res.shipped_segments else "")
        self.progress.finish(name, f"done: {res.records:,} records, {res.bytes / 1e6:,.1f} MB"
                                   f"{shipped} in {res.duration_s:.1f}s (pull {res.pull_s:.1f}s, install "
                                   f"{res.install_s:.1f}s, compaction {res.compact_s:.1f}s), "
                                   f"{comp.records_kept:,} records after compaction")
        return res

    async def _pull(self, topic: str, partition: int, staging: PartitionLog, off: int,
                    target: int, name: str, horizon: int = -1,
                    res: PartitionResult | None = None) -> None:
        """Pull [off, target) into ``staging`` (counted in ``res``): with protocol version 2,
        sealed format-2 segments as stored (``_pull_shipping``), the rest as records."""
        res = res if res is not None else PartitionResult(staging.topic, staging.partition)
        # the master's tombstones up to its horizon count as cleaned now (the store's clock)
        state = {"since_sync": 0, "horizon": horizon,
                 "clean_time_s": self.store.clock.ms() // 1000,
                 "pacer": SyncPacer(writeback_every=0), "scratch": Scratch()}
        if self.protocol >= SEGMENTS_VERSION:
            off = await self._pull_shipping(topic, partition, staging, off, target, name, state,
                                            res)
        if off < target:
            await self._pull_records(topic, partition, staging, off, target, name, state, res)
        await self._run(staging.sync)

    async def _pull_shipping(self, topic: str, partition: int, staging: PartitionLog, off: int,
                             target: int, name: str, state: dict, res: PartitionResult) -> int:
        """Version 2: walk the master's segment listing from ``off``; each sealed format-2
        segment that holds nothing already pulled is shipped as stored (``_ship``), what lies
        between as records. A segment compacted on the master meanwhile (409) makes it list
        again. Returns the offset the pull has reached."""
        listing, stale = None, False
        while off < target:
            if listing is None:
                listing = (await self.client.segments(topic, partition))["segments"]
            seg = next((s for s in listing if s["format"] == 2 and s.get("sealed") is True
                        and s["records"] > 0 and s["first_offset"] >= off
                        and s["first_offset"] < target and s.get("id")), None)
            if seg is None:
                break
            stop = seg["first_offset"]
            if any(s["records"] > 0 and s["last_offset"] >= off and s["first_offset"] < stop
                   for s in listing):
                reached = await self._pull_records(topic, partition, staging, off, stop, name,
                                                   state, res)
                if reached == off:  # the listing is behind the master's segments
                    if stale:
                        break  # (the records pull from here on brings whatever is there)
                    listing, stale = None, True
                off = reached
                continue
            stale = False
            done = await self._ship(topic, partition, staging, seg, name, state, res)
            if done is None:
                listing = None  # compacted or resealed on the master: list again
            else:
                off = max(off, done)
        return off

    async def _ship(self, topic: str, partition: int, staging: PartitionLog, seg: dict,
                    name: str, state: dict, res: PartitionResult) -> int | None:
        """Download a sealed format-2 segment's files as stored (resuming a download of the
        same segment version), check and install it (replication/shipped.py). Returns the
        offset after it, or None when the master's segment changed (list again). A segment
        that fails the checks is refused with one line naming the master's file and byte; a
        resumed download that fails them (a torn partial file) is downloaded again once."""
        incoming = Incoming(self.fs, topic, partition)
        base, sid = int(seg["base"]), seg["id"]
        have = await self._run(incoming.prepare, seg)
        resumed = any(have.values())
        if resumed:
            self.progress.note(name, f"resuming the download of segment {base} at byte "
                                     f"{have['log']:,} of {seg['log_size']:,}")
        try:
            return await self._ship_loop(topic, partition, staging, seg, incoming, have,
                                         resumed, name, state, res)
        finally:
            incoming.close()  # (a download cut short stays, to be resumed)

    async def _ship_loop(self, topic: str, partition: int, staging: PartitionLog, seg: dict,
                         incoming: Incoming, have: dict, resumed: bool, name: str, state: dict,
                         res: PartitionResult) -> int | None:
        base, sid = int(seg["base"]), seg["id"]
        while True:
            try:
                n = await self._ship_once(topic, partition, staging, seg, incoming, have, name,
                                          state, res)
            except ShippedSegmentError as e:
                await self._run(incoming.drop)
                if resumed:
                    self.progress.note(name, f"the resumed download of segment {base} fails its "
                                             f"checks ({e}); downloading it again")
                    resumed, have = False, {"log": 0, "index": 0}
                    await self._run(incoming.prepare, seg)
                    continue
                listing = (await self.client.segments(topic, partition))["segments"]
                if not any(s["base"] == base and s.get("id") == sid for s in listing):
                    return None  # replaced while it was read: not damage
                raise ProtocolError(
                    f"master {self.client.url}: {e} in the segment it sent (checked as "
                    f"downloaded, as stored); nothing of it was installed. Run `kcompact verify "
                    f"--store` on the master and rebuild {topic}-{partition} there "
                    f"({master_path(topic, partition, base, 'log')})") from None
            if n is None:
                await self._run(incoming.drop)
                return None
            res.records += n
            res.shipped_segments += 1
            self.progress.advance(name, seg["last_offset"] + 1, 0)
            return seg["last_offset"] + 1

    async def _ship_once(self, topic: str, partition: int, staging: PartitionLog, seg: dict,
                         incoming: Incoming, have: dict, name: str, state: dict,
                         res: PartitionResult) -> int | None:
        """One try of ``_ship``: the index downloaded, then the ``.log``, each block of it
        checked in the pool while the next is on the wire (ShippedInstall.feed), then the
        install. Returns the records installed, or None when the master's segment changed."""
        base, sid = int(seg["base"]), seg["id"]
        inst, pending = None, None
        # one buffer for every body of this download (each is written before the next comes),
        # from the replicator's pool (fresh memory costs a page fault every 4 KiB)
        into = self.bodies.take(min(self.max_bytes, max(seg["index_size"], seg["log_size"])))
        try:
            for file, size in (("index", seg["index_size"]), ("log", seg["log_size"])):
                pos = have[file]
                if file == "log":
                    inst = await self._run(ShippedInstall, self.store, staging, incoming, topic,
                                           partition, seg, state["horizon"],
                                           state["clean_time_s"])
                    if inst.ready(pos):  # a resumed download: what is there already
                        pending = asyncio.ensure_future(self._run(inst.feed, pos))
                while pos < size:
                    body = await self.client.segment_file(topic, partition, base, file, sid,
                                                          pos, self.max_bytes, into)
                    if body is None:
                        return None
                    await self._run(incoming.write, base, file, body)
                    pos += body.shape[0]
                    res.bytes += body.shape[0]
                    res.shipped_bytes += body.shape[0]
                    self.progress.advance(name, seg["first_offset"], body.shape[0])
                    if inst is not None and inst.ready(pos):
                        if pending is not None:
                            await pending  # (one block checked at a time, in order)
                        pending = asyncio.ensure_future(self._run(inst.feed, pos))
                    await self._throttle(body.shape[0])
            if pending is not None:
                p, pending = pending, None
                await p
            return await self._run(inst.finish)
        finally:
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)
            self.bodies.give(into)

    async def _pull_records(self, topic: str, partition: int, staging: PartitionLog, off: int,
                            stop: int, name: str, state: dict, res: PartitionResult) -> int:
        """Pull records [off, stop) into ``staging``: the next chunk is on the wire while the
        last one is checked and written in the pool. A chunk that fails the checks (nothing of
        it is written) is asked for again with ``check=1`` and the pull goes on after it.
        Returns the offset reached (a chunk may end past ``stop``)."""
        target = stop
        pending = None  # (future, its from offset, its records, its bytes)
        records = nbytes = 0
        args = (staging, topic, partition, state["scratch"], state)
        try:
            while True:
                chunk = (await self.client.records(topic, partition, off, self.max_bytes)
                         if off < target else None)
                if pending is not None:
                    fut, pfrom, pcount, pbytes = pending
                    pending = None
                    try:
                        await fut
                    except _BadChunk:
                        good = await self.client.records(topic, partition, pfrom,
                                                         self.max_bytes, check=True)
                        await self._run(self._append_staging, good, pfrom, *args, True)
                        records += good.count - pcount
                        nbytes += len(good.body) - pbytes
                        if good.count == 0 and good.next_offset <= pfrom:
                            break
                        off = good.next_offset  # the chunk fetched meanwhile is dropped
                        continue
                if chunk is None:
                    break
                if chunk.count == 0:
                    if chunk.next_offset <= off:
                        break  # nothing more below target (the master lost its tail?)
                    off = chunk.next_offset
                    continue
                fut = asyncio.ensure_future(self._run(self._append_staging, chunk, off, *args))
                pending = (fut, off, chunk.count, len(chunk.body))
                off = chunk.next_offset
                records += chunk.count
                nbytes += len(chunk.body)
                self.progress.advance(name, off, len(chunk.body))
                await self._throttle(len(chunk.body))
        finally:
            if pending is not None:
                await asyncio.wait([pending[0]])
            res.records += records
            res.bytes += nbytes
        return off

    async def _throttle(self, nbytes: int) -> None:
        self.last_pull = time.monotonic()
        rate = self.options.max_bytes_per_s
        if not rate:
            return
        now = time.monotonic()
        if self._rate_t0 is None:
            self._rate_t0 = now
        self._rate_bytes += nbytes
        ahead = self._rate_bytes / rate - (now - self._rate_t0)
        if ahead > 0:
            await asyncio.sleep(ahead)

    def _append_staging(self, chunk: Chunk, from_offset: int, staging: PartitionLog, topic: str,
                        partition: int, scratch: Scratch, state: dict,
                        checked: bool = False) -> None:
        s = _check(chunk, topic, partition, from_offset, self.store.secret, scratch, checked)
        staging.append(chunk.body, s, 0, len(s), clean_upto=state["horizon"],
                       clean_time_s=state["clean_time_s"])
        state["since_sync"] += len(chunk.body)
        pacer = state["pacer"]
        if state["since_sync"] >= self.options.sync_every_bytes:
            staging.sync()
            state["since_sync"] = 0
            pacer.reset()
        else:
            staging.start_writeback()
            if pacer.add(len(chunk.body))[1]:
                # the device's cache flushed as the pull goes (reput/backend.py
                # _BackgroundSync), not all at once at the next sync or at the install
                staging.sync_soon()

    # -- resume, install, finish (blocking; run in the pool) ------------------------------------

    def _live(self, topic: str, partition: int) -> PartitionLog:
        try:
            return self.store.writable_partition(topic, partition)
        except StoreLockedError:
            raise ReplicaError(f"{topic}-{partition} of {self.store.url} is being written by "
                               "another process (a mirror, a compaction, another replicate); "
                               "stop it first") from None

    def _live_next(self, topic: str, partition: int) -> int:
        with self.store.lock:
            return self._live(topic, partition).next_offset

    def _marker(self, topic: str, partition: int) -> str:
        return f"{fn.replicating_dir(topic, partition)}/{INSTALL_MARKER}"

    def _prepare(self, topic: str, partition: int) -> tuple[str, PartitionLog | None]:
        """Resolve an interrupted install, then open ``.replicating/`` for the pull."""
        fs = self.fs
        rdir = fn.replicating_dir(topic, partition)
        pdir = fn.partition_dir(topic, partition)
        sdir = swap.staging_dir(pdir)
        marker = self._marker(topic, partition)
        if fs.exists(marker):
            m = json.loads(fs.read(marker))
            if m.get("state") == "installed":
                return "installed", None
            if fs.exists(f"{sdir}/{swap.PLAN_NAME}"):
                # committed before the crash: opening the partition for write completes the swap
                with self.store.lock:
                    self._live(topic, partition)
                fs.write_atomic(marker, json.dumps({"version": 1, "state": "installed"}).encode())
                return "installed", None
            if m.get("mode") == "rename":
                lost = False
                for base in m.get("bases", []):
                    for suffix in (fn.LOG_SUFFIX, fn.INDEX_SUFFIX):
                        name = f"{fn.base_name(base)}{suffix}"
                        if not fs.exists(f"{rdir}/{name}"):
                            if fs.exists(f"{sdir}/{name}"):
                                fs.rename(f"{sdir}/{name}", f"{rdir}/{name}")
                            else:
                                lost = True
                if lost:
                    # someone rolled the staged files back before we resumed: pull again
                    fs.remove_tree(rdir)
                    self.progress.note(f"{topic}-{partition}", "interrupted install lost its "
                                       "staged files; pulling again from offset 0")
            fs.remove_tree(sdir)
            fs.delete(marker)
        staging = self._open_staging(topic, partition)
        master_id = self.client.store_id
        have = self._source(topic, partition).get("store_id")
        if have is not None and have != master_id:
            staging.close()
            fs.remove_tree(rdir)
            self.progress.note(f"{topic}-{partition}", f"discarding a partial pull from another "
                               f"master store ({have})")
            staging = self._open_staging(topic, partition)
            have = None
        if have is None:
            fs.write_atomic(f"{rdir}/{SOURCE_FILE}", json.dumps(
                {"store_id": master_id, "url": self.client.url}).encode())
        return "pull", staging

    def _source(self, topic: str, partition: int) -> dict:
        """``.replicating/source.json`` ({} when missing or unreadable)."""
        try:
            doc = json.loads(self.fs.read(f"{fn.replicating_dir(topic, partition)}/{SOURCE_FILE}"))
        except (FileNotFoundError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _note_horizon(self, topic: str, partition: int, start: int, horizon: int,
                      cleaned_ts: int | None = None) -> None:
        """Keep in ``source.json`` the compaction horizon the pulled records are clean up to:
        the master's at the start of a fresh pull, and never more than the master's at the start
        of any resumed one (records pulled before the master compacted further are only clean up
        to its horizon then). The install makes it the partition's horizon, so the force
        compaction maps only what the master had not compacted. Also the master's history
        horizon (compaction/history.py): the pulled records lack what its compaction cleaned,
        so the replica answers --as-of exactly no earlier than the master (the highest of the
        masters' horizons over resumed pulls; unknown when one did not say)."""
        doc = self._source(topic, partition)  # _prepare has just written or checked it
        clean = horizon if start == 0 else min(int(doc.get("horizon", -1)), horizon)
        key = history.HISTORY_KEY
        hist = cleaned_ts if start == 0 else history.combine(doc.get(key), cleaned_ts)
        if doc.get("horizon") != clean or key not in doc or doc[key] != hist:
            doc["horizon"] = clean
            doc[key] = hist
            self.fs.write_atomic(f"{fn.replicating_dir(topic, partition)}/{SOURCE_FILE}",
                                 json.dumps(doc).encode())

    def _installed_run(self, topic: str, partition: int, live: PartitionLog) -> dict:
        """The checkpoint's ``last_run`` of an install: the master, and the history horizon of
        the result: the master's combined with what the local partition had cleaned before
        (unknown when source.json has none: a pull begun by an older kcompact)."""
        pulled = self._source(topic, partition).get(history.HISTORY_KEY)
        return {"replicated_from": self.client.store_id,
                history.HISTORY_KEY: history.combine(pulled, history.partition_horizon(live))}

    def _pulled_horizon(self, topic: str, partition: int) -> int:
        try:
            return int(self._source(topic, partition).get("horizon", -1))
        except (ValueError, TypeError):
            return -1

    def _open_staging(self, topic: str, partition: int) -> PartitionLog:
        try:
            staging = PartitionLog(self.fs, topic, partition, self.store.secret,
                                   self.store.topic_config(topic), writable=True,
                                   sub=fn.REPLICATING_DIR, clock=self.store.clock)
            roll_past_shipped(staging)
            return staging
        except StoreLockedError:
            raise ReplicaError(f"another `kcompact replicate` is rebuilding {topic}-{partition} "
                               f"in {self.store.url}") from None

    def _install(self, topic: str, partition: int, staging: PartitionLog) -> bool:
        """Put the pulled segments in place (module docstring, step 2). Returns merged?"""
        fs = self.fs
        with self.store.lock:
            live = self._live(topic, partition)  # recovers any interrupted compaction swap
        pdir, rdir = live.dir, staging.dir
        sdir = swap.staging_dir(pdir)
        staging.sync()
        bases = [s.base for s in staging.segments if s.count()]
        merge = live.record_count() > 0
        # merged with local records, nothing is known clean; alone, the pulled records are
        # clean up to the horizon _note_horizon kept
        horizon = -1 if merge else self._pulled_horizon(topic, partition)
        marker = self._marker(topic, partition)
        fs.write_atomic(marker, json.dumps({"version": 1, "state": "installing",
                                            "mode": "merge" if merge else "rename",
                                            "bases": bases}).encode())
        fs.remove_tree(sdir)
        if merge:
            outputs = merge_logs(fs, topic, partition, self.store, live, staging)
            staging.close()
        else:
            staging.close()
            for base in bases:
                for suffix in (fn.LOG_SUFFIX, fn.INDEX_SUFFIX):
                    name = f"{fn.base_name(base)}{suffix}"
                    fs.rename(f"{rdir}/{name}", f"{sdir}/{name}")
            fs.sync_dir(sdir)
            fs.sync_dir(rdir)
            outputs = bases
        # the staged segments replace every live one in one commit (the store's publisher: the
        # swap plan on a local store, one manifest version on S3); the partition is reopened
        pub = self.store.publisher
        pub.install(live, sdir, outputs, self._installed_run(topic, partition, live), horizon)
        fs.write_atomic(marker, json.dumps({"version": 1, "state": "installed"}).encode())
        pub.installed(live)
        return merge

    def _finish(self, topic: str, partition: int, master_next: int):
        with self.store.lock:
            records = self._live(topic, partition).record_count()
        comp = Compactor(self.store, CompactionOptions(
            offset_map_memory=map_memory_for(records, self.options.offset_map_memory)))
        res = comp.compact_partition(topic, partition, force=True)
        if res.skipped:
            raise ReplicaError(f"{topic}-{partition}: compaction skipped: {res.skipped}")
        with self.store.lock:
            live = self._live(topic, partition)
            if live.next_offset < master_next:
                live.roll(master_next)
            live.sync()
        self.fs.sync_dir(fn.partition_dir(topic, partition))
        self.fs.remove_tree(fn.replicating_dir(topic, partition))
        return res

    # -- follow --------------------------------------------------------------------------------

    async def follow(self, stop: asyncio.Event) -> None:
        """Pull new records into the live partitions until ``stop`` is set."""
        sched = Scheduler(self.store, CompactionOptions(
            offset_map_memory=self.options.offset_map_memory),
            interval_s=self.options.compaction_interval_s)
        sched.start()
        self.scheduler = sched
        tasks: dict[tuple[str, int], asyncio.Task] = {}
        try:
            while not stop.is_set():
                doc = (await self.client.store_doc(forever=True) if self.master_doc is None
                       else self.master_doc)
                self.master_doc = None
                await self._run(self._sync_configs, doc)
                for t, p, _ in self._partitions(doc):
                    if (t, p) not in tasks:
                        tasks[(t, p)] = asyncio.ensure_future(self._follow_partition(t, p, stop))
                for key, task in tasks.items():
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                try:
                    await asyncio.wait_for(stop.wait(), self.options.follow_refresh_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await self._run(sched.stop)
            await self._run(self._sync_all)

    async def _follow_partition(self, topic: str, partition: int, stop: asyncio.Event) -> None:
        off = await self._run(self._live_next, topic, partition)
        scratch = Scratch()
        name = f"{topic}-{partition}"
        while not stop.is_set():
            chunk = await self.client.records(topic, partition, off, self.max_bytes,
                                              wait_ms=self.options.follow_wait_ms, forever=True)
            if chunk.count == 0 and chunk.next_offset <= off:
                continue
            try:
                await self._run(self._append_live, topic, partition, chunk, off, scratch)
            except _BadChunk:
                chunk = await self.client.records(topic, partition, off, self.max_bytes,
                                                  forever=True, check=True)
                await self._run(self._append_live, topic, partition, chunk, off, scratch, True)
            if chunk.count:
                self.progress.note(name, f"+{chunk.count:,} records, now at offset "
                                         f"{chunk.next_offset:,}")
            off = chunk.next_offset
            self.last_pull = time.monotonic()
            st = self.follow_stats.setdefault((topic, partition), [0, 0, 0, 0])
            st[0] += int(chunk.body.shape[0])
            st[1] += chunk.count
            st[2], st[3] = off, chunk.high_watermark

    def _append_live(self, topic: str, partition: int, chunk: Chunk, from_offset: int,
                     scratch: Scratch, checked: bool = False) -> None:
        s = _check(chunk, topic, partition, from_offset, self.store.secret, scratch, checked)
        with self.store.lock:
            # fetched each time: the background compaction may have released and reopened it
            live = self._live(topic, partition)
            if len(s):
                live.append(chunk.body, s, 0, len(s))
            elif chunk.next_offset > live.next_offset:
                live.roll(chunk.next_offset)  # the master's next offset moved past its last record
            now = time.monotonic()
            if now - self._follow_sync.get((topic, partition), 0.0) >= 1.0:
                live.sync()
                live.publish()  # S3: publish what was pulled (upload + manifest commit)
                self._follow_sync[(topic, partition)] = now

    def _sync_all(self) -> None:
        with self.store.lock:
            for t, p in list(self._follow_sync):
                try:
                    self._live(t, p).sync()
                except ReputError:
                    pass


class _BadChunk(ReplicationError):
    """A records body failed the replica's checks (nothing of it was written): a race with
    a swap on the master, or damage. The caller asks again with ``check=1``."""

    def __init__(self, from_offset: int, message: str):
        super().__init__(message)
        self.from_offset = from_offset


def _check(chunk: Chunk, topic: str, partition: int, from_offset: int, secret: bytes,
           scratch: Scratch, checked: bool):
    """check_records; a failure is a _BadChunk (retried with ``check=1``) unless the master
    already checked these bytes, in which case it is final."""
    try:
        return check_records(chunk.body, topic, partition, from_offset, chunk.next_offset,
                             chunk.count, secret, scratch)
    except ProtocolError as e:
        if checked:
            raise ProtocolError(f"{e} (after the master had checked these bytes: they were "
                                "damaged on the way; run `kcompact replicate` again)") from None
        raise _BadChunk(from_offset, str(e)) from None


def warm_up() -> None:
    """Load the kernels a rebuild runs (record scan, offset map, compaction) on a tiny
    in-memory store, so the first chunk does not wait for them."""
    from kcompact.reput.backend import MemoryBackend
    from kcompact.reput.record import RecordBatch
    st = Store.open("memory://warm-up", fs=MemoryBackend(), writer="w", create=True)
    st.append(RecordBatch.from_records("t", [(0, i, 0, b"k%d" % (i % 3), None if i == 4 else b"v")
                                             for i in range(9)]))
    st.flush()
    Compactor(st, CompactionOptions(offset_map_memory=1 << 16)).compact_partition("t", 0,
                                                                                    force=True)
    st.close()


def map_memory_for(records: int, budget: int) -> int:
    """An offset map no larger than the partition needs (it has at most ``records`` keys, at
    16-byte slots and 0.9 load), within ``budget``: a 128 MiB table filled and cleared for a
    small partition costs more than compacting it."""
    need = int(records * 16 / 0.9 * 1.1) + (64 << 10)
    return max(64 << 10, min(budget, need))


def merge_logs(fs, topic: str, partition: int, store: Store, local: PartitionLog,
               master: PartitionLog, read_bytes: int = 4 * MIB) -> list[int]:
    """Merge two partition logs by offset into ``.compacting/`` (the master wins on an offset
    both hold); returns the bases of the segments written. Records are read with the partition
    reader (verified), copied byte for byte and indexed with the store's secret."""
    out = PartitionLog(fs, topic, partition, store.secret, store.topic_config(topic),
                       writable=True, sub=fn.COMPACTING_DIR, clock=store.clock)
    ra_, rb_ = PartitionReader(local), PartitionReader(master)
    try:
        a = b = 0
        while True:
            ra, rb = ra_.read(a, max_bytes=read_bytes), rb_.read(b, max_bytes=read_bytes)
            if len(ra) == 0 and len(rb) == 0:
                break
            limit = min(int(r.offsets[-1]) for r in (ra, rb) if len(r))
            sa = ra.take(ra.offsets <= limit)
            sb = rb.take(rb.offsets <= limit)
            sa = sa.take(~np.isin(sa.offsets, sb.offsets))
            both = RecordColumns.concat([sa, sb])
            out.append_block(both.take(np.argsort(both.offsets, kind="stable")))
            a = b = limit + 1
        out.sync()
        return [s.base for s in out.segments if s.entry_count]
    finally:
        out.close()


# ---------------------------------------------------------------------------------------------
# the command


@dataclass(frozen=True)
class ReplicateOptions:
    """``kcompact replicate``'s options (ReplicaOptions: the pull's tuning)."""

    from_url: str
    token_file: str
    store: str
    follow: bool = False
    metrics: str | None = None       # --metrics HOST:PORT


async def _replicate(opts: ReplicateOptions, token: bytes, options: ReplicaOptions) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    progress = Progress()
    store = None
    rep = None
    metrics = None
    master = None
    if opts.metrics:
        from .ops import Ops, Unreachable, replica_metrics, start_ops
        ops = Ops("replicate")
        master = Unreachable(f"the master at {opts.from_url}")

        def master_check() -> str | None:
            if rep is not None and master.since is not None and rep.last_pull > master.since:
                master.up()  # a records response came after the failure
            return master.check()
        ops.check(master_check)
        ops.add(replica_metrics(lambda: rep))
        metrics = start_ops(ops, opts.metrics, lambda m: progress.note("replicate", m))

    def on_retry(m: str) -> None:
        if master is not None:
            master.down(m)
        progress.note("replicate", m)
    try:
        async with MasterClient(opts.from_url, token, retry_s=options.retry_s,
                                on_retry=on_retry) as client:
            first = await client.store_doc()  # fail fast before touching the replica store
            try:
                store = Store.open(opts.store, create=True)
            except ReputError as e:
                raise ReplicaError(f"replica store {opts.store}: {e}") from None
            rep = Replicator(client, store, options, progress)
            rep.master_doc = first
            await rep.connect()
            t0 = time.monotonic()
            work = asyncio.ensure_future(rep.rebuild())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait([work, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise Interrupted("interrupted; run the same `kcompact replicate` again to "
                                  "resume where it stopped")
            stopper.cancel()
            results = work.result()
            dt = time.monotonic() - t0
            total = sum(r.bytes for r in results)
            shipped = sum(r.shipped_bytes for r in results)
            print(f"replica {store.url} rebuilt from {client.url}: {len(results)} partitions, "
                  f"{sum(r.records for r in results):,} records, {total / 1e6:,.1f} MB pulled "
                  f"in {dt:.1f}s ({total / 1e6 / max(dt, 1e-9):,.0f} MB/s); protocol "
                  f"{rep.protocol}: {total:,} bytes, {shipped:,} of them "
                  f"{sum(r.shipped_segments for r in results)} segments as stored", flush=True)
            missing = unavailable_partitions(first)
            if missing:
                # a partition the master holds but does not serve is never a silent omission
                t, p, why = missing[0]
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                msg = (f"master {client.url} holds {t}-{p}{more} but does not serve it: {why}; "
                       f"the other {len(results)} partitions were replicated; fix it on the "
                       "master (`kcompact verify`, `kcompact repair`) and run `kcompact "
                       "replicate` again")
                if not opts.follow:
                    raise ReplicaError(msg)
                progress.note("replicate", f"warning: {msg}")
            if opts.follow and not stop.is_set():
                progress.note("replicate", "following the master (Ctrl-C to stop)")
                await rep.follow(stop)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if rep is not None:
            rep.close()
        if store is not None:
            store.close()
        if metrics is not None:
            metrics.stop()
        progress.close()


def replicate(opts: ReplicateOptions, options: ReplicaOptions | None = None) -> int:
    """`kcompact replicate --from URL --token-file F --store URL [--follow]`."""
    check_master_url(opts.from_url)
    token = read_token_file(opts.token_file)
    if opts.metrics and not opts.follow:
        raise ReplicationError("--metrics applies to replicate --follow (a long-running "
                               "replica) only")
    return asyncio.run(_replicate(opts, token, options or ReplicaOptions.from_env()))


__all__ = ["PartitionResult", "ReplicaOptions", "ReplicateOptions", "Replicator", "merge_logs",
           "replicate"]
