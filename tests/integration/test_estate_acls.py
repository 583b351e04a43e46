"""Issue 53 (ACLs): a mirror keeps the source's ACL bindings on the mirrored topics and the groups
kept with them (docs/formats/acls.md); `kcompact acls` lists them as kafka-acls --list does;
`restore --acls` creates them on another cluster (principals renamed, --to-topic renaming the
LITERAL resource), leaves what is there alone, and a consumer authenticated as the renamed
principal reads the restored topic while one without the ACL is refused.

Two real Apache Kafka 3.9.1 brokers (KRaft, StandardAuthorizer), shared by the module: the
PLAINTEXT listener's ANONYMOUS is the super user the tools (mirror, restore) use, a
SASL_PLAINTEXT (PLAIN) listener authenticates alice, bob and carol. A source without an
authorizer is the session's broker (Tansu, or whatever the session runs)."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, Producer
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType,
                                   AdminClient, NewTopic, ResourcePatternType, ResourceType)

from test_transactions import kcompact, wait_until  # noqa: E402

USERS = {"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw"}


def _broker_class():
    from kcompact.connectors.devtools.apache_kafka import ApacheKafkaBroker
    from kcompact.connectors.devtools.broker import HOST, _free_port

    class AuthorizedKafka(ApacheKafkaBroker):
        """StandardAuthorizer; PLAINTEXT (ANONYMOUS, the super user) for the tools and a
        SASL_PLAINTEXT listener with PLAIN users for the principals under test."""

        def properties(self, port, controller_port, data):
            props = super().properties(port, controller_port, data)
            self.sasl_port = _free_port()
            jaas = " ".join(f'user_{u}="{p}"' for u, p in USERS.items())
            props.update({
                "listeners": props["listeners"] + f",SASL_PLAINTEXT://{HOST}:{self.sasl_port}",
                "advertised.listeners": props["advertised.listeners"]
                + f",SASL_PLAINTEXT://{HOST}:{self.sasl_port}",
                "listener.security.protocol.map": props["listener.security.protocol.map"]
                + ",SASL_PLAINTEXT:SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config":
                    f"org.apache.kafka.common.security.plain.PlainLoginModule required {jaas};",
                "authorizer.class.name":
                    "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "super.users": "User:ANONYMOUS",
            })
            return props

        def sasl(self, user: str) -> dict:
            return {"bootstrap.servers": f"{HOST}:{self.sasl_port}",
                    "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                    "sasl.username": user, "sasl.password": USERS[user]}

    return AuthorizedKafka


@pytest.fixture(scope="module")
def clusters():
    """(source, target): two authorizing brokers, started one after the other."""
    from brokers import apache_kafka_unavailable
    why = apache_kafka_unavailable()
    if why is not None:
        pytest.skip(why)
    cls = _broker_class()
    with cls() as source, cls() as target:
        yield source, target


def _group_offsets(admin: AdminClient, group: str) -> dict[tuple[str, int], int]:
    """The group's committed offsets, if ListGroups lists it."""
    if group not in {g.group_id for g in admin.list_consumer_groups().result(30).valid}:
        return {}
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group]
    return {(tp.topic, tp.partition): tp.offset for tp in res.result(30).topic_partitions
            if tp.error is None and tp.offset >= 0}


def _commit_offset(admin: AdminClient, group: str, topic: str, partition: int,
                   offset: int) -> None:
    """Commit ``offset`` for the group (AlterConsumerGroupOffsets) and wait until ListGroups
    lists the group with it, committing again every 5 s while it is not listed: once on a loaded
    CI machine a group committed this way was still not listed 30 s later (an answer's
    partition error does not fail its future)."""
    want = {(topic, partition): offset}
    deadline = time.monotonic() + 60
    while True:
        admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(
            group, [KTP(topic, partition, offset)])])[group].result(30)
        again = time.monotonic() + 5
        while time.monotonic() < again:
            if _group_offsets(admin, group) == want:
                return
            time.sleep(0.1)
        assert time.monotonic() < deadline, f"the source lists no offset {offset} of {group}"


def _binding(rtype, name, ptype, principal, op, perm=AclPermissionType.ALLOW):
    return AclBinding(rtype, name, ptype, principal, "*", op, perm)


def _all_acls(bootstrap: str) -> set[tuple]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    flt = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None,
                           AclOperation.ANY, AclPermissionType.ANY)
    return {(a.restype.name, a.name, a.resource_pattern_type.name, a.principal, a.host,
             a.operation.name, a.permission_type.name)
            for a in admin.describe_acls(flt, request_timeout=20).result(30)}


def _kafka_acls_list(bootstrap: str, *args: str) -> str:
    """kafka-acls.sh --list (kafka.admin.AclCommand) on ``bootstrap``."""
    import subprocess

    from kcompact.connectors.devtools.apache_kafka import tool_command
    cmd = tool_command("kafka.admin.AclCommand",
                       ["--bootstrap-server", bootstrap, "--list", *args])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _sections(text: str) -> dict[str, set[str]]:
    """kafka-acls --list text -> {resource pattern line: {binding lines}}."""
    out: dict[str, set[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"Current ACLs for resource `(.*)`:", line.strip())
        if m:
            cur = out.setdefault(m.group(1), set())
        elif line.strip().startswith("(principal=") and cur is not None:
            cur.add(line.strip())
    return out


def _produce(bootstrap: str, topic: str, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    for i in range(n):
        p.produce(topic, key=b"k%d" % i, value=b"v%d" % i)
    assert p.flush(60) == 0


def test_acls_mirrored_and_restored(clusters, tmp_path):
    source, target = clusters
    src, dst = source.bootstrap_servers, target.bootstrap_servers
    x = uuid.uuid4().hex[:6]
    t1, t2, t3, group = f"orders{x}", f"pay{x}-in", f"other{x}", f"billing{x}"
    admin = AdminClient({"bootstrap.servers": src})
    for f in admin.create_topics([NewTopic(t, 1, 1) for t in (t1, t2, t3)],
                                 operation_timeout=30).values():
        f.result()
    T, G, L, P = ResourceType.TOPIC, ResourceType.GROUP, ResourcePatternType.LITERAL, \
        ResourcePatternType.PREFIXED
    acls = [_binding(T, t1, L, "User:alice", AclOperation.READ),
            _binding(T, t1, L, "User:alice", AclOperation.DESCRIBE),
            _binding(T, t2, L, "User:bob", AclOperation.WRITE),
            _binding(T, f"pay{x}-", P, "User:bob", AclOperation.READ),
            _binding(T, t1, L, "User:bob", AclOperation.READ, AclPermissionType.DENY),
            _binding(G, group, L, "User:alice", AclOperation.READ),
            _binding(T, t3, L, "User:alice", AclOperation.READ),       # not mirrored
            _binding(G, f"nobody{x}", L, "User:bob", AclOperation.READ)]  # no kept offsets
    for f in admin.create_acls(acls).values():
        f.result()
    # CreateAcls answers once the controller committed the bindings; the broker's authorizer
    # (which answers DescribeAcls) applies them from the metadata log a moment later: the
    # mirror starts once DescribeAcls gives back all eight
    want = {(b.restype.name, b.name, b.resource_pattern_type.name, b.principal, b.host,
             b.operation.name, b.permission_type.name) for b in acls}
    wait_until(lambda: want <= _all_acls(src), 30, "the source lists the new ACLs")
    for t in (t1, t2):
        _produce(src, t, 20)
    # the group committed on t1 (kept with it, so its binding is kept too); the mirror starts
    # once the source lists the group and its offset
    _commit_offset(admin, group, t1, 0, 7)

    store = str(tmp_path / "s")
    res = kcompact("mirror", "--bootstrap-servers", src, "--topic", t1, "--topic", t2,
                   "--store", store, "--engine", "local")
    assert res.returncode == 0, res.stderr
    assert "(1 positions kept)" in res.stderr, res.stderr
    assert "ACLs captured (6 bindings kept)" in res.stderr, res.stderr

    kept = json.loads(kcompact("acls", "--store", store, "--json").stdout)
    got = {tuple(b[k] for k in ("resource_type", "resource_name", "pattern_type", "principal",
                                "host", "operation", "permission_type"))
           for b in kept["bindings"]}
    mirrored = {b for b in _all_acls(src) if b[1] not in (t3, f"nobody{x}")}
    assert got == mirrored and len(got) == 6
    assert set(kept["captured"]) == {t1, t2}
    assert all(b["captured_ms"] > 0 for b in kept["bindings"])

    # `kcompact acls --topic` speaks kafka-acls --list: the same sections for t1's resource
    ours = kcompact("acls", "--store", store, "--topic", t1)
    assert ours.returncode == 0, ours.stderr
    theirs = _kafka_acls_list(src, "--topic", t1)
    pattern = f"ResourcePattern(resourceType=TOPIC, name={t1}, patternType=LITERAL)"
    assert _sections(ours.stdout)[pattern] == _sections(theirs)[pattern]
    assert len(_sections(theirs)[pattern]) == 3
    assert f"name={t3}" not in ours.stdout

    # --dry-run: what it would create, nothing created
    res = kcompact("restore", "--store", store, "--topic", t1, "--bootstrap-servers", dst,
                   "--to-topic", t1, "--acls", "--acl-principal-map", "User:alice=User:carol",
                   "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "4 ACL binding(s) would be created" in res.stderr, res.stderr
    assert f"would create ACL TOPIC:LITERAL:{t1} principal=User:carol host=* " \
        "operation=READ permission=ALLOW" in res.stderr
    assert _all_acls(dst) == set()

    # restore t1 (alice renamed carol) and t2 under another name
    res = kcompact("restore", "--store", store, "--topic", t1, "--bootstrap-servers", dst,
                   "--to-topic", t1, "--acls", "--acl-principal-map", "User:alice=User:carol",
                   "--groups", ".*")
    assert res.returncode == 0, res.stderr
    assert "restore: ACLs: created 4 binding(s)" in res.stderr, res.stderr
    t2c = f"pay{x}-copy"
    res = kcompact("restore", "--store", store, "--topic", t2, "--bootstrap-servers", dst,
                   "--to-topic", t2c, "--acls")
    assert res.returncode == 0, res.stderr
    # bob's WRITE on t2 now names the copy; his PREFIXED READ is created as it is
    assert "restore: ACLs: created 2 binding(s)" in res.stderr, res.stderr

    def renamed(b):
        principal = "User:carol" if b[3] == "User:alice" else b[3]
        name = t2c if (b[0], b[1], b[2]) == ("TOPIC", t2, "LITERAL") else b[1]
        return (b[0], name, b[2], principal, *b[4:])
    assert _all_acls(dst) == {renamed(b) for b in mirrored}
    # kafka-acls --list on the target: t1's section is the source's, alice renamed
    src_t1 = _sections(theirs)[pattern]
    dst_t1 = _sections(_kafka_acls_list(dst, "--topic", t1))[pattern]
    assert dst_t1 == {line.replace("User:alice", "User:carol") for line in src_t1}

    # a rerun leaves what is there alone
    res = kcompact("restore", "--store", store, "--topic", t1, "--bootstrap-servers", dst,
                   "--to-topic", t1, "--acls", "--acl-principal-map", "User:alice=User:carol")
    assert res.returncode == 0, res.stderr
    assert "restore: ACLs: all 4 binding(s) already on" in res.stderr, res.stderr

    # carol (alice's bindings, renamed) reads the restored topic in group billing; bob, denied
    # on it, is refused
    def read(user: str) -> list:
        c = Consumer(dict(target.sasl(user), **{"group.id": group, "auto.offset.reset":
                                                "earliest", "enable.auto.commit": False}))
        try:
            c.assign([KTP(t1, 0, 0)])
            out: list = []
            deadline = time.monotonic() + 30
            while len(out) < 20 and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is None:
                    continue
                if m.error():
                    raise KafkaException(m.error())
                out.append(m.value())
            return out
        finally:
            c.close()
    assert read("carol") == [b"v%d" % i for i in range(20)]
    with pytest.raises(KafkaException, match="(?i)authoriz"):
        read("bob")


def test_acls_as_of(clusters, tmp_path):
    """A binding deleted on the source is gone from the next capture, but kept as of before."""
    source, target = clusters
    src = source.bootstrap_servers
    x = uuid.uuid4().hex[:6]
    t = f"asof{x}"
    admin = AdminClient({"bootstrap.servers": src})
    admin.create_topics([NewTopic(t, 1, 1)], operation_timeout=30)[t].result()
    keep = _binding(ResourceType.TOPIC, t, ResourcePatternType.LITERAL, "User:alice",
                    AclOperation.READ)
    gone = _binding(ResourceType.TOPIC, t, ResourcePatternType.LITERAL, "User:bob",
                    AclOperation.READ)
    for f in admin.create_acls([keep, gone]).values():
        f.result()
    wait_until(lambda: len([b for b in _all_acls(src) if b[1] == t]) == 2, 30, "ACLs listed")
    _produce(src, t, 3)
    store = str(tmp_path / "s")
    assert kcompact("mirror", "--bootstrap-servers", src, "--topic", t, "--store", store,
                    "--engine", "local").returncode == 0
    first = json.loads(kcompact("acls", "--store", store, "--json").stdout)["captured"][t]
    for f in admin.delete_acls([AclBindingFilter(
            ResourceType.TOPIC, t, ResourcePatternType.LITERAL, "User:bob", "*",
            AclOperation.READ, AclPermissionType.ALLOW)]).values():
        f.result()
    wait_until(lambda: len([b for b in _all_acls(src) if b[1] == t]) == 1, 30, "ACL deleted")
    time.sleep(0.01)  # the next capture's wall clock is after the first's
    res = kcompact("mirror", "--bootstrap-servers", src, "--topic", t, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    now = json.loads(kcompact("acls", "--store", store, "--json").stdout)
    assert [b["principal"] for b in now["bindings"]] == ["User:alice"]
    assert now["captured"][t] > first
    then = json.loads(kcompact("acls", "--store", store, "--json", "--as-of",
                               str(first)).stdout)
    assert sorted(b["principal"] for b in then["bindings"]) == ["User:alice", "User:bob"]
    # restore --as-of applies the bindings as captured then
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers",
                   target.bootstrap_servers, "--to-topic", t, "--acls", "--as-of", str(first),
                   "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "2 ACL binding(s) would be created" in res.stderr, res.stderr
    # inspect: when the topic's ACLs were last captured
    doc = json.loads(kcompact("inspect", "--store", store, "--json").stdout)
    cap = next(d for d in doc["topics"] if d["topic"] == t)["captured"]
    assert cap["acls"] == now["captured"][t]
    text = kcompact("inspect", "--store", store).stdout
    assert "ACLS CAPTURED" in text


def test_no_authorizer_is_one_warning(apache_kafka, clusters, tmp_path):
    """The session's real Kafka (no authorizer: DescribeAcls answers SECURITY_DISABLED) as the
    source: one warning line, the records mirrored; a restore --acls onto it: one warning
    line, the records restored. (Tansu answers DescribeAcls with no bindings.)"""
    source, target = clusters
    kafka_bootstrap = apache_kafka.bootstrap
    x = uuid.uuid4().hex[:6]
    t = f"noauth{x}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(t, 1, 1)], operation_timeout=30)[t].result()
    wait_until(lambda: t in admin.list_topics(timeout=10).topics, 30, t)
    _produce(kafka_bootstrap, t, 5)
    store = str(tmp_path / "s")
    res = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", t, "--store",
                   store, "--engine", "local")
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "ACL" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("mirror: warning: ")
    assert "the source has no authorizer" in warnings[0] and "mirroring without" in warnings[0]
    assert "5 records" in res.stderr

    # an authorizing source's ACLs restored onto a cluster without an authorizer
    src = source.bootstrap_servers
    sadmin = AdminClient({"bootstrap.servers": src})
    sadmin.create_topics([NewTopic(t, 1, 1)], operation_timeout=30)[t].result()
    for f in sadmin.create_acls([_binding(ResourceType.TOPIC, t, ResourcePatternType.LITERAL,
                                          "User:alice", AclOperation.READ)]).values():
        f.result()
    wait_until(lambda: any(b[1] == t for b in _all_acls(src)), 30, "ACL listed")
    _produce(src, t, 4)
    store2 = str(tmp_path / "s2")
    assert kcompact("mirror", "--bootstrap-servers", src, "--topic", t, "--store", store2,
                    "--engine", "local").returncode == 0
    res = kcompact("restore", "--store", store2, "--topic", t, "--bootstrap-servers",
                   kafka_bootstrap, "--to-topic", f"{t}-back", "--acls")
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "ACL" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("restore: warning: "), res.stderr
    assert "the target has no authorizer" in warnings[0], warnings
    assert "the ACLs were not created" in warnings[0]
    assert "4 of 4 records produced" in res.stderr

    # --no-acls: nothing captured, nothing said
    store3 = str(tmp_path / "s3")
    res = kcompact("mirror", "--bootstrap-servers", src, "--topic", t, "--store", store3,
                   "--engine", "local", "--no-acls")
    assert res.returncode == 0, res.stderr
    assert "ACL" not in res.stderr
    assert json.loads(kcompact("acls", "--store", store3, "--json").stdout)["bindings"] == []
