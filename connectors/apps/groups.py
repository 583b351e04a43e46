"""``kcompact groups``: the consumer-group positions a store keeps (captured from the source by
``kcompact mirror``, or committed on the Kafka endpoint), with when each was kept and its lag
against the store's end.

A position is a store offset (= the source's offset): the next record the group reads. Its lag
is the store partition's next offset minus the position (0 when the group is at or past the
end: the store may not have copied everything the group read yet). Nothing is changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kcompact.reput import Store
from kcompact.replication.group_capture import kept_offsets

from ..errors import ConnectorsError
from .output import print_json


@dataclass(frozen=True)
class GroupsOptions:
    """``kcompact groups``' options."""

    store: str
    group: str | None = None     # --group RE, matched whole
    json: bool = False


def _iso(ms: int) -> str:
    from kcompact.compaction.history import format_time
    return format_time(ms).split(" ")[0]


def groups_doc(store: Store, group: str | None = None) -> dict[str, Any]:
    """{"groups": [{"group", "partitions": [{"topic", "partition", "offset", "origin",
    "kept_ms", "kept", "store_next_offset", "lag"}]}]} sorted by group, topic, partition."""
    try:
        rx = re.compile(group or ".*")
    except re.error as e:
        raise ConnectorsError(f"--group {group!r} is not a regular expression ({e})") from None
    kept = kept_offsets(store)
    ends: dict[tuple[str, int], int] = {}
    by: dict[str, list[dict[str, Any]]] = {}
    for (g, t, p), k in sorted(kept.items()):
        if not rx.fullmatch(g):
            continue
        if (t, p) not in ends:
            ends[(t, p)] = (store.next_offset(t, p) if t in store.topics()
                            and p in store.partitions(t) else 0)
        end = ends[(t, p)]
        by.setdefault(g, []).append({
            "topic": t, "partition": p, "offset": k.offset, "origin": k.origin,
            "kept_ms": k.commit_ms, "kept": _iso(k.commit_ms), "store_next_offset": end,
            "lag": max(0, end - k.offset)})
    return {"store": store.url,
            "groups": [{"group": g, "partitions": rows} for g, rows in sorted(by.items())]}


def run_groups(opts: GroupsOptions) -> int:
    with Store.open(opts.store) as store:
        doc = groups_doc(store, opts.group)
    if opts.json:
        print_json(doc)
        return 0
    if not doc["groups"]:
        print(f"no consumer group positions kept in {opts.store}"
              + (f" match --group {opts.group!r}" if opts.group else "")
              + " (kcompact mirror keeps the source's; see --groups there)")
        return 0
    print(f"{'GROUP':<24} {'TOPIC':<24} {'PARTITION':>9} {'OFFSET':>12} {'LAG':>10}  "
          f"{'ORIGIN':<8} KEPT")
    for g in doc["groups"]:
        for r in g["partitions"]:
            print(f"{g['group']:<24} {r['topic']:<24} {r['partition']:>9} {r['offset']:>12} "
                  f"{r['lag']:>10}  {r['origin']:<8} {r['kept']}")
    return 0


__all__ = ["GroupsOptions", "groups_doc", "run_groups"]
