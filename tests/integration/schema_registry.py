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
    GET  /schemas/ids/{id}/versions          -> [{"subject", "version"}, ...]
    PUT  /mode/{subject}                     {"mode": "IMPORT" | "READWRITE"}; ``import_mode``
                                             False answers 422 (42205) as a registry refusing it

Schemas may carry ``references`` ([{"name", "subject", "version"}], given back by every GET); a
registration in IMPORT mode takes the body's ``id`` (and ``version``). ``first_id`` offsets the
ids this registry gives out (a target whose ids differ from the source's); a subject in
``incompatible`` refuses any new version with 409 (error code 409), as a registry with a
compatibility rule refuses an incompatible schema.

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


class _Schemas(dict):
    """id -> (schema, type, references)."""


class _State:
    def __init__(self, first_id: int = 1) -> None:
        self.lock = threading.Lock()
        self.first_id = first_id
        self.schemas: dict[int, tuple[str, str, list]] = _Schemas()
        self.by_text: dict[tuple, int] = {}          # (canonical, type, refs) -> id
        self.subjects: dict[str, list[int]] = {}               # subject -> ids by version
        self.modes: dict[str, str] = {}
        self.import_mode = True
        self.incompatible: set[str] = set()
        self.requests: list[str] = []

    def next_id(self) -> int:
        return max(self.schemas, default=self.first_id - 1) + 1


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
            m = re.fullmatch(r"/schemas/ids/(\d+)(/versions)?", path)
            if m:
                sid = int(m.group(1))
                if sid not in st.schemas:
                    return self._error(404, 40403, f"Schema {sid} not found")
                if m.group(2):
                    return self._send(200, [{"subject": sub, "version": ids.index(sid) + 1}
                                            for sub, ids in sorted(st.subjects.items())
                                            if sid in ids])
                schema, stype, refs = st.schemas[sid]
                doc = {"schema": schema}
                if stype != "AVRO":
                    doc["schemaType"] = stype
                if refs:
                    doc["references"] = refs
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
        schema, stype, refs = self.server.state.schemas[sid]
        doc = {"subject": subject, "version": version, "id": sid, "schema": schema}
        if stype != "AVRO":
            doc["schemaType"] = stype
        if refs:
            doc["references"] = refs
        return doc

    def do_PUT(self) -> None:  # noqa: N802
        st = self.server.state
        path = urlsplit(self.path).path.rstrip("/")
        st.requests.append(f"PUT {path}")
        body = self._body()
        m = re.fullmatch(r"/mode/([^/]+)", path)
        if not m or not isinstance(body, dict) or body.get("mode") not in (
                "IMPORT", "READWRITE", "READONLY"):
            return self._error(422, 42204, "Invalid mode")
        if body["mode"] == "IMPORT" and not st.import_mode:
            return self._error(422, 42205, "Import mode is not allowed on this registry")
        with st.lock:
            st.modes[unquote(m.group(1))] = body["mode"]
        return self._send(200, {"mode": body["mode"]})

    def do_POST(self) -> None:  # noqa: N802
        st = self.server.state
        path = urlsplit(self.path).path.rstrip("/")
        st.requests.append(f"POST {path}")
        body = self._body()
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            return self._error(422, 42201, "Invalid schema: the body needs a 'schema' string")
        stype = body.get("schemaType") or "AVRO"
        refs = [{"name": r["name"], "subject": r["subject"], "version": int(r["version"])}
                for r in body.get("references") or []]
        key = (_canonical(body["schema"]), stype, json.dumps(refs, sort_keys=True))
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
                ids = st.subjects.setdefault(subject, [])
                if (sid is None or sid not in ids) and subject in st.incompatible and ids:
                    return self._error(409, 409, "Schema being registered is incompatible "
                                       "with an earlier schema for subject "
                                       f"\"{subject}\"")
                if "id" in body:
                    if st.modes.get(subject) != "IMPORT":
                        return self._error(422, 42205, "Subject is not in import mode")
                    sid = int(body["id"])
                    if sid in st.schemas and st.by_text.get(key) != sid:
                        return self._error(422, 42207, f"Schema id {sid} already used")
                if sid is None:
                    sid = st.next_id()
                if sid not in st.schemas:
                    st.schemas[sid] = (body["schema"], stype, refs)
                    st.by_text[key] = sid
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

    def __init__(self, first_id: int = 1) -> None:
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.state = _State(first_id)
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
        key = (_canonical(text), "AVRO", "[]")
        with self.state.lock:
            sid = self.state.by_text.get(key)
            if sid is None:
                sid = self.state.next_id()
                self.state.schemas[sid] = (text, "AVRO", [])
                self.state.by_text[key] = sid
            self.state.subjects.setdefault(subject, []).append(sid)
            return sid

    def __enter__(self) -> "SchemaRegistry":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
