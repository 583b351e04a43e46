"""The store source's errors: what stops a restore, and a progress record that cannot be read."""

from __future__ import annotations

from ...errors import ConnectorsError


class RestoreError(ConnectorsError):
    """A restore cannot go on; the message names the cause and what to do."""


class ProgressFormatError(RestoreError):
    """A progress record cannot be read: move on with ``--from-scratch`` (everything is
    produced again) after checking why it is damaged."""
