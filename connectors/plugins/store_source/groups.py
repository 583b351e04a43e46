"""``restore --groups``: the kept positions of the named groups, translated (translation.py) and
committed on the target cluster.

Which positions: the store's kept group offsets (replication/group_capture.py: captured from the
source by a mirror, or committed on the Kafka endpoint, the endpoint's winning) of the restored
store topic, for the groups whose whole id the regular expression matches; with ``--as-of``, as
kept at or before that time.

Committing: only into a group with no active member on the target cluster (a group with members
is skipped with one line naming it: its consumers would overwrite the position, and Kafka refuses
an offset commit from outside a live group anyway), with the Admin API's
AlterConsumerGroupOffsets, keeping the source commit's metadata. Idempotent: a rerun commits the
same positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TextIO

from kcompact.reput import Store
from kcompact.replication.group_capture import KeptOffset, kept_offsets

from .errors import RestoreError
from .kafka import kafka_failure
from .translation import current_pieces, decode_piece, translate


@dataclass
class GroupPlan:
    """The positions to translate: (group, store partition) -> source offset."""

    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    metadata: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def groups(self) -> list[str]:
        return sorted({g for g, _ in self.positions})


def plan_groups(store: Store, topic: str, regex: str, *, as_of_ms: int | None = None,
                allow_inexact: bool = False) -> GroupPlan:
    """The kept positions of ``topic`` for the groups ``regex`` matches whole."""
    try:
        rx = re.compile(regex)
    except re.error as e:
        raise RestoreError(f"--groups {regex!r} is not a regular expression ({e})") from None
    kept: Mapping[tuple[str, str, int], KeptOffset] = kept_offsets(
        store, as_of_ms=as_of_ms, allow_inexact=allow_inexact)
    plan = GroupPlan()
    for (g, t, p), k in kept.items():
        if t == topic and rx.fullmatch(g):
            plan.positions[(g, p)] = k.offset
            plan.metadata[(g, p)] = k.metadata
    return plan


def commit_positions(conf: Mapping[str, Any], target: str, offsets: Mapping[tuple[str, int], int],
                     metadata: Mapping[tuple[str, int], str], bootstrap: str, timeout: float,
                     log: TextIO) -> tuple[list[str], list[str]]:
    """Commit each group's translated positions on ``target``; returns (committed, skipped)."""
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException
    from confluent_kafka import TopicPartition as KTP
    from confluent_kafka.admin import AdminClient

    from ...framework.kafka_clients import kafka_error_text, kafka_logger
    by_group: dict[str, list[tuple[int, int]]] = {}
    for (g, p), o in sorted(offsets.items()):
        by_group.setdefault(g, []).append((p, o))
    if not by_group:
        return [], []
    admin = AdminClient(dict(conf, logger=kafka_logger()))
    try:
        described = admin.describe_consumer_groups(sorted(by_group), request_timeout=timeout)
    except KafkaException as e:
        raise kafka_failure("describe the consumer groups", e, bootstrap) from None
    committed, skipped = [], []
    for g, parts in by_group.items():
        try:
            desc = described[g].result(timeout)
            members = len(desc.members or [])
        except KafkaException as e:
            raise kafka_failure(f"describe consumer group {g!r}", e, bootstrap) from None
        if members:
            print(f"restore: group {g!r} has {members} active member(s) on {bootstrap}: its "
                  "position was not written (stop its consumers and run the same restore "
                  "again)", file=log, flush=True)
            skipped.append(g)
            continue
        tps = [KTP(target, p, o, metadata=metadata[(g, p)]) if metadata.get((g, p))
               else KTP(target, p, o) for p, o in parts]
        try:
            fut = admin.alter_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(g, tps)], request_timeout=timeout)[g]
            res = fut.result(timeout)
        except KafkaException as e:
            text = kafka_error_text(e)
            print(f"restore: group {g!r}: its position was not written ({text}); run the same "
                  "restore again", file=log, flush=True)
            skipped.append(g)
            continue
        bad = [tp for tp in res.topic_partitions if tp.error is not None]
        if bad:
            print(f"restore: group {g!r}: {target}-{bad[0].partition}: {bad[0].error.str()}; "
                  "run the same restore again", file=log, flush=True)
            skipped.append(g)
            continue
        shown = ", ".join(f"{p}:{o}" for p, o in parts[:8]) + (" ..." if len(parts) > 8 else "")
        print(f"restore: group {g!r}: committed its position on {target} ({shown})",
              file=log, flush=True)
        committed.append(g)
    return committed, skipped


def restore_groups(plan: GroupPlan, raw_maps: Mapping[bytes, bytes | None], progress: Any,
                   conf: Mapping[str, Any], target: str, bootstrap: str, timeout: float,
                   log: TextIO, warn: Callable[[str], None], regex: str
                   ) -> tuple[list[str], list[str]]:
    """The end of a finished restore with ``--groups``: ``plan``'s positions translated through
    the job's offset map records (``raw_maps``: key -> value, the current run's from
    ``progress.run_seq``) and committed. Returns (committed, skipped) group ids."""
    if not progress.mapped:
        raise RestoreError(f"{progress.job} produced records without an offset map: restore "
                           "with --from-scratch --groups to translate group positions")
    if not plan.positions:
        print(f"restore: no kept group position of store topic {progress.store_topic!r} "
              f"matches --groups {regex!r} (see `kcompact groups`)", file=log, flush=True)
        return [], []
    where = f"{progress.job} offset map"
    pieces = current_pieces([m for m in (decode_piece(v, where) for v in raw_maps.values())
                             if m is not None], progress.run_seq, progress.seq)
    ends = end_offsets(conf, target, {p for _, p in plan.positions}, bootstrap, timeout)
    tr = translate(plan.positions, pieces, ends)
    for g, p in tr.approximate:
        warn(f"group {g!r}: {target}-{p}: its position falls inside a chunk another producer "
             "interleaved with; it was set to that chunk's first record")
    return commit_positions(conf, target, tr.offsets, plan.metadata, bootstrap, timeout, log)


def end_offsets(conf: Mapping[str, Any], target: str, parts: set[int], bootstrap: str,
                timeout: float) -> dict[int, int]:
    """The target partitions' end offsets (for a partition nothing was restored to)."""
    from confluent_kafka import Consumer, KafkaException
    from confluent_kafka import TopicPartition as KTP

    from ...framework.kafka_clients import kafka_logger
    from .progress import PROBE_CONSUMER_CONFIG
    c = Consumer(dict(conf, **PROBE_CONSUMER_CONFIG, logger=kafka_logger()))
    try:
        out = {}
        for p in sorted(parts):
            try:
                out[p] = c.get_watermark_offsets(KTP(target, p), timeout=timeout)[1]
            except KafkaException as e:
                raise kafka_failure(f"read the end offset of {target}-{p}", e, bootstrap,
                                    topic=target, timeout=timeout) from None
        return out
    finally:
        c.close()
