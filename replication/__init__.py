"""Message-based replication: `kcompact serve` on a master store, `kcompact replicate` to rebuild a
replica from queue offset 0 (then force-compact, then optionally follow), and
`kcompact verify --against` to compare a replica's live state with the master's.

Protocol: docs/formats/replication-protocol.md. Depends on reput and compaction, never on
connectors (the CLI there calls ``serve``, ``replicate`` and ``verify_against``).
"""

from .acl_capture import acl_bindings
from .errors import (AuthError, MasterStoreError, MasterUnavailableError, ProtocolError,
                     ReplicaError, ReplicationError, RequestError)
from .live import digest_frames, live_offsets
from .protocol import PROTOCOL_VERSION, ServerLimits
from .replica import PartitionResult, ReplicaOptions, ReplicateOptions, Replicator, replicate
from .server import ServeOptions, run_server, serve
from .verify import (AgainstReport, PartitionDiff, VerifyAgainstOptions, compare_stores,
                     verify_against)

__all__ = [
    "acl_bindings",
    "AuthError", "MasterStoreError", "MasterUnavailableError", "ProtocolError", "ReplicaError",
    "ReplicationError", "RequestError",
    "digest_frames", "live_offsets",
    "PROTOCOL_VERSION", "ServerLimits",
    "PartitionResult", "ReplicaOptions", "ReplicateOptions", "Replicator", "replicate",
    "ServeOptions", "run_server", "serve",
    "AgainstReport", "PartitionDiff", "VerifyAgainstOptions", "compare_stores", "verify_against",
]
