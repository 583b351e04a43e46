"""InitProducerId (key 22): versions 0-4, flexible from 2. Refused.

Behaviour:
* refused as Kafka refuses a principal without write access: an idempotent producer (no
  transactional id) CLUSTER_AUTHORIZATION_FAILED (Kafka's answer without IdempotentWrite on the
  cluster), a transactional one TRANSACTIONAL_ID_AUTHORIZATION_FAILED; producer id and epoch
  -1; counted as a refused produce;
* the response has no message field; both codes are fatal in every client (none retries), which
  prints the code's name (docs/kafka-endpoint.md lists what each prints);
* advertised (it is the idempotent and transactional producers' first request) so that a
  producer is refused with an authorization error rather than failing on versions
  (kafka-python: IncompatibleBrokerVersion; the Java producer: UnsupportedVersionException).

Version notes:
* v1: the same fields;
* v2: flexible;
* v3: producer_id and producer_epoch in the request (KIP-360, ignored here);
* v4: the same fields (KIP-588's error codes).
"""

from __future__ import annotations

from ..wire import CLUSTER_AUTHORIZATION_FAILED, TRANSACTIONAL_ID_AUTHORIZATION_FAILED
from .base import register

KEY, NAME = 22, "InitProducerId"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 4, 2


async def handle(ep, req, conn) -> dict:
    ep.count_refused_produce()
    tid = getattr(req.body, "transactional_id", None)
    code = TRANSACTIONAL_ID_AUTHORIZATION_FAILED if tid else CLUSTER_AUTHORIZATION_FAILED
    return {"error_code": code, "producer_id": -1, "producer_epoch": -1}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
