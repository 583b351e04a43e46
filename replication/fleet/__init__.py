"""A fleet of Kafka endpoints over one S3 store (docs/fleet.md): membership, the ring and the
shared block cache. Spec of the peer protocol: docs/formats/peer-protocol.md."""

from .node import Fleet, FleetOptions
from .peers import PeerError, parse_peers
from .ring import Ring

__all__ = ["Fleet", "FleetOptions", "PeerError", "Ring", "parse_peers"]
