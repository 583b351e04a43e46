"""The segment list of a local partition: ``partitions/<t>/<p>/segments.json`` (version 1).

Spec: docs/formats/segment-list.md. Offset gaps are normal (compaction drops records and whole
segment groups; rolls land on source gaps), so a reader cannot tell a deleted segment from a
dropped one by offsets alone: the list says which segments the partition holds. It is the local
twin of the S3 manifest (docs/formats/manifest.md): per segment its base, the end of its offset
range (``next``), record count, first and last offsets, the sizes of its .log and .bcq and a
CRC32C of its .bcq; and a CRC32C of the list itself. It is replaced whole (write-temp, fsync,
rename, directory fsync) in the same step as each roll, compaction swap (reput/swap.py),
retention delete and replica install.

The last segment is the active one. A writer appending to it marks it **open** (only its base
is listed: its files grow); when the writer closes the partition it lists the segment's sizes
and checksum again, so a store at rest is described exactly, its active segment included.
Readers refuse a partition whose files disagree with the list (PartitionLog), ``kcompact
verify`` reports every disagreement (reput/verify.py), the compactor checks each .bcq it acts
on against its checksum before it changes anything (compaction/compactor.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

from . import bcq as B
from . import bcq2 as B2
from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError
from .jit import native
from .record import HEADER_SIZE

FORMAT_VERSION = 1
NAME = fn.SEGMENT_LIST
#: a Kafka record batch's header (docs/formats/segment-v2.md): the least a format-2 .log holds
KB_HEADER_SIZE = 61
#: offsets and positions are int64 / u32 on disk (record.md, bcq.md)
MAX_OFFSET = (1 << 63) - 1
MAX_SEGMENT_BYTES = (1 << 32) - 1
#: the smallest record: its header and a 1-byte topic
MIN_RECORD = HEADER_SIZE + 1

_N = native()


def crc32c(data, crc: int = 0) -> int:
    """CRC32C of ``data`` (bytes or a contiguous array) continuing from ``crc``."""
    return _N.crc32c(data, crc)


def stream_crc32c(f, size_hint: int, block: int = 1 << 20) -> tuple[int, int]:
    """(bytes, CRC32C) of what is left to read in the stream ``f`` (``readinto``), read
    through one reused buffer of up to ``block`` bytes (``size_hint``: the size expected, to
    size it): a large index read whole costs a fresh allocation, a page fault every 4 KiB. A
    stream's read errors surface as OSError."""
    n, crc = 0, 0
    buf = memoryview(bytearray(max(1, min(block, size_hint))))
    while True:
        k = f.readinto(buf)
        if not k:
            return n, crc
        crc = crc32c(buf[:k], crc)
        n += k


@dataclass(frozen=True)
class SegmentMeta:
    """One segment as the list describes it. An open segment (the active one while a writer
    appends) has only its base; every other field is None."""

    base: int
    next: int | None = None           # end of its offset range (exclusive)
    records: int | None = None
    first_offset: int | None = None   # -1 when empty
    last_offset: int | None = None
    log_size: int | None = None
    bcq_size: int | None = None
    bcq_crc32c: int | None = None
    #: the segment's store format (1: records + 48-byte entries; 2: Kafka batches + a lean
    #: index, docs/formats/segment-v2.md); "format" is written only for 2
    format: int = 1

    @property
    def open(self) -> bool:
        return self.log_size is None

    def to_dict(self) -> dict:
        if self.open:
            return {"base": self.base, "open": True}
        d = {"base": self.base, "next": self.next, "records": self.records,
             "first_offset": self.first_offset, "last_offset": self.last_offset,
             "log_size": self.log_size, "bcq_size": self.bcq_size,
             "bcq_crc32c": f"{self.bcq_crc32c:08x}"}
        if self.format != 1:
            d["format"] = self.format
        return d


@dataclass
class SegmentList:
    """The list (docs/formats/segment-list.md): ``segments`` sorted by base, the last one the
    active segment; ``version`` counts the writes; ``next_offset`` is the partition's log end
    offset when it was written."""

    segments: list[SegmentMeta] = field(default_factory=list)
    next_offset: int = 0
    version: int = 0

    def by_base(self) -> dict[int, SegmentMeta]:
        return {s.base: s for s in self.segments}

    @property
    def open(self) -> bool:
        """Whether a writer has the active segment open (its sizes are not listed)."""
        return bool(self.segments) and self.segments[-1].open

    def body(self) -> dict:
        return {"format_version": FORMAT_VERSION, "version": self.version,
                "next_offset": self.next_offset,
                "segments": [s.to_dict() for s in self.segments]}

    def to_json(self) -> bytes:
        body = self.body()
        body["crc32c"] = f"{crc32c(canonical(body)):08x}"
        return json.dumps(body, sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "SegmentList":
        """Parse and validate (checksum, schema, bounds); CorruptRecordError naming ``where``
        and what is wrong otherwise."""
        try:
            doc = json.loads(raw)
        except RecursionError:
            raise _bad(where, "nested too deeply to be a segment list") from None
        except ValueError as e:
            raise _bad(where, f"not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise _bad(where, "not a JSON object")
        fv = doc.get("format_version")
        if isinstance(fv, int) and not isinstance(fv, bool) and fv > FORMAT_VERSION:
            raise CorruptRecordError(f"{where}: segment list format version {fv} is newer than "
                                     f"this kcompact understands ({FORMAT_VERSION}); upgrade "
                                     "kcompact", where, 0)
        crc = doc.pop("crc32c", None)
        try:
            want = f"{crc32c(canonical(doc)):08x}"
        except (RecursionError, ValueError, TypeError):
            raise _bad(where, "its fields cannot be checked") from None
        if crc != want:
            raise _bad(where, f"checksum mismatch (crc32c {crc!r}, contents {want})")
        try:
            return cls._validated(doc)
        except (ValueError, TypeError, KeyError) as e:
            raise _bad(where, str(e) or type(e).__name__) from None

    @classmethod
    def _validated(cls, doc: dict) -> "SegmentList":
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unknown format_version {doc.get('format_version')!r}")
        version = field_int(doc, "version", 0, MAX_OFFSET)
        nxt = field_int(doc, "next_offset", 0, MAX_OFFSET)
        raw = doc["segments"]
        if not isinstance(raw, list):
            raise ValueError("segments is not a list")
        segs: list[SegmentMeta] = []
        for i, d in enumerate(raw):
            if not isinstance(d, dict):
                raise ValueError(f"segment {i} is not an object")
            base = field_int(d, "base", 0, MAX_OFFSET)
            if d.get("open") is True:
                segs.append(SegmentMeta(base))
                continue
            if segs and segs[-1].open:
                raise ValueError(f"segment {base} is closed after an open one (only the last "
                                 "segments may be open)")
            m = SegmentMeta(base, field_int(d, "next", 0, MAX_OFFSET),
                            field_int(d, "records", 0, MAX_SEGMENT_BYTES // MIN_RECORD),
                            field_int(d, "first_offset", -1, MAX_OFFSET),
                            field_int(d, "last_offset", -1, MAX_OFFSET),
                            field_int(d, "log_size", 0, MAX_SEGMENT_BYTES),
                            field_int(d, "bcq_size", 0, MAX_OFFSET), _hex32(d, "bcq_crc32c"),
                            field_int(d, "format", 1, 2) if "format" in d else 1)
            check_meta(m)
            segs.append(m)
        for a, b in zip(segs, segs[1:]):
            if b.base <= a.base:
                raise ValueError(f"segment {b.base} is not after segment {a.base}")
            if a.next is not None and a.next > b.base:
                raise ValueError(f"segment {a.base}'s range ends at {a.next}, past the next "
                                 f"segment's base {b.base}")
        if segs and nxt < max(segs[-1].base, segs[-1].next or 0):
            raise ValueError(f"next_offset {nxt} is below the last segment's range")
        return cls(segs, nxt, version)


def check_meta(m: SegmentMeta) -> None:
    """The bounds one closed segment's fields must satisfy (ValueError naming the first).
    Format 1: 48 index bytes and at least one record header a record. Format 2 (Kafka batches,
    a lean index): its records are compressed, so only a lean index's header and directory
    entry and one batch header per segment holding records are bounds."""
    if m.format == 1:
        if m.bcq_size != m.records * B.ENTRY_SIZE:
            raise ValueError(f"segment {m.base}: bcq_size {m.bcq_size} is not {B.ENTRY_SIZE} x "
                             f"{m.records} records")
        if m.log_size < m.records * MIN_RECORD:
            raise ValueError(f"segment {m.base}: log_size {m.log_size} is too small for "
                             f"{m.records} records")
    elif m.records and (m.bcq_size < B2.HEADER_SIZE + B2.DIR_DTYPE.itemsize
                        or m.log_size < KB_HEADER_SIZE):
        raise ValueError(f"segment {m.base}: a format-2 segment of {m.records} records with a "
                         f"{m.log_size}-byte .log and a {m.bcq_size}-byte lean index")
    elif not m.records and m.bcq_size > B2.HEADER_SIZE:
        raise ValueError(f"segment {m.base}: empty, but its lean index holds {m.bcq_size} bytes")
    if m.records == 0:
        if (m.first_offset, m.last_offset) != (-1, -1) or m.log_size != 0:
            raise ValueError(f"segment {m.base}: empty, but lists offsets or bytes")
        if m.next < m.base:
            raise ValueError(f"segment {m.base}: its range ends at {m.next}, before its base")
        return
    if not m.base <= m.first_offset <= m.last_offset < m.next:
        raise ValueError(f"segment {m.base}: offsets {m.first_offset}..{m.last_offset} are not "
                         f"inside its range [{m.base}, {m.next})")
    if m.last_offset - m.first_offset < m.records - 1:
        raise ValueError(f"segment {m.base}: {m.records} records do not fit offsets "
                         f"{m.first_offset}..{m.last_offset}")


def canonical(body: dict) -> bytes:
    """The bytes a JSON metadata file's ``crc32c`` covers: its other fields, sorted keys, no
    spaces (segments.json, store.json, compaction.checkpoint)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


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


def _bad(where: str, what: str) -> CorruptRecordError:
    return CorruptRecordError(f"{where}: damaged segment list: {what}; run `kcompact verify` "
                              "and rebuild this partition from a replica", where, 0)


# ---------------------------------------------------------------------------------------------
# reading and writing


def path(pdir: str) -> str:
    return f"{pdir}/{NAME}"


def read(fs: Backend, pdir: str) -> SegmentList | None:
    """The partition's list, None when it has none (a store written before lists existed)."""
    p = path(pdir)
    try:
        raw = fs.read(p)
    except FileNotFoundError:
        return None
    return SegmentList.from_json(raw, p)


def write(fs: Backend, pdir: str, lst: SegmentList) -> SegmentList:
    """Replace the list (write-temp, fsync, rename, directory fsync); returns what was written
    (its version one higher)."""
    new = replace(lst, version=lst.version + 1)
    fs.write_atomic(path(pdir), new.to_json())
    return new


def _size_of_part(fs: Backend, path: str) -> int:
    """The size of a segment's .log or .bcq; a missing one is a CorruptRecordError naming it."""
    try:
        return fs.size(path)
    except FileNotFoundError:
        raise CorruptRecordError(f"{path}: missing (its segment has the other file of the "
                                 "pair); run `kcompact verify` and rebuild this partition from "
                                 "a replica", path, 0) from None


def describe(fs: Backend, log_path: str, bcq_path: str, base: int, nxt: int | None,
             chunk_entries: int = 1 << 16) -> SegmentMeta:
    """A closed segment's entry computed from its files (reading its .bcq once): records,
    first and last offsets, sizes, the .bcq's CRC32C. ``nxt`` None: the last offset + 1."""
    log_size, bcq_size = _size_of_part(fs, log_path), _size_of_part(fs, bcq_path)
    if bcq_size >= 8 and B2.is_lean(fs.read(bcq_path, 0, 8)):
        return _describe_lean(fs, bcq_path, base, nxt, log_size, bcq_size)
    if bcq_size % B.ENTRY_SIZE:
        raise CorruptRecordError(f"{bcq_path}: {bcq_size} bytes is not a whole number of "
                                 f"{B.ENTRY_SIZE}-byte entries", bcq_path,
                                 bcq_size - bcq_size % B.ENTRY_SIZE)
    crc, n, first, last = 0, bcq_size // B.ENTRY_SIZE, -1, -1
    if bcq_size:
        with fs.open_read(bcq_path) as f:
            buf = np.empty(chunk_entries * B.ENTRY_SIZE, np.uint8)
            done = 0
            while done < bcq_size:
                want = min(buf.shape[0], bcq_size - done)
                mv = memoryview(buf)[:want]
                got = 0
                while got < want:
                    k = f.readinto(mv[got:])
                    if not k:
                        break
                    got += k
                if got != want:
                    raise CorruptRecordError(f"{bcq_path}: shorter than its size while read",
                                             bcq_path, done + got)
                crc = crc32c(buf[:want], crc)
                e = buf[:want - want % B.ENTRY_SIZE].view(B.BCQ_DTYPE)
                if e.shape[0]:
                    if first < 0 and done == 0:
                        first = int(e[0]["offset"])
                    last = int(e[-1]["offset"])
                done += want
    return SegmentMeta(base, max(last + 1, base) if nxt is None else nxt, n, first, last,
                       log_size, bcq_size, crc)


def _describe_lean(fs: Backend, bcq_path: str, base: int, nxt: int | None, log_size: int,
                   bcq_size: int) -> SegmentMeta:
    """``describe`` of a format-2 segment: its lean index's header and directory read and
    checked (the directory gives the records and the first and last offsets), and the whole
    file streamed once through a reused buffer for its CRC32C (read whole, a large index cost
    a fresh allocation, a page fault every 4 KiB, each time a swap described it)."""
    idx = B2.LeanIndex(lambda start, length: fs.read(bcq_path, start, length), bcq_path,
                       bcq_size)
    with fs.open_read(bcq_path) as f:
        done, crc = stream_crc32c(f, bcq_size)
    if done != bcq_size:
        raise CorruptRecordError(f"{bcq_path}: shorter than its size while read", bcq_path,
                                 done)
    if idx.log_size != log_size:
        raise CorruptRecordError(f"{bcq_path}: the lean index describes a .log of "
                                 f"{idx.log_size} bytes, the .log holds {log_size}", bcq_path, 0)
    first = int(idx.dir["first_offset"][0]) if idx.chunk_count else -1
    last = int(idx.dir["last_offset"][-1]) if idx.chunk_count else -1
    return SegmentMeta(base, max(last + 1, base) if nxt is None else nxt, idx.n, first, last,
                       log_size, bcq_size, crc, 2)


__all__ = ["FORMAT_VERSION", "SegmentList", "SegmentMeta", "canonical", "check_meta",
           "crc32c", "describe", "field_int", "path", "read", "stream_crc32c", "write"]
