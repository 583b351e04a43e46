"""Configs that follow the source: what ``kcompact mirror`` reads with describe_configs and stores
as each topic's *synced* configs (reput/topic_configs.py has the precedence: a local override set
with ``kcompact configs --alter`` still wins).

The rules (README "Mirror topics" has them as a table):

* the keys synced are :data:`SYNCED_KEYS`, Kafka's names; a key the source leaves at Kafka's
  built-in default (describe_configs' ``DEFAULT_CONFIG`` source) is not synced, so the store's
  default applies: the same value for every key but ``cleanup.policy``, whose store default is
  ``compact`` (Kafka's is ``delete``). A value set on the topic or on the broker is synced.
* ``segment.bytes`` larger than the store's default (1 GiB) is not synced: the store keeps 1 GiB
  (a store's segment is the unit of a compaction rewrite and of an S3 upload); a note says so.
* a value outside the store's range (``segment.bytes`` under 16 KiB, Kafka allowing 14 bytes) is
  not synced, with a warning naming the key and the range.
* a broker that refuses describe_configs (ACLs: ``DescribeConfigs`` on the topic) or cannot
  answer it gives one warning naming the permission, and the mirror goes on with the store's
  values; a sync never fails a mirror.

Done before any record of a topic is copied, and under ``--follow`` again every
``topic.metadata.refresh.interval.ms`` (librdkafka's, ``-X``; 5 minutes by default). The store
sink does it (:class:`SinkConfigSync`, its ``sync.topic.configs.enabled``) for ``kcompact
mirror --engine local`` and ``kcompact connect standalone`` alike: each topic when a task opens
it (at start, and when a following task picks up a topic that starts to match ``topics.regex``,
which the task checks for every few seconds: it is not left with the store's defaults until the
next refresh), then every refresh interval. The Spark engine syncs in its driver before its
tasks start. store.json is rewritten only when a synced value changed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, TextIO

from kcompact.errors import ConfigError
from kcompact.reput import Store, TopicConfig

from ..framework.kafka_clients import (admin_settings, kafka_error, kafka_error_text, kafka_logger,
                                        short_lived)

#: The topic configs read from Kafka (Kafka's names, reput/config.py's keys).
SYNCED_KEYS = ("cleanup.policy", "delete.retention.ms", "min.compaction.lag.ms",
               "max.compaction.lag.ms", "min.cleanable.dirty.ratio", "segment.bytes",
               "segment.ms", "retention.ms",
               # the codec of sealed segments (store format 2): a codec the source names is
               # kept (Kafka recompressed every batch to it); Kafka's default, producer, is
               # not synced (the store's default applies: producer in a store listing the
               # source-codec feature, the source batches' codec read by plugins/
               # codec_watch.py; zstd in an older one).
               # compression.zstd.level is not: Kafka describes it only since 3.8
               "compression.type")
#: The largest segment.bytes synced: the store's own default.
MAX_SYNCED_SEGMENT_BYTES = TopicConfig().segment_bytes
#: librdkafka's default topic.metadata.refresh.interval.ms.
DEFAULT_REFRESH_MS = 300_000

def refresh_interval_ms(kafka_config: Mapping[str, str]) -> int:
    try:
        return max(1000, int(kafka_config.get("topic.metadata.refresh.interval.ms",
                                              DEFAULT_REFRESH_MS)))
    except ValueError:
        return DEFAULT_REFRESH_MS


def source_configs(entries: Mapping[str, Any]
                   ) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """describe_configs' entries of one topic -> (values to sync, (``note`` or ``warning``,
    text) on each value left out)."""
    from confluent_kafka.admin import ConfigSource
    out, notes = {}, []
    # Kafka describes every config, its built-in defaults marked DEFAULT_CONFIG; Tansu returns
    # only the configs set on the topic, and marks those DEFAULT_CONFIG too (BROKER_NOTES.md):
    # a response without some key Kafka always describes is one of configs set.
    complete = all(k in entries for k in SYNCED_KEYS)
    for key in SYNCED_KEYS:
        e = entries.get(key)
        if e is None or e.value is None:
            continue
        if complete and (getattr(e, "is_default", False) or getattr(e, "source", None) in (
                ConfigSource.DEFAULT_CONFIG, ConfigSource.DEFAULT_CONFIG.value)):
            continue
        value = str(e.value)
        if key == "segment.bytes":
            try:
                if int(value) > MAX_SYNCED_SEGMENT_BYTES:
                    notes.append(("note", f"segment.bytes={value} is larger than a store's "
                                  "segments should be; the store keeps its default "
                                  f"{MAX_SYNCED_SEGMENT_BYTES}"))
                    continue
            except ValueError:
                pass
        try:
            TopicConfig().with_overrides({key: value})
        except ConfigError as err:
            notes.append(("warning", f"{err}; not synced, the store's value applies"))
            continue
        out[key] = value
    return out, notes


def describe_topics(bootstrap: str, topics: Iterable[str], kafka_config: Mapping[str, str],
                    timeout: float, warn: Callable[..., None]) -> dict[str, dict[str, str]]:
    """Each topic's values to sync, read with describe_configs; a topic whose configs cannot be
    read is left out, with a warning (``warn``) naming why and the permission needed."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, ConfigResource
    topics = list(topics)
    if not topics:
        return {}
    try:
        admin = AdminClient(short_lived(dict(admin_settings(kafka_config, bootstrap),
                                             logger=kafka_logger())))
    except KafkaException as e:
        warn(f"cannot read the topics' configs ({kafka_error_text(e)}); the store's values "
             "apply")
        return {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
    try:
        futures = admin.describe_configs(resources, request_timeout=timeout)
    except KafkaException as e:
        warn(f"describe_configs failed ({kafka_error_text(e)}); the store's values apply")
        return {}
    out: dict[str, dict[str, str]] = {}
    for res, fut in futures.items():
        topic = res.name
        try:
            entries = fut.result(timeout=timeout + 5)
        except KafkaException as e:
            err = kafka_error(e)
            code = err.code() if err is not None else None
            if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                        KafkaError.CLUSTER_AUTHORIZATION_FAILED):
                warn(f"topic {topic}: the broker refused describe_configs "
                     f"({kafka_error_text(e)}): grant DescribeConfigs on topic {topic} to sync "
                     "its configs; mirroring with the store's values")
            else:
                warn(f"topic {topic}: cannot read its configs ({kafka_error_text(e)}); "
                     "mirroring with the store's values")
            continue
        except Exception as e:  # noqa: BLE001 - a sync never fails the mirror
            warn(f"topic {topic}: cannot read its configs ({e}); mirroring with the store's "
                 "values")
            continue
        values, notes = source_configs(entries)
        for kind, n in notes:
            warn(f"topic {topic}: {n}", kind)
        out[topic] = values
    return out


def sync_configs(bootstrap: str, topics: Iterable[str], store_url: str,
                 kafka_config: Mapping[str, str], *, timeout: float = 10.0,
                 commitlog_dir: str | None = None, out: TextIO | None = None,
                 prefix: str = "mirror", history: Any = None,
                 writer: str | None = None) -> dict[str, TopicConfig]:
    """Read the topics' configs from Kafka and store them as synced configs (module
    docstring); returns the effective config of each topic synced. Never raises for Kafka's
    sake: a refusal is a warning on ``out``. The values synced are also kept in the store's
    config history (replication/config_capture.py) when they changed: by ``history`` (a
    ConfigCaptureWriter), or by one opened for this call with writer id ``writer``."""
    out = out if out is not None else sys.stderr

    def warn(msg: str, kind: str = "warning") -> None:
        print(f"{prefix}: {kind}: {msg}", file=out, flush=True)

    found = describe_topics(bootstrap, topics, kafka_config, timeout, warn)
    if not found:
        return {}
    done = {}
    since: dict[str, int | None] = {}
    with Store.open(store_url, commitlog_dir=commitlog_dir) as store:
        for topic, values in found.items():
            before = store.topic_config_layers(topic)
            done[topic] = store.sync_topic_config(topic, values, origin=bootstrap)
            after = store.topic_config_layers(topic)
            since[topic] = after.synced_ms
            if after.synced != before.synced:
                shown = ", ".join(f"{k}={v}" for k, v in sorted(after.synced.items()))
                hidden = sorted(set(after.synced) & set(after.overrides))
                print(f"{prefix}: {topic}: configs synced from Kafka: {shown or '(none set)'}"
                      + (f" (local overrides win for {', '.join(hidden)})" if hidden else ""),
                      file=out, flush=True)
    if history is not None or writer:
        _keep_history(found, since, bootstrap, store_url, commitlog_dir, history, writer, warn)
    return done


def _keep_history(found: Mapping[str, Mapping[str, str]], since: Mapping[str, int | None],
                  origin: str, store_url: str,
                  commitlog_dir: str | None, history: Any, writer: str | None,
                  warn: Callable[..., None]) -> None:
    """The synced values into the config history; a failure is a warning (the next sync
    tries again), never the mirror's."""
    from kcompact.replication.config_capture import ConfigCaptureWriter
    own = history is None
    try:
        if own:
            history = ConfigCaptureWriter(store_url, str(writer), commitlog_dir=commitlog_dir)
        history.keep(found, origin, since)
    except Exception as e:  # noqa: BLE001 - ConfigCaptureError, OSError, ReputError...
        warn(f"the synced configs' history was not kept ({e}); `configs --as-of` and `restore "
             "--as-of` use the current values for what is missing; the next sync tries again")
    finally:
        if own and history is not None:
            history.close()


class ConfigFollower:
    """Under ``--follow``: the sync again every metadata refresh interval (called by
    :class:`SinkConfigSync`'s thread, or from the mirror's tick with ``sync`` False), then each
    running task's store re-reads store.json (``on_synced``)."""

    def __init__(self, bootstrap: str, topics: Callable[[], Iterable[str]], store_url: str,
                 kafka_config: Mapping[str, str], *, out: TextIO,
                 on_synced: Callable[[], None], sync: bool = True,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "mirror",
                 history: Any = None):
        self.bootstrap, self.topics, self.store_url = bootstrap, topics, store_url
        self.sync = sync  # False (--no-sync-configs): only local overrides are picked up
        self.kafka_config, self.out, self.on_synced = dict(kafka_config), out, on_synced
        self.interval = refresh_interval_ms(kafka_config) / 1000
        self.clock, self.prefix = clock, prefix
        self.history = history  # a ConfigCaptureWriter: the synced values' history
        self.last = clock()

    def __call__(self, *_: Any) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.last = now
        try:
            if self.sync:
                sync_configs(self.bootstrap, list(self.topics()), self.store_url, self.kafka_config,
                             out=self.out, prefix=self.prefix, history=self.history)
        except Exception as e:  # noqa: BLE001 - a sync never stops a following mirror
            print(f"{self.prefix}: warning: config sync failed ({e}); trying again in "
                  f"{self.interval:.0f} s", file=self.out, flush=True)
            return
        self.on_synced()


class SinkConfigSync:
    """The store sink connector's config sync (``sync.topic.configs.enabled``, as MirrorMaker 2
    spells it), for ``kcompact connect standalone`` and ``kcompact mirror --engine local`` (whose
    lines it prefixes ``mirror:``; ``--no-sync-configs`` turns it off). Its tasks call
    :meth:`opened` from ``open()``, before any record of the partitions is fetched: a topic not
    synced yet is synced then (at the task's start, and for a topic that starts to match
    ``topics.regex`` while following). While following, a thread
    syncs every topic opened again every ``topic.metadata.refresh.interval.ms`` and the tasks'
    stores re-read store.json (a ``kcompact configs --alter`` reaches them the same way).
    :meth:`closed` (a topic stopped: deleted or recreated) leaves a topic out."""

    def __init__(self, store_url: str, kafka_conf: Mapping[str, Any], *, follow: bool,
                 commitlog_dir: str | None = None, out: TextIO | None = None,
                 prefix: str = "connect", writer: str | None = None):
        self.store_url, self.commitlog_dir = store_url, commitlog_dir
        self.history = None  # the synced values' history (replication/config_capture.py)
        if writer:
            from kcompact.replication.config_capture import ConfigCaptureWriter
            self.history = ConfigCaptureWriter(store_url, writer, commitlog_dir=commitlog_dir)
        self.kafka_conf = dict(kafka_conf)
        self.bootstrap = str(self.kafka_conf.get("bootstrap.servers", ""))
        self.follow, self.prefix = follow, prefix
        self.out = out if out is not None else sys.stderr
        self.topics: set[str] = set()
        self.stores: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def opened(self, store: Any, topics: Iterable[str]) -> None:
        """A task (writing ``store``) opened partitions of ``topics``."""
        with self._lock:
            if store not in self.stores:
                self.stores.append(store)
            new = sorted(set(topics) - self.topics)
            self.topics.update(new)
            if new:
                sync_configs(self.bootstrap, new, self.store_url, self.kafka_conf,
                             commitlog_dir=self.commitlog_dir, out=self.out, prefix=self.prefix,
                             history=self.history)
                store.reload_topic_configs()
            if self.follow and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="config-sync",
                                                daemon=True)
                self._thread.start()

    def closed(self, store: Any, topics: Iterable[str]) -> None:
        """A task stopped ``topics`` (deleted or recreated): no longer synced."""
        with self._lock:
            self.topics.difference_update(topics)

    def _run(self) -> None:
        def live() -> list[str]:
            with self._lock:
                return sorted(self.topics)

        def reload() -> None:
            with self._lock:
                stores = list(self.stores)
            for st in stores:
                try:
                    st.reload_topic_configs()
                except Exception:  # noqa: BLE001 - a closed store: its task ended
                    pass
        follower = ConfigFollower(self.bootstrap, live, self.store_url, self.kafka_conf,
                                  out=self.out, on_synced=reload, prefix=self.prefix,
                                  history=self.history)
        while not self._stop.wait(min(1.0, follower.interval)):
            follower()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        if self.history is not None:
            self.history.close()


__all__ = ["SYNCED_KEYS", "ConfigFollower", "SinkConfigSync", "describe_topics",
           "refresh_interval_ms", "source_configs", "sync_configs"]
