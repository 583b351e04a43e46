"""The compaction I/O budget (Kafka's cleaner ``Throttler``, ``log.cleaner.io.max.bytes.per.second``):
every byte a compaction reads or writes, index reads included, is charged to it
(``Compactor._throttle``), in `kcompact compact --max-bytes-per-sec` and in the background
scheduler alike. Time is injected (``monotonic``/``wait``), so tests never sleep.
"""

from __future__ import annotations

import time
from typing import Callable

from .errors import CompactionError


class IOBudget:
    """A byte-rate limit (Kafka's cleaner ``Throttler``): ``charge(n)`` after moving ``n`` bytes
    waits until the bytes charged since the budget's first use average at most ``bytes_per_s``.

    Pacing is from the end of the previous charge, so the time the work itself took counts
    toward the budget; the first charge of a run pays in full. ``monotonic`` and ``wait`` are
    injected (tests pass a fake clock, never sleeping): ``wait(seconds)`` returns True when the
    wait was cut short by a stop request, and then ``charge`` raises :class:`CompactionStopped`.
    ``bytes_per_s`` None or 0 means unlimited (bytes are still counted)."""

    def __init__(self, bytes_per_s: float | None, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], bool] | None = None):
        if bytes_per_s is not None and bytes_per_s < 0:
            raise CompactionError(f"I/O budget must be >= 0 bytes/s (0 = unlimited), "
                                  f"got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s or 0
        self.monotonic = monotonic
        self._wait = wait if wait is not None else _sleep
        self._last: float | None = None
        self.bytes = 0          # charged so far
        self.waited_s = 0.0     # time asked of wait() so far

    def restart(self) -> None:
        """Forget the pace (idle time between runs is not credit for the next run)."""
        self._last = None

    def charge(self, nbytes: int) -> None:
        self.bytes += nbytes
        if not self.bytes_per_s:
            return
        now = self.monotonic()
        due = (now if self._last is None else self._last) + nbytes / self.bytes_per_s
        if due <= now:
            self._last = now
            return
        self._last = due
        self.waited_s += due - now
        if self._wait(due - now):
            raise CompactionStopped("compaction stopped by Scheduler.stop(); the old segments "
                                    "are still in place")


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


class CompactionStopped(CompactionError):
    """A background compaction was cut short by a stop request: it was never committed, so the
    partition is as it was (its staged output is discarded by the next compaction or on open)."""
