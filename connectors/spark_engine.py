"""The Spark engine: a quiet SparkSession, the `kcompact` Python data source, and Spark stages.

* ``spark_session(master)``: ``local[*]`` by default; Spark's own output is quiet (log level WARN,
  no UI unless ``KCOMPACT_SPARK_UI=1``); Python workers run this interpreter.
* ``KcompactDataSource``: ``spark.read.format("kcompact").option("store", URL)
  .option("topic", T).load()`` -> ``topic, partition, offset, timestamp, key, value, headers``,
  one input partition per topic-partition, batches through Arrow. ``mode=latest`` (default):
  one row per live key (compacted segments plus the not-yet-compacted tail; tombstoned keys and
  keyless records absent); ``mode=all``: every stored record.
* ``compact_with_spark``: one Spark task per partition that the planner picks.
* ``mirror_with_spark``: one Spark task per topic-partition, each with its own commit-log writer.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from typing import Iterator

import numpy as np

from .errors import ConnectorsError

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


class SparkEngineError(ConnectorsError):
    """A Spark job failed: the message is the task's error; KCOMPACT_DEBUG=1 shows its traceback."""


def _log4j_file() -> str:
    path = os.path.join(tempfile.gettempdir(), "kcompact-log4j2.properties")
    if not os.path.exists(path) or open(path).read() != _LOG4J2:
        with open(path, "w") as f:
            f.write(_LOG4J2)
    return path


def _code_zip() -> str:
    """Our four packages zipped, shipped to executors when the master is not local."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(tempfile.gettempdir(), f"kcompact-code-{os.getpid()}.zip")
    with zipfile.ZipFile(path, "w") as z:
        for pkg in ("reput", "compaction", "replication", "connectors"):
            for dp, _, files in os.walk(os.path.join(root, pkg)):
                for f in files:
                    if f.endswith(".py"):
                        full = os.path.join(dp, f)
                        z.write(full, os.path.relpath(full, root))
    return path


def spark_session(master: str | None = None, app_name: str = "kcompact"):
    """A SparkSession for kcompact's jobs (created once per process, then reused)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise SparkEngineError(f"the Spark engine needs pyspark: {e}") from None
    import shutil
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise SparkEngineError("Spark needs Java 17: apt-get install -y openjdk-17-jre-headless "
                               "(or set JAVA_HOME), or use --engine local")
    master = master or "local[*]"
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
         .config("spark.task.maxFailures", "4")
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


def run_job(fn, *args):
    """Run a Spark action, turning a task failure into one clear line."""
    try:
        return fn(*args)
    except Exception as e:
        msg = str(e)
        # the Python exception raised in the task is quoted in the JVM's message
        for line in reversed(msg.splitlines()):
            line = line.strip()
            if line and ("Error:" in line or "Exception:" in line) and not line.startswith("at "):
                msg = line
                break
        if os.environ.get("KCOMPACT_DEBUG") not in (None, "", "0"):
            print(str(e), file=sys.stderr)
        raise SparkEngineError(f"Spark job failed: {msg.splitlines()[0] if msg else e}") from None


# ---------------------------------------------------------------------------------------------
# reading a partition as Arrow batches


def _arrow_batches(store, topic: str, partition: int, mode: str) -> Iterator:
    """Arrow RecordBatches of a partition (mode 'all' or 'latest')."""
    import pyarrow as pa
    from compaction.latest import latest_selection
    from reput.record import decode_headers

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
    from reput import _kernels as K
    from reput.errors import CorruptRecordError
    bad = _crc_mismatch(data, rel, sizes, K.CRC_TABLES)
    if bad >= 0:
        raise CorruptRecordError(f"{path}: corrupt record at byte {file_start + int(rel[bad])}",
                                 path, file_start + int(rel[bad]))


def _spans(data, rel):
    from reput._kernels import field_spans
    n = rel.shape[0]
    out = {k: np.empty(n, np.int64) for k in ("kstart", "klen", "vstart", "vlen", "hstart",
                                               "hlen")}
    out["attrs"] = np.empty(n, np.uint8)
    field_spans(data, rel, out["kstart"], out["klen"], out["vstart"], out["vlen"],
                out["hstart"], out["hlen"], out["attrs"])
    return out


def _crc_mismatch(data, rel, sizes, tables):
    from reput._kernels import first_crc_mismatch
    return int(first_crc_mismatch(data, rel, sizes, tables))


def _binary(pa, data, starts, lens, nulls):
    """A pyarrow BinaryArray gathered from (start, len) spans of data (nulls where flagged)."""
    from reput._kernels import gather_ranges
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
            from reput import Store
            st = Store.open(self.store_url)
            if self.topic not in st.topics():
                raise SparkEngineError(f"topic {self.topic!r} is not in store {self.store_url}")
            return [InputPartition(p) for p in st.partitions(self.topic)]

        def read(self, partition):
            from reput import Store
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


def register_data_source(spark) -> None:
    global _DS
    if _DS is None:
        _DS = _make_data_source()
    spark.dataSource.register(_DS)


# ---------------------------------------------------------------------------------------------
# Spark stages


def _compact_task(store_url: str, map_memory: int, force: bool):
    def run(candidates):
        from compaction import CompactionOptions, Compactor
        from reput import Store
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


def compact_with_spark(args) -> int:
    """`kcompact compact --engine spark`: one Spark task per partition the planner picks."""
    from compaction import plan
    from reput import Store

    from .cli import _human_bytes, _print_json
    st = Store.open(args.store)
    if args.topic and args.topic not in st.topics():
        raise ConnectorsError(f"topic {args.topic!r} is not in store {st.url}")
    cands = [(c.topic, c.partition) for c in plan(st, topic=args.topic, partition=args.partition,
                                                   force=args.force)]
    st.close()
    spark = spark_session(args.spark_master)
    results = compact_partitions_spark(spark, args.store, cands,
                                       map_memory=args.offset_map_memory, force=args.force)
    if args.json:
        _print_json({"store": args.store, "engine": "spark", "partitions": results})
        return 0
    if not results:
        print("nothing to compact (use --force)")
    for r in results:
        if r.get("skipped"):
            print(f"{r['topic']}-{r['partition']}: skipped: {r['skipped']}")
            continue
        print(f"{r['topic']}-{r['partition']}: {r['rounds']} rounds, kept {r['records_kept']:,} "
              f"dropped {r['records_dropped']:,}, {_human_bytes(r['size_before'])} -> "
              f"{_human_bytes(r['size_after'])} ({r['duration_s']:.2f}s, spark)")
    return 0
