"""The Spark engine on a real standalone cluster (issue 51).

Spark's ``Master`` and two ``Worker``s, started from pyspark's ``spark-class`` (one core and
1 GiB each, every listener on 127.0.0.1, work directories in tmp), run the executors in JVMs of
their own; the executors' Python is this venv's, where kcompact is installed (no copy of kcompact
is shipped to them). The store is on SeaweedFS (``s3_store_url``), which every executor reaches.

``kcompact mirror --engine spark --spark-master spark://...``, ``kcompact compact --engine spark
--spark-master ...`` and the ``kcompact`` data source on the cluster each give what the local
engine gives on the same topic (``kcompact dump --json`` of both stores; the data source's rows
against the local store's records). The driver says which kcompact the executors run, and
refuses executors whose Python has none.

The cluster is started once for the module and stopped at its end (SIGTERM, then SIGKILL);
every wait is on a condition (the master's JSON status page listing both workers ALIVE).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17", allow_module_level=True)

from kcompact.connectors import cli  # noqa: E402

from test_spark import keyed_records, latest_model, produce  # noqa: E402

KCOMPACT = str(Path(sys.executable).parent / "kcompact")
START_TIMEOUT = 120.0  # two worker JVMs registering on a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    """A Spark standalone Master and Workers (pyspark's spark-class), on 127.0.0.1."""

    def __init__(self, workdir: Path, workers: int = 2):
        import pyspark
        self.home = Path(pyspark.__file__).resolve().parent
        self.workdir = workdir
        self.n_workers = workers
        self.port, self.ui_port = _free_port(), _free_port()
        self.master = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def _env(self) -> dict[str, str]:
        # the workers pass their environment to the executors they start: the S3 credentials
        # and KCOMPACT_CACHE_DIR (s3_store_url) reach the tasks that way
        return {**os.environ, "SPARK_HOME": str(self.home), "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.workdir / "logs"), "SPARK_DAEMON_MEMORY": "256m",
                # the Master's and Workers' JVMs with C1 only, as the tests' Spark drivers
                # and executors (tests/conftest.py)
                "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1"}

    def _start(self, name: str, *args: str) -> None:
        log = self.workdir / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *args], stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, env=self._env(), cwd=str(self.workdir),
                start_new_session=True))

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            return sum(1 for w in self.status().get("workers", []) if w.get("state") == "ALIVE")
        except OSError:
            return 0

    def _wait(self, what: str, ready) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            for p, log in zip(self.procs, self.logs):
                if p.poll() is not None:
                    raise RuntimeError(f"{log.stem} exited with {p.returncode} before {what}:\n"
                                       + log.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {log.stem}\n" + log.read_text(errors="replace")[-1500:]
                                  for log in self.logs)
                raise TimeoutError(f"the Spark cluster: no {what} within {START_TIMEOUT:.0f} s"
                                   f"\n{tails}")
            time.sleep(0.2)

    def start(self) -> "StandaloneCluster":
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        self._wait("master status page", lambda: self.status_ok())
        for i in range(self.n_workers):
            work = self.workdir / f"worker-{i}"
            work.mkdir()
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host",
                        "127.0.0.1", "--cores", "1", "--memory", "1g", "--work-dir", str(work),
                        "--webui-port", str(_free_port()), self.master)
        self._wait(f"{self.n_workers} workers ALIVE",
                   lambda: self.alive_workers() == self.n_workers)
        return self

    def status_ok(self) -> bool:
        try:
            self.status()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first (their executors go with them)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def executor_dirs(self) -> int:
        """Executors the workers ran so far (a work directory each)."""
        return len(list(self.workdir.glob("worker-*/app-*/*/")))

    def executor_logs(self) -> str:
        """The executors' stderr files (the workers' work directories), for failure messages."""
        out = []
        for f in sorted(self.workdir.glob("worker-*/app-*/*/stderr")):
            out.append(f"--- {f.relative_to(self.workdir)}\n"
                       + f.read_text(errors="replace")[-2000:])
        return "\n".join(out)


@pytest.fixture(scope="module")
def cluster(s3_store_url, tmp_path_factory):
    """The standalone cluster, started after ``s3_store_url`` set the S3 environment (which the
    executors inherit from the workers), stopped at the module's end."""
    c = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield c.start()
    finally:
        c.stop()


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})


def dump(store: str, topic: str, partition: int, capsys) -> list[dict]:
    capsys.readouterr()
    assert cli.main(["dump", "--store", store, "--topic", topic, "--partition", str(partition),
                     "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def dumps(store: str, topic: str, partitions: int, capsys) -> dict[int, list[dict]]:
    return {p: dump(store, topic, p, capsys) for p in range(partitions)}


#: What the driver says when the executors run the kcompact installed in their Python.
NOTE_RE = re.compile(r"^kcompact: Spark executors run kcompact (\S+) installed in their Python "
                     r"\((.+?); 1 Python on (.+)\)$", re.M)

#: One driver on the cluster for `kcompact compact --engine spark --spark-master M` and the data
#: source: the session is started first (spark_session, as a user's program does), and the
#: command, run through the CLI's entry point, takes it, as the demo's stages do; then the
#: data source reads the compacted store in both modes. Prints one JSON line.
DRIVER = """
import contextlib, io, json, sys
from kcompact.connectors import cli
from kcompact.connectors.apps.spark import spark_session
master, store, topic = sys.argv[1:4]
spark = spark_session(master)
assert spark.sparkContext.master == master, spark.sparkContext.master
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = cli.main(["compact", "--store", store, "--force", "--engine", "spark",
                   "--spark-master", master, "--json"])
res = {"compact_rc": rc, "compact": out.getvalue()}
for mode in ("latest", "all"):
    df = (spark.read.format("kcompact").option("store", store).option("topic", topic)
          .option("mode", mode).load())
    res[mode] = [[r.partition, r.offset, None if r.key is None else r.key.hex(),
                  None if r.value is None else r.value.hex()]
                 for r in df.select("partition", "offset", "key", "value").collect()]
spark.stop()
print(json.dumps(res))
"""


def test_mirror_compact_and_read_on_a_standalone_cluster(cluster, s3_store_url, kafka_bootstrap,
                                                          make_topic, tmp_path, capsys):
    """The Spark mirror, compaction and data source on the cluster equal the local engine's on
    the same topic; the driver says the executors run its kcompact, installed in their Python.
    The compaction's tasks (the cluster's 2 cores) publish their partitions in one compaction
    object each, not one a partition."""
    import kcompact
    parts, n = 4, 3000
    topic = make_topic(partitions=parts)
    produce(kafka_bootstrap, topic, keyed_records(parts, n, keys=80))
    on_cluster = s3_store_url()
    local = str(tmp_path / "local")

    # the mirror, as a user runs it: one task per partition in the executors' JVMs
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store",
            on_cluster, "--engine", "spark", "--spark-master", cluster.master, "--no-compact")
    assert p.returncode == 0, p.stderr[-3000:] + cluster.executor_logs()
    note = NOTE_RE.search(p.stderr)
    assert note is not None, p.stderr[-3000:]
    assert note.group(1) == kcompact.__version__
    assert note.group(2) == sys.executable  # the Python the workers were told to run
    assert f"mirror: Spark {cluster.master} started" in p.stderr
    assert cluster.executor_dirs() == 2  # both workers ran an executor for it
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store",
            local, "--engine", "local")
    assert p.returncode == 0, p.stderr[-3000:]
    mirrored = dumps(local, topic, parts, capsys)
    assert sum(map(len, mirrored.values())) == n
    assert dumps(on_cluster, topic, parts, capsys) == mirrored

    # the compaction (one task per partition) and the data source, on the cluster
    p = subprocess.run([sys.executable, "-c", DRIVER, cluster.master, on_cluster, topic],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert p.returncode == 0, p.stderr[-3000:] + cluster.executor_logs()
    assert NOTE_RE.search(p.stderr) is not None, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["compact_rc"] == 0, p.stderr[-3000:]
    assert json.loads(got["compact"])["engine"] == "spark"
    prefix = on_cluster.split("/", 3)[3] + "/compacted/"
    listed = s3_store_url.server.client().list_objects_v2(Bucket=s3_store_url.bucket,
                                                          Prefix=prefix)
    objects = [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".kco")]
    assert 1 <= len(objects) <= 2, objects  # a task's partitions in one object
    assert cli.main(["compact", "--store", local, "--force", "--engine", "local"]) == 0
    compacted = dumps(local, topic, parts, capsys)
    assert sum(map(len, compacted.values())) < n  # the compaction dropped something
    assert dumps(on_cluster, topic, parts, capsys) == compacted

    stored = {p: [(r["offset"], r["timestamp"], _raw(r, "key"), _raw(r, "value"), ())
                  for r in recs] for p, recs in compacted.items()}
    every = sorted([p, off, _hex(key), _hex(value)]
                   for p, recs in stored.items() for off, _ts, key, value, _h in recs)
    assert sorted(got["all"]) == every
    live = sorted([p, off, key.hex(), value.hex()]
                  for (p, key), (off, _ts, value, _h) in latest_model(stored).items())
    assert live and sorted(got["latest"]) == live


def _raw(record: dict, name: str) -> bytes | None:
    """A key or value of ``dump --json`` back to bytes (text, else ``NAME_b64``)."""
    if record[name] is not None:
        return record[name].encode()
    b64 = record.get(f"{name}_b64")
    return None if b64 is None else base64.b64decode(b64)


def _hex(data: bytes | None) -> str | None:
    return None if data is None else data.hex()
