"""The restore's two helper threads: the next chunk read while the producer waits
(:class:`Prefetch`), and progress written to the store while the next chunk goes
(:class:`LatestWriter`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from .progress import Progress


class Prefetch:
    """Calls ``poll`` in a thread of its own while the producer thread waits in librdkafka
    (flush, commit: without the GIL): ``prepare()`` starts the next chunk, ``get()`` returns
    it (starting it first if nobody did). Reading ahead during the produce loop instead only
    made the two threads take turns with the GIL (measured: more CPU, no faster); the reading
    itself is mostly numba kernels and file reads, and the Python objects are built by the
    producer's thread (``RecordBlock.materialize``)."""

    def __init__(self, poll: Callable[[], Any], stop: threading.Event):
        self._poll, self._stop = poll, stop
        self._cond = threading.Condition()
        self._wanted = True
        self._busy = False
        self._ready: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="restore-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._wanted, self._busy = False, True
            try:
                item: Any = self._poll()
            except BaseException as e:  # noqa: BLE001 - raised by get()
                item = Failed(e)
            with self._cond:
                self._ready.append(item)
                self._busy = False
                self._cond.notify_all()
            if item is None or isinstance(item, Failed):
                return

    def prepare(self) -> None:
        with self._cond:
            if not self._ready and not self._busy:
                self._wanted = True
                self._cond.notify_all()

    def get(self) -> Any:
        """The next chunk; None at the end, or once stopped."""
        with self._cond:
            if not self._ready and not self._busy and self._thread.is_alive():
                self._wanted = True
                self._cond.notify_all()
            while not self._ready:
                if self._stop.is_set() or not self._thread.is_alive():
                    return None
                self._cond.wait(0.1)
            item = self._ready.pop(0)
        if isinstance(item, Failed):
            raise item.error
        return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()


@dataclass
class Failed:
    error: BaseException


class LatestWriter:
    """Writes progress records in a thread of its own, keeping only the newest pending one:
    the store's fsyncs then overlap with the next chunk. The Kafka progress record, written
    with each chunk, is never behind the store's, so a restart loses nothing by it."""

    def __init__(self, write: Callable[..., None]):
        self._write = write
        self._cond = threading.Condition()
        self._pending: Progress | None = None
        self._maps: list[tuple[bytes, bytes]] = []  # never skipped: every chunk's map
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="restore-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
                maps, self._maps = self._maps, []
                if item is None:
                    return
            try:
                self._write(item, maps)
            except BaseException as e:  # noqa: BLE001 - raised by submit()/close()
                self.error = e
                return

    def submit(self, p: Progress, maps: list[tuple[bytes, bytes]] = ()) -> None:
        if self.error is not None:
            raise self.error
        with self._cond:
            self._pending = p
            self._maps.extend(maps)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self.error is not None:
            raise self.error
