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

import os

import numpy as np

from .backend import Backend
from .errors import ReputError
from .columns import RecordColumns, stored_records
from .record import gather

#: a .bcq position is 32 bits (docs/formats/bcq.md)
MAX_SEGMENT_BYTES = 0xFFFFFFFF

#: format-1 bytes of a block taken into the queue at a time (a compaction's blocks are a few MiB;
#: encoding them a slice at a time keeps the copies that encoding makes that small)
APPEND_SLICE_BYTES = 1 << 20

#: the most batches stored uncompressed without a try after batches that did not compress
#: (docs/formats/segment-v2.md: 1, 3, 7 ... after 1, 2, 3 ... such batches in a row)
PLAIN_RUN_MAX = 63


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


class SegmentWriter2:
    """Writes one format-2 segment (docs/formats/segment-v2.md): a .log of Kafka batches and its
    lean .bcq (bcq-v2.md). ``append`` takes verified blocks (format-1 records in memory, as the
    partition reader hands them out, with the entries' clean times the caller wants) and encodes
    them into batches of about ``batch_bytes``; ``append_batches`` copies stored batches byte for
    byte (a compaction keeping every record of a run of them). ``sync`` writes the last batch
    and the index; then ``close``."""

    def __init__(self, fs: Backend, log_path: str, index_path: str, *, codec: int, level: int,
                 batch_bytes: int, target: int = 0):
        """``target``: what compression.type the segment is written for (codecs.target_of),
        kept in its lean index so that a later change of compression.type re-encodes it."""
        from .bcq2 import IndexBuilder
        self.fs, self.log_path, self.index_path = fs, log_path, index_path
        self.target = target
        self.codec, self.level, self.batch_bytes = codec, level, max(1, int(batch_bytes))
        self.log = fs.open_append(log_path)
        local = fs.local_path(index_path)
        self.builder = IndexBuilder(spill_dir=os.path.dirname(local) if local else None)
        self.size = 0    # bytes of the .log so far
        self.count = 0   # records so far
        self.written_codec = 0  # the codec of the last compressed batch (0: none compressed)
        self._bufs: list[np.ndarray] = []
        self._sizes: list[np.ndarray] = []
        self._entries: list[np.ndarray] = []
        self._pending = 0
        self._done = False
        #: batches tried in a row that did not compress (the next one tried is probed first)
        self._tried_plain = 0
        #: batches still to store uncompressed without trying (after ``_tried_plain`` ones)
        self._plain_left = 0

    def append(self, block: RecordColumns) -> int:
        """Queue a block's records (encoded once ``batch_bytes`` of them are queued); returns
        the format-1 bytes taken."""
        n = len(block)
        if n == 0:
            return 0
        data, rel, sizes, entries = stored_records(block)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        ends = np.cumsum(sizes)
        step = max(self.batch_bytes, APPEND_SLICE_BYTES)
        i = 0
        while i < n:  # a slice at a time: what is encoded at once stays small
            done = int(ends[i - 1]) if i else 0
            j = max(i + 1, min(n, int(np.searchsorted(ends, done + step, side="right"))))
            self._bufs.append(gather(data, rel[i:j], sizes[i:j]))
            self._sizes.append(sizes[i:j])
            self._entries.append(np.array(entries[i:j], copy=True))
            self._pending += int(ends[j - 1]) - done
            if self._pending >= self.batch_bytes:
                self._emit(final=False)
            i = j
        return int(ends[-1])

    def append_batches(self, raw: np.ndarray, sizes, counts, entries: np.ndarray,
                       codec: int = 0) -> int:
        """Copy stored batches lying back to back in ``raw`` as they are, in one write (their
        ``sizes`` and record ``counts``, and the index entries of all their records, given;
        ``codec``: the codec their segment records); returns their bytes."""
        self._emit(final=True)
        if codec:
            self.written_codec = codec
        self._check_room(raw.shape[0])
        self.log.write(raw)
        self.builder.add_batches(self.size, sizes, counts, entries)
        self.size += raw.shape[0]
        self.count += entries.shape[0]
        return raw.shape[0]

    def _check_room(self, nbytes: int) -> None:
        if self.size + nbytes > MAX_SEGMENT_BYTES:
            raise ReputError(f"{self.log_path}: a segment larger than 4 GiB cannot be indexed "
                             "(segment.bytes is at most 2 GiB)")

    def _emit(self, final: bool) -> None:
        """Encode queued records into batches: every full batch, and with ``final`` the rest.
        Runs of batches stored uncompressed (the topic's codec is none, or the last batches
        tried did not compress: ``_tried_plain``) are encoded in one call (batch.encode_plain)."""
        from .batch import CODEC_NONE, cut_batch, encode_batch, encode_plain
        if not self._bufs:
            return
        buf = np.concatenate(self._bufs) if len(self._bufs) > 1 else self._bufs[0]
        sizes = np.concatenate(self._sizes) if len(self._sizes) > 1 else self._sizes[0]
        ent = np.concatenate(self._entries) if len(self._entries) > 1 else self._entries[0]
        pos = np.zeros(sizes.shape[0], np.int64)
        if sizes.shape[0] > 1:
            np.cumsum(sizes[:-1], out=pos[1:])
        ends = pos + sizes
        offsets = ent["offset"].astype(np.int64)
        timestamps = ent["timestamp"].astype(np.int64)
        lo, n = 0, sizes.shape[0]
        # the batches of this call: written and indexed together after the loop
        start_size, datas, bsizes, counts = self.size, [], [], []
        while lo < n:
            if self.codec == CODEC_NONE or self._plain_left > 0:
                most = n if self.codec == CODEC_NONE else self._plain_left
                data, bs, cs, hi = encode_plain(buf, pos, ends, offsets, timestamps, lo, n,
                                                self.batch_bytes, most, final)
                if not cs:
                    break  # not a full batch yet: wait for more records
                self._check_room(data.shape[0])
                datas.append(data)
                bsizes += bs
                counts += cs
                if self.codec != CODEC_NONE:
                    self._plain_left -= len(cs)
                self.size += data.shape[0]
                self.count += hi - lo
                lo = hi
                continue
            hi = cut_batch(pos, ends, offsets, lo, n, self.batch_bytes, final)
            if hi == lo:
                break  # not a full batch yet: wait for more records
            eb = encode_batch(buf, pos, lo, hi, offsets, timestamps, self.codec, self.level,
                              probe_small=self._tried_plain > 0)
            if eb.codec == CODEC_NONE:
                # incompressible records (random or already compressed values): the next
                # 1, 3, 7 ... up to PLAIN_RUN_MAX batches are stored plain without a try
                self._tried_plain += 1
                self._plain_left = min((1 << min(self._tried_plain, 16)) - 1, PLAIN_RUN_MAX)
            else:
                self._tried_plain = 0
                self.written_codec = eb.codec
            self._check_room(len(eb.data))
            datas.append(eb.data)
            bsizes.append(len(eb.data))
            counts.append(hi - lo)
            self.size += len(eb.data)
            self.count += hi - lo
            lo = hi
        if datas:
            self.log.write(b"".join(datas) if len(datas) > 1 else datas[0])
            self.builder.add_batches(start_size, bsizes, counts, ent[:lo])
        if lo >= n:
            self._bufs, self._sizes, self._entries, self._pending = [], [], [], 0
        else:
            start = int(pos[lo])
            self._bufs, self._sizes = [buf[start:].copy()], [sizes[lo:].copy()]
            self._entries = [ent[lo:].copy()]
            self._pending = int(ends[-1]) - start

    def finish(self) -> None:
        """Write the last batch and the lean index (once)."""
        if self._done:
            return
        self._emit(final=True)
        idx = self.fs.open_append(self.index_path)
        try:
            self.builder.write_to(idx, self.written_codec, self.target)
            idx.sync()
        finally:
            idx.close()
        self._done = True

    def sync(self) -> None:
        self.finish()
        self.log.sync()

    def close(self) -> None:
        self.log.close()
