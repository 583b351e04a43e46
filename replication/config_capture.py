"""The history of the topic configs a mirror synced from the source (docs/formats/configs.md).

store.json keeps each topic's *current* synced values (reput/topic_configs.py). So that
``kcompact configs --describe --as-of TIME`` and ``kcompact restore --as-of TIME`` know them as
they were, the mirror's config sync (connectors/plugins/config_sync.py) also appends, whenever a
topic's synced values differ from the last ones kept here (and at the first sync of a topic),
one record to an internal compacted store topic, ``__kcompact-configs`` (partition 0), through
the store's normal write path (replication/internal_topic.py):

* key ``["topic", <topic>]``; value: the synced values (Kafka's names and the source's
  spelling), where they came from, and when they were captured (also the record's timestamp).

Local overrides (``kcompact configs --alter``) are not kept here: they are this store's own
settings, not the source's, and apply as they are now.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

from kcompact.reput import Store

from .errors import ReplicationError
from .internal_topic import InternalTopicWriter, read_records

TOPIC = "__kcompact-configs"
FORMAT_VERSION = 1


class ConfigCaptureError(ReplicationError):
    """A config-history record that cannot be read, or a capture that cannot be kept."""


@dataclass(frozen=True)
class KeptConfig:
    """A topic's synced values, in effect since ``synced_ms``."""

    synced: Mapping[str, str] = field(default_factory=dict)
    synced_from: str | None = None
    synced_ms: int = 0


def _key(topic: str) -> bytes:
    return json.dumps(["topic", topic], separators=(",", ":"), ensure_ascii=False).encode()


def _value(kc: KeptConfig) -> bytes:
    doc = {"synced": dict(sorted(kc.synced.items())), "synced_ms": kc.synced_ms,
           "version": FORMAT_VERSION}
    if kc.synced_from:
        doc["synced_from"] = kc.synced_from
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def decode(key: bytes | None, value: bytes | None, where: str) -> tuple[str, KeptConfig | None]:
    """(topic, KeptConfig or None for a tombstone); ConfigCaptureError names the record."""
    try:
        k = json.loads(key) if key is not None else None
        if not (isinstance(k, list) and len(k) == 2 and k[0] == "topic"
                and isinstance(k[1], str)):
            raise ValueError(f"key {key!r} is not [\"topic\", name]")
        if value is None:
            return k[1], None
        d = json.loads(value)
        if not isinstance(d, dict):
            raise ValueError("value is not a JSON object")
        if int(d.get("version", 0)) > FORMAT_VERSION:
            raise ConfigCaptureError(f"{where}: config history format {d['version']} is newer "
                                     f"than this kcompact reads ({FORMAT_VERSION}); upgrade")
        synced = d.get("synced")
        if not isinstance(synced, dict) or not all(
                isinstance(a, str) and isinstance(b, str) for a, b in synced.items()):
            raise ValueError("synced is not an object of strings")
        return k[1], KeptConfig(dict(synced), d.get("synced_from"), int(d["synced_ms"]))
    except ConfigCaptureError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigCaptureError(f"{where}: not a config history record ({e})") from None


def kept_configs(store: Store, *, as_of_ms: int | None = None, allow_inexact: bool = False
                 ) -> dict[str, KeptConfig]:
    """topic -> its synced values as last captured (at or before ``as_of_ms``); a topic
    without a capture then is absent."""
    where = f"{store.url} {TOPIC}-0"
    out: dict[str, KeptConfig] = {}
    for r in read_records(store, TOPIC, as_of_ms=as_of_ms, allow_inexact=allow_inexact,
                          what="the kept topic configs"):
        t, kc = decode(r.key, r.value, f"{where}@{r.offset}")
        if kc is None:
            out.pop(t, None)
        else:
            out[t] = kc
    return out


class ConfigCaptureWriter(InternalTopicWriter):
    """Appends a topic's synced values when they differ from the last kept (read under the
    partition's lock, so that two mirrors of one store never lose a change). A topic with no
    record has no synced values (the store's defaults): a topic whose source configs stay at
    Kafka's defaults gets no record, and a store whose topics all do has no history topic (nor
    this writer's commit log)."""

    topic = TOPIC

    def __init__(self, url: str, writer: str, *, commitlog_dir: str | None = None):
        super().__init__(url, writer, commitlog_dir=commitlog_dir, error=ConfigCaptureError,
                         what="the synced configs' history")
        self._lock = threading.Lock()

    @staticmethod
    def _changed(kept: Mapping[str, KeptConfig], wanted: Mapping[str, dict]) -> list[str]:
        return sorted(t for t, v in wanted.items()
                      if dict(kept[t].synced if t in kept else {}) != v)

    def keep(self, synced: Mapping[str, Mapping[str, str]], origin: str | None,
             since_ms: Mapping[str, int | None] | None = None,
             now_ms: int | None = None) -> list[str]:
        """``synced``: topic -> the values synced now, in effect since ``since_ms[topic]``
        (store.json's ``synced_ms``: the record's timestamp, so that ``--as-of`` finds values
        synced before this history was kept; now when unknown). Returns the topics whose
        values were appended (durable when this returns)."""
        now = int(time.time() * 1000) if now_ms is None else int(now_ms)
        since_ms = since_ms or {}
        wanted = {t: {k: str(v) for k, v in vals.items()} for t, vals in synced.items()}
        with self._lock:
            if self._store is None:
                # read without a writer (what other writers kept included): nothing to keep
                # leaves no commit log behind
                try:
                    with Store.open(self.url, commitlog_dir=self.commitlog_dir) as ro:
                        if not self._changed(kept_configs(ro), wanted):
                            return []
                except ConfigCaptureError:
                    raise
                except Exception:  # noqa: BLE001 - no store yet: the writer creates it
                    pass
            with self.locked() as append:
                kept = kept_configs(self.store())
                changed = self._changed(kept, wanted)
                new = {}
                for t in changed:
                    ts = since_ms.get(t)
                    ts = now if ts is None or int(ts) > now else int(ts)
                    new[t] = KeptConfig(wanted[t], origin, ts)
                # one append per timestamp (a batch's records share the one given)
                for ts in sorted({kc.synced_ms for kc in new.values()}):
                    append([(_key(t), _value(kc)) for t, kc in sorted(new.items())
                            if kc.synced_ms == ts], ts)
            return changed


def synced_as_of(store: Store, topic: str, as_of_ms: int, *, allow_inexact: bool = False
                 ) -> tuple[dict[str, str], str]:
    """``topic``'s synced values as of ``as_of_ms`` and where they come from: ``"history"``
    (the last captured at or before it), ``"defaults"`` (the history starts later: none were
    synced then), or ``"current"`` (the store keeps no history of the topic, mirrored before
    kcompact kept one: store.json's current values)."""
    then = kept_configs(store, as_of_ms=as_of_ms, allow_inexact=allow_inexact)
    if topic in then:
        return dict(then[topic].synced), "history"
    if topic in kept_configs(store):
        return {}, "defaults"
    return {k: str(v) for k, v in store.topic_config_layers(topic).synced.items()}, "current"


def layers_as_of(store: Store, topic: str, as_of_ms: int, *, allow_inexact: bool = False):
    """(TopicConfigLayers with the synced values as of ``as_of_ms`` and today's local
    overrides, where the synced values come from: see :func:`synced_as_of`)."""
    from dataclasses import replace

    from kcompact.reput.topic_configs import validated
    ly = store.topic_config_layers(topic)
    synced, source = synced_as_of(store, topic, as_of_ms, allow_inexact=allow_inexact)
    if source == "current":
        return ly, source
    then = kept_configs(store, as_of_ms=as_of_ms, allow_inexact=True).get(topic)
    return replace(ly, synced=validated(synced),
                   synced_ms=then.synced_ms if then is not None else None,
                   synced_from=then.synced_from if then is not None else None), source


__all__ = ["TOPIC", "ConfigCaptureError", "ConfigCaptureWriter", "KeptConfig", "decode",
           "kept_configs", "layers_as_of", "synced_as_of"]
