"""``kcompact mirror --engine spark``: one Spark task per topic-partition, then compaction.

The driver checks the topics (named, or matched by ``--topics-regex``) and the -X settings,
creates the store, syncs the topics' configs from Kafka (plugins/config_sync.py), dispatches what
dead writers left, and reads each partition's end offset from the consumer side (never ListOffsets
"latest", which Tansu gets wrong); then one Spark task per topic-partition runs the store sink
(connectors/plugins/store_sink.py, through the framework's worker, exactly as the local engine
does) with its own commit-log writer ``spark-<topic>-<partition>``, reput included; then a
compaction stage, one task per partition the planner picks (compact_job.py). A task resumes from
the store's own next offset of its partition, and a retried task reopens (and so recovers) the
same commit log: retries neither duplicate nor lose.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence, TextIO

from kcompact.compaction import DEFAULT_MAP_MEMORY, REPAIR_HINT, plan
from kcompact.reput import CorruptRecordError, ReputError, Store, StoreLockedError

from ...errors import ConnectorsError
from ...framework.api import TaskFailedError, TopicPartition
from ...framework.kafka_clients import kafka_error_text, kafka_logger
from ...framework.worker import Worker
from ...plugins.store_sink import StoreSinkConnector
from ...plugins.config_sync import sync_configs as sync_configs_of
from ..options import MirrorOptions, add_mirror, lag_text, mirror_props
from .compact_job import compact_partitions_spark, compaction_lines
from .errors import MirrorTaskError
from .session import run_job, spark_active, spark_session, stage_counts

PROGRESS_INTERVAL = 2.0
_WRITER_MAX = 128


def spark_writer_id(topic: str, partition: int) -> str:
    """The commit-log writer of a Spark mirror task: one per topic-partition, the same on
    every attempt and every run (so a retry reopens, and so recovers, the log it wrote)."""
    w = f"spark-{topic}-{partition}"
    if len(w) <= _WRITER_MAX:
        return w
    digest = hashlib.blake2b(topic.encode(), digest_size=6).hexdigest()
    return f"spark-{topic[:_WRITER_MAX - 40]}-{digest}-{partition}"


class SparkStoreSinkConnector(StoreSinkConnector):
    """The store sink of one Spark mirror task: the driver created the store and recovered
    every writer before the job."""

    RECOVER_WRITERS = False


@dataclass(frozen=True)
class _MirrorJob:
    """What every mirror task needs (pickled to the executors)."""

    bootstrap: str
    store: str
    kafka_config: tuple[tuple[str, str], ...]
    batch_max: int | None = None
    lock_wait_s: float = 60.0
    upload: str = "auto"   # --upload (WriterOptions.upload)
    schema_registry: str | None = None  # --schema-registry: each task keeps its schemas


def _wait_for_writer(store_url: str, writer: str, timeout: float) -> None:
    """Open (and so recover) this task's commit log, waiting while a previous attempt of the
    same task that is still dying holds it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            Store.open(store_url, writer=writer, create=True).close()
            return
        except StoreLockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


_FROZEN = False


def _freeze_heap() -> None:
    """Once per Python worker: move what is alive then (pyspark, kcompact, numba and the
    modules they loaded) into the collector's permanent generation (``gc.freeze``), so that
    the collections made while a task runs stop walking all of it again and again. Measured
    (one-off `perf` of a 2M-record Spark mirror): the collector was ~7% of the Python workers'
    and librdkafka threads' samples, most of the CPU a Spark task spends beyond the local
    engine's; `bench/spark.py --rounds 3`, two runs each, alternating: Spark 2.15-2.50 s
    without, 1.76-2.25 s with (ratio to local 0.59-0.61 -> 0.72-0.73)."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


def _mirror_partition(job: _MirrorJob, item: tuple[str, int, int, int], attempt: int) -> dict:
    """One topic-partition, in a Spark task: the store sink with writer spark-<topic>-<p>."""
    _freeze_heap()

    topic, partition, start, end = item
    t0, started_at = time.monotonic(), time.time()
    writer = spark_writer_id(topic, partition)
    _wait_for_writer(job.store, writer, job.lock_wait_s)
    props = mirror_props(topic, job.store, partitions=[partition], follow=False,
                         kafka_config=dict(job.kafka_config), writer=writer,
                         sync_groups=False,  # (the driver captures the group offsets)
                         sync_acls=False,    # and the ACLs
                         upload=job.upload, schema_registry=job.schema_registry)
    props["connector.class"] = f"{__name__}.SparkStoreSinkConnector"
    if job.batch_max:
        props["batch.max.records"] = job.batch_max
    worker = Worker({"bootstrap.servers": job.bootstrap, "metrics.log.interval.ms": 0},
                    where=f"spark task {topic}-{partition}", log=sys.stderr)
    add_mirror(worker, props)
    schema_sync = getattr(worker.connectors[-1], "schema_sync", None)
    worker.run()
    runner = worker.runners[0]
    return {"topic": topic, "partition": partition, "start": start, "end": end,
            "records": runner.metrics.records, "appended": getattr(runner.task, "appended", 0),
            "seconds": time.monotonic() - t0, "started_at": started_at, "attempt": attempt,
            "writer": writer, "schemas": schema_sync.kept if schema_sync is not None else 0}


def _mirror_task(job: _MirrorJob, items: Iterator[tuple[str, int, int, int]]
                 ) -> Iterator[dict]:
    from pyspark import TaskContext
    ctx = TaskContext.get()
    attempt = ctx.attemptNumber() if ctx is not None else 0
    for item in items:
        try:
            yield _mirror_partition(job, item, attempt)
        except Exception as e:
            cause = e.__cause__ if isinstance(e, TaskFailedError) else None
            if isinstance(cause, (ReputError, OSError)):
                msg = str(cause)  # without the worker's "task kcompact-mirror-0:" prefix
            elif isinstance(e, (ConnectorsError, ReputError)):
                msg = str(e)
            else:
                msg = f"{type(e).__name__}: {e}"
            raise MirrorTaskError(f"mirror task {item[0]}-{item[1]} (attempt {attempt + 1}): "
                                  f"{msg}") from e


def partition_ends(consumer_conf: Mapping[str, Any], tps: list, timeout: float
                   ) -> dict[Any, tuple[int, int, bool]]:
    """(low watermark, end offset, exact) of each partition, read from the consumer side.

    The consumer is assigned at the logical end (ListOffsets "latest": on Tansu the base offset
    of the last batch + 1, BROKER_NOTES.md; right on Kafka - never past the true end) and
    reads to end-of-partition, whose offset is the end (with read_committed, the last stable
    offset); the low watermark is the one fetch responses carry. A partition that gives no EOF
    within ``timeout`` (a producer outrunning us) ends at the cached high watermark of the
    fetch responses (right on Tansu too) or after the last record seen (``exact`` False)."""
    from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as KTP

    conf = dict(consumer_conf, **{"enable.partition.eof": True, "enable.auto.commit": False,
                                  "queued.min.messages": 1000, "fetch.wait.max.ms": 10,
                                  "logger": kafka_logger()})
    conf["client.id"] = f"{conf.get('client.id', 'kcompact')}-ends"
    c = Consumer(conf)
    try:
        # Leaders first: assigned to a partition whose leader it does not know yet, librdkafka
        # retries the offset lookup on a 500 ms timer (measured: 0.61 s -> 0.1 s here).
        for topic in sorted({tp.topic for tp in tps}):
            try:
                c.list_topics(topic, timeout=timeout)
            except KafkaException:
                pass  # the assignment below reports what is wrong
        c.assign([KTP(tp.topic, tp.partition, OFFSET_END) for tp in tps])
        ends: dict[tuple[str, int], int] = {}
        seen: dict[tuple[str, int], int] = {}
        deadline = time.monotonic() + timeout
        while len(ends) < len(tps) and time.monotonic() < deadline:
            # poll(), not consume(n, timeout): consume waits out its whole timeout unless n
            # messages came, and a few end-of-partition events never make n (0.1 s a mirror)
            m = c.poll(0.1)
            if m is None:
                continue
            err = m.error()
            key = (m.topic(), m.partition())
            if err is None:
                seen[key] = max(seen.get(key, 0), m.offset() + 1)
            elif err.code() == KafkaError._PARTITION_EOF:
                ends.setdefault(key, m.offset())
            elif err.fatal() or err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                               KafkaError.TOPIC_AUTHORIZATION_FAILED):
                raise ConnectorsError(f"{m.topic()}-{m.partition()}: {err.str()}")
        out = {}
        exact = set(ends)
        for tp in tps:
            try:
                lo, hw = c.get_watermark_offsets(KTP(tp.topic, tp.partition), cached=True)
            except KafkaException:
                lo, hw = -1, -1
            key = (tp.topic, tp.partition)
            if key not in ends:
                if hw is None or hw < 0:
                    try:  # nothing fetched at all: ask (low on Tansu, but never past the end)
                        lo, hw = c.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                         timeout=timeout)
                    except KafkaException as e:
                        raise ConnectorsError(f"{tp}: cannot read the partition's offsets: "
                                              f"{kafka_error_text(e)}") from None
                ends[key] = max(seen.get(key, 0), hw)
            out[tp] = (max(lo or 0, 0), ends[key], key in exact)
        return out
    finally:
        c.close()


@dataclass
class SparkMirrorResult:
    records: int                  # records appended to the store (duplicates skipped)
    seconds: float                # from the job's start to the end of the compaction stage
    partitions: int               # partitions of the topics selected
    tasks: list[dict] = field(default_factory=list)
    retried: int = 0              # tasks that needed more than one attempt
    compaction: list[dict] = field(default_factory=list)
    spark_start_s: float = 0.0    # JVM and SparkSession start (0 when one was running)
    mirror_s: float = 0.0         # the mirror stage alone

    @property
    def rate(self) -> float:
        return self.records / self.mirror_s if self.mirror_s > 0 else 0.0


class _Job:
    """A Spark action in a thread of its own, so the driver can report progress meanwhile."""

    def __init__(self, fn):
        self.result: Any = None
        self.error: BaseException | None = None
        from pyspark import InheritableThread

        def run() -> None:
            try:
                self.result = run_job(fn)
            except BaseException as e:  # noqa: BLE001 - re-raised on the driver's thread
                self.error = e
        self.thread = InheritableThread(target=run, name="kcompact-spark-job", daemon=True)
        self.thread.start()

    def wait(self, seconds: float) -> bool:
        self.thread.join(seconds)
        return not self.thread.is_alive()


def _mirror_progress(spark, store, todo: list[tuple[str, int, int, int]], t0: float,
                     last: list, out: TextIO) -> None:
    """One progress line: records in the store (its next offsets), per-partition lag, tasks."""
    copied, lag = 0, {}
    try:
        for topic, p, start, end in todo:
            n = min(max(store.next_offset(topic, p), start), end)
            copied += n - start
            if end - n:
                lag[TopicPartition(topic, p)] = end - n
    except Exception:  # noqa: BLE001 - a partition being written may be mid-append
        return
    done, running, failed = stage_counts(spark)
    now = time.monotonic()
    rate = (copied - last[1]) / max(now - last[0], 1e-9)
    last[0], last[1] = now, copied
    print(f"mirror: {copied:,} records, {rate:,.0f} rec/s, lag {sum(lag.values()):,}"
          + (f" [{lag_text(lag)}]" if lag else "")
          + f"; partitions done {done}/{len(todo)}, running {running}"
          + (f", {failed} failed attempts (retrying)" if failed else "")
          + f" ({now - t0:.0f} s)", file=out, flush=True)


def mirror_with_spark(bootstrap: str, topic: str | Sequence[str] | None, store: str, *,
                      master: str | None = None,
                      spark: Any = None, partitions: tuple[int, ...] | list[int] | None = None,
                      kafka_config: Mapping[str, str] | None = None, compact: bool = True,
                      batch_max: int | None = None, out: TextIO | None = None,
                      progress_interval: float = PROGRESS_INTERVAL,
                      topics_regex: str | None = None, exclude_regex: str | None = None,
                      sync_configs: bool = True, sync_groups: bool = True,
                      groups: str | None = None, exclude_groups: str | None = None,
                      upload: str = "auto", sync_acls: bool = True,
                      schema_registry: str | None = None) -> SparkMirrorResult:
    """Mirror ``topic`` (one name or several) and the topics ``topics_regex`` matches into
    ``store`` with one Spark task per topic-partition, then compact the partitions the
    planner picks (``compact=False``: skip that stage). ``spark``: a session to use (else
    ``spark_session(master)``, stopped at the end if this call started it).
    ``schema_registry``: every task keeps the schemas its records name before it stores
    them (plugins/schema_sync.py), as the local engine does."""
    out = out if out is not None else sys.stderr
    kafka_config = dict(kafka_config or {})
    if schema_registry:  # a bad URL is refused before anything runs
        from ...plugins.schema_sync import Registry
        schema_registry = Registry(schema_registry).url

    # 1. the driver: settings, topics, partitions, store, dead writers - before any JVM starts,
    # through the same worker code as the local engine (nothing is run: its task never starts)
    props = mirror_props(topic, store, partitions=partitions, follow=False,
                         kafka_config=kafka_config, writer="spark-driver",
                         topics_regex=topics_regex, exclude_regex=exclude_regex,
                         sync_groups=False, sync_acls=False)
    probe = Worker({"bootstrap.servers": bootstrap, "metrics.log.interval.ms": 0},
                   where="mirror", log=out)
    runner = add_mirror(probe, props)[0]
    for c in probe.connectors:
        c.stop()
    topics = list(probe.connectors[-1].props["topics"])
    what = topics[0] if len(topics) == 1 else f"{len(topics)} topics"
    if len(topics) > 1:
        print(f"mirror: topics: {', '.join(topics)}", file=out, flush=True)
    if sync_configs:
        sync_configs_of(bootstrap, topics, store, kafka_config, out=out,
                        writer="spark-driver-configs")
    group_sync = None
    if sync_groups:  # the source's group offsets, now and after the job (plugins/group_sync.py)
        from ...plugins.group_sync import SinkGroupSync
        group_sync = SinkGroupSync(store, runner.consumer_conf, writer="spark-driver-groups",
                                   follow=False, groups=groups, exclude=exclude_groups,
                                   out=out, prefix="mirror")
        group_sync.opened(topics)
    acl_sync = None
    if sync_acls:  # the source's ACLs, after the groups, now and after the job (acl_sync.py)
        from ...plugins.acl_sync import SinkAclSync
        acl_sync = SinkAclSync(store, runner.consumer_conf, writer="spark-driver-acls",
                               follow=False, out=out, prefix="mirror")
        acl_sync.opened(topics)
    tps = list(runner.assignment)
    timeout = probe.config["startup.timeout.ms"] / 1000
    ends = partition_ends(runner.consumer_conf, tps, timeout)
    st = Store.open(store)
    todo = []
    stored = {t: set(st.partitions(t)) for t in topics}
    refused: dict = {}  # damaged partitions: not mirrored, the others are (issue 44)
    for tp in tps:
        lo, end, exact = ends[tp]
        try:
            nxt = (st.next_offset(tp.topic, tp.partition) if tp.partition in stored[tp.topic]
                   else 0)
        except CorruptRecordError as e:
            st.release_partition(tp.topic, tp.partition)
            refused[tp] = (f"the store's partition is damaged ({str(e).splitlines()[0]}); "
                           "repair it (`kcompact repair`, docs/operations-damage.md), then "
                           "mirror again")
            print(f"kcompact: warning: mirror: {tp.topic}-{tp.partition} is not mirrored: "
                  f"{refused[tp]}; the other partitions are", file=sys.stderr, flush=True)
            continue
        if exact and nxt > end:
            st.close()
            raise ConnectorsError(
                f"{tp}: the store holds offsets up to {nxt - 1} but the partition ends at {end}: "
                "was the topic deleted and recreated? Mirror into a new store")
        start = nxt if nxt > 0 else lo
        if start != end:  # not exact and past the end: the task's consumer finds out
            todo.append((tp.topic, tp.partition, start, end))
    todo.sort(key=lambda it: (-(it[3] - it[2]), it[0], it[1]))  # biggest first: better packing
    total = sum(max(0, e - s) for _, _, s, e in todo)
    result = SparkMirrorResult(0, 0.0, len(tps))

    ours = False
    t_all = time.monotonic()

    def session():
        nonlocal spark, ours
        if spark is None:
            ours = not spark_active()
            t = time.monotonic()
            spark = spark_session(master)
            result.spark_start_s = time.monotonic() - t if ours else 0.0
            if ours:
                print(f"mirror: Spark {spark.sparkContext.master} started in "
                      f"{result.spark_start_s:.1f} s", file=out, flush=True)
        return spark

    try:
        if not todo:
            print(f"mirror: {what}: the store {store} is up to date ({len(tps)} partitions)",
                  file=out, flush=True)
        else:
            print(f"mirror: {what} ({len(tps)} partitions, {len(todo)} to copy, ~{total:,} "
                  f"records) from {bootstrap} into {store} with Spark", file=out, flush=True)
            sp = session()
            t0 = time.monotonic()
            job = _MirrorJob(bootstrap, store, tuple(sorted(kafka_config.items())), batch_max,
                             upload=upload, schema_registry=schema_registry)
            rdd = sp.sparkContext.parallelize(todo, len(todo))
            running = _Job(lambda: rdd.mapPartitions(
                functools.partial(_mirror_task, job)).collect())
            last = [t0, 0]
            try:
                while not running.wait(progress_interval):
                    _mirror_progress(sp, st, todo, t0, last, out)
            except KeyboardInterrupt:
                print("mirror: interrupted: cancelling the Spark job (run the same command "
                      "again to resume; nothing is lost or repeated)", file=out, flush=True)
                try:
                    sp.sparkContext.cancelAllJobs()  # the JVM may be gone already (Ctrl-C)
                except Exception:  # noqa: BLE001
                    pass
                running.wait(30)
                raise
            if running.error is not None:
                raise running.error
            result.tasks = sorted(running.result, key=lambda r: (r["topic"], r["partition"]))
            result.mirror_s = time.monotonic() - t0
            result.records = sum(r["appended"] for r in result.tasks)
            result.retried = sum(1 for r in result.tasks if r["attempt"] > 0)
            again = sum(r["records"] for r in result.tasks) - result.records
            n_schemas = sum(r.get("schemas", 0) for r in result.tasks)
            per: dict[str, list[int]] = {}
            for r in result.tasks:
                acc = per.setdefault(r["topic"], [0, 0])
                acc[0] += r["appended"]
                acc[1] += 1
            if len(per) > 1:
                for t, (n, k) in sorted(per.items()):
                    print(f"mirror: {t}: {n:,} records ({k} Spark tasks)", file=out, flush=True)
            print(f"mirror: done: {result.records:,} records in {result.mirror_s:.1f} s "
                  f"({result.rate:,.0f} rec/s), {len(result.tasks)} Spark tasks"
                  + (f", {len(per)} topics" if len(per) > 1 else "")
                  + (f" ({result.retried} retried)" if result.retried else "")
                  + (f", {again:,} records read again were already stored" if again else "")
                  + (f", {n_schemas} new schema{'' if n_schemas == 1 else 's'} kept"
                     if schema_registry else "")
                  + f"; store {store} flushed", file=out, flush=True)

        if group_sync is not None:
            group_sync.stop()  # the last capture: the mirror's end
            group_sync = None
        if acl_sync is not None:
            acl_sync.stop()
            if acl_sync.captures:  # the local engine's wording (apps/mirror.py)
                n = len(acl_sync.writer.kept())
                print(f"mirror: ACLs captured ({n} binding{'' if n == 1 else 's'} kept)",
                      file=out, flush=True)
            acl_sync = None
        # 2. compaction: one task per partition the planner picks
        if compact:
            selected = set(tps)
            damaged: list = []  # skipped, said, the others compacted (compaction/damage.py)
            cands = [(c.topic, c.partition) for t in topics
                     for c in plan(st, topic=t, damaged=damaged)
                     if TopicPartition(c.topic, c.partition) in selected]
            for d in damaged:
                print(f"compact: {d.line()}; {REPAIR_HINT}", file=out, flush=True)
            if cands:
                print(f"compact: {len(cands)} partitions with Spark", file=out, flush=True)
                result.compaction = compact_partitions_spark(
                    session(), store, cands, map_memory=DEFAULT_MAP_MEMORY, force=False)
                for line in compaction_lines(result.compaction):
                    print(f"compact: {line}", file=out, flush=True)
    finally:
        if group_sync is not None:
            group_sync.writer.close()
        if acl_sync is not None:
            acl_sync.writer.close()
        st.close()
        if ours and spark is not None:
            spark.stop()
    result.seconds = time.monotonic() - t_all
    if refused:
        tp, why = sorted(refused.items(), key=lambda kv: (kv[0].topic, kv[0].partition))[0]
        more = f" (and {len(refused) - 1} more partitions)" if len(refused) > 1 else ""
        raise ConnectorsError(f"{tp.topic}-{tp.partition}{more} was not mirrored: {why}")
    return result


def run_spark_mirror(opts: MirrorOptions) -> int:
    """``kcompact mirror --engine spark`` (apps/mirror.py chose this engine): SIGTERM cancels the
    job as Ctrl-C does, and a rerun resumes exactly where it stopped."""
    def on_term(_signum, _frame) -> None:
        raise KeyboardInterrupt  # cancel the job like Ctrl-C: a rerun resumes exactly

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        mirror_with_spark(opts.bootstrap_servers, opts.named_topics, opts.store,
                          master=opts.spark_master, partitions=opts.partitions,
                          kafka_config=opts.kafka_config, compact=opts.compact,
                          topics_regex=opts.topics_regex, exclude_regex=opts.exclude_regex,
                          sync_configs=opts.sync_configs, sync_groups=opts.sync_groups,
                          groups=opts.groups, exclude_groups=opts.exclude_groups,
                          upload=opts.upload, sync_acls=opts.sync_acls,
                          schema_registry=opts.schema_registry)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0

