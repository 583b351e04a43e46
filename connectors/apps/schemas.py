"""``kcompact schemas``: the source registry's schemas a store keeps (captured by ``kcompact
mirror --schema-registry``, replication/schema_capture.py): per schema id its type, the subjects
and versions that carry it on the source, its references; per topic the ids its records name and
those the source registry did not know. ``--json`` adds the schema texts. Nothing is changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kcompact.reput import Store
from kcompact.replication.schema_capture import KeptSchemas, kept_schemas

from ..errors import ConnectorsError
from .output import print_json


@dataclass(frozen=True)
class SchemasOptions:
    store: str
    topic: str | None = None     # --topic RE, matched whole
    json: bool = False


def schemas_doc(store: Store, kept: KeptSchemas, topic_re: str | None) -> dict[str, Any]:
    try:
        rx = re.compile(topic_re or ".*")
    except re.error as e:
        raise ConnectorsError(f"--topic {topic_re!r} is not a regular expression ({e})") from None
    topics = {t: ts for t, ts in sorted(kept.topics.items()) if rx.fullmatch(t)}
    ids = {s.id for s in kept.closure(set().union(*[ts.ids - ts.missing
                                                      for ts in topics.values()]))} \
        if topics else set()
    if topic_re is None:
        ids = set(kept.schemas)
    return {"store": store.url,
            "schemas": [dict(id=i, **{k: v for k, v in kept.schemas[i].to_doc().items()})
                        for i in sorted(ids)],
            "topics": {t: {"ids": sorted(ts.ids), "missing": sorted(ts.missing),
                           "captured_ms": ts.captured_ms} for t, ts in topics.items()}}


def run_schemas(opts: SchemasOptions) -> int:
    with Store.open(opts.store) as store:
        doc = schemas_doc(store, kept_schemas(store), opts.topic)
    if opts.json:
        print_json(doc)
        return 0
    if not doc["schemas"] and not doc["topics"]:
        print(f"no schemas kept in {opts.store} (kcompact mirror --schema-registry URL keeps "
              "them)")
        return 0
    print(f"{'ID':>6}  {'TYPE':<10} {'SUBJECT VERSIONS':<40} REFERENCES")
    for s in doc["schemas"]:
        subj = ", ".join(f"{a} v{b}" for a, b in s["subjects"]) or "-"
        refs = ", ".join(f"{n} ({a} v{b})" for n, a, b in s["references"]) or "-"
        print(f"{s['id']:>6}  {s['schema_type']:<10} {subj:<40} {refs}")
    print()
    for t, ts in doc["topics"].items():
        print(f"topic {t}: ids {', '.join(map(str, ts['ids'])) or '-'}"
              + (f"; NOT KNOWN to the source registry: {', '.join(map(str, ts['missing']))}"
                 if ts["missing"] else ""))
    return 0


__all__ = ["SchemasOptions", "run_schemas", "schemas_doc"]
