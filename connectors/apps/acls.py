"""``kcompact acls``: the source ACL bindings a store keeps (captured by ``kcompact mirror``,
replication/acl_capture.py), listed as ``kafka-acls.sh --list`` lists them: per resource pattern
a ``Current ACLs for resource `ResourcePattern(...)`:`` line, then one line per binding.

``--topic RE``: only the bindings that apply to a kept topic whose whole name RE matches (a
LITERAL binding on it, a PREFIXED one whose prefix it starts with, ``*``) and to the groups kept
with it. ``--json``: ``{"store", "bindings": [{resource_type, resource_name, pattern_type,
principal, host, operation, permission_type, captured_ms}], "captured": {topic: ms}}``. Nothing
is changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from kcompact.reput import Store
from kcompact.replication.acl_capture import FIELDS, KeptAcls, kept_acls
from kcompact.replication.group_capture import kept_offsets

from ..errors import ConnectorsError
from .output import print_json


@dataclass(frozen=True)
class AclsOptions:
    store: str
    topic: str | None = None     # --topic RE, matched whole
    json: bool = False
    as_of_ms: int | None = None
    allow_inexact: bool = False


def select(store: Store, kept: KeptAcls, topic_re: str | None) -> list[tuple]:
    """The kept bindings, or those of the topics ``topic_re`` matches whole and their groups."""
    if topic_re is None:
        return list(kept.bindings)
    try:
        rx = re.compile(topic_re)
    except re.error as e:
        raise ConnectorsError(f"--topic {topic_re!r} is not a regular expression ({e})") from None
    topics = [t for t in set(store.topics()) | set(kept.captured_ms) if rx.fullmatch(t)]
    groups = {g for (g, t, _), _k in kept_offsets(store).items() if t in topics}
    out = set()
    for t in topics:
        out.update(kept.for_topic(t, groups))
    return sorted(out)


def kafka_acls_lines(bindings: Iterable[tuple]) -> list[str]:
    """``kafka-acls.sh --list``'s text for ``bindings`` (tuples in FIELDS order)."""
    by: dict[tuple[str, str, str], list[tuple]] = {}
    for b in sorted(bindings):
        by.setdefault((b[0], b[1], b[2]), []).append(b)
    lines = []
    for (rtype, name, ptype), bs in by.items():
        lines.append(f"Current ACLs for resource `ResourcePattern(resourceType={rtype}, "
                     f"name={name}, patternType={ptype})`: ")
        for b in bs:
            lines.append(f" \t(principal={b[3]}, host={b[4]}, operation={b[5]}, "
                         f"permissionType={b[6]})")
        lines.append("")
    return lines


def acls_doc(store: Store, kept: KeptAcls, bindings: list[tuple]) -> dict[str, Any]:
    return {"store": store.url,
            "bindings": [dict(zip(FIELDS, b), captured_ms=kept.binding_ms.get(b))
                         for b in bindings],
            "captured": dict(sorted(kept.captured_ms.items()))}


def run_acls(opts: AclsOptions) -> int:
    with Store.open(opts.store) as store:
        kept = kept_acls(store, as_of_ms=opts.as_of_ms, allow_inexact=opts.allow_inexact)
        bindings = select(store, kept, opts.topic)
        doc = acls_doc(store, kept, bindings)
    if opts.json:
        print_json(doc)
        return 0
    if not bindings:
        print(f"no ACL bindings kept in {opts.store}"
              + (f" for topics matching --topic {opts.topic!r}" if opts.topic else "")
              + (" (kcompact mirror keeps the source's unless --no-acls)"
                 if not kept.captured_ms else ""))
        return 0
    print("\n".join(kafka_acls_lines(bindings)))
    return 0


__all__ = ["AclsOptions", "acls_doc", "kafka_acls_lines", "run_acls", "select"]
