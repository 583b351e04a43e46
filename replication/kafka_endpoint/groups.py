"""The endpoint's group coordinator: Kafka's classic group protocol on one node.

What Kafka's GroupCoordinator does, for the group APIs the endpoint serves (apis/join_group.py,
sync_group.py, heartbeat.py, leave_group.py, offset_commit.py, offset_fetch.py: their versions
beside them), in the event loop:

* **states** Empty -> PreparingRebalance -> CompletingRebalance -> Stable, and back to
  PreparingRebalance when a member joins, leaves or expires;
* **the join barrier**: a rebalance completes once every member of the group has rejoined, or
  when the longest rebalance timeout of its members has passed (those that did not rejoin are
  removed); a first join waits ``INITIAL_DELAY_S`` so that members starting together land in one
  generation. The generation then moves on, the protocol is the first of the leader's that all
  members support, the leader (the previous one if it rejoined, else the first to join) gets the
  members' metadata;
* **KIP-394**: a JoinGroup v4+ without a member id is answered MEMBER_ID_REQUIRED with the id to
  use; a member that never comes back with it is forgotten after its session timeout;
* **sessions**: a member not heard from (join, sync, heartbeat, commit) for its session timeout
  is removed and the group rebalances;
* **generation checks** on SyncGroup, Heartbeat and OffsetCommit (ILLEGAL_GENERATION,
  UNKNOWN_MEMBER_ID, REBALANCE_IN_PROGRESS as Kafka answers them);
* **offsets**: OffsetCommit appends to the store (replication/group_offsets.py, durable before
  the answer); a commit with generation -1 and no member id (a consumer using ``assign``) is
  accepted while the group has no members, as Kafka does. OffsetFetch merges what was committed
  here with what a mirror captured from the source cluster.

Static membership (``group.instance.id``) is accepted as a plain member (no fencing of a static
member by instance id). Errors are the codes Kafka answers; nothing here closes a connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable

from ..group_offsets import GroupOffset, GroupOffsets, GroupOffsetsError
from .wire import (COORDINATOR_NOT_AVAILABLE, ILLEGAL_GENERATION, INCONSISTENT_GROUP_PROTOCOL,
                   INVALID_GROUP_ID, INVALID_SESSION_TIMEOUT, MEMBER_ID_REQUIRED, NONE,
                   REBALANCE_IN_PROGRESS, UNKNOWN_MEMBER_ID, UNKNOWN_TOPIC_OR_PARTITION, ms)

EMPTY, PREPARING, COMPLETING, STABLE = "Empty", "PreparingRebalance", "CompletingRebalance", \
    "Stable"
#: Kafka's group.min/max.session.timeout.ms are 6 s and 30 min; the lower bound is 1 s here so
#: that tests and short-lived tools need not wait
MIN_SESSION_MS, MAX_SESSION_MS = 1000, 1800000
#: Kafka's group.initial.rebalance.delay.ms is 3 s; members starting together join within this
INITIAL_DELAY_S = 0.3
#: how often sessions are checked
TICK_S = 0.25


class Member:
    __slots__ = ("member_id", "instance_id", "client_id", "session_ms", "rebalance_ms",
                 "protocol_type", "protocols", "assignment", "join_waiter", "sync_waiter",
                 "seen", "joined")

    def __init__(self, member_id: str, client_id: str):
        self.member_id, self.client_id = member_id, client_id
        self.instance_id: str | None = None
        self.session_ms = self.rebalance_ms = 10000
        self.protocol_type = ""
        self.protocols: list[tuple[str, bytes]] = []
        self.assignment = b""
        self.join_waiter: asyncio.Future | None = None
        self.sync_waiter: asyncio.Future | None = None
        self.seen = time.monotonic()
        self.joined = False  # rejoined in the rebalance under way


class Group:
    def __init__(self, group_id: str):
        self.group_id = group_id
        self.state = EMPTY
        self.generation = 0
        self.protocol_type: str | None = None
        self.protocol: str | None = None
        self.leader: str | None = None
        self.members: dict[str, Member] = {}
        self.pending: dict[str, float] = {}   # KIP-394 ids handed out, not joined yet: expiry
        self.rebalance_deadline = 0.0
        self.delay_until = 0.0    # a first join's delay (INITIAL_DELAY_S) ends then
        self.join_task: asyncio.Task | None = None


class Coordinator:
    """The groups of one endpoint (module docstring). ``offsets`` keeps committed offsets;
    ``run(fn, *args)`` runs blocking work in the endpoint's thread pool."""

    def __init__(self, offsets: GroupOffsets, run: Callable, log: logging.Logger,
                 known: Callable[[str, int], bool]):
        self.offsets, self.run, self.log, self.known = offsets, run, log, known
        self.groups: dict[str, Group] = {}
        self._ticker: asyncio.Task | None = None

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for g in self.groups.values():
            if g.join_task is not None:
                g.join_task.cancel()
            for m in g.members.values():
                for w in (m.join_waiter, m.sync_waiter):
                    if w is not None and not w.done():
                        w.cancel()

    def _group(self, group_id: str) -> Group:
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = Group(group_id)
        return g

    # -- JoinGroup -----------------------------------------------------------------------------

    async def join(self, version: int, req: Any, client_id: str) -> dict:
        gid = req.group_id
        session_ms = ms(req.session_timeout)
        rebalance_ms = ms(getattr(req, "rebalance_timeout", session_ms))
        if rebalance_ms < 0:
            rebalance_ms = session_ms
        fail = {"generation_id": -1, "protocol_name": "", "leader": "", "members": [],
                "member_id": req.member_id}
        if not gid:
            return {**fail, "error_code": INVALID_GROUP_ID}
        if not MIN_SESSION_MS <= session_ms <= MAX_SESSION_MS:
            return {**fail, "error_code": INVALID_SESSION_TIMEOUT}
        g = self._group(gid)
        protocols = [(p.name, bytes(p.metadata)) for p in req.protocols]
        if not protocols or (g.protocol_type is not None and g.members
                             and req.protocol_type != g.protocol_type) or (
                g.members and not self._common(g, protocols, req.member_id)):
            return {**fail, "error_code": INCONSISTENT_GROUP_PROTOCOL}
        mid = req.member_id
        if not mid:
            mid = f"{client_id or 'member'}-{uuid.uuid4()}"
            if version >= 4:  # KIP-394: the client must come back with this id
                g.pending[mid] = time.monotonic() + session_ms / 1000.0
                return {**fail, "member_id": mid, "error_code": MEMBER_ID_REQUIRED}
        elif mid not in g.members and mid not in g.pending:
            return {**fail, "error_code": UNKNOWN_MEMBER_ID}
        g.pending.pop(mid, None)
        m = g.members.get(mid)
        if m is None:
            m = g.members[mid] = Member(mid, client_id)
        m.instance_id = getattr(req, "group_instance_id", None)
        m.session_ms, m.rebalance_ms = session_ms, rebalance_ms
        m.protocol_type, m.protocols = req.protocol_type, protocols
        m.seen = time.monotonic()
        g.protocol_type = req.protocol_type
        if m.join_waiter is not None and not m.join_waiter.done():
            m.join_waiter.cancel()  # a member that joins again replaces its earlier join
        m.join_waiter = asyncio.get_running_loop().create_future()
        m.joined = True
        if g.state != PREPARING:
            self._prepare(g, initial=g.state == EMPTY)
        self._maybe_complete(g)
        try:
            return await m.join_waiter
        except asyncio.CancelledError:
            return {**fail, "member_id": mid, "error_code": UNKNOWN_MEMBER_ID}

    @staticmethod
    def _common(g: Group, protocols: list, member_id: str) -> bool:
        names = {n for n, _ in protocols}
        for m in g.members.values():
            if m.member_id != member_id:
                names &= {n for n, _ in m.protocols}
        return bool(names)

    def _prepare(self, g: Group, initial: bool = False) -> None:
        """Start a rebalance: every member must rejoin before the longest rebalance timeout."""
        g.state = PREPARING
        for m in g.members.values():
            m.joined = m.join_waiter is not None and not m.join_waiter.done()
            if m.sync_waiter is not None and not m.sync_waiter.done():
                m.sync_waiter.set_result({"error_code": REBALANCE_IN_PROGRESS,
                                          "assignment": b""})
        timeout = max((m.rebalance_ms for m in g.members.values()), default=0) / 1000.0
        g.rebalance_deadline = time.monotonic() + timeout
        g.delay_until = time.monotonic() + INITIAL_DELAY_S if initial else 0.0
        if g.join_task is not None:
            g.join_task.cancel()
        g.join_task = asyncio.get_running_loop().create_task(self._join_timer(g, initial))

    async def _join_timer(self, g: Group, initial: bool) -> None:
        try:
            if initial:
                await asyncio.sleep(INITIAL_DELAY_S)
                g.delay_until = 0.0
                if self._maybe_complete(g):
                    return
            await asyncio.sleep(max(0.0, g.rebalance_deadline - time.monotonic()))
            if g.state == PREPARING:
                for mid in [mid for mid, m in g.members.items() if not m.joined]:
                    self.log.info("group %s: member %s did not rejoin within the rebalance "
                                  "timeout; removed", g.group_id, mid)
                    del g.members[mid]
                self._complete(g)
        except asyncio.CancelledError:
            pass

    def _maybe_complete(self, g: Group) -> bool:
        """Complete the rebalance when every member has rejoined (not before the first join's
        delay is over: the timer calls again then)."""
        if g.state != PREPARING or not all(m.joined for m in g.members.values()):
            return False
        if time.monotonic() < g.delay_until:
            return False
        task = g.join_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        self._complete(g)
        return True

    def _complete(self, g: Group) -> None:
        if not g.members:
            g.state, g.protocol, g.leader = EMPTY, None, None
            g.generation += 1
            return
        g.generation += 1
        order = list(g.members.values())
        leader = g.members.get(g.leader) if g.leader else None
        if leader is None:
            leader = order[0]
        g.leader = leader.member_id
        common = set.intersection(*({n for n, _ in m.protocols} for m in order))
        g.protocol = next(n for n, _ in leader.protocols if n in common)
        g.state = COMPLETING
        members = [{"member_id": m.member_id, "group_instance_id": m.instance_id,
                    "metadata": dict(m.protocols)[g.protocol]} for m in order]
        now = time.monotonic()
        for m in order:
            m.seen = now
            m.joined = False
            m.assignment = b""
            if m.join_waiter is not None and not m.join_waiter.done():
                m.join_waiter.set_result({
                    "error_code": NONE, "generation_id": g.generation,
                    "protocol_type": g.protocol_type, "protocol_name": g.protocol,
                    "leader": g.leader, "member_id": m.member_id,
                    "members": members if m.member_id == g.leader else []})

    # -- SyncGroup, Heartbeat, LeaveGroup ------------------------------------------------------

    def _check(self, gid: str, generation: int, mid: str) -> tuple[int, Group | None]:
        g = self.groups.get(gid)
        if g is None or mid not in g.members:
            return UNKNOWN_MEMBER_ID, g
        if generation != g.generation:
            return ILLEGAL_GENERATION, g
        g.members[mid].seen = time.monotonic()
        return NONE, g

    async def sync(self, req: Any) -> dict:
        err, g = self._check(req.group_id, int(req.generation_id), req.member_id)
        if err != NONE:
            return {"error_code": err, "assignment": b""}
        if g.state == PREPARING:
            return {"error_code": REBALANCE_IN_PROGRESS, "assignment": b""}
        m = g.members[req.member_id]
        if g.state == STABLE:
            return {"error_code": NONE, "assignment": m.assignment,
                    "protocol_type": g.protocol_type, "protocol_name": g.protocol}
        if req.member_id == g.leader:
            given = {a.member_id: bytes(a.assignment) for a in req.assignments}
            for mm in g.members.values():
                mm.assignment = given.get(mm.member_id, b"")
            g.state = STABLE
            for mm in g.members.values():
                if mm.sync_waiter is not None and not mm.sync_waiter.done():
                    mm.sync_waiter.set_result({"error_code": NONE, "assignment": mm.assignment})
            return {"error_code": NONE, "assignment": m.assignment,
                    "protocol_type": g.protocol_type, "protocol_name": g.protocol}
        m.sync_waiter = asyncio.get_running_loop().create_future()
        try:
            got = await asyncio.wait_for(asyncio.shield(m.sync_waiter), m.session_ms / 1000.0)
        except asyncio.TimeoutError:
            got = {"error_code": REBALANCE_IN_PROGRESS, "assignment": b""}
        except asyncio.CancelledError:
            got = {"error_code": UNKNOWN_MEMBER_ID, "assignment": b""}
        return {**got, "protocol_type": g.protocol_type, "protocol_name": g.protocol}

    def heartbeat(self, req: Any) -> int:
        err, g = self._check(req.group_id, int(req.generation_id), req.member_id)
        if err != NONE:
            return err
        return REBALANCE_IN_PROGRESS if g.state == PREPARING else NONE

    def leave(self, req: Any) -> int:
        g = self.groups.get(req.group_id)
        if g is None or req.member_id not in g.members:
            return UNKNOWN_MEMBER_ID
        self._remove(g, req.member_id, "left the group")
        return NONE

    def _remove(self, g: Group, mid: str, why: str) -> None:
        m = g.members.pop(mid)
        for w in (m.join_waiter, m.sync_waiter):
            if w is not None and not w.done():
                w.set_result({"error_code": UNKNOWN_MEMBER_ID, "assignment": b"",
                              "generation_id": -1, "protocol_name": "", "leader": "",
                              "member_id": mid, "members": []})
        self.log.info("group %s: member %s %s", g.group_id, mid, why)
        if g.state == PREPARING:
            self._maybe_complete(g)
        elif g.members:
            self._prepare(g)
        else:
            g.state, g.protocol, g.leader = EMPTY, None, None
            g.generation += 1

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for g in list(self.groups.values()):
                for mid, until in list(g.pending.items()):
                    if now > until:
                        del g.pending[mid]
                for mid, m in list(g.members.items()):
                    waiting = m.join_waiter is not None and not m.join_waiter.done()
                    if not waiting and now - m.seen > m.session_ms / 1000.0:
                        self._remove(g, mid, f"sent no heartbeat for {m.session_ms} ms "
                                             "(session timeout)")

    # -- offsets -------------------------------------------------------------------------------

    async def commit(self, req: Any) -> list:
        """OffsetCommit: [{"name", "partitions": [{"partition_index", "error_code"}]}]."""
        gid, mid = req.group_id, req.member_id
        gen = int(getattr(req, "generation_id_or_member_epoch", -1))
        g = self.groups.get(gid)
        err = NONE
        if not gid:
            err = INVALID_GROUP_ID if hasattr(req, "group_id") else NONE
        elif gen < 0 and not mid:
            if g is not None and g.members:
                err = UNKNOWN_MEMBER_ID  # Kafka: a simple commit to a group with members
        else:
            err, g = self._check(gid, gen, mid)
            if err == NONE and g.state == PREPARING:
                err = REBALANCE_IN_PROGRESS
        rows, answer = [], []
        for t in req.topics:
            parts = []
            for p in t.partitions:
                pe = err
                if pe == NONE and not self.known(t.name, int(p.partition_index)):
                    pe = UNKNOWN_TOPIC_OR_PARTITION
                if pe == NONE:
                    rows.append((t.name, int(p.partition_index), GroupOffset(
                        int(p.committed_offset), p.committed_metadata or "",
                        int(getattr(p, "committed_leader_epoch", -1)))))
                parts.append({"partition_index": p.partition_index, "error_code": pe})
            answer.append({"name": t.name, "partitions": parts})
        if rows:
            try:
                await self.run(self.offsets.commit, gid, rows)
            except (GroupOffsetsError, OSError, Exception) as e:  # noqa: BLE001
                self.log.warning("group %s: commit of %d offsets not kept: %s", gid, len(rows),
                                 " ".join(str(e).split())[:300])
                for t in answer:
                    for p in t["partitions"]:
                        if p["error_code"] == NONE:
                            p["error_code"] = COORDINATOR_NOT_AVAILABLE
        return answer

    def fetch_offsets(self, req: Any) -> list:
        """OffsetFetch: [{"name", "partitions": [...]}] (all the group's when topics is null)."""
        have = self.offsets.get(req.group_id)
        if req.topics is None:
            wanted: dict[str, list[int]] = {}
            for (t, p) in sorted(have):
                wanted.setdefault(t, []).append(p)
        else:
            wanted = {t.name: list(t.partition_indexes) for t in req.topics}
        out = []
        for name, parts in wanted.items():
            rows = []
            for p in parts:
                o = have.get((name, int(p)))
                rows.append({"partition_index": p, "error_code": NONE,
                             "committed_offset": o.offset if o else -1,
                             "committed_leader_epoch": o.leader_epoch if o else -1,
                             "metadata": o.metadata if o else ""})
            out.append({"name": name, "partitions": rows})
        return out
