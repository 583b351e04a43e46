"""Every path and suffix of a store, in one place (the way Kafka's LogFileUtils owns them).

Layout (docs/formats/README.md):

    store.json
    commitlog/<writer>/<20-digit base position>.log
    commitlog/<writer>/reput.checkpoint
    partitions/<topic>/<partition>/<20-digit base offset>.log   (+ .bcq, same base name)
    partitions/<topic>/<partition>/segments.json   (the segment list)
    partitions/<topic>/<partition>/compaction.checkpoint
    partitions/<topic>/<partition>/.compacting/   .replicating/
    quarantine/<run>/report.json, quarantine/<run>/partitions/...   (kcompact repair)
    .repair/<run>/                                 (a repair's staging)

Offsets and positions are zero-padded to 20 digits so that `ls` sorts the files numerically.
Paths are '/'-separated and relative to the store root; backends map them to files or keys.

On S3 (docs/formats/manifest.md) sealed segments are immutable objects named
``<20-digit base>-<16 hex>.log`` (and ``.bcq``), listed by the partition's manifest versions
``partitions/<topic>/<partition>/manifest/<20-digit version>.json``. A store with shared
uploads (docs/formats/shared-upload.md) also holds ``shared/<writer>/<20-digit seq>-<16 hex>.kso``
objects and their journal entries ``shared/<writer>/journal/<20-digit seq>.json``.
"""

from __future__ import annotations

import re

from .errors import ReputError
from .record import validate_topic

STORE_JSON = "store.json"
#: flock taken around a read-modify-write of store.json (local stores; reput/locks.py)
STORE_JSON_LOCK = "store.json.lock"
COMMITLOG_DIR = "commitlog"
PARTITIONS_DIR = "partitions"
LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".bcq"
REPUT_CHECKPOINT = "reput.checkpoint"
COMPACTION_CHECKPOINT = "compaction.checkpoint"
SEGMENT_LIST = "segments.json"
COMPACTING_DIR = ".compacting"
#: S3 stores: a writer's local segments sealed into format 2 just before their upload
SEALING_DIR = ".sealing"
REPLICATING_DIR = ".replicating"
DELETED_DIR = ".deleted"
LOCK_FILE = "writer.lock"
COMPACTION_LOCK = "compaction.lock"
TMP_SUFFIX = ".tmp"
MANIFEST_DIR = "manifest"
#: `kcompact repair` (docs/formats/quarantine.md): the damaged files it replaced, as evidence,
#: and where it builds a repaired partition before the swap
QUARANTINE_DIR = "quarantine"
REPAIR_DIR = ".repair"
MANIFEST_SUFFIX = ".json"
#: S3 stores with shared uploads (docs/formats/shared-upload.md)
SHARED_DIR = "shared"
JOURNAL_DIR = "journal"
SHARED_SUFFIX = ".kso"
#: compaction objects (docs/formats/compaction-object.md): one per compaction run on S3
COMPACTED_DIR = "compacted"
COMPACTED_SUFFIX = ".kco"

_BASE_RE = re.compile(r"^(\d{20})\.(log|bcq)$")
_OBJECT_RE = re.compile(r"^(\d{20})-([0-9a-f]{16})\.(log|bcq)$")
_MANIFEST_RE = re.compile(r"^(\d{20})\.json$")
_SHARED_RE = re.compile(r"^(\d{20})-([0-9a-f]{16})\.kso$")
_COMPACTED_RE = re.compile(r"^(\d{20})-([0-9a-f]{16})\.kco$")
_WRITER_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def base_name(n: int) -> str:
    return f"{n:020d}"


def parse_base(name: str) -> tuple[int, str] | None:
    """'00000000000000000042.log' -> (42, 'log'); None for other names."""
    m = _BASE_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def segment_object(base: int, tag: str, suffix: str) -> str:
    """An immutable segment object's name on S3: '<20-digit base>-<16 hex tag><suffix>'."""
    return f"{base_name(base)}-{tag}{suffix}"


def parse_segment_object(name: str) -> tuple[int, str, str] | None:
    """'00000000000000000042-9f3a0c11d2e4b5a6.log' -> (42, '9f3a0c11d2e4b5a6', 'log')."""
    m = _OBJECT_RE.match(name)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


def is_immutable_object(path: str) -> bool:
    """Is ``path`` a sealed segment object (never rewritten: safe to cache by name)?"""
    name = path.rsplit("/", 1)[-1]
    return (_OBJECT_RE.match(name) is not None or _SHARED_RE.match(name) is not None
            or _COMPACTED_RE.match(name) is not None)


def compaction_object(created_ms: int, tag: str) -> str:
    """A compaction object's path in the store: 'compacted/<20-digit ms>-<16 hex tag>.kco'."""
    return f"{COMPACTED_DIR}/{base_name(created_ms)}-{tag}{COMPACTED_SUFFIX}"


def parse_compaction_object(path: str) -> tuple[int, str] | None:
    """'compacted/00000001763766000000-9f3a0c11d2e4b5a6.kco' -> (1763766000000, tag); None for
    anything else (a path elsewhere included: a damaged manifest must not name another key)."""
    d, _, name = path.rpartition("/")
    m = _COMPACTED_RE.match(name) if d == COMPACTED_DIR else None
    return (int(m.group(1)), m.group(2)) if m else None


def shared_object(seq: int, tag: str) -> str:
    """A shared upload object's name: '<20-digit seq>-<16 hex tag>.kso'."""
    return f"{base_name(seq)}-{tag}{SHARED_SUFFIX}"


def parse_shared_object(name: str) -> tuple[int, str] | None:
    """'00000000000000000041-9f3a0c11d2e4b5a6.kso' -> (41, '9f3a0c11d2e4b5a6')."""
    m = _SHARED_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def journal_path(writer: str, seq: int) -> str:
    return f"{SHARED_DIR}/{writer}/{JOURNAL_DIR}/{base_name(seq)}{MANIFEST_SUFFIX}"


def is_journal_entry(path: str) -> bool:
    """Is ``path`` a shared upload journal entry (written once, by a conditional put)?"""
    bits = path.split("/")
    return (len(bits) == 4 and bits[0] == SHARED_DIR and bits[2] == JOURNAL_DIR
            and _MANIFEST_RE.match(bits[3]) is not None)


def manifest_dir(pdir: str) -> str:
    return f"{pdir}/{MANIFEST_DIR}"


def manifest_path(pdir: str, version: int) -> str:
    return f"{pdir}/{MANIFEST_DIR}/{base_name(version)}{MANIFEST_SUFFIX}"


def parse_manifest_name(name: str) -> int | None:
    """'00000000000000000007.json' -> 7; None for other names."""
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def validate_writer(writer: str) -> str:
    if not _WRITER_RE.match(writer) or writer in (".", ".."):
        raise ReputError(f"invalid writer id {writer!r}: use 1-128 characters of a-zA-Z0-9._-")
    return writer


def valid_writer(writer: str) -> bool:
    return bool(_WRITER_RE.match(writer)) and writer not in (".", "..")


def writer_dir(writer: str) -> str:
    return f"{COMMITLOG_DIR}/{validate_writer(writer)}"


def commitlog_segment(writer: str, base: int) -> str:
    return f"{writer_dir(writer)}/{base_name(base)}{LOG_SUFFIX}"


def reput_checkpoint(writer: str) -> str:
    return f"{writer_dir(writer)}/{REPUT_CHECKPOINT}"


def writer_lock(writer: str) -> str:
    return f"{writer_dir(writer)}/{LOCK_FILE}"


def topic_dir(topic: str) -> str:
    return f"{PARTITIONS_DIR}/{validate_topic(topic)}"


def partition_dir(topic: str, partition: int) -> str:
    if not isinstance(partition, int) or partition < 0:
        raise ReputError(f"invalid partition {partition!r}: use an integer >= 0")
    return f"{topic_dir(topic)}/{partition}"


def segment_log(topic: str, partition: int, base: int, sub: str | None = None) -> str:
    d = partition_dir(topic, partition) + (f"/{sub}" if sub else "")
    return f"{d}/{base_name(base)}{LOG_SUFFIX}"


def segment_index(topic: str, partition: int, base: int, sub: str | None = None) -> str:
    d = partition_dir(topic, partition) + (f"/{sub}" if sub else "")
    return f"{d}/{base_name(base)}{INDEX_SUFFIX}"


def segment_list(topic: str, partition: int) -> str:
    return f"{partition_dir(topic, partition)}/{SEGMENT_LIST}"


def compaction_checkpoint(topic: str, partition: int) -> str:
    return f"{partition_dir(topic, partition)}/{COMPACTION_CHECKPOINT}"


def compaction_lock(topic: str, partition: int) -> str:
    return f"{partition_dir(topic, partition)}/{COMPACTION_LOCK}"


def compacting_dir(topic: str, partition: int) -> str:
    return f"{partition_dir(topic, partition)}/{COMPACTING_DIR}"


def replicating_dir(topic: str, partition: int) -> str:
    return f"{partition_dir(topic, partition)}/{REPLICATING_DIR}"
