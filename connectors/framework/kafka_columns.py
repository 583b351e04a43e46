"""Consumed batches as columns, without a Message object per record (framework/_rdkafka.c).

confluent_kafka's ``consume()`` builds one Message object per record with the GIL held. For a
sink that stores bytes (the mirror), that is most of the task thread's GIL time, and the store's
append thread, which runs beside it, waits for the GIL. :class:`ColumnReader` makes the same
librdkafka call on the same consumer with the GIL released and returns the batch as packed
columns. It attaches only to a Consumer whose C layout it recognises (see the C file); otherwise
:meth:`ColumnReader.attach` returns None and the caller keeps ``consume()``.
``KCOMPACT_KAFKA_COLUMNS=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from kcompact.reput.record import decode_headers

_BOUND: Any = None  # the module once bound to the loaded librdkafka; False when unavailable


def _module() -> Any:
    """The C extension (_rdkafka) bound to the librdkafka confluent_kafka loaded, or None."""
    global _BOUND
    if os.environ.get("KCOMPACT_KAFKA_COLUMNS", "1") == "0":
        return None
    if _BOUND is None:
        _BOUND = False
        try:
            from confluent_kafka import cimpl  # noqa: F401 - loads librdkafka
            from . import _rdkafka
            path = _loaded_librdkafka()
            if path is not None:
                _rdkafka.bind(path)
                _BOUND = _rdkafka
        except (ImportError, OSError):
            pass
    return _BOUND or None


def _loaded_librdkafka() -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if "librdkafka" in os.path.basename(path) and ".so" in path:
                    return path
    except OSError:
        return None
    return None


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
        return (_BOUND or _module()).unpack(buf, starts, nulls)

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


def next_offsets(partitions: np.ndarray, offsets: np.ndarray) -> dict[int, int]:
    """Per partition of a batch, the offset after its last record (offsets increase within a
    partition)."""
    n = len(offsets)
    if not n:
        return {}
    uniq, idx = np.unique(partitions[::-1], return_index=True)
    return {p: int(offsets[n - 1 - i]) + 1 for p, i in zip(uniq.tolist(), idx.tolist())}


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


class ColumnReader:
    """Reads a confluent_kafka Consumer's batches as :class:`Batch` columns. Call
    :meth:`close` before the consumer's own close()."""

    def __init__(self, mod: Any, handle: Any):
        self._mod, self._handle = mod, handle

    @classmethod
    def attach(cls, consumer: Any, error_cb: Any, logger: Any) -> "ColumnReader | None":
        """A reader for ``consumer``, which was configured with exactly these ``error_cb`` and
        ``logger`` objects (the layout check compares them); None when the native module is not
        built, is turned off, or does not recognise this confluent_kafka."""
        mod = _module()
        if mod is None:
            return None
        handle = mod.attach(consumer, error_cb, logger)
        return None if handle is None else cls(mod, handle)

    def consume(self, num_messages: int, timeout: float) -> Batch:
        if self._handle is None:
            raise RuntimeError("the column reader is closed")
        (parts, offs, ts, names, tindex, kb, ko, kn, vb, vo, vn, hb, ho,
         events) = self._mod.consume(self._handle, num_messages, max(0, int(timeout * 1000)))
        return Batch(np.frombuffer(parts, np.int32), np.frombuffer(offs, np.int64),
                     np.frombuffer(ts, np.int64), names,
                     None if tindex is None else np.frombuffer(tindex, np.int32),
                     (kb, ko, kn, vb, vo, vn), None if hb is None else (hb, ho),
                     [Event(*e) for e in events])

    def close(self) -> None:
        if self._handle is not None:
            self._mod.detach(self._handle)
            self._handle = None


class ColumnSender:
    """Produces columns of records through a confluent_kafka Producer's librdkafka handle,
    without a Python object per record (connectors/framework/_rdkafka.c produce).

    Delivery reports: with ``on_delivery`` each record carries confluent_kafka's own per-message
    state, so its report reaches that callable as for ``produce(..., on_delivery=...)`` (under
    ``delivery.report.only.error`` only failures call it). Without, no report reaches Python:
    only inside a transaction, whose commit fails when any record failed delivery (librdkafka
    counts failed deliveries whatever the application's callbacks)."""

    def __init__(self, mod: Any, handle: Any):
        self._mod, self._handle = mod, handle

    @classmethod
    def attach(cls, producer: Any, error_cb: Any, logger: Any) -> "ColumnSender | None":
        """A sender for ``producer``, configured with exactly these ``error_cb`` and ``logger``
        objects; None when the native module is not built, is turned off, or does not
        recognise this confluent_kafka."""
        mod = _module()
        if mod is None:
            return None
        handle = mod.producer_attach(producer, error_cb, logger)
        return None if handle is None else cls(mod, handle)

    def produce(self, topic: str, partition: int, partitions: np.ndarray | None,
                keys: tuple, values: tuple, timestamps: np.ndarray,
                on_delivery: Any = None, headers: tuple | None = None) -> None:
        """Every record: ``keys``/``values`` are (buffer, starts, ends, nulls) with int64 starts
        and ends and uint8 nulls; ``partitions`` int32 per record, or None for ``partition``;
        ``headers`` None or (buffer, starts, ends) of each record's header section in the
        store's encoding (kcompact.reput.record.encode_headers; empty for none).
        Raises KafkaException for an error other than a full queue (which it waits out)."""
        done, code, reason = self._mod.produce(self._handle, topic, partition, partitions,
                                               *keys, *values, timestamps, on_delivery,
                                               headers)
        if code:
            from confluent_kafka import KafkaError, KafkaException
            raise KafkaException(KafkaError(code, f"{reason} (after {done} of "
                                                  f"{len(timestamps)} records)"))

    def close(self) -> None:
        self._handle = None
