"""Errors of the connectors package (framework, connectors, engines, CLI)."""

from __future__ import annotations

from typing import Mapping


class ConnectorsError(Exception):
    """Root of every error raised by kcompact's connectors, engines and command line."""


class ConfigError(ConnectorsError, ValueError):
    """A connector or worker property is unknown or invalid: the message names the key.

    ``key``, when given, is that property, and the message starts with ``"<key>: "``: a
    command whose flag stands for the property says the flag instead (:meth:`for_flags`)."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key

    def for_flags(self, flags: Mapping[str, str]) -> "ConfigError":
        """This error naming the command-line flag that set its property (``flags``: property
        -> flag, e.g. ``{"store.partitions": "--partitions"}``); itself when none did."""
        msg = str(self)
        if self.key in flags and msg.startswith(f"{self.key}:"):
            return ConfigError(flags[self.key] + msg[len(self.key):], key=self.key)
        return self


class MissingExtraError(ConnectorsError, ImportError):
    """An optional part of kcompact is not installed: the message names the extra to install
    (``pip install 'kcompact[dev]'``...); see connectors/extras.py."""
