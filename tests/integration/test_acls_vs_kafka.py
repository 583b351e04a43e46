"""The endpoint's ACLs against Apache Kafka 3.9.1's StandardAuthorizer (issue 54).

A second single-node Kafka (not the session's ``apache_kafka``, which has no authorizer) runs
with ``StandardAuthorizer``, ``super.users=User:ANONYMOUS`` (its PLAINTEXT listener: the
admin) and a SASL_PLAINTEXT listener with PLAIN users alice, bob and carol. The topics of
test_kafka_endpoint_acls are created and filled with the same records, ACL bindings are created
through the Admin API (literal, prefixed, ``*``, ``User:*``, a DENY over an ALLOW), and
``kafka-acls --list`` prints them. That listing, as printed, is the endpoint's ``--acls-file``;
the endpoint serves a store with the same records and the same users (``kcompact users add``).
Then for every principal the same observations are made on both with confluent-kafka: the
topics Metadata lists, each topic named in Metadata (its error), each topic read with assign
(its records or its error), and a subscribe in a few groups (the error, or none once a record
came): the two matrices must be equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient,
                                   NewTopic, ResourcePatternType, ResourceType)

from kcompact.connectors.devtools import apache_kafka as ak

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import (KCOMPACT, Endpoint, first_of_subscription, java,  # noqa: E402
                            read_to_end, sasl_conf)
from test_kafka_endpoint_acls import TOPICS, _records, build_store  # noqa: E402

pytestmark = pytest.mark.integration

USERS = {"alice": "alice-" + uuid.uuid4().hex[:8], "bob": "bob-" + uuid.uuid4().hex[:8],
         "carol": "carol-" + uuid.uuid4().hex[:8]}
GROUPS = ("g-alice", "g-bob-1", "carol-g", "other")

#: (resource type, name, pattern, principal, operation, permission)
BINDINGS = [
    ("TOPIC", "orders", "LITERAL", "User:alice", "READ", "ALLOW"),
    ("TOPIC", "team-a.", "PREFIXED", "User:alice", "ALL", "ALLOW"),
    ("TOPIC", "team-b.", "PREFIXED", "User:bob", "READ", "ALLOW"),
    ("TOPIC", "team-b.secret", "LITERAL", "User:bob", "READ", "DENY"),
    ("TOPIC", "*", "LITERAL", "User:carol", "DESCRIBE", "ALLOW"),
    ("TOPIC", "payments", "LITERAL", "User:*", "READ", "ALLOW"),
    ("TOPIC", "payments", "LITERAL", "User:alice", "ALL", "DENY"),
    ("GROUP", "g-alice", "LITERAL", "User:alice", "READ", "ALLOW"),
    ("GROUP", "g-bob", "PREFIXED", "User:bob", "READ", "ALLOW"),
    ("GROUP", "*", "LITERAL", "User:carol", "READ", "ALLOW"),
    ("GROUP", "carol-g", "LITERAL", "User:*", "DESCRIBE", "ALLOW"),
]


class SaslKafka(ak.ApacheKafkaBroker):
    """The launcher's node plus a SASL_PLAINTEXT (PLAIN) listener and StandardAuthorizer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sasl_port = ak._free_port()

    def properties(self, port, controller_port, data):
        p = super().properties(port, controller_port, data)
        sasl = f"SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}"
        users = " ".join(f'user_{u}="{pw}"' for u, pw in USERS.items())
        p.update({
            "listeners": p["listeners"] + "," + sasl,
            "advertised.listeners": p["advertised.listeners"] + "," + sasl,
            "listener.security.protocol.map": p["listener.security.protocol.map"]
            + ",SASL_PLAINTEXT:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config":
                f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};",
            "authorizer.class.name":
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS",
        })
        return p


@pytest.fixture(scope="module")
def kafka_with_acls():
    try:
        ak.find_java()
        ak.fetch(cache=ak.cache_dir(), log=lambda m: None)
    except Exception as e:  # noqa: BLE001 - no Java or no jars here
        pytest.skip(f"Apache Kafka cannot run here: {e}")
    broker = SaslKafka(cache=ak.cache_dir()).start()
    try:
        yield broker
    finally:
        broker.stop()


def _observe(bs: str, user: str) -> dict:
    """What ``user`` sees through ``bs`` (SASL_PLAINTEXT, PLAIN)."""
    conf = sasl_conf(bs, user, USERS[user])
    out: dict = {}
    c = Consumer({**conf, "group.id": "probe"})
    try:
        md = c.list_topics(timeout=20)
        out["listed"] = sorted(t for t, tm in md.topics.items()
                               if tm.error is None and not t.startswith("__"))
        for t in TOPICS:
            e = c.list_topics(t, timeout=20).topics[t].error
            out[f"named {t}"] = None if e is None else e.name()
    finally:
        c.close()
    for t in TOPICS:
        if out[f"named {t}"] is not None:
            continue
        out[f"read {t}"] = _read(conf, t)
    for g in GROUPS:
        out[f"group {g}"] = _subscribe(conf, g)
    return out


def _read(conf: dict, topic: str):
    """The records of partition 0 read with assign (in group carol-g, which every principal
    may describe: the coordinator lookup of assign() needs it), or the error's name."""
    try:
        got, err = read_to_end(conf, topic, "carol-g")
    except TimeoutError:
        return "TIMEOUT"
    return got if err is None else err.name()


def _subscribe(conf: dict, group: str):
    """Subscribe to team-b.events (which nobody but bob reads) or payments in ``group``: the
    error's name, or "ok" once a record came."""
    topic = "payments" if conf["sasl.username"] != "bob" else "team-b.events"
    try:
        err = first_of_subscription(conf, topic, group)
    except TimeoutError:
        return "TIMEOUT"
    return "ok" if err is None else err.name()


def test_the_same_matrix_as_kafkas_standard_authorizer(kafka_with_acls, tmp_path):
    broker = kafka_with_acls
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for f in admin.create_topics([NewTopic(t, 1, 1) for t in TOPICS]).values():
        f.result()
    p = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 5})
    for t in TOPICS:
        for _, k, v in _records(t):
            p.produce(t, key=k, value=v, partition=0)
    assert p.flush(30) == 0
    acls = [AclBinding(ResourceType[r], n, ResourcePatternType[pt], pr, "*", AclOperation[op],
                       AclPermissionType[perm]) for r, n, pt, pr, op, perm in BINDINGS]
    for f in admin.create_acls(acls).values():
        f.result()
    # kafka-acls --list, as an operator runs it; its output is the endpoint's --acls-file
    deadline = time.monotonic() + 30
    while True:
        r = java("kafka.admin.AclCommand", "--bootstrap-server", broker.bootstrap_servers,
                 "--list")
        assert r.returncode == 0, r.stderr[-2000:]
        if r.stdout.count("(principal=") == len(BINDINGS):
            break
        assert time.monotonic() < deadline, r.stdout
        time.sleep(0.5)
    (tmp_path / "acls.txt").write_text(r.stdout)
    url = build_store(str(tmp_path / "store"))
    for name, pw in USERS.items():
        got = subprocess.run([*KCOMPACT, "users", "add", "--file", str(tmp_path / "users"),
                              "--mechanism", "PLAIN", name], input=pw + "\n",
                             capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr
    ep = Endpoint(url, "--kafka-users-file", str(tmp_path / "users"), "--acls-file",
                  str(tmp_path / "acls.txt"), log=tmp_path / "ep.log").start()
    try:
        sasl_bs = f"127.0.0.1:{broker.sasl_port}"
        for user in USERS:
            want = _observe(sasl_bs, user)
            got = _observe(ep.bootstrap, user)
            assert got == want, (user, {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
                                        if want.get(k) != got.get(k)})
            # and the matrix is not trivial: records read, both denials met
            assert any(isinstance(v, list) and len(v) == 5 for k, v in want.items()
                       if k.startswith("read")), want
            assert {"TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED"} <= {
                v for v in want.values() if isinstance(v, str)} or user == "carol", want
    finally:
        ep.stop()
