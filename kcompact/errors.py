"""The root of every error kcompact raises on purpose, and the one configuration error.

``KcompactError`` is above each layer's own root (``kcompact.reput.ReputError``,
``kcompact.compaction.CompactionError``, ``kcompact.replication.ReplicationError``,
``kcompact.connectors.ConnectorsError``): catch it for any error a user can act on (the command
line does, printing its first line and exiting 1). ``ConfigError`` is the one error for a
setting that is unknown or out of range, whichever layer reads it (a topic config, a connector or
worker property, a command-line option, an environment variable).

This module imports nothing of kcompact, so that every layer can import it.
"""

from __future__ import annotations

from typing import Mapping


class KcompactError(Exception):
    """Root of every error kcompact raises on purpose: the message says what is wrong and what
    to do."""


class ConfigError(KcompactError, ValueError):
    """A setting is unknown or its value is invalid or out of range: the message names the key.

    ``key``, when given, is that setting, and the message starts with ``"<key>: "``: a command
    whose flag stands for the setting says the flag instead (:meth:`for_flags`)."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key

    def for_flags(self, flags: Mapping[str, str]) -> "ConfigError":
        """This error naming the command-line flag that set its setting (``flags``: setting ->
        flag, e.g. ``{"store.partitions": "--partitions"}``); itself when none did."""
        msg = str(self)
        if self.key in flags and msg.startswith(f"{self.key}:"):
            return ConfigError(flags[self.key] + msg[len(self.key):], key=self.key)
        return self


__all__ = ["ConfigError", "KcompactError"]
