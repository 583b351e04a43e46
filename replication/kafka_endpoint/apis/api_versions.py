"""ApiVersions (key 18): versions 0-3, flexible from 3.

Behaviour:
* answers every API registered in this package with its version range, in key order (built
  from the registry: base.api_keys), error NONE;
* a request of a version above 3 (or below 0) is answered by the server before decoding
  (``fallback``): UNSUPPORTED_VERSION with a v0 body listing the versions served; the Java
  client then retries with the highest version listed, as against Kafka's own broker;
* answered before SASL authentication, as Kafka answers it.

Version notes:
* v1: throttle_time_ms;
* v2: the same fields (throttling after the response);
* v3: flexible; client_software_name / version in the request (ignored here), supported and
  finalized features (none answered);
* v4 (KIP-511's UNSUPPORTED_VERSION v0 downgrade only): not served; answered by ``fallback``.
"""

from __future__ import annotations

from ..wire import NONE, UNSUPPORTED_VERSION, respond
from .base import api_keys, register

KEY, NAME = 18, "ApiVersions"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 3, 3


async def handle(ep, req, conn) -> dict:
    return {"error_code": NONE, "api_keys": api_keys()}


def fallback(correlation_id: int) -> bytes:
    """The answer to an ApiVersions request of a version this endpoint does not know: an
    UNSUPPORTED_VERSION v0 body with the versions served."""
    return respond(KEY, 0, correlation_id, error_code=UNSUPPORTED_VERSION, api_keys=api_keys())


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
