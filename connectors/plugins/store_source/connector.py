"""The store source connector: re-publishes a store topic into Kafka (``kcompact restore``).

Its properties (``STORE_SOURCE_CONFIG``), checked before anything starts; its one task
(task.py); and the runner the worker runs it with (runner.py), which owns the Kafka side.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import ConfigError
from ...framework.api import SourceConnector, SourceTask
from ...framework.config import ConfigDef, Importance, Type, at_least, between, one_of
from .progress import PROGRESS_TOPIC
from .runner import RestoreRunner
from .task import StoreSourceTask, open_store_topic

STORE_SOURCE_CONFIG = (
    ConfigDef()
    .define("store.url", Type.STRING, None, None, Importance.HIGH,
            "The store to read: a directory (file:// also accepted) or s3://bucket/prefix. "
            "Required.")
    .define("store.topic", Type.STRING, None, None, Importance.HIGH,
            "The store topic to restore. Required.")
    .define("topic", Type.STRING, "", None, Importance.HIGH,
            "The Kafka topic to produce to (default: store.topic). Created with the store's "
            "partition count when missing.")
    .define("mode", Type.STRING, "latest", one_of("latest", "all"), Importance.HIGH,
            "latest: the latest value per key (the compacted state). all: every stored record.")
    .define("repartition", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Place records with Kafka's default partitioner (murmur2 of the key) instead of "
            "keeping their partition numbers; needed when the target has fewer partitions.")
    .define("exactly.once.support", Type.STRING, "requested",
            one_of("requested", "required", "disabled"), Importance.MEDIUM,
            "requested: a transactional producer when the broker supports transactions, else "
            "the idempotent one. required: fail without transactions. disabled: idempotent.")
    .define("restore.from.scratch", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Ignore recorded progress and produce everything again.")
    .define("restore.chunk.records", Type.INT, 250_000, between(1, 10_000_000), Importance.LOW,
            "Records per chunk: one transaction, then one progress record.")
    .define("target.replication.factor", Type.INT, -1, at_least(-1), Importance.LOW,
            "Replication factor of topics the restore creates; -1 = the broker's default.")
    .define("progress.topic", Type.STRING, PROGRESS_TOPIC, None, Importance.LOW,
            "Internal compacted topic, in the store and on the target cluster, that keeps "
            "restore progress.")
    .define("as.of.ms", Type.LONG, None, None, Importance.MEDIUM,
            "Restore the state as of this time (epoch ms): per key its latest record with a "
            "timestamp at or before it. Refused when compaction already cleaned history past "
            "it, unless as.of.allow.inexact. Default: the latest state.")
    .define("as.of.allow.inexact", Type.BOOLEAN, False, None, Importance.LOW,
            "With as.of.ms: restore from what the store still holds even when compaction "
            "cleaned history past that time.")
    .define("groups", Type.STRING, None, None, Importance.MEDIUM,
            "A regular expression: once the restore is done, commit the kept positions of the "
            "groups whose whole id it matches on the target topic, translated exactly "
            "(groups with active members are skipped). Not with repartition.")
    .define("acls", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Once the restore is done, create on the target the source ACL bindings the store "
            "keeps for the store topic and the groups kept with it (store_source/acls.py); "
            "bindings already there are left alone. A target without an authorizer is one "
            "warning.")
    .define("configs", Type.BOOLEAN, False, None, Importance.MEDIUM,
            "Create the target topic with the configs synced from the source (as of as.of.ms "
            "when given: the store's config history, replication/config_capture.py) besides "
            "its cleanup.policy; a target that exists keeps its own.")
    .define("acls.principal.map", Type.LIST, [], None, Importance.LOW,
            "OLD=NEW pairs (comma-separated): principals renamed in the ACLs created.")
    .define("schema.registry.url", Type.STRING, None, None, Importance.MEDIUM,
            "The target's schema registry: before any record is produced, the schemas the "
            "store keeps for the topic are registered there, and every key's and value's "
            "wire-format schema id is rewritten to the target's (plugins/schema_sync.py).")
    .define("schema.keep.ids", Type.BOOLEAN, False, None, Importance.LOW,
            "With schema.registry.url: register under the source ids (import mode).")
    .define("store.commitlog.dir", Type.STRING, None, None, Importance.LOW,
            "Local directory for the progress writer's commit log when store.url is not a "
            "local directory (S3).")
)


class StoreSourceConnector(SourceConnector):
    """Re-publishes a store topic into Kafka (``kcompact restore``). One task: the produce loop
    is bound by one Python thread anyway, and one transactional producer keeps progress simple.

    The worker runs it with :class:`~.runner.RestoreRunner` (``make_runners``), which
    owns the producer, the target topic, the transactions and the progress records.
    """

    CONFIG = STORE_SOURCE_CONFIG

    def start(self, props: Mapping[str, Any]) -> None:
        super().start(props)
        for key in ("store.url", "store.topic"):
            if not props.get(key):
                raise ConfigError(f"{key}: required by StoreSourceConnector")
        from kcompact.reput.record import validate_topic
        from kcompact.reput.errors import ReputError
        for key in ("topic", "progress.topic"):
            if props.get(key):
                try:
                    validate_topic(props[key])
                except ReputError as e:
                    raise ConfigError(f"{key}: {e}") from None
        if props.get("groups") and props.get("repartition"):
            raise ConfigError("groups: group positions are not translated with repartition "
                              "(records change partitions, so a group's position in a source "
                              "partition has no place in the target's); restore without "
                              "--repartition to translate them")
        if props.get("groups"):
            import re
            try:
                re.compile(props["groups"])
            except re.error as e:
                raise ConfigError(f"groups: {props['groups']!r} is not a regular expression "
                                  f"({e})") from None
        # before any thread or Kafka client: a missing store or topic is a one-line error
        open_store_topic(props["store.url"], props["store.topic"]).close()

    def task_class(self) -> type[SourceTask]:
        return StoreSourceTask

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        return [dict(self.props, **{"task.id": 0})]

    def make_runners(self, **kw) -> list[Any]:
        return [RestoreRunner(connector=self, **kw)]
