"""How the commands print what they found: one JSON document on stdout, byte sizes for people,
and bytes as text when they are UTF-8 (else base64), as ``dump --json`` and ``kv get --json``
show keys and values (DESIGN.md, "Command line")."""

from __future__ import annotations

import base64
import json
import sys
from typing import Any


def print_json(doc: Any) -> None:
    """``doc`` as one indented JSON document on stdout."""
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB`` ... ``3.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def text_or_b64(name: str, data: bytes | None, out: dict[str, Any]) -> None:
    """``out[name]`` = ``data`` as UTF-8 text; when it is not valid UTF-8, None and
    ``out[name + "_b64"]`` = its base64; None stays None."""
    if data is None:
        out[name] = None
        return
    try:
        out[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[name] = None
        out[f"{name}_b64"] = base64.b64encode(data).decode()


class JsonLines:
    """``--log-format json``: a text stream (stderr) that writes each line given to it as one
    JSON object ``{"ts", "level", "command", "msg"}`` (``level``: error, warning or info, from
    the line's own words), so that every progress, warning and error line of a command, and
    the servers' log lines, is one JSON object on a line."""

    def __init__(self, stream, command: str):
        import threading
        self._stream, self.command = stream, command
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                if line.strip():
                    self._stream.write(self._format(line) + "\n")
            if lines:
                self._stream.flush()
        return len(text)

    def _format(self, line: str) -> str:
        import datetime
        low = line.lower()
        level = ("error" if "error:" in low or "error " in low[:40] else
                 "warning" if "warning" in low[:60] else "info")
        now = datetime.datetime.now(datetime.timezone.utc)
        return json.dumps({"ts": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                           "level": level, "command": self.command, "msg": line})

    def flush(self) -> None:
        with self._lock:
            if self._buf.strip():
                self._stream.write(self._format(self._buf) + "\n")
            self._buf = ""
            self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")
