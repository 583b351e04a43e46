"""Local append files reserve disk blocks past their end (fallocate KEEP_SIZE, reput/backend.py):
the size readers see is what was written, the reservation is given back at close and truncate,
nothing written is ever cut, and a process never holds more than its budget."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.reput import backend as bk

BLOCK = 4096


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


@pytest.fixture(autouse=True)
def reservations(monkeypatch):
    """This test's own account (files other tests left open hold theirs in the process's)."""
    r = bk._Reservations(bk.PREALLOCATE_BUDGET)
    monkeypatch.setattr(bk, "RESERVATIONS", r)
    return r


@pytest.fixture
def fs(tmp_path):
    f = bk.LocalBackend(str(tmp_path)).open_append("probe.bin")
    f.write(b"x")
    refused = f._reserved < 0
    f.close()
    if refused:
        pytest.skip(f"the file system under {tmp_path} refuses fallocate(KEEP_SIZE): append "
                    "files write without a reservation there (test_budget_and_model still run)")
    return bk.LocalBackend(str(tmp_path))


def test_blocks_are_reserved_while_open_and_given_back_at_close(fs, tmp_path):
    path = str(tmp_path / "log")
    f = fs.open_append("log")
    data = os.urandom(3 << 20)
    f.write(data[:1 << 20])
    f.write(data[1 << 20:])
    assert os.stat(path).st_size == len(data)  # readers see only what was written
    assert _allocated(path) >= len(data) + (2 << 20)  # reserved past the end
    assert bk.RESERVATIONS.held > 0
    mtime = os.stat(path).st_mtime_ns
    f.close()
    assert os.stat(path).st_size == len(data)
    assert _allocated(path) <= _round_up(len(data))
    assert os.stat(path).st_mtime_ns == mtime  # the last write's, for the commit log's retention
    with open(path, "rb") as r:
        assert r.read() == data
    assert bk.RESERVATIONS.held == 0


def test_truncate_gives_the_reservation_back(fs, tmp_path):
    path = str(tmp_path / "log")
    f = fs.open_append("log")
    f.write(b"a" * (1 << 20))
    f.truncate(10_000)
    assert _allocated(path) <= _round_up(10_000)
    assert bk.RESERVATIONS.held == 0
    f.write(b"b" * 100)
    f.close()
    with open(path, "rb") as r:
        assert r.read() == b"a" * 10_000 + b"b" * 100


def test_a_file_another_descriptor_grew_is_not_cut_at_close(fs, tmp_path):
    path = str(tmp_path / "log")
    f = fs.open_append("log")
    f.write(b"a" * 1000)
    with open(path, "ab") as other:
        other.write(b"b" * 500)
    f.close()  # its size (1000) is not the file's (1500): no truncate
    with open(path, "rb") as r:
        assert r.read() == b"a" * 1000 + b"b" * 500
    assert bk.RESERVATIONS.held == 0


def test_budget_and_model(tmp_path):
    """Random appends, truncates and reopens over three files against a bytes model, with a
    budget smaller than what they would reserve: contents always match, the process never holds
    more than the budget, and nothing is held once every file is closed."""
    bk.RESERVATIONS.budget = 1 << 20  # this test's account (the autouse fixture)
    fs = bk.LocalBackend(str(tmp_path))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["write", "truncate", "reopen"]),
                              st.integers(0, 700_000)), max_size=30))
    def run(ops):
        names = [f"f{i}-{os.urandom(4).hex()}" for i in range(3)]
        files = [fs.open_append(n) for n in names]
        model = [bytearray() for _ in names]
        try:
            for i, op, n in ops:
                if op == "write":
                    chunk = bytes([len(model[i]) % 251]) * n
                    files[i].write(chunk)
                    model[i] += chunk
                elif op == "truncate":
                    k = n % (len(model[i]) + 1)
                    files[i].truncate(k)
                    del model[i][k:]
                else:
                    files[i].close()
                    files[i] = fs.open_append(names[i])
                assert bk.RESERVATIONS.held <= bk.RESERVATIONS.budget
                assert os.stat(tmp_path / names[i]).st_size == len(model[i])
        finally:
            for f in files:
                f.close()
        assert bk.RESERVATIONS.held == 0
        for name, m in zip(names, model):
            with open(tmp_path / name, "rb") as r:
                assert r.read() == bytes(m)

    run()
