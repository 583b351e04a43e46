"""A store's write path: append, flush, roll, and the writer's seal thread.

One job of ``Store`` (reput/store.py; docs/architecture.md, "The rooms of the storage layer"),
which keeps a method for each of these that delegates here. ``append(batch)`` encodes the batch
into the writer's commit log and hands it to reput (``Reput``, reput/reput_service.py), which
dispatches it into the partitions' compaction logs; ``flush()`` makes it durable in this order,
which is the durability argument: commit log fsync, the partitions' fsyncs, the next offsets a
source advanced to, the publisher's step (S3: uploads and a manifest version or a journal
entry), then the reput checkpoint. Every flushed record survives a crash exactly once.
Everything runs under the store's lock.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native as _N
from .commitlog import CommitLog
from .errors import OffsetOrderError, ReputError
from .record import RecordBatch, Scratch, encode_scanned
from .reput_service import Reput
from .timing import Timing

if TYPE_CHECKING:
    from .partition import PartitionLog

SYNC_THREADS = 8  # partitions fsynced at once by a flush
WRITEBACK_BYTES = 8 << 20  # fsync=flush: queue appended bytes for writeback this often
BACKGROUND_SYNC_BYTES = 8 << 20  # ... and fdatasync the commit log in the background this often
# (8 MiB measured better than 32 on this VM: store bench with fsync 2.09M vs 1.85-1.89M rec/s,
# mirror 1.34 s vs 1.52 s, a Spark task's final flush 0.02 s vs 0.09 s; one-off A/B runs)
#: a batch whose partition numbers are all in [0, this] has its offset order checked in one
#: compiled pass (WritePath.check_order); a larger one (never from Kafka) with an argsort
ORDER_KERNEL_MAX_PARTITION = 1 << 16


def _offset_order(partitions: np.ndarray, offsets: np.ndarray, max_partition: int):
    """(i, seen) of the C offset_order (reput/_native.c)."""
    seen = np.empty(max_partition + 1, np.uint8)
    return _N.offset_order(partitions, offsets, max_partition, seen), seen


def warm_up() -> None:
    """Load the kernel of Store.append's offset-order check (numba's cache when the C module is
    not built: ~15 ms on its first call in a process, which a writer can pay while it starts
    instead of in its first append)."""
    _offset_order(np.zeros(2, np.int32), np.arange(2, dtype=np.int64), 0)


class SyncPacer:
    """When a writer under ``fsync=flush`` queues what it appended for writeback
    (sync_file_range) and when it asks for a background fdatasync: ``add(nbytes)`` returns
    (writeback, sync). Used by the store's writer and by a replica's pull."""

    __slots__ = ("writeback_every", "sync_every", "_unqueued", "_unsynced")

    def __init__(self, writeback_every: int | None = None, sync_every: int | None = None):
        # None: the module's WRITEBACK_BYTES / BACKGROUND_SYNC_BYTES, read at each add()
        self.writeback_every, self.sync_every = writeback_every, sync_every
        self._unqueued = self._unsynced = 0

    def add(self, nbytes: int) -> tuple[bool, bool]:
        self._unqueued += nbytes
        every = WRITEBACK_BYTES if self.writeback_every is None else self.writeback_every
        if self._unqueued < every:
            return False, False
        self._unsynced += self._unqueued
        self._unqueued = 0
        if self._unsynced < (BACKGROUND_SYNC_BYTES if self.sync_every is None
                             else self.sync_every):
            return True, False
        self._unsynced = 0
        return True, True

    def reset(self) -> None:
        """Everything so far was made durable (a full sync)."""
        self._unqueued = self._unsynced = 0


class WritePath:
    """The write path of ``store`` (its lock, clock, options, writer, publisher and partition
    registry): the writer's commit log and reput (None for a read-only store) and what a flush
    needs between appends."""

    def __init__(self, store: Any):
        self.store = store
        self.commitlog: CommitLog | None = None
        #: the writer's reput (reput/reput_service.py), made with its commit log
        self.reput: Reput | None = None
        self.stats = {"appended": 0, "dispatched": 0, "skipped": 0}
        #: each flush's fsyncs of the partitions' files (all of them: one observation)
        self.partition_fsync_time = Timing()
        #: the writer's seal thread (WriterOptions(seal="background"); reput/seal.py), made when
        #: a partition is opened for write; ``seals_left``: rolled segments its close left format 1
        self.sealer: Any = None
        self.seals_left = 0
        self._scratch = Scratch()
        self._pacer = SyncPacer()
        self._sync_pool: Any = None  # flush's fsync threads (_sync_partitions), made when needed
        self._sync_pool_pid = -1
        #: (topic, partition) -> where the source goes on past the last record appended
        #: (``advance_next_offset``), made the partitions' next offsets by the next flush
        self._advances: dict[tuple[str, int], int] = {}

    def open_commitlog(self) -> None:
        """A writer's store: take its commit log (``commitlog/<writer>/``) and make its reput."""
        st = self.store
        self.commitlog = CommitLog(st.commitlog_fs, st.writer, st.options, st.clock)
        self.reput = Reput(self.commitlog, st.writer, st.secret, st.writable_partition,
                           self.stats)

    def _require_writer(self) -> None:
        if self.commitlog is None:
            raise ReputError("this store was opened read-only; open it with a writer id to append")

    # -- append --------------------------------------------------------------------------

    def check_order(self, batch: RecordBatch) -> list[int]:
        """``Store._check_order``."""
        parts, offs = batch.partitions, batch.offsets
        if len(batch) == 0:
            return []
        lo, hi = int(parts.min()), int(parts.max())
        if lo >= 0 and hi <= ORDER_KERNEL_MAX_PARTITION:
            i, seen = _offset_order(parts, offs, hi)
            if i >= 0:
                p = parts[i]
                prev = int(offs[:i][parts[:i] == p][-1])
                raise OffsetOrderError(
                    f"{batch.topic}-{int(p)}: offset {int(offs[i])} follows {prev} in the "
                    "batch; offsets must strictly increase")
            return np.flatnonzero(seen).tolist()
        order = np.argsort(parts, kind="stable")
        p, o = parts[order], offs[order]
        bad = np.nonzero((p[1:] == p[:-1]) & (o[1:] <= o[:-1]))[0]
        if bad.size:
            i = int(bad[0]) + 1
            raise OffsetOrderError(f"{batch.topic}-{int(p[i])}: offset {int(o[i])} follows "
                                   f"{int(o[i - 1])} in the batch; offsets must strictly increase")
        return np.unique(parts).tolist()

    def append(self, batch: RecordBatch) -> int:
        """``Store.append``."""
        self._require_writer()
        if len(batch) == 0:
            return 0
        partitions = self.check_order(batch)
        st = self.store
        with st.lock:
            # take every partition this batch writes before the commit log gets a byte of it:
            # a partition held by another writer fails the append with nothing written
            for p in partitions:
                st.writable_partition(batch.topic, p)
            buf, s = encode_scanned(batch, secret=st.secret, scratch=self._scratch)
            start, end = self.commitlog.append(buf, s.positions)
            self.stats["appended"] += len(batch)
            if start == self.reput.position:
                # The bytes just written are in memory, and so is their scan (one topic, the
                # batch's): dispatch them without reading or parsing them again.
                n = self.reput.dispatch_scanned(buf, s, batch.topic, end)
            else:
                n = self.reput.dispatch()
            self._maybe_start_writeback(end - start)
            return n

    def advance_next_offset(self, topic: str, partition: int, offset: int) -> None:
        """``Store.advance_next_offset``."""
        self._require_writer()
        with self.store.lock:
            key = (topic, int(partition))
            if offset > self._advances.get(key, -1):
                self._advances[key] = int(offset)

    def dispatch(self) -> int:
        """Reput: copy commit-log records after the dispatched position into partitions."""
        assert self.reput is not None
        with self.store.lock:
            return self.reput.dispatch()

    def write_timings(self) -> dict[str, Timing]:
        """``Store.write_timings``."""
        cl = self.commitlog
        if cl is None:
            return {}
        return {"append": cl.append_time, "commitlog": cl.fsync_time,
                "partitions": self.partition_fsync_time}

    def _maybe_start_writeback(self, nbytes: int) -> None:
        """Under ``fsync=flush``, queue what was appended for writeback every
        ``WRITEBACK_BYTES`` (sync_file_range, no waiting), so that the fsyncs of ``flush`` find
        little left to write: the disk works while the writer goes on, instead of all at once
        when a flush (or the end of a mirror) waits for it."""
        st = self.store
        if st.options.fsync != "flush":
            return
        writeback, sync = self._pacer.add(nbytes)
        if not writeback:
            return
        self.commitlog.start_writeback()
        reg = st.registry
        for key in reg.writable:
            reg.open[key].start_writeback()
        if sync:
            # An fdatasync of the commit log, in a thread of its own: the device's cache is then
            # flushed as the stream goes (the compaction logs' bytes queued just above with it),
            # instead of all at once in the fsyncs of the next flush (backend._BackgroundSync).
            self.commitlog.sync_soon()

    # -- flush ---------------------------------------------------------------------------

    def flush(self) -> None:
        """``Store.flush``: durable, published, then the reput checkpoint."""
        if self.commitlog is None:
            return
        st = self.store
        with st.lock:
            if self.sealer is not None:
                self.sealer.check()  # a seal that failed (its segment left format 1)
            if st.options.fsync != "never":
                self.commitlog.sync()
                t0 = st.clock.monotonic()
                self._sync_partitions()
                self.partition_fsync_time.observe(st.clock.monotonic() - t0)
            advances, self._advances = self._advances, {}
            for (topic, partition), offset in sorted(advances.items()):
                st.writable_partition(topic, partition).advance_next_offset(offset)
            # publish (S3: each partition's new segments uploaded and its manifest committed,
            # or one shared object for all of them), before the checkpoint says those records
            # need no re-dispatch
            st.publisher.publish_all()
            done = self.reput.position
            if done != self.commitlog.read_checkpoint():
                self.commitlog.write_checkpoint(done)
            self.commitlog.delete_dispatched(done)

    def _sync_partitions(self) -> None:
        """fsync the files of every partition this writer appended to, several partitions at
        once: concurrent fsyncs share the filesystem's journal commits and the device's cache
        flushes (measured on this VM: 16 files of 8 MiB, 0.08-0.12 s one after another, 0.06 s
        with 8 threads). Every sync ends before this returns; the first failure is raised."""
        reg = self.store.registry
        pls = [reg.open[key] for key in reg.writable]
        if not self.store.publisher.fsyncs_partitions:
            # the commit log (fsynced above) is the durable copy until the journal commit,
            # after which the local segments are dropped: no fsync of 2 files a partition
            for pl in pls:
                pl.sync(fsync=False)
            return
        if len(pls) <= 1:
            for pl in pls:
                pl.sync()
            return
        if self._sync_pool is None or self._sync_pool_pid != os.getpid():
            # (a forked child has the pool object but none of its threads: a new pool)
            from concurrent.futures import ThreadPoolExecutor
            self._sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="kcompact-fsync")
            self._sync_pool_pid = os.getpid()
        futures = [self._sync_pool.submit(pl.sync) for pl in pls]
        for f in futures:
            f.exception()  # wait for all of them before raising any
        for f in futures:
            f.result()

    def roll(self, *, only_due: bool = False) -> int:
        """``Store.roll``."""
        st = self.store
        reg = st.registry
        n = 0
        with st.lock:
            now = st.clock.ms()
            for key in sorted(reg.writable):
                pl = reg.open[key]
                if only_due:
                    n += pl.roll_if_due(now)
                elif any(s.kind == "file" and s.log_size for s in pl.segments[-1:]):
                    pl.roll(writer=st.writer or "writer")
                    n += 1
        return n

    # -- the seal thread -----------------------------------------------------------------

    def drain_seals(self) -> None:
        """``Store.drain_seals``."""
        if self.sealer is not None:
            self.sealer.drain()
            self.sealer.check()

    def background_seals(self, pl: "PartitionLog") -> None:
        """Seal ``pl``'s rolled segments in the writer's seal thread: those it rolls from now
        on, and (in a format-2 store) those a previous writer left format 1."""
        from .seal import Sealer
        st = self.store
        if self.sealer is None:
            self.sealer = Sealer(st.lock)
        pl.seal_queue = self.sealer.submit
        if st.meta.format_version >= 2:
            self.sealer.submit(pl, None)

    def close_sealer(self) -> None:
        """The store closes: the seal under way ends (outside the store's lock, which it takes
        to swap its segment in); what is still queued, and what the last flush hands it, is
        left format 1."""
        if self.sealer is not None:
            self.sealer.close()

    def forget_sealer(self) -> None:
        """After the last flush: count the segments the seal thread left format 1."""
        if self.sealer is not None:
            self.seals_left += self.sealer.left
            self.sealer = None

    def close(self) -> None:
        """The store's partitions are closed: release the commit log and the fsync threads."""
        if self.commitlog is not None:
            self.commitlog.close()
            self.commitlog = None
        if self._sync_pool is not None:
            if self._sync_pool_pid == os.getpid():
                self._sync_pool.shutdown()
            self._sync_pool = None
