"""The client matrix (issue 52): mainstream Kafka clients read a store through the Kafka endpoint
as they read Apache Kafka 3.9.1.

The clients, each installed from its registry into the cache directory (clients/install.py; `make
clients`) and skipped with the reason when its toolchain is absent: kafka-python and aiokafka
(PyPI, as installed: no extras, in a virtualenv of their own), kafkajs 2.2.4 (npm), segmentio's
kafka-go and IBM's sarama (the Go module proxy; sarama also pinned to protocol 2.0.0, a common
setting), rskafka 0.6 (crates.io, built with cargo; no group column: it has no groups). Each is
driven by a small program under clients/ with one command line (clientlib.py).

The store: a topic of 4 partitions produced uncompressed to the real Kafka (keyed updates,
tombstones, keyless records, headers, a committed transaction ending partition 1, an aborted one
ending partition 2), mirrored as ``kcompact mirror`` does and compacted with ``kcompact compact
--force`` (delete.retention.ms=0, until every tombstone past it is gone): partition 0's last
record, a tombstone, stays (compaction never removes a partition's last record, as Kafka never
cleans the active segment holding it), so partitions 1 and 2 end in an offset gap (transaction
markers, which the store does not hold), partitions 0 and 3 end in a record; and a zstd topic
(``compression.type=zstd`` at the source, which the mirror syncs).
``kcompact serve --kafka-listen`` serves it, once for the module. The columns, per client:

* read: every partition from offset 0 delivers exactly ``kcompact dump --json``'s records (none
  twice; past a partition's last record, a client that hands transaction markers to the
  application, kafka-go, gets a control record where Kafka's log holds a marker), and the
  client's position reaches the high watermark where it says its position (where it reaches
  Kafka's on the source topic);
* group: a member reads half, commits, leaves; a second resumes: every record once, and the
  committed offsets are what the same client commits on Kafka;
* offsets: ListOffsets earliest and latest equal the same client's on Kafka (latest: the store's
  end offsets);
* produce: the client's default producer is refused with an error saying why (the endpoint is
  read-only, or the producer is not authorized to write), and the store is unchanged;
* idle: after the last record, the Fetch requests a client makes in IDLE_S seconds are at most
  twice what it makes against Apache Kafka for the source topic (both counted by the same
  loopback proxy, clients/fetch_proxy.py), and no record comes again;
* zstd: the zstd topic reads as dumped where the client reads it from Kafka; a client that fails
  on Kafka (no zstd codec as installed, or a Fetch below v10, which Kafka refuses a zstd topic)
  fails on the endpoint with the same error.

Run time: about 3 minutes on 2 cores with the clients cached (first install: about a minute more,
most of it the Go build).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kcompact.connectors.apps.mirror import mirror_local
from kcompact.reput import Store

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "clients"))
from endpoint_tools import KCOMPACT, Endpoint, read_all  # noqa: E402
from fetch_proxy import FetchCountingProxy  # noqa: E402
import install  # noqa: E402

pytestmark = pytest.mark.integration

CLIENTS_DIR = Path(__file__).parent / "clients"
T0 = (int(time.time()) - 3600) * 1000
PARTITIONS = 4
#: how long the idle column lets each client poll at the end of every partition
IDLE_S = 5.0

#: client -> (installer, argv prefix after the installed path, environment)
CLIENTS = {
    "kafka-python": ("python", [str(CLIENTS_DIR / "kafka_python_client.py")], {}),
    "aiokafka": ("python", [str(CLIENTS_DIR / "aiokafka_client.py")], {}),
    "kafkajs": ("node", [str(CLIENTS_DIR / "kafkajs" / "client.js")], {}),
    "kafka-go": ("go", ["kafka-go"], {}),
    "sarama": ("go", ["sarama"], {}),
    "sarama-2.0.0": ("go", ["sarama"], {"SARAMA_VERSION": "2.0.0"}),
    "rskafka": ("rust", [], {}),
}

#: columns a client fails on Kafka itself for the matrix's topic: the endpoint must fail with the
#: same error
RSKAFKA_MARKERS = ("rskafka 0.6 cannot decode a transaction marker (it reads the control "
                   "record's length as the key's version: 'Unknown control batch record version: "
                   "8192'), so it cannot read a partition holding one, from Kafka either")
FAILS_AS_ON_KAFKA = {("read", "rskafka"): RSKAFKA_MARKERS, ("idle", "rskafka"): RSKAFKA_MARKERS}

#: the columns a client has no API for: client -> {column: why}
UNSUPPORTED = {"rskafka": {"group": "rskafka has no consumer groups"}}

#: what a client cannot tell apart, applied to the dump it is compared with: kafka-go reads an
#: empty header value as none (a nil slice), on Kafka too
EMPTY_HEADER_IS_NULL = {"kafka-go"}
#: clients that hold a record's headers in a map ordered by name (rskafka: a BTreeMap)
HEADERS_BY_NAME = {"rskafka"}
#: clients that hand transaction markers to the application as records, on Kafka too
#: (segmentio/kafka-go #1446; its Reader moves only past the messages it delivers): past a
#: partition's last record they deliver control records, each at an offset where Kafka's log
#: holds a marker (on Kafka it also delivers an aborted transaction's records)
DELIVERS_MARKERS = {"kafka-go"}

_installed: dict[str, object] = {}


#: Gaps of issue 52 this matrix still shows (the issue stays open until they are gone). Each is
#: a strict xfail: the day a client passes, its test fails until the entry goes.
KNOWN_GAPS: dict[tuple[str, str], str] = {}


#: intermittent, not explained yet (issue 52 open): not strict, the test still runs and reports
FLAKY: dict[tuple[str, str], str] = {}


def _known_gap(request, column: str, client: str) -> None:
    unsupported = UNSUPPORTED.get(client, {}).get(column)
    if unsupported:
        pytest.skip(unsupported)
    why = KNOWN_GAPS.get((column, client))
    if why:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"issue 52 open: {why}"))
    flaky = FLAKY.get((column, client))
    if flaky:
        request.applymarker(pytest.mark.xfail(strict=False, reason=f"issue 52 open: {flaky}"))




def _as_read_by(client: str, records: list[dict]) -> list[dict]:
    if client in HEADERS_BY_NAME:
        return [{**r, "headers": sorted(r["headers"])} for r in records]
    if client not in EMPTY_HEADER_IS_NULL:
        return records
    return [{**r, "headers": [[k, v or None] for k, v in r["headers"]]} for r in records]


def _data_and_markers(client: str, records: list[dict], lasts: list[int]
                      ) -> tuple[list[dict], dict[int, list[int]]]:
    """(the records up to each partition's last record, sorted; {partition: offsets of the
    records delivered past it}), the second empty but for a client of DELIVERS_MARKERS."""
    data = [r for r in records if r["offset"] <= lasts[r["partition"]]]
    past: dict[int, list[int]] = {}
    for r in records:
        if r["offset"] > lasts[r["partition"]]:
            past.setdefault(r["partition"], []).append(r["offset"])
    return _sorted(data), past


def _is_marker(r: dict) -> bool:
    """A control record as a client hands it on: key (version 0, type ABORT or COMMIT)."""
    key = base64.b64decode(r["key"]) if r["key"] is not None else b""
    return key in (b"\x00\x00\x00\x00", b"\x00\x00\x00\x01")


def _check_markers(client: str, ours: "Run", m: "Matrix") -> list[dict]:
    """The records of ``ours`` up to each partition's last record; past it only what
    DELIVERS_MARKERS allows: control records, each at an offset where Kafka's log holds a
    transaction marker or an aborted record (past its last committed record, below the high
    watermark: what the client may be handed from Kafka; whether it is, before its position
    reaches the end, depends on how Kafka's answers are cut)."""
    data, past = _data_and_markers(client, ours.records, m.endpoint.lasts)
    if client not in DELIVERS_MARKERS:
        assert not past, f"records past the last one: {past}"
        return data
    extra = [r for r in ours.records if r["offset"] > m.endpoint.lasts[r["partition"]]]
    assert all(_is_marker(r) for r in extra), extra
    assert all(m.kafka.lasts[p] < o < m.kafka.hwm[p] for p, v in past.items() for o in v), \
        (past, m.kafka.lasts, m.kafka.hwm)
    return data


def _client_argv(client: str) -> tuple[list[str], dict]:
    kind, args, env = CLIENTS[client]
    if kind not in _installed:
        installer = {"python": install.python_clients, "node": install.node_clients,
                     "go": install.go_clients, "rust": install.rust_clients}[kind]
        try:
            _installed[kind] = installer()
        except install.Unavailable as e:
            _installed[kind] = e
    got = _installed[kind]
    if isinstance(got, install.Unavailable):
        pytest.skip(str(got))
    env = {**os.environ, **env}
    if kind == "node":
        env["NODE_PATH"] = str(got)
        return ["node", *args], env
    return [str(got), *args], env


# -- the workload, the store, the endpoint ---------------------------------------------------


def _produce_workload(bootstrap: str, topic: str) -> None:
    """Uncompressed: keyed updates, tombstones, keyless records and headers on every partition;
    partition 0 ends with a tombstone, 1 with a committed transaction, 2 with an aborted one,
    3 with a plain keyed record."""
    failed = []
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "none",
                  "on_delivery": lambda err, _msg: err and failed.append(err)})
    for part in range(PARTITIONS):
        for i in range(45):
            key = None if i % 7 == 3 else b"k%d" % (i % 9)
            value = None if key is not None and i % 10 == 8 else b"p%d-v%d-" % (part, i) + \
                b"y" * (i % 23)
            p.produce(topic, key=key, value=value, partition=part, timestamp=T0 + i * 10,
                      headers=[("h", b"%d" % i), ("empty", b"")] if i % 4 == 0 else None)
    p.produce(topic, key=b"k0", value=None, partition=0, timestamp=T0 + 1000)
    p.produce(topic, key=b"last", value=b"plain", partition=3, timestamp=T0 + 1000)
    assert p.flush(30) == 0 and not failed, failed
    for part, commit in ((1, True), (2, True), (2, False)):
        tp = Producer({"bootstrap.servers": bootstrap, "compression.type": "none",
                       "transactional.id": f"matrix-{topic}-{part}-{commit}"})
        tp.init_transactions(30)
        tp.begin_transaction()
        for i in range(3):
            tp.produce(topic, key=b"tx%d" % i, value=b"committed" if commit else b"aborted",
                       partition=part, timestamp=T0 + 2000 + i,
                       headers=[("tx", b"%d" % i)])
        tp.flush(30)
        (tp.commit_transaction if commit else tp.abort_transaction)(30)
    _settled(bootstrap, topic)


def _settled(bootstrap: str, topic: str) -> None:
    """Wait until Kafka wrote the transactions' markers (the last stable offsets reach the
    high watermarks)."""
    from confluent_kafka import Consumer, TopicPartition

    def ends(isolation: str) -> list:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ends",
                      "isolation.level": isolation})
        try:
            return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                    for p in range(PARTITIONS)]
        finally:
            c.close()
    deadline = time.monotonic() + 30
    while ends("read_committed") != ends("read_uncommitted"):
        assert time.monotonic() < deadline, "the transaction markers were never written"
        time.sleep(0.2)


def _produce_zstd(bootstrap: str, topic: str) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "compression.type": "zstd"})
    for part in (0, 1):
        for i in range(30):
            p.produce(topic, key=b"z%d" % (i % 6), value=b"zstd-%d-" % i + b"z" * 50,
                      partition=part, timestamp=T0 + i)
    assert p.flush(30) == 0


def _kcompact(*args: str) -> str:
    r = subprocess.run([*KCOMPACT, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (args, r.stderr[-2000:])
    return r.stdout


def _b64_field(d: dict, name: str) -> str | None:
    if d.get(name) is not None:
        return base64.b64encode(d[name].encode()).decode()
    if d.get(name + "_b64") is not None:
        return d[name + "_b64"]
    return None


def _dump(url: str, topic: str, partitions: int) -> list[dict]:
    """``kcompact dump --json`` of every partition, as the client programs print records."""
    out = []
    for p in range(partitions):
        for line in _kcompact("dump", "--store", url, "--topic", topic, "--partition", str(p),
                              "--json").splitlines():
            d = json.loads(line)
            out.append({"topic": d["topic"], "partition": d["partition"], "offset": d["offset"],
                        "timestamp": d["timestamp"], "key": _b64_field(d, "key"),
                        "value": _b64_field(d, "value"),
                        "headers": [[h["key"], _b64_field(h, "value")] for h in d["headers"]]})
    return out


def _lasts(records: list[dict], partitions: int) -> list[int]:
    return [max((r["offset"] for r in records if r["partition"] == p), default=-1)
            for p in range(partitions)]


@dataclass
class Target:
    """One side of the comparison: the endpoint over the store, or Apache Kafka's source."""
    name: str
    bootstrap: str
    proxy: FetchCountingProxy
    topic: str
    zstd_topic: str
    lasts: list[int]          # each partition's last record offset (read_committed)
    zstd_lasts: list[int]
    hwm: list[int]
    runs: dict = field(default_factory=dict)


@dataclass
class Matrix:
    url: str
    work: Path
    endpoint: Target
    kafka: Target
    dump: list[dict]
    zstd_dump: list[dict]
    first: list[int]          # each partition's first record offset in the store


@pytest.fixture(scope="module")
def matrix(apache_kafka, tmp_path_factory):
    from confluent_kafka.admin import NewTopic
    topic, ztopic = f"matrix-{uuid.uuid4().hex[:8]}", f"matrixz-{uuid.uuid4().hex[:8]}"
    fs = apache_kafka.admin.create_topics([
        NewTopic(topic, PARTITIONS, 1, config={"retention.ms": "-1"}),
        NewTopic(ztopic, 2, 1, config={"retention.ms": "-1", "compression.type": "zstd"})])
    for f in fs.values():
        f.result()
    _produce_workload(apache_kafka.bootstrap, topic)
    _produce_zstd(apache_kafka.bootstrap, ztopic)
    work = tmp_path_factory.mktemp("matrix")
    url = str(work / "store")
    for t in (topic, ztopic):
        mirror_local(apache_kafka.bootstrap, t, url, out=io.StringIO(), handle_signals=False)
    # compacted in the store only (Kafka refuses keyless records to a compacted topic)
    _kcompact("configs", "--store", url, "--topic", topic, "--alter", "--add-config",
              "cleanup.policy=compact,delete.retention.ms=0,min.compaction.lag.ms=0")
    # a tombstone is stamped by the pass that first cleans it and dropped by a later one (the
    # first pass may find it in the active segment, which it seals): until every tombstone is
    # gone but partition 0's last record, which compaction never removes (4 passes at most)
    for _ in range(4):
        _kcompact("compact", "--store", url, "--force")
        dump = _dump(url, topic, PARTITIONS)
        if [r for r in dump if r["key"] is not None and r["value"] is None] == \
                [r for r in dump if r["partition"] == 0][-1:]:
            break
    zdump = _dump(url, ztopic, 2)
    with Store.open(url) as st:
        hwm = [st.next_offset(topic, p) for p in range(PARTITIONS)]
        first = [st.first_offset(topic, p) for p in range(PARTITIONS)]
    lasts = _lasts(dump, PARTITIONS)
    theirs = read_all(apache_kafka.bootstrap, topic, PARTITIONS)
    assert all(theirs[p] for p in range(PARTITIONS)), {p: len(v) for p, v in theirs.items()}
    kafka_lasts = [theirs[p][-1][0] for p in range(PARTITIONS)]
    ztheirs = read_all(apache_kafka.bootstrap, ztopic, 2)
    # the premise: partitions 1 and 2 end in a gap (transaction markers, on Kafka too), 0 and
    # 3 do not: 0 ends in a tombstone past delete.retention.ms, which compaction keeps as the
    # partition's last record (Kafka's active segment holds it); every other tombstone went;
    # the end offsets are Kafka's
    assert theirs[-1] == hwm
    assert [last + 1 < end for last, end in zip(lasts, hwm)] == [False, True, True, False]
    tombstones = [r for r in dump if r["key"] is not None and r["value"] is None]
    assert [(r["partition"], r["offset"]) for r in tombstones] == [(0, hwm[0] - 1)]
    assert kafka_lasts[0] == hwm[0] - 1 and kafka_lasts[3] == hwm[3] - 1
    assert kafka_lasts[1] < hwm[1] - 1 and kafka_lasts[2] < hwm[2] - 1
    assert len(dump) < sum(len(theirs[p]) for p in range(PARTITIONS))  # compaction dropped some
    ep = Endpoint(url, "--allow-unauthenticated", log=work / "endpoint.log").start()
    proxies = [FetchCountingProxy(ep.bootstrap).start(),
               FetchCountingProxy(apache_kafka.bootstrap).start()]
    try:
        yield Matrix(
            url, work,
            Target("endpoint", ep.bootstrap, proxies[0], topic, ztopic, lasts,
                   _lasts(zdump, 2), hwm),
            Target("kafka", apache_kafka.bootstrap, proxies[1], topic, ztopic, kafka_lasts,
                   [ztheirs[p][-1][0] for p in (0, 1)], hwm),
            dump, zdump, first)
    finally:
        for p in proxies:
            p.stop()
        ep.stop()
        apache_kafka.admin.delete_topics([topic, ztopic], operation_timeout=30)


# -- running a client program ----------------------------------------------------------------


@dataclass
class Run:
    lines: list[dict]
    returncode: int
    stderr: str
    fetches: int | None = None        # Fetch requests counted between idle start and end

    @property
    def error(self) -> str | None:
        return next((x["error"] for x in self.lines if "error" in x), None)

    def one(self, key: str):
        return next(x[key] for x in self.lines if key in x)

    @property
    def records(self) -> list[dict]:
        return [x for x in self.lines if "offset" in x]

    def why(self) -> str:
        return f"error {self.error!r}; exit {self.returncode}; stderr: {self.stderr[-1500:]}"


def _run(client: str, target: Target, *args: str, timeout: float = 150) -> Run:
    """The client's program with ``args`` (clientlib.py's command line); for ``idle``, through
    the target's counting proxy, the fetches between its idle start and end lines counted."""
    argv, env = _client_argv(client)
    idle = args[0] == "idle"
    bs = target.proxy.bootstrap if idle else target.bootstrap
    err = tempfile.TemporaryFile("w+")       # a file: a chatty client never blocks on it
    proc = subprocess.Popen([*argv, args[0], bs, *args[1:]], stdout=subprocess.PIPE,
                            stderr=err, text=True, env=env)
    lines, marks = [], {}
    deadline = time.monotonic() + timeout
    try:
        for raw in proc.stdout:
            line = json.loads(raw)
            if line.get("idle") in ("start", "end"):
                marks[line["idle"]] = target.proxy.fetches
            lines.append(line)
            if time.monotonic() > deadline:
                break
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            lines.append({"error": f"still running after {timeout:.0f} s"})
    err.seek(0)
    stderr = err.read()
    err.close()
    fetches = marks["end"] - marks["start"] if len(marks) == 2 else None
    return Run(lines, proc.returncode, stderr, fetches)


def _both(client: str, m: Matrix, make_args) -> tuple[Run, Run]:
    """The same command on the endpoint and on Kafka at once: (endpoint's run, Kafka's)."""
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_run, client, t, *make_args(t)) for t in (m.endpoint, m.kafka)]
        return futs[0].result(), futs[1].result()


def _ints(d: dict) -> dict[int, int | None]:
    return {int(k): v for k, v in d.items()}


def _csv(xs: list[int]) -> str:
    return ",".join(map(str, xs))


def _sorted(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["partition"], r["offset"]))


# -- the columns -----------------------------------------------------------------------------


def _fails_as_on_kafka(column: str, client: str, ours: Run, theirs: Run, m: Matrix) -> bool:
    """For a client FAILS_AS_ON_KAFKA lists (it fails on Kafka): True when it fails on the
    endpoint with the same error; False when it does not fail there (the column's checks then
    apply: it must pass them)."""
    if (column, client) not in FAILS_AS_ON_KAFKA:
        return False
    assert theirs.error is not None, f"the premise: {client} fails on Kafka ({theirs.lines[-3:]})"
    if ours.error is None:
        return False
    assert _normalized(ours.error, m) == _normalized(theirs.error, m)
    return True


@pytest.mark.parametrize("client", CLIENTS)
def test_read_every_record_as_dumped(matrix, client, request):
    _known_gap(request, 'read', client)
    m = matrix
    ours, theirs = _both(client, m, lambda t: ("read", t.topic, _csv(t.lasts)))
    if _fails_as_on_kafka("read", client, ours, theirs, m):
        return
    fails_on_kafka = ("read", client) in FAILS_AS_ON_KAFKA
    if not fails_on_kafka:
        assert theirs.error is None, f"the premise: {client} reads the source topic: " \
            f"{theirs.why()}"
    assert ours.error is None, ours.why()
    # (each partition's in order: none came twice)
    assert _check_markers(client, ours, m) == _as_read_by(client, m.dump)
    if fails_on_kafka:
        return  # (no position on Kafka to compare with)
    hwm = dict(enumerate(m.endpoint.hwm))
    kafka_positions = _ints(theirs.one("positions"))
    positions = _ints(ours.one("positions"))
    if all(v is None for v in kafka_positions.values()):
        return  # the client does not say its position (sarama)
    assert kafka_positions == hwm, "the premise: on Kafka the client's position reaches the end"
    assert positions == hwm, "the position stopped short of the high watermark"


@pytest.mark.parametrize("client", CLIENTS)
def test_group_resumes_and_commits_the_end(matrix, client, request):
    _known_gap(request, 'group', client)
    m = matrix
    half = len(m.dump) // 2
    ours, theirs = _both(client, m, lambda t: (
        "group", t.topic, _csv(t.lasts), f"matrix-{client}-{uuid.uuid4().hex[:6]}", str(half)))
    assert theirs.error is None, f"the premise: {client} groups on Kafka: {theirs.why()}"
    assert ours.error is None, ours.why()
    # every record once, across the restart
    assert _check_markers(client, ours, m) == _as_read_by(client, m.dump)
    hwm, committed = m.endpoint.hwm, _ints(ours.one("committed"))
    on_kafka = _ints(theirs.one("committed"))
    # every partition ends as on Kafka (markers, a record): the same commits as there (the end
    # of partition 1, past its commit marker, when the client steps over markers)
    assert committed == on_kafka
    assert on_kafka[0] == hwm[0] and on_kafka[3] == hwm[3], \
        "the premise: on Kafka the client commits the end of a partition ending in a record"


@pytest.mark.parametrize("client", CLIENTS)
def test_list_offsets_earliest_and_latest(matrix, client):
    m = matrix
    ours, theirs = _both(client, m, lambda t: ("offsets", t.topic, str(PARTITIONS)))
    assert theirs.error is None and ours.error is None, (ours.why(), theirs.why())
    got = {k: _ints(ours.one(k)) for k in ("earliest", "latest")}
    # the log start offset is the source's (compaction never moves it, on Kafka neither), at
    # or below the first record the store kept; the end offsets are the store's
    assert got == {k: _ints(theirs.one(k)) for k in ("earliest", "latest")}
    assert got["latest"] == dict(enumerate(m.endpoint.hwm))
    assert all(got["earliest"][p] <= m.first[p] for p in range(PARTITIONS))


@pytest.mark.parametrize("client", CLIENTS)
def test_produce_is_refused_saying_why(matrix, client, request):
    _known_gap(request, 'produce', client)
    m = matrix
    ours = _run(client, m.endpoint, "produce", m.endpoint.topic)
    assert ours.error is None, ours.why()
    assert not any("produced" in x for x in ours.lines), "a produce was accepted"
    message = ours.one("produce_error")
    # the endpoint's reason, or an authorization error (InitProducerId, the idempotent and
    # transactional producers' first request, has no message: Kafka refuses a principal
    # without write access so)
    assert re.search(r"read-only|authoriz", message, re.I), f"{client} prints no reason: " \
        f"{message!r}"
    with Store.open(m.url) as st:
        assert [st.next_offset(m.endpoint.topic, p) for p in range(PARTITIONS)] == \
            m.endpoint.hwm


@pytest.mark.parametrize("client", CLIENTS)
def test_idle_at_the_end_fetches_as_on_kafka(matrix, client, request):
    _known_gap(request, 'idle', client)
    m = matrix
    ours, theirs = _both(client, m, lambda t: ("idle", t.topic, _csv(t.lasts), str(IDLE_S)))
    if _fails_as_on_kafka("idle", client, ours, theirs, m):
        return
    assert theirs.error is None and theirs.fetches is not None, theirs.why()
    assert ours.error is None and ours.fetches is not None, ours.why()
    assert ours.one("records") == 0, "records delivered again while idle"
    assert ours.fetches <= 2 * max(theirs.fetches, 1), (
        f"{ours.fetches} fetches in {IDLE_S} s idle; {theirs.fetches} against Kafka")


def _normalized(error: str, m: Matrix) -> str:
    for t in (m.endpoint, m.kafka):
        error = error.replace(t.bootstrap, "BROKER").replace(t.zstd_topic, "TOPIC")
        error = error.replace(t.topic, "TOPIC")
    error = re.sub(r"TOPIC/\d+", "TOPIC/P", error)    # whichever partition failed first
    error = re.sub(r"partition \d+ at \d+", "partition P at O", error)
    return re.sub(r"127\.0\.0\.1:\d+|localhost:\d+", "BROKER", error)


@pytest.mark.parametrize("client", CLIENTS)
def test_zstd_source_reads_or_fails_as_on_kafka(matrix, client, request):
    _known_gap(request, 'zstd', client)
    m = matrix
    ours, theirs = _both(client, m, lambda t: ("read", t.zstd_topic, _csv(t.zstd_lasts)))
    if theirs.error is not None:       # no zstd in this client as installed
        assert ours.error is not None, "reads on the endpoint what it cannot read on Kafka"
        assert _normalized(ours.error, m) == _normalized(theirs.error, m)
        return
    assert ours.error is None, ours.why()
    assert _sorted(ours.records) == _as_read_by(client, m.zstd_dump)
