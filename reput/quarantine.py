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

The two ways of putting a partition in place are the store kind's (``LocalRepair``,
``ManifestRepair``: reput/repair_kinds.py, picked once for the run's store); ``RepairRun`` here
is the run itself: its staging, the partitions it holds, the evidence and the report.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass

from . import filenames as fn
from .backend import Backend, LocalBackend
from .config import Clock, TopicConfig
from .errors import StoreLockedError
from .locks import FileLock
from .partition import PartitionLog
# (the kind-specific steps, and the names this module has always exported)
from .repair_kinds import (COMMIT_SUFFIX, QUARANTINE_DIR, REPAIR_DIR, REPORT_NAME,  # noqa: F401
                           REPORT_VERSION, RUN_LOCK, RepairError, finish_repairs,
                           quarantine_dir, repair_kind_for)


def new_run_id(clock: Clock) -> str:
    """``20261128T105600.123Z-1a2b``: when the run started (UTC, sorts by time) and a tag."""
    ms = clock.ms()
    return (time.strftime("%Y%m%dT%H%M%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z-"
            + secrets.token_hex(2))


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
        #: how this store's partitions are read for salvage and replaced (its kind's)
        self.kind = repair_kind_for(fs)
        root = self.kind.staging_root(local_fs)
        if root is None:
            raise RepairError(f"{fs.url}: a repair needs a local directory to build in; this "
                              "store has none")
        self.fs, self.local_fs, self.clock = fs, local_fs, clock
        self.run = new_run_id(clock)
        self.stage_root = os.path.join(root, REPAIR_DIR, self.run)
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
        self.kind.install(self, t, p, entry, next_offset=next_offset,
                          cleaned_offset=cleaned_offset, split_to=split_to or {})
        self.report["partitions"].append(entry)
        self.write_report()

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
            self.kind.finish(self)
            self.local_fs.remove_tree(f"{REPAIR_DIR}/{self.run}")
            if not self.local_fs.listdir(REPAIR_DIR):
                self.local_fs.remove_tree(REPAIR_DIR)
        finally:
            self._lock.release()

    def __enter__(self) -> "RepairRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["QUARANTINE_DIR", "REPAIR_DIR", "REPORT_NAME", "RepairError", "RepairRun", "Staged",
           "finish_repairs", "new_run_id", "quarantine_dir"]
