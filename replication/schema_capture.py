"""The source registry's schemas kept in the store (docs/formats/schemas.md).

A mirror given a schema registry (connectors/plugins/schema_sync.py) finds the schema ids its
records name in Confluent's wire format (magic byte 0, then a 4-byte big-endian id, on keys and
values), fetches each id's schema once, with the subjects and versions that carry it and every
schema it references, and keeps them in an internal compacted store topic,
``__kcompact-schemas`` (partition 0), written through the store's normal write path:

* ``["schema", id]``: the schema text, its type, its references and its (subject, version)
  pairs on the source registry;
* ``["topic", topic]``: the ids the topic's keys and values carry, and those the source
  registry did not know (``missing``), with when they were last captured.

A capture is flushed before it returns; an id already kept is not fetched or written again.
:func:`kept_schemas` reads them back, now or as of a time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from kcompact.reput import Store

from .errors import ReplicationError
from .internal_topic import LOCK_WAIT_S, InternalTopicWriter, read_records

TOPIC = "__kcompact-schemas"
FORMAT_VERSION = 1


class SchemaCaptureError(ReplicationError):
    """A schema record that cannot be read, or a capture that cannot be kept."""


@dataclass(frozen=True)
class KeptSchema:
    """One source schema: ``references`` are (name, subject, version); ``subjects`` are the
    (subject, version) pairs that carry it on the source registry."""

    id: int
    schema: str
    schema_type: str = "AVRO"
    references: tuple[tuple[str, str, int], ...] = ()
    subjects: tuple[tuple[str, int], ...] = ()
    captured_ms: int = 0

    def to_doc(self) -> dict:
        return {"schema": self.schema, "schema_type": self.schema_type,
                "references": [list(r) for r in self.references],
                "subjects": [list(s) for s in self.subjects], "captured_ms": self.captured_ms}


@dataclass
class TopicSchemas:
    ids: set[int] = field(default_factory=set)
    missing: set[int] = field(default_factory=set)
    captured_ms: int = 0


@dataclass
class KeptSchemas:
    schemas: dict[int, KeptSchema] = field(default_factory=dict)
    topics: dict[str, TopicSchemas] = field(default_factory=dict)

    @property
    def captured_ms(self) -> dict[str, int]:
        return {t: ts.captured_ms for t, ts in self.topics.items()}

    def closure(self, ids: Iterable[int]) -> list[KeptSchema]:
        """The schemas of ``ids`` and every schema they reference (found by subject and
        version among the kept ones), references before the schemas naming them, else in
        source id order. KeyError names an id not kept."""
        by_sv = {sv: s.id for s in self.schemas.values() for sv in s.subjects}
        out: list[KeptSchema] = []
        done: set[int] = set()

        def visit(i: int, path: tuple[int, ...]) -> None:
            if i in done or i in path:
                return
            s = self.schemas[i]
            for _name, subject, version in s.references:
                ref = by_sv.get((subject, int(version)))
                if ref is None:
                    raise KeyError(f"schema {i} references {subject} version {version}, which "
                                   "the store does not keep")
                visit(ref, path + (i,))
            done.add(i)
            out.append(s)
        for i in sorted(set(ids)):
            visit(i, ())
        return out


def _key(*parts) -> bytes:
    return json.dumps(list(parts), separators=(",", ":"), ensure_ascii=False).encode()


def _value(doc: dict) -> bytes:
    return json.dumps(dict(doc, version=FORMAT_VERSION), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


def decode(key: bytes | None, value: bytes | None, where: str) -> tuple[tuple, dict | None]:
    try:
        k = json.loads(key) if key is not None else None
        if not (isinstance(k, list) and len(k) == 2 and (
                (k[0] == "schema" and isinstance(k[1], int))
                or (k[0] == "topic" and isinstance(k[1], str)))):
            raise ValueError(f"key {key!r} is neither [\"schema\", id] nor [\"topic\", name]")
        if value is None:
            return tuple(k), None
        d = json.loads(value)
        if not isinstance(d, dict):
            raise ValueError("value is not a JSON object")
        if int(d.get("version", 0)) > FORMAT_VERSION:
            raise SchemaCaptureError(f"{where}: schema format {d['version']} is newer than "
                                     f"this kcompact reads ({FORMAT_VERSION}); upgrade")
        int(d["captured_ms"])
        return tuple(k), d
    except SchemaCaptureError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise SchemaCaptureError(f"{where}: not a schema record ({e})") from None


def _merge(rows) -> KeptSchemas:
    latest: dict[tuple, dict] = {}
    for k, d in rows:
        if d is None:
            latest.pop(k, None)
        else:
            latest[k] = d
    out = KeptSchemas()
    for k, d in latest.items():
        if k[0] == "schema":
            out.schemas[k[1]] = KeptSchema(
                k[1], str(d["schema"]), str(d.get("schema_type") or "AVRO"),
                tuple((str(n), str(s), int(v)) for n, s, v in d.get("references") or []),
                tuple((str(s), int(v)) for s, v in d.get("subjects") or []),
                int(d["captured_ms"]))
        else:
            out.topics[k[1]] = TopicSchemas(set(map(int, d.get("ids") or [])),
                                            set(map(int, d.get("missing") or [])),
                                            int(d["captured_ms"]))
    return out


def kept_schemas(store: Store, *, as_of_ms: int | None = None, allow_inexact: bool = False
                 ) -> KeptSchemas:
    """The schemas a store keeps, now or as captured at or before ``as_of_ms``."""
    where = f"{store.url} {TOPIC}-0"
    recs = read_records(store, TOPIC, as_of_ms=as_of_ms, allow_inexact=allow_inexact,
                        what="the kept schemas")
    return _merge(decode(r.key, r.value, f"{where}@{r.offset}") for r in recs)


class SchemaCaptureWriter(InternalTopicWriter):
    """Appends schemas and topics' ids to a store; knows what it keeps (read back when it
    starts, and again under the partition's lock before each append) so that nothing is
    written twice."""

    topic = TOPIC

    def __init__(self, url: str, writer: str, *, commitlog_dir: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S):
        super().__init__(url, writer, commitlog_dir=commitlog_dir, lock_wait_s=lock_wait_s,
                         error=SchemaCaptureError, what="the schemas")
        self._kept: KeptSchemas | None = None

    def kept(self) -> KeptSchemas:
        if self._kept is None:
            self._kept = kept_schemas(self.store())
        return self._kept

    def keep(self, schemas: Iterable[KeptSchema], topics: Mapping[str, tuple[set, set]],
             now_ms: int | None = None) -> int:
        """Append ``schemas`` not kept yet and, per topic, its ids and missing ids (added to
        what it keeps); returns the schemas appended. Durable when this returns."""
        schemas, topics = list(schemas), dict(topics)
        if not schemas and not topics:
            return 0
        now = int(time.time() * 1000) if now_ms is None else int(now_ms)
        with self.locked() as append:
            st = self.store()
            # read again under the partition's lock: other writers (the Spark engine's tasks,
            # one per topic-partition) may have kept schemas or a topic's ids since this
            # writer last read them; what they kept is neither written twice nor lost
            self._kept = kept = kept_schemas(st)
            recs: list[tuple[bytes, bytes]] = []
            new = [s for s in schemas if s.id not in kept.schemas]
            for s in new:
                s = KeptSchema(s.id, s.schema, s.schema_type, s.references, s.subjects, now)
                recs.append((_key("schema", s.id), _value(s.to_doc())))
            updated: dict[str, TopicSchemas] = {}
            for t, (ids, missing) in topics.items():
                cur = kept.topics.get(t, TopicSchemas())
                ts = TopicSchemas(cur.ids | set(ids), (cur.missing | set(missing)) - (
                    set(ids) - set(missing)), now)
                if (ts.ids, ts.missing) == (cur.ids, cur.missing):
                    continue
                updated[t] = ts
                recs.append((_key("topic", t), _value({"ids": sorted(ts.ids),
                                                       "missing": sorted(ts.missing),
                                                       "captured_ms": now})))
            if not recs:
                return 0
            append(recs, now)
        for s in new:
            kept.schemas[s.id] = KeptSchema(s.id, s.schema, s.schema_type, s.references,
                                            s.subjects, now)
        kept.topics.update(updated)
        return len(new)


__all__ = ["TOPIC", "KeptSchema", "KeptSchemas", "SchemaCaptureError", "SchemaCaptureWriter",
           "TopicSchemas", "kept_schemas"]
