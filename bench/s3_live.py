"""Benchmark (issue 49): the live edge of an S3 store through the Kafka endpoint - the endpoint's
S3 requests a second and produce -> consume latency - with the journal follower (reput/
s3_follow.py) next to the old LIST-polling refresh, in one run.

    python bench/s3_live.py [--partitions 8,512] [--seconds 60] [--rate 2]

The issue's shape, everything on 127.0.0.1: SeaweedFS (connectors/devtools/seaweed.py) and the
embedded broker (Tansu, connectors/devtools/broker.py) are started here; for each partition
count a topic of that many partitions gets ``--rate`` records a second per partition (100-byte
values, the producer's CreateTime) for the whole run; ``kcompact mirror --follow`` (a child
process, the defaults: a new S3 store, so shared uploads, flushed every 500 ms) copies it into
``s3://bench/live-<P>-<id>``; the Kafka endpoint (``kcompact serve --kafka-listen``'s
``run_kafka_endpoint``, run in this process so that its S3 client is the one counted) serves
that store, and one confluent-kafka consumer, assigned every partition at its end, reads for
``--seconds``. Each S3 call of this process is counted by wrapping the boto3 client the backend
makes (``reput.s3.make_client``), as bench/s3_estate.py counts a writer's; the mirror's requests
are its own process's and not counted. The endpoint runs twice per partition count, on a fresh
store view each time: ``journal`` (the default) and ``list`` (``KCOMPACT_S3_FOLLOW=list``: every
refresh of every partition lists its manifests and ``shared/``, and every fetch lists the
topic's partitions - the path before issue 49, the baseline).

Printed per partition count and mode: requests a second by kind over the steady window (from
the consumer's first record + 5 s to the end), LISTs, latency p50/p99/max (consume time minus
the record's CreateTime), records produced in the window and how many the consumer had not
received 15 s after it, and where a record's time went (``writer``: from its CreateTime to its
flush's journal entry's created_ms; ``commit``: from there until this process held the entry;
``serve``: from there until the consumer had it); then journal / list ratios.
``BENCH_MIRROR_CACHE=DIR`` puts the mirror's commit log and local segments in DIR;
``BENCH_MIRROR_PROFILE=FILE`` runs the mirror under cProfile (its stats in FILE). Targets:
<= 8 requests a second and no LIST in steady state at 8 and at 512 partitions, p99 <= 1.5 s,
every record delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from kcompact.connectors.devtools.broker import EmbeddedBroker  # noqa: E402
from kcompact.connectors.devtools.seaweed import SeaweedS3  # noqa: E402
from kcompact.reput import s3 as s3mod  # noqa: E402
from kcompact.reput import shared as SH  # noqa: E402

KINDS = {"get_object": "GET", "list_objects_v2": "LIST", "put_object": "PUT",
         "head_object": "HEAD", "delete_objects": "DEL", "delete_object": "DEL"}


class Counted:
    """A boto3 S3 client whose calls are counted by kind (``COUNTS``)."""

    def __init__(self, client, counts: Counter, lock: threading.Lock):
        self._c, self._counts, self._lock = client, counts, lock

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        kind = KINDS.get(name)
        if kind is None or not callable(attr):
            return attr

        def call(*a, **k):
            what = what_of(k.get("Key") or k.get("Prefix") or "")
            with self._lock:
                self._counts[kind] += 1
                WHAT[f"{kind} {what}"] += 1
            return attr(*a, **k)
        return call


def what_of(key: str) -> str:
    """What a request's key or prefix is, for the breakdown (store prefix dropped)."""
    bits = key.split("/")[1:]  # (the store's prefix first)
    if not bits or bits == [""]:
        return "store root"
    if bits[0] == "partitions":
        if "manifest" in bits:
            return "partition manifest"
        return "partitions listing" if len(bits) <= 3 else "partition segment"
    if bits[0] == "shared":
        if "journal" in bits:
            return "journal entry" if bits[-1] else "journal listing"
        if bits[-1] == "writers.json":
            return "writers registry"
        return "shared object" if bits[-1].endswith(".kso") else "shared listing"
    return bits[0]


WHAT: Counter = Counter()


COUNTS: Counter = Counter()
COUNTS_LOCK = threading.Lock()
_make_client = s3mod.make_client
s3mod.make_client = lambda *a, **k: Counted(_make_client(*a, **k), COUNTS, COUNTS_LOCK)


#: when this process first held each journal entry: (partition, offset) -> (the entry's
#: created_ms, the ms this process added it), for the latency's stages (``shared.on_entry``)
SEEN: dict[tuple[int, int], tuple[int, int]] = {}


@SH.on_entry
def _seen(_fs, entry) -> None:
    now = int(time.time() * 1000)
    for part in entry.parts:
        d = part.desc
        if d is not None:
            for o in range(d.base, d.last_offset + 1):
                SEEN.setdefault((part.partition, o), (entry.created_ms, now))


def counts() -> Counter:
    with COUNTS_LOCK:
        return Counter(COUNTS)


def whats() -> Counter:
    with COUNTS_LOCK:
        return Counter(WHAT)


class Producing(threading.Thread):
    """``rate`` records a second to every partition of ``topic``, in 10 steps a second."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, rate: float):
        super().__init__(daemon=True)
        self.p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                           "enable.idempotence": False, "acks": "1"})
        self.topic, self.partitions, self.rate = topic, partitions, rate
        self.stop = threading.Event()
        self.sent: list[tuple[int, int]] = []  # (ms, partition) per record sent
        self.errors = 0

    def run(self) -> None:
        per_step = self.partitions * self.rate / 10.0
        owed, n, t = 0.0, 0, time.monotonic()
        value = b"v" * 100
        while not self.stop.is_set():
            owed += per_step
            while owed >= 1:
                part = n % self.partitions
                n += 1
                owed -= 1
                try:
                    self.p.produce(self.topic, value, key=b"k%d" % n, partition=part,
                                   timestamp=int(time.time() * 1000))
                    self.sent.append((int(time.time() * 1000), part))
                except BufferError:
                    self.errors += 1
            self.p.poll(0)
            t += 0.1
            time.sleep(max(0.0, t - time.monotonic()))
        self.p.flush(10)


class Endpoint(threading.Thread):
    """The Kafka endpoint on ``url`` in this process (its own event loop)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.ready = threading.Event()
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_ev: asyncio.Event | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from kcompact.replication.kafka_endpoint.command import (KafkaEndpointOptions,
                                                                  run_kafka_endpoint)

        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_ev = asyncio.Event()

            def ready(_host, port):
                self.port = port
                self.ready.set()
            await run_kafka_endpoint(self.url, KafkaEndpointOptions("127.0.0.1:0"),
                                     stop=self.stop_ev, ready=ready)
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e
            self.ready.set()

    def close(self) -> None:
        if self.loop is not None and self.stop_ev is not None:
            self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.join(30)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def source_ends(bootstrap: str, topic: str, partitions: int) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"w-{uuid.uuid4()}"})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in range(partitions)]
    finally:
        c.close()


def measure(url: str, topic: str, partitions: int, seconds: float, bootstrap: str,
            mode: str) -> dict:
    """One endpoint (KCOMPACT_S3_FOLLOW=mode) and one consumer at the end of every partition:
    the steady window's requests and latencies, and the records not delivered 15 s after."""
    os.environ["KCOMPACT_S3_FOLLOW"] = mode
    ep = Endpoint(url)
    ep.start()
    ep.ready.wait(120)
    if ep.error is not None:
        raise ep.error
    c = Consumer({"bootstrap.servers": f"127.0.0.1:{ep.port}", "group.id": f"b-{uuid.uuid4()}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 500})
    try:
        c.assign([TopicPartition(topic, p, OFFSET_END) for p in range(partitions)])
        lat: list[float] = []
        stages: dict[str, list[float]] = {"writer": [], "commit": [], "serve": []}
        got: dict[int, set[int]] = {p: set() for p in range(partitions)}
        started = time.time()
        window_start = t_end = late_until = None
        c0 = c1 = None
        ends: list[int] = []
        while True:
            m = c.poll(0.2)
            now = time.time()
            if m is not None and m.error() is None:
                got[m.partition()].add(m.offset())
                if window_start is None:
                    window_start, t_end = now + 5, now + 5 + seconds
                if c0 is not None and c1 is None:
                    ts = m.timestamp()[1]
                    lat.append(now * 1000 - ts)
                    seen = SEEN.get((m.partition(), m.offset()))
                    if seen is not None:
                        stages["writer"].append(seen[0] - ts)
                        stages["commit"].append(seen[1] - seen[0])
                        stages["serve"].append(now * 1000 - seen[1])
            if window_start is not None and c0 is None and now >= window_start:
                c0, w0, x0 = counts(), now, whats()
            if t_end is not None and c1 is None and now >= t_end:
                c1, w1, x1 = counts(), now, whats()
                ends = source_ends(bootstrap, topic, partitions)
                late_until = time.time() + 15
            if late_until is not None and (now >= late_until or all(
                    not got[p] or max(got[p]) >= ends[p] - 1 for p in range(partitions))):
                break
            if window_start is None and now - started > 180:
                raise RuntimeError("the consumer received nothing in 180 s")
        made = c1 - c0
        span = w1 - w0
        missing = 0
        for p in range(partitions):
            if got[p]:
                lo = min(got[p])
                missing += sum(1 for o in range(lo, ends[p]) if o not in got[p])
        return {"mode": mode, "requests": dict(made), "what": dict((x1 - x0).most_common(6)), "per_s": sum(made.values()) / span,
                "list_per_s": made.get("LIST", 0) / span,
                "by_kind_per_s": {k: v / span for k, v in made.items()},
                "p50": pct(lat, 0.5) / 1000, "p99": pct(lat, 0.99) / 1000,
                "max": max(lat) / 1000 if lat else float("nan"), "consumed": len(lat),
                "missing": missing, "seconds": span,
                "stages": {k: (pct(v, 0.5) / 1000, pct(v, 0.99) / 1000, len(v))
                           for k, v in stages.items()}}
    finally:
        c.close()
        ep.close()


def run_count(s3: SeaweedS3, broker, partitions: int, seconds: float, rate: float,
              work: str, modes: list[str]) -> list[dict]:
    topic = f"live-{partitions}-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(60)
    url = s3.url(f"live-{partitions}-{uuid.uuid4().hex[:6]}", bucket="bench")
    producer = Producing(broker.bootstrap_servers, topic, partitions, rate)
    producer.start()
    env = dict(os.environ, **s3.env(), KCOMPACT_CACHE_DIR=os.environ.get(
        "BENCH_MIRROR_CACHE") or os.path.join(work, "mirror-cache"))
    env.pop("KCOMPACT_S3_FOLLOW", None)
    log = open(os.path.join(work, f"mirror-{partitions}.log"), "w")
    # BENCH_MIRROR_PROFILE=FILE: the mirror runs under cProfile, its stats written to FILE
    # when it stops (SIGTERM stops it as Ctrl-C does); the latency then includes the overhead
    prof = os.environ.get("BENCH_MIRROR_PROFILE")
    run = [sys.executable] + (["-m", "cProfile", "-o", prof] if prof else [])
    mirror = subprocess.Popen(run + ["-m", "kcompact", "mirror", "--bootstrap-servers",
                               broker.bootstrap_servers, "--topic", topic, "--store", url,
                               "--follow", "--no-groups"], stdout=log, stderr=log, env=env)
    try:
        deadline = time.time() + 180
        from kcompact.reput import Store
        while True:  # the store exists and holds a record of every partition
            try:
                with Store.open(url) as st:
                    if len(st.partitions(topic)) >= partitions:
                        break
            except Exception:  # noqa: BLE001 - not created yet
                pass
            if mirror.poll() is not None or time.time() > deadline:
                log.flush()
                with open(log.name) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"the mirror did not start (exit {mirror.poll()}); its log "
                                   f"ends:\n{tail}")
            time.sleep(1)
        out = []
        for mode in modes:
            try:
                r = measure(url, topic, partitions, seconds, broker.bootstrap_servers, mode)
            except Exception as e:  # noqa: BLE001 - reported, the other modes still run
                print(f"  {partitions} partitions, {mode}: failed: {e}", flush=True)
                continue
            r["partitions"] = partitions
            out.append(r)
            print(fmt(r), flush=True)
        return out
    finally:
        producer.stop.set()
        producer.join(30)
        mirror.terminate()
        try:
            mirror.wait(60)
        except subprocess.TimeoutExpired:
            mirror.kill()
        log.close()


def fmt(r: dict) -> str:
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["by_kind_per_s"].items()))
    return (f"  {r['partitions']:>4} partitions, {r['mode']:<7}: {r['per_s']:6.2f} S3 requests/s "
            f"({kinds or 'none'}), LIST {r['list_per_s']:.2f}/s; latency p50 {r['p50']:.2f} s, "
            f"p99 {r['p99']:.2f} s, max {r['max']:.2f} s; {r['consumed']} records in "
            f"{r['seconds']:.0f} s, {r['missing']} not delivered 15 s later\n"
            f"        stages p50/p99 (s): " + ", ".join(
                f"{k} {a:.2f}/{b:.2f}" for k, (a, b, _n) in r["stages"].items()) + "\n"
            f"        by key: " + ", ".join(f"{k} {v / r['seconds']:.2f}/s"
                                          for k, v in r["what"].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", default="8,512")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=2.0, help="records a second per partition")
    ap.add_argument("--modes", default="journal,list")
    args = ap.parse_args()
    counts_ = [int(x) for x in args.partitions.split(",")]
    modes = args.modes.split(",")
    results = []
    with tempfile.TemporaryDirectory() as work, SeaweedS3() as s3, EmbeddedBroker() as broker:
        os.environ.update(s3.env())
        os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(work, "cache")
        s3.create_bucket("bench")
        for n in counts_:
            print(f"{n} partitions, {args.rate:g} records/s each, {args.seconds:g} s per mode",
                  flush=True)
            results += run_count(s3, broker, n, args.seconds, args.rate, work, modes)
    print("\nsummary (journal follower vs the LIST-polling baseline, same run):")
    for n in counts_:
        rs = {r["mode"]: r for r in results if r["partitions"] == n}
        j, b = rs.get("journal"), rs.get("list")
        if j is None:
            continue
        line = (f"  {n:>4} partitions: {j['per_s']:.2f} requests/s, {j['list_per_s']:.2f} LIST/s, "
                f"p99 {j['p99']:.2f} s")
        if b is not None:
            line += (f"  | baseline {b['per_s']:.2f} requests/s ({b['list_per_s']:.2f} LIST/s), "
                     f"p99 {b['p99']:.2f} s  | ratio requests {j['per_s'] / max(b['per_s'], 1e-9):.3f}x"
                     f", p99 {j['p99'] / max(b['p99'], 1e-9):.2f}x")
        ok = (j["per_s"] <= 8 and j["list_per_s"] == 0 and j["p99"] <= 1.5
              and j["missing"] == 0)
        print(line + ("  (targets met)" if ok else "  (targets NOT met)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
