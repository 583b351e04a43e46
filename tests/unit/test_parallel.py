"""reput/parallel.py: both halves run, the second in the helper thread (or in the caller when the
helper is busy), errors reach the caller, and a call from the helper itself does not wait on
itself."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kcompact.reput import parallel


def test_both_runs_the_second_half_in_the_helper():
    who, started = {}, threading.Event()

    def first():  # waits for the helper to take the second half (else the caller runs it)
        who["a"] = threading.get_ident()
        assert started.wait(10)
        return 1

    def second():
        who["b"] = threading.get_ident()
        started.set()
        return 2
    assert parallel.both(first, second) == (1, 2)
    assert who["a"] == threading.get_ident()
    assert who["b"] != who["a"]


def test_errors_reach_the_caller_first_half_first():
    with pytest.raises(ValueError, match="first"):
        parallel.both(lambda: (_ for _ in ()).throw(ValueError("first")),
                      lambda: (_ for _ in ()).throw(KeyError("second")))
    with pytest.raises(KeyError, match="second"):
        parallel.both(lambda: 1, lambda: (_ for _ in ()).throw(KeyError("second")))


def test_a_call_from_the_helper_and_a_busy_helper_do_not_deadlock():
    # the helper's half calls both() itself: run there in turn
    a, (b, c) = parallel.both(lambda: 1, lambda: parallel.both(lambda: 2, lambda: 3))
    assert (a, b, c) == (1, 2, 3)
    # two callers at once: one finds the helper busy and runs its second half itself
    gate = threading.Event()
    out = {}

    def slow():
        gate.wait(5)
        return "slow"
    t = threading.Thread(target=lambda: out.setdefault("t", parallel.both(lambda: 0, slow)))
    t.start()
    time.sleep(0.05)  # the helper now waits in slow()
    assert parallel.both(lambda: "x", lambda: "y") == ("x", "y")
    gate.set()
    t.join(5)
    assert out["t"] == (0, "slow")


def test_worth_splitting():
    assert not parallel.worth_splitting(parallel.SPLIT_ABOVE - 1)
    assert parallel.worth_splitting(parallel.SPLIT_ABOVE) == ((os.cpu_count() or 1) > 1)
