"""Errors of the replication package. Catch ``ReplicationError`` for all of them.

Every message is one line that names what failed (the master URL, the partition, the HTTP status)
and what to do next; the CLI prints it as ``kcompact: error: <message>`` and exits 1.
"""

from __future__ import annotations

from kcompact.errors import KcompactError


class ReplicationError(KcompactError):
    """Root of every error raised by `kcompact serve`, `replicate` and `verify --against`."""


class MasterUnavailableError(ReplicationError):
    """The master could not be reached (refused, reset, timed out, or a 5xx) for longer than the
    retry budget: start `kcompact serve` on the master, check the URL and the network, then run
    `kcompact replicate` again; it resumes where it stopped."""


class AuthError(ReplicationError):
    """The master refused the token (401: none was sent, 403: it is not the master's). Pass the
    file the master was started with (`--token-file`)."""


class ProtocolError(ReplicationError):
    """The master answered something this replica does not accept (a bad status, a missing
    header, records of another partition, offsets out of order, a CRC failure). Nothing of that
    response was written; upgrade both sides to the same kcompact version if it persists."""


class MasterStoreError(ReplicationError):
    """The master answered that its own store cannot serve what was asked (a ``500``, or an
    error frame ending a streamed body): ``path`` and ``position`` name the master's damaged file
    and byte when it is damage. Deterministic, so never retried: run `kcompact verify --store` on
    the master, rebuild that partition there (from a replica or the source topic), then run
    `kcompact replicate` or `verify --against` again."""

    def __init__(self, message: str, detail: str, path: str | None = None,
                 position: int | None = None):
        super().__init__(message)
        self.detail = detail  # the master's own words, without the URL
        self.path = path
        self.position = position


class RequestError(ReplicationError, ValueError):
    """A request parameter is invalid (server side: turned into HTTP 400/404/413)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ReplicaError(ReplicationError):
    """The replica store cannot take the rebuild (another process writes the partition, or the
    replica holds records the master never had in a way that cannot be merged)."""
