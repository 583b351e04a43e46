"""Consumed batches as columns, without a Message object per record.

kcompact's own Kafka consumer (native_kafka.NativeConsumer, on _rdkafka.c) reads a batch with the
GIL released and returns it as packed columns: a :class:`Batch`. The sequences here read those
columns back as confluent-kafka's Message methods would give them, made into Python objects only
when an element is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from kcompact.reput.record import decode_headers

from . import _rdkafka as _NATIVE


class Event(NamedTuple):
    """An error message of a batch (end of partition, offset out of range ...)."""
    topic: str | None
    partition: int
    offset: int
    code: int
    reason: str
    fatal: bool


class PackedBytes(Sequence):
    """A packed column (bytes, n+1 int64 starts, n null flags) as a sequence of bytes | None,
    made into bytes objects only when an element is read."""

    __slots__ = ("buf", "starts", "nulls", "_items")

    def __init__(self, buf: Any, starts: Any, nulls: Any):
        self.buf, self.starts, self.nulls = buf, starts, nulls
        self._items: list | None = None

    @staticmethod
    def unpacked(buf: Any, starts: Any, nulls: Any) -> list:
        """The column as a list of bytes | None."""
        return _NATIVE.unpack(buf, starts, nulls)

    def _list(self) -> list:
        if self._items is None:
            self._items = self.unpacked(self.buf, self.starts, self.nulls)
        return self._items

    def __len__(self) -> int:
        return len(self.nulls)

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self) -> Iterator:
        return iter(self._list())

    def count(self, x) -> int:
        return self._list().count(x)


def header_lists(buf: Any, starts: Sequence[int], ends: Sequence[int]) -> list:
    """Header sections buf[starts[i]:ends[i]] in the store's encoding as Message.headers()
    gives them: a list of (name, bytes | None), or None for an empty section."""
    mv = memoryview(buf)
    return [list(decode_headers(mv[a:z])) if z > a else None for a, z in zip(starts, ends)]


def _last_of_each(partitions: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The partitions of a batch and where each one's last record is."""
    uniq, idx = np.unique(partitions[::-1], return_index=True)
    return uniq.tolist(), len(partitions) - 1 - idx


def next_offsets(partitions: np.ndarray, offsets: np.ndarray) -> dict[int, int]:
    """Per partition of a batch, the offset after its last record (offsets increase within a
    partition)."""
    if not len(offsets):
        return {}
    parts, last = _last_of_each(partitions)
    return dict(zip(parts, (offsets[last] + 1).tolist()))


def last_records(partitions: np.ndarray, offsets: np.ndarray, timestamps: np.ndarray
                 ) -> dict[int, tuple[int, int]]:
    """Per partition of a batch, (the offset after its last record, that record's timestamp)."""
    if not len(offsets):
        return {}
    parts, last = _last_of_each(partitions)
    return dict(zip(parts, zip((offsets[last] + 1).tolist(), timestamps[last].tolist())))


class PackedHeaders(Sequence):
    """A header column in the store's encoding (kcompact.reput.record.encode_headers) as a sequence of
    lists of (name, bytes | None), or None for a record without headers, as Message.headers()."""

    __slots__ = ("buf", "starts", "_items")

    def __init__(self, buf: Any, starts: Any):
        self.buf, self.starts = buf, starts
        self._items: list | None = None

    def _list(self) -> list:
        if self._items is None:
            st = np.frombuffer(self.starts, np.int64).tolist()
            self._items = header_lists(self.buf, st, st[1:])
        return self._items

    def __len__(self) -> int:
        return len(self.starts) // 8 - 1

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self) -> Iterator:
        return iter(self._list())


class Batch(NamedTuple):
    """One consume() as columns: ``topics`` has one name when every record is of it, else
    ``topic_index`` (int32 per record) indexes it. ``packed`` is (key bytes, key starts, key
    nulls, value bytes, value starts, value nulls); ``headers`` (bytes, starts) or None."""
    partitions: np.ndarray
    offsets: np.ndarray
    timestamps: np.ndarray
    topics: list
    topic_index: np.ndarray | None
    packed: tuple
    headers: tuple | None
    events: list

    def __len__(self) -> int:
        return len(self.offsets)

    def topic_column(self) -> list:
        if self.topic_index is None:
            return [self.topics[0]] * len(self) if self.topics else []
        names = self.topics
        return [names[i] for i in self.topic_index.tolist()]
