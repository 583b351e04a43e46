"""Crash-safe replacement of a partition's segments (the compaction swap).

Spec and state machine: docs/formats/compaction-swap.md. In short:

1. STAGED   outputs are written and fsynced in ``.compacting/`` (no plan yet: abort = delete dir)
2. COMMITTED ``.compacting/swap.json`` written atomically: the plan (inputs, outputs, checkpoint)
3. APPLIED  outputs renamed over/next to the old segments, replaced inputs deleted, checkpoint
            written, then swap.json and ``.compacting/`` removed.

Opening a partition for write calls ``recover_swap``: a ``.compacting/`` without swap.json is
rolled back (deleted); with swap.json the apply step is redone (every step is idempotent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError

SWAP_VERSION = 1
PLAN_NAME = "swap.json"
CHECKPOINT_VERSION = 1


@dataclass
class SwapPlan:
    inputs: list[int]           # bases of the segments being replaced
    outputs: list[int]          # bases of the staged segments that replace them
    cleaned_offset: int | None  # new compaction horizon (None: unchanged)
    last_run: dict | None = None

    def to_json(self) -> bytes:
        return json.dumps({"version": SWAP_VERSION, "inputs": self.inputs, "outputs": self.outputs,
                           "cleaned_offset": self.cleaned_offset,
                           "last_run": self.last_run}).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "SwapPlan":
        try:
            d = json.loads(raw)
            if d["version"] != SWAP_VERSION:
                raise ValueError("version")
            return cls([int(x) for x in d["inputs"]], [int(x) for x in d["outputs"]],
                       None if d["cleaned_offset"] is None else int(d["cleaned_offset"]),
                       d.get("last_run"))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptRecordError(f"{where}: unreadable swap plan ({e})", where, 0) from None


def staging_dir(pdir: str) -> str:
    return f"{pdir}/{fn.COMPACTING_DIR}"


def commit(fs: Backend, pdir: str, plan: SwapPlan) -> None:
    """The commit point: after this returns, the swap completes even across a crash."""
    fs.write_atomic(f"{staging_dir(pdir)}/{PLAN_NAME}", plan.to_json())


def trash_dir(pdir: str) -> str:
    return f"{pdir}/{fn.DELETED_DIR}"


def _retire(fs: Backend, pdir: str, name: str) -> None:
    """Move a replaced file to .deleted/ (unlinked later: freeing a large file's cached pages
    is slow, and Kafka likewise deletes replaced segments after file.delete.delay.ms)."""
    src = f"{pdir}/{name}"
    if not fs.exists(src):
        return
    if fs.local_path(src) is None:
        fs.delete(src)
        return
    k = 0
    while fs.exists(f"{trash_dir(pdir)}/{name}.{k}"):
        k += 1
    fs.rename(src, f"{trash_dir(pdir)}/{name}.{k}")


def apply(fs: Backend, pdir: str, plan: SwapPlan) -> None:
    """Move staged outputs into place, retire replaced inputs, write the checkpoint. Idempotent."""
    sdir = staging_dir(pdir)
    for base in plan.outputs:
        # .log first: until the .bcq follows, readers see a .bcq that does not match and retry
        for suffix in (fn.LOG_SUFFIX, fn.INDEX_SUFFIX):
            name = f"{fn.base_name(base)}{suffix}"
            src = f"{sdir}/{name}"
            if fs.exists(src):
                _retire(fs, pdir, name)
                fs.rename(src, f"{pdir}/{name}")
    outs = set(plan.outputs)
    for base in plan.inputs:
        if base not in outs:
            _retire(fs, pdir, f"{fn.base_name(base)}{fn.INDEX_SUFFIX}")
            _retire(fs, pdir, f"{fn.base_name(base)}{fn.LOG_SUFFIX}")
    fs.sync_dir(pdir)
    if plan.cleaned_offset is not None or plan.last_run is not None:
        write_checkpoint(fs, pdir, plan.cleaned_offset, plan.last_run)
    fs.delete(f"{sdir}/{PLAN_NAME}")
    fs.remove_tree(sdir)
    fs.sync_dir(pdir)


def abort(fs: Backend, pdir: str) -> None:
    fs.remove_tree(staging_dir(pdir))


def recover_swap(fs: Backend, pdir: str) -> str | None:
    """Finish or roll back an interrupted swap. Returns 'rolled-back', 'completed' or None."""
    sdir = staging_dir(pdir)
    if not fs.isdir(sdir) and not fs.exists(f"{sdir}/{PLAN_NAME}"):
        return None
    try:
        raw = fs.read(f"{sdir}/{PLAN_NAME}")
    except FileNotFoundError:
        abort(fs, pdir)
        return "rolled-back"
    apply(fs, pdir, SwapPlan.from_json(raw, f"{sdir}/{PLAN_NAME}"))
    return "completed"


# -- compaction.checkpoint ---------------------------------------------------------------------


def read_checkpoint(fs: Backend, pdir: str) -> tuple[int, dict | None]:
    """(cleaned_offset, last_run); cleaned_offset is -1 when the partition was never compacted.
    On an object store both live in the partition's latest manifest (manifest.md)."""
    if not fs.appendable:
        from .manifest import read_latest
        m = read_latest(fs, pdir)
        return (-1, None) if m is None else (m.cleaned_offset, m.last_run)
    path = f"{pdir}/{fn.COMPACTION_CHECKPOINT}"
    try:
        raw = fs.read(path)
    except FileNotFoundError:
        return -1, None
    try:
        d = json.loads(raw)
        if d["version"] != CHECKPOINT_VERSION:
            raise ValueError("version")
        return int(d["cleaned_offset"]), d.get("last_run")
    except (ValueError, KeyError, TypeError):
        raise CorruptRecordError(f"{path}: unreadable compaction checkpoint; delete it and the "
                                 "next compaction recleans the partition from offset 0",
                                 path, 0) from None


def write_checkpoint(fs: Backend, pdir: str, cleaned_offset: int | None,
                     last_run: dict | None) -> None:
    old, old_run = read_checkpoint(fs, pdir)
    fs.write_atomic(f"{pdir}/{fn.COMPACTION_CHECKPOINT}", json.dumps({
        "version": CHECKPOINT_VERSION,
        "cleaned_offset": old if cleaned_offset is None else cleaned_offset,
        "last_run": last_run if last_run is not None else old_run}).encode())


def empty_trash(fs: Backend, pdir: str) -> int:
    """Unlink retired segment files; returns how many. Safe at any time: nothing reads them
    (a reader that still maps one keeps its inode alive until it lets go)."""
    d = trash_dir(pdir)
    names = fs.listdir(d)
    for name in names:
        fs.delete(f"{d}/{name}")
    return len(names)
