"""The key-value map decoding Avro values through a real HTTP Schema Registry.

Values in the store are in Confluent's wire format (magic byte 0, 4-byte big-endian schema id,
Avro body), written here with fastavro against schemas registered in the ``schema_registry``
fixture, so the decoding side is checked independently of our own Avro encoder. The map is
built by ``kcompact kv build`` and read back by ``kcompact kv get --value-converter avro`` and
by ``KVMap(value_converter="avro")``: latest value per key, tombstones absent, two schema
versions of one subject each decoded with its own writer schema.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import fastavro
import pytest

from kcompact.connectors.apps.kv import KVMap
from kcompact.reput import RecordBatch, Store, WriterOptions

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "users"
TS0 = 1_700_000_000_000

USER_V1 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"}]}
USER_V2 = {"type": "record", "name": "User", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "email", "type": ["null", "string"], "default": None}]}


def confluent(schema_id: int, schema: dict, datum: dict) -> bytes:
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), datum)
    return b"\x00" + schema_id.to_bytes(4, "big") + body.getvalue()


def kcompact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcompact", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def avro_map(schema_registry, tmp_path):
    """A store of Avro values (updates, a tombstone, a keyless record, two schema versions),
    and the map built from it by `kcompact kv build`. Returns (db dir, expected decoded map)."""
    v1 = schema_registry.register(f"{TOPIC}-value", USER_V1)
    v2 = schema_registry.register(f"{TOPIC}-value", USER_V2)
    assert v1 != v2
    rows, expected = [], {}
    for i in range(40):
        key = b"user-%02d" % (i % 10)
        if i % 10 == 7 and i >= 30:
            value, datum = None, None                          # tombstone: user-07 deleted
        elif i >= 20 and i % 2:
            datum = {"id": i, "name": f"n{i}", "email": f"u{i}@example.com"}
            value = confluent(v2, USER_V2, datum)
        else:
            datum = {"id": i, "name": f"n{i}"}
            value = confluent(v1, USER_V1, datum)              # decoded with v1: no email
        rows.append((0, i, TS0 + i, key, value))
        expected[key] = datum
    rows.append((0, 40, TS0 + 40, None, confluent(v1, USER_V1, {"id": 99, "name": "keyless"})))
    expected = {k: v for k, v in expected.items() if v is not None}
    store = tmp_path / "store"
    with Store.open(str(store), writer="w", create=True,
                    options=WriterOptions(fsync="never")) as st:
        st.append(RecordBatch.from_records(TOPIC, rows))
        st.flush()
    db = tmp_path / "users.kv"
    proc = kcompact("kv", "build", "--store", str(store), "--topic", TOPIC, "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    return db, expected


def test_kv_get_cli_decodes_avro_through_the_registry(avro_map, schema_registry):
    db, expected = avro_map
    conf = ["--value-converter", "avro", "--converter-config",
            f"schema.registry.url={schema_registry.url}"]
    for key, datum in expected.items():
        proc = kcompact("kv", "get", "--db", str(db), key.decode(), "--json", *conf)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == {"key": key.decode(), "found": True, "value": datum}
    # v2 records really went through the v2 writer schema (the optional field is there)
    assert any("email" in d for d in expected.values())
    assert any("email" not in d for d in expected.values())
    # plain output: the decoded value as one JSON line
    proc = kcompact("kv", "get", "--db", str(db), "user-03", *conf)
    assert proc.returncode == 0 and json.loads(proc.stdout) == expected[b"user-03"]
    # the tombstoned key is absent, with or without the converter
    proc = kcompact("kv", "get", "--db", str(db), "user-07", "--json", *conf)
    assert proc.returncode == 1 and json.loads(proc.stdout) == {"key": "user-07", "found": False}
    # the registry answered the schema lookups over HTTP
    assert any(r.startswith("GET /schemas/ids/") for r in schema_registry.state.requests)


def test_kvmap_value_converter_avro(avro_map, schema_registry):
    db, expected = avro_map
    cfg = {"schema.registry.url": schema_registry.url}
    with KVMap(db, value_converter="avro", converter_config=cfg) as m:
        assert len(m) == len(expected) == 9
        assert {k: m.get(k) for k in expected} == expected
        assert m.get(b"user-07") is None and b"user-07" not in m
        assert dict(m.items()) == expected
        assert dict(m.items(prefix=b"user-0")) == expected
        with m.snapshot() as s:
            assert s.get(b"user-05") == expected[b"user-05"]
    with KVMap(db) as m:   # without a converter: the stored Confluent bytes, unchanged
        raw = m.get(b"user-01")
        assert raw[:1] == b"\x00" and len(raw) > 5


def test_kv_get_avro_with_the_registry_down_fails_with_one_line(avro_map, schema_registry):
    db, _ = avro_map
    url = schema_registry.url
    schema_registry.stop()
    proc = kcompact("kv", "get", "--db", str(db), "user-01", "--json", "--value-converter",
                    "avro", "--converter-config", f"schema.registry.url={url}",
                    "--converter-config", "schema.registry.max.retries=0")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(errors) == 1, proc.stderr
    assert f"Schema Registry at {url} is unreachable" in errors[0]
