"""Connect-style configuration: the key tables of the worker, connectors, converters and plugins,
and the two file formats connectors are configured with (Java ``.properties`` and JSON).

The tables are kcompact's one declarative shape (reput/configdef.py, Kafka's ``ConfigDef``):
each key has a name, a :class:`Type`, a default (or none: the key is then required), an
importance, a doc string and a validator. The :class:`ConfigDef` here raises this package's
:class:`~kcompact.connectors.errors.ConfigError`; ``parse`` rejects, naming the key:

* a key no definition knows (listing the known ones, with a "did you mean" when one is close),
  unless it starts with a declared pass-through prefix (``consumer.``, ``producer.``,
  ``value.converter.`` ...): those belong to another component, which validates them itself;
* a missing required key, a value of the wrong type, a value its validator refuses.

The reference page of every property is generated from these tables
(connectors/devtools/reference.py).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

from kcompact.reput import configdef as _def
from kcompact.reput.configdef import (NO_DEFAULT, ConfigKey, Importance, Type, Validator,
                                      at_least, between, non_empty, one_of)

from ..errors import ConfigError

__all__ = ["ConfigDef", "ConfigKey", "Importance", "NO_DEFAULT", "Type", "Validator",
           "at_least", "between", "one_of", "non_empty", "load_class", "load_config_file",
           "parse_properties", "parse_kv_pairs"]


class ConfigDef(_def.ConfigDef):
    """reput's ConfigDef, raising the connectors' ConfigError."""

    error = ConfigError


# ---------------------------------------------------------------------------------------------
# files


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str, where: str) -> str:
    out = []
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        i += 1
        if i >= n:
            break  # a lone trailing backslash (continuation already handled) is dropped
        c = text[i]
        if c == "u":
            hexpart = text[i + 1:i + 5]
            if len(hexpart) != 4 or not all(h in "0123456789abcdefABCDEF" for h in hexpart):
                raise ConfigError(f"{where}: malformed \\uXXXX escape {text[i - 1:i + 5]!r}")
            out.append(chr(int(hexpart, 16)))
            i += 5
            continue
        out.append(_ESCAPES.get(c, c))
        i += 1
    return "".join(out)


def _logical_lines(text: str):
    """Java Properties' logical lines: comments and blank lines dropped, continuations joined.

    Yields (first physical line number, text)."""
    lines = re.split(r"\r\n|\r|\n", text)  # not splitlines(): Java breaks only on these
    i = 0
    while i < len(lines):
        start = i
        line = lines[i].lstrip(" \t\f")
        i += 1
        if not line or line[0] in "#!":
            continue
        parts = []
        while True:
            trailing = len(line) - len(line.rstrip("\\"))
            if trailing % 2 == 1:  # odd number of backslashes: the line continues
                parts.append(line[:-1])
                if i >= len(lines):
                    break
                line = lines[i].lstrip(" \t\f")
                i += 1
                continue
            parts.append(line)
            break
        yield start + 1, "".join(parts)


def parse_properties(text: str, *, where: str = "properties") -> dict[str, str]:
    """Parse Java ``.properties`` text: ``key=value``, ``key: value``, ``key value``, ``#``/``!``
    comments, backslash line continuations and escapes (``\\t``, ``\\uXXXX``, ``\\=``...).
    The last of duplicate keys wins, as in ``java.util.Properties``."""
    out: dict[str, str] = {}
    for lineno, line in _logical_lines(text):
        # the key ends at the first unescaped '=', ':' or whitespace
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if c == "\\":
                i += 2
                continue
            if c in "=: \t\f":
                break
            i += 1
        raw_key, rest = line[:i], line[i:]
        rest = rest.lstrip(" \t\f")
        if rest[:1] in ("=", ":"):
            rest = rest[1:].lstrip(" \t\f")
        key = _unescape(raw_key, f"{where}:{lineno}")
        if not key:
            raise ConfigError(f"{where}:{lineno}: a line with a value but no key")
        out[key] = _unescape(rest, f"{where}:{lineno}")
    return out


def parse_kv_pairs(pairs: Iterable[str], *, flag: str = "-X") -> dict[str, str]:
    """``["k=v", ...]`` (command-line ``-X k=v``) -> dict; a pair without '=' is an error."""
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"{flag} expects key=value; got {p!r}")
        out[k.strip()] = v.strip()
    return out


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Properties from a ``.properties`` file, or a ``.json`` file: either a flat object or
    Connect's REST form ``{"name": ..., "config": {...}}``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a properties or JSON file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.endswith(".json") or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        if isinstance(doc.get("config"), dict):
            cfg = dict(doc["config"])
            if "name" in doc:
                cfg.setdefault("name", doc["name"])
            doc = cfg
        for k, v in doc.items():
            if isinstance(v, dict):
                raise ConfigError(f"{path}: property {k!r} must be a string, number or boolean")
        return {str(k): v for k, v in doc.items()}
    return parse_properties(text, where=path)


def load_class(name: str, *, key: str, kind: str, known: Iterable[str] = ()) -> Any:
    """Import ``package.module.ClassName`` (or ``package.module:ClassName``) for a CLASS-typed
    property; the error names the key and lists the built-in short names."""
    name = name.strip()
    mod_name, sep, attr = name.replace(":", ".").rpartition(".")
    hint = f" (built-in: {', '.join(known)})" if known else ""
    if not sep or not mod_name:
        raise ConfigError(f"{key}: unknown {kind} {name!r}{hint}; or give a dotted Python path "
                          "such as mypackage.module.MyClass")
    if name.startswith(("org.apache.", "io.confluent.", "com.")):
        raise ConfigError(f"{key}: {name!r} is a Java class; kcompact runs Python {kind}s"
                          f"{hint}")
    import importlib
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {mod_name!r} for {kind} {name!r}: {e}"
                          f"{hint}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}: module {mod_name!r} has no {attr!r}{hint}") from None
