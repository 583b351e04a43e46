"""Every ``KCOMPACT_*`` environment variable, declared once (reput/configdef.py's shape).

Three tables: :data:`ENV`, the variables a running kcompact reads (each read through
:func:`value`, :func:`flag` or :func:`cache_dir` by the module that needs it); :data:`BUILD_ENV`,
read by ``setup.py`` when the C extensions are compiled; :data:`DEV_ENV`, read by the tests and
benchmarks. The user guide's reference page is generated from them, and a unit test
(tests/unit/test_docs_reference.py) fails when a ``KCOMPACT_*`` name appears in the code but in
no table, or in a table but nowhere in the code.

A variable that is unset or blank has its default; a value that does not parse is a ConfigError
naming the variable (``KCOMPACT_S3_CACHE_MB='lots': expected an integer``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .configdef import ConfigDef, Importance, Type, at_least, between, one_of
from .errors import ConfigError

__all__ = ["BUILD_ENV", "DEV_ENV", "ENV", "cache_dir", "debug", "flag", "value"]

MIB = 1 << 20


def _mib(name: str, v: Any) -> None:
    if v is not None and v < 0:
        raise ConfigError(f"{name}: {v} is out of range: a number of MiB, at least 0")


_mib.__doc__ = "[0,...] MiB"

#: What a running kcompact reads.
ENV = (
    ConfigDef()
    .define("KCOMPACT_DEBUG", Type.STRING, "", None, Importance.MEDIUM,
            "Set (to anything but 0) to print the traceback of an error, librdkafka's log and, "
            "for a failed Spark task, its Python traceback and Spark's task logs.")
    .define("KCOMPACT_CACHE_DIR", Type.STRING, None, None, Importance.MEDIUM,
            "Local directory for what a store on S3 keeps locally (a writer's commit log and "
            "active segments, under <store id>/) and for Apache Kafka's jars (kafka-<version>/)."
            " Default: $XDG_CACHE_HOME/kcompact, else ~/.cache/kcompact.")
    .define("KCOMPACT_S3_CACHE_MB", Type.INT, 256, _mib, Importance.LOW,
            "Process-wide LRU cache of S3 data blocks (4 MiB each), in MiB.")
    .define("KCOMPACT_S3_SPOOL_MB", Type.INT, 4096, _mib, Importance.LOW,
            "Process-wide local spool of .bcq indexes fetched whole from S3, in MiB of disk.")
    .define("KCOMPACT_S3_GRACE_MS", Type.LONG, 10 * 60 * 1000, at_least(0), Importance.LOW,
            "How long replaced and orphaned S3 objects are kept so that readers holding an older "
            "manifest finish (ms); a store URL's ?grace_ms= wins.")
    .define("KCOMPACT_S3_SHARED_SPLIT_OBJECTS", Type.INT, 32, between(1, 100_000),
            Importance.LOW,
            "S3 stores with shared uploads: the compactor splits a partition's parts of shared "
            "objects into a segment of its own once it depends on this many shared objects (or "
            "its oldest part is older than the topic's max.compaction.lag.ms). Higher: fewer "
            "split requests, more objects a reader of the partition touches.")
    .define("KCOMPACT_S3_COMPACTION_OBJECTS", Type.STRING, "auto",
            one_of("auto", "store", "partition"), Importance.LOW,
            "How a compaction run on an S3 store uploads its outputs: store (one object per run "
            "holding every partition it compacted, docs/formats/compaction-object.md; the store "
            "becomes format 4), partition (a .log and a .bcq object per output segment, as "
            "before), or auto (store on a store with shared uploads, else partition, so a "
            "format-2 store stays readable by older kcompacts).")
    .define("KCOMPACT_S3_COMPACTION_OBJECT_MB", Type.INT, 1024, between(1, 5 * 1024),
            Importance.LOW,
            "S3: a compaction run uploads its object and opens another once the outputs staged "
            "for it reach this many MiB (S3's single PUT is 5 GiB).")
    .define("KCOMPACT_S3_FOLLOW", Type.STRING, "journal", one_of("journal", "list"),
            Importance.LOW,
            "How a reader that follows an S3 store with shared uploads (the Kafka endpoint, "
            "kcompact serve, kv build --follow) finds new data: journal (one GET of each "
            "writer's next journal entry per KCOMPACT_S3_FOLLOW_MS, whatever the partition "
            "count) or list (every refresh of every partition lists the store, as before; for "
            "comparison).")
    .define("KCOMPACT_S3_ACTIVE_MEMORY_MB", Type.INT, 256, between(0, 1 << 20),
            Importance.LOW,
            "S3 stores with shared uploads: a writer keeps its partitions' active segments (the "
            "records appended since the last flush, which the commit log holds durably) in "
            "memory up to this many MiB in all, on the local disk past it (0: always on disk).")
    .define("KCOMPACT_S3_FOLLOW_MS", Type.INT, 250, between(10, 60_000), Importance.LOW,
            "S3 stores with shared uploads: how often a following reader looks for each "
            "writer's next journal entry (ms; one GET per writer each time).")
    .define("KCOMPACT_S3_MANIFEST_RECHECK_S", Type.INT, 300, between(1, 86_400),
            Importance.LOW,
            "S3 stores with shared uploads: how often a following reader re-reads a partition's "
            "manifest to pick up splits and compactions (s; one GET per partition, spread over "
            "the interval). Keep it below the grace period (KCOMPACT_S3_GRACE_MS).")
    .define("KCOMPACT_S3_CATALOG_FOLD", Type.INT, 4, between(1, 100_000), Importance.LOW,
            "S3 stores with a store catalog (docs/formats/store-catalog.md): a writer with "
            "shared uploads folds its journal entries into the catalog every this many "
            "flushes (one PUT); a reader opening the store GETs fewer entries than this per "
            "writer.")
    .define("KCOMPACT_S3_REFRESH_MS", Type.INT, 200, between(0, 600_000), Importance.LOW,
            "S3 stores with shared uploads: a reader reuses its listing of the store catalog "
            "and of the writers' journals for this long (ms): opening many partitions within "
            "it costs one listing of each, not one per partition.")
    .define("KCOMPACT_S3_CATALOG_POLL_MS", Type.INT, 5000, between(10, 600_000),
            Importance.LOW,
            "S3 stores with a store catalog: how often a following reader looks for the "
            "catalog's next version (ms; one GET), which brings it every partition's new "
            "manifest (splits, compactions).")
    .define("KCOMPACT_REPLICATION_MAX_BYTES", Type.INT, 8 * MIB,
            between(64 << 10, 1 << 30), Importance.LOW,
            "kcompact replicate: bytes asked for per request (capped by the master's 64 MiB "
            "limit). Lower it on a link slower than about 2 Mbit/s.")
    .define("KCOMPACT_REPLICATION_PARALLEL", Type.INT, 2, between(1, 64), Importance.LOW,
            "kcompact replicate: partitions pulled at once (as many may be installing and "
            "compacting meanwhile).")
    .define("KCOMPACT_REPLICATION_RATE", Type.DOUBLE, 0.0, at_least(0), Importance.LOW,
            "kcompact replicate: pull rate limit over all partitions, bytes/s; 0 = unlimited.")
    .define("KCOMPACT_REPLICATION_RETRY_S", Type.DOUBLE, 120.0, at_least(0), Importance.LOW,
            "kcompact replicate: how long a master outage is waited for mid-rebuild, seconds "
            "(forever with --follow).")
    .define("KCOMPACT_REPLICATION_PROTOCOL", Type.INT, None, between(1, 2), Importance.LOW,
            "kcompact replicate: the highest replication protocol to use (1: records only, as "
            "a replica before protocol 2); default: the best the master speaks.")
    .define("KCOMPACT_SERVE_PROTOCOLS", Type.STRING, "", None, Importance.LOW,
            "kcompact serve: the replication protocol versions offered, e.g. '1' (records "
            "only, as a master before protocol 2); default: every version this kcompact "
            "speaks.")
    .define("KCOMPACT_SPARK_UI", Type.STRING, "", None, Importance.LOW,
            "1: start Spark's web UI (off by default).")
    .define("KCOMPACT_SPARK_JAVA_OPTIONS", Type.STRING, "", None, Importance.LOW,
            "JVM options added to the Spark driver's and executors' that kcompact starts, "
            "e.g. '-XX:TieredStopAtLevel=1' (less JIT CPU for short jobs; the tests use it).")
    .define("KCOMPACT_KAFKA_VERSION", Type.STRING, "3.9.1", None, Importance.LOW,
            "kcompact broker --engine kafka: the Apache Kafka release to fetch and run (3.x or "
            "4.x); the default is the release kcompact is tested and benchmarked against.")
    .define("KCOMPACT_LIBRDKAFKA", Type.STRING, None, None, Importance.LOW,
            "Path of the librdkafka shared library kcompact's own Kafka client loads; default: "
            "the one confluent-kafka's wheel ships, else the system's.")
    .define("KCOMPACT_KAFKA_IO", Type.STRING, None, None, Importance.LOW,
            "Gone (issue 39): it chose confluent-kafka's clients for the data path instead of "
            "kcompact's own; setting it now only prints a warning. `kcompact --version` names "
            "the Kafka client in use.")
)

#: Read by setup.py when the C extensions are compiled: nothing since issue 39 (librdkafka's
#: header and zstd's decoder are vendored in third_party/; the table stays for the reference page).
BUILD_ENV = ConfigDef()

#: Read by the tests (tests/README.md) and the benchmarks (bench/README.md).
DEV_ENV = (
    ConfigDef()
    .define("KCOMPACT_TEST_BROKER", Type.STRING, None, one_of("tansu", "testcontainers"),
            Importance.LOW,
            "The integration tests' broker: tansu or testcontainers; default: "
            "KAFKA_BOOTSTRAP_SERVERS, else testcontainers' Kafka when Docker answers, else Tansu.")
    .define("KCOMPACT_TEST_KAFKA_IMAGE", Type.STRING, "confluentinc/cp-kafka:7.6.0", None,
            Importance.LOW, "The Docker image of testcontainers' Kafka.")
    .define("KCOMPACT_FUZZ_EXAMPLES", Type.INT, None, at_least(1), Importance.LOW,
            "tests/unit/test_fuzz_store.py: hypothesis examples per test, for a longer run.")
    .define("KCOMPACT_CRASH_SEED", Type.INT, 20240601, None, Importance.LOW,
            "tests/unit/test_compaction_crash.py: the seed of its random kill points.")
    .define("KCOMPACT_FULL_CAMPAIGN", Type.STRING, None, one_of("1"), Importance.LOW,
            "tests/integration/test_issue44_repair_e2e.py: 1 runs every case of the damage "
            "campaign end to end (about 20 minutes) instead of a sample.")
    .define("KCOMPACT_BENCH_KAFKA_LOGS", Type.STRING, None, None, Importance.LOW,
            "bench/kafka_peers.py: keep the Apache Kafka broker's logs in this directory.")
)


def value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The variable's typed value (its default when unset or blank); a value that does not
    parse, or that its validator refuses, is a ConfigError naming the variable."""
    key = ENV[name]
    raw = (os.environ if env is None else env).get(name, "")
    if raw is None or not str(raw).strip():
        return key.default
    try:
        return key.parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{name}={raw!r}: {str(e).removeprefix(name + ': ')}") from None


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A switch: set to anything but ``0`` (``KCOMPACT_DEBUG=1``)."""
    return str(value(name, env)).strip() not in ("", "0")


def debug() -> bool:
    """``KCOMPACT_DEBUG`` is set: tracebacks and librdkafka's log."""
    return flag("KCOMPACT_DEBUG")


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """``$KCOMPACT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kcompact``, else ``~/.cache/kcompact``."""
    env = os.environ if env is None else env
    return value("KCOMPACT_CACHE_DIR", env) or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "kcompact")
