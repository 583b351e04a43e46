"""Read-only views of a store's partitions shared by a server's threads.

Every reader and writer opens a partition through its store (``Store.open_view``,
``Store.partition``, ``Store.writable_partition``: the store's topic config, clock and
strictness, so a partition one command refuses no other serves). A server (the replication
master, reput's HTTP reads; the Kafka endpoint) answers many requests at once: it keeps one view
per partition here, opened by that same door, and uses each under its own lock (a
``PartitionLog`` is not thread-safe); ``forget`` drops one that failed (damage), so the next
request opens it again.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from .partition import PartitionLog


class PartitionViews:
    """The cache (see the module docstring); ``open_view(topic, partition)``: the store's door."""

    def __init__(self, open_view: Callable[[str, int], PartitionLog]):
        self._open = open_view
        self._lock = threading.Lock()
        self._views: dict[tuple[str, int], tuple[threading.Lock, PartitionLog]] = {}

    def get(self, topic: str, partition: int) -> tuple[threading.Lock, PartitionLog]:
        """(the view's lock, the view), opened the first time (a refusal is raised, and
        nothing is kept)."""
        key = (topic, partition)
        with self._lock:
            got = self._views.get(key)
            if got is None:
                got = self._views[key] = (threading.Lock(), self._open(topic, partition))
            return got

    @contextmanager
    def reading(self, topic: str, partition: int) -> Iterator[PartitionLog]:
        """The partition's view, refreshed, held under its lock for the ``with`` block."""
        lock, pl = self.get(topic, partition)
        with lock:
            pl.refresh()
            yield pl

    def forget(self, topic: str, partition: int) -> None:
        """Drop the view (the next ``get`` opens the partition again)."""
        with self._lock:
            self._views.pop((topic, partition), None)


__all__ = ["PartitionViews"]
