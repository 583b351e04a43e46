"""Errors of the connectors package (framework, connectors, engines, CLI). ``ConfigError`` is
kcompact's one configuration error (kcompact/errors.py), re-exported here."""

from __future__ import annotations

from kcompact.errors import ConfigError, KcompactError


class ConnectorsError(KcompactError):
    """Root of every error raised by kcompact's connectors, engines and command line."""


class MissingExtraError(ConnectorsError, ImportError):
    """An optional part of kcompact is not installed: the message names the extra to install
    (``pip install 'kcompact[dev]'``...); see connectors/extras.py."""


__all__ = ["ConfigError", "ConnectorsError", "MissingExtraError"]
