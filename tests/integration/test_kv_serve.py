"""``kcompact kv serve`` and ``kv build --follow`` answering reads (connectors/apps/kv/serve.py,
remote.py), run as an operator runs them: a real process following a real store, read over
HTTP and by ``kcompact kv get`` from another process; its /metrics and /healthz
(replication/ops.py) scraped and parsed with prometheus_client's own parser; the same for
``serve`` and ``replicate --follow``, and the health endpoint's 503. No broker: the followers
follow a store (tests/integration/test_service.py follows Kafka).

The expected map is test_kv.py's dict model of the records. Every process is stopped by the
test (SIGTERM), and each wait is bounded."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kcompact.connectors.apps.kv.follower_client import ADDRESS_FILE
from kcompact.replication import ReplicationError
from kcompact.replication.ops import Ops, Unreachable, start_ops
from kcompact.reput import RecordBatch, Store, WriterOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_kv import TOPIC, gen_records, model, write_store  # noqa: E402

KCOMPACT = [sys.executable, "-m", "kcompact"]
WAIT_S = 60.0


class Proc:
    """A kcompact process whose stderr is read for its URLs."""

    def __init__(self, args: list[str], tmp_path, name: str = "proc"):
        self.err_path = tmp_path / f"{name}.err"
        self.out_path = tmp_path / f"{name}.out"
        self.p = subprocess.Popen(KCOMPACT + args, stdout=open(self.out_path, "wb"),
                                  stderr=open(self.err_path, "wb"))

    def err(self) -> str:
        return self.err_path.read_text()

    def wait_line(self, text: str) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for line in self.err().splitlines():
                if text in line:
                    return line
            if self.p.poll() is not None:
                raise AssertionError(f"exited {self.p.returncode}: {self.err()}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {WAIT_S}s: {self.err()}")

    def url_after(self, text: str) -> str:
        line = self.wait_line(text)
        return line.split(text, 1)[1].split()[0]

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()


def http(url: str, *, data: bytes | None = None, token: str | None = None
         ) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=data)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def jget(url: str, **kw) -> dict:
    status, _, body = http(url, **kw)
    assert status == 200, (status, body)
    return json.loads(body)


def value_of(item: dict) -> bytes:
    if item.get("value_b64") is not None:
        return base64.b64decode(item["value_b64"])
    return item["value"].encode()


def key_of(item: dict) -> bytes:
    if item.get("key_b64") is not None:
        return base64.b64decode(item["key_b64"])
    return item["key"].encode()


def scan_all(url: str, limit: int, query: str = "") -> tuple[dict[bytes, bytes], int]:
    doc = jget(f"{url}/v1/scan?limit={limit}{query}")
    out, pages = {}, 1
    while True:
        for it in doc["items"]:
            out[key_of(it)] = value_of(it)
        if doc["next"] is None:
            return out, pages
        doc = jget(f"{url}/v1/scan?token={doc['next']}&limit={limit}")
        pages += 1


def kv_get(db, key: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(KCOMPACT + ["kv", "get", "--db", str(db), key, *extra],
                          capture_output=True, timeout=WAIT_S)


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {WAIT_S}s")


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    status, headers, body = http(url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def append_records(store, records) -> None:
    with Store.open(str(store), writer="w", options=WriterOptions(fsync="never")) as st:
        by_p: dict[int, list] = {}
        for r in records:
            by_p.setdefault(r[0], []).append(r)
        for rows in by_p.values():
            st.append(RecordBatch.from_records(TOPIC, rows))
        st.flush()


# ---------------------------------------------------------------------------------------------


def test_kv_serve_answers_every_read_and_kv_get_goes_through_it(tmp_path, procs):
    records = gen_records(3000, partitions=3, keys=400, seed=3)
    store, db = tmp_path / "store", tmp_path / "map"
    write_store(store, records)
    expected = model(records)
    srv = Proc(["kv", "serve", "--store", str(store), "--topic", TOPIC, "--db", str(db),
                "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"], tmp_path, "serve")
    procs.append(srv)
    url = srv.url_after(f"serving reads of {db} on ")
    murl = srv.url_after("metrics on ").rsplit("/metrics", 1)[0]
    srv.wait_line("following topic")

    # offsets: the store's next offsets, every key counted
    ends: dict[int, int] = {}
    for p, off, *_ in records:
        ends[p] = max(ends.get(p, 0), off + 1)
    doc = jget(f"{url}/v1/offsets")
    assert doc["topic"] == TOPIC and doc["keys"] == len(expected) and not doc["building"]
    assert {int(p): o for p, o in doc["offsets"].items()} == ends

    # one key: JSON (text or base64 as dump --json) and raw bytes; absent keys
    k, v = sorted(expected.items())[5]
    item = jget(f"{url}/v1/get?key={k.decode()}")
    assert item["found"] and value_of(item) == v and item["key"] == k.decode()
    status, headers, body = http(f"{url}/v1/raw?key_b64={base64.b64encode(k).decode()}")
    assert status == 200 and body == v and headers["X-Kcompact-Topic"] == TOPIC
    assert jget(f"{url}/v1/get?key=absent") == {"key": "absent", "found": False}
    status, headers, _ = http(f"{url}/v1/raw?key=absent")
    assert status == 404 and headers["X-Kcompact-Found"] == "0"
    status, _, body = http(f"{url}/v1/get")
    assert status == 400 and b"missing key" in body

    # many keys in one request, in the order asked, with the offsets of the same snapshot
    some = sorted(expected)[:50]
    body = json.dumps({"keys": [x.decode() for x in some] + ["absent"],
                       "keys_b64": [base64.b64encode(b"\xff\x00").decode()]}).encode()
    got = jget(f"{url}/v1/get", data=body)
    assert [key_of(r) for r in got["results"]] == some + [b"absent", b"\xff\x00"]
    assert [value_of(r) for r in got["results"][:50]] == [expected[x] for x in some]
    assert not got["results"][50]["found"] and not got["results"][51]["found"]

    # scans: the whole map in pages, a prefix, a range
    whole, pages = scan_all(url, 37)
    assert whole == expected and pages == -(-len(expected) // 37)
    pre, _ = scan_all(url, 10, "&prefix=p1-")
    assert pre == {x: y for x, y in expected.items() if x.startswith(b"p1-")}
    rng, _ = scan_all(url, 1000, "&start=p0-k00100&stop=p2-k00000")
    assert rng == {x: y for x, y in expected.items() if b"p0-k00100" <= x < b"p2-k00000"}

    # a scan's pages all show the snapshot of its first page, while the follower applies
    # more records; a new read shows them
    first = jget(f"{url}/v1/scan?limit=5&prefix=p0-")
    more = [(0, ends[0] + i, 1_700_000_100_000, key_of(it), b"changed")
            for i, it in enumerate(first["items"] + [{"key": "p0-zzz"}])]
    append_records(store, more)
    wait_for(lambda: jget(f"{url}/v1/get?key=p0-zzz")["found"], "the follower applies")
    rest, token = {}, first["next"]
    while token:
        page = jget(f"{url}/v1/scan?token={token}&limit=50")
        assert page["offsets"] == first["offsets"]
        rest.update({key_of(i): value_of(i) for i in page["items"]})
        token = page["next"]
    assert b"p0-zzz" not in rest
    assert rest == {x: y for x, y in expected.items() if x.startswith(b"p0-")
                    and x not in {key_of(i) for i in first["items"]}}
    assert value_of(jget(f"{url}/v1/get?key={key_of(first['items'][0]).decode()}")) == \
        b"changed"
    status, _, body = http(f"{url}/v1/scan?token=not-a-token")
    assert status == 400

    # kv get in another process reads through the follower (LevelDB's lock keeps it out)
    assert (db / ADDRESS_FILE).exists() and (db / ADDRESS_FILE).stat().st_mode & 0o077 == 0
    r = kv_get(db, "p0-zzz")
    assert r.returncode == 0 and r.stdout == b"changed\n", r.stderr
    r = kv_get(db, "p0-zzz", "--json")
    assert json.loads(r.stdout) == {"key": "p0-zzz", "found": True, "value": "changed"}
    assert kv_get(db, "absent").returncode == 1

    # metrics and health of the running follower
    m = scrape(murl)
    applied = {dict(lab)["partition"]: v for lab, v in m["kcompact_kv_applied_offset"].items()}
    assert applied == {str(p): float(ends[p] + (len(more) if p == 0 else 0)) for p in ends}
    assert set(m["kcompact_kv_lag_records"].values()) == {0.0}
    assert m["kcompact_kv_keys"][(("topic", TOPIC),)] == len(expected) + 1
    assert [dict(lab)["command"] for lab in m["kcompact_info"]] == ["kv serve"]
    assert m["kcompact_kv_http_requests_total"][(("code", "200"), ("route", "/v1/scan"))] >= 3
    status, _, body = http(murl + "/healthz")
    assert (status, body) == (200, b"ok\n")

    # stopped: the address file goes, and kv get opens the map itself
    assert srv.stop() == 0
    assert not (db / ADDRESS_FILE).exists()
    r = kv_get(db, "p0-zzz")
    assert r.returncode == 0 and r.stdout == b"changed\n"


def test_kv_serve_bearer_token_and_loopback(tmp_path, procs):
    records = gen_records(300, partitions=1, keys=50, seed=4)
    store, db = tmp_path / "store", tmp_path / "map"
    write_store(store, records)
    # beyond loopback a token is required: refused before anything starts
    r = subprocess.run(KCOMPACT + ["kv", "serve", "--store", str(store), "--topic", TOPIC,
                                   "--db", str(db), "--listen", "0.0.0.0:0"],
                       capture_output=True, timeout=WAIT_S)
    assert r.returncode == 1 and b"needs --token-file" in r.stderr
    assert r.stderr.decode().count("\n") == 1
    token = "t0ken-of-sixteen-chars-or-more"
    (tmp_path / "token").write_text(token + "\n")
    srv = Proc(["kv", "serve", "--store", str(store), "--topic", TOPIC, "--db", str(db),
                "--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "token")], tmp_path)
    procs.append(srv)
    url = srv.url_after(f"serving reads of {db} on ")
    srv.wait_line("following topic")
    k = sorted(model(records))[0].decode()
    assert http(f"{url}/v1/get?key={k}")[0] == 401
    assert http(f"{url}/v1/get?key={k}", token="wrong-token-wrong-token")[0] == 403
    assert jget(f"{url}/v1/get?key={k}", token=token)["found"]
    # the address file's own token: kv get still answers
    r = kv_get(db, k)
    assert r.returncode == 0 and r.stdout.rstrip(b"\n") == model(records)[k.encode()]
    # a second follower of the same map is refused with one line
    r = subprocess.run(KCOMPACT + ["kv", "serve", "--store", str(store), "--topic", TOPIC,
                                   "--db", str(db), "--listen", "127.0.0.1:0"],
                       capture_output=True, timeout=WAIT_S)
    assert r.returncode == 1 and b"one follower per map" in r.stderr
    assert srv.stop() == 0


def test_kv_build_follow_answers_kv_get_and_a_dead_follower_is_named(tmp_path, procs):
    records = gen_records(500, partitions=2, keys=80, seed=5)
    store, db = tmp_path / "store", tmp_path / "map"
    write_store(store, records)
    b = Proc(["kv", "build", "--store", str(store), "--topic", TOPIC, "--db", str(db),
              "--follow"], tmp_path)
    procs.append(b)
    b.wait_line("following topic")
    k, v = sorted(model(records).items())[3]
    r = kv_get(db, k.decode())
    assert r.returncode == 0 and r.stdout == v + b"\n", r.stderr
    # SIGKILLed: the map stays locked by nobody, the address file stays behind; kv get opens
    # the map itself (LevelDB's lock went with the process)
    b.p.kill()
    b.p.wait()
    assert (db / ADDRESS_FILE).exists()
    r = kv_get(db, k.decode())
    assert r.returncode == 0 and r.stdout == v + b"\n", r.stderr


def test_healthz_answers_503_with_the_reason_and_a_busy_address_is_one_line():
    now = [100.0]
    u = Unreachable("the Kafka cluster at b:9092", timeout_s=30, clock=lambda: now[0])
    u.down("connection refused")
    now[0] += 31
    ops = Ops("test")
    ops.check(u.check)
    ops.error("decode")
    server = start_ops(ops, "127.0.0.1:0")
    try:
        status, _, body = http(server.url + "/healthz")
        assert status == 503 and body == b"the Kafka cluster at b:9092 unreachable for 31s: " \
                                         b"connection refused\n"
        u.up()
        assert http(server.url + "/healthz")[:3:2] == (200, b"ok\n")
        m = scrape(server.url)
        assert m["kcompact_errors_total"][(("kind", "decode"),)] == 1.0
        assert "process_cpu_seconds_total" in m
    finally:
        server.stop()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ReplicationError, match="cannot listen on --metrics 127.0.0.1:"):
            start_ops(Ops("x"), f"127.0.0.1:{s.getsockname()[1]}")


def test_serve_and_replicate_follow_metrics(tmp_path, procs):
    """serve --metrics counts the records bytes it sent; replicate --follow --metrics shows its
    pull bytes, next offsets and follow lag per partition, and they reach the master's ends
    after more records are appended; both healthy."""
    records = gen_records(1500, partitions=2, keys=100, seed=6)
    master, replica = tmp_path / "master", tmp_path / "replica"
    write_store(master, records)
    (tmp_path / "token").write_text("a-token-of-enough-characters\n")
    token = str(tmp_path / "token")
    srv = Proc(["serve", "--store", str(master), "--listen", "127.0.0.1:0", "--token-file",
                token, "--metrics", "127.0.0.1:0"], tmp_path, "serve")
    procs.append(srv)
    smetrics = srv.url_after("metrics on ").rsplit("/metrics", 1)[0]
    url = srv.url_after(f"serving {master} on ")
    rep = Proc(["replicate", "--from", url, "--token-file", token, "--store", str(replica),
                "--follow", "--metrics", "127.0.0.1:0"], tmp_path, "replicate")
    procs.append(rep)
    rmetrics = rep.url_after("metrics on ").rsplit("/metrics", 1)[0]
    rep.wait_line("following the master")
    more = [(p, off + 10_000, ts, k, v) for p, off, ts, k, v in records[:300]]
    append_records(master, more)
    ends: dict[int, int] = {}
    for p, off, *_ in records + more:
        ends[p] = max(ends.get(p, 0), off + 1)

    def replica_at_ends() -> bool:
        m = scrape(rmetrics).get("kcompact_replication_next_offset", {})
        return {dict(lab)["partition"]: v for lab, v in m.items()} == \
            {str(p): float(o) for p, o in ends.items()}
    wait_for(replica_at_ends, "the replica's next offsets reach the master's")
    m = scrape(rmetrics)
    assert set(m["kcompact_replication_follow_lag_records"].values()) == {0.0}
    assert sum(m["kcompact_replication_pull_records_total"].values()) == len(more)
    assert min(m["kcompact_replication_pull_bytes_total"].values()) > 0
    assert "kcompact_compaction_runs_total" in m
    assert http(rmetrics + "/healthz")[:3:2] == (200, b"ok\n")
    s = scrape(smetrics)
    assert min(s["kcompact_serve_sent_bytes_total"].values()) > 0
    assert [dict(lab)["command"] for lab in s["kcompact_info"]] == ["serve"]
    assert http(smetrics + "/healthz")[:3:2] == (200, b"ok\n")
    assert rep.stop() == 0
    assert srv.stop() == 0
