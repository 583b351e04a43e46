"""The LevelDB sink as a Connect-style connector: a Kafka topic -> a key-value map directory.

    connector.class=kcompact.connectors.plugins.leveldb_connector.LevelDBSinkConnector
    topics=users
    kv.db=/data/users.kv

for ``kcompact connect standalone``. The worker owns the consumer; the task applies each batch
through :class:`~kcompact.connectors.plugins.leveldb_sink.LevelDBSink` (the records' bytes as Kafka
holds them, the partitions' next offsets in the same WriteBatch), starts every partition at the
map's own offset and commits nothing to the consumer group: exactly once, as ``kcompact kv build``
is. One task (LevelDB is one process per database) and one topic per map.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..framework.api import OFFSET_BEGINNING, SinkConnector, SinkRecords, SinkTask, TopicPartition
from ..framework.config import ConfigDef, Importance, Type
from ..errors import ConfigError
from .leveldb_sink import LevelDBSink, open_db

LEVELDB_SINK_CONFIG = ConfigDef().define(
    "kv.db", Type.STRING, None, None, Importance.HIGH,
    "The map directory (created when missing; it keeps one topic). Required.")


class LevelDBSinkConnector(SinkConnector):
    """Keeps a local LevelDB map of a topic's latest value per key."""

    CONFIG = LEVELDB_SINK_CONFIG

    def start(self, props: Mapping[str, Any]) -> None:
        super().start(props)
        if not props.get("kv.db"):
            raise ConfigError("kv.db: required by LevelDBSinkConnector (the map directory)")

    def task_class(self) -> type[SinkTask]:
        return LevelDBSinkTask

    def task_configs(self, max_tasks: int) -> list[dict[str, Any]]:
        return [dict(self.props, **{"task.id": 0})]   # one process per LevelDB database


class LevelDBSinkTask(SinkTask):
    #: Consumer settings this task cannot work without (the worker rejects an override).
    REQUIRED_CONSUMER_CONFIG = {"isolation.level": "read_committed"}
    #: Defaults the user may override: a map whose next offset left the topic stops, loudly.
    DEFAULT_CONSUMER_CONFIG = {"auto.offset.reset": "error"}

    db: Any = None

    def start(self, props: Mapping[str, Any]) -> None:
        self.path = str(props["kv.db"])
        self.db = open_db(self.path, create=True)
        self.sink = LevelDBSink(self.db, self.path)

    def open(self, partitions: Sequence[TopicPartition]) -> None:
        for topic in sorted({tp.topic for tp in partitions}):
            self.sink.bind(topic)   # a map holds one topic: a second one is refused here
        self.context.offset({tp: self.sink.offsets.get(tp.partition, OFFSET_BEGINNING)
                             for tp in partitions})

    def put(self, records: SinkRecords) -> None:
        if len(records) == 0:
            return
        for topic in set(records.topics):
            self.sink.bind(topic)
        nxt: dict[int, int] = {}
        for p, off in zip(records.partitions, records.offsets):
            nxt[int(p)] = int(off) + 1
        self.sink.apply(list(records.raw_keys), list(records.raw_values), nxt)

    def pre_commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        return {}   # the map's own offsets are the position: nothing goes to the group

    def stop(self) -> None:
        if self.db is not None and not self.db.closed:
            self.db.close()
