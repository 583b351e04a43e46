"""Reads of one partition by offset, the next one made in a thread while the caller works on the
current one.

A bulk reader that knows where its next read starts as soon as a read returns (the KV map's
build: the first winner after the block) hands that offset to ``prefetch`` before it works on
the block, and ``take``s the next block when it is done. The partition reader's heavy parts
(reading, decompressing a format-2 span, walking, converting and checking the records) release
the GIL, so on a machine with a core to spare the read of the next block overlaps the caller's
work on this one. One read is in flight at a time; the reader's state (the batch a read keeps
for the next) is only touched by that thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from .columns import KeyValues, RecordColumns
from .reader import PartitionReader


class ReadAhead:
    """``with ReadAhead(reader) as ra: ra.prefetch(o, max_bytes=N); block = ra.take()``;
    ``fields=True``: blocks of keys and values only (``reader.read_fields``)."""

    def __init__(self, reader: PartitionReader, *, fields: bool = False):
        self.reader = reader
        #: read keys and values only (``reader.read_fields``), else whole records
        self.fields = fields
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kcompact-read-ahead")
        self._next: Future | None = None

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prefetch(self, from_offset: int, max_records: int | None = None,
                 max_bytes: int | None = None, want=None) -> None:
        """Start ``reader.read(from_offset, max_records, max_bytes)`` (one at a time); with
        ``fields``, ``reader.read_fields(from_offset, max_bytes, want)``."""
        if self._next is not None:
            raise RuntimeError("a read is already in flight: take() it first")
        if self.fields:
            if max_records is not None:
                raise ValueError("a read of keys and values is bounded in bytes only")
            self._next = self._pool.submit(self.reader.read_fields, from_offset, max_bytes,
                                           want)
        else:
            self._next = self._pool.submit(self.reader.read, from_offset, max_records,
                                           max_bytes)

    def take(self) -> "RecordColumns | KeyValues":
        """The block the last ``prefetch`` asked for (its error, if it failed)."""
        if self._next is None:
            raise RuntimeError("nothing prefetched")
        fut, self._next = self._next, None
        return fut.result()

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        self._pool.shutdown(wait=True)


__all__ = ["ReadAhead"]
