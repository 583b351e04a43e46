"""Partition manifests: the versioned list of a partition's sealed segments on S3.

Spec: docs/formats/manifest.md. A partition's truth is its highest manifest version
``partitions/<t>/<p>/manifest/<20-digit N>.json``; version N+1 is created with a conditional put
(``Backend.create_exclusive``), so of two concurrent committers exactly one wins and the other
re-reads and rebases (``commit``). Each segment entry (a ``SegmentDesc``, reput/segment_desc.py)
carries a pyroaring ``BitMap`` (portable serialization, base64) of its offsets relative to the
segment's base, so a reader answers "which offsets exist" and "which segment holds offset o"
without downloading a segment. A version is never rewritten; old ones are deleted by ``collect_garbage`` (the newest ``KEEP_VERSIONS`` stay).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from . import filenames as fn
from . import ledger
from .backend import Backend
from .errors import CorruptRecordError, ReputError
from .segment_desc import MAX_OFFSET, SegmentDesc, object_name
from .segment_desc import field_int as _int

FORMAT_VERSION = 1
KEEP_VERSIONS = 3
#: A zero-byte manifest version is an upload that never completed. S3 leaves nothing behind a
#: PUT whose client died; SeaweedFS can leave the key with an empty body (seen once in CI: a
#: writer SIGKILLed mid-commit, tests/unit/test_kill_writer.py on SeaweedFS). Readers skip such
#: a version; a committer that finds one in its way deletes it once it is this old (a PUT of a
#: few KB still in flight is never that slow; object ages assume clocks within it, as the
#: garbage collector's grace period does) and takes its number.
ABORTED_VERSION_AGE_MS = 10_000


class ManifestConflictError(ReputError):
    """Another process changed the partition in a way this commit cannot be rebased onto (two
    writers of one partition, or a compaction whose inputs were replaced meanwhile)."""


@dataclass
class Manifest:
    """One version of a partition's manifest (docs/formats/manifest.md, grammar)."""

    version: int = 0
    created_ms: int = 0
    writer: str = ""
    cleaned_offset: int = -1
    next_offset: int = 0
    last_run: dict | None = None
    segments: list[SegmentDesc] = field(default_factory=list)
    #: segments replaced by this or an earlier version, kept until ``since_ms`` + grace so
    #: that readers holding an older version can finish: [{"log", "bcq", "since_ms"}]
    retired: list[dict] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    #: shared uploads (docs/formats/shared-upload.md): per writer, the highest journal entry
    #: whose parts of this partition are in ``segments`` (split) - those above it are not
    split_to: dict[str, int] = field(default_factory=dict)
    #: when ``split_to`` rose: [{"writer", "seq", "ms"}], those within the grace period and the
    #: newest older one per writer (a shared object is deleted once the split covering it is
    #: older than the grace period, however often the partition splits since)
    split_log: list[dict] = field(default_factory=list)

    def split_since(self, writer: str, seq: int) -> int | None:
        """When (ms) a split first covered ``writer``'s journal entry ``seq`` as far as
        ``split_log`` tells (None: not covered)."""
        if self.split_to.get(writer, -1) < seq:
            return None
        times = [int(r["ms"]) for r in self.split_log
                 if r.get("writer") == writer and int(r.get("seq", -1)) >= seq]
        return min(times) if times else self.created_ms

    def with_split(self, split: dict[str, int], now_ms: int, grace_ms: int) -> list[dict]:
        """``split_log`` after raising ``split_to`` by ``split`` at ``now_ms``, pruned."""
        log = self.split_log + [{"writer": w, "seq": q, "ms": now_ms}
                                for w, q in sorted(split.items())]
        keep = []
        for w in sorted({r["writer"] for r in log}):
            mine = sorted((r for r in log if r["writer"] == w), key=lambda r: r["seq"])
            old = [r for r in mine if int(r["ms"]) + grace_ms <= now_ms]
            keep += old[-1:] + [r for r in mine if int(r["ms"]) + grace_ms > now_ms]
        return keep

    @property
    def last_offset(self) -> int:
        """The highest offset any listed segment holds (-1: none)."""
        return max((s.last_offset for s in self.segments), default=-1)

    def names(self) -> set[str]:
        return {n for s in self.segments for n in (s.log, s.bcq)}

    def to_json(self) -> bytes:
        d = {
            "version": self.version, "format_version": self.format_version,
            "created_ms": self.created_ms, "writer": self.writer,
            "cleaned_offset": self.cleaned_offset, "next_offset": self.next_offset,
            "last_run": self.last_run,
            "segments": [s.to_manifest_dict() for s in self.segments],
            "retired": self.retired,
        }
        if self.split_to:
            d["split_to"] = dict(sorted(self.split_to.items()))
        if self.split_log:
            d["split_log"] = self.split_log
        return json.dumps(d, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Manifest":
        """Parse and validate (schema, bounds, segments in order and apart, offsets below
        next_offset); CorruptRecordError naming ``where`` and what is wrong otherwise."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            fv = _int(d, "format_version", 1, MAX_OFFSET)
            if fv > FORMAT_VERSION:
                raise ReputError(f"{where}: manifest format version {fv} is newer than this "
                                 f"kcompact understands ({FORMAT_VERSION}); upgrade kcompact")
            if not isinstance(d["segments"], list):
                raise ValueError("segments is not a list")
            segs = sorted((SegmentDesc.from_manifest_dict(s) for s in d["segments"]),
                          key=lambda s: s.base)
            for a, b in zip(segs, segs[1:]):
                if b.base <= a.base or (a.records and a.last_offset >= b.base):
                    raise ValueError(f"segments {a.log} and {b.log} overlap")
            last_run = d.get("last_run")
            if last_run is not None and not isinstance(last_run, dict):
                raise ValueError("last_run is not an object")
            retired = d.get("retired") or []
            if not isinstance(retired, list) or not all(isinstance(r, dict) for r in retired):
                raise ValueError("retired is not a list of objects")
            for r in retired:
                for key in ("log", "bcq"):
                    if r.get(key) is not None and not object_name(r[key], key):
                        raise ValueError(f"retired {key} {r[key]!r} is not a segment object")
                if "object" in r and fn.parse_compaction_object(r["object"]) is None:
                    raise ValueError(f"retired object {r['object']!r} is not a compaction object")
            split_to = d.get("split_to") or {}
            if not isinstance(split_to, dict) or not all(
                    isinstance(k, str) and fn.valid_writer(k) and isinstance(v, int)
                    and not isinstance(v, bool) and 0 <= v <= MAX_OFFSET
                    for k, v in split_to.items()):
                raise ValueError("split_to is not an object of writer ids and entry numbers")
            split_log = d.get("split_log") or []
            if not isinstance(split_log, list) or not all(
                    isinstance(r, dict) and isinstance(r.get("writer"), str)
                    and isinstance(r.get("seq"), int) and isinstance(r.get("ms"), int)
                    for r in split_log):
                raise ValueError("split_log is not a list of {writer, seq, ms}")
            writer = d.get("writer", "")
            m = cls(_int(d, "version", 1, MAX_OFFSET),
                    _int(d, "created_ms", 0, MAX_OFFSET) if "created_ms" in d else 0,
                    writer if isinstance(writer, str) else str(writer),
                    _int(d, "cleaned_offset", -1, MAX_OFFSET),
                    _int(d, "next_offset", 0, MAX_OFFSET), last_run, segs, retired, fv,
                    dict(split_to), split_log)
            return m
        except ReputError:
            raise
        except RecursionError:
            raise CorruptRecordError(f"{where}: unreadable partition manifest (nested too "
                                     "deeply)", where, 0) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptRecordError(f"{where}: unreadable partition manifest ({e})",
                                     where, 0) from None

    def successor(self, writer: str, now_ms: int, grace_ms: int, **changes) -> "Manifest":
        """Version N+1 with ``changes``; retired entries past the grace period are dropped
        (their objects are garbage now: ``collect_garbage`` deletes them by age)."""
        retired = [r for r in changes.pop("retired", self.retired)
                   if int(r.get("since_ms", 0)) + grace_ms > now_ms]
        return replace(self, version=self.version + 1, created_ms=now_ms, writer=writer,
                       retired=retired, format_version=FORMAT_VERSION, **changes)


# ---------------------------------------------------------------------------------------------
# reading and committing


def list_versions(fs: Backend, pdir: str, after: int | None = None) -> list[int]:
    """Manifest versions present under ``pdir/manifest/`` (ascending); with ``after``, only
    those above it (one listing request that starts after that key)."""
    lister = getattr(fs, "list_objects", None)
    if lister is not None:
        start = f"{fn.base_name(after)}{fn.MANIFEST_SUFFIX}" if after is not None else None
        names = [n for n, _, _ in lister(fn.manifest_dir(pdir), start_after=start)]
    else:
        names = fs.listdir(fn.manifest_dir(pdir))
    out = sorted(v for v in map(fn.parse_manifest_name, names) if v is not None)
    return [v for v in out if after is None or v > after]


def read_version(fs: Backend, pdir: str, version: int) -> Manifest | None:
    """Version ``version``; None when it is an aborted upload (zero bytes, see
    ABORTED_VERSION_AGE_MS)."""
    path = fn.manifest_path(pdir, version)
    raw = fs.read(path)
    if not raw:
        return None
    return Manifest.from_json(raw, f"{fs.url}/{path}")


def read_latest(fs: Backend, pdir: str, known: Manifest | None = None) -> Manifest | None:
    """The highest committed version (None: the partition has no manifest yet); aborted
    uploads above it are skipped. With ``known``, only versions above it are listed, and
    ``known`` itself is returned when there are none."""
    for _ in range(5):
        versions = list_versions(fs, pdir, None if known is None else known.version)
        try:
            for v in reversed(versions):
                m = read_version(fs, pdir, v)
                if m is not None:
                    return m
            return known
        except FileNotFoundError:
            continue  # deleted between the listing and the read (garbage of an old version)
    raise ReputError(f"{fs.url}/{fn.manifest_dir(pdir)}: manifest versions keep disappearing; "
                     "is another process deleting them?")


def commit(fs: Backend, pdir: str, base: Manifest | None,
           change: Callable[[Manifest], Manifest | None], *, writer: str, grace_ms: int,
           clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
           attempts: int = 64) -> Manifest | None:
    """Commit ``change`` applied to the latest version, as version N+1 (conditional create).

    ``change(latest)`` returns the new contents (its version is set here) or None when there is
    nothing to commit; it raises ManifestConflictError when it cannot apply to ``latest``. On a
    lost race (412) the latest version is read again and ``change`` re-applied: that is the
    rebase. Returns the committed manifest (or None when ``change`` said nothing to do).
    """
    latest = base
    for _ in range(attempts):
        cur = latest or Manifest(version=0)
        new = change(cur)
        if new is None:
            return None
        now = clock_ms()
        new = cur.successor(writer, now, grace_ms, cleaned_offset=new.cleaned_offset,
                            next_offset=new.next_offset, last_run=new.last_run,
                            segments=sorted(new.segments, key=lambda s: s.base),
                            retired=new.retired, split_to=new.split_to,
                            split_log=new.split_log)
        if fs.create_exclusive(fn.manifest_path(pdir, new.version), new.to_json()):
            # the partition's second record of it, after it (docs/formats/ledger.md); not
            # while the partition has never listed a segment (a shared-upload partition's
            # empty manifest: nothing to lose, and no request per partition for it)
            if new.segments or cur.segments:
                ledger.write(fs, pdir, fn.MANIFEST_DIR, new.version, new.segments,
                             new.next_offset)
                new.ledger_written = True  # (its committer need not read the ledger back)
            for hook in _COMMIT_HOOKS:  # (the store catalog, derived from manifests)
                hook(fs, pdir, new, writer)
            return new
        latest = read_latest(fs, pdir, latest)
        if (latest.version if latest is not None else 0) < new.version:
            # the key holds no manifest; its age is on the object store's clock
            _clear_aborted(fs, pdir, new.version, fs.clock_ms())
    raise ManifestConflictError(f"{fs.url}/{pdir}: could not commit a manifest version after "
                                f"{attempts} attempts (too many concurrent committers)")


#: called after each manifest version committed here, with (fs, pdir, manifest, writer): the
#: store catalog registers its record of it (reput/store_catalog.py), so the catalog is derived
#: from manifests without this module importing it
_COMMIT_HOOKS: list[Callable[[Backend, str, "Manifest", str], None]] = []


def on_commit(hook: Callable[[Backend, str, "Manifest", str], None]):
    """Register ``hook`` to run after every manifest commit of this process."""
    if hook not in _COMMIT_HOOKS:
        _COMMIT_HOOKS.append(hook)
    return hook


def _clear_aborted(fs: Backend, pdir: str, version: int, now_ms: int) -> None:
    """Version ``version`` exists and holds no manifest: delete it once it is
    ABORTED_VERSION_AGE_MS old, else wait a little for it to complete or age."""
    lister = getattr(fs, "list_objects", None)
    if lister is None:
        return
    name = f"{fn.base_name(version)}{fn.MANIFEST_SUFFIX}"
    for n, size, mtime in lister(fn.manifest_dir(pdir), start_after=None):
        if n == name:
            if size == 0 and now_ms - mtime >= ABORTED_VERSION_AGE_MS:
                fs.delete(fn.manifest_path(pdir, version))
            else:
                time.sleep(0.25)
            return


# ---------------------------------------------------------------------------------------------
# garbage


def collect_garbage(fs: Backend, pdir: str, *, grace_ms: int, now_ms: int,
                    keep_versions: int = KEEP_VERSIONS, known: Manifest | None = None,
                    objects_now_ms: int | None = None) -> list[str]:
    """Delete what no reader can need any more (docs/formats/manifest.md, Garbage):

    * segment objects that the latest version does not list, unless they were retired less
      than ``grace_ms`` ago or were written less than ``grace_ms`` ago (an upload whose commit
      is still coming);
    * manifest versions older than the newest ``keep_versions`` whose successor is older than
      ``grace_ms``.

    Lists first, then reads the latest version, so a segment committed after the listing is
    never taken for an orphan (the listing names the latest version: it is read unless
    ``known`` is that version). Returns the deleted paths (relative to the store).

    ``now_ms`` is the committers' clock (the one ``since_ms`` of a retired entry was stamped
    with: the store's injected clock); ``objects_now_ms`` (default ``now_ms``) is the object
    store's, which object modification times are on."""
    if objects_now_ms is None:
        objects_now_ms = now_ms
    lister = getattr(fs, "list_objects", None)
    if lister is None:
        return []
    objs = lister(pdir)
    listed = [v for v in (fn.parse_manifest_name(n.split("/", 1)[1]) for n, _, _ in objs
                          if n.startswith(fn.MANIFEST_DIR + "/")) if v is not None]
    if not listed:
        return []
    top_version = max(listed)
    if known is not None and known.version == top_version:
        latest = known
    else:
        try:
            latest = read_latest(fs, pdir, known)
        except FileNotFoundError:
            return []  # another collector got there first
        if latest is None:
            return []
    keep = latest.names()
    keep |= {n for r in latest.retired if int(r.get("since_ms", 0)) + grace_ms > now_ms
             for n in (r.get("log"), r.get("bcq")) if n}
    doomed = []
    versions: list[tuple[int, int]] = []
    for name, _size, mtime in objs:
        if "/" in name:
            sub, rest = name.split("/", 1)
            if sub == fn.MANIFEST_DIR and "/" not in rest:
                v = fn.parse_manifest_name(rest)
                if v is not None:
                    versions.append((v, mtime))
            continue
        if fn.parse_segment_object(name) is None:
            continue
        if name not in keep and mtime + grace_ms <= objects_now_ms:
            doomed.append(f"{pdir}/{name}")
    versions.sort()
    top = {v for v, _ in versions[-keep_versions:]}
    mtimes = dict(versions)
    for v, _ in versions:
        if v in top or v >= latest.version:
            continue
        succ = mtimes.get(v + 1)
        if succ is not None and succ + grace_ms <= objects_now_ms:
            doomed.append(fn.manifest_path(pdir, v))
    delete_all(fs, doomed)
    return doomed


def delete_all(fs: Backend, paths: list[str]) -> None:
    """Delete ``paths`` (batched where the backend can: up to 1000 per S3 request)."""
    if not paths:
        return
    deleter = getattr(fs, "delete_many", None)
    if deleter is not None:
        deleter(paths)
    else:
        for p in paths:
            fs.delete(p)
