"""The registry every served API enters, beside its handler (franz-go's kfake ``regKey``).

Each module of this package serves one Kafka API: it opens with what it answers and its version
notes, declares ``KEY``, ``NAME``, ``MIN_VERSION``, ``MAX_VERSION`` and ``FLEXIBLE_FROM`` (the
first version with compact encodings and tagged fields, Kafka's ``flexibleVersions``; None: no
flexible version served) and registers its handler with them. ApiVersions advertises what is
registered, requests are checked against it, and the endpoint dispatches through it
(dispatch.py); nothing else lists the APIs or their versions.

A handler is ``async def handle(ep, req, conn)``: ``ep`` the running Endpoint (server.py),
``req`` the decoded wire.Request, ``conn`` the server's Connection. It answers the response's
fields as plain values (wire.build's dict: the dispatcher applies the ACLs, counts the error
codes and encodes the frame), or, when ``encodes_itself`` (Fetch), the encoded frame as a list
of buffers, or None: nothing can be answered (the connection is closed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..wire import WireError

#: the one broker's node id (Metadata, FindCoordinator)
NODE_ID = 0
READ_ONLY = ("this Kafka endpoint serves a kcompact store read-only: produce to the source "
             "cluster, which the store mirrors")


@dataclass(frozen=True)
class Api:
    key: int
    name: str
    min_version: int
    max_version: int
    #: the first flexible version (compact encodings, tagged fields); None: none served
    flexible_from: int | None
    handle: Callable[[Any, Any, Any], Awaitable[Any]]
    #: the handler writes its own frame (Fetch: stored batch bytes without a copy) and applies
    #: the ACLs itself
    encodes_itself: bool = False

    def serves(self, version: int) -> bool:
        return self.min_version <= version <= self.max_version

    def flexible(self, version: int) -> bool:
        return self.flexible_from is not None and version >= self.flexible_from


#: API key -> Api, filled as the modules of this package are imported (apis/__init__.py)
REGISTRY: dict[int, Api] = {}


def register(key: int, name: str, min_version: int, max_version: int,
             flexible_from: int | None, handle: Callable, *,
             encodes_itself: bool = False) -> Api:
    """Enter one API; an error for a key registered twice or a range that is not one."""
    if key in REGISTRY:
        raise ValueError(f"API key {key} ({name}) is registered twice")
    if not 0 <= min_version <= max_version:
        raise ValueError(f"{name}: versions {min_version}-{max_version} are not a range")
    if flexible_from is not None and flexible_from < 0:
        raise ValueError(f"{name}: flexible from version {flexible_from}")
    api = Api(key, name, min_version, max_version, flexible_from, handle, encodes_itself)
    REGISTRY[key] = api
    return api


def name_of(key: int) -> str:
    """The API's Kafka name (``Fetch``), or ``key N`` for a key not served."""
    api = REGISTRY.get(key)
    return api.name if api is not None else f"key {key}"


def lookup(key: int, version: int) -> Api:
    """The served API of a request; WireError (the connection is closed with its reason
    logged) for a key or version not served."""
    api = REGISTRY.get(key)
    if api is None:
        raise WireError(f"API key {key} (version {version}) is not served by this read-only "
                        "endpoint")
    if not api.serves(version):
        raise WireError(f"{api.name} version {version} is not served (versions "
                        f"{api.min_version}-{api.max_version} are)")
    return api


def served() -> dict[int, tuple[int, int]]:
    """API key -> (min, max) version served."""
    return {k: (a.min_version, a.max_version) for k, a in sorted(REGISTRY.items())}


def api_keys() -> list[dict]:
    """ApiVersions' ``api_keys``: every registered API in key order."""
    return [{"api_key": a.key, "min_version": a.min_version, "max_version": a.max_version}
            for _, a in sorted(REGISTRY.items())]
