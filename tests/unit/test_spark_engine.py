"""The Spark engine's pure helpers (no JVM, no Spark: the real jobs are in
tests/integration/test_spark.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kcompact.connectors.apps.spark.mirror_job import spark_writer_id
from kcompact.connectors.apps.spark.session import master_with_retries, task_error_line
from kcompact.reput.filenames import validate_writer


def test_importing_the_engine_loads_no_pyspark():
    code = ("import sys, kcompact.connectors.apps.spark.mirror_job, "
            "kcompact.connectors.apps.spark.compact_job; print('pyspark' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("master,want", [
    ("local", "local[1,4]"), ("local[*]", "local[*,4]"), ("local[2]", "local[2,4]"),
    ("local[ 3 ]", "local[3,4]"), ("local[2,7]", "local[2,7]"),
    ("spark://h:7077", "spark://h:7077"), ("yarn", "yarn"), ("local-cluster[2,1,1024]",
                                                            "local-cluster[2,1,1024]"),
])
def test_local_masters_get_task_retries(master, want):
    assert master_with_retries(master) == want


def test_writer_ids_are_deterministic_and_valid():
    assert spark_writer_id("orders", 3) == "spark-orders-3"
    long = "t" * 249  # Kafka's longest topic name
    a, b = spark_writer_id(long, 0), spark_writer_id(long, 1)
    assert a != b and a == spark_writer_id(long, 0)
    assert spark_writer_id(long[:-1] + "u", 0) != a
    for w in (a, b, spark_writer_id("a.b_c-d", 12)):
        assert validate_writer(w) == w


def test_task_error_line():
    text = ("An exception was thrown from the Python worker:\nTraceback (most recent call "
            "last):\n  File \"x.py\", line 1, in f\n    raise E\n"
            "kcompact.connectors.apps.spark.errors.MirrorTaskError: mirror task t-1 (attempt 4): "
            "locked\n")
    assert task_error_line(text) == "mirror task t-1 (attempt 4): locked"
    assert task_error_line("Traceback:\nRuntimeError: boom\n SQLSTATE: 38000") == \
        "RuntimeError: boom"
    assert task_error_line("something odd happened\nmore") == "something odd happened"


def test_a_worker_freezes_its_heap_once():
    """The first mirror task of a Python worker freezes what is alive (gc.freeze), later ones
    do not freeze again (what their tasks leave behind stays collectable)."""
    code = """
import gc
from kcompact.connectors.apps.spark.mirror_job import _freeze_heap
assert gc.get_freeze_count() == 0
_freeze_heap()
first = gc.get_freeze_count()
later = [[i] for i in range(1000)]
_freeze_heap()
print(first > 1000, gc.get_freeze_count() == first)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
