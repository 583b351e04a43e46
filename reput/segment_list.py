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

from . import filenames as fn
from . import ledger
from .backend import Backend
from .errors import CorruptRecordError
from .jit import native
from .segment_desc import MAX_OFFSET, SegmentDesc, field_int

FORMAT_VERSION = 1
NAME = fn.SEGMENT_LIST

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


@dataclass
class SegmentList:
    """The list (docs/formats/segment-list.md): ``segments`` sorted by base, the last one the
    active segment; ``version`` counts the writes; ``next_offset`` is the partition's log end
    offset when it was written."""

    segments: list[SegmentDesc] = field(default_factory=list)
    next_offset: int = 0
    version: int = 0

    def by_base(self) -> dict[int, SegmentDesc]:
        return {s.base: s for s in self.segments}

    @property
    def open(self) -> bool:
        """Whether a writer has the active segment open (its sizes are not listed)."""
        return bool(self.segments) and self.segments[-1].open

    def body(self) -> dict:
        return {"format_version": FORMAT_VERSION, "version": self.version,
                "next_offset": self.next_offset,
                "segments": [s.to_list_dict() for s in self.segments]}

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
        segs: list[SegmentDesc] = []
        for i, d in enumerate(raw):
            if not isinstance(d, dict):
                raise ValueError(f"segment {i} is not an object")
            if d.get("open") is not True and segs and segs[-1].open:
                raise ValueError(f"segment {field_int(d, 'base', 0, MAX_OFFSET)} is closed "
                                 "after an open one (only the last segments may be open)")
            segs.append(SegmentDesc.from_list_dict(d))
        for a, b in zip(segs, segs[1:]):
            if b.base <= a.base:
                raise ValueError(f"segment {b.base} is not after segment {a.base}")
            if a.next is not None and a.next > b.base:
                raise ValueError(f"segment {a.base}'s range ends at {a.next}, past the next "
                                 f"segment's base {b.base}")
        if segs and nxt < max(segs[-1].base, segs[-1].next or 0):
            raise ValueError(f"next_offset {nxt} is below the last segment's range")
        return cls(segs, nxt, version)


def canonical(body: dict) -> bytes:
    """The bytes a JSON metadata file's ``crc32c`` covers: its other fields, sorted keys, no
    spaces (segments.json, store.json, compaction.checkpoint)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


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
    """Replace the list (write-temp, fsync, rename, directory fsync), then the partition's
    ledger (reput/ledger.py); returns what was written (its version one higher)."""
    new = replace(lst, version=lst.version + 1)
    fs.write_atomic(path(pdir), new.to_json())
    # the partition's second record of it, after it (docs/formats/ledger.md)
    ledger.write(fs, pdir, NAME, new.version, new.segments, new.next_offset)
    return new


__all__ = ["FORMAT_VERSION", "SegmentList", "canonical", "crc32c", "path", "read",
           "stream_crc32c", "write"]
