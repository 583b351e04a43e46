"""A real Apache Kafka broker for development, tests and benchmarks (``kcompact broker --engine kafka``).

Apache Kafka's jars (``org.apache.kafka:kafka_2.13``, ``kafka-tools`` for the perf-test peers,
and ``slf4j-reload4j`` so the broker logs) are resolved from Maven Central by ``mvn`` through a
small generated pom into ``$KCOMPACT_CACHE_DIR/kafka-<version>/libs`` (default cache
``~/.cache/kcompact``). The file ``.fetched`` is written last, so a fetch cut short is redone from
scratch; once it is there no network (and no ``mvn``) is needed. The version is pinned to
:data:`KAFKA_VERSION` (the one every test and benchmark figure is measured on) and overridden by
``$KCOMPACT_KAFKA_VERSION`` or ``version=``; the launcher speaks Kafka 3.x (KRaft, reload4j).

:class:`ApacheKafkaBroker` mirrors :class:`~kcompact.connectors.broker.EmbeddedBroker`: a context
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
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from types import TracebackType
from typing import Mapping, Sequence

from .broker import (HOST, _accepts_connections, _free_port, _kill_group, _metadata_cluster_id,
                      _port_is_bindable, _quiet_admin)
from ..errors import ConnectorsError

__all__ = ["KAFKA_VERSION", "ApacheKafkaBroker", "ApacheKafkaError", "cache_dir", "fetch",
           "find_java", "kafka_version", "tool_command"]

#: The Apache Kafka release fetched, tested and benchmarked against.
KAFKA_VERSION = "3.9.1"
VERSION_ENV = "KCOMPACT_KAFKA_VERSION"
CACHE_ENV = "KCOMPACT_CACHE_DIR"
#: The artifacts resolved (with their runtime dependencies): the broker, the perf-test tools,
#: and an slf4j binding for the reload4j that Kafka 3.x logs through.
ARTIFACTS = (("org.apache.kafka", "kafka_2.13", None), ("org.apache.kafka", "kafka-tools", None),
             ("org.slf4j", "slf4j-reload4j", "1.7.36"))
#: Written into the version's directory once every jar is in place.
MARKER = ".fetched"
MVN_TIMEOUT = 900.0
DEFAULT_STARTUP_TIMEOUT = 120.0
#: SIGTERM runs Kafka's controlled shutdown (a few seconds on one node); then SIGKILL.
DEFAULT_STOP_TIMEOUT = 30.0
DEFAULT_HEAP = "1g"
_PORT_PICK_ATTEMPTS = 3
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


class ApacheKafkaError(ConnectorsError):
    """Apache Kafka could not be fetched, started or kept running. One line: what failed and
    what to do (install java or mvn, free the port, read the broker's last log line)."""


# -- where things are ---------------------------------------------------------------------------


def kafka_version() -> str:
    """``$KCOMPACT_KAFKA_VERSION`` or :data:`KAFKA_VERSION`."""
    version = os.environ.get(VERSION_ENV, "").strip() or KAFKA_VERSION
    if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+(-[A-Za-z0-9.]+)?", version):
        raise ApacheKafkaError(f"{VERSION_ENV}={version!r} is not a Kafka release number "
                               f"(example: {KAFKA_VERSION}); unset it for the pinned one")
    return version


def cache_dir() -> Path:
    """``$KCOMPACT_CACHE_DIR`` or ``~/.cache/kcompact``."""
    return Path(os.environ.get(CACHE_ENV, "").strip() or Path.home() / ".cache" / "kcompact")


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
        f"<version>{v or version}</version></dependency>\n" for g, a, v in ARTIFACTS)
    return ("<project xmlns=\"http://maven.apache.org/POM/4.0.0\"><modelVersion>4.0.0</modelVersion>"
            "<groupId>kcompact</groupId><artifactId>apache-kafka-jars</artifactId>"
            f"<version>{version}</version><packaging>pom</packaging>\n"
            f"<dependencies>\n{deps}</dependencies></project>\n")


def _mvn_failure(output: str, version: str) -> str:
    """The artifact (or else the first error line) of a failed ``mvn`` run, for one line."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", output)
    m = (re.search(r"(?:Could not find artifact|Could not transfer artifact|"
                   r"Failure to find|resolve artifact) ([^\s:]+:[^\s:]+(?::[^\s:]+){1,3})", text)
         or re.search(r"artifact ([a-z0-9_.-]+:[a-z0-9_.-]+:[^\s:]*:?[^\s:]*)", text, re.I))
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
    libs = fetch(version, cache)
    log4j = libs.parent / "tools-log4j.properties"
    if not log4j.is_file():
        log4j.write_text(_TOOL_LOG4J)
    return [find_java(), f"-Xmx{heap}", *_JVM_OPTIONS, f"-Dlog4j.configuration=file:{log4j}",
            "-cp", _classpath(libs), main_class, *args]


def _cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding (22 characters)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


# -- the broker ---------------------------------------------------------------------------------


class ApacheKafkaBroker:
    """A single-node Apache Kafka (KRaft, broker and controller in one JVM) on ``127.0.0.1``,
    for as long as the context lasts; data and logs live in a temporary directory that
    :meth:`stop` removes (pass ``log_dir`` to keep the logs). ::

        with ApacheKafkaBroker() as broker:
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    """

    engine = "kafka"

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
        if port is not None and not 0 < port < 65536:
            raise ApacheKafkaError(f"broker port {port} is out of range: choose a port in 1..65535")
        self._requested_port = port
        self.version = version or kafka_version()
        self._cache = Path(cache) if cache is not None else None
        self._heap = heap
        self._config = dict(broker_config or {})
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._log_dir_arg = Path(log_dir) if log_dir is not None else None
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None
        self._log_dir: Path | None = None
        self._log_file = None
        self._finalizer: weakref.finalize | None = None
        self.cluster_id = _cluster_id()

    @property
    def port(self) -> int:
        if self._port is None:
            raise ApacheKafkaError("Apache Kafka is not running: call start() first")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        """``"127.0.0.1:PORT"``, for ``bootstrap.servers``."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

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

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def properties(self, port: int, controller_port: int, data: Path) -> dict[str, str]:
        """server.properties for a node listening on ``port`` (controller on ``controller_port``)."""
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

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "ApacheKafkaBroker":
        """Fetch the jars if needed, format a fresh node, start it; return once it answers."""
        if self._proc is not None:
            raise ApacheKafkaError(f"Apache Kafka is already running on {self.bootstrap_servers}: "
                                   "call stop() before start()")
        java = find_java()
        libs = fetch(self.version, self._cache,
                     log=lambda m: print(f"kcompact broker: {m}", file=sys.stderr, flush=True))
        self._tmpdir = Path(tempfile.mkdtemp(prefix="kcompact-kafka-"))
        self._log_dir = self._log_dir_arg or self._tmpdir / "logs"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self._requested_port is not None:
                if not _port_is_bindable(self._requested_port):
                    raise ApacheKafkaError(
                        f"cannot start Apache Kafka: {HOST}:{self._requested_port} is already in "
                        "use; stop whatever listens there or choose another port")
                self._spawn_and_wait(java, libs, self._requested_port)
            else:
                for attempt in range(_PORT_PICK_ATTEMPTS):
                    try:
                        self._spawn_and_wait(java, libs, _free_port())
                        break
                    except _PortTaken:
                        if attempt == _PORT_PICK_ATTEMPTS - 1:
                            raise ApacheKafkaError(
                                "cannot start Apache Kafka: every free port picked was taken "
                                f"before it could bind ({_PORT_PICK_ATTEMPTS} tries); retry, or "
                                "pass a port") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM to the broker's process group, SIGKILL after the stop timeout; then remove
        its data. Idempotent."""
        if self._proc is not None:
            self._terminate(self._proc)
        self._forget_process()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
            if self._log_dir_arg is None:
                self._log_dir = None

    def __enter__(self) -> "ApacheKafkaBroker":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.bootstrap_servers if self._port is not None else "stopped"
        return f"ApacheKafkaBroker({self.version}, {where}, pid={self.pid})"

    # -- internals ------------------------------------------------------------------------------

    def _spawn_and_wait(self, java: str, libs: Path, port: int) -> None:
        assert self._tmpdir is not None and self._log_dir is not None
        data = self._tmpdir / "data"
        shutil.rmtree(data, ignore_errors=True)  # a retry on another port formats afresh
        controller_port = _free_port()
        while controller_port == port:
            controller_port = _free_port()
        conf = self._tmpdir / "server.properties"
        conf.write_text("".join(f"{k}={v}\n" for k, v in
                                self.properties(port, controller_port, data).items()))
        log4j = self._tmpdir / "log4j.properties"
        log4j.write_text(_LOG4J.format(logs=self._log_dir))
        jvm = [java, f"-Xmx{self._heap}", "-Xms256m", *_JVM_OPTIONS,
               f"-Dlog4j.configuration=file:{log4j}", f"-Dkafka.logs.dir={self._log_dir}",
               "-cp", _classpath(libs)]
        env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_OPTS", "KAFKA_HEAP_OPTS",
                                                                "JAVA_TOOL_OPTIONS")}
        fmt = subprocess.run([*jvm, "kafka.tools.StorageTool", "format",
                              f"--cluster-id={self.cluster_id}",
                              "-c", str(conf)], stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, env=env, timeout=self._startup_timeout)
        if fmt.returncode != 0:
            last = _last_line(fmt.stdout + "\n" + fmt.stderr)
            raise ApacheKafkaError(f"formatting Apache Kafka {self.version}'s storage failed "
                                   f"(exit {fmt.returncode}): {last}")
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self._log_dir / "broker.log", "ab")  # noqa: SIM115 - stop() closes
        try:
            proc = subprocess.Popen([*jvm, "kafka.Kafka", str(conf)], stdin=subprocess.DEVNULL,
                                    stdout=self._log_file, stderr=subprocess.STDOUT,
                                    cwd=self._tmpdir, env=env, start_new_session=True,
                                    close_fds=True)
        except OSError as exc:
            raise ApacheKafkaError(f"cannot run {java}: {exc}; check the Java install") from exc
        self._proc = proc
        self._port = port
        self._finalizer = weakref.finalize(self, _kill_group, proc.pid)
        self._wait_ready(proc, port)

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        admin = None
        while True:
            code = proc.poll()
            if code is not None:
                self._forget_process()
                tail = self.log_tail()
                if "Address already in use" in tail:
                    if self._requested_port is None:
                        raise _PortTaken()
                    raise ApacheKafkaError(
                        f"cannot start Apache Kafka: {HOST}:{port} is already in use; stop "
                        f"whatever listens there or choose another port ({tail})")
                raise ApacheKafkaError(
                    f"Apache Kafka exited with code {code} while starting on {HOST}:{port}; "
                    f"{self._log_hint()}fix what its log says: {tail}")
            if _accepts_connections(port):
                if admin is None:
                    admin = _quiet_admin(f"{HOST}:{port}")
                if _metadata_cluster_id(admin) == self.cluster_id and proc.poll() is None:
                    return
            if time.monotonic() >= deadline:
                raise ApacheKafkaError(
                    f"Apache Kafka did not answer on {HOST}:{port} within "
                    f"{self._startup_timeout:.0f}s; {self._log_hint()}raise the startup timeout "
                    f"if the machine is overloaded (last lines of its log: {self.log_tail()})")
            time.sleep(0.1)

    def _log_hint(self) -> str:
        return f"see {self._log_dir}; " if self._log_dir_arg is not None else ""

    def _forget_process(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._proc = None
        self._port = None

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self._stop_timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The broker's last ERROR/FATAL lines (else its last lines), on one line with " | "."""
        if self._log_dir is None:
            return "(no broker log)"
        kept: list[str] = []
        for name in ("broker.log", "server.log"):
            path = self._log_dir / name
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - 32768))
                    kept += [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()
                             if ln.strip()]
        errors = [ln for ln in kept if not ln.startswith(("at ", "..."))
                  and (" ERROR " in ln or " FATAL " in ln or re.search(r"(Exception|Error)\b", ln))]
        return " | ".join((errors or kept)[-lines:]) or "(broker log is empty)"


class _PortTaken(Exception):
    """A port we picked was bound by someone else before Kafka got it; pick again."""


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
                                description="Apache Kafka's jars for kcompact's tests and benchmarks")
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
