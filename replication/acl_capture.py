"""The source cluster's ACL bindings kept in the store (docs/formats/acls.md).

A mirror (connectors/plugins/acl_sync.py) reads the source's ACL bindings with the Admin API
(DescribeAcls) and keeps those that concern the mirrored topics and the consumer groups kept
with them in an internal compacted store topic, ``__kcompact-acls`` (partition 0), written
through the store's normal write path:

* one record per binding, keyed by the binding's seven fields; its value says when it was
  captured; a binding that concerns a captured topic or group and is gone from the source gets
  a tombstone (so the store keeps the history ``restore --as-of`` reads back);
* one ``capture`` record per topic: when its bindings were last captured (``kcompact inspect``).

Only what changed since the last capture this writer knows of is appended (the bindings are
read back from the topic when it starts), flushed before :meth:`AclCaptureWriter.capture`
returns.

:func:`acl_bindings` is the public reader: the kept bindings, now or as of a time, as dicts
with exactly the keys of :data:`FIELDS` (Kafka's upper-case names: ``TOPIC``, ``LITERAL``,
``READ``, ``ALLOW``...).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from kcompact.errors import KcompactError
from kcompact.reput import Store

from .errors import ReplicationError
from .internal_topic import LOCK_WAIT_S, InternalTopicWriter, read_records

TOPIC = "__kcompact-acls"
FORMAT_VERSION = 1
#: a binding's fields, in key order (Kafka's AclBinding: pattern, then entry)
FIELDS = ("resource_type", "resource_name", "pattern_type", "principal", "host", "operation",
          "permission_type")
#: the resource types kept: the mirrored topics' and the kept groups'
RESOURCE_TYPES = ("TOPIC", "GROUP")
PATTERN_TYPES = ("LITERAL", "PREFIXED")

Binding = tuple  # the FIELDS' values, in order


class AclCaptureError(ReplicationError):
    """An ACL record that cannot be read, or a capture that cannot be kept."""


def binding_tuple(d: Mapping[str, str]) -> Binding:
    """A binding dict (FIELDS) -> its tuple; ValueError when a field is missing or not a
    string."""
    out = []
    for f in FIELDS:
        v = d.get(f)
        if not isinstance(v, str):
            raise ValueError(f"binding field {f!r} is {v!r}, not a string")
        out.append(v)
    return tuple(out)


def binding_dict(b: Binding) -> dict[str, str]:
    return dict(zip(FIELDS, b))


def encode_binding_key(b: Binding) -> bytes:
    return json.dumps(["binding", *b], separators=(",", ":"), ensure_ascii=False).encode()


def encode_capture_key(topic: str) -> bytes:
    return json.dumps(["capture", topic], separators=(",", ":"), ensure_ascii=False).encode()


def _value(doc: dict) -> bytes:
    return json.dumps(dict(doc, version=FORMAT_VERSION), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


def decode(key: bytes | None, value: bytes | None, where: str) -> tuple[tuple, dict | None]:
    """(key tuple, value dict or None for a tombstone); AclCaptureError names the record."""
    try:
        k = json.loads(key) if key is not None else None
        ok = isinstance(k, list) and k and all(isinstance(x, str) for x in k) and (
            (k[0] == "binding" and len(k) == 1 + len(FIELDS))
            or (k[0] == "capture" and len(k) == 2))
        if not ok:
            raise ValueError(f"key {key!r} is neither [\"binding\", 7 fields] nor "
                             "[\"capture\", topic]")
        if value is None:
            return tuple(k), None
        d = json.loads(value)
        if not isinstance(d, dict):
            raise ValueError("value is not a JSON object")
        if int(d.get("version", 0)) > FORMAT_VERSION:
            raise AclCaptureError(f"{where}: ACL format {d['version']} is newer than this "
                                  f"kcompact reads ({FORMAT_VERSION}); upgrade")
        int(d["captured_ms"])
        return tuple(k), d
    except AclCaptureError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise AclCaptureError(f"{where}: not an ACL record ({e})") from None


def pattern_matches(pattern_type: str, name: str, resource: str) -> bool:
    """Whether a binding's resource pattern applies to the resource named ``resource``
    (Kafka's rules: LITERAL ``*`` is every resource)."""
    if pattern_type == "LITERAL":
        return name == resource or name == "*"
    if pattern_type == "PREFIXED":
        return resource.startswith(name)
    return False


def concerns(b: Binding, topics: Iterable[str], groups: Iterable[str]) -> bool:
    """Whether binding ``b`` applies to one of ``topics`` (a TOPIC binding) or ``groups`` (a
    GROUP binding)."""
    rtype, name, ptype = b[0], b[1], b[2]
    names = topics if rtype == "TOPIC" else groups if rtype == "GROUP" else ()
    return any(pattern_matches(ptype, name, n) for n in names)


@dataclass
class KeptAcls:
    """What a store keeps: the bindings (tuples, sorted) and, per topic, when its bindings were
    last captured (epoch ms)."""

    bindings: list[Binding] = field(default_factory=list)
    captured_ms: dict[str, int] = field(default_factory=dict)
    #: binding -> when it was (last) captured
    binding_ms: dict[Binding, int] = field(default_factory=dict)

    def dicts(self) -> list[dict[str, str]]:
        return [binding_dict(b) for b in self.bindings]

    def for_topic(self, topic: str, groups: Iterable[str] = ()) -> list[Binding]:
        """The bindings that apply to ``topic`` and to the ``groups``."""
        groups = list(groups)
        return [b for b in self.bindings if concerns(b, [topic], groups)]


def _merge(rows: Iterable[tuple[tuple, dict | None]]) -> KeptAcls:
    latest: dict[tuple, dict] = {}
    for k, d in rows:
        if d is None:
            latest.pop(k, None)
        else:
            latest[k] = d
    out = KeptAcls()
    for k, d in latest.items():
        if k[0] == "binding":
            out.binding_ms[tuple(k[1:])] = int(d["captured_ms"])
        else:
            out.captured_ms[k[1]] = int(d["captured_ms"])
    out.bindings = sorted(out.binding_ms)
    return out


def kept_acls(store: Store, *, as_of_ms: int | None = None, allow_inexact: bool = False
              ) -> KeptAcls:
    """The bindings a store keeps, now or as of ``as_of_ms`` (as captured at or before it; then
    AsOfInexactError when compaction cleaned the topic's history past it, unless
    ``allow_inexact``). Empty when the store keeps none."""
    where = f"{store.url} {TOPIC}-0"
    recs = read_records(store, TOPIC, as_of_ms=as_of_ms, allow_inexact=allow_inexact,
                        what="the kept ACLs")
    return _merge(decode(r.key, r.value, f"{where}@{r.offset}") for r in recs)


def acl_bindings(store: Store | str, *, as_of_ms: int | None = None,
                 allow_inexact: bool = False) -> list[dict[str, str]]:
    """The ACL bindings a mirror captured from the source into ``store`` (a Store or its URL),
    now or as captured at or before ``as_of_ms``: dicts with exactly the keys of
    :data:`FIELDS`, Kafka's upper-case names (``{"resource_type": "TOPIC", "resource_name":
    "orders", "pattern_type": "LITERAL", "principal": "User:alice", "host": "*", "operation":
    "READ", "permission_type": "ALLOW"}``), sorted."""
    if isinstance(store, str):
        with Store.open(store) as st:
            return kept_acls(st, as_of_ms=as_of_ms, allow_inexact=allow_inexact).dicts()
    return kept_acls(store, as_of_ms=as_of_ms, allow_inexact=allow_inexact).dicts()


class AclCaptureWriter(InternalTopicWriter):
    """Appends captured bindings to a store (``capture``); remembers what it last kept so that
    an unchanged binding is not written again. One per mirror process; its writer id is the
    caller's."""

    topic = TOPIC

    def __init__(self, url: str, writer: str, *, commitlog_dir: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S):
        super().__init__(url, writer, commitlog_dir=commitlog_dir, lock_wait_s=lock_wait_s,
                         error=AclCaptureError, what="the ACLs")
        self._kept: set[Binding] | None = None
        self._topic_kept = True

    def kept(self) -> set[Binding]:
        if self._kept is None:
            if self._store is not None:
                self._kept = set(kept_acls(self._store).bindings)
            else:
                # read without a writer: a source with no bindings to keep leaves no commit
                # log of this writer behind
                try:
                    with Store.open(self.url) as ro:
                        self._kept = set(kept_acls(ro).bindings)
                        self._topic_kept = TOPIC in ro.topics()
                except KcompactError:
                    self._kept = set(kept_acls(self.store()).bindings)
        return self._kept

    def _keeps_topic(self) -> bool:
        if self._store is not None:
            return TOPIC in self._store.topics()
        return self._topic_kept

    def capture(self, bindings: Iterable[Binding], topics: Iterable[str],
                groups: Iterable[str] = (), now_ms: int | None = None) -> tuple[int, int]:
        """Keep ``bindings`` (read from the source: those concerning ``topics`` and ``groups``)
        and a capture mark per topic; a kept binding that concerns them and is not among
        ``bindings`` any more gets a tombstone. Returns (bindings added, bindings removed);
        durable when this returns."""
        topics, groups = sorted(set(topics)), sorted(set(groups))
        if not topics:
            return 0, 0
        kept = self.kept()
        now = int(time.time() * 1000) if now_ms is None else int(now_ms)
        current = {b for b in bindings if concerns(b, topics, groups)}
        added = sorted(current - kept)
        removed = sorted(b for b in kept - current if concerns(b, topics, groups))
        if not added and not removed and not self._keeps_topic():
            return 0, 0  # a source with no bindings on them: the store stays as it was
        recs: list[tuple[bytes, bytes | None]] = []
        recs += [(encode_binding_key(b), _value({"captured_ms": now})) for b in added]
        recs += [(encode_binding_key(b), None) for b in removed]
        recs += [(encode_capture_key(t), _value({"captured_ms": now, "bindings": sum(
            1 for b in current if concerns(b, [t], groups))})) for t in topics]
        self.append(recs, now)
        kept.difference_update(removed)
        kept.update(added)
        return len(added), len(removed)


__all__ = ["FIELDS", "TOPIC", "AclCaptureError", "AclCaptureWriter", "KeptAcls",
           "acl_bindings", "binding_dict", "binding_tuple", "concerns", "kept_acls",
           "pattern_matches"]
