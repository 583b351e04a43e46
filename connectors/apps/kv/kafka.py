"""The Kafka half of the map builder: catching up from (and following) the topic itself, after
the store, at the map's own offsets (``assign()``, ``isolation.level=read_committed``, batches as
columns on kcompact's own consumer, framework/native_kafka.py), one WriteBatch per batch with the
new offsets inside it.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from ...framework.kafka_clients import kafka_logger
from ...framework.kafka_columns import PackedBytes, next_offsets
from ...framework.native_kafka import kafka_consumer
from ...plugins.leveldb_sink import KVError, LevelDBSink


class KafkaCatchUp:
    """MapBuilder's methods that read the Kafka topic (it sets the attributes they use)."""

    def _start(self, consumer: Any, sink: LevelDBSink, partition: int) -> int:
        """Where a partition's consumption starts: after the map's last record, or at the
        partition's low watermark for a new map (asked for here: ~0.5 s sooner than
        librdkafka's own OFFSET_BEGINNING lookup, as in connectors/framework/worker.py)."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
        if partition in sink.offsets:
            return sink.offsets[partition]
        try:
            lo, _ = consumer.get_watermark_offsets(TopicPartition(self.topic, partition),
                                                   timeout=15)
        except KafkaException:
            return OFFSET_BEGINNING  # let librdkafka look it up
        return lo if lo is not None and lo >= 0 else OFFSET_BEGINNING

    def _kafka(self, sink: LevelDBSink, stop: threading.Event, follow: bool) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        def error_cb(err: Any) -> None:
            return None
        logger = kafka_logger()
        conf = {"bootstrap.servers": self.bootstrap_servers,
                "group.id": f"kcompact-kv-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False, "enable.auto.offset.store": False,
                "isolation.level": "read_committed", "auto.offset.reset": "error",
                "enable.partition.eof": True, "error_cb": error_cb, "logger": logger,
                # a map builds slower than Kafka serves: without this, librdkafka's prefetch
                # queue goes over its limit and the next fetch waits 1 s (SINK_CONSUMER_DEFAULTS,
                # connectors/framework/kafka_clients.py)
                "fetch.queue.backoff.ms": 10}
        conf.update(self.kafka_config)
        conf["isolation.level"] = "read_committed"
        try:
            consumer = kafka_consumer(conf)
        except KafkaException as e:
            raise KVError(f"invalid Kafka consumer settings: {e}") from None
        try:
            try:
                md = consumer.list_topics(self.topic, timeout=15)
            except KafkaException as e:
                raise KVError(f"cannot reach Kafka at {self.bootstrap_servers}: {e}") from None
            tmd = md.topics.get(self.topic)
            if tmd is None or tmd.error is not None or not tmd.partitions:
                raise KVError(f"topic {self.topic!r} is not on the Kafka cluster at "
                              f"{self.bootstrap_servers}"
                              + (f" ({tmd.error})" if tmd is not None and tmd.error else ""))
            sink.bind(self.topic, cluster_id=md.cluster_id)
            parts = sorted(tmd.partitions)
            consumer.assign([TopicPartition(self.topic, p, self._start(consumer, sink, p))
                             for p in parts])
            self.progress(f"consuming {self.topic!r} from {self.bootstrap_servers} at the map's "
                          f"offsets {dict(sorted((p, sink.offsets.get(p, 0)) for p in parts))}")
            at_end: set[int] = set()
            idle_since = time.monotonic()
            while not stop.is_set():
                keys, values, nxt = self._columns(consumer, at_end)
                if keys:
                    sink.apply(keys, values, nxt)
                    self.report["applied_records"] += len(keys)
                    idle_since = time.monotonic()
                    if follow and self.caught_up.is_set():
                        self.progress(f"applied {len(keys):,} records; {sink.count:,} keys")
                if at_end >= set(parts):
                    self._mark_caught_up(sink)
                if at_end >= set(parts) and not self.caught_up.is_set():
                    self.caught_up.set()
                    self.progress(f"caught up with Kafka: {sink.count:,} keys")
                    if not follow:
                        return
                    self.progress(f"following {self.topic!r} on {self.bootstrap_servers} "
                                  "(stop with Ctrl-C)")
                if (not follow and not keys
                        and time.monotonic() - idle_since > self.kafka_idle_timeout):
                    missing = sorted(set(parts) - at_end)
                    raise KVError(f"Kafka partitions {missing} of {self.topic!r} sent neither "
                                  f"records nor their end for {self.kafka_idle_timeout:.0f}s "
                                  "(is the map ahead of the topic? it may have been recreated)")
        finally:
            consumer.close()

    def _kafka_error(self, code: int, text: str, fatal: bool, retriable: bool) -> None:
        from confluent_kafka import KafkaError
        if fatal or not retriable:
            raise KVError(f"Kafka consumer of {self.topic!r}: {text}"
                          + (" (the map's next offset is no longer in the topic: delete the "
                             "map and build it again)"
                             if code == KafkaError._AUTO_OFFSET_RESET else ""))

    def _columns(self, consumer: Any, at_end: set) -> tuple[list, list, dict]:
        """One batch of columns (NativeConsumer.consume_columns): keys, values and next
        offsets per partition; ends seen into at_end. Its
        end-of-partition events come apart from the records, so a partition is at its end when
        its event's offset is past every record of it in the batch (a record after the event
        means the partition grew again)."""
        from confluent_kafka import KafkaError

        b = consumer.consume_columns(self.follow_batch_records, 0.2)
        eof: dict[int, int] = {}
        for ev in b.events:
            if ev.code == KafkaError._PARTITION_EOF:
                eof[ev.partition] = ev.offset
            else:
                # not retriable: as for a Message's error, whose KafkaError never says so
                self._kafka_error(ev.code, ev.reason, ev.fatal, False)
        nxt = next_offsets(b.partitions, b.offsets)
        for p in nxt:
            at_end.discard(p)
        for p, off in eof.items():
            if nxt.get(p, -1) <= off:
                at_end.add(p)
        if not nxt:
            return [], [], nxt
        kb, ko, kn, vb, vo, vn = b.packed
        return PackedBytes.unpacked(kb, ko, kn), PackedBytes.unpacked(vb, vo, vn), nxt
