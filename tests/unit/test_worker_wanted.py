"""How many messages the sink loop asks consume() for (connectors/framework/worker.py
``SinkTaskRunner._wanted``): the whole batch until every pending partition's end is known, then
no more than what is left, so that the last consume() of a bounded run returns with the last
records instead of waiting out its timeout; always the batch in follow mode."""

from __future__ import annotations

from types import SimpleNamespace

from kcompact.connectors.framework.api import TopicPartition
from kcompact.connectors.framework.sink_runner import SinkTaskRunner

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


def _runner(ends, positions, follow=False):
    return SimpleNamespace(follow=follow, _end_at_start=dict(ends),
                           metrics=SimpleNamespace(position=dict(positions)))


def wanted(r, pending, batch=100):
    return SinkTaskRunner._wanted(r, set(pending), batch)


def test_batch_until_every_pending_end_is_known():
    assert wanted(_runner({A: 50}, {A: 40, B: 0}), {A, B}) == 100
    assert wanted(_runner({A: 50, B: 10}, {A: 40, B: -1}), {A, B}) == 100  # position unknown


def test_what_is_left_when_less_than_a_batch():
    assert wanted(_runner({A: 50, B: 10}, {A: 40, B: 3}), {A, B}) == 17
    assert wanted(_runner({A: 50, B: 10}, {A: 40, B: 3}), {A}) == 10  # B is done


def test_batch_when_enough_is_left_or_nothing_seems_left():
    assert wanted(_runner({A: 500}, {A: 40}), {A}) == 100
    assert wanted(_runner({A: 50}, {A: 50}), {A}) == 100  # ended: the loop marks it done
    assert wanted(_runner({A: 50}, {A: 40}), set()) == 100


def test_follow_mode_always_asks_for_a_batch():
    assert wanted(_runner({A: 50}, {A: 40}, follow=True), {A}) == 100
