"""What `kcompact repair` does for the damage that is not a partition's: store.json and the
commit logs (docs/operations-damage.md; the partitions are reput/salvage.py's).

* **store.json** that does not read (docs/formats/store-json.md: checksum, JSON, fields) is
  rebuilt: from its own fields when its JSON still parses (each field validated as on open),
  else from what can be found in its bytes (the store id, the digest secret), else new ones.
  What could not be recovered is said (topic configs back to their defaults; a new digest
  secret, with which every partition's index is then rebuilt: the digests are the store's, the
  records are not changed). A store.json that is missing while the store holds partitions or
  commit logs is rebuilt the same way.
* **A commit-log segment** whose records fail their CRC: its records below the writer's reput
  checkpoint are already in their partitions, so a segment wholly below it is set aside and
  nothing is lost; one with undispatched records keeps its records up to the damage, and what
  followed is said (those records' partitions end before them: a mirror reads them again from
  Kafka). A reput checkpoint that does not read is set aside (the writer then dispatches its
  whole log again: dispatch is idempotent).

Each damaged file is moved (or copied, when it is rewritten in place) to
``quarantine/<run>/`` first (reput/quarantine.py).
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from typing import Callable

from . import _kernels as K
from . import _native as _N
from . import filenames as fn
from .backend import Backend
from .errors import CorruptRecordError, StoreFormatError
from .repair_kinds import repair_kind_for
from .store import FEATURE_SEGMENT_LIST, StoreMeta

_ID = re.compile(rb'"store_id"\s*:\s*"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-'
                 rb'[0-9a-f]{12})"')
_SECRET = re.compile(rb'"secret"\s*:\s*"([0-9a-f]{32})"')
_CREATED = re.compile(rb'"created_ms"\s*:\s*(\d{1,15})')


def looks_like_store(fs: Backend) -> bool:
    """Whether ``fs`` holds a store's data (partitions or commit logs) without its store.json."""
    return bool(fs.listdir(fn.PARTITIONS_DIR)) or bool(fs.listdir(fn.COMMITLOG_DIR))


def rebuild_store_json(fs: Backend, now_ms: int) -> tuple[StoreMeta, list[str]] | None:
    """The store.json to write instead of one that does not read, and what could not be
    recovered (module docstring); None when it reads (or there is no store here)."""
    try:
        raw = fs.read(fn.STORE_JSON)
    except FileNotFoundError:
        if not looks_like_store(fs):
            return None
        raw = b""
    try:
        StoreMeta.from_json(raw, fs.url)
        return None
    except StoreFormatError:
        pass
    notes: list[str] = []
    meta = _from_fields(raw)
    if meta is not None:
        notes.append("store.json failed its checks; rebuilt from its own fields, each "
                     "validated (check the topic configs: `kcompact configs --describe`)")
        return meta, notes
    m = _ID.search(raw)
    store_id = m.group(1).decode() if m else str(uuid.uuid4())
    if not m:
        notes.append("the store id could not be recovered: a new one (a replica of this store "
                     "rebuilds from offset 0)")
    m = _SECRET.search(raw)
    if m:
        secret = bytes.fromhex(m.group(1).decode())
    else:
        secret = secrets.token_bytes(16)
        notes.append("the digest secret could not be recovered: a new one, every partition's "
                     "index rebuilt with it")
    m = _CREATED.search(raw)
    created = int(m.group(1)) if m else now_ms
    notes.append("topic configs could not be recovered: every topic back to the defaults (set "
                 "them again with `kcompact configs --alter`, or a mirror syncs them)")
    meta = StoreMeta(store_id, secret, created, {},
                     features=repair_kind_for(fs).store_features(FEATURE_SEGMENT_LIST))
    return meta, notes


def _from_fields(raw: bytes) -> StoreMeta | None:
    """A StoreMeta from store.json's own fields when its JSON parses (checksum aside)."""
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            return None
        d.pop("crc32c", None)
        return StoreMeta.from_json(json.dumps(d).encode(), "store.json")
    except (ValueError, RecursionError, StoreFormatError, TypeError):
        return None


def commitlog_segments(fs: Backend):
    """Every commit-log segment of ``fs``: (writer, base, size, byte where its damage starts
    or None, what), as ``kcompact verify`` checks them (a torn tail of a writer's last segment
    is not damage: the writer cuts it on open)."""
    for writer in fs.listdir(fn.COMMITLOG_DIR):
        try:
            fn.validate_writer(writer)
        except Exception:  # noqa: BLE001 - not a writer's directory
            continue
        bases = sorted(b for b, kind in filter(None, map(fn.parse_base,
                                                          fs.listdir(fn.writer_dir(writer))))
                       if kind == "log")
        for k, base in enumerate(bases):
            size = fs.size(fn.commitlog_segment(writer, base))
            stop, status = 0, K.SCAN_OK
            if size:
                buf = fs.map(fn.commitlog_segment(writer, base), size)
                _, stop, status = _N.count_records(buf, 0, size, True)
                del buf
            if status == K.SCAN_OK or (status == K.SCAN_TORN and k == len(bases) - 1):
                yield writer, base, size, None, None
            else:
                yield writer, base, size, int(stop), ("corrupt record"
                                                      if status == K.SCAN_CORRUPT
                                                      else "torn record")


def damaged_commitlogs(fs: Backend) -> list[tuple[str, int, int, int, str]]:
    """(writer, segment base, its size, byte where its damage starts, what) of each damaged
    commit-log segment (``commitlog_segments``)."""
    return [c for c in commitlog_segments(fs) if c[3] is not None]


def commitlogs_damaged(fs: Backend) -> bool:
    """Whether a commit log of ``fs`` has a damaged segment or an unreadable checkpoint."""
    for writer in fs.listdir(fn.COMMITLOG_DIR):
        try:
            fn.validate_writer(writer)
        except Exception:  # noqa: BLE001 - not a writer's directory
            continue
        try:
            reput_checkpoint(fs, writer)
        except CorruptRecordError:
            return True
    return bool(damaged_commitlogs(fs))


def reput_checkpoint(fs: Backend, writer: str) -> int | None:
    """The writer's reput checkpoint; None when it is missing; raises CorruptRecordError when
    it does not read."""
    path = fn.reput_checkpoint(writer)
    try:
        raw = fs.read(path)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
        pos = int(d["position"])
        if d.get("version") != 1 or pos < 0:
            raise ValueError
        return pos
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CorruptRecordError(f"{path}: unreadable reput checkpoint", path, 0) from None


def salvage_commitlogs(fs: Backend, set_aside: Callable[[Backend, str], str],
                       keep_copy: Callable[[Backend, str], str]) -> list[dict]:
    """Repair the commit logs of ``fs`` (module docstring). ``set_aside(fs, path)`` moves a file
    to quarantine, ``keep_copy(fs, path)`` copies it there; both return where. Returns one
    entry per file changed, for the report."""
    out = []
    for writer in fs.listdir(fn.COMMITLOG_DIR):
        try:
            fn.validate_writer(writer)
            reput_checkpoint(fs, writer)
        except CorruptRecordError as e:
            out.append({"file": e.path, "what": "unreadable reput checkpoint; set aside (the "
                        "writer dispatches its whole log again, idempotently)",
                        "quarantine": set_aside(fs, e.path), "lost": None})
        except Exception:  # noqa: BLE001 - not a writer's directory
            continue
    for writer, base, size, stop, what in damaged_commitlogs(fs):
        path = fn.commitlog_segment(writer, base)
        ckpt = reput_checkpoint(fs, writer)
        if ckpt is not None and base + size <= ckpt:
            out.append({"file": path, "what": f"{what} at byte {stop}; every record of it was "
                        "dispatched: set aside, nothing lost", "quarantine": set_aside(fs, path),
                        "lost": None})
            continue
        where = keep_copy(fs, path)
        f = fs.open_append(path)
        try:
            f.truncate(stop)
            f.sync()
        finally:
            f.close()
        lo = max(base + stop, ckpt or 0)
        out.append({"file": path, "what": f"{what} at byte {stop}; cut there (the records "
                    "after it were not yet dispatched: their partitions end before them, and a "
                    "mirror reads them again from Kafka)", "quarantine": where,
                    "lost": {"commitlog_bytes": [lo, base + size]}})
    return out


__all__ = ["commitlog_segments", "commitlogs_damaged", "damaged_commitlogs", "looks_like_store", "rebuild_store_json", "reput_checkpoint",
           "salvage_commitlogs"]
