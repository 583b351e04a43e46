"""ACLs on the Kafka endpoint in process (authorize.Gate): the APIs the client tests do not
reach one by one (ListOffsets, OffsetCommit with a topic or group denied, OffsetFetch of all a
group's topics, FindCoordinator, JoinGroup), every version served answering a well-formed
response under ACLs, and the tokens file's format (replication/tokens.py)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_kafka_endpoint_model import Client, Served  # noqa: E402
from test_kafka_endpoint_server import _decoded, store  # noqa: E402,F401
from test_reader_model import TOPIC  # noqa: E402

from kcompact.replication.acls import AclBinding, Authorizer  # noqa: E402
from kcompact.replication.kafka_endpoint.authorize import AclSource  # noqa: E402
from kcompact.replication.tokens import (TokenSet, TokensFileError, add_token,  # noqa: E402
                                         parse_tokens)

ANON = "User:ANONYMOUS"


def _acl(rtype, name, op, perm="ALLOW", pattern="LITERAL"):
    return AclBinding(rtype, name, pattern, ANON, "*", op, perm)


def _with(srv: Served, *bindings) -> None:
    srv.ep.gate.source.authorizer = Authorizer(bindings)


def _commit(c: Client) -> list[int]:
    r = _decoded(8, 7, c.call(8, 7, group_id="g", generation_id_or_member_epoch=-1,
                              member_id="", group_instance_id=None, topics=[{
                                  "name": TOPIC, "partitions": [{
                                      "partition_index": 0, "committed_offset": 1,
                                      "committed_leader_epoch": -1,
                                      "committed_metadata": ""}]}]))
    return [int(p.error_code) for t in r.topics for p in t.partitions]


def _offset_fetch(c: Client, topics):
    return _decoded(9, 7, c.call(9, 7, group_id="g", topics=topics, require_stable=False))


def test_each_api_denied_as_kafka_denies_it(store):
    log = logging.getLogger("test-authorize")
    srv = Served(store, acls=AclSource(Authorizer([]), log))
    try:
        c = Client(srv.port)
        _with(srv, _acl("GROUP", "g", "READ"), _acl("TOPIC", TOPIC, "READ"))
        assert _commit(c) == [0]
        r = _offset_fetch(c, None)
        assert [t.name for t in r.topics] == [TOPIC]
        # the group allowed, the topic not
        _with(srv, _acl("GROUP", "g", "READ"))
        assert _commit(c) == [29]
        assert _offset_fetch(c, None).topics == ()  # left out of all the group's topics
        r = _offset_fetch(c, [{"name": TOPIC, "partition_indexes": [0]}])
        assert [(int(p.error_code), p.committed_offset) for p in r.topics[0].partitions] == [
            (29, -1)]
        r = _decoded(2, 7, c.call(2, 7, replica_id=-1, isolation_level=0, topics=[{
            "name": TOPIC, "partitions": [{"partition_index": 0, "timestamp": -1,
                                           "current_leader_epoch": -1}]}]))
        assert [(int(p.error_code), p.offset) for p in r.topics[0].partitions] == [(29, -1)]
        r = _decoded(3, 12, c.call(3, 12, topics=None, allow_auto_topic_creation=False,
                                   include_topic_authorized_operations=False))
        assert r.topics == ()
        r = _decoded(3, 12, c.call(3, 12, topics=[{"name": TOPIC, "topic_id": None},
                                                  {"name": "absent", "topic_id": None}],
                                   allow_auto_topic_creation=False,
                                   include_topic_authorized_operations=False))
        assert [(t.name, int(t.error_code)) for t in r.topics] == [(TOPIC, 29), ("absent", 29)]
        # describe only: listed and offsets answered, but no READ: Fetch denied
        _with(srv, _acl("TOPIC", TOPIC, "DESCRIBE"))
        r = _decoded(2, 7, c.call(2, 7, replica_id=-1, isolation_level=0, topics=[{
            "name": TOPIC, "partitions": [{"partition_index": 0, "timestamp": -2,
                                           "current_leader_epoch": -1}]}]))
        assert int(r.topics[0].partitions[0].error_code) == 0
        assert c.fetch(12, 0, 1 << 20)[0] == 29
        # a DENY beats the ALLOW of everything
        _with(srv, _acl("TOPIC", "*", "ALL"), _acl("TOPIC", TOPIC[:1], "READ", "DENY",
                                                   "PREFIXED"))
        assert c.fetch(12, 0, 1 << 20)[0] == 29
        # nothing for the group: every group API GROUP_AUTHORIZATION_FAILED
        _with(srv, _acl("TOPIC", TOPIC, "READ"))
        assert _commit(c) == [30]
        assert int(_offset_fetch(c, None).error_code) == 30
        r = _decoded(10, 3, c.call(10, 3, key="g", key_type=0))
        assert int(r.error_code) == 30
        r = _decoded(11, 5, c.call(11, 5, group_id="g", session_timeout=10000,
                                   rebalance_timeout=10000, member_id="",
                                   group_instance_id=None, protocol_type="consumer",
                                   protocols=[{"name": "range", "metadata": b""}]))
        assert int(r.error_code) == 30
        for key, version, body in ((12, 3, {"group_id": "g", "generation_id": 1,
                                            "member_id": "m", "group_instance_id": None}),
                                   (13, 2, {"group_id": "g", "member_id": "m"}),
                                   (14, 3, {"group_id": "g", "generation_id": 1,
                                            "member_id": "m", "group_instance_id": None,
                                            "assignments": []})):
            assert int(_decoded(key, version, c.call(key, version, **body)).error_code) == 30
        denied = {k: n for k, n in srv.ep.gate.denied.items()}
        assert denied[(ANON, "GROUP", "READ")] >= 5
        c.close()
    finally:
        srv.close()


def test_every_version_answers_well_formed_under_acls(store):
    from kcompact.replication.kafka_endpoint.apis import served
    srv = Served(store, acls=AclSource(Authorizer([]), logging.getLogger("t")))
    try:
        c = Client(srv.port)
        for key, (lo, hi) in sorted(served().items()):
            if key == 36:
                continue
            for version in range(lo, hi + 1):
                body = {"acks": -1} if key == 0 else {}
                assert _decoded(key, version, c.call(key, version, **body)) is not None
        c.close()
    finally:
        srv.close()


def test_acl_file_reload_keeps_the_previous_on_a_parse_error(tmp_path):
    f = tmp_path / "acls"
    head = ("Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=t, "
            "patternType=LITERAL)`:\n")
    f.write_text(head + "\t(principal=User:a, host=*, operation=READ, permissionType=ALLOW)\n")
    now = [0.0]
    lines = []
    log = logging.getLogger("t-reload")
    log.warning = lambda msg, *a: lines.append(msg % a)  # type: ignore[method-assign]
    log.info = lambda msg, *a: None  # type: ignore[method-assign]
    src = AclSource.from_file(str(f), log, clock=lambda: now[0])
    assert src.current().authorize("User:a", "h", "READ", "TOPIC", "t")
    f.write_text(head + "\t(principal=User:b, host=*, operation=READ, permissionType=ALLOW)\n")
    assert src.current().authorize("User:a", "h", "READ", "TOPIC", "t")  # not checked yet
    now[0] = 5.0
    assert src.current().authorize("User:b", "h", "READ", "TOPIC", "t")
    f.write_text(head + "nonsense\n")
    now[0] = 10.0
    assert src.current().authorize("User:b", "h", "READ", "TOPIC", "t")
    assert len(lines) == 1 and "line 2: not a line kafka-acls --list prints" in lines[0]


def test_tokens_file(tmp_path):
    f = str(tmp_path / "tokens")
    a = add_token(f, "a", "team-a.*,orders")
    b = add_token(f, "b", "*")
    ts = parse_tokens(open(f).read(), f)
    st, tok = ts.find(f"Bearer {a}")
    assert st == 0 and tok.name == "a"
    assert tok.allows("team-a.x") and tok.allows("orders") and not tok.allows("orders2")
    assert not tok.allows("team-b.x")
    assert ts.find(f"Bearer {b}")[1].allows("anything")
    assert ts.find(None) == (401, None) and ts.find("Bearer nope") == (403, None)
    single = TokenSet.single(b"x" * 20)
    assert single.find("Bearer " + "x" * 20)[1].allows("t")
    for text, why in (("a sha256:00 t", "expected `NAME sha256:HEX"),
                      ("a sha256:" + "0" * 64 + " a/b", "topic pattern 'a/b'"),
                      ("a sha256:" + "0" * 64 + " t\na sha256:" + "1" * 64 + " t",
                       "line 2: a second token named a"), ("# nothing", "holds no token")):
        with pytest.raises(TokensFileError, match=why):
            parse_tokens(text, "f")
