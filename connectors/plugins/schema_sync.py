"""Schemas kept with the copy (replication/schema_capture.py, docs/formats/schemas.md): the
mirror's capture from the source registry, and the restore's registration on the target
registry with the id map it rewrites records with.

Confluent's wire format: a key or value that starts with magic byte 0 and is at least 5 bytes
long carries a 4-byte big-endian schema id after it. With ``--schema-registry URL``
(``schema.registry.url``, as the Avro converter spells it) every key and value of the mirrored
topics is read that way.

**Mirror** (:class:`SinkSchemaSync`, the store sink's ``put`` before a batch is stored): an id
not kept yet is fetched from the source registry (``GET /schemas/ids/{id}``, its subjects and
versions ``GET /schemas/ids/{id}/versions``, every reference ``GET
/subjects/{s}/versions/{v}``) and kept once. An id the registry does not know (404) is one
warning line; the record is stored as it is and the id is kept as *missing* for its topic (a
restore of it refuses to start). A registry that cannot be reached stops the mirror with one
line before that batch is stored (what was stored before has its schemas kept; a rerun
continues).

**Restore** (:func:`register_all`, then :class:`IdMap` on every chunk): before any record is
produced, the kept schemas of the topic, references first, then in source id order, are
registered on the target under their subjects in their source version order; a schema the
target already has under the subject is looked up, not registered again (a rerun registers
nothing twice). The source -> target id map rewrites the 4 id bytes of every key and value that
carries one, from the store's original bytes, so a record is mapped exactly once however often
the restore restarts. ``--keep-schema-ids``: the target's import mode (``PUT /mode/{subject}``
IMPORT) registers each schema under its source id and version, and the map is the identity; a
target that does not allow it is refused with one line. A schema the target rejects (409
incompatible, 422 invalid) stops the restore before any record is produced, naming subject and
version.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterable, Mapping, TextIO

import numpy as np

from ..errors import ConnectorsError

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
TIMEOUT_S = 10.0


class SchemaRegistryError(ConnectorsError):
    """A schema registry that cannot be reached, or that refused a request."""


class RegistryHTTPError(SchemaRegistryError):
    def __init__(self, message: str, status: int, code: int | None):
        super().__init__(message)
        self.status, self.code = status, code


class Registry:
    """A Confluent Schema Registry REST client (the calls this module makes)."""

    def __init__(self, url: str, timeout: float = TIMEOUT_S):
        url = (url or "").strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise SchemaRegistryError(f"--schema-registry {url!r}: give the registry's "
                                      "http:// or https:// URL")
        self.url, self.timeout = url, timeout

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": CONTENT_TYPE,
                                              "Accept": CONTENT_TYPE})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            try:
                doc = json.loads(e.read() or b"{}")
            except ValueError:
                doc = {}
            code = doc.get("error_code") if isinstance(doc, dict) else None
            msg = doc.get("message") if isinstance(doc, dict) else None
            raise RegistryHTTPError(f"schema registry {self.url}: {method} {path}: HTTP "
                                    f"{e.code}{f' ({msg})' if msg else ''}", e.code,
                                    code) from None
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            raise SchemaRegistryError(f"schema registry {self.url} cannot be reached ({why}); "
                                      "start it or check --schema-registry") from None
        return json.loads(raw) if raw else None


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


# -- the wire format ----------------------------------------------------------------------------


def ids_of(values: Iterable[bytes | None]) -> set[int]:
    """The schema ids of the wire-format values among ``values``."""
    return {int.from_bytes(v[1:5], "big") for v in values
            if v is not None and len(v) >= 5 and v[0] == 0}


def ids_of_column(buf: Any, starts: np.ndarray, ends: np.ndarray, nulls: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(record indices, ids) of the wire-format fields of a column (buffer, starts, ends,
    nulls)."""
    arr = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8)
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    ok = ((np.asarray(nulls) == 0) & (ends - starts >= 5))
    idx = np.nonzero(ok)[0]
    if len(idx) == 0 or arr.size == 0:
        return idx, np.zeros(0, np.uint32)
    s = starts[idx]
    idx = idx[arr[s] == 0]
    s = starts[idx]
    ids = ((arr[s + 1].astype(np.uint32) << 24) | (arr[s + 2].astype(np.uint32) << 16)
           | (arr[s + 3].astype(np.uint32) << 8) | arr[s + 4].astype(np.uint32))
    return idx, ids


# -- the mirror's capture -----------------------------------------------------------------------


def fetch_schema(reg: Registry, sid: int) -> list[Any]:
    """The schema ``sid`` and every schema it references (KeptSchema, references first);
    RegistryHTTPError 404 when the registry does not know ``sid``."""
    from kcompact.replication.schema_capture import KeptSchema
    out: list[KeptSchema] = []
    seen: set[int] = set()

    def refs_of(doc: Mapping) -> tuple:
        return tuple((str(r["name"]), str(r["subject"]), int(r["version"]))
                     for r in doc.get("references") or [])

    def subjects_of(i: int) -> tuple:
        try:
            vs = reg.call("GET", f"/schemas/ids/{i}/versions") or []
        except RegistryHTTPError as e:
            if e.status != 404:
                raise
            vs = []
        return tuple(sorted((str(v["subject"]), int(v["version"])) for v in vs))

    def visit(i: int, doc: Mapping, subjects: tuple) -> None:
        if i in seen:
            return
        seen.add(i)
        refs = refs_of(doc)
        for _name, subject, version in refs:
            rd = reg.call("GET", f"/subjects/{q(subject)}/versions/{version}")
            visit(int(rd["id"]), rd, subjects_of(int(rd["id"])))
        out.append(KeptSchema(i, str(doc["schema"]), str(doc.get("schemaType") or "AVRO"),
                              refs, subjects))
    doc = reg.call("GET", f"/schemas/ids/{sid}")
    visit(sid, doc, subjects_of(sid))
    return out


class SinkSchemaSync:
    """The store sink's schema capture (module docstring); tasks call :meth:`seen` with each
    batch before it is stored."""

    def __init__(self, store_url: str, registry_url: str, *, writer: str,
                 commitlog_dir: str | None = None, out: TextIO | None = None,
                 prefix: str = "connect"):
        from kcompact.replication.schema_capture import SchemaCaptureWriter
        self.registry = Registry(registry_url)
        self.writer = SchemaCaptureWriter(store_url, writer, commitlog_dir=commitlog_dir)
        self.out = out if out is not None else sys.stderr
        self.prefix = prefix
        self.known: dict[str, set[int]] = {}    # topic -> ids kept for it (in this process)
        self.kept = 0
        self._lock = threading.Lock()

    def seen(self, records: Any) -> None:
        """The ids ``records`` (a SinkRecords batch) carry; those new to their topic are kept
        before this returns. SchemaRegistryError when the registry cannot be reached."""
        by_topic: dict[str, set[int]] = {}
        topics = records.topics
        if records.packed is not None and topics and topics[0] == topics[-1] and \
                topics.count(topics[0]) == len(topics):
            kb, ko, kn, vb, vo, vn = records.packed
            found: set[int] = set()
            for b, o, nl in ((kb, ko, kn), (vb, vo, vn)):
                offs = np.frombuffer(o, np.int64)
                _, ids = ids_of_column(b, offs[:-1], offs[1:], np.frombuffer(nl, np.uint8))
                found.update(int(i) for i in np.unique(ids))
            by_topic[topics[0]] = found
        else:
            for t, k, v in zip(topics, records.raw_keys, records.raw_values):
                for f in (k, v):
                    if f is not None and len(f) >= 5 and f[0] == 0:
                        by_topic.setdefault(t, set()).add(int.from_bytes(f[1:5], "big"))
        for t in by_topic:
            if t not in self.known:  # what an earlier run kept for it
                ts = self.writer.kept().topics.get(t)
                self.known[t] = set(ts.ids) if ts is not None else set()
        new = {t: ids - self.known[t] for t, ids in by_topic.items()}
        new = {t: ids for t, ids in new.items() if ids}
        if new:
            with self._lock:
                self._keep(new)

    def _keep(self, new: Mapping[str, set[int]]) -> None:
        kept = self.writer.kept()
        schemas: dict[int, Any] = {}
        topics: dict[str, tuple[set, set]] = {}
        for t, ids in new.items():
            missing = set()
            for i in sorted(ids):
                if i in kept.schemas or i in schemas:
                    continue
                try:
                    for s in fetch_schema(self.registry, i):
                        schemas.setdefault(s.id, s)
                except RegistryHTTPError as e:
                    if e.status != 404:
                        raise
                    missing.add(i)
                    print(f"{self.prefix}: warning: topic {t}: schema id {i} is not known to "
                          f"{self.registry.url} ({e}); its records are stored as they are, "
                          "and a restore of the topic with --schema-registry refuses to start",
                          file=self.out, flush=True)
            topics[t] = (set(ids), missing)
        self.kept += self.writer.keep(schemas.values(), topics)
        for t, ids in new.items():
            self.known[t].update(ids)

    def stop(self) -> None:
        self.writer.close()


# -- the restore's registration -----------------------------------------------------------------


def _body(s: Any, ref_versions: Mapping[tuple[str, int], int], **extra) -> dict:
    doc: dict[str, Any] = {"schema": s.schema}
    if s.schema_type != "AVRO":
        doc["schemaType"] = s.schema_type
    if s.references:
        doc["references"] = [{"name": n, "subject": sub,
                              "version": ref_versions.get((sub, v), v)}
                             for n, sub, v in s.references]
    doc.update(extra)
    return doc


def register_all(reg: Registry, schemas: list[Any], *, keep_ids: bool, log: TextIO
                 ) -> dict[int, int]:
    """Register ``schemas`` (KeptSchema, references first) on ``reg``; the map source id ->
    target id. RestoreError-like SchemaRegistryError naming subject and version when the
    target rejects one."""
    idmap: dict[int, int] = {}
    versions: dict[tuple[str, int], int] = {}   # (subject, source version) -> target version
    registered = found = 0
    for s in schemas:
        if not s.subjects:
            raise SchemaRegistryError(f"schema id {s.id} was kept without a subject (the source "
                                      "registry did not say which subjects carry it), so it "
                                      "cannot be registered; mirror again from a registry "
                                      "that answers GET /schemas/ids/{id}/versions")
        for subject, version in sorted(s.subjects, key=lambda sv: (sv[1], sv[0])):
            body = _body(s, versions)
            try:
                hit = reg.call("POST", f"/subjects/{q(subject)}", body)
            except RegistryHTTPError as e:
                if e.status != 404:
                    raise
                hit = None
            if hit is not None and (not keep_ids or int(hit["id"]) == s.id):
                found += 1
            else:
                try:
                    if keep_ids:
                        _import(reg, subject, version, s, versions)
                    else:
                        reg.call("POST", f"/subjects/{q(subject)}/versions", body)
                except RegistryHTTPError as e:
                    what = ("incompatible with the versions the target has"
                            if e.status == 409 else "rejected")
                    raise SchemaRegistryError(
                        f"target registry {reg.url} {what}: subject {subject!r} version "
                        f"{version} (source schema id {s.id}): {e}; nothing was produced")
                registered += 1
                hit = reg.call("POST", f"/subjects/{q(subject)}", body)
            idmap[s.id] = int(hit["id"])
            versions[(subject, version)] = int(hit["version"])
    moved = sum(1 for a, b in idmap.items() if a != b)
    print(f"restore: schemas: {registered} registered on {reg.url}, {found} already there; "
          f"{len(idmap)} ids ({moved} remapped)", file=log, flush=True)
    return idmap


def _import(reg: Registry, subject: str, version: int, s: Any,
            versions: Mapping[tuple[str, int], int]) -> None:
    """Register ``s`` under its source id and version with the subject in IMPORT mode."""
    try:
        reg.call("PUT", f"/mode/{q(subject)}?force=true", {"mode": "IMPORT"})
    except RegistryHTTPError as e:
        raise SchemaRegistryError(f"target registry {reg.url} does not allow import mode for "
                                  f"subject {subject!r} ({e}): restore without "
                                  "--keep-schema-ids to register the schemas under new ids "
                                  "(the records are rewritten to them)") from None
    try:
        reg.call("POST", f"/subjects/{q(subject)}/versions",
                 _body(s, versions, id=s.id, version=version))
    finally:
        try:
            reg.call("PUT", f"/mode/{q(subject)}", {"mode": "READWRITE"})
        except SchemaRegistryError:
            pass


class IdMap:
    """Source -> target schema ids, applied to a chunk's key and value columns."""

    def __init__(self, idmap: Mapping[int, int], topic: str):
        self.topic = topic
        items = sorted(idmap.items())
        self.src = np.array([a for a, _ in items], np.uint32)
        self.dst = np.array([b for _, b in items], np.uint32)
        self.identity = all(a == b for a, b in items)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        if len(self.src) == 0:
            pos, bad = np.zeros(len(ids), np.int64), np.ones(len(ids), bool)
        else:
            pos = np.minimum(np.searchsorted(self.src, ids), len(self.src) - 1)
            bad = self.src[pos] != ids
        if np.any(bad):
            unknown = int(ids[np.nonzero(bad)[0][0]])
            raise SchemaRegistryError(f"a record of store topic {self.topic!r} carries schema id "
                                      f"{unknown}, which the store does not keep (mirrored "
                                      "without --schema-registry?); nothing of this chunk was "
                                      "produced")
        return self.dst[pos]

    def column(self, col: tuple) -> tuple:
        """(buffer, starts, ends, nulls) with every wire-format id rewritten (a copy of the
        buffer; the column itself when nothing changes)."""
        if self.identity:
            return col
        buf, starts, ends, nulls = col
        idx, ids = ids_of_column(buf, starts, ends, nulls)
        if len(idx) == 0:
            return col
        new = self._lookup(ids)
        arr = np.frombuffer(buf, np.uint8).copy() if not isinstance(buf, np.ndarray) else \
            buf.view(np.uint8).copy()
        s = np.asarray(starts, np.int64)[idx]
        for k in range(4):
            arr[s + 1 + k] = ((new >> (8 * (3 - k))) & 0xFF).astype(np.uint8)
        return arr, starts, ends, nulls

    def values(self, values: list) -> list:
        """Keys or values as bytes objects, rewritten."""
        if self.identity:
            return values
        out = list(values)
        for i, v in enumerate(values):
            if v is not None and len(v) >= 5 and v[0] == 0:
                sid = int.from_bytes(v[1:5], "big")
                new = int(self._lookup(np.array([sid], np.uint32))[0])
                out[i] = v[:1] + new.to_bytes(4, "big") + v[5:]
        return out


__all__ = ["IdMap", "Registry", "RegistryHTTPError", "SchemaRegistryError", "SinkSchemaSync",
           "fetch_schema", "ids_of", "ids_of_column", "register_all"]
