"""The worker's Prometheus metrics and health (``metrics.listen``; ``--metrics`` of ``mirror``
and ``connect standalone``), read from each task's :class:`TaskMetrics` when Prometheus scrapes
(replication/ops.py): nothing is counted twice and the task loops pay nothing.

Health: a task that failed, or whose Kafka client reported the brokers unreachable and which a
metadata request (made by the check itself, with the task's own consumer settings) still cannot
reach ``metrics.unreachable.timeout.ms`` later, makes ``/healthz`` answer 503 with the reason.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from kcompact.replication.ops import Ops, compaction_metrics, counter, gauge, store_metrics


def worker_metrics(ops: Ops, worker: Any, unreachable_timeout_s: float) -> None:
    """Add the worker's tasks' metrics and health checks to ``ops``."""
    probes: dict[int, Any] = {}

    def collect() -> Iterable:
        lab = ["task"]
        fams = {
            "records": counter("records", "Records handed to the task (sinks) or produced "
                               "(sources): mirrored, restored, written to the map.", lab),
            "bytes": counter("bytes", "Key + value bytes of those records.", lab),
            "errors": counter("task_errors", "Records that failed conversion or delivery.", lab),
            "dropped": counter("records_dropped", "Records skipped under errors.tolerance=all.",
                               lab),
            "dlq": counter("dlq_records", "Records written to the dead-letter topic.", lab),
            "retries": counter("task_retries", "Retried operations.", lab),
        }
        lag = gauge("lag_records", "Per partition: the Kafka topic's end offset minus the "
                    "task's next offset (for the mirror: the store's next offset).",
                    ["topic", "partition"])
        position = gauge("next_offset", "Per partition: the task's next offset.",
                         ["topic", "partition"])
        last_ts = gauge("last_record_timestamp_seconds", "Per partition: the timestamp of the "
                        "last record the task stored (its Kafka timestamp; a record without one "
                        "is not counted).", ["topic", "partition"])
        up = gauge("task_running", "1 while the task's thread runs.", lab)
        for r in list(worker.runners):
            m = r.metrics
            lv = [m.name]
            for key, v in (("records", m.records), ("bytes", m.bytes), ("errors", m.errors),
                           ("dropped", m.skipped), ("dlq", m.dead_lettered),
                           ("retries", m.retries)):
                fams[key].add_metric(lv, v)
            up.add_metric(lv, int(r.alive))
            for tp, v in sorted(m.lag().items(), key=_by_tp):
                lag.add_metric([tp.topic, str(tp.partition)], v)
            for tp, v in sorted(m.position.items(), key=_by_tp):
                if v >= 0:
                    position.add_metric([tp.topic, str(tp.partition)], v)
            for tp, v in sorted(m.last_timestamp.items(), key=_by_tp):
                last_ts.add_metric([tp.topic, str(tp.partition)], v / 1000)
        yield from fams.values()
        yield lag
        yield position
        yield last_ts
        yield up
        tasks = [getattr(r, "task", None) for r in list(worker.runners)]
        stores = [st for st in (getattr(t, "store", None) for t in tasks)
                  if hasattr(st, "write_timings")]
        if stores:
            yield from store_metrics(stores)
        for t in tasks:
            sched = getattr(t, "scheduler", None)
            if sched is not None:
                yield from compaction_metrics(sched)

    def failed() -> str | None:
        bad = [f"task {r.metrics.name} failed: {r.failure}" for r in worker.runners
               if r.failure is not None]
        return "; ".join(bad) or None

    def unreachable() -> str | None:
        now = time.monotonic()
        for r in list(worker.runners):
            m = r.metrics
            since = m.unreachable_since
            if since is None or now - since < unreachable_timeout_s:
                continue
            why = _probe(r, probes)
            if why is None:  # it answers again: the client's error is over
                m.unreachable_since = None
                continue
            return (f"task {m.name}: Kafka unreachable for {now - since:.0f}s "
                    f"({m.unreachable_reason}; a metadata request: {why})")
        return None

    ops.add(collect)
    ops.check(failed)
    ops.check(unreachable)

    def close() -> None:
        for c in probes.values():
            c.close()
        probes.clear()
    ops.on_close(close)


def _by_tp(item: tuple) -> tuple[str, int]:
    return item[0].topic, item[0].partition


def _probe(runner: Any, probes: dict[int, Any]) -> str | None:
    """None when the task's brokers answer a metadata request within 5 s, else why not."""
    from confluent_kafka import Consumer, KafkaException
    conf = runner.kafka_conf()
    if not conf:
        return "no client settings to probe with"
    c = probes.get(id(runner))
    try:
        if c is None:
            from .kafka_clients import kafka_logger
            keep = {k: v for k, v in conf.items() if k in ("bootstrap.servers",) or
                    k.startswith(("security.", "sasl.", "ssl.", "client.dns", "socket."))}
            c = probes[id(runner)] = Consumer(dict(keep, **{
                "group.id": "kcompact-health", "logger": kafka_logger(),
                "error_cb": lambda _e: None}))
        c.list_topics(timeout=5)
        return None
    except KafkaException as e:
        return str(e.args[0].str() if e.args else e)
