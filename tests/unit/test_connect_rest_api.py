"""The Connect REST API's handlers and herder (connectors/apps/connect_rest/) with no broker:
the connectors are an idle source of this module (its own task runner, which touches no Kafka),
served by the real aiohttp server on 127.0.0.1, port 0. The Kafka parts (a store sink mirroring,
the Apache Connect oracle) are tests/integration/test_connect_rest.py."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from kcompact.connectors.apps.connect_rest import Herder, start_rest
from kcompact.connectors.apps.connect_rest.auth import hash_password, load_users
from kcompact.connectors.errors import ConfigError
from kcompact.connectors.framework.api import SourceConnector, SourceTask
from kcompact.connectors.framework.config import ConfigDef, Importance, Type
from kcompact.connectors.framework.task_runner import TaskRunner
from kcompact.connectors.framework.worker import Worker

WAIT_S = 20.0


class _Failure(RuntimeError):
    pass


class IdleRunner(TaskRunner):
    """Waits for its stop event; with ``fail=true`` it fails at once."""

    def __init__(self, name: str, props: dict, stop: threading.Event):
        super().__init__(f"{name}-0")
        self.props, self.stop_event = props, stop

    def _run(self) -> None:
        if self.props.get("fail"):
            self.failure = _Failure("the idle task was told to fail")
            return
        until = self.props.get("until")
        if until:  # a bounded task: it ends by itself once the file exists
            import os
            while not os.path.exists(until) and not self.stop_event.wait(0.01):
                pass
            return
        self.stop_event.wait()


class IdleTask(SourceTask):
    def start(self, props) -> None:
        pass

    def stop(self) -> None:
        pass

    def poll(self):
        return []


class IdleSource(SourceConnector):
    CONFIG = (ConfigDef()
              .define("fail", Type.BOOLEAN, False, None, Importance.LOW, "Fail the task.")
              .define("label", Type.STRING, "", None, Importance.LOW, "Anything.")
              .define("until", Type.STRING, "", None, Importance.LOW,
                      "End the task once this file exists."))

    def task_class(self):
        return IdleTask

    def make_runners(self, *, name, props, settings, stop, startup_timeout, log):
        return [IdleRunner(name, dict(props), stop)]


CLASS = f"{__name__}.IdleSource"


def _rest(worker: Worker, state_dir, log):
    """The REST API over a herder of ``worker``, at its ``listeners`` (required)."""
    herder = Herder(worker, state_dir=state_dir, log=log)
    return start_rest(worker, herder, worker.config["listeners"], required=True,
                      where="worker.properties", log=log)


class Api:
    def __init__(self, tmp, extra: dict | None = None, files=()):
        self.log = io.StringIO()
        props = {"bootstrap.servers": "127.0.0.1:9", "listeners": "http://127.0.0.1:0",
                 **(extra or {})}
        self.worker = Worker(props, log=self.log)
        self.rest = _rest(self.worker, str(tmp / "state"), self.log)
        self.rest.herder.load(list(files))
        self.base = self.rest.url

    def close(self) -> None:
        self.worker.stop()
        self.rest.herder.shutdown()
        self.rest.stop()

    def __call__(self, method: str, path: str, body: Any = None, headers=None
                 ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=WAIT_S) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        return status, json.loads(raw) if raw.strip() else None

    def state(self, name: str) -> str:
        doc = self("GET", f"/connectors/{name}/status")[1]
        return doc["connector"]["state"] + "/" + ",".join(t["state"] for t in doc["tasks"])

    def wait_state(self, name: str, want: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.state(name) != want:
            assert time.monotonic() < deadline, f"{name}: {self.state(name)}, not {want}"
            time.sleep(0.01)


@pytest.fixture
def api(tmp_path):
    a = Api(tmp_path)
    yield a
    a.close()


def _config(**kw) -> dict[str, str]:
    return {"connector.class": CLASS, "tasks.max": "1", **kw}


def test_lifecycle_and_shapes(api):
    status, doc = api("GET", "/")
    assert status == 200 and set(doc) == {"version", "commit", "kafka_cluster_id"}
    assert api("GET", "/connectors") == (200, [])
    status, doc = api("POST", "/connectors", {"name": "a", "config": _config()})
    assert status == 201
    assert doc == {"name": "a", "config": dict(_config(), name="a"),
                   "tasks": [{"connector": "a", "task": 0}], "type": "source"}
    assert api("POST", "/connectors", {"name": "a", "config": _config()}) == (
        409, {"error_code": 409, "message": "Connector a already exists"})
    api.wait_state("a", "RUNNING/RUNNING")
    status, doc = api("GET", "/connectors/a/status")
    wid = api.rest.herder.worker_id
    assert doc == {"name": "a", "connector": {"state": "RUNNING", "worker_id": wid},
                   "tasks": [{"id": 0, "state": "RUNNING", "worker_id": wid}], "type": "source"}
    status, doc = api("GET", "/connectors?expand=status&expand=info")
    assert set(doc) == {"a"} and set(doc["a"]) == {"status", "info"}
    assert api("GET", "/connectors/a/tasks")[1][0]["id"] == {"connector": "a", "task": 0}
    assert api("GET", "/connectors/a/tasks/0/status")[1]["state"] == "RUNNING"
    assert api("GET", "/connectors/a/tasks/3/status") == (
        404, {"error_code": 404, "message": "No status found for task a-3"})
    assert api("GET", "/connectors/zz") == (
        404, {"error_code": 404, "message": "Connector zz not found"})

    assert api("PUT", "/connectors/a/pause")[0] == 202
    assert api.state("a") == "PAUSED/PAUSED"
    assert api("PUT", "/connectors/a/resume")[0] == 202
    api.wait_state("a", "RUNNING/RUNNING")
    assert api("PUT", "/connectors/a/stop")[0] == 204
    assert api.state("a") == "STOPPED/"
    assert api("GET", "/connectors/a/tasks")[1] == []
    assert api("PUT", "/connectors/a/resume")[0] == 202
    api.wait_state("a", "RUNNING/RUNNING")
    assert api("DELETE", "/connectors/a")[0] == 204
    assert api("DELETE", "/connectors/a")[0] == 404
    assert api("GET", "/connectors") == (200, [])
    assert api("GET", "/no/such") == (404, {"error_code": 404, "message": "HTTP 404 Not Found"})
    assert api("DELETE", "/connector-plugins")[0] == 405


def test_failed_task_has_a_trace_and_restarts(api):
    assert api("POST", "/connectors", {"name": "f", "config": _config(fail="true")})[0] == 201
    api.wait_state("f", "RUNNING/FAILED")
    task = api("GET", "/connectors/f/tasks/0/status")[1]
    assert task["state"] == "FAILED" and "the idle task was told to fail" in task["trace"]
    assert "_Failure" in task["trace"]
    # KIP-745: only the failed task restarts, and the answer shows it RESTARTING
    status, doc = api("POST", "/connectors/f/restart?includeTasks=true&onlyFailed=true")
    assert status == 202
    assert doc["connector"]["state"] == "RUNNING" and doc["tasks"][0]["state"] == "RESTARTING"
    api.wait_state("f", "RUNNING/FAILED")  # it fails again: its config says so
    assert api("POST", "/connectors/f/restart")[0] == 204
    # a fixed config restarts it for good
    status, doc = api("PUT", "/connectors/f/config", _config(fail="false"))
    assert status == 200 and doc["config"]["fail"] == "false"
    api.wait_state("f", "RUNNING/RUNNING")
    assert api("POST", "/connectors/f/tasks/0/restart")[0] == 204
    assert api("POST", "/connectors/f/tasks/4/restart")[0] == 404
    assert api("POST", "/connectors/nope/restart")[0] == 404
    assert api("POST", "/connectors/f/restart?includeTasks=maybe")[0] == 400


def test_bad_config_is_400_naming_the_key_and_changes_nothing(api, tmp_path):
    status, doc = api("POST", "/connectors", {"name": "b", "config": _config(lable="x")})
    assert status == 400 and doc["error_code"] == 400
    assert "'lable'" in doc["message"] and "did you mean 'label'" in doc["message"]
    assert api("GET", "/connectors") == (200, [])
    assert not (tmp_path / "state").exists() or not list((tmp_path / "state").iterdir())
    status, doc = api("POST", "/connectors", {"name": "b", "config": _config(fail="sometimes")})
    assert status == 400 and "fail" in doc["message"]
    assert api("POST", "/connectors", {"name": "b", "config": _config()})[0] == 201
    before = (tmp_path / "state" / "b.json").read_text()
    status, doc = api("PUT", "/connectors/b/config", _config(**{"tasks.max": "0"}))
    assert status == 400 and "tasks.max" in doc["message"]
    assert (tmp_path / "state" / "b.json").read_text() == before
    assert api("GET", "/connectors/b/config")[1] == dict(_config(), name="b")
    assert api.state("b") == "RUNNING/RUNNING"
    status, doc = api("PUT", "/connectors/b/config", dict(_config(), name="c"))
    assert status == 400 and "doesn't match" in doc["message"]
    assert api("POST", "/connectors", {"name": " s", "config": _config()})[0] == 400
    assert api("POST", "/connectors", [1, 2])[0] == 400


def test_put_config_creates_and_state_survives_a_restart(tmp_path):
    a = Api(tmp_path)
    try:
        status, doc = a("PUT", "/connectors/p/config", _config(label="one"))
        assert status == 201 and doc["name"] == "p"
        assert a("PUT", "/connectors/p/pause")[0] == 202
        assert a("POST", "/connectors", {"name": "q", "config": _config()})[0] == 201
        assert a("PUT", "/connectors/q/stop")[0] == 204
    finally:
        a.close()
    kept = json.loads((tmp_path / "state" / "p.json").read_text())
    assert kept == {"format": 1, "name": "p", "config": dict(_config(label="one"), name="p"),
                    "target_state": "PAUSED"}
    b = Api(tmp_path)
    try:
        assert b("GET", "/connectors")[1] == ["p", "q"]
        assert b.state("p") == "PAUSED/PAUSED" and b.state("q") == "STOPPED/"
        assert b("GET", "/connectors/p/config")[1]["label"] == "one"
        assert b("PUT", "/connectors/p/resume")[0] == 202
        b.wait_state("p", "RUNNING/RUNNING")
    finally:
        b.close()
    # a connector of the command line wins over a state file of the same name
    c = Api(tmp_path, files=[("p.properties", dict(_config(label="file"), name="p"))])
    try:
        assert c("GET", "/connectors/p/config")[1]["label"] == "file"
        assert "ignored" in c.log.getvalue()
    finally:
        c.close()


def test_unreadable_state_file_is_named(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "x.json").write_text("{not json")
    w = Worker({"bootstrap.servers": "127.0.0.1:9", "listeners": "http://127.0.0.1:0"},
               log=io.StringIO())
    rest = _rest(w, str(tmp_path / "state"), io.StringIO())
    try:
        with pytest.raises(Exception, match=r"x\.json: not a connector state file"):
            rest.herder.load([])
    finally:
        rest.stop()


def test_validate(api):
    good = _config(name="v")
    status, doc = api("PUT", f"/connector-plugins/{CLASS}/config/validate", good)
    assert status == 200 and doc["error_count"] == 0
    assert set(doc) == {"name", "error_count", "groups", "configs"}
    entry = doc["configs"][0]
    assert set(entry) == {"definition", "value"}
    assert set(entry["value"]) == {"name", "value", "recommended_values", "errors", "visible"}
    assert {"name", "type", "required", "default_value", "importance", "documentation",
            "group", "width", "display_name", "dependents", "order"} == set(entry["definition"])
    bad = dict(good, **{"tasks.max": "many", "lable": "x"})
    bad.pop("name")
    status, doc = api("PUT", f"/connector-plugins/{CLASS}/config/validate", bad)
    errors = {c["value"]["name"]: c["value"]["errors"] for c in doc["configs"]}
    assert doc["error_count"] == 3
    assert errors["tasks.max"] and "integer" in errors["tasks.max"][0]
    assert errors["name"] == ['Missing required configuration "name" which has no default '
                              'value.']
    assert "did you mean 'label'" in errors["lable"][0]
    status, doc = api("PUT", f"/connector-plugins/{CLASS}/config/validate",
                      dict(good, **{"connector.class": "StoreSinkConnector"}))
    assert status == 400 and "does not match" in doc["message"]
    status, doc = api("PUT", "/connector-plugins/NoSuchConnector/config/validate", good)
    assert status == 400 and "NoSuchConnector" in doc["message"]
    status, doc = api("GET", "/connector-plugins")
    assert {p["class"].rsplit(".", 1)[1] for p in doc} == {
        "StoreSinkConnector", "StoreSourceConnector", "LevelDBSinkConnector"}
    status, doc = api("GET", "/connector-plugins?connectorsOnly=false")
    assert "converter" in {p["type"] for p in doc}
    status, doc = api("GET", "/connector-plugins/StoreSinkConnector/config")
    assert status == 200 and "store.url" in {k["name"] for k in doc}


def test_offsets_need_stopped_and_sources_are_refused(api):
    assert api("POST", "/connectors", {"name": "o", "config": _config()})[0] == 201
    status, doc = api("DELETE", "/connectors/o/offsets")
    assert status == 400 and "STOPPED" in doc["message"]
    assert api("PATCH", "/connectors/o/offsets", {"offsets": []})[0] == 400
    assert api("GET", "/connectors/o/offsets")[0] == 400  # a source: not offered yet
    assert api("GET", "/connectors/zz/offsets")[0] == 404


def test_loggers(api):
    status, doc = api("GET", "/admin/loggers")
    assert status == 200 and set(doc["root"]) == {"level", "last_modified"}
    status, doc = api("PUT", "/admin/loggers/kcompact.test.rest", {"level": "DEBUG"})
    assert status == 200 and doc == ["kcompact.test.rest"]
    status, doc = api("GET", "/admin/loggers/kcompact.test.rest")
    assert doc["level"] == "DEBUG" and isinstance(doc["last_modified"], int)
    assert api("PUT", "/admin/loggers/kcompact.test.rest", {"level": "LOUD"})[0] == 400
    assert api("GET", "/admin/loggers/kcompact.nothing.here")[0] == 404
    import logging
    logging.getLogger("kcompact.test.rest").setLevel(logging.NOTSET)


def test_topics_and_state_metrics(tmp_path):
    a = Api(tmp_path, extra={"metrics.listen": "127.0.0.1:0"})
    try:
        assert a("POST", "/connectors", {"name": "m", "config": _config()})[0] == 201
        assert a("GET", "/connectors/m/topics") == (200, {"m": {"topics": []}})
        assert a("PUT", "/connectors/m/topics/reset")[0] == 202
        assert a("PUT", "/connectors/m/pause")[0] == 202
        from prometheus_client import generate_latest
        text = generate_latest(a.worker.ops.registry).decode()
        assert 'kcompact_connector_state{connector="m",state="PAUSED",type="source"} 1.0' in text
        assert 'kcompact_connector_state{connector="m",state="RUNNING",type="source"} 0.0' in text
        assert 'kcompact_connector_task_state{connector="m",state="PAUSED",task="0"} 1.0' in text
    finally:
        a.close()


def test_non_loopback_needs_users_and_basic_auth_checks_them(tmp_path):
    w = Worker({"bootstrap.servers": "127.0.0.1:9", "listeners": "http://0.0.0.0:0"},
               log=io.StringIO())
    with pytest.raises(ConfigError, match="rest.basic.auth.users.file"):
        _rest(w, None, io.StringIO())
    plain = tmp_path / "plain"
    plain.write_text("admin:secret\n")
    with pytest.raises(ConfigError, match=r"plain:1: expected USER:pbkdf2_sha256"):
        load_users(str(plain))
    users = tmp_path / "users"
    users.write_text(f"# operators\nadmin:{hash_password('s3cret', iterations=1000)}\n")
    a = Api(tmp_path, extra={"rest.basic.auth.users.file": str(users)})
    try:
        status, doc = a("GET", "/connectors")
        assert status == 401 and doc["error_code"] == 401

        def basic(u, p):
            return {"Authorization": "Basic " + base64.b64encode(f"{u}:{p}".encode()).decode()}
        assert a("GET", "/connectors", headers=basic("admin", "wrong"))[0] == 401
        assert a("GET", "/connectors", headers=basic("admin", "s3cret")) == (200, [])
    finally:
        a.close()


def test_listeners_must_be_one_http_url(tmp_path):
    for bad in ("127.0.0.1:8083", "ftp://127.0.0.1:8083", "http://a:1,http://b:2",
                "http://127.0.0.1:8083/x"):
        w = Worker({"bootstrap.servers": "127.0.0.1:9", "listeners": bad}, log=io.StringIO())
        with pytest.raises(ConfigError, match="listeners"):
            _rest(w, None, io.StringIO())


# -- connect standalone's lifetime: the API on by default, the run ending with its files' work --


class Standalone:
    """``run_standalone`` in a thread, with a worker file of ``worker`` (no listeners key
    unless given) and connector files of ``connectors``."""

    def __init__(self, tmp, worker: dict, connectors: dict[str, dict]):
        from kcompact.connectors.apps.connect import run_standalone
        self.log = _Lines()
        wf = tmp / "worker.properties"
        wf.write_text("".join(f"{k}={v}\n" for k, v in
                              {"bootstrap.servers": "127.0.0.1:9",
                               "metrics.log.interval.ms": "0", **worker}.items()))
        files = []
        for name, c in connectors.items():
            f = tmp / f"{name}.json"
            f.write_text(json.dumps(dict(c, name=name)))
            files.append(str(f))
        self.stop = threading.Event()
        self.result: list = []

        def run():
            try:
                self.result.append(run_standalone(str(wf), files, out=self.log, stop=self.stop))
            except BaseException as e:  # noqa: BLE001 - looked at by the test
                self.result.append(e)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def url(self) -> str:
        import re
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            m = re.search(r"REST API on (http\S+)", self.log.getvalue())
            if m:
                return m.group(1)
            assert not self.result, (self.result, self.log.getvalue())
            time.sleep(0.01)
        raise AssertionError(self.log.getvalue())

    def ended(self, timeout: float = WAIT_S):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running: " + self.log.getvalue()
        return self.result[0]

    def close(self):
        self.stop.set()
        self.thread.join(WAIT_S)


class _Lines(io.StringIO):
    """A StringIO written from several threads."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def write(self, s):
        with self._lock:
            return super().write(s)

    def getvalue(self):
        with self._lock:
            return super().getvalue()


def _get(url: str):
    with urllib.request.urlopen(url, timeout=WAIT_S) as r:
        return json.loads(r.read())


def test_listeners_default_is_connects():
    from kcompact.connectors.framework.worker import WORKER_CONFIG
    w = WORKER_CONFIG.parse({"bootstrap.servers": "x:1"})
    assert w["listeners"] == "http://127.0.0.1:8083" and w["exit.when.finished"] is True


def test_files_run_ends_when_their_work_is_done_and_serves_meanwhile(tmp_path):
    done = tmp_path / "done"
    s = Standalone(tmp_path, {"listeners": "http://127.0.0.1:0"},
                   {"bounded": _config(until=str(done))})
    try:
        base = s.url()
        assert _get(f"{base}/connectors/bounded/status")["tasks"][0]["state"] == "RUNNING"
        done.write_text("")
        assert s.ended() is None  # by itself, no signal
        assert "connect: bounded: 1 task(s)" in s.log.getvalue()
    finally:
        s.close()


def test_paused_connector_keeps_a_files_run_going(tmp_path):
    """Work left: a connector paused through the API is resumed later, so the run goes on."""
    done = tmp_path / "done"
    s = Standalone(tmp_path, {"listeners": "http://127.0.0.1:0"},
                   {"p": _config(until=str(done))})
    try:
        base = s.url()
        req = urllib.request.Request(f"{base}/connectors/p/pause", method="PUT")
        assert urllib.request.urlopen(req, timeout=WAIT_S).status == 202
        done.write_text("")
        s.thread.join(1.0)
        assert s.thread.is_alive()  # paused: not finished
        req = urllib.request.Request(f"{base}/connectors/p/resume", method="PUT")
        assert urllib.request.urlopen(req, timeout=WAIT_S).status == 202
        assert s.ended() is None  # resumed, the file exists: it ends at once
    finally:
        s.close()


def test_exit_when_finished_false_runs_until_stopped_as_apache(tmp_path):
    done = tmp_path / "done"
    done.write_text("")
    s = Standalone(tmp_path, {"listeners": "http://127.0.0.1:0", "exit.when.finished": "false"},
                   {"b": _config(until=str(done)), "f": _config(fail="true")})
    try:
        base = s.url()
        deadline = time.monotonic() + WAIT_S
        while _get(f"{base}/connectors/b/status")["tasks"][0]["state"] != "UNASSIGNED" or \
                _get(f"{base}/connectors/f/status")["tasks"][0]["state"] != "FAILED":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert s.thread.is_alive()
    finally:
        s.stop.set()
    assert s.ended() is None


def test_failed_file_task_ends_a_files_run(tmp_path):
    from kcompact.connectors.framework.api import TaskFailedError
    s = Standalone(tmp_path, {"listeners": "http://127.0.0.1:0"}, {"f": _config(fail="true")})
    try:
        e = s.ended()
        assert isinstance(e, TaskFailedError) and "the idle task was told to fail" in str(e)
    finally:
        s.close()


def test_default_port_taken_is_one_line_and_the_run_goes_on(tmp_path):
    """Port 8083 held (by this test, or by anything else that has it): a worker file without
    listeners runs its connectors without the API, saying so in one line."""
    import socket
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 8083))
        held.listen()
    except OSError:
        pass  # taken already: as good
    try:
        done = tmp_path / "done"
        done.write_text("")
        s = Standalone(tmp_path, {}, {"b": _config(until=str(done))})
        assert s.ended() is None
        lines = [ln for ln in s.log.getvalue().splitlines() if "REST API" in ln]
        assert len(lines) == 1 and "REST API not served" in lines[0] and \
            "127.0.0.1:8083" in lines[0] and "listeners=" in lines[0], lines
        # given in the worker file, the same port is an error naming it
        s = Standalone(tmp_path, {"listeners": "http://127.0.0.1:8083"},
                       {"b": _config(until=str(done))})
        e = s.ended()
        assert isinstance(e, ConfigError) and "127.0.0.1:8083" in str(e) and \
            "free port" in str(e), e
    finally:
        held.close()


def test_no_files_and_no_listeners_is_an_error(tmp_path):
    s = Standalone(tmp_path, {"listeners": ""}, {})
    e = s.ended()
    assert isinstance(e, ConfigError) and "no connector file" in str(e)


# -- https listeners (connect_rest/tls.py): PEM and PKCS12 stores, client certificates --------

from _tls_certs import make_certs as _certs  # noqa: E402


def _https_get(url: str, ca: str, cert: str | None = None) -> tuple[int, Any]:
    import ssl
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert)
    with urllib.request.urlopen(url, timeout=WAIT_S, context=ctx) as r:
        return r.status, json.loads(r.read())


def _curl(*args: str) -> int:
    import shutil
    import subprocess
    if shutil.which("curl") is None:
        return -1
    return subprocess.run(["curl", "-sf", "-o", "/dev/null", *args], capture_output=True,
                          timeout=60).returncode


def test_https_listener_with_a_pem_keystore(tmp_path):
    c = _certs(tmp_path)
    for extra in ({"listeners.https.ssl.keystore.location": c["server.pem"]},
                  {"listeners.https.ssl.keystore.location": c["server-enc.pem"],
                   "listeners.https.ssl.keystore.type": "PEM",
                   "listeners.https.ssl.key.password": "kpw"},
                  {"listeners.https.ssl.keystore.key": open(c["server-enc.pem"]).read()
                   .split("-----BEGIN CERTIFICATE")[0],
                   "listeners.https.ssl.keystore.certificate.chain":
                       "-----BEGIN CERTIFICATE" + open(c["server-enc.pem"]).read()
                       .split("-----BEGIN CERTIFICATE", 1)[1],
                   "listeners.https.ssl.key.password": "kpw"}):
        a = Api(tmp_path, extra={"listeners": "https://127.0.0.1:0", **extra})
        try:
            assert a.base.startswith("https://127.0.0.1:")
            status, doc = _https_get(a.base + "/", c["ca.pem"])
            assert status == 200 and "version" in doc
            assert _curl("--cacert", c["ca.pem"], a.base + "/connectors") in (0, -1)
            # a client that does not trust the CA refuses the server
            with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
                _https_get(a.base + "/", c["intruder.pem"])
        finally:
            a.close()


def test_https_client_auth_required_with_pkcs12_stores(tmp_path):
    import ssl
    c = _certs(tmp_path)
    a = Api(tmp_path, extra={
        "listeners": "https://127.0.0.1:0",
        "listeners.https.ssl.keystore.location": c["server.p12"],
        "listeners.https.ssl.keystore.type": "PKCS12",
        "listeners.https.ssl.keystore.password": "serverpw",
        "listeners.https.ssl.truststore.location": c["trust.p12"],
        "listeners.https.ssl.truststore.password": "trustpw",
        "listeners.https.ssl.client.auth": "required"})
    try:
        assert _https_get(a.base + "/connectors", c["ca.pem"], c["client.pem"]) == (200, [])
        for cert in (None, c["intruder.pem"]):  # no certificate, or one of another CA
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                _https_get(a.base + "/connectors", c["ca.pem"], cert)
        if _curl("--version") != -1:
            assert _curl("--cacert", c["ca.pem"], "--cert", c["client.pem"],
                         a.base + "/connectors") == 0
            assert _curl("--cacert", c["ca.pem"], a.base + "/connectors") != 0
    finally:
        a.close()


def test_https_required_client_auth_allows_other_addresses(tmp_path):
    c = _certs(tmp_path)
    tls = {"listeners": "https://0.0.0.0:0",
           "listeners.https.ssl.keystore.location": c["server.pem"],
           "listeners.https.ssl.truststore.location": c["ca.pem"]}
    w = Worker({"bootstrap.servers": "127.0.0.1:9", **tls}, log=io.StringIO())
    with pytest.raises(ConfigError, match="listeners.https.ssl.client.auth=required"):
        _rest(w, None, io.StringIO())  # TLS alone: anyone may still connect
    a = Api(tmp_path, extra=dict(tls, **{"listeners.https.ssl.client.auth": "required"}))
    try:
        port = a.base.rsplit(":", 1)[1]
        assert _https_get(f"https://127.0.0.1:{port}/connectors", c["ca.pem"],
                          c["client.pem"]) == (200, [])
    finally:
        a.close()


@pytest.mark.parametrize("extra, message", [
    ({}, "needs the server's key and certificate"),
    ({"listeners.https.ssl.keystore.location": "JKS"}, "is a JKS keystore"),
    ({"listeners.https.ssl.keystore.location": "CA"}, "no private key with its certificate"),
    ({"listeners.https.ssl.keystore.location": "P12"}, "not a PKCS12 store this password"),
    ({"listeners.https.ssl.keystore.location": "SERVER",
      "listeners.https.ssl.client.auth": "required"}, "against a truststore"),
    ({"listeners.https.ssl.keystore.location": "SERVER",
      "listeners.https.ssl.keystore.type": "BKS"}, "is not PEM or PKCS12"),
])
def test_https_bad_stores_are_one_line_naming_the_key(tmp_path, extra, message):
    c = _certs(tmp_path)
    (tmp_path / "store.jks").write_bytes(b"\xfe\xed\xfe\xed\x00\x00\x00\x02")
    paths = {"JKS": str(tmp_path / "store.jks"), "CA": c["ca.pem"], "P12": c["server.p12"],
             "SERVER": c["server.pem"]}
    extra = {k: paths.get(v, v) for k, v in extra.items()}
    w = Worker({"bootstrap.servers": "127.0.0.1:9", "listeners": "https://127.0.0.1:0",
                **extra}, log=io.StringIO())
    with pytest.raises(ConfigError, match=message) as e:
        _rest(w, None, io.StringIO())
    assert "\n" not in str(e.value)


def test_client_auth_needs_an_https_listener(tmp_path):
    w = Worker({"bootstrap.servers": "127.0.0.1:9", "listeners": "http://127.0.0.1:0",
                "listeners.https.ssl.client.auth": "required"}, log=io.StringIO())
    with pytest.raises(ConfigError, match="needs an https listener"):
        _rest(w, None, io.StringIO())
