"""The store's partition registry: which partitions a topic has, the one door to a partition,
and the partitions a store has open.

``PartitionRegistry`` is one job of ``Store`` (reput/store.py; docs/architecture.md, "The
rooms of the storage layer"), which keeps a method for each of these that delegates here:

* the listing: a topic's partitions (the store catalog and the journal entries it has not
  folded, a follower's kept listing, or one LIST), and the store's topics;
* the door: ``open_view`` opens every read-only view (this store's reads, the replication
  master, the Kafka endpoint's views, verify), with the store's topic config, clock and
  strictness; ``partition`` caches them, ``writable_partition`` opens one for this store's
  writer (its lock taken, its holder named) and hands it to the publisher;
* strictness: whether a partition without a segment list is refused (``require_list``), and
  store.json's feature saying so once every partition has one;
* the open partitions themselves (``open``: (topic, partition) -> PartitionLog, ``writable``:
  those this store's writer holds), which the write path, the publisher and recovery walk.

Everything here runs under the store's lock (``Store.lock``), as before the split.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import filenames as fn
from . import shared as SH
from .errors import ReputError
from .locks import FileLock, partition_holder
from .partition import PartitionLog
from .record import validate_topic
from .store_meta import FEATURE_SEGMENT_LIST, StoreMeta

if TYPE_CHECKING:
    from .partition_views import PartitionViews

#: a follower of an S3 store with shared uploads and no catalog lists a topic's partitions at
#: most this often (s); the journal names the partitions written since (``partitions``)
PARTITIONS_RELIST_S = 30.0


class PartitionRegistry:
    """A store's partitions: listed, opened through one door, held (see the module docstring).
    ``store`` gives the backend, store.json (``meta``), topic configs, clock, lock, writer and
    publisher; the registry keeps only what it opened."""

    def __init__(self, store: Any):
        self.store = store
        #: (topic, partition) -> its open log: read-only views and this writer's partitions
        self.open: dict[tuple[str, int], PartitionLog] = {}
        #: the keys of ``open`` this store's writer holds
        self.writable: set[tuple[str, int]] = set()
        #: a partition was opened for write since the last close (``maybe_require_lists``)
        self.wrote = False
        #: a follower of a store without a catalog: topic -> (its partitions listed, when)
        self._listing: dict[str, tuple[set[int], float]] = {}
        self._views: Any = None  # (``views``, made when a server first asks)

    # -- listing -------------------------------------------------------------------------

    def _cataloged(self) -> dict[str, set[int]] | None:
        """A store with a catalog: its topics and partitions, from the catalog and the journal
        entries it has not folded yet (no LIST of ``partitions/``); None for other stores."""
        # (also under KCOMPACT_S3_FOLLOW=list: a catalog store's partitions not split yet
        # have no manifest, so no directory to list)
        fs = self.store.fs
        cat = self.store.publisher.store_catalog()
        if cat is None:
            return None
        f = self.store.publisher.follower()
        j = SH.journal_for(fs)
        if f is not None:
            f.poll()
        else:
            cat.refresh()
            if j is not None:
                j.refresh()
        out: dict[str, set[int]] = {t: cat.partitions(t) for t in cat.topics()}
        for t, p in (j.partition_keys() if j is not None else ()):
            out.setdefault(t, set()).add(p)
        return out

    def _listed_partitions(self, topic: str) -> set[int]:
        """The topic's partition directories (one LIST). A process that follows an S3 store
        with shared uploads but no catalog (reput/s3_follow.py; ``kv build --follow`` asks at
        every poll round) lists them at most every ``PARTITIONS_RELIST_S``, and adds the
        partitions the journal's entries name (no request)."""
        fs = self.store.fs
        f = self.store.publisher.follower()
        if f is None:
            return {int(p) for p in fs.listdir(fn.topic_dir(topic)) if p.isdigit()}
        now = time.monotonic()
        got = self._listing.get(topic)
        if got is None or now - got[1] >= PARTITIONS_RELIST_S:
            got = ({int(p) for p in fs.listdir(fn.topic_dir(topic)) if p.isdigit()}, now)
            self._listing[topic] = got
        f.poll()
        return got[0] | {p for t, p in f.journal.partition_keys() if t == topic}

    def topics(self) -> list[str]:
        meta = self.store.meta
        names = set(meta.topics) | set(meta.recorded_partitions)
        cataloged = self._cataloged()
        if cataloged is not None:
            return sorted(names | {t for t, ps in cataloged.items() if ps})
        for name in self.store.fs.listdir(fn.PARTITIONS_DIR):
            try:
                names.add(validate_topic(name))
            except ReputError:
                continue
        return sorted(names)

    def partitions(self, topic: str) -> list[int]:
        cataloged = self._cataloged()
        if cataloged is not None:
            found = set(cataloged.get(topic, ()))
        else:
            found = self._listed_partitions(topic)
        return sorted(found | self.store.publisher.unlisted_partitions(topic))

    # -- the door ------------------------------------------------------------------------

    def open_view(self, topic: str, partition: int, *, strict: bool = True) -> PartitionLog:
        """A new read-only view of the partition (``Store.open_view``)."""
        st = self.store
        pl = PartitionLog(st.fs, topic, partition, st.secret, st.topic_config(topic),
                          clock=st.clock, require_list=self.require_list, strict=strict)
        pl.source_codec = st.source_codec(topic, partition)
        return pl

    @property
    def views(self) -> "PartitionViews":
        """Read-only views shared by a server's threads (``Store.views``)."""
        with self.store.lock:
            if self._views is None:
                from .partition_views import PartitionViews
                self._views = PartitionViews(self.open_view)
            return self._views

    def partition(self, topic: str, partition: int) -> PartitionLog:
        """The partition's log (read-only view unless this process writes it)."""
        key = (topic, partition)
        with self.store.lock:
            pl = self.open.get(key)
            if pl is None:
                pl = self.open_view(topic, partition)
                self.open[key] = pl
            elif key not in self.writable:
                pl.refresh()
            return pl

    def writable_partition(self, topic: str, partition: int) -> PartitionLog:
        key = (topic, partition)
        st = self.store
        with st.lock:
            if key not in self.writable:
                old = self.open.pop(key, None)
                if old is not None:
                    old.close()
                pl = self._open_writable(topic, partition)
                self.wrote = True
                if st.options.seal_format == 2:  # else rolled segments stay format 1
                    pl.require_format = st.require_format
                self.open[key] = pl
                self.writable.add(key)
                st.publisher.writable_opened(pl, key)
            return self.open[key]

    def _open_writable(self, topic: str, partition: int) -> PartitionLog:
        from .errors import StoreLockedError
        st = self.store
        deadline = st.clock.monotonic() + st.partition_lock_wait_s
        holder = partition_holder(st.writer)
        while True:
            try:
                pl = PartitionLog(st.fs, topic, partition, st.secret,
                                  st.topic_config(topic), writable=True,
                                  local_fs=st.local_fs,
                                  clock=st.clock, require_list=self.require_list,
                                  holder=holder)
                pl.source_codec = st.source_codec(topic, partition)
                return pl
            except StoreLockedError as e:
                if e.by_writer or st.clock.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def release(self, topic: str, partition: int) -> None:
        """Forget a cached partition (after another component rewrote its files)."""
        with self.store.lock:
            pl = self.open.pop((topic, partition), None)
            self.writable.discard((topic, partition))
            if pl is not None:
                pl.close()

    def adopted(self) -> None:
        """store.json was read again: the open partitions take their topics' configs."""
        st = self.store
        for (t, p), pl in self.open.items():
            pl.config = st.topic_config(t)
            pl.source_codec = st.source_codec(t, p)

    def close_views(self) -> None:
        """Close the read-only views (the partitions this writer holds stay open)."""
        with self.store.lock:
            for key in list(self.open):
                if key not in self.writable:
                    self.open.pop(key).close()

    def abandon(self) -> None:
        """A writer's open failed: close every open partition, publishing nothing, and forget
        them (their locks released: the caller may open the store again)."""
        try:
            for pl in self.open.values():
                pl.close(publish=False)
        finally:
            self.open.clear()
            self.writable.clear()

    # -- strictness ----------------------------------------------------------------------

    @property
    def require_list(self) -> bool:
        """Whether every local partition of this store has a segment list (store.json's
        features say so), so that one without is refused."""
        st = self.store
        return st.publisher.requires_lists(st.meta.features, FEATURE_SEGMENT_LIST)

    def maybe_require_lists(self) -> None:
        """A store from before segment lists: once every partition has its list (each gets
        one the first time it is opened for write), store.json says so, and from then on a
        partition without a list is refused."""
        st = self.store
        fs = st.fs
        for t in self.topics():
            for p in self.partitions(t):
                pdir = fn.partition_dir(t, p)
                if not fs.exists(f"{pdir}/{fn.SEGMENT_LIST}") and any(
                        fn.parse_base(n) for n in fs.listdir(pdir)):
                    return
        with FileLock(fs, fn.STORE_JSON_LOCK) as flock:  # (as a topic config change)
            flock.acquire(blocking=True)
            meta = StoreMeta.from_json(fs.read(fn.STORE_JSON), fs.url)
            if FEATURE_SEGMENT_LIST not in meta.features:
                meta.features = meta.features + [FEATURE_SEGMENT_LIST]
                fs.write_atomic(fn.STORE_JSON, meta.to_json())
        st.meta = meta
