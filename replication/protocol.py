"""The replication wire protocol, versions 1 and 2: paths, headers, limits, and the binary bodies.

Spec: docs/formats/replication-protocol.md. Everything here is a pure function or a constant, so
the server (replication/server.py), the replica (replication/replica.py) and the tests share one
definition of what a valid request and a valid response are.

Bodies:

* ``records``: records back to back, byte for byte as the master stores them (record.md).
* ``live``: a pyroaring ``BitMap64`` in the portable serialization: the live offsets.
* ``digests``: frames of fixed 32-byte entries (``DIGEST_DTYPE``) and a key block, ending with an
  empty frame; one entry per live record: offset, SipHash-2-4-128 of the record under a salt the
  client chose, and where its key is in the frame's key block. A failure after the status line
  was sent ends the body with an *error frame* instead (``ERROR_MAGIC``, the JSON error document
  of a non-200 answer), which a reader of protocol 1 without it refuses by its magic.
* ``segments`` (version 2): a JSON list of a partition's segments; a sealed format-2 segment's
  ``log`` and ``index`` files are then read as stored, by byte range (``segment_id`` names the
  version of the pair a range must come from).
"""

from __future__ import annotations

import hmac
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterator, Mapping
from urllib.parse import unquote

import numpy as np

from kcompact.reput.env import value as env_value
from kcompact.reput.errors import InvalidTopicError
from kcompact.reput.record import (ATTR_NULL_KEY, HEADER_SIZE, SCAN_OK, SCAN_TORN, Scratch,
                                   field_spans, gather, hash_ranges, scan, validate_topic)

from .errors import MasterStoreError, ProtocolError, ReplicationError, RequestError

#: the version of the resources every kcompact serves (store, topics, records, live, digests):
#: the ``Kcompact-Protocol`` header of their responses, which a replica of version 1 requires
PROTOCOL_VERSION = 1
#: version 2 adds the segments resources (a sealed format-2 segment's files, as stored)
SEGMENTS_VERSION = 2
#: the versions this kcompact speaks (a master advertises its own in ``/v1/store``'s
#: ``protocols``; a master without that field speaks version 1 only)
PROTOCOL_VERSIONS = (1, 2)
API_PREFIX = "/v1"

# response headers
H_NEXT_OFFSET = "Kcompact-Next-Offset"        # offset to ask for next
H_RECORD_COUNT = "Kcompact-Record-Count"      # records in this body
H_HIGH_WATERMARK = "Kcompact-High-Watermark"  # the partition's next offset when it was read
H_UPTO = "Kcompact-Upto"                      # live/digests: offsets below this were considered
H_LIVE_COUNT = "Kcompact-Live-Count"          # live: number of offsets in the bitmap
H_STORE_ID = "Kcompact-Store-Id"              # every response: the master store's id
H_PROTOCOL = "Kcompact-Protocol"              # every response: its resource's version
H_SEGMENT_ID = "Kcompact-Segment-Id"          # segment files: the version of the pair sent
H_FILE_SIZE = "Kcompact-File-Size"            # segment files: bytes of the whole file

CT_RECORDS = "application/vnd.kcompact.records.v1"
CT_BITMAP = "application/vnd.kcompact.live-bitmap64.v1"
CT_DIGESTS = "application/vnd.kcompact.digests.v1"
CT_SEGMENT_FILE = "application/vnd.kcompact.segment-file.v2"

#: the two files of a sealed format-2 segment a replica of version 2 reads
SEGMENT_FILES = ("log", "index")

OFFSET_MAX = 2**63 - 1
MIB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Limits of `kcompact serve`: per request (max_bytes, default_max_bytes and max_wait_ms are
    advertised in ``GET /v1/store``) and per client (max_connections, client_timeout_s)."""

    max_bytes: int = 64 * MIB          # largest max_bytes a records request may ask for (else 413)
    default_max_bytes: int = 8 * MIB   # when the request names none
    max_wait_ms: int = 30_000          # longest long-poll of a records request
    live_map_memory: int = 64 * MIB    # offset-map budget of one live/digests computation
    max_summaries: int = 2             # live/digests computations running at once (else 503)
    max_url_bytes: int = 2048          # longer request targets: 414
    max_connections: int = 256         # client connections open at once (more: 503, closed)
    client_timeout_s: float = 30.0     # to send a whole request; a response must move as often

    def __post_init__(self):
        if not 64 * 1024 <= self.default_max_bytes <= self.max_bytes <= 1 << 30:
            raise ReplicationError("server limits: need 64 KiB <= default_max_bytes <= "
                                   "max_bytes <= 1 GiB")
        if not 0 <= self.max_wait_ms <= 300_000:
            raise ReplicationError("server limits: max_wait_ms must be in [0, 300000]")
        if self.live_map_memory < 1 << 16 or self.max_summaries < 1:
            raise ReplicationError("server limits: live_map_memory >= 64 KiB, max_summaries >= 1")
        if not 1 <= self.max_connections <= 65536:
            raise ReplicationError(f"--max-connections {self.max_connections}: use 1 to 65536")
        if not 0.1 <= self.client_timeout_s <= 3600:
            raise ReplicationError(f"--client-timeout {self.client_timeout_s:g}: use 0.1 to 3600 "
                                   "seconds")

    def to_dict(self) -> dict:
        return {"max_bytes": self.max_bytes, "default_max_bytes": self.default_max_bytes,
                "max_wait_ms": self.max_wait_ms}

    @classmethod
    def per_client(cls, max_connections: int | None, client_timeout_s: float | None
                   ) -> "ServerLimits":
        """The defaults with a server's --max-connections and --client-timeout (None: the
        default); bounds checked in __post_init__ (one-line errors)."""
        d = cls()
        return cls(max_connections=d.max_connections if max_connections is None
                   else max_connections,
                   client_timeout_s=d.client_timeout_s if client_timeout_s is None
                   else client_timeout_s)


def serve_protocols(env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The versions ``kcompact serve`` offers: ``KCOMPACT_SERVE_PROTOCOLS`` (e.g. ``1``: a
    master that ships records only, as a kcompact before version 2 did), default all."""
    raw = env_value("KCOMPACT_SERVE_PROTOCOLS", env)
    if not raw.strip():
        return PROTOCOL_VERSIONS
    try:
        got = tuple(sorted({int(v) for v in raw.replace(",", " ").split()}))
    except ValueError:
        got = ()
    if PROTOCOL_VERSION not in got or not set(got) <= set(PROTOCOL_VERSIONS):
        raise ReplicationError(f"KCOMPACT_SERVE_PROTOCOLS={raw!r}: name versions this kcompact "
                               f"speaks ({', '.join(map(str, PROTOCOL_VERSIONS))}), 1 among "
                               "them (every replica needs its resources)")
    return got


# ---------------------------------------------------------------------------------------------
# auth


def read_token_file(path: str) -> bytes:
    """The bearer token: the file's content without surrounding whitespace (>= 16 characters)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4097)
    except OSError as e:
        raise ReplicationError(f"cannot read token file {path}: {e.strerror or e}") from None
    token = raw.strip()
    if len(raw) > 4096 or not 16 <= len(token) or not re.fullmatch(rb"[\x21-\x7e]+", token):
        raise ReplicationError(f"token file {path}: the token must be one line of 16-4096 "
                               "printable ASCII characters (e.g. `openssl rand -hex 32 > FILE`)")
    return token


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def check_token(header: str | None, expected: bytes) -> int:
    """HTTP status of an Authorization header: 0 when accepted, 401 none, 403 wrong.

    The comparison is constant-time (``hmac.compare_digest``) over the token bytes."""
    got = parse_bearer(header)
    if got is None:
        return 401
    try:
        raw = got.encode("ascii")
    except UnicodeEncodeError:
        return 403
    return 0 if hmac.compare_digest(raw, expected) else 403


# ---------------------------------------------------------------------------------------------
# paths


@dataclass(frozen=True)
class Route:
    """A parsed request path. ``kind``: store, topics, topic, partition, records, live, digests,
    segments (version 2: the list), segment_file (``base``, ``file``: log or index)."""

    kind: str
    topic: str | None = None
    partition: int | None = None
    base: int | None = None
    file: str | None = None


_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._~%-]*$")
PARTITION_ACTIONS = ("records", "live", "digests", "segments")


def _decode_segment(raw: str) -> str:
    if not _SEGMENT_RE.match(raw):
        raise RequestError(400, f"invalid character in path segment {raw[:60]!r}")
    try:
        seg = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise RequestError(400, f"path segment {raw[:60]!r} is not UTF-8") from None
    if seg in (".", "..") or "/" in seg or "\\" in seg or "\x00" in seg:
        raise RequestError(400, f"path segment {raw[:60]!r} names a directory or a separator")
    return seg


def parse_path(raw_path: str) -> Route:
    """Parse the request target's path (as sent, percent-encoding intact).

    Raises RequestError: 400 for traversal (``..``, ``%2e%2e``, ``/`` or ``%2f`` inside a topic),
    an invalid topic (Kafka's rule) or a partition that is not a non-negative integer; 404 for a
    path that names nothing.
    """
    path = raw_path.split("?", 1)[0]
    if not path.startswith("/"):
        raise RequestError(400, "the request path must start with '/'")
    raw = path[1:].split("/")
    segs = [_decode_segment(s) for s in raw]
    if segs[-1] == "" and len(segs) > 1:
        segs = segs[:-1]  # one trailing slash is tolerated
    if segs == [""]:
        raise RequestError(404, f"nothing at '/'; this server speaks {API_PREFIX}/")
    if "" in segs:
        raise RequestError(400, "empty path segment ('//')")
    if not segs or segs[0] != API_PREFIX[1:]:
        raise RequestError(404, f"unknown path {path[:80]!r}; this server speaks {API_PREFIX}/")
    rest = segs[1:]
    if rest == ["store"]:
        return Route("store")
    if not rest or rest[0] != "topics":
        raise RequestError(404, f"unknown path {path[:80]!r}")
    if len(rest) == 1:
        return Route("topics")
    topic = rest[1]
    try:
        validate_topic(topic)
    except InvalidTopicError as e:
        raise RequestError(400, str(e)) from None
    if len(rest) == 2:
        return Route("topic", topic)
    if rest[2] != "partitions":
        # /v1/topics/a/b/...: a topic name with '/' in it, which Kafka's rule forbids
        raise RequestError(400, f"invalid topic name {'/'.join(rest[1:3])[:80]!r}: "
                                "topic names cannot contain '/'")
    if len(rest) == 3:
        return Route("topic", topic)
    ptext = rest[3]
    if not re.fullmatch(r"[0-9]{1,10}", ptext) or int(ptext) > 2**31 - 1:
        raise RequestError(400, f"invalid partition {ptext[:40]!r}: use an integer in "
                                "[0, 2147483647]")
    partition = int(ptext)
    if len(rest) == 4:
        return Route("partition", topic, partition)
    if len(rest) == 5 and rest[4] in PARTITION_ACTIONS:
        return Route(rest[4], topic, partition)
    if len(rest) == 7 and rest[4] == "segments":
        btext = rest[5]
        if not re.fullmatch(r"[0-9]{1,20}", btext) or int(btext) > OFFSET_MAX:
            raise RequestError(400, f"invalid segment base {btext[:40]!r}: use an offset in "
                                    f"[0, {OFFSET_MAX}]")
        if rest[6] not in SEGMENT_FILES:
            raise RequestError(404, f"unknown path {path[:80]!r}; a segment has "
                                    + " and ".join(SEGMENT_FILES))
        return Route("segment_file", topic, partition, int(btext), rest[6])
    raise RequestError(404, f"unknown path {path[:80]!r}; a partition has "
                            + ", ".join(PARTITION_ACTIONS))


def partition_path(topic: str, partition: int, action: str | None = None) -> str:
    """The request path for a partition resource (client side)."""
    p = f"{API_PREFIX}/topics/{validate_topic(topic)}/partitions/{int(partition)}"
    return f"{p}/{action}" if action else p


def segment_file_path(topic: str, partition: int, base: int, file: str) -> str:
    """The request path of a sealed segment's file (version 2, client side)."""
    return f"{partition_path(topic, partition, 'segments')}/{int(base)}/{file}"


# ---------------------------------------------------------------------------------------------
# query parameters


QUERY_PARAMS = {
    "store": (), "topics": (), "topic": (), "partition": (),
    "records": ("from", "max_bytes", "wait_ms", "check"),
    "live": ("upto",),
    "digests": ("upto", "salt"),
    "segments": (),
    "segment_file": ("id", "from", "max_bytes"),
}


def _int_param(name: str, text: str, lo: int, hi: int) -> int:
    if not re.fullmatch(r"[0-9]{1,19}", text or ""):
        raise RequestError(400, f"query parameter {name}={text[:30]!r}: expected an integer "
                                f">= {lo}")
    v = int(text)
    if v < lo or v > hi:
        raise RequestError(400, f"query parameter {name}={v} is out of range [{lo}, {hi}]")
    return v


@dataclass(frozen=True)
class Query:
    from_offset: int = 0
    max_bytes: int = 0
    wait_ms: int = 0
    upto: int | None = None
    salt: bytes | None = None
    check: bool = False
    segment_id: str | None = None


def parse_query(kind: str, params: Mapping[str, str], limits: ServerLimits,
                multi: Mapping[str, int] | None = None) -> Query:
    """Validate the query of a request of ``kind``. Unknown or repeated parameters are 400;
    ``max_bytes`` above ``limits.max_bytes`` is 413 (not clamped, so a client learns the limit
    instead of silently getting less than it asked for)."""
    allowed = QUERY_PARAMS.get(kind, ())
    for name in params:
        if name not in allowed:
            raise RequestError(400, f"unknown query parameter {name[:40]!r}"
                               + (f"; this resource takes {', '.join(allowed)}" if allowed
                                  else "; this resource takes none"))
        if multi and multi.get(name, 1) > 1:
            raise RequestError(400, f"query parameter {name!r} given more than once")
    q: dict = {}
    if "from" in params:
        q["from_offset"] = _int_param("from", params["from"], 0, OFFSET_MAX)
    if kind in ("records", "segment_file"):
        mb = params.get("max_bytes")
        if mb is None:
            q["max_bytes"] = limits.default_max_bytes
        else:
            v = _int_param("max_bytes", mb, 1, OFFSET_MAX)
            if v > limits.max_bytes:
                raise RequestError(413, f"max_bytes={v} is above this server's limit of "
                                        f"{limits.max_bytes} bytes; ask for at most that")
            q["max_bytes"] = v
    if "check" in params:
        if params["check"] not in ("0", "1"):
            raise RequestError(400, "query parameter check: 0 or 1")
        q["check"] = params["check"] == "1"
    if "wait_ms" in params:
        q["wait_ms"] = _int_param("wait_ms", params["wait_ms"], 0, limits.max_wait_ms)
    if "upto" in params:
        q["upto"] = _int_param("upto", params["upto"], 0, OFFSET_MAX)
    if kind == "digests":
        salt = params.get("salt")
        if salt is None or not re.fullmatch(r"[0-9a-fA-F]{32}", salt):
            raise RequestError(400, "query parameter salt: 32 hex digits (16 random bytes) are "
                                    "required")
        q["salt"] = bytes.fromhex(salt)
    if kind == "segment_file":
        sid = params.get("id")
        if sid is None or not SEGMENT_ID_RE.fullmatch(sid):
            raise RequestError(400, "query parameter id: the segment's id from its listing "
                                    "(`.../segments`) is required")
        q["segment_id"] = sid
    return Query(**q)


#: a segment id: ``<log bytes, hex>-<lean index header CRC, 8 hex digits>``
SEGMENT_ID_RE = re.compile(r"[0-9a-f]{1,16}-[0-9a-f]{8}")


def segment_id(log_size: int, index_header_crc: int) -> str:
    """The id of one version of a sealed format-2 segment's pair: its .log's size and its lean
    index's header CRC (which covers the directory's CRC, hence every chunk's), so a segment
    rewritten by a compaction or a seal under the same base gets another id."""
    return f"{int(log_size):x}-{int(index_header_crc) & 0xFFFFFFFF:08x}"


# ---------------------------------------------------------------------------------------------
# records responses (client side)


def check_records(body: bytes, topic: str, partition: int, from_offset: int,
                  next_offset: int, count: int, secret: bytes,
                  scratch: Scratch | None = None):
    """Validate a records body and scan it with the *replica's* secret (its digests).

    Every record must pass its CRC and header checks, belong to ``topic``/``partition``, have an
    offset >= ``from_offset``, strictly increasing; ``count`` and ``next_offset`` (headers) must
    agree with the body. Returns the Scan; raises ProtocolError naming what is wrong.
    """
    where = f"{topic}-{partition} from offset {from_offset}"
    buf = np.frombuffer(body, dtype=np.uint8)
    s = scan(buf, 0, buf.shape[0], secret=secret, verify_crc=True, scratch=scratch)
    n = len(s)
    if s.status != SCAN_OK:
        raise ProtocolError(f"{where}: {'torn' if s.status == SCAN_TORN else 'corrupt'} record "
                            f"at byte {s.stop} of the master's response (CRC or header check "
                            "failed); nothing of it was written")
    if n != count:
        raise ProtocolError(f"{where}: the master announced {count} records, the body holds {n}")
    if n == 0:
        if next_offset < from_offset:
            raise ProtocolError(f"{where}: next offset {next_offset} is before the request's")
        return s
    offs = s.offsets[:n]
    if int(offs[0]) < from_offset or (n > 1 and bool(np.any(offs[1:] <= offs[:-1]))):
        raise ProtocolError(f"{where}: offsets out of order in the master's response")
    if next_offset != int(offs[-1]) + 1:
        raise ProtocolError(f"{where}: next offset header {next_offset} does not follow the last "
                            f"record ({int(offs[-1])})")
    if bool(np.any(s.partitions[:n] != partition)):
        raise ProtocolError(f"{where}: the master sent records of another partition")
    th = s.topic_hash[:n]
    tb = topic.encode()
    p0 = int(s.positions[0])
    if (bool(np.any(th != th[0])) or int(buf[p0 + 10]) != len(tb)
            or bytes(buf[p0 + HEADER_SIZE:p0 + HEADER_SIZE + len(tb)]) != tb):
        raise ProtocolError(f"{where}: the master sent records of another topic")
    return s


# ---------------------------------------------------------------------------------------------
# digests body


DIGEST_MAGIC = b"KCD1"
FRAME_HEADER = struct.Struct("<4sII")  # magic, entries, key-block bytes
DIGEST_DTYPE = np.dtype([
    ("offset", "<i8"),    # the live record's offset
    ("hash_lo", "<u8"),   # SipHash-2-4-128(record bytes [8, size); salt), low word
    ("hash_hi", "<u8"),   # high word
    ("key_pos", "<u4"),   # where the key starts in the frame's key block
    ("key_len", "<i4"),   # its length; -1 for a keyless record
])
assert DIGEST_DTYPE.itemsize == 32
MAX_FRAME_ENTRIES = 1 << 20
MAX_FRAME_KEYS = 256 * MIB
END_FRAME = FRAME_HEADER.pack(DIGEST_MAGIC, 0, 0)

# The error frame: ends a streamed body whose 200 status line is already on the wire (the server
# can no longer answer 500). Same 12-byte header shape, another magic, so a reader that knows only
# DIGEST_MAGIC refuses it as a bad frame instead of taking it for digests.
ERROR_MAGIC = b"KCE1"
ERROR_HEADER = struct.Struct("<4sII")  # magic, status (as HTTP's), bytes of the JSON document
MAX_ERROR_BYTES = 64 * 1024


def error_doc(status: int, message: str, path: str | None = None,
              position: int | None = None) -> dict:
    """The JSON error document of every non-200 answer and of an error frame: one line, the
    status, and for damage the store-relative file and byte."""
    doc: dict = {"error": " ".join(message.split())[:4000], "status": int(status)}
    if path is not None:
        doc["path"] = path
    if position is not None:
        doc["position"] = int(position)
    return doc


def error_frame(doc: dict) -> bytes:
    """An error frame carrying ``doc`` (error_doc)."""
    raw = json.dumps(doc).encode()
    if len(raw) > MAX_ERROR_BYTES:
        raw = json.dumps(error_doc(doc.get("status", 500), doc["error"][:1000])).encode()
    return ERROR_HEADER.pack(ERROR_MAGIC, int(doc.get("status", 500)), len(raw)) + raw


def master_error(doc, status: int, where: str) -> MasterStoreError:
    """The MasterStoreError of an error document (``where``: the master URL and path)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), str):
        detail = f"error {status} without a valid error document"
        return MasterStoreError(f"{where}: {detail}", detail)
    detail = " ".join(doc["error"].split())
    path, pos = doc.get("path"), doc.get("position")
    return MasterStoreError(f"{where}: {detail}", detail, path if isinstance(path, str) else None,
                            pos if isinstance(pos, int) and not isinstance(pos, bool) else None)


def record_hashes(buf: np.ndarray, positions: np.ndarray, sizes: np.ndarray,
                  salt: bytes) -> tuple[np.ndarray, np.ndarray]:
    """SipHash-2-4-128 under ``salt`` of each record's bytes [8, size): everything its CRC
    covers (header fields, topic, key, value, headers). Vectorized (one compiled loop)."""
    return hash_ranges(buf, positions.astype(np.int64) + 8, sizes.astype(np.int64) - 8, salt)


def digest_frame(buf: np.ndarray, positions: np.ndarray, sizes: np.ndarray,
                 offsets: np.ndarray, salt: bytes) -> bytes:
    """One digests frame for the records at ``positions`` of ``buf`` (already CRC-checked)."""
    n = positions.shape[0]
    if n == 0:
        return b""
    pos = positions.astype(np.int64)
    e = np.empty(n, DIGEST_DTYPE)
    e["offset"] = offsets
    e["hash_lo"], e["hash_hi"] = record_hashes(buf, pos, sizes, salt)
    sp = field_spans(buf, pos)
    null_key = (sp.attrs & ATTR_NULL_KEY) != 0
    klen = np.where(null_key, 0, sp.klen)
    kpos = np.zeros(n, np.int64)
    np.cumsum(klen[:-1], out=kpos[1:])
    total = int(klen.sum())
    keys = gather(buf, sp.kstart, klen)
    e["key_pos"] = kpos
    e["key_len"] = np.where(null_key, -1, klen)
    return FRAME_HEADER.pack(DIGEST_MAGIC, n, total) + e.tobytes() + keys.tobytes()


@dataclass
class DigestFrame:
    entries: np.ndarray  # DIGEST_DTYPE
    keys: bytes

    def key(self, i: int) -> bytes | None:
        n = int(self.entries["key_len"][i])
        if n < 0:
            return None
        p = int(self.entries["key_pos"][i])
        return self.keys[p:p + n]


class FrameReader:
    """Incremental parser of a digests body: ``feed`` bytes as they arrive, get whole frames.

    Rejects a bad magic, oversized frames, key positions outside the key block, and anything
    after the end frame; ``done`` is True once the end frame was read (a body without it was cut
    short). An error frame raises MasterStoreError with the master's message (``where`` prefixes
    it: the master URL and path)."""

    def __init__(self, where: str = "master"):
        self._buf = bytearray()
        self.done = False
        self.where = where

    def _error(self) -> None:
        """Raise the error frame at the start of the buffer once it is whole."""
        _, status, size = ERROR_HEADER.unpack_from(self._buf, 0)
        if size > MAX_ERROR_BYTES:
            raise ProtocolError(f"{self.where}: error frame of {size} bytes is over the limit")
        if len(self._buf) < ERROR_HEADER.size + size:
            return
        try:
            doc = json.loads(bytes(self._buf[ERROR_HEADER.size:ERROR_HEADER.size + size]))
        except ValueError:
            doc = None
        raise master_error(doc, status, self.where)

    def feed(self, data: bytes) -> Iterator[DigestFrame]:
        if self.done and data:
            raise ProtocolError("digests: data after the end frame")
        self._buf += data
        while len(self._buf) >= FRAME_HEADER.size:
            magic, n, klen = FRAME_HEADER.unpack_from(self._buf, 0)
            if magic == ERROR_MAGIC:
                self._error()
                return  # not whole yet
            if magic != DIGEST_MAGIC:
                raise ProtocolError("digests: bad frame magic (not a kcompact digests body)")
            if n > MAX_FRAME_ENTRIES or klen > MAX_FRAME_KEYS:
                raise ProtocolError(f"digests: frame of {n} entries / {klen} key bytes is "
                                    "over the limit")
            size = FRAME_HEADER.size + n * DIGEST_DTYPE.itemsize + klen
            if len(self._buf) < size:
                return
            if n == 0:
                self.done = True
                if len(self._buf) > size:
                    raise ProtocolError("digests: data after the end frame")
                del self._buf[:size]
                return
            start = FRAME_HEADER.size
            e = np.frombuffer(bytes(self._buf[start:start + n * 32]), DIGEST_DTYPE).copy()
            keys = bytes(self._buf[start + n * 32:size])
            del self._buf[:size]
            ln = e["key_len"].astype(np.int64)
            if (bool(np.any(ln < -1)) or bool(np.any(e["key_pos"].astype(np.int64)
                                                      + np.maximum(ln, 0) > klen))
                    or (n > 1 and bool(np.any(e["offset"][1:] <= e["offset"][:-1])))):
                raise ProtocolError("digests: a frame has keys outside its key block or "
                                    "offsets out of order")
            yield DigestFrame(e, keys)


def new_salt() -> bytes:
    return os.urandom(16)
