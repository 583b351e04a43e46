"""Two halves of one large read at once: the caller's thread takes the first, a helper thread the
second.

The storage layer's C kernels release the GIL, so a large span of store format 2 (its records
walked, converted and checked against their index entries) goes twice as fast on a machine with
a core to spare when split in two (reput/batch.py, reput/reader.py). One helper thread serves
the process, made on first use; a call from the helper itself runs both halves in turn, so
nothing waits on itself.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

A = TypeVar("A")
B = TypeVar("B")

#: a span of at least this many bytes is split (below, a thread hand-off costs more than it gains)
SPLIT_ABOVE = 1 << 20

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_helper_ident: int | None = None


def _mark() -> None:
    global _helper_ident
    _helper_ident = threading.get_ident()


def worth_splitting(nbytes: int) -> bool:
    """Whether a span of ``nbytes`` is split: large enough, and more than one core."""
    return nbytes >= SPLIT_ABOVE and (os.cpu_count() or 1) > 1


def both(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """(first(), second()), the second in the helper thread while the caller runs the first (or
    in the caller, when the helper has not started it by then); an exception of either is
    raised, the first's when both fail."""
    global _pool
    if threading.get_ident() == _helper_ident:
        return first(), second()
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kcompact-half",
                                       initializer=_mark)
        pool = _pool
    fut = pool.submit(second)
    try:
        a = first()
    except BaseException:
        if not fut.cancel():  # started: let it end before the caller's buffers go
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the first's exception is the one raised
                pass
        raise
    # not started yet (the helper busy with another caller's half): run it here
    return a, (second() if fut.cancel() else fut.result())


__all__ = ["SPLIT_ABOVE", "both", "worth_splitting"]
