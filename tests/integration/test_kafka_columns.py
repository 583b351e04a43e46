"""kcompact.connectors.framework.kafka_columns: consumed batches read straight into columns
(connectors/framework/_rdkafka.c) against a real broker, compared with confluent_kafka's Message
objects for the same records; the layout check, the callbacks that run inside its consume, and
closing."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kcompact.connectors.framework.kafka_columns import (ColumnReader, ColumnSender, PackedBytes,
                                                         PackedHeaders, _module)
from kcompact.connectors.framework.kafka_clients import kafka_logger
from test_mirror import TS0, produce, varied_records
from topics import read_topic

pytestmark = pytest.mark.skipif(
    _module() is None,
    reason="kcompact.connectors.framework._rdkafka is not built (no C compiler at install): "
           "consume() is used, which every mirror test covers")


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
        assert ColumnSender.attach(c, cb, logger) is None  # a consumer is not a producer
    finally:
        c.close()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "error_cb": cb, "logger": logger})
    assert ColumnReader.attach(p, cb, logger) is None
    assert ColumnSender.attach(p, errors.append, logger) is None
    assert ColumnSender.attach(p, cb, logger) is not None
    assert ColumnReader.attach("not a consumer", cb, logger) is None
    assert ColumnSender.attach(b"not a producer", cb, logger) is None


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


def _columns(items: list) -> tuple:
    starts, ends, at = [], [], 0
    for x in items:
        starts.append(at)
        at += len(x or b"")
        ends.append(at)
    return (b"".join(x or b"" for x in items), np.array(starts, np.int64),
            np.array(ends, np.int64), np.array([x is None for x in items], np.uint8))


def test_sender_failed_delivery_fails_the_commit(kafka_bootstrap, make_topic):
    """Records produced through ColumnSender have no delivery report in Python; a record that
    fails delivery must still fail the transaction's commit (and one that is delivered reads
    back as sent: null and empty keys and values, timestamps, a partition per record)."""
    cb, logger = [].append, kafka_logger()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "error_cb": cb, "logger": logger,
                  "transactional.id": f"cols-{uuid.uuid4().hex[:8]}",
                  "allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 500,
                  "message.timeout.ms": 5000})
    p.init_transactions(30)
    sender = ColumnSender.attach(p, cb, logger)
    assert sender is not None
    topic = make_topic(partitions=2)
    keys, values = [None, b"", b"k2", b"k3"], [b"v0", None, b"", b"v3" * 100]
    p.begin_transaction()
    sender.produce(topic, -1, np.array([0, 1, 0, 1], np.int32), _columns(keys),
                   _columns(values), np.array([TS0 + i for i in range(4)], np.int64))
    p.commit_transaction(30)
    got = read_topic(kafka_bootstrap, topic, 2)
    assert got == {0: [(0, TS0, None, b"v0", ()), (1, TS0 + 2, b"k2", b"", ())],
                   1: [(0, TS0 + 1, b"", None, ()), (1, TS0 + 3, b"k3", b"v3" * 100, ())]}

    p.begin_transaction()
    sender.produce(f"no-such-topic-{uuid.uuid4().hex[:8]}", 0, None, _columns([b"k"]),
                   _columns([b"v"]), np.array([TS0], np.int64))
    with pytest.raises(KafkaException, match="failed delivery"):
        p.commit_transaction(30)
    p.abort_transaction(30)
    sender.close()


def test_sender_delivery_reports_reach_on_delivery(kafka_bootstrap, make_topic):
    """Without a transaction each record carries confluent_kafka's per-message state: a failed
    delivery reaches on_delivery with its error and message, as from produce(); the references
    the records held on the callable are all given back."""
    import sys
    cb, logger = [].append, kafka_logger()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "error_cb": cb, "logger": logger,
                  "enable.idempotence": True, "allow.auto.create.topics": False,
                  "topic.metadata.propagation.max.ms": 500, "message.timeout.ms": 5000})
    sender = ColumnSender.attach(p, cb, logger)
    assert sender is not None
    reports: list = []

    def on_delivery(err, msg):
        reports.append((err.code() if err else None, msg.topic(), msg.key()))
    refs = sys.getrefcount(on_delivery)
    topic = make_topic(partitions=1)
    n = 500
    keys = [b"k%d" % i for i in range(n)]
    sender.produce(topic, 0, None, _columns(keys), _columns([b"v"] * n),
                   np.full(n, TS0, np.int64), on_delivery)
    assert p.flush(30) == 0
    # delivery.report.only.error is off here: every success is reported, as from produce()
    assert sorted(reports) == sorted((None, topic, k) for k in keys)
    reports.clear()
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    sender.produce(missing, 0, None, _columns([b"a", b"b"]), _columns([b"1", b"2"]),
                   np.array([TS0, TS0], np.int64), on_delivery)
    assert p.flush(30) == 0
    assert sorted(reports) == [(KafkaError.UNKNOWN_TOPIC_OR_PART, missing, b"a"),
                               (KafkaError.UNKNOWN_TOPIC_OR_PART, missing, b"b")], reports
    assert sys.getrefcount(on_delivery) == refs
    got = read_topic(kafka_bootstrap, topic, 1)
    assert [r[2] for r in got[0]] == keys
    # a header section that does not parse is refused before any record goes
    bad = (b"\x05\x00\x00\x00", np.array([0], np.int64), np.array([4], np.int64))
    with pytest.raises(ValueError, match="header section"):
        sender.produce(topic, 0, None, _columns([b"x"]), _columns([b"y"]),
                       np.array([TS0], np.int64), on_delivery, bad)
    assert sys.getrefcount(on_delivery) == refs
    sender.close()
