"""Sealing: a rolled format-1 segment re-encoded as a format-2 segment (Kafka batches, lean index).

Spec: docs/formats/segment-v2.md ("Sealing: format 1 to format 2"). The writer rolls its active
segment when ``segment.bytes`` is reached; at its next ``sync`` (a flush) each segment it rolled
is read through the partition reader (so the CRC of every record is checked before it is
re-encoded), written as batches of the topic's codec and a lean index into ``.compacting/``, and
swapped in with the compaction swap (compaction-swap.md; inputs = outputs = the segment's base):
a crash at any point leaves the format-1 pair or the format-2 pair, never a mix. A compaction of
the partition running at that moment holds its lock: the seal is skipped (the compaction rewrites
format-1 segments into format 2 itself). On an object store the writer encodes each segment
into format 2 just before it uploads it (``encode_segment``, partition_manifest.py).
"""

from __future__ import annotations

from . import filenames as fn
from . import swap
from .batch import codec_of
from .locks import FileLock
from .reader import IndexCursor, PartitionReader
from .rewrite import SegmentWriter2

#: bytes read at once from the format-1 segment being sealed
SEAL_READ_BYTES = 8 << 20


def encode_segment(pl, seg, fs, log_out: str, idx_out: str) -> None:
    """Write format-1 segment ``seg`` of ``pl`` as a format-2 pair ``log_out``/``idx_out`` on
    ``fs`` (fsynced), every record read through the partition reader (its CRC checked)."""
    cfg = pl.config
    out = SegmentWriter2(fs, log_out, idx_out, codec=codec_of(cfg.compression_type),
                         level=cfg.compression_zstd_level, batch_bytes=cfg.compression_batch_bytes)
    try:
        reader = PartitionReader(pl)
        with reader.segment(seg, sequential=True, block_bytes=SEAL_READ_BYTES) as src:
            for _, chunk in IndexCursor(pl).chunks(seg):
                for block in src.select(chunk):
                    out.append(block)
        out.sync()
    finally:
        out.close()


def seal_segment(pl, base: int) -> bool:
    """Re-encode the sealed format-1 segment at ``base`` of writable local partition ``pl``
    into format 2. Returns whether it was (False: gone, already format 2, empty, the active
    segment, or a compaction holds the partition)."""
    seg = next((s for s in pl.segments if s.base == base), None)
    if (seg is None or seg is pl.segments[-1] or seg.kind != "file" or seg.log_size == 0
            or pl.require_format is None or pl.seg_format(seg) == 2):
        return False  # (no store to raise to format 2: a scratch partition stays format 1)
    fs = pl.local_fs
    lock = FileLock(fs, f"{pl.dir}/{fn.COMPACTION_LOCK}")
    if not lock.acquire(blocking=False):
        return False
    try:
        pl.require_format(2)
        sdir = swap.staging_dir(pl.dir)
        fs.remove_tree(sdir)
        name = fn.base_name(base)
        encode_segment(pl, seg, fs, f"{sdir}/{name}{fn.LOG_SUFFIX}",
                       f"{sdir}/{name}{fn.INDEX_SUFFIX}")
        fs.sync_dir(sdir)
        plan = swap.SwapPlan([base], [base], None)
        swap.commit(fs, pl.dir, plan)
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


__all__ = ["encode_segment", "seal_segment"]
