"""Kafka Connect's REST API on ``kcompact connect standalone`` (connectors/apps/connect_rest/).

1. **Apache Kafka Connect 3.9.1 as the oracle**: its standalone worker
   (``org.apache.kafka.connect.cli.ConnectStandalone``, connect-runtime from Kafka's jars and
   connect-file from Maven Central) with a FileStreamSink connector, and kcompact's worker with
   a store sink, get the same sequence of requests; the status codes and the JSON shapes (keys
   and value types, connector-specific values aside) must be equal. One Apache worker serves the
   module. The one answer that differs by design is DELETE/PATCH of a stopped sink's offsets:
   Apache moves the consumer group, kcompact's store sink refuses (its offsets are the store's).
2. **End to end** on kcompact alone: a store sink created through the API mirrors a topic; a PUT
   of a changed config restarts its tasks and the store holds each record once; pause stops
   consumption and resume catches up; a restart of the worker brings back the API-created
   connector (and its PAUSED state); a bad config answers 400 naming the key and changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kcompact.reput import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from connect_rest_tools import (ApacheConnect, KcompactConnect, Lines,  # noqa: E402
                                connect_unavailable, differences, request, shape, wait_until)


def _produce(bootstrap: str, topic: str, start: int, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(start, start + n):
        p.produce(topic, key=f"k{i % 7}".encode(), value=f"v{i}".encode(), partition=0)
    assert p.flush(30) == 0


def _store_records(url: str, topic: str) -> list[int]:
    """The offsets the store holds for partition 0 of ``topic`` (each once)."""
    with Store.open(url) as st:
        if topic not in st.topics():
            return []
        return [r.offset for r in st.iter_records(topic, 0)]


# -- 1. the oracle ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle_broker(request) -> str:
    """The broker both workers use: the real Apache Kafka 3.9.1 (Connect's own broker)."""
    return request.getfixturevalue("apache_kafka").bootstrap


@pytest.fixture(scope="module")
def apache_connect(oracle_broker, tmp_path_factory):
    why = connect_unavailable()
    if why is not None:
        pytest.skip(why)
    c = ApacheConnect(tmp_path_factory.mktemp("apache-connect"), oracle_broker).start()
    try:
        yield c
    finally:
        c.stop()


def _topic(bootstrap: str, name: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": bootstrap})
    a.create_topics([NewTopic(name, 1, 1)])[name].result()
    wait_until(lambda: name in a.list_topics(timeout=5).topics, f"topic {name}")
    return name


def _state(base: str, name: str) -> str | None:
    status, doc = request(f"{base}/connectors/{name}/status")
    if status != 200:
        return None
    return doc["connector"]["state"] + "/" + ",".join(t["state"] for t in doc["tasks"])


def _wait_state(base: str, name: str, want: str, what: str) -> None:
    seen: list = []

    def check() -> bool:
        seen[:] = [_state(base, name)]
        return seen[0] == want
    try:
        wait_until(check, what)
    except AssertionError:
        raise AssertionError(f"{what}: {name} is {seen[0]}, not {want}: "
                             f"{request(f'{base}/connectors/{name}/status')[1]}") from None


def _sequence(base: str, name: str, config: dict[str, str], changed: dict[str, str],
              good: dict[str, str], plugin: str, out: list | None = None
              ) -> list[tuple[str, int, object]]:
    """The requests, in order; returns (step, status, body) of each (also in ``out``)."""
    out = out if out is not None else []

    def step(label: str, method: str, path: str, body=None):
        status, doc = request(base + path, method, body)
        out.append((label, status, doc))
        return status, doc

    step("root", "GET", "/")
    step("list empty", "GET", "/connectors")
    step("create", "POST", "/connectors", {"name": name, "config": config})
    step("create again", "POST", "/connectors", {"name": name, "config": config})
    _wait_state(base, name, "RUNNING/RUNNING", "connector running")
    step("list", "GET", "/connectors")
    step("list expand status", "GET", "/connectors?expand=status")
    step("list expand info", "GET", "/connectors?expand=info")
    step("list expand both", "GET", "/connectors?expand=status&expand=info")
    step("get", "GET", f"/connectors/{name}")
    step("get config", "GET", f"/connectors/{name}/config")
    step("get missing", "GET", "/connectors/no-such-connector")
    step("status missing", "GET", "/connectors/no-such-connector/status")
    step("config missing", "GET", "/connectors/no-such-connector/config")
    step("status", "GET", f"/connectors/{name}/status")
    step("tasks", "GET", f"/connectors/{name}/tasks")
    step("task status", "GET", f"/connectors/{name}/tasks/0/status")
    step("task status missing", "GET", f"/connectors/{name}/tasks/7/status")
    step("put config", "PUT", f"/connectors/{name}/config", dict(config, **changed))
    step("put config other name", "PUT", f"/connectors/{name}/config",
         dict(config, name="another-name"))
    _wait_state(base, name, "RUNNING/RUNNING", "running after the change")
    step("pause", "PUT", f"/connectors/{name}/pause")
    _wait_state(base, name, "PAUSED/PAUSED", "paused")
    step("status paused", "GET", f"/connectors/{name}/status")
    step("pause missing", "PUT", "/connectors/no-such-connector/pause")
    step("resume", "PUT", f"/connectors/{name}/resume")
    _wait_state(base, name, "RUNNING/RUNNING", "resumed")
    step("offsets running", "GET", f"/connectors/{name}/offsets")
    step("delete offsets running", "DELETE", f"/connectors/{name}/offsets")
    step("patch offsets running", "PATCH", f"/connectors/{name}/offsets", {"offsets": []})
    step("restart", "POST", f"/connectors/{name}/restart")
    _wait_state(base, name, "RUNNING/RUNNING", "running after restart")
    step("restart with tasks", "POST", f"/connectors/{name}/restart?includeTasks=true")
    _wait_state(base, name, "RUNNING/RUNNING", "running after restart")
    step("restart only failed", "POST",
         f"/connectors/{name}/restart?includeTasks=true&onlyFailed=true")
    step("restart missing", "POST", "/connectors/no-such-connector/restart")
    step("restart task", "POST", f"/connectors/{name}/tasks/0/restart")
    _wait_state(base, name, "RUNNING/RUNNING", "running after restart")
    step("topics", "GET", f"/connectors/{name}/topics")
    step("stop", "PUT", f"/connectors/{name}/stop")
    _wait_state(base, name, "STOPPED/", "stopped")
    step("status stopped", "GET", f"/connectors/{name}/status")
    step("offsets stopped", "GET", f"/connectors/{name}/offsets")
    step("resume stopped", "PUT", f"/connectors/{name}/resume")
    _wait_state(base, name, "RUNNING/RUNNING", "running after stop")
    step("plugins", "GET", "/connector-plugins")
    step("plugins all", "GET", "/connector-plugins?connectorsOnly=false")
    step("validate good", "PUT", f"/connector-plugins/{plugin}/config/validate", good)
    step("validate bad", "PUT", f"/connector-plugins/{plugin}/config/validate",
         dict(good, **{"tasks.max": "many"}))
    step("validate other class", "PUT", f"/connector-plugins/{plugin}/config/validate",
         dict(good, **{"connector.class": "SomethingElseConnector"}))
    step("loggers", "GET", "/admin/loggers")
    step("logger root", "GET", "/admin/loggers/root")
    # last before the delete: Apache 3.9.1 answers 404 but then lists a FAILED task 7
    step("restart task missing", "POST", f"/connectors/{name}/tasks/7/restart")
    step("delete", "DELETE", f"/connectors/{name}")
    step("delete again", "DELETE", f"/connectors/{name}")
    step("get deleted", "GET", f"/connectors/{name}")
    step("no such path", "GET", "/no/such/path")
    return out


#: Steps where Apache Kafka Connect 3.9.1 is wrong, with kcompact's status and why.
APACHE_BUGS = {
    # StandaloneHerder.restartConnectorAndTasks dereferences the missing connector's config
    "restart missing": (404, "Apache answers 500 (a NullPointerException), not 404"),
}


def _configs(doc):
    """A connector's or a task's config is a map of the connector's own keys: compared as one
    map of string -> its values' type."""
    if isinstance(doc, list):
        return [_configs(x) for x in doc]
    if not isinstance(doc, dict):
        return doc
    return {k: ({"*": sorted({type(x).__name__ for x in v.values()})}
                if k == "config" and isinstance(v, dict) else _configs(v))
            for k, v in doc.items()}


def _comparable(label: str, doc):
    """The part of an answer whose shape is compared: configs (the connector's keys) as maps,
    the loggers' root (the others are each worker's own), the sink plugins."""
    if label == "get config":
        return _configs({"config": doc})
    if label == "loggers":
        return {"root": doc["root"]}
    if label in ("plugins", "plugins all") and isinstance(doc, list):
        return [{k: v for k, v in p.items()} for p in doc if p.get("type") in ("sink",)]
    return _configs(doc)


def test_rest_api_answers_as_apache_connect(apache_connect, oracle_broker, tmp_path):
    topic = _topic(oracle_broker, f"connect-rest-oracle-{os.getpid()}")
    _produce(oracle_broker, topic, 0, 20)
    name = "oracle-sink"
    apache = _sequence(
        apache_connect.url, name,
        {"connector.class": "org.apache.kafka.connect.file.FileStreamSinkConnector",
         "tasks.max": "1", "topics": topic, "file": str(tmp_path / "sink.txt")},
        {"errors.tolerance": "all"},
        {"connector.class": "org.apache.kafka.connect.file.FileStreamSinkConnector",
         "name": "v", "tasks.max": "1", "topics": topic, "file": str(tmp_path / "v.txt")},
        "FileStreamSinkConnector")
    (tmp_path / "k").mkdir()
    with KcompactConnect(tmp_path / "k", oracle_broker) as k:
        ours = _sequence(
            k.url, name,
            {"connector.class": "StoreSinkConnector", "tasks.max": "1", "topics": topic,
             "store.url": str(tmp_path / "store")},
            {"errors.tolerance": "all"},
            {"connector.class": "StoreSinkConnector", "name": "v", "tasks.max": "1",
             "topics": topic, "store.url": str(tmp_path / "store2")},
            "StoreSinkConnector")
    assert [s for s, *_ in apache] == [s for s, *_ in ours]
    problems = []
    for (label, a_status, a_doc), (_, k_status, k_doc) in zip(apache, ours):
        if label in APACHE_BUGS:
            want, _why = APACHE_BUGS[label]
            assert k_status == want and set(k_doc) == {"error_code", "message"}, (label, k_doc)
            continue
        if a_status != k_status:
            problems.append(f"{label}: status {a_status} (Apache) vs {k_status} (kcompact): "
                            f"{json.dumps(a_doc)[:300]} / {json.dumps(k_doc)[:300]}")
            continue
        diff = differences(shape(_comparable(label, a_doc)), shape(_comparable(label, k_doc)))
        if diff:
            problems.append(f"{label}: {'; '.join(diff)}")
        if a_status >= 400:
            assert set(a_doc) == {"error_code", "message"} and a_doc["error_code"] == a_status
    assert not problems, "\n".join(problems)
    # the bad config's error is on its key, on both
    for seq in (apache, ours):
        doc = dict((label, d) for label, _s, d in seq)["validate bad"]
        assert doc["error_count"] >= 1
        bad = [c for c in doc["configs"] if c["value"]["name"] == "tasks.max"]
        assert bad and bad[0]["value"]["errors"], doc
        assert dict((label, d) for label, _s, d in seq)["validate good"]["error_count"] == 0


def _source_sequence(base: str, name: str, config: dict[str, str], ready) -> list:
    """KIP-875 on a source connector: (step, status, body) of each request."""
    out: list = []

    def step(label: str, method: str, path: str, body=None):
        status, doc = request(base + path, method, body)
        out.append((label, status, doc))
        return status, doc

    step("create", "POST", "/connectors", {"name": name, "config": config})
    wait_until(lambda: ready(request(f"{base}/connectors/{name}/offsets")[1]),
               f"{name}'s first offsets")
    step("offsets running", "GET", f"/connectors/{name}/offsets")
    step("patch running", "PATCH", f"/connectors/{name}/offsets", {"offsets": []})
    step("delete running", "DELETE", f"/connectors/{name}/offsets")
    step("stop", "PUT", f"/connectors/{name}/stop")
    _wait_state(base, name, "STOPPED/", "stopped")
    _s, doc = step("offsets stopped", "GET", f"/connectors/{name}/offsets")
    entry = doc["offsets"][0]
    step("patch empty", "PATCH", f"/connectors/{name}/offsets", {"offsets": []})
    step("patch", "PATCH", f"/connectors/{name}/offsets", {"offsets": [
        {"partition": entry["partition"], "offset": {k: 1 for k in entry["offset"]}}]})
    step("offsets patched", "GET", f"/connectors/{name}/offsets")
    step("patch to null", "PATCH", f"/connectors/{name}/offsets", {"offsets": [
        {"partition": entry["partition"], "offset": None}]})
    step("offsets nulled", "GET", f"/connectors/{name}/offsets")
    step("patch back", "PATCH", f"/connectors/{name}/offsets", {"offsets": [
        {"partition": entry["partition"], "offset": {k: 2 for k in entry["offset"]}}]})
    step("delete", "DELETE", f"/connectors/{name}/offsets")
    step("offsets reset", "GET", f"/connectors/{name}/offsets")
    step("delete missing", "DELETE", "/connectors/no-such-connector/offsets")
    step("delete connector", "DELETE", f"/connectors/{name}")
    return out


def _source_offsets_shape(doc):
    """A source partition and offset are maps of the connector's own keys."""
    if isinstance(doc, dict) and isinstance(doc.get("offsets"), list):
        return {"offsets": [{k: ({"*": sorted({type(x).__name__ for x in v.values()})}
                                 if isinstance(v, dict) else v) for k, v in e.items()}
                            for e in doc["offsets"]]}
    return doc


def test_source_offsets_answer_as_apache_connect(apache_connect, oracle_broker, tmp_path):
    """KIP-875 on a source connector, Apache's FileStreamSource beside kcompact's store source:
    the same status codes and shapes, and the positions moved as asked."""
    topic = _topic(oracle_broker, f"connect-rest-src-{os.getpid()}")
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line {i}\n" for i in range(10)))
    apache = _source_sequence(
        apache_connect.url, "oracle-source",
        {"connector.class": "org.apache.kafka.connect.file.FileStreamSourceConnector",
         "tasks.max": "1", "topic": f"{topic}-file", "file": str(lines)},
        lambda d: bool(d and d.get("offsets")))
    _produce(oracle_broker, topic, 0, 10)
    store = str(tmp_path / "store")
    (tmp_path / "k").mkdir()
    with KcompactConnect(tmp_path / "k", oracle_broker) as k:
        _create(k.url, "copy", {"connector.class": "StoreSinkConnector", "topics": topic,
                                "store.url": store, "follow": "false"})
        wait_until(lambda: len(_store_records(store, topic)) == 10, "stored")
        ours = _source_sequence(
            k.url, "oracle-source",
            {"connector.class": "StoreSourceConnector", "store.url": store,
             "store.topic": topic, "topic": f"{topic}-restored", "mode": "all"},
            lambda d: bool(d and d.get("offsets")))
    problems = []
    for (label, a_status, a_doc), (_, k_status, k_doc) in zip(apache, ours):
        if a_status != k_status:
            problems.append(f"{label}: status {a_status} (Apache) vs {k_status} (kcompact): "
                            f"{json.dumps(a_doc)[:300]} / {json.dumps(k_doc)[:300]}")
            continue
        diff = differences(shape(_configs(_source_offsets_shape(a_doc))),
                           shape(_configs(_source_offsets_shape(k_doc))))
        if diff:
            problems.append(f"{label}: {'; '.join(diff)}")
    assert not problems, "\n".join(problems)
    for seq in (apache, ours):
        docs = {label: d for label, _s, d in seq}
        assert [e["offset"] for e in docs["offsets patched"]["offsets"]] == [
            {k: 1 for k in docs["offsets stopped"]["offsets"][0]["offset"]}], seq
        assert docs["offsets reset"] == {"offsets": []}, seq
        assert docs["patch"] == {"message": "The offsets for this connector have been altered "
                                            "successfully"}, seq
        assert docs["delete"] == {"message": "The offsets for this connector have been reset "
                                             "successfully"}, seq


def _tls_attempt(url: str, ca: str, cert: str | None):
    """(status, body) of GET ``url`` with a client trusting ``ca`` and presenting ``cert``, or
    the name of the error the TLS handshake ended in."""
    import ssl
    import urllib.error
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(cert)
    try:
        return request(url, context=ctx)
    except (ssl.SSLError, urllib.error.URLError, ConnectionError) as e:
        return "refused", type(e).__name__


def test_https_client_auth_as_apache_connect(oracle_broker, tmp_path):
    """The same https listener with required client certificates on Apache's worker and on
    kcompact's (a PKCS12 keystore, and a truststore made by keytool): a client with the CA's
    certificate is answered alike, one without a certificate or with another CA's is refused
    by both."""
    import shutil
    why = connect_unavailable()
    if why is not None:
        pytest.skip(why)
    if shutil.which("keytool") is None:
        pytest.skip("the truststore is made with Java's keytool, not on PATH")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from _tls_certs import make_certs
    c = make_certs(tmp_path)
    trust = str(tmp_path / "trust-keytool.p12")
    subprocess.run(["keytool", "-importcert", "-noprompt", "-alias", "ca", "-file",
                    c["ca.pem"], "-keystore", trust, "-storetype", "PKCS12",
                    "-storepass", "trustpw"], check=True, capture_output=True, timeout=120)
    tls = {"listeners.https.ssl.keystore.location": c["server.p12"],
           "listeners.https.ssl.keystore.type": "PKCS12",
           "listeners.https.ssl.keystore.password": "serverpw",
           "listeners.https.ssl.truststore.location": trust,
           "listeners.https.ssl.truststore.type": "PKCS12",
           "listeners.https.ssl.truststore.password": "trustpw",
           "listeners.https.ssl.client.auth": "required"}
    import ssl
    probe = ssl.create_default_context(cafile=c["ca.pem"])
    probe.load_cert_chain(c["client.pem"])
    (tmp_path / "a").mkdir()
    apache = ApacheConnect(tmp_path / "a", oracle_broker, scheme="https", context=probe,
                           extra=tls)
    answers = {}
    apache.start()
    try:
        answers["apache"] = [_tls_attempt(apache.url + path, c["ca.pem"], cert)
                             for path in ("/", "/connectors")
                             for cert in (c["client.pem"], None, c["intruder.pem"])]
    finally:
        apache.stop()
    (tmp_path / "k").mkdir()
    with KcompactConnect(tmp_path / "k", oracle_broker,
                         extra=dict(tls, listeners="https://127.0.0.1:0")) as k:
        assert k.url.startswith("https://")
        answers["kcompact"] = [_tls_attempt(k.url + path, c["ca.pem"], cert)
                               for path in ("/", "/connectors")
                               for cert in (c["client.pem"], None, c["intruder.pem"])]
    a, k = answers["apache"], answers["kcompact"]
    assert [x[0] for x in a] == [x[0] for x in k] == [200, "refused", "refused"] * 2, answers
    assert differences(shape(a[0][1]), shape(k[0][1])) == [] and a[3][1] == k[3][1] == []


# -- 2. end to end ----------------------------------------------------------------------------


def _create(base: str, name: str, config: dict) -> None:
    status, doc = request(f"{base}/connectors", "POST", {"name": name, "config": config})
    assert status == 201, doc


def test_store_sink_through_the_api(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    store = str(tmp_path / "store")
    _produce(kafka_bootstrap, topic, 0, 50)
    config = {"connector.class": "StoreSinkConnector", "topics": topic, "store.url": store}
    with KcompactConnect(tmp_path, kafka_bootstrap) as k:
        base = k.url
        # a bad config: 400 naming the key, and nothing created
        status, doc = request(f"{base}/connectors", "POST",
                              {"name": "bad", "config": dict(config, **{"tasks.maxx": "2"})})
        assert status == 400 and "tasks.maxx" in doc["message"] and \
            "did you mean 'tasks.max'" in doc["message"], doc
        assert request(f"{base}/connectors")[1] == []

        _create(base, "mirror", config)
        wait_until(lambda: len(_store_records(store, topic)) == 50, "50 records mirrored")

        # a bad change: 400 naming the key, the connector goes on unchanged
        status, doc = request(f"{base}/connectors/mirror/config", "PUT",
                              dict(config, **{"batch.max.records": "lots"}))
        assert status == 400 and "batch.max.records" in doc["message"], doc
        assert request(f"{base}/connectors/mirror/config")[1] == dict(config, name="mirror")
        assert _state(base, "mirror") == "RUNNING/RUNNING"

        # a changed config restarts the tasks; exactly once across the change
        status, doc = request(f"{base}/connectors/mirror/config", "PUT",
                              dict(config, **{"batch.max.records": "7"}))
        assert status == 200 and doc["config"]["batch.max.records"] == "7", doc
        _produce(kafka_bootstrap, topic, 50, 30)
        wait_until(lambda: len(_store_records(store, topic)) == 80, "80 records mirrored")
        assert _store_records(store, topic) == list(range(80))

        # pause: no consumption (the records wait in Kafka); resume: it catches up
        assert request(f"{base}/connectors/mirror/pause", "PUT")[0] == 202
        wait_until(lambda: _state(base, "mirror") == "PAUSED/PAUSED", "paused")
        _produce(kafka_bootstrap, topic, 80, 20)
        status, doc = request(f"{base}/connectors/mirror/offsets")
        assert status == 200 and doc["offsets"] == [
            {"partition": {"kafka_topic": topic, "kafka_partition": 0},
             "offset": {"kafka_offset": 80}}], doc
        assert len(_store_records(store, topic)) == 80  # nothing consumed while paused
        assert request(f"{base}/connectors/mirror/resume", "PUT")[0] == 202
        wait_until(lambda: len(_store_records(store, topic)) == 100, "caught up after resume")
        assert _store_records(store, topic) == list(range(100))

        # KIP-875: offsets can be changed only when STOPPED; a store sink's never
        status, doc = request(f"{base}/connectors/mirror/offsets", "DELETE")
        assert status == 400 and "STOPPED" in doc["message"]
        assert request(f"{base}/connectors/mirror/stop", "PUT")[0] == 204
        status, doc = request(f"{base}/connectors/mirror/offsets", "DELETE")
        assert status == 400 and "store" in doc["message"] and "new store" in doc["message"]
        status, doc = request(f"{base}/connectors/mirror/status")
        assert doc["connector"]["state"] == "STOPPED" and doc["tasks"] == []
        assert request(f"{base}/connectors/mirror/resume", "PUT")[0] == 202
        wait_until(lambda: _state(base, "mirror") == "RUNNING/RUNNING", "running again")
        status, doc = request(f"{base}/connectors/mirror/topics")
        assert doc == {"mirror": {"topics": [topic]}}
    assert _store_records(store, topic) == list(range(100))


def test_worker_restart_keeps_api_connectors(kafka_bootstrap, make_topic, tmp_path):
    """The command itself (SIGTERM, then started again): the connector created through the API
    comes back from connectors.state.dir with its target state."""
    topic = make_topic(partitions=1)
    store = str(tmp_path / "store")
    _produce(kafka_bootstrap, topic, 0, 10)
    from kcompact.connectors.devtools.broker import _free_port
    port = _free_port()
    worker = tmp_path / "worker.properties"
    worker.write_text(f"bootstrap.servers={kafka_bootstrap}\nlisteners=http://127.0.0.1:{port}\n"
                      "offset.flush.interval.ms=200\nmetrics.log.interval.ms=0\n")
    base = f"http://127.0.0.1:{port}"

    def launch() -> tuple[subprocess.Popen, Lines]:
        proc = subprocess.Popen([sys.executable, "-m", "kcompact", "connect", "standalone",
                                 str(worker)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines = Lines()
        import threading
        threading.Thread(target=lambda: [lines.write(ln) for ln in proc.stderr],
                         daemon=True).start()
        lines.wait_for(r"REST API on http://")
        return proc, lines

    proc, lines = launch()
    try:
        _create(base, "kept", {"connector.class": "StoreSinkConnector", "topics": topic,
                               "store.url": store})
        wait_until(lambda: len(_store_records(store, topic)) == 10, "mirrored")
        assert request(f"{base}/connectors/kept/pause", "PUT")[0] == 202
        wait_until(lambda: _state(base, "kept") == "PAUSED/PAUSED", "paused")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, lines.text()
    assert (tmp_path / "worker.connectors" / "kept.json").is_file()
    proc, lines = launch()
    try:
        assert request(f"{base}/connectors")[1] == ["kept"]
        assert _state(base, "kept") == "PAUSED/PAUSED"
        _produce(kafka_bootstrap, topic, 10, 5)
        assert request(f"{base}/connectors/kept/resume", "PUT")[0] == 202
        wait_until(lambda: len(_store_records(store, topic)) == 15, "resumed after restart")
        assert request(f"{base}/connectors/kept", "DELETE")[0] == 204
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, lines.text()
    assert not (tmp_path / "worker.connectors" / "kept.json").exists()
    assert _store_records(store, topic) == list(range(15))


def _topic_values(bootstrap: str, topic: str) -> list[bytes]:
    """Partition 0 of ``topic`` as a read_committed consumer sees it (the values)."""
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "connect-rest-read",
                  "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        md = c.list_topics(topic, timeout=10)
        if topic not in md.topics or md.topics[topic].error is not None:
            return []
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        c.assign([TopicPartition(topic, 0, lo)])
        out: list[bytes] = []
        while True:
            pos = c.position([TopicPartition(topic, 0)])[0].offset
            if pos >= hi:
                return out
            for m in c.consume(500, 1.0):
                if m.error() is None:
                    out.append(m.value())
    finally:
        c.close()


def test_store_source_offsets_are_its_restore_progress(kafka_bootstrap, make_topic, tmp_path):
    """KIP-875 on the store source: GET shows the restore's positions, DELETE resets them (a
    resume produces everything again), PATCH sets one partition's position."""
    topic = make_topic(partitions=1)
    target = f"{topic}-restored"
    store = str(tmp_path / "store")
    _produce(kafka_bootstrap, topic, 0, 30)
    with KcompactConnect(tmp_path, kafka_bootstrap) as k:
        base = k.url
        _create(base, "copy", {"connector.class": "StoreSinkConnector", "topics": topic,
                               "store.url": store, "follow": "false"})
        wait_until(lambda: len(_store_records(store, topic)) == 30, "30 records stored")
        _create(base, "back", {"connector.class": "StoreSourceConnector", "store.url": store,
                               "store.topic": topic, "topic": target, "mode": "all"})
        want = [f"v{i}".encode() for i in range(30)]
        wait_until(lambda: _topic_values(kafka_bootstrap, target) == want, "restored")
        _wait_state(base, "back", "RUNNING/UNASSIGNED", "the restore's task ended")
        status, doc = request(f"{base}/connectors/back/offsets")
        assert (status, doc) == (200, {"offsets": [{"partition": {"partition": 0},
                                                    "offset": {"position": 30}}]})
        # changed only when STOPPED
        status, doc = request(f"{base}/connectors/back/offsets", "DELETE")
        assert status == 400 and "STOPPED" in doc["message"]
        assert request(f"{base}/connectors/back/stop", "PUT")[0] == 204
        status, doc = request(f"{base}/connectors/back/offsets", "DELETE")
        assert status == 200 and "reset successfully" in doc["message"], doc
        assert request(f"{base}/connectors/back/offsets") == (200, {"offsets": []})
        # a resume restores from the beginning
        assert request(f"{base}/connectors/back/resume", "PUT")[0] == 202
        wait_until(lambda: _topic_values(kafka_bootstrap, target) == want + want,
                   "restored again")
        _wait_state(base, "back", "RUNNING/UNASSIGNED", "the second restore ended")
        assert request(f"{base}/connectors/back/stop", "PUT")[0] == 204
        # PATCH: partition 0 back to store offset 25
        status, doc = request(f"{base}/connectors/back/offsets", "PATCH", {"offsets": [
            {"partition": {"partition": 0}, "offset": {"position": 25}}]})
        assert status == 200 and "altered successfully" in doc["message"], doc
        assert request(f"{base}/connectors/back/offsets")[1] == {"offsets": [
            {"partition": {"partition": 0}, "offset": {"position": 25}}]}
        # bad moves: 400 naming what is wrong, nothing changed
        for body, what in (({"partition": {"partition": 3}, "offset": {"position": 1}},
                            "no partition 3"),
                           ({"partition": {"partition": 0}, "offset": {"position": 31}},
                            "past the end"),
                           ({"partition": {"file": "x"}, "offset": {"position": 1}},
                            '{"partition": N}'),
                           ({"partition": {"partition": 0}, "offset": {"pos": 1}},
                            '{"position": N}')):
            status, doc = request(f"{base}/connectors/back/offsets", "PATCH",
                                  {"offsets": [body]})
            assert status == 400 and what in doc["message"], (body, doc)
        assert request(f"{base}/connectors/back/offsets")[1]["offsets"][0]["offset"] == {
            "position": 25}
        assert request(f"{base}/connectors/back/resume", "PUT")[0] == 202
        wait_until(lambda: _topic_values(kafka_bootstrap, target) == want + want + want[25:],
                   "the last five again")
        _wait_state(base, "back", "RUNNING/UNASSIGNED", "the third restore ended")
        assert request(f"{base}/connectors/back/offsets")[1]["offsets"][0]["offset"] == {
            "position": 30}


def test_one_task_restarts_alone(kafka_bootstrap, make_topic, tmp_path):
    """POST /connectors/{name}/tasks/1/restart: task 1 stops (flushed) and starts again on its
    partition, task 0 goes on untouched (the connector is not restarted: its start line is
    printed once), and the store holds every record of both partitions once."""
    topic = make_topic(partitions=2)
    store = str(tmp_path / "store")
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i in range(40):
        p.produce(topic, key=b"k%d" % i, value=b"v%d" % i, partition=i % 2)
    assert p.flush(30) == 0

    def stored() -> tuple[list[int], list[int]]:
        with Store.open(store) as st:
            if topic not in st.topics():
                return [], []
            return tuple([r.offset for r in st.iter_records(topic, part)] for part in (0, 1))
    with KcompactConnect(tmp_path, kafka_bootstrap) as k:
        _create(k.url, "two", {"connector.class": "StoreSinkConnector", "topics": topic,
                               "store.url": store, "tasks.max": "2"})
        wait_until(lambda: stored() == (list(range(20)), list(range(20))), "40 stored")
        _wait_state(k.url, "two", "RUNNING/RUNNING,RUNNING", "two tasks running")
        assert request(f"{k.url}/connectors/two/tasks/1/restart", "POST")[0] == 204
        k.out.wait_for(r"two: task 1 restarted")
        _wait_state(k.url, "two", "RUNNING/RUNNING,RUNNING", "running after the restart")
        for i in range(40, 60):
            p.produce(topic, key=b"k%d" % i, value=b"v%d" % i, partition=i % 2)
        assert p.flush(30) == 0
        wait_until(lambda: stored() == (list(range(30)), list(range(30))), "60 stored")
        assert k.out.text().count("connect: two: 2 task(s)") == 1, k.out.text()
        assert request(f"{k.url}/connectors/two/tasks/2/restart", "POST")[0] == 404
