"""How a repair reads and replaces a partition: one implementation per kind of store.

``kcompact repair`` (reput/quarantine.py, replication/repair.py, docs/formats/quarantine.md)
does the same steps on every store; what differs by kind is where a damaged partition's
segments are for salvage (reput/salvage.py) and how the repaired partition is put in place, so
that is one class per kind, picked once for the store's backend (``repair_kind_for``), the way
reput/publisher.py picks a store's publisher:

=====================  ====================================  ====================================
step                   ``LocalRepair``                       ``ManifestRepair``
=====================  ====================================  ====================================
salvage's sources      the directory and its segment list    the newest manifest version that
                                                             reads, orphans past it, shared parts
                                                             and a writer's local segments
the install            commit marker, then one exchange of   evidence copied to quarantine, the
                       the two directories (renameat2)       segments uploaded, one manifest
                                                             version above every one present
a run's close          finish a committed swap left          (nothing)
=====================  ====================================  ====================================

Nothing else in the repair asks which kind the store is (tests/unit/test_sealing.py keeps it so).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets

import numpy as np

from . import bcq as B
from . import bcq2 as B2
from . import filenames as fn
from . import manifest as M
from . import salvage_sources as SS
from .backend import Backend, LocalBackend
from .errors import CorruptRecordError, ReputError
from .locks import FileLock
from .segment_desc import SegmentDesc
from .segment_list import crc32c

QUARANTINE_DIR = fn.QUARANTINE_DIR
REPAIR_DIR = fn.REPAIR_DIR
REPORT_NAME = "report.json"
RUN_LOCK = "run.lock"
REPORT_VERSION = 1
COMMIT_SUFFIX = ".commit"


class RepairError(ReputError):
    """A partition cannot be repaired as asked (another process writes it, the repaired copy
    does not verify): nothing of it was changed; the message says what to do."""


def quarantine_dir(run: str) -> str:
    return f"{QUARANTINE_DIR}/{run}"


class RepairKind:
    """The interface; see the module docstring."""

    def staging_root(self, local_fs: Backend) -> str | None:
        """The local directory a run builds its repaired partitions in (None: none)."""
        return local_fs.local_path("")

    def local_fs(self, fs: Backend, store_id: str, default_dir) -> Backend:
        """Where a writer of this store keeps its local files (the partitions' locks, the
        staging): the store itself, or ``default_dir(store_id)`` on an object store."""
        return fs

    def store_features(self, segment_list_feature: str) -> list[str]:
        """The features a store.json rebuilt by repair lists (reput/salvage_store.py)."""
        return [segment_list_feature]

    def salvage_sources(self, fs: Backend, topic: str, partition: int, out: "SS.Salvaged",
                        local_fs: Backend | None) -> tuple[list["SS.Source"], int]:
        """The partition's segments as found, and the next offset its catalog gives."""
        return SS.local_sources(fs, fn.partition_dir(topic, partition), out)

    def install(self, run, topic: str, partition: int, entry: dict, *, next_offset: int,
                cleaned_offset: int, split_to: dict[str, int]) -> None:
        """Put ``run``'s staged partition (closed, synced) in place of the live one, the old
        one into quarantine (``entry`` says where)."""
        from .swap import write_checkpoint
        pdir = fn.partition_dir(topic, partition)
        write_checkpoint(run.stage_fs, pdir, cleaned_offset,
                         {"repaired": run.run, "mode": run.report.get("mode")})
        run.stage_fs.sync_dir(pdir)
        _commit_local(run.fs, run.stage_fs, run.run, topic, partition, entry)
        _finish_local(run.fs, run.run, topic, partition)

    def finish(self, run) -> None:
        """A run's close: a swap committed and not finished (a failure in between) finished."""
        rdir = f"{REPAIR_DIR}/{run.run}/{fn.PARTITIONS_DIR}"
        for topic in run.fs.listdir(rdir):
            for name in run.fs.listdir(f"{rdir}/{topic}"):
                if name.endswith(COMMIT_SUFFIX):
                    _finish_local(run.fs, run.run, topic, int(name[:-len(COMMIT_SUFFIX)]))


class LocalRepair(RepairKind):
    """A local store: the interface's steps (module docstring)."""


class ManifestRepair(RepairKind):
    """An object store: each partition is its manifest (docs/formats/manifest.md)."""

    def local_fs(self, fs: Backend, store_id: str, default_dir) -> Backend:
        return LocalBackend(default_dir(store_id))

    def store_features(self, segment_list_feature: str) -> list[str]:
        return []

    def salvage_sources(self, fs, topic, partition, out, local_fs):
        pdir = fn.partition_dir(topic, partition)
        sources, next_offset = SS.manifest_sources(fs, pdir, out)
        parts, nxt = SS.shared_sources(fs, topic, partition, out)
        sources += parts
        next_offset = max(next_offset, nxt)
        if local_fs is not None:
            extra, nxt = SS.local_sources(local_fs, pdir, out, listed=False)
            sources += [s for s in extra if not sources or s.base > sources[-1].base]
            next_offset = max(next_offset, nxt)
        return sources, next_offset

    def install(self, run, topic, partition, entry, *, next_offset, cleaned_offset, split_to):
        self._install(run, topic, partition, entry, next_offset, cleaned_offset, split_to)

    def finish(self, run) -> None:
        pass

    def _install(self, run, t: str, p: int, entry: dict, next_offset: int,
                 cleaned_offset: int, split_to: dict[str, int]) -> None:
        """Copy every object of the partition to quarantine (the evidence), upload the staged
        segments as new objects, and commit one manifest version above every version present
        (the commit point; module docstring of reput/quarantine.py)."""
        fs, stage_fs = run.fs, run.stage_fs
        pdir = fn.partition_dir(t, p)
        qdir = f"{quarantine_dir(run.run)}/{pdir}"
        lister = getattr(fs, "list_objects", None)
        names = [n for n, _, _ in lister(pdir)] if lister is not None else []
        for name in names:  # the evidence first: the commit below retires these objects
            try:
                fs.write_atomic(f"{qdir}/{name}", fs.read(f"{pdir}/{name}"))
            except FileNotFoundError:
                continue
        entry["files"] = [f"{pdir}/{n}" for n in names]
        run.write_report_with(entry, state="committing")
        segs = []
        uploaded = []
        try:
            for base in sorted(b for b, kind in filter(None, map(
                    fn.parse_base, stage_fs.listdir(pdir))) if kind == "log"):
                name = fn.base_name(base)
                lrel, irel = f"{pdir}/{name}{fn.LOG_SUFFIX}", f"{pdir}/{name}{fn.INDEX_SUFFIX}"
                raw = np.frombuffer(stage_fs.read(irel), np.uint8)
                lean = B2.is_lean(raw[:8].tobytes())
                if lean:  # a segment shipped as stored (repair --from, protocol 2)
                    e = B2.LeanIndex(lambda a, n: raw[a:a + n].tobytes(), irel,
                                     raw.shape[0]).entries
                else:
                    e = B.view(raw)
                if not e.shape[0]:
                    continue
                tag = secrets.token_hex(8)
                lname = fn.segment_object(base, tag, fn.LOG_SUFFIX)
                iname = fn.segment_object(base, tag, fn.INDEX_SUFFIX)
                up = getattr(fs, "upload_file", None)
                for rel, obj in ((lrel, lname), (irel, iname)):
                    if up is not None:
                        up(f"{pdir}/{obj}", stage_fs.local_path(rel))
                    else:
                        fs.write_atomic(f"{pdir}/{obj}", stage_fs.read(rel))
                    uploaded.append(f"{pdir}/{obj}")
                segs.append(SegmentDesc.from_entries(
                    base, lname, iname, stage_fs.size(lrel), e["offset"], crc32c(raw),
                    raw.shape[0] if lean else None, 2 if lean else 1))
            _commit_manifest(fs, pdir, segs, next_offset, cleaned_offset,
                             {"repaired": run.run, "mode": run.report.get("mode")},
                             run.clock.ms(), split_to)
        except BaseException:
            for path in uploaded:  # (orphans otherwise; the garbage collection takes them)
                try:
                    fs.delete(path)
                except Exception:  # noqa: BLE001 - best effort
                    pass
            raise
        stage_fs.remove_tree(pdir)


def repair_kind_for(fs: Backend) -> RepairKind:
    """The repair implementation for a store's backend: chosen once, here."""
    return LocalRepair() if fs.appendable else ManifestRepair()


def _commit_manifest(fs: Backend, pdir: str, segs: list, next_offset: int, cleaned: int,
                     last_run: dict, now_ms: int, split_to: dict[str, int] | None = None
                     ) -> None:
    """One manifest version above every version present (a damaged one is then never read
    again: reput/manifest.py reads the newest that reads), listing ``segs``; the segments of
    the newest readable version retire (deleted after the grace period). ``split_to``: the
    parts of shared objects ``segs`` replace (shared-upload.md: a split's marks, so the
    journal's copy of those records is no longer read and its objects are collected)."""
    versions = M.list_versions(fs, pdir)
    retired = []
    old = M.Manifest()
    for v in reversed(versions):
        try:
            m = M.read_version(fs, pdir, v)
        except (CorruptRecordError, FileNotFoundError):
            continue
        if m is not None:
            retired = m.retired + [{"log": e.log, "bcq": e.bcq, "since_ms": now_ms}
                                   for e in m.segments]
            old = m
            break
    top = M.Manifest(version=max(versions, default=0))
    last = max([next_offset] + [e.last_offset + 1 for e in segs])
    raised = {w: q for w, q in (split_to or {}).items() if q > old.split_to.get(w, -1)}
    marks = dict(old.split_to)
    marks.update(raised)
    split_log = old.with_split(raised, now_ms, int(getattr(fs, "grace_ms", 0))) if raised \
        else old.split_log

    def change(cur: M.Manifest) -> M.Manifest:
        return M.Manifest(version=cur.version, segments=segs, next_offset=last,
                          cleaned_offset=cleaned, last_run=last_run, retired=retired,
                          split_to=marks, split_log=split_log)
    M.commit(fs, pdir, top, change, writer="repair", grace_ms=int(getattr(fs, "grace_ms", 0)),
             clock_ms=lambda: now_ms)


# -- the local swap -------------------------------------------------------------------------------


def _marker(run: str, topic: str, partition: int) -> str:
    return f"{REPAIR_DIR}/{run}/{fn.partition_dir(topic, partition)}{COMMIT_SUFFIX}"


def _staged_dir(run: str, topic: str, partition: int) -> str:
    return f"{REPAIR_DIR}/{run}/{fn.partition_dir(topic, partition)}"


def _ino(fs: Backend, path: str) -> int | None:
    try:
        return os.stat(fs.local_path(path)).st_ino
    except FileNotFoundError:
        return None


def _commit_local(fs: Backend, stage_fs: Backend, run: str, topic: str, partition: int,
                  entry: dict) -> None:
    """The commit point of a local partition's swap."""
    staged = _staged_dir(run, topic, partition)
    doc = {"version": 1, "topic": topic, "partition": partition,
           "new_ino": _ino(fs, staged), "entry": entry}
    fs.write_atomic(_marker(run, topic, partition), json.dumps(doc).encode())


def _finish_local(fs: Backend, run: str, topic: str, partition: int) -> None:
    """Complete a committed swap (idempotent: each step is told apart by the live
    directory's inode)."""
    marker = _marker(run, topic, partition)
    doc = json.loads(fs.read(marker))
    live = fn.partition_dir(topic, partition)
    staged = _staged_dir(run, topic, partition)
    qdir = doc["entry"]["quarantine"]
    new = doc["new_ino"]
    if _ino(fs, live) != new:
        if _ino(fs, staged) != new:
            raise RepairError(f"{fs.url}/{marker}: neither {live} nor {staged} is the repaired "
                              "partition; leave both as they are and report this")
        if _ino(fs, live) is None:
            fs.rename(staged, live)
        elif not _exchange(fs, live, staged):
            fs.rename(live, qdir)       # (a moment without the partition: no exchange here)
            fs.rename(staged, live)
        fs.sync_dir(fn.topic_dir(topic))
    if _ino(fs, staged) is not None:    # the old partition, after the exchange
        fs.rename(staged, qdir)
    fs.sync_dir(fn.topic_dir(topic))
    _append_report(fs, doc["entry"])
    fs.delete(marker)


def _append_report(fs: Backend, entry: dict) -> None:
    """(A recovered swap's entry, when its run died before writing it.)"""
    path = f"{entry['quarantine'].split('/partitions/', 1)[0]}/{REPORT_NAME}"
    try:
        doc = json.loads(fs.read(path))
    except (FileNotFoundError, ValueError):
        doc = {"version": REPORT_VERSION, "partitions": []}
    parts = doc.setdefault("partitions", [])
    key = (entry.get("topic"), entry.get("partition"))
    if not any((e.get("topic"), e.get("partition")) == key and e.get("state") != "committing"
               for e in parts):
        parts[:] = [e for e in parts if (e.get("topic"), e.get("partition")) != key]
        parts.append(entry)
        fs.write_atomic(path, json.dumps(doc, indent=1).encode() + b"\n")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(fs: Backend, a: str, b: str) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False when the
    system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn_ = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn_.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn_(_AT_FDCWD, os.fsencode(fs.local_path(a)), _AT_FDCWD, os.fsencode(fs.local_path(b)),
             _RENAME_EXCHANGE)
    return rc == 0


def finish_repairs(fs: Backend) -> list[str]:
    """Complete the committed swaps of repairs that died, and remove what an uncommitted one
    staged (module docstring); a run still alive (its lock held) is left alone. Returns the
    partitions finished. For ``Store.open`` on a local store."""
    done = []
    for run in fs.listdir(REPAIR_DIR):
        rdir = f"{REPAIR_DIR}/{run}"
        rfs = LocalBackend(fs.local_path(rdir))
        lock = FileLock(rfs, RUN_LOCK)
        if not lock.acquire(blocking=False):
            continue  # a repair is running
        try:
            for topic in fs.listdir(f"{rdir}/{fn.PARTITIONS_DIR}"):
                for name in fs.listdir(f"{rdir}/{fn.PARTITIONS_DIR}/{topic}"):
                    if name.endswith(COMMIT_SUFFIX) and name[:-len(COMMIT_SUFFIX)].isdigit():
                        p = int(name[:-len(COMMIT_SUFFIX)])
                        _finish_local(fs, run, topic, p)
                        done.append(f"{topic}-{p}")
            fs.remove_tree(rdir)
        finally:
            lock.release()
    if not fs.listdir(REPAIR_DIR):
        fs.remove_tree(REPAIR_DIR)
    return done
