"""The store source (restore) without a broker: Kafka's murmur2 partitioner against the Java
client's test vectors, progress records (encoding, the store's progress topic), and the task's
plan and chunks against a dict model of the store. No processes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.plugins.store_source.kernels import murmur2_many, murmur2_partitions
from kcompact.connectors.framework.api import SourceRecord, SourceTaskContext, source_partition_key
from kcompact.connectors.cli import build_parser
from kcompact.connectors.errors import ConfigError, ConnectorsError
from kcompact.connectors.plugins.store_source import StoreSourceConnector, StoreSourceTask
from kcompact.connectors.plugins.store_source.errors import ProgressFormatError
from kcompact.connectors.plugins.store_source.kafka import kafka_failure
from kcompact.connectors.plugins.store_source.kernels import default_partition, murmur2
from kcompact.connectors.plugins.store_source.progress import (PROGRESS_FORMAT_VERSION,
                                                               PROGRESS_TOPIC, Progress, RestoreJob,
                                                               StoreProgress, decode_progress,
                                                               encode_progress, newest)
from kcompact.connectors.plugins.store_source.task import INCLUDE_TOMBSTONES, TARGET_PARTITIONS
from kcompact.connectors.apps.restore import connector_props
from kcompact.connectors.framework.worker import validate_connector
from kcompact.reput import Store
from kcompact.reput.filenames import validate_writer
from kcompact.reput.record import RecordBatch, validate_topic

# -- murmur2 ---------------------------------------------------------------------------------------

# Kafka's clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java (testMurmur2), and the
# lengths 1-5 (every tail case) as pinned against the Java client by Akka's Murmur2Spec.
JAVA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    bytes([ord("a"), ord("b"), ord("c")]): 479470107,
    b"1": -1993445489,
    b"12": 126087238,
    b"123": -267702483,
    b"1234": -1614185708,
    b"12345": -1188365604,
}


def _kernel_hashes(keys: list[bytes]) -> list[int]:
    buf = np.frombuffer(b"".join(keys) or b"\0", np.uint8)
    lens = np.array([len(k) for k in keys], np.int64)
    starts = np.zeros(len(keys), np.int64)
    if len(keys) > 1:
        np.cumsum(lens[:-1], out=starts[1:])
    out = np.empty(len(keys), np.uint64)
    murmur2_many(buf, starts, lens, out)
    return [int(h) - (1 << 32) if int(h) >= 1 << 31 else int(h) for h in out]


@pytest.mark.parametrize("key,expected", list(JAVA_VECTORS.items()))
def test_murmur2_matches_the_java_client(key, expected):
    assert murmur2(key) == expected
    assert _kernel_hashes([key]) == [expected]


def test_default_partition_is_to_positive_modulo():
    # Utils.toPositive(murmur2(key)) % numPartitions, with toPositive = h & 0x7fffffff
    for key, h in JAVA_VECTORS.items():
        for n in (1, 3, 4, 7, 100):
            assert default_partition(key, n) == (h & 0x7FFFFFFF) % n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=30))
def test_murmur2_kernel_matches_the_reference(keys):
    assert _kernel_hashes(keys) == [murmur2(k) for k in keys]


def test_murmur2_partitions_keyless_round_robin():
    keys = [b"a", b"", b"bb", b"", b"ccc", b""]
    keyless = np.array([False, True, False, True, False, True])
    buf = np.frombuffer(b"".join(keys), np.uint8)
    lens = np.array([len(k) for k in keys], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    out = np.empty(len(keys), np.int64)
    nxt = murmur2_partitions(buf, starts, lens, keyless, 4, 2, out)
    assert nxt == 5
    assert out[[1, 3, 5]].tolist() == [2, 3, 0]
    assert [int(out[i]) for i in (0, 2, 4)] == [default_partition(keys[i], 4) for i in (0, 2, 4)]


# -- progress records ----------------------------------------------------------------------------


JOB = RestoreJob("store-1", "orders", "cluster-a", "orders-restored")


def test_job_ids_are_valid_and_stable():
    assert JOB.key == "orders->cluster-a/orders-restored"
    validate_writer(JOB.writer)
    assert JOB.transactional_id == RestoreJob("store-1", "orders", "cluster-a",
                                              "orders-restored").transactional_id
    others = {RestoreJob("store-2", "orders", "cluster-a", "orders-restored").token,
              RestoreJob("store-1", "orders", "cluster-b", "orders-restored").token,
              RestoreJob("store-1", "orders", "cluster-a", "other").token}
    assert JOB.token not in others and len(others) == 3
    validate_topic(PROGRESS_TOPIC)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 10_000), st.integers(0, 2**62), max_size=20),
       st.integers(0, 2**40), st.booleans(), st.sampled_from(["latest", "all"]))
def test_progress_round_trip(positions, produced, done, mode):
    p = Progress.start(JOB, mode).advance(positions, produced, done, transactional=True)
    q = decode_progress(encode_progress(p), where="test")
    assert q == p
    assert q.seq == 1 and q.positions == positions and q.version == PROGRESS_FORMAT_VERSION


def test_progress_encoding_is_the_documented_json():
    p = Progress.start(JOB, "latest").advance({0: 10, 2: 5}, 12, False, transactional=True)
    doc = json.loads(encode_progress(p))
    assert doc["positions"] == {"0": 10, "2": 5}
    assert doc["job"] == JOB.key and doc["seq"] == 1 and doc["produced"] == 12
    assert set(doc) == {"version", "job", "store_id", "store_topic", "cluster_id",
                        "target_topic", "mode", "seq", "positions", "produced", "done",
                        "transactional", "updated_ms", "run_seq", "as_of_ms", "mapped"}
    assert doc["version"] == 2 and doc["run_seq"] == 0 and doc["as_of_ms"] is None
    assert doc["mapped"] is True


@pytest.mark.parametrize("raw,message", [
    (b"not json", "unreadable progress record"),
    (b"[1, 2]", "unreadable progress record"),
    (json.dumps({"version": 99}).encode(), "newer than this kcompact"),
    (None, "tombstone"),
])
def test_progress_decode_errors(raw, message):
    with pytest.raises(ProgressFormatError, match=message):
        decode_progress(raw, where="here")


@pytest.mark.parametrize("change", [
    {"positions": {"0": -1}}, {"positions": {"x": 1}}, {"mode": "sometimes"}, {"seq": -3},
    {"positions": None},
])
def test_progress_decode_rejects_bad_fields(change):
    doc = json.loads(encode_progress(Progress.start(JOB, "all").advance({0: 1}, 1, False, False)))
    doc.update(change)
    with pytest.raises(ProgressFormatError, match="invalid field"):
        decode_progress(json.dumps(doc).encode(), where="here")


def test_newest_takes_the_highest_sequence():
    a = Progress.start(JOB, "latest").advance({0: 1}, 1, False, True)
    b = a.advance({0: 2}, 1, False, True)
    assert newest(a, b) is b and newest(b, a) is b and newest(None, a) is a
    assert newest(None, None) is None
    same = Progress(**{**a.__dict__})
    assert newest(a, same) is a  # a tie keeps the first (the store's)


def test_store_progress_round_trip(tmp_path):
    url = str(tmp_path / "store")
    Store.create(url).close()
    sp = StoreProgress(url, JOB)
    assert sp.read() is None
    other = StoreProgress(url, RestoreJob("store-1", "payments", "cluster-a", "p2"))
    p = Progress.start(JOB, "latest")
    for i in range(5):
        p = p.advance({0: i * 10, 1: i}, 10, i == 4, transactional=False)
        sp.write(p)
        other.write(Progress.start(other.job, "all").advance({0: 99}, 1, False, False))
    got = StoreProgress(url, JOB).read()
    assert got == p and got.done and got.seq == 5
    assert other.read().positions == {0: 99}
    sp.close()
    other.close()
    # the records went through the store's normal write path: a compacted topic like any other
    with Store.open(url) as st:
        assert PROGRESS_TOPIC in st.topics()
        recs = list(st.iter_records(PROGRESS_TOPIC, 0))
        assert len(recs) == 10 and [r.offset for r in recs] == list(range(10))
        assert recs[-2].key == JOB.key.encode()


# -- Kafka errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code,needle", [
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, "DESCRIBE, CREATE and WRITE on topic t"),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, "CREATE on the cluster"),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "transactional id"),
    (KafkaError.SASL_AUTHENTICATION_FAILED, "valid credentials"),
])
def test_authorization_failures_are_one_clear_line(code, needle):
    e = kafka_failure("create topic 't'", KafkaException(KafkaError(code)), "b:9092", topic="t")
    msg = str(e)
    assert msg.startswith("not authorized to create topic 't' on b:9092") and needle in msg
    assert "\n" not in msg


def test_unreachable_broker_is_one_clear_line():
    e = kafka_failure("read the cluster metadata", KafkaException(KafkaError(
        KafkaError._TRANSPORT)), "127.0.0.1:1", timeout=10)
    assert str(e).startswith("cannot reach Kafka at 127.0.0.1:1 within 10 s")


# -- the task: plan and chunks against a model -----------------------------------------------------


def _make_store(url: str, n: int, partitions: int, seed: int = 1, keys: int = 40
                ) -> dict[int, list[tuple]]:
    """Random records (keys from a small set, tombstones, keyless, empty values, headers);
    returns the model: partition -> [(offset, ts, key, value, headers)]."""
    rng = random.Random(seed)
    model: dict[int, list[tuple]] = {p: [] for p in range(partitions)}
    with Store.open(url, writer="w", create=True) as st:
        for p in range(partitions):
            rows = []
            off = 0
            for i in range(n):
                off += rng.choice((1, 1, 2))  # gaps, as transaction markers leave
                key = None if rng.random() < 0.05 else b"k%d" % rng.randrange(keys)
                value = (None if rng.random() < 0.1 else
                         b"" if rng.random() < 0.05 else b"v%d-%d" % (p, i))
                headers = (("h", b"1"), ("n", None)) if rng.random() < 0.2 else ()
                rows.append((p, off, 1_700_000_000_000 + off, key, value, headers))
                model[p].append((off, 1_700_000_000_000 + off, key, value, headers))
            st.append(RecordBatch.from_records("orders", rows))
    return model


def _latest(rows, from_offset=0, tombstones=False):
    last = {}
    for r in rows:
        if r[2] is not None:
            last[r[2]] = r
    out = [r for r in last.values() if r[0] >= from_offset and (tombstones or r[3] is not None)]
    return sorted(out)


def _run_task(url, *, mode="latest", positions=None, chunk=7, **extra):
    task = StoreSourceTask()
    offsets = {source_partition_key({"partition": p}): {"position": n}
               for p, n in (positions or {}).items()}
    task.initialize(SourceTaskContext(offsets))
    task.start({"store.url": url, "store.topic": "orders", "mode": mode,
                "restore.chunk.records": chunk, **extra})
    got: dict[int, list[tuple]] = {}
    chunks = []
    while (c := task.poll()) is not None:
        chunks.append(c)
        assert len(list(c)) == len(c) == sum(len(b) for b in c.blocks)
        for r in c:
            assert isinstance(r, SourceRecord)
            got.setdefault(r.source_partition["partition"], []).append(
                (r.source_offset["position"] - 1, r.timestamp, r.key, r.value, r.headers,
                 r.partition))
    task.stop()
    return task, got, chunks


def test_latest_mode_is_the_latest_value_per_key(tmp_path):
    url = str(tmp_path / "s")
    model = _make_store(url, 300, 3)
    task, got, chunks = _run_task(url)
    for p in range(3):
        assert [g[:5] for g in got[p]] == _latest(model[p])
        assert all(g[5] == p for g in got[p])  # same partition number
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert all(len(c) <= 7 + 2 for c in chunks)  # 7 spread over the partitions, rounded up
    # positions never go back, and end at each partition's next offset
    for a, b in zip(chunks, chunks[1:]):
        assert all(b.positions[p] >= a.positions[p] for p in a.positions)
    assert chunks[-1].positions == {p: model[p][-1][0] + 1 for p in range(3)}


def test_all_mode_is_every_record(tmp_path):
    url = str(tmp_path / "s")
    model = _make_store(url, 200, 2, seed=2)
    _, got, _ = _run_task(url, mode="all", chunk=50)
    assert {p: [g[:5] for g in rows] for p, rows in got.items()} == model


def test_resume_from_positions_plans_only_the_rest(tmp_path):
    url = str(tmp_path / "s")
    model = _make_store(url, 300, 2, seed=3)
    pos = {0: model[0][150][0], 1: model[1][40][0]}
    _, got, _ = _run_task(url, positions=pos)
    for p in range(2):
        assert [g[:5] for g in got[p]] == [r for r in _latest(model[p]) if r[0] >= pos[p]]
    # with tombstones (a target that existed, or a resumed run): deleted keys are deleted there
    _, got, _ = _run_task(url, positions=pos, **{INCLUDE_TOMBSTONES: True})
    for p in range(2):
        assert [g[:5] for g in got[p]] == _latest(model[p], pos[p], tombstones=True)


def test_chunks_concatenate_to_the_plan_for_any_chunk_size(tmp_path):
    url = str(tmp_path / "s")
    model = _make_store(url, 120, 4, seed=4)
    want = {p: _latest(model[p]) for p in range(4)}
    for chunk in (1, 3, 64, 10_000):
        task, got, _ = _run_task(url, chunk=chunk)
        assert {p: [g[:5] for g in rows] for p, rows in got.items()} == \
            {p: w for p, w in want.items() if w}
        assert task.total == sum(len(w) for w in want.values()) and task.remaining == 0


def test_repartition_places_by_murmur2(tmp_path):
    url = str(tmp_path / "s")
    _make_store(url, 200, 3, seed=5)
    _, got, _ = _run_task(url, mode="all", repartition=True, **{TARGET_PARTITIONS: 2})
    keyless = []
    for rows in got.values():
        for _, _, key, _, _, part in rows:
            if key is None:
                keyless.append(part)
            else:
                assert part == default_partition(key, 2)
    assert keyless and set(keyless) <= {0, 1}


def test_connector_errors_name_the_store_and_topic(tmp_path):
    url = str(tmp_path / "s")
    _make_store(url, 5, 1)
    c = StoreSourceConnector()
    with pytest.raises(ConnectorsError, match=r"topic 'nope' is not in store .* holds: orders"):
        c.start({"store.url": url, "store.topic": "nope"})
    with pytest.raises(Exception, match="not a kcompact store"):
        c.start({"store.url": str(tmp_path / "missing"), "store.topic": "orders"})
    with pytest.raises(ConfigError, match="invalid topic name"):
        c.start({"store.url": url, "store.topic": "orders", "topic": "bad topic"})


def test_properties_validate_with_the_short_name(tmp_path):
    props = {"name": "r", "connector.class": "StoreSourceConnector", "store.url": "/x",
             "store.topic": "t", "topic": "t2", "mode": "all", "repartition": "true"}
    cls, values = validate_connector(props, where="r.properties")
    assert cls is StoreSourceConnector and values["mode"] == "all" and values["repartition"]
    with pytest.raises(ConfigError, match="mode: expected one of latest, all"):
        validate_connector(dict(props, mode="some"), where="r.properties")
    with pytest.raises(ConfigError, match="unknown property 'modes'"):
        validate_connector(dict(props, modes="all"), where="r.properties")


def test_cli_restore_flags_and_x_passthrough():
    args = build_parser().parse_args([
        "restore", "--store", "/s", "--topic", "t", "--bootstrap-servers", "b:1",
        "--to-topic", "t2", "--repartition", "--mode", "all", "-X", "linger.ms=5"])
    assert args.repartition and args.mode == "all" and args.kafka_config == ["linger.ms=5"]
    props = connector_props("/s", "t", "t2", kafka_config={"linger.ms": "5"})
    assert props["producer.override.linger.ms"] == "5"
    with pytest.raises(ConfigError, match="use --bootstrap-servers"):
        connector_props("/s", "t", "t2", kafka_config={"bootstrap.servers": "x"})


def test_example_properties_validate():
    from pathlib import Path

    from kcompact.connectors.framework.config import load_config_file
    path = Path(__file__).resolve().parents[2] / "examples" / "store-source.properties"
    cls, values = validate_connector(load_config_file(path), where=str(path))
    assert cls is StoreSourceConnector and values["store.topic"] == "orders"
    assert values["topic"] == "orders-restored" and values["mode"] == "latest"


def test_a_compaction_under_the_reader_is_planned_again(tmp_path):
    """A forced compaction swaps the segments between two chunks: the task notices (the index
    entries no longer match the .log) and plans the rest again from its cursor."""
    from kcompact.compaction import compact_store
    url = str(tmp_path / "s")
    with Store.open(url, writer="w", create=True) as st:
        st.set_topic_config("orders", {"segment.bytes": 16_384})
    model = _make_store(url, 3000, 1, seed=6, keys=2000)
    want = _latest(model[0])
    task = StoreSourceTask()
    task.initialize(SourceTaskContext({}))
    task.start({"store.url": url, "store.topic": "orders", "restore.chunk.records": 100})
    assert len(task.pls[0].segments) > 3
    got = [(r.source_offset["position"] - 1, r.timestamp, r.key, r.value, r.headers)
           for r in task.poll()]
    with Store.open(url) as st:
        assert compact_store(st, topic="orders", force=True)
    while (c := task.poll()) is not None:
        got.extend((r.source_offset["position"] - 1, r.timestamp, r.key, r.value, r.headers)
                   for r in c)
    task.stop()
    assert task.replans >= 1
    assert got == want
