"""A topic's configs by where each value comes from: default < synced from Kafka < local override.

``kcompact mirror`` stores the source topic's compaction-relevant configs (read with
describe_configs) as the topic's *synced* values; ``kcompact configs --alter`` (and the Python
API ``Store.alter_topic_config`` / ``set_topic_config``) sets *local overrides*, which win over
synced values and survive later mirrors; every other key has its default (reput/config.py).
:class:`TopicConfigLayers` is that model, pure (no I/O): the store keeps one per topic in
store.json's ``topic_configs`` (docs/formats/store-json.md) and writes the effective values it
yields into ``topics`` as before, so a reader that knows only ``topics`` still sees what
compaction uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .config import TOPIC_CONFIG, TOPIC_KEYS, ConfigError, TopicConfig
from .config import topic_key as known_key

DEFAULT, SYNCED, OVERRIDE = "default", "synced", "override"
#: what a store created before store.json's "source-codec" feature keeps as its defaults: its
#: compression.type default was zstd (reput/config.py's is producer)
LEGACY_DEFAULTS = TopicConfig(compression_type="zstd")


def default_config(features) -> TopicConfig:
    """A store's topic defaults, by store.json's ``features``: a store created since the
    source's codec became the default lists "source-codec"; an older one keeps zstd."""
    return TopicConfig() if "source-codec" in features else LEGACY_DEFAULTS


def validated(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` checked and normalised key by key (ints, floats, the policy's spelling)."""
    return {name: known_key(name).parse(v) for name, v in values.items()}


@dataclass(frozen=True)
class ConfigEntry:
    """One key of ``kcompact configs --describe``."""

    name: str
    value: Any
    source: str                      # DEFAULT, SYNCED or OVERRIDE
    synced: Any = None               # the synced value when an override hides it
    default: Any = None
    doc: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "value": self.value, "source": self.source,
             "default": self.default}
        if self.synced is not None:
            d["synced_value"] = self.synced
        return d


@dataclass(frozen=True)
class TopicConfigLayers:
    """A topic's synced values and local overrides (validated, normalised)."""

    synced: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Any] = field(default_factory=dict)
    synced_ms: int | None = None     # when the synced values last changed
    synced_from: str | None = None   # where they came from (bootstrap servers)

    # -- store.json ------------------------------------------------------------------------

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TopicConfigLayers":
        if not isinstance(d, Mapping):
            raise ValueError(f"topic_configs entry {d!r} is not an object")
        ms = d.get("synced_ms")
        return cls(validated(d.get("synced") or {}), validated(d.get("overrides") or {}),
                   None if ms is None else int(ms), d.get("synced_from"))

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"synced": dict(sorted(self.synced.items())),
                             "overrides": dict(sorted(self.overrides.items()))}
        if self.synced_ms is not None:
            d["synced_ms"] = self.synced_ms
        if self.synced_from:
            d["synced_from"] = self.synced_from
        return d

    @classmethod
    def from_legacy(cls, cfg: Mapping[str, Any] | None, base: TopicConfig | None = None
                    ) -> "TopicConfigLayers":
        """A ``topics`` entry written before ``topic_configs`` existed (every key, set through
        the Python API): the keys whose value differs from the default (``base``'s: the
        store's defaults) are local overrides; the effective config is unchanged either way."""
        values = validated(cfg or {})
        defaults = (base or TopicConfig()).to_dict()
        return cls(overrides={k: v for k, v in values.items() if v != defaults[k]})

    # -- precedence ------------------------------------------------------------------------

    def effective(self, base: TopicConfig | None = None) -> TopicConfig:
        """default < synced < override (``base``: the store's defaults, default_config)."""
        return (base or TopicConfig()).with_overrides({**self.synced, **self.overrides})

    def describe(self, base: TopicConfig | None = None) -> list[ConfigEntry]:
        out = []
        eff = self.effective(base).to_dict()
        defaults = (base or TopicConfig()).to_dict()
        for k in TOPIC_KEYS:
            if k.name in self.overrides:
                src = OVERRIDE
            elif k.name in self.synced:
                src = SYNCED
            else:
                src = DEFAULT
            hidden = self.synced.get(k.name) if src == OVERRIDE else None
            out.append(ConfigEntry(k.name, eff[k.name], src, hidden, defaults[k.name], k.doc))
        return out

    def source_of(self, name: str) -> str:
        known_key(name)
        return OVERRIDE if name in self.overrides else SYNCED if name in self.synced else DEFAULT

    # -- changes ---------------------------------------------------------------------------

    def altered(self, add: Mapping[str, Any] = (), delete: Iterable[str] = ()
                ) -> "TopicConfigLayers":
        """Local overrides ``add`` set and ``delete`` removed (a key of both is refused)."""
        add = validated(dict(add))
        delete = list(delete)
        for name in delete:
            known_key(name)
        both = sorted(set(add) & set(delete))
        if both:
            raise ConfigError(f"{both[0]}: both added and deleted; give it once")
        ov = {k: v for k, v in self.overrides.items() if k not in delete}
        ov.update(add)
        return replace(self, overrides=ov)

    def with_synced(self, values: Mapping[str, Any], *, ms: int, origin: str | None
                    ) -> "TopicConfigLayers":
        """The synced values replaced by ``values`` (validated); ``synced_ms`` moves only when
        they change."""
        values = validated(values)
        if values == dict(self.synced) and (self.synced_ms is not None or not values):
            return self
        return replace(self, synced=values, synced_ms=ms, synced_from=origin)


__all__ = ["DEFAULT", "LEGACY_DEFAULTS", "OVERRIDE", "SYNCED", "ConfigEntry", "TopicConfigLayers",
           "default_config", "known_key", "validated"]
