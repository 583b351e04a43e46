"""Errors of the compaction package. Catch ``CompactionError`` for all of them."""

from __future__ import annotations

from kcompact.errors import KcompactError


class CompactionError(KcompactError):
    """Root of compaction errors. The old segments are still in place when this is raised:
    fix what the message names (disk space, a read error) and run `kcompact compact` again."""
