"""A quiet SparkSession for kcompact's jobs, and running a Spark action as one clear line.

``spark_session(master)``: ``local[*]`` by default; Spark's own output is quiet (log level WARN,
no UI unless ``KCOMPACT_SPARK_UI=1``); Python workers run this interpreter unless
``PYSPARK_PYTHON`` names another; the ``kcompact`` data source (source.py) is registered.

On a master whose executors run in JVMs of their own (``spark://``, ``yarn``, ``k8s://``,
``local-cluster``), a probe job asks the executors' Python for its kcompact
(``check_executors``): it must be the driver's version, with its C extensions, installed there
or unpacked from ``spark.archives`` (a packed virtualenv). The driver says which on stderr, and
refuses anything else with one line saying what to do (``executors_verdict``). kcompact itself
is never shipped as code: a copy on the executors' path would shadow the installed package and
could not hold its C extensions.

In local mode Spark retries a task only when the master says so (``local[N,F]``: in local mode
``spark.task.maxFailures`` is ignored), so ``local[N]`` becomes ``local[N,TASK_MAX_FAILURES]``.
The JVM's warning about incubator modules, which Spark 4's launcher makes it print on every
start, is filtered out of its stderr (``JVM_NOISE``).
``run_job`` turns a failed job into one line naming the task's error (``task_error_line``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import threading

from kcompact.reput import env

from .errors import SparkEngineError, SparkExecutorsError
from .source import register_data_source

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
#: Lines the driver's JVM prints on stderr that say nothing to a kcompact user. Spark 4's
#: launcher puts --add-modules=jdk.incubator.vector on every driver JVM's command line
#: (spark-launcher's JavaModuleOptions, added by SparkSubmitCommandBuilder whatever the
#: configuration), and Java warns on every start of a JVM that resolves an incubator module
#: (jdk.internal.module.ModuleBootstrap), with no option to turn the warning off.
JVM_NOISE = (b"WARNING: Using incubator modules: jdk.incubator.vector",)


def _debug() -> bool:
    return env.debug()


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
#: the masters whose executors are this process's JVM and Python: local, local[N], local[N,F]
_LOCAL_N_F_RE = re.compile(r"^local(?:\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\])?$")


def master_with_retries(master: str, max_failures: int = TASK_MAX_FAILURES) -> str:
    """``local``/``local[N]``/``local[*]`` -> ``local[N,F]``: in local mode Spark ignores
    spark.task.maxFailures and gives each task one attempt unless the master names F."""
    m = _LOCAL_RE.match(master.strip())
    if m is None:
        return master
    return f"local[{m.group(1) or 1},{max_failures}]"


#: The C extensions an executor's kcompact must import: a copy without them (a zip of the
#: .py files, a source tree never built) is not kcompact.
NATIVE_MODULES = ("kcompact.reput._native", "kcompact.compaction._native",
                  "kcompact.connectors.apps.kv._native", "kcompact.connectors.framework._rdkafka")


@dataclasses.dataclass(frozen=True)
class ExecutorPython:
    """What one probe task found in an executor's Python: ``version`` None when it has no
    kcompact; ``problem`` the error importing kcompact or one of its C extensions;
    ``from_archive``: kcompact lies under the task's working directory (a packed environment
    unpacked from ``spark.archives``)."""

    host: str
    python: str
    version: str | None
    problem: str | None = None
    from_archive: bool = False


def _probe_task():
    """The probe task: what the executor's Python holds. A nested function, so it is pickled by
    value and runs on an executor whose Python has no kcompact (then it says so)."""
    def run(_items):
        import importlib
        import os
        import socket
        import sys
        version = problem = None
        archive = False
        try:
            import kcompact
            version = kcompact.__version__
            here = os.path.abspath(os.getcwd()) + os.sep  # links kept: YARN links archives
            archive = (os.path.abspath(kcompact.__file__).startswith(here)
                       or os.path.abspath(sys.executable).startswith(here))
            for name in native:
                importlib.import_module(name)
        except ImportError as e:
            problem = f"{type(e).__name__}: {e}"
        yield (socket.gethostname(), sys.executable, version, problem, archive)
    native = NATIVE_MODULES
    return run


def _spark_python(spark) -> str:
    """The Python the executors are told to run (spark.pyspark.python, else PYSPARK_PYTHON)."""
    conf = spark.sparkContext.getConf()
    return conf.get("spark.pyspark.python", None) or os.environ.get("PYSPARK_PYTHON", "python3")


_HOW = ("install kcompact {v} in the Python the executors run (PYSPARK_PYTHON) on every worker, "
        "or ship a packed virtualenv with spark.archives (docs/spark.md, \"On a cluster\")")


def executors_verdict(driver_version: str, found: list[ExecutorPython], python: str) -> str:
    """The one-line note saying which kcompact the executors run, when every probed executor
    imports kcompact ``driver_version`` with its C extensions; else SparkExecutorsError, one
    line saying what is wrong and what to do. ``python``: the Python the executors were told
    to run (for the messages)."""
    how = _HOW.format(v=driver_version)
    if not found:
        raise SparkExecutorsError(f"no Spark executor answered kcompact's probe; {how}")
    for e in found:
        where = f"the executors' Python ({e.python} on {e.host})"
        if e.version is None:
            raise SparkExecutorsError(f"{where} has no kcompact; {how}")
        if e.version != driver_version:
            raise SparkExecutorsError(f"{where} has kcompact {e.version}, the driver "
                                      f"{driver_version}: {how}")
        if e.problem is not None:
            raise SparkExecutorsError(f"{where} has kcompact {e.version} but cannot import it "
                                      f"({e.problem}); {how}")
    hosts = sorted({e.host for e in found})
    pythons = sorted({e.python for e in found})
    how_there = ("unpacked from spark.archives" if all(e.from_archive for e in found) else
                 "installed in their Python")
    return (f"kcompact: Spark executors run kcompact {driver_version} {how_there} "
            f"({python}; {len(pythons)} Python{'s' if len(pythons) > 1 else ''} on "
            f"{', '.join(hosts)})")


def check_executors(spark) -> str:
    """Run the probe on the executors (a task per core Spark has, at least 2, so that every
    executor is likely asked) and return executors_verdict's note (or raise its error)."""
    import kcompact
    python = _spark_python(spark)
    n = max(2, spark.sparkContext.defaultParallelism)
    rdd = spark.sparkContext.parallelize(range(n), n)
    try:
        rows = run_job(lambda: rdd.mapPartitions(_probe_task()).collect())
    except SparkEngineError as e:
        why = str(e).removeprefix("Spark job failed: ")
        raise SparkExecutorsError(
            f"the Spark executors cannot run kcompact's probe with Python {python} ({why}); "
            + _HOW.format(v=kcompact.__version__)) from None
    found = sorted({ExecutorPython(*r) for r in rows}, key=lambda e: (e.host, e.python))
    return executors_verdict(kcompact.__version__, found, python)


def _relay(src_fd: int, out_fd: int) -> None:
    """Copy the JVM's stderr to ``out_fd`` line by line, without the lines of JVM_NOISE, until
    the JVM (and every process that inherited the pipe) is gone."""
    with os.fdopen(src_fd, "rb") as lines:
        for line in lines:
            if line.rstrip(b"\r\n") in JVM_NOISE:
                continue
            try:
                os.write(out_fd, line)
            except OSError:
                pass  # our stderr is gone: keep draining, or the JVM would block on a full pipe
    os.close(out_fd)


@contextlib.contextmanager
def _jvm_stderr_filtered():
    """While the driver's JVM starts inside this block, its stderr (fd 2, which Spark's
    spark-submit and the JVM inherit) is a pipe that a thread relays to this process's stderr
    without JVM_NOISE, for as long as the JVM runs. Nothing is changed in Spark or Java: the
    JVM only inherits another stderr. A JVM already running keeps its own."""
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    out_fd = os.dup(2)
    threading.Thread(target=_relay, args=(read_fd, out_fd), name="kcompact-jvm-stderr",
                     daemon=True).start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(out_fd, 2)  # ours again; the JVM and its children keep the pipe


def spark_session(master: str | None = None, app_name: str = "kcompact"):
    """A SparkSession for kcompact's jobs (created once per process, then reused)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
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
    ui = env.flag("KCOMPACT_SPARK_UI")
    java = f"-Dlog4j.configurationFile=file:{log4j} {env.value('KCOMPACT_SPARK_JAVA_OPTIONS')}"
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.ui.enabled", "true" if ui else "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.extraJavaOptions", java.strip())
         .config("spark.executor.extraJavaOptions", java.strip())
         .config("spark.sql.shuffle.partitions", "8")
         .config("spark.task.maxFailures", str(TASK_MAX_FAILURES))
         .config("spark.python.worker.reuse", "true"))
    if master.startswith("local"):
        b = b.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress",
                                                              "127.0.0.1")
    try:
        with _jvm_stderr_filtered():
            spark = b.getOrCreate()
    except Exception as e:  # py4j / JVM start failures
        raise SparkEngineError(f"cannot start Spark ({master}): {str(e).splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("WARN")
    if _LOCAL_N_F_RE.match(master) is None:
        # executors in JVMs of their own, with the Python they were told to run: it must hold
        # this kcompact (installed there, or a packed environment from spark.archives)
        try:
            note = check_executors(spark)
        except BaseException:
            spark.stop()
            raise
        print(note, file=sys.stderr, flush=True)
    register_data_source(spark)
    return spark


def spark_active() -> bool:
    """Whether this process already has a SparkSession (then it is not ours to stop)."""
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession
    try:
        SparkSession.active()
    except PySparkRuntimeError:
        return False
    return True


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
    """None when the Spark engine can run here, else why not (one line): pyspark is always
    installed with kcompact; Java is not."""
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


def stage_counts(spark) -> tuple[int, int, int]:
    """(completed, running, failed attempts) tasks of the active stages; zeros when Spark
    cannot say (progress only)."""
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
