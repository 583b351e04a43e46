"""The mirror's capture of the source's ACL bindings (``sync.topic.acls.enabled``,
``sync.topic.acls.interval.ms``: MirrorMaker 2's names), kept in the store
(replication/acl_capture.py, docs/formats/acls.md).

What: the source's ACL bindings (Kafka's Admin API, DescribeAcls) that apply to the mirrored
topics (TOPIC bindings, LITERAL or PREFIXED, ``*`` included) and to the consumer groups whose
offsets the store keeps on those topics (GROUP bindings; plugins/group_sync.py captures the
groups). Cluster, transactional-id and delegation-token bindings are not kept; neither are
users or their credentials (SCRAM), which Kafka's Admin API does not give back.

When: when the mirror's tasks first open their topics (after the group offsets' first capture,
so that the groups are known), every ``sync.topic.acls.interval.ms`` (default 10 minutes) while
following, and when the mirror stops (after the groups' last capture). The store sink does it
for ``kcompact mirror --engine local`` and ``kcompact connect standalone``; the Spark engine's
driver before and after its job. ``kcompact mirror --no-acls`` turns it off.

A source without an authorizer (Kafka answers SECURITY_DISABLED), or that refuses DescribeAcls
(no Describe on the cluster), gives one warning line, and the mirror goes on; so does any other
failure (a capture never fails a mirror: the next one tries again).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, TextIO

from ..framework.kafka_clients import (admin_settings, kafka_error, kafka_error_text, kafka_logger,
                                        short_lived)
from .periodic_capture import PeriodicCapture

#: MirrorMaker 2's default sync.topic.acls.interval.ms: ten minutes
DEFAULT_INTERVAL_MS = 600_000
#: seconds an Admin API request may take
TIMEOUT_S = 10.0


class AclsUnavailable(Exception):
    """The source cannot give its ACLs: the warning line says why."""


def binding_of(acl: Any) -> tuple[str, ...]:
    """A confluent-kafka AclBinding -> the stored tuple (replication/acl_capture.FIELDS)."""
    return (acl.restype.name, acl.name, acl.resource_pattern_type.name, acl.principal,
            acl.host, acl.operation.name, acl.permission_type.name)


def describe_all(admin: Any, timeout: float = TIMEOUT_S) -> list[tuple[str, ...]]:
    """Every TOPIC and GROUP binding of the cluster (one DescribeAcls per resource type).
    Raises AclsUnavailable with the warning's text when the cluster cannot give them."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import (AclBindingFilter, AclOperation, AclPermissionType,
                                       ResourcePatternType, ResourceType)
    out: list[tuple[str, ...]] = []
    for rtype in (ResourceType.TOPIC, ResourceType.GROUP):
        flt = AclBindingFilter(rtype, None, ResourcePatternType.ANY, None, None,
                               AclOperation.ANY, AclPermissionType.ANY)
        try:
            found = admin.describe_acls(flt, request_timeout=timeout).result(timeout + 5)
        except KafkaException as e:
            err = kafka_error(e)
            code = err.code() if err is not None else None
            text = kafka_error_text(e)
            if code == KafkaError.SECURITY_DISABLED or "no authorizer" in text.lower() or \
                    "security features are disabled" in text.lower():
                raise AclsUnavailable(f"the source has no authorizer ({text}): no ACLs to "
                                      "keep; mirroring without them") from None
            if code in (KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                        KafkaError.TOPIC_AUTHORIZATION_FAILED):
                raise AclsUnavailable(f"the source refused to describe its ACLs ({text}): "
                                      "grant Describe on the cluster to keep them; mirroring "
                                      "without them") from None
            if code in (KafkaError._UNSUPPORTED_FEATURE, KafkaError.UNSUPPORTED_VERSION,
                        KafkaError._NOT_IMPLEMENTED, KafkaError.INVALID_REQUEST):
                raise AclsUnavailable(f"the source does not answer DescribeAcls ({text}); "
                                      "mirroring without ACLs") from None
            raise AclsUnavailable(f"cannot read the source's ACLs ({text}); trying again at "
                                  "the next capture") from None
        out.extend(binding_of(a) for a in found or [])
    if not out and authorizer_of(admin, timeout) == "":
        # Kafka 3.9 (KRaft) answers DescribeAcls without an authorizer with no bindings, not
        # SECURITY_DISABLED: its broker config says there is none
        raise AclsUnavailable("the source has no authorizer (its authorizer.class.name is "
                              "empty): no ACLs to keep; mirroring without them")
    return sorted(set(out))


def authorizer_of(admin: Any, timeout: float = TIMEOUT_S) -> str | None:
    """A broker's ``authorizer.class.name`` ("" for none), or None when it cannot be read (no
    DescribeConfigs on the cluster, a broker that does not describe it)."""
    from confluent_kafka.admin import ConfigResource
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        if not brokers:
            return None
        res = ConfigResource(ConfigResource.Type.BROKER, str(min(brokers)))
        entries = admin.describe_configs([res], request_timeout=timeout)[res].result(timeout + 5)
    except Exception:  # noqa: BLE001 - unknown: no conclusion
        return None
    e = entries.get("authorizer.class.name")
    if e is None:
        return None
    return "" if e.value is None else str(e.value).strip()


def kept_groups(store_url: str, topics: Iterable[str], commitlog_dir: str | None = None
                ) -> set[str]:
    """The groups whose offsets the store keeps on ``topics``."""
    from kcompact.reput import Store
    from kcompact.replication.group_capture import kept_offsets
    topics = set(topics)
    with Store.open(store_url, commitlog_dir=commitlog_dir) as st:
        return {g for (g, t, _), _k in kept_offsets(st).items() if t in topics}


def capture_once(bootstrap: str, kafka_conf: Mapping[str, Any], topics: Iterable[str],
                 writer: Any, warn: Any) -> tuple[int, int] | None:
    """One capture into ``writer`` (an AclCaptureWriter): (added, removed), or None when it
    failed (``warn`` told why)."""
    from confluent_kafka.admin import AdminClient
    topics = set(topics)
    if not topics:
        return 0, 0
    try:
        admin = AdminClient(short_lived(dict(admin_settings(kafka_conf, bootstrap),
                                             logger=kafka_logger())))
        found = describe_all(admin)
    except AclsUnavailable as e:
        warn(str(e))
        return None
    except Exception as e:  # noqa: BLE001 - a capture never fails a mirror
        warn(f"cannot read the source's ACLs ({type(e).__name__}: {e}); trying again at the "
             "next capture")
        return None
    try:
        groups = kept_groups(writer.url, topics, writer.commitlog_dir)
        return writer.capture(found, topics, groups)
    except Exception as e:  # noqa: BLE001 - AclCaptureError, OSError...
        warn(f"the captured ACLs were not kept ({e}); trying again at the next capture")
        return None


class SinkAclSync(PeriodicCapture):
    """The store sink's capture of the source's ACLs (module docstring). Tasks call
    :meth:`opened` with the topics they open (a topic new to the mirror is captured then); a
    thread captures every interval while following; :meth:`stop` captures once more and
    closes the writer."""

    thread_name = "acl-sync"
    every_new_topic = True

    def __init__(self, store_url: str, kafka_conf: Mapping[str, Any], *, writer: str,
                 follow: bool, interval_ms: int = DEFAULT_INTERVAL_MS,
                 commitlog_dir: str | None = None, out: TextIO | None = None,
                 prefix: str = "connect"):
        from kcompact.replication.acl_capture import AclCaptureWriter
        super().__init__(kafka_conf, follow=follow, interval_ms=interval_ms, out=out,
                         prefix=prefix)
        self.writer = AclCaptureWriter(store_url, writer, commitlog_dir=commitlog_dir)
        self.kept = 0           # bindings added over the captures

    def capture_once(self, topics: set[str]) -> tuple[int, int] | None:
        return capture_once(self.bootstrap, self.kafka_conf, topics, self.writer, self._warn)

    def counted(self, result: tuple[int, int]) -> None:
        self.kept += result[0]


__all__ = ["DEFAULT_INTERVAL_MS", "SinkAclSync", "binding_of", "capture_once", "describe_all",
           "kept_groups"]
