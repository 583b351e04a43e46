"""What the commands' options share, below every application that takes them.

* ``-X key=value`` librdkafka settings become connector overrides (``consumer.override.`` or
  ``producer.override.``): :func:`kafka_overrides`, which refuses a key that has a flag of its own;
* ``kcompact mirror``'s options (:class:`MirrorOptions`, ``--partitions`` read by
  :func:`parse_partitions`) and the store sink properties they stand for (:func:`mirror_props`):
  both engines run the same store sink, the local one in this process (apps/mirror.py) and the
  Spark one in one task per partition (apps/spark/mirror_job.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import ConfigError

#: -X keys that have their own flag.
OWN_FLAGS = {"bootstrap.servers": "--bootstrap-servers",
             "metadata.broker.list": "--bootstrap-servers"}
#: The commit-log writer of the local engine.
LOCAL_WRITER = "local"
#: The mirror's connector (and consumer group) name.
MIRROR_CONNECTOR = "kcompact-mirror"
#: The exit code of a mirror (or connect standalone) that ended normally (or by SIGTERM) after
#: stopping some topics (deleted or recreated while followed) and mirroring the others.
EXIT_TOPICS_STOPPED = 3
#: Store sink properties that a flag of ``kcompact mirror`` sets: errors name the flag.
MIRROR_FLAGS = {"store.partitions": "--partitions", "store.url": "--store"}


def kafka_overrides(kafka_config: Mapping[str, str], prefix: str) -> dict[str, str]:
    """``-X`` settings as connector properties under ``prefix`` (``consumer.override.``...)."""
    out = {}
    for k, v in kafka_config.items():
        if k in OWN_FLAGS:
            raise ConfigError(f"-X {k}: use {OWN_FLAGS[k]} instead")
        out[f"{prefix}{k}"] = v
    return out


@dataclass(frozen=True)
class MirrorOptions:
    """``kcompact mirror``: topics into a store, with the engine chosen (apps/mirror.py).

    The topics: ``topic`` and ``topics`` (named; ``--topic`` repeated) and those
    ``topics_regex`` matches whole, less internal ones and those ``exclude_regex`` matches
    (framework/topic_sets.py)."""

    bootstrap_servers: str
    topic: str | None
    store: str
    engine: str | None = None        # "spark", "local", or None: spark unless following
    spark_master: str | None = None
    follow: bool = False
    compact: bool = True             # --engine spark: the compaction stage after the mirror
    partitions: tuple[int, ...] | None = None
    kafka_config: Mapping[str, str] = field(default_factory=dict)  # -X consumer settings
    metrics: str | None = None       # --metrics HOST:PORT (--engine local)
    topics: tuple[str, ...] = ()
    topics_regex: str | None = None
    exclude_regex: str | None = None
    sync_configs: bool = True        # configs follow the source (plugins/config_sync.py)
    #: the source's consumer-group offsets kept in the store (plugins/group_sync.py)
    sync_groups: bool = True         # --no-groups: False
    groups: str | None = None        # --groups RE (default every group)
    exclude_groups: str | None = None  # --exclude-groups RE
    groups_interval_ms: int | None = None  # --sync-group-offsets-interval-ms (--follow)
    #: the source's ACL bindings kept in the store (plugins/acl_sync.py)
    sync_acls: bool = True           # --no-acls: False
    acls_interval_ms: int | None = None  # --sync-topic-acls-interval-ms (--follow)
    #: --schema-registry URL: the records' schemas kept in the store (plugins/schema_sync.py)
    schema_registry: str | None = None
    #: --upload: how an S3 store's writer uploads (WriterOptions.upload: auto, shared, partition)
    upload: str = "auto"
    #: --flush-interval-ms (None: 500 ms into an S3 store with shared uploads, else 5 s)
    flush_interval_ms: int | None = None

    @property
    def named_topics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(([self.topic] if self.topic else []) + list(self.topics)))


def named_topics(topic: str | Sequence[str] | None) -> list[str]:
    """A topic, several, or none -> the list of names (in order, without repeats)."""
    if topic is None:
        return []
    if isinstance(topic, str):
        return [topic]
    return list(dict.fromkeys(topic))


def parse_partitions(text: str | None) -> tuple[int, ...] | None:
    """``--partitions``: ``0,2,5`` or ranges ``0-3``, sorted without repeats; None for all."""
    if text is None or not text.strip():
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                out.extend(range(int(lo), int(hi) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"--partitions: {part!r} is not a partition number or range "
                              "(examples: 0,2,5 or 0-3)") from None
    if any(p < 0 for p in out):
        raise ConfigError("--partitions: partition numbers are >= 0")
    return tuple(sorted(set(out)))


def exit_code(signal_name: str | None, stopped: Mapping[str, str]) -> int:
    """A following run's exit code: 130 after SIGINT; else EXIT_TOPICS_STOPPED when topics
    were stopped (``stopped``: topic -> why); else 0."""
    if signal_name == "SIGINT":
        return 130
    return EXIT_TOPICS_STOPPED if stopped else 0


def add_mirror(worker: Any, props: Mapping[str, Any]) -> list[Any]:
    """Add the mirror's store sink (``props``: :func:`mirror_props`) to a framework Worker, as
    both engines do; a bad setting is reported with the flag the user gave (``--partitions``,
    ``--store``, ``-X key``). Returns its task runners."""
    try:
        return worker.add_connector(props, where="mirror", consumer_origin=lambda k: f"-X {k}")
    except ConfigError as e:
        raise e.for_flags(MIRROR_FLAGS) from None


def mirror_props(topic: str | Sequence[str] | None, store: str, *,
                 partitions: tuple[int, ...] | list[int] | None, follow: bool,
                 kafka_config: Mapping[str, str], writer: str = LOCAL_WRITER,
                 topics_regex: str | None = None, exclude_regex: str | None = None,
                 sync_configs: bool = False, sync_groups: bool = True,
                 groups: str | None = None, exclude_groups: str | None = None,
                 groups_interval_ms: int | None = None,
                 upload: str = "auto", sync_acls: bool = True,
                 acls_interval_ms: int | None = None,
                 schema_registry: str | None = None) -> dict[str, Any]:
    """The store sink connector's properties for a mirror of ``topic`` (one name or several)
    and the topics ``topics_regex`` matches into ``store``. ``sync_configs``: the connector's
    tasks sync each topic's configs when they open it (the local engine: at start and for a
    topic picked up while following) and, while following, at each metadata refresh; the Spark
    engine syncs in its driver instead (False)."""
    names = named_topics(topic)
    if not names and not topics_regex:
        raise ConfigError("give --topic T (repeatable) or --topics-regex PATTERN")
    props: dict[str, Any] = {
        "name": MIRROR_CONNECTOR,
        "connector.class": "StoreSinkConnector",
        "tasks.max": 1,
        "topics": ",".join(names),
        "store.url": store,
        "store.writer": writer,
        "follow": follow,
        "store.compaction.background": follow,
        # --no-sync-configs (apps/mirror.py); the Spark engine's driver syncs by itself
        "sync.topic.configs.enabled": sync_configs,
        # --no-groups; the Spark engine's driver captures by itself
        "sync.group.offsets.enabled": sync_groups,
        # --no-acls; the Spark engine's driver captures by itself
        "sync.topic.acls.enabled": sync_acls,
    }
    if acls_interval_ms:
        props["sync.topic.acls.interval.ms"] = acls_interval_ms
    if schema_registry:
        props["schema.registry.url"] = schema_registry
    if upload != "auto":
        props["store.upload"] = upload
    if groups:
        props["groups"] = groups
    if exclude_groups:
        props["groups.exclude"] = exclude_groups
    if groups_interval_ms:
        props["sync.group.offsets.interval.ms"] = groups_interval_ms
    if topics_regex:
        props["topics.regex"] = topics_regex
    if exclude_regex:
        props["topics.exclude.regex"] = exclude_regex
    if partitions:
        props["store.partitions"] = ",".join(map(str, partitions))
    props.update(kafka_overrides(kafka_config, "consumer.override."))
    return props


def lag_text(lag: Mapping) -> str:
    """The worst lags: ``p0=12 p3=4`` for one topic, ``orders: p0=12; users: p1=3`` for
    several (at most 8 partitions named)."""
    worst = sorted(lag.items(), key=lambda kv: (-kv[1], kv[0].topic, kv[0].partition))[:8]
    more = f" (+{len(lag) - len(worst)} more)" if len(lag) > len(worst) else ""
    topics = sorted({tp.topic for tp in lag})
    if len(topics) == 1:
        return " ".join(f"p{tp.partition}={v:,}" for tp, v in sorted(
            worst, key=lambda kv: kv[0].partition)) + more
    by_topic: dict[str, list] = {}
    for tp, v in sorted(worst, key=lambda kv: (kv[0].topic, kv[0].partition)):
        by_topic.setdefault(tp.topic, []).append(f"p{tp.partition}={v:,}")
    return "; ".join(f"{t}: {' '.join(ps)}" for t, ps in by_topic.items()) + more
