"""The Kafka wire protocol as the endpoint speaks it: the codec glue and Kafka's error codes.

Requests and every response but Fetch's are kio's generated entities (Aiven's ``kio``, built from
Kafka's JSON message schemas): ``decode_request`` reads a request's header and body, ``encode``
writes a response's header and body. ``build(cls, **fields)`` makes a response entity of any
version from one set of plain values (ints for error codes and milliseconds, dicts and lists
for nested entities), dropping the fields that version does not have, so one handler answers
every version it serves. The Fetch response is written by hand (apis/fetch.py) so that stored
batch bytes go out without a copy. What is served, and each API's versions, is registered beside
its handler (apis/); what each API answers is in docs/kafka-endpoint.md.
"""

from __future__ import annotations

import datetime
import io
import struct
import typing
import uuid
from dataclasses import MISSING, fields, is_dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer

# error codes (Kafka's Errors)
NONE = 0
OFFSET_OUT_OF_RANGE = 1
UNKNOWN_TOPIC_OR_PARTITION = 3
COORDINATOR_NOT_AVAILABLE = 15
NOT_COORDINATOR = 16
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
INVALID_GROUP_ID = 24
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
TOPIC_AUTHORIZATION_FAILED = 29
GROUP_AUTHORIZATION_FAILED = 30
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
#: a partition that fails its checks (damaged, or its ledger disagrees): Kafka's offline log
KAFKA_STORAGE_ERROR = 56
SASL_AUTHENTICATION_FAILED = 58
UNSUPPORTED_COMPRESSION_TYPE = 76
MEMBER_ID_REQUIRED = 79
GROUP_MAX_SIZE_REACHED = 81
UNKNOWN_SERVER_ERROR = -1

#: the request header's first fields: size excluded (api key, api version, correlation id)
_HEAD = struct.Struct(">hhi")
_SIZE = struct.Struct(">i")


class WireError(Exception):
    """A request that cannot be answered: the connection is closed with this reason logged."""


class Request(NamedTuple):
    api_key: int
    version: int
    correlation_id: int
    client_id: str | None
    body: Any          # the kio request entity


def peek_header(frame: bytes) -> tuple[int, int, int]:
    """(api key, api version, correlation id) of a request frame (size prefix removed)."""
    if len(frame) < _HEAD.size:
        raise WireError(f"a request of {len(frame)} bytes is shorter than a request header")
    return _HEAD.unpack_from(frame, 0)


def decode_request(frame: bytes, name: str) -> Request:
    """A request's header and body (``name``: its API's, for the error); WireError when kio
    cannot read it. The caller has checked that the API and version are served
    (apis.lookup)."""
    key, version, corr = peek_header(frame)
    req_cls = _request_schema(key, version)
    try:
        header, n = entity_reader(req_cls.__header_schema__)(frame, 0)
        body, m = entity_reader(req_cls)(frame, n)
    except Exception as e:  # noqa: BLE001 - kio raises several kinds on malformed bytes
        raise WireError(f"malformed {name} v{version} request: "
                        f"{type(e).__name__}: {str(e)[:200]}") from None
    # bytes after the body are ignored, as Kafka's broker ignores them (librdkafka 2.x sends
    # three zero bytes after a Metadata v12 body)
    return Request(key, version, corr, header.client_id, body)


@lru_cache(maxsize=None)
def _request_schema(key: int, version: int):
    return load_request_schema(key, version)


@lru_cache(maxsize=None)
def response_schema(key: int, version: int):
    return load_response_schema(key, version)


def encode(key: int, version: int, correlation_id: int, body: Any) -> bytes:
    """A whole response frame (size prefix, header, body) of a kio response entity."""
    cls = response_schema(key, version)
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    header_cls = cls.__header_schema__
    entity_writer(header_cls)(out, _make(header_cls, {"correlation_id": correlation_id}))
    entity_writer(cls)(out, body)
    buf = out.getbuffer()
    _SIZE.pack_into(buf, 0, len(buf) - 4)
    data = bytes(buf)
    del buf
    return data


def respond(key: int, version: int, correlation_id: int, **values: Any) -> bytes:
    """``encode`` of ``build(response schema, **values)``."""
    return encode(key, version, correlation_id, build(response_schema(key, version), **values))


# -- building kio entities from plain values ---------------------------------------------------


def build(cls, **values: Any):
    """An instance of the kio entity ``cls`` from plain values (module docstring). Fields the
    version lacks are ignored; fields not given take their schema default."""
    return _make(cls, values)


@lru_cache(maxsize=None)
def _plan(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        t = hints[f.name]
        if type(None) in typing.get_args(t):  # nullable: Optional[X] / X | None
            t = next(a for a in typing.get_args(t) if a is not type(None))
        nested = next((a for a in typing.get_args(t) if is_dataclass(a)), None)
        if nested is None and is_dataclass(t):
            nested = t
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        out.append((f.name, f.metadata.get("kafka_type"), nested, has_default,
                    typing.get_origin(t) is tuple))
    return tuple(out)


def _make(cls, values: dict):
    kw = {}
    for name, ktype, nested, has_default, is_tuple in _plan(cls):
        if name not in values:
            if not has_default:
                kw[name] = _zero(ktype, is_tuple)
            continue
        kw[name] = _convert(values[name], ktype, nested, is_tuple)
    return cls(**kw)


def _convert(v: Any, ktype: str | None, nested, is_tuple: bool):
    if v is None:
        return None
    if nested is not None:
        if is_tuple:
            return tuple(x if isinstance(x, nested) else _make(nested, x) for x in v)
        return v if isinstance(v, nested) else _make(nested, v)
    if is_tuple:
        return tuple(v)
    if ktype == "error_code":
        return ErrorCode(int(v))
    if ktype in ("timedelta_i32", "timedelta_i64"):
        return v if isinstance(v, datetime.timedelta) else datetime.timedelta(milliseconds=int(v))
    if ktype == "uuid":
        return v if isinstance(v, uuid.UUID) else uuid.UUID(str(v))
    return v


def _zero(ktype: str | None, is_tuple: bool):
    """A required field's value when a handler leaves it out."""
    if is_tuple:
        return ()
    if ktype == "error_code":
        return ErrorCode(0)
    if ktype in ("timedelta_i32", "timedelta_i64"):
        return datetime.timedelta(0)
    if ktype in ("string",):
        return ""
    if ktype in ("bytes", "records"):
        return b""
    if ktype == "bool":
        return False
    if ktype == "uuid":
        return uuid.UUID(int=0)
    return 0


def error_name(code: int) -> str:
    """Kafka's name of an error code (``OFFSET_OUT_OF_RANGE``), or ``CODE_<n>``."""
    try:
        return ErrorCode(int(code)).name.upper()
    except ValueError:
        return f"CODE_{int(code)}"


def ms(v: Any) -> int:
    """A kio duration field (timedelta) in milliseconds."""
    if isinstance(v, datetime.timedelta):
        return int(v / datetime.timedelta(milliseconds=1))
    return int(v)
