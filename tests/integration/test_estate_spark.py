"""Issue 53 on the Spark engine (PySpark local[2], one session for the module): the driver
captures the source's ACL bindings before and after the job (a binding deleted on the source
is gone from the next capture and kept as of before), and with ``--schema-registry`` every
Spark task keeps the schemas its records name before it stores them, each id once across the
tasks and every topic's ids merged, so that a restore with a target registry maps them.

The ACL source is one Apache Kafka 3.9.1 with StandardAuthorizer (test_estate_acls's broker);
the schemas use the session's broker and tests/integration/schema_registry.py."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (AclBindingFilter, AclOperation, AclPermissionType,
                                   AdminClient, NewTopic, ResourcePatternType, ResourceType)

if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17", allow_module_level=True)

from kcompact.connectors import cli  # noqa: E402
from kcompact.connectors.apps.spark import spark_session  # noqa: E402
from kcompact.reput import Store  # noqa: E402
from schema_registry import SchemaRegistry  # noqa: E402
from test_estate_acls import _all_acls, _binding, _broker_class, _commit_offset, _produce  # noqa: E402
from test_estate_schemas import Source, _decoded  # noqa: E402
from test_transactions import kcompact, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    s = spark_session("local[2]")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def authorized():
    from brokers import apache_kafka_unavailable
    why = apache_kafka_unavailable()
    if why is not None:
        pytest.skip(why)
    with _broker_class()() as k:
        yield k


def _topics(bootstrap: str, *names: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(n, partitions, 1) for n in names],
                                 operation_timeout=30).values():
        f.result()
    wait_until(lambda: set(names) <= set(admin.list_topics(timeout=10).topics), 30, "topics")


def _kept(store: str, *args: str) -> set[tuple]:
    doc = json.loads(kcompact("acls", "--store", store, "--json", *args).stdout)
    return {tuple(b[k] for k in ("resource_type", "resource_name", "pattern_type", "principal",
                                 "host", "operation", "permission_type"))
            for b in doc["bindings"]}


def test_spark_mirror_captures_acls(spark, authorized, tmp_path, capsys):
    src = authorized.bootstrap_servers
    x = uuid.uuid4().hex[:6]
    t, other, group = f"sp{x}", f"spother{x}", f"spg{x}"
    _topics(src, t, other, partitions=2)
    T, G, L, P = ResourceType.TOPIC, ResourceType.GROUP, ResourcePatternType.LITERAL, \
        ResourcePatternType.PREFIXED
    acls = [_binding(T, t, L, "User:alice", AclOperation.READ),
            _binding(T, f"sp{x[:3]}", P, "User:bob", AclOperation.DESCRIBE),
            _binding(G, group, L, "User:alice", AclOperation.READ),
            _binding(T, other, L, "User:alice", AclOperation.READ)]   # not mirrored
    admin = AdminClient({"bootstrap.servers": src})
    for f in admin.create_acls(acls).values():
        f.result()
    wait_until(lambda: len([b for b in _all_acls(src) if x in b[1] or x[:3] in b[1]]) >= 4,
               30, "the source lists the new ACLs")
    _produce(src, t, 30)
    _commit_offset(admin, group, t, 0, 3)   # the group's binding is kept with t

    store = str(tmp_path / "s")
    argv = ["mirror", "--bootstrap-servers", src, "--topic", t, "--store", store,
            "--engine", "spark", "--no-compact"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "with Spark" in err and "ACLs captured (3 bindings kept)" in err, err
    want = {b for b in _all_acls(src) if b[1] in (t, f"sp{x[:3]}", group)}
    assert _kept(store) == want and len(want) == 3
    first = json.loads(kcompact("acls", "--store", store, "--json").stdout)["captured"][t]

    # bob's binding deleted on the source: gone from the next Spark mirror's capture, kept as
    # of the first
    for f in admin.delete_acls([AclBindingFilter(
            T, f"sp{x[:3]}", P, "User:bob", "*", AclOperation.DESCRIBE,
            AclPermissionType.ALLOW)]).values():
        f.result()
    wait_until(lambda: not any(b[3] == "User:bob" and b[1] == f"sp{x[:3]}"
                               for b in _all_acls(src)), 30, "ACL deleted")
    _produce(src, t, 5)
    wait_until(lambda: time.time() * 1000 > first, 5, "the clock moves")
    assert cli.main(argv) == 0
    assert "ACLs captured (2 bindings kept)" in capsys.readouterr().err
    assert {b[3] for b in _kept(store)} == {"User:alice"}
    assert _kept(store, "--as-of", str(first)) == want

    # --no-acls: the Spark driver captures nothing
    store2 = str(tmp_path / "s2")
    assert cli.main(["mirror", "--bootstrap-servers", src, "--topic", t, "--store", store2,
                     "--engine", "spark", "--no-compact", "--no-acls"]) == 0
    assert "ACL" not in capsys.readouterr().err
    assert _kept(store2) == set()


def test_spark_mirror_keeps_schemas(spark, kafka_bootstrap, tmp_path, capsys):
    t = f"spsch{uuid.uuid4().hex[:6]}"
    _topics(kafka_bootstrap, t, partitions=3)
    with SchemaRegistry() as src_sr, SchemaRegistry(first_id=2001) as dst_sr:
        src = Source(src_sr, t)
        src.produce(kafka_bootstrap, 600)   # keyed: spread over the three partitions
        store = str(tmp_path / "s")
        assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", t,
                         "--store", store, "--engine", "spark", "--no-compact",
                         "--schema-registry", src_sr.url]) == 0
        err = capsys.readouterr().err
        assert "3 Spark tasks" in err and "4 new schemas kept" in err, err
        doc = json.loads(kcompact("schemas", "--store", store, "--json").stdout)
        assert {s["id"] for s in doc["schemas"]} == {src.addr, src.v1, src.v2, src.key}
        # three tasks kept the topic's ids: merged, none lost
        assert doc["topics"][t]["ids"] == sorted({src.v1, src.v2, src.key})
        # each schema written once across the tasks
        with Store.open(store) as st:
            keys = [json.loads(r.key) for r in st.iter_records("__kcompact-schemas", 0)]
        assert sorted(k[1] for k in keys if k[0] == "schema") == sorted(
            {src.addr, src.v1, src.v2, src.key})

        res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers",
                       kafka_bootstrap, "--to-topic", f"{t}-copy", "--schema-registry",
                       dst_sr.url)
        assert res.returncode == 0, res.stderr
        assert "4 registered" in res.stderr and "(4 remapped)" in res.stderr, res.stderr
        src_view = _decoded(kafka_bootstrap, t, src_sr.url, 3)
        assert _decoded(kafka_bootstrap, f"{t}-copy", dst_sr.url, 3) == src_view
        assert len(src_view) == 603

        # a registry URL that is not one: refused before Spark runs
        assert cli.main(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", t,
                         "--store", store, "--engine", "spark", "--schema-registry",
                         "nope"]) == 1
        assert "give the registry's http://" in capsys.readouterr().err
