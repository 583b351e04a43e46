"""A following sink task's view of its topics as the cluster changes (:class:`TopicWatcher`,
whose :meth:`~TopicWatcher.check` runs every metadata refresh interval), and what the task does
with it (:class:`TopicFollowing`, mixed into sink_runner.SinkTaskRunner).

* a topic read whole that gains partitions: the new ones are handed back to be assigned (the
  task opens them, so the store sink starts them at their first offset);
* a topic that starts to match ``topics.regex`` (framework/topic_sets.py): all its partitions,
  once its topic id is known (handed to the task's ``open()``, where the store sink records it
  with the partitions before any record is fetched);
* a followed topic (read whole, matched by ``topics.regex``, or only some of its partitions:
  ``store.partitions``, ``--partitions``) deleted, or deleted and created again (a new topic
  id, read with describe_topics): a :class:`GoneTopic`, naming the topic and its old and new
  ids. The runner stops that topic only (the others go on), so that the records of a new topic
  never land after the old one's in the same partition log (its offsets start again at 0). The
  watcher forgets it: a recreated topic that still matches ``topics.regex`` is not picked up
  again. librdkafka itself goes on fetching at the same offset in the new topic without any
  error or log line (measured: Kafka 3.9.1 KRaft, librdkafka 2.16: delete, create and produce
  took 80 ms), so between two checks :meth:`TopicWatcher.verify` confirms the topic ids of
  every batch before it is stored (:meth:`TopicFollowing._verify_ids`).

With several tasks (``tasks.max``), every task's watcher watches every topic the connector reads
whole, and the partitions they find are spread over the tasks round-robin, as Connect's
rebalance would, by one :class:`PartitionClaims` the connector's tasks share: the first task to
find a partition gives it an owner, and each task assigns only its own. A topic the connector
reads at start, whichever task reads it, is never a new match of ``topics.regex``.

Two requests per check: one metadata request for every topic (a consumer's ``list_topics``) and
one describe_topics of the followed topics (their ids). A broker that cannot answer
describe_topics is checked by partition counts and presence only.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

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
    """One following task's watch (module docstring). ``whole_topics``: the connector's topics
    read whole (topic -> partition count), watched for new partitions by every task;
    ``followed``: the topics this task reads (some partitions or all), whose ids are checked;
    ``known``: every topic of the connector, which ``topics.regex`` does not pick up again."""

    def __init__(self, consumer_conf: Mapping[str, Any], whole_topics: Mapping[str, int], *,
                 connector: str, regex: str | None = None, exclude: str | None = None,
                 known: Iterable[str] = (), followed: Iterable[str] = ()):
        self.connector = connector
        self.whole = dict(whole_topics)          # topic -> partitions assigned (all of them)
        self.regex, self.exclude = regex or None, exclude or None
        #: the topics whose deletion or re-creation is watched (their ids in ``ids``)
        self.followed = set(followed) | set(self.whole)
        self.known = set(known) | self.followed  # never picked up again by topics.regex
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
        self.ids = self._topic_ids(sorted(self.followed))[0]

    def forget(self, topic: str) -> None:
        """Stop watching ``topic`` (it stays known: a regex does not pick it up again)."""
        self.whole.pop(topic, None)
        self.ids.pop(topic, None)
        self.followed.discard(topic)

    def check(self, consumer: Any) -> tuple[list[TopicPartition], list[GoneTopic]]:
        """(the partitions to add: new ones of a whole topic, every one of a newly matching
        topic; the followed topics deleted or recreated, which are forgotten). Nothing when
        the broker did not answer (checked again next time)."""
        try:
            md = consumer.list_topics(timeout=5).topics
        except Exception:  # noqa: BLE001 - a broker away for a moment: check next time
            return [], []
        present = {t: m for t, m in md.items() if m.error is None}
        gone = [GoneTopic(t, self.ids.get(t), None) for t in sorted(self.followed)
                if t not in present]
        ids, _ = self._topic_ids(sorted(t for t in self.followed if t in present))
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
            matched = [t for t in match_topics(present, (), self.regex, self.exclude)
                       if t not in self.known]
            found = self._topic_ids(matched)[0]
            for topic in matched:
                if topic not in found and self.ids:
                    # a broker that gives ids did not answer for this one: picked up at the
                    # next check, so that its id is known (and recorded) before any record
                    continue
                self.known.add(topic)
                self.followed.add(topic)
                parts = sorted(present[topic].partitions)
                self.whole[topic] = len(parts)
                new += [TopicPartition(topic, p) for p in parts]
                if topic in found:
                    self.ids[topic] = found[topic]
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


class TopicFollowing:
    """What a following sink task does with its :class:`TopicWatcher` (mixed into
    sink_runner.SinkTaskRunner, whose attributes it uses: ``task``, ``consumer``, ``metrics``,
    ``assignment``, ``claims``, ``announced``, ``stop_event``, ``_ctx``, ``_start_offset``).

    * at start, the watcher reads the ids of the task's topics *before* the task ``open()``s
      them, and hands them over in ``SinkTaskContext.topic_ids`` (the store sink compares them
      with the ids it has on record, and records them);
    * every check, the partitions found are opened the same way (ids first, then ``open()``,
      which records them and syncs the topic's configs in the store sink), and assigned only
      then, so nothing of a topic is fetched before the task has recorded it;
    * a topic the task refuses in ``open()`` (``SinkTaskContext.refuse_topic``), or that the
      watcher finds deleted or recreated, is stopped alone (:meth:`_stop_topics`);
    * every batch is stored only once its topics' ids are confirmed (:meth:`_verify_ids`).
    """

    watcher: TopicWatcher | None = None

    def _start_watch(self, ctx: Any) -> None:
        """The watcher, and the ids of the task's topics in ``ctx.topic_ids`` (before open())."""
        regex, exclude = self.topic_pattern or (None, None)
        mine = {tp.topic for tp in self.assignment}
        self.watcher = TopicWatcher(self.consumer_conf, self.whole_topics,
                                    connector=self.connector, regex=regex, exclude=exclude,
                                    known=self.connector_topics, followed=mine)
        self.watcher.start()
        ctx.topic_ids.update({t: i for t, i in self.watcher.ids.items() if t in mine})

    @staticmethod
    def _refused(ctx: Any) -> list[GoneTopic]:
        """The topics the task refused in its last open(): not the ones it has on record."""
        refused, ctx.refused = ctx.refused, {}
        return [GoneTopic(t, old, ctx.topic_ids.get(t)) for t, old in sorted(refused.items())]

    def _watch_topics(self) -> None:
        """Assign what the watcher found: the task opens the new partitions (after their
        topics' ids are in its context) and they start where it asks (the store sink: the
        partition's first offset); a topic it refuses is stopped instead."""
        from confluent_kafka import TopicPartition as KTP
        known = set(self.watcher.known)
        found, gone = self.watcher.check(self.consumer)
        self._stop_topics(gone)
        new = self.claims.mine(self.task_id, found)
        if not new:
            return
        ctx = self._ctx
        ctx.add_assignment(new)
        ids = self.watcher.ids
        ctx.topic_ids.update({tp.topic: ids[tp.topic] for tp in new if tp.topic in ids})
        self.task.open(new)
        dropped = self._drop_refused(ctx)
        new = [tp for tp in new if tp not in dropped]
        refused = self._refused(ctx)
        if refused:
            self._stop_topics(refused)  # of these topics, the partitions assigned before
            stopped = self.metrics.stopped
            shut = [tp for tp in new if tp.topic in stopped]
            new = [tp for tp in new if tp.topic not in stopped]
            self.task.close(shut)  # opened, never assigned
            if not new:
                return
        parts = []
        for tp in new:
            off = self._start_offset(tp, ctx.requested_offsets.get(tp))
            self.metrics.position[tp] = off if off >= 0 else -1
            parts.append(KTP(tp.topic, tp.partition, off))
        self.consumer.incremental_assign(parts)
        self.assignment.extend(new)
        by_topic: dict[str, list[int]] = {}
        for tp in new:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        for topic, ps in sorted(by_topic.items()):
            what = "new partitions" if topic in known else "new topic"
            print(f"kcompact: {self.metrics.name}: {what} {topic} "
                  f"[{', '.join(map(str, ps))}]: following from the start",
                  file=sys.stderr, flush=True)

    def _gone(self, topics) -> bool:
        """True when one of ``topics`` (of an error event) was deleted or recreated: it is
        then stopped. Only while following with a watcher that knows the topic's id."""
        if self.watcher is None:
            return False
        gone = self.watcher.verify(topics, self.stop_event.is_set)
        self._stop_topics(gone or [])
        return bool(gone)

    def _stop_topics(self, gone: list[GoneTopic]) -> None:
        """Stop mirroring the topics deleted or recreated (or refused by the task), the others
        going on: one line each, their partitions paused (no more fetches) and closed, their
        lag forgotten, the watcher no longer watching them; records of theirs still in flight
        are dropped by ``_deliver``."""
        from confluent_kafka import TopicPartition as KTP
        m = self.metrics
        for g in gone:
            if g.topic in m.stopped:
                continue
            m.stopped[g.topic] = g.reason
            if self.watcher is not None:
                self.watcher.forget(g.topic)
            parts = [tp for tp in self.assignment if tp.topic == g.topic]
            if self.announced.setdefault(g.topic, m.name) == m.name:
                print(f"kcompact: warning: {m.name}: {g.message()}", file=sys.stderr,
                      flush=True)
            if self.consumer is not None and parts:  # none yet: refused at start
                try:
                    self.consumer.pause([KTP(tp.topic, tp.partition) for tp in parts])
                except Exception:  # noqa: BLE001 - its records are dropped anyway
                    pass
            for tp in parts:
                m.high_watermark.pop(tp, None)
            self.task.close(parts)

    def _without_stopped(self, topics, single, parts, offs, ts, raw_keys, raw_values, headers):
        """The batch's columns without the records of stopped topics: False when it has none
        (kept as it is), None when it has nothing else. Rare (records of a topic fetched before
        it was stopped), so built record by record."""
        stopped = self.metrics.stopped
        if single:
            return None if topics[0] in stopped else False
        keep = [i for i, t in enumerate(topics) if t not in stopped]
        if len(keep) == len(topics):
            return False
        if not keep:
            return None

        def pick(col):
            return [col[i] for i in keep]
        return (pick(topics), np.asarray(parts)[keep], np.asarray(offs)[keep],
                np.asarray(ts)[keep], pick(raw_keys), pick(raw_values), pick(headers))

    def _verify_ids(self, topics: list, single: bool) -> bool:
        """While following, a batch is stored only once the ids of its topics are confirmed by
        a describe_topics made after it was fetched (~1 ms on a local Kafka, and no cost
        measured on a following mirror's catch-up), so a topic deleted and created again is
        never mixed into the old one's logs (librdkafka goes on fetching at the same offset in
        the new topic without a word): its records are dropped and it is stopped. Every batch,
        whatever its size or how soon it follows another: no window (tests/unit/
        test_topic_following.py counts the lookups). False when the task is stopping before
        the broker answered (the batch is not stored)."""
        gone = self.watcher.verify((topics[0],) if single else set(topics),
                                   self.stop_event.is_set)
        if gone is None:
            return False
        self._stop_topics(gone)
        return True


__all__ = ["GoneTopic", "PartitionClaims", "TopicFollowing", "TopicWatcher",
           "describe_topic_ids"]
