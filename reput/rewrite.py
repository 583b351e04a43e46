"""A new segment made of records read from others: a compaction's output.

Kafka's log owns the segment rewrite (``UnifiedLog.replaceSegments``; the cleaner only decides):
here too the cleaner (compaction/compactor.py) decides which records stay and what their clean
times become, and this writer, the storage layer's, copies them. Records are copied byte for
byte from the verified blocks the partition reader returns (reput/reader.py), so the CRC their
first writer computed is the one every later reader checks; their .bcq entries are the ones
given with the block (offset, timestamp, digest, flags, clean time) at their new positions.
The output is staged (in ``.compacting/``); the swap that puts it in place is reput/swap.py's,
or on an object store ``PartitionLog.commit_staged``.
"""

from __future__ import annotations

import numpy as np

from .backend import Backend
from .errors import ReputError
from .columns import RecordColumns, stored_records
from .record import gather

#: a .bcq position is 32 bits (docs/formats/bcq.md)
MAX_SEGMENT_BYTES = 0xFFFFFFFF


class SegmentWriter:
    """Writes one new segment's .log and .bcq (``append`` blocks, then ``sync`` and ``close``)."""

    def __init__(self, fs: Backend, log_path: str, index_path: str):
        self.log_path = log_path
        self.log = fs.open_append(log_path)
        try:
            self.index = fs.open_append(index_path)
        except BaseException:
            self.log.close()
            raise
        self.size = 0    # bytes of the .log so far
        self.count = 0   # records so far
        self._out = np.empty(0, np.uint8)

    def append(self, block: RecordColumns) -> int:
        """Append a block's records; returns the bytes written (.log and .bcq)."""
        n = len(block)
        if n == 0:
            return 0
        data, rel, sizes, entries = stored_records(block)
        total = int(sizes.sum())
        if self.size + total > MAX_SEGMENT_BYTES:
            raise ReputError(f"{self.log_path}: a segment larger than 4 GiB cannot be indexed "
                             "(segment.bytes is at most 2 GiB)")
        if self._out.shape[0] < total:  # reused: a fresh buffer costs a page fault per 4 KiB
            self._out = np.empty(max(total, 2 * self._out.shape[0]), np.uint8)
        out = gather(data, rel, sizes, self._out)
        ent = entries.copy()
        pos = np.empty(n, np.int64)
        pos[0] = self.size
        np.cumsum(sizes[:-1], out=pos[1:])
        pos[1:] += self.size
        ent["position"] = pos
        self.log.write(out)
        self.index.write(ent.view(np.uint8))
        self.size += total
        self.count += n
        return total + ent.nbytes

    def sync(self) -> None:
        self.log.sync()
        self.index.sync()

    def close(self) -> None:
        try:
            self.log.close()
        finally:
            self.index.close()
