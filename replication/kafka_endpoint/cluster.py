"""The cluster the endpoint shows: one broker (node 0) alone, or every live node of a fleet
(replication/fleet/, docs/fleet.md).

In a fleet, Metadata lists every node the ring holds (its advertised Kafka address learned over
the peer protocol), each partition led by its owner on the ring, and each group coordinated by
its owner; a Fetch or ListOffsets of a partition this node does not lead is answered
NOT_LEADER_OR_FOLLOWER, a group request to a node that does not coordinate it NOT_COORDINATOR,
so that clients refresh their metadata and move. Without a fleet every answer is node 0's, as
before.
"""

from __future__ import annotations

from .apis.base import NODE_ID

NOT_LEADER_OR_FOLLOWER = 6
NOT_COORDINATOR = 16


def fleet_of(ep):
    return getattr(ep, "fleet", None)


def node_id(ep) -> int:
    f = fleet_of(ep)
    return NODE_ID if f is None else f.node_id


def brokers(ep, conn) -> list[dict]:
    """Metadata's brokers: this node at the address the client reached, and the live peers."""
    host, port = ep.advertised_for(conn)
    f = fleet_of(ep)
    if f is None:
        return [{"node_id": NODE_ID, "host": host, "port": port, "rack": None}]
    out = []
    for nid, addr in sorted(f.live().items()):
        if nid == f.node_id:
            out.append({"node_id": nid, "host": host, "port": port, "rack": None})
        elif addr is not None:
            out.append({"node_id": nid, "host": addr[0], "port": addr[1], "rack": None})
    return out


def controller(ep) -> int:
    f = fleet_of(ep)
    return NODE_ID if f is None else min(f.live())


def leader(ep, topic: str, partition: int) -> int:
    f = fleet_of(ep)
    return NODE_ID if f is None else f.leader(topic, partition)


def leads(ep, topic: str, partition: int) -> bool:
    f = fleet_of(ep)
    return f is None or f.leader(topic, partition) == f.node_id


def coordinates(ep, group: str) -> bool:
    f = fleet_of(ep)
    return f is None or f.coordinator(group) == f.node_id


def coordinator_address(ep, conn, group: str) -> tuple[int, str, int]:
    """(node id, host, port) of the group's coordinator."""
    host, port = ep.advertised_for(conn)
    f = fleet_of(ep)
    if f is None:
        return NODE_ID, host, port
    nid = f.coordinator(group)
    addr = f.live().get(nid)
    if nid == f.node_id or addr is None:
        return f.node_id, host, port
    return nid, addr[0], addr[1]
