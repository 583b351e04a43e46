"""The partition ledger: a second, independent record of what a partition holds.

Spec: docs/formats/ledger.md. ``partitions/<t>/<p>/ledger.json`` (on S3 a key beside the
manifest) copies, after every write of the partition's catalog (its segment list,
reput/segment_list.py, or a manifest version, reput/manifest.py), the version written, the
partition's first and next offsets, its live records, and each segment's range, record count,
sizes and digest (the CRC32C of its .bcq, which holds every record's offset, position, size and
128-bit key digest). Kafka keeps ``log-start-offset-checkpoint`` beside its segments for the
same reason: the segment list alone cannot tell a segment deleted together with the list from
one never written.

Checked whenever a partition's catalog is (re)read (``check``): the catalog at the version the
ledger records must say exactly what the ledger says; an older catalog than the ledger's (a list
or manifest put back from a copy, a lost newest manifest version), or no catalog at all while
the ledger says the partition holds records, is damage. A catalog newer than the ledger (a crash
between the two writes, or a catalog written by a kcompact before ledgers) is not checked until
the next catalog write brings the ledger up to it; a partition with no ledger (a store written
before ledgers) is not checked. Like the segment list, the ledger is small and written whole
(``Backend.write_atomic``), after the catalog: a crash between the two leaves the ledger one
version behind, never ahead.
"""

from __future__ import annotations

import json

from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError
from .jit import native
from .segment_desc import SegmentDesc

FORMAT_VERSION = 1
NAME = "ledger.json"


class LedgerMismatchError(CorruptRecordError):
    """A partition's catalog (segment list or manifest) disagrees with its ledger, or is gone
    while its ledger says it holds records: segments were lost, or a catalog file replaced.
    The partition is refused, never served as a shorter one: repair it (`kcompact repair`)."""


def path(pdir: str) -> str:
    return f"{pdir}/{NAME}"


def _entry(d: SegmentDesc) -> dict:
    if d.open:
        return {"base": d.base, "open": True}
    e = {"base": d.base, "next": d.next, "records": d.records, "first_offset": d.first_offset,
         "last_offset": d.last_offset, "log_size": d.log_size, "bcq_size": d.bcq_size,
         "digest": None if d.bcq_crc32c is None else f"{d.bcq_crc32c:08x}",
         "format": d.format}
    if d.log is not None:  # a manifest's object names
        e["log"], e["bcq"] = d.log, d.bcq
    return e


def body(catalog: str, version: int, descs: list[SegmentDesc], next_offset: int) -> dict:
    """The ledger's fields (everything but ``crc32c``) for a catalog written at ``version``."""
    segs = [_entry(d) for d in sorted(descs, key=lambda d: d.base)]
    live = [d for d in descs if not d.open and d.records]
    return {"format_version": FORMAT_VERSION, "catalog": catalog, "version": int(version),
            "first_offset": min((d.first_offset for d in live), default=int(next_offset)),
            "next_offset": int(next_offset),
            "records": sum(d.records for d in live), "segments": segs}


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _crc(doc: dict) -> str:
    return f"{native().crc32c(_canonical(doc), 0):08x}"  # (segment_list.crc32c's kernel)


def write(fs: Backend, pdir: str, catalog: str, version: int, descs: list[SegmentDesc],
          next_offset: int) -> None:
    """Record the catalog just written (after it, never before)."""
    doc = body(catalog, version, descs, next_offset)
    doc["crc32c"] = _crc(doc)
    fs.write_atomic(path(pdir), json.dumps(doc, sort_keys=True, indent=1).encode())


def delete(fs: Backend, pdir: str) -> None:
    try:
        fs.delete(path(pdir))
    except FileNotFoundError:
        pass


def read(fs: Backend, pdir: str) -> dict | None:
    """The ledger's fields, None when the partition has none; a damaged one raises."""
    p = path(pdir)
    try:
        raw = fs.read(p)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        crc = doc.pop("crc32c", None)
        if crc != _crc(doc):
            raise ValueError("its checksum does not match")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {doc.get('format_version')!r} is unknown to this "
                             "kcompact; upgrade kcompact")
        for k in ("version", "first_offset", "next_offset", "records"):
            if not isinstance(doc.get(k), int) or isinstance(doc.get(k), bool) or doc[k] < 0:
                raise ValueError(f"{k} is not a non-negative integer")
        if not isinstance(doc.get("segments"), list):
            raise ValueError("segments is not a list")
    except (ValueError, UnicodeDecodeError) as e:
        raise LedgerMismatchError(
            f"{p}: damaged partition ledger ({e}); the partition cannot be checked against "
            "it: run `kcompact verify`, then `kcompact repair` (docs/operations-damage.md)",
            p, 0) from None
    return doc


def check(fs: Backend, pdir: str, catalog_path: str, version: int | None,
          descs: list[SegmentDesc], next_offset: int) -> LedgerMismatchError | None:
    """What is wrong with the catalog as read (``version`` None: there is none) against the
    partition's ledger; None when it agrees or nothing can be checked (module docstring)."""
    led = read(fs, pdir)
    if led is None:
        return None
    where = path(pdir)

    def bad(what: str) -> LedgerMismatchError:
        return LedgerMismatchError(
            f"{catalog_path}: {what}; segments or the partition's catalog were lost or "
            f"replaced: the partition is refused rather than served short; repair it with "
            "`kcompact repair` (docs/operations-damage.md)", catalog_path, 0)

    held = (f"{led['records']} records at offsets {led['first_offset']}.."
            f"{led['next_offset'] - 1} in {len(led['segments'])} segments")
    if version is None:
        if led["records"]:
            return bad(f"missing, and the partition's ledger ({where}, version "
                       f"{led['version']}) says it holds {held}")
        return None
    if version < led["version"]:
        return bad(f"version {version} is older than version {led['version']} that the "
                   f"partition's ledger ({where}) records, which holds {held}")
    if version > led["version"]:
        return None  # the ledger is behind (a crash between the two writes): next write
    now = body(led.get("catalog", ""), version, descs, next_offset)
    if now["segments"] != led["segments"] or now["next_offset"] != led["next_offset"]:
        have = {e["base"]: e for e in now["segments"]}
        want = {e["base"]: e for e in led["segments"]}
        for base in sorted(set(have) | set(want)):
            if have.get(base) != want.get(base):
                what = ("does not list it" if base not in have else
                        "lists it, the ledger does not" if base not in want else
                        f"lists {have[base]}, the ledger {want[base]}")
                return bad(f"version {version} disagrees with the partition's ledger "
                           f"({where}) on segment {base}: the catalog {what}")
        return bad(f"version {version} says next offset {now['next_offset']}, the "
                   f"partition's ledger ({where}) {led['next_offset']}")
    return None


__all__ = ["FORMAT_VERSION", "LedgerMismatchError", "NAME", "body", "check", "delete", "path",
           "read", "write"]
