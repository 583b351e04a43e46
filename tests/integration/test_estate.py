"""Issue 21: mirror an estate, not a topic. Topic sets (--topic repeated, --topics-regex,
--exclude-regex, internal topics), configs that follow the source (describe_configs; a real Kafka
where its semantics matter: every config described, defaults marked, ACLs), `kcompact configs`
on a mirrored store, and a following mirror that picks up new topics and partitions and stops
on a deleted or recreated topic (real Kafka: Tansu 0.6 crashes librdkafka 2.16 when a topic a
consumer is assigned to is deleted, BROKER_NOTES.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicCollection
from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient,
                                   AlterConfigOpType, ConfigEntry, ConfigResource, NewPartitions,
                                   NewTopic, ResourcePatternType, ResourceType)

from kcompact.reput import Store
from topics import read_store, read_topic  # noqa: E402

from test_transactions import ROOT, error_line, kcompact, wait_until  # noqa: E402


def produce(bootstrap: str, topic: str, n: int, *, partition: int | None = None,
            tag: bytes = b"v") -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    for i in range(n):
        kw = {} if partition is None else {"partition": partition}
        p.produce(topic, key=b"k%d" % i, value=tag + b"%d" % i, **kw)
    assert p.flush(60) == 0


class Topics:
    """Topics with names of the test's choosing (a common prefix, for regexes), deleted at the
    end."""

    def __init__(self, admin: AdminClient):
        self.admin, self.prefix, self.made = admin, f"est{uuid.uuid4().hex[:8]}", []

    def make(self, suffix: str, partitions: int = 1, config: dict | None = None,
             name: str | None = None) -> str:
        name = name or f"{self.prefix}-{suffix}"
        self.admin.create_topics([NewTopic(name, partitions, 1, config=config or {})],
                                 operation_timeout=30)[name].result()
        self.made.append(name)
        wait_until(lambda: name in self.admin.list_topics(timeout=10).topics, 30, name)
        return name

    def delete(self) -> None:
        if self.made:
            for f in self.admin.delete_topics(self.made, operation_timeout=30).values():
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - cleanup
                    pass


@pytest.fixture
def topics(kafka_admin):
    t = Topics(kafka_admin)
    yield t
    t.delete()


@pytest.fixture
def kafka_topics(apache_kafka):
    t = Topics(apache_kafka.admin)
    yield t
    t.delete()


def stored_count(store: str, topic: str) -> int:
    try:
        with Store.open(store) as st:
            return sum(1 for p in st.partitions(topic) for _ in st.iter_records(topic, p))
    except Exception:  # noqa: BLE001 - not created yet
        return -1


def describe(store: str, topic: str) -> dict[str, tuple]:
    res = kcompact("configs", "--store", store, "--topic", topic, "--describe", "--json")
    assert res.returncode == 0, res.stderr
    return {c["name"]: (c["value"], c["source"], c.get("synced_value"))
            for c in json.loads(res.stdout)["configs"]}


# -- topic sets (the session broker) -------------------------------------------------------------


def test_topics_regex_exclude_and_internal_topics(kafka_bootstrap, topics, tmp_path):
    orders = topics.make("orders", 2)
    users = topics.make("users")
    skipped = topics.make("skip")
    internal = topics.make("", name=f"__{topics.prefix}-internal")
    for t in (orders, users, skipped, internal):
        produce(kafka_bootstrap, t, 20)
    store = str(tmp_path / "s")
    res = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topics-regex",
                   f"(__)?{topics.prefix}-.*", "--exclude-regex", ".*-skip", "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    with Store.open(store) as st:
        assert st.topics() == [orders, users]
    for t, parts in ((orders, 2), (users, 1)):
        assert read_store(store, t) == read_topic(kafka_bootstrap, t, parts)
    assert f"mirror: 2 topics (3 partitions) from {kafka_bootstrap} into {store}" in res.stderr
    assert f"mirror: {orders}: 20 records (2 partitions)" in res.stderr
    assert f"mirror: {users}: 20 records (1 partitions)" in res.stderr
    assert "mirror: done: 40 records in " in res.stderr and ", 2 topics;" in res.stderr

    # an internal topic is mirrored when named, next to a pattern's topics; --topic repeats
    res = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", internal,
                   "--topic", skipped, "--store", store, "--engine", "local")
    assert res.returncode == 0, res.stderr
    with Store.open(store) as st:
        assert st.topics() == sorted([orders, users, skipped, internal])
    assert stored_count(store, internal) == 20


def test_topic_set_usage_and_errors(kafka_bootstrap, topics, tmp_path):
    store = str(tmp_path / "s")
    base = ["mirror", "--bootstrap-servers", kafka_bootstrap, "--store", store, "--engine",
            "local"]
    res = kcompact(*base)
    assert res.returncode == 2 and "give --topic T (repeatable) or --topics-regex RE" in \
        res.stderr
    res = kcompact(*base, "--topic", "x", "--exclude-regex", "y")
    assert res.returncode == 2 and "--exclude-regex applies to" in res.stderr
    res = kcompact(*base, "--topics-regex", "[unclosed")
    assert res.returncode == 1
    assert "topics.regex: '[unclosed' is not a valid regular expression" in error_line(res)
    res = kcompact(*base, "--topics-regex", f"{topics.prefix}-nothing-.*")
    assert res.returncode == 1
    assert f"matches no topic on {kafka_bootstrap}" in error_line(res)
    assert not os.path.exists(store)  # nothing created


def test_store_sink_takes_topics_regex(kafka_bootstrap, topics, tmp_path):
    """connect standalone: the store sink with Connect's topics.regex (no topics)."""
    a, b = topics.make("a"), topics.make("b", 2)
    produce(kafka_bootstrap, a, 5)
    produce(kafka_bootstrap, b, 7)
    store = tmp_path / "s"
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={kafka_bootstrap}\n")
    conn = tmp_path / "sink.properties"
    conn.write_text("name=estate-sink\nconnector.class=StoreSinkConnector\n"
                    f"topics.regex={topics.prefix}-.*\nstore.url={store}\nfollow=false\n")
    res = kcompact("connect", "standalone", str(worker), str(conn))
    assert res.returncode == 0, res.stderr
    assert read_store(str(store), a) == read_topic(kafka_bootstrap, a, 1)
    assert read_store(str(store), b) == read_topic(kafka_bootstrap, b, 2)


def test_configs_set_on_tansu_are_synced(kafka_bootstrap, kafka_broker_kind, topics, tmp_path):
    """On Tansu describe_configs returns only the configs set on the topic (and marks them
    default): those are synced; on a real Kafka see the tests below."""
    t = topics.make("cfg", config={"cleanup.policy": "compact", "delete.retention.ms": "12345"})
    produce(kafka_bootstrap, t, 3)
    store = str(tmp_path / "s")
    res = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", t, "--store",
                   store, "--engine", "local")
    assert res.returncode == 0, res.stderr
    got = describe(store, t)
    assert got["delete.retention.ms"] == (12345, "synced", None)
    assert got["cleanup.policy"] == ("compact", "synced", None)
    assert got["min.compaction.lag.ms"] == (0, "default", None)


def test_topic_set_and_configs_on_an_s3_store(kafka_bootstrap, topics, s3_store_url):
    """SeaweedFS: a regex mirror into an S3 store syncs each topic's configs; `kcompact configs`
    alters them there while the store holds data, and a later mirror keeps the override."""
    a = topics.make("a", config={"delete.retention.ms": "4242"})
    b = topics.make("b", 2)
    produce(kafka_bootstrap, a, 6)
    produce(kafka_bootstrap, b, 9)
    url = s3_store_url()
    args = ("mirror", "--bootstrap-servers", kafka_bootstrap, "--topics-regex",
            f"{topics.prefix}-.*", "--store", url, "--engine", "local")
    res = kcompact(*args)
    assert res.returncode == 0, res.stderr
    assert read_store(url, a) == read_topic(kafka_bootstrap, a, 1)
    assert read_store(url, b) == read_topic(kafka_bootstrap, b, 2)
    assert describe(url, a)["delete.retention.ms"] == (4242, "synced", None)
    res = kcompact("configs", "--store", url, "--topic", a, "--alter", "--add-config",
                   "delete.retention.ms=7,min.cleanable.dirty.ratio=0.25")
    assert res.returncode == 0, res.stderr
    produce(kafka_bootstrap, a, 2, tag=b"more")
    res = kcompact(*args)
    assert res.returncode == 0, res.stderr
    got = describe(url, a)
    assert got["delete.retention.ms"] == (7, "override", 4242)
    assert got["min.cleanable.dirty.ratio"] == (0.25, "override", None)
    assert stored_count(url, a) == 8


# -- configs follow the source (a real Kafka) ----------------------------------------------------


def test_configs_follow_the_source_and_local_overrides_win(apache_kafka, kafka_topics, tmp_path):
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    t = kafka_topics.make("cfg", config={"cleanup.policy": "compact",
                                         "delete.retention.ms": "12345",
                                         "min.cleanable.dirty.ratio": "0.2",
                                         "segment.bytes": "2147483647"})
    produce(bootstrap, t, 10)
    store = str(tmp_path / "s")
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", t, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    assert f"mirror: note: topic {t}: segment.bytes=2147483647 is larger than a store's " \
        "segments should be; the store keeps its default 1073741824" in res.stderr
    got = describe(store, t)
    assert got["delete.retention.ms"] == (12345, "synced", None)
    assert got["min.cleanable.dirty.ratio"] == (0.2, "synced", None)
    assert got["cleanup.policy"] == ("compact", "synced", None)
    assert got["segment.bytes"] == (1 << 30, "default", None)
    # Kafka's built-in defaults are not synced: the store's own apply
    assert got["min.compaction.lag.ms"] == (0, "default", None)
    assert got["retention.ms"] == (604800000, "default", None)

    # a local override survives the next mirror, which syncs what changed in Kafka
    res = kcompact("configs", "--store", store, "--topic", t, "--alter", "--add-config",
                   "delete.retention.ms=5")
    assert res.returncode == 0, res.stderr
    r = ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[
        ConfigEntry("delete.retention.ms", "999",
                    incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.ms", "3600000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([r])[r].result(timeout=30)
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", t, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    assert "(local overrides win for delete.retention.ms)" in res.stderr
    got = describe(store, t)
    assert got["delete.retention.ms"] == (5, "override", 999)
    assert got["retention.ms"] == (3600000, "synced", None)
    res = kcompact("inspect", "--store", store, "--json")
    doc = json.loads(res.stdout)["topics"][0]
    assert doc["config"]["delete.retention.ms"] == 5
    assert doc["config_source"]["retention.ms"] == "synced"

    # --no-sync-configs: nothing read from Kafka
    other = str(tmp_path / "other")
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", t, "--store", other,
                   "--engine", "local", "--no-sync-configs")
    assert res.returncode == 0, res.stderr
    assert {v[1] for v in describe(other, t).values()} == {"default"}


def test_a_broker_refusing_describe_configs_is_a_warning(tmp_path):
    """A real Kafka with ACLs: the mirror may read the topic but not DescribeConfigs on it."""
    from brokers import apache_kafka_unavailable
    why = apache_kafka_unavailable()
    if why is not None:
        pytest.skip(why)
    from kcompact.connectors.devtools.apache_kafka import ApacheKafkaBroker
    cfg = {"authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
           "allow.everyone.if.no.acl.found": "true"}
    with ApacheKafkaBroker(broker_config=cfg) as broker:
        bootstrap = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic("acl", 1, 1, config={"delete.retention.ms": "12345"})],
                            operation_timeout=30)["acl"].result()
        acls = [AclBinding(ResourceType.TOPIC, "acl", ResourcePatternType.LITERAL,
                           "User:ANONYMOUS", "*", op, perm)
                for op, perm in ((AclOperation.ALL, AclPermissionType.ALLOW),
                                 (AclOperation.DESCRIBE_CONFIGS, AclPermissionType.DENY))]
        for f in admin.create_acls(acls).values():
            f.result()
        produce(bootstrap, "acl", 5)
        store = str(tmp_path / "s")
        res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", "acl", "--store",
                       store, "--engine", "local")
        # the store sink under connect standalone says the same
        other = str(tmp_path / "connect")
        worker, conn = _connect_files(tmp_path, bootstrap, "name=acl\ntopics=acl\n"
                                      f"store.url={other}\nfollow=false\n")
        res2 = kcompact("connect", "standalone", str(worker), str(conn))
    assert res.returncode == 0, res.stderr
    assert "mirror: warning: topic acl: the broker refused describe_configs (Topic " \
        "authorization failed" in res.stderr
    assert "grant DescribeConfigs on topic acl to sync its configs; mirroring with the " \
        "store's values" in res.stderr
    assert stored_count(store, "acl") == 5
    assert describe(store, "acl")["delete.retention.ms"] == (86400000, "default", None)
    assert res2.returncode == 0, res2.stderr
    assert "connect: warning: topic acl: the broker refused describe_configs (Topic " \
        "authorization failed" in res2.stderr and "grant DescribeConfigs on topic acl" in \
        res2.stderr
    assert stored_count(other, "acl") == 5


# -- following: new topics, new partitions, deleted and recreated topics (a real Kafka) ----------


def _background(*args: str, log: Path) -> subprocess.Popen:
    """``kcompact ARGS`` running, its stderr into ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=f,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _follow(bootstrap: str, store: str, *args: str, log: Path) -> subprocess.Popen:
    return _background("mirror", "--bootstrap-servers", bootstrap, "--store", store, "--engine",
                       "local", "--follow", *args, log=log)


def _connect_follow(worker: Path, conn: Path, log: Path) -> subprocess.Popen:
    return _background("connect", "standalone", str(worker), str(conn), log=log)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM (flush, exit) when still running; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(30)


def _topic_id(admin: AdminClient, topic: str) -> str:
    """The topic's id (asked again while a topic just created is not known yet)."""
    got: list[str] = []

    def described() -> bool:
        try:
            fut = admin.describe_topics(TopicCollection([topic]))[topic]
            got.append(str(fut.result(30).topic_id))
            return True
        except Exception as e:  # noqa: BLE001 - UNKNOWN_TOPIC_OR_PART for a moment
            if "UNKNOWN_TOPIC" in str(e):
                return False
            raise
    wait_until(described, what=f"topic {topic}'s id")
    return got[-1]


def _recreate(admin: AdminClient, topic: str, partitions: int = 1) -> None:
    """Delete ``topic`` and create it again under the same name (a new topic id)."""
    admin.delete_topics([topic], operation_timeout=30)[topic].result()

    def created() -> bool:
        try:
            admin.create_topics([NewTopic(topic, partitions, 1)],
                                operation_timeout=30)[topic].result()
            return True
        except Exception as e:  # noqa: BLE001 - deletion still in progress
            if "marked for deletion" in str(e) or "TOPIC_ALREADY_EXISTS" in str(e):
                return False
            raise
    wait_until(created, what="the re-creation")


def _stopped_lines(err: str, topic: str) -> list[str]:
    return [ln for ln in err.splitlines()
            if ln.startswith("kcompact: warning: ") and f"topic {topic} stopped" in ln]


def test_following_picks_up_new_topics_and_partitions_and_stops_only_a_deleted_one(
        apache_kafka, kafka_topics, tmp_path):
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    a = kafka_topics.make("a")
    produce(bootstrap, a, 10)
    a_id = _topic_id(admin, a)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    proc = _follow(bootstrap, store, "--topics-regex", f"{kafka_topics.prefix}-.*",
                   "-X", "topic.metadata.refresh.interval.ms=1000", log=log)
    try:
        wait_until(lambda: stored_count(store, a) == 10, what="the first topic")
        b = kafka_topics.make("b", 2)
        produce(bootstrap, b, 8)
        wait_until(lambda: stored_count(store, b) == 8, what="the new topic")
        admin.create_partitions([NewPartitions(b, 3)])[b].result()
        produce(bootstrap, b, 4, partition=2, tag=b"p2-")
        wait_until(lambda: stored_count(store, b) == 12, what="the new partition")
        assert proc.poll() is None, log.read_text()
        assert read_store(store, b) == read_topic(bootstrap, b, 3)
        admin.delete_topics([a], operation_timeout=30)[a].result()
        kafka_topics.made.remove(a)
        wait_until(lambda: _stopped_lines(log.read_text(), a), what="the deleted topic's line")
        # the other topic goes on
        produce(bootstrap, b, 6, tag=b"after")
        wait_until(lambda: stored_count(store, b) == 18, what="records after the deletion")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 3, err
    assert f"new topic {b} [0, 1]: following from the start" in err
    assert f"new partitions {b} [2]: following from the start" in err
    assert not [ln for ln in err.splitlines() if ln.startswith("kcompact: error:")], err
    (line,) = _stopped_lines(err, a)
    assert f"it was deleted (topic id {a_id})" in line and "the other topics go on" in line
    assert "mirror it into a new store" in line
    assert read_store(store, b) == read_topic(bootstrap, b, 3)
    assert stored_count(store, a) == 10  # what was mirrored stays
    assert f"mirror: {a}: 10 records (1 partitions), stopped: deleted (topic id {a_id})" in err
    assert f"1 topic stopped ({a}); store {store} flushed" in err
    with Store.open(store) as st:  # what was picked up was recorded (before its records)
        assert st.recorded_topic_id(b) == _topic_id(admin, b)
        assert st.recorded_partitions(b) == [0, 1, 2]


def test_a_recreated_topic_stops_alone_and_never_mixes_into_its_log(
        apache_kafka, kafka_topics, tmp_path):
    """Two followed topics; one is deleted and created again (and written to) between two
    metadata checks, then every record of the other is produced. The recreated topic stops
    (its line names the old and new topic ids), the store holds its old records only, and the
    other's all arrive. A mirror whose every topic stopped ends by itself; both exit 3."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    t, other = kafka_topics.make("re"), kafka_topics.make("other", 2)
    produce(bootstrap, t, 30)
    old_id = _topic_id(admin, t)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    proc = _follow(bootstrap, store, "--topic", t, "--topic", other,
                   "-X", "topic.metadata.refresh.interval.ms=20000", log=log)
    try:
        wait_until(lambda: stored_count(store, t) == 30, what="the first records")
        old = read_store(store, t)
        _recreate(admin, t)
        new_id = _topic_id(admin, t)
        produce(bootstrap, t, 40, tag=b"new")
        wait_until(lambda: _stopped_lines(log.read_text(), t), 120, "the recreated topic's line")
        produce(bootstrap, other, 50, tag=b"o")
        wait_until(lambda: stored_count(store, other) == 50, what="the other topic's records")
        wait_until(lambda: "1 topic stopped" in log.read_text(), what="a progress line")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 3, err
    assert not [ln for ln in err.splitlines() if ln.startswith("kcompact: error:")], err
    (line,) = _stopped_lines(err, t)
    # found by its new id, or by describe_topics not knowing it for a moment (deleted)
    assert (f"deleted and created again (topic id {old_id} -> {new_id})" in line
            or f"it was deleted (topic id {old_id})" in line), line
    assert read_store(store, t) == old
    assert read_store(store, other) == read_topic(bootstrap, other, 2)
    assert any(ln.startswith("mirror: ") and f"1 topic stopped ({t})" in ln and "rec/s" in ln
               and "done" not in ln for ln in err.splitlines()), err
    assert f"mirror: {t}: 30 records (1 partitions), stopped: deleted" in err

    # alone: a mirror whose only topic is recreated under it stops, and so ends, by itself
    solo = kafka_topics.make("solo")
    produce(bootstrap, solo, 5)
    store2, log2 = str(tmp_path / "s2"), tmp_path / "err2.log"
    proc = _follow(bootstrap, store2, "--topic", solo, "--no-sync-configs",
                   "-X", "topic.metadata.refresh.interval.ms=1000", log=log2)
    try:
        wait_until(lambda: stored_count(store2, solo) == 5, what="the solo topic's records")
        old = read_store(store2, solo)
        _recreate(admin, solo)
        produce(bootstrap, solo, 9, tag=b"new")
        rc = proc.wait(120)
    finally:
        _stop(proc)
    err = log2.read_text()
    assert rc == 3, err
    assert len(_stopped_lines(err, solo)) == 1, err
    assert f"1 topic stopped ({solo}); store {store2} flushed" in err
    assert read_store(store2, solo) == old


# -- the store sink under connect standalone syncs configs too (a real Kafka) --------------------


def _connect_files(tmp_path: Path, bootstrap: str, conn: str) -> tuple[Path, Path]:
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={bootstrap}\n")
    path = tmp_path / f"sink-{uuid.uuid4().hex[:6]}.properties"
    path.write_text("connector.class=StoreSinkConnector\n" + conn)
    return worker, path


def test_connect_standalone_store_sink_syncs_configs(apache_kafka, kafka_topics, tmp_path):
    """At start (each topic as a task opens it), and while following at each metadata
    refresh; sync.topic.configs.enabled=false turns it off."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    t = kafka_topics.make("cs", 2, config={"cleanup.policy": "compact",
                                           "delete.retention.ms": "12345"})
    produce(bootstrap, t, 10)
    store = str(tmp_path / "s")
    worker, conn = _connect_files(tmp_path, bootstrap, f"name=cs\ntopics={t}\nstore.url={store}\n"
                                  "follow=false\ntasks.max=2\n")
    res = kcompact("connect", "standalone", str(worker), str(conn))
    assert res.returncode == 0, res.stderr
    assert f"connect: {t}: configs synced from Kafka: cleanup.policy=compact, " \
        "delete.retention.ms=12345" in res.stderr
    assert res.stderr.count("configs synced from Kafka") == 1, res.stderr  # once for 2 tasks
    got = describe(store, t)
    assert got["delete.retention.ms"] == (12345, "synced", None)
    assert got["cleanup.policy"] == ("compact", "synced", None)

    off = str(tmp_path / "off")
    worker, conn = _connect_files(tmp_path, bootstrap, f"name=off\ntopics={t}\nstore.url={off}\n"
                                  "follow=false\nsync.topic.configs.enabled=false\n")
    res = kcompact("connect", "standalone", str(worker), str(conn))
    assert res.returncode == 0, res.stderr
    assert "configs synced" not in res.stderr
    assert {v[1] for v in describe(off, t).values()} == {"default"}

    # following: a config changed in Kafka reaches the store within a metadata refresh
    fol, log = str(tmp_path / "fol"), tmp_path / "err.log"
    worker, conn = _connect_files(
        tmp_path, bootstrap, f"name=fol\ntopics={t}\nstore.url={fol}\n"
        "consumer.override.topic.metadata.refresh.interval.ms=1000\n")
    proc = _connect_follow(worker, conn, log)
    try:
        wait_until(lambda: stored_count(fol, t) == 10, what="the records")
        assert describe(fol, t)["delete.retention.ms"] == (12345, "synced", None)
        r = ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[
            ConfigEntry("delete.retention.ms", "777",
                        incremental_operation=AlterConfigOpType.SET)])
        admin.incremental_alter_configs([r])[r].result(timeout=30)
        wait_until(lambda: describe(fol, t)["delete.retention.ms"] == (777, "synced", None),
                   what="the changed config")
    finally:
        rc = _stop(proc)
    assert rc == 0, log.read_text()
    assert "delete.retention.ms=777" in log.read_text()


def test_new_matches_are_spread_over_the_tasks(kafka_bootstrap, topics, tmp_path):
    """connect standalone, tasks.max=2, topics.regex, following: a topic that starts to match
    has its partitions spread over both tasks round-robin (task 0 read the first topic's only
    partition at start, so the new topic's partition 0 goes to task 1 and partition 1 to task
    0), each partition read by one task only."""
    a = topics.make("a")
    produce(kafka_bootstrap, a, 5)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    worker, conn = _connect_files(
        tmp_path, kafka_bootstrap,
        f"name=spread\ntopics.regex={topics.prefix}-.*\nstore.url={store}\ntasks.max=2\n"
        "consumer.override.topic.metadata.refresh.interval.ms=1000\n")
    proc = _connect_follow(worker, conn, log)
    try:
        wait_until(lambda: stored_count(store, a) == 5, what="the first topic")
        b = topics.make("b", 2)
        produce(kafka_bootstrap, b, 20)
        wait_until(lambda: stored_count(store, b) == 20, what="the new topic")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 0, err
    assert f"kcompact: spread-1: new topic {b} [0]: following from the start" in err
    assert f"kcompact: spread-0: new topic {b} [1]: following from the start" in err
    assert read_store(store, b) == read_topic(kafka_bootstrap, b, 2)
    assert read_store(store, a) == read_topic(kafka_bootstrap, a, 1)


def test_a_mirror_restarted_on_a_recreated_topic_refuses_it(apache_kafka, kafka_topics,
                                                            tmp_path):
    """The store records each topic's id when a mirror first copies it; a later mirror of a
    topic deleted and created again (offsets from 0: they would land after the old ones') is
    one line naming both ids, and the store is left as it was."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    topic, other = kafka_topics.make("orders"), kafka_topics.make("other")
    store = str(tmp_path / "store")
    produce(bootstrap, topic, 20, tag=b"old")
    produce(bootstrap, other, 5)
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic, "--topic",
                   other, "--store", store, "--engine", "local")
    assert res.returncode == 0, res.stderr
    old_id = _topic_id(admin, topic)
    with Store.open(store) as st:
        assert st.recorded_topic_id(topic) == old_id
    before = read_store(store, topic)
    _recreate(admin, topic)
    new_id = _topic_id(admin, topic)
    produce(bootstrap, topic, 40, tag=b"new")  # past the store's offsets: no gap to notice
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", topic, "--topic",
                   other, "--store", store, "--engine", "local")
    assert res.returncode == 1
    assert error_line(res) == (
        f"kcompact: error: topic '{topic}' was deleted and created again since store {store} "
        f"copied it (topic id {old_id} then, {new_id} now): its offsets start again and would "
        "mix with the stored ones; mirror it into a new store, or leave it out of this store's "
        "mirrors")
    assert read_store(store, topic) == before
    # leaving it out: the other topic goes on
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", other, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr


def test_a_topic_picked_up_while_following_is_recorded_and_refused_once_recreated(
        apache_kafka, kafka_topics, tmp_path):
    """A topic that starts to match --topics-regex while a mirror follows gets its id and
    partitions recorded before any of its records is stored, as at start; so once it is deleted
    and created again (with more records than the store holds: no gap to notice), the next mirror
    refuses it with one line naming both ids, exit 1, and leaves the store as it was."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    a = kafka_topics.make("a")
    produce(bootstrap, a, 5)
    regex = f"{kafka_topics.prefix}-.*"
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    proc = _follow(bootstrap, store, "--topics-regex", regex,
                   "-X", "topic.metadata.refresh.interval.ms=1000", log=log)
    try:
        wait_until(lambda: stored_count(store, a) == 5, what="the first topic")
        b = kafka_topics.make("b", 2)
        b_id = _topic_id(admin, b)
        produce(bootstrap, b, 10, tag=b"old")
        wait_until(lambda: stored_count(store, b) == 10, what="the new topic")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    assert rc == 0, log.read_text()
    assert f"new topic {b} [0, 1]: following from the start" in log.read_text()
    with Store.open(store) as st:
        assert st.recorded_topic_id(b) == b_id
        assert st.recorded_partitions(b) == [0, 1]
    before = read_store(store, b)
    meta = (Path(store) / "store.json").read_bytes()
    _recreate(admin, b, partitions=2)
    new_id = _topic_id(admin, b)
    produce(bootstrap, b, 40, tag=b"new")  # every partition longer than the stored one
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topics-regex", regex,
                   "--store", store, "--engine", "local")
    assert res.returncode == 1, res.stderr
    assert error_line(res) == (
        f"kcompact: error: topic '{b}' was deleted and created again since store {store} "
        f"copied it (topic id {b_id} then, {new_id} now): its offsets start again and would "
        "mix with the stored ones; mirror it into a new store, or leave it out of this store's "
        "mirrors")
    assert read_store(store, b) == before
    assert (Path(store) / "store.json").read_bytes() == meta


def test_a_topic_picked_up_while_following_has_its_configs_synced_first(
        apache_kafka, kafka_topics, tmp_path):
    """Without -X topic.metadata.refresh.interval.ms topics are picked up every 5 s while
    configs are synced again every 5 min (librdkafka's default): a topic picked up is synced
    when it is picked up, before its records are stored, not at the next refresh."""
    bootstrap = apache_kafka.bootstrap
    a = kafka_topics.make("a")
    produce(bootstrap, a, 3)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    proc = _follow(bootstrap, store, "--topics-regex", f"{kafka_topics.prefix}-.*", log=log)
    try:
        wait_until(lambda: stored_count(store, a) == 3, what="the first topic")
        b = kafka_topics.make("b", config={"delete.retention.ms": "12345"})
        produce(bootstrap, b, 4)
        wait_until(lambda: stored_count(store, b) == 4, 60, "the new topic's records")
        assert describe(store, b)["delete.retention.ms"] == (12345, "synced", None)
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 0, err
    lines = err.splitlines()
    (synced,) = [i for i, ln in enumerate(lines)
                 if ln.startswith(f"mirror: {b}: configs synced from Kafka: ")]
    assert "delete.retention.ms=12345" in lines[synced]
    (picked,) = [i for i, ln in enumerate(lines)
                 if f"new topic {b} [0]: following from the start" in ln]
    assert synced < picked, err  # synced in open(), before the partition was assigned


def test_a_topic_followed_with_partitions_stops_alone_when_recreated(
        apache_kafka, kafka_topics, tmp_path):
    """--partitions: the topics read in part are watched for deletion and re-creation too, and
    each batch's topic ids confirmed: the recreated topic stops alone (same line), the store
    holds its old records only, and the other topic goes on; exit 3."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    t, other = kafka_topics.make("part", 2), kafka_topics.make("po", 2)
    produce(bootstrap, t, 20, partition=0)
    produce(bootstrap, other, 5, partition=0)
    old_id = _topic_id(admin, t)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    proc = _follow(bootstrap, store, "--topic", t, "--topic", other, "--partitions", "0",
                   "-X", "topic.metadata.refresh.interval.ms=20000", log=log)
    try:
        wait_until(lambda: stored_count(store, t) == 20, what="the first records")
        wait_until(lambda: stored_count(store, other) == 5, what="the other topic's records")
        old = read_store(store, t)
        _recreate(admin, t, partitions=2)
        new_id = _topic_id(admin, t)
        produce(bootstrap, t, 40, partition=0, tag=b"new")
        wait_until(lambda: _stopped_lines(log.read_text(), t), 120, "the recreated topic's line")
        produce(bootstrap, other, 7, partition=0, tag=b"o")
        wait_until(lambda: stored_count(store, other) == 12, what="the other topic goes on")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 3, err
    assert not [ln for ln in err.splitlines() if ln.startswith("kcompact: error:")], err
    (line,) = _stopped_lines(err, t)
    assert "the other topics go on" in line
    assert (f"deleted and created again (topic id {old_id} -> {new_id})" in line
            or f"it was deleted (topic id {old_id})" in line), line
    assert read_store(store, t) == old
    assert read_store(store, other) == {0: read_topic(bootstrap, other, 2)[0]}


def test_connect_standalone_stops_a_recreated_topic_alone(apache_kafka, kafka_topics, tmp_path):
    """The store sink under connect standalone, two followed topics: one deleted and created
    again is stopped alone (one line naming it and both ids), the other goes on, and the run
    exits 3 on SIGTERM, as kcompact mirror does; a later run on that store refuses the topic
    (exit 1, one line naming both ids)."""
    bootstrap, admin = apache_kafka.bootstrap, apache_kafka.admin
    t, other = kafka_topics.make("cre"), kafka_topics.make("cother")
    produce(bootstrap, t, 10)
    produce(bootstrap, other, 5)
    old_id = _topic_id(admin, t)
    store, log = str(tmp_path / "s"), tmp_path / "err.log"
    worker, conn = _connect_files(
        tmp_path, bootstrap, f"name=cre\ntopics={t},{other}\nstore.url={store}\n"
        "consumer.override.topic.metadata.refresh.interval.ms=1000\n")
    proc = _connect_follow(worker, conn, log)
    try:
        wait_until(lambda: stored_count(store, t) == 10, what="the first records")
        wait_until(lambda: stored_count(store, other) == 5, what="the other topic's records")
        old = read_store(store, t)
        _recreate(admin, t)
        new_id = _topic_id(admin, t)
        produce(bootstrap, t, 30, tag=b"new")
        wait_until(lambda: _stopped_lines(log.read_text(), t), 120, "the recreated topic's line")
        produce(bootstrap, other, 6, tag=b"o")
        wait_until(lambda: stored_count(store, other) == 11, what="the other topic goes on")
        assert proc.poll() is None, log.read_text()
    finally:
        rc = _stop(proc)
    err = log.read_text()
    assert rc == 3, err
    (line,) = _stopped_lines(err, t)
    assert line.startswith(f"kcompact: warning: cre-0: topic {t} stopped, the other topics go "
                           "on: it was deleted"), line
    assert old_id in line
    assert read_store(store, t) == old
    assert read_store(store, other) == read_topic(bootstrap, other, 1)

    worker, conn = _connect_files(tmp_path, bootstrap,
                                  f"name=again\ntopics={t},{other}\nstore.url={store}\n"
                                  "follow=false\n")
    res = kcompact("connect", "standalone", str(worker), str(conn))
    assert res.returncode == 1, res.stderr
    assert f"topic '{t}' was deleted and created again since store {store} copied it (topic " \
        f"id {old_id} then, {new_id} now)" in error_line(res)
    assert read_store(store, t) == old
