"""Connect-style configuration: typed key definitions, validation that names the bad key, and
the two file formats connectors are configured with (Java ``.properties`` and JSON).

A :class:`ConfigDef` is Kafka's ``ConfigDef``: each key has a name, a :class:`Type`, a default
(or none: the key is then required), an importance, a doc string and a validator. ``parse``
turns raw properties (strings from a file, or native values from JSON) into typed values and
rejects, naming the key:

* a key no definition knows (listing the known ones, with a "did you mean" when one is close),
  unless it starts with a declared pass-through prefix (``consumer.``, ``producer.``,
  ``value.converter.`` ...): those belong to another component, which validates them itself;
* a missing required key, a value of the wrong type, a value its validator refuses.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConfigError

__all__ = ["ConfigDef", "ConfigKey", "Importance", "NO_DEFAULT", "Type", "at_least", "between",
           "one_of", "non_empty", "load_class", "load_config_file", "parse_properties",
           "parse_kv_pairs"]


class Type(str, enum.Enum):
    BOOLEAN = "boolean"
    INT = "int"
    LONG = "long"
    DOUBLE = "double"
    STRING = "string"
    LIST = "list"
    CLASS = "class"
    PASSWORD = "password"


class Importance(str, enum.Enum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


#: Marks a required key.
NO_DEFAULT: Any = _NoDefault()

Validator = Callable[[str, Any], None]

_INT_RANGE = {Type.INT: (-(2**31), 2**31 - 1), Type.LONG: (-(2**63), 2**63 - 1)}


# ---------------------------------------------------------------------------------------------
# validators (Kafka's ConfigDef.Range / ValidString / NonEmptyString)


def at_least(lo: float) -> Validator:
    def check(name: str, v: Any) -> None:
        if v is not None and v < lo:
            raise ConfigError(f"{name}: {v} is out of range: must be at least {lo}")
    check.__doc__ = f"[{lo},...]"
    return check


def between(lo: float, hi: float) -> Validator:
    def check(name: str, v: Any) -> None:
        if v is not None and not lo <= v <= hi:
            raise ConfigError(f"{name}: {v} is out of range [{lo}, {hi}]")
    check.__doc__ = f"[{lo},...,{hi}]"
    return check


def one_of(*choices: str, case_sensitive: bool = False) -> Validator:
    allowed = set(choices) if case_sensitive else {c.lower() for c in choices}

    def check(name: str, v: Any) -> None:
        if v is None:
            return
        if (v if case_sensitive else str(v).lower()) not in allowed:
            raise ConfigError(f"{name}: expected one of {', '.join(choices)}; got {v!r}")
    check.__doc__ = "[" + ", ".join(choices) + "]"
    return check


def non_empty(name: str, v: Any) -> None:
    if v is None or (isinstance(v, (str, list)) and len(v) == 0):
        raise ConfigError(f"{name}: must not be empty")


non_empty.__doc__ = "non-empty"


# ---------------------------------------------------------------------------------------------
# keys and definitions


@dataclass(frozen=True)
class ConfigKey:
    name: str
    type: Type
    default: Any = NO_DEFAULT
    importance: Importance = Importance.MEDIUM
    doc: str = ""
    validator: Validator | None = None

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT

    def parse(self, raw: Any) -> Any:
        """Raw value (string or native) -> typed value, validated. Raises ConfigError."""
        value = _parse_type(self.name, self.type, raw)
        if self.validator is not None:
            self.validator(self.name, value)
        return value

    def default_text(self) -> str:
        if self.required:
            return "(required)"
        d = self.default
        if d is None:
            return "null"
        if isinstance(d, bool):
            return str(d).lower()
        if isinstance(d, list):
            return ",".join(map(str, d)) or '""'
        return str(d) if str(d) != "" else '""'


def _parse_type(name: str, type_: Type, raw: Any) -> Any:
    if raw is None:
        return None
    if type_ is Type.BOOLEAN:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("true", "false"):
            return s == "true"
        raise ConfigError(f"{name}: expected true or false; got {raw!r}")
    if type_ in (Type.INT, Type.LONG):
        if isinstance(raw, bool):
            raise ConfigError(f"{name}: expected an integer; got {raw!r}")
        try:
            v = int(str(raw).strip()) if not isinstance(raw, int) else raw
        except ValueError:
            raise ConfigError(f"{name}: expected an integer; got {raw!r}") from None
        lo, hi = _INT_RANGE[type_]
        if not lo <= v <= hi:
            raise ConfigError(f"{name}: {v} does not fit a {type_.value}")
        return v
    if type_ is Type.DOUBLE:
        try:
            return float(str(raw).strip()) if not isinstance(raw, (int, float)) else float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number; got {raw!r}") from None
    if type_ is Type.LIST:
        if isinstance(raw, (list, tuple)):
            items = [str(x).strip() for x in raw]
        else:
            items = [x.strip() for x in str(raw).split(",")]
        return [x for x in items if x]
    # STRING, CLASS, PASSWORD
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ConfigError(f"{name}: expected a string; got {raw!r}")
    return str(raw).strip()


class ConfigDef:
    """An ordered set of key definitions plus the prefixes passed through unvalidated."""

    def __init__(self, keys: Iterable[ConfigKey] = (), passthrough: Iterable[str] = ()):
        self._keys: dict[str, ConfigKey] = {}
        for k in keys:
            self._add(k)
        self.passthrough: tuple[str, ...] = tuple(passthrough)

    def _add(self, key: ConfigKey) -> None:
        if key.name in self._keys:
            raise ValueError(f"config key {key.name!r} is defined twice")
        if not key.required and key.default is not None:
            key.parse(key.default)  # a default must pass its own validator
        self._keys[key.name] = key

    def define(self, name: str, type: Type, default: Any = NO_DEFAULT, validator:
               Validator | None = None, importance: Importance = Importance.MEDIUM,
               doc: str = "") -> "ConfigDef":
        self._add(ConfigKey(name, type, default, importance, doc, validator))
        return self

    def with_passthrough(self, *prefixes: str) -> "ConfigDef":
        self.passthrough = self.passthrough + tuple(prefixes)
        return self

    def merge(self, other: "ConfigDef") -> "ConfigDef":
        """A new definition with both key sets (a name defined in both is an error)."""
        out = ConfigDef(self._keys.values(), self.passthrough)
        for k in other._keys.values():
            out._add(k)
        out.passthrough = out.passthrough + tuple(p for p in other.passthrough
                                                  if p not in out.passthrough)
        return out

    def keys(self) -> list[ConfigKey]:
        return list(self._keys.values())

    def names(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def __getitem__(self, name: str) -> ConfigKey:
        return self._keys[name]

    def is_passthrough(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.passthrough)

    def parse(self, props: Mapping[str, Any], *, where: str = "", ignore: Iterable[str] = ()
              ) -> dict[str, Any]:
        """Typed values for every defined key (defaults filled in) plus the pass-through keys
        as given. ``where`` prefixes error messages (e.g. the file name); keys in ``ignore`` are
        accepted and dropped (they belong to the caller)."""
        pre = f"{where}: " if where else ""
        ignored = set(ignore)
        out: dict[str, Any] = {}
        for name, raw in props.items():
            if name in ignored:
                continue
            key = self._keys.get(name)
            if key is not None:
                try:
                    out[name] = key.parse(raw)
                except ConfigError as e:
                    raise ConfigError(f"{pre}{e}") from None
            elif self.is_passthrough(name):
                out[name] = raw
            else:
                raise ConfigError(pre + self.unknown_key_message(name))
        for key in self._keys.values():
            if key.name not in out:
                if key.required:
                    raise ConfigError(f"{pre}missing required property {key.name!r}: {key.doc}")
                out[key.name] = key.default
        return out

    def unknown_key_message(self, name: str) -> str:
        known = sorted(self._keys)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        prefixes = ""
        if self.passthrough:
            prefixes = " (and keys starting with " + ", ".join(
                f"'{p}'" for p in self.passthrough) + ")"
        return f"unknown property {name!r}{hint} Known properties: {', '.join(known)}{prefixes}"

    @staticmethod
    def with_prefix(props: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """The keys starting with ``prefix``, with the prefix removed."""
        return {k[len(prefix):]: v for k, v in props.items() if k.startswith(prefix)}

    def markdown_table(self) -> str:
        """A reference table (name, type, default, valid values, importance, doc)."""
        rows = ["| key | type | default | valid values | importance | description |",
                "|---|---|---|---|---|---|"]
        for k in self._keys.values():
            valid = (k.validator.__doc__ or "") if k.validator else ""
            rows.append(f"| `{k.name}` | {k.type.value} | `{k.default_text()}` | {valid} | "
                        f"{k.importance.value} | {k.doc} |")
        return "\n".join(rows)


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
