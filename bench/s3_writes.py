"""Benchmark (issue 49): a following mirror's S3 requests a second as the partition count grows,
with the defaults (a new S3 store: shared uploads, the store catalog) next to per-partition
uploads (``--upload partition``: the defaults before issue 49, the baseline), in one run.

    python bench/s3_writes.py [--partitions 8,256] [--seconds 30] [--rate 2] [--by-key]

The issue's shape, everything on 127.0.0.1: SeaweedFS (connectors/devtools/seaweed.py) and the
embedded broker (Tansu, connectors/devtools/broker.py) are started here; for each partition
count and mode a topic of that many partitions gets ``--rate`` records a second per partition
(100-byte values) for the whole run, and ``kcompact mirror --follow`` copies it into a new store
``s3://bench/writes-<P>-<mode>-<id>``. The mirror runs in a child process (this script with
``--child``) that wraps the boto3 client the backend makes (``reput.s3.make_client``), as
bench/s3_live.py counts the Kafka endpoint's, and writes its counts by kind every second; the
mirror then runs ``kcompact``'s own command line in that process. Printed per partition count
and mode: requests a second over the mirror's first ``--seconds`` (what the issue measured:
opening the store and every partition, then flushing) and over its last half (the steady
state), by kind; then each mode's ratio of the largest partition count's rate to the smallest's.
Target: with the defaults, the rate at 256 partitions <= 2x the rate at 8 (issue 49 measured 21x
with per-partition uploads, then the default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = {"get_object": "GET", "list_objects_v2": "LIST", "put_object": "PUT",
         "head_object": "HEAD", "delete_objects": "DEL", "delete_object": "DEL",
}


def child(out_path: str, argv: list[str]) -> int:
    """The mirror, its S3 calls counted; the counts written to ``out_path`` every second."""
    from kcompact.reput import s3 as s3mod
    counts: Counter = Counter()
    lock = threading.Lock()

    class Counted:
        def __init__(self, client):
            self._c = client

        def __getattr__(self, name):
            attr = getattr(self._c, name)
            kind = KINDS.get(name)
            if kind is None or not callable(attr):
                return attr

            def call(*a, **k):
                key = k.get("Key") or k.get("Prefix") or ""
                with lock:
                    counts[kind] += 1
                    counts[f"K {kind} {shape_of(key)}"] += 1
                return attr(*a, **k)
            return call

    make = s3mod.make_client
    s3mod.make_client = lambda *a, **k: Counted(make(*a, **k))
    t0 = time.monotonic()

    def report():
        with open(out_path, "a") as f:
            while True:
                time.sleep(1.0)
                with lock:
                    snap = dict(counts)
                f.write(json.dumps({"t": time.monotonic() - t0, "counts": snap}) + "\n")
                f.flush()
    threading.Thread(target=report, daemon=True).start()
    from kcompact.connectors.cli import main
    return main(argv)


def shape_of(key: str) -> str:
    """The key with its store prefix cut, partition numbers as N and versions as V."""
    key = key.split("/", 1)[1] if "/" in key else key
    key = re.sub(r"\d{20}", "V", key)
    key = re.sub(r"V-[0-9a-f]{16}", "V-tag", key)
    return re.sub(r"/\d+(?=/|$)", "/N", key)


def rate(samples: list[dict], lo: float, hi: float) -> tuple[float, dict]:
    """Requests a second between the samples nearest ``lo`` and ``hi`` seconds, by kind."""
    a = min(samples, key=lambda s: abs(s["t"] - lo))
    b = min(samples, key=lambda s: abs(s["t"] - hi))
    dt = max(1e-9, b["t"] - a["t"])
    kinds = {k: (b["counts"].get(k, 0) - a["counts"].get(k, 0)) / dt
             for k in set(a["counts"]) | set(b["counts"])}
    kinds = {k: v for k, v in kinds.items() if v}
    keys = {k[2:]: v * dt for k, v in kinds.items() if k.startswith("K ")}
    kinds = {k: v for k, v in kinds.items() if not k.startswith("K ")}
    return sum(kinds.values()), kinds, keys


def run_one(s3, broker, partitions: int, mode: str, seconds: float, rate_per_s: float,
            work: str) -> dict:
    from confluent_kafka.admin import AdminClient, NewTopic
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from s3_live import Producing
    topic = f"writes-{partitions}-{mode}-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(60)
    url = s3.url(f"{topic}", bucket="bench")
    producer = Producing(broker.bootstrap_servers, topic, partitions, rate_per_s)
    producer.start()
    out_path = os.path.join(work, f"{topic}.counts")
    log = open(os.path.join(work, f"{topic}.log"), "w")
    env = dict(os.environ, KCOMPACT_CACHE_DIR=os.path.join(work, f"cache-{topic}"))
    argv = ["mirror", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic,
            "--store", url, "--follow", "--no-groups"]
    if mode == "partition":
        argv += ["--upload", "partition"]
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", out_path,
                             "--", *argv], stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + seconds + 5
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"the mirror stopped (see {log.name})")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        producer.stop.set()
        producer.join(30)
        log.close()
    with open(out_path) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    first, first_k, first_keys = rate(samples, 0.0, seconds)
    steady, steady_k, _ = rate(samples, seconds / 2, seconds)
    return {"partitions": partitions, "mode": mode, "first": first, "first_kinds": first_k,
            "steady": steady, "steady_kinds": steady_k, "first_keys": first_keys}


def fmt_kinds(kinds: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items())) or "none"


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        out_path = sys.argv[i + 1]
        return child(out_path, sys.argv[sys.argv.index("--") + 1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", default="8,256")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--by-key", action="store_true",
                    help="also print the requests of each run's first --seconds by key "
                    "(partitions as N)")
    args = ap.parse_args()
    from kcompact.connectors.devtools.broker import EmbeddedBroker
    from kcompact.connectors.devtools.seaweed import SeaweedS3
    plist = [int(p) for p in args.partitions.split(",")]
    res = {}
    with tempfile.TemporaryDirectory() as work, SeaweedS3() as s3, EmbeddedBroker() as broker:
        os.environ.update(s3.env())
        s3.create_bucket("bench")
        for p in plist:
            for mode in ("defaults", "partition"):
                r = run_one(s3, broker, p, mode, args.seconds, args.rate, work)
                res[(p, mode)] = r
                print(f"{p:4d} partitions, {mode:9s}: first {args.seconds:.0f} s "
                      f"{r['first']:7.2f} requests/s ({fmt_kinds(r['first_kinds'])}); "
                      f"last {args.seconds / 2:.0f} s {r['steady']:7.2f} requests/s "
                      f"({fmt_kinds(r['steady_kinds'])})", flush=True)
                if args.by_key:
                    for shape, v in sorted(r["first_keys"].items(), key=lambda kv: -kv[1])[:12]:
                        print(f"        {v:>7.0f} {shape}")
    lo, hi = min(plist), max(plist)
    print(f"\nsummary (a following mirror's S3 requests a second, {hi} vs {lo} partitions, "
          "same run):")
    for mode in ("defaults", "partition"):
        a, b = res[(lo, mode)], res[(hi, mode)]
        r1, r2 = b["first"] / max(a["first"], 1e-9), b["steady"] / max(a["steady"], 1e-9)
        note = (f" (target <= 2x: {'met' if r1 <= 2 else 'NOT met'})" if mode == "defaults"
                else " (baseline: per-partition uploads)")
        print(f"  {mode:9s}: first {args.seconds:.0f} s {a['first']:.2f} -> {b['first']:.2f} "
              f"requests/s = {r1:.2f}x; steady {a['steady']:.2f} -> {b['steady']:.2f} = "
              f"{r2:.2f}x{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
