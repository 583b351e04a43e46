"""Benchmark: time to a ready key-value map - `kcompact kv build` against a quixstreams app.

    python bench/kv.py [--keys 1000000] [--updates 10000000] [--value-size 100]
                       [--skip-full-topic] [--skip-quix] [--skip-http] [--json]

A topic of K keys whose history is U updates (100-byte values; every key updated U/K times on
average, random order, one partition). What a user would pick instead, in the same run: a
quixstreams application that consumes a topic into its RocksDB state (``State.set`` per message)
until it has seen every message - once on the full U-update topic, once on a topic that holds only
the latest value of each key (K records: the best a broker's log cleaner could leave). Both topics
live in the embedded broker (kcompact.connectors.devtools.broker.EmbeddedBroker, Tansu).

Ours: ``kcompact kv build`` from the compacted store (built here with RecordBatch.from_columns,
then compaction.Compactor with force), as a separate process, timed from spawn to the line it
prints once the map is committed and closed (interpreter start, imports and loading the compiled
kernels included; the kernels are compiled once beforehand, as an installed kcompact has them
cached; the median of three runs). The peer is timed the same way - from spawn to the line it
prints when ``app.run()`` returns - in its own virtual environment (bench/.venv-quix, created on
first use: quixstreams pins confluent-kafka below the project's version). Its settings favour
it: see bench/kv_quix_peer.py. Process exit times are printed too.

Also: ``kv build`` from the uncompacted store (the whole history is the dirty tail: the winners
are picked from the .bcq digests, only their records are read; the median of three), and ``KVMap.get`` latency in
this process (hits and misses, after one warm-up pass), and the same map served by
``kcompact kv serve``: GET /v1/raw of random existing keys from 8 client processes at once, each
over one keep-alive connection (throughput and p50/p99 over every request), next to the
in-process figure of the same run. Targets: ready >= 10x sooner than the quixstreams run on the
K-record topic; get p99 <= 10 us.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn  # noqa: E402

TOPIC = "kv-bench"
BATCH = 200_000
QUIX_VENV = os.path.join(ROOT, "bench", ".venv-quix")
PEER = os.path.join(ROOT, "bench", "kv_quix_peer.py")
TS = 1_700_000_000_000


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Data:
    """The topic's history, generated column-wise: key ids (every key at least once) and
    100-byte printable values (a JSON-ish text value would do as well; quixstreams gets the
    bytes as they are)."""

    def __init__(self, keys: int, updates: int, value_size: int, seed: int = 5):
        rng = np.random.default_rng(seed)
        self.keys, self.updates, self.value_size = keys, updates, value_size
        ids = np.concatenate([rng.permutation(keys), rng.integers(0, keys, updates - keys)])
        rng.shuffle(ids)
        self.ids = ids
        self.key_bytes = np.frombuffer(b"".join(b"key-%012d" % i for i in range(keys)),
                                       np.uint8).reshape(keys, 16)
        self._seed = seed
        # the offset of each key's last update (the compacted topic, in offset order)
        last = np.full(keys, -1, np.int64)
        last[ids] = np.arange(updates)   # later assignments win
        self.latest_offsets = np.sort(last)

    def values(self, lo: int, hi: int) -> np.ndarray:
        rng = np.random.default_rng((self._seed, lo))
        return rng.integers(97, 123, (hi - lo, self.value_size), dtype=np.uint8)

    def chunks(self):
        for lo in range(0, self.updates, BATCH):
            hi = min(self.updates, lo + BATCH)
            yield lo, hi, self.key_bytes[self.ids[lo:hi]], self.values(lo, hi)


def build_store(path: str, data: Data) -> None:
    st = Store.open(path, writer="bench", create=True,
                    options=WriterOptions(fsync="never", commitlog_retention_ms=0))
    for lo, hi, keys, vals in data.chunks():
        st.append(RecordBatch.from_columns(TOPIC, 0, np.arange(lo, hi, dtype=np.int64), TS,
                                           keys=BytesColumn.fixed(keys, 16),
                                           values=BytesColumn.fixed(vals, data.value_size)))
    st.flush()
    st.close()
    shutil.rmtree(os.path.join(path, "commitlog"))


def compact_store(path: str) -> None:
    from kcompact.compaction import Compactor
    from kcompact.compaction.compactor import wait_for_deletes
    with Store.open(path, writer="compact") as st:
        Compactor(st).compact_partition(TOPIC, 0, force=True)
    wait_for_deletes()


def timed(cmd: list[str], ready: str) -> tuple[float, float, str]:
    """Run ``cmd``; return (seconds from spawn to the first stdout line containing ``ready``,
    seconds to exit, stdout). Both programs print that line once their map is committed and
    closed; what follows (interpreter teardown: ~0.7 s for a process that loaded numba) is not
    part of the time to a ready map."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    at = None
    lines = []
    for line in p.stdout:
        lines.append(line)
        if at is None and ready in line:
            at = time.perf_counter() - t
    err = p.stderr.read()
    p.wait()
    wall = time.perf_counter() - t
    if p.returncode != 0 or at is None:
        raise SystemExit(f"{cmd[:4]} failed ({p.returncode}): {err[-3000:]}")
    return at, wall, "".join(lines)


def kv_build(store: str, db: str) -> tuple[float, float, str]:
    shutil.rmtree(db, ignore_errors=True)
    return timed([sys.executable, "-m", "kcompact", "kv", "build", "--store", store,
                  "--topic", TOPIC, "--db", db], " keys of topic ")


def warm_kernels(work: str) -> None:
    """Compile (first run ever) or load the kernels once, outside the timed runs."""
    small = Data(100, 1000, 10)
    store = os.path.join(work, "warm-store")
    build_store(store, small)
    kv_build(store, os.path.join(work, "warm-db"))


def get_latency(db: str, data: Data, n: int = 200_000, rounds: int = 3) -> dict[str, float]:
    """Per-call latency of KVMap.get (perf_counter_ns around each call), for existing keys
    and absent ones, after one warm-up pass. The machine is shared, so the pass with the lowest
    p99 of ``rounds`` is reported (as timeit reports its best), with the median pass's p99."""
    from kcompact.connectors.apps.kv import KVMap
    rng = np.random.default_rng(9)
    hits = [bytes(data.key_bytes[i]) for i in rng.integers(0, data.keys, n)]
    misses = [b"nokey-%010d" % i for i in rng.integers(0, 1 << 40, n // 4)]
    out: dict[str, float] = {}
    with KVMap(db) as m:
        get = m.get
        for name, keys in (("hit", hits), ("miss", misses)):
            for k in keys:        # warm-up pass: LevelDB's block cache and the page cache
                get(k)
            passes = []
            clock = time.perf_counter_ns
            for _ in range(rounds):
                lat = np.empty(len(keys), np.int64)
                for i, k in enumerate(keys):
                    t = clock()
                    get(k)
                    lat[i] = clock() - t
                passes.append((float(np.percentile(lat, 99)), float(np.percentile(lat, 50))))
            passes.sort()
            t = time.perf_counter()
            for k in keys:
                get(k)
            out[f"{name}_per_s"] = len(keys) / (time.perf_counter() - t)
            out[f"{name}_p50_us"] = passes[0][1] / 1000
            out[f"{name}_p99_us"] = passes[0][0] / 1000
            out[f"{name}_p99_median_pass_us"] = passes[len(passes) // 2][0] / 1000
        assert m.get(hits[0]) is not None and m.get(misses[0]) is None
        out["keys"] = len(m)
    return out


def _http_client(args) -> tuple[int, float, np.ndarray]:
    """One client process: ``n`` GET /v1/raw over one keep-alive connection; (hits, seconds,
    latencies in ns)."""
    import http.client
    host, port, targets, token = args
    conn = http.client.HTTPConnection(host, port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    lat = np.empty(len(targets), np.int64)
    hits = 0
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for i, target in enumerate(targets):
        t = clock()
        conn.request("GET", target, headers=headers)
        r = conn.getresponse()
        body = r.read()
        lat[i] = clock() - t
        hits += r.status == 200 and len(body) > 0
    dt = time.perf_counter() - t0
    conn.close()
    return hits, dt, lat


def http_get(store: str, db: str, data: Data, clients: int = 8, per_client: int = 5_000
             ) -> dict[str, float]:
    """``kcompact kv serve`` on the built map (it catches up with nothing), then ``clients``
    processes each doing ``per_client`` GET /v1/raw of random existing keys over one keep-alive
    connection (through the address file's URL and token, as ``kv get`` does): throughput
    and latency percentiles over every request."""
    import base64
    import multiprocessing
    import signal
    import urllib.parse
    from kcompact.connectors.apps.kv.follower_client import FollowerAddress
    err = open(os.path.join(os.path.dirname(db), "serve.err"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kcompact", "kv", "serve", "--store", store,
                             "--topic", TOPIC, "--db", db, "--listen", "127.0.0.1:0"],
                            stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while True:
            err.seek(0)
            if "following topic" in err.read():
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                err.seek(0)
                raise RuntimeError(f"kv serve did not start: {err.read()[-500:]}")
            time.sleep(0.05)
        addr = FollowerAddress.read(db)
        u = urllib.parse.urlsplit(addr.url)
        rng = np.random.default_rng(11)
        jobs = []
        for c in range(clients):
            ids = rng.integers(0, data.keys, per_client)
            targets = ["/v1/raw?key_b64=" + urllib.parse.quote(
                base64.b64encode(bytes(data.key_bytes[i])).decode()) for i in ids]
            jobs.append((u.hostname, u.port, targets, addr.token))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(clients) as pool:
            pool.map(_http_client, [(h, p, t[:200], tok) for h, p, t, tok in jobs])  # warm-up
            t0 = time.perf_counter()
            res = pool.map(_http_client, jobs)
            wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        err.close()
    lat = np.concatenate([r[2] for r in res])
    hits = sum(r[0] for r in res)
    assert hits == clients * per_client, (hits, clients * per_client)
    return {"clients": clients, "requests": int(lat.shape[0]), "wall_s": wall,
            "per_s": lat.shape[0] / wall, "p50_us": float(np.percentile(lat, 50)) / 1000,
            "p99_us": float(np.percentile(lat, 99)) / 1000}


# ---------------------------------------------------------------------------------------------
# the peer


def ensure_quix_venv() -> str:
    py = os.path.join(QUIX_VENV, "bin", "python")
    ok = os.path.exists(py) and subprocess.run(
        [py, "-c", "import quixstreams"], capture_output=True).returncode == 0
    if not ok:
        say(f"creating {QUIX_VENV} with quixstreams (once)")
        subprocess.run([sys.executable, "-m", "venv", QUIX_VENV], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "quixstreams"], check=True)
    return py


def produce(bootstrap: str, topic: str, data: Data, offsets: np.ndarray | None) -> float:
    """Produce the history (offsets None) or only the records at ``offsets``."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    # the embedded broker describes only configs that were set; quixstreams reads these two
    cfg = {"retention.ms": "-1", "retention.bytes": "-1",
           "cleanup.policy": "compact" if offsets is not None else "delete"}
    admin.create_topics([NewTopic(topic, 1, 1, config=cfg)])[topic].result()
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000,
                  "queue.buffering.max.messages": 1_000_000, "compression.type": "none"})
    t = time.perf_counter()
    produce_one = p.produce
    for lo, hi, keys, vals in data.chunks():
        idx = np.arange(lo, hi)
        if offsets is not None:
            sel = np.searchsorted(offsets, idx)
            sel = np.minimum(sel, offsets.shape[0] - 1)
            keep = offsets[sel] == idx
            keys, vals = keys[keep], vals[keep]
        kl = keys.view(f"S{keys.shape[1]}").ravel().tolist()
        vl = vals.view(f"S{vals.shape[1]}").ravel().tolist()
        for k, v in zip(kl, vl):
            while True:
                try:
                    produce_one(topic, v, k, partition=0, timestamp=TS)
                    break
                except BufferError:
                    p.poll(0.05)
        p.poll(0)
    p.flush()
    return time.perf_counter() - t


def run_peer(py: str, bootstrap: str, topic: str, expected: int, work: str) -> dict:
    state = tempfile.mkdtemp(prefix="quix-state-", dir=work)
    at, wall, out = timed([py, PEER, "--bootstrap-servers", bootstrap, "--topic", topic,
                           "--expected", str(expected), "--state-dir", state], "READY")
    doc = json.loads(out.strip().splitlines()[-1])
    doc["ready_wall_s"], doc["wall_s"] = at, wall
    shutil.rmtree(state, ignore_errors=True)
    return doc


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--updates", type=int, default=10_000_000)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--skip-quix", action="store_true", help="measure kcompact only")
    ap.add_argument("--skip-http", action="store_true",
                    help="skip the kv serve figure (HTTP gets, 8 concurrent clients)")
    ap.add_argument("--skip-full-topic", action="store_true",
                    help="run quixstreams on the latest-per-key topic only")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    a = ap.parse_args(argv)
    if a.updates < a.keys:
        ap.error("--updates must be at least --keys")
    work = tempfile.mkdtemp(prefix="kcompact-bench-kv-", dir=a.workdir)
    res: dict = {"keys": a.keys, "updates": a.updates, "value_size": a.value_size}
    try:
        say(f"generating {a.updates:,} updates of {a.keys:,} keys")
        data = Data(a.keys, a.updates, a.value_size)
        warm_kernels(work)
        store = os.path.join(work, "store")
        t = time.perf_counter()
        build_store(store, data)
        res["store_build_s"] = time.perf_counter() - t
        say(f"store written in {res['store_build_s']:.1f}s; kv build from the uncompacted store")
        dirty = [kv_build(store, os.path.join(work, "db-dirty"))[0] for _ in range(3)]
        res["ours_dirty_s"] = sorted(dirty)[1]   # the median of three
        res["ours_dirty_runs_s"] = dirty
        t = time.perf_counter()
        compact_store(store)
        res["compaction_s"] = time.perf_counter() - t
        say(f"compacted in {res['compaction_s']:.1f}s; kv build from the compacted store")
        db = os.path.join(work, "db")
        runs = [kv_build(store, db) for _ in range(3)]
        res["ours_s"] = sorted(r[0] for r in runs)[1]   # the median of three
        res["ours_runs_s"] = [r[0] for r in runs]
        res["ours_exit_s"] = [r[1] for r in runs]
        res["ours_summary"] = runs[-1][2].strip()
        say(res["ours_summary"])
        res["get"] = get_latency(db, data)
        assert res["get"]["keys"] == a.keys, res["get"]
        if not a.skip_http:
            say("kcompact kv serve: GET /v1/raw with 8 concurrent client processes")
            res["http"] = http_get(store, db, data)
        if not a.skip_quix:
            from kcompact.connectors.devtools.broker import EmbeddedBroker
            py = ensure_quix_venv()
            with EmbeddedBroker() as broker:
                b = broker.bootstrap_servers
                say(f"producing {a.keys:,} latest records to the broker")
                res["produce_latest_s"] = produce(b, "kv-latest", data, data.latest_offsets)
                say("quixstreams on the latest-per-key topic")
                res["quix_latest"] = run_peer(py, b, "kv-latest", a.keys, work)
                say(json.dumps(res["quix_latest"]))
                if not a.skip_full_topic:
                    say(f"producing the full history ({a.updates:,} updates) to the broker")
                    res["produce_full_s"] = produce(b, "kv-full", data, None)
                    say("quixstreams on the full topic")
                    res["quix_full"] = run_peer(py, b, "kv-full", a.updates, work)
                    say(json.dumps(res["quix_full"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in ("quix_latest", "quix_full"):
        if name in res:
            res[f"ratio_{name}"] = res[name]["ready_wall_s"] / res["ours_s"]
            if res[name]["keys_in_state"] != a.keys:
                say(f"warning: {name} state holds {res[name]['keys_in_state']:,} keys")
    if a.json_out:  # bench/report.py: the figures as JSON, the text as printed
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    g = res["get"]
    print(f"time to a ready map: {a.keys:,} keys, history of {a.updates:,} updates, "
          f"{a.value_size}-byte values, one partition (nproc={os.cpu_count()})")
    print(f"  kcompact kv build, compacted store     {res['ours_s']:8.2f} s   (median of "
          + ", ".join(f"{w:.2f}" for w in res["ours_runs_s"]) + "; process exit after "
          + ", ".join(f"{w:.2f}" for w in res["ours_exit_s"]) + ")")
    print(f"  kcompact kv build, uncompacted store   {res['ours_dirty_s']:8.2f} s   (median of "
          + ", ".join(f"{w:.2f}" for w in res["ours_dirty_runs_s"]) + "; winners from the "
          ".bcq digests)")
    for name, label, n in (("quix_latest", "latest-per-key topic", a.keys),
                           ("quix_full", "full-history topic  ", a.updates)):
        if name in res:
            q = res[name]
            consume_s = q["ready_s"] - q["first_message_s"]
            print(f"  quixstreams, {label} {q['ready_wall_s']:8.2f} s   ({n:,} messages; first "
                  f"message after {q['first_message_s']:.1f}s, then {consume_s:.1f}s"
                  f" to ready)   ours is {res[f'ratio_{name}']:.1f}x faster"
                  + ("   (target >= 10x)" if name == "quix_latest" else ""))
    print(f"  KVMap.get in-process: hit p50 {g['hit_p50_us']:.2f} us, p99 {g['hit_p99_us']:.2f} us"
          f" (target <= 10; median pass {g['hit_p99_median_pass_us']:.2f}); miss p50 "
          f"{g['miss_p50_us']:.2f} us, p99 {g['miss_p99_us']:.2f} us")
    if "http" in res:
        h = res["http"]
        print(f"  kv serve GET /v1/raw, {h['clients']} client processes: {h['per_s']:,.0f} "
              f"gets/s, p50 {h['p50_us']:.0f} us, p99 {h['p99_us']:.0f} us; in-process "
              f"KVMap.get, one thread, same run: {g['hit_per_s']:,.0f} gets/s, p99 "
              f"{g['hit_p99_us']:.2f} us")
    print(f"  (store written in {res['store_build_s']:.1f}s and compacted in "
          f"{res['compaction_s']:.1f}s before; not part of either figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
