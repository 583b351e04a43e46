"""Which kcompact a cluster's executors run (issue 51): the driver's decision on what its probe
found (connectors/apps/spark/session.py ``executors_verdict``), and the probe itself, which must
run in a Python that has no kcompact (then it says so). No JVM here: the probe on a real
standalone cluster is in tests/integration/test_spark_cluster.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

import kcompact
from kcompact.connectors.apps.spark import SparkEngineError, SparkExecutorsError
from kcompact.connectors.apps.spark.session import (NATIVE_MODULES, ExecutorPython, _probe_task,
                                                    executors_verdict)

V = kcompact.__version__
PY = "/opt/venv/bin/python"


def test_installed_kcompact_of_the_drivers_version_runs_and_the_note_says_so():
    found = [ExecutorPython("w1", PY, V), ExecutorPython("w2", PY, V)]
    assert executors_verdict(V, found, PY) == (
        f"kcompact: Spark executors run kcompact {V} installed in their Python "
        f"({PY}; 1 Python on w1, w2)")


def test_a_packed_environment_from_spark_archives_is_named_as_such():
    found = [ExecutorPython("w1", "/work/app-1/0/environment/bin/python", V, None, True),
             ExecutorPython("w2", "/work/app-1/1/environment/bin/python", V, None, True)]
    note = executors_verdict(V, found, "./environment/bin/python")
    assert note == (f"kcompact: Spark executors run kcompact {V} unpacked from spark.archives "
                    "(./environment/bin/python; 2 Pythons on w1, w2)")


def test_another_version_on_an_executor_is_one_line_saying_what_to_do():
    found = [ExecutorPython("w1", PY, V), ExecutorPython("w2", PY, "0.0.1")]
    with pytest.raises(SparkExecutorsError) as e:
        executors_verdict(V, found, PY)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, SparkEngineError)
    assert msg.startswith(f"the executors' Python ({PY} on w2) has kcompact 0.0.1, the driver {V}:")
    assert f"install kcompact {V} in the Python the executors run (PYSPARK_PYTHON)" in msg
    assert "spark.archives" in msg and "docs/spark.md" in msg


def test_an_executor_without_kcompact_or_with_a_broken_one_is_refused():
    with pytest.raises(SparkExecutorsError, match=rf"^the executors' Python \({PY} on w1\) has "
                       rf"no kcompact; install kcompact {V} "):
        executors_verdict(V, [ExecutorPython("w1", PY, None, "ModuleNotFoundError: x")], PY)
    with pytest.raises(SparkExecutorsError, match=r"has kcompact .* but cannot import it "
                       r"\(ImportError: cannot import name '_rdkafka'"):
        executors_verdict(V, [ExecutorPython("w1", PY, V, "ImportError: cannot import name "
                                             "'_rdkafka' from 'kcompact.connectors.framework'")],
                          PY)
    with pytest.raises(SparkExecutorsError, match="no Spark executor answered"):
        executors_verdict(V, [], PY)


def test_the_probe_reports_this_pythons_kcompact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not under the task's directory: installed, not unpacked
    [row] = list(_probe_task()(iter([0])))
    found = ExecutorPython(*row)
    assert (found.python, found.version, found.problem, found.from_archive) == (
        sys.executable, V, None, False)
    for name in NATIVE_MODULES:
        assert name in sys.modules


def test_the_probe_runs_in_a_python_without_kcompact(tmp_path):
    """Pickled as Spark ships it (pyspark's cloudpickle), the probe is code by value: a Python
    with pyspark but no kcompact (site-packages on its path, without the .pth files that make
    the editable install importable) loads it, runs it and says it has no kcompact."""
    from pyspark import cloudpickle
    blob = tmp_path / "probe.pickle"
    blob.write_bytes(cloudpickle.dumps(_probe_task()))
    code = ("import json, pickle, sys; sys.path.append(sys.argv[1]); "
            "f = pickle.loads(open(sys.argv[2], 'rb').read()); print(json.dumps(list(f(iter([0])))))")
    site = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-S", "-c", code, site, str(blob)], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    [row] = json.loads(p.stdout)
    found = ExecutorPython(*row)
    assert found.version is None and "No module named 'kcompact'" in found.problem
