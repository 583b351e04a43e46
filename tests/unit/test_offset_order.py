"""Store.append's offset-order check (reput/store.py ``_check_order``): offsets must strictly
increase within each partition of a batch. Partition numbers in [0, ORDER_KERNEL_MAX_PARTITION]
take one compiled pass (reput/_native.c ``offset_order``), larger ones an argsort; both
refuse the same batches with the same message, return the batch's partitions, and leave the
commit log untouched when they refuse."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.reput import write_path as S
from kcompact.reput.errors import OffsetOrderError
from kcompact.reput.record import BytesColumn, RecordBatch
from kcompact.reput.store import Store


def _batch(parts, offs) -> RecordBatch:
    n = len(parts)
    return RecordBatch("t", np.asarray(parts, np.int32), np.asarray(offs, np.int64),
                       np.zeros(n, np.int64), BytesColumn.empties(n), BytesColumn.empties(n),
                       BytesColumn.empties(n))


def _expected(parts, offs):
    """The first record (in batch order) whose offset is not above its partition's previous."""
    last = {}
    for i, (p, o) in enumerate(zip(parts, offs)):
        if p in last and o <= last[p]:
            return f"t-{p}: offset {o} follows {last[p]} in the batch"
        last[p] = o
    return None


@pytest.fixture
def store(tmp_path):
    st_ = Store.open(str(tmp_path / "s"), writer="w", create=True)
    yield st_
    st_.close()


@pytest.mark.parametrize("kernel", [True, False])
@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=30))
def test_both_paths_agree_with_a_plain_loop(tmp_path_factory, kernel, rows):
    parts = [p for p, _ in rows]
    offs = [o for _, o in rows]
    want = _expected(parts, offs)
    with Store.open(str(tmp_path_factory.mktemp("s")), writer="w", create=True) as st_:
        old = S.ORDER_KERNEL_MAX_PARTITION
        S.ORDER_KERNEL_MAX_PARTITION = 1 << 16 if kernel else -1
        try:
            if want is None:
                assert st_._check_order(_batch(parts, offs)) == sorted(set(parts))
            else:
                with pytest.raises(OffsetOrderError) as e:
                    st_._check_order(_batch(parts, offs))
                if kernel:  # the argsort path names the first bad record in partition order
                    assert str(e.value).startswith(want)
        finally:
            S.ORDER_KERNEL_MAX_PARTITION = old


def test_partition_numbers_beyond_the_kernel_range(store):
    assert store._check_order(_batch([70_000, 2, 70_000], [1, 1, 2])) == [2, 70_000]
    with pytest.raises(OffsetOrderError, match="t-70000: offset 1 follows 3"):
        store._check_order(_batch([70_000, 2, 70_000], [3, 1, 1]))


def test_refused_batch_writes_nothing(store):
    before = store.commitlog.end
    with pytest.raises(OffsetOrderError, match="t-1: offset 5 follows 5 in the batch"):
        store.append(_batch([3, 1, 3, 1], [0, 5, 1, 5]))
    assert store.commitlog.end == before
    assert store.append(_batch([3, 1, 3, 1], [0, 5, 1, 6])) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(-3, 12)), max_size=40))
def test_c_offset_order_agrees_with_numba(rows):
    """The C kernel (the path a store takes when built) against numba's twin."""
    import _oracle_kernels as K
    if S._N is None:
        pytest.skip("the C module is not built")
    parts = np.array([p for p, _ in rows], np.int32)
    offs = np.array([o for _, o in rows], np.int64)
    seen = np.full(6, 9, np.uint8)
    i = S._N.offset_order(parts, offs, 5, seen)
    j, seen_nb = K.offset_order(parts, offs, 5)
    assert i == j
    if i < 0:
        assert seen.tolist() == seen_nb.tolist()
    with pytest.raises(ValueError, match="offset_order"):
        S._N.offset_order(np.array([7], np.int32), np.array([1], np.int64), 5, seen)
