"""Group offsets in a fleet: one writer of ``__kcompact-group-offsets`` partition 0, fenced.

A group's coordinator (its owner on the ring) answers its OffsetCommits; the records are
written by ONE node, the **offsets writer**: the owner of the topic's partition 0 on the ring
(``p|__kcompact-group-offsets|0``). A coordinator that is not the writer forwards the commit over
the peer protocol (``POST /peer/v1/commit``) and answers the client once the writer has made it
durable. The writer is fenced through the store: before its first write it claims the next
**epoch** with a conditional put (``create_exclusive``) of
``fleet/group-offsets-writer/<20-digit epoch>.json``, waits ``LEASE_S`` (so that a previous
writer's commit already checked finishes), and before every commit checks that no later epoch
exists; a writer that finds one stops writing (it forwards, or fails the commit: the client
retries). A coordinator reloads the offsets from the store when its ring changes, so a group's
new coordinator reads what the old one committed. Spec: docs/formats/peer-protocol.md.
"""

from __future__ import annotations

import json
import threading
import time

from ..group_offsets import TOPIC, GroupOffset, GroupOffsets, GroupOffsetsError
from .peers import PeerError
from .ring import partition_key

EPOCH_DIR = "fleet/group-offsets-writer"
#: seconds a new writer waits after claiming its epoch before its first write; a commit whose
#: epoch check is older than half of it is not written
LEASE_S = 3.0
WRITER_KEY = partition_key(TOPIC, 0)


def epoch_path(epoch: int) -> str:
    return f"{EPOCH_DIR}/{epoch:020d}.json"


class FleetOffsets:
    """``GroupOffsets``' interface (load, get, groups, commit, close) for a node of ``fleet``."""

    def __init__(self, inner: GroupOffsets, fleet, fs, log):
        self.inner, self.fleet, self.fs, self.log = inner, fleet, fs, log
        self._lock = threading.Lock()
        self._loaded_at = -1
        self.epoch: int | None = None
        self._claimed = 0.0
        self.lost = 0

    # -- reads ---------------------------------------------------------------------------------

    def load(self) -> int:
        changes = self.fleet.ring_changes
        n = self.inner.load()
        self._loaded_at = changes
        return n

    def _fresh(self) -> None:
        if self.fleet.ring_changes != self._loaded_at:
            self.fleet.ring()  # (updates ring_changes first)
            with self._lock:
                if self.fleet.ring_changes != self._loaded_at:
                    self.load()

    def get(self, group: str) -> dict[tuple[str, int], GroupOffset]:
        self._fresh()
        return self.inner.get(group)

    def groups(self) -> set[str]:
        return self.inner.groups()

    def close(self) -> None:
        self.inner.close()

    # -- commits -------------------------------------------------------------------------------

    def commit(self, group: str, rows) -> None:
        rows = [(t, int(p), o) for t, p, o in rows]
        writer = self.fleet.ring().owner(WRITER_KEY)
        if writer == self.fleet.node_id:
            self.write(group, rows)
            return
        with self._lock:
            if self.epoch is not None:  # no longer the writer: let the new one open it
                self.epoch = None
                self.inner.reopen()
        try:
            self.fleet.peers[writer].client.commit(group, rows)
        except PeerError as e:
            raise GroupOffsetsError(f"the offsets writer (node {writer}) did not keep the "
                                    f"commit: {e}") from None
        self.inner.remember(group, rows)

    def write(self, group: str, rows) -> None:
        """This node as the writer: fenced, then appended (a peer's forwarded commit too)."""
        if self.fleet.ring().owner(WRITER_KEY) != self.fleet.node_id:
            raise GroupOffsetsError(f"node {self.fleet.node_id} is not the offsets writer "
                                    "of the fleet now")
        with self._lock:
            t0 = self._fence()
            if time.monotonic() - t0 > LEASE_S / 2:
                raise GroupOffsetsError("the offsets writer's epoch check took too long; "
                                        "commit again")
            self.inner.commit(group, rows)

    def _epochs(self) -> list[int]:
        try:
            names = self.fs.listdir(EPOCH_DIR)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            stem = n.rsplit("/", 1)[-1].removesuffix(".json")
            if stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def _fence(self) -> float:
        """Claim an epoch when this node holds none, wait out its lease, then check that no
        later epoch exists; returns when that check was made."""
        if self.epoch is None:
            for _ in range(20):
                have = self._epochs()
                nxt = (have[-1] + 1) if have else 1
                doc = json.dumps({"node_id": self.fleet.node_id,
                                  "claimed_ms": int(time.time() * 1000)}).encode()
                if self.fs.create_exclusive(epoch_path(nxt), doc):
                    self.epoch, self._claimed = nxt, time.monotonic()
                    self.log.info("fleet: node %d writes the group offsets (epoch %d)",
                                  self.fleet.node_id, nxt)
                    break
            else:
                raise GroupOffsetsError("could not claim the offsets writer's epoch")
            self.inner.reopen()  # the previous writer's records: the partition read afresh
        wait = self._claimed + LEASE_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        checked = time.monotonic()
        newest = self._epochs()
        if newest and newest[-1] > self.epoch:
            self.log.warning("fleet: node %d's offsets writer epoch %d was taken over (epoch "
                             "%d)", self.fleet.node_id, self.epoch, newest[-1])
            self.lost += 1
            self.epoch = None
            self.inner.reopen()
            raise GroupOffsetsError("another node writes the group offsets now; commit again")
        return checked
