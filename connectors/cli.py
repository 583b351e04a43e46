"""The ``kcompact`` command line (the contract in DESIGN.md, "Command line"): argparse only.

Each command's flags become its typed options (a frozen dataclass next to the application that
takes them: connectors.apps, kcompact.replication, connectors.devtools), which the application
runs. This module owns the exit codes and how an error is printed: 0 success; 1 a runtime
error, printed as one line naming what is wrong (``verify`` also exits 1 when it finds
corruption or a difference); 2 a usage error (argparse's message). ``--json`` prints one JSON
document on stdout (``dump --json``: one object per line). Progress goes to stderr. Set
KCOMPACT_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any, Callable

# numpy's OpenBLAS starts a thread a core when numpy is imported, and they spin ~0.1 s of CPU
# each before they sleep; kcompact never calls BLAS, and on a 2-core machine that is CPU taken
# from the command's first tenth of a second. One thread unless the user says otherwise (the
# variable is read when numpy loads, below).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kcompact.errors import KcompactError  # noqa: E402
from kcompact.connectors.framework.gcmode import bulk_gc  # noqa: E402

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _kafka_config(items: list[str]) -> dict[str, str]:
    return _kafka_config_flag(items, "-X")


def _kafka_config_flag(items: list[str], flag: str) -> dict[str, str]:
    from .framework.config import parse_kv_pairs
    return parse_kv_pairs(items, flag=flag)


# ---------------------------------------------------------------------------------------------
# commands: flags -> options -> the application


def cmd_demo(a: argparse.Namespace) -> int:
    from .devtools.demo import DemoOptions, run_demo
    return run_demo(DemoOptions(workdir=a.workdir, records=a.records, s3=a.s3))


def cmd_broker(a: argparse.Namespace) -> int:
    from .devtools.broker import run_foreground
    if a.engine == "kafka":
        from functools import partial

        from .devtools.apache_kafka import ApacheKafkaBroker, broker_overrides
        overrides = broker_overrides(_kafka_config_flag(a.override, "--override"))
        return run_foreground(a.port, factory=partial(ApacheKafkaBroker,
                                                      broker_config=overrides))
    return run_foreground(a.port)


def cmd_mirror(a: argparse.Namespace) -> int:
    from .apps.mirror import run_mirror
    from .apps.options import MirrorOptions, parse_partitions
    return run_mirror(MirrorOptions(
        bootstrap_servers=a.bootstrap_servers, topic=None, topics=tuple(a.topic or ()),
        topics_regex=a.topics_regex, exclude_regex=a.exclude_regex, store=a.store,
        engine=a.engine, spark_master=a.spark_master, follow=a.follow,
        compact=not a.no_compact, partitions=parse_partitions(a.partitions),
        kafka_config=_kafka_config(a.kafka_config), sync_configs=not a.no_sync_configs,
        metrics=a.metrics, sync_groups=not a.no_groups, groups=a.groups,
        exclude_groups=a.exclude_groups, groups_interval_ms=a.sync_group_offsets_interval_ms,
        upload=a.upload, sync_acls=not a.no_acls,
        acls_interval_ms=a.sync_topic_acls_interval_ms, schema_registry=a.schema_registry,
        flush_interval_ms=a.flush_interval_ms))


def cmd_configs(a: argparse.Namespace) -> int:
    from .apps.configs import ConfigsOptions, run_configs
    return run_configs(ConfigsOptions(store=a.store, topic=a.topic, describe=a.describe,
                                      alter=a.alter, add_config=a.add_config,
                                      delete_config=a.delete_config, json=a.json,
                                      as_of_ms=a.as_of, allow_inexact=a.allow_inexact))


def cmd_compact(a: argparse.Namespace) -> int:
    from .apps.compact import CompactOptions, run_compact
    return run_compact(CompactOptions(
        store=a.store, topic=a.topic, partition=a.partition, force=a.force,
        offset_map_memory=a.offset_map_memory, engine=a.engine, spark_master=a.spark_master,
        json=a.json, max_bytes_per_sec=a.max_bytes_per_sec))


def cmd_inspect(a: argparse.Namespace) -> int:
    from .apps.inspect import InspectOptions, run_inspect
    return run_inspect(InspectOptions(store=a.store, topic=a.topic, json=a.json, plot=a.plot,
                                      verify=a.verify))


def cmd_acls(a: argparse.Namespace) -> int:
    from .apps.acls import AclsOptions, run_acls
    return run_acls(AclsOptions(store=a.store, topic=a.topic, json=a.json, as_of_ms=a.as_of,
                                allow_inexact=a.allow_inexact))


def cmd_schemas(a: argparse.Namespace) -> int:
    from .apps.schemas import SchemasOptions, run_schemas
    return run_schemas(SchemasOptions(store=a.store, topic=a.topic, json=a.json))


def cmd_groups(a: argparse.Namespace) -> int:
    from .apps.groups import GroupsOptions, run_groups
    return run_groups(GroupsOptions(store=a.store, group=a.group, json=a.json))


def cmd_dump(a: argparse.Namespace) -> int:
    from .apps.inspect import DumpOptions, run_dump
    return run_dump(DumpOptions(store=a.store, topic=a.topic, partition=a.partition,
                                from_offset=a.from_offset, limit=a.limit, json=a.json,
                                as_of_ms=a.as_of, allow_inexact=a.allow_inexact))


def cmd_verify(a: argparse.Namespace) -> int:
    if a.against:
        from kcompact.replication import VerifyAgainstOptions, verify_against
        return verify_against(VerifyAgainstOptions(store=a.store, against=a.against,
                                                   token_file=a.token_file, json=a.json))
    from .apps.inspect import VerifyOptions, run_verify
    return run_verify(VerifyOptions(store=a.store, json=a.json))


def cmd_serve(a: argparse.Namespace) -> int:
    from kcompact.replication import ServeOptions
    from kcompact.replication.kafka_endpoint import (KafkaEndpointOptions, Limits,
                                                     ServeAllOptions, serve_all)
    http = None
    if a.listen:
        http = ServeOptions(store=a.store, listen=a.listen, token_file=a.token_file,
                            tokens_file=a.tokens_file,
                            tls_cert=a.tls_cert, tls_key=a.tls_key,
                            max_connections=a.max_connections,
                            client_timeout_s=a.client_timeout, metrics=a.metrics)
    kafka = None
    if a.kafka_listen:
        kafka = KafkaEndpointOptions(listen=a.kafka_listen, token_file=a.kafka_token_file,
                                     tls_cert=a.tls_cert, tls_key=a.tls_key,
                                     allow_unauthenticated=a.allow_unauthenticated,
                                     limits=Limits.given(a.max_connections, a.client_timeout,
                                                         a.kafka_idle_timeout),
                                     users_file=a.kafka_users_file,
                                     tls_client_ca=a.tls_client_ca, acls_file=a.acls_file,
                                     acls_from_store=a.acls_from_store,
                                     allow_everyone_if_no_acl_found=(
                                         a.allow_everyone_if_no_acl_found),
                                     fleet=_fleet_options(a))
    return serve_all(ServeAllOptions(store=a.store, kafka=kafka, http=http, metrics=a.metrics))


def cmd_users_add(a: argparse.Namespace) -> int:
    from kcompact.replication.kafka_endpoint.sasl import add_user
    password = sys.stdin.buffer.readline().rstrip(b"\r\n")
    add_user(a.file, a.name, a.mechanism, password)
    print(f"kcompact users: {a.mechanism} credential of {a.name} written to {a.file}",
          file=sys.stderr)
    return 0


def cmd_tokens_add(a: argparse.Namespace) -> int:
    from kcompact.replication.tokens import add_token
    print(add_token(a.file, a.name, a.topics))
    print(f"kcompact tokens: {a.name} ({a.topics}) written to {a.file}; the token above is "
          "not stored, keep it", file=sys.stderr)
    return 0


def cmd_replicate(a: argparse.Namespace) -> int:
    from kcompact.replication import ReplicateOptions, replicate
    return replicate(ReplicateOptions(from_url=a.from_url, token_file=a.token_file,
                                      store=a.store, follow=a.follow, metrics=a.metrics))


def cmd_repair(a: argparse.Namespace) -> int:
    from kcompact.replication.repair import RepairOptions, repair
    return repair(RepairOptions(store=a.store, from_url=a.from_url, token_file=a.token_file,
                                topic=a.topic, partition=a.partition, salvage=a.salvage,
                                json=a.json))


def cmd_restore(a: argparse.Namespace) -> int:
    from .apps.restore import RestoreOptions, run_restore
    return run_restore(RestoreOptions(
        store=a.store, topic=a.topic, bootstrap_servers=a.bootstrap_servers,
        to_topic=a.to_topic, repartition=a.repartition, mode=a.mode,
        from_scratch=a.from_scratch, chunk_records=a.chunk_records,
        exactly_once=a.exactly_once, kafka_config=_kafka_config(a.kafka_config),
        groups=a.groups, as_of_ms=a.as_of, allow_inexact=a.allow_inexact, acls=a.acls,
        acl_principal_map=tuple(a.acl_principal_map or ()), dry_run=a.dry_run,
        schema_registry=a.schema_registry, keep_schema_ids=a.keep_schema_ids,
        configs=a.configs))


def cmd_kv_build(a: argparse.Namespace) -> int:
    from .apps.kv.command import KVBuildOptions, kv_build, parse_settings
    return kv_build(KVBuildOptions(store=a.store, topic=a.topic, db=a.db, follow=a.follow,
                                   bootstrap_servers=a.bootstrap_servers,
                                   kafka_config=parse_settings(a.kafka_config, "-X"),
                                   metrics=a.metrics, as_of_ms=a.as_of,
                                   allow_inexact=a.allow_inexact))


def cmd_kv_serve(a: argparse.Namespace) -> int:
    from .apps.kv.command import parse_settings
    from .apps.kv.serve import KVServeOptions, follow_and_serve
    return follow_and_serve(KVServeOptions(
        store=a.store, topic=a.topic, db=a.db, listen=a.listen, token_file=a.token_file,
        tokens_file=a.tokens_file, bootstrap_servers=a.bootstrap_servers, kafka_config=parse_settings(a.kafka_config, "-X"),
        metrics=a.metrics, max_connections=a.max_connections,
        client_timeout_s=a.client_timeout))


def cmd_kv_get(a: argparse.Namespace) -> int:
    from .apps.kv.command import KVGetOptions, kv_get, parse_settings
    return kv_get(KVGetOptions(db=a.db, key=a.key, json=a.json, key_base64=a.key_base64,
                               value_converter=a.value_converter,
                               converter_config=parse_settings(a.converter_config,
                                                               "--converter-config")))


def cmd_connect_standalone(a: argparse.Namespace) -> int:
    from .apps.connect import ConnectOptions, run_connect
    return run_connect(ConnectOptions(worker=a.worker, connectors=tuple(a.connectors),
                                      metrics=a.metrics))


# ---------------------------------------------------------------------------------------------
# parser


def parse_size(text: str) -> int:
    """'128MiB', '64m', '1g', '1048576' -> bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 128MiB, 64m, 1g)")


def _verify_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`verify`'s flags that only make sense together: a usage error (exit 2) otherwise."""
    def check(args) -> None:
        if args.against and not args.token_file:
            parser.error("--against needs --token-file F (the file holding the master's "
                         "bearer token)")
        if args.token_file and not args.against:
            parser.error("--token-file applies to --against only")
    return check


def _repair_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`repair`: --from (with --token-file) or --salvage, one of the two."""
    def check(args) -> None:
        if bool(args.from_url) == bool(args.salvage):
            parser.error("give --from URL --token-file F (a serving master or replica) or "
                         "--salvage (keep what verifies), one of the two")
        if args.from_url and not args.token_file:
            parser.error("--from needs --token-file F (the file holding the source's bearer "
                         "token)")
        if args.token_file and not args.from_url:
            parser.error("--token-file applies to --from only")
        if args.partition is not None and args.topic is None:
            parser.error("--partition needs --topic")
    return check


def _fleet_options(a: argparse.Namespace):
    """`serve --peers`: the node's FleetOptions (None: a node alone, as before)."""
    if a.peers is None:
        return None
    from kcompact.replication.fleet import FleetOptions
    return FleetOptions(node_id=a.node_id, peer_listen=a.peer_listen, peers=a.peers,
                        token_file=a.peer_token_file)


def _serve_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`serve`: --listen with --token-file, --kafka-listen, or both (exit 2 otherwise)."""
    def check(args) -> None:
        if not args.listen and not args.kafka_listen:
            parser.error("give --listen HOST:PORT --token-file F (replication over HTTP), "
                         "--kafka-listen HOST:PORT (Kafka clients), or both")
        if args.listen and not args.token_file and not args.tokens_file:
            parser.error("--listen needs --token-file F (the file holding the bearer token "
                         "replicas must send) or --tokens-file F")
        if args.tokens_file and not args.listen:
            parser.error("--tokens-file applies to --listen only")
        if args.token_file and not args.listen:
            parser.error("--token-file applies to --listen only (the Kafka listener's is "
                         "--kafka-token-file)")
        for flag in ("kafka_token_file", "allow_unauthenticated", "kafka_idle_timeout",
                     "kafka_users_file", "tls_client_ca", "acls_file", "acls_from_store",
                     "allow_everyone_if_no_acl_found"):
            if getattr(args, flag) and not args.kafka_listen:
                parser.error(f"--{flag.replace('_', '-')} applies to --kafka-listen only")
        fleet = [f for f in ("node_id", "peer_listen", "peers", "peer_token_file")
                 if getattr(args, f) is not None]
        if fleet and not args.kafka_listen:
            parser.error("--node-id, --peer-listen, --peers and --peer-token-file make "
                         "--kafka-listen a node of a fleet: add --kafka-listen")
        if fleet and (args.peers is None or args.node_id is None or args.peer_listen is None):
            parser.error("a fleet node needs --node-id N, --peer-listen HOST:PORT and --peers "
                         "1@HOST:PORT,2@HOST:PORT,... (every node, this one included)")
        if args.peer_listen and not args.peer_token_file and not args.allow_unauthenticated:
            from kcompact.replication.connections import is_loopback
            host = args.peer_listen.rpartition(":")[0].strip("[]")
            if host and not is_loopback(host):
                parser.error(f"--peer-listen {args.peer_listen} is not a loopback address: add "
                             "--peer-token-file F (every node the same token) or "
                             "--allow-unauthenticated")
        if args.kafka_listen and not args.kafka_token_file and not args.allow_unauthenticated \
                and not args.kafka_users_file and not args.tls_client_ca:
            from kcompact.replication.connections import is_loopback
            host = args.kafka_listen.rpartition(":")[0].strip("[]")
            if host and not is_loopback(host):
                parser.error(f"--kafka-listen {args.kafka_listen} is not a loopback address: "
                             "add --kafka-token-file F (SASL/PLAIN), --kafka-users-file F, "
                             "--tls-client-ca F or --allow-unauthenticated")
    return check


def _metrics_flag(s: argparse.ArgumentParser) -> None:
    """The flags of a long-running command (README, "Operating kcompact")."""
    s.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at /metrics and a health check at /healthz "
                   "(no token: use a loopback or private address)")
    _log_format_flag(s, argparse.SUPPRESS)


def _log_format_flag(s: argparse.ArgumentParser, default: Any) -> None:
    s.add_argument("--log-format", choices=("text", "json"), default=default,
                   help="stderr lines as text (default) or one JSON object per line")


def _broker_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`broker`: --override configures the real Kafka only."""
    def check(args) -> None:
        if args.override and args.engine != "kafka":
            parser.error("--override applies to --engine kafka (Kafka's server configs); the "
                         "embedded Tansu broker takes none")
    return check


def _mirror_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`mirror`: some topic to mirror; --exclude-regex narrows --topics-regex."""
    def check(args) -> None:
        if not args.topic and not args.topics_regex:
            parser.error("give --topic T (repeatable) or --topics-regex RE")
        if args.exclude_regex and not args.topics_regex:
            parser.error("--exclude-regex applies to the topics --topics-regex matches")
        ms = args.sync_group_offsets_interval_ms
        if ms is not None and ms < 1000:
            parser.error("--sync-group-offsets-interval-ms: at least 1000")
        ms = args.sync_topic_acls_interval_ms
        if ms is not None and ms < 1000:
            parser.error("--sync-topic-acls-interval-ms: at least 1000")
        if args.no_groups and (args.groups or args.exclude_groups):
            parser.error("--no-groups keeps no group offsets: drop --groups/--exclude-groups")
        import re
        for flag, rx in (("--groups", args.groups), ("--exclude-groups", args.exclude_groups)):
            try:
                re.compile(rx or "")
            except re.error as e:
                parser.error(f"{flag} {rx!r} is not a regular expression ({e})")
    return check


def _configs_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    """`configs`: --add-config/--delete-config go with --alter, which needs one of them."""
    def check(args) -> None:
        if args.describe and (args.add_config or args.delete_config):
            parser.error("--add-config and --delete-config go with --alter")
        if args.alter and not (args.add_config or args.delete_config):
            parser.error("--alter needs --add-config K=V[,K=V] or --delete-config K[,K]")
        if args.alter and args.as_of is not None:
            parser.error("--as-of goes with --describe")
    return check


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag, each with its help text: what it is, its default and its unit,
    as Kafka's own tools say it (a test runs every ``--help`` and checks that none is missing).
    """
    p = argparse.ArgumentParser(prog="kcompact", description=(
        "Keep a compacted copy of Kafka topics in RocketMQ-style storage. "
        "`kcompact COMMAND --help` lists a command's flags."))
    p.add_argument("--version", action=_Version, nargs=0,
                   help="print kcompact's version and its native paths (Kafka I/O, zstd), and exit")
    _log_format_flag(p, "text")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help="one of:")
    sub.required = True

    s = sub.add_parser("demo", help="broker + sample data + mirror + compact + replica + KV")
    s.add_argument("--workdir", default=None, metavar="DIR", help="where the demo keeps its "
                   "stores and map (default: a new temporary directory)")
    s.add_argument("--records", type=int, default=20_000, metavar="N",
                   help="records to produce to the demo topic (default 20000)")
    s.add_argument("--s3", action="store_true", help="put the stores on S3, served by a "
                   "SeaweedFS the demo starts on 127.0.0.1 (needs kcompact[dev])")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("broker", help="a development broker on 127.0.0.1, in the foreground")
    s.add_argument("--engine", choices=("tansu", "kafka"), default="tansu",
                   help="tansu (default): the embedded memory-only broker; kafka: a real Apache "
                   "Kafka (KRaft single node; jars fetched with Maven into $KCOMPACT_CACHE_DIR, "
                   "version $KCOMPACT_KAFKA_VERSION)")
    s.add_argument("--port", type=int, default=None, metavar="PORT",
                   help="port to listen on, on 127.0.0.1 (default: a free port); the broker "
                   "prints 'kcompact broker listening on 127.0.0.1:PORT' once it is ready")
    s.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="--engine kafka: a Kafka server config, as kafka-server-start.sh's "
                   "--override, e.g. message.max.bytes=4194304 (repeatable; the listeners, "
                   "node and data directory are the launcher's)")
    s.set_defaults(func=cmd_broker, check_usage=_broker_usage(s))

    s = sub.add_parser("mirror", help="mirror Kafka topics into a store")
    _bootstrap_flag(s, "the Kafka cluster to read from")
    s.add_argument("--topic", action="append", default=None, metavar="TOPIC",
                   help="a topic to mirror (repeatable; an internal __ topic only when named)")
    s.add_argument("--topics-regex", default=None, metavar="RE",
                   help="also every topic whose whole name this regular expression matches "
                   "(Connect's topics.regex), internal topics (names starting with __) left out")
    s.add_argument("--exclude-regex", default=None, metavar="RE",
                   help="leave out the topics --topics-regex matched that this matches whole")
    s.add_argument("--no-sync-configs", action="store_true",
                   help="do not read the topics' configs from Kafka (describe_configs) into the "
                   "store; by default they follow the source at each start (and refresh)")
    s.add_argument("--groups", default=None, metavar="RE",
                   help="keep the committed offsets of the consumer groups whose whole id this "
                   "matches (default: every group that committed on a mirrored topic), captured "
                   "at start, every 60 s while following and at the end")
    s.add_argument("--exclude-groups", default=None, metavar="RE",
                   help="leave out the groups whose whole id this matches")
    s.add_argument("--no-groups", action="store_true",
                   help="do not keep the source's consumer-group offsets")
    s.add_argument("--sync-group-offsets-interval-ms", type=int, default=None, metavar="MS",
                   help="--follow: how often the groups' offsets are captured (MirrorMaker 2's "
                   "sync.group.offsets.interval.ms; default 60000, at least 1000)")
    s.add_argument("--no-acls", action="store_true",
                   help="do not keep the source's ACL bindings on the mirrored topics and "
                   "their groups (kept by default: `kcompact acls`, `restore --acls`)")
    s.add_argument("--sync-topic-acls-interval-ms", type=int, default=None, metavar="MS",
                   help="--follow: how often the ACLs are captured (MirrorMaker 2's "
                   "sync.topic.acls.interval.ms; default 600000, at least 1000)")
    s.add_argument("--schema-registry", default=None, metavar="URL",
                   help="the source's schema registry: keep every schema the records name in "
                   "Confluent's wire format (magic byte 0 + 4-byte id), with its subjects, "
                   "versions and references (`kcompact schemas`; the default engine is then local, "
                   "--engine spark keeps them too)")
    _store_flag(s, "the store to write (created when missing)")
    s.add_argument("--engine", choices=("spark", "local"), default=None,
                   help="spark (the default without --follow): one Spark task per partition, "
                   "then a compaction stage; local: this process")
    s.add_argument("--spark-master", default=None, metavar="URL",
                   help="--engine spark: the Spark master (default local[*]); the store must be "
                   "reachable from every executor")
    s.add_argument("--follow", action="store_true",
                   help="keep mirroring new records, with background compaction, until Ctrl-C "
                   "or SIGTERM (implies --engine local); without it the mirror stops at the end "
                   "offsets it saw when it started")
    s.add_argument("--upload", choices=("auto", "shared", "partition"), default="auto",
                   help="an S3 store: shared uploads one object for every partition a flush "
                   "wrote (2 requests a flush, whatever the partition count; the store becomes "
                   "format 3), partition a .log, .bcq and manifest per partition; auto (the "
                   "default): shared for a new store or one that uses shared uploads, else "
                   "partition")
    s.add_argument("--flush-interval-ms", type=int, default=None, metavar="MS",
                   help="how often the store is flushed (a flush is what readers see; default "
                   "500 into an S3 store with shared uploads, where a flush costs 2 requests, "
                   "else 5000)")
    s.add_argument("--no-compact", action="store_true",
                   help="--engine spark: skip the compaction stage after the mirror (the store "
                   "then holds every record, as after a batch --engine local)")
    s.add_argument("--partitions", default=None, metavar="LIST",
                   help="only these partitions: numbers and ranges, comma-separated, e.g. "
                   "0,2-3 (default: every partition)")
    _kafka_settings_flag(s, "consumer")
    _metrics_flag(s)
    s.set_defaults(func=cmd_mirror, check_usage=_mirror_usage(s))

    s = sub.add_parser("compact", help="compact partitions of a store")
    _store_flag(s, "the store to compact")
    s.add_argument("--topic", default=None, metavar="TOPIC",
                   help="only this topic (default: every topic)")
    s.add_argument("--partition", type=int, default=None, metavar="P",
                   help="only this partition of --topic (default: every partition)")
    s.add_argument("--force", action="store_true",
                   help="compact every selected partition now, the active segment included "
                   "(it is rolled first), whatever its dirty ratio and lag")
    s.add_argument("--offset-map-memory", type=parse_size, default=128 << 20, metavar="SIZE",
                   help="memory for the offset map, e.g. 128MiB, 64m, 1g (default 128MiB, "
                   "~7.5M keys); more distinct keys take more rounds, never a wrong result")
    s.add_argument("--max-bytes-per-sec", type=parse_size, default=0, metavar="RATE",
                   help="I/O budget: bytes read (index reads included) plus written per second, "
                   "as Kafka's log.cleaner.io.max.bytes.per.second (e.g. 50M; default 0: "
                   "unlimited)")
    s.add_argument("--engine", choices=("spark", "local"), default="local",
                   help="local (default): in this process; spark: one Spark task per partition")
    s.add_argument("--spark-master", default=None, metavar="URL",
                   help="--engine spark: the Spark master (default local[*])")
    _json_flag(s, "print the report as one JSON document on stdout")
    s.set_defaults(func=cmd_compact)

    s = sub.add_parser("configs", help="describe or alter a store's topic configs "
                       "(kafka-configs.sh's spelling)")
    _store_flag(s, "the store whose topic configs to describe or alter")
    s.add_argument("--topic", required=True, metavar="TOPIC", help="the store topic")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--describe", action="store_true",
                      help="each config with its value and source: default, synced from Kafka "
                      "(by kcompact mirror) or local override")
    what.add_argument("--alter", action="store_true",
                      help="change local overrides (with --add-config and/or --delete-config)")
    s.add_argument("--add-config", default=None, metavar="K=V[,K=V]",
                   help="set local overrides; they win over synced values and survive later "
                   "mirrors (a value with commas in brackets: cleanup.policy=[compact,delete])")
    s.add_argument("--delete-config", default=None, metavar="K[,K]",
                   help="remove local overrides (the synced value or the default applies again)")
    _json_flag(s, "print the configs as one JSON document on stdout")
    _as_of_flags(s, "--describe: the values synced from the source as they were at TIME (the "
                 "store's config history; local overrides as they are now)")
    s.set_defaults(func=cmd_configs, check_usage=_as_of_usage(s, _configs_usage(s)))

    s = sub.add_parser("inspect", help="show topics, partitions, segments and dirty ratios")
    _store_flag(s, "the store to look at (nothing is changed)")
    s.add_argument("--topic", default=None, metavar="TOPIC",
                   help="only this topic (default: every topic)")
    _json_flag(s, "print everything as one JSON document on stdout")
    s.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also write a chart of live, dirty and reclaimed bytes per partition to "
                   "this PNG (needs kcompact[plots])")
    s.add_argument("--verify", action="store_true",
                   help="also read and check every record, as `kcompact verify` does, and show "
                   "the result per partition (VERIFIED column; --json: `verify`)")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("groups", help="the consumer-group positions a store keeps, with their "
                       "lag against the store's end")
    _store_flag(s, "the store to read (nothing is changed)")
    s.add_argument("--group", default=None, metavar="RE",
                   help="only the groups whose whole id this regular expression matches "
                   "(default: every group)")
    _json_flag(s, "print {\"groups\": [{\"group\", \"partitions\": [{\"topic\", "
               "\"partition\", \"offset\", \"origin\", \"kept_ms\", \"lag\", ...}]}]} "
               "as one JSON document")
    s.set_defaults(func=cmd_groups)

    s = sub.add_parser("acls", help="the source ACL bindings a store keeps, in kafka-acls "
                       "--list's terms")
    _store_flag(s, "the store to read (nothing is changed)")
    s.add_argument("--topic", default=None, metavar="RE",
                   help="only the bindings of the kept topics whose whole name this matches "
                   "(and of the groups kept with them)")
    _json_flag(s, "print {\"bindings\": [{resource_type, resource_name, pattern_type, "
               "principal, host, operation, permission_type, captured_ms}], \"captured\": "
               "{topic: ms}} as one JSON document")
    _as_of_flags(s, "the bindings as captured at or before TIME")
    s.set_defaults(func=cmd_acls, check_usage=_as_of_usage(s))

    s = sub.add_parser("schemas", help="the source schemas a store keeps (kcompact mirror "
                       "--schema-registry)")
    _store_flag(s, "the store to read (nothing is changed)")
    s.add_argument("--topic", default=None, metavar="RE",
                   help="only the schemas the kept topics whose whole name this matches use")
    _json_flag(s, "print {\"schemas\": [{id, schema_type, subjects, references, schema, "
               "captured_ms}], \"topics\": {topic: {ids, missing, captured_ms}}} as one JSON "
               "document")
    s.set_defaults(func=cmd_schemas)

    s = sub.add_parser("dump", help="print a partition's records")
    _store_flag(s, "the store to read (nothing is changed)")
    s.add_argument("--topic", required=True, metavar="TOPIC", help="the topic to print")
    s.add_argument("--partition", type=int, required=True, metavar="P",
                   help="the partition to print")
    s.add_argument("--from-offset", type=int, default=0, metavar="O",
                   help="first offset to print (default 0); an offset compaction removed "
                   "starts at the next one")
    s.add_argument("--limit", type=int, default=None, metavar="N",
                   help="print at most N records (default: every record)")
    _json_flag(s, "one JSON object per record (topic, partition, offset, timestamp, key, value, "
               "headers), values uncut; without it a line per record, values cut at 60 "
               "characters")
    _as_of_flags(s, "print the partition's state at TIME instead of its records: per key its "
                 "latest record with a timestamp at or before TIME (none when that is a "
                 "tombstone), and keyless records up to TIME")
    s.set_defaults(func=cmd_dump, check_usage=_as_of_usage(s))

    s = sub.add_parser("verify", help="check every record and index entry (exit 1 on problems)")
    _store_flag(s, "the store to check (nothing is changed)")
    _json_flag(s, "print the report as one JSON document on stdout")
    s.add_argument("--against", default=None, metavar="URL",
                   help="compare with a master served by `kcompact serve` at this URL, "
                   "http(s)://HOST:PORT (needs --token-file)")
    s.add_argument("--token-file", default=None, metavar="FILE",
                   help="--against: the file holding the master's bearer token")
    s.set_defaults(func=cmd_verify, check_usage=_verify_usage(s))

    s = sub.add_parser("serve", help="serve a store to replicas over HTTP and/or to Kafka "
                       "clients as a read-only Kafka broker")
    _store_flag(s, "the store to serve (read-only: mirrors and compaction keep running)")
    s.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="HTTP replication: address to listen on, e.g. 0.0.0.0:8470 (needs "
                   "--token-file)")
    s.add_argument("--token-file", default=None, metavar="FILE",
                   help="with --listen: file holding the bearer token replicas must send "
                   "(e.g. made with `openssl rand -hex 32`)")
    s.add_argument("--tokens-file", default=None, metavar="FILE",
                   help="with --listen: named bearer tokens, each limited to topic patterns, "
                   "hashed (made with `kcompact tokens add`; docs/security.md)")
    s.add_argument("--kafka-listen", default=None, metavar="HOST:PORT",
                   help="serve the store to Kafka clients (a read-only broker) on this "
                   "address, e.g. 127.0.0.1:9092 (port 0 picks a free one)")
    s.add_argument("--kafka-token-file", default=None, metavar="FILE",
                   help="require SASL/PLAIN on --kafka-listen: any user name, this file's "
                   "token as the password")
    s.add_argument("--kafka-users-file", default=None, metavar="FILE",
                   help="enable SASL/SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN on --kafka-listen "
                   "for the users of this file (made with `kcompact users add`; "
                   "docs/security.md)")
    s.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="--kafka-listen with TLS: require a client certificate signed by this "
                   "CA; its subject is the principal User:<DN>")
    s.add_argument("--acls-file", default=None, metavar="FILE",
                   help="authorize --kafka-listen's requests with these ACLs: the output of "
                   "`kafka-acls --list` as it is (re-read when it changes)")
    s.add_argument("--acls-from-store", action="store_true",
                   help="authorize --kafka-listen's requests with the ACLs `kcompact mirror` "
                   "captured from the source cluster")
    s.add_argument("--allow-everyone-if-no-acl-found", action="store_true",
                   help="with ACLs: allow a resource no ACL names (Kafka's "
                   "allow.everyone.if.no.acl.found; default: denied)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="let --kafka-listen bind a non-loopback address without "
                   "--kafka-token-file")
    s.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve TLS with this certificate on --listen (HTTPS) and "
                   "--kafka-listen (with --tls-key; default: plain)")
    s.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the private key of --tls-cert")
    s.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="client connections open at once, per listener; more are answered 503 "
                   "(--listen) or closed (--kafka-listen) (default 256 and 1024)")
    s.add_argument("--client-timeout", type=float, default=None, metavar="S",
                   help="seconds a client has to send a whole request, or to take any byte of "
                        "its response, before it is disconnected (default 30)")
    s.add_argument("--kafka-idle-timeout", type=float, default=None, metavar="S",
                   help="close a Kafka client connection idle between requests for this long "
                   "(Kafka's connections.max.idle.ms; default 600)")
    s.add_argument("--node-id", type=int, default=None, metavar="N",
                   help="fleet: this node's id in --peers (docs/fleet.md)")
    s.add_argument("--peer-listen", default=None, metavar="HOST:PORT",
                   help="fleet: where the other nodes reach this one (pings, shared blocks)")
    s.add_argument("--peers", default=None, metavar="ID@HOST:PORT,...",
                   help="fleet: every node's id and --peer-listen address, this one included "
                   "(Kafka's controller.quorum.voters spelling)")
    s.add_argument("--peer-token-file", default=None, metavar="FILE",
                   help="fleet: the bearer token every node sends and requires on "
                   "--peer-listen")
    _metrics_flag(s)
    s.set_defaults(func=cmd_serve, check_usage=_serve_usage(s))

    s = sub.add_parser("users", help="manage the users file of `serve --kafka-users-file`")
    us = s.add_subparsers(dest="users_command", required=True, metavar="COMMAND",
                          help="one of:")
    u = us.add_parser("add", help="add or replace a user's credential (password on stdin)")
    u.add_argument("--file", required=True, metavar="FILE",
                   help="the users file (created with mode 0600)")
    u.add_argument("--mechanism", default="SCRAM-SHA-512",
                   choices=["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"],
                   help="the SASL mechanism of the credential (default SCRAM-SHA-512)")
    u.add_argument("name", help="the user name (the principal is User:NAME)")
    u.set_defaults(func=cmd_users_add)

    s = sub.add_parser("tokens", help="manage the tokens file of `serve --tokens-file` and "
                       "`kv serve --tokens-file`")
    ts = s.add_subparsers(dest="tokens_command", required=True, metavar="COMMAND",
                          help="one of:")
    t = ts.add_parser("add", help="make a token for some topics: its hash goes to the file, "
                      "the token to stdout (shown this once)")
    t.add_argument("--file", required=True, metavar="FILE",
                   help="the tokens file (created with mode 0600)")
    t.add_argument("--topics", required=True, metavar="PATTERNS",
                   help="comma-separated topics the token may list, replicate or read: a "
                   "name, prefix* or *")
    t.add_argument("name", help="the token's name (in logs and 403 answers)")
    t.set_defaults(func=cmd_tokens_add)

    s = sub.add_parser("replicate", help="rebuild a replica from a serving master")
    s.add_argument("--from", dest="from_url", required=True, metavar="URL",
                   help="the master's `kcompact serve`, http(s)://HOST:PORT")
    s.add_argument("--token-file", required=True, metavar="FILE",
                   help="file holding the master's bearer token")
    _store_flag(s, "the replica store to build (created when missing, with its own digest "
                "secret)")
    s.add_argument("--follow", action="store_true",
                   help="after the rebuild, keep pulling new records until Ctrl-C or SIGTERM")
    _metrics_flag(s)
    s.set_defaults(func=cmd_replicate)

    s = sub.add_parser("repair", help="repair the damaged partitions `verify` finds (from a "
                       "replica, or by keeping what verifies); docs/operations-damage.md")
    _store_flag(s, "the store to repair (its damaged files are moved to quarantine/<time>/, "
                "never deleted)")
    s.add_argument("--from", dest="from_url", default=None, metavar="URL",
                   help="pull each damaged partition again from this serving master or replica "
                   "(`kcompact serve`), http(s)://HOST:PORT (needs --token-file); local records "
                   "newer than the source's are kept")
    s.add_argument("--token-file", default=None, metavar="FILE",
                   help="--from: the file holding the source's bearer token")
    s.add_argument("--salvage", action="store_true",
                   help="no replica: keep every record that verifies, drop the damaged ones, "
                   "rebuild the indexes and print what was lost as offset ranges")
    s.add_argument("--topic", default=None, metavar="TOPIC",
                   help="only this topic (default: every topic)")
    s.add_argument("--partition", type=int, default=None, metavar="P",
                   help="repair this partition (with --topic), damaged or not (default: the "
                   "partitions `verify` finds damaged)")
    _json_flag(s, "print what was repaired and lost as one JSON document on stdout")
    s.set_defaults(func=cmd_repair, check_usage=_repair_usage(s))

    s = sub.add_parser("restore", help="re-publish a store's topic into Kafka")
    _store_flag(s, "the store to read")
    s.add_argument("--topic", required=True, metavar="TOPIC", help="the store topic to restore")
    _bootstrap_flag(s, "the Kafka cluster to write to")
    s.add_argument("--to-topic", required=True, metavar="TOPIC",
                   help="the Kafka topic to write; created when missing, with the store "
                   "topic's partition count and cleanup.policy")
    s.add_argument("--repartition", action="store_true",
                   help="place records by key with Kafka's default partitioner (murmur2), "
                   "e.g. into a topic with fewer partitions (default: store partition p -> "
                   "partition p)")
    s.add_argument("--mode", choices=("latest", "all"), default="latest",
                   help="latest value per key (default), or every stored record")
    s.add_argument("--from-scratch", action="store_true",
                   help="ignore recorded progress and produce everything again")
    s.add_argument("--chunk-records", type=int, default=None, metavar="N",
                   help="records per transaction and progress record (default 250000)")
    s.add_argument("--exactly-once", choices=("requested", "required", "disabled"),
                   default="requested", help="transactions: when the broker has them "
                   "(default), always, or never (idempotent producer)")
    s.add_argument("--groups", default=None, metavar="RE",
                   help="once the restore is done, commit on --to-topic the kept positions "
                   "(`kcompact groups`) of the consumer groups whose whole id this matches, "
                   "translated exactly: a source offset O becomes the target offset of the "
                   "first restored record at or after O (groups with active members are "
                   "skipped; not with --repartition)")
    s.add_argument("--configs", action="store_true",
                   help="create the target topic with the configs synced from the source "
                   "(`kcompact configs --describe`: retention, compaction, segment, "
                   "compression; as of TIME with --as-of) besides its cleanup.policy; a "
                   "target that exists keeps its own")
    s.add_argument("--acls", action="store_true",
                   help="once the restore is done, create on the target the source ACL "
                   "bindings the store keeps (`kcompact acls`) for the topic (a LITERAL one "
                   "names --to-topic) and the groups kept with it; bindings already there are "
                   "left alone")
    s.add_argument("--acl-principal-map", action="append", default=None, metavar="OLD=NEW",
                   help="with --acls: create OLD's bindings for NEW (User:alice=User:carol; "
                   "repeatable)")
    s.add_argument("--schema-registry", default=None, metavar="URL",
                   help="the target's schema registry: register the schemas the store keeps "
                   "for the topic (references first, in source order) before any record is "
                   "produced, and rewrite each key's and value's schema id to the target's")
    s.add_argument("--keep-schema-ids", action="store_true",
                   help="with --schema-registry: register under the source ids (the target's "
                   "import mode); refused where the target does not allow it")
    s.add_argument("--dry-run", action="store_true",
                   help="print what the restore would create besides the records (the ACLs "
                   "of --acls); produce and change nothing")
    _as_of_flags(s, "restore the topic's state at TIME (per key its latest record with a "
                 "timestamp at or before TIME; with --groups, their positions as kept then; "
                 "with --acls, the bindings as captured then)")
    _kafka_settings_flag(s, "producer")
    s.set_defaults(func=cmd_restore, check_usage=_as_of_usage(s, _restore_usage(s)))

    kv = sub.add_parser("kv", help="the local key-value map (LevelDB)")
    kvs = kv.add_subparsers(dest="kv_command", metavar="COMMAND", help="one of:")
    kvs.required = True
    s = kvs.add_parser("build", help="build (and follow) a map from a store")
    _map_flags(s, "the store to build the map from")
    s.add_argument("--follow", action="store_true",
                   help="keep applying new records (from the store, or from Kafka with "
                   "--bootstrap-servers) until Ctrl-C or SIGTERM")
    s.add_argument("--bootstrap-servers", default=None, metavar="HOST:PORT[,...]",
                   help="after the store, catch up (and with --follow, follow) from this Kafka "
                   "cluster (default: the store only)")
    _kafka_settings_flag(s, "consumer", "for --bootstrap-servers")
    _as_of_flags(s, "build the map of the topic's state at TIME (per key its latest record "
                 "with a timestamp at or before TIME; a new map, never followed)")
    _metrics_flag(s)
    s.set_defaults(func=cmd_kv_build, check_usage=_as_of_usage(s, _kv_as_of_usage(s)))
    s = kvs.add_parser("serve", help="follow a map and answer reads over HTTP")
    _map_flags(s, "the store to build and follow the map from")
    s.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where the read API listens (without --token-file: a loopback address "
                   "only)")
    s.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the bearer token clients must send (required beyond "
                   "loopback; default: none, loopback only)")
    s.add_argument("--tokens-file", default=None, metavar="FILE",
                   help="named bearer tokens limited to topic patterns (`kcompact tokens "
                   "add`): only those allowed this map's topic may read it")
    s.add_argument("--bootstrap-servers", default=None, metavar="HOST:PORT[,...]",
                   help="after the store, catch up and follow from this Kafka cluster "
                   "(default: follow the store only)")
    _kafka_settings_flag(s, "consumer", "for --bootstrap-servers")
    s.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="client connections open at once; more are answered 503 (default 256)")
    s.add_argument("--client-timeout", type=float, default=None, metavar="S",
                   help="seconds a client has to send a whole request (default 30)")
    _metrics_flag(s)
    s.set_defaults(func=cmd_kv_serve)
    s = kvs.add_parser("get", help="look a key up (exit 1 when it is absent)")
    s.add_argument("--db", required=True, metavar="DIR", help="the map's LevelDB directory")
    s.add_argument("key", metavar="KEY", help="the key, as UTF-8 text (base64 with --key-base64)")
    _json_flag(s, "print {\"key\", \"found\", \"value\"} as one JSON document")
    s.add_argument("--key-base64", action="store_true", help="KEY is base64 (binary keys)")
    s.add_argument("--value-converter", default=None, metavar="NAME",
                   help="decode the value: json, avro, string, or a converter class name "
                   "(default: the bytes as stored)")
    s.add_argument("--converter-config", action="append", default=[], metavar="KEY=VALUE",
                   help="value converter setting, e.g. schema.registry.url=URL (repeatable)")
    s.set_defaults(func=cmd_kv_get)

    c = sub.add_parser("connect", help="run Connect-style connectors")
    cs = c.add_subparsers(dest="connect_command", metavar="MODE", help="one of:")
    cs.required = True
    s = cs.add_parser("standalone", help="WORKER.properties CONNECTOR.properties...")
    s.add_argument("worker", metavar="WORKER.properties",
                   help="the worker's properties (bootstrap.servers, converters, ...)")
    s.add_argument("connectors", nargs="*", metavar="CONNECTOR.properties",
                   help="one file per connector (name, connector.class, its settings); none "
                   "when the worker serves the REST API (listeners) to add them with")
    _metrics_flag(s)
    s.set_defaults(func=cmd_connect_standalone)
    return p


def parse_time(text: str) -> int:
    """--as-of TIME: ISO 8601 or epoch milliseconds -> epoch milliseconds (usage error else)."""
    from kcompact.compaction.history import parse_time as parse
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _as_of_flags(s: argparse.ArgumentParser, what: str) -> None:
    """--as-of TIME and --allow-inexact (docs/groups-and-as-of.md)."""
    s.add_argument("--as-of", type=parse_time, default=None, metavar="TIME",
                   help=f"{what}. TIME: ISO 8601 (2026-11-28T14:29:00Z; local time without an "
                   "offset, as Kafka's tools) or epoch milliseconds. Refused (exit 1, naming the "
                   "earliest exact time) when compaction already cleaned history past TIME")
    s.add_argument("--allow-inexact", action="store_true",
                   help="with --as-of: answer from what the store still holds even when "
                   "compaction already cleaned history past TIME")


def _as_of_usage(parser: argparse.ArgumentParser,
                 more: Callable[[Any], None] | None = None) -> Callable[[Any], None]:
    """--allow-inexact goes with --as-of."""
    def check(args) -> None:
        if args.allow_inexact and args.as_of is None:
            parser.error("--allow-inexact goes with --as-of TIME")
        if more is not None:
            more(args)
    return check


def _restore_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    def check(args) -> None:
        if args.keep_schema_ids and not args.schema_registry:
            parser.error("--keep-schema-ids goes with --schema-registry URL")
        if args.acl_principal_map and not args.acls:
            parser.error("--acl-principal-map goes with --acls")
        if args.groups and args.repartition:
            parser.error("--groups cannot go with --repartition: records change partitions, so "
                         "a group's position in a source partition has no place in the target")
    return check


def _kv_as_of_usage(parser: argparse.ArgumentParser) -> Callable[[Any], None]:
    def check(args) -> None:
        if args.as_of is not None and (args.follow or args.bootstrap_servers):
            parser.error("--as-of builds a past state from the store: not with --follow or "
                         "--bootstrap-servers")
    return check


class _Version(argparse.Action):
    """``--version``: kcompact's version, then the Kafka I/O path and the zstd path in use (the
    C client and the vendored decoder, or what runs instead and why), one line each. Worked out
    only when asked: loading librdkafka is not free."""

    def __call__(self, parser, namespace, values, option_string=None):
        from kcompact import __version__
        from kcompact.reput.codecs import zstd_path
        from .framework.native_kafka import describe
        print(f"kcompact {__version__}\nkafka io: {describe()}\nzstd: {zstd_path()}")
        parser.exit()


def _store_flag(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--store", required=True, metavar="URL",
                   help=f"{what}: a directory, or s3://bucket/prefix")


def _map_flags(s: argparse.ArgumentParser, store: str) -> None:
    """--store, --topic and --db of the commands that build a key-value map."""
    _store_flag(s, store)
    s.add_argument("--topic", required=True, metavar="TOPIC",
                   help="the store topic whose latest value per key the map holds")
    s.add_argument("--db", required=True, metavar="DIR",
                   help="the map's LevelDB directory: created when missing, brought up to "
                   "date when it exists")


def _bootstrap_flag(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--bootstrap-servers", required=True, metavar="HOST:PORT[,...]",
                   help=f"{what}: one or more brokers, comma-separated")


def _json_flag(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--json", action="store_true", help=what)


def _kafka_settings_flag(s: argparse.ArgumentParser, client: str, when: str = "") -> None:
    s.add_argument("-X", dest="kafka_config", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a librdkafka {client} setting{' ' + when if when else ''}, e.g. "
                   "security.protocol=SASL_SSL (repeatable)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_usage = getattr(args, "check_usage", None)
    if check_usage is not None:
        check_usage(args)  # exits 2 with argparse's usage message
    from kcompact.reput.env import debug as env_debug
    debug = env_debug()
    if getattr(args, "log_format", "text") == "json":
        from .apps.output import JsonLines
        name = " ".join(x for x in (args.command, getattr(args, "kv_command", None),
                                    getattr(args, "connect_command", None)) if x)
        sys.stderr = JsonLines(sys.stderr, name)
    try:
        with bulk_gc():  # a command is one bulk job (connectors/framework/gcmode.py)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kcompact: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except (KcompactError, OSError) as e:  # one a user can act on: one line, exit 1
        if debug:
            traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kcompact: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # an unexpected failure is still one line, with its type
        if debug:
            traceback.print_exc()
        print(f"kcompact: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set KCOMPACT_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
