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
