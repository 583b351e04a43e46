"""End offsets past transaction markers: the store and its Kafka endpoint against Apache Kafka 3.9.1.

A topic whose partition 0 ends in a committed transaction (its commit marker is the last offset)
and whose partition 1 ends in an aborted one (aborted records, then the abort marker) is mirrored
into a store (``mirror_local``, as ``kcompact mirror``). A read_committed mirror never receives
the markers or the aborted records, yet the store's end offsets must be Kafka's: the mirror
records its consumer's position (past them) as each partition's next offset. Then, through
``kcompact serve --kafka-listen``:

* end offsets (watermarks, GetOffsetShell -1 and -2) equal Kafka's; confluent-kafka's
  end-of-partition events come at Kafka's offsets; the GlobalKTable restore loop ends at them;
* a consumer group that committed Kafka's end offsets (what failing over with issue 42's captured
  offsets gives) resumes on the endpoint with nothing read again;
* more records and transactions produced, the mirror run again: it resumes after the markers,
  storing exactly the new committed records (none read twice, none skipped), and the end offsets
  still agree.
"""

from __future__ import annotations

import io
import os
import sys
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from kcompact.connectors.apps.mirror import mirror_local
from kcompact.reput import Store

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import java, raw_fetch, read_all, restore, serving  # noqa: E402
from test_kafka_endpoint import _franzgo, franzgo  # noqa: E402,F401 (a fixture)
from topics import read_store  # noqa: E402

pytestmark = pytest.mark.integration

T0 = (int(time.time()) - 3600) * 1000


def _produce(bootstrap: str, topic: str, round_: int) -> None:
    """Plain records to both partitions, then a committed transaction to partition 0 and an
    aborted one to partition 1: each partition ends in a marker."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for part in (0, 1):
        for i in range(12):
            p.produce(topic, key=b"k%d" % (i % 5), value=b"r%d-%d" % (round_, i),
                      partition=part, timestamp=T0 + round_ * 1000 + i)
    assert p.flush(30) == 0
    for part, commit in ((0, True), (1, False)):
        tp = Producer({"bootstrap.servers": bootstrap,
                       "transactional.id": f"tails-{topic}-{part}"})
        tp.init_transactions(30)
        tp.begin_transaction()
        for i in range(3):
            tp.produce(topic, key=b"tx%d" % i, value=b"%s-%d" % (
                b"committed" if commit else b"aborted", round_), partition=part,
                timestamp=T0 + round_ * 1000 + 500 + i)
        tp.flush(30)
        (tp.commit_transaction if commit else tp.abort_transaction)(30)
    _settled(bootstrap, topic)


def _ends(bootstrap: str, topic: str, isolation: str = "read_committed"
          ) -> list[tuple[int, int]]:
    """Each partition's (log start, end offset): the last stable offset under read_committed
    (Kafka answers ListOffsets latest by the consumer's isolation level)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends",
                  "isolation.level": isolation})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in (0, 1)]
    finally:
        c.close()


def _settled(bootstrap: str, topic: str) -> None:
    """Wait until Kafka has written the transactions' markers (a commit or an abort returns
    before its markers are written: the last stable offset stays at the transaction's first
    record until then)."""
    deadline = time.monotonic() + 30
    while _ends(bootstrap, topic) != _ends(bootstrap, topic, "read_uncommitted"):
        assert time.monotonic() < deadline, "the transaction markers were never written"
        time.sleep(0.2)


def _mirror(bootstrap: str, topic: str, url: str) -> int:
    return mirror_local(bootstrap, topic, url, out=io.StringIO(), handle_signals=False).records


@pytest.fixture(scope="module")
def tails(apache_kafka, tmp_path_factory):
    """(kafka bootstrap, topic, store url, running Endpoint, work dir)."""
    from confluent_kafka.admin import NewTopic
    topic = f"tails-{uuid.uuid4().hex[:8]}"
    apache_kafka.admin.create_topics([NewTopic(topic, 2, 1, config={"retention.ms": "-1"})]
                                     )[topic].result()
    _produce(apache_kafka.bootstrap, topic, 0)
    work = tmp_path_factory.mktemp("tails")
    url = str(work / "store")
    assert _mirror(apache_kafka.bootstrap, topic, url) == 2 * 12 + 3
    with serving(apache_kafka, topic, url, work) as it:
        yield it


def test_end_offsets_are_kafkas_past_the_markers(tails):
    kafka, topic, url, ep, work = tails
    theirs = read_all(kafka, topic)
    ends = _ends(kafka, topic)
    # the premise: each partition ends past its last committed record (its marker; partition
    # 1 also after the aborted records)
    assert [hi for _, hi in ends] == theirs[-1]
    assert ends[0][1] == theirs[0][-1][0] + 2 and ends[1][1] == theirs[1][-1][0] + 5
    with Store.open(url) as ro:
        assert [ro.next_offset(topic, p) for p in (0, 1)] == [hi for _, hi in ends]
    assert _ends(ep.bootstrap, topic) == ends
    assert read_all(ep.bootstrap, topic) == theirs              # the EOF offsets included
    assert read_all(ep.bootstrap, topic, isolation="read_uncommitted") == theirs
    shell = [java("org.apache.kafka.tools.GetOffsetShell", "--bootstrap-server", bs,
                  "--topic", topic, "--time", t) for t in ("-1", "-2")
             for bs in (kafka, ep.bootstrap)]
    assert all(r.returncode == 0 for r in shell), [r.stderr[-500:] for r in shell]
    assert shell[0].stdout == shell[1].stdout and shell[2].stdout == shell[3].stdout
    assert shell[0].stdout == "".join(f"{topic}:{p}:{ends[p][1]}\n" for p in (0, 1))
    for p in (0, 1):  # the GlobalKTable restore loop ends at Kafka's end offset
        _, n, position, end = restore(ep.bootstrap, topic, p, work)
        assert int(n) == len(theirs[p]) and position == end == str(ends[p][1])


def _group_member(bs: str, group: str) -> Consumer:
    return Consumer({"bootstrap.servers": bs, "group.id": group, "auto.offset.reset": "earliest",
                     "enable.auto.commit": False, "enable.partition.eof": True,
                     "isolation.level": "read_committed", "session.timeout.ms": 6000,
                     "heartbeat.interval.ms": 300})


def _consume_to_eof(c: Consumer, topic: str) -> tuple[list, dict]:
    """Subscribe and read until both partitions report their end: (records, EOF offsets)."""
    c.subscribe([topic])
    got, eof = [], {}
    deadline = time.monotonic() + 60
    while len(eof) < 2:
        assert time.monotonic() < deadline, ("no end of partition", eof, len(got))
        m = c.poll(0.5)
        if m is None:
            continue
        if m.error() is not None:
            assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
            eof[m.partition()] = m.offset()
            continue
        got.append((m.partition(), m.offset()))
    return got, eof


def test_a_group_committed_at_kafkas_end_resumes_on_the_endpoint(tails):
    kafka, topic, _url, ep, _ = tails
    group = f"failover-{uuid.uuid4().hex[:6]}"
    ends = [hi for _, hi in _ends(kafka, topic)]
    # on Kafka: the group reads everything and commits its positions (past the markers)
    c = _group_member(kafka, group)
    try:
        got, eof = _consume_to_eof(c, topic)
        assert got and eof == {0: ends[0], 1: ends[1]}
        c.commit(asynchronous=False)
        committed = [tp.offset for tp in c.committed(
            [TopicPartition(topic, p) for p in (0, 1)], timeout=10)]
    finally:
        c.close()
    assert committed == ends
    # fail over: the same offsets committed for the group on the endpoint (as a group offset
    # capture or a failover tool does), then the group goes on there
    setter = Consumer({"bootstrap.servers": ep.bootstrap, "group.id": group})
    try:
        setter.commit(offsets=[TopicPartition(topic, p, committed[p]) for p in (0, 1)],
                      asynchronous=False)
    finally:
        setter.close()
    c = _group_member(ep.bootstrap, group)
    try:
        got, eof = _consume_to_eof(c, topic)
    finally:
        c.close()
    assert got == [] and eof == {0: ends[0], 1: ends[1]}  # nothing read again


def test_a_mirror_resumes_after_the_markers_and_the_endpoint_follows(tails):
    kafka, topic, url, ep, _ = tails
    before = read_all(kafka, topic)
    _produce(kafka, topic, 1)
    after = read_all(kafka, topic)
    new = sum(len(after[p]) - len(before[p]) for p in (0, 1))
    assert new == 2 * 12 + 3
    assert _mirror(kafka, topic, url) == new    # nothing read twice, nothing skipped
    stored = read_store(url, topic)
    for p in (0, 1):
        assert stored[p] == after[p]
    ends = _ends(kafka, topic)
    with Store.open(url) as ro:
        assert [ro.next_offset(topic, p) for p in (0, 1)] == [hi for _, hi in ends]
    assert _ends(ep.bootstrap, topic) == ends
    assert read_all(ep.bootstrap, topic) == after
    assert _mirror(kafka, topic, url) == 0      # at the end: nothing more


def _raw_fetch(bootstrap: str, topic: str, partition: int, offset: int) -> bytes:
    err, records = raw_fetch(bootstrap, topic, partition, offset)
    assert err == 0, err
    return records


def _head(raw: bytes) -> dict:
    import struct
    (base, length, epoch, magic, _crc, attrs, last_delta, base_ts, max_ts, pid, pepoch, seq,
     count) = struct.unpack_from(">qiibIhiqqqhii", raw, 0)
    return {"base": base, "length": length, "epoch": epoch, "magic": magic, "attributes": attrs,
            "last_offset_delta": last_delta, "base_ts": base_ts, "max_ts": max_ts, "pid": pid,
            "producer_epoch": pepoch, "base_sequence": seq, "count": count,
            "records": raw[61:12 + length]}


def test_a_partition_ends_in_the_control_batch_kafka_serves_for_its_markers(tails):
    """Kafka 3.9.1's Fetch at a partition's last offset, a COMMIT marker (partition 0) and an
    ABORT marker (partition 1), captured and compared with what the endpoint serves at the
    offsets after the store's last record (its trailing gap): the same control batch shape
    (transactional | control attributes, one record at offset delta 0 whose key is version 0 +
    type and value version 0 + coordinator epoch, baseSequence -1, no codec), a COMMIT always,
    at the high watermark - 1; producer id, epochs and timestamps are Kafka's own."""
    kafka, topic, url, ep, _ = tails
    ends = [hi for _, hi in _ends(kafka, topic)]
    with Store.open(url) as ro:
        lasts = [max(r.offset for r in ro.iter_records(topic, p)) for p in (0, 1)]
    for p, kind in ((0, 1), (1, 0)):
        theirs = _head(_raw_fetch(kafka, topic, p, ends[p] - 1))
        assert theirs["base"] == ends[p] - 1 and theirs["attributes"] == 0x30, theirs
        assert (theirs["last_offset_delta"], theirs["count"], theirs["base_sequence"],
                theirs["magic"]) == (0, 1, -1, 2)
        assert theirs["pid"] >= 0
        # the one record: length 16, attributes 0, timestamp delta 0, offset delta 0, key (4
        # bytes: version 0, type), value (6 bytes: version 0, coordinator epoch), no header
        rec = theirs["records"]
        assert rec[:5] == b"\x20\x00\x00\x00\x08" and rec[5:9] == bytes([0, 0, 0, kind])
        assert rec[9] == 0x0C and rec[10:12] == b"\0\0" and rec[16:] == b"\x00"
        for frm in range(lasts[p] + 1, ends[p]):  # every offset of the store's trailing gap
            ours = _head(_raw_fetch(ep.bootstrap, topic, p, frm))
            assert ours["base"] == ends[p] - 1
            for k in ("attributes", "last_offset_delta", "count", "base_sequence", "magic",
                      "length"):
                assert ours[k] == theirs[k], (k, ours, theirs)
            # a COMMIT (type 1) whatever Kafka's was, of a producer id no data carries
            assert ours["records"][:5] == rec[:5] and ours["records"][5:9] == b"\0\0\0\x01"
            assert ours["records"][9:12] == rec[9:12] and ours["records"][16:] == b"\x00"
            assert ours["pid"] == 2**63 - 1


def _walk(raw: bytes) -> list[tuple[int, int, int]]:
    """(base offset, last offset, attributes) of each whole batch of a records section."""
    import struct
    out, p = [], 0
    while p + 61 <= len(raw):
        base, length = struct.unpack_from(">qi", raw, p)
        if p + 12 + length > len(raw):
            break  # a partial batch at the end (Kafka cuts its answers by bytes)
        attrs, last_delta = struct.unpack_from(">hi", raw, p + 21)
        out.append((base, base + last_delta, attrs))
        p += 12 + length
    return out


def test_the_last_data_and_its_marker_come_in_one_answer_as_from_kafka(tails):
    """Kafka 3.9.1's Fetch at a partition's last committed record, the partition ending in
    transaction markers: the data, then the marker, in the same answer (a log ending in markers
    serves them with the data). The endpoint, at the store's last record of that partition:
    the batch holding it, then its end-of-log marker at the high watermark - 1, in one answer
    too (a client handing control records to the application, kafka-go, gets it with the
    data, as from Kafka)."""
    kafka, topic, url, ep, _ = tails
    ends = [hi for _, hi in _ends(kafka, topic)]
    with Store.open(url) as ro:
        lasts = [max(r.offset for r in ro.iter_records(topic, p)) for p in (0, 1)]
    for p in (0, 1):
        theirs = _walk(_raw_fetch(kafka, topic, p, lasts[p]))
        assert theirs[0][0] <= lasts[p] <= theirs[0][1], theirs
        assert theirs[-1][2] & 0x20 and theirs[-1][:2] == (ends[p] - 1, ends[p] - 1), theirs
        ours = _walk(_raw_fetch(ep.bootstrap, topic, p, lasts[p]))
        assert ours[0][0] <= lasts[p] <= ours[0][1] and not ours[0][2] & 0x20, ours
        assert [b[:2] for b in ours[1:]] == [(ends[p] - 1, ends[p] - 1)], ours
        assert ours[-1][2] == 0x30  # transactional | control, as Kafka's marker
        assert theirs[-1][2] == 0x30


def test_franz_go_commits_at_the_endpoint_what_it_commits_at_kafka(tails, franzgo):
    """A kgo group over partitions ending in markers (Kafka) and in the endpoint's marker (the
    store's trailing gaps): the same records, the same committed offsets (kgo commits the
    offset after the last record it returned, never past a control batch)."""
    kafka, topic, _url, ep, _ = tails
    ours = _franzgo(franzgo, "group", ep.bootstrap, topic, f"kgo-{uuid.uuid4().hex[:6]}")
    theirs = _franzgo(franzgo, "group", kafka, topic, f"kgo-{uuid.uuid4().hex[:6]}")
    assert ours == theirs and len(ours) > 20
