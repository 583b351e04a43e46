"""Replacing a damaged partition whole, crash-safely, and keeping the damaged files as evidence.

Spec: docs/formats/quarantine.md. ``kcompact repair`` builds the repaired partition apart, in
``.repair/<run>/partitions/<topic>/<partition>/`` (a complete partition directory: segments,
segment list, checkpoint), then puts it in place here:

* **local store**: the commit point is ``.repair/<run>/partitions/<topic>/<partition>.commit``
  (written atomically: the repaired directory's inode and the quarantine path). The two
  directories are then exchanged in one ``renameat2(RENAME_EXCHANGE)`` where the file system
  has it (readers see the old partition or the new one, never none), else by two renames
  (the old one aside first); the old directory goes to ``quarantine/<run>/partitions/<topic>/
  <partition>/`` as it was, and the marker is removed. Every step is idempotent and told
  apart by the live directory's inode, so ``finish_repairs`` (run by ``Store.open``) completes
  a committed swap a killed repair left, and removes an uncommitted staging: the partition is
  the old one or the repaired one, never a mix.
* **S3 store**: every object of the partition (segments, manifest versions) is copied to
  ``quarantine/<run>/partitions/<topic>/<partition>/`` first; the repaired segments are
  uploaded as new immutable objects and one manifest version, numbered above every version
  present (a damaged one included, which is then never read again), is the commit point. The
  replaced objects retire as a compaction's do (deleted after the grace period; their copies in
  quarantine stay).

``quarantine/<run>/report.json`` says what each repaired partition had, what replaced it and
what was lost. kcompact never deletes anything under ``quarantine/``.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from . import bcq as B
from . import bcq2 as B2
from . import filenames as fn
from . import manifest as M
from .backend import Backend, LocalBackend
from .config import Clock, TopicConfig
from .errors import CorruptRecordError, ReputError, StoreLockedError
from .locks import FileLock
from .partition import PartitionLog
from .segment_list import crc32c
from .segment_desc import SegmentDesc

QUARANTINE_DIR = fn.QUARANTINE_DIR
REPAIR_DIR = fn.REPAIR_DIR
REPORT_NAME = "report.json"
RUN_LOCK = "run.lock"
REPORT_VERSION = 1
COMMIT_SUFFIX = ".commit"


class RepairError(ReputError):
    """A partition cannot be repaired as asked (another process writes it, the repaired copy
    does not verify): nothing of it was changed; the message says what to do."""


def new_run_id(clock: Clock) -> str:
    """``20261128T105600.123Z-1a2b``: when the run started (UTC, sorts by time) and a tag."""
    ms = clock.ms()
    return (time.strftime("%Y%m%dT%H%M%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z-"
            + secrets.token_hex(2))


def quarantine_dir(run: str) -> str:
    return f"{QUARANTINE_DIR}/{run}"


def _root(fs: Backend) -> str | None:
    return fs.local_path("") if fs.appendable else None


@dataclass
class Staged:
    """A repaired partition built apart (``RepairRun.stage``): its log is open for write."""

    topic: str
    partition: int
    log: PartitionLog


class RepairRun:
    """One `kcompact repair` run: its staging (``.repair/<run>/``, on the store's local
    directory: the store itself, or an S3 store's local directory) and its quarantine
    (``quarantine/<run>/`` in the store). Hold it open for the run (its lock tells
    ``finish_repairs`` the run is alive)."""

    def __init__(self, fs: Backend, local_fs: Backend, clock: Clock, *, report: dict):
        if _root(local_fs) is None:
            raise RepairError(f"{fs.url}: a repair needs a local directory to build in; this "
                              "store has none")
        self.fs, self.local_fs, self.clock = fs, local_fs, clock
        self.run = new_run_id(clock)
        self.stage_root = os.path.join(_root(local_fs), REPAIR_DIR, self.run)
        self.stage_fs = LocalBackend(self.stage_root)
        os.makedirs(self.stage_root, exist_ok=True)
        self._lock = FileLock(self.stage_fs, RUN_LOCK)
        self._lock.acquire(blocking=True)
        self.report = dict(report, version=REPORT_VERSION, run=self.run,
                           created_ms=clock.ms(), partitions=[])
        self._held: list[FileLock] = []

    # -- the partition -------------------------------------------------------------------------

    def hold(self, topic: str, partition: int) -> None:
        """Take the partition's writer and compaction locks (on the local directory) until
        the run ends: no mirror, compaction or replica writes it meanwhile."""
        pdir = fn.partition_dir(topic, partition)
        for name in (fn.LOCK_FILE, fn.COMPACTION_LOCK):
            lock = FileLock(self.local_fs, f"{pdir}/{name}")
            if not lock.acquire(blocking=False, holder=f"kcompact repair, pid {os.getpid()}"):
                raise RepairError(f"{topic}-{partition} of {self.fs.url} is being written or "
                                  "compacted by another process (a mirror, a compaction, a "
                                  "replica); stop it, then run `kcompact repair` again")
            self._held.append(lock)

    def stage(self, topic: str, partition: int, secret: bytes, config: TopicConfig
              ) -> Staged:
        """An empty partition log in the staging, open for write (its segments are rolled at
        the topic's ``segment.bytes``)."""
        self.stage_fs.remove_tree(fn.partition_dir(topic, partition))
        try:
            log = PartitionLog(self.stage_fs, topic, partition, secret, config, writable=True,
                               clock=self.clock)
        except StoreLockedError:
            raise RepairError(f"{self.stage_root}: staging of {topic}-{partition} is in use")
        return Staged(topic, partition, log)

    def install(self, staged: Staged, entry: dict, *, next_offset: int,
                cleaned_offset: int = -1, split_to: dict[str, int] | None = None) -> None:
        """Put the staged partition in place of the live one (module docstring), the old one
        into quarantine, and ``entry`` into the report. ``split_to`` (an S3 store with shared
        uploads): the parts of shared objects the staged partition replaces, per writer the
        highest journal entry (the new manifest's ``split_to`` is raised to it)."""
        log = staged.log
        if log.next_offset < next_offset:
            log.roll(next_offset)  # the partition continues where it did
        log.sync()
        log.close(publish=False)
        t, p = staged.topic, staged.partition
        pdir = fn.partition_dir(t, p)
        entry = dict(entry, quarantine=f"{quarantine_dir(self.run)}/{pdir}")
        if self.fs.appendable:
            from .swap import write_checkpoint
            write_checkpoint(self.stage_fs, pdir, cleaned_offset,
                             {"repaired": self.run, "mode": self.report.get("mode")})
            self.stage_fs.sync_dir(pdir)
            _commit_local(self.fs, self.stage_fs, self.run, t, p, entry)
            _finish_local(self.fs, self.run, t, p)
        else:
            self._install_remote(t, p, entry, next_offset, cleaned_offset, split_to or {})
        self.report["partitions"].append(entry)
        self.write_report()

    def _install_remote(self, t: str, p: int, entry: dict, next_offset: int,
                        cleaned_offset: int, split_to: dict[str, int]) -> None:
        pdir = fn.partition_dir(t, p)
        qdir = f"{quarantine_dir(self.run)}/{pdir}"
        lister = getattr(self.fs, "list_objects", None)
        names = [n for n, _, _ in lister(pdir)] if lister is not None else []
        for name in names:  # the evidence first: the commit below retires these objects
            try:
                self.fs.write_atomic(f"{qdir}/{name}", self.fs.read(f"{pdir}/{name}"))
            except FileNotFoundError:
                continue
        entry["files"] = [f"{pdir}/{n}" for n in names]
        self.write_report_with(entry, state="committing")
        segs = []
        uploaded = []
        try:
            for base in sorted(b for b, kind in filter(None, map(
                    fn.parse_base, self.stage_fs.listdir(pdir))) if kind == "log"):
                name = fn.base_name(base)
                lrel, irel = f"{pdir}/{name}{fn.LOG_SUFFIX}", f"{pdir}/{name}{fn.INDEX_SUFFIX}"
                raw = np.frombuffer(self.stage_fs.read(irel), np.uint8)
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
                up = getattr(self.fs, "upload_file", None)
                for rel, obj in ((lrel, lname), (irel, iname)):
                    if up is not None:
                        up(f"{pdir}/{obj}", self.stage_fs.local_path(rel))
                    else:
                        self.fs.write_atomic(f"{pdir}/{obj}", self.stage_fs.read(rel))
                    uploaded.append(f"{pdir}/{obj}")
                segs.append(SegmentDesc.from_entries(
                    base, lname, iname, self.stage_fs.size(lrel), e["offset"], crc32c(raw),
                    raw.shape[0] if lean else None, 2 if lean else 1))
            _commit_manifest(self.fs, pdir, segs, next_offset, cleaned_offset,
                             {"repaired": self.run, "mode": self.report.get("mode")},
                             self.clock.ms(), split_to)
        except BaseException:
            for path in uploaded:  # (orphans otherwise; the garbage collection takes them)
                try:
                    self.fs.delete(path)
                except Exception:  # noqa: BLE001 - best effort
                    pass
            raise
        self.stage_fs.remove_tree(pdir)

    # -- files that are not a partition's (store.json, commit logs) ----------------------------

    def keep_copy(self, fs: Backend, path: str) -> str:
        """Copy ``path`` (on ``fs``: the store, or its local directory for commit logs) to
        ``quarantine/<run>/<path>`` there, before it is rewritten; returns the copy's path."""
        dst = f"{quarantine_dir(self.run)}/{path}"
        src_os, dst_os = fs.local_path(path), fs.local_path(dst)
        if src_os is not None and dst_os is not None:
            import shutil
            os.makedirs(os.path.dirname(dst_os), exist_ok=True)
            shutil.copyfile(src_os, dst_os)
            fs.sync_dir(os.path.dirname(dst))
        else:
            fs.write_atomic(dst, fs.read(path))
        return dst

    def set_aside(self, fs: Backend, path: str) -> str:
        """Move ``path`` on ``fs`` to ``quarantine/<run>/<path>`` there; returns where."""
        dst = f"{quarantine_dir(self.run)}/{path}"
        if fs.local_path(path) is not None:
            fs.rename(path, dst)
            fs.sync_dir(os.path.dirname(path))
        else:
            fs.write_atomic(dst, fs.read(path))
            fs.delete(path)
        return dst

    # -- the report ----------------------------------------------------------------------------

    def write_report(self) -> None:
        self.fs.write_atomic(f"{quarantine_dir(self.run)}/{REPORT_NAME}",
                             json.dumps(self.report, indent=1).encode() + b"\n")

    def write_report_with(self, entry: dict, state: str) -> None:
        doc = dict(self.report, partitions=self.report["partitions"] + [dict(entry,
                                                                             state=state)])
        self.fs.write_atomic(f"{quarantine_dir(self.run)}/{REPORT_NAME}",
                             json.dumps(doc, indent=1).encode() + b"\n")

    def close(self) -> None:
        """End the run: the partition locks released, a swap committed but not finished (a
        failure in between) finished, the staging removed. Raises when that finish fails (the
        staging then stays, for ``finish_repairs`` at the next open)."""
        for lock in self._held:
            lock.release()
        self._held.clear()
        try:
            if self.fs.appendable:
                rdir = f"{REPAIR_DIR}/{self.run}/{fn.PARTITIONS_DIR}"
                for topic in self.fs.listdir(rdir):
                    for name in self.fs.listdir(f"{rdir}/{topic}"):
                        if name.endswith(COMMIT_SUFFIX):
                            _finish_local(self.fs, self.run, topic,
                                          int(name[:-len(COMMIT_SUFFIX)]))
            self.local_fs.remove_tree(f"{REPAIR_DIR}/{self.run}")
            if not self.local_fs.listdir(REPAIR_DIR):
                self.local_fs.remove_tree(REPAIR_DIR)
        finally:
            self._lock.release()

    def __enter__(self) -> "RepairRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


__all__ = ["QUARANTINE_DIR", "REPAIR_DIR", "REPORT_NAME", "RepairError", "RepairRun", "Staged",
           "finish_repairs", "new_run_id", "quarantine_dir"]
