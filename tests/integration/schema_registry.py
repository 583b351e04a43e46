"""A minimal but real Confluent Schema Registry (HTTP, in memory) for the integration tests.

No Schema Registry server ships as a Python package, so this implements the part of its REST
API that confluent-kafka's ``SchemaRegistryClient`` uses for Avro serialisation, with the same
JSON shapes and error codes:

    POST /subjects/{subject}/versions        register -> {"id": N} (same schema -> same id)
    POST /subjects/{subject}                 look up a schema -> {"subject","id","version","schema"}
    GET  /schemas/ids/{id}                   -> {"schema": "..."} (+ "schemaType" when not AVRO)
    GET  /subjects                           -> ["subject", ...]
    GET  /subjects/{subject}/versions        -> [1, 2, ...]
    GET  /subjects/{subject}/versions/{v}    v = number or "latest"

Unknown ids/subjects answer 404 with error codes 40403/40401, malformed bodies 422 (42201). It
binds 127.0.0.1 on a free port, serves from a thread, and :meth:`SchemaRegistry.stop` closes the
socket so that "registry down" is a real connection refusal.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.schemas: list[tuple[str, str]] = []              # id-1 -> (schema, type)
        self.by_text: dict[tuple[str, str], int] = {}          # (canonical, type) -> id
        self.subjects: dict[str, list[int]] = {}               # subject -> ids by version
        self.requests: list[str] = []


def _canonical(schema: str) -> str:
    try:
        return json.dumps(json.loads(schema), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return schema


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: int, message: str) -> None:
        self._send(status, {"error_code": code, "message": message})

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return None

    def do_GET(self) -> None:  # noqa: N802
        st = self.server.state
        path = urlsplit(self.path).path.rstrip("/")
        st.requests.append(f"GET {path}")
        with st.lock:
            if path == "/subjects":
                return self._send(200, sorted(st.subjects))
            m = re.fullmatch(r"/schemas/ids/(\d+)", path)
            if m:
                sid = int(m.group(1))
                if not 1 <= sid <= len(st.schemas):
                    return self._error(404, 40403, f"Schema {sid} not found")
                schema, stype = st.schemas[sid - 1]
                doc = {"schema": schema}
                if stype != "AVRO":
                    doc["schemaType"] = stype
                return self._send(200, doc)
            m = re.fullmatch(r"/subjects/([^/]+)/versions", path)
            if m:
                ids = st.subjects.get(unquote(m.group(1)))
                if ids is None:
                    return self._error(404, 40401, f"Subject '{unquote(m.group(1))}' not found.")
                return self._send(200, list(range(1, len(ids) + 1)))
            m = re.fullmatch(r"/subjects/([^/]+)/versions/(latest|-1|\d+)", path)
            if m:
                subject = unquote(m.group(1))
                ids = st.subjects.get(subject)
                if ids is None:
                    return self._error(404, 40401, f"Subject '{subject}' not found.")
                v = len(ids) if m.group(2) in ("latest", "-1") else int(m.group(2))
                if not 1 <= v <= len(ids):
                    return self._error(404, 40402, f"Version {v} not found.")
                return self._send(200, self._version_doc(subject, v, ids[v - 1]))
        return self._error(404, 404, f"no route for GET {path}")

    def _version_doc(self, subject: str, version: int, sid: int) -> dict[str, Any]:
        schema, stype = self.server.state.schemas[sid - 1]
        doc = {"subject": subject, "version": version, "id": sid, "schema": schema}
        if stype != "AVRO":
            doc["schemaType"] = stype
        return doc

    def do_POST(self) -> None:  # noqa: N802
        st = self.server.state
        path = urlsplit(self.path).path.rstrip("/")
        st.requests.append(f"POST {path}")
        body = self._body()
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            return self._error(422, 42201, "Invalid schema: the body needs a 'schema' string")
        stype = body.get("schemaType") or "AVRO"
        key = (_canonical(body["schema"]), stype)
        if stype == "AVRO":
            try:
                json.loads(body["schema"])
            except ValueError:
                return self._error(422, 42201, "Invalid schema: not JSON")
        with st.lock:
            m = re.fullmatch(r"/subjects/([^/]+)/versions", path)
            if m:
                subject = unquote(m.group(1))
                sid = st.by_text.get(key)
                if sid is None:
                    st.schemas.append((body["schema"], stype))
                    sid = len(st.schemas)
                    st.by_text[key] = sid
                ids = st.subjects.setdefault(subject, [])
                if sid not in ids:
                    ids.append(sid)
                return self._send(200, {"id": sid})
            m = re.fullmatch(r"/subjects/([^/]+)", path)
            if m:
                subject = unquote(m.group(1))
                ids = st.subjects.get(subject)
                if ids is None:
                    return self._error(404, 40401, f"Subject '{subject}' not found.")
                sid = st.by_text.get(key)
                if sid is None or sid not in ids:
                    return self._error(404, 40403, "Schema not found")
                return self._send(200, self._version_doc(subject, ids.index(sid) + 1, sid))
        return self._error(404, 404, f"no route for POST {path}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class SchemaRegistry:
    """``with SchemaRegistry() as sr: sr.url`` - an HTTP Schema Registry on 127.0.0.1."""

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.state = _State()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SchemaRegistry":
        self._server = _Server(("127.0.0.1", self.port), _Handler)
        self._server.state = self.state
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="test-schema-registry")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def register(self, subject: str, schema: dict | str) -> int:
        """Register directly (no HTTP), returns the id."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        key = (_canonical(text), "AVRO")
        with self.state.lock:
            sid = self.state.by_text.get(key)
            if sid is None:
                self.state.schemas.append((text, "AVRO"))
                sid = len(self.state.schemas)
                self.state.by_text[key] = sid
            self.state.subjects.setdefault(subject, []).append(sid)
            return sid

    def __enter__(self) -> "SchemaRegistry":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
