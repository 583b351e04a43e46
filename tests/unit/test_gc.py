"""kcompact.connectors.framework.gcmode.bulk_gc: raised thresholds while any bulk path runs, the old ones back after."""

import gc
import threading

from kcompact.connectors.framework.gcmode import BULK_THRESHOLD, bulk_gc


def test_nested_and_threaded_bulk_gc_restores_the_thresholds():
    old = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        inner_ready, release = threading.Event(), threading.Event()

        def other():
            with bulk_gc():
                inner_ready.set()
                release.wait(10)

        with bulk_gc():
            assert gc.get_threshold() == BULK_THRESHOLD
            t = threading.Thread(target=other)
            t.start()
            assert inner_ready.wait(10)
            with bulk_gc():
                assert gc.get_threshold() == BULK_THRESHOLD
            assert gc.get_threshold() == BULK_THRESHOLD
        assert gc.get_threshold() == BULK_THRESHOLD  # the other thread is still inside
        release.set()
        t.join()
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(100_000, 50, 50)  # never lowered
        with bulk_gc():
            assert gc.get_threshold() == (100_000, 50, 50)
        assert gc.get_threshold() == (100_000, 50, 50)
    finally:
        gc.set_threshold(*old)


def test_thresholds_come_back_after_an_error():
    old = gc.get_threshold()
    try:
        with bulk_gc():
            raise ValueError("x")
    except ValueError:
        pass
    assert gc.get_threshold() == old
