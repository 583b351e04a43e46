"""Which Kafka broker the integration tests use (conftest.py's ``kafka_bootstrap``), as plain
functions so that the choice itself is testable.

The first of: ``KAFKA_BOOTSTRAP_SERVERS`` (a broker you bring: ``external``); testcontainers'
Kafka when a Docker engine answers (``testcontainers``); the embedded Tansu broker (``tansu``).
``KCOMPACT_TEST_BROKER=tansu|testcontainers`` forces one of the last two; forcing
testcontainers without a Docker engine is an error, not a silent fallback.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
BROKER_ENV = "KCOMPACT_TEST_BROKER"
BROKER_CHOICES = ("tansu", "testcontainers")
KAFKA_IMAGE_ENV = "KCOMPACT_TEST_KAFKA_IMAGE"
KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"
DOCKER_PROBE_TIMEOUT_S = 0.8


def apache_kafka_unavailable() -> str | None:
    """None when a real Apache Kafka can be started here (java, and the jars cached or mvn to
    fetch them), else why not, one line (the real-broker tests skip with it)."""
    import shutil

    from kcompact.connectors.devtools import apache_kafka
    if shutil.which("java") is None:
        return "no `java` on PATH: the real Apache Kafka tier needs Java 17 (and Maven)"
    version = apache_kafka.kafka_version()
    if not (apache_kafka.cache_dir() / f"kafka-{version}" / apache_kafka.MARKER).is_file() \
            and shutil.which("mvn") is None:
        return (f"no `mvn` on PATH and Apache Kafka {version}'s jars are not cached: the real "
                "Apache Kafka tier needs Maven once")
    return None


class BrokerChoiceError(Exception):
    """The environment asks for a broker that cannot be had; ``usage`` when the request itself
    is malformed (an unknown name, two contradicting variables)."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def docker_unavailable(timeout: float = DOCKER_PROBE_TIMEOUT_S) -> str | None:
    """None when a Docker engine answers within ``timeout`` seconds, else why not (one line).

    The engine is looked up the way testcontainers does (its properties file, DOCKER_HOST, the
    current docker context, else the default socket), and asked for its API version (what
    docker-py does first) and a ping, each bounded by ``timeout``. Without an engine the first
    request fails at once on a missing or refused socket."""
    import docker  # testcontainers' dependency; both come with kcompact[test]
    import testcontainers.core.docker_client as tc_docker
    try:
        get_host = getattr(tc_docker, "get_docker_host", None)
        host = get_host() if get_host is not None else None
        client = (docker.DockerClient(base_url=host, timeout=timeout) if host
                  else docker.from_env(timeout=timeout))
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - any failure means: no engine to use
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"no Docker engine answers ({first[:200]})"
    return None


_chosen: str | None = None


def broker_kind(env: Mapping[str, str] | None = None,
                probe: Callable[[], str | None] = docker_unavailable) -> str:
    """``external``, ``testcontainers`` or ``tansu`` for this environment (module docstring).
    With the process environment the answer is computed once (one Docker probe per session)."""
    global _chosen
    if env is None:
        if _chosen is None:
            _chosen = broker_kind(os.environ, probe)
        return _chosen
    external = env.get(BOOTSTRAP_ENV, "").strip()
    forced = env.get(BROKER_ENV, "").strip().lower()
    if forced and forced not in BROKER_CHOICES:
        raise BrokerChoiceError(f"{BROKER_ENV}={forced!r}: expected one of "
                                f"{', '.join(BROKER_CHOICES)} (or unset it to choose "
                                "automatically)", usage=True)
    if external:
        if forced:
            raise BrokerChoiceError(f"both {BOOTSTRAP_ENV} and {BROKER_ENV} choose the test "
                                    "broker; unset one of them", usage=True)
        return "external"
    if forced == "tansu":
        return "tansu"  # no Docker probe at all
    why = probe()
    if why is None:
        return "testcontainers"
    if forced == "testcontainers":
        raise BrokerChoiceError(f"{BROKER_ENV}=testcontainers, but {why}: start Docker (or set "
                                f"DOCKER_HOST), or unset {BROKER_ENV} to use the embedded Tansu "
                                "broker")
    return "tansu"


def kafka_image() -> str:
    """The Kafka image testcontainers runs (KRaft mode, so Confluent Platform 7.0 or later)."""
    return os.environ.get(KAFKA_IMAGE_ENV, "").strip() or KAFKA_IMAGE


def kafka_container_class() -> type:
    """testcontainers' KafkaContainer (``testcontainers.community.kafka`` since 4.15, before
    that ``testcontainers.kafka``)."""
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:
        from testcontainers.kafka import KafkaContainer
    return KafkaContainer
