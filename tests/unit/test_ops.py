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
