"""What a read returns: a block of a partition's records as columns (``RecordColumns``).

The partition reader (reput/reader.py) fills it; every record in it passed the reader's check.
The index's fields (offset, timestamp, flags, key digest, clean time) are numpy columns; keys,
values and encoded header sections are ``BytesColumn``s gathered on first use from where the
fields lie in the bytes read (``key_spans`` etc. give them without a copy). Nothing here says
how records are laid out on disk: ``stored_records`` is for the storage layer's own writers,
which copy records byte for byte.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np

from . import bcq as B
from .record import (ATTR_NULL_KEY, ATTR_NULL_VALUE, BytesColumn, Record, decode_headers,
                     decode_one, field_spans, gather)

_EMPTY_ENTRIES = np.zeros(0, dtype=B.BCQ_DTYPE)
_EMPTY_BUF = np.zeros(0, np.uint8)


class Spans(NamedTuple):
    """A field of a block's records where it lies, no copy: ``buf[starts[i]:+lengths[i]]``,
    or None where ``null[i]``."""

    buf: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    null: np.ndarray


class RecordColumns:
    """A block of records of one partition, in offset order, every one verified.

    ``offsets``, ``timestamps``, ``flags`` (bcq.FLAG_TOMBSTONE | bcq.FLAG_KEYLESS), ``digest_lo``/
    ``digest_hi`` (the store's keyed key digest) and ``clean_time`` are numpy columns;
    ``keys``, ``values`` and ``headers`` are ``BytesColumn``s gathered on first use (headers as
    their encoded sections: ``header_lists`` decodes them); ``key_spans`` etc. give the same
    fields where they lie, without a copy. ``next_offset`` is where the next read of the
    partition starts. A block from a streamed selection lives in a reused buffer: it is valid
    until the next block of that stream.
    """

    __slots__ = ("topic", "partition", "next_offset", "_data", "_entries", "_rel", "_cache")

    def __init__(self, topic: str, partition: int, data: np.ndarray, entries: np.ndarray,
                 rel: np.ndarray, next_offset: int):
        self.topic, self.partition, self.next_offset = topic, partition, int(next_offset)
        self._data = data          # the bytes the records lie in
        self._entries = entries    # their index entries (positions: in the .log)
        self._rel = rel            # int64: where each record starts in _data
        self._cache: dict = {}

    @classmethod
    def empty(cls, topic: str, partition: int, next_offset: int) -> "RecordColumns":
        return cls(topic, partition, _EMPTY_BUF, _EMPTY_ENTRIES, np.zeros(0, np.int64),
                   next_offset)

    def __len__(self) -> int:
        return self._entries.shape[0]

    def __repr__(self) -> str:
        first = int(self.offsets[0]) if len(self) else None
        return (f"RecordColumns({self.topic}-{self.partition}, {len(self)} records from offset "
                f"{first}, next {self.next_offset})")

    # -- the index's columns ---------------------------------------------------------------

    @property
    def offsets(self) -> np.ndarray:
        return self._entries["offset"]

    @property
    def timestamps(self) -> np.ndarray:
        return self._entries["timestamp"]

    @property
    def flags(self) -> np.ndarray:
        return self._entries["flags"]

    @property
    def digest_lo(self) -> np.ndarray:
        return self._entries["digest_lo"]

    @property
    def digest_hi(self) -> np.ndarray:
        return self._entries["digest_hi"]

    @property
    def clean_time(self) -> np.ndarray:
        return self._entries["clean_time"]

    @property
    def tombstones(self) -> np.ndarray:
        """True where the value is null."""
        return (self.flags & B.FLAG_TOMBSTONE) != 0

    @property
    def keyless(self) -> np.ndarray:
        """True where the key is null."""
        return (self.flags & B.FLAG_KEYLESS) != 0

    @property
    def nbytes(self) -> int:
        """The bytes these records take in the store."""
        return int(self._entries["size"].sum(dtype=np.int64))

    # -- the records' fields ---------------------------------------------------------------

    def _spans(self):
        sp = self._cache.get("spans")
        if sp is None:
            sp = self._cache["spans"] = field_spans(self._data, self._rel)
        return sp

    def key_spans(self) -> Spans:
        sp = self._spans()
        return Spans(self._data, sp.kstart, sp.klen, (sp.attrs & ATTR_NULL_KEY) != 0)

    def value_spans(self) -> Spans:
        sp = self._spans()
        return Spans(self._data, sp.vstart, sp.vlen, (sp.attrs & ATTR_NULL_VALUE) != 0)

    def header_spans(self) -> Spans:
        sp = self._spans()
        return Spans(self._data, sp.hstart, sp.hlen, np.zeros(len(self), np.bool_))

    def _column(self, name: str, spans: Spans) -> BytesColumn:
        col = self._cache.get(name)
        if col is None:
            lens = np.where(spans.null, 0, spans.lengths)
            offs = np.zeros(lens.shape[0] + 1, np.int64)
            np.cumsum(lens, out=offs[1:])
            col = self._cache[name] = BytesColumn(gather(spans.buf, spans.starts, lens), offs,
                                                  spans.null)
        return col

    @property
    def keys(self) -> BytesColumn:
        return self._column("keys", self.key_spans())

    @property
    def values(self) -> BytesColumn:
        return self._column("values", self.value_spans())

    @property
    def headers(self) -> BytesColumn:
        """Each record's encoded header section (empty: no headers; record.md)."""
        return self._column("headers", self.header_spans())

    def header_lists(self) -> list[tuple[tuple[str, bytes | None], ...]]:
        """Each record's headers, decoded."""
        h = self.headers
        if not h.buf.shape[0]:
            return [()] * len(self)
        return [decode_headers(b) if b else () for b in h.to_list()]

    def records(self) -> Iterator[Record]:
        """``Record`` objects, one at a time (dump, restore's progress, tests)."""
        for p in self._rel.tolist():
            yield decode_one(self._data, p, verify_crc=False, where=self.topic)

    # -- sub-blocks ------------------------------------------------------------------------

    def take(self, which) -> "RecordColumns":
        """The records at ``which`` (a boolean mask or indices), in that order (no copy of the
        record bytes)."""
        return RecordColumns(self.topic, self.partition, self._data, self._entries[which],
                             self._rel[which], self.next_offset)

    def head(self, k: int) -> "RecordColumns":
        """The first ``k`` records; the next read starts after the last of them."""
        if k >= len(self):
            return self
        return RecordColumns(self.topic, self.partition, self._data, self._entries[:k],
                             self._rel[:k], int(self._entries[k - 1]["offset"]) + 1)

    @classmethod
    def concat(cls, blocks: list["RecordColumns"]) -> "RecordColumns":
        """The records of several blocks of one partition, one after the other."""
        blocks = [b for b in blocks if len(b)]
        if len(blocks) == 1:
            return blocks[0]
        if not blocks:
            raise ValueError("concat of no records")
        data = np.concatenate([b._data for b in blocks])
        shift = np.cumsum([0] + [b._data.shape[0] for b in blocks[:-1]])
        rel = np.concatenate([b._rel + int(d) for b, d in zip(blocks, shift)])
        return cls(blocks[0].topic, blocks[0].partition, data,
                   np.concatenate([b._entries for b in blocks]), rel,
                   max(b.next_offset for b in blocks))


def stored_records(block: RecordColumns) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data, positions in data, sizes, index entries) of a block's records as stored: for the
    storage layer's own writers, which copy records byte for byte (``SegmentWriter``,
    ``PartitionLog.append_block``)."""
    return (block._data, block._rel, block._entries["size"].astype(np.int64), block._entries)


class KeyValues:
    """The keys and values of a block of records where they lie (no copy), with their offsets:
    what ``PartitionReader.read_fields`` hands a reader that needs nothing else (the KV map's
    build). Every record was checked as ``RecordColumns``' are. ``next_offset``: where the next
    read starts."""

    __slots__ = ("offsets", "keys", "values", "next_offset")

    def __init__(self, offsets: np.ndarray, keys: Spans, values: Spans, next_offset: int):
        self.offsets, self.keys, self.values = offsets, keys, values
        self.next_offset = next_offset

    @classmethod
    def of(cls, block: RecordColumns) -> "KeyValues":
        return cls(block.offsets, block.key_spans(), block.value_spans(), block.next_offset)

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def __repr__(self) -> str:
        return f"KeyValues({len(self)} records, next {self.next_offset})"

    def key_spans(self) -> Spans:
        return self.keys

    def value_spans(self) -> Spans:
        return self.values

    def take(self, which) -> "KeyValues":
        """The records at ``which`` (a boolean mask or indices), in that order."""
        k, v = self.keys, self.values
        return KeyValues(self.offsets[which],
                         Spans(k.buf, k.starts[which], k.lengths[which], k.null[which]),
                         Spans(v.buf, v.starts[which], v.lengths[which], v.null[which]),
                         self.next_offset)
