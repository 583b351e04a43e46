"""connectors.kafka_columns: consumed batches read straight into columns (connectors/_rdkafka.c)
against a real broker, compared with confluent_kafka's Message objects for the same records;
the layout check, the callbacks that run inside its consume, and closing."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from connectors.kafka_columns import ColumnReader, PackedBytes, PackedHeaders, _module
from connectors.worker import kafka_logger
from test_mirror import produce, varied_records

pytestmark = pytest.mark.skipif(
    _module() is None,
    reason="connectors._rdkafka is not built (no C compiler at install): consume() is used, "
           "which every mirror test covers")


def _consumer_with(bootstrap: str, error_cb, **extra) -> tuple[Consumer, object]:
    logger = kafka_logger()
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"cols-{uuid.uuid4().hex[:6]}",
                  "enable.partition.eof": True, "error_cb": error_cb, "logger": logger,
                  **extra})
    return c, logger


def _rows_by_columns(reader: ColumnReader, ends: int) -> tuple[list, list]:
    rows, eofs = [], []
    for _ in range(200):
        if len(eofs) >= ends:
            break
        b = reader.consume(500, 0.5)
        eofs += [(e.topic, e.partition, e.offset) for e in b.events
                 if e.code == KafkaError._PARTITION_EOF]
        assert all(e.code == KafkaError._PARTITION_EOF for e in b.events), b.events
        keys, values = PackedBytes(*b.packed[:3]), PackedBytes(*b.packed[3:])
        headers = PackedHeaders(*b.headers) if b.headers is not None else [None] * len(b)
        for i, t in enumerate(b.topic_column()):
            rows.append((t, int(b.partitions[i]), int(b.offsets[i]), int(b.timestamps[i]),
                         keys[i], values[i], headers[i]))
    return rows, eofs


def _rows_by_messages(c: Consumer, ends: int) -> tuple[list, list]:
    rows, eofs = [], []
    for _ in range(200):
        if len(eofs) >= ends:
            break
        for m in c.consume(500, 0.5):
            if m.error() is not None:
                eofs.append((m.topic(), m.partition(), m.offset()))
                continue
            rows.append((m.topic(), m.partition(), m.offset(), m.timestamp()[1], m.key(),
                         m.value(), m.headers()))
    return rows, eofs


def test_columns_equal_message_objects(kafka_bootstrap, make_topic):
    """Two topics x 3 partitions, null/empty/binary keys and values, repeated and null headers,
    explicit timestamps: the same rows, in the same per-partition order, and the same
    end-of-partition events as confluent_kafka's consume()."""
    topics = [make_topic(partitions=3), make_topic(partitions=3)]
    for n, t in enumerate(topics):
        produce(kafka_bootstrap, t, varied_records(3, 700, seed=n + 1))
    assign = [TopicPartition(t, p, 0) for t in topics for p in range(3)]

    errors: list = []
    cb = errors.append
    c, logger = _consumer_with(kafka_bootstrap, cb)
    reader = ColumnReader.attach(c, cb, logger)
    assert reader is not None
    c.assign(assign)
    try:
        by_columns, eof_columns = _rows_by_columns(reader, len(assign))
    finally:
        reader.close()
        c.close()
    c2, _ = _consumer_with(kafka_bootstrap, [].append)
    c2.assign(assign)
    try:
        by_messages, eof_messages = _rows_by_messages(c2, len(assign))
    finally:
        c2.close()
    assert len(by_messages) == 1400
    assert sorted(by_columns, key=lambda r: r[:3]) == sorted(by_messages, key=lambda r: r[:3])
    for tp in {(r[0], r[1]) for r in by_columns}:  # offsets increase within a partition
        offs = [r[2] for r in by_columns if (r[0], r[1]) == tp]
        assert offs == sorted(offs)
    assert sorted(eof_columns) == sorted(eof_messages)
    assert errors == []


def test_attach_checks_the_configured_objects(kafka_bootstrap):
    """attach() recognises the Consumer only through the very error_cb and logger objects it was
    configured with; other objects, or a Producer, get None (consume() is used instead)."""
    errors: list = []
    cb = errors.append
    c, logger = _consumer_with(kafka_bootstrap, cb)
    try:
        assert ColumnReader.attach(c, errors.append, logger) is None  # an equal, other object
        assert ColumnReader.attach(c, cb, object()) is None
        reader = ColumnReader.attach(c, cb, logger)
        assert reader is not None
        reader.close()
    finally:
        c.close()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "error_cb": cb, "logger": logger})
    assert ColumnReader.attach(p, cb, logger) is None
    assert ColumnReader.attach("not a consumer", cb, logger) is None


def test_callbacks_run_inside_consume(closed_port):
    """error_cb runs inside the reader's consume (the CallState confluent_kafka's trampolines
    need is set up), and an exception it raises comes out of consume, as from consume()."""
    errors: list = []
    cb = errors.append
    c, logger = _consumer_with(f"127.0.0.1:{closed_port}", cb)
    reader = ColumnReader.attach(c, cb, logger)
    assert reader is not None
    c.assign([TopicPartition("nowhere", 0, 0)])
    try:
        for _ in range(40):
            b = reader.consume(100, 0.25)
            assert len(b) == 0
            if errors:
                break
        assert errors and all(e.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                                           KafkaError._RESOLVE) for e in errors), errors
    finally:
        reader.close()
        c.close()

    class Boom(Exception):
        pass

    def raising(err):
        raise Boom(str(err))
    c, logger = _consumer_with(f"127.0.0.1:{closed_port}", raising)
    reader = ColumnReader.attach(c, raising, logger)
    c.assign([TopicPartition("nowhere", 0, 0)])
    try:
        with pytest.raises(Boom):
            for _ in range(40):
                reader.consume(100, 0.25)
    finally:
        reader.close()
        c.close()


def test_closed_reader_and_consumer_raise(kafka_bootstrap):
    cb = [].append
    c, logger = _consumer_with(kafka_bootstrap, cb)
    reader = ColumnReader.attach(c, cb, logger)
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        reader.consume(10, 0.01)
    reader = ColumnReader.attach(c, cb, logger)
    c.close()  # without closing the reader first: the reader sees the consumer is closed
    with pytest.raises(RuntimeError, match="closed"):
        reader.consume(10, 0.01)
    reader.close()
