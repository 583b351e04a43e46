"""A partition's damage record: damage found is remembered beside the partition until repaired.

Spec: docs/formats/damage-record.md. ``partitions/<t>/<p>/damage.json`` (on S3 a key beside the
manifest) says where whatever found damage in the partition found it first: the file, the byte,
the reason, who found it (``compact``, ``background compaction``, ``verify``, ``inspect
--verify``, a reader such as ``dump`` or the Kafka endpoint) and when (ms since the epoch, the
finder's clock). Written whole (``Backend.write_atomic``) and only when the damage is news (the
same file, byte and reason already recorded: left as it is, keeping the first time found), so a
reader meeting the same damage again writes nothing. ``kcompact inspect`` shows it and exits 1;
``kcompact repair`` deletes it with the damaged files, and so does a compaction that rewrites
the partition without the recorded file (compaction/damage.py). Recording is best effort: a
store the finder cannot write (a read-only mount, missing S3 permissions) keeps no record, and
the finder still reports the damage as before.
"""

from __future__ import annotations

import json

from . import filenames as fn
from .backend import Backend
from .errors import ReputError

FORMAT_VERSION = 1
NAME = "damage.json"


def path(topic: str, partition: int) -> str:
    return f"{fn.partition_dir(topic, partition)}/{NAME}"


def read(fs: Backend, topic: str, partition: int) -> dict | None:
    """The partition's record (``topic, partition, path, position, reason, found_by,
    found_ms``), None when it has none. A record that does not parse is itself reported as the
    partition's damage (something wrote it, and only damage writes it)."""
    p = path(topic, partition)
    try:
        raw = fs.read(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("reason"), str):
            raise ValueError("not a damage record")
        pos = doc.get("position")
        return {"topic": topic, "partition": partition,
                "path": doc.get("path") if isinstance(doc.get("path"), str) else None,
                "position": pos if isinstance(pos, int) and not isinstance(pos, bool) else None,
                "reason": doc["reason"],
                "found_by": str(doc.get("found_by") or ""),
                "found_ms": doc.get("found_ms") if isinstance(doc.get("found_ms"), int) else None}
    except (ValueError, UnicodeDecodeError):
        return {"topic": topic, "partition": partition, "path": p, "position": 0,
                "reason": f"{p}: an unreadable damage record (damage was found earlier)",
                "found_by": "", "found_ms": None}


def write(fs: Backend, topic: str, partition: int, *, path_: str | None,
          position: int | None, reason: str, found_by: str, found_ms: int) -> bool:
    """Record damage unless the same is recorded already; whether it wrote (best effort:
    False when the store cannot be written)."""
    try:
        old = read(fs, topic, partition)
        if old is not None and (old["path"], old["position"], old["reason"]) == \
                (path_, position, reason):
            return False
        doc = {"format_version": FORMAT_VERSION, "topic": topic, "partition": partition,
               "path": path_, "position": position, "reason": reason,
               "found_by": found_by, "found_ms": int(found_ms)}
        fs.write_atomic(path(topic, partition),
                        json.dumps(doc, sort_keys=True, indent=1).encode())
        return True
    except (OSError, ReputError):  # (a read-only store, an object store's refusal)
        return False


def clear(fs: Backend, topic: str, partition: int) -> bool:
    """Delete the record; whether there was one."""
    try:
        if not fs.exists(path(topic, partition)):
            return False
        fs.delete(path(topic, partition))
        return True
    except FileNotFoundError:
        return False


__all__ = ["FORMAT_VERSION", "NAME", "clear", "path", "read", "write"]
