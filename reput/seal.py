"""Sealing: a rolled format-1 segment re-encoded as a format-2 segment (Kafka batches, lean index).

Spec: docs/formats/segment-v2.md ("Sealing: format 1 to format 2"). The writer rolls its active
segment when ``segment.bytes`` is reached; at its next ``sync`` (a flush) each segment it rolled
is read through the partition reader (so the CRC of every record is checked before it is
re-encoded), written as batches of the topic's codec and a lean index into ``.compacting/``, and
swapped in with the compaction swap (compaction-swap.md; inputs = outputs = the segment's base):
a crash at any point leaves the format-1 pair or the format-2 pair, never a mix. A compaction of
the partition running at that moment holds its lock: the seal is skipped (the compaction rewrites
format-1 segments into format 2 itself). On an object store the writer encodes each segment
into format 2 just before it uploads it (``encode_segment``, catalog_manifest.py).

``WriterOptions(seal="background")`` (what the mirror's store sink uses): the writer's ``Sealer``
thread seals rolled segments while appends go on (the encode runs outside the store's lock, with
the partition's compaction lock held, as a compaction does; only the swap takes the store's
lock), and the writer's close does not wait for segments still queued: they stay format 1
(valid, readable) until the next writer of the store opens the partition (which queues them
again), a compaction or ``kcompact compact``.
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext

import numpy as np

from . import filenames as fn
from . import swap
from .batch import codec_of
from .codecs import target_of
from .errors import ReputError
from .locks import FileLock
from .rewrite import SegmentWriter2

#: bytes read at once from the format-1 segment being sealed
SEAL_READ_BYTES = 8 << 20


def encode_segment_bytes(seg, cfg, source: int | None = None
                         ) -> tuple[bytearray, bytearray, np.ndarray]:
    """``encode_segment`` into memory: the format-2 ``.log`` and ``.bcq`` bytes of format-1
    segment ``seg``, and the offsets its lean index lists (every record's: those of ``seg``'s
    own index, checked against the count written, so the index just built is not decoded
    again). A writer's part of a shared object is encoded straight into the object, with no
    local file nor fsync: docs/formats/shared-upload.md, "A writer's flush"."""
    from .backend import MemoryBackend
    mem = MemoryBackend()
    written = encode_segment(seg, cfg, mem, "log", "bcq", source)
    offsets = np.ascontiguousarray(seg.entries()["offset"], dtype=np.int64)
    if written != offsets.shape[0]:
        raise ReputError(f"{seg.log_path}: {written} records encoded of the "
                         f"{offsets.shape[0]} its index lists")
    return mem.files["log"], mem.files["bcq"], offsets


def encode_segment(seg, cfg, fs, log_out: str, idx_out: str, source: int | None = None) -> int:
    """Write format-1 segment ``seg`` as a format-2 pair ``log_out``/``idx_out`` on ``fs``
    (fsynced) with its topic's codec (``cfg``: its TopicConfig; ``producer``: ``source``, the
    codec the mirror read the source's batches of the partition with, ``PartitionLog.
    source_codec``; uncompressed when it is unknown: codecs.codec_of), every record read
    through the segment's selection (its CRC checked). Returns the records written."""
    out = SegmentWriter2(fs, log_out, idx_out, codec=codec_of(cfg.compression_type, source),
                         level=cfg.compression_zstd_level, batch_bytes=cfg.compression_batch_bytes,
                         target=target_of(cfg.compression_type))
    try:
        with seg.selection(sequential=True, block_bytes=SEAL_READ_BYTES) as src:
            for _, chunk in seg.index_chunks():
                for block in src.select(chunk):
                    out.append(block)
        out.sync()
        return out.count
    finally:
        out.close()


def _sealable(pl, base: int):
    seg = next((s for s in pl.segments if s.base == base), None)
    if (seg is None or seg is pl.segments[-1] or seg.kind != "file" or seg.log_size == 0
            or pl.require_format is None or not seg.sealable):
        return None  # (no store to raise to format 2: a scratch partition stays format 1)
    return seg


def unsealed_bases(pl) -> list[int]:
    """Bases of ``pl``'s rolled segments still in format 1 (what a writer's sealer queues when
    it opens the partition of a format-2 store)."""
    return [s.base for s in pl.segments[:-1] if _sealable(pl, s.base) is not None]


def seal_segment(pl, base: int, store_lock=None) -> bool:
    """Re-encode the sealed format-1 segment at ``base`` of writable local partition ``pl``
    into format 2. Returns whether it was (False: gone, already format 2, empty, the active
    segment, or a compaction holds the partition). ``store_lock``: the writer's store lock,
    when the seal runs beside the writer's appends (``Sealer``): the segment is looked up and
    swapped in under it, encoded outside it."""
    guard = store_lock if store_lock is not None else nullcontext()
    with guard:
        seg = _sealable(pl, base)
    if seg is None:
        return False
    fs = pl.local_fs
    lock = FileLock(fs, f"{pl.dir}/{fn.COMPACTION_LOCK}")
    if not lock.acquire(blocking=False):
        return False
    try:
        with guard:
            if _sealable(pl, base) is not seg:  # swapped meanwhile (a compaction)
                return False
        pl.require_format(2)
        sdir = swap.staging_dir(pl.dir)
        fs.remove_tree(sdir)
        name = fn.base_name(base)
        encode_segment(seg, pl.config, fs, f"{sdir}/{name}{fn.LOG_SUFFIX}",
                       f"{sdir}/{name}{fn.INDEX_SUFFIX}", pl.source_codec)
        fs.sync_dir(sdir)
        plan = swap.SwapPlan([base], [base], None)
        swap.commit(fs, pl.dir, plan)
        with guard:
            swap.apply(fs, pl.dir, plan)
            pl.reload_after_swap()
        swap.empty_trash(fs, pl.dir)
        return True
    except BaseException:
        if not fs.exists(f"{swap.staging_dir(pl.dir)}/{swap.PLAN_NAME}"):
            swap.abort(fs, pl.dir)
        raise
    finally:
        lock.release()


class Sealer:
    """A writer's seal thread (``WriterOptions(seal="background")``): seals the segments its
    partitions roll, one at a time, while the writer appends. ``close`` finishes the seal under
    way and drops the queue (those segments stay format 1). The first failure is raised by the
    next ``check`` (the writer's flush); the segment it failed on is left as it was."""

    def __init__(self, store_lock):
        self.store_lock = store_lock
        self.sealed = 0
        self.left = 0  # queued segments a close dropped (still format 1)
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, pl, base: int | None) -> None:
        """Queue the seal of ``pl``'s segment at ``base`` (None: each rolled one still format 1)."""
        if self._closed:
            self.left += 1
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kcompact-seal", daemon=True)
            self._thread.start()
        self._q.put((pl, base))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            pl, base = item
            try:
                if base is None:  # what an earlier writer left format 1
                    with self.store_lock:
                        bases = unsealed_bases(pl)
                else:
                    bases = [base]
                for i, b in enumerate(bases):
                    if self._closed or self.error is not None:
                        self.left += len(bases) - i
                        break
                    self.sealed += seal_segment(pl, b, self.store_lock)
            except BaseException as e:  # noqa: BLE001 - raised on the writer's thread
                self.error = e
            finally:
                self._q.task_done()

    def drain(self) -> None:
        """Wait until every seal handed over so far is done (or failed: ``check``)."""
        if self._thread is not None:
            self._q.join()

    def check(self) -> None:
        """Raise the first seal failure (once)."""
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def close(self) -> None:
        """Finish the seal under way; leave the queued ones format 1."""
        self._closed = True
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None


__all__ = ["Sealer", "encode_segment", "seal_segment", "unsealed_bases"]
