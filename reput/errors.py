"""Errors of the storage layer. Catch ``ReputError`` for all of them."""

from __future__ import annotations


class ReputError(Exception):
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
    """

    def __init__(self, message: str, path: str | None = None, position: int | None = None):
        super().__init__(message)
        self.path = path
        self.position = position


class OffsetOrderError(ReputError, ValueError):
    """Records of a partition must arrive with strictly increasing offsets above the stored ones."""


class StoreLockedError(ReputError):
    """Another process writes to this commit log: one writer per commitlog/<writer>/ at a time."""
