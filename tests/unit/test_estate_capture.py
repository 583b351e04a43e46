"""Captured ACL bindings and schemas in the store (replication/acl_capture.py,
replication/schema_capture.py) against models: captures of random topic sets and bindings read
back now and as of each capture time (a binding gone from the source is gone from later reads,
kept as of before; a capture concerns only its own topics and groups); the restore's ACL plan
(principal map, --to-topic rename); schema closures references first; the restore's principal
map parsing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.connectors.plugins.store_source.acls import parse_principal_map, plan_acls
from kcompact.connectors.plugins.store_source.errors import RestoreError
from kcompact.replication.acl_capture import (AclCaptureWriter, acl_bindings, concerns,
                                             kept_acls)
from kcompact.replication.schema_capture import KeptSchema, SchemaCaptureWriter, kept_schemas
from kcompact.reput.store import Store

TOPICS = ["orders", "ord-x", "pay"]
GROUPS = ["billing", "audit"]
BINDINGS = [(rt, name, pt, pr, "*", op, "ALLOW")
            for rt, name, pt in [("TOPIC", "orders", "LITERAL"), ("TOPIC", "pay", "LITERAL"),
                                 ("TOPIC", "ord", "PREFIXED"), ("TOPIC", "*", "LITERAL"),
                                 ("TOPIC", "zzz", "LITERAL"), ("GROUP", "billing", "LITERAL"),
                                 ("GROUP", "a", "PREFIXED")]
            for pr in ("User:alice", "User:bob") for op in ("READ", "WRITE")]

captures = st.lists(st.tuples(st.sets(st.sampled_from(TOPICS), min_size=1),
                              st.sets(st.sampled_from(GROUPS)),
                              st.sets(st.sampled_from(BINDINGS))), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=captures)
def test_acl_captures_against_a_model(tmp_path_factory, steps):
    url = str(tmp_path_factory.mktemp("acl") / "s")
    Store.open(url, create=True).close()
    model: set[tuple] = set()
    history: list[tuple[int, set]] = []
    w = AclCaptureWriter(url, "mirror-acls")
    try:
        for i, (topics, groups, source) in enumerate(steps):
            now = 1_000_000 + i * 1000
            current = {b for b in source if concerns(b, topics, groups)}
            gone = {b for b in model if concerns(b, topics, groups)} - current
            added, removed = w.capture(source, topics, groups, now_ms=now)
            assert (added, removed) == (len(current - model), len(gone))
            model = (model - gone) | current
            history.append((now, set(model)))
    finally:
        w.close()
    with Store.open(url) as s:
        if not model and not any(h for _, h in history):
            return  # nothing ever kept: the store may keep no ACL topic at all
        kept = kept_acls(s)
        assert set(kept.bindings) == model
        for now, want in history:
            assert set(kept_acls(s, as_of_ms=now).bindings) == want
        dicts = acl_bindings(s)
        assert all(set(d) == {"resource_type", "resource_name", "pattern_type", "principal",
                              "host", "operation", "permission_type"} for d in dicts)
        assert len(dicts) == len(model)
    # a restarted writer knows what is kept: an unchanged capture adds and removes nothing
    w2 = AclCaptureWriter(url, "mirror-acls")
    try:
        topics, groups, source = steps[-1]
        assert w2.capture(source, topics, groups) == (0, 0)
    finally:
        w2.close()


def test_acl_plan_renames(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).close()
    w = AclCaptureWriter(url, "m-acls")
    try:
        w.capture(BINDINGS, ["orders"], [], now_ms=5)
    finally:
        w.close()
    with Store.open(url) as s:
        plan = plan_acls(s, "orders", "orders-copy", {"User:alice": "User:carol"})
    names = {(b[1], b[2]) for b in plan.bindings}
    assert names == {("orders-copy", "LITERAL"), ("ord", "PREFIXED"), ("*", "LITERAL")}
    assert {b[3] for b in plan.bindings} == {"User:carol", "User:bob"}
    assert plan.captured_ms == 5


def test_principal_map_parsing():
    assert parse_principal_map(["alice=User:carol", "Group:x=Group:y"]) == {
        "User:alice": "User:carol", "Group:x": "Group:y"}
    for bad in (["alice"], ["=x"], ["a=b", "a=c"]):
        with pytest.raises(RestoreError):
            parse_principal_map(bad)


def test_schemas_kept_once_and_closed_references_first(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).close()
    addr = KeptSchema(7, "A", "AVRO", (), (("addr", 1),))
    order = KeptSchema(3, "O", "AVRO", (("ex.A", "addr", 1),), (("orders-value", 1),))
    key = KeptSchema(9, "K", "AVRO", (), (("orders-key", 1),))
    w = SchemaCaptureWriter(url, "m-schemas")
    try:
        assert w.keep([order, addr], {"orders": ({3}, set())}, now_ms=10) == 2
        assert w.keep([order, key], {"orders": ({9}, set()), "x": ({404}, {404})},
                      now_ms=20) == 1
    finally:
        w.close()
    with Store.open(url) as s:
        kept = kept_schemas(s)
        assert kept.topics["orders"].ids == {3, 9} and kept.topics["x"].missing == {404}
        assert [k.id for k in kept.closure({3, 9})] == [7, 3, 9]  # the reference first
        then = kept_schemas(s, as_of_ms=15)
        assert set(then.schemas) == {3, 7} and then.topics["orders"].ids == {3}
        without_ref = type(kept)({3: order}, kept.topics)  # the referenced schema not kept
        with pytest.raises(KeyError, match="references"):
            without_ref.closure({3})


# -- the synced configs' history (replication/config_capture.py) ---------------------------------

from kcompact.replication.config_capture import (TOPIC as CONFIGS_TOPIC,  # noqa: E402
                                                 ConfigCaptureWriter, kept_configs,
                                                 layers_as_of, synced_as_of)

config_steps = st.lists(st.tuples(st.sampled_from(TOPICS),
                                  st.dictionaries(st.sampled_from(["retention.ms",
                                                                   "cleanup.policy"]),
                                                  st.sampled_from(["1000", "2000", "compact",
                                                                   "delete"]), max_size=2),
                                  st.integers(1, 3)), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=config_steps)
def test_config_history_against_a_model(tmp_path_factory, steps):
    """Synced values kept whenever they change, read back as of every time against a model
    (values in effect since the step's time; a topic never synced, or synced only at the
    defaults, has none); two writers with stale views of one store lose nothing."""
    url = str(tmp_path_factory.mktemp("cfg") / "s")
    Store.open(url, create=True).close()
    writers = [ConfigCaptureWriter(url, "w1"), ConfigCaptureWriter(url, "w2")]
    model: list[tuple[int, str, dict]] = []      # (since, topic, values)
    now = 1_000
    try:
        for i, (topic, values, gap) in enumerate(steps):
            now += gap
            changed = writers[i % 2].keep({topic: values}, "k:9092", {topic: now}, now_ms=now)
            last = next((v for _, t, v in reversed(model) if t == topic), {})
            assert changed == ([topic] if values != last else [])
            if values != last:
                model.append((now, topic, values))
    finally:
        for w in writers:
            w.close()
    with Store.open(url) as s:
        if not model:
            assert CONFIGS_TOPIC not in s.topics()  # defaults only: nothing written
        for t_ms in range(1_000, now + 2):
            want = {}
            for since, topic, values in model:
                if since <= t_ms:
                    want[topic] = values
            got = {t: dict(kc.synced) for t, kc in kept_configs(s, as_of_ms=t_ms).items()}
            assert got == {t: v for t, v in want.items() if t in got or v}, t_ms
            for topic in TOPICS:
                values, source = synced_as_of(s, topic, t_ms)
                assert values == want.get(topic, {})
                assert source == ("history" if topic in got else "defaults"
                                  if any(m[1] == topic for m in model) else "current")


def test_config_history_of_a_store_without_one(tmp_path):
    """A store mirrored before the history was kept: --as-of answers with the current values;
    the first capture's timestamp is when store.json says they were synced."""
    url = str(tmp_path / "s")
    with Store.open(url, create=True) as s:
        s.sync_topic_config("t", {"retention.ms": "5000", "cleanup.policy": "delete"})
        synced_ms = s.topic_config_layers("t").synced_ms
        ly, source = layers_as_of(s, "t", 1)
        assert source == "current" and ly.effective(s.meta.defaults).cleanup_policy == "delete"
    w = ConfigCaptureWriter(url, "w")
    try:
        assert w.keep({"t": {"retention.ms": "5000", "cleanup.policy": "delete"}}, "k",
                      {"t": synced_ms}, now_ms=synced_ms + 10_000) == ["t"]
    finally:
        w.close()
    with Store.open(url) as s:
        assert synced_as_of(s, "t", synced_ms) == ({"retention.ms": "5000",
                                                     "cleanup.policy": "delete"}, "history")
        assert synced_as_of(s, "t", synced_ms - 1) == ({}, "defaults")
        ly, _ = layers_as_of(s, "t", synced_ms - 1)
        assert ly.effective(s.meta.defaults).cleanup_policy == "compact"  # the store's default
