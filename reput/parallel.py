"""Two halves of one large read at once: the caller's thread takes the first, a helper thread the
second (``both``); or the next of a sequence of decodes made while the caller works on this one
(``ahead``).

The storage layer's C kernels release the GIL, so a large span of store format 2 (its records
walked, converted and checked against their index entries) goes twice as fast on a machine with
a core to spare when split in two (reput/batch.py, reput/reader.py). One helper thread serves
the process, made on first use; a call from the helper itself runs both halves in turn, so
nothing waits on itself; a forked child makes its own.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

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


def _forget_helper() -> None:
    """In a forked child: the parent's helper thread is not there (a pool that thinks it has one
    would take work nobody runs); the child makes its own on first use."""
    global _pool, _helper_ident, _lock
    _pool, _helper_ident, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_helper)


def _helper() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kcompact-half",
                                       initializer=_mark)
        return _pool


def worth_splitting(nbytes: int) -> bool:
    """Whether a span of ``nbytes`` is split: large enough, and more than one core."""
    return nbytes >= SPLIT_ABOVE and (os.cpu_count() or 1) > 1


def both(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """(first(), second()), the second in the helper thread while the caller runs the first (or
    in the caller, when the helper has not started it by then); an exception of either is
    raised, the first's when both fail."""
    if threading.get_ident() == _helper_ident:
        return first(), second()
    fut = _helper().submit(second)
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


_END = object()


def ahead(fn: Callable[[A], B], items: Iterable[A]) -> Iterator[tuple[A, B]]:
    """``(item, fn(item))`` for each of ``items`` in order, ``fn`` of the next item computed in
    the helper thread while the caller works on this one (a lean index's next chunk decoded
    while the caller consumes this one). In the caller alone on one core or from the helper
    itself. An exception of ``fn`` is raised where its item would have been yielded; a caller
    that stops early leaves nothing running."""
    it = iter(items)
    if threading.get_ident() == _helper_ident or (os.cpu_count() or 1) < 2:
        for x in it:
            yield x, fn(x)
        return
    x = next(it, _END)
    if x is _END:
        return
    fut = _helper().submit(fn, x)
    try:
        while True:
            y = next(it, _END)
            cur = fut.result()
            fut = None if y is _END else _helper().submit(fn, y)
            yield x, cur
            if y is _END:
                return
            x = y
    finally:
        if fut is not None and not fut.cancel():
            try:  # started: let it end before the caller's objects go
                fut.result()
            except BaseException:  # noqa: BLE001 - nobody asked for this one's result
                pass


__all__ = ["SPLIT_ABOVE", "ahead", "both", "worth_splitting"]
