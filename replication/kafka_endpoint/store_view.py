"""The store as the Kafka endpoint sees it: topics, partition bounds, batches, timestamps.

Thread-safe and blocking (the endpoint calls it from its thread pool). The store is opened
read-only next to whatever writes it (a ``mirror --follow``, a compactor); each call re-lists
the partition (a segment list or manifest read, cheap) before it reads. Data comes only from
``PartitionReader.kafka_batches`` and the timestamp lookups (reput/reader.py, each segment's
kind answering: reput/segment_v1.py, segment_v2.py): nothing here parses a segment. Internal topics (``__kcompact-*``) are not served, nor topics or partitions a
symlink takes outside a local store (``MasterStore.outside``, as ``kcompact serve``).

A partition's bounds, as Kafka names them:

* **log start offset**: the first offset its first segment covers (its base). Like Kafka's log
  start, it does not move when compaction removes the first records (retention that deletes a
  segment moves it);
* **high watermark** = last stable offset: ``next_offset``, which a compaction that empties the
  tail does not move back. The store holds committed records only (the mirror reads
  read_committed; markers are gaps), so nothing is ever open or aborted.

A gap after the last stored batch (a compacted tail, a trailing transaction marker) would leave a
consumer short of the high watermark for ever (it fetches the same offset again and again);
``fetch`` ends it the way a Kafka log ending in a transaction marker ends: a COMMIT control
batch at the high watermark - 1 (docs/formats/kafka-endpoint-fetch.md), which every client steps
over to the high watermark. As Kafka's markers come with the data before them, the marker also
follows the partition's last batch in the answer that carries it, when it fits within the
fetch's ``max_bytes`` (otherwise the next fetch, in the gap, gets it alone).
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from kcompact.reput import damage_record as DR
from kcompact.reput.batch import control_batch
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.s3_follow import follow, follow_mode, follower_for, off_edge
from kcompact.reput.reader import max_timestamp, offset_for_timestamp
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import PartitionReader

from ..master_store import MasterStore
from ..protocol import ServerLimits

INTERNAL_PREFIX = "__kcompact-"

#: a topic's partition list is listed again at most this often when a request names only
#: partitions it holds (s), and at most every PARTITIONS_MISS_S when one names a partition it
#: does not: a fetch at the live edge costs no listing (a LIST on S3)
PARTITIONS_S = 300.0
PARTITIONS_MISS_S = 1.0


class Bounds(NamedTuple):
    log_start: int
    high_watermark: int


class Fetched(NamedTuple):
    """What a fetch of one partition returns: ``parts`` (buffers, whole batches), ``nbytes``,
    the bounds it read under, and whether any batch is zstd-compressed."""

    parts: list
    nbytes: int
    bounds: Bounds
    zstd: bool = False


class StoreView:
    """Read-only, thread-safe access for the endpoint (module docstring)."""

    def __init__(self, url: str):
        self.master = MasterStore(url, ServerLimits())
        self.store = self.master.store
        follow(self.store.fs)  # (MasterStore did already: the endpoint only reads and follows)
        self._lock = threading.Lock()
        #: topic -> (its partitions, when listed)
        self._listed: dict[str, tuple[list[int], float]] = {}

    def close(self) -> None:
        self.store.close()

    @property
    def url(self) -> str:
        return self.store.url

    # -- topics --------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        with off_edge():
            return [t for t in self.master.topics() if not t.startswith(INTERNAL_PREFIX)]

    def partitions(self, topic: str, want: int | None = None) -> list[int]:
        """The topic's partitions: those holding data and those a mirror recorded (empty).
        With ``want`` (a fetch), the last listing unless older than PARTITIONS_S, or, when
        ``want`` is not among them, older than PARTITIONS_MISS_S; without (Metadata), listed."""
        if topic.startswith(INTERNAL_PREFIX):
            return []
        now = time.monotonic()
        with self._lock:
            got = self._listed.get(topic)
        if got is not None and want is not None and follow_mode() == "journal":
            ps, at = got
            age = now - at
            if age < PARTITIONS_S and (want is None or want in ps or age < PARTITIONS_MISS_S):
                return ps
        with off_edge():
            have = set(self.master.partitions(topic)) | set(
                self.store.recorded_partitions(topic))
        ps = sorted(p for p in have if self.master.outside(topic, p) is None)
        with self._lock:
            self._listed[topic] = (ps, now)
        return ps

    def topic_id(self, topic: str) -> str | None:
        return self.store.recorded_topic_id(topic)

    def zstd_topic(self, topic: str) -> bool:
        """Whether the topic's compression.type is zstd (Kafka refuses such a topic to a Fetch
        below v10: KIP-110)."""
        return self.store.topic_config(topic).compression_type == "zstd"

    def changes(self) -> int | None:
        """A number that moves whenever the store may hold new records: the generation of the
        store's follower (reput/s3_follow.py), after its poll (one GET per writer per follow
        interval, whoever asks, while a reader waits at the live edge: ``at_edge``). None when
        the store gives no such signal (a local store, S3 without shared uploads): then each
        partition must be looked at. A waiting Fetch asks this, not every partition's bounds,
        while nothing moves."""
        f = follower_for(self.store.fs)
        if f is None:
            return None
        with off_edge():
            return f.poll()

    def at_edge(self) -> None:
        """A Fetch found less than its min_bytes: it waits at the live edge, and the store's
        polls keep the follow interval for a while (reput/s3_follow.py ``Follower.at_edge``).
        The endpoint's reads are otherwise content with an older poll while nothing is new
        (``off_edge``)."""
        f = follower_for(self.store.fs)
        if f is not None:
            f.at_edge()

    @staticmethod
    def _refresh(pl: PartitionLog, fresh: bool = False) -> None:
        """``pl.refresh()`` off the live edge (``at_edge``); ``fresh``: as at the edge."""
        with off_edge(not fresh):
            pl.refresh()

    def has(self, topic: str, partition: int) -> bool:
        return partition in self.partitions(topic, partition)

    # -- partitions ----------------------------------------------------------------------------

    def _part(self, topic: str, partition: int) -> tuple[threading.Lock, PartitionLog]:
        """(its lock, the partition's view): the store's one door (``Store.views``), shared
        with the master's, so the endpoint refuses what every command refuses."""
        with off_edge():
            return self.store.views.get(topic, partition)

    @staticmethod
    def _bounds(pl: PartitionLog) -> Bounds:
        hwm = pl.next_offset
        start = pl.segments[0].base if pl.segments else hwm
        return Bounds(min(start, hwm), hwm)

    def _damaged(self, topic: str, partition: int, err: CorruptRecordError) -> None:
        """Record damage met serving a partition beside it (reput/damage_record.py), once;
        the caller answers KAFKA_STORAGE_ERROR for it."""
        self.store.views.forget(topic, partition)
        DR.write(self.store.fs, topic, partition, path_=err.path, position=err.position,
                 reason=str(err).strip().splitlines()[0] if str(err).strip() else
                 type(err).__name__, found_by="kafka endpoint", found_ms=self.store.clock.ms())

    def bounds(self, topic: str, partition: int, fresh: bool = False) -> Bounds:
        """``fresh``: from a poll at most a follow interval old (ListOffsets LATEST), even
        while no reader waits at the live edge."""
        try:
            lock, pl = self._part(topic, partition)
            with lock:
                self._refresh(pl, fresh)
                return self._bounds(pl)
        except CorruptRecordError as e:
            self._damaged(topic, partition, e)
            raise

    def fetch(self, topic: str, partition: int, offset: int, max_bytes: int) -> Fetched:
        """Whole batches from ``offset`` within ``max_bytes`` (the first whole past it), or, in
        a gap after the last record, the marker ending it (a control batch at the high
        watermark - 1), which also follows the partition's last data when it fits within
        ``max_bytes``; nothing at the high watermark.
        The caller checked ``offset`` against the bounds (``bounds``) and passes them again
        here as they were read (a partition that moved meanwhile is read as it is now)."""
        try:
            return self._fetch(topic, partition, offset, max_bytes)
        except CorruptRecordError as e:
            self._damaged(topic, partition, e)
            raise

    def _fetch(self, topic: str, partition: int, offset: int, max_bytes: int) -> Fetched:
        lock, pl = self._part(topic, partition)
        with lock:
            self._refresh(pl)
            b = self._bounds(pl)
            if offset >= b.high_watermark or offset < b.log_start:
                return Fetched([], 0, b)
            kb = PartitionReader(pl).kafka_batches(offset, max_bytes)
            if not kb.nbytes:  # in the trailing gap: its marker alone
                raw = control_batch(b.high_watermark - 1)
                return Fetched([raw], len(raw), b)
            if kb.next_offset < b.high_watermark and pl.last_offset < kb.next_offset:
                # the partition's last data, then its trailing gap: the marker in the same
                # answer, after the data, as Kafka serves a log ending in transaction markers,
                # while it fits whole within max_bytes (a later batch never overflows it)
                raw = control_batch(b.high_watermark - 1)
                if kb.nbytes + len(raw) <= max_bytes:
                    return Fetched([*kb.parts, raw], kb.nbytes + len(raw), b, kb.zstd)
            return Fetched(kb.parts, kb.nbytes, b, kb.zstd)

    def offset_for_timestamp(self, topic: str, partition: int, ts: int
                             ) -> tuple[int, int] | None:
        lock, pl = self._part(topic, partition)
        with lock:
            self._refresh(pl)
            hit = offset_for_timestamp(PartitionReader(pl), ts)
            return None if hit is None else (hit.offset, hit.timestamp)

    def max_timestamp(self, topic: str, partition: int) -> tuple[int, int] | None:
        lock, pl = self._part(topic, partition)
        with lock:
            self._refresh(pl)
            hit = max_timestamp(PartitionReader(pl))
            return None if hit is None else (hit.offset, hit.timestamp)
