"""Per-partition progress on stderr: a rich progress bar on a terminal (when rich is installed),
else one plain line per partition every few seconds and when it finishes (logs stay readable)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Progress:
    def __init__(self, stream: TextIO | None = None, interval_s: float = 2.0,
                 enabled: bool = True):
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.enabled = enabled
        self._lock = threading.Lock()
        self._state: dict[str, dict] = {}
        self._rich = None
        self._tasks: dict[str, int] = {}
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, Progress as RichProgress, TextColumn,
                                           TimeRemainingColumn)
                self._rich = RichProgress(
                    TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.percentage:>5.1f}%"),
                    TextColumn("offset {task.fields[offset]:>,}/{task.fields[target]:,}"),
                    TextColumn("{task.fields[mb]:>9,.1f} MB {task.fields[rate]:>6,.0f} MB/s"),
                    TimeRemainingColumn(), console=Console(file=self.stream), transient=False)
                self._rich.start()
            except ImportError:
                self._rich = None

    def start(self, name: str, first: int, target: int, resumed_from: int = 0) -> None:
        with self._lock:
            self._state[name] = {"first": first, "target": target, "offset": resumed_from,
                                 "bytes": 0, "t0": time.monotonic(), "last": 0.0}
            if self._rich is not None:
                self._tasks[name] = self._rich.add_task(
                    name, total=max(target - first, 1), completed=max(resumed_from - first, 0),
                    offset=resumed_from, target=target, mb=0.0, rate=0.0)
        if self._rich is None and self.enabled and resumed_from > first:
            self._line(f"{name}: resuming at offset {resumed_from:,} of {target:,}")

    def advance(self, name: str, offset: int, nbytes: int) -> None:
        with self._lock:
            st = self._state.get(name)
            if st is None:
                return
            st["offset"], st["bytes"] = offset, st["bytes"] + nbytes
            now = time.monotonic()
            if self._rich is not None:
                self._rich.update(self._tasks[name],
                                  completed=min(offset, st["target"]) - st["first"],
                                  offset=offset, mb=st["bytes"] / 1e6,
                                  rate=st["bytes"] / max(now - st["t0"], 1e-9) / 1e6)
                return
            if not self.enabled or now - st["last"] < self.interval_s:
                return
            st["last"] = now
        self._line(self._status(name, st, now))

    def note(self, name: str, text: str) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.console.print(f"{name}: {text}")
        else:
            self._line(f"{name}: {text}")

    def finish(self, name: str, text: str) -> None:
        with self._lock:
            st = self._state.get(name)
            if self._rich is not None and name in self._tasks:
                self._rich.update(self._tasks[name], completed=max(st["target"] - st["first"], 1),
                                  offset=st["target"])
        self.note(name, text)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    @staticmethod
    def _status(name: str, st: dict, now: float) -> str:
        span = max(st["target"] - st["first"], 1)
        pct = 100.0 * min(max(st["offset"] - st["first"], 0), span) / span
        dt = max(now - st["t0"], 1e-9)
        return (f"{name}: offset {st['offset']:,}/{st['target']:,} ({pct:.0f}%), "
                f"{_mb(st['bytes'])} at {st['bytes'] / dt / 1e6:,.0f} MB/s")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
