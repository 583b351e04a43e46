"""KIP-875's ``GET|PATCH|DELETE /connectors/{name}/offsets``, in Connect's shape
(``{"offsets": [{"partition": {...}, "offset": {...}}]}``; a sink's partition is
``{"kafka_topic": T, "kafka_partition": P}`` and its offset ``{"kafka_offset": N}``).

* The store sink keeps no consumer-group offsets: its offsets *are* the store's next offsets
  (the offset after the last record the store holds, per partition), read from the store. They
  move only with the store's contents, so PATCH and DELETE answer 400 saying so: moving them
  back would store records twice, forward would leave a gap the store cannot tell from
  compaction. To mirror again from the start, point ``store.url`` at a new store.
* Another sink's offsets are its consumer group's (``connect-<name>``) committed offsets;
  changing them is not offered (400).
* Source connectors: not offered yet (400 on GET, PATCH and DELETE alike would hide progress:
  the store source keeps its restore progress in the store and on the target cluster,
  docs/formats/restore-progress.md).

PATCH and DELETE need the connector STOPPED (400 otherwise, with Connect's message); GET works
in any state.
"""

from __future__ import annotations

from typing import Any

from .herder import ConnectRestError, Herder

STORE_SINK = "kcompact.connectors.plugins.store_sink.StoreSinkConnector"


def _class_of(config: dict[str, str]) -> str:
    from ...framework.worker import BUILTIN_CONNECTORS
    c = (config.get("connector.class") or "").strip()
    return BUILTIN_CONNECTORS.get(c, c)


def _is_store_sink(config: dict[str, str]) -> bool:
    from ...framework.worker import connector_class
    from ...plugins.store_sink import StoreSinkConnector
    try:
        return issubclass(connector_class(config.get("connector.class") or ""),
                          StoreSinkConnector)
    except Exception:  # noqa: BLE001 - not loadable: not a store sink
        return False


def _sink_entry(topic: str, partition: int, offset: int) -> dict[str, Any]:
    return {"partition": {"kafka_topic": topic, "kafka_partition": partition},
            "offset": {"kafka_offset": offset}}


def _store_offsets(herder: Herder, name: str, config: dict[str, str]) -> list[dict]:
    from kcompact.reput import Store, StoreNotFoundError
    topics = [t.strip() for t in (config.get("topics") or "").split(",") if t.strip()]
    topics = sorted(set(topics) | set(herder.active_topics(name)))
    try:
        store = Store.open(config["store.url"], commitlog_dir=config.get("store.commitlog.dir"))
    except StoreNotFoundError:
        return []
    try:
        out = []
        known = set(store.topics())
        for t in topics:
            if t not in known:
                continue
            parts = sorted(set(store.recorded_partitions(t)) | set(store.partitions(t)))
            for p in parts:
                out.append(_sink_entry(t, p, store.next_offset(t, p)))
        return out
    finally:
        store.close()


def _group_offsets(herder: Herder, name: str) -> list[dict]:
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient
    from ...framework.kafka_clients import kafka_logger, short_lived
    w = herder.worker
    s = w._settings("admin", {}, {}, None)  # the worker's admin.* settings
    admin = AdminClient(short_lived(dict(s.conf, logger=kafka_logger())))
    group = f"connect-{name}"
    fut = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                            request_timeout=10)[group]
    res = fut.result()
    return [_sink_entry(tp.topic, tp.partition, tp.offset)
            for tp in sorted(res.topic_partitions or [], key=lambda x: (x.topic, x.partition))
            if tp.offset >= 0]


def connector_offsets(herder: Herder, name: str) -> dict[str, Any]:
    with herder.lock:
        m = herder.get(name)
        config = dict(m.config)
        kind = m.type
    if kind == "sink":
        if _is_store_sink(config):
            return {"offsets": _store_offsets(herder, name, config)}
        return {"offsets": _group_offsets(herder, name)}
    raise ConnectRestError(400, f"Connector {name}: the offsets of a {kind} connector are not "
                           "offered by kcompact's API yet (the store source keeps its restore "
                           "progress in the store: `kcompact restore` reports it)")


def _must_be_stopped(herder: Herder, name: str) -> dict[str, str]:
    with herder.lock:
        m = herder.get(name)
        if m.target != "STOPPED":
            raise ConnectRestError(400, "Connectors must be in the STOPPED state before their "
                                   "offsets can be modified. This can be done for the specified "
                                   f"connector by issuing a 'PUT' request to the '/connectors/"
                                   f"{name}/stop' endpoint")
        return dict(m.config)


def _refuse(name: str, config: dict[str, str], verb: str, done: str) -> ConnectRestError:
    if _is_store_sink(config):
        return ConnectRestError(400, f"Connector {name}: a store sink's offsets are the store's "
                                "own next offsets (the offset after the last record it holds); "
                                f"they cannot be {done}: that would store records twice or "
                                "leave a gap. To mirror from the start again, give store.url a "
                                "new store (PUT /connectors/" + name + "/config)")
    return ConnectRestError(400, f"Connector {name}: kcompact's API does not {verb} a "
                            "connector's offsets yet")


def alter_offsets(herder: Herder, name: str, doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not doc.get("offsets") or \
            not isinstance(doc.get("offsets"), list):
        raise ConnectRestError(400, "Partitions / offsets need to be provided for an alter "
                               "offsets request")
    config = _must_be_stopped(herder, name)
    raise _refuse(name, config, "alter", "altered")


def reset_offsets(herder: Herder, name: str) -> dict[str, Any]:
    config = _must_be_stopped(herder, name)
    raise _refuse(name, config, "reset", "reset")
