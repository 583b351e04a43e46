"""The one segment descriptor: what a partition's catalog says one of its segments is.

A local partition's segment list (docs/formats/segment-list.md) and an object store's partition
manifest (docs/formats/manifest.md) describe the same thing: a segment's base, record count,
first and last offsets, the sizes of its .log and .bcq, the .bcq's CRC32C and its store format.
The list adds the end of the segment's offset range (``next``) and may list the active segment
**open** (only its base: a writer is appending to it); the manifest adds the names of the
segment's two objects and a roaring bitmap of its offsets (``offsets``, relative to the base),
which answers offset questions without a download. ``SegmentDesc`` is both, with each file's
JSON form (``to_list_dict``/``from_list_dict``, ``to_manifest_dict``/``from_manifest_dict``:
byte-identical to what each format specifies) and the bounds each form must satisfy.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
from pyroaring import BitMap

from .bcq import ENTRY_SIZE
from .bcq2 import DIR_DTYPE
from .bcq2 import HEADER_SIZE as LEAN_HEADER_SIZE
from .errors import ReputError
from .record import HEADER_SIZE

#: offsets and positions are int64 / u32 on disk (record.md, bcq.md)
MAX_OFFSET = (1 << 63) - 1
MAX_SEGMENT_BYTES = (1 << 32) - 1
#: the smallest format-1 record: its header and a 1-byte topic (record.md)
MIN_RECORD = HEADER_SIZE + 1
#: a Kafka record batch's header (segment-v2.md): the least a format-2 .log holds
KB_HEADER_SIZE = 61
#: a lean index's header and one directory entry (bcq-v2.md): the least one holding records has
LEAN_DIR_ENTRY = DIR_DTYPE.itemsize
#: a 32-bit roaring bitmap holds offsets base .. base + 2^32 - 1
MAX_REL = (1 << 32) - 1
#: the store formats a segment may have (1: records + 48-byte entries; 2: Kafka batches + a
#: lean index, docs/formats/segment-v2.md)
FORMATS = (1, 2)


@dataclass(frozen=True)
class SegmentDesc:
    """One segment as its partition's catalog describes it (see the module docstring).

    A segment listed **open** (the active one while a writer appends, segment lists only) has
    only its base; every other field is None. ``next`` is the segment list's (None in a
    manifest); ``log``/``bcq`` (object names, relative to the partition's prefix) and
    ``offsets`` (the bitmap) are the manifest's (None in a segment list); ``bcq_crc32c`` may be
    None in a manifest written before segment lists existed."""

    base: int
    next: int | None = None           # end of its offset range (exclusive)
    records: int | None = None
    first_offset: int | None = None   # -1 when empty
    last_offset: int | None = None
    log_size: int | None = None
    bcq_size: int | None = None
    bcq_crc32c: int | None = None
    #: "format" is written only for 2
    format: int = 1
    log: str | None = None
    bcq: str | None = None
    offsets: BitMap | None = None
    #: a segment inside a compaction object (docs/formats/compaction-object.md): the object's
    #: path relative to the store and where its .log and .bcq bytes start in it
    object: str | None = None
    log_pos: int | None = None
    bcq_pos: int | None = None

    # -- what every catalog's entry answers ---------------------------------------------------

    @property
    def open(self) -> bool:
        return self.log_size is None

    @property
    def has_bitmap(self) -> bool:
        """A manifest's entry: its bitmap answers offset questions without a request."""
        return self.offsets is not None

    def listed(self) -> tuple[int, int, int] | None:
        """(records, first offset, last offset), None when the segment is listed open."""
        if self.open:
            return None
        return self.records, self.first_offset, self.last_offset

    def expected_bcq(self) -> tuple[int, int] | None:
        """(size, CRC32C) the segment's .bcq must have; None when nothing says."""
        if self.open or self.bcq_crc32c is None:
            return None
        return self.bcq_size, self.bcq_crc32c

    # -- the manifest's bitmap ---------------------------------------------------------------

    @classmethod
    def from_entries(cls, base: int, log: str, bcq: str, log_size: int,
                     offsets: np.ndarray, bcq_crc32c: int | None = None,
                     bcq_size: int | None = None, format: int = 1) -> "SegmentDesc":
        """The manifest entry of a segment whose .bcq holds records at ``offsets`` (sorted
        int64); ``bcq_size``: the .bcq's bytes when it is not 48 a record (a lean index)."""
        n = int(offsets.shape[0])
        rel = offsets.astype(np.int64) - base
        if n and (int(rel[0]) < 0 or int(rel[-1]) > MAX_REL):
            raise ReputError(f"segment {log}: offsets {int(offsets[0])}..{int(offsets[-1])} do "
                             f"not fit a 32-bit bitmap relative to base {base}")
        bm = BitMap(rel.astype(np.uint32)) if n else BitMap()
        return cls(base, None, n, int(offsets[0]) if n else -1, int(offsets[-1]) if n else -1,
                   int(log_size), n * ENTRY_SIZE if bcq_size is None else int(bcq_size),
                   bcq_crc32c, format, log, bcq, bm)

    def holds(self, offset: int) -> bool:
        rel = offset - self.base
        return 0 <= rel <= MAX_REL and rel in self.offsets

    def rank_below(self, offset: int) -> int:
        """How many of this segment's records have an offset < ``offset`` (= the index of the
        first entry >= offset in its .bcq)."""
        rel = offset - self.base
        if rel <= 0:
            return 0
        if rel > MAX_REL:
            return self.records
        return int(self.offsets.rank(rel - 1))

    def offset_at_or_after(self, offset: int) -> int | None:
        """The first offset >= ``offset`` this segment holds (None: none)."""
        if not self.records or offset > self.last_offset:
            return None
        if offset <= self.first_offset:
            return self.first_offset
        return self.base + int(self.offsets.next_set_bit(offset - self.base))

    def offset_array(self) -> np.ndarray:
        return np.asarray(self.offsets.to_array(), dtype=np.int64) + self.base

    # -- a segment list's entry (docs/formats/segment-list.md) --------------------------------

    def to_list_dict(self) -> dict:
        if self.open:
            return {"base": self.base, "open": True}
        d = {"base": self.base, "next": self.next, "records": self.records,
             "first_offset": self.first_offset, "last_offset": self.last_offset,
             "log_size": self.log_size, "bcq_size": self.bcq_size,
             "bcq_crc32c": f"{self.bcq_crc32c:08x}"}
        if self.format != 1:
            d["format"] = self.format
        return d

    @classmethod
    def from_list_dict(cls, d) -> "SegmentDesc":
        """Parse and validate one entry of a segment list (ValueError naming what is wrong)."""
        if not isinstance(d, dict):
            raise ValueError("not an object")
        base = field_int(d, "base", 0, MAX_OFFSET)
        if d.get("open") is True:
            return cls(base)
        m = cls(base, field_int(d, "next", 0, MAX_OFFSET),
                field_int(d, "records", 0, MAX_SEGMENT_BYTES // MIN_RECORD),
                field_int(d, "first_offset", -1, MAX_OFFSET),
                field_int(d, "last_offset", -1, MAX_OFFSET),
                field_int(d, "log_size", 0, MAX_SEGMENT_BYTES),
                field_int(d, "bcq_size", 0, MAX_OFFSET), _hex32(d, "bcq_crc32c"),
                field_int(d, "format", 1, 2) if "format" in d else 1)
        m.check_listed()
        return m

    def check_listed(self) -> None:
        """The bounds one closed segment-list entry must satisfy (ValueError naming the first).
        Format 1: 48 index bytes and at least one record header a record. Format 2 (Kafka
        batches, a lean index): its records are compressed, so only a lean index's header and
        directory entry and one batch header per segment holding records are bounds."""
        if self.format == 1:
            if self.bcq_size != self.records * ENTRY_SIZE:
                raise ValueError(f"segment {self.base}: bcq_size {self.bcq_size} is not "
                                 f"{ENTRY_SIZE} x {self.records} records")
            if self.log_size < self.records * MIN_RECORD:
                raise ValueError(f"segment {self.base}: log_size {self.log_size} is too small "
                                 f"for {self.records} records")
        elif self.records and (self.bcq_size < LEAN_HEADER_SIZE + LEAN_DIR_ENTRY
                               or self.log_size < KB_HEADER_SIZE):
            raise ValueError(f"segment {self.base}: a format-2 segment of {self.records} records "
                             f"with a {self.log_size}-byte .log and a {self.bcq_size}-byte lean "
                             "index")
        elif not self.records and self.bcq_size > LEAN_HEADER_SIZE:
            raise ValueError(f"segment {self.base}: empty, but its lean index holds "
                             f"{self.bcq_size} bytes")
        if self.records == 0:
            if (self.first_offset, self.last_offset) != (-1, -1) or self.log_size != 0:
                raise ValueError(f"segment {self.base}: empty, but lists offsets or bytes")
            if self.next < self.base:
                raise ValueError(f"segment {self.base}: its range ends at {self.next}, before "
                                 "its base")
            return
        if not self.base <= self.first_offset <= self.last_offset < self.next:
            raise ValueError(f"segment {self.base}: offsets {self.first_offset}.."
                             f"{self.last_offset} are not inside its range [{self.base}, "
                             f"{self.next})")
        if self.last_offset - self.first_offset < self.records - 1:
            raise ValueError(f"segment {self.base}: {self.records} records do not fit offsets "
                             f"{self.first_offset}..{self.last_offset}")

    # -- a manifest's entry (docs/formats/manifest.md) ----------------------------------------

    def to_manifest_dict(self) -> dict:
        d = {"base": self.base, "log": self.log, "bcq": self.bcq,
             "log_size": self.log_size, "bcq_size": self.bcq_size, "records": self.records,
             "first_offset": self.first_offset, "last_offset": self.last_offset,
             "offsets": base64.b64encode(self.offsets.serialize()).decode()}
        if self.bcq_crc32c is not None:
            d["bcq_crc32c"] = f"{self.bcq_crc32c:08x}"
        if self.format != 1:
            d["format"] = self.format
        if self.object is not None:
            d["object"], d["log_pos"], d["bcq_pos"] = self.object, self.log_pos, self.bcq_pos
        return d

    @classmethod
    def from_manifest_dict(cls, d) -> "SegmentDesc":
        """Parse and validate one manifest entry (ValueError naming what is wrong): object
        names of this base, sizes and offsets in range, the bitmap consistent with the counts."""
        if not isinstance(d, dict):
            raise ValueError("a segment entry is not an object")
        base = field_int(d, "base", 0, MAX_OFFSET)
        names = []
        for key in ("log", "bcq"):
            name = d[key]
            if not object_name(name, key):
                raise ValueError(f"segment {base}: {key} {name!r} is not a segment object name")
            names.append(name)
        log = names[0]
        raw = d["offsets"]
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"segment {log}: offsets is not a base64 bitmap")
        try:
            bm = BitMap.deserialize(base64.b64decode(raw, validate=True))
        except (ValueError, IndexError, MemoryError, OverflowError):
            raise ValueError(f"segment {log}: offsets is not a valid bitmap") from None
        records = field_int(d, "records", 0, MAX_REL + 1)
        log_size = field_int(d, "log_size", 0, MAX_OFFSET)
        bcq_size = field_int(d, "bcq_size", 0, MAX_OFFSET)
        first = field_int(d, "first_offset", -1, MAX_OFFSET)
        last = field_int(d, "last_offset", -1, MAX_OFFSET)
        fmt = field_int(d, "format", 1, 2**31) if "format" in d else 1
        if fmt not in FORMATS:
            raise ValueError(f"segment {log}: format {fmt} is unknown to this kcompact "
                             "(it reads formats 1 and 2); upgrade kcompact")
        crc = d.get("bcq_crc32c")
        if crc is not None:
            if not isinstance(crc, str) or len(crc) != 8:
                raise ValueError(f"segment {log}: bcq_crc32c is not 8 hex digits")
            crc = int(crc, 16)
        if len(bm) != records:
            raise ValueError(f"segment {log}: bitmap holds {len(bm)} offsets, records says "
                             f"{records}")
        if fmt == 1 and bcq_size != ENTRY_SIZE * records:
            raise ValueError(f"segment {log}: bcq_size {bcq_size} is not 48 x {records}")
        want = (base + bm.min(), base + bm.max()) if records else (-1, -1)
        if (first, last) != want:
            raise ValueError(f"segment {log}: first/last offsets {first}..{last} are not its "
                             f"bitmap's {want[0]}..{want[1]}")
        if last > MAX_OFFSET:
            raise ValueError(f"segment {log}: offsets beyond 2^63")
        obj = log_pos = bcq_pos = None
        if "object" in d:  # (a shared part has log_pos/bcq_pos but no object: shared.py)
            from .filenames import parse_compaction_object
            obj = d["object"]
            if not isinstance(obj, str) or parse_compaction_object(obj) is None:
                raise ValueError(f"segment {log}: object {obj!r} is not a compaction object")
            log_pos = field_int(d, "log_pos", 0, MAX_OFFSET)
            bcq_pos = field_int(d, "bcq_pos", 0, MAX_OFFSET)
            if fmt != 2 or bcq_pos != log_pos + log_size:
                raise ValueError(f"segment {log}: inside {obj}, but not a format-2 segment "
                                 f"whose index follows its .log ({log_pos}+{log_size} != "
                                 f"{bcq_pos})")
        return cls(base, None, records, first, last, log_size, bcq_size, crc, fmt, log,
                   names[1], bm, obj, log_pos, bcq_pos)


def field_int(d: dict, key: str, lo: int, hi: int) -> int:
    """``d[key]``, an integer (never a boolean) in [lo, hi]; ValueError naming it otherwise
    (the bounds check of every JSON metadata file: segment lists, manifests)."""
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key} is not an integer")
    if not lo <= v <= hi:
        raise ValueError(f"{key} {v} is outside [{lo}, {hi}]")
    return v


def _hex32(d: dict, key: str) -> int:
    v = d[key]
    if not isinstance(v, str) or len(v) != 8:
        raise ValueError(f"{key} is not 8 hex digits")
    return int(v, 16)


def object_name(name, suffix: str) -> bool:
    """A segment object's name as a manifest may hold it: a plain file name in the partition
    (no path: a damaged manifest must not name an object elsewhere) ending in .log or .bcq."""
    return (isinstance(name, str) and name.endswith("." + suffix) and len(name) > 4
            and "/" not in name and "\\" not in name and name not in (".", "..")
            and not name.startswith("."))


__all__ = ["FORMATS", "MAX_OFFSET", "MAX_SEGMENT_BYTES", "SegmentDesc", "field_int",
           "object_name"]
