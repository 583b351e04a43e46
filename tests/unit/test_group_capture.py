"""Captured group offsets in the store (replication/group_capture.py) against a dict model:
``source`` records written by the capture writer (only changed positions), ``endpoint`` records
written by the Kafka endpoint's module (replication/group_offsets.py), read back merged (the
endpoint's commit wins) now and as of a time; compaction of the topic keeps the latest per key
and refuses an as-of read past its cleaned history. Also the mirror's group filter.
"""

from __future__ import annotations

import random

import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.compaction.history import AsOfInexactError
from kcompact.connectors.plugins.group_sync import GroupFilter
from kcompact.replication.group_capture import CaptureWriter, kept_offsets
from kcompact.replication.group_offsets import TOPIC, GroupOffset, GroupOffsets
from kcompact.reput.store import Store


def test_capture_and_merge_against_a_model(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).close()
    rng = random.Random(5)
    w = CaptureWriter(url, "mirror-groups")
    history: list[tuple[int, dict]] = []  # (capture time, model after it)
    model: dict[tuple, int] = {}
    appended = 0
    try:
        for step in range(12):
            now = 1_000_000 + step * 1000
            rows = [(f"g{rng.randrange(4)}", "orders", rng.randrange(3), rng.randrange(100), "")
                    for _ in range(6)]
            rows = list({(g, t, p): (g, t, p, o, m) for g, t, p, o, m in rows}.values())
            changed = sum(model.get((g, t, p)) != o for g, t, p, o, _ in rows)
            assert w.capture(rows, now_ms=now) == changed  # unchanged positions not rewritten
            appended += changed
            for g, t, p, o, _ in rows:
                model[(g, t, p)] = o
            history.append((now, dict(model)))
    finally:
        w.close()
    # a second writer (a restarted mirror) knows what is kept
    w2 = CaptureWriter(url, "mirror-groups")
    try:
        assert w2.kept() == model
    finally:
        w2.close()
    # the endpoint's own commit overrides the captured position of its group
    ep = GroupOffsets(url, "sid")
    try:
        ep.commit("g0", [("orders", 1, GroupOffset(4242))])
    finally:
        ep.close()
    with Store.open(url) as st:
        kept = kept_offsets(st)
        want = {**model, ("g0", "orders", 1): 4242}
        assert {k: v.offset for k, v in kept.items()} == want
        assert kept[("g0", "orders", 1)].origin == "endpoint"
        for now, snap in history:
            got = kept_offsets(st, as_of_ms=now)
            assert {k: v.offset for k, v in got.items()} == snap
            assert all(v.commit_ms <= now for v in got.values())


def test_compacted_captures_keep_the_latest_and_refuse_older_times(tmp_path):
    url = str(tmp_path / "s")
    Store.open(url, create=True).close()
    w = CaptureWriter(url, "mirror-groups")
    try:
        for i in range(5):
            w.capture([("g", "orders", 0, 10 * (i + 1), "")], now_ms=1_000_000 + i)
    finally:
        w.close()
    with Store.open(url, writer="c") as st:
        Compactor(st, CompactionOptions()).compact_partition(TOPIC, 0, force=True)
    with Store.open(url) as st:
        assert [r.offset for r in st.iter_records(TOPIC, 0)] == [4]
        assert kept_offsets(st)[("g", "orders", 0)].offset == 50
        assert kept_offsets(st, as_of_ms=1_000_004)[("g", "orders", 0)].offset == 50
        with pytest.raises(AsOfInexactError, match="the kept group offsets"):
            kept_offsets(st, as_of_ms=1_000_002)
        assert kept_offsets(st, as_of_ms=1_000_002, allow_inexact=True) == {}


def test_group_filter():
    f = GroupFilter("billing-.*", "billing-test")
    assert f("billing-eu") and not f("billing-test") and not f("xbilling-eu")
    assert GroupFilter(None, None)("anything")


# -- ListGroups while a coordinator loads (connectors/plugins/group_sync.py) ----------------------


class _ScriptedAdmin:
    """Answers list_consumer_groups with the listings given, one per call (the last repeats):
    the shape confluent-kafka's AdminClient gives, (valid, errors)."""

    def __init__(self, *listings):
        self.listings, self.calls = list(listings), 0

    def list_consumer_groups(self, request_timeout=None):
        from concurrent.futures import Future

        from confluent_kafka.admin import ListConsumerGroupsResult
        valid, errors = self.listings[min(self.calls, len(self.listings) - 1)]
        self.calls += 1
        fut = Future()
        fut.set_result(ListConsumerGroupsResult(valid=valid, errors=errors))
        return fut


def _listing(*names):
    from confluent_kafka import ConsumerGroupState, ConsumerGroupType
    from confluent_kafka.admin import ConsumerGroupListing
    return [ConsumerGroupListing(n, False, ConsumerGroupState.EMPTY, ConsumerGroupType.CLASSIC)
            for n in names]


def test_a_loading_coordinator_is_asked_again_until_it_lists_every_group():
    from confluent_kafka import KafkaError, KafkaException

    from kcompact.connectors.plugins.group_sync import list_groups
    loading = KafkaException(KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS))
    admin = _ScriptedAdmin((_listing("a"), [loading]), (_listing("a", "b"), []))
    got = list_groups(admin, timeout=5, pause_s=0.01)
    assert sorted(g.group_id for g in got.valid) == ["a", "b"] and admin.calls == 2
    # still loading when the time is up: what was listed, never an endless wait
    admin = _ScriptedAdmin((_listing("a"), [loading]))
    assert [g.group_id for g in list_groups(admin, timeout=0.05, pause_s=0.01).valid] == ["a"]
    # another error with nothing listed: raised as it came (the capture warns with it)
    denied = KafkaException(KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException) as e:
        list_groups(_ScriptedAdmin(([], [denied])), timeout=5, pause_s=0.01)
    assert e.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED
