"""Errors of the connectors package (framework, connectors, engines, CLI)."""

from __future__ import annotations


class ConnectorsError(Exception):
    """Root of every error raised by kcompact's connectors, engines and command line."""


class ConfigError(ConnectorsError, ValueError):
    """A connector or worker property is unknown or invalid: the message names the key."""


class MissingExtraError(ConnectorsError, ImportError):
    """An optional part of kcompact is not installed: the message names the extra to install
    (``pip install 'kcompact[dev]'``...); see connectors/extras.py."""
