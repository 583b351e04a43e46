"""The one dispatch of the endpoint's requests: the registered API's handler (apis/), with the
ACLs applied around it, its error codes counted (the endpoint's errors metric) and its answer
encoded. docs/kafka-endpoint.md says what each API answers.
"""

from __future__ import annotations

from typing import Any

from .apis import REGISTRY
from .wire import Request, respond


class Dispatcher:
    """``endpoint``: the running endpoint (server.Endpoint: its store view, coordinator, ACL
    gate, advertised address, thread pool runner, metrics)."""

    def __init__(self, endpoint: Any):
        self.ep = endpoint

    async def answer(self, req: Request, conn: Any = None) -> bytes | list | None:
        """The response frame (a list of buffers from an API that encodes itself); None:
        nothing can be answered (a produce with acks=0). ``req`` is of a served API and
        version (apis.lookup); ``conn``: the server's Connection."""
        api = REGISTRY[req.api_key]
        if api.encodes_itself:  # (Fetch: it applies the ACLs and counts its errors itself)
            return await api.handle(self.ep, req, conn)
        gate = self.ep.gate
        if gate is None:
            values = await api.handle(self.ep, req, conn)
        else:  # ACLs (authorize.py): an answer instead of the handler's, or one amended
            instead, req, after = gate.before(req, conn)
            if instead is not None:
                values = instead
            else:
                values = await api.handle(self.ep, req, conn)
                if values is not None:
                    values = after(values)
        if values is None:
            return None
        self.ep.count_errors(api.name, _error_codes(values))
        return respond(api.key, req.version, req.correlation_id, throttle_time=0, **values)


def _error_codes(values):
    """Every ``error_code`` in a response's plain values (nested dicts and lists)."""
    if isinstance(values, dict):
        for k, v in values.items():
            if k == "error_code":
                yield int(v)
            elif isinstance(v, (dict, list, tuple)):
                yield from _error_codes(v)
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from _error_codes(v)
