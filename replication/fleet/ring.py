"""The fleet's ring: rendezvous (highest random weight) hashing over the live node ids.

Spec: docs/formats/peer-protocol.md (The ring). The owner of a key is the node whose
``BLAKE2b-64(key "|" node id)`` is highest; the owners in falling order are the fallbacks. A node
joining or leaving moves only the keys it gains or owned, and two nodes with the same view of
the live nodes compute the same owners.
"""

from __future__ import annotations

import hashlib
from typing import Iterable


def _score(key: bytes, node: int) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"|%d" % node, digest_size=8).digest(), "big")


class Ring:
    """An immutable ring over ``nodes`` (node ids)."""

    def __init__(self, nodes: Iterable[int]):
        self.nodes = tuple(sorted({int(n) for n in nodes}))

    def __len__(self) -> int:
        return len(self.nodes)

    def __eq__(self, other) -> bool:
        return isinstance(other, Ring) and other.nodes == self.nodes

    def __hash__(self) -> int:
        return hash(self.nodes)

    def __repr__(self) -> str:
        return f"Ring({list(self.nodes)})"

    def owners(self, key: str | bytes) -> list[int]:
        """Every node, the key's owner first."""
        k = key.encode() if isinstance(key, str) else key
        return sorted(self.nodes, key=lambda n: (_score(k, n), n), reverse=True)

    def owner(self, key: str | bytes) -> int | None:
        """The key's owner (None on an empty ring)."""
        if not self.nodes:
            return None
        k = key.encode() if isinstance(key, str) else key
        return max(self.nodes, key=lambda n: (_score(k, n), n))


def block_key(path: str, block: int) -> str:
    return f"b|{path}|{int(block)}"


def partition_key(topic: str, partition: int) -> str:
    return f"p|{topic}|{int(partition)}"


def group_key(group: str) -> str:
    return f"g|{group}"


#: the key whose owner polls the store's journal and catalog heads for the whole fleet
HEADS_KEY = "h|heads"
