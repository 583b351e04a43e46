"""SaslAuthenticate (key 36): versions 0-2, flexible from 2.

Behaviour: one step of the SASL exchange begun by a SaslHandshake v1 (sasl.py: PLAIN, SCRAM);
once it is done the connection is authenticated as ``User:NAME``. A failed step is answered
SASL_AUTHENTICATION_FAILED with the reason, one before a handshake ILLEGAL_SASL_STATE; either
way ``conn.auth_failure`` says why and the server sends the answer, logs the reason and closes
the connection (as Kafka does).

Version notes:
* v1: session_lifetime_ms in the response (0: no re-authentication asked for);
* v2: flexible.
"""

from __future__ import annotations

from ..sasl import SaslFailure
from ..wire import ILLEGAL_SASL_STATE, NONE, SASL_AUTHENTICATION_FAILED
from .base import register

KEY, NAME = 36, "SaslAuthenticate"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 0, 2, 2


def step(conn, data: bytes) -> bytes:
    """One SASL step of ``conn`` (also the bare tokens after a SaslHandshake v0); SaslFailure
    when it fails. The connection is authenticated once the exchange is done."""
    out = conn.sasl.step(data)
    if conn.sasl.done:
        conn.authenticated, conn.principal = True, conn.sasl.principal
        conn.mechanism_ok = False
    return out


async def handle(ep, req, conn) -> dict:
    if not conn.mechanism_ok or conn.sasl is None:
        conn.auth_failure = "SaslAuthenticate before a SaslHandshake"
        return {"error_code": ILLEGAL_SASL_STATE, "auth_bytes": b"",
                "error_message": "SaslAuthenticate before a SaslHandshake naming one of "
                f"{', '.join(ep.auth.mechanisms)}"}
    try:
        out = step(conn, req.body.auth_bytes)
    except SaslFailure as e:
        user = getattr(conn.sasl, "user", None)
        conn.auth_failure = f"{e} (principal User:{user})" if user else str(e)
        return {"error_code": SASL_AUTHENTICATION_FAILED, "auth_bytes": b"",
                "error_message": str(e)}
    return {"error_code": NONE, "error_message": None, "auth_bytes": out}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
