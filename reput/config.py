"""Typed, validated configuration: topic configs (Kafka's names) and store/writer options.

:data:`TOPIC_CONFIG` is the table of topic configs, Kafka's LogConfig in kcompact's one shape
(reput/configdef.py): each key written once with its type, default, validator and doc. The
:class:`TopicConfig` dataclass takes its defaults from it, store.json's values are parsed by it,
and the user guide's reference page is generated from it. Unknown keys are rejected naming the
key. Values arrive as strings (properties files, CLI) or native types (store.json) and are
normalised here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any

from .configdef import ConfigDef, Importance, Type, at_least, between, one_of
from .errors import ConfigError  # kcompact's one configuration error (kcompact/errors.py)

DAY_MS = 24 * 3600 * 1000
LONG_MAX = 2**63 - 1

COMPRESSION_TYPES = ("uncompressed", "gzip", "snappy", "lz4", "zstd", "producer")


def _policy(name: str, v: Any) -> str:
    parts = sorted(p.strip() for p in str(v).replace(" ", "").split(",") if p.strip())
    if parts not in (["compact"], ["compact", "delete"], ["delete"]):
        raise ConfigError(f"{name}: expected 'compact', 'delete' or 'compact,delete', got {v!r}")
    return ",".join(parts)


_policy.__doc__ = "[compact, delete, compact,delete]"

#: Topic configs (Kafka's names), the store's defaults, ranges and meaning.
TOPIC_CONFIG = (
    ConfigDef()
    .define("cleanup.policy", Type.STRING, "compact", _policy, Importance.HIGH,
            "'compact' keeps the latest record per key; 'compact,delete' also drops segments "
            "older than retention.ms; 'delete' only drops them. (Kafka's default is 'delete'; "
            "a store's is 'compact'.)")
    .define("delete.retention.ms", Type.LONG, DAY_MS, at_least(0), Importance.MEDIUM,
            "How long a tombstone is kept after the compaction that first cleaned it, in ms.")
    .define("min.compaction.lag.ms", Type.LONG, 0, at_least(0), Importance.MEDIUM,
            "Records younger than this (ms, by their timestamp) are never compacted.")
    .define("max.compaction.lag.ms", Type.LONG, LONG_MAX, at_least(1), Importance.MEDIUM,
            "A partition whose oldest dirty record is older than this (ms) is compacted "
            "whatever its dirty ratio.")
    .define("min.cleanable.dirty.ratio", Type.DOUBLE, 0.5, between(0, 1), Importance.MEDIUM,
            "Compact a partition when dirty bytes / (clean + dirty bytes) reaches this.")
    .define("segment.bytes", Type.INT, 1 << 30, between(1 << 14, (1 << 31) - 1),
            Importance.MEDIUM,
            "Maximum size of a compaction-log segment before it is sealed and a new one starts "
            "(a segment is the unit of a compaction rewrite and of an S3 upload).")
    .define("segment.ms", Type.LONG, 7 * DAY_MS, at_least(1), Importance.MEDIUM,
            "The active segment is rolled when a record arrives this long (ms, by its "
            "timestamp) after the segment's first record; with cleanup.policy=compact the roll "
            "time is min(segment.ms, max.compaction.lag.ms) (Kafka's KIP-354).")
    .define("retention.ms", Type.LONG, 7 * DAY_MS, at_least(-1), Importance.MEDIUM,
            "With cleanup.policy=compact,delete: segments whose newest record is older (ms) are "
            "deleted; -1 keeps them forever.")
    .define("compression.type", Type.STRING, "producer", one_of(*COMPRESSION_TYPES),
            Importance.MEDIUM,
            "Codec of sealed (format-2) segments' batches. 'producer' (Kafka's meaning, the "
            "default of a store whose store.json lists the source-codec feature, i.e. created "
            "by a kcompact that has it; an older store's default stays zstd): stored batches "
            "keep their codec, and records a mirror consumed are sealed with the codec the "
            "mirror read the source's batches with (store.json source_codecs; uncompressed "
            "when it could not). A codec (zstd, "
            "lz4, snappy, gzip, uncompressed) recompresses; a change re-encodes every segment "
            "at the partition's next compaction (docs/formats/segment-v2.md).")
    .define("compression.zstd.level", Type.INT, 3, between(1, 22), Importance.LOW,
            "zstd level of sealed segments' batches (KIP-390's name).")
    .define("compression.batch.bytes", Type.INT, 8 << 10, between(1 << 10, 64 << 20),
            Importance.LOW,
            "Uncompressed bytes of records per stored batch of a sealed segment (a read of one "
            "record decodes its whole batch; docs/formats/segment-v2.md says how 8 KiB was "
            "chosen).")
)
#: The keys of :data:`TOPIC_CONFIG`, in order.
TOPIC_KEYS = tuple(TOPIC_CONFIG)


def _default(name: str) -> Any:
    return TOPIC_CONFIG[name].default


def topic_key(name: str):
    """The key's definition, or a ConfigError naming the known keys."""
    if name not in TOPIC_CONFIG:
        raise ConfigError(f"unknown topic config {name!r}; known keys: "
                          + ", ".join(sorted(TOPIC_CONFIG.names())))
    return TOPIC_CONFIG[name]


@dataclass(frozen=True)
class TopicConfig:
    """A topic's effective configs; one field per :data:`TOPIC_CONFIG` key (its name with
    ``_`` for ``.``), whose default is the table's."""

    cleanup_policy: str = _default("cleanup.policy")
    delete_retention_ms: int = _default("delete.retention.ms")
    min_compaction_lag_ms: int = _default("min.compaction.lag.ms")
    max_compaction_lag_ms: int = _default("max.compaction.lag.ms")
    min_cleanable_dirty_ratio: float = _default("min.cleanable.dirty.ratio")
    segment_bytes: int = _default("segment.bytes")
    segment_ms: int = _default("segment.ms")
    retention_ms: int = _default("retention.ms")
    compression_type: str = _default("compression.type")
    compression_zstd_level: int = _default("compression.zstd.level")
    compression_batch_bytes: int = _default("compression.batch.bytes")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "TopicConfig":
        return cls().with_overrides(d or {})

    def with_overrides(self, d: dict[str, Any]) -> "TopicConfig":
        changes = {}
        for name, value in d.items():
            key = topic_key(name)
            changes[key.attr] = key.parse(value)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k.name: getattr(self, k.attr) for k in TOPIC_KEYS}

    @property
    def compact(self) -> bool:
        return "compact" in self.cleanup_policy.split(",")

    @property
    def delete(self) -> bool:
        return "delete" in self.cleanup_policy.split(",")

    @property
    def roll_ms(self) -> int:
        """How long the active segment stays active: ``segment.ms``, or for a compacted topic
        ``min(segment.ms, max.compaction.lag.ms)`` so that no record waits longer than the lag
        to become cleanable (Kafka's KIP-354)."""
        if self.compact:
            return min(self.segment_ms, self.max_compaction_lag_ms)
        return self.segment_ms


# one field per key, in the table's order: a key added to one and not the other fails at import
assert [f.name for f in fields(TopicConfig)] == [k.attr for k in TOPIC_KEYS], \
    "TopicConfig's fields and TOPIC_CONFIG's keys differ"


def _int_at_least(lo: int, hi: int = LONG_MAX):
    def check(name: str, v: Any) -> int:
        try:
            iv = int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}") from None
        if iv < lo or iv > hi:
            raise ConfigError(f"{name}: {iv} is out of range [{lo}, {hi}]")
        return iv
    return check


FSYNC_POLICIES = ("always", "flush", "never")
SEAL_MODES = ("flush", "background")
UPLOAD_MODES = ("auto", "shared", "partition")


@dataclass(frozen=True)
class WriterOptions:
    """How a commit-log writer appends.

    fsync: 'always' (every append), 'flush' (on Store.flush, the default), 'never' (the OS).
    seal_format: the store format a rolled segment is sealed into at the next flush: 2 (a
    Kafka log segment, docs/formats/segment-v2.md, the default) or 1 (left as appended: a
    store a kcompact that knows only format 1 can still read, until a compaction).
    seal: where a rolled segment is sealed: 'flush' (inline, by the next flush: the default) or
    'background' (a thread of the writer, while it appends; the writer's close does not wait
    for the segments still queued: they stay format 1 until the next writer of the partition,
    a compaction or ``kcompact compact`` seals them; reput/seal.py).
    fold: where a writer with shared uploads on a store with a catalog folds its journal
    entries into the catalog (docs/formats/store-catalog.md), every few flushes: 'flush'
    (inline, by the flush that commits the last of them: the default) or 'background' (a thread
    of the writer, after that flush, while appends go on; the writer's close waits for it and
    folds what is left). Not a commit point either way.
    upload: how an S3 writer's flush uploads (docs/formats/shared-upload.md): 'shared' (one
    object for every partition it wrote and one journal entry: 2 PUTs a flush, whatever the
    partition count; the store becomes format 3), 'partition' (a .log, a .bcq and a manifest
    version per partition) or 'auto' (the default: 'shared' for a store it creates or one that
    already uses shared uploads, else 'partition'). Local stores ignore it.
    """

    commitlog_segment_bytes: int = 1 << 30
    fsync: str = "flush"
    commitlog_retention_ms: int = 3600 * 1000
    verify_crc_on_dispatch: bool = False
    seal_format: int = 2
    seal: str = "flush"
    upload: str = "auto"
    fold: str = "flush"

    def __post_init__(self):
        _int_at_least(1 << 16, 1 << 40)("commitlog.segment.bytes", self.commitlog_segment_bytes)
        _int_at_least(0)("commitlog.retention.ms", self.commitlog_retention_ms)
        if self.seal_format not in (1, 2):
            raise ConfigError(f"seal_format: expected 1 or 2, got {self.seal_format!r}")
        if self.upload not in UPLOAD_MODES:
            raise ConfigError(f"upload: expected one of {', '.join(UPLOAD_MODES)}, got "
                              f"{self.upload!r}")
        if self.upload == "shared" and self.seal_format != 2:
            raise ConfigError("upload: 'shared' uploads format-2 segments; it needs seal_format 2")
        if self.seal not in SEAL_MODES:
            raise ConfigError(f"seal: expected one of {', '.join(SEAL_MODES)}, got {self.seal!r}")
        if self.fold not in SEAL_MODES:
            raise ConfigError(f"fold: expected one of {', '.join(SEAL_MODES)}, got {self.fold!r}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync: expected one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")


class Clock:
    """Injected time source (Kafka's ``Time``): tests pass a ManualClock, no sleeps."""

    def ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        """Seconds on a monotonic clock, for durations (reput/timing.py)."""
        return time.perf_counter()


SYSTEM_CLOCK = Clock()


@dataclass
class ManualClock(Clock):
    now_ms: int = 1_700_000_000_000

    def ms(self) -> int:
        return self.now_ms

    def monotonic(self) -> float:
        return self.now_ms / 1000

    def advance(self, ms: int) -> None:
        self.now_ms += ms


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]
