"""The Kafka endpoint (``kcompact serve --kafka-listen``, issue 40) against Apache Kafka 3.9.1.

One topic (2 partitions) is produced to the real Kafka: keyed updates, tombstones, keyless records,
headers, empty values, batches from a zstd and a gzip producer, one committed and one aborted
transaction (partition 1 ends with the committed transaction's marker: a trailing gap). It is
mirrored into a store (``mirror_local``, as ``kcompact mirror``), and the store is served by
``kcompact serve --store S --kafka-listen 127.0.0.1:0`` started as a process and stopped by the
test. Then unmodified clients read both and must agree:

* confluent-kafka with ``assign`` (read_committed and read_uncommitted: the store holds what
  read_committed sees), end offsets, ListOffsets by time, earliest, latest;
* Kafka's Java tools from the cached jars: ConsoleConsumer with ``--partition`` and with
  ``--group``, GetOffsetShell (-1, -2, -3), VerifiableConsumer;
* a Java loop shaped like Kafka Streams' GlobalKTable restore (``position < endOffsets``) on the
  partition ending in a gap, which must finish;
* after a forced compaction of the store: each partition ends in Kafka's last record (a tombstone
  past delete.retention.ms: compaction keeps a partition's last record); compacted as a kcompact
  before that rule did (the last records removed: a trailing gap), the endpoint serves exactly
  the compacted store's records (the live state: the latest value of every key, keyless records
  kept), and a restore loop still finishes.

And: consumer groups (two confluent-kafka members rebalancing, commits kept across a restart of
the endpoint), a refused produce leaving the store unchanged, SASL/PLAIN and TLS, and bad clients
(garbage, a 2 GiB size prefix, an unknown API key, idle connections) that never take the
endpoint down. More independent clients: Debian's kcat (``-L``, ``-C -p -o -e``, ``-Q``) and a
franz-go program (tests/integration/franzgo: kgo ``ConsumePartitions`` and a ``ConsumerGroup``,
kadm's start/end offsets and committed offsets), built into the cache directory; each skips
with the reason when kcat or Go is absent or the build fails.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kcompact.compaction import CompactionOptions, compact_store
from kcompact.compaction import assessment as assessment_mod
from kcompact.compaction import compactor as compactor_mod
from kcompact.connectors.apps.mirror import mirror_local
from kcompact.reput import ManualClock, Store

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import (Endpoint, java, raw_fetch, raw_fetch_frame, read_all,  # noqa: E402
                            restore, serving)
from topics import read_store  # noqa: E402

pytestmark = pytest.mark.integration

#: the records' timestamps start here (recent: an old CreateTime would let the topic's
#: retention delete them on the Kafka side during the run)
T0 = (int(time.time()) - 3600) * 1000


# -- the workload ------------------------------------------------------------------------------


def _produce(bootstrap: str, topic: str) -> None:
    base = {"bootstrap.servers": bootstrap, "linger.ms": 5}
    for codec, part in (("zstd", 0), ("gzip", 1), ("none", 0)):
        p = Producer({**base, "compression.type": codec})
        for i in range(60):
            key = None if i % 11 == 0 else b"k%02d" % (i % 17)
            value = None if i % 13 == 5 else b"" if i % 19 == 3 else b"%s-%d-" % (
                codec.encode(), i) + b"x" * (i % 40)
            if key is None and value is None:
                value = b"keyless"
            p.produce(topic, key=key, value=value, partition=part, timestamp=T0 + i * 10,
                      headers=[("h", b"%d" % i), ("empty", b"")] if i % 3 == 0 else None)
        assert p.flush(30) == 0
    for committed, part in ((False, 0), (True, 1)):
        tp = Producer({**base, "transactional.id": f"ep-{topic}-{committed}"})
        tp.init_transactions(30)
        tp.begin_transaction()
        for i in range(5):
            tp.produce(topic, key=b"tx%d" % i, value=b"committed" if committed else b"aborted",
                       partition=part, timestamp=T0 + 5000 + i)
        tp.flush(30)
        (tp.commit_transaction if committed else tp.abort_transaction)(30)
    # each partition ends with a tombstone, which a compaction keeps (a partition's last record
    # stays, as in Kafka's active segment) and a kcompact before that rule removed with
    # delete.retention.ms=0: such a store ends in a gap (its end offset does not move back)
    p = Producer(base)
    for part, key in ((0, b"k00"), (1, b"tx4")):
        p.produce(topic, key=key, value=None, partition=part, timestamp=T0 + 6000)
    assert p.flush(30) == 0


@pytest.fixture(scope="module")
def served(apache_kafka, tmp_path_factory):
    """(kafka bootstrap, topic, store url, running Endpoint, work dir)."""
    from confluent_kafka.admin import NewTopic
    topic = f"ep-{uuid.uuid4().hex[:8]}"
    apache_kafka.admin.create_topics([NewTopic(topic, 2, 1, config={"retention.ms": "-1"})]
                                     )[topic].result()
    _produce(apache_kafka.bootstrap, topic)
    work = tmp_path_factory.mktemp("endpoint")
    url = str(work / "store")
    mirror_local(apache_kafka.bootstrap, topic, url, out=io.StringIO(), handle_signals=False)
    with serving(apache_kafka, topic, url, work) as it:
        yield it


# -- records, end offsets, ListOffsets -----------------------------------------------------------


def test_confluent_assign_reads_what_kafka_serves(served):
    kafka, topic, _url, ep, _ = served
    ours = read_all(ep.bootstrap, topic)
    theirs = read_all(kafka, topic)
    assert ours == theirs
    assert sum(len(ours[p]) for p in (0, 1)) > 150
    assert ours[-1] == [ours[0][-1][0] + 1, ours[1][-1][0] + 1]
    # read_uncommitted: Kafka also shows the aborted records; the store holds committed data
    uncommitted = read_all(ep.bootstrap, topic, isolation="read_uncommitted")
    assert uncommitted == theirs
    assert any(r[3] == b"aborted" for r in read_all(kafka, topic,
                                                     isolation="read_uncommitted")[0])


def test_list_offsets_agree(served):
    kafka, topic, _url, ep, _ = served
    answers = []
    for bs in (kafka, ep.bootstrap):
        c = Consumer({"bootstrap.servers": bs, "group.id": "lo"})
        try:
            wm = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in (0, 1)]
            times = [T0 - 1, T0, T0 + 15, T0 + 300, T0 + 5002, T0 + 10 ** 9]
            by_time = [[r.offset for r in c.offsets_for_times(
                [TopicPartition(topic, p, t) for p in (0, 1)], timeout=10)] for t in times]
        finally:
            c.close()
        answers.append((wm, by_time))
    (kwm, kby), (owm, oby) = answers
    assert owm == kwm
    committed = read_all(kafka, topic)
    for t, k, o in zip(times, kby, oby):
        for p in (0, 1):
            # Kafka's time index also holds aborted records (a read_committed consumer that
            # seeks there steps over them); the store holds committed records only: ours is
            # the first committed record at or after Kafka's answer
            want = k[p] if k[p] < 0 else min(
                (r[0] for r in committed[p] if r[0] >= k[p]), default=-1)
            assert o[p] == want, (t, p, k[p], o[p])
    shell = [java("org.apache.kafka.tools.GetOffsetShell", "--bootstrap-server", bs,
                  "--topic", topic, "--time", t) for bs in (kafka, ep.bootstrap)
             for t in ("-1", "-2", "-3")]
    assert all(r.returncode == 0 for r in shell), [r.stderr[-500:] for r in shell]
    assert [r.stdout for r in shell[:2]] == [r.stdout for r in shell[3:5]]
    # -3 (max timestamp): Kafka's answer is a transaction marker here (a marker's timestamp
    # is when it was written, after every record's); the store holds no marker: ours is the
    # first record holding the largest record timestamp
    ours = read_all(ep.bootstrap, topic)
    want = "".join(f"{topic}:{p}:{max(ours[p], key=lambda r: (r[1], -r[0]))[0]}\n"
                   for p in (0, 1))
    assert shell[5].stdout == want


# -- Java clients ----------------------------------------------------------------------------------


def _console(bs: str, topic: str, *args: str) -> list[str]:
    r = java("org.apache.kafka.tools.consumer.ConsoleConsumer", "--bootstrap-server", bs,
             "--topic", topic, "--timeout-ms", "20000", "--property", "print.offset=true",
             "--property", "print.key=true", "--property", "print.headers=true",
             "--property", "print.timestamp=true", *args)
    assert "Processed a total of" in r.stderr, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_console_consumer_by_partition_and_by_group(served):
    kafka, topic, _url, ep, _ = served
    counts = {p: len(v) for p, v in read_all(ep.bootstrap, topic).items() if p >= 0}
    for p in (0, 1):
        args = ("--partition", str(p), "--offset", "earliest", "--max-messages",
                str(counts[p]), "--isolation-level", "read_committed")
        ours = _console(ep.bootstrap, topic, *args)
        assert len(ours) == counts[p] and ours == _console(kafka, topic, *args)
    args = ("--from-beginning", "--max-messages", str(sum(counts.values())))
    group = _console(ep.bootstrap, topic, "--group", f"cg-{uuid.uuid4().hex[:6]}", *args)
    want = _console(kafka, topic, "--group", f"cg-{uuid.uuid4().hex[:6]}", *args,
                    "--isolation-level", "read_committed")
    assert sorted(group) == sorted(want)


def test_verifiable_consumer_consumes_and_commits(served):
    _kafka, topic, _url, ep, _ = served
    total = sum(len(v) for k, v in read_all(ep.bootstrap, topic).items() if k >= 0)
    r = java("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", ep.bootstrap,
             "--topic", topic, "--group-id", f"vc-{uuid.uuid4().hex[:6]}", "--max-messages",
             str(total), "--reset-policy", "earliest", "--session-timeout", "10000",
             timeout=120)
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    consumed = sum(e["count"] for e in events if e["name"] == "records_consumed")
    commits = [e for e in events if e["name"] == "offsets_committed"]
    assert consumed == total, r.stderr[-2000:]
    assert commits and all(e["success"] for e in commits), commits


def test_global_ktable_restore_loop_matches_kafka(served):
    kafka, topic, _url, ep, work = served
    for p in (0, 1):
        assert restore(ep.bootstrap, topic, p, work) == restore(kafka, topic, p, work)


# -- compaction ------------------------------------------------------------------------------------


def _compact_twice(url: str, topic: str) -> None:
    """Forced compactions with delete.retention.ms=0: a tombstone is stamped by the pass that
    first cleans it and dropped by a pass delete.retention.ms later (as in Kafka): two passes,
    the clock moved between them."""
    with Store.open(url, writer="t") as st:
        st.set_topic_config(topic, {"cleanup.policy": "compact", "min.compaction.lag.ms": 0,
                                    "delete.retention.ms": 0})
        clock = ManualClock(int(time.time() * 1000))
        for _ in range(2):
            compact_store(st, topic=topic, force=True, options=CompactionOptions(),
                          clock=clock)
            clock.advance(5000)


@pytest.fixture(scope="module")
def compacted(served, tmp_path_factory):
    """A copy of the store compacted as a kcompact before the keep-the-last-record rule
    compacted it, so that each partition ends in a gap (its last record, a tombstone, removed;
    partition 1 also after a transaction's marker), and served: (kafka, topic, copy url,
    Endpoint, work dir). Such stores exist: the endpoint must end their gaps."""
    kafka, topic, url, _ep, _work = served
    work = tmp_path_factory.mktemp("compacted")
    copy = work / "compacted"
    shutil.copytree(url, copy)
    with pytest.MonkeyPatch.context() as mp:  # (the rule's one input: "no last record")
        for mod in (compactor_mod, assessment_mod):
            mp.setattr(mod, "tail_offset", lambda pl: -1)
        _compact_twice(str(copy), topic)
    ep = Endpoint(copy, log=work / "ep.log").start()
    try:
        yield kafka, topic, str(copy), ep, work
    finally:
        ep.stop()


def test_after_compaction_the_endpoint_serves_the_compacted_store(compacted):
    kafka, topic, copy, ep, work = compacted
    stored = read_store(copy, topic)
    ours = read_all(ep.bootstrap, topic)
    for p in (0, 1):
        assert ours[p] == stored[p]
    full = read_all(kafka, topic)
    # the live state: the latest value of every key, every keyless record
    for p in (0, 1):
        latest: dict = {}
        for off, _ts, k, v, _h in full[p]:
            if k is not None:
                latest[k] = (off, v)
        live = {k: ov for k, ov in latest.items() if ov[1] is not None}
        got = {r[2]: (r[0], r[3]) for r in ours[p] if r[2] is not None and r[3] is not None}
        assert got == live
        assert [r for r in ours[p] if r[2] is None] == [r for r in full[p] if r[2] is None]
    # the end offsets do not move back: each partition now ends in a gap (its last
    # record, a tombstone, was removed), which the endpoint ends with a marker
    assert ours[-1] == full[-1]
    assert all(ours[p][-1][0] + 1 < ours[-1][p] for p in (0, 1)), (
        [ours[p][-3:] for p in (0, 1)], ours[-1])
    for p in (0, 1):  # the GlobalKTable restore loop reaches the end offset
        _, n, position, end = restore(ep.bootstrap, topic, p, work)
        assert int(n) == len(ours[p]) and position == end == str(full[-1][p])


def test_compaction_keeps_each_partitions_last_record_as_kafka_does(served, tmp_path):
    """Compacted now, each partition ends in Kafka's last record, its tombstone past
    delete.retention.ms: the same end, read through the endpoint, as from Kafka (no gap)."""
    kafka, topic, url, _ep, _ = served
    copy = tmp_path / "compacted-now"
    shutil.copytree(url, copy)
    _compact_twice(str(copy), topic)
    full = read_all(kafka, topic)
    ep = Endpoint(copy, log=tmp_path / "ep.log").start()
    try:
        ours = read_all(ep.bootstrap, topic)
    finally:
        ep.stop()
    assert ours[-1] == full[-1]
    for p in (0, 1):
        assert ours[p][-1] == full[p][-1] and full[p][-1][0] == full[-1][p] - 1
        assert full[p][-1][3] is None  # (the workload ends each partition with a tombstone)
        # every other tombstone past delete.retention.ms went
        assert [r[0] for r in ours[p] if r[2] is not None and r[3] is None] == [full[p][-1][0]]


def _fetches(bs: str, topic: str, group: str, idle_s: float) -> tuple[list, list, int]:
    """A confluent-kafka group member reads ``topic`` to its end (both partitions' EOF),
    commits, then idles ``idle_s`` at the end: (records (partition, offset), committed offsets,
    Fetch requests it sent while idle, from librdkafka's statistics)."""
    stats: list = []
    c = Consumer({"bootstrap.servers": bs, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": "read_committed", "statistics.interval.ms": 200,
                  "stats_cb": lambda j: stats.append(json.loads(j))})

    def sent() -> int:
        # Fetch requests sent to the partition leader so far (the broker entries' "req")
        return sum(b.get("req", {}).get("Fetch", 0) for b in stats[-1]["brokers"].values()
                   if b.get("nodeid", -1) >= 0) if stats else 0
    try:
        c.subscribe([topic])
        got, eof = [], set()
        deadline = time.monotonic() + 60
        while len(eof) < 2:
            assert time.monotonic() < deadline, ("no end of partition", eof, len(got))
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                assert m.error().code() == KafkaError._PARTITION_EOF, m.error()
                eof.add(m.partition())
                continue
            got.append((m.partition(), m.offset()))
        c.commit(asynchronous=False)
        committed = [tp.offset for tp in c.committed(
            [TopicPartition(topic, p) for p in (0, 1)], timeout=10)]
        n = len(stats)
        while len(stats) < n + 2:  # a fresh statistics count to start from
            assert c.poll(0.1) is None
        before = sent()
        end = time.monotonic() + idle_s
        while time.monotonic() < end:
            assert c.poll(0.1) is None  # nothing more: not a record read twice
        n = len(stats)
        while len(stats) < n + 2:
            assert c.poll(0.1) is None
        return got, committed, sent() - before
    finally:
        c.close()


def test_a_group_reads_the_compacted_copy_once_commits_its_end_and_idles(compacted):
    """Every record once, the committed offsets = the high watermarks (past the gaps the
    markers end), and at the end a consumer fetches no more often than it does from Apache
    Kafka at the end of the same topic (long polls: at most twice as many, plus a couple)."""
    kafka, topic, copy, ep, _ = compacted
    stored = read_store(copy, topic)
    ends = read_all(ep.bootstrap, topic)[-1]
    got, committed, idle = _fetches(ep.bootstrap, topic, f"g-{uuid.uuid4().hex[:6]}", 3.0)
    assert sorted(got) == sorted((p, r[0]) for p in (0, 1) for r in stored[p])
    assert committed == ends
    _, theirs, kafka_idle = _fetches(kafka, topic, f"g-{uuid.uuid4().hex[:6]}", 3.0)
    assert theirs == ends
    assert idle <= 2 * kafka_idle + 2, (idle, kafka_idle)


def test_kcat_and_franz_go_read_the_compacted_copy_to_its_end(compacted, franzgo):
    kafka, topic, copy, ep, _ = compacted
    stored = read_store(copy, topic)
    ends = read_all(ep.bootstrap, topic)[-1]
    want = sorted((p, r[0]) for p in (0, 1) for r in stored[p])
    recs = _franzgo(franzgo, "partitions", ep.bootstrap, topic, "2")
    assert sorted((r["p"], r["o"]) for r in recs[:-1]) == want
    assert recs[-1]["end"] == {"0": ends[0], "1": ends[1]}, recs[-1]
    grp = _franzgo(franzgo, "group", ep.bootstrap, topic, f"kgo-{uuid.uuid4().hex[:6]}")
    assert sorted((r["p"], r["o"]) for r in grp[:-1]) == want
    # kgo commits the offset after the last record it returned, never past a control batch:
    # what it commits at a Kafka partition ending in markers too (test_kafka_endpoint_tails)
    assert grp[-1]["committed"] == {str(p): stored[p][-1][0] + 1 for p in (0, 1)}, grp[-1]
    if shutil.which("kcat") or shutil.which("kafkacat"):
        for part in (0, 1):
            out = _kcat_run("-b", ep.bootstrap, "-C", "-t", topic, "-p", str(part), "-o",
                            "beginning", "-e", "-q", "-f", "%o\\n")
            assert [int(x) for x in out.split()] == [r[0] for r in stored[part]]


def test_a_fetch_below_v10_of_a_zstd_topic_fails_as_from_kafka(served, apache_kafka, tmp_path):
    """KIP-110 as Kafka applies it, by the topic's compression.type. A source topic configured
    zstd, mirrored (the mirror syncs its compression.type: the store's batches are zstd), read
    with Fetch v4 and v9: UNSUPPORTED_COMPRESSION_TYPE from Kafka and from the endpoint; v10
    and v12: records from both. The module's topic (compression.type producer; zstd, gzip and
    uncompressed producers; stored uncompressed: the source's codec unknown) gets records to a
    Fetch v4 from both (Kafka serves a producer topic's zstd batches to it)."""
    from confluent_kafka.admin import NewTopic
    kafka, topic, url, _ep, _ = served
    zt = f"zstd-{uuid.uuid4().hex[:6]}"
    apache_kafka.admin.create_topics([NewTopic(zt, 1, 1, config={
        "compression.type": "zstd", "retention.ms": "-1"})])[zt].result()
    p = Producer({"bootstrap.servers": kafka, "linger.ms": 5})
    for i in range(50):
        p.produce(zt, key=b"k%d" % i, value=b"value %d " % i * 10, partition=0,
                  timestamp=T0 + i)
    assert p.flush(30) == 0
    copy = str(tmp_path / "zstd-store")
    mirror_local(kafka, zt, copy, out=io.StringIO(), handle_signals=False)
    with Store.open(copy, writer="t") as st:
        assert st.topic_config(zt).compression_type == "zstd"  # synced from the source
        compact_store(st, topic=zt, force=True, options=CompactionOptions())
        assert {d["codec"] for d in _segments(st, zt, 0)} == {"zstd"}
    with Store.open(url) as st:
        assert st.topic_config(topic).compression_type == "producer"
        codecs = {d["codec"] for p in (0, 1) for d in _segments(st, topic, p)}
        assert codecs and codecs <= {"none", "uncompressed"}, codecs  # (format 1: "none")
    ep = Endpoint(copy, log=tmp_path / "ep.log").start()
    try:
        for version, want in ((4, 76), (9, 76), (10, 0), (12, 0)):  # 76: UNSUPPORTED_COMPRESSION_TYPE
            got = [raw_fetch(bs, zt, 0, 0, version) for bs in (kafka, ep.bootstrap)]
            assert [g[0] for g in got] == [want, want], (version, [g[0] for g in got])
            assert bool(got[0][1]) == bool(got[1][1]) == (want == 0)
        # the refusal byte for byte as Kafka's (offsets -1, records null: sarama 2.0.0 cannot
        # decode null records and says so, from both)
        for version in (4, 7, 9):
            frames = [raw_fetch_frame(bs, zt, 0, 0, version) for bs in (kafka, ep.bootstrap)]
            assert frames[1] == frames[0], (version, frames)
    finally:
        ep.stop()
        apache_kafka.admin.delete_topics([zt], operation_timeout=30)
    ep = Endpoint(url, log=tmp_path / "ep2.log").start()
    try:
        for part in (0, 1):
            got = [raw_fetch(bs, topic, part, 0, 4) for bs in (kafka, ep.bootstrap)]
            assert [g[0] for g in got] == [0, 0] and got[0][1] and got[1][1], part
    finally:
        ep.stop()


def _segments(st: Store, topic: str, p: int) -> list[dict]:
    pl = st.partition(topic, p)
    return [s.describe() for s in pl.segments if s.log_size]


# -- groups ------------------------------------------------------------------------------------------


def _member(bs: str, group: str, name: str) -> Consumer:
    return Consumer({"bootstrap.servers": bs, "group.id": group, "client.id": name,
                     "auto.offset.reset": "earliest", "enable.auto.commit": False,
                     "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})


def test_group_rebalances_and_keeps_commits_across_a_restart(served, tmp_path):
    _kafka, topic, url, ep, _ = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    a = _member(ep.bootstrap, group, "a")
    a.subscribe([topic])
    got, deadline = 0, time.monotonic() + 30
    while got < 40 and time.monotonic() < deadline:
        m = a.poll(0.5)
        got += m is not None and m.error() is None
    assert {tp.partition for tp in a.assignment()} == {0, 1}
    a.commit(asynchronous=False)
    committed = {tp.partition: tp.offset for tp in a.committed(
        [TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)}
    assert any(o >= 0 for o in committed.values())
    b = _member(ep.bootstrap, group, "b")
    b.subscribe([topic])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        a.poll(0.1)
        b.poll(0.1)
        if len(a.assignment()) == 1 and len(b.assignment()) == 1:
            break
    assert {tp.partition for tp in a.assignment() + b.assignment()} == {0, 1}
    b.close()
    a.close()
    ep.stop()
    ep.start()  # the same store, a new process: the commits are read back from the store
    c = _member(ep.bootstrap, group, "c")
    try:
        again = {tp.partition: tp.offset for tp in c.committed(
            [TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)}
    finally:
        c.close()
    assert again == committed


# -- refused produce, security, bad clients ----------------------------------------------------


def test_produce_is_refused_and_the_store_is_unchanged(served):
    _kafka, topic, url, ep, _ = served
    before = read_store(url, topic)
    errors = []
    p = Producer({"bootstrap.servers": ep.bootstrap, "message.timeout.ms": 10000,
                  "retries": 0})
    p.produce(topic, key=b"k", value=b"v", partition=0,
              on_delivery=lambda err, _m: errors.append(err))
    p.flush(15)
    assert len(errors) == 1 and errors[0] is not None
    assert errors[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, errors[0]
    assert read_store(url, topic) == before


def test_a_producer_is_refused_and_says_why(served, tmp_path):
    """What docs/kafka-endpoint.md lists: an idempotent librdkafka producer is refused at
    InitProducerId (fatal CLUSTER_AUTHORIZATION_FAILED), a transactional one at its
    coordinator with the read-only message, and the Java producer (VerifiableProducer, its
    defaults and idempotence explicitly on) prints an authorization error (its default send
    reaches Produce: TopicAuthorizationException); the store is unchanged."""
    _kafka, topic, url, ep, _ = served
    before = read_store(url, topic)
    p = Producer({"bootstrap.servers": ep.bootstrap, "message.timeout.ms": 10000,
                  "enable.idempotence": True})
    p.produce(topic, key=b"k", value=b"v", partition=0)
    with pytest.raises(KafkaException) as got:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            p.poll(0.2)
    err = got.value.args[0]
    assert err.fatal() and err.code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED, err
    tp = Producer({"bootstrap.servers": ep.bootstrap, "transactional.id": "refused"})
    with pytest.raises(KafkaException) as got:
        tp.init_transactions(15)
    err = got.value.args[0]
    assert err.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, err
    assert "read-only" in err.str()
    for conf, want in (("retries=0\n", "TopicAuthorizationException"),
                       ("enable.idempotence=true\nretries=3\n", "ClusterAuthorizationException")):
        props = tmp_path / "producer.properties"
        props.write_text(conf)
        r = java("org.apache.kafka.tools.VerifiableProducer", "--bootstrap-server",
                 ep.bootstrap, "--topic", topic, "--max-messages", "1", "--producer.config",
                 str(props))
        if want == "TopicAuthorizationException":
            events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
            failed = [e for e in events if e["name"] == "producer_send_error"]
            assert len(failed) == 1 and failed[0]["exception"].endswith(want), (
                r.stdout, r.stderr[-2000:])
            # (the Java client names the topic, not the message: "Not authorized to access
            # topics: [t]")
            assert topic in failed[0]["message"], failed
        else:  # (a send error event, or the fatal error thrown out of send)
            assert want in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])
    assert read_store(url, topic) == before


def _tls_files(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_sasl_plain_and_tls(served, tmp_path):
    _kafka, topic, url, _ep, _ = served
    token = "t0k3n-" + uuid.uuid4().hex
    (tmp_path / "token").write_text(token + "\n")
    cert, key = _tls_files(tmp_path)
    want = read_all(_ep.bootstrap, topic)
    ep = Endpoint(url, "--kafka-token-file", str(tmp_path / "token"), "--tls-cert", str(cert),
                  "--tls-key", str(key), log=tmp_path / "ep.log").start()
    try:
        ok = {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN",
              "sasl.username": "anyone", "sasl.password": token, "ssl.ca.location": str(cert)}
        assert read_all(ep.bootstrap, topic, extra=ok) == want
        for bad in ({**ok, "sasl.password": "wrong-" + token}, {
                "security.protocol": "SSL", "ssl.ca.location": str(cert)}):
            c = Consumer({"bootstrap.servers": ep.bootstrap, "group.id": "x", **bad})
            try:
                with pytest.raises(Exception):
                    c.list_topics(timeout=5)
            finally:
                c.close()
        assert ep.alive()
    finally:
        ep.stop()
    log = (tmp_path / "ep.log").read_text()
    assert "authentication failed" in log or "before SASL authentication" in log


def _frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def test_bad_clients_never_take_the_endpoint_down(served):
    _kafka, topic, _url, ep, work = served
    want = read_all(ep.bootstrap, topic)
    idle = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(20)]
    sends = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",            # garbage: 1.19 GB size prefix
             struct.pack(">i", 2 ** 31 - 1) + b"x" * 100,      # a 2 GiB size prefix
             _frame(struct.pack(">hhih", 9999, 0, 1, -1)),      # an unknown API key
             _frame(struct.pack(">hhih", 1, 99, 2, -1)),        # Fetch v99
             _frame(struct.pack(">hhih", 3, 12, 3, 1) + b"x"),  # a truncated Metadata v12
             _frame(b"\x00\x12\x00\x04\x00\x00\x00\x07\xff\xff\x00\x00"),  # ApiVersions v4
             ]
    answers = []
    for data in sends:
        s = socket.create_connection(("127.0.0.1", ep.port))
        s.settimeout(10)
        s.sendall(data)
        got = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if data.startswith(b"\x00\x00\x00\x0c\x00\x12") and len(got) >= 4 and \
                        len(got) >= 4 + struct.unpack(">i", got[:4])[0]:
                    break
        except socket.timeout:
            pass
        answers.append(got)
        s.close()
    # ApiVersions v4: UNSUPPORTED_VERSION (35) with a v0 body listing the versions served
    assert answers[-1][4:8] == b"\x00\x00\x00\x07" and answers[-1][8:10] == b"\x00\x23"
    assert all(a == b"" for a in answers[:-1])  # each closed with a logged reason
    assert ep.alive()
    assert read_all(ep.bootstrap, topic) == want
    for s in idle:
        s.close()
    log = ep.log.read_text()
    assert "request size of" in log and "not served" in log


def test_limits_and_metrics_of_the_command_line(served, tmp_path):
    """``--kafka-idle-timeout``, ``--max-connections`` and ``--metrics`` as an operator gives
    them: a silent connection closed after the idle timeout, one over the limit closed at once,
    each logged; the metrics (scraped and parsed with prometheus_client) count requests by
    API, the errors inside answers by API and error name, and closed connections by reason."""
    import re
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    _kafka, topic, url, _ep, _ = served
    ep = Endpoint(url, "--kafka-idle-timeout", "1", "--max-connections", "3", "--metrics",
                  "127.0.0.1:0", log=tmp_path / "ep.log").start()
    try:
        silent = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(3)]
        time.sleep(0.3)
        over = socket.create_connection(("127.0.0.1", ep.port))
        over.settimeout(10)
        assert over.recv(10) == b""            # over the limit: closed at once
        for s in silent:                       # silent for 1 s: closed
            s.settimeout(10)
            assert s.recv(10) == b""
            s.close()
        over.close()
        want = read_all(ep.bootstrap, topic)
        assert want[-1] and all(want[p] for p in (0, 1))
        c = Consumer({"bootstrap.servers": ep.bootstrap, "group.id": "oor",
                      "auto.offset.reset": "earliest", "enable.partition.eof": True})
        c.assign([TopicPartition(topic, 0, 10 ** 9)])  # out of range: reset to the start
        try:
            deadline, m = time.monotonic() + 30, None
            while time.monotonic() < deadline and (m is None or m.error() is not None):
                m = c.poll(0.5)
            assert m is not None and m.error() is None and m.offset() < 10 ** 9
            assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1] > 0
        finally:
            c.close()
        murl = re.search(r"metrics on (http://\S+/metrics)", ep.log.read_text()).group(1)
        body = urllib.request.urlopen(murl, timeout=10).read().decode()
    finally:
        ep.stop()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert samples[("kcompact_kafka_requests_total", (("api", "Fetch"),))] > 0
    assert samples[("kcompact_kafka_requests_total", (("api", "ListOffsets"),))] > 0
    assert samples[("kcompact_kafka_error_responses_total",
                    (("api", "Fetch"), ("error", "OFFSET_OUT_OF_RANGE")))] >= 1
    assert samples[("kcompact_kafka_connections_closed_total", (("reason", "idle"),))] >= 3
    assert samples[("kcompact_kafka_connections_closed_total", (("reason", "too_many"),))] >= 1
    assert samples[("kcompact_kafka_response_bytes_total", ())] > 0
    log = ep.log.read_text()
    assert "no request within 1s of connecting" in log and "connections are open" in log


# -- more independent clients: kcat (librdkafka 2.0 in Debian's build) and franz-go ---------------


def _kcat() -> str:
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        pytest.skip("kcat is not installed (Debian: apt-get install kcat; `make kcat`)")
    return kcat


def _kcat_run(*args: str) -> str:
    r = subprocess.run([_kcat(), *args], capture_output=True, timeout=60)
    assert r.returncode == 0, (args, r.stderr.decode()[-2000:])
    return r.stdout.decode()


def test_kcat_lists_consumes_and_queries_as_from_kafka(served):
    kafka, topic, _url, ep, _ = served
    # -L: the topic, its partitions (leaders, replicas and in-sync replicas are the one
    # broker of each: Kafka's node 1, the endpoint's node 0)
    listed = []
    for bs in (kafka, ep.bootstrap):
        meta = json.loads(_kcat_run("-b", bs, "-L", "-J", "-t", topic))
        (t,) = meta["topics"]
        one = meta["brokers"][0]["id"]
        assert len(meta["brokers"]) == 1
        assert all(p["leader"] == one and [r["id"] for r in p["replicas"]] == [one]
                   and [r["id"] for r in p["isrs"]] == [one] for p in t["partitions"])
        listed.append((t["topic"], [p["partition"] for p in t["partitions"]]))
    assert listed[0] == listed[1] == (topic, [0, 1])
    # -C -p -o -e: from the beginning, from inside, from the end's neighbourhood, to the end
    fmt = "%p %o %T %k|%s|%h\\n"
    for part in (0, 1):
        for start in ("beginning", "7", "-5"):
            out = [_kcat_run("-b", bs, "-C", "-t", topic, "-p", str(part), "-o", start, "-e",
                             "-q", "-Z", "-X", "isolation.level=read_committed", "-f", fmt)
                   for bs in (kafka, ep.bootstrap)]
            assert out[0] == out[1] and out[0], (part, start)
    # -Q: offsets by timestamp (Kafka's time index also holds aborted records: ours is the
    # first committed record at or after Kafka's answer, as test_list_offsets_agree says)
    committed = read_all(kafka, topic)
    for ts in (T0 - 1, T0, T0 + 15, T0 + 300):
        query = [a for p in (0, 1) for a in ("-t", f"{topic}:{p}:{ts}")]
        got = [dict(_query_lines(_kcat_run("-b", bs, "-Q", *query)))
               for bs in (kafka, ep.bootstrap)]
        for p in (0, 1):
            k = got[0][p]
            want = k if k < 0 else min((r[0] for r in committed[p] if r[0] >= k), default=-1)
            assert got[1][p] == want, (ts, p, got)


def _query_lines(text: str):
    """kcat -Q's lines (``topic [p] offset N``) as (p, N)."""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "offset":
            yield int(words[1].strip("[]")), int(words[3])


FRANZGO = Path(__file__).parent / "franzgo"


@pytest.fixture(scope="module")
def franzgo() -> str:
    """tests/integration/franzgo (franz-go's kgo and kadm) built into the cache directory once
    per source version; skipped with the reason when Go is absent or the build fails (offline
    without the modules cached)."""
    import hashlib
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: the franz-go client test needs it")
    digest = hashlib.sha256(b"".join((FRANZGO / n).read_bytes()
                                     for n in ("go.mod", "go.sum", "main.go"))).hexdigest()[:16]
    cache = Path(os.environ.get("KCOMPACT_CACHE_DIR") or Path.home() / ".cache" / "kcompact")
    exe = cache / "franzgo" / digest / "franzgo"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([go, "build", "-o", str(exe), "."], cwd=FRANZGO, capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            pytest.skip(f"the franz-go client did not build (offline?): {r.stderr[-500:]}")
    return str(exe)


def _franzgo(exe: str, *args: str) -> list[dict]:
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(x) for x in r.stdout.splitlines()]


def test_franz_go_reads_as_from_kafka(served, franzgo):
    kafka, topic, _url, ep, _ = served
    ours = _franzgo(franzgo, "partitions", ep.bootstrap, topic, "2")
    theirs = _franzgo(franzgo, "partitions", kafka, topic, "2")
    assert ours == theirs
    assert len(ours) > 150 and set(ours[-1]) == {"start", "end"}
    # a consumer group: every record once, and the commit kept by the endpoint's coordinator
    ours = _franzgo(franzgo, "group", ep.bootstrap, topic, f"kgo-{uuid.uuid4().hex[:6]}")
    theirs = _franzgo(franzgo, "group", kafka, topic, f"kgo-{uuid.uuid4().hex[:6]}")
    assert ours == theirs
    assert len(ours) > 150 and set(ours[-1]) == {"committed"}
