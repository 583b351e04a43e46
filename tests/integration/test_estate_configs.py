"""Issue 53 (configs as of a time): each change of a source topic's configs that a mirror
syncs is kept in the store's config history (docs/formats/configs.md), so that `kcompact
configs --describe --as-of TIME` shows the synced values as they were then and `restore
--as-of TIME` creates the target topic with the cleanup.policy of then, beside the records of
then (`--configs`: with the other synced configs of then too). The session's real Apache
Kafka 3.9.1 (incremental_alter_configs, describe_configs)."""

from __future__ import annotations

import json
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource,
                                   NewTopic)

from test_transactions import kcompact, wait_until  # noqa: E402
from topics import read_topic  # noqa: E402


def _configs(admin: AdminClient, topic: str) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return {k: e.value for k, e in admin.describe_configs([res])[res].result(30).items()}


def _produce(bootstrap: str, topic: str, rows) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    for k, v in rows:
        p.produce(topic, key=k, value=v)
    assert p.flush(60) == 0


def _describe(store: str, topic: str, *args: str) -> dict:
    res = kcompact("configs", "--store", store, "--topic", topic, "--describe", "--json", *args)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    return dict(doc, values={c["name"]: (c["value"], c["source"]) for c in doc["configs"]})


def test_configs_as_of_and_restore_as_of(apache_kafka, tmp_path):
    bootstrap = apache_kafka.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap})
    t = f"cfg{uuid.uuid4().hex[:6]}"
    admin.create_topics([NewTopic(t, 1, 1, config={"cleanup.policy": "delete",
                                                   "retention.ms": "86400000"})],
                        operation_timeout=30)[t].result()
    wait_until(lambda: t in admin.list_topics(timeout=10).topics, 30, t)
    _produce(bootstrap, t, [(b"a", b"1"), (b"b", b"1")])
    store = str(tmp_path / "s")
    before_any = int(time.time() * 1000) - 1
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", t, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    first = _describe(store, t)
    assert first["values"]["cleanup.policy"] == ("delete", "synced")
    assert first["values"]["retention.ms"] == (86400000, "synced")
    t1 = first["synced_ms"]

    # the source changes its configs; the next mirror syncs them and keeps the change
    wait_until(lambda: time.time() * 1000 > t1 + 5, 5, "the clock moves")
    res = ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[
        ConfigEntry("cleanup.policy", "compact",
                    incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.ms", "172800000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result(30)
    wait_until(lambda: _configs(admin, t)["cleanup.policy"] == "compact", 30, "altered")
    _produce(bootstrap, t, [(b"a", b"2")])
    res = kcompact("mirror", "--bootstrap-servers", bootstrap, "--topic", t, "--store", store,
                   "--engine", "local")
    assert res.returncode == 0, res.stderr
    now = _describe(store, t)
    assert now["values"]["cleanup.policy"] == ("compact", "synced")
    assert now["values"]["retention.ms"] == (172800000, "synced")
    assert now["synced_ms"] > t1

    # --as-of: the values synced then; before the first sync: none (the store's defaults)
    then = _describe(store, t, "--as-of", str(t1))
    assert then["as_of_source"] == "history" and then["synced_ms"] == t1
    assert then["values"]["cleanup.policy"] == ("delete", "synced")
    assert then["values"]["retention.ms"] == (86400000, "synced")
    early = _describe(store, t, "--as-of", str(before_any))
    assert early["as_of_source"] == "defaults"
    assert early["values"]["cleanup.policy"] == ("compact", "default")
    text = kcompact("configs", "--store", store, "--topic", t, "--describe", "--as-of",
                    str(t1)).stdout
    assert "cleanup.policy=delete" in text and " as of " in text, text
    # a local override applies as it is now, whatever the time
    assert kcompact("configs", "--store", store, "--topic", t, "--alter", "--add-config",
                    "retention.ms=5000").returncode == 0
    assert _describe(store, t, "--as-of", str(t1))["values"]["retention.ms"] == (5000,
                                                                                  "override")
    # --as-of goes with --describe
    bad = kcompact("configs", "--store", store, "--topic", t, "--alter", "--add-config",
                   "retention.ms=1", "--as-of", str(t1))
    assert bad.returncode == 2 and "--as-of goes with --describe" in bad.stderr

    # restore --as-of t1: the records of then, on a topic created with the policy of then
    old, new = f"{t}-then", f"{t}-now"
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers", bootstrap,
                   "--to-topic", old, "--as-of", str(t1))
    assert res.returncode == 0, res.stderr
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers", bootstrap,
                   "--to-topic", new)
    assert res.returncode == 0, res.stderr
    assert _configs(admin, old)["cleanup.policy"] == "delete"
    assert _configs(admin, new)["cleanup.policy"] == "compact"
    # without --configs only the policy is set: retention.ms is the target's default
    assert _configs(admin, old)["retention.ms"] == "604800000"
    # --configs: the synced configs too, as of then and now (the local override is the
    # store's own setting, not the source's: not applied)
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers", bootstrap,
                   "--to-topic", f"{t}-cfg-then", "--as-of", str(t1), "--configs")
    assert res.returncode == 0, res.stderr
    assert (f"restore: configs: {t}-cfg-then created with cleanup.policy=delete, "
            "retention.ms=86400000") in res.stderr, res.stderr
    then_cfg = _configs(admin, f"{t}-cfg-then")
    assert (then_cfg["cleanup.policy"], then_cfg["retention.ms"]) == ("delete", "86400000")
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers", bootstrap,
                   "--to-topic", f"{t}-cfg-now", "--configs")
    assert res.returncode == 0, res.stderr
    now_cfg = _configs(admin, f"{t}-cfg-now")
    assert (now_cfg["cleanup.policy"], now_cfg["retention.ms"]) == ("compact", "172800000")
    # a target that exists keeps its own (the same restore again, now with --configs)
    res = kcompact("restore", "--store", store, "--topic", t, "--bootstrap-servers", bootstrap,
                   "--to-topic", old, "--as-of", str(t1), "--configs")
    assert res.returncode == 0, res.stderr
    assert f"restore: configs: {old} exists; its configs are left as they are" in res.stderr
    assert _configs(admin, old)["cleanup.policy"] == "delete"
    assert sorted((k, v) for _ts, k, v, _h in read_topic(bootstrap, old, 1, offsets=False)[0]) \
        == [(b"a", b"1"), (b"b", b"1")]

    # the history is an internal topic of the store: two records of the topic, one per change
    doc = kcompact("dump", "--store", store, "--topic", "__kcompact-configs", "--partition", "0",
                   "--json")
    assert doc.returncode == 0, doc.stderr
    rows = [json.loads(line) for line in doc.stdout.splitlines()]
    assert [json.loads(r["key"]) for r in rows] == [["topic", t], ["topic", t]]
    values = [json.loads(r["value"]) for r in rows]
    assert [v["synced"]["retention.ms"] for v in values] == ["86400000", "172800000"]
    assert [r["timestamp"] for r in rows] == [v["synced_ms"] for v in values] == [
        t1, now["synced_ms"]]
