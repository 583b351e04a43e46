"""``restore --acls``: the source ACL bindings a store keeps (replication/acl_capture.py) created
on the target cluster for the restored topic.

Which bindings: those that apply to the store topic (TOPIC: LITERAL on its name, PREFIXED on a
prefix of it, ``*``) and to the consumer groups whose offsets the store keeps on it (GROUP), as
kept now or, with ``--as-of``, at or before that time. A LITERAL binding on the store topic
names ``--to-topic`` on the target; PREFIXED and ``*`` bindings are created as they are.
``--acl-principal-map OLD=NEW`` (repeatable) renames principals.

Creating: bindings the target already has are left alone (DescribeAcls first), the others are
created with CreateAcls. A target without an authorizer, or that refuses DescribeAcls or
CreateAcls, gives one warning line and the restore goes on (its records are restored either
way). Idempotent: a rerun creates nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, TextIO

from kcompact.reput import Store
from kcompact.replication.acl_capture import kept_acls
from kcompact.replication.group_capture import kept_offsets

from .errors import RestoreError


def parse_principal_map(items: Iterable[str]) -> dict[str, str]:
    """``--acl-principal-map OLD=NEW`` values -> {OLD: NEW}; a name without a type is a
    ``User:``."""
    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        old, new = old.strip(), new.strip()
        if not sep or not old or not new:
            raise RestoreError(f"--acl-principal-map {item!r}: give OLD=NEW (User:alice="
                               "User:carol)")
        old = old if ":" in old else f"User:{old}"
        new = new if ":" in new else f"User:{new}"
        if old in out and out[old] != new:
            raise RestoreError(f"--acl-principal-map: {old} is mapped twice ({out[old]}, "
                               f"{new})")
        out[old] = new
    return out


@dataclass
class AclPlan:
    """The bindings to create on the target (tuples in acl_capture.FIELDS order)."""

    bindings: list[tuple] = field(default_factory=list)
    kept: int = 0                 # bindings the store keeps in all
    captured_ms: int | None = None  # when the store topic's bindings were last captured


def plan_acls(store: Store, topic: str, to_topic: str, principal_map: Mapping[str, str], *,
              as_of_ms: int | None = None, allow_inexact: bool = False) -> AclPlan:
    kept = kept_acls(store, as_of_ms=as_of_ms, allow_inexact=allow_inexact)
    groups = {g for (g, t, _), _k in kept_offsets(store, as_of_ms=as_of_ms,
                                                  allow_inexact=True).items() if t == topic}
    out = set()
    for b in kept.for_topic(topic, groups):
        rtype, name, ptype, principal, host, op, perm = b
        if rtype == "TOPIC" and ptype == "LITERAL" and name == topic:
            name = to_topic
        out.add((rtype, name, ptype, principal_map.get(principal, principal), host, op, perm))
    return AclPlan(sorted(out), len(kept.bindings), kept.captured_ms.get(topic))


def to_kafka(b: tuple) -> Any:
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType,
                                       ResourcePatternType, ResourceType)
    return AclBinding(ResourceType[b[0]], b[1], ResourcePatternType[b[2]], b[3], b[4],
                      AclOperation[b[5]], AclPermissionType[b[6]])


def binding_line(b: tuple) -> str:
    return (f"{b[0]}:{b[2]}:{b[1]} principal={b[3]} host={b[4]} operation={b[5]} "
            f"permission={b[6]}")


def _why(e: Exception) -> tuple[str, bool]:
    """(text, whether the target cannot take ACLs at all)."""
    from confluent_kafka import KafkaError

    from ...framework.kafka_clients import kafka_error, kafka_error_text
    err = kafka_error(e)
    code = err.code() if err is not None else None
    text = kafka_error_text(e) if err is not None else str(e)
    if code == KafkaError.SECURITY_DISABLED or "security features are disabled" in text.lower():
        return f"the target has no authorizer ({text})", True
    if code in (KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TOPIC_AUTHORIZATION_FAILED):
        return (f"the target refused ({text}): the restore's principal needs Alter on the "
                "cluster to create ACLs"), True
    return text, False


def apply_acls(plan: AclPlan, conf: Mapping[str, Any], bootstrap: str, timeout: float,
               log: TextIO, *, dry_run: bool = False) -> tuple[int, int]:
    """Create ``plan``'s bindings the target does not have; (created, already there). Never
    raises for the target's sake: a refusal is one warning line on ``log``."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (AclBindingFilter, AclOperation, AclPermissionType,
                                       AdminClient, ResourcePatternType, ResourceType)

    from ...framework.kafka_clients import kafka_logger
    from ..acl_sync import binding_of

    def warn(msg: str) -> None:
        print(f"restore: warning: {msg}; the ACLs were not created", file=log, flush=True)

    if not plan.bindings:
        return 0, 0
    admin = AdminClient(dict(conf, logger=kafka_logger()))
    have: set[tuple] = set()
    for rtype in sorted({b[0] for b in plan.bindings}):
        flt = AclBindingFilter(ResourceType[rtype], None, ResourcePatternType.ANY, None, None,
                               AclOperation.ANY, AclPermissionType.ANY)
        try:
            have.update(binding_of(a) for a in
                        admin.describe_acls(flt, request_timeout=timeout).result(timeout + 5)
                        or [])
        except KafkaException as e:
            text, _ = _why(e)
            warn(f"cannot read the ACLs of {bootstrap}: {text}")
            return 0, 0
    todo = [b for b in plan.bindings if b not in have]
    there = len(plan.bindings) - len(todo)
    if dry_run:
        for b in todo:
            print(f"restore: would create ACL {binding_line(b)}", file=log, flush=True)
        print(f"restore: --dry-run: {len(todo)} ACL binding(s) would be created on {bootstrap}"
              f", {there} already there", file=log, flush=True)
        return 0, there
    if not todo:
        print(f"restore: ACLs: all {there} binding(s) already on {bootstrap}", file=log,
              flush=True)
        return 0, there
    try:
        futures = admin.create_acls([to_kafka(b) for b in todo], request_timeout=timeout)
    except KafkaException as e:
        warn(f"{bootstrap}: {_why(e)[0]}")
        return 0, there
    created = 0
    for acl, fut in futures.items():
        try:
            fut.result(timeout + 5)
            created += 1
        except KafkaException as e:
            text, fatal = _why(e)
            warn(f"{bootstrap}: ACL {binding_line(binding_of(acl))}: {text}")
            if fatal:
                return created, there
    print(f"restore: ACLs: created {created} binding(s) on {bootstrap}"
          + (f", {there} already there" if there else ""), file=log, flush=True)
    return created, there
