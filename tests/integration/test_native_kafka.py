"""kcompact's own Kafka client (connectors/framework/native_kafka.py on _rdkafka.c, librdkafka's
public API), the data path's one client, against a real broker: consumed columns equal
confluent-kafka's Message objects (the reference), metadata and watermarks equal
confluent-kafka's, and each failure has the outcome confluent-kafka's clients gave: a setting
librdkafka refuses, a callback that raises, a broker that goes away mid-batch, a failed delivery
(with and without a transaction), a fenced transactional producer, Ctrl-C during a blocking
consume. ``KCOMPACT_KAFKA_IO`` (the switch to confluent-kafka's clients until issue 39) only
warns that it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kcompact.connectors.devtools.broker import EmbeddedBroker
from kcompact.connectors.errors import ConfigError
from kcompact.connectors.framework import native_kafka
from kcompact.connectors.framework.kafka_clients import KafkaSettings, kafka_logger
from kcompact.connectors.framework.kafka_columns import PackedBytes, PackedHeaders
from kcompact.connectors.framework.native_kafka import (NativeConsumer, NativeProducer,
                                                        kafka_consumer, kafka_producer)
from test_mirror import TS0, produce, varied_records
from topics import packed_columns, read_topic

def _consumer_conf(bootstrap: str, error_cb=None, **extra) -> dict:
    conf = {"bootstrap.servers": bootstrap, "group.id": f"nk-{uuid.uuid4().hex[:6]}",
            "enable.partition.eof": True, "enable.auto.commit": False, "logger": kafka_logger(),
            **extra}
    if error_cb is not None:
        conf["error_cb"] = error_cb
    return conf


def _consume(c, n: int, timeout: float) -> tuple[list, list]:
    """One batch on either path: rows (topic, partition, offset, ts, key, value, headers) and
    error events (code, topic, partition, offset)."""
    if isinstance(c, NativeConsumer):
        b = c.consume_columns(n, timeout)
        keys, values = PackedBytes(*b.packed[:3]), PackedBytes(*b.packed[3:])
        headers = PackedHeaders(*b.headers) if b.headers is not None else [None] * len(b)
        rows = [(t, int(b.partitions[i]), int(b.offsets[i]), int(b.timestamps[i]), keys[i],
                 values[i], headers[i]) for i, t in enumerate(b.topic_column())]
        return rows, [(e.code, e.topic, e.partition, e.offset) for e in b.events]
    rows, events = [], []
    for m in c.consume(n, timeout):
        if m.error() is not None:
            events.append((m.error().code(), m.topic(), m.partition(), m.offset()))
        else:
            rows.append((m.topic(), m.partition(), m.offset(), m.timestamp()[1], m.key(),
                         m.value(), m.headers()))
    return rows, events


def _read_all(c, ends: int) -> tuple[list, list]:
    rows, eofs = [], []
    for _ in range(200):
        if len(eofs) >= ends:
            break
        got, events = _consume(c, 500, 0.5)
        rows += got
        assert all(e[0] == KafkaError._PARTITION_EOF for e in events), events
        eofs += [e[1:] for e in events]
    return rows, eofs


def test_columns_equal_message_objects(kafka_bootstrap, make_topic):
    """Two topics x 3 partitions, null/empty/binary keys and values, repeated and null headers,
    explicit timestamps: the same rows, in the same per-partition order, and the same
    end-of-partition events as confluent-kafka's consume()."""
    topics = [make_topic(partitions=3), make_topic(partitions=3)]
    for n, t in enumerate(topics):
        produce(kafka_bootstrap, t, varied_records(3, 700, seed=n + 1))
    assign = [TopicPartition(t, p, 0) for t in topics for p in range(3)]
    errors: list = []
    native = NativeConsumer(_consumer_conf(kafka_bootstrap, errors.append))
    native.assign(assign)
    try:
        by_columns, eof_columns = _read_all(native, len(assign))
    finally:
        native.close()
    c = Consumer(_consumer_conf(kafka_bootstrap))
    c.assign(assign)
    try:
        by_messages, eof_messages = _read_all(c, len(assign))
    finally:
        c.close()
    assert len(by_messages) == 1400
    assert sorted(by_columns, key=lambda r: r[:3]) == sorted(by_messages, key=lambda r: r[:3])
    for tp in {(r[0], r[1]) for r in by_columns}:  # offsets increase within a partition
        offs = [r[2] for r in by_columns if (r[0], r[1]) == tp]
        assert offs == sorted(offs)
    assert sorted(eof_columns) == sorted(eof_messages)
    assert errors == []


def test_metadata_and_watermarks_as_confluent_kafka(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, varied_records(3, 90, seed=3))
    native = NativeConsumer(_consumer_conf(kafka_bootstrap))
    c = Consumer(_consumer_conf(kafka_bootstrap))
    try:
        mine, theirs = native.list_topics(topic, timeout=15), c.list_topics(topic, timeout=15)
        assert mine.cluster_id == theirs.cluster_id and mine.cluster_id
        assert sorted(mine.topics[topic].partitions) == sorted(theirs.topics[topic].partitions)
        assert mine.topics[topic].error is None
        missing = f"no-such-{uuid.uuid4().hex[:8]}"
        assert native.list_topics(missing, timeout=15).topics[missing].error.code() == \
            c.list_topics(missing, timeout=15).topics[missing].error.code()
        for p in range(3):
            tp = TopicPartition(topic, p)
            assert native.get_watermark_offsets(tp, timeout=15) == \
                c.get_watermark_offsets(tp, timeout=15)
    finally:
        native.close()
        c.close()
    native.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        native.consume_columns(10, 0.01)


def test_unknown_setting_names_the_key(kafka_bootstrap):
    settings = KafkaSettings({"bootstrap.servers": kafka_bootstrap})
    settings.update({"no.such.setting": "1"}, lambda k: f"-X {k}")
    with pytest.raises(KafkaException) as e:
        kafka_consumer(_consumer_conf(kafka_bootstrap, **{"no.such.setting": 1}))
    err = settings.explain(e.value, "Kafka consumer")
    assert isinstance(err, ConfigError)
    assert str(err).startswith("-X no.such.setting=1: invalid Kafka consumer setting")
    with pytest.raises(KafkaException, match='"batch.size"'):
        kafka_producer({"bootstrap.servers": kafka_bootstrap, "batch.size": "big"})


def test_the_io_switch_is_gone_and_says_so(kafka_bootstrap, monkeypatch, capsys):
    """KCOMPACT_KAFKA_IO=confluent (the second data path until issue 39): one warning line, and
    the client is kcompact's own all the same."""
    monkeypatch.setenv(native_kafka.IO_ENV, "confluent")
    monkeypatch.setattr(native_kafka, "_warned", False)
    c = kafka_consumer(_consumer_conf(kafka_bootstrap))
    p = kafka_producer(_producer_conf(kafka_bootstrap))
    c.close()
    assert isinstance(c, NativeConsumer) and isinstance(p, NativeProducer)
    err = capsys.readouterr().err.splitlines()
    assert err == ["kcompact: warning: KCOMPACT_KAFKA_IO is gone and ignored: the data path "
                   "always runs on kcompact's own Kafka client (see `kcompact --version`); "
                   "unset it"], err


def test_no_librdkafka_is_one_error_naming_why(monkeypatch):
    monkeypatch.setattr(native_kafka, "_loaded", False)
    monkeypatch.setattr(native_kafka, "_why_not", "no librdkafka found")
    with pytest.raises(ConfigError, match="Kafka client cannot run: no librdkafka found"):
        kafka_consumer({})
    assert native_kafka.describe() == "UNAVAILABLE: no librdkafka found"


def test_clients_opened_at_once_all_load_the_library(monkeypatch):
    """The tasks of one worker open their clients at once (connect standalone, tasks.max=2): a
    thread must never see the library's load half done (it once read 'cannot run: ' with no
    reason while another thread was loading)."""
    import threading
    monkeypatch.setattr(native_kafka, "_loaded", None)
    monkeypatch.setattr(native_kafka, "_why_not", "")
    start, got = threading.Barrier(8), []

    def load() -> None:
        start.wait()
        got.append(native_kafka._native_module())

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and got[0] is not None and all(m is got[0] for m in got), \
        native_kafka._why_not


class Boom(Exception):
    pass


def test_callback_that_raises_comes_out_of_consume(closed_port):
    """error_cb is called on the consuming thread; what it raises comes out of consume (the
    batch in hand is dropped),; a callback that does not raise sees the
    connection errors."""
    seen: list = []
    c = kafka_consumer(_consumer_conf(f"127.0.0.1:{closed_port}", seen.append))
    c.assign([TopicPartition("nowhere", 0, 0)])
    try:
        for _ in range(40):
            assert _consume(c, 100, 0.25) == ([], [])
            if seen:
                break
        assert seen and all(e.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                                         KafkaError._RESOLVE) for e in seen), seen
    finally:
        c.close()

    def raising(err):
        raise Boom(str(err))
    c = kafka_consumer(_consumer_conf(f"127.0.0.1:{closed_port}", raising))
    c.assign([TopicPartition("nowhere", 0, 0)])
    try:
        with pytest.raises(Boom):
            for _ in range(40):
                _consume(c, 100, 0.25)
    finally:
        c.close()


def test_broker_going_away_mid_batch(tmp_path):
    """A broker of its own, stopped while the consumer is between batches: no exception from
    consume, only empty batches, and error_cb is told the brokers are down,."""
    errors: list = []
    with EmbeddedBroker() as broker:
        bootstrap = broker.bootstrap_servers
        from confluent_kafka.admin import AdminClient, NewTopic
        topic = f"away-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
        del admin
        produce(bootstrap, topic, varied_records(1, 2000, seed=9))
        c = kafka_consumer(_consumer_conf(bootstrap, errors.append))
        c.assign([TopicPartition(topic, 0, 0)])
        rows: list = []
        for _ in range(100):
            got, _ = _consume(c, 300, 0.5)
            rows += got
            if rows:
                break
        assert 0 < len(rows) <= 2000
    try:
        # the broker is gone: what was fetched before may still come, then nothing, no raise
        for _ in range(60):
            got, events = _consume(c, 300, 0.25)
            rows += got
            if any(e.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT)
                   for e in errors):
                break
        assert any(e.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT)
                   for e in errors), errors
        assert [r[2] for r in rows] == list(range(len(rows)))  # in order, no gap, no repeat
    finally:
        c.close()


def _producer_conf(bootstrap: str, **extra) -> dict:
    return {"bootstrap.servers": bootstrap, "logger": kafka_logger(),
            "allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 500,
            "message.timeout.ms": 5000, **extra}


def _send(p, topic: str, partition: int, keys: list, values: list, parts=None) -> None:
    """The records, as columns."""
    ts = np.array([TS0 + i for i in range(len(keys))], np.int64)
    p.produce_columns(topic, partition, None if parts is None else np.array(parts, np.int32),
                      packed_columns(keys), packed_columns(values), ts)


def test_failed_delivery_fails_the_commit(kafka_bootstrap, make_topic):
    """Delivered records read back as sent (null and empty keys and values, timestamps, a
    partition per record); a record that fails delivery fails the transaction's commit."""
    p = kafka_producer(_producer_conf(kafka_bootstrap,
                                      **{"transactional.id": f"nk-{uuid.uuid4().hex[:8]}"}))
    p.init_transactions(30)
    topic = make_topic(partitions=2)
    p.begin_transaction()
    _send(p, topic, -1, [None, b"", b"k2", b"k3"], [b"v0", None, b"", b"v3" * 100],
          parts=[0, 1, 0, 1])
    p.commit_transaction(30)
    assert read_topic(kafka_bootstrap, topic, 2) == {
        0: [(0, TS0, None, b"v0", ()), (1, TS0 + 2, b"k2", b"", ())],
        1: [(0, TS0 + 1, b"", None, ()), (1, TS0 + 3, b"k3", b"v3" * 100, ())]}
    p.begin_transaction()
    _send(p, f"no-such-topic-{uuid.uuid4().hex[:8]}", 0, [b"k"], [b"v"])
    with pytest.raises(KafkaException, match="failed delivery"):
        p.commit_transaction(30)
    p.abort_transaction(30)


def test_failed_delivery_reaches_on_delivery(kafka_bootstrap, make_topic):
    """Without a transaction, each failed record reaches the configuration's on_delivery with
    its error, topic and partition, (delivery.report.only.error, as restore)."""
    reports: list = []

    def on_delivery(err, msg):
        reports.append((err.code() if err else None, msg.topic(), msg.partition()))
    p = kafka_producer(_producer_conf(kafka_bootstrap, on_delivery=on_delivery,
                                      **{"enable.idempotence": True,
                                         "delivery.report.only.error": True}))
    topic = make_topic(partitions=1)
    _send(p, topic, 0, [b"k%d" % i for i in range(500)], [b"v"] * 500)
    assert p.flush(30) == 0
    assert reports == []
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    _send(p, missing, 0, [b"a", b"b"], [b"1", b"2"])
    assert p.flush(30) == 0
    assert reports == [(KafkaError.UNKNOWN_TOPIC_OR_PART, missing, 0)] * 2, reports
    assert [r[2] for r in read_topic(kafka_bootstrap, topic, 1)[0]] == \
        [b"k%d" % i for i in range(500)]


def test_malformed_header_section_is_refused_before_any_record(kafka_bootstrap, make_topic):
    p = NativeProducer(_producer_conf(kafka_bootstrap))
    topic = make_topic(partitions=1)
    bad = (b"\x05\x00\x00\x00", np.array([0], np.int64), np.array([4], np.int64))
    with pytest.raises(ValueError, match="header section"):
        p.produce_columns(topic, 0, None, packed_columns([b"x"]), packed_columns([b"y"]),
                          np.array([TS0], np.int64), bad)
    assert len(p) == 0
    with pytest.raises(TypeError, match="on_delivery"):
        p.produce(topic, b"v", b"k", 0, None, print)


def test_fenced_transactional_producer(kafka_bootstrap, make_topic):
    """A second producer with the same transactional id fences the first: the first's next
    transaction fails with a fatal fencing error,."""
    tid = f"nk-fence-{uuid.uuid4().hex[:8]}"
    topic = make_topic(partitions=1)
    first = kafka_producer(_producer_conf(kafka_bootstrap, **{"transactional.id": tid}))
    first.init_transactions(30)
    second = kafka_producer(_producer_conf(kafka_bootstrap, **{"transactional.id": tid}))
    second.init_transactions(30)
    with pytest.raises(KafkaException) as e:
        first.begin_transaction()
        _send(first, topic, 0, [b"k"], [b"v"])
        first.commit_transaction(30)
    err = e.value.args[0]
    assert err.fatal() and err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                          KafkaError.INVALID_PRODUCER_EPOCH), err
    second.begin_transaction()
    _send(second, topic, 0, [b"k2"], [b"v2"])
    second.commit_transaction(30)
    assert [r[2] for r in read_topic(kafka_bootstrap, topic, 1)[0]] == [b"k2"]


_SIGINT_CHILD = textwrap.dedent("""
    import signal, sys
    # a parent started in the background by a non-interactive shell hands SIGINT down ignored,
    # and Python then installs no KeyboardInterrupt handler: Ctrl-C's default, explicitly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from confluent_kafka import TopicPartition
    from kcompact.connectors.framework.native_kafka import kafka_consumer
    c = kafka_consumer({"bootstrap.servers": sys.argv[1], "group.id": "sigint",
                        "enable.partition.eof": False})
    c.assign([TopicPartition(sys.argv[2], 0, 0)])
    consume = c.consume_columns
    print("consuming", flush=True)
    try:
        for _ in range(3):
            consume(100, 60.0)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    c.close()
""")


def test_sigint_during_a_blocking_consume(kafka_bootstrap, make_topic):
    """Ctrl-C while consume waits (60 s, an empty partition) raises KeyboardInterrupt out of
    it (a process of its own: the signal goes to it alone)."""
    topic = make_topic(partitions=1)
    child = subprocess.Popen([sys.executable, "-c", _SIGINT_CHILD, kafka_bootstrap, topic],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        assert child.stdout.readline().strip() == "consuming"
        import time
        time.sleep(1.0)  # inside consume (not a timing assertion: any moment inside will do)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert out.strip() == "interrupted", (out, err)
    assert child.returncode == 0, err
