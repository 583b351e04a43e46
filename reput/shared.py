"""Shared upload objects and the writer journal (docs/formats/shared-upload.md).

On an S3 store whose store.json lists the ``shared-upload`` feature (format 3), a writer's flush
uploads ONE object (``shared/<writer>/<seq>-<tag>.kso``) holding the new records of every
partition it wrote - each partition's part the bytes of a sealed format-2 ``.log`` and its lean
index - and commits it by creating ONE journal entry (``shared/<writer>/journal/<seq>.json``,
a conditional create): 2 PUTs a flush whatever the partition count (WarpStream's L0 files).

A partition is then its manifest's segments plus the parts of journal entries above the
manifest's ``split_to`` (per writer, the highest entry it has absorbed). ``Journal`` is the
process's view of every writer's journal (one listing per refresh, each entry fetched once: they
are immutable), shared by every partition of the store (``journal_for``); ``RangeView`` maps a
part's two byte ranges to the paths of a format-2 segment, so the part is read by the ordinary
``KafkaSegment`` code through the block cache (``SharedRangeSegment``, reput/segment_shared.py).

The split (the compactor: ``ManifestCatalog.stage_split``) joins a partition's parts into one
per-partition segment and raises ``split_to`` in the same manifest commit; ``collect_garbage``
deletes an object once every partition it holds a part of has split it and the grace period has
passed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import env as _env
from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError, ReputError
from .manifest import delete_all
from .segment_desc import MAX_OFFSET, SegmentDesc, field_int
from .segment_list import canonical, crc32c

#: store.json's feature and format version of a store that holds shared objects
FEATURE = "shared-upload"
STORE_FORMAT = 3
#: the trailer of a .kso: footer length, footer CRC-32C, parts, magic (24 bytes)
MAGIC = b"KCSHARE1"
TRAILER = struct.Struct("<QII8s")
#: a journal listing is reused by reads within this many seconds (a store-wide scan of many
#: partitions costs one listing, not one a partition)
REFRESH_S = 0.2


def refresh_s() -> float:
    """How long a listing is reused (``KCOMPACT_S3_REFRESH_MS``; ``REFRESH_S`` by default)."""
    return int(_env.value("KCOMPACT_S3_REFRESH_MS")) / 1000.0


class SharedWriterConflictError(ReputError):
    """Another live process commits shared uploads under the same writer id."""


def split_max_shared() -> int:
    """How many shared objects a partition may depend on before the compactor splits it."""
    return int(_env.value("KCOMPACT_S3_SHARED_SPLIT_OBJECTS"))


# ---------------------------------------------------------------------------------------------
# parts and journal entries


@dataclass(frozen=True)
class Part:
    """One partition's part of a shared object, as its journal entry lists it."""

    writer: str
    seq: int
    object: str            # the .kso's path, relative to the store
    topic: str
    partition: int
    next_offset: int       # where the partition goes on after this part
    created_ms: int        # the journal entry's
    log_pos: int = 0
    bcq_pos: int = 0
    #: its records as a manifest entry describes a segment (virtual object names); None: a
    #: part with no record (the partition's next offset moved: transaction markers)
    desc: SegmentDesc | None = None

    @property
    def records(self) -> int:
        return self.desc.records if self.desc is not None else 0

    def to_dict(self) -> dict:
        d: dict = {"topic": self.topic, "partition": self.partition,
                   "next_offset": self.next_offset}
        if self.desc is None:
            d["records"] = 0
            return d
        d.update(self.desc.to_manifest_dict())
        d["log_pos"], d["bcq_pos"] = self.log_pos, self.bcq_pos
        return d

    @classmethod
    def from_dict(cls, d, writer: str, seq: int, obj: str, created_ms: int,
                  object_size: int) -> "Part":
        if not isinstance(d, dict):
            raise ValueError("a part is not an object")
        topic = d["topic"]
        if not isinstance(topic, str) or not topic:
            raise ValueError("a part's topic is not a name")
        partition = field_int(d, "partition", 0, (1 << 31) - 1)
        nxt = field_int(d, "next_offset", 0, MAX_OFFSET)
        if "log" not in d:
            if field_int(d, "records", 0, 0) != 0:
                raise ValueError(f"part {topic}-{partition}: records without objects")
            return cls(writer, seq, obj, topic, partition, nxt, created_ms)
        desc = SegmentDesc.from_manifest_dict(d)
        if desc.format != 2:
            raise ValueError(f"part {topic}-{partition}: format {desc.format}, expected 2")
        log_pos = field_int(d, "log_pos", 0, MAX_OFFSET)
        bcq_pos = field_int(d, "bcq_pos", 0, MAX_OFFSET)
        if log_pos + desc.log_size != bcq_pos or bcq_pos + desc.bcq_size > object_size:
            raise ValueError(f"part {topic}-{partition}: ranges {log_pos}+{desc.log_size}, "
                             f"{bcq_pos}+{desc.bcq_size} do not lie in a "
                             f"{object_size}-byte object")
        if desc.records and nxt <= desc.last_offset:
            raise ValueError(f"part {topic}-{partition}: next_offset {nxt} is not past its "
                             f"last offset {desc.last_offset}")
        return cls(writer, seq, obj, topic, partition, nxt, created_ms, log_pos, bcq_pos, desc)


@dataclass
class Entry:
    """One journal entry: the commit of one shared object (its grammar: shared-upload.md)."""

    writer: str
    seq: int
    created_ms: int
    object: str            # the object's name (in shared/<writer>/)
    object_size: int
    parts: list[Part] = field(default_factory=list)
    #: the entry's JSON object as committed (its key's content parsed), when this process
    #: committed it: ``as_dict`` without encoding it again (a store catalog's fold)
    committed_dict: dict | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict:
        """The entry's JSON object, ``crc32c`` included (what a store catalog's ``entries``
        holds: store-catalog.md)."""
        if self.committed_dict is not None:
            return self.committed_dict
        return json.loads(self.to_json())

    @property
    def path(self) -> str:
        return fn.journal_path(self.writer, self.seq)

    @property
    def object_path(self) -> str:
        return f"{fn.SHARED_DIR}/{self.writer}/{self.object}"

    def _body(self) -> dict:
        return {"seq": self.seq, "writer": self.writer, "created_ms": self.created_ms,
                "object": self.object, "object_size": self.object_size,
                "parts": [p.to_dict() for p in self.parts]}

    def to_json(self) -> bytes:
        body = self._body()
        body["crc32c"] = f"{crc32c(canonical(body)):08x}"
        return json.dumps(body, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str, writer: str, seq: int) -> "Entry":
        """Parse and validate; CorruptRecordError naming ``where`` and the problem."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            crc = d.pop("crc32c", None)
            if crc != f"{crc32c(canonical(d)):08x}":
                raise ValueError("it does not match its checksum")
            if d.get("writer") != writer or field_int(d, "seq", 0, MAX_OFFSET) != seq:
                raise ValueError("its writer or seq is not its name's")
            obj = d["object"]
            if not isinstance(obj, str) or fn.parse_shared_object(obj) is None \
                    or fn.parse_shared_object(obj)[0] != seq:
                raise ValueError(f"object {obj!r} is not this entry's shared object name")
            size = field_int(d, "object_size", TRAILER.size, MAX_OFFSET)
            created = field_int(d, "created_ms", 0, MAX_OFFSET)
            if not isinstance(d["parts"], list):
                raise ValueError("parts is not a list")
            opath = f"{fn.SHARED_DIR}/{writer}/{obj}"
            parts = [Part.from_dict(p, writer, seq, opath, created, size) for p in d["parts"]]
            return cls(writer, seq, created, obj, size, parts)
        except RecursionError:
            raise CorruptRecordError(f"{where}: unreadable journal entry (nested too deeply)",
                                     where, 0) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptRecordError(f"{where}: unreadable journal entry ({e}); run `kcompact "
                                     "verify`", where, 0) from None


# ---------------------------------------------------------------------------------------------
# the object


class ObjectBuilder:
    """A shared object written to a local file, part by part, then its footer and trailer."""

    def __init__(self, out, writer: str, seq: int, tag: str):
        self.out, self.writer, self.seq = out, writer, seq
        self.name = fn.shared_object(seq, tag)
        self.tag = tag
        self.pos = 0
        self.parts: list[dict] = []

    def add(self, topic: str, partition: int, base: int, log_ospath, log_size: int,
            bcq: np.ndarray, offsets: np.ndarray, next_offset: int) -> None:
        """One format-2 segment's .log (its bytes, or copied from the file at ``log_ospath``)
        and lean index."""
        log_pos = self.pos
        if not isinstance(log_ospath, str):
            if len(log_ospath) != log_size:
                raise ReputError(f"part {topic}/{partition}@{base}: {len(log_ospath)} bytes "
                                 f"encoded, {log_size} expected")
            self.out.write(log_ospath)
        else:
            with open(log_ospath, "rb") as f:
                left = log_size
                while left:
                    chunk = f.read(min(left, 8 << 20))
                    if not chunk:
                        raise CorruptRecordError(f"{log_ospath}: shorter than its {log_size} "
                                                 "bytes while it was uploaded", log_ospath,
                                                 log_size - left)
                    self.out.write(chunk)
                    left -= len(chunk)
        self.out.write(memoryview(bcq))
        self.pos += log_size + bcq.shape[0]
        desc = SegmentDesc.from_entries(
            base, fn.segment_object(base, self.tag, fn.LOG_SUFFIX),
            fn.segment_object(base, self.tag, fn.INDEX_SUFFIX), log_size, offsets,
            crc32c(bcq.tobytes()) if bcq.shape[0] else 0, bcq.shape[0], 2)
        d = {"topic": topic, "partition": partition, "next_offset": next_offset}
        d.update(desc.to_manifest_dict())
        d["log_pos"], d["bcq_pos"] = log_pos, log_pos + log_size
        self.parts.append(d)

    def advance(self, topic: str, partition: int, next_offset: int) -> None:
        """A part with no record: the partition goes on at ``next_offset``."""
        self.parts.append({"topic": topic, "partition": partition, "next_offset": next_offset,
                           "records": 0})

    def finish(self) -> int:
        """Footer and trailer; returns the object's size."""
        footer = json.dumps(self.parts, separators=(",", ":")).encode()
        self.out.write(footer)
        self.out.write(TRAILER.pack(len(footer), crc32c(footer), len(self.parts), MAGIC))
        self.pos += len(footer) + TRAILER.size
        return self.pos


def read_footer(fs: Backend, path: str, size: int) -> list[dict]:
    """The parts a shared object's own footer lists (``kcompact verify``); CorruptRecordError
    naming the object when its trailer or footer is damaged."""
    if size < TRAILER.size:
        raise CorruptRecordError(f"{path}: {size} bytes, shorter than a shared object's "
                                 "trailer", path, 0)
    tail = fs.read(path, size - TRAILER.size, TRAILER.size)
    flen, fcrc, nparts, magic = TRAILER.unpack(tail)
    if magic != MAGIC:
        raise CorruptRecordError(f"{path}: not a shared object (bad magic)", path,
                                 size - TRAILER.size)
    if flen > size - TRAILER.size:
        raise CorruptRecordError(f"{path}: its footer length {flen} is past its start", path,
                                 size - TRAILER.size)
    footer = fs.read(path, size - TRAILER.size - flen, flen)
    if crc32c(footer) != fcrc:
        raise CorruptRecordError(f"{path}: its footer does not match its checksum", path,
                                 size - TRAILER.size - flen)
    parts = json.loads(footer)
    if not isinstance(parts, list) or len(parts) != nparts:
        raise CorruptRecordError(f"{path}: its footer lists {len(parts)} parts, its trailer "
                                 f"{nparts}", path, size - TRAILER.size - flen)
    return parts


# ---------------------------------------------------------------------------------------------
# a part's bytes as a segment's files


class RangeView(Backend):
    """Read-only paths that are byte ranges of other objects of ``fs`` (a part's .log and
    .bcq, named as a segment's): a ``KafkaSegment`` reads a part through it unchanged, and every
    read is a ranged read of the shared object (through the block cache on S3)."""

    appendable = False

    def __init__(self, fs: Backend):
        self.base_fs = fs
        self.url = fs.url
        self._ranges: dict[str, tuple[str, int, int]] = {}

    def add(self, path: str, obj: str, pos: int, length: int) -> None:
        self._ranges[path] = (obj, pos, length)

    def _range(self, path: str) -> tuple[str, int, int]:
        try:
            return self._ranges[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def read(self, path, start=0, length=None):
        obj, pos, n = self._range(path)
        start = min(max(0, start), n)
        length = n - start if length is None else max(0, min(length, n - start))
        if not length:
            return b""
        data = self.base_fs.read(obj, pos + start, length)
        if len(data) != length:
            raise CorruptRecordError(f"{obj}: {len(data)} bytes at {pos + start}, its journal "
                                     f"entry says {length}; run `kcompact verify`", obj,
                                     pos + start)
        return data

    def open_read(self, path, start=0):
        """A stream of the range from ``start``: one ranged GET where the backend has them
        (``S3Backend.open_range``: a compaction reading a large segment inside a compaction
        object front to back, without holding it in memory or the block cache), else the
        bytes through ``read``."""
        obj, pos, n = self._range(path)
        start = min(max(0, start), n)
        ranged = getattr(self.base_fs, "open_range", None)
        if ranged is not None and n - start > 4 * getattr(self.base_fs, "block_size", 1 << 22):
            return ranged(obj, pos + start, n - start)
        return io.BytesIO(self.read(path, start))

    def map(self, path, size=None):
        _, _, n = self._range(path)
        return np.frombuffer(self.read(path, 0, n if size is None else min(size, n)), np.uint8)

    def size(self, path):
        return self._range(path)[2]

    def clock_ms(self) -> int:
        return self.base_fs.clock_ms()

    def has_local_copy(self, path: str) -> bool:
        obj = self._range(path)[0]
        has = getattr(self.base_fs, "has_local_copy", None)
        return bool(has and has(obj))

    def isdir(self, path):
        return False

    def listdir(self, path):
        return []

    def _read_only(self, path: str):
        raise ReputError(f"{path}: a range of a shared object is never written")

    def write_atomic(self, path, data):
        self._read_only(path)

    def create_exclusive(self, path, data):
        self._read_only(path)

    def delete(self, path):
        self._read_only(path)

    def rename(self, src, dst):
        self._read_only(src)

    def open_append(self, path):
        self._read_only(path)

    def remove_tree(self, path):
        self._read_only(path)


# ---------------------------------------------------------------------------------------------
# the journal


class Journal:
    """The process's view of every writer's journal on one store (see the module docstring)."""

    def __init__(self, fs: Backend):
        self.fs = fs
        self._lock = threading.RLock()
        self.entries: dict[tuple[str, int], Entry] = {}
        #: (topic, partition) -> its parts in ``entries`` (a partition's lookup does not walk
        #: every entry of every writer)
        self._by_partition: dict[tuple[str, int], list[Part]] = {}
        #: partitions whose list in ``_by_partition`` is not in ``_order`` (a part added
        #: out of order: sorted at the next ``parts``; parts usually come in order)
        self._unsorted: set[tuple[str, int]] = set()
        #: shared objects listed by the last refresh: path -> (size, last modified ms)
        self.objects: dict[str, tuple[int, int]] = {}
        self._listed_at: float | None = None
        #: journal entries the last listing saw (fetched or not), and those added since
        self._listed: set[tuple[str, int]] = set()
        #: grows whenever an entry is added or dropped (a follower's partition recomputes its
        #: parts only then: reput/s3_follow.py)
        self.generation = 0
        #: listed keys not fetched yet (a partition's lookup fetches those it needs)
        self._unfetched: set[tuple[str, int]] = set()
        #: keys that held no entry (an upload that never completed)
        self._empty: set[tuple[str, int]] = set()
        #: a store with a catalog (reput/store_catalog.py): writer -> the highest seq the
        #: catalog folded; the catalog holds every entry at or below it still needed, so
        #: those are never fetched from their keys
        self.folded: dict[str, int] = {}

    def refresh(self, max_age_s: float | None = None) -> None:
        """List the journals again unless listed less than ``max_age_s`` ago (one LIST of
        ``shared/``). Entries are fetched when a partition needs them (``parts``: only those
        above its manifest's ``split_to``), each once: they never change."""
        with self._lock:
            if max_age_s is None:
                max_age_s = refresh_s()
            now = time.monotonic()
            if self._listed_at is not None and now - self._listed_at < max_age_s:
                return
            listed = self.fs.list_objects(fn.SHARED_DIR)
            keys, objects = set(), {}
            for name, size, mtime in listed:
                bits = name.split("/")
                if len(bits) == 3 and bits[1] == fn.JOURNAL_DIR:
                    v = fn.parse_manifest_name(bits[2])
                    if v is not None:
                        keys.add((bits[0], v))
                elif len(bits) == 2 and fn.parse_shared_object(bits[1]) is not None:
                    objects[f"{fn.SHARED_DIR}/{name}"] = (size, mtime)
            # an entry above a writer's newest listed one was committed after the listing (the
            # collector never deletes a writer's newest entry): only older ones can be gone
            newest: dict[str, int] = {}
            for w, s in keys:
                newest[w] = max(newest.get(w, -1), s)
            gone = [k for k in self.entries if k not in keys and k[1] < newest.get(k[0], -1)]
            for key in gone:
                del self.entries[key]
            if gone:
                self._index()
            fresh = keys | {k for k in self._listed
                            if k not in keys and k[1] > newest.get(k[0], -1)}
            if gone or fresh != self._listed:
                self.generation += 1
            self._listed = fresh
            self._unfetched = {k for k in fresh if k not in self.entries
                               and k not in self._empty and k[1] > self.folded.get(k[0], -1)}
            self.objects = objects
            self._listed_at = time.monotonic()

    def _fetch(self, keys) -> None:
        for writer, seq in sorted(keys):
            if (writer, seq) in self.entries:
                continue
            path = fn.journal_path(writer, seq)
            try:
                raw = self.fs.read(path)
            except FileNotFoundError:
                self._unfetched.discard((writer, seq))
                continue  # collected between the listing and the read
            if not raw:
                self._unfetched.discard((writer, seq))
                self._empty.add((writer, seq))
                continue  # an upload that never completed (a writer killed mid-PUT)
            self._put(Entry.from_json(raw, f"{self.fs.url}/{path}", writer, seq))

    def has(self, writer: str, seq: int) -> bool:
        with self._lock:
            return (writer, seq) in self.entries

    def mark_listed(self, folded: set[tuple[str, int]]) -> None:
        """A catalog folded each (writer, seq) of ``folded`` and everything of that writer
        below it (reput/store_catalog.py): those keys count as listed (a writer's next seq is
        above them) and are not fetched."""
        with self._lock:
            for w, s in folded:
                if s > self.folded.get(w, -1):
                    self.folded[w] = s
                if (w, s) not in self._listed:
                    self._listed.add((w, s))
                    self.generation += 1
            self._unfetched = {k for k in self._unfetched if k[1] > self.folded.get(k[0], -1)}

    def partition_keys(self) -> list[tuple[str, int]]:
        """(topic, partition) of every part of the entries listed (those a catalog folded are
        in it: only the others are fetched)."""
        with self._lock:
            self._fetch(list(self._unfetched))
            return list(self._by_partition)

    def listed_keys(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._listed)

    def list_writer(self, writer: str) -> list[int]:
        """One LIST of one writer's journal (a writer new to a follower): the seqs of its
        entries, which the follower fetches as partitions need them."""
        seqs = []
        for name, _size, _mtime in self.fs.list_objects(
                f"{fn.SHARED_DIR}/{writer}/{fn.JOURNAL_DIR}"):
            v = fn.parse_manifest_name(name)
            if v is not None and "/" not in name:
                seqs.append(v)
        with self._lock:
            new = {(writer, s) for s in seqs} - self._listed
            if new:
                self._listed |= new
                self._unfetched |= {k for k in new if k not in self.entries
                                    and k[1] > self.folded.get(k[0], -1)}
                self.generation += 1
        return seqs

    def fetch_entry(self, writer: str, seq: int) -> "Entry | None":
        """One GET of the writer's entry ``seq``, added to the journal (a follower's poll);
        FileNotFoundError when it does not exist (yet); None for an empty key (a writer killed
        mid-upload: its next process goes on at the next seq)."""
        with self._lock:
            have = self.entries.get((writer, seq))
        if have is not None:
            return have
        path = fn.journal_path(writer, seq)
        raw = self.fs.read(path)
        with self._lock:
            if not raw:
                self._listed.add((writer, seq))
                self._empty.add((writer, seq))
                self._unfetched.discard((writer, seq))
                return None
            entry = Entry.from_json(raw, f"{self.fs.url}/{path}", writer, seq)
            self._put(entry)
            return entry

    def fetch_all(self) -> None:
        """Every listed entry (the partitions it names, garbage collection)."""
        with self._lock:
            self._fetch(self._listed)

    def add(self, entry: Entry) -> None:
        """An entry this process just committed (no listing needed to see it)."""
        with self._lock:
            self._put(entry)

    def _put(self, entry: Entry) -> None:
        key = (entry.writer, entry.seq)
        if key in self.entries:
            return
        self.entries[key] = entry
        self._listed.add(key)
        self._unfetched.discard(key)
        self.generation += 1
        for hook in _ENTRY_HOOKS:
            hook(self.fs, entry)
        for p in entry.parts:
            key = (p.topic, p.partition)
            have = self._by_partition.get(key)
            if have is None:
                self._by_partition[key] = [p]
                continue
            if _order(p) < _order(have[-1]):
                self._unsorted.add(key)
            have.append(p)

    def _index(self) -> None:
        self._by_partition = {}
        for e in self.entries.values():
            for p in e.parts:
                self._by_partition.setdefault((p.topic, p.partition), []).append(p)
        self._unsorted = set(self._by_partition)

    def next_seq(self, writer: str) -> int:
        with self._lock:
            return 1 + max((s for w, s in self._listed if w == writer), default=-1)

    def parts(self, topic: str, partition: int, split_to: dict[str, int]) -> list[Part]:
        """The partition's parts above ``split_to``, in offset order (parts with no record
        after those with records: they only move the next offset)."""
        with self._lock:
            self._fetch([(w, s) for w, s in self._unfetched if s > split_to.get(w, -1)])
            key = (topic, partition)
            have = self._by_partition.get(key, ())
            if key in self._unsorted:
                have.sort(key=_order)
                self._unsorted.discard(key)
            if not split_to:
                return list(have)
            return [p for p in have if p.seq > split_to.get(p.writer, -1)]


#: ``on_entry`` callbacks
_ENTRY_HOOKS: list[Callable[[Backend, Entry], None]] = []


def on_entry(hook: Callable[[Backend, Entry], None]) -> Callable[[Backend, Entry], None]:
    """Call ``hook(fs, entry)`` whenever a journal of this process first holds a journal
    entry (committed by this process, fetched from its key, or found in a store catalog):
    e.g. a benchmark timing when a reader learns of a flush (bench/s3_live.py). It runs under
    the journal's lock: keep it quick, and never raise. Returns ``hook`` (a decorator)."""
    _ENTRY_HOOKS.append(hook)
    return hook


def off_entry(hook: Callable[[Backend, Entry], None]) -> None:
    """Stop calling ``hook`` (``on_entry``)."""
    if hook in _ENTRY_HOOKS:
        _ENTRY_HOOKS.remove(hook)


def _order(p: Part) -> tuple:
    """A partition's parts in offset order, those with no record after those with records
    (they only move the next offset)."""
    return (p.desc is None, p.desc.base if p.desc else 0, p.next_offset)


_JOURNALS: "weakref.WeakKeyDictionary[Backend, Journal]" = weakref.WeakKeyDictionary()
_JOURNALS_LOCK = threading.Lock()


def enable(fs: Backend) -> Journal:
    """The store on ``fs`` uses shared uploads: its partitions read the journal from now on."""
    with _JOURNALS_LOCK:
        j = _JOURNALS.get(fs)
        if j is None:
            j = _JOURNALS[fs] = Journal(fs)
        return j


def journal_for(fs: Backend) -> Journal | None:
    """The journal of the store on ``fs``; None when it uses no shared uploads."""
    return _JOURNALS.get(fs)


#: a long-running reader of a store without shared uploads re-reads store.json this often to
#: notice a writer starting them (``journal_in_use``)
RECHECK_S = 30.0
_CHECKED: "weakref.WeakKeyDictionary[Backend, float]" = weakref.WeakKeyDictionary()


def checked(fs: Backend) -> None:
    """store.json of the store on ``fs`` was just read (by Store.open)."""
    with _JOURNALS_LOCK:
        _CHECKED[fs] = time.monotonic()


def journal_in_use(fs: Backend) -> Journal | None:
    """``journal_for``, and for a store not known to use shared uploads, a look at store.json
    at most every RECHECK_S seconds: a process that opened the store before a writer started
    shared uploads (a following kv map, the Kafka endpoint) then reads them too."""
    j = _JOURNALS.get(fs)
    if j is not None or getattr(fs, "list_objects", None) is None:
        return j
    with _JOURNALS_LOCK:
        last = _CHECKED.get(fs)
        if last is not None and time.monotonic() - last < RECHECK_S:
            return None
        _CHECKED[fs] = time.monotonic()
    try:
        features = json.loads(fs.read(fn.STORE_JSON)).get("features") or []
    except (OSError, ValueError, AttributeError, ReputError):
        return None  # the store's open reports a damaged store.json; nothing to read here
    return enable(fs) if FEATURE in features else None


# ---------------------------------------------------------------------------------------------
# the writers registry (a follower learns of a new writer from it: reput/s3_follow.py)

WRITERS_PATH = f"{fn.SHARED_DIR}/writers.json"


def read_writers(fs: Backend) -> set[str] | None:
    """The writer ids ``shared/writers.json`` lists (one GET); None when the store has none
    (written before it). A damaged registry is a CorruptRecordError naming it."""
    try:
        raw = fs.read(WRITERS_PATH)
    except FileNotFoundError:
        return None
    where = f"{fs.url}/{WRITERS_PATH}"
    try:
        d = json.loads(raw)
        crc = d.pop("crc32c", None)
        if crc != f"{crc32c(canonical(d)):08x}":
            raise ValueError("it does not match its checksum")
        if field_int(d, "format", 1, 1) != 1 or not isinstance(d["writers"], dict):
            raise ValueError("not a format-1 writers registry")
        for w in d["writers"]:
            fn.validate_writer(w)
        return set(d["writers"])
    except (ValueError, KeyError, TypeError, AttributeError, ReputError) as e:
        raise CorruptRecordError(f"{where}: unreadable writers registry ({e}); delete it (every "
                                 "writer writes it again at its next start)", where, 0) from None


def _writers_json(writers: dict[str, int]) -> bytes:
    body = {"format": 1, "writers": dict(sorted(writers.items()))}
    body["crc32c"] = f"{crc32c(canonical(body)):08x}"
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def register_writer(fs: Backend, writer: str, now_ms: int, attempts: int = 5) -> None:
    """List ``writer`` in the writers registry before its first commit (a GET; when it is not
    listed yet, a PUT of the registry with it added, then a GET to check that no other
    writer's PUT raced it away). A registration lost to a race anyway is found by the
    followers' periodic listing of ``shared/``."""
    for attempt in range(attempts):
        try:
            raw = fs.read(WRITERS_PATH)
            cur = json.loads(raw).get("writers") or {}
            if not isinstance(cur, dict):
                cur = {}
        except FileNotFoundError:
            cur = {}
        except ValueError:
            cur = {}  # damaged: written again whole
        if writer in cur:
            return
        cur = {k: v for k, v in cur.items() if isinstance(k, str) and isinstance(v, int)}
        cur[writer] = now_ms
        fs.write_atomic(WRITERS_PATH, _writers_json(cur))
        time.sleep(0.005 * attempt)


# ---------------------------------------------------------------------------------------------
# committing a flush


def commit_object(fs: Backend, journal: Journal, writer: str, builder: ObjectBuilder,
                  ospath: str, created_ms: int) -> Entry:
    """Upload the finished object at ``ospath`` (one PUT), then create its journal entry
    (one conditional PUT: the commit). A lost create means another process writes under this
    writer id: SharedWriterConflictError, the object left an orphan for the collector."""
    size = os.path.getsize(ospath)
    obj_path = f"{fn.SHARED_DIR}/{writer}/{builder.name}"
    up = getattr(fs, "upload_file", None)
    if up is not None:
        up(obj_path, ospath)
    else:
        with open(ospath, "rb") as f:
            fs.write_atomic(obj_path, f.read())
    raw_entry = Entry(writer, builder.seq, created_ms, builder.name, size, []).to_json()
    body = json.loads(raw_entry)
    body.pop("crc32c")
    body["parts"] = builder.parts
    body["crc32c"] = f"{crc32c(canonical(body)):08x}"
    raw = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    where = f"{fs.url}/{fn.journal_path(writer, builder.seq)}"
    entry = Entry.from_json(raw, where, writer, builder.seq)  # what readers will parse
    entry.committed_dict = body
    if not fs.create_exclusive(fn.journal_path(writer, builder.seq), raw):
        raise SharedWriterConflictError(
            f"{where} already exists: another process commits shared uploads as writer "
            f"{writer!r}; give each writer its own id (store.writer)")
    journal.add(entry)
    return entry


# ---------------------------------------------------------------------------------------------
# garbage


def collect_garbage(fs: Backend, journal: Journal,
                    manifest_of: Callable[[str, int], object], *, grace_ms: int, now_ms: int,
                    objects_now_ms: int) -> list[str]:
    """Delete shared objects every partition of which has split them (its latest manifest's
    ``split_to`` covers the entry, raised more than the grace period ago: ``split_log``), and
    orphans (objects no
    entry names, older than the grace period: a writer died between upload and commit). Every
    writer's newest entry is kept (it numbers the writer's next flush); older collected ones
    are deleted after their objects. ``manifest_of(topic, partition)``: the partition's latest
    manifest (None: none). Returns the deleted paths."""
    journal.refresh(0.0)
    journal.fetch_all()
    with journal._lock:
        entries = dict(journal.entries)
        objects = dict(journal.objects)
    newest: dict[str, int] = {}
    for w, s in entries:
        newest[w] = max(newest.get(w, -1), s)
    named = {e.object_path for e in entries.values()}
    manifests: dict[tuple[str, int], object] = {}
    doomed_objects, doomed_entries = [], []
    def absorbed(p: Part) -> bool:
        """Its partition's latest manifest holds the part (split), or, for a part with no
        record, has its next offset; and has for a grace period."""
        key = (p.topic, p.partition)
        if key not in manifests:
            manifests[key] = manifest_of(*key)
        m = manifests[key]
        if m is None:
            return False
        since = m.split_since(p.writer, p.seq)
        if since is None and not p.records and m.next_offset >= p.next_offset:
            since = m.created_ms
        return since is not None and since + grace_ms <= now_ms

    for (w, s), e in sorted(entries.items()):
        if not all(absorbed(p) for p in e.parts):
            continue
        if e.object_path in objects:
            doomed_objects.append(e.object_path)
        if s != newest[w]:
            doomed_entries.append(e.path)
    for path, (_size, mtime) in objects.items():
        if path not in named and mtime + grace_ms <= objects_now_ms:
            doomed_objects.append(path)
    delete_all(fs, doomed_objects)  # objects first: an entry outlives its object
    delete_all(fs, doomed_entries)
    if doomed_objects or doomed_entries:
        journal.refresh(0.0)
    return doomed_objects + doomed_entries


__all__ = ["FEATURE", "STORE_FORMAT", "WRITERS_PATH", "read_writers", "register_writer",
           "Entry", "Journal", "ObjectBuilder", "Part", "RangeView", "on_entry", "off_entry",
           "SharedWriterConflictError", "collect_garbage", "commit_object", "enable",
           "checked", "journal_for", "journal_in_use", "read_footer", "split_max_shared"]
