"""Errors of the storage layer. Catch ``ReputError`` for all of them."""

from __future__ import annotations

from kcompact.errors import ConfigError, KcompactError  # noqa: F401  (ConfigError: kcompact's one)


class ReputError(KcompactError):
    """Root of every error raised by the store."""


class InvalidTopicError(ReputError, ValueError):
    """A topic name Kafka would reject: use 1-249 characters of a-zA-Z0-9._- ."""


class StoreNotFoundError(ReputError):
    """The path is not a kcompact store: pass the directory that holds store.json, or create one."""


class StoreFormatError(ReputError):
    """store.json is unreadable, truncated, or from a newer kcompact: upgrade kcompact or restore it."""


class CorruptRecordError(ReputError):
    """A record or index entry failed its checks. ``path`` and ``position`` say where.

    The store never serves such bytes as data: run `kcompact verify` to list every problem, then
    rebuild the partition from a replica (`kcompact replicate`) or from the source topic.

    Raised by a read (reput/reader.py), it also carries ``last_good_offset`` (the offset of the
    last record before the damage that passed every check, None if none did) and ``prefix``
    (those verified records of the block, a ``RecordColumns``, or None): an iterating reader
    hands them out before it raises.
    """

    def __init__(self, message: str, path: str | None = None, position: int | None = None, *,
                 last_good_offset: int | None = None, prefix=None):
        super().__init__(message)
        self.path = path
        self.position = position
        self.last_good_offset = last_good_offset
        self.prefix = prefix


class OffsetOrderError(ReputError, ValueError):
    """Records of a partition must arrive with strictly increasing offsets above the stored ones."""


class StoreLockedError(ReputError):
    """Another process writes to this commit log (one writer per commitlog/<writer>/ at a time)
    or to this partition. ``by_writer``: the partition's holder is a writer, which keeps it as
    long as it runs (not a compaction or a repair, which hold it for a while); waiting for it is
    pointless."""

    def __init__(self, message: str, by_writer: bool = False):
        super().__init__(message)
        self.by_writer = by_writer
