"""Converters: Kafka bytes <-> connector values (Connect's ``Converter``).

``to_connect(topic, data)`` reads a key or value from Kafka; ``from_connect(topic, value)`` writes
one. A payload a converter cannot read raises :class:`~kcompact.connectors.framework.api.DataError`
(subject to ``errors.tolerance``); a service that does not answer (the Schema Registry) raises
:class:`~kcompact.connectors.framework.api.RetriableError`. ``None`` (a null key, a tombstone) is
``None`` both ways.

* :class:`ByteArrayConverter` - the bytes as they are (the store sink's default: a mirror is exact).
* :class:`StringConverter` - text in ``encoding`` (UTF-8).
* :class:`JsonConverter` - JSON; ``schemas.enable=true`` reads and writes Connect's
  ``{"schema": ..., "payload": ...}`` envelope. Default false here (Connect's default is true).
* :class:`AvroConverter` - Avro in the Confluent wire format: magic byte 0, the schema id as a
  4-byte big-endian integer, then the Avro binary body. Schemas are resolved through a Schema
  Registry with confluent-kafka's ``SchemaRegistryClient`` (cached per id) and decoded with
  fastavro. Subjects follow the TopicNameStrategy (``<topic>-key`` / ``<topic>-value``).

Class names are looked up by :func:`converter_class`: short names (``AvroConverter``), dotted
Python paths, and the Java names people copy from Connect configs
(``io.confluent.connect.avro.AvroConverter`` ...).
"""

from __future__ import annotations

import abc
import base64
import codecs
import io
import json
import struct
import threading
from typing import Any, Mapping

from .api import DataError, RetriableError
from .config import ConfigDef, Importance, Type, at_least, load_class, one_of
from ..errors import ConfigError, ConnectorsError

#: Confluent wire format: magic byte 0, then the schema id (big-endian int32).
MAGIC_BYTE = 0
WIRE_HEADER = struct.Struct(">bI")


class Converter(abc.ABC):
    """Base of every converter. ``CONFIG`` lists the keys it takes (after the
    ``key.converter.``/``value.converter.`` prefix is removed)."""

    CONFIG: ConfigDef = ConfigDef()
    #: True when to_connect returns its input unchanged (the worker then skips the call).
    identity = False

    def __init__(self) -> None:
        self.is_key = False
        self.config: dict[str, Any] = {}

    def configure(self, configs: Mapping[str, Any], is_key: bool) -> None:
        where = f"{'key' if is_key else 'value'}.converter ({type(self).__name__})"
        try:
            self.config = self.CONFIG.parse(configs)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        self.is_key = is_key

    @property
    def role(self) -> str:
        return "key" if self.is_key else "value"

    @abc.abstractmethod
    def to_connect(self, topic: str, data: bytes | None) -> Any:
        ...

    @abc.abstractmethod
    def from_connect(self, topic: str, value: Any) -> bytes | None:
        ...

    def to_connect_many(self, topic: str, datas: list) -> list:
        """Convert a column; raises on the first bad item (the worker then goes record by
        record to attribute the error)."""
        conv = self.to_connect
        return [conv(topic, d) for d in datas]

    def close(self) -> None:
        pass


class ByteArrayConverter(Converter):
    identity = True

    def to_connect(self, topic: str, data: bytes | None) -> Any:
        return data

    def to_connect_many(self, topic: str, datas: list) -> list:
        return datas

    def from_connect(self, topic: str, value: Any) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise DataError(f"ByteArrayConverter: expected bytes for the {self.role}, "
                        f"got {type(value).__name__}")


def _valid_encoding(name: str, v: Any) -> None:
    try:
        codecs.lookup(v)
    except LookupError:
        raise ConfigError(f"{name}: unknown character encoding {v!r}") from None


class StringConverter(Converter):
    CONFIG = ConfigDef().define("encoding", Type.STRING, "UTF-8", _valid_encoding,
                                Importance.LOW, "Character encoding of the bytes.")

    def to_connect(self, topic: str, data: bytes | None) -> Any:
        if data is None:
            return None
        try:
            return data.decode(self.config.get("encoding", "UTF-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"StringConverter: {self.role} is not valid "
                            f"{self.config.get('encoding', 'UTF-8')} ({e.reason} at byte "
                            f"{e.start} of {len(data)})") from None

    def from_connect(self, topic: str, value: Any) -> bytes | None:
        if value is None:
            return None
        if isinstance(value, bytes):
            return value
        return str(value).encode(self.config.get("encoding", "UTF-8"))


class JsonConverter(Converter):
    CONFIG = ConfigDef().define(
        "schemas.enable", Type.BOOLEAN, False, None, Importance.MEDIUM,
        "Read and write Connect's {\"schema\", \"payload\"} envelope (Connect's default is "
        "true; kcompact's is false: plain JSON).")

    def to_connect(self, topic: str, data: bytes | None) -> Any:
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"JsonConverter: {self.role} of {len(data)} bytes is not valid "
                            f"JSON: {e}") from None
        if self.config.get("schemas.enable"):
            if not isinstance(doc, dict) or set(doc) != {"schema", "payload"}:
                raise DataError('JsonConverter with schemas.enable=true requires "schema" and '
                                '"payload" fields and may not contain additional fields; set '
                                "schemas.enable=false for plain JSON")
            return doc["payload"]
        return doc

    def from_connect(self, topic: str, value: Any) -> bytes | None:
        if value is None:
            return None
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode()  # Connect writes bytes as base64
        try:
            if self.config.get("schemas.enable"):
                value = {"schema": connect_schema_of(value), "payload": value}
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            raise DataError(f"JsonConverter: cannot write {type(value).__name__} as JSON: {e}"
                            ) from None


def connect_schema_of(value: Any, optional: bool = False) -> dict[str, Any]:
    """Connect's JSON schema of a Python value (struct for dicts, array, primitives)."""
    if isinstance(value, bool):
        t: dict[str, Any] = {"type": "boolean"}
    elif isinstance(value, int):
        t = {"type": "int64"}
    elif isinstance(value, float):
        t = {"type": "double"}
    elif isinstance(value, str):
        t = {"type": "string"}
    elif isinstance(value, (bytes, bytearray)):
        t = {"type": "bytes"}
    elif isinstance(value, list):
        t = {"type": "array", "items": connect_schema_of(value[0], True) if value
             else {"type": "string", "optional": True}}
    elif isinstance(value, dict):
        t = {"type": "struct", "fields": [dict(connect_schema_of(v, True), field=str(k))
                                          for k, v in value.items()]}
    elif value is None:
        t = {"type": "string"}
        optional = True
    else:
        raise TypeError(f"no Connect schema for {type(value).__name__}")
    t["optional"] = optional
    return t


# ---------------------------------------------------------------------------------------------
# Avro


def _sr_client_class():
    from confluent_kafka.schema_registry import SchemaRegistryClient
    return SchemaRegistryClient


def _transport_errors() -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [OSError]
    for mod in ("confluent_kafka.schema_registry.common._httpx_compat", "httpx"):
        try:
            m = __import__(mod, fromlist=["httpx"])
            hx = getattr(m, "httpx", m)
            out.append(hx.TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(out)


class AvroConverter(Converter):
    CONFIG = (
        ConfigDef()
        .define("schema.registry.url", Type.LIST, None, None, Importance.HIGH,
                "Schema Registry URL(s), comma-separated. Required.")
        .define("basic.auth.credentials.source", Type.STRING, "USER_INFO",
                one_of("USER_INFO", "URL"), Importance.LOW,
                "Where the basic-auth credentials come from: USER_INFO (basic.auth.user.info) "
                "or URL (user:password@ in the URL).")
        .define("basic.auth.user.info", Type.PASSWORD, None, None, Importance.MEDIUM,
                "user:password for the Schema Registry.")
        .define("schema.registry.ssl.ca.location", Type.STRING, None, None, Importance.LOW,
                "CA bundle that signs the registry's certificate.")
        .define("schema.registry.ssl.certificate.location", Type.STRING, None, None,
                Importance.LOW, "Client certificate (mutual TLS).")
        .define("schema.registry.ssl.key.location", Type.STRING, None, None, Importance.LOW,
                "Client key (mutual TLS).")
        .define("schema.registry.request.timeout.ms", Type.INT, 10_000, at_least(1),
                Importance.LOW, "Timeout of one registry request.")
        .define("schema.registry.max.retries", Type.INT, 2, at_least(0), Importance.LOW,
                "Client-side retries of a failed registry request (network errors, 5xx).")
        .define("schema.registry.retries.wait.ms", Type.INT, 500, at_least(0), Importance.LOW,
                "First back-off between those retries (doubles each time).")
        .define("auto.register.schemas", Type.BOOLEAN, True, None, Importance.MEDIUM,
                "from_connect: register avro.schema under the subject if it is new.")
        .define("use.latest.version", Type.BOOLEAN, False, None, Importance.MEDIUM,
                "from_connect: write with the subject's latest registered schema.")
        .define("avro.schema", Type.STRING, None, None, Importance.MEDIUM,
                "from_connect: the Avro schema (JSON) to write with.")
    )

    def __init__(self, client: Any = None) -> None:
        super().__init__()
        self._client = client
        self._parsed: dict[int, Any] = {}
        self._write: dict[str, tuple[int, Any]] = {}
        self._lock = threading.Lock()
        self._transport = _transport_errors()

    def configure(self, configs: Mapping[str, Any], is_key: bool) -> None:
        super().configure(configs, is_key)
        urls = self.config["schema.registry.url"]
        if self._client is None:
            if not urls:
                raise ConfigError(f"{self.role}.converter.schema.registry.url: required by "
                                  "AvroConverter (e.g. http://localhost:8081)")
            conf: dict[str, Any] = {
                "url": ",".join(urls),
                "timeout": self.config["schema.registry.request.timeout.ms"] / 1000.0,
                "max.retries": self.config["schema.registry.max.retries"],
                "retries.wait.ms": self.config["schema.registry.retries.wait.ms"],
                "retries.max.wait.ms": max(self.config["schema.registry.retries.wait.ms"] * 4, 1),
            }
            if self.config["basic.auth.user.info"]:
                conf["basic.auth.user.info"] = self.config["basic.auth.user.info"]
                conf["basic.auth.credentials.source"] = "USER_INFO"
            elif self.config["basic.auth.credentials.source"] == "URL":
                conf["basic.auth.credentials.source"] = "URL"
            for ours, theirs in (("schema.registry.ssl.ca.location", "ssl.ca.location"),
                                 ("schema.registry.ssl.certificate.location",
                                  "ssl.certificate.location"),
                                 ("schema.registry.ssl.key.location", "ssl.key.location")):
                if self.config[ours]:
                    conf[theirs] = self.config[ours]
            try:
                self._client = _sr_client_class()(conf)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{self.role}.converter: invalid Schema Registry settings: {e}"
                                  ) from None
        self.url = ",".join(urls or ["(client)"])

    def subject(self, topic: str) -> str:
        return f"{topic}-{self.role}"

    # -- schemas -------------------------------------------------------------------------------

    def _registry_call(self, what: str, fn, *args):
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        try:
            return fn(*args)
        except SchemaRegistryError as e:
            status = getattr(e, "http_status_code", None) or 0
            if status == 404:
                raise DataError(f"AvroConverter: {what}: not found in the Schema Registry at "
                                f"{self.url} ({e.error_message})") from None
            if status >= 500 or status in (408, 429):
                raise RetriableError(f"Schema Registry at {self.url} failed: {what}: HTTP "
                                     f"{status} {e.error_message}") from None
            raise ConnectorsError(f"Schema Registry at {self.url} refused {what}: HTTP {status} "
                                  f"{e.error_message}") from None
        except self._transport as e:
            raise RetriableError(f"Schema Registry at {self.url} is unreachable ({what}): "
                                 f"{type(e).__name__}: {e}") from None

    def _reader_schema(self, schema_id: int):
        parsed = self._parsed.get(schema_id)
        if parsed is not None:
            return parsed
        import fastavro
        with self._lock:
            schema = self._registry_call(f"schema id {schema_id}", self._client.get_schema,
                                         schema_id)
            if (schema.schema_type or "AVRO").upper() != "AVRO":
                raise DataError(f"AvroConverter: schema id {schema_id} is a "
                                f"{schema.schema_type} schema, not Avro")
            try:
                parsed = fastavro.parse_schema(json.loads(schema.schema_str))
            except Exception as e:  # noqa: BLE001 - any parse failure is this schema's fault
                raise DataError(f"AvroConverter: schema id {schema_id} from {self.url} is not a "
                                f"valid Avro schema: {e}") from None
            self._parsed[schema_id] = parsed
        return parsed

    def _writer_schema(self, topic: str) -> tuple[int, Any]:
        subject = self.subject(topic)
        hit = self._write.get(subject)
        if hit is not None:
            return hit
        import fastavro
        from confluent_kafka.schema_registry import Schema
        with self._lock:
            text = self.config.get("avro.schema")
            if self.config.get("use.latest.version"):
                reg = self._registry_call(f"latest version of subject {subject!r}",
                                          self._client.get_latest_version, subject)
                schema_id, text = reg.schema_id, reg.schema.schema_str
            elif text:
                s = Schema(text, "AVRO")
                if self.config.get("auto.register.schemas"):
                    schema_id = self._registry_call(f"register under {subject!r}",
                                                    self._client.register_schema, subject, s)
                else:
                    schema_id = self._registry_call(f"look up under {subject!r}",
                                                    self._client.lookup_schema, subject,
                                                    s).schema_id
            else:
                raise ConfigError(f"{self.role}.converter: writing Avro needs avro.schema or "
                                  "use.latest.version=true")
            try:
                parsed = fastavro.parse_schema(json.loads(text))
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"{self.role}.converter.avro.schema: not a valid Avro schema: "
                                  f"{e}") from None
            self._write[subject] = (schema_id, parsed)
            return schema_id, parsed

    # -- conversion ----------------------------------------------------------------------------

    def to_connect(self, topic: str, data: bytes | None) -> Any:
        if data is None:
            return None
        if len(data) < WIRE_HEADER.size:
            raise DataError(f"AvroConverter: {self.role} of {len(data)} bytes is shorter than "
                            "the 5-byte Confluent wire-format header (magic byte 0 + schema id)")
        magic, schema_id = WIRE_HEADER.unpack_from(data, 0)
        if magic != MAGIC_BYTE:
            raise DataError(f"AvroConverter: unknown magic byte {magic} in the {self.role}: not "
                            "the Confluent wire format (magic byte 0 + 4-byte schema id)")
        parsed = self._reader_schema(schema_id)
        import fastavro
        buf = io.BytesIO(data)
        buf.seek(WIRE_HEADER.size)
        try:
            value = fastavro.schemaless_reader(buf, parsed, None)
        except Exception as e:  # noqa: BLE001 - fastavro raises EOFError, ValueError, IndexError...
            raise DataError(f"AvroConverter: cannot decode the {self.role} ({len(data)} bytes) "
                            f"with schema id {schema_id}: {type(e).__name__}: {e}") from None
        if buf.tell() != len(data):
            raise DataError(f"AvroConverter: {len(data) - buf.tell()} trailing bytes after the "
                            f"Avro {self.role} (schema id {schema_id}): the payload is corrupt or "
                            "was written with another schema")
        return value

    def from_connect(self, topic: str, value: Any) -> bytes | None:
        if value is None:
            return None
        schema_id, parsed = self._writer_schema(topic)
        import fastavro
        buf = io.BytesIO()
        buf.write(WIRE_HEADER.pack(MAGIC_BYTE, schema_id))
        try:
            fastavro.schemaless_writer(buf, parsed, value)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"AvroConverter: the {self.role} does not match schema id "
                            f"{schema_id}: {type(e).__name__}: {e}") from None
        return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# lookup

_BUILTIN: dict[str, type[Converter]] = {
    "ByteArrayConverter": ByteArrayConverter,
    "StringConverter": StringConverter,
    "JsonConverter": JsonConverter,
    "AvroConverter": AvroConverter,
    # The Java class names found in Kafka Connect configs.
    "org.apache.kafka.connect.converters.ByteArrayConverter": ByteArrayConverter,
    "org.apache.kafka.connect.storage.StringConverter": StringConverter,
    "org.apache.kafka.connect.json.JsonConverter": JsonConverter,
    "io.confluent.connect.avro.AvroConverter": AvroConverter,
}
# The dotted names of earlier layouts, still accepted: before kcompact installed under one
# import name (kcompact 0.1: connectors.converters.X), and before the framework had a folder of
# its own (kcompact.connectors.converters.X).
_BUILTIN.update({f"{module}.{c.__name__}": c
                 for module in ("connectors.converters", "kcompact.connectors.converters")
                 for c in (ByteArrayConverter, StringConverter, JsonConverter, AvroConverter)})


def converter_class(name: str, *, key: str = "converter") -> type[Converter]:
    """A converter class from a short name, a Connect Java name, or a dotted Python path."""
    cls = _BUILTIN.get(name.strip())
    if cls is not None:
        return cls
    loaded = load_class(name, key=key, kind="converter", known=[k for k in _BUILTIN if "." not in k])
    if not (isinstance(loaded, type) and issubclass(loaded, Converter)):
        raise ConfigError(f"{key}: {name!r} is not a kcompact Converter subclass")
    return loaded


def make_converter(name: str, configs: Mapping[str, Any], *, is_key: bool) -> Converter:
    conv = converter_class(name, key=f"{'key' if is_key else 'value'}.converter")()
    conv.configure(configs, is_key)
    return conv
