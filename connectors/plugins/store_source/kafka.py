"""The restore's Kafka side: topics created with the store's partition count, and a Kafka failure
as one line that names the cause and what to do (the ACL a principal needs, an unreachable
broker, a fenced transactional id).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from ...framework.kafka_clients import kafka_error, kafka_error_text
from .errors import RestoreError


AUTH_CODES: set[int] = set()
UNSUPPORTED_CODES: set[int] = set()


def load_codes() -> None:
    """Fill AUTH_CODES and UNSUPPORTED_CODES (on first use: confluent_kafka loads librdkafka)."""
    from confluent_kafka import KafkaError as E
    if not AUTH_CODES:
        AUTH_CODES.update({E.TOPIC_AUTHORIZATION_FAILED, E.CLUSTER_AUTHORIZATION_FAILED,
                            E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                            E.GROUP_AUTHORIZATION_FAILED, E._AUTHENTICATION,
                            E.SASL_AUTHENTICATION_FAILED})
        UNSUPPORTED_CODES.update({E._UNSUPPORTED_FEATURE, E.UNSUPPORTED_VERSION,
                                   E._NOT_IMPLEMENTED, E.UNSUPPORTED_FOR_MESSAGE_FORMAT,
                                   E.COORDINATOR_NOT_AVAILABLE, E._TIMED_OUT})


def kafka_failure(what: str, exc: BaseException, bootstrap: str, *, topic: str | None = None,
                  timeout: float | None = None) -> RestoreError:
    """One line for a Kafka failure: authorization, an unreachable broker, or the error text."""
    from confluent_kafka import KafkaError as E
    load_codes()
    err = kafka_error(exc)
    code = err.code() if err is not None else None
    text = kafka_error_text(exc)
    if code in AUTH_CODES:
        acl = {E.TOPIC_AUTHORIZATION_FAILED: f"DESCRIBE, CREATE and WRITE on topic {topic}"
               if topic else "the topic ACLs",
               E.CLUSTER_AUTHORIZATION_FAILED: "CREATE on the cluster (or create the topic "
               "yourself)",
               E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "WRITE and DESCRIBE on the "
               "transactional id (or restore with exactly.once.support=disabled)"}.get(
                   code, "valid credentials (-X sasl.* / ssl.*)")
        return RestoreError(f"not authorized to {what} on {bootstrap} ({text}); the principal "
                            f"needs {acl}")
    if code in (E._FENCED, E.PRODUCER_FENCED, E.INVALID_PRODUCER_EPOCH):
        return RestoreError(f"cannot {what} on {bootstrap}: another restore of the same job "
                            f"took over its transactional id ({text}); one run per job at a "
                            "time")
    if code in (E._TRANSPORT, E._ALL_BROKERS_DOWN, E._RESOLVE) or (
            code == E._TIMED_OUT and timeout is not None):
        wait = f" within {timeout:.0f} s" if timeout else ""
        return RestoreError(f"cannot reach Kafka at {bootstrap}{wait} to {what} ({text}); check "
                            "--bootstrap-servers and that the broker is up")
    return RestoreError(f"cannot {what} on {bootstrap}: {text}")


def _describe(consumer: Any, topic: str, bootstrap: str, timeout: float) -> int | None:
    """Partition count of a topic, None when it does not exist (a consumer metadata request,
    which never auto-creates the topic)."""
    from confluent_kafka import KafkaError, KafkaException
    try:
        md = consumer.list_topics(topic=topic, timeout=timeout)
    except KafkaException as e:
        raise kafka_failure(f"read the metadata of topic {topic!r}", e, bootstrap, topic=topic,
                            timeout=timeout) from None
    t = md.topics.get(topic)
    if t is None or (t.error is not None and t.error.code() in (
            KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)):
        return None
    if t.error is not None:
        from confluent_kafka import KafkaException as KE
        raise kafka_failure(f"describe topic {topic!r}", KE(t.error), bootstrap, topic=topic)
    return len(t.partitions)


def ensure_topic(admin: Any, consumer: Any, topic: str, partitions: int, bootstrap: str, *,
                 config: Mapping[str, str], replication_factor: int, timeout: float
                 ) -> tuple[int, bool]:
    """(partition count, created now): creates the topic when missing, and waits until the
    metadata shows every partition with a leader."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic
    have = _describe(consumer, topic, bootstrap, timeout)
    if have is not None:
        return have, False
    new = NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor,
                   config=dict(config))
    try:
        admin.create_topics([new], operation_timeout=timeout,
                            request_timeout=timeout)[topic].result()
    except KafkaException as e:
        err = kafka_error(e)
        if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise kafka_failure(f"create topic {topic!r} ({partitions} partitions)", e,
                                bootstrap, topic=topic, timeout=timeout) from None
        created = False
    else:
        created = True
    deadline = time.monotonic() + timeout
    while True:
        md = consumer.list_topics(topic=topic, timeout=timeout).topics.get(topic)
        if md is not None and md.error is None and md.partitions and \
                all(p.leader >= 0 for p in md.partitions.values()):
            return len(md.partitions), created
        if time.monotonic() > deadline:
            raise RestoreError(f"topic {topic!r} was created on {bootstrap} but its partitions "
                               f"got no leader within {timeout:.0f} s; check the brokers")
        time.sleep(0.05)


def delete_topic(conf: Mapping[str, Any], topic: str, timeout: float) -> str | None:
    """Delete ``topic`` with a new admin client of ``conf``; None when done, else why not."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient
    from ...framework.kafka_clients import kafka_logger
    try:
        admin = AdminClient(dict(conf, logger=kafka_logger()))
        admin.delete_topics([topic], operation_timeout=timeout,
                            request_timeout=timeout)[topic].result(timeout)
    except KafkaException as e:
        return kafka_error_text(e)
    except Exception as e:  # noqa: BLE001 - a timeout of the future; reported, not raised
        return f"{type(e).__name__}: {e}"
    return None
