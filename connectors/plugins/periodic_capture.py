"""What the store sink's estate captures share (plugins/group_sync.py, acl_sync.py): a capture
from the source cluster into a store writer (replication/internal_topic.py) when the mirror's
tasks open their topics, every interval from a thread while following, and once more when the
mirror stops; a failure is one warning line per distinct reason, never the mirror's."""

from __future__ import annotations

import sys
import threading
from typing import Any, Iterable, Mapping, TextIO


class PeriodicCapture:
    """Subclasses set ``writer`` and ``thread_name`` and implement :meth:`capture_once`
    (topics -> what was kept, or None when the capture failed and warned why).
    ``every_new_topic``: capture again whenever a task opens a topic new to the mirror (else
    only at the first topics)."""

    thread_name = "capture"
    every_new_topic = True
    writer: Any = None

    def __init__(self, kafka_conf: Mapping[str, Any], *, follow: bool, interval_ms: int,
                 out: TextIO | None, prefix: str):
        self.kafka_conf = dict(kafka_conf)
        self.bootstrap = str(self.kafka_conf.get("bootstrap.servers", ""))
        self.follow, self.interval = follow, max(1.0, interval_ms / 1000)
        self.out = out if out is not None else sys.stderr
        self.prefix = prefix
        self.topics: set[str] = set()
        self.captures = 0       # captures that succeeded
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:  # one line per distinct reason
            self._warned.add(msg)
            print(f"{self.prefix}: warning: {msg}", file=self.out, flush=True)

    def capture_once(self, topics: set[str]) -> Any:
        raise NotImplementedError

    def counted(self, result: Any) -> None:
        """A capture succeeded with ``result``."""

    def capture(self) -> None:
        with self._lock:
            n = self.capture_once(set(self.topics))
        if n is not None:
            self.captures += 1
            self.counted(n)

    def opened(self, topics: Iterable[str]) -> None:
        """A task opened ``topics``: captured now if new to this mirror (the first ones only,
        unless ``every_new_topic``)."""
        with self._lock:
            first = not self.topics
            new = set(topics) - self.topics
            self.topics.update(new)
        if new and (first or self.every_new_topic):
            self.capture()
        if self.follow and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name,
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.capture()

    def stop(self) -> None:
        """The last capture (the mirror's end), then the writer is closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            self._thread = None
        try:
            if self.topics:
                self.capture()
        finally:
            self.writer.close()


__all__ = ["PeriodicCapture"]
