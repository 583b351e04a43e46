"""Which codec the source's batches have: a small Kafka-protocol client that reads a batch header.

No Kafka client tells a consumer the codec of the batches it decompressed (librdkafka,
confluent-kafka and the Java consumer hide a batch's attributes), so the mirror asks the brokers
itself: ApiVersions, Metadata (each partition's leader), then one Fetch (v4 to v12, what the
broker serves, ``read_uncommitted``, a few KB a partition) at the position being mirrored, and
the low 3 bits of the first data batch's attributes (control batches, transaction markers, are
stepped over; a message set of magic 0/1 keeps its codec in the same bits). A partition whose
position returns no data batch (the end of the log, markers only) is asked again at its last
offset, then a little before it. Requests and responses are kio's entities (Kafka's JSON message
schemas, as the Kafka endpoint uses them: replication/kafka_endpoint/wire.py).

Connection settings are the mirror's own librdkafka keys: ``bootstrap.servers``,
``security.protocol`` PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL; ``ssl.ca.location`` /
``ssl.ca.pem``, ``ssl.certificate.location`` + ``ssl.key.location`` (+ ``ssl.key.password``),
``ssl.endpoint.identification.algorithm`` (``https``, librdkafka's default, or ``none``),
``enable.ssl.certificate.verification``; ``sasl.mechanisms`` (or ``sasl.mechanism``) PLAIN,
SCRAM-SHA-256, SCRAM-SHA-512 with ``sasl.username`` and ``sasl.password``. Anything else
(GSSAPI, OAUTHBEARER, a PKCS#12 keystore) is a :class:`CodecProbeError` naming it, as is every
failure to connect or to read an answer: the caller falls back (connectors/plugins/
codec_watch.py) and never loses a record for it, the probe reading nothing it stores.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import os
import socket
import ssl
import struct
from typing import Any, Mapping

from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer

from ..errors import ConnectorsError

#: API keys and the versions this client speaks (the highest a broker serves is used)
API_VERSIONS, METADATA, FETCH, LIST_OFFSETS = 18, 3, 1, 2
SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
SPOKEN = {METADATA: (1, 12), FETCH: (4, 12), LIST_OFFSETS: (1, 6),
          SASL_HANDSHAKE: (1, 1), SASL_AUTHENTICATE: (0, 2)}
#: bytes asked for a partition (Kafka answers at least the first batch whole: KIP-74)
PROBE_BYTES = 16 << 10
#: how long a Fetch waits for a partition with nothing at its position (ms)
FETCH_WAIT_MS = 100
#: the largest answer read (a broker saying more is not speaking Kafka to us)
MAX_RESPONSE = 64 << 20
#: record batch and message set: magic's byte, and where each keeps its attributes
_MAGIC_AT, _ATTR_V2, _ATTR_V01 = 16, 21, 17
_CONTROL = 0x20
CLIENT_ID = "kcompact-codec-probe"
_SIZE = struct.Struct(">i")


class CodecProbeError(ConnectorsError):
    """The source's batches could not be read (the reason, one line)."""


def probe_codecs(conf: Mapping[str, Any], topic: str, positions: Mapping[int, int], *,
                 timeout: float = 10.0) -> dict[int, int | None]:
    """The codec id (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd) of the source's batches of each
    partition of ``topic`` in ``positions`` (partition -> offset being mirrored; < 0: the log's
    end), None for a partition with no data batch to read (an empty one). Raises
    CodecProbeError (module docstring)."""
    servers = _bootstrap(conf)
    last_error = None
    for host, port in servers:
        try:
            conn = _Connection(host, port, conf, timeout)
        except CodecProbeError as e:
            last_error = e
            continue
        try:
            brokers, leaders = conn.metadata(topic)
        finally:
            conn.close()
        break
    else:
        raise last_error or CodecProbeError("bootstrap.servers names no broker")
    by_leader: dict[int, list[int]] = {}
    for p in positions:
        if p not in leaders:
            raise CodecProbeError(f"topic {topic} has no partition {p} in the broker's metadata")
        by_leader.setdefault(leaders[p], []).append(p)
    out: dict[int, int | None] = {}
    for node, parts in sorted(by_leader.items()):
        if node not in brokers:
            raise CodecProbeError(f"topic {topic}: the leader of partition {parts[0]} (broker "
                                  f"{node}) is not in the broker's metadata")
        conn = _Connection(*brokers[node], conf, timeout)
        try:
            out.update(conn.codecs(topic, {p: positions[p] for p in parts}))
        finally:
            conn.close()
    return out


def batch_codec(records: bytes | memoryview | None) -> tuple[int | None, int | None]:
    """(codec of the first data batch, the offset after the last batch header seen) of a
    Fetch response's records bytes; (None, offset) when they hold only control batches,
    (None, None) when they hold no batch header."""
    if not records:
        return None, None
    b = memoryview(records)
    pos, after = 0, None
    while pos + _ATTR_V2 + 2 <= len(b):
        base, size = struct.unpack_from(">qi", b, pos)
        magic = b[pos + _MAGIC_AT]
        if magic == 2:
            attrs = struct.unpack_from(">h", b, pos + _ATTR_V2)[0]
            if not attrs & _CONTROL:
                return attrs & 7, None
            if pos + 61 <= len(b):
                after = base + struct.unpack_from(">i", b, pos + 23)[0] + 1
        elif magic in (0, 1):
            return b[pos + _ATTR_V01] & 7, None
        else:
            raise CodecProbeError(f"the broker answered a batch of magic {magic} (not Kafka's "
                                  "0, 1 or 2)")
        if size < 0:
            raise CodecProbeError(f"the broker answered a batch of size {size}")
        pos += 12 + size
    return None, after


# -- settings ---------------------------------------------------------------------------------


def _bootstrap(conf: Mapping[str, Any]) -> list[tuple[str, int]]:
    raw = str(conf.get("bootstrap.servers") or conf.get("metadata.broker.list") or "")
    out = []
    for item in filter(None, (s.strip() for s in raw.split(","))):
        item = item.split("://", 1)[-1]
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise CodecProbeError(f"bootstrap.servers: {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise CodecProbeError("bootstrap.servers is empty")
    return out


def _protocol(conf: Mapping[str, Any]) -> tuple[bool, bool]:
    """(TLS, SASL) of ``security.protocol``."""
    proto = str(conf.get("security.protocol") or "plaintext").lower()
    spoken = {"plaintext": (False, False), "ssl": (True, False),
              "sasl_plaintext": (False, True), "sasl_ssl": (True, True)}
    if proto not in spoken:
        raise CodecProbeError(f"security.protocol={proto} is not one this probe speaks")
    return spoken[proto]


def _tls_context(conf: Mapping[str, Any]) -> ssl.SSLContext:
    for key in ("ssl.keystore.location", "ssl.engine.location", "ssl.certificate.pem",
                "ssl.key.pem"):
        if conf.get(key):
            raise CodecProbeError(f"{key} is not a setting this probe reads")
    ca = conf.get("ssl.ca.location") or None
    ctx = ssl.create_default_context(cafile=None if ca == "probe" else ca,
                                     cadata=conf.get("ssl.ca.pem") or None)
    if str(conf.get("ssl.endpoint.identification.algorithm", "https")).lower() == "none":
        ctx.check_hostname = False
    if str(conf.get("enable.ssl.certificate.verification", "true")).lower() == "false":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert = conf.get("ssl.certificate.location")
    if cert:
        ctx.load_cert_chain(cert, conf.get("ssl.key.location") or None,
                            conf.get("ssl.key.password") or None)
    return ctx


# -- a connection -----------------------------------------------------------------------------


class _Connection:
    """One broker connection: TLS and SASL as ``conf`` says, then requests one at a time."""

    def __init__(self, host: str, port: int, conf: Mapping[str, Any], timeout: float):
        self.where = f"{host}:{port}"
        self.corr = 0
        self.versions: dict[int, tuple[int, int]] = {}
        tls, sasl = _protocol(conf)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise CodecProbeError(f"cannot connect to {self.where} ({e.strerror or e})") from None
        try:
            if tls:
                sock = _tls_context(conf).wrap_socket(sock, server_hostname=host)
        except CodecProbeError:
            sock.close()
            raise
        except (OSError, ssl.SSLError, ValueError) as e:
            sock.close()
            raise CodecProbeError(f"TLS with {self.where} failed ({e})") from None
        self.sock = sock
        try:
            api = self.request(API_VERSIONS, 0, {})
            if int(api.error_code):
                raise CodecProbeError(f"{self.where} refused ApiVersions (error "
                                      f"{int(api.error_code)})")
            self.versions = {int(k.api_key): (int(k.min_version), int(k.max_version))
                             for k in api.api_keys}
            if sasl:
                self._authenticate(conf)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def version(self, key: int) -> int:
        lo, hi = SPOKEN[key]
        have = self.versions.get(key)
        if have is None or have[1] < lo or have[0] > hi:
            raise CodecProbeError(f"{self.where} serves no version of API {key} this probe "
                                  f"speaks ({lo}-{hi}; it serves {have or 'none'})")
        return min(hi, have[1])

    def request(self, key: int, version: int, values: dict) -> Any:
        from kcompact.replication.kafka_endpoint.wire import build
        self.corr += 1
        req = load_request_schema(key, version)
        out = io.BytesIO()
        out.write(b"\0\0\0\0")
        head_cls = req.__header_schema__
        entity_writer(head_cls)(out, build(head_cls, request_api_key=key,
                                           request_api_version=version,
                                           correlation_id=self.corr, client_id=CLIENT_ID))
        entity_writer(req)(out, build(req, **values))
        frame = bytearray(out.getbuffer())
        _SIZE.pack_into(frame, 0, len(frame) - 4)
        try:
            self.sock.sendall(frame)
            size = _SIZE.unpack(self._read(4))[0]
            if not 0 < size <= MAX_RESPONSE:
                raise CodecProbeError(f"{self.where} answered a frame of {size} bytes: not a "
                                      "Kafka broker's answer")
            data = self._read(size)
        except (OSError, ssl.SSLError) as e:
            raise CodecProbeError(f"{self.where}: {type(e).__name__}: {e}") from None
        resp = load_response_schema(key, version)
        try:
            head, n = entity_reader(resp.__header_schema__)(data, 0)
            if int(head.correlation_id) != self.corr:
                raise CodecProbeError(f"{self.where} answered correlation id "
                                      f"{int(head.correlation_id)}, not {self.corr}")
            body, _ = entity_reader(resp)(data, n)
        except CodecProbeError:
            raise
        except Exception as e:  # noqa: BLE001 - kio raises several kinds on garbage
            raise CodecProbeError(f"{self.where} answered API {key} v{version} with bytes that "
                                  f"are not its response ({type(e).__name__})") from None
        return body

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise CodecProbeError(f"{self.where} closed the connection")
            buf += chunk
        return bytes(buf)

    # -- SASL ---------------------------------------------------------------------------------

    def _authenticate(self, conf: Mapping[str, Any]) -> None:
        mech = str(conf.get("sasl.mechanisms") or conf.get("sasl.mechanism") or "GSSAPI").upper()
        if mech not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            raise CodecProbeError(f"sasl.mechanisms={mech} is not one this probe speaks "
                                  "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512)")
        user = str(conf.get("sasl.username") or "")
        password = str(conf.get("sasl.password") or "")
        hs = self.request(SASL_HANDSHAKE, self.version(SASL_HANDSHAKE), {"mechanism": mech})
        if int(hs.error_code):
            raise CodecProbeError(f"{self.where} refused SASL mechanism {mech} (it enables "
                                  f"{', '.join(hs.mechanisms) or 'none'})")
        if mech == "PLAIN":
            self._auth(b"\0" + user.encode() + b"\0" + password.encode())
            return
        h = "sha256" if mech == "SCRAM-SHA-256" else "sha512"
        nonce = base64.b64encode(os.urandom(18)).decode()
        bare = f"n={_saslname(user)},r={nonce}"
        first = self._auth(f"n,,{bare}".encode()).decode()
        fields = dict(kv.split("=", 1) for kv in first.split(",") if "=" in kv)
        try:
            rnonce, salt, it = fields["r"], base64.b64decode(fields["s"]), int(fields["i"])
        except (KeyError, ValueError) as e:
            raise CodecProbeError(f"{self.where}: a SCRAM server-first message without {e}") \
                from None
        if not rnonce.startswith(nonce):
            raise CodecProbeError(f"{self.where}: the SCRAM server nonce does not extend ours")
        salted = hashlib.pbkdf2_hmac(h, password.encode(), salt, it)
        client_key = hmac.new(salted, b"Client Key", h).digest()
        final_bare = f"c=biws,r={rnonce}"
        auth = f"{bare},{first},{final_bare}".encode()
        sig = hmac.new(hashlib.new(h, client_key).digest(), auth, h).digest()
        proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, sig))).decode()
        final = self._auth(f"{final_bare},p={proof}".encode()).decode()
        server_sig = hmac.new(hmac.new(salted, b"Server Key", h).digest(), auth, h).digest()
        if final != "v=" + base64.b64encode(server_sig).decode():
            raise CodecProbeError(f"{self.where}: the SCRAM server signature does not verify")

    def _auth(self, token: bytes) -> bytes:
        r = self.request(SASL_AUTHENTICATE, self.version(SASL_AUTHENTICATE),
                         {"auth_bytes": token})
        if int(r.error_code):
            raise CodecProbeError(f"{self.where} refused the SASL credentials "
                                  f"({r.error_message or 'error ' + str(int(r.error_code))})")
        return bytes(r.auth_bytes)

    # -- what the probe asks --------------------------------------------------------------------

    def metadata(self, topic: str) -> tuple[dict[int, tuple[str, int]], dict[int, int]]:
        """({broker id: (host, port)}, {partition: leader id}) of ``topic``."""
        md = self.request(METADATA, self.version(METADATA),
                          {"topics": [{"name": topic}], "allow_auto_topic_creation": False})
        brokers = {int(b.node_id): (b.host, int(b.port)) for b in md.brokers}
        t = next((t for t in md.topics if t.name == topic), None)
        if t is None or int(t.error_code):
            raise CodecProbeError(f"the broker's metadata has no topic {topic}"
                                  + (f" (error {int(t.error_code)})" if t is not None else ""))
        return brokers, {int(p.partition_index): int(p.leader_id) for p in t.partitions
                         if int(p.error_code) == 0 and int(p.leader_id) >= 0}

    def fetch(self, topic: str, offsets: Mapping[int, int]) -> dict[int, Any]:
        v = self.version(FETCH)
        body = self.request(FETCH, v, {
            # (Tansu answers nothing to min_bytes 0; Kafka answers at once once it has a byte)
            "replica_id": -1, "max_wait": FETCH_WAIT_MS, "min_bytes": 1,
            "max_bytes": PROBE_BYTES * max(1, len(offsets)), "isolation_level": 0,
            "session_id": 0, "session_epoch": -1,
            "topics": [{"topic": topic, "partitions": [
                {"partition": p, "fetch_offset": o, "partition_max_bytes": PROBE_BYTES,
                 "current_leader_epoch": -1, "last_fetched_epoch": -1, "log_start_offset": -1}
                for p, o in offsets.items()]}]})
        if int(getattr(body, "error_code", 0) or 0):
            raise CodecProbeError(f"{self.where} refused Fetch (error {int(body.error_code)})")
        return {int(p.partition_index): p for t in body.responses for p in t.partitions}

    def latest(self, topic: str, partitions) -> dict[int, int]:
        """Each partition's log end offset (ListOffsets, latest)."""
        body = self.request(LIST_OFFSETS, self.version(LIST_OFFSETS), {
            "replica_id": -1, "isolation_level": 0,
            "topics": [{"name": topic, "partitions": [
                {"partition_index": p, "timestamp": -1, "current_leader_epoch": -1}
                for p in partitions]}]})
        return {int(p.partition_index): int(p.offset) for t in body.topics for p in t.partitions
                if int(p.error_code) == 0}

    def codecs(self, topic: str, positions: Mapping[int, int]) -> dict[int, int | None]:
        """The codec of each partition's first data batch at its position; where there is
        none (the log's end, markers only, out of range), of the batches just before the end
        (1, 200, then 5,000 offsets back); None when the partition shows no data batch."""
        out: dict[int, int | None] = {}
        at = {p: o for p, o in positions.items() if o >= 0}
        need_end = [p for p, o in positions.items() if o < 0]
        back: dict[int, int] = {}
        for _ in range(8):
            if need_end:
                ends = self.latest(topic, need_end)
                for p in need_end:
                    end, k = ends.get(p, 0), back.get(p, 0)
                    if end <= 0 or k >= len(_BACK):
                        out[p] = None
                    else:
                        at[p], back[p] = max(0, end - _BACK[k]), k + 1
                need_end = []
            if not at:
                break
            got = self.fetch(topic, at)
            nxt = {}
            for p, o in at.items():
                part = got.get(p)
                if part is None:  # (Tansu leaves out a partition with nothing to answer)
                    need_end.append(p)
                    continue
                err = int(part.error_code)
                if err not in (0, 1):  # (1: OFFSET_OUT_OF_RANGE, past the log's ends)
                    raise CodecProbeError(f"{self.where} refused Fetch of {topic}-{p} (error "
                                          f"{err})")
                codec, after = batch_codec(part.records) if err == 0 else (None, None)
                if codec is not None:
                    out[p] = codec
                elif after is not None and after > o:  # markers only: on past them
                    nxt[p] = after
                else:
                    need_end.append(p)
            at = nxt
        for p in positions:
            out.setdefault(p, None)
        return out


#: how far before a partition's end the probe looks when its position shows no data batch
_BACK = (1, 200, 5000)


def _saslname(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


__all__ = ["CodecProbeError", "PROBE_BYTES", "batch_codec", "probe_codecs"]
