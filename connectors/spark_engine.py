"""The Spark engine: a quiet SparkSession, the `kcompact` Python data source, and Spark stages.

* ``spark_session(master)``: ``local[*]`` by default; Spark's own output is quiet (log level WARN,
  no UI unless ``KCOMPACT_SPARK_UI=1``); Python workers run this interpreter.
* ``KcompactDataSource``: ``spark.read.format("kcompact").option("store", URL)
  .option("topic", T).load()`` -> ``topic, partition, offset, timestamp, key, value, headers``,
  one input partition per topic-partition, batches through Arrow. ``mode=latest`` (default):
  one row per live key (compacted segments plus the not-yet-compacted tail; tombstoned keys and
  keyless records absent); ``mode=all``: every stored record.
* ``compact_with_spark``: one Spark task per partition that the planner picks.
* ``mirror_with_spark`` / ``run_mirror`` (``kcompact mirror --engine spark``): the driver checks
  the topic and the -X settings, creates the store, dispatches what dead writers left, reads each
  partition's end offset from the consumer side (never ListOffsets "latest", which Tansu gets
  wrong); then one Spark task per topic-partition runs the store sink (connectors/plugins/store_sink.py,
  through connectors/framework/worker.py, exactly as the local engine does) with its own commit-log writer
  ``spark-<topic>-<partition>``, reput included; then a compaction stage, one task per partition
  the planner picks. A task resumes from the store's own next offset of its partition, and a
  retried task reopens (and so recovers) the same commit log: retries neither duplicate nor lose.

In local mode Spark retries a task only when the master says so (``local[N,F]``: in local mode
``spark.task.maxFailures`` is ignored), so ``local[N]`` becomes ``local[N,TASK_MAX_FAILURES]``.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib
import os
import re
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, TextIO

import numpy as np

from .errors import ConfigError, ConnectorsError
from .plugins.store_sink import StoreSinkConnector, StoreSinkTask

SCHEMA = ("topic string, partition int, offset long, timestamp timestamp, key binary, "
          "value binary, headers array<struct<key:string,value:binary>>")
ARROW_BATCH_BYTES = 8 << 20

_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n%ex
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = error
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.spark.name = org.apache.spark
logger.spark.level = warn
"""
#: Without KCOMPACT_DEBUG: a failed task attempt is not a wall of Java and Python stack traces
#: (the executor's ERROR, the task-set manager's "Lost task" WARN); the driver reports task
#: failures itself, as one line, and counts retried tasks.
_LOG4J2_QUIET_TASKS = """\
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tasksets.name = org.apache.spark.scheduler.TaskSetManager
logger.tasksets.level = off
logger.pyrunner.name = org.apache.spark.api.python.PythonRunner
logger.pyrunner.level = off
"""
#: Attempts per task (local masters get it as local[N,F]; others through spark.task.maxFailures).
TASK_MAX_FAILURES = 4


class SparkEngineError(ConnectorsError):
    """A Spark job failed: the message is the task's error; KCOMPACT_DEBUG=1 shows its traceback."""


def _debug() -> bool:
    return os.environ.get("KCOMPACT_DEBUG") not in (None, "", "0")


def _log4j_file() -> str:
    text = _LOG4J2 if _debug() else _LOG4J2 + _LOG4J2_QUIET_TASKS
    name = "kcompact-log4j2-debug.properties" if _debug() else "kcompact-log4j2.properties"
    path = os.path.join(tempfile.gettempdir(), name)
    try:
        with open(path) as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # another kcompact process may be reading it
    return path


_LOCAL_RE = re.compile(r"^local(?:\[\s*(\*|\d+)\s*\])?$")


def master_with_retries(master: str, max_failures: int = TASK_MAX_FAILURES) -> str:
    """``local``/``local[N]``/``local[*]`` -> ``local[N,F]``: in local mode Spark ignores
    spark.task.maxFailures and gives each task one attempt unless the master names F."""
    m = _LOCAL_RE.match(master.strip())
    if m is None:
        return master
    return f"local[{m.group(1) or 1},{max_failures}]"


def _code_zip() -> str:
    """The ``kcompact`` package zipped as it is installed (kcompact/reput/..., each layer from
    wherever its folder is), shipped to executors when the master is not local."""
    import kcompact
    path = os.path.join(tempfile.gettempdir(), f"kcompact-code-{os.getpid()}.zip")
    roots = [("kcompact", os.path.dirname(os.path.abspath(kcompact.__file__)))]
    for layer in ("reput", "compaction", "replication", "connectors"):
        mod = importlib.import_module(f"kcompact.{layer}")
        roots.append((f"kcompact/{layer}", os.path.dirname(os.path.abspath(mod.__file__))))
    with zipfile.ZipFile(path, "w") as z:
        for arc_root, root in roots:
            for dp, dns, files in os.walk(root):
                if arc_root == "kcompact":
                    dns[:] = []  # the layers are added from their own folders
                for f in files:
                    if f.endswith(".py"):
                        full = os.path.join(dp, f)
                        z.write(full, f"{arc_root}/{os.path.relpath(full, root)}")
    return path


def spark_session(master: str | None = None, app_name: str = "kcompact"):
    """A SparkSession for kcompact's jobs (created once per process, then reused)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise SparkEngineError(f"the Spark engine needs pyspark: {e}") from None
    active = SparkSession.getActiveSession()
    if active is not None:
        # this process's session (the demo runs several stages in one): reuse it as it is,
        # without a builder whose settings Spark would ignore with a warning
        register_data_source(active)
        return active
    why = java_problem()
    if why is not None:
        raise SparkEngineError(f"Spark cannot start: {why}, or use --engine local")
    master = master_with_retries(master or "local[*]")
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # loopback only, and no warning
    log4j = _log4j_file()
    ui = os.environ.get("KCOMPACT_SPARK_UI") == "1"
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.enabled", "true" if ui else "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{log4j}")
         .config("spark.executor.extraJavaOptions", f"-Dlog4j.configurationFile=file:{log4j}")
         .config("spark.sql.shuffle.partitions", "8")
         .config("spark.task.maxFailures", str(TASK_MAX_FAILURES))
         .config("spark.python.worker.reuse", "true"))
    if master.startswith("local"):
        b = b.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress",
                                                              "127.0.0.1")
    try:
        spark = b.getOrCreate()
    except Exception as e:  # py4j / JVM start failures
        raise SparkEngineError(f"cannot start Spark ({master}): {str(e).splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("WARN")
    if not master.startswith("local"):
        spark.sparkContext.addPyFile(_code_zip())
    register_data_source(spark)
    return spark


def spark_active() -> bool:
    """Whether this process already has a SparkContext (then it is not ours to stop)."""
    try:
        from pyspark import SparkContext
    except ImportError:
        return False
    return SparkContext._active_spark_context is not None


def java_problem() -> str | None:
    """None when a ``java`` that Spark's launcher will run exists, else why not (one line).

    Spark's launcher (bin/spark-class) runs ``$JAVA_HOME/bin/java`` when JAVA_HOME is set and
    ``java`` from PATH otherwise, so a JAVA_HOME that names no Java is as fatal as no Java at
    all: checked here, before a JVM start fails with a py4j traceback."""
    import shutil
    home = os.environ.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not (os.path.isfile(java) and os.access(java, os.X_OK)):
            return (f"JAVA_HOME={home} has no bin/java; point JAVA_HOME at a Java 17 "
                    "installation or unset it")
        return None
    if shutil.which("java") is None:
        return ("Java 17 is not installed (apt-get install -y openjdk-17-jre-headless, "
                "or set JAVA_HOME)")
    return None


def spark_available() -> str | None:
    """None when the Spark engine can run here, else why not (one line)."""
    import importlib.util
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (pip install pyspark)"
    return java_problem()


#: ``module.path.SomeError: message`` as the last line of a Python traceback.
_PY_ERROR_RE = re.compile(r"^((?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit)))"
                          r"(?::\s*(.*))?$")
_OUR_PACKAGES = ("kcompact.",)


def task_error_line(text: str) -> str:
    """The error a Spark task raised, as one line, from the text of the driver's exception
    (the task's Python traceback quoted in the JVM's message). kcompact's own errors are shown
    by their message alone (as the CLI shows them); others keep their class name."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line or line.startswith(("at ", "File ", "SQLSTATE")):
            continue
        m = _PY_ERROR_RE.match(line)
        if m is None:
            continue
        qual, name, msg = m.group(1), m.group(2), (m.group(3) or "").strip()
        if qual.startswith(_OUR_PACKAGES) and msg:
            return msg
        if qual.startswith(("org.apache.", "java.", "py4j.", "scala.")) and not msg:
            continue
        return f"{name}: {msg}" if msg else name
    first = text.strip().splitlines()
    return first[0] if first else "unknown error"


def run_job(fn, *args):
    """Run a Spark action, turning a task failure into one clear line (and, with
    KCOMPACT_DEBUG=1, printing the task's traceback on stderr first)."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        if _debug():
            print(str(e), file=sys.stderr, flush=True)
        raise SparkEngineError(f"Spark job failed: {task_error_line(str(e))}") from None


# ---------------------------------------------------------------------------------------------
# reading a partition as Arrow batches


def _arrow_batches(store, topic: str, partition: int, mode: str) -> Iterator:
    """Arrow RecordBatches of a partition (mode 'all' or 'latest')."""
    import pyarrow as pa
    from kcompact.compaction.latest import latest_selection
    from kcompact.reput.record import decode_headers

    pl = store.partition(topic, partition)
    if mode == "all":
        selection = [(seg, None) for seg in pl.segments]
    else:
        selection = latest_selection(pl)
    topic_arr_cache: dict[int, object] = {}
    for seg, which in selection:
        idx = pl.index(seg)
        e = idx.entries if which is None else idx.entries[which]
        if e.shape[0] == 0:
            continue
        path = pl.log_path(seg.base)
        # contiguous runs of selected entries are read in bounded slices
        pos = e["position"].astype(np.int64)
        ends = pos + e["size"].astype(np.int64)
        i = 0
        n = e.shape[0]
        while i < n:
            j = int(np.searchsorted(ends, pos[i] + ARROW_BATCH_BYTES, side="right"))
            j = max(j, i + 1)
            start, stop = int(pos[i]), int(ends[j - 1])
            data = np.frombuffer(store.fs.read(path, start, stop - start), np.uint8)
            rel = pos[i:j] - start
            spans = _spans(data, rel)
            _check_crcs(data, rel, e["size"][i:j].astype(np.int64), path, start)
            m = j - i
            kl, vl, hl = spans["klen"], spans["vlen"], spans["hlen"]
            keys = _binary(pa, data, spans["kstart"], kl, (spans["attrs"] & 2) != 0)
            values = _binary(pa, data, spans["vstart"], vl, (spans["attrs"] & 1) != 0)
            headers = []
            for r in range(m):
                if hl[r]:
                    s = int(spans["hstart"][r])
                    headers.append([{"key": k, "value": v} for k, v in
                                    decode_headers(data[s:s + int(hl[r])].tobytes())])
                else:
                    headers.append([])
            if m not in topic_arr_cache:
                topic_arr_cache[m] = pa.array([topic] * m, pa.string())
            batch = pa.RecordBatch.from_arrays([
                topic_arr_cache[m],
                pa.array(np.full(m, partition, np.int32)),
                pa.array(e["offset"][i:j].astype(np.int64)),
                pa.array(e["timestamp"][i:j].astype(np.int64) * 1000,
                         pa.timestamp("us", tz="UTC")),
                keys, values,
                pa.array(headers, _HEADERS_TYPE(pa)),
            ], names=["topic", "partition", "offset", "timestamp", "key", "value", "headers"])
            yield batch
            i = j


def _HEADERS_TYPE(pa):
    # Spark's Arrow schema names the list item field "element"
    return pa.list_(pa.field("element", pa.struct([("key", pa.string()),
                                                   ("value", pa.binary())])))


def _check_crcs(data, rel, sizes, path, file_start) -> None:
    from kcompact.reput import _kernels as K
    from kcompact.reput.errors import CorruptRecordError
    bad = _crc_mismatch(data, rel, sizes, K.CRC_TABLES)
    if bad >= 0:
        raise CorruptRecordError(f"{path}: corrupt record at byte {file_start + int(rel[bad])}",
                                 path, file_start + int(rel[bad]))


def _spans(data, rel):
    from kcompact.reput._kernels import field_spans
    n = rel.shape[0]
    out = {k: np.empty(n, np.int64) for k in ("kstart", "klen", "vstart", "vlen", "hstart",
                                               "hlen")}
    out["attrs"] = np.empty(n, np.uint8)
    field_spans(data, rel, out["kstart"], out["klen"], out["vstart"], out["vlen"],
                out["hstart"], out["hlen"], out["attrs"])
    return out


def _crc_mismatch(data, rel, sizes, tables):
    from kcompact.reput._kernels import first_crc_mismatch
    return int(first_crc_mismatch(data, rel, sizes, tables))


def _binary(pa, data, starts, lens, nulls):
    """A pyarrow BinaryArray gathered from (start, len) spans of data (nulls where flagged)."""
    from kcompact.reput._kernels import gather_ranges
    lens = np.where(nulls, 0, lens)
    offs = np.zeros(lens.shape[0] + 1, np.int32)
    np.cumsum(lens, out=offs[1:])
    buf = np.empty(int(offs[-1]), np.uint8)
    gather_ranges(data, starts, lens, buf)
    validity = pa.py_buffer(np.packbits(~nulls, bitorder="little").tobytes())
    return pa.BinaryArray.from_buffers(pa.binary(), lens.shape[0],
                                       [validity, pa.py_buffer(offs.tobytes()),
                                        pa.py_buffer(buf.tobytes())],
                                       null_count=int(nulls.sum()))


# ---------------------------------------------------------------------------------------------
# the data source


def _make_data_source():
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class KcompactReader(DataSourceReader):
        def __init__(self, options):
            self.store_url = options.get("store")
            self.topic = options.get("topic")
            self.mode = options.get("mode", "latest")
            if not self.store_url or not self.topic:
                raise SparkEngineError("the kcompact data source needs .option('store', URL) "
                                       "and .option('topic', T)")
            if self.mode not in ("latest", "all"):
                raise SparkEngineError(f"mode must be 'latest' or 'all', not {self.mode!r}")

        def partitions(self):
            from kcompact.reput import Store
            st = Store.open(self.store_url)
            if self.topic not in st.topics():
                raise SparkEngineError(f"topic {self.topic!r} is not in store {self.store_url}")
            return [InputPartition(p) for p in st.partitions(self.topic)]

        def read(self, partition):
            from kcompact.reput import Store
            st = Store.open(self.store_url)
            yield from _arrow_batches(st, self.topic, partition.value, self.mode)

    class KcompactDataSource(DataSource):
        @classmethod
        def name(cls):
            return "kcompact"

        def schema(self):
            return SCHEMA

        def reader(self, schema):
            return KcompactReader(self.options)

    return KcompactDataSource


_DS = None


_REGISTERED: set[int] = set()  # SparkContexts (by id) the data source is registered with


def register_data_source(spark) -> None:
    """Register the ``kcompact`` data source with this session's context (once: registering
    again makes Spark warn that it replaced the source)."""
    global _DS
    if _DS is None:
        _DS = _make_data_source()
    key = id(spark.sparkContext)
    if key in _REGISTERED:
        return
    spark.dataSource.register(_DS)
    _REGISTERED.add(key)


# ---------------------------------------------------------------------------------------------
# Spark stages


def _compact_task(store_url: str, map_memory: int, force: bool):
    def run(candidates):
        from kcompact.compaction import CompactionOptions, Compactor
        from kcompact.reput import Store
        st = Store.open(store_url)
        c = Compactor(st, CompactionOptions(offset_map_memory=map_memory))
        for topic, partition in candidates:
            r = c.compact_partition(topic, partition, force=force)
            st.release_partition(topic, partition)
            yield r.to_dict()
        st.close()
    return run


def compact_partitions_spark(spark, store_url: str, candidates: list[tuple[str, int]], *,
                             map_memory: int, force: bool) -> list[dict]:
    if not candidates:
        return []
    rdd = spark.sparkContext.parallelize(candidates, len(candidates))
    return run_job(lambda: rdd.mapPartitions(_compact_task(store_url, map_memory, force))
                   .collect())


def _compaction_lines(results: list[dict]) -> list[str]:
    from .cli import _human_bytes
    out = []
    for r in results:
        if r.get("skipped"):
            out.append(f"{r['topic']}-{r['partition']}: skipped: {r['skipped']}")
            continue
        out.append(f"{r['topic']}-{r['partition']}: {r['rounds']} rounds, kept "
                   f"{r['records_kept']:,} dropped {r['records_dropped']:,}, "
                   f"{_human_bytes(r['size_before'])} -> {_human_bytes(r['size_after'])} "
                   f"({r['duration_s']:.2f}s, spark)")
    return out


def compact_with_spark(args) -> int:
    """`kcompact compact --engine spark`: one Spark task per partition the planner picks."""
    from kcompact.compaction import plan
    from kcompact.reput import Store

    from .cli import _print_json
    st = Store.open(args.store)
    if args.topic and args.topic not in st.topics():
        raise ConnectorsError(f"topic {args.topic!r} is not in store {st.url}")
    if args.partition is not None and not args.topic:
        raise ConnectorsError("--partition needs --topic")
    cands = [(c.topic, c.partition) for c in plan(st, topic=args.topic, partition=args.partition,
                                                   force=args.force)]
    st.close()
    results: list[dict] = []
    if cands:  # no JVM for nothing to do
        ours = not spark_active()
        spark = spark_session(args.spark_master)
        try:
            results = compact_partitions_spark(spark, args.store, cands,
                                               map_memory=args.offset_map_memory,
                                               force=args.force)
        finally:
            if ours:
                spark.stop()
    if args.json:
        _print_json({"store": args.store, "engine": "spark", "partitions": results})
        return 0
    if not results:
        print("nothing to compact (no partition reached min.cleanable.dirty.ratio, "
              "max.compaction.lag.ms or the small-segment limit; use --force)")
    for line in _compaction_lines(results):
        print(line)
    return 0


# ---------------------------------------------------------------------------------------------
# mirror: one Spark task per topic-partition

#: Test hook, read by the driver and applied in the tasks' first attempt only:
#: ``MODE:RECORDS[:PARTITION][,...]`` - after RECORDS records of PARTITION (every partition
#: when omitted) are appended, MODE ``raise`` raises in the task (the worker then closes the
#: store), ``exit`` kills the Python worker with os._exit (nothing flushed or closed).
FAIL_ENV = "KCOMPACT_TEST_FAIL_TASK"
PROGRESS_INTERVAL = 2.0
_WRITER_MAX = 128


class MirrorTaskError(SparkEngineError):
    """A mirror task failed on every attempt: the message names the topic-partition."""


def spark_writer_id(topic: str, partition: int) -> str:
    """The commit-log writer of a Spark mirror task: one per topic-partition, the same on
    every attempt and every run (so a retry reopens, and so recovers, the log it wrote)."""
    w = f"spark-{topic}-{partition}"
    if len(w) <= _WRITER_MAX:
        return w
    digest = hashlib.blake2b(topic.encode(), digest_size=6).hexdigest()
    return f"spark-{topic[:_WRITER_MAX - 40]}-{digest}-{partition}"


def parse_fail_spec(text: str | None) -> tuple[tuple[str, int, int | None], ...]:
    out = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.split(":")
        try:
            if bits[0] not in ("raise", "exit") or len(bits) not in (2, 3):
                raise ValueError
            out.append((bits[0], int(bits[1]), int(bits[2]) if len(bits) == 3 else None))
        except ValueError:
            raise ConfigError(f"{FAIL_ENV}={text!r}: expected MODE:RECORDS[:PARTITION] with "
                              "MODE raise or exit") from None
    return tuple(out)


class InjectedTaskFailure(RuntimeError):
    """Raised by the FAIL_ENV test hook."""


#: This task's failure injection (set by _mirror_partition in the Python worker, read by the
#: task's put(); a Python worker runs one task at a time).
_FAIL: tuple[str, int] | None = None


class SparkStoreSinkTask(StoreSinkTask):
    """The store sink task, plus the FAIL_ENV test hook."""

    _seen = 0

    def put(self, records) -> None:
        super().put(records)
        fail = _FAIL
        if fail is None:
            return
        self._seen += len(records)
        if self._seen >= fail[1]:
            self.appender.drain()  # those records are in the commit log and the partition
            if fail[0] == "exit":
                os._exit(17)
            raise InjectedTaskFailure(f"injected failure after {self._seen} records "
                                      f"({FAIL_ENV})")


class SparkStoreSinkConnector(StoreSinkConnector):
    """The store sink of one Spark mirror task: the driver created the store and recovered
    every writer before the job."""

    RECOVER_WRITERS = False

    def task_class(self):
        return SparkStoreSinkTask


@dataclass(frozen=True)
class _MirrorJob:
    """What every mirror task needs (pickled to the executors)."""

    bootstrap: str
    topic: str
    store: str
    kafka_config: tuple[tuple[str, str], ...]
    batch_max: int | None = None
    fail: tuple[tuple[str, int, int | None], ...] = ()
    lock_wait_s: float = 60.0


def _wait_for_writer(store_url: str, writer: str, timeout: float) -> None:
    """Open (and so recover) this task's commit log, waiting while a previous attempt of the
    same task that is still dying holds it."""
    from kcompact.reput import Store, StoreLockedError
    deadline = time.monotonic() + timeout
    while True:
        try:
            Store.open(store_url, writer=writer, create=True).close()
            return
        except StoreLockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


_FROZEN = False


def _freeze_heap() -> None:
    """Once per Python worker: move what is alive then (pyspark, kcompact, numba and the
    modules they loaded) into the collector's permanent generation (``gc.freeze``), so that
    the collections made while a task runs stop walking all of it again and again. Measured
    (one-off `perf` of a 2M-record Spark mirror): the collector was ~7% of the Python workers'
    and librdkafka threads' samples, most of the CPU a Spark task spends beyond the local
    engine's; `bench/spark.py --rounds 3`, two runs each, alternating: Spark 2.15-2.50 s
    without, 1.76-2.25 s with (ratio to local 0.59-0.61 -> 0.72-0.73)."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


def _mirror_partition(job: _MirrorJob, item: tuple[int, int, int], attempt: int) -> dict:
    """One topic-partition, in a Spark task: the store sink with writer spark-<topic>-<p>."""
    global _FAIL
    _freeze_heap()
    from .mirror import connector_props
    from .framework.worker import Worker

    partition, start, end = item
    t0, started_at = time.monotonic(), time.time()
    writer = spark_writer_id(job.topic, partition)
    _wait_for_writer(job.store, writer, job.lock_wait_s)
    props = connector_props(job.topic, job.store, partitions=[partition], follow=False,
                            kafka_config=dict(job.kafka_config), writer=writer)
    props["connector.class"] = f"{__name__}.SparkStoreSinkConnector"
    if job.batch_max:
        props["batch.max.records"] = job.batch_max
    if attempt == 0:
        for mode, after, p in job.fail:
            if p is None or p == partition:
                _FAIL = (mode, after)
    worker = Worker({"bootstrap.servers": job.bootstrap, "metrics.log.interval.ms": 0},
                    where=f"spark task {job.topic}-{partition}", log=sys.stderr)
    try:
        worker.add_connector(props, where="mirror", consumer_origin=lambda k: f"-X {k}")
        worker.run()
    finally:
        _FAIL = None
    runner = worker.runners[0]
    return {"topic": job.topic, "partition": partition, "start": start, "end": end,
            "records": runner.metrics.records, "appended": getattr(runner.task, "appended", 0),
            "seconds": time.monotonic() - t0, "started_at": started_at, "attempt": attempt,
            "writer": writer}


def _mirror_task(job: _MirrorJob, items: Iterator[tuple[int, int, int]]) -> Iterator[dict]:
    from pyspark import TaskContext
    ctx = TaskContext.get()
    attempt = ctx.attemptNumber() if ctx is not None else 0
    for item in items:
        try:
            yield _mirror_partition(job, item, attempt)
        except Exception as e:
            from kcompact.reput import ReputError

            from .framework.api import TaskFailedError
            cause = e.__cause__ if isinstance(e, TaskFailedError) else None
            if isinstance(cause, (ReputError, OSError)):
                msg = str(cause)  # without the worker's "task kcompact-mirror-0:" prefix
            elif isinstance(e, (ConnectorsError, ReputError)):
                msg = str(e)
            else:
                msg = f"{type(e).__name__}: {e}"
            raise MirrorTaskError(f"mirror task {job.topic}-{item[0]} (attempt {attempt + 1}): "
                                  f"{msg}") from e


def partition_ends(consumer_conf: Mapping[str, Any], tps: list, timeout: float
                   ) -> dict[int, tuple[int, int, bool]]:
    """(low watermark, end offset, exact) of each partition, read from the consumer side.

    The consumer is assigned at the logical end (ListOffsets "latest": on Tansu the base offset
    of the last batch + 1, BROKER_NOTES.md; right on Kafka - never past the true end) and
    reads to end-of-partition, whose offset is the end (with read_committed, the last stable
    offset); the low watermark is the one fetch responses carry. A partition that gives no EOF
    within ``timeout`` (a producer outrunning us) ends at the cached high watermark of the
    fetch responses (right on Tansu too) or after the last record seen (``exact`` False)."""
    from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as KTP

    from .framework.kafka_clients import kafka_error_text, kafka_logger
    conf = dict(consumer_conf, **{"enable.partition.eof": True, "enable.auto.commit": False,
                                  "queued.min.messages": 1000, "fetch.wait.max.ms": 10,
                                  "logger": kafka_logger()})
    conf["client.id"] = f"{conf.get('client.id', 'kcompact')}-ends"
    c = Consumer(conf)
    try:
        # Leaders first: assigned to a partition whose leader it does not know yet, librdkafka
        # retries the offset lookup on a 500 ms timer (measured: 0.61 s -> 0.1 s here).
        for topic in sorted({tp.topic for tp in tps}):
            try:
                c.list_topics(topic, timeout=timeout)
            except KafkaException:
                pass  # the assignment below reports what is wrong
        c.assign([KTP(tp.topic, tp.partition, OFFSET_END) for tp in tps])
        ends: dict[int, int] = {}
        seen: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(ends) < len(tps) and time.monotonic() < deadline:
            # poll(), not consume(n, timeout): consume waits out its whole timeout unless n
            # messages came, and a few end-of-partition events never make n (0.1 s a mirror)
            m = c.poll(0.1)
            if m is None:
                continue
            err = m.error()
            if err is None:
                seen[m.partition()] = max(seen.get(m.partition(), 0), m.offset() + 1)
            elif err.code() == KafkaError._PARTITION_EOF:
                ends.setdefault(m.partition(), m.offset())
            elif err.fatal() or err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                               KafkaError.TOPIC_AUTHORIZATION_FAILED):
                raise ConnectorsError(f"{m.topic()}-{m.partition()}: {err.str()}")
        out = {}
        exact = set(ends)
        for tp in tps:
            try:
                lo, hw = c.get_watermark_offsets(KTP(tp.topic, tp.partition), cached=True)
            except KafkaException:
                lo, hw = -1, -1
            if tp.partition not in ends:
                if hw is None or hw < 0:
                    try:  # nothing fetched at all: ask (low on Tansu, but never past the end)
                        lo, hw = c.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                         timeout=timeout)
                    except KafkaException as e:
                        raise ConnectorsError(f"{tp}: cannot read the partition's offsets: "
                                              f"{kafka_error_text(e)}") from None
                ends[tp.partition] = max(seen.get(tp.partition, 0), hw)
            out[tp.partition] = (max(lo or 0, 0), ends[tp.partition], tp.partition in exact)
        return out
    finally:
        c.close()


@dataclass
class SparkMirrorResult:
    records: int                  # records appended to the store (duplicates skipped)
    seconds: float                # from the job's start to the end of the compaction stage
    partitions: int               # partitions of the topic selected
    tasks: list[dict] = field(default_factory=list)
    retried: int = 0              # tasks that needed more than one attempt
    compaction: list[dict] = field(default_factory=list)
    spark_start_s: float = 0.0    # JVM and SparkSession start (0 when one was running)
    mirror_s: float = 0.0         # the mirror stage alone

    @property
    def rate(self) -> float:
        return self.records / self.mirror_s if self.mirror_s > 0 else 0.0


class _Job:
    """A Spark action in a thread of its own, so the driver can report progress meanwhile."""

    def __init__(self, fn):
        self.result: Any = None
        self.error: BaseException | None = None
        from pyspark import InheritableThread

        def run() -> None:
            try:
                self.result = run_job(fn)
            except BaseException as e:  # noqa: BLE001 - re-raised on the driver's thread
                self.error = e
        self.thread = InheritableThread(target=run, name="kcompact-spark-job", daemon=True)
        self.thread.start()

    def wait(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return not self.thread.is_alive()


def _stage_counts(spark) -> tuple[int, int, int]:
    """(completed, running, failed attempts) tasks of the active stages."""
    done = running = failed = 0
    try:
        tracker = spark.sparkContext.statusTracker()
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info is not None:
                done += info.numCompletedTasks
                running += info.numActiveTasks
                failed += info.numFailedTasks
    except Exception:  # noqa: BLE001 - progress only
        pass
    return done, running, failed


def _mirror_progress(spark, store, topic: str, todo: list[tuple[int, int, int]], t0: float,
                     last: list, out: TextIO) -> None:
    """One progress line: records in the store (its next offsets), per-partition lag, tasks."""
    copied, lag = 0, {}
    try:
        for p, start, end in todo:
            n = min(max(store.next_offset(topic, p), start), end)
            copied += n - start
            if end - n:
                lag[p] = end - n
    except Exception:  # noqa: BLE001 - a partition being written may be mid-append
        return
    done, running, failed = _stage_counts(spark)
    now = time.monotonic()
    rate = (copied - last[1]) / max(now - last[0], 1e-9)
    last[0], last[1] = now, copied
    worst = sorted(lag.items(), key=lambda kv: -kv[1])[:8]
    per = " ".join(f"p{p}={v:,}" for p, v in sorted(worst))
    more = f" (+{len(lag) - len(worst)} more)" if len(lag) > len(worst) else ""
    print(f"mirror: {copied:,} records, {rate:,.0f} rec/s, lag {sum(lag.values()):,}"
          + (f" [{per}{more}]" if lag else "")
          + f"; partitions done {done}/{len(todo)}, running {running}"
          + (f", {failed} failed attempts (retrying)" if failed else "")
          + f" ({now - t0:.0f} s)", file=out, flush=True)


def mirror_with_spark(bootstrap: str, topic: str, store: str, *, master: str | None = None,
                      spark: Any = None, partitions: list[int] | None = None,
                      kafka_config: Mapping[str, str] | None = None, compact: bool = True,
                      batch_max: int | None = None, out: TextIO | None = None,
                      progress_interval: float = PROGRESS_INTERVAL) -> SparkMirrorResult:
    """Mirror ``topic`` into ``store`` with one Spark task per partition, then compact the
    partitions the planner picks (``compact=False``: skip that stage). ``spark``: a session to
    use (else ``spark_session(master)``, stopped at the end if this call started it)."""
    from kcompact.reput import Store

    from .mirror import connector_props
    from .framework.worker import Worker
    out = out if out is not None else sys.stderr
    kafka_config = dict(kafka_config or {})
    fail = parse_fail_spec(os.environ.get(FAIL_ENV))

    # 1. the driver: settings, topic, partitions, store, dead writers - before any JVM starts,
    # through the same worker code as the local engine (nothing is run: its task never starts)
    props = connector_props(topic, store, partitions=partitions, follow=False,
                            kafka_config=kafka_config, writer="spark-driver")
    probe = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0},
                   where="mirror", log=out)
    runner = probe.add_connector(props, where="mirror", consumer_origin=lambda k: f"-X {k}")[0]
    for c in probe.connectors:
        c.stop()
    tps = list(runner.assignment)
    timeout = probe.config["startup.timeout.ms"] / 1000
    ends = partition_ends(runner.consumer_conf, tps, timeout)
    st = Store.open(store)
    todo = []
    stored = set(st.partitions(topic))
    for tp in tps:
        lo, end, exact = ends[tp.partition]
        nxt = st.next_offset(topic, tp.partition) if tp.partition in stored else 0
        if exact and nxt > end:
            st.close()
            raise ConnectorsError(
                f"{tp}: the store holds offsets up to {nxt - 1} but the partition ends at {end}: "
                "was the topic deleted and recreated? Mirror into a new store")
        start = nxt if nxt > 0 else lo
        if start != end:  # not exact and past the end: the task's consumer finds out
            todo.append((tp.partition, start, end))
    todo.sort(key=lambda it: (-(it[2] - it[1]), it[0]))  # biggest first: better packing
    total = sum(max(0, e - s) for _, s, e in todo)
    result = SparkMirrorResult(0, 0.0, len(tps))

    ours = False
    t_all = time.monotonic()

    def session():
        nonlocal spark, ours
        if spark is None:
            ours = not spark_active()
            t = time.monotonic()
            spark = spark_session(master)
            result.spark_start_s = time.monotonic() - t if ours else 0.0
            if ours:
                print(f"mirror: Spark {spark.sparkContext.master} started in "
                      f"{result.spark_start_s:.1f} s", file=out, flush=True)
        return spark

    try:
        if not todo:
            print(f"mirror: {topic}: the store {store} is up to date ({len(tps)} partitions)",
                  file=out, flush=True)
        else:
            print(f"mirror: {topic} ({len(tps)} partitions, {len(todo)} to copy, ~{total:,} "
                  f"records) from {bootstrap} into {store} with Spark", file=out, flush=True)
            sp = session()
            t0 = time.monotonic()
            job = _MirrorJob(bootstrap, topic, store, tuple(sorted(kafka_config.items())),
                             batch_max, fail)
            rdd = sp.sparkContext.parallelize(todo, len(todo))
            running = _Job(lambda: rdd.mapPartitions(
                functools.partial(_mirror_task, job)).collect())
            last = [t0, 0]
            try:
                while not running.wait(progress_interval):
                    _mirror_progress(sp, st, topic, todo, t0, last, out)
            except KeyboardInterrupt:
                print("mirror: interrupted: cancelling the Spark job (run the same command "
                      "again to resume; nothing is lost or repeated)", file=out, flush=True)
                try:
                    sp.sparkContext.cancelAllJobs()  # the JVM may be gone already (Ctrl-C)
                except Exception:  # noqa: BLE001
                    pass
                running.wait(30)
                raise
            if running.error is not None:
                raise running.error
            result.tasks = sorted(running.result, key=lambda r: r["partition"])
            result.mirror_s = time.monotonic() - t0
            result.records = sum(r["appended"] for r in result.tasks)
            result.retried = sum(1 for r in result.tasks if r["attempt"] > 0)
            again = sum(r["records"] for r in result.tasks) - result.records
            print(f"mirror: done: {result.records:,} records in {result.mirror_s:.1f} s "
                  f"({result.rate:,.0f} rec/s), {len(result.tasks)} Spark tasks"
                  + (f" ({result.retried} retried)" if result.retried else "")
                  + (f", {again:,} records read again were already stored" if again else "")
                  + f"; store {store} flushed", file=out, flush=True)

        # 2. compaction: one task per partition the planner picks
        if compact:
            from kcompact.compaction import plan
            selected = {tp.partition for tp in tps}
            cands = [(c.topic, c.partition) for c in plan(st, topic=topic)
                     if c.partition in selected]
            if cands:
                from kcompact.compaction import DEFAULT_MAP_MEMORY
                print(f"compact: {len(cands)} partitions with Spark", file=out, flush=True)
                result.compaction = compact_partitions_spark(
                    session(), store, cands, map_memory=DEFAULT_MAP_MEMORY, force=False)
                for line in _compaction_lines(result.compaction):
                    print(f"compact: {line}", file=out, flush=True)
    finally:
        st.close()
        if ours and spark is not None:
            spark.stop()
    result.seconds = time.monotonic() - t_all
    return result


def run_mirror(args) -> int:
    """``kcompact mirror --engine spark`` (connectors/mirror.py calls it; also the default
    engine of a batch mirror, which falls back to the local engine when Spark cannot run)."""
    from .framework.config import parse_kv_pairs
    from .mirror import cmd_mirror, parse_partitions
    if args.follow:
        raise ConfigError("--follow needs --engine local: the Spark engine runs batch mirrors "
                          "(to the end offsets seen at start)")
    why = spark_available()
    if why is not None:
        if args.engine == "spark":
            raise SparkEngineError(f"--engine spark: {why}; or use --engine local")
        print(f"kcompact mirror: the Spark engine cannot run ({why}); running with --engine "
              "local", file=sys.stderr, flush=True)
        args.engine = "local"
        return cmd_mirror(args)
    import signal

    def on_term(_signum, _frame) -> None:
        raise KeyboardInterrupt  # cancel the job like Ctrl-C: a rerun resumes exactly

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        mirror_with_spark(args.bootstrap_servers, args.topic, args.store,
                          master=args.spark_master, partitions=parse_partitions(args.partitions),
                          kafka_config=parse_kv_pairs(args.kafka_config, flag="-X"),
                          compact=not getattr(args, "no_compact", False))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
