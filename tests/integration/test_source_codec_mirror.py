"""The source's codec end to end (issue 52): a topic produced with each codec (none, gzip, snappy,
lz4, zstd), mirrored into a new store with the defaults (``compression.type=producer``), keeps
that codec in every sealed batch (the store's .log files read batch by batch); a store topic
whose compression.type names a codec is recompressed to it; the records are the source's.
On Tansu (which keeps a produced batch as it came, codec included) and Apache Kafka 3.9.1. A
probe that cannot run (nothing listening, garbage answered) costs one line and no record; a
mirror over SASL PLAIN reads the codec with its own settings, and the probe speaks TLS, on a
Kafka 3.9.1 with those listeners. About 30 s in all (two Kafka starts)."""

from __future__ import annotations

import io
import os
import struct

import pytest
from confluent_kafka import Producer

from kcompact.compaction import CompactionOptions, compact_store
from kcompact.connectors.apps.mirror import mirror_local
from kcompact.reput import Store
from kcompact.reput.codecs import CODEC_BY_NAME
from topics import read_store  # noqa: E402

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
N = 2000


def _records(codec: str) -> list[tuple[bytes, bytes]]:
    return [(b"k%d" % (i % 700), b'{"order": %d, "codec": "%s", "status": "paid"}' % (
        i, codec.encode())) for i in range(N)]


def _produce(bootstrap: str, topic: str, codec: str) -> None:
    errors: list = []
    p = Producer({"bootstrap.servers": bootstrap, "compression.type": codec, "linger.ms": 20,
                  "batch.size": 16384})
    for k, v in _records(codec):
        p.produce(topic, key=k, value=v, partition=0,
                  on_delivery=lambda err, _m: err is not None and errors.append(err))
    assert p.flush(60) == 0 and not errors, errors[:3]


def sealed_codecs(store: str, topic: str) -> tuple[set[int], int]:
    """(codecs of every batch of the partition's format-2 segments, how many segments)."""
    codecs, segments = set(), 0
    with Store.open(store) as st:
        pl = st.partition(topic, 0)
        for seg in pl.segments:
            if seg.format != 2 or not seg.log_size:
                continue
            segments += 1
            data = seg.fs.read(seg.log_path)
            pos = 0
            while pos < len(data):
                size, = struct.unpack_from(">i", data, pos + 8)
                attrs, = struct.unpack_from(">h", data, pos + 21)
                codecs.add(attrs & 7)
                pos += 12 + size
    return codecs, segments


def test_each_source_codec_is_kept_in_the_sealed_batches(any_broker, make_topic, tmp_path,
                                                         capfd):
    topics = {codec: make_topic(1) for codec in CODECS}
    recompressed = make_topic(1)  # zstd at the source, lz4 named on the store's topic
    for codec, t in topics.items():
        _produce(any_broker.bootstrap, t, codec)
    _produce(any_broker.bootstrap, recompressed, "zstd")
    store = str(tmp_path / "store")
    small = {"segment.bytes": 16384, "min.compaction.lag.ms": 0}
    Store.create(store, topics={**{t: small for t in topics.values()},
                                recompressed: {**small, "compression.type": "lz4"}}).close()
    res = mirror_local(any_broker.bootstrap, [*topics.values(), recompressed], store,
                       out=io.StringIO(), handle_signals=False)
    assert res.records == N * (len(CODECS) + 1)
    with Store.open(store, writer="t") as st:
        compact_store(st, force=True, options=CompactionOptions())  # seals what stayed format 1
    err = capfd.readouterr().err
    for codec, t in topics.items():
        name = "uncompressed" if codec == "none" else codec
        assert f"topic {t}: the source's batches are {name} (partition 0)" in err, err
        got, segments = sealed_codecs(store, t)
        assert segments > 0
        assert got == {CODEC_BY_NAME[name]}, (codec, got)
        stored = read_store(store, t)[0]
        last = {}
        for i, (k, v) in enumerate(_records(codec)):
            last[k] = (i, v)
        assert {r[2]: (r[0], r[3]) for r in stored} == last  # compacted: each key's latest
    got, _ = sealed_codecs(store, recompressed)
    assert got == {CODEC_BY_NAME["lz4"]}
    assert f"topic {recompressed}: the source's" not in err  # a named codec: never probed
    with Store.open(store) as st:  # what the probe read is in store.json
        assert {st.source_codec(t, 0) for t in topics.values()} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("failure", ["refused", "garbage"])
def test_a_probe_that_fails_loses_nothing(failure, kafka_bootstrap, make_topic, tmp_path, capfd,
                                          monkeypatch):
    """The probe pointed at a port where nothing listens, or at a server answering garbage (the
    mirror's own connection is the broker's): one line, the records stored uncompressed."""
    import socket
    import threading

    from kcompact.connectors.framework import codec_probe
    t = make_topic(1)
    _produce(kafka_bootstrap, t, "zstd")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    if failure == "garbage":
        srv.listen(8)

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                with c:
                    c.recv(1 << 16)
                    c.sendall(b"\x00\x00\x00\x0c" + b"\xff" * 12)
        threading.Thread(target=serve, daemon=True).start()
    real = codec_probe.probe_codecs

    def elsewhere(conf, topic, offsets, **kw):
        return real({**conf, "bootstrap.servers": f"127.0.0.1:{port}"}, topic, offsets, **kw)
    monkeypatch.setattr("kcompact.connectors.plugins.codec_watch.probe_codecs", elsewhere)
    store = str(tmp_path / "store")
    Store.create(store, topics={t: {"segment.bytes": 16384, "min.compaction.lag.ms": 0}}).close()
    try:
        res = mirror_local(kafka_bootstrap, t, store, out=io.StringIO(), handle_signals=False)
    finally:
        srv.close()
    assert res.records == N
    with Store.open(store, writer="t") as st:
        compact_store(st, force=True, options=CompactionOptions())
        assert st.source_codec(t, 0) is None
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "source's batch codec" in x]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mirror: warning: topic {t}: cannot read the source's batch codec "
                               f"(127.0.0.1:{port}" if failure == "garbage" else
                               f"mirror: warning: topic {t}: cannot read the source's batch codec "
                               f"(cannot connect to 127.0.0.1:{port}")
    assert "stored uncompressed" in lines[0]
    assert sealed_codecs(store, t)[0] == {0}
    last = {}
    for i, (k, v) in enumerate(_records("zstd")):
        last[k] = (i, v)
    assert {r[2]: (r[0], r[3]) for r in read_store(store, t)[0]} == last


def test_the_mirror_reads_the_codec_over_sasl_and_tls(tmp_path, capfd):
    """A real Kafka 3.9.1 with a SASL_PLAINTEXT (PLAIN) and an SSL listener beside its
    PLAINTEXT one: a mirror over SASL seals a zstd-produced topic as zstd (its probe speaks
    the mirror's settings), the probe reads it over TLS with the CA given, and wrong
    credentials are one line naming Kafka's refusal."""
    import socket
    import subprocess
    import time

    from brokers import apache_kafka_unavailable
    from confluent_kafka.admin import AdminClient, NewTopic

    from kcompact.connectors.devtools import apache_kafka as ak
    from kcompact.connectors.framework.codec_probe import CodecProbeError, probe_codecs
    why = apache_kafka_unavailable()
    if why is not None:
        pytest.skip(why)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"openssl cannot make a certificate: {r.stderr.decode()[-200:]}")
    keystore = tmp_path / "keystore.pem"
    keystore.write_bytes(key.read_bytes() + cert.read_bytes())

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    sasl_port, ssl_port = free(), free()

    class SecureKafka(ak.ApacheKafkaBroker):
        def properties(self, port, controller_port, data):
            p = super().properties(port, controller_port, data)
            more = f"SASL_PLAINTEXT://{ak.HOST}:{sasl_port},SSL://{ak.HOST}:{ssl_port}"
            p["listeners"] += "," + more
            p["advertised.listeners"] += "," + more
            p["listener.security.protocol.map"] += ",SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL"
            p["sasl.enabled.mechanisms"] = "PLAIN"
            p["listener.name.sasl_plaintext.plain.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.plain.PlainLoginModule required "
                'username="admin" password="admin-pw" user_alice="alice-pw";')
            p["listener.name.ssl.ssl.keystore.type"] = "PEM"
            p["listener.name.ssl.ssl.keystore.location"] = str(keystore)
            return p

    with SecureKafka(cache=ak.cache_dir()) as broker:
        bs = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bs})
        admin.create_topics([NewTopic("z", 1, 1)])["z"].result()
        deadline = time.monotonic() + 30
        while True:  # (the topic's leader is known a moment after it is created)
            try:
                _produce(bs, "z", "zstd")
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
        sasl = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanisms": "PLAIN",
                "sasl.username": "alice", "sasl.password": "alice-pw"}
        del admin
        store = str(tmp_path / "store")
        Store.create(store, topics={"z": {"segment.bytes": 16384}}).close()
        res = mirror_local(f"127.0.0.1:{sasl_port}", "z", store, kafka_config=sasl,
                           out=io.StringIO(), handle_signals=False)
        assert res.records == N
        with Store.open(store, writer="t") as st:
            compact_store(st, force=True, options=CompactionOptions())
        assert sealed_codecs(store, "z")[0] == {CODEC_BY_NAME["zstd"]}
        assert "topic z: the source's batches are zstd (partition 0)" in capfd.readouterr().err
        tls = {"bootstrap.servers": f"127.0.0.1:{ssl_port}", "security.protocol": "SSL",
               "ssl.ca.location": str(cert)}
        assert probe_codecs(tls, "z", {0: 0}) == {0: CODEC_BY_NAME["zstd"]}
        with pytest.raises(CodecProbeError, match="refused the SASL credentials "
                           r"\(Authentication failed: Invalid username or password\)"):
            probe_codecs({**sasl, "bootstrap.servers": f"127.0.0.1:{sasl_port}",
                          "sasl.password": "wrong"}, "z", {0: 0})
