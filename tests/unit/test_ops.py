"""The pieces of running as a service that need no process (replication/ops.py,
connectors/apps/output.py, connectors/apps/kv/serve.py): the unreachable-peer health check on
an injected clock, the JSON log lines, a scan's continuation token and range, the listen
address checks."""

from __future__ import annotations

import json

import pytest

from kcompact.connectors.apps.kv.serve import _BadRequest, _scan_range, _token, _untoken
from kcompact.connectors.apps.output import JsonLines
from kcompact.replication import ReplicationError
from kcompact.replication.connections import is_loopback, local_url, parse_listen
from kcompact.replication.ops import Ops, Unreachable, check_listen


def test_unreachable_fails_only_past_its_timeout_and_recovers():
    now = [100.0]
    u = Unreachable("the Kafka cluster at b:9092", timeout_s=30, clock=lambda: now[0])
    assert u.check() is None
    u.down("connection refused")
    now[0] += 29
    assert u.check() is None
    u.down("still refused")      # the first failure's time is kept
    now[0] += 2
    assert u.check() == "the Kafka cluster at b:9092 unreachable for 31s: still refused"
    u.up()
    assert u.check() is None


def test_health_collects_every_reason_and_a_failing_check_is_one():
    ops = Ops("test")
    ops.check(lambda: None)
    ops.check(lambda: "task t-0 failed:\n  boom")
    ops.check(lambda: 1 / 0)
    assert ops.health() == ["task t-0 failed: boom",
                            "health check failed: ZeroDivisionError: division by zero"]
    closed = []
    ops.on_close(lambda: closed.append(1))
    ops.close()
    ops.close()
    assert closed == [1]
    text = ops.exposition().decode()
    assert 'kcompact_info{command="test"' in text


def test_json_lines_one_object_per_line_with_its_level():
    class Sink:
        text = ""

        def write(self, t):
            self.text += t

        def flush(self):
            pass
    sink = Sink()
    j = JsonLines(sink, "mirror")
    j.write("mirror: 10 records\nkcompact: warning: slow")
    j.write("\nkcompact: error: boom\n\n")
    j.write("no newline yet")
    assert len(sink.text.splitlines()) == 3
    j.flush()
    lines = [json.loads(x) for x in sink.text.splitlines()]
    assert [(x["level"], x["command"], x["msg"]) for x in lines] == [
        ("info", "mirror", "mirror: 10 records"), ("warning", "mirror", "kcompact: warning: slow"),
        ("error", "mirror", "kcompact: error: boom"), ("info", "mirror", "no newline yet")]
    assert all(x["ts"].endswith("Z") for x in lines)


def test_scan_token_and_range():
    assert _untoken(_token(7, b"\x00ab", None)) == (7, b"\x00ab", None)
    assert _untoken(_token(1, b"", b"\xff")) == (1, b"", b"\xff")
    with pytest.raises(_BadRequest):
        _untoken("not-a-token")
    assert _scan_range({"prefix": "user-"}) == (b"user-", b"user.")
    assert _scan_range({"prefix_b64": "/w=="}) == (b"\xff", None)
    assert _scan_range({"prefix": "a", "start": "ab", "stop": "b"}) == (b"ab", b"b")
    assert _scan_range({"start": "k", "stop": "m"}) == (b"k", b"m")
    with pytest.raises(_BadRequest, match="not both"):
        _scan_range({"prefix": "a", "prefix_b64": "YQ=="})


def test_listen_addresses():
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ReplicationError, match="--metrics 'nope': use HOST:PORT"):
        check_listen("nope")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert local_url("http://0.0.0.0:81") == "http://127.0.0.1:81"
    assert local_url("http://[::]:81") == "http://[::1]:81"


# -- issue 22's remainder: write timings, assessments, last-record timestamps, log prefix -----

def _families(ops: Ops) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(ops.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class _StepClock:
    """A store clock whose monotonic seconds step by ``step`` at each read: every duration the
    writer measures (two reads) is exactly ``step``."""

    def __init__(self, step: float):
        from kcompact.reput.config import ManualClock
        self.wall, self.step, self.now = ManualClock(), step, 0.0

    def ms(self) -> int:
        return self.wall.ms()

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def test_commitlog_append_and_fsync_histograms_count_each_call(tmp_path):
    from kcompact.replication.ops import store_metrics
    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    clock = _StepClock(0.003)
    s = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock)
    try:
        opened_flushes = s.partition_fsync_time.count   # the open's own flush
        for b in range(3):
            s.append(RecordBatch.from_records("t", [(p, b * 10 + i, clock.ms(), b"k%d" % i, b"v")
                                                    for p in (0, 1) for i in range(10)]))
        s.flush()
        ops = Ops("test")
        ops.add(lambda: store_metrics([s]))
        m = _families(ops)
    finally:
        s.close()
    a = "kcompact_commitlog_append_seconds"
    assert m[(a + "_count", ())] == 3                   # one observation per append call
    assert m[(a + "_sum", ())] == pytest.approx(3 * 0.003)
    assert m[(a + "_bucket", (("le", "0.0025"),))] == 0
    assert m[(a + "_bucket", (("le", "0.005"),))] == 3
    assert m[(a + "_bucket", (("le", "+Inf"),))] == 3
    f = "kcompact_fsync_seconds"
    assert m[(f + "_count", (("file", "commitlog"),))] == 1    # the flush's
    assert m[(f + "_sum", (("file", "commitlog"),))] == pytest.approx(0.003)
    assert m[(f + "_count", (("file", "partitions"),))] == opened_flushes + 1
    assert m[(f + "_bucket", (("file", "partitions"), ("le", "0.0025")))] == 0


def test_fsync_always_observes_one_fsync_per_append(tmp_path):
    from kcompact.reput.config import WriterOptions
    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    clock = _StepClock(0.5)
    s = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock,
                   options=WriterOptions(fsync="always"))
    try:
        for b in range(4):
            s.append(RecordBatch.from_records("t", [(0, b, clock.ms(), b"k", b"v")]))
        t = s.write_timings()
        assert t["append"].count == 4 and t["commitlog"].count == 4
        buckets, total, n = t["commitlog"].snapshot()
        assert n == 4 and total == pytest.approx(2.0)
        assert dict(buckets)["0.25"] == 0 and dict(buckets)["0.5"] == 4
    finally:
        s.close()
    assert Store.open(str(tmp_path / "s")).write_timings() == {}   # read-only: no writer


def test_dirty_ratio_is_the_schedulers_last_assessment(tmp_path):
    """compaction_metrics reads Scheduler.assessments (made on the scheduler's thread): each
    partition's dirty ratio as the planner saw it, then again after compacting it."""
    from kcompact.compaction import Scheduler, assess_partition
    from kcompact.replication.ops import compaction_metrics
    from kcompact.reput.config import ManualClock
    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    clock = ManualClock()
    s = Store.open(str(tmp_path / "s"), writer="w", create=True, clock=clock)
    try:
        s.set_topic_config("t", {"segment.bytes": 16384})
        s.append(RecordBatch.from_records("t", [
            (0, i, clock.ms(), b"k%d" % (i % 20), b"v" * 300) for i in range(400)]))
        s.append(RecordBatch.from_records("t", [(1, i, clock.ms(), b"k", b"x")
                                                for i in range(10)]))
        s.flush()
        sched = Scheduler(s, clock=clock)
        ops = Ops("test")
        ops.add(lambda: compaction_metrics(sched))
        assert not any(k[0] == "kcompact_dirty_ratio" for k in _families(ops))  # no run yet
        before = assess_partition(s.partition("t", 0), s.topic_config("t"), clock.ms())
        assert before.dirty_ratio == 1.0
        results = sched.run_once()
        assert [(r.topic, r.partition) for r in results] == [("t", 0)]
        m = _families(ops)
        after = assess_partition(s.partition("t", 0), s.topic_config("t"), clock.ms())
        lab0, lab1 = (("partition", "0"), ("topic", "t")), (("partition", "1"), ("topic", "t"))
        assert m[("kcompact_dirty_ratio", lab0)] == after.dirty_ratio < before.dirty_ratio
        assert m[("kcompact_clean_bytes", lab0)] == after.clean_bytes > 0
        assert m[("kcompact_dirty_bytes", lab0)] == after.dirty_bytes
        assert m[("kcompact_dirty_ratio", lab1)] == 0.0       # only its active segment
        assert m[("kcompact_compaction_offset_map_utilization", lab0)] == \
            results[0].map_utilization_max > 0
    finally:
        s.close()


def test_last_records_per_partition():
    import numpy as np

    from kcompact.connectors.framework.kafka_columns import last_records, next_offsets
    parts = np.array([0, 1, 0, 2, 1], np.int32)
    offs = np.array([5, 7, 6, 1, 8], np.int64)
    ts = np.array([100, 200, 300, -1, 250], np.int64)
    assert last_records(parts, offs, ts) == {0: (7, 300), 1: (9, 250), 2: (2, -1)}
    assert next_offsets(parts, offs) == {0: 7, 1: 9, 2: 2}
    assert last_records(parts[:0], offs[:0], ts[:0]) == {}


def test_kafka_errors_note_unreachable_brokers_only():
    from confluent_kafka import KafkaError

    from kcompact.connectors.framework.task_runner import TaskMetrics
    m = TaskMetrics("t-0")
    m.note_kafka_error(KafkaError(KafkaError._MSG_TIMED_OUT, "timed out"))
    assert m.unreachable_since is None
    m.note_kafka_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert m.unreachable_since is not None and m.unreachable_reason == "1/1 brokers are down"


def test_server_log_lines_name_the_running_command(capsys):
    import logging

    from kcompact.replication.connections import setup_log
    # commands of their own: a logger set up earlier in the process keeps that stderr
    lg = setup_log("unit mirror")
    lg.warning("closed the connection of %s:\n no request", "127.0.0.1:5")
    setup_log("unit kv serve").warning("refused")
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == ["kcompact unit mirror: closed the connection of 127.0.0.1:5: no request",
                        "kcompact unit kv serve: refused"]
    assert isinstance(lg, logging.Logger)
