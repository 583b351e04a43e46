"""Durations of a writer's commit-log appends and fsyncs, kept for an operator's metrics
(``kcompact_commitlog_append_seconds``, ``kcompact_fsync_seconds``: replication/ops.py).

A :class:`Timing` is a histogram with fixed bucket bounds (Prometheus' ``le``): the writer calls
``observe(seconds)`` once per append call or fsync (two clock reads and a bisect over
:data:`BUCKETS`, never per record), and a scrape reads ``snapshot()`` from another thread. The
counts are plain ints in a list: a snapshot copies the list (atomic in CPython), and its count is
the sum of that copy, so the buckets, the count and ``+Inf`` always agree; ``sum`` may miss an
observation made while the copy was taken (off by one append, never torn).
"""

from __future__ import annotations

from bisect import bisect_left

#: upper bounds in seconds (100 us to 10 s): an append of a batch is ~0.1-10 ms, an fsync
#: 0.1 ms (no new bytes) to seconds (a slow disk)
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0)


class Timing:
    """A histogram of durations (seconds) over :data:`BUCKETS`."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one: above the highest bound
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float, int]:
        """(cumulative ``(le, count)`` pairs ending with ``+Inf``, sum of seconds, count)."""
        counts = list(self.counts)
        total = self.total
        out, acc = [], 0
        for le, n in zip((*map(repr, BUCKETS), "+Inf"), counts):
            acc += n
            out.append((le, acc))
        return out, total, acc

    @property
    def count(self) -> int:
        return sum(self.counts)
