"""The APIs the Kafka endpoint serves: one module per API, its versions registered beside its
handler (base.py says how), imported here in key order so that each registers once.
dispatch.py answers every request through ``REGISTRY``; ApiVersions advertises it.
"""

from . import (produce, fetch, list_offsets, metadata, offset_commit,  # noqa: F401
               offset_fetch, find_coordinator, join_group, heartbeat, leave_group, sync_group,
               sasl_handshake, api_versions, init_producer_id, sasl_authenticate)
from .base import NODE_ID, READ_ONLY, REGISTRY, Api, api_keys, lookup, name_of, served

__all__ = ["Api", "NODE_ID", "READ_ONLY", "REGISTRY", "api_keys", "lookup", "name_of",
           "served"]
