"""Helpers of test_connect_rest.py: a ``kcompact connect standalone`` worker with the REST API
run in this process (or as the command), Apache Kafka Connect 3.9's standalone worker run from
Maven Central's jars, an HTTP client, and the comparison of JSON *shapes* (keys and value types,
not values)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kcompact.connectors.devtools import apache_kafka

WAIT_S = 60.0


class Lines(io.TextIOBase):
    """A thread-safe text sink whose lines a test can wait on."""

    def __init__(self) -> None:
        self._buf: list[str] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf.append(s)
        return len(s)

    def text(self) -> str:
        with self._lock:
            return "".join(self._buf)

    def wait_for(self, pattern: str, timeout: float = WAIT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s; output:\n"
                             f"{self.text()[-3000:]}")


def request(url: str, method: str = "GET", body: Any = None, headers: dict | None = None,
            context: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    text = raw.decode() if raw else ""
    try:
        return status, json.loads(text) if text.strip() else None
    except ValueError:
        return status, text


def wait_until(fn, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})")


class KcompactConnect:
    """``kcompact connect standalone`` with ``listeners=http://127.0.0.1:0`` in a thread."""

    def __init__(self, tmp: Path, bootstrap: str, connector_files: list[str] = (),
                 extra: dict[str, str] | None = None, worker_name: str = "worker.properties"):
        self.worker = tmp / worker_name
        props = {"bootstrap.servers": bootstrap, "listeners": "http://127.0.0.1:0",
                 "offset.flush.interval.ms": "200", "metrics.log.interval.ms": "0",
                 **(extra or {})}
        self.worker.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        self.files = list(connector_files)
        self.out = Lines()
        self.stop_event = threading.Event()
        self.result: list[Any] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kcompact.connectors.apps.connect import run_standalone
        try:
            self.result.append(run_standalone(str(self.worker), self.files, out=self.out,
                                              stop=self.stop_event))
        except BaseException as e:  # noqa: BLE001 - reported by start()/stop()
            self.result.append(e)

    def start(self) -> "KcompactConnect":
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            m = re.search(r"REST API on (https?://\S+)", self.out.text())
            if m:
                self.url = m.group(1)
                return self
            if self.result:
                raise AssertionError(f"the worker ended: {self.result[0]!r}\n{self.out.text()}")
            time.sleep(0.02)
        raise AssertionError(f"no REST API within {WAIT_S:.0f}s:\n{self.out.text()}")

    def stop(self) -> Any:
        self.stop_event.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the worker did not stop"
        if self.result and isinstance(self.result[0], BaseException):
            raise self.result[0]
        return self.result[0] if self.result else None

    def __enter__(self) -> "KcompactConnect":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- Apache Kafka Connect 3.9.1's standalone worker -------------------------------------------


def connect_file_jar() -> Path:
    """``org.apache.kafka:connect-file`` of the pinned version, fetched with Maven into the
    kcompact cache (beside Kafka's jars, which hold connect-runtime and its dependencies)."""
    version = apache_kafka.kafka_version()
    d = apache_kafka.cache_dir() / f"connect-file-{version}"
    jar = d / f"connect-file-{version}.jar"
    if jar.is_file():
        return jar
    d.mkdir(parents=True, exist_ok=True)
    mvn = apache_kafka._find_mvn()
    done = subprocess.run([mvn, "-B", "-q", "dependency:copy",
                           f"-Dartifact=org.apache.kafka:connect-file:{version}",
                           f"-DoutputDirectory={d}"], cwd=d, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not jar.is_file():
        raise RuntimeError(f"fetching connect-file {version}: {done.stdout[-500:]}"
                           f"{done.stderr[-500:]}")
    return jar


def connect_unavailable() -> str | None:
    if not any(os.access(os.path.join(p, "java"), os.X_OK)
               for p in os.environ.get("PATH", "").split(os.pathsep)):
        return "Apache Kafka Connect needs java on PATH"
    libs = apache_kafka.cache_dir() / f"kafka-{apache_kafka.kafka_version()}" / "libs"
    if not any(libs.glob("connect-runtime-*.jar")):
        try:
            apache_kafka.fetch()
        except apache_kafka.ApacheKafkaError as e:
            return f"Apache Kafka's jars: {e}"
    try:
        connect_file_jar()
    except (RuntimeError, apache_kafka.ApacheKafkaError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None


_LOG4J = """log4j.rootLogger=WARN, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
"""


class ApacheConnect:
    """``org.apache.kafka.connect.cli.ConnectStandalone`` on 127.0.0.1, a free port."""

    def __init__(self, tmp: Path, bootstrap: str, extra: dict[str, str] | None = None,
                 scheme: str = "http", context: Any = None):
        from kcompact.connectors.devtools.broker import _free_port
        self.tmp = tmp
        self.port = _free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.context = context  # the probe's TLS context (https)
        (tmp / "log4j.properties").write_text(_LOG4J)
        props = {"bootstrap.servers": bootstrap, "listeners": self.url,
                 "key.converter": "org.apache.kafka.connect.storage.StringConverter",
                 "value.converter": "org.apache.kafka.connect.storage.StringConverter",
                 "offset.storage.file.filename": str(tmp / "offsets"),
                 "offset.flush.interval.ms": "500", **(extra or {})}
        (tmp / "worker.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ApacheConnect":
        libs = apache_kafka.fetch()
        cp = f"{libs}/*{os.pathsep}{connect_file_jar()}"
        self.log = open(self.tmp / "connect.log", "wb")
        self.proc = subprocess.Popen(
            [apache_kafka.find_java(), "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
             f"-Dlog4j.configuration=file:{self.tmp / 'log4j.properties'}", "-cp", cp,
             "org.apache.kafka.connect.cli.ConnectStandalone", str(self.tmp / "worker.properties")],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"Apache Connect exited {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                status, doc = request(self.url + "/", context=self.context)
                if status == 200 and isinstance(doc, dict) and "version" in doc:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"Apache Connect did not answer within 120s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.tmp / "connect.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()


# -- JSON shapes ------------------------------------------------------------------------------


def shape(v: Any) -> Any:
    """Keys and value types: a dict's keys with their values' shapes, a list's elements' shapes
    merged, a scalar's type name."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        out: Any = None
        for x in v:
            out = merge(out, shape(x))
        return [out] if out is not None else []
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return "str"


def merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: merge(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):
        return [merge(a[0] if a else None, b[0] if b else None)] if (a or b) else []
    sa = a if isinstance(a, frozenset) else frozenset([a] if isinstance(a, str) else [repr(a)])
    sb = b if isinstance(b, frozenset) else frozenset([b] if isinstance(b, str) else [repr(b)])
    return sa | sb


def differences(a: Any, b: Any, path: str = "$") -> list[str]:
    """Where shapes ``a`` and ``b`` differ: a null matches any type (nullable fields); an empty
    list matches any list."""
    def types(x):
        return x if isinstance(x, frozenset) else frozenset([x]) if isinstance(x, str) else None

    ta, tb = types(a), types(b)
    if ta is not None and tb is not None:
        ra, rb = ta - {"null"}, tb - {"null"}
        return [] if not ra or not rb or ra & rb else [f"{path}: {sorted(ta)} vs {sorted(tb)}"]
    if ta is not None and "null" in ta and len(ta) == 1 or \
            tb is not None and "null" in tb and len(tb) == 1:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        if set(a) != set(b):
            out.append(f"{path}: keys {sorted(a)} vs {sorted(b)}")
        for k in set(a) & set(b):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if not a or not b:
            return []
        return differences(a[0], b[0], f"{path}[]")
    return [f"{path}: {a!r} vs {b!r}"]


def python() -> str:
    return sys.executable
