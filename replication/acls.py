"""ACL bindings with Kafka's semantics: what a principal may do to a topic, group or cluster.

An ``AclBinding`` is Kafka's (resource type, resource name, pattern type, principal, host,
operation, permission type), all in Kafka's upper-case names. Three ways in:

* ``parse_acls_listing(text)``: what ``kafka-acls --list`` prints (Kafka 3.x), pasted as is::

      Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=orders, patternType=LITERAL)`:
          (principal=User:alice, host=*, operation=READ, permissionType=ALLOW)

  (blank lines, ``#`` comments and ``ACLs for principal ...`` headers are skipped; any other
  line is an ``AclParseError`` naming its number);
* ``bindings_from_dicts(rows)``: dicts with the snake_case keys resource_type, resource_name,
  pattern_type, principal, host, operation, permission_type (what ``mirror`` captures);
* ``AclBinding(...)`` directly.

``Authorizer(bindings).authorize(principal, host, operation, resource_type, name)`` decides as
Kafka's StandardAuthorizer does (docs/security.md): a DENY that matches wins over any ALLOW; a
binding matches the resource when LITERAL and equal, LITERAL ``*`` (every resource of the type),
or PREFIXED and the name starts with it; the principal when equal or ``User:*``; the host when
equal or ``*``; the operation when equal or ALL, and, for an ALLOW only, DESCRIBE is implied by
READ, WRITE, DELETE and ALTER (DESCRIBE_CONFIGS by ALTER_CONFIGS). No matching ALLOW: denied,
unless ``allow_everyone_if_no_acl_found`` and no binding at all names the resource (Kafka's
allow.everyone.if.no.acl.found).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from .errors import ReplicationError

RESOURCE_TYPES = ("TOPIC", "GROUP", "CLUSTER", "TRANSACTIONAL_ID", "DELEGATION_TOKEN", "USER")
PATTERN_TYPES = ("LITERAL", "PREFIXED")
OPERATIONS = ("ALL", "READ", "WRITE", "CREATE", "DELETE", "ALTER", "DESCRIBE", "CLUSTER_ACTION",
              "DESCRIBE_CONFIGS", "ALTER_CONFIGS", "IDEMPOTENT_WRITE", "CREATE_TOKENS",
              "DESCRIBE_TOKENS")
PERMISSIONS = ("ALLOW", "DENY")
WILDCARD = "*"
WILDCARD_PRINCIPAL = "User:*"
#: an ALLOW of one of these operations also allows the key (Kafka's AclEntry.supportedOperations
#: / StandardAuthorizerData: "READ, WRITE, DELETE, ALTER imply DESCRIBE")
IMPLIED_BY = {"DESCRIBE": ("READ", "WRITE", "DELETE", "ALTER"),
              "DESCRIBE_CONFIGS": ("ALTER_CONFIGS",)}
#: the cluster resource's only name (Kafka's ResourcePattern for CLUSTER)
CLUSTER_NAME = "kafka-cluster"


class AclError(ReplicationError):
    """Bindings that cannot be used (a bad field value): fix the ACL source named."""


class AclParseError(AclError):
    """A line of an ACL listing that is not what ``kafka-acls --list`` prints: the message
    names the file and the line number; paste the listing as the tool printed it."""


class NoCapturedAclsError(AclError):
    """``--acls-from-store`` on a store holding no ACLs captured from the source cluster."""


@dataclass(frozen=True)
class AclBinding:
    resource_type: str
    resource_name: str
    pattern_type: str
    principal: str
    host: str
    operation: str
    permission_type: str

    def __post_init__(self) -> None:
        for field, allowed in (("resource_type", RESOURCE_TYPES),
                               ("pattern_type", PATTERN_TYPES),
                               ("operation", OPERATIONS), ("permission_type", PERMISSIONS)):
            v = getattr(self, field)
            if v not in allowed:
                raise AclError(f"ACL {field} {v!r}: use one of {', '.join(allowed)}")
        if not self.resource_name:
            raise AclError("ACL resource_name is empty")
        if ":" not in self.principal:
            raise AclError(f"ACL principal {self.principal!r}: write it TYPE:NAME, e.g. "
                           "User:alice")
        if not self.host:
            raise AclError("ACL host is empty: use * for every host")

    def matches_resource(self, resource_type: str, name: str) -> bool:
        if self.resource_type != resource_type:
            return False
        if self.pattern_type == "LITERAL":
            return self.resource_name == name or self.resource_name == WILDCARD
        return name.startswith(self.resource_name)

    def as_dict(self) -> dict:
        return {"resource_type": self.resource_type, "resource_name": self.resource_name,
                "pattern_type": self.pattern_type, "principal": self.principal,
                "host": self.host, "operation": self.operation,
                "permission_type": self.permission_type}


KEYS = ("resource_type", "resource_name", "pattern_type", "principal", "host", "operation",
        "permission_type")


def bindings_from_dicts(rows: Iterable[dict]) -> list[AclBinding]:
    """Bindings from dicts with exactly the keys ``KEYS`` (string values, Kafka's names)."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != set(KEYS):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise AclError(f"ACL binding {i}: expected the keys {', '.join(KEYS)}; got {got}")
        if not all(isinstance(row[k], str) for k in KEYS):
            raise AclError(f"ACL binding {i}: every value must be a string")
        try:
            out.append(AclBinding(**{k: row[k] for k in KEYS}))
        except AclError as e:
            raise AclError(f"ACL binding {i}: {e}") from None
    return out


_RESOURCE_LINE = re.compile(
    r"Current ACLs for resource `ResourcePattern\(resourceType=([A-Z_]+), name=(.*), "
    r"patternType=([A-Z_]+)\)`:")
_ENTRY_LINE = re.compile(
    r"\(principal=(.+), host=(.+?), operation=([A-Z_]+), permissionType=([A-Z_]+)\)")
_PRINCIPAL_LINE = re.compile(r"ACLs for principal `.*`")


def parse_acls_listing(text: str, source: str = "the ACL listing") -> list[AclBinding]:
    """The bindings of a ``kafka-acls --list`` output; AclParseError naming the line."""
    out: list[AclBinding] = []
    resource: tuple[str, str, str] | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#") or _PRINCIPAL_LINE.fullmatch(line):
            continue
        m = _RESOURCE_LINE.fullmatch(line)
        try:
            if m:
                resource = (m.group(1), m.group(2), m.group(3))
                if resource[0] not in RESOURCE_TYPES or resource[2] not in PATTERN_TYPES:
                    raise AclError(f"resource type {resource[0]} / pattern type {resource[2]} "
                                   "unknown")
                continue
            e = _ENTRY_LINE.fullmatch(line)
            if e is None:
                raise AclError(
                    "not a line kafka-acls --list prints (expected ``Current ACLs for resource "
                    "`ResourcePattern(resourceType=..., name=..., patternType=...)`:`` or "
                    "``(principal=User:..., host=..., operation=..., permissionType=...)``)")
            if resource is None:
                raise AclError("an ACL entry before any `Current ACLs for resource` line")
            out.append(AclBinding(resource[0], resource[1], resource[2], e.group(1),
                                  e.group(2), e.group(3), e.group(4)))
        except AclError as err:
            raise AclParseError(f"{source} line {n}: {err}: {line[:120]!r}") from None
    return out


def read_acls_file(path: str) -> list[AclBinding]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise AclError(f"cannot read --acls-file {path}: {getattr(e, 'strerror', None) or e}"
                       ) from None
    return parse_acls_listing(text, path)


def load_captured_bindings(store) -> list[AclBinding]:
    """The ACL bindings ``kcompact mirror`` captured from the source cluster into ``store`` (a
    Store or its URL; docs/formats/acls.md): NoCapturedAclsError when it keeps none."""
    from .acl_capture import acl_bindings  # the capture reads the store: a layer above this one

    rows = acl_bindings(store)
    if not rows:
        raise NoCapturedAclsError(
            f"the store {getattr(store, 'url', store)} has no captured ACLs; run kcompact mirror "
            "(which captures ACLs) first, or pass --acls-file with the output of kafka-acls "
            "--list")
    return bindings_from_dicts(rows)


class Authorizer:
    """Kafka's authorization decision over a fixed set of bindings."""

    def __init__(self, bindings: Iterable[AclBinding], *,
                 allow_everyone_if_no_acl_found: bool = False,
                 super_users: Iterable[str] = ()):
        self.bindings = tuple(bindings)
        self.allow_everyone_if_no_acl_found = allow_everyone_if_no_acl_found
        self.super_users = frozenset(super_users)
        by_type: dict[str, list[AclBinding]] = {}
        for b in self.bindings:
            by_type.setdefault(b.resource_type, []).append(b)
        self._by_type = by_type

    def authorize(self, principal: str, host: str, operation: str, resource_type: str,
                  name: str) -> bool:
        if principal in self.super_users:
            return True
        allowed = False
        any_acl = False
        for b in self._by_type.get(resource_type, ()):
            if not b.matches_resource(resource_type, name):
                continue
            any_acl = True
            if b.principal != principal and b.principal != WILDCARD_PRINCIPAL:
                continue
            if b.host != host and b.host != WILDCARD:
                continue
            if b.permission_type == "DENY":
                if b.operation in ("ALL", operation):
                    return False
                continue
            if b.operation in ("ALL", operation) or b.operation in IMPLIED_BY.get(operation, ()):
                allowed = True
        if not any_acl and self.allow_everyone_if_no_acl_found:
            return True
        return allowed
