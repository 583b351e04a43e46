"""A following sink task's view of its topics as the cluster changes (sink_runner.py calls
:meth:`TopicWatcher.check` every metadata refresh interval).

* a topic read whole that gains partitions: the new ones are handed back to be assigned (the
  task opens them, so the store sink starts them at their first offset);
* a topic that starts to match ``topics.regex`` (framework/topic_sets.py): all its partitions;
* a followed topic deleted, or deleted and created again (a new topic id, read with
  describe_topics): a :class:`GoneTopic`, naming the topic and its old and new ids. The runner
  stops that topic only (the others go on), so that the records of a new topic never land after
  the old one's in the same partition log (its offsets start again at 0). The watcher forgets
  it: a recreated topic that still matches ``topics.regex`` is not picked up again.
  librdkafka itself goes on fetching at the same offset in the new topic without any error or
  log line (measured: Kafka 3.9.1 KRaft, librdkafka 2.16: delete, create and produce took 80 ms),
  so between two checks :meth:`TopicWatcher.verify` confirms the topic ids of every batch
  before it is stored (sink_runner.py, ``_verify_ids``).

With several tasks (``tasks.max``), every task's watcher watches every topic the connector reads
whole, and the partitions they find are spread over the tasks round-robin, as Connect's
rebalance would, by one :class:`PartitionClaims` the connector's tasks share: the first task to
find a partition gives it an owner, and each task assigns only its own.

Two requests per check: one metadata request for every topic (a consumer's ``list_topics``) and
one describe_topics of the followed topics (their ids). A broker that cannot answer describe_topics
is checked by partition counts and presence only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .api import TopicPartition
from .kafka_clients import admin_settings, kafka_error, kafka_logger
from .topic_sets import match_topics


def describe_topic_ids(admin: Any, topics: list[str]) -> tuple[dict[str, str], set[str]]:
    """(the ids of ``topics`` the broker described, the topics it said it does not know), by
    one describe_topics through ``admin`` (a confluent-kafka AdminClient); a topic in neither
    was not answered for (a broker away, a timeout, a broker without describe_topics)."""
    from confluent_kafka import KafkaError, TopicCollection
    out: dict[str, str] = {}
    unknown: set[str] = set()
    if not topics:
        return out, unknown
    try:
        futures = admin.describe_topics(TopicCollection(topics), request_timeout=5)
    except Exception:  # noqa: BLE001 - a broker without describe_topics: no id check
        return out, unknown
    for topic, fut in futures.items():
        try:
            tid = fut.result(timeout=10).topic_id
        except Exception as e:  # noqa: BLE001 - gone, or not answered
            err = kafka_error(e)
            if err is not None and err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                  KafkaError.UNKNOWN_TOPIC_ID):
                unknown.add(topic)
            continue
        if tid is not None:
            out[topic] = str(tid)
    return out, unknown


@dataclass(frozen=True)
class GoneTopic:
    """A followed topic that was deleted (``new_id`` None) or deleted and created again."""

    topic: str
    old_id: str | None
    new_id: str | None

    @property
    def reason(self) -> str:
        """``deleted (topic id X)`` or ``deleted and created again (topic id X -> Y)``."""
        old = self.old_id or "unknown"
        if self.new_id is None:
            return f"deleted (topic id {old})"
        return f"deleted and created again (topic id {old} -> {self.new_id})"

    def message(self) -> str:
        """The line that says so, and what to do next."""
        if self.new_id is None:
            after = ("a topic created again under that name starts its offsets at 0 again: "
                     "mirror it into a new store")
        else:
            after = ("nothing of the new topic was stored (its offsets start again at 0 and "
                     "would mix with the old topic's): mirror it into a new store")
        return (f"topic {self.topic} stopped, the other topics go on: it was {self.reason}; "
                f"its records mirrored so far stay in the store, and {after}. Leave it out of "
                "this store's next mirror (drop its --topic, or --exclude-regex it)")


class PartitionClaims:
    """Which task of a connector reads each partition found while following, shared by its
    tasks (threads of one worker): the first task to find a partition gives it to the next task
    in round-robin order, continuing the order of the assignment at start."""

    def __init__(self, tasks: int, assigned: int = 0):
        self.tasks = max(1, tasks)
        self._next = assigned % self.tasks
        self._owner: dict[TopicPartition, int] = {}
        self._lock = threading.Lock()

    def mine(self, task: int, found: Iterable[TopicPartition]) -> list[TopicPartition]:
        """Of the partitions ``found`` (in order), those that belong to ``task``."""
        out = []
        with self._lock:
            for tp in found:
                owner = self._owner.get(tp)
                if owner is None:
                    owner = self._owner[tp] = self._next
                    self._next = (self._next + 1) % self.tasks
                if owner == task:
                    out.append(tp)
        return out


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

    def _topic_ids(self, topics: list[str]) -> tuple[dict[str, str], set[str]]:
        from confluent_kafka.admin import AdminClient
        if not topics:
            return {}, set()
        if self._admin is None:
            self._admin = AdminClient(dict(self._conf, logger=kafka_logger()))
        return describe_topic_ids(self._admin, topics)

    def start(self) -> None:
        """Record the followed topics' ids (at the task's start)."""
        self.ids = self._topic_ids(sorted(self.whole))[0]

    def forget(self, topic: str) -> None:
        """Stop watching ``topic`` (it stays known: a regex does not pick it up again)."""
        self.whole.pop(topic, None)
        self.ids.pop(topic, None)

    def check(self, consumer: Any) -> tuple[list[TopicPartition], list[GoneTopic]]:
        """(the partitions to add: new ones of a whole topic, every one of a newly matching
        topic; the followed topics deleted or recreated, which are forgotten). Nothing when
        the broker did not answer (checked again next time)."""
        try:
            md = consumer.list_topics(timeout=5).topics
        except Exception:  # noqa: BLE001 - a broker away for a moment: check next time
            return [], []
        present = {t: m for t, m in md.items() if m.error is None}
        gone = [GoneTopic(t, self.ids.get(t), None) for t in sorted(self.whole)
                if t not in present]
        ids, _ = self._topic_ids(sorted(t for t in self.whole if t in present))
        for topic, tid in ids.items():
            old = self.ids.setdefault(topic, tid)
            if tid != old:
                gone.append(GoneTopic(topic, old, tid))
        for g in gone:
            self.forget(g.topic)
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
                self.ids.update(self._topic_ids([topic])[0])
        return new, gone

    def verify(self, topics: Iterable[str], stop: Callable[[], bool] = lambda: False
               ) -> list[GoneTopic] | None:
        """Before records of ``topics`` are stored (sink_runner.py): the topics whose ids are
        no longer the ones recorded (read after the records were fetched, so a topic deleted
        and created again before that is caught), forgotten. A topic the broker says it does
        not know is deleted (asked three times, 0.5 s apart, for the id of a new one). While
        the broker does not answer, asked again each second; None when ``stop()`` turns true
        first (nothing confirmed: the records must not be stored). A broker that gave no ids
        at start is not checked."""
        todo = sorted(t for t in set(topics) if t in self.ids)
        if not todo:
            return []
        ids: dict[str, str] = {}
        unknown_tries = 0
        while True:
            got, unknown = self._topic_ids([t for t in todo if t not in ids])
            ids.update(got)
            if len(ids) == len(todo):
                break
            if unknown:
                unknown_tries += 1
                if unknown_tries >= 3 and len(ids) + len(unknown) == len(todo):
                    break
            if stop():
                return None
            time.sleep(0.5 if unknown else 1.0)
        gone = [GoneTopic(t, self.ids[t], ids.get(t)) for t in todo
                if ids.get(t) != self.ids[t]]
        for g in gone:
            self.forget(g.topic)
        return gone

    def close(self) -> None:
        self._admin = None


__all__ = ["GoneTopic", "PartitionClaims", "TopicWatcher", "describe_topic_ids"]
