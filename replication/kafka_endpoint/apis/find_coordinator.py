"""FindCoordinator (key 10): versions 0-3, flexible from 3.

Behaviour:
* node 0, at the address the client reached (``ep.advertised_for``), coordinates every group;
  in a fleet the group's owner on the ring does (cluster.py);
* a transaction coordinator (key type 1) is refused: TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
  non-retriable, with the read-only message (a transactional producer then fails at once rather
  than retrying); any other key type: INVALID_REQUEST, as Kafka answers an unknown one;
* with ACLs: DESCRIBE on the group (authorize.Gate).

Version notes:
* v0: a group key only (no key type, no error message);
* v1: key_type, throttle_time_ms and error_message;
* v2: the same fields;
* v3: flexible;
* v4: batched coordinator keys (KIP-699): not served.
"""

from __future__ import annotations

from ..wire import INVALID_REQUEST, NONE, TRANSACTIONAL_ID_AUTHORIZATION_FAILED
from .. import cluster
from .base import READ_ONLY, register

KEY, NAME = 10, "FindCoordinator"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 3, 3
#: the key types
GROUP_KEY, TRANSACTION_KEY = 0, 1


async def handle(ep, req, conn) -> dict:
    key_type = int(getattr(req.body, "key_type", GROUP_KEY))
    if key_type != GROUP_KEY:
        code = TRANSACTIONAL_ID_AUTHORIZATION_FAILED if key_type == TRANSACTION_KEY \
            else INVALID_REQUEST
        why = READ_ONLY if key_type == TRANSACTION_KEY else \
            f"unknown coordinator key type {key_type} (0: group, 1: transaction)"
        return {"error_code": code, "error_message": why, "node_id": -1, "host": "",
                "port": -1}
    nid, host, port = cluster.coordinator_address(ep, conn, str(req.body.key))
    return {"error_code": NONE, "error_message": None, "node_id": nid, "host": host,
            "port": port}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
