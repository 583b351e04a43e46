"""The one shape every kcompact setting is declared in: Kafka's ``ConfigDef``.

A :class:`ConfigDef` is an ordered table of :class:`ConfigKey` entries, each written once: a
name, a :class:`Type`, a default (or :data:`NO_DEFAULT`: the key is required), an importance, a
doc string and a validator (:func:`at_least`, :func:`between`, :func:`one_of`, ...). The code
reads its settings through these tables (``parse``, ``ConfigKey.parse``, ``default``), and the
user guide's reference pages are generated from the same tables (connectors/devtools/reference.py),
so a key, its default and its doc cannot drift apart. The tables are:

* topic configs (Kafka's names): :data:`kcompact.reput.config.TOPIC_CONFIG`;
* ``KCOMPACT_*`` environment variables: :data:`kcompact.reput.env.ENV`;
* the Connect-style worker, connector, converter and plugin properties: ``CONFIG`` tables in
  connectors/framework and connectors/plugins (built on this module through
  connectors/framework/config.py, which adds the properties file formats).

``parse`` turns raw properties (strings from a file or a flag, native values from JSON) into
typed values and rejects, naming the key: a key no definition knows (listing the known ones,
with a "did you mean" when one is close) unless it starts with a declared pass-through prefix
(``consumer.``, ``value.converter.`` ...: those belong to another component, which validates
them itself); a missing required key; a value of the wrong type; a value its validator refuses.
A validator may also normalise the value it accepts (it returns the normal form).
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError

__all__ = ["ConfigDef", "ConfigKey", "Importance", "NO_DEFAULT", "Type", "Validator",
           "at_least", "between", "non_empty", "one_of"]


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

#: ``check(name, value)``: raises ConfigError naming ``name``, or returns None (the value is
#: kept) or the value's normal form. Its ``__doc__`` is the valid values, as the reference
#: pages show them (``[0,...]``, ``[none, all]``).
Validator = Callable[[str, Any], Any]

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

    def check(name: str, v: Any) -> Any:
        if v is None:
            return None
        norm = v if case_sensitive else str(v).lower()
        if norm not in allowed:
            raise ConfigError(f"{name}: expected one of {', '.join(choices)}; got {v!r}")
        return None if case_sensitive else norm
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

    @property
    def attr(self) -> str:
        """The Python name of the key (``segment.bytes`` -> ``segment_bytes``)."""
        return self.name.replace(".", "_").replace("-", "_")

    def parse(self, raw: Any) -> Any:
        """Raw value (string or native) -> typed value, validated (and normalised by its
        validator). Raises ConfigError naming the key."""
        value = _parse_type(self.name, self.type, raw)
        if self.validator is not None:
            norm = self.validator(self.name, value)
            if norm is not None:
                value = norm
        return value

    def valid_values(self) -> str:
        """The validator's description (``[0,...]``), or "" when any value of the type goes."""
        return (self.validator.__doc__ or "") if self.validator is not None else ""

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
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        try:
            v = int(str(raw).strip()) if not isinstance(raw, int) else raw
        except ValueError:
            raise ConfigError(f"{name}: expected an integer; got {raw!r}") from None
        lo, hi = _INT_RANGE[type_]
        if not lo <= v <= hi:
            raise ConfigError(f"{name}: {v} does not fit a {type_.value}")
        return v
    if type_ is Type.DOUBLE:
        if isinstance(raw, bool):
            raise ConfigError(f"{name}: expected a number; got {raw!r}")
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
    """An ordered set of key definitions plus the prefixes passed through unvalidated.

    ``error`` is the exception class its ``parse`` raises (a package's own ConfigError)."""

    error: type[Exception] = ConfigError

    def __init__(self, keys: Iterable[ConfigKey] = (), passthrough: Iterable[str] = ()):
        self._keys: dict[str, ConfigKey] = {}
        for k in keys:
            self._add(k)
        self.passthrough: tuple[str, ...] = tuple(passthrough)

    def _add(self, key: ConfigKey) -> None:
        if key.name in self._keys:
            raise ValueError(f"config key {key.name!r} is defined twice")
        if not key.required and key.default is not None:
            try:
                key.parse(key.default)  # a default must pass its own validator
            except (ConfigError, self.error) as e:
                raise self.error(f"the default of {e}") from None
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
        out = type(self)(self._keys.values(), self.passthrough)
        for k in other._keys.values():
            out._add(k)
        out.passthrough = out.passthrough + tuple(p for p in other.passthrough
                                                  if p not in out.passthrough)
        return out

    def keys(self) -> list[ConfigKey]:
        return list(self._keys.values())

    def names(self) -> list[str]:
        return list(self._keys)

    def defaults(self) -> dict[str, Any]:
        """Every key with a default -> that default."""
        return {k.name: k.default for k in self._keys.values() if not k.required}

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def __getitem__(self, name: str) -> ConfigKey:
        return self._keys[name]

    def __iter__(self):
        return iter(self._keys.values())

    def is_passthrough(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.passthrough)

    def parse_value(self, name: str, raw: Any, *, what: str = "property",
                    whats: str = "properties") -> Any:
        """One key's raw value, typed and validated; an unknown key is an error naming the
        known ones."""
        key = self._keys.get(name)
        if key is None:
            raise self.error(self.unknown_key_message(name, what=what, whats=whats))
        try:
            return key.parse(raw)
        except (ConfigError, self.error) as e:
            raise self.error(str(e)) from None

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
                except (ConfigError, self.error) as e:
                    raise self.error(f"{pre}{e}") from None
            elif self.is_passthrough(name):
                out[name] = raw
            else:
                raise self.error(pre + self.unknown_key_message(name))
        for key in self._keys.values():
            if key.name not in out:
                if key.required:
                    raise self.error(f"{pre}missing required property {key.name!r}: {key.doc}")
                out[key.name] = key.default
        return out

    def unknown_key_message(self, name: str, *, what: str = "property",
                            whats: str = "properties") -> str:
        known = sorted(self._keys)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        prefixes = ""
        if self.passthrough:
            prefixes = " (and keys starting with " + ", ".join(
                f"'{p}'" for p in self.passthrough) + ")"
        return f"unknown {what} {name!r}{hint} Known {whats}: {', '.join(known)}{prefixes}"

    @staticmethod
    def with_prefix(props: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """The keys starting with ``prefix``, with the prefix removed."""
        return {k[len(prefix):]: v for k, v in props.items() if k.startswith(prefix)}

    def markdown_table(self) -> str:
        """The reference table: key, type, default, valid values, importance, description."""
        rows = ["| key | type | default | valid values | importance | description |",
                "|---|---|---|---|---|---|"]
        for k in self._keys.values():
            rows.append(f"| `{k.name}` | {k.type.value} | `{k.default_text()}` | "
                        f"{_cell(k.valid_values())} | {k.importance.value} | {_cell(k.doc)} |")
        return "\n".join(rows)


def _cell(text: str) -> str:
    """Text safe in a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")
