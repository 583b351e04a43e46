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
* The store source's offsets are its restore progress (docs/formats/restore-progress.md: the
  job's newest record of the store's and the target cluster's ``__kcompact-restore-offsets``),
  one entry per store partition: ``{"partition": {"partition": P}, "offset": {"position": N}}``
  (every record of partition P below store offset N that the mode selects has been produced),
  the task's own source partition and offset. DELETE appends a reset record to the store's
  progress (as ``restore --from-scratch`` does: a resume produces everything again); PATCH
  appends one with the given positions (an offset of null: back to 0). Both answer Connect's
  ``{"message": ...}``. Another source connector's: not offered yet (400).

PATCH and DELETE need the connector STOPPED (400 otherwise, with Connect's message); GET works
in any state.
"""

from __future__ import annotations

import json
from typing import Any

from .herder import ConnectRestError, Herder


def _is_a(config: dict[str, str], base: type) -> bool:
    from ...framework.worker import connector_class
    try:
        return issubclass(connector_class(config.get("connector.class") or ""), base)
    except Exception:  # noqa: BLE001 - not loadable: not one
        return False


def _is_store_sink(config: dict[str, str]) -> bool:
    from ...plugins.store_sink import StoreSinkConnector
    return _is_a(config, StoreSinkConnector)


def _is_store_source(config: dict[str, str]) -> bool:
    from ...plugins.store_source import StoreSourceConnector
    return _is_a(config, StoreSourceConnector)


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
    if _is_store_source(config):
        _job, _values, last = _restore_progress(herder, name, config)
        return {"offsets": [] if last is None else
                [_source_entry(p, n) for p, n in sorted(last.positions.items())]}
    raise ConnectRestError(400, f"Connector {name}: the offsets of this {kind} connector are "
                           "not offered by kcompact's API yet (the store source's are)")


# -- the store source: its restore progress ---------------------------------------------------


def _source_entry(partition: int, position: int) -> dict[str, Any]:
    return {"partition": {"partition": partition}, "offset": {"position": position}}


def _restore_progress(herder: Herder, name: str, config: dict[str, str]):
    """(the restore job, the connector's parsed values, its newest progress record or None):
    the job is named by the store's id and the target cluster's (asked of its metadata)."""
    from confluent_kafka import Consumer, KafkaException
    from ...framework.kafka_clients import kafka_logger
    from ...framework.worker import validate_connector
    from ...plugins.store_source.progress import (PROBE_CONSUMER_CONFIG, PROGRESS_TOPIC,
                                                  RestoreJob, StoreProgress, newest,
                                                  read_kafka_progress)
    from ...plugins.store_source.runner import _PRODUCER_ONLY
    from ...plugins.store_source.task import open_store_topic
    _cls, values = validate_connector(config, where=f"connector {name}")
    w = herder.worker
    timeout = w.config["startup.timeout.ms"] / 1000
    topic = values["store.topic"]
    target = values.get("topic") or topic
    progress_topic = values.get("progress.topic") or PROGRESS_TOPIC
    with open_store_topic(values["store.url"], topic) as st:
        store_id = st.meta.store_id
    settings = w._settings("producer", {}, values, None)  # the connector's producer settings
    conf = {k: v for k, v in settings.conf.items() if k not in _PRODUCER_ONLY}
    try:
        c = Consumer(dict(conf, **PROBE_CONSUMER_CONFIG, logger=kafka_logger()))
    except KafkaException as e:
        raise settings.explain(e, "Kafka consumer") from None
    try:
        try:
            md = c.list_topics(timeout=timeout)
        except KafkaException as e:
            raise ConnectRestError(500, f"Connector {name}: cannot read the target cluster's "
                                   f"metadata at {w.bootstrap}: {e}") from None
        job = RestoreJob(store_id, topic, md.cluster_id or w.bootstrap, target)
        kafka_p = read_kafka_progress(c, progress_topic, job, w.bootstrap, max(timeout, 30.0)) \
            if progress_topic in md.topics else None
    finally:
        c.close()
    store_p = StoreProgress(values["store.url"], job, topic=progress_topic,
                            commitlog_dir=values.get("store.commitlog.dir")).read()
    return job, values, newest(store_p, kafka_p)


def _write_progress(values: dict[str, Any], job, progress) -> None:
    from ...plugins.store_source.progress import PROGRESS_TOPIC, StoreProgress
    sp = StoreProgress(values["store.url"], job,
                       topic=values.get("progress.topic") or PROGRESS_TOPIC,
                       commitlog_dir=values.get("store.commitlog.dir"))
    try:
        sp.write(progress)
    finally:
        sp.close()


def _positions(name: str, doc: dict[str, Any], values: dict[str, Any]) -> dict[int, int | None]:
    """PATCH's body -> store partition -> position (None: back to 0), checked against the
    store topic's partitions and their ends."""
    from kcompact.reput import Store
    out: dict[int, int | None] = {}
    with Store.open(values["store.url"], commitlog_dir=values.get("store.commitlog.dir")) as st:
        topic = values["store.topic"]
        known = set(st.partitions(topic))
        for entry in doc["offsets"]:
            part = entry.get("partition") if isinstance(entry, dict) else None
            if not isinstance(part, dict) or set(part) != {"partition"} or \
                    not isinstance(part["partition"], int) or isinstance(part["partition"], bool):
                raise ConnectRestError(400, f"Connector {name}: each partition must be "
                                       '{"partition": N} (a partition of store topic '
                                       f"{topic!r}); got {json.dumps(part)}")
            p = part["partition"]
            if p not in known:
                raise ConnectRestError(400, f"Connector {name}: store topic {topic!r} has no "
                                       f"partition {p} (it has {sorted(known)})")
            off = entry.get("offset")
            if off is None:
                out[p] = None
                continue
            pos = off.get("position") if isinstance(off, dict) and set(off) == {"position"} \
                else None
            if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
                raise ConnectRestError(400, f"Connector {name}: partition {p}'s offset must be "
                                       '{"position": N} with N >= 0 (a store offset), or null; '
                                       f"got {json.dumps(off)}")
            end = st.next_offset(topic, p)
            if pos > end:
                raise ConnectRestError(400, f"Connector {name}: position {pos} of partition "
                                       f"{p} is past the end of store topic {topic!r} "
                                       f"(its next offset is {end})")
            out[p] = pos
    return out


def _alter_store_source(herder: Herder, name: str, config: dict[str, str],
                        doc: dict[str, Any] | None) -> dict[str, Any]:
    """PATCH (``doc``) or DELETE (None) of a stopped store source's progress."""
    from ...plugins.store_source.progress import Progress
    job, values, last = _restore_progress(herder, name, config)
    mode, as_of = values.get("mode") or "latest", values.get("as.of.ms")
    if doc is None:  # a reset record, as restore --from-scratch writes
        _write_progress(values, job, Progress.start(job, mode, last.seq if last else 0, as_of)
                        .advance({}, 0, False, False))
        return {"message": "The offsets for this connector have been reset successfully"}
    moves = _positions(name, doc, values)
    base = last if last is not None else Progress.start(job, mode, 0, as_of)
    positions = dict(base.positions)
    for p, pos in moves.items():
        if pos is None or pos == 0:
            positions.pop(p, None)
        else:
            positions[p] = pos
    _write_progress(values, job, base.advance(positions, 0, False, base.transactional,
                                              mapped=base.mapped))
    return {"message": "The offsets for this connector have been altered successfully"}


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
    with herder.lock:  # no resume while the progress is written
        config = _must_be_stopped(herder, name)
        if _is_store_source(config):
            return _alter_store_source(herder, name, config, doc)
    raise _refuse(name, config, "alter", "altered")


def reset_offsets(herder: Herder, name: str) -> dict[str, Any]:
    with herder.lock:  # no resume while the progress is written
        config = _must_be_stopped(herder, name)
        if _is_store_source(config):
            return _alter_store_source(herder, name, config, None)
    raise _refuse(name, config, "reset", "reset")
