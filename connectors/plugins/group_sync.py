"""The mirror's capture of the source's consumer-group offsets (``sync.group.offsets.enabled``,
MirrorMaker 2's names), kept in the store (replication/group_capture.py,
docs/formats/group-offsets.md, origin ``source``).

What: the committed offsets of the source's consumer groups on the mirrored topics (Kafka's
Admin API: ListGroups, then OffsetFetch per group), for the groups whose whole id ``groups``
matches (default: every group) and ``groups.exclude`` does not. Only positions that changed
since the last capture are appended (each record's timestamp is when it was captured), so a
store keeps a history of positions that ``restore --as-of`` reads back.

When: when the mirror's tasks first open their topics (before any record is fetched), every
``sync.group.offsets.interval.ms`` (default 60 s) while following, and when the mirror stops.
The store sink does it for ``kcompact mirror --engine local`` and ``kcompact connect
standalone``; the Spark engine's driver calls :func:`capture_once` before and after its job.

A source that refuses the group APIs (no Describe on the groups, an old broker) gives one
warning line naming what is missing, and the mirror goes on; so does any other failure (a
capture never fails a mirror: the next one tries again).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Iterable, Mapping, TextIO

from ..framework.kafka_clients import (admin_settings, kafka_error, kafka_error_text, kafka_logger,
                                        short_lived)
from .periodic_capture import PeriodicCapture

#: MirrorMaker 2's default: once a minute
DEFAULT_INTERVAL_MS = 60_000
#: seconds an Admin API request may take
TIMEOUT_S = 10.0


class GroupFilter:
    """``groups`` (default every group) and ``groups.exclude``, each matched whole."""

    def __init__(self, include: str | None, exclude: str | None):
        self.include = re.compile(include or ".*")
        self.exclude = re.compile(exclude) if exclude else None

    def __call__(self, group: str) -> bool:
        return bool(self.include.fullmatch(group)) and not (
            self.exclude is not None and self.exclude.fullmatch(group))


def _busy_coordinator(exc: BaseException) -> bool:
    """A ListGroups error that passes: a coordinator still loading its groups (a broker just
    started, or a new leader of ``__consumer_offsets`` partitions), or not there yet."""
    from confluent_kafka import KafkaError
    err = exc if hasattr(exc, "code") else kafka_error(exc)  # (a KafkaException, or its error)
    return err is not None and err.code() in (KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                                              KafkaError.COORDINATOR_NOT_AVAILABLE,
                                              KafkaError.NOT_COORDINATOR)


def list_groups(admin: Any, timeout: float = TIMEOUT_S, *, pause_s: float = 0.25) -> Any:
    """ListGroups on every broker (Admin API). A broker whose coordinator is still loading
    answers with the groups loaded so far and an error: asked again until it answers whole or
    ``timeout`` passed (a capture then keeps what it got: the next one gets the rest). Raises
    KafkaException when no broker listed its groups."""
    from confluent_kafka import KafkaException
    deadline = time.monotonic() + timeout
    while True:
        listing = admin.list_consumer_groups(request_timeout=timeout).result(timeout + 5)
        errors = listing.errors or []
        if errors and all(_busy_coordinator(e) for e in errors) \
                and time.monotonic() + pause_s < deadline:
            time.sleep(pause_s)
            continue
        if errors and not listing.valid:  # the first error says why
            err = errors[0]
            raise err if isinstance(err, KafkaException) else KafkaException(err)
        return listing


def read_source_offsets(admin: Any, topics: set[str], wanted: Callable[[str], bool],
                        timeout: float = TIMEOUT_S) -> list[tuple[str, str, int, int, str]]:
    """(group, topic, partition, offset, metadata) of every committed offset of a wanted group
    on ``topics``. Raises KafkaException when the cluster refuses the group APIs; a group that
    cannot be read alone is skipped."""
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException
    listing = list_groups(admin, timeout)
    names = sorted(g.group_id for g in listing.valid or [] if wanted(g.group_id))
    rows: list[tuple[str, str, int, int, str]] = []
    for g in names:  # OffsetFetch is answered per group (the coordinator's)
        try:
            res = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(g)], request_timeout=timeout)[g].result(timeout + 5)
        except KafkaException as e:
            err = kafka_error(e)
            from confluent_kafka import KafkaError
            if err is not None and err.code() in (KafkaError.GROUP_AUTHORIZATION_FAILED,
                                                  KafkaError.GROUP_ID_NOT_FOUND):
                continue  # this group only
            raise
        for tp in res.topic_partitions or []:
            if tp.topic in topics and tp.offset >= 0 and tp.error is None:
                rows.append((g, tp.topic, int(tp.partition), int(tp.offset),
                             tp.metadata or ""))
    return rows


def capture_once(bootstrap: str, kafka_conf: Mapping[str, Any], topics: Iterable[str],
                 writer: Any, wanted: Callable[[str], bool], warn: Callable[[str], None]
                 ) -> int | None:
    """One capture into ``writer`` (a CaptureWriter); the records appended, or None when it
    failed (``warn`` told why)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient
    topics = set(topics)
    if not topics:
        return 0
    try:
        admin = AdminClient(short_lived(dict(admin_settings(kafka_conf, bootstrap),
                                             logger=kafka_logger())))
        rows = read_source_offsets(admin, topics, wanted)
    except KafkaException as e:
        err = kafka_error(e)
        code = err.code() if err is not None else None
        if code in (KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                    KafkaError.TOPIC_AUTHORIZATION_FAILED):
            warn(f"the source refused to list or describe its consumer groups "
                 f"({kafka_error_text(e)}): grant Describe on the cluster and on the groups to "
                 "keep their offsets; mirroring without them")
        elif code in (KafkaError._UNSUPPORTED_FEATURE, KafkaError.UNSUPPORTED_VERSION,
                      KafkaError._NOT_IMPLEMENTED, KafkaError.INVALID_REQUEST):
            warn(f"the source does not answer the consumer group APIs "
                 f"({kafka_error_text(e)}); mirroring without group offsets")
        else:
            warn(f"cannot read the source's consumer group offsets ({kafka_error_text(e)}); "
                 "trying again at the next capture")
        return None
    except Exception as e:  # noqa: BLE001 - a capture never fails a mirror
        warn(f"cannot read the source's consumer group offsets ({type(e).__name__}: {e}); "
             "trying again at the next capture")
        return None
    try:
        return writer.capture(rows)
    except Exception as e:  # noqa: BLE001 - GroupOffsetsError, OSError...
        warn(f"the captured group offsets were not kept ({e}); trying again at the next "
             "capture")
        return None


class SinkGroupSync(PeriodicCapture):
    """The store sink connector's capture (module docstring). Tasks call :meth:`opened` with
    the topics they open (the first ones are captured then); a thread captures every interval
    while following; :meth:`stop` captures once more and closes the writer."""

    thread_name = "group-sync"
    every_new_topic = False

    def __init__(self, store_url: str, kafka_conf: Mapping[str, Any], *, writer: str,
                 follow: bool, interval_ms: int = DEFAULT_INTERVAL_MS,
                 groups: str | None = None, exclude: str | None = None,
                 commitlog_dir: str | None = None, out: TextIO | None = None,
                 prefix: str = "connect"):
        from kcompact.replication.group_capture import CaptureWriter
        super().__init__(kafka_conf, follow=follow, interval_ms=interval_ms, out=out,
                         prefix=prefix)
        self.wanted = GroupFilter(groups, exclude)
        self.writer = CaptureWriter(store_url, writer, commitlog_dir=commitlog_dir)
        self.kept = 0           # records appended

    def capture_once(self, topics: set[str]) -> int | None:
        return capture_once(self.bootstrap, self.kafka_conf, topics, self.writer, self.wanted,
                            self._warn)

    def counted(self, result: int) -> None:
        self.kept += result


__all__ = ["DEFAULT_INTERVAL_MS", "GroupFilter", "SinkGroupSync", "capture_once", "list_groups",
           "read_source_offsets"]
