"""SaslHandshake (key 17): versions 0-1 (none flexible).

Behaviour: the client names its mechanism; the answer lists the mechanisms this endpoint
offers (sasl.py: the token's PLAIN, the users file's SCRAM-SHA-256/512 and PLAIN) with NONE, or
UNSUPPORTED_SASL_MECHANISM for another. Answered before authentication.

Version notes:
* v0: the client then sends the SASL tokens bare, size-prefixed, with no SaslAuthenticate
  around them (Kafka's legacy flow: server.py reads them, ``conn.raw_sasl``);
* v1: the tokens come in SaslAuthenticate requests (sasl_authenticate.py).
"""

from __future__ import annotations

from ..wire import NONE, UNSUPPORTED_SASL_MECHANISM
from .base import register

KEY, NAME = 17, "SaslHandshake"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 1, None


async def handle(ep, req, conn) -> dict:
    conn.sasl = ep.auth.session(req.body.mechanism)
    ok = conn.sasl is not None
    conn.mechanism_ok = ok
    conn.raw_sasl = ok and req.version == 0
    return {"error_code": NONE if ok else UNSUPPORTED_SASL_MECHANISM,
            "mechanisms": list(ep.auth.mechanisms)}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
