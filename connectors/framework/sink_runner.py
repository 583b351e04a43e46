"""One sink task in a thread of its own: its consumer, converters, error handling and loop
(Kafka Connect's ``WorkerSinkTask``).

The task never joins a consumer group: the worker hands it an assignment, and the runner
``assign()``s it, starting each partition where the task asked in ``open()``
(``context.offset``) - else at the group's committed offset, else the earliest. It runs until
stopped, or with ``follow=false`` until every partition has reached the end it had when the task
started (end-of-partition events, and the high watermark of the first fetch response - never
ListOffsets, which Tansu gets wrong). While following (topic_watch.py, :class:`TopicFollowing`,
mixed in here), every metadata refresh interval (``topic.metadata.refresh.interval.ms`` when
set, else ``PARTITION_CHECK_INTERVAL`` seconds) a :class:`~.topic_watch.TopicWatcher` finds the
partitions a topic read whole gained and the topics that started to match ``topics.regex``: the
task ``open()``s them (their topic ids in its context first) and they are assigned from the
start offsets it asks for. A followed topic deleted or created again (new topic id), or one the
task refuses in ``open()``, is stopped alone: one line names it, its partitions are paused and
``close()``d, none of its records is handed to the task any more, and the other topics go on
(``TaskMetrics.stopped``; the task ends once it has nothing left to follow). Every
``offset.flush.interval.ms`` (and at the end) it calls ``pre_commit``; offsets it returns are
committed to the group (the store sink returns none).
The consumer is kcompact's own (native_kafka.NativeConsumer): batches read as columns, without a
Python object per record.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ConnectorsError
from .api import OFFSET_BEGINNING as OFFSET_BEGINNING_REQUEST
from .api import (DataError, RetriableError, SinkRecords, SinkTask, SinkTaskContext,
                  TopicPartition)
from .converters import Converter
from .errors_handling import SKIPPED, ErrorContext, ErrorHandler, Stage, class_name
from .kafka_clients import ClientReports, KafkaSettings, kafka_error_text, kafka_logger
from .kafka_columns import Batch, Event, PackedBytes, PackedHeaders, last_records, next_offsets
from .native_kafka import kafka_consumer
from .task_runner import TaskRunner
from .topic_watch import PartitionClaims, TopicFollowing

#: How often a following task's consumer reports its brokers' state (librdkafka statistics).
STATS_INTERVAL_MS = 2000
#: Seconds between checks, while following, that no followed topic gained partitions.
PARTITION_CHECK_INTERVAL = 5.0


class SinkTaskRunner(TopicFollowing, TaskRunner):
    """One sink task: its consumer, converters, error handler and loop (a thread)."""

    def __init__(self, *, connector: str, task_id: int, task: SinkTask, props: dict[str, Any],
                 assignment: list[TopicPartition], consumer_conf: dict[str, Any],
                 key_converter: Converter, value_converter: Converter, errors: ErrorHandler,
                 follow: bool, batch_max: int, flush_interval_ms: int, stop: threading.Event,
                 startup_timeout: float, settings: KafkaSettings,
                 whole_topics: Mapping[str, int] | None = None,
                 topic_pattern: tuple[str, str] | None = None,
                 claims: PartitionClaims | None = None,
                 announced: dict[str, str] | None = None,
                 topics: Sequence[str] = ()):
        self.connector, self.task_id, self.task, self.props = connector, task_id, task, props
        self.assignment, self.consumer_conf = assignment, consumer_conf
        self.key_conv, self.value_conv, self.errors = key_converter, value_converter, errors
        self.follow, self.batch_max, self.flush_interval = follow, batch_max, flush_interval_ms
        self.stop_event, self.startup_timeout, self.settings = stop, startup_timeout, settings
        super().__init__(f"{connector}-{task_id}")
        self.consumer: Any = None
        self._end_at_start: dict[TopicPartition, int] = {}
        self._unverified: dict[TopicPartition, tuple[float, int, int]] = {}
        self._last_warning = 0.0
        # the callbacks' state, apart from the runner; the metrics hear of unreachable brokers,
        # and a following task's also of all brokers down and up again (from the statistics
        # that only it asks for)
        self._reports = ClientReports(self.metrics, disconnects=follow)
        #: topics followed whole -> their partition count at start (checked while following)
        self.whole_topics = dict(whole_topics or {})
        #: (topics.regex, topics.exclude.regex) whose new matches this task picks up
        self.topic_pattern = topic_pattern
        #: every topic of the connector at start (whatever task reads it): never a new match
        self.connector_topics = set(topics) | {tp.topic for tp in assignment}
        #: who reads the partitions found while following, shared by the connector's tasks
        self.claims = claims if claims is not None else PartitionClaims(1)
        #: topic -> the task that said it stopped, shared by the connector's tasks (one line)
        self.announced = announced if announced is not None else {}
        self.watcher = None  # a TopicWatcher while following (topic_watch.TopicFollowing)
        self._ctx: SinkTaskContext | None = None
        self._last_partition_check = time.monotonic()
        try:
            refresh = float(consumer_conf.get("topic.metadata.refresh.interval.ms", 0)) / 1000
        except (TypeError, ValueError):
            refresh = 0.0
        self.check_interval = max(1.0, refresh) if refresh > 0 else PARTITION_CHECK_INTERVAL

    # -- lifecycle -----------------------------------------------------------------------------

    def _run(self) -> None:
        started = False
        try:
            ctx = self._ctx = SinkTaskContext(self.assignment)
            self.task.initialize(ctx)
            self.task.start(self.props)
            started = True
            if self.follow:  # the topics' ids, before open() (which may record them)
                self._start_watch(ctx)
            self.task.open(self.assignment)
            self._stop_topics(self._refused(ctx))
            self._drop_refused(ctx)
            self._open_consumer(ctx.requested_offsets)
            self._loop(ctx)
            self._commit()
        except BaseException as e:  # noqa: BLE001 - reported by the worker
            self.failure = e
        finally:
            self.metrics.finished = time.monotonic()
            self._shutdown(started)

    def _drop_refused(self, ctx: SinkTaskContext) -> list[TopicPartition]:
        """Leave the partitions the task refused in open() unassigned: one line each; the
        others go on. Returns them."""
        refused, ctx.refused_partitions = ctx.refused_partitions, {}
        if not refused:
            return []
        for tp, why in sorted(refused.items(), key=lambda kv: (kv[0].topic, kv[0].partition)):
            self.metrics.refused[tp] = why
            print(f"kcompact: warning: {self.metrics.name}: {tp.topic}-{tp.partition} is not "
                  f"mirrored: {why}; the other partitions are", file=sys.stderr, flush=True)
        self.assignment[:] = [tp for tp in self.assignment if tp not in refused]
        self.task.close(list(refused))
        return list(refused)

    def _live(self) -> list[TopicPartition]:
        """The assigned partitions of topics not stopped."""
        stopped = self.metrics.stopped
        return [tp for tp in self.assignment if tp.topic not in stopped] if stopped \
            else self.assignment

    def _shutdown(self, started: bool) -> None:
        for step in (lambda: self.errors.flush_dlq(),
                     lambda: self.task.close(self._live()) if started else None,
                     lambda: self.task.stop() if started else None,
                     lambda: self.consumer.close() if self.consumer is not None else None,
                     lambda: self.errors.dlq.producer.flush(10) if self.errors.dlq else None,
                     self._release_clients):
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - keep the first failure
                if self.failure is None:
                    self.failure = e

    def _release_clients(self) -> None:
        """Drop librdkafka clients now (not at garbage collection, which may be never for a
        reference cycle), so no client keeps reconnecting after the task ended."""
        self.consumer = None
        if self.watcher is not None:
            self.watcher.close()
        if self.errors.dlq is not None:
            self.errors.dlq.producer = None

    def kafka_conf(self) -> dict | None:
        return self.consumer_conf

    def _open_consumer(self, requested: Mapping[TopicPartition, int]) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as KTP
        error_cb, logger = self._reports.on_error, kafka_logger()
        conf = dict(self.consumer_conf, error_cb=error_cb, logger=logger)
        if self.follow:
            # the brokers' connection state, for "disconnected since" in progress lines
            conf.setdefault("statistics.interval.ms", STATS_INTERVAL_MS)
            conf["stats_cb"] = self._reports.on_stats
        try:
            self.consumer = kafka_consumer(conf)
        except KafkaException as e:
            raise self.settings.explain(e, "Kafka consumer") from None
        parts = []
        for tp in self._live():
            off = self._start_offset(tp, requested.get(tp))
            self.metrics.position[tp] = off if off >= 0 else -1
            parts.append(KTP(tp.topic, tp.partition, off))
        self.consumer.assign(parts)

    def _start_offset(self, tp: TopicPartition, off: int | None) -> int:
        """Where ``tp`` starts: the offset the task asked for (OFFSET_BEGINNING: the low
        watermark), else the group's committed offset (OFFSET_STORED)."""
        from confluent_kafka import OFFSET_STORED, KafkaException
        from confluent_kafka import TopicPartition as KTP
        if off is None:
            return OFFSET_STORED
        try:
            lo, hi = self.consumer.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                         timeout=self.startup_timeout)
        except KafkaException as e:
            raise ConnectorsError(f"{tp}: cannot read the partition's offsets: "
                                  f"{kafka_error_text(e)}") from None
        if off == OFFSET_BEGINNING_REQUEST:
            # The low watermark is right on every broker (Tansu included), and asking for it
            # here is ~0.5 s faster than librdkafka's OFFSET_BEGINNING lookup.
            return lo
        if off > hi:
            # Tansu's uncached high watermark can be low (BROKER_NOTES.md): a start past it is
            # only suspicious, verified by the partition's first message or EOF.
            self._unverified[tp] = (time.monotonic() + 2 * self.startup_timeout, off, hi)
        return off

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self, ctx: SinkTaskContext) -> None:
        # consume() stays on this thread: with confluent-kafka 2.16, pause() or
        # get_watermark_offsets() from one thread while another is inside consume() deadlocks
        # (measured), and a separate fetch thread gained nothing measurable under the GIL.
        # The store sink overlaps its writes with consume() in a thread of its own instead.
        batch = self.batch_max
        consume = self.consumer.consume_columns
        last_flush = time.monotonic()
        last_lag = 0.0
        pending = set() if self.follow else set(self._live())
        # consume() waits at most 0.2 s, and at most a tenth of the flush interval: a record's
        # wait for the flush after it stays about the interval (a mirror into a store with
        # shared uploads flushes every 500 ms: its live edge, issue 49)
        wait_s = min(0.2, max(0.01, self.flush_interval / 10_000))
        while not self.stop_event.is_set():
            if not self.follow and not pending:
                break
            if ctx.stop_requested:
                break
            if self.metrics.stopped and not self.topic_pattern and not self._live() and \
                    (self.watcher is None or not self.watcher.whole):
                break  # every topic stopped, and no partition nor topic can be added
            # columns straight from librdkafka (native_kafka.NativeConsumer)
            cols = consume(self._wanted(pending, batch), wait_s)
            if self._reports.errors:
                self._check_kafka_errors()
            if cols.events:
                self._events(cols.events, pending)
            if len(cols):
                self._process_columns(cols)
            now = time.monotonic()
            if self._unverified:
                self._verify_starts(now)
            if now - last_lag >= 1.0 or (not self.follow and len(pending) < 64):
                self._watermarks(pending)
                last_lag = now
            if now - last_flush >= self.flush_interval / 1000:
                self._commit()
                last_flush = now
            if self.watcher is not None and \
                    now - self._last_partition_check >= self.check_interval:
                self._last_partition_check = now
                self._watch_topics()

    def _wanted(self, pending: set, batch: int) -> int:
        """How many messages to ask consume() for: ``batch``, or fewer at the end of a bounded
        run. consume() returns when it has that many or when its timeout expires, so asking
        for the whole batch when fewer records are left would wait the full timeout before
        the last of them is stored (0.2 s at the end of every run). Once every pending
        partition's end is known, ask for what is left; offset gaps (transaction markers, a
        compacted source) make that an upper bound, where the timeout still ends the wait."""
        if self.follow or not pending:
            return batch
        left = 0
        ends, pos = self._end_at_start, self.metrics.position
        for tp in pending:
            end = ends.get(tp)
            at = pos.get(tp, -1)
            if end is None or at < 0:
                return batch
            left += max(0, end - at)
            if left >= batch:
                return batch
        return left if left > 0 else batch

    def _events(self, events: list[Event], pending: set) -> None:
        from confluent_kafka import KafkaError
        stopped = self.metrics.stopped
        for ev in events:
            code = ev.code
            tp = TopicPartition(ev.topic or "", ev.partition)
            if tp.topic in stopped:
                continue
            if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE,
                        KafkaError.UNKNOWN_TOPIC_OR_PART) and self._gone([tp.topic]):
                continue  # deleted or recreated: that topic is stopped, the others go on
            if code == KafkaError._PARTITION_EOF:
                self._unverified.pop(tp, None)
                if ev.offset > self.metrics.position.get(tp, -1):
                    self.metrics.position[tp] = ev.offset
                if tp in pending:
                    self._partition_done(tp, pending)
            elif code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                raise ConnectorsError(
                    f"{tp}: offset {self.metrics.position.get(tp)} is not in the topic any more "
                    f"({ev.reason}): records were deleted (retention) before they were mirrored, "
                    "or the topic was recreated. Mirror into a new store, or accept the gap with "
                    "auto.offset.reset=earliest (-X / consumer.override.)")
            elif ev.fatal or code in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                      KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                      KafkaError.GROUP_AUTHORIZATION_FAILED):
                raise ConnectorsError(f"{tp}: {ev.reason} ({KafkaError(code).name()})")
            else:
                self._warn(f"{tp}: {ev.reason}")

    def _partition_done(self, tp: TopicPartition, pending: set) -> None:
        from confluent_kafka import TopicPartition as KTP
        pending.discard(tp)
        self.metrics.done.add(tp)
        try:
            self.consumer.pause([KTP(tp.topic, tp.partition)])
        except Exception:  # noqa: BLE001 - pausing only saves work
            pass
        self.task.partition_done(tp)

    def _watermarks(self, pending: set) -> None:
        """Cached high watermarks (from fetch responses, right on Tansu): lag, and the end of
        a bounded run when a partition's producer never lets it reach EOF."""
        from confluent_kafka import TopicPartition as KTP
        get = self.consumer.get_watermark_offsets
        for tp in self._live():
            try:
                _, hi = get(KTP(tp.topic, tp.partition), cached=True)
            except Exception:  # noqa: BLE001 - nothing fetched yet
                continue
            if hi is None or hi < 0:
                continue
            self.metrics.high_watermark[tp] = hi
            if tp in pending:
                end = self._end_at_start.setdefault(tp, hi)
                if self.metrics.position.get(tp, -1) >= end:
                    self._partition_done(tp, pending)

    def _verify_starts(self, now: float) -> None:
        for tp, (deadline, off, hi) in list(self._unverified.items()):
            if now > deadline:
                raise ConnectorsError(
                    f"{tp}: nothing to read from offset {off} (the store's next offset) and no "
                    f"end-of-partition within {self.startup_timeout * 2:.0f} s; the partition "
                    f"seems to end at {hi}: was the topic deleted and recreated? Mirror into a "
                    "new store")

    def _check_kafka_errors(self) -> None:
        from confluent_kafka import KafkaError
        errs = self._reports.take_errors()
        for err in errs:
            if err.fatal():
                raise ConnectorsError(f"Kafka client failed: {err.str()} ({err.name()})")
            if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT,
                              KafkaError._RESOLVE, KafkaError._AUTHENTICATION):
                self._warn(f"{err.str()}; retrying")

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10:
            self._last_warning = now
            print(f"kcompact: warning: {self.metrics.name}: {msg}", file=sys.stderr, flush=True)

    def _process_columns(self, cols: Batch) -> None:
        """Hand a batch read as columns (NativeConsumer.consume_columns) to the task."""
        n = len(cols)
        single = cols.topic_index is None
        topics = cols.topic_column()
        kb, ko, kn, vb, vo, vn = cols.packed
        if self.key_conv.identity and self.value_conv.identity:
            # bytes objects only if the task reads them (a columnar sink reads ``packed``)
            raw_keys: Sequence = PackedBytes(kb, ko, kn)
            raw_values: Sequence = PackedBytes(vb, vo, vn)
            headers: Sequence = ([None] * n if cols.headers is None
                                 else PackedHeaders(*cols.headers))
        else:
            unpack = PackedBytes.unpacked
            raw_keys, raw_values = unpack(kb, ko, kn), unpack(vb, vo, vn)
            headers = ([None] * n if cols.headers is None
                       else list(PackedHeaders(*cols.headers)))
        self._deliver(topics, single, cols.partitions, cols.offsets, cols.timestamps, raw_keys,
                      raw_values, headers, cols.packed, cols.headers)

    def _deliver(self, topics: list, single: bool, parts: np.ndarray, offs: np.ndarray,
                 ts: np.ndarray, raw_keys: Sequence, raw_values: Sequence, headers: Sequence,
                 packed: tuple | None, packed_headers: tuple | None) -> None:
        n = len(offs)
        if self.watcher is not None:
            if not self._verify_ids(topics, single):
                return  # stopping before the topics' ids could be confirmed: not stored
            if self.metrics.stopped:
                kept = self._without_stopped(topics, single, parts, offs, ts, raw_keys,
                                             raw_values, headers)
                if kept is None:
                    return
                if kept is not False:
                    topics, parts, offs, ts, raw_keys, raw_values, headers = kept
                    packed = packed_headers = None
                    n = len(offs)
        if self._unverified:
            for tp in {TopicPartition(t, int(p)) for t, p in zip(topics, parts)}:
                self._unverified.pop(tp, None)

        if self.key_conv.identity and self.value_conv.identity:
            records = SinkRecords(topics, parts, offs, ts, raw_keys, raw_values, headers)
            records.packed, records.packed_headers = packed, packed_headers
        else:
            records = self._convert(topics, parts, offs, ts, raw_keys, raw_values, headers)
        self._put(records)
        m = self.metrics
        m.records += len(records)
        if records.nbytes is None:  # the task may have counted them while writing
            records.nbytes = (sum(map(len, filter(None, records.raw_keys)))
                              + sum(map(len, filter(None, records.raw_values))))
        m.bytes += records.nbytes
        m.count_errors(self.errors)
        if self.errors.dlq is not None:
            m.dead_lettered = self.errors.dlq.produced
        # Position = last offset + 1 per partition (offsets increase within a partition), and
        # the timestamp of that last record (-1: it has none). Never backwards: a batch's
        # events are handled before its records, and a partition's end-of-partition event
        # (past trailing transaction markers and aborted records) may come in the same batch
        # as its last records.
        pos = m.position
        if single:
            t = topics[0]
            m.count_topic(t, len(records))
            for p, (nxt, last_ts) in last_records(parts, offs, ts).items():
                tp = TopicPartition(t, p)
                if nxt > pos.get(tp, -1):
                    pos[tp] = nxt
                if last_ts >= 0:
                    m.last_timestamp[tp] = last_ts
        else:
            for t, c in Counter(records.topics).items():
                m.count_topic(t, c)
            for t, p, o, last_ts in zip(topics, parts.tolist(), offs.tolist(), ts.tolist()):
                tp = TopicPartition(t, p)
                if o + 1 > pos.get(tp, -1):
                    pos[tp] = o + 1
                if last_ts >= 0:
                    m.last_timestamp[tp] = last_ts

    def _convert(self, topics, parts, offs, ts, raw_keys, raw_values, headers) -> SinkRecords:
        single = topics[0] == topics[-1] and topics.count(topics[0]) == len(topics)
        if single:
            try:
                keys = self.key_conv.to_connect_many(topics[0], raw_keys)
                values = self.value_conv.to_connect_many(topics[0], raw_values)
                return SinkRecords(topics, parts, offs, ts, keys, values, headers,
                                   raw_keys, raw_values)
            except (DataError, RetriableError):
                pass  # go record by record to retry / tolerate / attribute the failure
        keep: list[int] = []
        keys, values = [], []
        kc, vc = self.key_conv, self.value_conv

        def pick(col: list) -> list:
            return [col[i] for i in keep]

        def kept() -> SinkRecords:
            if len(keep) == len(offs):
                return SinkRecords(topics, parts, offs, ts, keys, values, headers, raw_keys,
                                   raw_values)
            return SinkRecords(pick(topics), pick(parts), pick(offs), pick(ts), keys, values,
                               pick(headers), pick(raw_keys), pick(raw_values))
        try:
            for i in range(len(offs)):
                base = (topics[i], parts[i], offs[i], ts[i], raw_keys[i], raw_values[i],
                        headers[i])
                k = self.errors.execute(
                    lambda: kc.to_connect(base[0], base[4]),
                    ErrorContext(*base, Stage.KEY_CONVERTER, class_name(type(kc))))
                if k is SKIPPED:
                    continue
                v = self.errors.execute(
                    lambda: vc.to_connect(base[0], base[5]),
                    ErrorContext(*base, Stage.VALUE_CONVERTER, class_name(type(vc))))
                if v is SKIPPED:
                    continue
                keep.append(i)
                keys.append(k)
                values.append(v)
        except (DataError, RetriableError):
            # The task stops at this record: keep what came before it (a restart resumes
            # exactly at the record that failed).
            self.errors.flush_dlq()
            self._put(kept())
            raise
        # A skipped record must be in the dead-letter topic before anything after it can be
        # stored (and flushed): otherwise a crash could leave it in neither.
        self.errors.flush_dlq()
        return kept()

    def _put(self, records: SinkRecords) -> None:
        if not len(records):
            return
        delay = 0.3
        start = time.monotonic()
        timeout_ms = self.errors.retry_timeout_ms
        while True:
            try:
                self.task.put(records)
                return
            except RetriableError as e:
                spent = (time.monotonic() - start) * 1000
                if (timeout_ms >= 0 and spent + delay * 1000 > timeout_ms) or \
                        self.stop_event.is_set():
                    raise
                self._warn(f"put failed ({e}); retrying")
                time.sleep(delay)
                delay = min(delay * 2, self.errors.max_delay_ms / 1000)

    def _commit(self) -> None:
        from confluent_kafka import TopicPartition as KTP
        self.errors.flush_dlq()
        # the consumer's positions (past transaction markers after the last record: the
        # end-of-partition offset), of the topics not stopped (a recreated one's are not its)
        stopped = self.metrics.stopped
        positions = {tp: off for tp, off in self.metrics.position.items()
                     if off >= 0 and tp.topic not in stopped}
        offsets = self.task.pre_commit(positions)
        if offsets:
            self.consumer.commit(offsets=[KTP(tp.topic, tp.partition, off)
                                          for tp, off in offsets.items()], asynchronous=False)
