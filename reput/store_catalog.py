"""The store catalog: every partition's manifest and the journal entries still needed, in one object.

Spec: docs/formats/store-catalog.md. An S3 store at format 5 (store.json feature
``store-catalog``) keeps ``catalog/<20-digit version>.json``: a checkpoint of every partition's
latest manifest (manifest.md) and of the writers' journal entries (shared-upload.md) that some
partition still needs, so that opening or refreshing the store costs O(1) + O(writers) requests
instead of a LIST and a GET per partition (Iceberg's manifest list, Delta Lake's checkpoint).

It is **derived**: per-partition manifests stay the commit point. ``manifest.commit`` records
each manifest it commits here after its own commit (``after_manifest_commit``; inside
``StoreCatalog.batch()`` many of them become one catalog version), a writer with shared uploads
folds its journal entries every ``fold_every()`` commits (``fold``), and the garbage collector
records any manifest newer than the catalog's before it deletes anything (``reconcile``). A
catalog behind a manifest shows the partition as it was before that commit: complete, since
compactions and splits only move records between objects that outlive them by the grace period.

``StoreCatalog`` is one per store per process (``for_store``/``enable``), shared by every
partition: its view is re-read at most every ``REFRESH_S`` (one LIST of ``catalog/`` and a GET
when it moved), and a follower GETs the next version's key instead (``poll_next``: a 404 until
someone commits it).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from . import env as _env
from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError, ReputError
from .manifest import Manifest, delete_all, on_commit
from .segment_desc import MAX_OFFSET, field_int
from .segment_list import canonical, crc32c

FEATURE = "store-catalog"
#: the store format of a store with a catalog (store-json.md; 4 is compaction objects')
STORE_FORMAT = 5
FORMAT_VERSION = 1
CATALOG_DIR = "catalog"
#: versions kept besides those younger than the grace period
KEEP_VERSIONS = 3
#: a process's view of the newest version is re-listed at most this often (s) by readers that
#: do not follow the store (a scan of many partitions costs one listing)
REFRESH_S = 0.2


def refresh_s() -> float:
    """How long a listing is reused (``KCOMPACT_S3_REFRESH_MS``; ``REFRESH_S`` by default)."""
    return int(_env.value("KCOMPACT_S3_REFRESH_MS")) / 1000.0


def fold_every() -> int:
    """A writer with shared uploads folds its journal entries every this many commits."""
    return max(1, int(_env.value("KCOMPACT_S3_CATALOG_FOLD")))


def poll_interval_s() -> float:
    """A follower GETs the catalog's next version at most this often."""
    return int(_env.value("KCOMPACT_S3_CATALOG_POLL_MS")) / 1000.0


def catalog_path(version: int) -> str:
    return f"{CATALOG_DIR}/{fn.base_name(version)}.json"


def parse_catalog_name(name: str) -> int | None:
    if not name.endswith(".json") or "/" in name:
        return None
    stem = name[:-5]
    return int(stem) if len(stem) == 20 and stem.isdigit() else None


def pdir_key(pdir: str) -> tuple[str, int] | None:
    """(topic, partition) of a partition directory ``partitions/<topic>/<p>``."""
    bits = pdir.strip("/").split("/")
    if len(bits) == 3 and bits[0] == fn.PARTITIONS_DIR and bits[2].isdigit():
        return bits[1], int(bits[2])
    return None


def _canonical_json(raw: bytes) -> bytes:
    return canonical(json.loads(raw))


def _crc_of_bytes_matches(raw: bytes, crc) -> bool:
    """Whether ``raw`` is a catalog written as ``Catalog.to_json`` writes it (its canonical
    JSON, then ``crc32c`` last) whose checksum matches the bytes before it: the check without
    encoding the parsed object again. False for any other layout (the caller then checks the
    canonical JSON of what it parsed, as for every other metadata file)."""
    if not isinstance(crc, str) or len(crc) != 8:
        return False
    tail = b',"crc32c":"' + crc.encode() + b'"}'
    end = len(raw.rstrip(b"\n"))
    if raw[end - len(tail):end] != tail:
        return False
    body = memoryview(raw)[:end - len(tail)]
    return f"{crc32c(b'}', crc32c(body)):08x}" == crc


class CatalogConflictError(ReputError):
    """Too many concurrent committers of the store catalog."""


@dataclass
class Catalog:
    """One catalog version, parsed (its grammar: store-catalog.md)."""

    version: int = 0
    created_ms: int = 0
    writer: str = ""
    #: topic -> partition -> its manifest (None: no manifest yet, records only in the journal)
    partitions: dict[str, dict[int, Manifest | None]] = field(default_factory=dict)
    #: writer -> the highest seq folded in
    folded: dict[str, int] = field(default_factory=dict)
    #: writer -> its entries still needed (journal entry JSON objects, ascending by seq)
    entries: dict[str, list[dict]] = field(default_factory=dict)
    #: the canonical JSON of each entry ((writer, seq) -> bytes: entries never change) and
    #: of each manifest ((topic, partition) -> (the Manifest, bytes)), shared with the
    #: versions made from this one (``successor``): a commit encodes only what is new
    #: (``to_json``), not every entry and manifest again
    _canon: dict = field(default_factory=dict, compare=False, repr=False)

    def manifest(self, topic: str, partition: int) -> Manifest | None:
        return self.partitions.get(topic, {}).get(partition)

    def holds(self, topic: str, partition: int) -> bool:
        return partition in self.partitions.get(topic, {})

    def canonical(self) -> bytes:
        """The canonical JSON of the version's fields but its checksum (what ``crc32c``
        covers: segment_list.canonical of the body), assembled from the canonical JSON of
        each entry and manifest, kept from the versions before (``_canon``)."""
        canon = self._canon
        enc = json.dumps
        topics = []
        for t in sorted(self.partitions):
            ps = self.partitions[t]
            if not ps:
                continue
            items = []
            for key in sorted(str(p) for p in ps):
                m = ps[int(key)]
                if m is None:
                    items.append(f"{enc(key)}:null".encode())
                    continue
                have = canon.get((t, int(key)))
                if have is None or have[0] is not m:
                    have = canon[(t, int(key))] = (m, _canonical_json(m.to_json()))
                items.append(enc(key).encode() + b":" + have[1])
            topics.append(enc(t).encode() + b":{" + b",".join(items) + b"}")
        writers = []
        for w in sorted(self.folded):
            ents = []
            for e in self.entries.get(w, []):
                k = (w, e["seq"])
                got = canon.get(k)
                if got is None:
                    got = canon[k] = canonical(e)
                ents.append(got)
            writers.append(enc(w).encode() + b':{"entries":[' + b",".join(ents)
                           + b'],"folded":' + str(int(self.folded[w])).encode() + b"}")
        return b"".join([
            b'{"created_ms":', str(int(self.created_ms)).encode(),
            b',"format":', str(FORMAT_VERSION).encode(),
            b',"journal":{', b",".join(writers), b'}',
            b',"partitions":{', b",".join(topics), b'}',
            b',"version":', str(int(self.version)).encode(),
            b',"writer":', enc(self.writer).encode(), b"}"])

    def to_json(self) -> bytes:
        """The version's object: its canonical JSON with ``crc32c`` added last (any key order
        is the same object to a reader; this one lets a reader check the checksum over the
        bytes as read: ``from_json``)."""
        body = self.canonical()
        return body[:-1] + b',"crc32c":"' + f"{crc32c(body):08x}".encode() + b'"}\n'

    def prune_canon(self) -> None:
        """Forget the canonical JSON of entries and manifests this version no longer holds."""
        live = {(w, e["seq"]) for w, es in self.entries.items() for e in es}
        for k in [k for k, v in self._canon.items() if (k not in live if isinstance(v, bytes)
                                                         else self.manifest(*k) is not v[0])]:
            del self._canon[k]

    @classmethod
    def from_json(cls, raw: bytes, where: str, version: int) -> "Catalog":
        """Parse and validate; CorruptRecordError naming ``where`` and the problem (a newer
        ``format``: ReputError saying to upgrade)."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            fmt = field_int(d, "format", 1, MAX_OFFSET)
            if fmt > FORMAT_VERSION:
                raise ReputError(f"{where}: store catalog format {fmt} is newer than this "
                                 f"kcompact understands ({FORMAT_VERSION}); upgrade kcompact")
            crc = d.pop("crc32c", None)
            if not _crc_of_bytes_matches(raw, crc) and crc != f"{crc32c(canonical(d)):08x}":
                raise ValueError("it does not match its checksum")
            if field_int(d, "version", 1, MAX_OFFSET) != version:
                raise ValueError("its version is not its name's")
            cat = cls(version, field_int(d, "created_ms", 0, MAX_OFFSET), str(d["writer"]))
            if not isinstance(d["partitions"], dict):
                raise ValueError("partitions is not an object")
            for topic, ps in d["partitions"].items():
                fn.validate_topic(topic)
                if not isinstance(ps, dict):
                    raise ValueError(f"partitions of {topic!r} is not an object")
                out = cat.partitions.setdefault(topic, {})
                for p, m in ps.items():
                    if not p.isdigit() or int(p) >= 1 << 31:
                        raise ValueError(f"partition {p!r} of {topic!r} is not a number")
                    out[int(p)] = None if m is None else Manifest.from_json(
                        json.dumps(m).encode(), f"{where} ({topic}/{p})")
            if not isinstance(d["journal"], dict):
                raise ValueError("journal is not an object")
            for w, j in d["journal"].items():
                fn.validate_writer(w)
                folded = field_int(j, "folded", 0, MAX_OFFSET)
                cat.folded[w] = folded
                ents = j["entries"]
                if not isinstance(ents, list):
                    raise ValueError(f"entries of {w!r} is not a list")
                for e in ents:  # (each parsed and checked when used: seed_journal)
                    if not isinstance(e, dict):
                        raise ValueError(f"an entry of {w!r} is not an object")
                    field_int(e, "seq", 0, folded)
                    if not isinstance(e.get("parts"), list):
                        raise ValueError(f"an entry of {w!r} has no parts")
                cat.entries[w] = sorted(ents, key=lambda e: e["seq"])
            return cat
        except RecursionError:
            raise CorruptRecordError(f"{where}: unreadable store catalog (nested too deeply)",
                                     where, 0) from None
        except CorruptRecordError as e:
            raise CorruptRecordError(f"{where}: unreadable store catalog ({e}); run `kcompact "
                                     "verify`", where, 0) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptRecordError(f"{where}: unreadable store catalog ({e}); run `kcompact "
                                     "verify`", where, 0) from None

    def successor(self, writer: str, now_ms: int) -> "Catalog":
        return Catalog(self.version + 1, now_ms, writer,
                       {t: dict(ps) for t, ps in self.partitions.items()},
                       dict(self.folded), {w: list(es) for w, es in self.entries.items()},
                       self._canon)

    def drop_unneeded(self) -> None:
        """Drop every entry no partition needs any more (all its parts' partitions have split
        at or past it)."""
        for w, es in self.entries.items():
            keep = []
            for e in es:
                for p in e["parts"]:
                    m = self.manifest(p["topic"], p["partition"])
                    if m is None or m.split_to.get(w, -1) < e["seq"]:
                        keep.append(e)
                        break
            self.entries[w] = keep


class StoreCatalog:
    """The process's view of one store's catalog (module docstring)."""

    def __init__(self, fs: Backend, clock_ms=None):
        self.fs = fs
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._lock = threading.RLock()
        self.latest: Catalog | None = None
        self._read_at: float | None = None
        self._polled_at: float | None = None
        #: when ``latest`` was last known to be the newest version (a listing, or this
        #: process's own commit): older than half the grace period, versions above it may
        #: have been collected, so their keys are listed, never assumed free (``_stale``)
        self._fresh_at: float | None = None
        #: grows whenever the view moves (a partition recomputes only then)
        self.generation = 0
        self._batch_depth = 0
        self._pending: dict[tuple[str, int], Manifest | None] = {}
        #: topic -> (the partitions with a directory under ``partitions/<topic>/``, when
        #: listed): ``unstored``'s listing, shared by every partition of the process
        self._dirs: dict[str, tuple[set[int], float]] = {}
        self._dirs_lock = threading.Lock()
        self.stats = {"list": 0, "get_hit": 0, "get_miss": 0, "put": 0, "conflict": 0,
                      "list_dirs": 0}

    # -- reading -------------------------------------------------------------------------------

    def refresh(self, max_age_s: float | None = None) -> Catalog | None:
        """The newest version, listed again unless listed less than ``max_age_s`` ago (one LIST
        of ``catalog/``, and a GET when it moved)."""
        with self._lock:
            if max_age_s is None:
                max_age_s = refresh_s()
            now = time.monotonic()
            if self._read_at is not None and now - self._read_at < max_age_s:
                return self.latest
            self._read_at = now
            self._polled_at = now
            self._fresh_at = now
            self.stats["list"] += 1
            after = self.latest.version if self.latest is not None else None
            start = f"{fn.base_name(after)}.json" if after is not None else None
            names = [n for n, _s, _m in self.fs.list_objects(CATALOG_DIR, start_after=start)]
            versions = sorted(v for v in map(parse_catalog_name, names) if v is not None)
            first_error = None
            for v in reversed(versions):
                if after is not None and v <= after:
                    break
                try:
                    got = self._read(v)
                except CorruptRecordError as e:  # a damaged version: the one below it
                    first_error = first_error or e
                    continue
                if got is not None:
                    self._adopt(got)
                    break
            else:
                if first_error is not None and self.latest is None:
                    raise first_error
            return self.latest

    def _read(self, version: int) -> Catalog | None:
        path = catalog_path(version)
        try:
            raw = self.fs.read(path)
        except FileNotFoundError:
            return None  # collected between the listing and the read
        self.stats["get_hit"] += 1
        if not raw:
            return None  # an upload that never completed
        return Catalog.from_json(raw, f"{self.fs.url}/{path}", version)

    def _adopt(self, cat: Catalog) -> None:
        if self.latest is None or cat.version > self.latest.version:
            self.latest = cat
            self.generation += 1
            from . import shared as SH
            j = SH.journal_for(self.fs)
            if j is not None:
                seed_journal(j, cat)

    def _stale(self) -> bool:
        """Whether versions above ``latest`` may have come and been collected since it was
        known to be the newest (the collector deletes a version only once it is older than
        the grace period, and only below the newest KEEP_VERSIONS): its next key cannot be
        assumed free, nor a 404 there to mean nothing is newer."""
        grace_s = int(getattr(self.fs, "grace_ms", 0)) / 1000.0
        return self._fresh_at is None or time.monotonic() - self._fresh_at >= grace_s / 2

    def poll_next(self, max_age_s: float | None = None) -> bool:
        """A follower: GET the next version's key (a 404 until it exists); when it exists, a
        HEAD of each key after it while they exist, and only the newest is read and parsed;
        whether the view moved. At most once per ``poll_interval_s``; a
        LIST instead when the view is older than half the grace period (``_stale``)."""
        age = poll_interval_s() if max_age_s is None else max_age_s
        with self._lock:
            now = time.monotonic()
            if self.latest is None or self._stale():
                before = self.generation
                self.refresh(0.0)
                return self.generation != before
            if self._polled_at is not None and now - self._polled_at < age:
                return False
            self._polled_at = now
            v = self.latest.version + 1
            try:
                raw = self.fs.read(catalog_path(v))
            except FileNotFoundError:
                self.stats["get_miss"] += 1
                return False
            except OSError:
                return False  # asked again at the next poll
            self.stats["get_hit"] += 1
            # every version is a whole checkpoint: only the newest of those written since the
            # last poll is parsed (a HEAD of each key after ``v`` finds it; the first 404 ends)
            top = v
            for _ in range(64):
                try:
                    if not self.fs.exists(catalog_path(top + 1)):
                        break
                except OSError:
                    break
                top += 1
            while top > v:
                try:
                    raw = self.fs.read(catalog_path(top))
                    self.stats["get_hit"] += 1
                    break
                except FileNotFoundError:
                    top -= 1  # (collected since the HEAD: the one below)
                except OSError:
                    top = v  # (the one already read)
            if not raw:
                self.refresh(0.0)  # an aborted upload at that key: list past it
                return True
            self._adopt(Catalog.from_json(raw, f"{self.fs.url}/{catalog_path(top)}", top))
            return True

    def manifest(self, topic: str, partition: int) -> tuple[bool, Manifest | None]:
        """(whether the catalog lists the partition, its manifest there)."""
        cat = self.latest
        if cat is None:
            return False, None
        return cat.holds(topic, partition), cat.manifest(topic, partition)

    def unstored(self, topic: str, partition: int) -> bool:
        """Whether the partition has no object under ``partitions/`` (no manifest, no ledger:
        a partition the catalog does not list yet, whose records are all in journal entries,
        or that has none). One LIST of the topic's directory (``partitions/<topic>/``, with a
        delimiter: one page per 1,000 partitions), reused for ``refresh_s()`` by every
        partition of the process, as the catalog's own listing: a partition the catalog does
        not list costs no request of its own (store-catalog.md, "Opening a partition")."""
        with self._dirs_lock:
            now = time.monotonic()
            got = self._dirs.get(topic)
            if got is None or now - got[1] >= refresh_s():
                self.stats["list_dirs"] += 1
                names = {int(p) for p in self.fs.listdir(fn.topic_dir(topic)) if p.isdigit()}
                got = self._dirs[topic] = (names, now)
            return partition not in got[0]

    def topics(self) -> set[str]:
        cat = self.latest
        return {t for t, ps in cat.partitions.items() if ps} if cat is not None else set()

    def partitions(self, topic: str) -> set[int]:
        cat = self.latest
        return set(cat.partitions.get(topic, {})) if cat is not None else set()

    # -- committing ----------------------------------------------------------------------------

    def commit(self, writer: str, change, attempts: int = 64) -> Catalog | None:
        """Version N+1 = ``change`` applied to (a copy of) the newest version N (conditional
        create); on a lost race the newest is read again and ``change`` re-applied. ``change``
        returns False when there is nothing to commit."""
        with self._lock:
            if self.latest is None or self._stale():
                self.refresh(0.0)  # (a collected version's key must never be written again)
            for _ in range(attempts):
                cur = self.latest or Catalog()
                new = cur.successor(writer, self._clock_ms())
                if change(new) is False:
                    return None
                new.drop_unneeded()
                new.prune_canon()
                self.stats["put"] += 1
                t0 = time.monotonic()
                if self.fs.create_exclusive(catalog_path(new.version), new.to_json()):
                    self._adopt(new)
                    self._fresh_at = t0
                    return new
                self.stats["conflict"] += 1
                self.refresh(0.0)
                if self.latest is None or self.latest.version < new.version:
                    # the key holds no catalog (an aborted upload): step past it
                    self.latest = Catalog(new.version, cur.created_ms, cur.writer,
                                          cur.partitions, cur.folded, cur.entries)
            raise CatalogConflictError(
                f"{self.fs.url}/{CATALOG_DIR}: could not commit a catalog version after "
                f"{attempts} attempts (too many concurrent committers)")

    def record(self, manifests: dict[tuple[str, int], Manifest | None], writer: str) -> None:
        """Record partitions' manifests (each replaces the catalog's only when newer; None: a
        partition with no manifest yet, listed). Inside ``batch()``: at the end of it."""
        with self._lock:
            if self._batch_depth:
                for k, m in manifests.items():
                    old = self._pending.get(k)
                    if k not in self._pending or (m is not None and (
                            old is None or m.version > old.version)):
                        self._pending[k] = m
                return
        self._commit_records(manifests, writer)

    def _commit_records(self, manifests, writer: str) -> None:
        def change(new: Catalog) -> bool:
            moved = False
            for (t, p), m in manifests.items():
                ps = new.partitions.setdefault(t, {})
                old = ps.get(p)
                if p not in ps or (m is not None and (old is None or m.version > old.version)):
                    ps[p] = m if m is not None else old
                    moved = True
            return moved
        if manifests:
            self.commit(writer, change)

    @contextmanager
    def batch(self, writer: str = "compactor") -> Iterator["StoreCatalog"]:
        """Manifest commits (``manifest.commit``, any thread) inside the block are recorded
        together, as one catalog version, when the outermost block ends (also when it
        raises: those manifests are committed). A failed catalog commit is not raised (the
        catalog lags: store-catalog.md, "Lagging")."""
        with self._lock:
            self._batch_depth += 1
        try:
            yield self
        finally:
            with self._lock:
                self._batch_depth -= 1
                pending = {}
                if not self._batch_depth:
                    pending, self._pending = self._pending, {}
            try:
                self._commit_records(pending, writer)
            except (OSError, ReputError):
                pass

    def fold(self, writer: str, entries: list, partitions=()) -> None:
        """A writer's journal entries (``shared.Entry``) folded in, and the partitions they
        name listed."""
        if not entries:
            return
        raw = [e.as_dict() for e in entries]
        top = max(e.seq for e in entries)
        keys = {(p.topic, p.partition) for e in entries for p in e.parts} | set(partitions)

        def change(new: Catalog) -> bool:
            have = new.folded.get(writer, -1)
            add = [e for e in raw if e["seq"] > have]
            new_keys = [k for k in keys if not new.holds(*k)]
            if not add and not new_keys:
                return False
            for t, p in new_keys:
                new.partitions.setdefault(t, {})[p] = None
            if add:
                new.entries[writer] = new.entries.get(writer, []) + add
                new.folded[writer] = max(have, top)
            return True
        self.commit(writer, change)

    def reconcile(self, manifest_of, writer: str = "gc", also=()) -> int:
        """Record every partition manifest newer than the catalog's (``manifest_of(topic,
        partition)`` reads the manifest itself), for the partitions it lists and those in
        ``also`` (found by listing ``partitions/``); returns how many were."""
        cat = self.refresh(0.0)
        if cat is None:
            return 0
        newer = {}
        keys = {(t, p) for t, ps in cat.partitions.items() for p in ps} | set(also)
        for t, p in sorted(keys):
            m = cat.manifest(t, p)
            cur = manifest_of(t, p)
            if cur is not None and (m is None or cur.version > m.version):
                newer[(t, p)] = cur
        self._commit_records(newer, writer)
        return len(newer)

    # -- garbage -------------------------------------------------------------------------------

    def collect_garbage(self, *, grace_ms: int, now_ms: int) -> list[str]:
        """Delete versions below the newest ``KEEP_VERSIONS`` once older than the grace period
        (by LastModified, on the object store's clock: ``now_ms``)."""
        listed = sorted((v, mtime) for name, _s, mtime in self.fs.list_objects(CATALOG_DIR)
                        if (v := parse_catalog_name(name)) is not None)
        old = [catalog_path(v) for v, mtime in listed[:-KEEP_VERSIONS]
               if now_ms - mtime >= grace_ms]
        delete_all(self.fs, old)
        return old


def seed_journal(journal, cat: Catalog) -> None:
    """The entries a catalog version holds, added to the process's journal (no GET of their
    keys), and each writer's folded seq marked as listed (its next entry is above it)."""
    from .shared import Entry
    where = f"{journal.fs.url}/{catalog_path(cat.version)}"
    for w, es in cat.entries.items():
        for e in es:
            if journal.has(w, e["seq"]):
                continue  # (entries never change: each is parsed once per process)
            journal.add(Entry.from_json(json.dumps(e).encode(), f"{where} ({w} entry "
                                        f"{e['seq']}); run `kcompact verify`", w, e["seq"]))
    journal.mark_listed({(w, s) for w, s in cat.folded.items()})


_CATALOGS: "weakref.WeakKeyDictionary[Backend, StoreCatalog]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def enable(fs: Backend, clock_ms=None) -> StoreCatalog:
    """The store on ``fs`` has a catalog (store.json lists ``store-catalog``)."""
    with _LOCK:
        c = _CATALOGS.get(fs)
        if c is None:
            c = _CATALOGS[fs] = StoreCatalog(fs, clock_ms)
        return c


def for_store(fs: Backend) -> StoreCatalog | None:
    """The catalog of the store on ``fs`` in this process; None for a store without one."""
    return _CATALOGS.get(fs)


def for_reading(fs: Backend) -> StoreCatalog | None:
    """``for_store``, for a reader's use: None also under ``KCOMPACT_S3_FOLLOW=list`` (every
    refresh lists the store, as before issue 49: the baseline benchmarks compare with). Writers
    and committers always keep the catalog (``for_store``)."""
    if str(_env.value("KCOMPACT_S3_FOLLOW")) == "list":
        return None
    return _CATALOGS.get(fs)


def after_manifest_commit(fs: Backend, pdir: str, manifest: Manifest, writer: str) -> None:
    """``manifest.commit`` committed ``manifest`` for the partition in ``pdir``: record it."""
    c = _CATALOGS.get(fs)
    key = pdir_key(pdir)
    if c is None or key is None:
        return
    try:
        c.record({key: manifest}, writer)
    except (OSError, ReputError):
        # never fails the manifest commit, which is done: the catalog lags until the next
        # commit of that partition, its next open for write, or the collector (store-catalog.md)
        pass


@on_commit
def _record_commit(fs: Backend, pdir: str, manifest: Manifest, writer: str) -> None:
    # (looked up at each call: a test may replace after_manifest_commit)
    after_manifest_commit(fs, pdir, manifest, writer)


__all__ = ["CATALOG_DIR", "Catalog", "CatalogConflictError", "FEATURE", "STORE_FORMAT",
           "StoreCatalog", "after_manifest_commit", "catalog_path", "enable", "fold_every",
           "for_reading", "for_store", "poll_interval_s", "seed_journal"]
