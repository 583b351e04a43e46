"""The Kafka endpoint's API registry (replication/kafka_endpoint/apis/, issue 48): one module per
API, its versions declared beside its handler, one registry that ApiVersions advertises, requests
are checked against and the server dispatches through.

* every module of the package declares KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM and
  registers exactly those, its opening line naming them; nothing is registered by any other
  module;
* FLEXIBLE_FROM is Kafka's flexibleVersions: kio's request and response schemas (generated from
  Kafka's JSON) are flexible at exactly the served versions >= it;
* the ranges are those docs/kafka-endpoint.md's table lists (the contract users read);
* ApiVersions, at every version served, answers the registry; an API registered at run time is
  advertised and answered through the one dispatch, and refused once it is gone.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys

import pytest
from kio.index import load_request_schema, load_response_schema

sys.path.insert(0, os.path.dirname(__file__))

from test_kafka_endpoint_model import Client, Served  # noqa: E402
from test_kafka_endpoint_server import _decoded, store  # noqa: E402,F401

from kcompact.replication.kafka_endpoint import apis  # noqa: E402
from kcompact.replication.kafka_endpoint.apis import base  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _api_modules() -> list:
    return [importlib.import_module(f"{apis.__name__}.{m.name}")
            for m in pkgutil.iter_modules(apis.__path__) if m.name != "base"]


def test_every_api_module_registers_the_versions_it_declares():
    mods = _api_modules()
    assert len(mods) == len(apis.REGISTRY)
    for mod in mods:
        api = apis.REGISTRY[mod.KEY]
        assert mod.API is api, mod.__name__
        assert (api.name, api.min_version, api.max_version, api.flexible_from) == (
            mod.NAME, mod.MIN_VERSION, mod.MAX_VERSION, mod.FLEXIBLE_FROM), mod.__name__
        assert api.handle is mod.handle, mod.__name__
        # the module opens with its API, key and versions (kfake's "ApiVersions: v0-4")
        first = mod.__doc__.splitlines()[0]
        want = f"{mod.NAME} (key {mod.KEY}): versions {mod.MIN_VERSION}-{mod.MAX_VERSION}"
        assert first.startswith(want), (mod.__name__, first)
        assert "Version notes:" in mod.__doc__, mod.__name__


def test_flexible_from_is_kafkas_flexible_versions():
    for api in apis.REGISTRY.values():
        for v in range(api.min_version, api.max_version + 1):
            assert load_request_schema(api.key, v).__flexible__ is api.flexible(v), (api.name, v)
            assert load_response_schema(api.key, v).__flexible__ is api.flexible(v), \
                (api.name, v)


def _documented_ranges() -> dict[str, tuple[int, int]]:
    """API name -> (min, max) from docs/kafka-endpoint.md's table of APIs."""
    out = {}
    with open(os.path.join(ROOT, "docs", "kafka-endpoint.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 3 or not re.fullmatch(r"\d+-\d+(, \d+-\d+)*", cells[1]):
                continue
            names = re.findall(r"(\w+) \(\d+\)", cells[0])
            spans = [tuple(map(int, s.split("-"))) for s in cells[1].split(", ")]
            assert len(names) == len(spans), line
            out.update(zip(names, spans))
    return out


def test_the_registered_ranges_are_the_documented_ones():
    assert _documented_ranges() == {a.name: (a.min_version, a.max_version)
                                    for a in apis.REGISTRY.values()}


def test_registering_a_key_twice_or_a_non_range_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        base.register(1, "Fetch", 4, 12, 12, apis.REGISTRY[1].handle)
    with pytest.raises(ValueError, match="not a range"):
        base.register(60, "DescribeCluster", 1, 0, 0, apis.REGISTRY[1].handle)
    assert 60 not in apis.REGISTRY


def _advertised(body) -> dict[int, tuple[int, int]]:
    return {int(k.api_key): (int(k.min_version), int(k.max_version)) for k in body.api_keys}


def test_api_versions_answers_the_registry(store):
    srv = Served(store)
    try:
        c = Client(srv.port)
        for v in range(apis.api_versions.MIN_VERSION, apis.api_versions.MAX_VERSION + 1):
            body = _decoded(18, v, c.call(18, v))
            assert int(body.error_code) == 0
            assert _advertised(body) == apis.served()
            assert [int(k.api_key) for k in body.api_keys] == sorted(apis.REGISTRY)
        c.close()
    finally:
        srv.close()


def test_an_api_registered_at_run_time_is_advertised_and_dispatched(store):
    """DescribeCluster (key 60) v0, registered by a test: ApiVersions lists it, the server
    hands its request to the registered handler and encodes its values; removed again, a
    request for it closes the connection as for any API not served."""
    seen = []

    async def handle(ep, req, conn):
        seen.append((req.api_key, req.version))
        return {"error_code": 0, "cluster_id": ep.cluster_id, "controller_id": 0,
                "brokers": [], "cluster_authorized_operations": 0}

    srv = Served(store)
    api = base.register(60, "DescribeCluster", 0, 0, 0, handle)
    try:
        c = Client(srv.port)
        assert _advertised(_decoded(18, 3, c.call(18, 3)))[60] == (0, 0)
        got = _decoded(60, 0, c.call(60, 0, include_cluster_authorized_operations=False))
        assert seen == [(60, 0)]
        assert (int(got.error_code), got.cluster_id) == (0, srv.ep.cluster_id)
        assert srv.ep.requests["DescribeCluster"] == 1
        del apis.REGISTRY[60]
        assert 60 not in _advertised(_decoded(18, 3, c.call(18, 3)))
        with pytest.raises(AssertionError, match="closed"):
            c.call(60, 0, include_cluster_authorized_operations=False)
        c.close()
    finally:
        if apis.REGISTRY.get(60) is api:
            del apis.REGISTRY[60]
        srv.close()
