"""The source-codec probe (connectors/framework/codec_probe.py, issue 52), in process: against the
Kafka endpoint (a real Kafka-protocol server serving stored batches with their codec) over
PLAINTEXT, TLS, SASL PLAIN and SCRAM-SHA-256/512; its failures (nothing listening, a server
answering garbage or closing, an authentication it does not speak, wrong credentials) are each
one CodecProbeError line; and batch_codec reads each codec, steps over control batches and
reads a magic-1 message set."""

from __future__ import annotations

import os
import socket
import ssl
import struct
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_kafka_endpoint_model import Served  # noqa: E402

from kcompact.connectors.framework.codec_probe import (CodecProbeError, batch_codec,  # noqa: E402
                                                       probe_codecs)
from kcompact.replication.kafka_endpoint.sasl import make_credential, parse_users  # noqa: E402
from kcompact.reput import Store  # noqa: E402
from kcompact.reput.batch import (BATCH_HEADER, HEADER_SIZE, LOG_OVERHEAD,  # noqa: E402
                                  control_batch)
from kcompact.reput.codecs import CODEC_GZIP, CODEC_LZ4, CODEC_ZSTD  # noqa: E402
from kcompact.reput.record import Record, RecordBatch  # noqa: E402

TOPIC = "orders"
TOKEN = b"probe-token"


def _store(tmp_path, codec: str) -> str:
    """A store whose topic's sealed batches are ``codec`` (compression.type named), one
    partition sealed and one empty."""
    url = str(tmp_path / f"store-{codec}")
    st = Store.open(url, writer="w", create=True)
    st.set_topic_config(TOPIC, {"segment.bytes": 1 << 14, "compression.type": codec})
    st.record_partitions(TOPIC, [0, 1])
    recs = [Record(TOPIC, 0, i, 1_700_000_000_000 + i, b"k%d" % i, b"paid order %d " % i * 8, ())
            for i in range(600)]
    for i in range(0, len(recs), 50):
        st.append(RecordBatch.from_records(TOPIC, recs[i:i + 50]))
    st.flush()
    st.roll()
    st.close()
    with Store.open(url, writer="w") as st:
        st.drain_seals()
    return url


@pytest.fixture(scope="module")
def zstd_store(tmp_path_factory) -> str:
    return _store(tmp_path_factory.mktemp("probe"), "zstd")


def test_reads_the_served_codec_of_each_partition(tmp_path):
    for codec, want in (("gzip", CODEC_GZIP), ("lz4", CODEC_LZ4)):
        srv = Served(_store(tmp_path, codec))
        try:
            conf = {"bootstrap.servers": f"127.0.0.1:{srv.port}"}
            # at the first offset, past the end (the last batch), and an empty partition
            assert probe_codecs(conf, TOPIC, {0: 0, 1: 0}) == {0: want, 1: None}
            assert probe_codecs(conf, TOPIC, {0: 10_000}) == {0: want}
        finally:
            srv.close()


def test_sasl_plain_and_scram(zstd_store):
    users = parse_users("\n".join(
        f"carol {make_credential(m, b'pw', iterations=4096)}"
        for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")), "test")
    srv = Served(zstd_store, token=TOKEN, users=users)
    try:
        base = {"bootstrap.servers": f"127.0.0.1:{srv.port}", "security.protocol": "SASL_PLAINTEXT"}
        assert probe_codecs({**base, "sasl.mechanisms": "PLAIN", "sasl.username": "x",
                             "sasl.password": TOKEN.decode()}, TOPIC, {0: 0}) == {0: CODEC_ZSTD}
        for mech in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            conf = {**base, "sasl.mechanism": mech, "sasl.username": "carol",
                    "sasl.password": "pw"}
            assert probe_codecs(conf, TOPIC, {0: 0}) == {0: CODEC_ZSTD}
        with pytest.raises(CodecProbeError, match="refused the SASL credentials"):
            probe_codecs({**base, "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "carol",
                          "sasl.password": "wrong"}, TOPIC, {0: 0})
        with pytest.raises(CodecProbeError, match="sasl.mechanisms=OAUTHBEARER is not one"):
            probe_codecs({**base, "sasl.mechanisms": "OAUTHBEARER"}, TOPIC, {0: 0})
    finally:
        srv.close()


def test_tls(zstd_store, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a certificate: {r.stderr.decode()[-200:]}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    srv = Served(zstd_store, ssl_context=ctx)
    try:
        conf = {"bootstrap.servers": f"127.0.0.1:{srv.port}", "security.protocol": "SSL"}
        assert probe_codecs({**conf, "ssl.ca.location": str(cert)}, TOPIC, {0: 0}) == \
            {0: CODEC_ZSTD}
        with pytest.raises(CodecProbeError, match="TLS with 127.0.0.1:.* failed"):
            probe_codecs(conf, TOPIC, {0: 0})  # (a certificate no CA of the system signed)
    finally:
        srv.close()


def test_nothing_listening(closed_port):
    with pytest.raises(CodecProbeError, match=f"cannot connect to 127.0.0.1:{closed_port}"):
        probe_codecs({"bootstrap.servers": f"127.0.0.1:{closed_port}"}, TOPIC, {0: 0},
                     timeout=5)


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Liar:
    """A TCP server answering every request with ``answer(request frame)``."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                try:
                    size = struct.unpack(">i", c.recv(4))[0]
                    frame = b""
                    while len(frame) < size:
                        frame += c.recv(size - len(frame))
                    c.sendall(self.answer(frame))
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("answer, says", [
    (lambda f: b"HTTP/1.1 400 Bad Request\r\n\r\n", "not a Kafka broker's answer"),
    (lambda f: struct.pack(">i", 40) + f[4:8] + struct.pack(">hi", 0, 1 << 30) + b"\xff" * 30,
     "not its response"),
    (lambda f: struct.pack(">i", 10) + struct.pack(">ihi", 99, 0, 0), "correlation id 99"),
    (lambda f: b"", "closed the connection"),
])
def test_garbage_answers(answer, says):
    srv = _Liar(answer)
    try:
        with pytest.raises(CodecProbeError, match=says) as e:
            probe_codecs({"bootstrap.servers": f"127.0.0.1:{srv.port}"}, TOPIC, {0: 0},
                         timeout=5)
        assert "\n" not in str(e.value)
    finally:
        srv.close()


def test_settings_it_does_not_speak():
    for conf, says in (({"bootstrap.servers": ""}, "bootstrap.servers is empty"),
                       ({"bootstrap.servers": "nohost"}, "is not host:port"),
                       ({"bootstrap.servers": "127.0.0.1:1", "security.protocol": "kerberos"},
                        "security.protocol=kerberos")):
        with pytest.raises(CodecProbeError, match=says):
            probe_codecs(conf, TOPIC, {0: 0})


def _batch(codec: int, base: int = 0) -> bytes:
    """A RecordBatch v2 header of three records and 10 bytes of (unread) records."""
    out = bytearray(HEADER_SIZE + 10)
    BATCH_HEADER.pack_into(out, 0, base, HEADER_SIZE - LOG_OVERHEAD + 10, -1, 2, 0, codec, 2,
                           0, 0, -1, -1, -1, 3)
    return bytes(out)


def test_batch_codec():
    assert batch_codec(None) == (None, None)
    for codec in range(5):
        assert batch_codec(_batch(codec))[0] == codec
        assert batch_codec(_batch(codec)[:30])[0] == codec  # (a header is enough)
    marker = control_batch(7)
    assert batch_codec(marker + _batch(CODEC_LZ4, 8)) == (CODEC_LZ4, None)
    assert batch_codec(marker) == (None, 8)  # only markers: go on after them
    v1 = struct.pack(">qiIbbq", 5, 22, 0, 1, CODEC_GZIP, 0) + struct.pack(">ii", -1, -1)
    assert batch_codec(v1)[0] == CODEC_GZIP
    with pytest.raises(CodecProbeError, match="magic 7"):
        batch_codec(b"\0" * 16 + b"\x07" + b"\0" * 60)
