"""Fixtures for tests that talk to a real Kafka-compatible broker.

``kafka_bootstrap`` is the broker for the whole session, the first of:

1. the one named by ``KAFKA_BOOTSTRAP_SERVERS`` (bring your own Kafka);
2. testcontainers' Kafka (``KafkaContainer``, KRaft mode), started for the session and stopped
   at the end, when a Docker engine answers a ping within 0.8 s (brokers.py; with no engine
   the probe is one refused connection, well under a second); 3. an
:class:`kcompact.connectors.devtools.broker.EmbeddedBroker` (Tansu, memory only, 127.0.0.1) started
once
   and stopped at the end.

``KCOMPACT_TEST_BROKER=tansu`` or ``=testcontainers`` forces 3 or 2 (the latter fails the session
with one clear line when no Docker engine answers, since it was asked for);
``KCOMPACT_TEST_KAFKA_IMAGE`` picks the Kafka image. ``kafka_broker_kind`` says which broker
runs (``external``, ``testcontainers`` or ``tansu``), for tests that pin Tansu's quirks.
``make_topic`` creates uniquely named topics on it.

**The real Apache Kafka tier.** ``apache_kafka`` is a real Apache Kafka for the session
(kcompact.connectors.devtools.apache_kafka, the pinned version, fetched with Maven when missing),
started lazily by the first test that asks for it and stopped at the end; the broker you bring
(``KAFKA_BOOTSTRAP_SERVERS``) or testcontainers' Kafka serves instead when it is the session's.
Without ``java`` (or without ``mvn`` and cached jars) those tests skip with the one-line reason.
``any_broker`` runs a test on the session broker (``tansu``: Tansu unless one of the above
replaces it) and on the real Kafka (``kafka``): the tests of Kafka semantics (transactions,
read_committed mirror, restore exactly-once, kv follow, the store sink) take it;
``make_topic`` then creates topics on the broker of the run.

Every test under tests/integration/ is marked ``integration``, so ``pytest -m "not integration"``
runs without starting any process. What the embedded broker does and does not support is written
down in BROKER_NOTES.md next to this file.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from kcompact.connectors.devtools.broker import EmbeddedBroker
from kcompact.connectors.devtools import apache_kafka as _apache_kafka

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from brokers import (BOOTSTRAP_ENV, BrokerChoiceError, apache_kafka_unavailable,  # noqa: E402
                     broker_kind, kafka_container_class, kafka_image)

_TOPIC_READY_TIMEOUT = 15.0
#: Where Apache Kafka's jars are cached, read before any fixture changes KCOMPACT_CACHE_DIR
#: (the S3 fixture points it at a temporary directory for the writers' commit logs).
_KAFKA_CACHE = _apache_kafka.cache_dir()


#: The files that take longest (their tests' sum in a clean-clone run, longest first): run
#: first, so that pytest-xdist's workers (``--dist loadfile``: a file is one unit of work) end
#: together instead of one finishing a long file alone (longest processing time first).
LONGEST_FIRST = ("test_doc_examples.py", "test_client_matrix.py", "test_s3.py",
                 "test_issue44_repair_e2e.py", "test_fleet.py", "test_first_hour.py",
                 "test_spark_cluster.py", "test_packaging.py", "test_demo.py", "test_s3_suite.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session, not only ours: mark by location.
    ours = []
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)
            ours.append(item)
    if len(ours) == len(items):  # (a stable sort: a file's tests keep their order)
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda it: rank.get(Path(str(it.path)).name, len(rank)))


# -- the broker: yours, testcontainers' Kafka, or the embedded Tansu (brokers.py) ----------------


@pytest.fixture(scope="session")
def kafka_broker_kind() -> str:
    """Which broker the session runs: ``external``, ``testcontainers`` or ``tansu``; a
    choice that cannot be honoured ends the session with one line (brokers.py)."""
    try:
        return broker_kind()
    except BrokerChoiceError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR if e.usage
                    else pytest.ExitCode.TESTS_FAILED)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker_kind: str) -> Iterator[str]:
    """``bootstrap.servers`` of the session's broker (module docstring)."""
    broker = _bootstrap(kafka_broker_kind)
    try:
        yield next(broker)
    finally:
        # Kafka clients still alive in garbage (a failed test's traceback holds its frames, and
        # with them the fixtures' clients, such as kafka_admin's) go before the broker, or they
        # log "Connection refused" until the interpreter exits. This collects them now that
        # kcompact's clients no longer hold their owners from C (kafka_clients.ClientReports).
        gc.collect()
        broker.close()  # stops the broker


def _bootstrap(kafka_broker_kind: str) -> Iterator[str]:
    if kafka_broker_kind == "external":
        yield os.environ[BOOTSTRAP_ENV].strip()
    elif kafka_broker_kind == "testcontainers":
        # one broker: the transaction log must not ask for 3 replicas (Kafka's default), or
        # every transactional producer (restore, the transaction tests) waits for a coordinator
        container = (kafka_container_class()(kafka_image()).with_kraft()
                     .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
                     .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1"))
        container.start(timeout=180)  # the JVM's start on a busy 2-core machine (image pull aside)
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
    else:
        with EmbeddedBroker() as broker:
            yield broker.bootstrap_servers


class _SessionAdmin:
    """The session's AdminClient, which the fixture lets go before the broker stops.

    An AdminClient has no close(): it goes with its last reference, and the tests' own
    references (their arguments) live until the end of the session's teardown, after the broker
    stopped, so it logged that it lost the broker. The tests hold this proxy instead (every
    AdminClient method through it); the fixture drops the client itself."""

    def __init__(self, bootstrap: str):
        self.client: AdminClient | None = AdminClient({"bootstrap.servers": bootstrap})

    def __getattr__(self, name: str):
        if self.client is None:
            raise RuntimeError("the session's Kafka admin client is closed (the broker stopped)")
        return getattr(self.client, name)


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> Iterator[AdminClient]:
    admin = _SessionAdmin(kafka_bootstrap)
    yield admin  # type: ignore[misc] - every AdminClient method, through the proxy
    admin.client = None  # before kafka_bootstrap stops the broker


@dataclass
class BrokerUnderTest:
    """One broker a test runs on: ``kind`` is ``tansu``, ``external``, ``testcontainers`` or
    ``kafka`` (the real Apache Kafka of this session)."""

    kind: str
    bootstrap: str
    admin: AdminClient
    #: the ApacheKafkaBroker when this session started one (its logs, data directory)
    process: object | None = None

    @property
    def real_kafka(self) -> bool:
        """A real Kafka: read_committed hides aborted transactions, ListOffsets is right."""
        return self.kind != "tansu"


@pytest.fixture(scope="session")
def apache_kafka(request: pytest.FixtureRequest,
                 kafka_broker_kind: str) -> Iterator[BrokerUnderTest]:
    """A real Apache Kafka for the session (module docstring), started on first use."""
    if kafka_broker_kind in ("external", "testcontainers"):
        bootstrap = os.environ[BOOTSTRAP_ENV].strip() if kafka_broker_kind == "external" \
            else None
        if bootstrap is None:  # the session's testcontainers Kafka is a real Kafka already
            bootstrap = request.getfixturevalue("kafka_bootstrap")
        yield BrokerUnderTest(kafka_broker_kind, bootstrap,
                              AdminClient({"bootstrap.servers": bootstrap}))
        return
    why = apache_kafka_unavailable()
    if why is not None:
        pytest.skip(why)
    try:
        broker = _apache_kafka.ApacheKafkaBroker(cache=_KAFKA_CACHE).start()
    except _apache_kafka.ApacheKafkaError as e:
        pytest.fail(f"the real Apache Kafka did not start: {e}", pytrace=False)
    try:
        yield BrokerUnderTest("kafka", broker.bootstrap_servers,
                         AdminClient({"bootstrap.servers": broker.bootstrap_servers}), broker)
    finally:
        broker.stop()


@pytest.fixture(params=["tansu", "kafka"])
def any_broker(request: pytest.FixtureRequest) -> BrokerUnderTest:
    """The session broker (``tansu``) and the real Apache Kafka (``kafka``), in turn."""
    if request.param == "kafka":
        return request.getfixturevalue("apache_kafka")
    return BrokerUnderTest(request.getfixturevalue("kafka_broker_kind"),
                      request.getfixturevalue("kafka_bootstrap"),
                      request.getfixturevalue("kafka_admin"))


def _admin_of_test(request: pytest.FixtureRequest) -> AdminClient:
    """The admin client of the broker the test runs on: ``any_broker``'s, or ``apache_kafka``'s
    for a real-Kafka-only test, else the session broker's."""
    for name in ("any_broker", "apache_kafka"):
        if name in request.fixturenames:
            return request.getfixturevalue(name).admin
    return request.getfixturevalue("kafka_admin")


@pytest.fixture
def make_topic(request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """Factory: ``make_topic(partitions=N, config={...})`` creates a fresh topic, returns its name.

    The name is unique per call (test name + random suffix), so tests never see each other's
    records on a shared broker. The call returns once metadata shows every partition with a
    leader; the topics are deleted after the test (best effort). The broker is the one the test
    runs on (``any_broker``, ``apache_kafka``, else the session's).
    """
    kafka_admin = _admin_of_test(request)
    created: list[str] = []
    prefix = "it-" + re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:60]

    def make(partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        new = NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})
        kafka_admin.create_topics([new], operation_timeout=10, request_timeout=15)[name].result()
        created.append(name)
        _wait_for_topic(kafka_admin, name, partitions)
        return name

    yield make

    if created:
        futures = kafka_admin.delete_topics(created, operation_timeout=10, request_timeout=15)
        for future in futures.values():
            try:
                future.result()
            except Exception:  # noqa: BLE001 - cleanup must not turn a pass into an error
                pass


def _wait_for_topic(admin: AdminClient, name: str, partitions: int) -> None:
    deadline = time.monotonic() + _TOPIC_READY_TIMEOUT
    while True:
        topic = admin.list_topics(topic=name, timeout=5).topics.get(name)
        if (
            topic is not None
            and topic.error is None
            and len(topic.partitions) == partitions
            and all(p.leader >= 0 for p in topic.partitions.values())
        ):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"topic {name} was created but its {partitions} partition(s) did not all get a "
                f"leader within {_TOPIC_READY_TIMEOUT:.0f}s; check the broker"
            )
        time.sleep(0.05)


# -- connectors (issue 4): Schema Registry, Kafka helpers ---------------------------------------


@pytest.fixture
def schema_registry() -> Iterator[object]:
    """A real HTTP Schema Registry (``schema_registry.py`` beside this file) on 127.0.0.1,
    stopped after the test. ``.url``, ``.register(subject, schema)``, ``.stop()``."""
    import sys

    sys.path.insert(0, str(_HERE))
    try:
        from schema_registry import SchemaRegistry
    finally:
        sys.path.remove(str(_HERE))
    sr = SchemaRegistry().start()
    try:
        yield sr
    finally:
        sr.stop()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- S3 (issue 8): SeaweedFS ------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_store_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """Factory of fresh S3 store URLs on a SeaweedFS server started for the session.

    ``weed mini`` (connectors/devtools/seaweed.py) runs on free ports, every listener on 127.0.0.1,
    its data in a temporary directory; the bucket ``kcompact-it`` is created; ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION`` and ``KCOMPACT_CACHE_DIR`` (the
    writers' local commit-log directories) are set for this process and its children, and restored
    at the end, when the server is stopped (no process left behind).

    ``make(grace_ms=None)`` returns ``s3://kcompact-it/<unique prefix>`` (with
    ``?grace_ms=N`` when given). ``make.server`` is the SeaweedS3 (endpoint, credentials,
    ``client()``), ``make.bucket`` the bucket name.
    """
    from kcompact.connectors.devtools.seaweed import SeaweedS3

    server = SeaweedS3(workdir=str(tmp_path_factory.mktemp("seaweedfs"))).start()
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "KCOMPACT_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in names}
    try:
        bucket = server.create_bucket("kcompact-it")
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            os.environ.pop(k, None)
        os.environ.update(server.env())
        os.environ["KCOMPACT_CACHE_DIR"] = str(tmp_path_factory.mktemp("kcompact-cache"))

        def make(grace_ms: int | None = None) -> str:
            url = f"s3://{bucket}/it-{uuid.uuid4().hex[:12]}"
            return url if grace_ms is None else f"{url}?grace_ms={int(grace_ms)}"

        make.server = server  # type: ignore[attr-defined]
        make.bucket = bucket  # type: ignore[attr-defined]
        yield make
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
