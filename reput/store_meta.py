"""store.json: a store's identity, digest secret, format, features and topic configs.

Spec: docs/formats/store-json.md. ``StoreMeta`` is its contents (read with ``from_json``, which
checks its checksum and every field; written whole with ``to_json``); the store
(reput/store.py) reads it when it opens and rewrites it under store.json.lock when a topic's
config, recorded partitions or topic id, or the store's format change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .codecs import CODEC_BY_NAME, CODEC_NAMES
from .config import TopicConfig
from .errors import StoreFormatError
from .record import validate_topic
from .segment_list import canonical, crc32c
from .topic_configs import TopicConfigLayers, default_config


#: store format (docs/formats/store-json.md): 2 since sealed segments may be Kafka log segments
#: (segment-v2.md); a format-1 store is raised to 2 when its first format-2 segment is written.
#: A new store is created at FORMAT_VERSION; this kcompact reads up to KNOWN_FORMAT_VERSION (3:
#: an S3 store with shared uploads, docs/formats/shared-upload.md, raised so by its first one)
FORMAT_VERSION = 2
#: (4: an S3 store holding compaction objects, docs/formats/compaction-object.md)
#: (5: an S3 store with a store catalog, docs/formats/store-catalog.md)
KNOWN_FORMAT_VERSION = 5
#: store.json "features": what this store keeps beyond its format. "segment-list": every local
#: partition has a segment list (docs/formats/segment-list.md), so one without is refused
FEATURE_SEGMENT_LIST = "segment-list"
#: store.json "features": "source-codec": the topics' compression.type default is producer (the
#: source's codec kept); a store without it (created before) keeps zstd (reput/topic_configs.py)
FEATURE_SOURCE_CODEC = "source-codec"


@dataclass
class StoreMeta:
    """Contents of store.json (docs/formats/store-json.md)."""

    store_id: str
    secret: bytes
    created_ms: int
    topics: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: each topic's synced values and local overrides (reput/topic_configs.py); ``topics``
    #: holds the effective values they give, written alongside for readers that know only it
    layers: dict[str, TopicConfigLayers] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)
    #: each topic's recorded partitions (Store.record_partitions), written only when some are
    recorded_partitions: dict[str, list[int]] = field(default_factory=dict)
    #: each topic's Kafka topic id when a mirror first copied it (Store.record_topic_id)
    topic_ids: dict[str, str] = field(default_factory=dict)
    #: the codec a mirror last read its source's batches with, per topic and partition
    #: (codec ids; Store.record_source_codecs): what ``compression.type=producer`` seals with
    source_codecs: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def defaults(self) -> TopicConfig:
        """The topics' defaults in this store (topic_configs.default_config)."""
        return default_config(self.features)

    def set_layers(self, topic: str, layers: TopicConfigLayers) -> None:
        self.layers[topic] = layers
        self.topics[topic] = layers.effective(self.defaults).to_dict()

    def _body(self) -> dict:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "store_id": self.store_id,
            "digest": {"algorithm": "siphash-2-4-128", "secret": self.secret.hex()},
            "created_ms": self.created_ms,
            "topics": self.topics,
        }
        if self.layers:
            body["topic_configs"] = {t: ly.to_json() for t, ly in self.layers.items()}
        if self.features:
            body["features"] = sorted(set(self.features))
        if self.recorded_partitions:
            body["partitions"] = self.recorded_partitions
        if self.topic_ids:
            body["topic_ids"] = self.topic_ids
        if self.source_codecs:
            body["source_codecs"] = {t: {str(p): CODEC_NAMES[c] for p, c in sorted(ps.items())}
                                     for t, ps in self.source_codecs.items()}
        return body

    def to_json(self) -> bytes:
        body = self._body()
        body["crc32c"] = f"{crc32c(canonical(body)):08x}"
        return json.dumps(body, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "StoreMeta":
        try:
            d = json.loads(raw)
            version = int(d["format_version"])
        except RecursionError:
            raise StoreFormatError(f"{where}: store.json is nested too deeply to be one; restore "
                                   "it from a backup (the digest secret is in it)") from None
        except (ValueError, KeyError, TypeError):
            raise StoreFormatError(f"{where}: store.json is truncated or not valid JSON; restore "
                                   "it from a backup (the digest secret is in it)") from None
        if version > KNOWN_FORMAT_VERSION:
            raise StoreFormatError(f"{where}: store format version {version} is newer than this "
                                   f"kcompact understands ({KNOWN_FORMAT_VERSION}); upgrade "
                                   "kcompact")
        if "crc32c" in d:  # written by a kcompact that checksums it (older ones do not)
            crc = d.pop("crc32c")
            try:
                ok = crc == f"{crc32c(canonical(d)):08x}"
            except (RecursionError, ValueError, TypeError):
                ok = False
            if not ok:
                raise StoreFormatError(f"{where}: store.json does not match its checksum; "
                                       "restore it from a backup (the digest secret is in it)")
        if version > KNOWN_FORMAT_VERSION:
            raise StoreFormatError(f"{where}: store format version {version} is newer than this "
                                   f"kcompact understands ({KNOWN_FORMAT_VERSION}); upgrade "
                                   "kcompact")
        try:
            secret = bytes.fromhex(d["digest"]["secret"])
            if len(secret) != 16 or d["digest"]["algorithm"] != "siphash-2-4-128":
                raise ValueError
            topics = d.get("topics", {})
            for t, cfg in topics.items():
                validate_topic(t)
                TopicConfig.from_dict(cfg)
            features = d.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                raise ValueError("features is not a list of names")
            if not isinstance(d["store_id"], str) or not d["store_id"]:
                raise ValueError("store_id is not a name")
            meta = cls(d["store_id"], secret, int(d.get("created_ms", 0)), topics, version,
                       features=features)
            for t, ly in (d.get("topic_configs") or {}).items():
                meta.set_layers(validate_topic(t), TopicConfigLayers.from_json(ly))
            meta.recorded_partitions = {validate_topic(t): partition_numbers(ps)
                                        for t, ps in d.get("partitions", {}).items()}
            meta.topic_ids = {validate_topic(t): topic_id_of(i)
                              for t, i in d.get("topic_ids", {}).items()}
            meta.source_codecs = {validate_topic(t): source_codecs_of(ps)
                                  for t, ps in d.get("source_codecs", {}).items()}
            return meta
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreFormatError(f"{where}: store.json has an invalid field ({e}); restore it "
                                   "from a backup") from None


def topic_id_of(tid: Any) -> str:
    if not isinstance(tid, str) or not tid or len(tid) > 64:
        raise ValueError(f"topic_ids: {tid!r} is not a topic id")
    return tid


def source_codecs_of(ps: Any) -> dict[int, int]:
    """A topic's entry of store.json's ``source_codecs``: {"partition": codec name}."""
    if not isinstance(ps, dict):
        raise ValueError(f"source_codecs: {ps!r} is not an object of partitions")
    out = {}
    for p, name in ps.items():
        if not (isinstance(p, str) and p.isdigit()) or name not in CODEC_BY_NAME:
            raise ValueError(f"source_codecs: {p!r}: {name!r} is not a partition's codec")
        out[int(p)] = CODEC_BY_NAME[name]
    return out


def partition_numbers(ps: Any) -> list[int]:
    """A topic's entry of store.json's ``partitions``: sorted distinct partition numbers."""
    if not isinstance(ps, list) or not all(type(p) is int and p >= 0 for p in ps):
        raise ValueError(f"partitions: {ps!r} is not a list of partition numbers")
    return sorted(set(ps))


__all__ = ["FEATURE_SEGMENT_LIST", "FEATURE_SOURCE_CODEC", "FORMAT_VERSION",
           "KNOWN_FORMAT_VERSION", "StoreMeta", "partition_numbers", "source_codecs_of", "topic_id_of"]
