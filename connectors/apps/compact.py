"""``kcompact compact``: compact a store's partitions, in this process or with Spark.

First the active segment of each partition no writer holds is rolled (a store at rest: only
sealed segments are cleanable). Then the planner (kcompact.compaction) picks the partitions that
reached ``min.cleanable.dirty.ratio`` or ``max.compaction.lag.ms``, hold a tombstone past its
``delete.retention.ms`` or runs of small segments (``--force``: every partition, the active
segment rolled first), and each result names its trigger (``reason``); ``--engine local``
compacts them here, within ``--max-bytes-per-sec`` (Kafka's
``log.cleaner.io.max.bytes.per.second``), ``--engine spark`` in one Spark task per partition
(apps/spark/compact_job.py). An explicit engine is never swapped for another: when Spark cannot
run, the command says why before anything is opened.

A partition found damaged is skipped with one line on stderr naming its file, byte and reason
(compaction/damage.py), every other partition is compacted, and the command then exits 1 with
one error line naming the damage and `kcompact repair` (docs/operations-damage.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from kcompact.compaction import (DEFAULT_MAP_MEMORY, REPAIR_HINT, CompactionOptions, Damage,
                                 compact_store, damaged_result, plan, roll_unheld, unique)
from kcompact.reput import CorruptRecordError
from kcompact.reput import Store

from ..errors import ConnectorsError
from .output import human_bytes, print_json

NOTHING_TO_COMPACT = ("nothing to compact (no partition reached min.cleanable.dirty.ratio, "
                      "max.compaction.lag.ms, an expired tombstone or the small-segment limit; "
                      "use --force)")


@dataclass(frozen=True)
class CompactOptions:
    """``kcompact compact``'s options."""

    store: str
    topic: str | None = None
    partition: int | None = None
    force: bool = False
    offset_map_memory: int = DEFAULT_MAP_MEMORY
    engine: str = "local"            # "local" or "spark"
    spark_master: str | None = None
    json: bool = False
    max_bytes_per_sec: int = 0       # I/O budget, bytes read + written per second; 0: unlimited


def _open(opts: CompactOptions) -> Store:
    store = Store.open(opts.store)
    if opts.topic and opts.topic not in store.topics():
        store.close()
        raise ConnectorsError(f"topic {opts.topic!r} is not in store {store.url}")
    if opts.partition is not None and not opts.topic:
        store.close()
        raise ConnectorsError("--partition needs --topic")
    return store


def run_compact(opts: CompactOptions) -> int:
    """``kcompact compact``: compact, print what was done, return the exit code."""
    if opts.engine == "spark":
        return _compact_spark(opts)
    if opts.max_bytes_per_sec < 0:
        raise ConnectorsError(f"--max-bytes-per-sec: {opts.max_bytes_per_sec} is negative; "
                              "give a byte rate, or 0 for unlimited")
    store = _open(opts)
    results = compact_store(store, topic=opts.topic, partition=opts.partition, force=opts.force,
                            options=CompactionOptions(
                                offset_map_memory=opts.offset_map_memory,
                                throttle_bytes_per_s=opts.max_bytes_per_sec or None),
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    store.close()
    if opts.json:
        print_json({"store": opts.store, "partitions": [r.to_dict() for r in results]})
        return _exit_for([r.to_dict() for r in results])
    if not results:
        print(NOTHING_TO_COMPACT)
    for r in results:
        if r.damaged:
            print(f"{r.topic}-{r.partition}: skipped: damaged (see stderr)")
            continue
        if r.skipped:
            print(f"{r.topic}-{r.partition}: skipped: {r.skipped}")
            continue
        print(f"{r.topic}-{r.partition} ({r.reason}): {r.rounds} rounds, kept {r.records_kept:,} dropped "
              f"{r.records_dropped:,} records ({r.tombstones_dropped:,} tombstones), "
              f"{human_bytes(r.size_before)} -> {human_bytes(r.size_after)}, "
              f"read {human_bytes(r.bytes_read)} wrote {human_bytes(r.bytes_written)} "
              f"(recopy {r.recopy_percent:.0f}%), segments {r.segments_before} -> "
              f"{r.segments_after}, map {r.map_utilization_max:.0%} full at "
              f"{r.map_bytes_per_key:.1f} B/key, {r.duration_s:.2f}s")
    return _exit_for([r.to_dict() for r in results])


def _exit_for(results: list[dict]) -> int:
    """0, or the one error line (exit 1) when a partition was skipped as damaged: it names the
    first one's file, byte and reason, how many others were damaged and compacted, and the
    command that repairs it (the partitions' own lines came before, on stderr)."""
    bad = [r for r in results if r.get("damaged")]
    if not bad:
        return 0
    d = Damage(**bad[0]["damaged"])
    more = f" (and {len(bad) - 1} more damaged partitions)" if len(bad) > 1 else ""
    done = len(results) - len(bad)
    raise ConnectorsError(f"{d.name} is damaged and was not compacted{more}: {d.where()}; "
                          f"{done} other partitions were processed; {REPAIR_HINT}")


def _compact_spark(opts: CompactOptions) -> int:
    from .spark.compact_job import compact_with_spark, compaction_lines
    from .spark.errors import SparkEngineError
    from .spark.session import spark_available
    why = spark_available()
    if why is not None:
        raise SparkEngineError(f"--engine spark: {why}; or use --engine local")
    if opts.max_bytes_per_sec:
        raise ConnectorsError("--max-bytes-per-sec applies to --engine local (a Spark task "
                              "per partition has no shared budget)")
    store = _open(opts)
    damaged: list[Damage] = []
    if not opts.force:
        for t in ([opts.topic] if opts.topic else store.topics()):
            for p in store.partitions(t):
                if opts.partition is None or p == opts.partition:
                    try:
                        roll_unheld(store, t, p)
                    except CorruptRecordError as e:
                        damaged.append(Damage.of(t, p, e))
    found = {(d.topic, d.partition) for d in damaged}
    cands = [(c.topic, c.partition) for c in plan(store, topic=opts.topic,
                                                   partition=opts.partition, force=opts.force,
                                                   damaged=damaged)
             if (c.topic, c.partition) not in found]
    store.close()
    results = [damaged_result(d).to_dict() for d in unique(damaged)]
    results += compact_with_spark(opts.store, cands, master=opts.spark_master,
                                  map_memory=opts.offset_map_memory, force=opts.force)
    if any(r.get("shared_parts_split") for r in results):
        with _open(opts) as store:  # S3 with shared uploads: objects every partition split
            store.collect_shared_garbage()
    for r in results:
        if r.get("damaged"):
            print(Damage(**r["damaged"]).line(), file=sys.stderr, flush=True)
    if opts.json:
        print_json({"store": opts.store, "engine": "spark", "partitions": results})
        return _exit_for(results)
    if not results:
        print(NOTHING_TO_COMPACT)
    for line in compaction_lines(results):
        print(line)
    return _exit_for(results)
