"""store.json as a store rewrites it: topic configs by layer, the partitions and topic ids a
mirror recorded, and the format version (docs/formats/store-json.md).

``StoreConfigs`` is one job of ``Store`` (reput/store.py; docs/architecture.md, "The rooms of
the storage layer"), which keeps a method for each of these that delegates here. Its contents
are ``StoreMeta`` (reput/store_meta.py); every change here is a read-modify-write of store.json
under store.json.lock (flock; on S3 the object is replaced whole by one PUT), so a mirror's
sync and `kcompact configs --alter` from another process never write over each other's keys.
What was read becomes the store's ``meta`` (``adopt``: the publisher and the open partitions
are told).
"""

from __future__ import annotations

from typing import Any

from . import filenames as fn
from .config import TopicConfig
from .locks import FileLock
from .record import validate_topic
from .store_meta import StoreMeta, partition_numbers, topic_id_of
from .topic_configs import TopicConfigLayers


class StoreConfigs:
    """store.json's read-modify-writes for ``store`` (its backend, lock, clock, publisher and
    partition registry), each adopted as the store's ``meta``."""

    def __init__(self, store: Any):
        self.store = store

    def _read(self) -> StoreMeta:
        fs = self.store.fs
        return StoreMeta.from_json(fs.read(fn.STORE_JSON), fs.url)

    def _write(self, meta: StoreMeta) -> None:
        self.store.fs.write_atomic(fn.STORE_JSON, meta.to_json())

    def record_partitions(self, topic: str, partitions: list[int] | tuple[int, ...]) -> list[int]:
        """``Store.record_partitions``."""
        want = partition_numbers(list(partitions))
        with self.store.lock, FileLock(self.store.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)  # as a topic config change (store-json.md)
            meta = self._read()
            have = meta.recorded_partitions.get(validate_topic(topic), [])
            if not set(want) <= set(have):
                meta.recorded_partitions[topic] = sorted(set(have) | set(want))
                self._write(meta)
            self.adopt(meta)
            return list(meta.recorded_partitions.get(topic, []))

    def record_topic_id(self, topic: str, topic_id: str) -> str:
        """``Store.record_topic_id``."""
        tid = topic_id_of(topic_id)
        with self.store.lock, FileLock(self.store.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = self._read()
            if validate_topic(topic) not in meta.topic_ids:
                meta.topic_ids[topic] = tid
                self._write(meta)
            self.adopt(meta)
            return meta.topic_ids[topic]

    def record_source_codecs(self, topic: str, codecs: dict[int, int]) -> bool:
        """``Store.record_source_codecs``."""
        want = {int(p): int(c) for p, c in codecs.items()}
        with self.store.lock, FileLock(self.store.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = self._read()
            have = meta.source_codecs.get(validate_topic(topic), {})
            changed = any(have.get(p) != c for p, c in want.items())
            if changed:
                meta.source_codecs[topic] = {**have, **want}
                self._write(meta)
            self.adopt(meta)
            return changed

    def topic_config(self, topic: str) -> TopicConfig:
        """The effective config: default < synced from Kafka < local override."""
        meta = self.store.meta
        return meta.defaults.with_overrides(meta.topics.get(topic) or {})

    def topic_config_layers(self, topic: str) -> TopicConfigLayers:
        meta = self.store.meta
        ly = meta.layers.get(topic)
        return ly if ly is not None else TopicConfigLayers.from_legacy(
            meta.topics.get(topic), meta.defaults)

    def alter_topic_config(self, topic: str, add: dict[str, Any] | None = None,
                           delete: list[str] | tuple[str, ...] = ()) -> TopicConfig:
        """``Store.alter_topic_config``."""
        validate_topic(topic)
        return self._update_layers(topic, lambda ly: ly.altered(add or {}, delete))

    def sync_topic_config(self, topic: str, values: dict[str, Any], *,
                          origin: str | None = None) -> TopicConfig:
        """``Store.sync_topic_config``."""
        validate_topic(topic)
        ms = self.store.clock.ms
        return self._update_layers(
            topic, lambda ly: ly.with_synced(values, ms=ms(), origin=origin))

    def reload(self) -> None:
        """Re-read store.json (``Store.reload_topic_configs``)."""
        with self.store.lock:
            self.adopt(self._read())

    def _update_layers(self, topic: str, change) -> TopicConfig:
        with self.store.lock, FileLock(self.store.fs, fn.STORE_JSON_LOCK) as flock:
            flock.acquire(blocking=True)
            meta = self._read()
            before = meta.layers.get(topic)
            current = before if before is not None else TopicConfigLayers.from_legacy(
                meta.topics.get(topic), meta.defaults)
            new = change(current)
            if new != before:
                meta.set_layers(topic, new)
                self._write(meta)
            self.adopt(meta)
            return self.topic_config(topic)

    def adopt(self, meta: StoreMeta) -> None:
        """``meta`` is the store's store.json from now on."""
        st = self.store
        st.meta = meta
        st.publisher.adopted(meta)
        st.registry.adopted()

    def require_format(self, version: int, feature: str | None = None) -> None:
        """``Store.require_format``."""
        def done(meta: StoreMeta) -> bool:
            return meta.format_version >= version and (feature is None
                                                        or feature in meta.features)
        st = self.store
        if done(st.meta):
            return
        with st.lock:
            meta = self._read()
            if not done(meta):
                meta.format_version = max(meta.format_version, version)
                if feature is not None:
                    meta.features = sorted(set(meta.features) | {feature})
                self._write(meta)
            st.meta = meta
