"""Crash-safe replacement of a partition's segments (the compaction swap).

Spec and state machine: docs/formats/compaction-swap.md. In short:

1. STAGED   outputs are written and fsynced in ``.compacting/`` (no plan yet: abort = delete dir)
2. COMMITTED ``.compacting/swap.json`` written atomically: the plan (inputs, outputs with their
            segment-list entries, checkpoint)
3. APPLIED  outputs renamed over/next to the old segments, replaced inputs deleted, the segment
            list rewritten (docs/formats/segment-list.md), checkpoint written, then swap.json
            and ``.compacting/`` removed.

Opening a partition for write calls ``recover_swap``: a ``.compacting/`` without swap.json is
rolled back (deleted); with swap.json the apply step is redone (every step is idempotent).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, replace

from . import filenames as fn
from . import segment_list as SL
from .backend import Backend
from .errors import CorruptRecordError
from .segment import describe_files
from .segment_desc import SegmentDesc

#: 2 adds "segments", the outputs' segment-list entries; a version 1 plan (written before
#: segment lists) is still applied, its entries computed from the files
SWAP_VERSION = 2
PLAN_NAME = "swap.json"
CHECKPOINT_VERSION = 1


@dataclass
class SwapPlan:
    inputs: list[int]           # bases of the segments being replaced
    outputs: list[int]          # bases of the staged segments that replace them
    cleaned_offset: int | None  # new compaction horizon (None: unchanged)
    last_run: dict | None = None
    #: the outputs' segment-list entries (their ``next`` is set when applied); None: computed
    #: from the staged files at the commit
    segments: list[SegmentDesc] | None = None

    def to_json(self) -> bytes:
        return json.dumps({"version": SWAP_VERSION, "inputs": self.inputs, "outputs": self.outputs,
                           "cleaned_offset": self.cleaned_offset,
                           "last_run": self.last_run,
                           "segments": None if self.segments is None else
                           [m.to_list_dict() for m in self.segments]}).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "SwapPlan":
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or d.get("version") not in (1, SWAP_VERSION):
                raise ValueError(f"version {d.get('version') if isinstance(d, dict) else '?'}")
            bounds = (0, SL.MAX_OFFSET)
            inputs = [_bounded(x, *bounds) for x in d["inputs"]]
            outputs = [_bounded(x, *bounds) for x in d["outputs"]]
            cleaned = d["cleaned_offset"]
            cleaned = None if cleaned is None else _bounded(cleaned, -1, SL.MAX_OFFSET)
            last_run = d.get("last_run")
            if last_run is not None and not isinstance(last_run, dict):
                raise ValueError("last_run is not an object")
            metas = None
            if d.get("segments") is not None:
                body = {"format_version": SL.FORMAT_VERSION, "version": 0,
                        "next_offset": SL.MAX_OFFSET, "segments": d["segments"]}
                metas = SL.SegmentList._validated(body).segments
                if sorted(m.base for m in metas) != sorted(outputs) or \
                        any(m.open for m in metas):
                    raise ValueError("its segment entries are not its outputs'")
            return cls(inputs, outputs, cleaned, last_run, metas)
        except RecursionError:
            raise CorruptRecordError(f"{where}: unreadable swap plan (nested too deeply)",
                                     where, 0) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptRecordError(f"{where}: unreadable swap plan ({e})", where, 0) from None


def _bounded(x, lo: int, hi: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise ValueError(f"{x!r} is not an integer in [{lo}, {hi}]")
    return x


def staging_dir(pdir: str) -> str:
    return f"{pdir}/{fn.COMPACTING_DIR}"


def commit(fs: Backend, pdir: str, plan: SwapPlan) -> None:
    """The commit point: after this returns, the swap completes even across a crash. The
    outputs' segment-list entries are computed from the staged files when the plan has none."""
    if plan.segments is None and fs.appendable:
        plan.segments = [_describe_output(fs, pdir, b) for b in plan.outputs]
    fs.write_atomic(f"{staging_dir(pdir)}/{PLAN_NAME}", plan.to_json())


def _output_paths(fs: Backend, pdir: str, base: int) -> tuple[str, str]:
    """An output's .log and .bcq: staged, or already in place (an index-only output's .log,
    or a re-run of apply)."""
    out = []
    for suffix in (fn.LOG_SUFFIX, fn.INDEX_SUFFIX):
        name = f"{fn.base_name(base)}{suffix}"
        staged = f"{staging_dir(pdir)}/{name}"
        out.append(staged if fs.exists(staged) else f"{pdir}/{name}")
    return out[0], out[1]


def _describe_output(fs: Backend, pdir: str, base: int) -> SegmentDesc:
    lp, ip = _output_paths(fs, pdir, base)
    return describe_files(fs, lp, ip, base, None)


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
    """Move staged outputs into place, retire replaced inputs, rewrite the segment list, write
    the checkpoint. Idempotent."""
    sdir = staging_dir(pdir)
    metas = plan.segments
    if metas is None and fs.appendable:  # a version 1 plan
        metas = [_describe_output(fs, pdir, b) for b in plan.outputs]
    for m in metas or []:  # a staged file must be what the plan says before it goes live
        for path, size in zip(_output_paths(fs, pdir, m.base), (m.log_size, m.bcq_size)):
            if fs.size(path) != size:
                raise CorruptRecordError(
                    f"{path}: holds {fs.size(path)} bytes, the committed swap plan says "
                    f"{size}; the swap is not applied: run `kcompact verify`", path, 0)
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
    if metas is not None:
        _update_list(fs, pdir, plan, metas)
    if plan.cleaned_offset is not None or plan.last_run is not None:
        write_checkpoint(fs, pdir, plan.cleaned_offset, plan.last_run)
    fs.delete(f"{sdir}/{PLAN_NAME}")
    fs.remove_tree(sdir)
    fs.sync_dir(pdir)


def _update_list(fs: Backend, pdir: str, plan: SwapPlan, metas: list[SegmentDesc]) -> None:
    """The segment list without the inputs and with the outputs (each output's range ends at
    the next segment's base). A partition without a list (a new one, or a store from before
    lists) gets one listing every segment now in place."""
    lst = SL.read(fs, pdir)
    if lst is None:
        listed = []
        outs = {m.base: m for m in metas}
        for name in sorted(fs.listdir(pdir)):
            parsed = fn.parse_base(name)
            if parsed and parsed[1] == "log" and parsed[0] not in outs:
                listed.append(describe_files(fs, f"{pdir}/{name}",
                                             f"{pdir}/{fn.base_name(parsed[0])}"
                                             f"{fn.INDEX_SUFFIX}", parsed[0], None))
        lst = SL.SegmentList(listed, 0, 0)
    gone = set(plan.inputs) | {m.base for m in metas}
    segs = sorted([m for m in lst.segments if m.base not in gone] + list(metas),
                  key=lambda m: m.base)
    outs = {m.base for m in metas}
    out = []
    for i, m in enumerate(segs):
        if m.base in outs:  # its range: up to the next segment (the last: past its records)
            nxt = segs[i + 1].base if i + 1 < len(segs) else max(m.last_offset + 1, m.base)
            m = replace(m, next=nxt)
        out.append(m)
    nxt_off = max([lst.next_offset] + [m.base if m.open else m.next for m in out])
    new = SL.SegmentList(out, nxt_off, lst.version)
    if new.segments != lst.segments or new.next_offset != lst.next_offset:
        SL.write(fs, pdir, new)


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
        if not isinstance(d, dict) or d.get("version") != CHECKPOINT_VERSION:
            raise ValueError("version")
        if "crc32c" in d:  # written since segment lists (older checkpoints have none)
            crc = d.pop("crc32c")
            if crc != f"{SL.crc32c(SL.canonical(d)):08x}":
                raise ValueError("checksum")
        last_run = d.get("last_run")
        if last_run is not None and not isinstance(last_run, dict):
            raise ValueError("last_run")
        return _bounded(d["cleaned_offset"], -1, SL.MAX_OFFSET), last_run
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CorruptRecordError(f"{path}: unreadable compaction checkpoint; delete it and the "
                                 "next compaction recleans the partition from offset 0",
                                 path, 0) from None


def write_checkpoint(fs: Backend, pdir: str, cleaned_offset: int | None,
                     last_run: dict | None) -> None:
    old, old_run = read_checkpoint(fs, pdir)
    body = {"version": CHECKPOINT_VERSION,
            "cleaned_offset": old if cleaned_offset is None else cleaned_offset,
            "last_run": last_run if last_run is not None else old_run}
    body["crc32c"] = f"{SL.crc32c(SL.canonical(body)):08x}"
    fs.write_atomic(f"{pdir}/{fn.COMPACTION_CHECKPOINT}", json.dumps(body).encode())


def empty_trash(fs: Backend, pdir: str) -> int:
    """Unlink retired segment files; returns how many. Safe at any time: nothing reads them
    (a reader that still maps one keeps its inode alive until it lets go)."""
    d = trash_dir(pdir)
    names = fs.listdir(d)
    for name in names:
        fs.delete(f"{d}/{name}")
    return len(names)


#: deletions deferred by ``empty_trash_later`` (Kafka's file.delete.delay.ms)
_pending_deletes: list[threading.Thread] = []


def empty_trash_later(fs: Backend, pdir: str, delay_s: float) -> None:
    """``empty_trash`` in ``delay_s`` seconds, in a thread of its own."""
    def run():
        time.sleep(delay_s)
        empty_trash(fs, pdir)
    t = threading.Thread(target=run, name="kcompact-delete", daemon=True)
    t.start()
    _pending_deletes.append(t)


def wait_for_deletes() -> None:
    """Block until deferred segment deletions are done (called before a CLI process exits)."""
    while _pending_deletes:
        _pending_deletes.pop().join()
