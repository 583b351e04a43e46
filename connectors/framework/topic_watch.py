"""A following sink task's view of its topics as the cluster changes (sink_runner.py calls
:meth:`TopicWatcher.check` every metadata refresh interval).

* a topic read whole that gains partitions: the new ones are handed back to be assigned (the
  task opens them, so the store sink starts them at their first offset);
* a topic that starts to match ``topics.regex`` (framework/topic_sets.py): all its partitions;
* a followed topic deleted, or deleted and created again (a new topic id, read with
  describe_topics): :class:`TopicGoneError`, naming the topic, so that the records of a new topic
  never land after the old one's in the same partition log (its offsets start again at 0).
  librdkafka itself goes on fetching at the same offset in the new topic without any error or
  log line (measured: Kafka 3.9.1 KRaft, librdkafka 2.16: delete, create and produce took 80 ms),
  so between two checks :meth:`TopicWatcher.verify` confirms the topic ids of each batch before
  it is stored (sink_runner.py says when it may skip that).

Two requests per check: one metadata request for every topic (a consumer's ``list_topics``) and
one describe_topics of the followed topics (their ids). A broker that cannot answer describe_topics
is checked by partition counts and presence only.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from ..errors import ConnectorsError
from .api import TopicPartition
from .kafka_clients import admin_settings, kafka_logger
from .topic_sets import match_topics


#: A full batch that follows a full batch of the same topic within this many seconds is stored
#: without confirming the topic's id again (sink_runner.py, ``_verify_resumed``).
RESUME_CHECK_S = 1.0


class TopicGoneError(ConnectorsError):
    """A followed topic was deleted (and maybe created again) under the task."""


class TopicWatcher:
    def __init__(self, consumer_conf: Mapping[str, Any], whole_topics: Mapping[str, int], *,
                 connector: str, regex: str | None = None, exclude: str | None = None,
                 known: Iterable[str] = ()):
        self.connector = connector
        self.whole = dict(whole_topics)          # topic -> partitions assigned (all of them)
        self.regex, self.exclude = regex or None, exclude or None
        self.known = set(known) | set(self.whole)  # every topic the task reads (or a subset of)
        self.ids: dict[str, str] = {}
        self._admin: Any = None
        self._conf = admin_settings(consumer_conf)

    def _topic_ids(self, topics: list[str]) -> dict[str, str]:
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient
        if not topics:
            return {}
        if self._admin is None:
            self._admin = AdminClient(dict(self._conf, logger=kafka_logger()))
        out = {}
        try:
            futures = self._admin.describe_topics(TopicCollection(topics), request_timeout=5)
        except Exception:  # noqa: BLE001 - a broker without describe_topics: no id check
            return {}
        for topic, fut in futures.items():
            try:
                tid = fut.result(timeout=10).topic_id
            except Exception:  # noqa: BLE001 - gone: the metadata check says so
                continue
            if tid is not None:
                out[topic] = str(tid)
        return out

    def start(self) -> None:
        """Record the followed topics' ids (at the task's start)."""
        self.ids = self._topic_ids(sorted(self.whole))

    def check(self, consumer: Any) -> list[TopicPartition]:
        """The partitions to add (new ones of a whole topic, every one of a newly matching
        topic); raises TopicGoneError for a followed topic deleted or recreated. Returns []
        when the broker did not answer (checked again next time)."""
        try:
            md = consumer.list_topics(timeout=5).topics
        except Exception:  # noqa: BLE001 - a broker away for a moment: check next time
            return []
        present = {t: m for t, m in md.items() if m.error is None}
        for topic in sorted(self.whole):
            if topic not in present:
                raise TopicGoneError(
                    f"topic {topic} was deleted while {self.connector} followed it; its "
                    "partitions' records stay in the store. Restart without it, or mirror a "
                    "topic created again under that name into a new store")
        ids = self._topic_ids(sorted(self.whole))
        for topic, tid in ids.items():
            old = self.ids.setdefault(topic, tid)
            if tid != old:
                raise TopicGoneError(
                    f"topic {topic} was deleted and created again (topic id {old} -> {tid}) "
                    f"while {self.connector} followed it; stopped before any record of the "
                    "new topic was stored (its offsets start again at 0 and would mix with the "
                    "old topic's): mirror it into a new store")
        new: list[TopicPartition] = []
        for topic, count in sorted(self.whole.items()):
            parts = sorted(present[topic].partitions)
            if len(parts) > count:
                new += [TopicPartition(topic, p) for p in parts if p >= count]
                self.whole[topic] = len(parts)
        if self.regex:
            for topic in match_topics(present, (), self.regex, self.exclude):
                if topic in self.known:
                    continue
                self.known.add(topic)
                parts = sorted(present[topic].partitions)
                self.whole[topic] = len(parts)
                new += [TopicPartition(topic, p) for p in parts]
                self.ids.update(self._topic_ids([topic]))
        return new

    def verify(self, topics: Iterable[str]) -> None:
        """Before records of ``topics`` are stored (sink_runner.py): their topic ids are still
        the ones recorded, read after the records were fetched, so a topic deleted and created
        again before that is caught. Raises TopicGoneError; a broker that gave no ids at start
        is not checked."""
        todo = sorted(t for t in set(topics) if t in self.ids)
        if not todo:
            return
        ids: dict[str, str] = {}
        for _ in range(3):
            ids = self._topic_ids(todo)
            if len(ids) == len(todo):
                break
            time.sleep(0.5)
        for topic in todo:
            tid = ids.get(topic)
            if tid is None:
                raise TopicGoneError(
                    f"topic {topic}: records arrived but describe_topics does not know the "
                    f"topic (deleted and being created again?) while {self.connector} followed "
                    "it; stopped before storing them: check the topic, and mirror a topic "
                    "created again under that name into a new store")
            if tid != self.ids[topic]:
                raise TopicGoneError(
                    f"topic {topic} was deleted and created again (topic id {self.ids[topic]} "
                    f"-> {tid}) while {self.connector} followed it; stopped before any record "
                    "of the new topic was stored (its offsets start again at 0 and would mix "
                    "with the old topic's): mirror it into a new store")

    def close(self) -> None:
        self._admin = None


__all__ = ["RESUME_CHECK_S", "TopicGoneError", "TopicWatcher"]
