"""The Kafka endpoint's listener against the protocol's corner cases (issue 40), in process.

SASL/PLAIN through SaslHandshake v1 + SaslAuthenticate and through SaslHandshake v0 (then a bare
token, as Kafka's legacy flow), FindCoordinator's key types, the host advertised on a wildcard
listener, an idle timeout closing silent connections while others are served, a TLS listener
logging why a plaintext client was dropped, and one port for every address of ``localhost``.
The endpoint runs in a thread of this process (test_kafka_endpoint_model.Served) and is spoken
to by a minimal protocol client (kio encodes the requests).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_kafka_endpoint_model import Client, Served  # noqa: E402
from test_reader_model import TOPIC, _build  # noqa: E402

from kcompact.replication.kafka_endpoint.server import Limits, advertised_host  # noqa: E402

TOKEN = b"s3cret-token-for-tests"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logger() -> tuple[logging.Logger, Lines]:
    log = logging.getLogger(f"test-endpoint-{time.monotonic_ns()}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    h = Lines()
    log.addHandler(h)
    return log, h


@pytest.fixture
def store(tmp_path) -> str:
    st_, _ = _build("local", str(tmp_path), [(1, b"k", b"v", [])], False)
    st_.close()
    return st_.url


def _closed(s: socket.socket, within: float = 10.0) -> bool:
    """Whether the peer closes ``s`` within ``within`` seconds (whatever it sent before)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def _metadata_ok(c: Client) -> bool:
    r = c.call(3, 12, topics=None, allow_auto_topic_creation=False,
               include_topic_authorized_operations=False)
    return TOPIC.encode() in r


def test_sasl_plain_through_handshake_v1_and_authenticate(store):
    log, lines = _logger()
    srv = Served(store, token=TOKEN, log=log)
    try:
        c = Client(srv.port)
        r = c.call(17, 1, mechanism="PLAIN")
        assert struct.unpack_from(">h", r, 4)[0] == 0
        r = c.call(36, 2, auth_bytes=b"\0anyone\0" + TOKEN)
        assert struct.unpack_from(">h", r, 5)[0] == 0  # (v2: flexible header, one tag byte)
        assert _metadata_ok(c)
        c.close()
        c = Client(srv.port)
        c.call(17, 1, mechanism="PLAIN")
        r = c.call(36, 1, auth_bytes=b"\0anyone\0wrong")
        assert struct.unpack_from(">h", r, 4)[0] == 58  # SASL_AUTHENTICATION_FAILED
        assert _closed(c.s)
        c = Client(srv.port)  # a request before authenticating: closed, with the reason
        c.s.sendall(struct.pack(">i", 12) + struct.pack(">hhih", 3, 1, 9, -1) + b"\0\0\0\0")
        assert _closed(c.s)
    finally:
        srv.close()
    assert any("before SASL authentication" in x for x in lines.lines), lines.lines


def test_sasl_plain_through_handshake_v0_and_a_bare_token(store):
    """SaslHandshake v0 (Kafka's legacy flow): the client then sends the PLAIN token bare,
    size-prefixed; Kafka answers an empty token, or closes the connection."""
    log, lines = _logger()
    srv = Served(store, token=TOKEN, log=log)
    try:
        c = Client(srv.port)
        r = c.call(17, 0, mechanism="PLAIN")
        assert struct.unpack_from(">h", r, 4)[0] == 0
        token = b"\0anyone\0" + TOKEN
        c.s.sendall(struct.pack(">i", len(token)) + token)
        assert c._read(4) == b"\0\0\0\0"
        assert _metadata_ok(c)
        c.close()
        c = Client(srv.port)
        c.call(17, 0, mechanism="PLAIN")
        c.s.sendall(struct.pack(">i", 5) + b"\0a\0bc")
        assert _closed(c.s)
        c = Client(srv.port)
        r = c.call(17, 0, mechanism="SCRAM-SHA-256")
        assert struct.unpack_from(">h", r, 4)[0] == 33  # UNSUPPORTED_SASL_MECHANISM
    finally:
        srv.close()
    assert any("authentication failed" in x for x in lines.lines), lines.lines
    assert srv.ep.errors[("SaslHandshake", "SASL_AUTHENTICATION_FAILED")] == 1


@pytest.mark.parametrize("version", [0, 1, 3])
def test_find_coordinator_by_key_type(store, version):
    srv = Served(store)
    try:
        c = Client(srv.port)
        r = c.call(10, version, key="g", key_type=0)
        p = 4 + (1 if version >= 3 else 0) + (4 if version >= 1 else 0)
        assert struct.unpack_from(">h", r, p)[0] == 0
        assert b"127.0.0.1" in r and struct.pack(">i", srv.port) in r
        if version >= 1:
            r = c.call(10, version, key="tx", key_type=1)
            assert struct.unpack_from(">h", r, p)[0] == 53  # TRANSACTIONAL_ID_AUTHORIZATION..
            assert b"read-only" in r
            r = c.call(10, version, key="x", key_type=7)
            assert struct.unpack_from(">h", r, p)[0] == 42  # INVALID_REQUEST
        c.close()
    finally:
        srv.close()


def test_a_wildcard_listener_advertises_the_address_a_client_reached():
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("::", "::ffff:10.1.2.3") == "10.1.2.3"
    assert advertised_host("::", "fe80::1%eth0") == "fe80::1"
    assert advertised_host("", "192.168.0.7") == "192.168.0.7"
    assert advertised_host("broker.example", "10.1.2.3") == "broker.example"
    assert advertised_host("127.0.0.1", "127.0.0.1") == "127.0.0.1"


def test_idle_connections_are_closed_and_others_served(store):
    log, lines = _logger()
    srv = Served(store, limits=Limits(idle_timeout_s=0.5), log=log)
    try:
        silent = socket.create_connection(("127.0.0.1", srv.port))
        spoke = Client(srv.port)
        assert _metadata_ok(spoke)
        busy = Client(srv.port)
        for _ in range(6):  # a client that keeps asking stays connected
            assert _metadata_ok(busy)
            time.sleep(0.2)
        assert _closed(silent, 10) and _closed(spoke.s, 10)
        assert _metadata_ok(busy)
        busy.close()
    finally:
        srv.close()
    assert srv.ep.closed.get("idle", 0) >= 2
    assert any("no request within 0.5s" in x for x in lines.lines), lines.lines
    assert any("idle for 0.5s" in x for x in lines.lines), lines.lines


def test_a_tls_listener_says_why_it_dropped_a_plaintext_client(store, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a certificate: {r.stderr.decode()[-200:]}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    log, lines = _logger()
    srv = Served(store, ssl_context=ctx, log=log)
    try:
        plain = Client(srv.port)  # an ApiVersions request spoken without TLS
        plain.s.sendall(struct.pack(">i", 10) + struct.pack(">hhih", 18, 3, 1, -1))
        assert _closed(plain.s)
        client_ctx = ssl.create_default_context(cafile=str(cert))
        with socket.create_connection(("127.0.0.1", srv.port)) as raw, \
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            req = struct.pack(">hhih", 18, 0, 5, -1)
            s.sendall(struct.pack(">i", len(req)) + req)
            size = struct.unpack(">i", s.recv(4))[0]
            assert size > 6 and struct.unpack(">ih", s.recv(6)) == (5, 0)
    finally:
        srv.close()
    assert any("TLS handshake failed" in x and "without TLS" in x for x in lines.lines), \
        lines.lines
    assert srv.ep.closed.get("tls") == 1


def test_localhost_port_0_listens_on_one_port(store):
    have = {fam for fam, *_ in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    srv = Served(store, host="localhost")
    try:
        ports = {s.getsockname()[1] for s in srv.ep._server.sockets}
        assert ports == {srv.port} and len(srv.ep._server.sockets) >= 1
        for fam in have:
            addr = "127.0.0.1" if fam == socket.AF_INET else "::1"
            try:
                s = socket.create_connection((addr, srv.port), timeout=5)
            except OSError:
                continue  # (an address family this host does not route)
            s.close()
    finally:
        srv.close()


def _decoded(key: int, version: int, raw: bytes):
    """A response frame (size prefix removed) decoded with kio."""
    from kio.serial import entity_reader

    from kcompact.replication.kafka_endpoint.wire import response_schema
    cls = response_schema(key, version)
    _header, n = entity_reader(cls.__header_schema__)(raw, 0)
    body, _ = entity_reader(cls)(raw, n)
    return body


@pytest.mark.parametrize("version", [1, 2, 5, 7])
def test_offset_fetch_of_an_unknown_group(store, version):
    """As Kafka: no error, offset -1 for each partition asked; all of a group's (topics null,
    v2+): none."""
    srv = Served(store)
    try:
        c = Client(srv.port)
        extra = {"require_stable": False} if version >= 7 else {}
        r = _decoded(9, version, c.call(9, version, group_id="nobody", topics=[
            {"name": TOPIC, "partition_indexes": [0, 3]}], **extra))
        (t,) = r.topics
        assert [(p.partition_index, p.committed_offset, int(p.error_code)) for p in
                t.partitions] == [(0, -1, 0), (3, -1, 0)]
        if version >= 2:
            assert int(r.error_code) == 0
            r = _decoded(9, version, c.call(9, version, group_id="nobody", topics=None, **extra))
            assert r.topics == ()
        c.close()
    finally:
        srv.close()


def test_every_api_and_version_served_answers_a_well_formed_response(store):
    """Each (API, version) ApiVersions advertises, asked with a minimal request (empty
    lists, empty names), gets a response kio decodes whole at that version; the connection
    stays open throughout."""
    from kcompact.replication.kafka_endpoint.apis import served
    srv = Served(store)
    try:
        c = Client(srv.port)
        for key, (lo, hi) in sorted(served().items()):
            if key == 36:  # (SaslAuthenticate before a handshake closes: tested above)
                continue
            for version in range(lo, hi + 1):
                body = {"acks": -1} if key == 0 else {}
                raw = c.call(key, version, **body)
                assert _decoded(key, version, raw) is not None, (key, version)
        assert _metadata_ok(c)
        c.close()
    finally:
        srv.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_waiting_fetch_whose_client_closed_stops_waiting(store, pipelined):
    """A Fetch at the high watermark waits up to its max_wait (30 s here) for new records;
    when its client closes the connection meanwhile, it stops waiting (and polling the store)
    at its next look: the endpoint drops the connection long before the wait would end.
    ``pipelined``: the client sent another request behind the Fetch before it closed (as
    librdkafka's consumer does when it closes: a Metadata request), which the endpoint has not
    read yet while the Fetch waits."""
    srv = Served(store)
    try:
        c = Client(srv.port)
        err, hwm = c.fetch(12, 1, 1 << 20)[:2]  # (the record is at offset 1)
        assert err == 0 and hwm > 0
        c.send(1, 12, replica_id=-1, max_wait=30_000, min_bytes=1, max_bytes=1 << 20,
               isolation_level=1, session_id=0, session_epoch=-1, topics=[{
                   "topic": TOPIC, "partitions": [{
                       "partition": 0, "fetch_offset": hwm, "partition_max_bytes": 1 << 20,
                       "log_start_offset": -1, "current_leader_epoch": -1,
                       "last_fetched_epoch": -1}]}], forgotten_topics_data=[], rack_id="")
        deadline = time.monotonic() + 20
        while srv.ep.requests.get("Fetch", 0) < 2:  # it is read and waits at the edge
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(srv.ep.open) == 1
        if pipelined:  # an ApiVersions request behind the waiting Fetch
            c.send(18, 3, client_software_name="model", client_software_version="1")
            time.sleep(0.2)
            assert srv.ep.requests.get("ApiVersions", 0) == 0  # not read: the Fetch waits
        c.close()
        deadline = time.monotonic() + 15  # half its 30 s wait
        while srv.ep.open:
            assert time.monotonic() < deadline, "the fetch kept waiting for a closed client"
            time.sleep(0.02)
    finally:
        srv.close()
