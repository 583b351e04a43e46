"""The Kafka endpoint's Fetch and ListOffsets against a model of what Kafka would answer (issue 40).

Random stores (offsets with gaps, tombstones, keyless records, headers, sometimes force-compacted
so that the tail may be gone) are served by the endpoint in this process (its asyncio server on
127.0.0.1 in a thread; no server process), and a minimal protocol client written here from the
Kafka protocol spec (kio only encodes its requests) fetches from random offsets with random byte
limits, at random versions 4-12 (some partitions end, as their source did, in transaction markers
past the last record: ``Store.advance_next_offset``). The model, from the partition reader's records: the first
batch holds the first record at or after the offset (or, past the last record and below the high
watermark, the partition ends as a Kafka log ending in a transaction marker does: one COMMIT
control batch at the high watermark - 1); records decode to the model's; the response's bytes stay
within the limits unless a single batch; out of [log start, high watermark]: OFFSET_OUT_OF_RANGE;
an unknown partition: UNKNOWN_TOPIC_OR_PARTITION; ListOffsets earliest/latest are the bounds.
A consumer fetching on from each answer's next offset reads exactly the model's records and
stops at the high watermark.
"""

from __future__ import annotations

import asyncio
import bisect
import io
import logging
import os
import socket
import struct
import sys
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.serial import entity_writer

from kcompact.reput import Store
from kcompact.reput.reader import PartitionReader
from kcompact.replication.group_offsets import GroupOffsets
from kcompact.replication.kafka_endpoint.groups import Coordinator
from kcompact.replication.kafka_endpoint.server import Endpoint, Limits
from kcompact.replication.kafka_endpoint.store_view import StoreView
from kcompact.replication.kafka_endpoint.wire import build, _request_schema

sys.path.insert(0, os.path.dirname(__file__))

from _kafka_wire import decode_batches  # noqa: E402
from test_reader_model import TOPIC, _build, _record  # noqa: E402


class Served:
    """The endpoint over ``url`` in a thread of this process."""

    def __init__(self, url: str, **endpoint):
        """``endpoint``: Endpoint's keyword arguments (token, limits, ssl_context, log)."""
        self.url = url
        self.kwargs = {"token": None, "limits": Limits(),
                       "log": logging.getLogger("test-endpoint"), **endpoint}
        self.host = self.kwargs.pop("host", "127.0.0.1")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.view = StoreView(self.url)
        offsets = GroupOffsets(self.url, self.view.store.meta.store_id)
        log = self.kwargs["log"]
        self.ep = Endpoint(self.view, lambda ep: Coordinator(offsets, ep.run, log,
                                                              self.view.has), **self.kwargs)
        _, self.port = await self.ep.start(self.host, 0)

    def close(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.ep.close(), self.loop)
        fut.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.view.close()


class Client:
    """A minimal Kafka client: kio encodes the request, the response is read by hand."""

    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.corr = 0

    def send(self, api_key: int, version: int, /, **body) -> None:
        """The request sent, its response not read (``call`` reads it)."""
        cls = _request_schema(api_key, version)
        out = io.BytesIO()
        self.corr += 1
        hdr = cls.__header_schema__
        entity_writer(hdr)(out, build(hdr, request_api_key=api_key, request_api_version=version,
                                      correlation_id=self.corr, client_id="model"))
        entity_writer(cls)(out, build(cls, **body))
        raw = out.getvalue()
        self.s.sendall(struct.pack(">i", len(raw)) + raw)

    def call(self, api_key: int, version: int, /, **body) -> bytes:
        self.send(api_key, version, **body)
        size = struct.unpack(">i", self._read(4))[0]
        resp = self._read(size)
        assert struct.unpack_from(">i", resp, 0)[0] == self.corr
        return resp

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            assert chunk, "the endpoint closed the connection"
            buf += chunk
        return buf

    def fetch(self, version: int, offset: int, max_bytes: int, partition: int = 0):
        """(error, high watermark, log start, records bytes) of one partition."""
        r = self.call(1, version, replica_id=-1, max_wait=0, min_bytes=0, max_bytes=max_bytes,
                      isolation_level=1, session_id=0, session_epoch=-1, topics=[{
                          "topic": TOPIC, "partitions": [{
                              "partition": partition, "fetch_offset": offset,
                              "partition_max_bytes": max_bytes, "log_start_offset": -1,
                              "current_leader_epoch": -1, "last_fetched_epoch": -1}]}],
                      forgotten_topics_data=[], rack_id="")
        flex = version >= 12
        p = 4 + (1 if flex else 0) + 4 + (6 if version >= 7 else 0)

        def count():
            nonlocal p
            if flex:
                n, p = _uvarint(r, p)
                return n - 1
            n = struct.unpack_from(">i", r, p)[0]
            p += 4
            return n

        assert count() == 1
        if flex:
            n, p = _uvarint(r, p)
            name = r[p:p + n - 1]
            p += n - 1
        else:
            n = struct.unpack_from(">h", r, p)[0]
            name = r[p + 2:p + 2 + n]
            p += 2 + n
        assert name.decode() == TOPIC
        assert count() == 1
        part, err, hwm, lso = struct.unpack_from(">ihqq", r, p)
        p += 22
        assert part == partition and lso == hwm
        start = -1
        if version >= 5:
            start = struct.unpack_from(">q", r, p)[0]
            p += 8
        assert count() == 0  # aborted transactions: empty
        if version >= 11:
            assert struct.unpack_from(">i", r, p)[0] == -1
            p += 4
        n = count()
        if n < 0:  # null: only the zstd refusal's, as Kafka's
            assert err == 76 and n == -1, (err, n)
            return err, hwm, start, None
        return err, hwm, start, r[p:p + n]

    def list_offsets(self, ts: int, partition: int = 0) -> tuple[int, int]:
        r = self.call(2, 1, replica_id=-1, topics=[{"name": TOPIC, "partitions": [
            {"partition_index": partition, "timestamp": ts}]}])
        # v1: corr, [topic: name, [partition error timestamp offset]]
        p = 4 + 4
        n = struct.unpack_from(">h", r, p)[0]
        p += 2 + n + 4
        _part, err, _ts, off = struct.unpack_from(">ihqq", r, p)
        return err, off

    def close(self) -> None:
        self.s.close()


#: a COMMIT control batch's bytes (docs/formats/kafka-endpoint-fetch.md)
MARKER_SIZE = 78


def _assert_end_marker(b, hwm: int) -> None:
    """``b`` is the end-of-log marker: a COMMIT control batch at the high watermark - 1."""
    assert b.attributes == 0x30  # transactional | control, uncompressed
    assert (b.base_offset, b.last_offset, b.size) == (hwm - 1, hwm - 1, MARKER_SIZE)
    assert [(r.offset, r.key, r.value) for r in b.records] == [
        (hwm - 1, b"\0\0\0\1", b"\0" * 6)]  # COMMIT v0, coordinator epoch 0


def _uvarint(b: bytes, p: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        c = b[p]
        p += 1
        n |= (c & 0x7F) << shift
        if not c & 0x80:
            return n, p
        shift += 7


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_record, max_size=120), compact=st.booleans(),
       markers=st.integers(0, 3), data=st.data())
def test_fetch_and_list_offsets_answer_as_kafka_would(rows, compact, markers, data):
    with tempfile.TemporaryDirectory() as root:
        st_, _ = _build("local", root, rows, compact)
        st_.record_partitions(TOPIC, [0])
        if markers:  # the source ends in transaction markers: its end offset is past them
            st_.advance_next_offset(TOPIC, 0, st_.next_offset(TOPIC, 0) + markers)
            st_.flush()
        st_.close()
        ro = Store.open(st_.url)
        pl = ro.partition(TOPIC, 0)
        model = {r.offset: r for r in PartitionReader(pl).records(0)}
        hwm = pl.next_offset
        start = pl.segments[0].base if pl.segments else hwm
        ro.close()
        offs = sorted(model)
        srv = Served(st_.url)
        c = Client(srv.port)
        try:
            assert c.list_offsets(-1) == (0, hwm)
            assert c.list_offsets(-2) == (0, start)
            assert c.fetch(12, 0, 100, partition=7)[0] == 3  # UNKNOWN_TOPIC_OR_PARTITION
            for _ in range(6):
                version = data.draw(st.integers(4, 12))
                frm = data.draw(st.one_of(st.integers(-2, hwm + 3),
                                          st.sampled_from(offs or [0])))
                max_bytes = data.draw(st.integers(0, 9000))
                err, got_hwm, got_start, raw = c.fetch(version, frm, max_bytes)
                assert got_hwm == hwm and (version < 5 or got_start == start)
                if frm < start or frm > hwm:
                    assert err == 1 and raw == b""  # OFFSET_OUT_OF_RANGE
                    continue
                assert err == 0
                batches = decode_batches(raw)
                assert sum(b.size for b in batches) == len(raw)
                rest = offs[bisect.bisect_left(offs, frm):]
                if frm == hwm:
                    assert raw == b""
                elif not rest:  # a trailing gap: a COMMIT marker at the high watermark - 1
                    assert len(batches) == 1
                    _assert_end_marker(batches[0], hwm)
                else:
                    assert batches[0].base_offset <= rest[0] <= batches[0].last_offset
                    assert len(batches) == 1 or len(raw) <= max_bytes
                    stored = [b for b in batches if not b.attributes & 0x20]
                    # the partition's last data before its trailing gap: the marker follows
                    # in the same answer when it fits whole within the limit (Kafka's
                    # markers come with the data)
                    end = stored[-1].last_offset + 1
                    if end < hwm and offs[-1] < end and \
                            sum(b.size for b in stored) + MARKER_SIZE <= max_bytes:
                        assert batches[len(stored):] and len(batches) == len(stored) + 1
                        _assert_end_marker(batches[-1], hwm)
                    else:
                        assert batches == stored, (end, hwm, offs[-1], len(raw), max_bytes)
                    for b in stored:
                        for r in b.records:
                            m = model[r.offset]
                            assert (r.timestamp, r.key, r.value, r.headers) == (
                                m.timestamp, m.key, m.value, tuple(m.headers))
            # a consumer reading on from the log start stops at the high watermark with
            # exactly the model's records
            at, seen = start, []
            for _ in range(4 * len(offs) + 5):
                if at >= hwm:
                    break
                err, _, _, raw = c.fetch(12, at, data.draw(st.integers(1, 5000)))
                assert err == 0
                batches = decode_batches(raw)
                assert batches
                seen += [r.offset for b in batches if not b.attributes & 0x20
                         for r in b.records if r.offset >= at]
                at = batches[-1].last_offset + 1
            assert at == hwm and seen == offs
        finally:
            c.close()
            srv.close()


def test_an_empty_fetch_and_an_old_api_versions_are_answered(tmp_path):
    st_, _ = _build("local", str(tmp_path), [(1, b"k", b"v", [])], False)
    st_.close()
    srv = Served(st_.url)
    c = Client(srv.port)
    try:
        r = c.call(1, 12, replica_id=-1, max_wait=0, min_bytes=0, max_bytes=1000,
                   isolation_level=0, session_id=0, session_epoch=-1, topics=[],
                   forgotten_topics_data=[], rack_id="")
        assert r[5:15] == b"\0\0\0\0\0\0\0\0\0\0" and r[15] == 1  # no error, no topic
        raw = struct.pack(">hhih", 18, 9, 77, -1)
        c.s.sendall(struct.pack(">i", len(raw)) + raw)
        size = struct.unpack(">i", c._read(4))[0]
        body = c._read(size)
        assert struct.unpack_from(">ih", body, 0) == (77, 35)  # UNSUPPORTED_VERSION, v0 body
        n = struct.unpack_from(">i", body, 6)[0]
        keys = {struct.unpack_from(">hhh", body, 10 + 6 * i) for i in range(n)}
        assert (1, 4, 12) in keys and (0, 3, 9) in keys and (18, 0, 3) in keys
    finally:
        c.close()
        srv.close()


@pytest.mark.parametrize("version", [3, 9])
def test_produce_is_refused_with_a_reason(tmp_path, version):
    st_, _ = _build("local", str(tmp_path), [(1, b"k", b"v", [])], False)
    st_.close()
    srv = Served(st_.url)
    c = Client(srv.port)
    try:
        r = c.call(0, version, transactional_id=None, acks=-1, timeout=1000, topic_data=[
            {"name": TOPIC, "partition_data": [{"index": 0, "records": b""}]}])
        assert struct.pack(">h", 29) in r  # TOPIC_AUTHORIZATION_FAILED
        assert (b"read-only" in r) == (version >= 8)  # the message field is v8+
    finally:
        c.close()
        srv.close()
    with Store.open(st_.url) as ro:
        assert ro.partition(TOPIC, 0).next_offset == 2


def test_error_codes_inside_answers_count_by_api_and_error(tmp_path):
    """The errors metric counts each partition's error in Fetch and ListOffsets answers (and
    each refused produce, an old ApiVersions), by API and Kafka's error name."""
    st_, _ = _build("local", str(tmp_path), [(1, b"k", b"v", []), (1, b"k2", b"v", [])], False)
    st_.close()
    srv = Served(st_.url)
    c = Client(srv.port)
    try:
        assert c.fetch(12, 99, 1000)[0] == 1                # OFFSET_OUT_OF_RANGE
        assert c.fetch(11, 99, 1000)[0] == 1
        assert c.fetch(12, 0, 1000, partition=5)[0] == 3    # UNKNOWN_TOPIC_OR_PARTITION
        assert c.fetch(12, 1, 1000)[0] == 0                 # (no error: not counted)
        assert c.list_offsets(-1, partition=9)[0] == 3
        assert c.list_offsets(-1)[0] == 0
        c.call(0, 9, transactional_id=None, acks=-1, timeout=1000, topic_data=[
            {"name": TOPIC, "partition_data": [{"index": 0, "records": b""},
                                               {"index": 1, "records": b""}]}])
        raw = struct.pack(">hhih", 18, 9, 77, -1)
        c.s.sendall(struct.pack(">i", len(raw)) + raw)
        c._read(struct.unpack(">i", c._read(4))[0])
        assert srv.ep.errors == {("Fetch", "OFFSET_OUT_OF_RANGE"): 2,
                                 ("Fetch", "UNKNOWN_TOPIC_OR_PARTITION"): 1,
                                 ("ListOffsets", "UNKNOWN_TOPIC_OR_PARTITION"): 1,
                                 ("Produce", "TOPIC_AUTHORIZATION_FAILED"): 2,
                                 ("ApiVersions", "UNSUPPORTED_VERSION"): 1}
        fam = next(f for f in srv.ep.collect() if f.name.endswith("kafka_error_responses"))
        samples = {(s.labels["api"], s.labels["error"]): s.value for s in fam.samples
                   if s.name.endswith("_total")}
        assert samples[("Fetch", "OFFSET_OUT_OF_RANGE")] == 2
    finally:
        c.close()
        srv.close()


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("transactional", [False, True])
def test_init_producer_id_is_refused_as_kafka_refuses_a_principal_without_write(
        tmp_path, version, transactional):
    """An idempotent producer's InitProducerId: CLUSTER_AUTHORIZATION_FAILED (31), a
    transactional one's: TRANSACTIONAL_ID_AUTHORIZATION_FAILED (53); no producer id; advertised
    in ApiVersions (0-4), so that clients are refused rather than failing on versions."""
    from kcompact.replication.kafka_endpoint.apis import served
    assert served()[22] == (0, 4)
    st_, _ = _build("local", str(tmp_path), [(1, b"k", b"v", [])], False)
    st_.close()
    srv = Served(st_.url)
    c = Client(srv.port)
    try:
        r = c.call(22, version, transactional_id="tx-1" if transactional else None,
                   transaction_timeout=60000, producer_id=-1, producer_epoch=-1)
        p = 4 + (1 if version >= 2 else 0)  # correlation id, [v2+] header tags
        _throttle, err, pid, epoch = struct.unpack_from(">ihqh", r, p)
        assert (err, pid, epoch) == ((53 if transactional else 31), -1, -1)
        assert srv.ep.refused_produces == 1
    finally:
        c.close()
        srv.close()


def _zstd_store(root: str, codec: str) -> str:
    """A store written at the default codec (every key distinct: a compaction drops nothing),
    then ``compression.type=codec`` and a forced compaction, which re-encodes every segment."""
    st_, _ = _build("local", root, [(1, b"k%d" % i, b"value %d " % i * 20, [])
                                    for i in range(300)], False)
    st_.set_topic_config(TOPIC, {"compression.type": codec})
    st_.flush()
    from kcompact.compaction import CompactionOptions, Compactor
    res = Compactor(st_, CompactionOptions()).compact_partition(TOPIC, 0, force=True)
    assert res.skipped is None
    st_.close()
    return st_.url


@pytest.mark.parametrize("codec", ["zstd", "gzip", "lz4", "snappy", "uncompressed",
                                   "producer over zstd"])
def test_a_zstd_topic_is_served_only_to_fetch_v10_and_later(tmp_path, codec):
    """KIP-110 as Kafka applies it: a topic whose compression.type is zstd is answered
    UNSUPPORTED_COMPRESSION_TYPE (76), records null, offsets -1, to a Fetch v4-v9, and served as stored to
    v10+; every other codec is served to every version, and so are the zstd batches of a
    topic whose compression.type is producer (Kafka decides by the topic's config)."""
    url = _zstd_store(str(tmp_path), "zstd" if codec == "producer over zstd" else codec)
    if codec == "producer over zstd":
        with Store.open(url) as st_:
            st_.set_topic_config(TOPIC, {"compression.type": "producer"})
    srv = Served(url)
    c = Client(srv.port)
    try:
        start = c.list_offsets(-2)[1]
        for version in (4, 9, 10, 12):
            err, hwm, _, raw = c.fetch(version, start, 1 << 20)
            if codec == "zstd" and version < 10:
                # (the offsets -1 and the records null, as Kafka answers: rskafka prints the
                # offsets, sarama 2.0.0 fails to decode null records, from Kafka too)
                assert (err, hwm, raw) == (76, -1, None)
                continue
            assert err == 0
            batches = decode_batches(raw)
            want = {"zstd": 4, "gzip": 1, "snappy": 2, "lz4": 3, "uncompressed": 0,
                    "producer over zstd": 4}[codec]
            assert batches and {b.attributes & 7 for b in batches} == {want}
            assert [r.value for b in batches for r in b.records][:2] == [
                b"value 0 " * 20, b"value 1 " * 20]
    finally:
        c.close()
        srv.close()


def _gap_store(root: str) -> tuple[str, list[int], int]:
    """A compacted partition whose source ended 7 offsets past its last record: (url, the
    stored offsets, the high watermark)."""
    st_, _ = _build("local", root, [(1, b"k%d" % (i % 5), b"v%d" % i, []) for i in range(50)],
                    True)
    st_.record_partitions(TOPIC, [0])
    st_.advance_next_offset(TOPIC, 0, st_.next_offset(TOPIC, 0) + 7)
    st_.flush()
    st_.close()
    with Store.open(st_.url) as ro:
        return st_.url, [r.offset for r in ro.iter_records(TOPIC, 0)], ro.next_offset(TOPIC, 0)


def _confluent(bs: str) -> tuple[list[int], int, int]:
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bs, "group.id": "g-confluent",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "enable.partition.eof": True})
    try:
        c.subscribe([TOPIC])
        got, eof = [], None
        while eof is None:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                eof = m.offset()
                continue
            got.append(m.offset())
        c.commit(asynchronous=False)
        return got, eof, c.committed([TopicPartition(TOPIC, 0)], timeout=10)[0].offset
    finally:
        c.close()


def _kafka_python(bs: str) -> tuple[list[int], int, int]:
    kafka = pytest.importorskip("kafka", reason="kafka-python is not installed")
    tp = kafka.TopicPartition(TOPIC, 0)
    c = kafka.KafkaConsumer(bootstrap_servers=bs, group_id="g-kafka-python",
                            auto_offset_reset="earliest", enable_auto_commit=False,
                            consumer_timeout_ms=3000)
    try:
        c.subscribe([TOPIC])
        got = [m.offset for m in c]  # (until 3 s without a record)
        c.commit()
        return got, c.position(tp), c.committed(tp)
    finally:
        c.close()


def _aiokafka(bs: str) -> tuple[list[int], int, int]:
    aiokafka = pytest.importorskip("aiokafka", reason="aiokafka is not installed")

    async def run():
        tp = aiokafka.TopicPartition(TOPIC, 0)
        c = aiokafka.AIOKafkaConsumer(TOPIC, bootstrap_servers=bs, group_id="g-aiokafka",
                                      auto_offset_reset="earliest", enable_auto_commit=False)
        await c.start()
        try:
            got = []
            while batch := await c.getmany(timeout_ms=2000):
                got += [m.offset for ms in batch.values() for m in ms]
            await c.commit()
            return got, await c.position(tp), await c.committed(tp)
        finally:
            await c.stop()
    return asyncio.run(run())


@pytest.mark.parametrize("client", [_confluent, _kafka_python, _aiokafka],
                         ids=["confluent-kafka", "kafka-python", "aiokafka"])
def test_a_group_steps_over_the_end_marker_to_the_high_watermark(tmp_path, client):
    """A group member reads every record once, ends at the high watermark (past the trailing
    gap the marker ends) and commits it."""
    url, offs, hwm = _gap_store(str(tmp_path))
    assert offs and offs[-1] + 1 < hwm
    srv = Served(url)
    try:
        got, end, committed = client(f"127.0.0.1:{srv.port}")
        assert (got, end, committed) == (offs, hwm, hwm)
    finally:
        srv.close()


@pytest.mark.parametrize("version", [4, 12])
def test_the_last_data_and_the_end_marker_come_in_one_answer(tmp_path, version):
    """A Fetch that reaches a partition's last record, the partition ending in a gap: the data
    and then the end-of-log marker in the same answer (as Kafka serves a log ending in
    transaction markers: the markers with the data), so that a client handing control records
    to the application (kafka-go) has it with the data; when the marker does not fit whole
    within the limit, the data alone, and the next fetch (in the gap) gets the marker alone.
    A partition ending in a record gets no marker."""
    url, offs, hwm = _gap_store(str(tmp_path))
    assert offs and offs[-1] + 1 < hwm
    srv = Served(url)
    c = Client(srv.port)
    try:
        err, got_hwm, _, raw = c.fetch(version, offs[-1], 1 << 20)
        assert (err, got_hwm) == (0, hwm)
        batches = decode_batches(raw)
        assert len(batches) >= 2 and sum(b.size for b in batches) == len(raw)
        *data, marker = batches
        assert not any(b.attributes & 0x20 for b in data)
        assert [r.offset for b in data for r in b.records if r.offset >= offs[-1]] == offs[-1:]
        assert data[-1].last_offset < hwm - 1
        _assert_end_marker(marker, hwm)
        # the limit one byte short of data + marker: the data alone, the marker next
        data_bytes = sum(b.size for b in data)
        err, _, _, raw = c.fetch(version, offs[-1], data_bytes + MARKER_SIZE - 1)
        assert err == 0 and [b.size for b in decode_batches(raw)] == [b.size for b in data]
        err, _, _, raw = c.fetch(version, data[-1].last_offset + 1, data_bytes)
        assert err == 0
        (alone,) = decode_batches(raw)
        _assert_end_marker(alone, hwm)
        # a fetch from the log start with room for all: every record, then the marker
        err, _, _, raw = c.fetch(version, offs[0], 1 << 20)
        batches = decode_batches(raw)
        assert [r.offset for b in batches[:-1] for r in b.records] == offs
        _assert_end_marker(batches[-1], hwm)
    finally:
        c.close()
        srv.close()
    # the same partition without its trailing gap: no marker after its last record
    st_, _ = _build("local", str(tmp_path / "plain"),
                    [(1, b"k%d" % (i % 5), b"v%d" % i, []) for i in range(50)], True)
    st_.close()
    with Store.open(st_.url) as ro:
        first = ro.first_offset(TOPIC, 0)
    srv = Served(st_.url)
    c = Client(srv.port)
    try:
        err, plain_hwm, _, raw = c.fetch(version, first, 1 << 20)
        batches = decode_batches(raw)
        assert err == 0 and batches and not any(b.attributes & 0x20 for b in batches)
        assert batches[-1].last_offset + 1 == plain_hwm
    finally:
        c.close()
        srv.close()
