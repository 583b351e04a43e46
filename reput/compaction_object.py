"""Compaction objects: one S3 object per compaction run (docs/formats/compaction-object.md).

A compaction run over many partitions of an S3 store (``compact_store``) stages each
partition's output segments locally as before; a ``CompactionBatch`` then packs every staged
output of the run into ONE object ``compacted/<ms>-<tag>.kco`` - each part byte for byte a
sealed format-2 segment's ``.log`` and lean index, a footer indexing them, the trailer of a
shared upload object with its own magic - uploads it (1 PUT) and commits each partition's
manifest with entries naming their byte ranges in it (``object``, ``log_pos``, ``bcq_pos``).
Readers see such an entry as a segment read through a ``RangeView`` (reput/shared.py), so
partitions in one object share its 4 MiB blocks in the block cache: a whole-store read costs
about bytes / 4 MiB GETs, not 2 per partition. The batch rolls to another object beyond
``KCOMPACT_S3_COMPACTION_OBJECT_MB`` (S3's single PUT is 5 GiB).

``collect_garbage`` deletes an object no partition's latest manifest lists a segment in (and
no retired entry younger than the grace period names): one a killed run uploaded but never
committed, or one every partition has compacted again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from . import env as _env
from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError
from .segment_desc import SegmentDesc
from .segment_list import crc32c

#: store.json's feature and format version of a store holding compaction objects
FEATURE = "compaction-objects"
STORE_FORMAT = 4
#: the trailer: footer length, footer CRC-32C, parts, magic (24 bytes; shared-upload.md's)
MAGIC = b"KCCOMPO1"
TRAILER = struct.Struct("<QII8s")
#: S3's single-PUT limit bounds an object
MAX_OBJECT_MB = 5 * 1024


def mode(features=()) -> str:
    """``store`` (one object per run) or ``partition`` (per-partition segment objects, as
    before: the baseline of bench/s3_catchup.py) for a store whose store.json lists
    ``features``: ``KCOMPACT_S3_COMPACTION_OBJECTS``, whose default ``auto`` is ``store`` on a
    store with shared uploads (format 3 already) and ``partition`` on one without (a format-2
    store stays readable by the kcompacts that read it)."""
    from .shared import FEATURE as SHARED
    m = str(_env.value("KCOMPACT_S3_COMPACTION_OBJECTS"))
    if m == "auto":
        return "store" if SHARED in features or FEATURE in features else "partition"
    return m


def bound_bytes() -> int:
    """The staged bytes at which a batch uploads its object and opens another."""
    return int(_env.value("KCOMPACT_S3_COMPACTION_OBJECT_MB")) << 20


# ---------------------------------------------------------------------------------------------
# the object


@dataclass
class PartEntry:
    """One part of a compaction object: its partition and its manifest segment entry."""

    topic: str
    partition: int
    desc: SegmentDesc

    def to_dict(self) -> dict:
        d = {"topic": self.topic, "partition": self.partition}
        d.update(self.desc.to_manifest_dict())
        return d


def write_object(out, obj_path: str, parts) -> list[PartEntry]:
    """Write a compaction object to the open binary file ``out``: for each ``(topic,
    partition, base, log_ospath, log_size, bcq_ospath, offsets)`` in ``parts`` (sorted by
    topic, partition, base) the .log's and the lean index's bytes, then footer and trailer.
    Returns the part entries (the manifest entries of the segments inside it)."""
    parsed = fn.parse_compaction_object(obj_path)
    if parsed is None:
        raise ValueError(f"{obj_path!r} is not a compaction object path")
    tag = parsed[1]
    pos = 0
    entries: list[PartEntry] = []
    for topic, partition, base, log_ospath, log_size, bcq_ospath, offsets in parts:
        log_pos = pos
        pos += _copy(out, log_ospath, log_size)
        with open(bcq_ospath, "rb") as f:
            bcq = f.read()
        out.write(bcq)
        pos += len(bcq)
        desc = SegmentDesc.from_entries(
            base, fn.segment_object(base, tag, fn.LOG_SUFFIX),
            fn.segment_object(base, tag, fn.INDEX_SUFFIX), log_size, offsets,
            crc32c(bcq) if bcq else 0, len(bcq), 2)
        desc = replace(desc, object=obj_path, log_pos=log_pos, bcq_pos=log_pos + log_size)
        entries.append(PartEntry(topic, partition, desc))
    footer = json.dumps([e.to_dict() for e in entries], separators=(",", ":")).encode()
    out.write(footer)
    out.write(TRAILER.pack(len(footer), crc32c(footer), len(entries), MAGIC))
    return entries


def _copy(out, ospath: str, size: int) -> int:
    with open(ospath, "rb") as f:
        left = size
        while left:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                raise CorruptRecordError(f"{ospath}: shorter than its {size} bytes while it was "
                                         "packed into a compaction object", ospath, size - left)
            out.write(chunk)
            left -= len(chunk)
    return size


def read_footer(fs: Backend, path: str, size: int) -> list[PartEntry]:
    """The parts a compaction object's footer lists, checked (magic, CRC-32C, count, every
    entry a valid manifest entry of this object inside it); anything else is one
    ``CorruptRecordError`` line naming the object."""
    where = f"{fs.url}/{path}"

    def bad(what: str, pos: int) -> CorruptRecordError:
        return CorruptRecordError(f"{where}: {what}; run `kcompact verify`", where, pos)
    if size < TRAILER.size:
        raise bad(f"{size} bytes, shorter than a compaction object's trailer", 0)
    tail = fs.read(path, size - TRAILER.size, TRAILER.size)
    if len(tail) != TRAILER.size:
        raise bad(f"shorter than its listed {size} bytes", len(tail))
    flen, fcrc, nparts, magic = TRAILER.unpack(tail)
    if magic != MAGIC:
        raise bad("not a compaction object (bad magic)", size - TRAILER.size)
    if flen > size - TRAILER.size:
        raise bad(f"its footer length {flen} is past its start", size - TRAILER.size)
    start = size - TRAILER.size - flen
    footer = fs.read(path, start, flen)
    if len(footer) != flen or crc32c(footer) != fcrc:
        raise bad("its footer does not match its checksum", start)
    try:
        raw = json.loads(footer)
        if not isinstance(raw, list) or len(raw) != nparts:
            raise ValueError(f"its footer lists {len(raw) if isinstance(raw, list) else 'no'} "
                             f"parts, its trailer {nparts}")
        out = []
        for d in raw:
            topic, partition = d["topic"], d["partition"]
            if not isinstance(topic, str) or not topic or not isinstance(partition, int) \
                    or isinstance(partition, bool) or not 0 <= partition < 1 << 31:
                raise ValueError("a part names no topic-partition")
            desc = SegmentDesc.from_manifest_dict(d)
            if desc.object != path or desc.bcq_pos + desc.bcq_size > start:
                raise ValueError(f"part {topic}-{partition} at {desc.base} does not lie in it")
            out.append(PartEntry(topic, partition, desc))
        return out
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise bad(f"unreadable footer ({e})", start) from None


# ---------------------------------------------------------------------------------------------
# a compaction run's batch


@dataclass
class _Staged:
    pl: object                  # the PartitionLog (its catalog holds the staged outputs)
    finish: Callable[[bool], None]   # called once committed (True) or abandoned (False)
    run: dict | None
    size: int


@dataclass
class CompactionBatch:
    """The partitions of one compaction run whose staged outputs go into one object (see the
    module docstring). ``add`` takes a partition whose compaction staged its outputs (its
    compaction lock held: ``finish`` releases it); ``publish`` packs, uploads and commits."""

    fs: Backend                 # the store's S3 backend
    local_dir: str              # where objects are written before their upload (OS path)
    writer: str = "compactor"
    require_format: Callable[[int, str], None] | None = None
    bound: int = field(default_factory=bound_bytes)
    #: the objects uploaded, and how many partitions committed into them
    objects: list[str] = field(default_factory=list)
    committed: int = 0
    _items: list[_Staged] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: a test's hook: called after the upload, before the first manifest commit
    after_upload: Callable[[str], None] | None = None

    @property
    def staged_bytes(self) -> int:
        return sum(i.size for i in self._items)

    def add(self, pl, run: dict | None, finish: Callable[[bool], None]) -> None:
        """A partition's compaction staged its outputs; published with the batch (now, when
        the batch reaches its bound)."""
        size = sum(s.log_size + s.index_size for s in pl.staged_segments)
        with self._lock:
            self._items.append(_Staged(pl, finish, run, size))
            full = self.staged_bytes >= self.bound
        if full:
            self.publish()

    def publish(self) -> list[tuple[object, bool]]:
        """One object of every staged output (none when no partition wrote any: commits
        only), uploaded; then each partition's manifest commit. Returns (pl, committed)."""
        with self._lock:
            items, self._items = self._items, []
        if not items:
            return []
        results: list[tuple[object, bool]] = []
        placed: dict[int, dict] = {}
        ospath = None
        try:
            parts = []
            for i, it in enumerate(items):
                pl = it.pl
                for seg in sorted(pl.staged_segments, key=lambda s: s.base):
                    lfs = pl.local_fs
                    parts.append((pl.topic, pl.partition, seg.base,
                                  lfs.local_path(seg.log_path), seg.log_size,
                                  lfs.local_path(seg.bcq_path), seg.entries()["offset"], i))
            if parts:
                parts.sort(key=lambda p: (p[0], p[1], p[2]))
                obj = fn.compaction_object(self.fs.clock_ms(), secrets.token_hex(8))
                os.makedirs(self.local_dir, exist_ok=True)
                ospath = os.path.join(self.local_dir, obj.rsplit("/", 1)[1])
                with open(ospath, "wb") as out:
                    entries = write_object(out, obj, [p[:7] for p in parts])
                    out.flush()
                    os.fsync(out.fileno())
                for p, e in zip(parts, entries):
                    placed.setdefault(p[7], {})[e.desc.base] = e.desc
                if self.require_format is not None:
                    self.require_format(STORE_FORMAT, FEATURE)
                up = getattr(self.fs, "upload_file", None)
                if up is not None:
                    up(obj, ospath)
                else:
                    with open(ospath, "rb") as f:
                        self.fs.write_atomic(obj, f.read())
                self.objects.append(obj)
                seed = getattr(self.fs, "seed", None)
                if seed is not None:
                    seed(obj, ospath)  # the local copy is spooled: read back without a request
                if self.after_upload is not None:
                    self.after_upload(obj)
            from . import store_catalog as SC
            cat = SC.for_store(self.fs)
            # a store catalog records every partition's commit as one version
            with cat.batch(self.writer) if cat is not None else contextlib.nullcontext():
                for i, it in enumerate(items):
                    ok = False
                    try:
                        ok = it.pl.commit_staged(self.writer, it.run,
                                                 placed=placed.get(i, {}))
                        self.committed += ok
                    finally:
                        results.append((it.pl, ok))
                        it.finish(ok)
        except BaseException:
            done = {id(pl) for pl, _ in results}
            for it in items:
                if id(it.pl) not in done:
                    try:
                        it.pl.abort_staged()
                    finally:
                        it.finish(False)
            raise
        finally:
            if ospath is not None and os.path.exists(ospath):
                os.unlink(ospath)
        return results

    def abort(self) -> None:
        """Drop what is staged and not yet published (a failed run)."""
        with self._lock:
            items, self._items = self._items, []
        for it in items:
            try:
                it.pl.abort_staged()
            finally:
                it.finish(False)


# ---------------------------------------------------------------------------------------------
# garbage


def collect_garbage(fs: Backend, manifest_of: Callable[[str, int], object], *, grace_ms: int,
                    now_ms: int, objects_now_ms: int,
                    warn: Callable[[str], None] | None = None) -> list[str]:
    """Delete compaction objects older than the grace period (their LastModified) that no
    partition's latest manifest lists a segment in and no retired entry younger than the grace
    period names (``manifest_of(topic, partition)``: the partition's latest manifest, None:
    none). An object whose footer is damaged is kept, and ``warn`` gets its one line. Returns
    the deleted paths."""
    lister = getattr(fs, "list_objects", None)
    if lister is None:
        return []
    doomed = []
    for name, size, mtime in lister(fn.COMPACTED_DIR):
        path = f"{fn.COMPACTED_DIR}/{name}"
        if fn.parse_compaction_object(path) is None or mtime + grace_ms > objects_now_ms:
            continue
        try:
            parts = read_footer(fs, path, size)
        except CorruptRecordError as e:
            if warn is not None:
                warn(str(e))
            continue
        if not any(_uses(manifest_of(t, p), path, grace_ms, now_ms)
                   for t, p in sorted({(e.topic, e.partition) for e in parts})):
            doomed.append(path)
    from .manifest import delete_all
    delete_all(fs, doomed)
    return doomed


def _uses(m, path: str, grace_ms: int, now_ms: int) -> bool:
    if m is None:
        return False
    if any(s.object == path for s in m.segments):
        return True
    return any(r.get("object") == path and int(r.get("since_ms", 0)) + grace_ms > now_ms
               for r in m.retired)


__all__ = ["FEATURE", "STORE_FORMAT", "MAGIC", "CompactionBatch", "PartEntry",
           "collect_garbage", "mode", "bound_bytes", "read_footer", "write_object"]
