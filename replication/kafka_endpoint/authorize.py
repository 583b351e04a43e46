"""ACLs on the Kafka endpoint: each request authorized as Kafka's broker authorizes it.

``AclSource`` holds the bindings (``--acls-file``, re-read when the file changes: checked at
most once a second; a reload that fails to parse keeps the ACLs in force, with one log line
naming the line; or ``--acls-from-store``). ``Gate`` applies them per API, with the operations
and error codes of Kafka's KafkaApis (docs/security.md):

* Metadata: DESCRIBE on each topic; a topic not allowed is left out of the full listing and
  answered TOPIC_AUTHORIZATION_FAILED when named (whether or not the store has it);
* ListOffsets: DESCRIBE on the topic; Fetch: READ on the topic (TOPIC_AUTHORIZATION_FAILED per
  partition);
* FindCoordinator (group key): DESCRIBE on the group; JoinGroup, SyncGroup, Heartbeat,
  LeaveGroup: READ on the group (GROUP_AUTHORIZATION_FAILED);
* OffsetCommit: READ on the group, then READ on each topic; OffsetFetch: DESCRIBE on the group,
  then DESCRIBE on each topic (not allowed: left out of an all-topics answer).

Each denial is counted by principal (``denied``) and logged once per principal, operation and
resource.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from typing import Any, Callable

from ..acls import Authorizer, AclError, read_acls_file
from .apis import (find_coordinator, heartbeat, join_group, leave_group, list_offsets, metadata,
                   offset_commit, offset_fetch, sync_group)
from .apis.fetch import PartitionResult, encode_fetch, read_partitions
from .store_view import Bounds
from .wire import GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED

METADATA, LIST_OFFSETS, FIND_COORDINATOR = metadata.KEY, list_offsets.KEY, find_coordinator.KEY
JOIN_GROUP, SYNC_GROUP, HEARTBEAT = join_group.KEY, sync_group.KEY, heartbeat.KEY
LEAVE_GROUP, OFFSET_COMMIT, OFFSET_FETCH = leave_group.KEY, offset_commit.KEY, offset_fetch.KEY
RELOAD_CHECK_S = 1.0
_NO_BOUNDS = Bounds(-1, -1)


class AclSource:
    """The authorizer in force: fixed (``bindings``), or a file's, re-read when it changes."""

    def __init__(self, authorizer: Authorizer, log: logging.Logger, path: str | None = None,
                 allow_everyone_if_no_acl_found: bool = False, clock=time.monotonic):
        self.authorizer, self.log, self.path = authorizer, log, path
        self.everyone = allow_everyone_if_no_acl_found
        self.clock = clock
        self._checked = clock()
        self._stamp = self._stat() if path else None
        self._lock = threading.Lock()
        self.reloads = 0
        self.reload_errors = 0

    @classmethod
    def from_file(cls, path: str, log: logging.Logger, everyone: bool = False,
                  clock=time.monotonic) -> "AclSource":
        """The file's ACLs; AclError (naming the line) when it cannot be used."""
        return cls(Authorizer(read_acls_file(path), allow_everyone_if_no_acl_found=everyone),
                   log, path, everyone, clock)

    def _stat(self):
        """The file's content hash (an edit within the file system's timestamp granularity
        changes no mtime; the file is small), None when it cannot be read."""
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:
            return None

    def current(self) -> Authorizer:
        if self.path is not None and self.clock() - self._checked >= RELOAD_CHECK_S:
            with self._lock:
                self._checked = self.clock()
                stamp = self._stat()
                if stamp is not None and stamp != self._stamp:
                    self._stamp = stamp
                    try:
                        self.authorizer = Authorizer(
                            read_acls_file(self.path),
                            allow_everyone_if_no_acl_found=self.everyone)
                        self.reloads += 1
                        self.log.info("reloaded --acls-file %s: %d bindings", self.path,
                                      len(self.authorizer.bindings))
                    except AclError as e:
                        self.reload_errors += 1
                        self.log.warning("kept the previous ACLs: %s", e)
        return self.authorizer


def _host(conn: Any) -> str:
    peer = getattr(conn, "peer", "") or ""
    host = peer.rsplit(":", 1)[0] if ":" in peer else peer
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:"):]
    return host


class Gate:
    """Authorization of each request of a connection (``conn.principal``)."""

    def __init__(self, source: AclSource, log: logging.Logger):
        self.source, self.log = source, log
        #: (principal, resource type, operation) -> denials
        self.denied: dict[tuple[str, str, str], int] = {}
        self._logged: set[tuple[str, str, str, str]] = set()

    def allowed(self, conn: Any, op: str, rtype: str, name: str) -> bool:
        principal = getattr(conn, "principal", None) or "User:ANONYMOUS"
        ok = self.source.current().authorize(principal, _host(conn), op, rtype, name)
        if not ok:
            k = (principal, rtype, op)
            self.denied[k] = self.denied.get(k, 0) + 1
            once = (principal, rtype, op, name)
            if once not in self._logged and len(self._logged) < 100_000:
                self._logged.add(once)
                self.log.warning("denied %s %s on %s %r (from %s): no ACL allows it", principal,
                                 op, rtype, name, _host(conn))
        return ok

    # -- before / after the handlers -----------------------------------------------------------

    def before(self, req: Any, conn: Any) -> tuple[dict | None, Any, Callable[[dict], dict]]:
        """(an answer instead of the handler's, or None; the request to hand on; a function
        applied to the handler's answer)."""
        k, body = req.api_key, req.body
        same = lambda v: v  # noqa: E731
        if k == METADATA:
            return None, req, lambda v: self._metadata(v, body, conn)
        if k == LIST_OFFSETS:
            return None, req, lambda v: self._list_offsets(v, conn)
        if k == FIND_COORDINATOR:
            if int(getattr(body, "key_type", 0)) == 0 and not self.allowed(
                    conn, "DESCRIBE", "GROUP", body.key):
                return {"error_code": GROUP_AUTHORIZATION_FAILED, "error_message": None,
                        "node_id": -1, "host": "", "port": -1}, req, same
            return None, req, same
        if k in (JOIN_GROUP, SYNC_GROUP, HEARTBEAT, LEAVE_GROUP):
            if self.allowed(conn, "READ", "GROUP", body.group_id):
                return None, req, same
            fail: dict = {"error_code": GROUP_AUTHORIZATION_FAILED}
            if k == JOIN_GROUP:
                fail.update(generation_id=-1, protocol_name="", leader="", members=[],
                            member_id=body.member_id)
            elif k == SYNC_GROUP:
                fail.update(assignment=b"")
            return fail, req, same
        if k == OFFSET_COMMIT:
            return self._offset_commit(req, conn)
        if k == OFFSET_FETCH:
            return self._offset_fetch(req, conn)
        return None, req, same

    def _metadata(self, values: dict, body: Any, conn: Any) -> dict:
        named = body.topics is not None
        out = []
        for t in values["topics"]:
            if self.allowed(conn, "DESCRIBE", "TOPIC", t["name"]):
                out.append(t)
            elif named:
                out.append({"error_code": TOPIC_AUTHORIZATION_FAILED, "name": t["name"],
                            "topic_id": t.get("topic_id"), "partitions": []})
        return {**values, "topics": out}

    def _list_offsets(self, values: dict, conn: Any) -> dict:
        for t in values["topics"]:
            if not self.allowed(conn, "DESCRIBE", "TOPIC", t["name"]):
                for p in t["partitions"]:
                    p.update(error_code=TOPIC_AUTHORIZATION_FAILED, offset=-1, timestamp=-1)
        return values

    def _offset_commit(self, req: Any, conn: Any):
        body = req.body
        same = lambda v: v  # noqa: E731
        if not self.allowed(conn, "READ", "GROUP", body.group_id):
            return {"topics": [{"name": t.name, "partitions": [
                {"partition_index": p.partition_index,
                 "error_code": GROUP_AUTHORIZATION_FAILED} for p in t.partitions]}
                for t in body.topics]}, req, same
        denied = [t for t in body.topics if not self.allowed(conn, "READ", "TOPIC", t.name)]
        if not denied:
            return None, req, same
        kept = tuple(t for t in body.topics if t not in denied)
        req2 = req._replace(body=dataclasses.replace(body, topics=kept))

        def merge(values: dict) -> dict:
            rows = {t["name"]: t for t in values["topics"]}
            out = []
            for t in body.topics:
                if t in denied:
                    out.append({"name": t.name, "partitions": [
                        {"partition_index": p.partition_index,
                         "error_code": TOPIC_AUTHORIZATION_FAILED} for p in t.partitions]})
                else:
                    out.append(rows[t.name])
            return {**values, "topics": out}
        return None, req2, merge

    def _offset_fetch(self, req: Any, conn: Any):
        body = req.body
        if not self.allowed(conn, "DESCRIBE", "GROUP", body.group_id):
            parts = [] if body.topics is None else [
                {"name": t.name, "partitions": [
                    {"partition_index": p, "error_code": GROUP_AUTHORIZATION_FAILED,
                     "committed_offset": -1, "committed_leader_epoch": -1, "metadata": ""}
                    for p in t.partition_indexes]} for t in body.topics]
            return {"error_code": GROUP_AUTHORIZATION_FAILED, "topics": parts}, req, \
                lambda v: v

        def post(values: dict) -> dict:
            out = []
            for t in values["topics"]:
                if self.allowed(conn, "DESCRIBE", "TOPIC", t["name"]):
                    out.append(t)
                elif body.topics is not None:
                    for p in t["partitions"]:
                        p.update(error_code=TOPIC_AUTHORIZATION_FAILED, committed_offset=-1,
                                 committed_leader_epoch=-1, metadata="")
                    out.append(t)
            return {**values, "topics": out}
        return None, req, post

    # -- Fetch ---------------------------------------------------------------------------------

    def fetch_denied(self, req: Any, conn: Any) -> set[str]:
        return {t.topic for t in (req.body.topics or ())
                if not self.allowed(conn, "READ", "TOPIC", t.topic)}

    async def fetch_with_denied(self, ep: Any, req: Any, denied: set[str],
                                leads: Any = None) -> list:
        """A Fetch naming a topic not allowed: the allowed ones read once (no long poll: the
        client gets its error at once), the others TOPIC_AUTHORIZATION_FAILED per partition.
        ``leads`` (a fleet): the allowed partitions another node leads are
        NOT_LEADER_OR_FOLLOWER, as in any Fetch."""
        topics = list(req.body.topics or ())
        allowed = [t for t in topics if t.topic not in denied]
        max_bytes = int(getattr(req.body, "max_bytes", 0x7FFFFFFF))
        seen, _ = await ep.run(read_partitions, ep.view, req.version, allowed, max_bytes,
                               leads) if allowed else ([], 0)
        got = dict(seen)
        out = []
        for t in topics:
            if t.topic in denied:
                out.append((t.topic, [PartitionResult(int(p.partition),
                                                      TOPIC_AUTHORIZATION_FAILED, _NO_BOUNDS)
                                      for p in t.partitions]))
            else:
                out.append((t.topic, got[t.topic]))
        return encode_fetch(req.version, req.correlation_id, out)

    def collect(self):
        from ..ops import counter
        d = counter("kafka_authorization_denied", "Kafka requests (per topic or group) an ACL "
                    "denied, by principal, resource type and operation.",
                    ["principal", "resource_type", "operation"])
        for (p, r, o), n in sorted(self.denied.items()):
            d.add_metric([p, r, o], n)
        yield d
