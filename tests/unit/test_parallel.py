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


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: ahead runs in the caller")
def test_ahead_gives_every_item_in_order_the_next_made_in_the_helper():
    caller = threading.get_ident()
    made_by = {}

    def fn(x):
        made_by[x] = threading.get_ident()
        return x * x
    assert list(parallel.ahead(fn, range(6))) == [(x, x * x) for x in range(6)]
    assert set(made_by) == set(range(6)) and caller not in made_by.values()
    assert list(parallel.ahead(fn, [])) == []
    # from the helper itself: in order, in the helper (no wait on itself)
    got = parallel.both(lambda: None, lambda: list(parallel.ahead(fn, range(3))))[1]
    assert got == [(0, 0), (1, 1), (2, 4)]


def test_ahead_raises_where_the_item_would_come_and_stops_cleanly():
    running = threading.Event()
    release = threading.Event()
    done = []

    def fn(x):
        if x == 2:
            raise ValueError("item 2")
        if x == 5:
            running.set()
            release.wait(10)
            done.append(x)
        return x
    got = []
    with pytest.raises(ValueError, match="item 2"):
        for x, y in parallel.ahead(fn, range(4)):
            got.append(y)
    assert got == [0, 1]
    # a caller that stops while the next item is being made: that one ends before ahead returns
    gen = parallel.ahead(fn, [4, 5, 6])
    assert next(gen) == (4, 4)
    if (os.cpu_count() or 1) > 1:
        assert running.wait(10)
        threading.Timer(0.2, release.set).start()
        gen.close()
        assert done == [5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_makes_its_own_helper():
    """The helper thread does not survive a fork: a child whose pool still counted it would
    wait forever on work nobody runs (a fork server's compaction child did)."""
    parallel.both(lambda: 1, lambda: 2)  # the helper exists in this process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        import signal
        signal.alarm(20)  # a hang ends the child with SIGALRM
        ok = list(parallel.ahead(lambda x: x + 1, range(5))) == [(x, x + 1) for x in range(5)]
        ok = ok and parallel.both(lambda: 1, lambda: 2) == (1, 2)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
