"""Compaction on Spark (``kcompact compact --engine spark``, and the stage after a Spark mirror).
Each task runs kcompact.compaction's Compactor on its share of the partitions the planner picked,
exactly as ``--engine local`` does in one process; a partition found damaged is skipped (its
result says where: compaction/damage.py), the others are compacted.

On an S3 store with compaction objects (docs/formats/compaction-object.md) a task publishes the
outputs of all its partitions in one object, as a local run does (``Store.compaction_batch``): a
run makes about as many objects as tasks - ``tasks()``, the session's parallelism - not one per
partition, so reading the store after it costs GETs by bytes. Elsewhere a task is a partition.
"""

from __future__ import annotations

from ..output import human_bytes
from .session import run_job, spark_active, spark_session


def _compact_task(store_url: str, map_memory: int, force: bool):
    def run(candidates):
        from kcompact.compaction import (CompactionError, CompactionOptions, Compactor,
                                         damage_in, damaged_result, one_object_per_run)
        from kcompact.compaction.damage import compacted, remember
        from kcompact.reput import CorruptRecordError, Store
        st = Store.open(store_url)
        c = Compactor(st, CompactionOptions(offset_map_memory=map_memory))
        out = []
        try:
            # S3 with compaction objects: the task's partitions publish in one object
            with one_object_per_run(st, c) as done:
                for topic, partition in candidates:
                    try:
                        r = c.compact_partition(topic, partition, force=force)
                    except (CorruptRecordError, CompactionError, FileNotFoundError) as e:
                        d = damage_in(topic, partition, e)  # damage stays in its partition
                        if d is None:
                            raise
                        remember(st, d, "compact")  # beside the partition, until repaired
                        r = damaged_result(d)
                        st.release_partition(topic, partition)
                    else:
                        compacted(st, topic, partition)
                        done(topic, partition)
                    out.append(r.to_dict())
        finally:
            st.close()
        yield from out
    return run


def tasks(spark, store_url: str, count: int) -> int:
    """How many tasks compact ``count`` partitions: one a partition, or on an S3 store whose
    compactions write compaction objects at most the session's default parallelism (each task
    one object of its partitions)."""
    from kcompact.reput import Store
    try:
        with Store.open(store_url) as st:
            batched = st.compaction_batch() is not None
    except Exception:  # (the tasks open it and say what is wrong, one line)
        batched = False
    if not batched:
        return count
    return max(1, min(count, spark.sparkContext.defaultParallelism))


def compact_partitions_spark(spark, store_url: str, candidates: list[tuple[str, int]], *,
                             map_memory: int, force: bool) -> list[dict]:
    """Compact ``candidates`` ((topic, partition) pairs) with the session ``spark``; the
    compaction results as dicts (CompactionResult.to_dict), in the candidates' order."""
    if not candidates:
        return []
    rdd = spark.sparkContext.parallelize(candidates,
                                         tasks(spark, store_url, len(candidates)))
    return run_job(lambda: rdd.mapPartitions(_compact_task(store_url, map_memory, force))
                   .collect())


def compact_with_spark(store_url: str, candidates: list[tuple[str, int]], *,
                       master: str | None, map_memory: int, force: bool) -> list[dict]:
    """The same with a session of this process (started for the job and stopped after it when
    none was running); no JVM is started for nothing to do."""
    if not candidates:
        return []
    ours = not spark_active()
    spark = spark_session(master)
    try:
        return compact_partitions_spark(spark, store_url, candidates, map_memory=map_memory,
                                        force=force)
    finally:
        if ours:
            spark.stop()


def compaction_lines(results: list[dict]) -> list[str]:
    """One line per partition a Spark compaction stage compacted (or skipped)."""
    out = []
    for r in results:
        if r.get("skipped"):
            out.append(f"{r['topic']}-{r['partition']}: skipped: {r['skipped']}")
            continue
        out.append(f"{r['topic']}-{r['partition']}: {r['rounds']} rounds, kept "
                   f"{r['records_kept']:,} dropped {r['records_dropped']:,}, "
                   f"{human_bytes(r['size_before'])} -> {human_bytes(r['size_after'])} "
                   f"({r['duration_s']:.2f}s, spark)")
    return out
