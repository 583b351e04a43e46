"""A real Apache Kafka broker for development, tests and benchmarks: ``kcompact broker
--engine kafka``.

Apache Kafka's jars (``org.apache.kafka:kafka_2.13``, ``kafka-tools`` for the perf-test peers,
and ``slf4j-reload4j`` so the broker logs) are resolved from Maven Central by ``mvn`` through a
small generated pom into ``$KCOMPACT_CACHE_DIR/kafka-<version>/libs`` (default cache
``~/.cache/kcompact``). The file ``.fetched`` is written last, so a fetch cut short is redone from
scratch; once it is there no network (and no ``mvn``) is needed. The version is pinned to
:data:`KAFKA_VERSION` (the one every test and benchmark figure is measured on) and overridden by
``$KCOMPACT_KAFKA_VERSION`` or ``version=``; the launcher runs Kafka 3.x (reload4j) and 4.x
(log4j 2), both in KRaft mode.

``ApacheKafkaBroker`` shares its lifecycle with the Tansu broker
(:class:`~kcompact.connectors.devtools.broker.BrokerProcess`): a context
manager with ``start``/``stop``, ``bootstrap_servers``, ``is_running`` and ``log_tail``. ``start``
writes a KRaft combined-mode single node (``process.roles=broker,controller``, a static
``controller.quorum.voters``) into a temporary directory, formats it with
``kafka.tools.StorageTool`` under a random cluster id, and runs ``kafka.Kafka`` on 127.0.0.1 (the
client listener on ``port`` or a free port, the controller listener on another free one) in its
own process group, until a metadata request answers with that cluster id. ``stop`` sends SIGTERM
(Kafka's controlled shutdown), SIGKILL after ``stop_timeout``, and removes the data.

Settings are for a 2-core machine: ``-Xmx1g -XX:+UseSerialGC``, every internal topic with one
replica and one partition, no initial rebalance delay, the log cleaner on with a 1 s backoff
(Kafka's is 15 s). The broker's log4j writes ``server.log`` and ``log-cleaner.log`` (the
cleaner's "Processed X MB in Y seconds" lines, read by bench/compaction.py) into
:attr:`ApacheKafkaBroker.log_dir`. Differences from Tansu are in tests/integration/BROKER_NOTES.md.

``python -m kcompact.connectors.devtools.apache_kafka fetch`` fetches the jars (``make test`` runs
it); ``... path`` prints the libs directory.
"""

from __future__ import annotations

import base64
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Mapping, Sequence

from kcompact.reput import env as _env

from .broker import HOST, BrokerProcess, _free_port, read_tail
from ..errors import ConnectorsError

__all__ = ["KAFKA_VERSION", "ApacheKafkaBroker", "ApacheKafkaError", "broker_overrides",
           "cache_dir", "fetch", "find_java", "kafka_version", "tool_command"]

VERSION_ENV = "KCOMPACT_KAFKA_VERSION"
#: The Apache Kafka release fetched, tested and benchmarked against (the variable's default).
KAFKA_VERSION = _env.ENV[VERSION_ENV].default
CACHE_ENV = "KCOMPACT_CACHE_DIR"
#: The artifacts resolved (with their runtime dependencies): the broker, the perf-test tools,
#: and an slf4j binding for the logging library of the release: reload4j for Kafka 3.x, the
#: log4j 2 that Kafka 4.x depends on.
ARTIFACTS = (("org.apache.kafka", "kafka_2.13", None), ("org.apache.kafka", "kafka-tools", None))
SLF4J_BINDING = {3: ("org.slf4j", "slf4j-reload4j", "1.7.36"),
                 4: ("org.apache.logging.log4j", "log4j-slf4j-impl", "2.24.3")}
#: Written into the version's directory once every jar is in place.
MARKER = ".fetched"
MVN_TIMEOUT = 900.0
DEFAULT_STARTUP_TIMEOUT = 120.0
#: SIGTERM runs Kafka's controlled shutdown (a few seconds on one node); then SIGKILL.
DEFAULT_STOP_TIMEOUT = 30.0
DEFAULT_HEAP = "1g"
_LOG_TAIL_LINES = 3

#: server.properties of the single node; ``broker_config=`` overrides any of them.
BROKER_DEFAULTS: dict[str, str] = {
    "num.partitions": "1",
    "default.replication.factor": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "group.initial.rebalance.delay.ms": "0",
    "log.cleaner.enable": "true",
    "log.cleaner.threads": "1",
    "log.cleaner.backoff.ms": "1000",
    "num.network.threads": "2",
    "num.io.threads": "4",
    "num.recovery.threads.per.data.dir": "1",
    "log.flush.offset.checkpoint.interval.ms": "60000",
    # a test and demo broker deletes no record by time or size: Kafka's retention check (30 s
    # after start, then every 5 min) deletes whole logs of records stamped more than
    # retention.ms (7 days) ago, and tests and demos produce at fixed 2023 timestamps; a read
    # that a check overtook got OFFSET_OUT_OF_RANGE at offset 0 and no record (seen in CI)
    "log.retention.check.interval.ms": str(7 * 24 * 3600 * 1000),
    "log.initial.task.delay.ms": str(24 * 3600 * 1000),
}
_JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
                "-Dzookeeper.jmx.log4j.disable=true")

_LOG4J = """\
log4j.appender.server=org.apache.log4j.FileAppender
log4j.appender.server.File={logs}/server.log
log4j.appender.server.layout=org.apache.log4j.PatternLayout
log4j.appender.server.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.appender.cleaner=org.apache.log4j.FileAppender
log4j.appender.cleaner.File={logs}/log-cleaner.log
log4j.appender.cleaner.layout=org.apache.log4j.PatternLayout
log4j.appender.cleaner.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.Threshold=ERROR
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.rootLogger=INFO, server, stderr
log4j.logger.kafka.log.LogCleaner=INFO, cleaner
log4j.additivity.kafka.log.LogCleaner=false
log4j.logger.kafka.log.LogCleaner$CleanerThread=INFO, cleaner
log4j.additivity.kafka.log.LogCleaner$CleanerThread=false
log4j.logger.kafka.log.LogCleanerManager=INFO, cleaner
log4j.additivity.kafka.log.LogCleanerManager=false
log4j.logger.kafka.log.Cleaner=INFO, cleaner
log4j.additivity.kafka.log.Cleaner=false
log4j.logger.org.apache.kafka.storage.internals.log.LogCleaner=INFO, cleaner
log4j.additivity.org.apache.kafka.storage.internals.log.LogCleaner=false
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.controller=WARN
"""
#: Tools (perf tests) log errors only, to stderr.
_TOOL_LOG4J = """\
log4j.rootLogger=ERROR, stderr
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n
"""


#: The same for Kafka 4.x, which logs through log4j 2 (its LogCleaner is a Java class in the
#: storage module, and its statistics come from the cleaner thread's logger).
_LOG4J2 = """\
status = error
appender.server.type = File
appender.server.name = server
appender.server.fileName = {logs}/server.log
appender.server.layout.type = PatternLayout
appender.server.layout.pattern = [%d] %p %m (%c)%n
appender.cleaner.type = File
appender.cleaner.name = cleaner
appender.cleaner.fileName = {logs}/log-cleaner.log
appender.cleaner.layout.type = PatternLayout
appender.cleaner.layout.pattern = [%d] %p %m (%c)%n
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.filter.threshold.type = ThresholdFilter
appender.stderr.filter.threshold.level = error
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.server.ref = server
rootLogger.appenderRef.stderr.ref = stderr
logger.cleaner.name = org.apache.kafka.storage.internals.log.LogCleaner
logger.cleaner.level = info
logger.cleaner.additivity = false
logger.cleaner.appenderRef.cleaner.ref = cleaner
logger.cleanerthread.name = org.apache.kafka.storage.internals.log.LogCleaner$CleanerThread
logger.cleanerthread.level = info
logger.cleanerthread.additivity = false
logger.cleanerthread.appenderRef.cleaner.ref = cleaner
logger.cleanermanager.name = org.apache.kafka.storage.internals.log.LogCleanerManager
logger.cleanermanager.level = info
logger.cleanermanager.additivity = false
logger.cleanermanager.appenderRef.cleaner.ref = cleaner
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
"""
_TOOL_LOG4J2 = """\
status = error
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
"""


def _major(version: str) -> int:
    return int(version.split(".", 1)[0])


def _logging(version: str, path: Path, template: str, template2: str, **fmt: str) -> str:
    """Write the release's logging configuration to ``path``; the JVM option that reads it."""
    if _major(version) >= 4:
        path.write_text(template2.format(**fmt) if fmt else template2)
        return f"-Dlog4j2.configurationFile={path}"
    path.write_text(template.format(**fmt) if fmt else template)
    return f"-Dlog4j.configuration=file:{path}"


class ApacheKafkaError(ConnectorsError):
    """Apache Kafka could not be fetched, started or kept running. One line: what failed and
    what to do (install java or mvn, free the port, read the broker's last log line)."""


#: server.properties keys the launcher sets itself: a single node on 127.0.0.1 with its data in
#: a temporary directory (``--override`` of one of them is refused: the broker would not be the
#: one the launcher waits for, or would leave data behind).
LAUNCHER_KEYS = ("process.roles", "node.id", "controller.quorum.voters", "listeners",
                 "advertised.listeners", "controller.listener.names",
                 "listener.security.protocol.map", "inter.broker.listener.name", "log.dirs",
                 "log.dir")


def broker_overrides(overrides: Mapping[str, str]) -> dict[str, str]:
    """``kcompact broker --engine kafka --override KEY=VALUE``: Kafka server configs over
    :data:`BROKER_DEFAULTS`, as ``kafka-server-start.sh --override`` (Kafka checks the values
    at start: a bad one stops it with its own message); a key the launcher owns is refused."""
    for key in overrides:
        if key in LAUNCHER_KEYS:
            raise ApacheKafkaError(
                f"--override {key}: set by kcompact broker itself (a single node on "
                f"127.0.0.1 with temporary data); use --port for the client port")
    return dict(overrides)


# -- where things are ---------------------------------------------------------------------------


def kafka_version() -> str:
    """``$KCOMPACT_KAFKA_VERSION`` or :data:`KAFKA_VERSION`."""
    version = _env.value(VERSION_ENV)
    if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+(-[A-Za-z0-9.]+)?", version) or \
            int(version.split(".")[0]) < 3:
        raise ApacheKafkaError(f"{VERSION_ENV}={version!r} is not a Kafka release number "
                               f"the launcher runs (3.x or 4.x, example: {KAFKA_VERSION}); "
                               "unset it for the pinned one")
    return version


def cache_dir() -> Path:
    """``$KCOMPACT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kcompact``, else ``~/.cache/kcompact``."""
    return Path(_env.cache_dir())


def _version_dir(version: str, cache: Path | None) -> Path:
    return (cache if cache is not None else cache_dir()) / f"kafka-{version}"


def find_java() -> str:
    """The ``java`` on PATH (Kafka 3.9 needs Java 11 or later; tested on 17)."""
    java = shutil.which("java")
    if java is None:
        raise ApacheKafkaError("Apache Kafka needs Java: no `java` on PATH; install Java 17 "
                               "(apt-get install openjdk-17-jre-headless) and retry")
    return java


def _find_mvn() -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ApacheKafkaError("fetching Apache Kafka's jars needs Maven: no `mvn` on PATH; "
                               "install it (apt-get install maven) and retry")
    return mvn


def _pom(version: str) -> str:
    deps = "".join(
        f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v or version}</version></dependency>\n"
        for g, a, v in (*ARTIFACTS, SLF4J_BINDING[min(4, _major(version))]))
    return ("<project xmlns=\"http://maven.apache.org/POM/4.0.0\">"
            "<modelVersion>4.0.0</modelVersion>"
            "<groupId>kcompact</groupId><artifactId>apache-kafka-jars</artifactId>"
            f"<version>{version}</version><packaging>pom</packaging>\n"
            f"<dependencies>\n{deps}</dependencies></project>\n")


def _mvn_failure(output: str, version: str) -> str:
    """The artifact (or else the first error line) of a failed ``mvn`` run, for one line."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", output)
    m = re.search(r"(?:Could not find artifact|Could not transfer artifact|Failure to find|"
                  r"could not be resolved:|resolve artifact) ((?:[\w.-]+:){3,4}[\w.-]*\w)", text)
    if m:
        return f"cannot resolve {m.group(1)}"
    errors = [ln.strip() for ln in text.splitlines() if "[ERROR]" in ln and ln.strip() != "[ERROR]"]
    first = (errors or [ln for ln in text.splitlines() if ln.strip()] or ["no output"])[0]
    return first.replace("[ERROR]", "").strip()[:300] or f"kafka_2.13:{version}"


def fetch(version: str | None = None, cache: Path | None = None,
          log: "callable | None" = None) -> Path:
    """Return the directory of Apache Kafka ``version``'s jars, fetching them with Maven first
    when they are not cached (one fetch at a time per cache, under a lock file)."""
    version = version or kafka_version()
    vdir = _version_dir(version, cache)
    libs = vdir / "libs"
    if (vdir / MARKER).is_file():
        return libs
    vdir.mkdir(parents=True, exist_ok=True)
    with open(vdir.parent / f"kafka-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (vdir / MARKER).is_file():  # another process fetched while we waited
            return libs
        mvn = _find_mvn()
        find_java()
        if log is not None:
            log(f"fetching Apache Kafka {version}'s jars with Maven into {libs}")
        partial = vdir / "libs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(libs, ignore_errors=True)
        (vdir / "pom.xml").write_text(_pom(version))
        cmd = [mvn, "-B", "-q", "-f", str(vdir / "pom.xml"), "dependency:copy-dependencies",
               f"-DoutputDirectory={partial}", "-DincludeScope=runtime"]
        try:
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=MVN_TIMEOUT, cwd=vdir)
        except subprocess.TimeoutExpired:
            raise ApacheKafkaError(f"fetching Apache Kafka {version}'s jars: mvn did not finish "
                                   f"within {MVN_TIMEOUT:.0f}s; check the network to Maven "
                                   "Central and retry") from None
        if done.returncode != 0:
            why = _mvn_failure(done.stdout + "\n" + done.stderr, version)
            raise ApacheKafkaError(f"fetching Apache Kafka {version}'s jars failed: {why} "
                                   "(is the version on Maven Central and the network up? "
                                   f"`mvn -f {vdir / 'pom.xml'} dependency:tree` shows more)")
        if not (partial / f"kafka_2.13-{version}.jar").is_file():
            raise ApacheKafkaError(f"fetching Apache Kafka {version}'s jars: mvn succeeded but "
                                   f"left no kafka_2.13-{version}.jar in {partial}")
        partial.rename(libs)
        (vdir / MARKER).write_text(f"{version}\n{len(list(libs.glob('*.jar')))} jars\n")
    return libs


def _classpath(libs: Path) -> str:
    return str(libs / "*")


def tool_command(main_class: str, args: Sequence[str], *, version: str | None = None,
                 cache: Path | None = None, heap: str = "512m") -> list[str]:
    """A command line running one of Kafka's tools (``org.apache.kafka.tools.ConsumerPerformance``,
    ``ProducerPerformance``, ...) from the fetched jars, logging errors only."""
    version = version or kafka_version()
    libs = fetch(version, cache)
    logging = _logging(version, libs.parent / "tools-log4j.properties", _TOOL_LOG4J,
                       _TOOL_LOG4J2)
    return [find_java(), f"-Xmx{heap}", *_JVM_OPTIONS, logging, "-cp", _classpath(libs),
            main_class, *args]


def _cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding (22 characters)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


# -- the broker ---------------------------------------------------------------------------------


class ApacheKafkaBroker(BrokerProcess):
    """A single-node Apache Kafka (KRaft, broker and controller in one JVM) on ``127.0.0.1``,
    for as long as the context lasts; data and logs live in a temporary directory that
    :meth:`stop` removes (pass ``log_dir`` to keep the logs). The lifecycle is
    :class:`~kcompact.connectors.devtools.broker.BrokerProcess`'s, shared with the Tansu broker. ::

        with ApacheKafkaBroker() as broker:
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    """

    engine = "kafka"
    what = "Apache Kafka"
    error = ApacheKafkaError
    #: Kafka's controlled shutdown (SIGINT would do the same; SIGTERM is what init systems send)
    stop_signal = signal.SIGTERM
    addr_in_use = ("Address already in use",)
    probe_interval = 0.1

    def __init__(
        self,
        port: int | None = None,
        *,
        version: str | None = None,
        cache: str | os.PathLike[str] | None = None,
        heap: str = DEFAULT_HEAP,
        broker_config: Mapping[str, str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port, startup_timeout=startup_timeout, stop_timeout=stop_timeout,
                         log_dir=log_dir)
        self.version = version or kafka_version()
        self._cache = Path(cache) if cache is not None else None
        self._heap = heap
        self._config = dict(broker_config or {})
        self._log_dir: Path | None = None
        self._java: str | None = None
        self._libs: Path | None = None
        self.cluster_id = _cluster_id()

    @property
    def log_dir(self) -> Path | None:
        """Where ``server.log``, ``log-cleaner.log`` and ``broker.log`` (stdout/stderr) are."""
        return self._log_dir

    @property
    def log_path(self) -> Path | None:
        return self._log_dir / "server.log" if self._log_dir is not None else None

    @property
    def cleaner_log_path(self) -> Path | None:
        return self._log_dir / "log-cleaner.log" if self._log_dir is not None else None

    @property
    def data_dir(self) -> Path | None:
        return self._tmpdir / "data" if self._tmpdir is not None else None

    def properties(self, port: int, controller_port: int, data: Path) -> dict[str, str]:
        """server.properties for a node listening on ``port`` (its controller on
        ``controller_port``)."""
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{HOST}:{controller_port}",
            "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(data),
            **BROKER_DEFAULTS,
        }
        props.update(self._config)
        return props

    # -- BrokerProcess ----------------------------------------------------------------------

    def _prepare(self) -> None:
        """java, the jars (fetched when missing), the temporary directory."""
        self._java = find_java()
        self._libs = fetch(self.version, self._cache, log=lambda m: print(
            f"kcompact broker: {m}", file=sys.stderr, flush=True))
        self._tmpdir = Path(tempfile.mkdtemp(prefix="kcompact-kafka-"))
        self._log_dir = self._log_dir_arg or self._tmpdir / "logs"
        self._log_dir.mkdir(parents=True, exist_ok=True)

    def _jvm(self) -> list[str]:
        assert self._tmpdir is not None and self._libs is not None and self._java is not None
        logging = _logging(self.version, self._tmpdir / "log4j.properties", _LOG4J, _LOG4J2,
                           logs=str(self._log_dir))
        return [self._java, f"-Xmx{self._heap}", "-Xms256m", *_JVM_OPTIONS, logging,
                f"-Dkafka.logs.dir={self._log_dir}", "-cp", _classpath(self._libs)]

    def command(self, port: int) -> list[str]:
        assert self._tmpdir is not None
        return [*self._jvm(), "kafka.Kafka", str(self._tmpdir / "server.properties")]

    def _before_spawn(self, port: int) -> tuple[Path, dict[str, str]]:
        """Write server.properties and log4j.properties, format the storage afresh (a retry on
        another port starts over)."""
        assert self._tmpdir is not None and self._log_dir is not None
        data = self._tmpdir / "data"
        shutil.rmtree(data, ignore_errors=True)
        controller_port = _free_port()
        while controller_port == port:
            controller_port = _free_port()
        conf = self._tmpdir / "server.properties"
        conf.write_text("".join(f"{k}={v}\n" for k, v in
                                self.properties(port, controller_port, data).items()))
        env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_OPTS", "KAFKA_HEAP_OPTS",
                                                                "JAVA_TOOL_OPTIONS")}
        # (a one-shot tool: C1 alone compiles what it runs, for about a third less CPU)
        fmt = subprocess.run([*self._jvm(), "-XX:TieredStopAtLevel=1", "kafka.tools.StorageTool",
                              "format",
                              f"--cluster-id={self.cluster_id}", "-c", str(conf)],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                             timeout=self._startup_timeout)
        if fmt.returncode != 0:
            last = _last_line(fmt.stdout + "\n" + fmt.stderr)
            raise ApacheKafkaError(f"formatting Apache Kafka {self.version}'s storage failed "
                                   f"(exit {fmt.returncode}): {last}")
        return self._tmpdir, env

    def _stdout_path(self) -> Path:
        assert self._log_dir is not None
        return self._log_dir / "broker.log"

    def _spawn_error(self, cmd: list[str], exc: OSError) -> ConnectorsError:
        return ApacheKafkaError(f"cannot run {cmd[0]}: {exc}; check the Java install")

    def _cleanup(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
            if self._log_dir_arg is None:
                self._log_dir = None

    def _log_hint(self) -> str:
        return f"see {self._log_dir}; " if self._log_dir_arg is not None else ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The broker's last ERROR/FATAL lines (else its last lines), on one line with " | "."""
        if self._log_dir is None:
            return "(no broker log)"
        kept: list[str] = []
        for name in ("broker.log", "server.log"):
            path = self._log_dir / name
            if path.exists():
                kept += read_tail(path, 32768)
        errors = [ln for ln in kept if not ln.startswith(("at ", "..."))
                  and (" ERROR " in ln or " FATAL " in ln or re.search(r"(Exception|Error)\b", ln))]
        return " | ".join((errors or kept)[-lines:]) or "(broker log is empty)"


def _last_line(text: str) -> str:
    """The cause in a JVM's output: the last exception line (not its stack frames), else the
    last line."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.startswith("log4j:WARN")]
    causes = [ln for ln in lines if not ln.startswith(("at ", "..."))
              and re.search(r"(Exception|Error)\b", ln)]
    return (causes or lines or ["(no output)"])[-1]


def main(argv: list[str] | None = None) -> int:
    """``python -m kcompact.connectors.devtools.apache_kafka fetch|path``."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m kcompact.connectors.devtools.apache_kafka",
                                description="Apache Kafka's jars for kcompact's tests and "
                                "benchmarks")
    p.add_argument("action", choices=("fetch", "path"))
    p.add_argument("--version", default=None, help=f"default ${VERSION_ENV} or {KAFKA_VERSION}")
    args = p.parse_args(argv)
    try:
        libs = fetch(args.version, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ApacheKafkaError as e:
        print(f"kcompact: error: {e}", file=sys.stderr)
        return 1
    if args.action == "path":
        print(libs)
    else:
        print(f"Apache Kafka {args.version or kafka_version()} jars in {libs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
