"""The Spark engine's errors: a job that failed, a mirror task that failed on every attempt, and
executors whose Python cannot run this kcompact."""

from __future__ import annotations

from ...errors import ConnectorsError


class SparkEngineError(ConnectorsError):
    """A Spark job failed: the message is the task's error; KCOMPACT_DEBUG=1 shows its traceback."""


class MirrorTaskError(SparkEngineError):
    """A mirror task failed on every attempt: the message names the topic-partition."""


class SparkExecutorsError(SparkEngineError):
    """The executors of a cluster cannot run this kcompact: their Python has none, another
    version, or one that does not import; the message says which and what to do."""
