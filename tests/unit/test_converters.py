"""Converters: byte array, string, JSON, Avro (Confluent wire format). No processes: the Avro
tests use an in-memory stand-in for confluent-kafka's SchemaRegistryClient (the HTTP client
against a real registry server is covered in tests/integration/test_mirror.py)."""

from __future__ import annotations

import io
import json
import struct

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.framework.api import DataError, RetriableError
from kcompact.connectors.framework.converters import (AvroConverter, ByteArrayConverter,
                                                      JsonConverter, StringConverter,
                                                      converter_class, make_converter)
from kcompact.connectors.errors import ConfigError

SCHEMA = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"},
    {"name": "name", "type": "string"},
    {"name": "email", "type": ["null", "string"], "default": None},
    {"name": "tags", "type": {"type": "array", "items": "string"}},
]}


class FakeRegistry:
    """The part of SchemaRegistryClient the converter calls, in memory."""

    def __init__(self, down: bool = False):
        self.schemas: dict[int, str] = {}
        self.subjects: dict[str, list[int]] = {}
        self.down = down
        self.calls = 0

    def _check(self):
        self.calls += 1
        if self.down:
            raise ConnectionRefusedError(111, "Connection refused")

    def register_schema(self, subject, schema, normalize_schemas=False):
        self._check()
        for sid, text in self.schemas.items():
            if json.loads(text) == json.loads(schema.schema_str):
                break
        else:
            sid = len(self.schemas) + 1
            self.schemas[sid] = schema.schema_str
        self.subjects.setdefault(subject, []).append(sid)
        return sid

    def get_schema(self, schema_id, subject_name=None, fmt=None):
        from confluent_kafka.schema_registry import Schema
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        self._check()
        if schema_id not in self.schemas:
            raise SchemaRegistryError(404, 40403, f"Schema {schema_id} not found")
        return Schema(self.schemas[schema_id], "AVRO")

    def get_latest_version(self, subject, fmt=None):
        from confluent_kafka.schema_registry import RegisteredSchema, Schema
        self._check()
        sid = self.subjects[subject][-1]
        return RegisteredSchema(schema_id=sid, guid=None, schema=Schema(self.schemas[sid], "AVRO"),
                                subject=subject, version=len(self.subjects[subject]))


def _avro(client=None, **cfg) -> AvroConverter:
    c = AvroConverter(client=client or FakeRegistry())
    c.configure(dict({"schema.registry.url": "http://sr.test:8081"}, **cfg), is_key=False)
    return c


def _wire(schema_id: int, schema: dict, value) -> bytes:
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, schema_id))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), value)
    return buf.getvalue()


# -- byte array / string / json ------------------------------------------------------------------


def test_byte_array_is_identity():
    c = make_converter("ByteArrayConverter", {}, is_key=True)
    data = [b"", None, b"\x00\xff"]
    assert c.to_connect_many("t", data) is data
    assert c.from_connect("t", bytearray(b"ab")) == b"ab"
    with pytest.raises(DataError, match="expected bytes for the key, got str"):
        c.from_connect("t", "text")


def test_string_converter():
    c = make_converter("StringConverter", {}, is_key=False)
    assert c.to_connect("t", "héllo".encode()) == "héllo"
    assert c.to_connect("t", None) is None and c.to_connect("t", b"") == ""
    assert c.from_connect("t", "é") == "é".encode()
    with pytest.raises(DataError, match="value is not valid UTF-8 .* at byte 1 of 2"):
        c.to_connect("t", b"a\xff")
    latin = make_converter("StringConverter", {"encoding": "latin-1"}, is_key=False)
    assert latin.to_connect("t", b"\xe9") == "é"
    with pytest.raises(ConfigError, match="encoding: unknown character encoding 'klingon'"):
        make_converter("StringConverter", {"encoding": "klingon"}, is_key=False)


def test_json_converter_plain_and_envelope():
    c = make_converter("JsonConverter", {}, is_key=False)
    assert c.to_connect("t", b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    assert c.to_connect("t", None) is None
    with pytest.raises(DataError, match="value of 5 bytes is not valid JSON"):
        c.to_connect("t", b"{nope")
    with pytest.raises(DataError, match="value of 0 bytes is not valid JSON"):
        c.to_connect("t", b"")
    assert json.loads(c.from_connect("t", {"a": 1})) == {"a": 1}

    env = make_converter("JsonConverter", {"schemas.enable": "true"}, is_key=False)
    doc = env.from_connect("t", {"id": 1, "name": "x", "ok": True, "tags": ["a"]})
    parsed = json.loads(doc)
    assert parsed["schema"]["type"] == "struct"
    assert {f["field"]: f["type"] for f in parsed["schema"]["fields"]} == {
        "id": "int64", "name": "string", "ok": "boolean", "tags": "array"}
    assert env.to_connect("t", doc) == {"id": 1, "name": "x", "ok": True, "tags": ["a"]}
    with pytest.raises(DataError, match='requires "schema" and "payload"'):
        env.to_connect("t", b'{"id": 1}')


def test_converter_lookup():
    assert converter_class("io.confluent.connect.avro.AvroConverter") is AvroConverter
    assert converter_class("org.apache.kafka.connect.json.JsonConverter") is JsonConverter
    assert converter_class("org.apache.kafka.connect.storage.StringConverter") is StringConverter
    assert converter_class("kcompact.connectors.framework.converters.ByteArrayConverter") \
        is ByteArrayConverter
    # the dotted names of earlier layouts still resolve
    for old in ("connectors.converters", "kcompact.connectors.converters"):
        assert converter_class(f"{old}.AvroConverter") is AvroConverter
    with pytest.raises(ConfigError, match="unknown converter 'Avro'.*built-in: ByteArrayConverter"):
        converter_class("Avro")
    with pytest.raises(ConfigError, match="is not a kcompact Converter subclass"):
        converter_class("json.JSONDecoder")
    with pytest.raises(ConfigError, match="org.apache.kafka.connect.foo.Bar' is a Java class"):
        converter_class("org.apache.kafka.connect.foo.Bar")


# -- Avro ----------------------------------------------------------------------------------------


def test_avro_decodes_the_confluent_wire_format():
    reg = FakeRegistry()
    sid = reg.register_schema("t-value", _schema(SCHEMA))
    c = _avro(reg)
    user = {"id": 7, "name": "ada", "email": None, "tags": ["x", "y"]}
    assert c.to_connect("t", _wire(sid, SCHEMA, user)) == user
    assert c.to_connect("t", None) is None
    calls = reg.calls
    c.to_connect("t", _wire(sid, SCHEMA, user))
    assert reg.calls == calls  # schemas are cached per id


def _schema(d):
    from confluent_kafka.schema_registry import Schema
    return Schema(json.dumps(d), "AVRO")


@pytest.mark.parametrize("payload, message", [
    (b"\x00\x00\x01", "value of 3 bytes is shorter than the 5-byte Confluent wire-format header"),
    (b"\x01\x00\x00\x00\x01\x02", "unknown magic byte 1 in the value"),
    (b"\x00\x00\x00\x00\x09\x02", r"schema id 9: not found in the Schema Registry at "
                                  r"http://sr.test:8081"),
    (b"\x00\x00\x00\x00\x01\x0e\x06ad", "cannot decode the value .* with schema id 1"),
])
def test_avro_malformed_payloads_are_data_errors(payload, message):
    reg = FakeRegistry()
    reg.register_schema("t-value", _schema(SCHEMA))
    with pytest.raises(DataError, match=message):
        _avro(reg).to_connect("t", payload)


def test_avro_trailing_bytes_are_a_data_error():
    reg = FakeRegistry()
    sid = reg.register_schema("t-value", _schema(SCHEMA))
    data = _wire(sid, SCHEMA, {"id": 1, "name": "a", "email": None, "tags": []}) + b"\x00"
    with pytest.raises(DataError, match="1 trailing bytes after the Avro value"):
        _avro(reg).to_connect("t", data)


def test_avro_registry_down_is_retriable_and_says_so():
    c = _avro(FakeRegistry(down=True))
    with pytest.raises(RetriableError, match="Schema Registry at http://sr.test:8081 is "
                                             "unreachable .*schema id 1.*Connection refused"):
        c.to_connect("t", _wire(1, SCHEMA, {"id": 1, "name": "a", "email": None, "tags": []}))


def test_avro_needs_a_registry_url():
    c = AvroConverter()
    with pytest.raises(ConfigError, match="value.converter.schema.registry.url: required"):
        c.configure({}, is_key=False)
    with pytest.raises(ConfigError, match="unknown property 'schema.registry.urls'"):
        AvroConverter().configure({"schema.registry.urls": "http://x"}, is_key=True)


def test_avro_from_connect_registers_and_round_trips():
    reg = FakeRegistry()
    w = _avro(reg, **{"avro.schema": json.dumps(SCHEMA)})
    user = {"id": 1, "name": "b", "email": "b@x", "tags": []}
    data = w.from_connect("orders", user)
    assert data[0] == 0 and struct.unpack(">I", data[1:5])[0] == reg.subjects["orders-value"][0]
    assert _avro(reg).to_connect("orders", data) == user
    with pytest.raises(DataError, match="does not match schema id"):
        w.from_connect("orders", {"id": "not a long"})
    latest = _avro(reg, **{"use.latest.version": "true"})
    assert latest.from_connect("orders", user) == data
    with pytest.raises(ConfigError, match="writing Avro needs avro.schema or use.latest.version"):
        _avro(reg).from_connect("orders", user)


_users = st.fixed_dictionaries({
    "id": st.integers(-(2**63), 2**63 - 1),
    "name": st.text(max_size=30),
    "email": st.none() | st.text(max_size=10),
    "tags": st.lists(st.text(max_size=5), max_size=4),
})


@settings(max_examples=100, deadline=None)
@given(_users)
def test_avro_round_trip_property(user):
    reg = FakeRegistry()
    w = _avro(reg, **{"avro.schema": json.dumps(SCHEMA)})
    assert _avro(reg).to_connect("t", w.from_connect("t", user)) == user


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40))
def test_avro_never_returns_garbage_for_random_bytes(body):
    """Random bytes after a valid header either decode to a value of the schema, or raise
    DataError - never another exception. (Re-encoding need not give the same bytes: Avro
    accepts non-minimal varints.)"""
    reg = FakeRegistry()
    sid = reg.register_schema("t-value", _schema(SCHEMA))
    payload = struct.pack(">bI", 0, sid) + body
    c = _avro(reg)
    try:
        v = c.to_connect("t", payload)
    except DataError:
        return
    from fastavro.validation import validate
    assert validate(v, fastavro.parse_schema(SCHEMA), raise_errors=False)
