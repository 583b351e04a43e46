"""Topic configs by source (reput/topic_configs.py, docs/formats/store-json.md): default <
synced from Kafka < local override, checked against a plain dict model; store.json written
before ``topic_configs`` opens unchanged; `kcompact configs` (connectors/apps/configs.py) on a
local and an S3 store; changes from several processes at once all land (store.json.lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend, shared_store_at, store_at  # noqa: E402,F401

from kcompact.connectors import cli  # noqa: E402
from kcompact.reput import MemoryBackend, Store, TopicConfig  # noqa: E402
from kcompact.reput.config import ConfigError  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.topic_configs import TopicConfigLayers  # noqa: E402

DEFAULTS = TopicConfig().to_dict()
VALUES = {
    "cleanup.policy": st.sampled_from(["compact", "compact,delete", "delete"]),
    "delete.retention.ms": st.integers(0, 10**12),
    "min.compaction.lag.ms": st.integers(0, 10**9),
    "max.compaction.lag.ms": st.integers(1, 2**63 - 1),
    "min.cleanable.dirty.ratio": st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]),
    "segment.bytes": st.integers(1 << 14, (1 << 31) - 1),
    "retention.ms": st.integers(-1, 10**12),
}
config_dicts = st.fixed_dictionaries({}, optional=VALUES)
ops = st.lists(st.one_of(
    st.tuples(st.just("sync"), config_dicts),
    st.tuples(st.just("add"), config_dicts),
    st.tuples(st.just("delete"), st.lists(st.sampled_from(sorted(VALUES)), unique=True)),
    st.just(("reopen", None))), max_size=12)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_precedence_matches_a_dict_model(steps):
    fs = MemoryBackend()
    store = Store.create("memory://", fs=fs)
    synced: dict = {}
    overrides: dict = {}
    for op, arg in steps:
        if op == "sync":
            store.sync_topic_config("t", arg, origin="k:9092")
            synced = dict(arg)
        elif op == "add":
            store.alter_topic_config("t", add=arg)
            overrides.update(arg)
        elif op == "delete":
            store.alter_topic_config("t", delete=arg)
            for k in arg:
                overrides.pop(k, None)
        else:
            store = Store.open("memory://", fs=fs)
        want = {**DEFAULTS, **synced, **overrides}
        assert store.topic_config("t").to_dict() == want
        described = {e.name: (e.value, e.source) for e in
                     store.topic_config_layers("t").describe()}
        assert described == {k: (v, "override" if k in overrides else
                                 "synced" if k in synced else "default")
                             for k, v in want.items()}
        # what a reader that knows only store.json's `topics` sees is the effective config
        doc = json.loads(fs.read("store.json"))
        if "t" in doc["topics"]:
            assert doc["topics"]["t"] == want


def test_overrides_survive_a_sync_and_the_synced_value_is_kept_under_them():
    store = Store.create("memory://", fs=MemoryBackend())
    store.sync_topic_config("t", {"delete.retention.ms": 12345, "segment.bytes": 1 << 20})
    store.alter_topic_config("t", add={"delete.retention.ms": "7"})
    store.sync_topic_config("t", {"delete.retention.ms": 999, "segment.bytes": 1 << 21})
    cfg = store.topic_config("t")
    assert cfg.delete_retention_ms == 7 and cfg.segment_bytes == 1 << 21
    entry = {e.name: e for e in store.topic_config_layers("t").describe()}
    assert entry["delete.retention.ms"].source == "override"
    assert entry["delete.retention.ms"].synced == 999
    store.alter_topic_config("t", delete=["delete.retention.ms"])
    assert store.topic_config("t").delete_retention_ms == 999


def test_an_unchanged_sync_does_not_rewrite_store_json():
    fs = MemoryBackend()
    store = Store.create("memory://", fs=fs)
    store.sync_topic_config("t", {"retention.ms": 5})
    before = fs.read("store.json")
    store.sync_topic_config("t", {"retention.ms": 5})
    assert fs.read("store.json") == before


def test_a_bad_value_or_key_changes_nothing():
    fs = MemoryBackend()
    store = Store.create("memory://", fs=fs)
    store.alter_topic_config("t", add={"retention.ms": 5})
    before = fs.read("store.json")
    with pytest.raises(ConfigError, match=r"segment.bytes: 1 is out of range \[16384, "):
        store.alter_topic_config("t", add={"retention.ms": 6, "segment.bytes": 1})
    with pytest.raises(ConfigError, match="unknown topic config 'nope'; known keys: "):
        store.alter_topic_config("t", delete=["nope"])
    with pytest.raises(ConfigError, match="retention.ms: expected an integer"):
        store.sync_topic_config("t", {"retention.ms": "x"})
    assert fs.read("store.json") == before


def test_a_store_json_written_before_topic_configs_opens_unchanged():
    fs = MemoryBackend()
    Store.create("memory://", fs=fs)
    doc = json.loads(fs.read("store.json"))
    for key in ("crc32c", "features"):  # (a store.json that old has neither: issue 27's)
        doc.pop(key, None)
    legacy = dict(DEFAULTS, **{"delete.retention.ms": 5})
    doc["topics"] = {"old": legacy}
    fs.write_atomic("store.json", json.dumps(doc).encode())
    store = Store.open("memory://", fs=fs)
    assert store.topic_config("old").to_dict() == legacy
    sources = {e.name: e.source for e in store.topic_config_layers("old").describe()}
    assert sources["delete.retention.ms"] == "override"
    assert sources["segment.bytes"] == "default"
    # a sync never hides what was set through the Python API before
    store.sync_topic_config("old", {"delete.retention.ms": 9, "retention.ms": 11})
    assert store.topic_config("old").delete_retention_ms == 5
    assert store.topic_config("old").retention_ms == 11
    assert TopicConfigLayers.from_legacy(None) == TopicConfigLayers()


def test_a_writer_sees_a_change_made_by_another_process_when_it_reloads(tmp_path):
    url = str(tmp_path / "s")
    with Store.open(url, writer="w", create=True) as writer:
        writer.append(RecordBatch.from_records("t", [(0, 0, 1, b"k", b"v")]))
        pl = writer.writable_partition("t", 0)
        with Store.open(url) as other:
            other.alter_topic_config("t", add={"min.cleanable.dirty.ratio": 0.05})
        assert pl.config.min_cleanable_dirty_ratio == 0.5
        writer.reload_topic_configs()
        assert pl.config.min_cleanable_dirty_ratio == 0.05
        assert writer.topic_config("t").min_cleanable_dirty_ratio == 0.05


_ALTER_LOOP = """
import sys
from kcompact.reput import Store
url, topic = sys.argv[1], sys.argv[2]
for i in range(25):
    with Store.open(url) as s:
        s.alter_topic_config(topic, add={"retention.ms": i})
"""


def test_changes_from_several_processes_at_once_all_land(shared_store_at):
    url = shared_store_at()
    Store.create(url).close()
    procs = [subprocess.Popen([sys.executable, "-c", _ALTER_LOOP, url, f"t{i}"])
             for i in range(4)]
    assert [p.wait(120) for p in procs] == [0] * 4
    with Store.open(url) as s:
        assert {t: s.topic_config(t).retention_ms for t in s.topics()} == \
            {f"t{i}": 24 for i in range(4)}


# -- kcompact configs (in-process, local and S3) ------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_configs_command_on_each_backend(store_at, capsys):
    url = store_at()
    with Store.open(url, writer="w", create=True) as st_:
        st_.append(RecordBatch.from_records("orders", [(0, 0, 1, b"k", b"v")]))
        st_.sync_topic_config("orders", {"delete.retention.ms": 12345}, origin="b:9092")
    rc, out, err = _cli(capsys, "configs", "--store", url, "--topic", "orders", "--describe")
    assert rc == 0, err
    assert "delete.retention.ms=12345" in out and "synced from Kafka" in out
    rc, out, err = _cli(capsys, "configs", "--store", url, "--topic", "orders", "--alter",
                        "--add-config",
                        "min.cleanable.dirty.ratio=0.1,cleanup.policy=[compact,delete]")
    assert (rc, out.strip()) == (0, "Completed updating config for topic orders."), err
    rc, out, _ = _cli(capsys, "configs", "--store", url, "--topic", "orders", "--describe",
                      "--json")
    doc = json.loads(out)
    got = {c["name"]: (c["value"], c["source"]) for c in doc["configs"]}
    assert got["min.cleanable.dirty.ratio"] == (0.1, "override")
    assert got["cleanup.policy"] == ("compact,delete", "override")
    assert got["delete.retention.ms"] == (12345, "synced")
    assert got["segment.bytes"] == (1 << 30, "default")
    assert doc["synced_from"] == "b:9092"
    rc, out, _ = _cli(capsys, "inspect", "--store", url, "--json")
    t = json.loads(out)["topics"][0]
    assert t["config"]["min.cleanable.dirty.ratio"] == 0.1
    assert t["config_source"]["delete.retention.ms"] == "synced"
    rc, _, err = _cli(capsys, "configs", "--store", url, "--topic", "orders", "--alter",
                      "--delete-config", "min.cleanable.dirty.ratio,retention.ms")
    assert rc == 0 and "retention.ms had no local override" in err
    with Store.open(url) as s:
        assert s.topic_config("orders").min_cleanable_dirty_ratio == 0.5


@pytest.mark.parametrize("args, message", [
    (["--add-config", "nope=1"], "kcompact: error: unknown topic config 'nope'; known keys: "),
    (["--add-config", "segment.bytes=12"],
     "kcompact: error: segment.bytes: 12 is out of range [16384, 2147483647]"),
    (["--add-config", "min.cleanable.dirty.ratio=2"],
     "kcompact: error: min.cleanable.dirty.ratio: 2.0 is out of range [0, 1]"),
    (["--add-config", "retention.ms"], "kcompact: error: --add-config: 'retention.ms' is not "
     "key=value"),
    (["--delete-config", "nope"], "kcompact: error: unknown topic config 'nope'"),
])
def test_configs_refuses_bad_input_in_one_line_and_writes_nothing(store_at, capsys, args,
                                                                  message):
    url = store_at()
    with Store.open(url, create=True) as s:
        s.alter_topic_config("t", add={"retention.ms": 5})
        before = s.fs.read("store.json")
    rc, out, err = _cli(capsys, "configs", "--store", url, "--topic", "t", "--alter", *args)
    assert rc == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1
    with Store.open(url) as s:
        assert s.fs.read("store.json") == before


def test_configs_usage_and_unknown_topic(store_at, capsys):
    url = store_at()
    Store.create(url).close()
    with pytest.raises(SystemExit) as e:
        cli.main(["configs", "--store", url, "--topic", "t", "--alter"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["configs", "--store", url, "--topic", "t"])
    assert e.value.code == 2
    capsys.readouterr()
    rc, _, err = _cli(capsys, "configs", "--store", url, "--topic", "t", "--describe")
    assert rc == 1 and "topic 't' is not in store" in err


def test_a_replica_keeps_its_masters_configs_as_synced_apart_from_its_overrides(tmp_path,
                                                                                   capsys):
    """replication/replica.py ``_sync_configs``: the master's effective values (those not at
    the default) are the replica's synced configs from ``master URL``; an override set on the
    replica wins and survives the next sync; a key the master resets leaves the replica too;
    a replica written before (the master's values kept as local overrides) is mended once."""
    from types import SimpleNamespace

    from kcompact.replication.replica import Replicator

    url = str(tmp_path / "replica")
    master = "http://127.0.0.1:8470"

    def doc(**cfg) -> dict:
        return {"topics": [{"topic": "orders",
                            "config": TopicConfig().with_overrides(cfg).to_dict()}]}

    with Store.open(url, writer="r", create=True) as st_:
        replica = SimpleNamespace(client=SimpleNamespace(url=master), store=st_)
        Replicator._sync_configs(replica, doc(**{"delete.retention.ms": 12345,
                                              "min.cleanable.dirty.ratio": 0.2}))
        ly = st_.topic_config_layers("orders")
        assert dict(ly.synced) == {"delete.retention.ms": 12345, "min.cleanable.dirty.ratio": 0.2}
        assert dict(ly.overrides) == {} and ly.synced_from == f"master {master}"
        st_.alter_topic_config("orders", {"delete.retention.ms": 5})
        Replicator._sync_configs(replica, doc(**{"delete.retention.ms": 999}))
        ly = st_.topic_config_layers("orders")
        assert dict(ly.synced) == {"delete.retention.ms": 999}  # the ratio was reset
        assert dict(ly.overrides) == {"delete.retention.ms": 5}
        assert st_.topic_config("orders").delete_retention_ms == 5
    rc, out, err = _cli(capsys, "configs", "--store", url, "--topic", "orders", "--describe")
    assert rc == 0, err
    assert f"(synced from master {master} " in out
    assert "delete.retention.ms=5" in out and "local override; synced value 999" in out
    assert "min.cleanable.dirty.ratio=0.5" in out
    assert "synced from Kafka" not in out

    # a replica of an older kcompact: the master's values were copied as local overrides
    old = str(tmp_path / "old")
    with Store.open(old, writer="r", create=True) as st_:
        st_.set_topic_config("orders", {"delete.retention.ms": 12345, "retention.ms": 1000})
        replica = SimpleNamespace(client=SimpleNamespace(url=master), store=st_)
        Replicator._sync_configs(replica, doc(**{"delete.retention.ms": 12345}))
        ly = st_.topic_config_layers("orders")
        # retention.ms=1000 is not the master's: kept as the override it may be
        assert dict(ly.synced) == {"delete.retention.ms": 12345}
        assert dict(ly.overrides) == {"retention.ms": 1000}
