"""The Spark engine's errors: a job that failed, and a mirror task that failed on every attempt."""

from __future__ import annotations

from ...errors import ConnectorsError


class SparkEngineError(ConnectorsError):
    """A Spark job failed: the message is the task's error; KCOMPACT_DEBUG=1 shows its traceback."""


class MirrorTaskError(SparkEngineError):
    """A mirror task failed on every attempt: the message names the topic-partition."""
