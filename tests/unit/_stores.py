"""Store URLs by backend, for unit tests parametrized by backend (not a test module).

A test that takes the ``store_at`` fixture runs twice: ``[local]`` on a directory under
tmp_path, ``[s3]`` on an S3 store in the in-memory S3 (``_fake_s3.FakeS3``). ``store_at(name)``
returns the URL of a (not yet created) store, a different one per name. On ``s3`` the fake is
installed for the test: ``kcompact.reput.s3.make_client`` returns it, so every S3Backend the test's
process makes (``Store.open(url)``, the CLI's ``main`` run in-process) talks to it, and
``KCOMPACT_CACHE_DIR`` (writers' local commit logs) is the test's own directory. Other
processes cannot see the fake: tests that run a store in a child process take their S3 run on
SeaweedFS instead, from tests/integration/test_s3_suite.py, which overrides ``store_at``.

``shared_store_at`` is ``store_at`` for tests whose stores child processes open (the CLI as a
subprocess, a writer to SIGKILL): local here, SeaweedFS in test_s3_suite.py.

A hypothesis test (no function-scoped fixtures) parametrizes ``backend`` itself and calls
``store_url(backend, directory)`` inside ``backend_env(backend, directory)``.

``flip_byte_in_the_middle(url, topic, partition)`` damages a local store: one flipped byte in the
middle of a partition's first segment.

Import the fixtures into a test module to use them:
``from _stores import backend, store_at  # noqa: F401``.
"""

from __future__ import annotations

import os
import sys
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import FakeS3  # noqa: E402

BACKENDS = ("local", "s3")
BUCKET = "bucket"


@contextmanager
def backend_env(backend: str, root: str) -> Iterator[FakeS3 | None]:
    """On ``s3``: the in-memory S3 installed (as module docstring) until the block ends."""
    if backend not in ("s3", "s3-shared"):
        yield None
        return
    from kcompact.reput import s3 as s3mod
    fake = FakeS3(buckets=(BUCKET,))
    old_client, old_cache = s3mod.make_client, os.environ.get("KCOMPACT_CACHE_DIR")
    s3mod.make_client = lambda *a, **k: fake
    os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(str(root), "kcompact-cache")
    try:
        yield fake
    finally:
        s3mod.make_client = old_client
        if old_cache is None:
            os.environ.pop("KCOMPACT_CACHE_DIR", None)
        else:
            os.environ["KCOMPACT_CACHE_DIR"] = old_cache


def store_url(backend: str, root, name: str = "store") -> str:
    """A fresh store URL: ``root/name`` on ``local``, ``s3://bucket/<unique>-name`` on ``s3``
    (inside ``backend_env``)."""
    if backend in ("s3", "s3-shared"):
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}-{name}"
    return os.path.join(str(root), name)


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Iterator[str]:
    """``local`` or ``s3`` (the in-memory S3 installed for the test)."""
    with backend_env(request.param, str(tmp_path)):
        yield request.param


def url_factory(backend: str, root):
    """``make(name="store")`` -> the store URL for ``name`` (the same URL for the same name)."""
    urls: dict[str, str] = {}

    def make(name: str = "store") -> str:
        if name not in urls:
            urls[name] = store_url(backend, root, name)
        return urls[name]
    make.backend = backend  # type: ignore[attr-defined]
    return make


@pytest.fixture
def store_at(backend, tmp_path):
    """Factory: ``store_at(name="store")`` -> a store URL on this test's backend."""
    return url_factory(backend, tmp_path)


@pytest.fixture
def shared_store_at(tmp_path):
    """As ``store_at``, for tests whose stores are opened by child processes too: local only
    here (a child cannot see the in-memory S3); tests/integration/test_s3_suite.py runs the
    same tests with this fixture yielding SeaweedFS stores."""
    return url_factory("local", tmp_path)


def flip_byte_in_the_middle(url: str, topic: str, partition: int) -> str:
    """One flipped byte in the middle of the partition's first segment of the local store at
    ``url``; that segment's path in the store."""
    pdir = os.path.join(url, "partitions", topic, str(partition))
    log = sorted(n for n in os.listdir(pdir) if n.endswith(".log"))[0]
    path = os.path.join(pdir, log)
    middle = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        b = f.read(1)
        f.seek(middle)
        f.write(bytes([b[0] ^ 0xFF]))
    return f"partitions/{topic}/{partition}/{log}"
