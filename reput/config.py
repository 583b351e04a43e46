"""Typed, validated configuration: topic configs (Kafka's names) and store/writer options.

Each topic config key has a name, a default, a doc string and a validator, as in Kafka's
LogConfig/CleanerConfig; unknown keys are rejected naming the key. Values arrive as strings
(properties files, CLI) or native types (store.json) and are normalised here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from kcompact.errors import ConfigError  # the one configuration error (kcompact/errors.py)


DAY_MS = 24 * 3600 * 1000
LONG_MAX = 2**63 - 1


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


def _ratio(name: str, v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number between 0 and 1, got {v!r}") from None
    if not 0.0 <= f <= 1.0:
        raise ConfigError(f"{name}: {f} is out of range [0, 1]")
    return f


COMPRESSION_TYPES = ("uncompressed", "gzip", "snappy", "lz4", "zstd", "producer")


def _compression(name: str, v: Any) -> str:
    s = str(v).strip().lower()
    if s not in COMPRESSION_TYPES:
        raise ConfigError(f"{name}: expected one of {', '.join(COMPRESSION_TYPES)}, got {v!r}")
    return s


def _policy(name: str, v: Any) -> str:
    parts = sorted(p.strip() for p in str(v).replace(" ", "").split(",") if p.strip())
    if parts not in (["compact"], ["compact", "delete"], ["delete"]):
        raise ConfigError(f"{name}: expected 'compact', 'delete' or 'compact,delete', got {v!r}")
    return ",".join(parts)


@dataclass(frozen=True)
class _Key:
    name: str
    attr: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str


TOPIC_KEYS: tuple[_Key, ...] = (
    _Key("cleanup.policy", "cleanup_policy", "compact", _policy,
         "'compact' keeps the latest record per key; 'compact,delete' also drops segments "
         "older than retention.ms."),
    _Key("delete.retention.ms", "delete_retention_ms", DAY_MS, _int_at_least(0),
         "How long a tombstone is kept after the compaction that first cleaned it."),
    _Key("min.compaction.lag.ms", "min_compaction_lag_ms", 0, _int_at_least(0),
         "Records younger than this are never compacted."),
    _Key("max.compaction.lag.ms", "max_compaction_lag_ms", LONG_MAX, _int_at_least(1),
         "A partition whose oldest dirty record is older than this is compacted whatever its "
         "dirty ratio."),
    _Key("min.cleanable.dirty.ratio", "min_cleanable_dirty_ratio", 0.5, _ratio,
         "Compact a partition when dirty bytes / total bytes reaches this."),
    _Key("segment.bytes", "segment_bytes", 1 << 30, _int_at_least(1 << 14, (1 << 31) - 1),
         "Maximum size of a compaction-log segment before it is sealed and a new one starts."),
    _Key("segment.ms", "segment_ms", 7 * DAY_MS, _int_at_least(1),
         "The active segment is rolled when a record arrives this long (by its timestamp) "
         "after the segment's first record; with cleanup.policy=compact the roll time is "
         "min(segment.ms, max.compaction.lag.ms) (Kafka's KIP-354)."),
    _Key("retention.ms", "retention_ms", 7 * DAY_MS, _int_at_least(-1),
         "With cleanup.policy=compact,delete: segments whose newest record is older are "
         "deleted; -1 keeps them forever."),
    _Key("compression.type", "compression_type", "zstd", _compression,
         "Codec of sealed (format-2) segments' batches: the source topic's when a mirror synced "
         "one; 'producer' means zstd (docs/formats/segment-v2.md)."),
    _Key("compression.zstd.level", "compression_zstd_level", 3, _int_at_least(1, 22),
         "zstd level of sealed segments' batches (KIP-390's name)."),
    _Key("compression.batch.bytes", "compression_batch_bytes", 8 << 10,
         _int_at_least(1 << 10, 64 << 20),
         "Uncompressed bytes of records per stored batch of a sealed segment (a read of one "
         "record decodes its whole batch; measured, docs/formats/segment-v2.md)."),
)
_BY_NAME = {k.name: k for k in TOPIC_KEYS}


@dataclass(frozen=True)
class TopicConfig:
    cleanup_policy: str = "compact"
    delete_retention_ms: int = DAY_MS
    min_compaction_lag_ms: int = 0
    max_compaction_lag_ms: int = LONG_MAX
    min_cleanable_dirty_ratio: float = 0.5
    segment_bytes: int = 1 << 30
    segment_ms: int = 7 * DAY_MS
    retention_ms: int = 7 * DAY_MS
    compression_type: str = "zstd"
    compression_zstd_level: int = 3
    compression_batch_bytes: int = 8 << 10

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "TopicConfig":
        return cls().with_overrides(d or {})

    def with_overrides(self, d: dict[str, Any]) -> "TopicConfig":
        changes = {}
        for name, value in d.items():
            key = _BY_NAME.get(name)
            if key is None:
                raise ConfigError(f"unknown topic config {name!r}; known keys: "
                                  + ", ".join(sorted(_BY_NAME)))
            changes[key.attr] = key.check(name, value)
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


FSYNC_POLICIES = ("always", "flush", "never")
SEAL_MODES = ("flush", "background")


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
    """

    commitlog_segment_bytes: int = 1 << 30
    fsync: str = "flush"
    commitlog_retention_ms: int = 3600 * 1000
    verify_crc_on_dispatch: bool = False
    seal_format: int = 2
    seal: str = "flush"

    def __post_init__(self):
        _int_at_least(1 << 16, 1 << 40)("commitlog.segment.bytes", self.commitlog_segment_bytes)
        _int_at_least(0)("commitlog.retention.ms", self.commitlog_retention_ms)
        if self.seal_format not in (1, 2):
            raise ConfigError(f"seal_format: expected 1 or 2, got {self.seal_format!r}")
        if self.seal not in SEAL_MODES:
            raise ConfigError(f"seal: expected one of {', '.join(SEAL_MODES)}, got {self.seal!r}")
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
