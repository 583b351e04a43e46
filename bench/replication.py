"""Benchmark: rebuild of a replica over loopback, next to `cp -r` of the master store directory.

    python bench/replication.py [--size 1GiB] [--partitions 4] [--tombstones 0.01] [--json]
                                [--baseline-python PY [--rounds 3]]

A compacted master of about ``--size`` bytes of records (16-byte keys, 100-byte values, a share
of tombstones, several partitions) is built with ``RecordBatch.from_columns`` and force-compacted
once (not timed); its fully dispatched commit log is removed so that the directory holds what a
replica pulls. Then, in the same run:

1. baseline: ``cp -r`` of the master store directory (page cache warm, no fsync), and the same
   followed by ``sync -f`` (the rebuild fsyncs what it writes);
2. ``kcompact serve`` on 127.0.0.1 (started before timing), and ``kcompact replicate`` into an
   empty directory: pull from offset 0 of every partition (CRC check of every record, digests
   under the replica's own secret), install, force-compaction, fsync. Timed as the whole command
   (interpreter start included) and as the rebuild the command reports;
3. ``kcompact verify --against`` must then exit 0.

With ``--link MB/s``, the rebuild is run once more over an emulated link of that rate (the
replica paces its pull: KCOMPACT_REPLICATION_RATE), next to the time that link takes to carry
the master's bytes at rest (what a copy over it would cost at best): on anything slower than
loopback the bytes moved, not the CPU, set the rebuild's time.

With ``--baseline-python PY`` (the interpreter of another kcompact installation, e.g. a checkout
from before store format 2) the whole measurement is run ``--rounds`` times by each installation
in turn, each building its own master, and the medians of the rebuild and of the command are
printed with the ratio ours / baseline (issue 28's target: within 10 %).

Target: rebuild time <= 2 x copy time. Prints the ratios and MB/s. The rebuild is durable
(it fsyncs what it writes before saying "rebuilt"), `cp -r` is not: on a disk slower than the
page cache the durable copy (`cp -r` + `sync`) is the like-for-like baseline, and both ratios are
printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("kcompact") is None:  # (run by another installation: its own)
    sys.path.insert(0, ROOT)

from kcompact.compaction import CompactionOptions, Compactor  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput.record import RecordBatch, BytesColumn  # noqa: E402

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")
TOPIC = "bench"
KEY, VALUE, BATCH = 16, 100, 200_000
RECORD = 44 + len(TOPIC) + KEY + VALUE


def _size(text: str) -> int:
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def _reported(out: str, fallback: float) -> float:
    """The rebuild time the command reports: "X MB pulled in T.Ts (R MB/s)" gives it to a
    tenth of a second, X / R to a fraction of a percent (R is whole MB/s); else ``fallback``."""
    m = re.search(r"([0-9,.]+) MB pulled in ([0-9.]+)s \(([0-9,]+) MB/s\)", out)
    if m:
        mb, secs, rate = (float(g.replace(",", "")) for g in m.groups())
        if rate > 0 and abs(mb / rate - secs) <= 0.051 + secs * 0.01:
            return mb / rate
        return secs
    m = re.search(r"in ([0-9.]+)s", out)
    return float(m.group(1)) if m else fallback


def build_master(path: str, size: int, partitions: int, tombstones: float) -> dict:
    n = max(size // RECORD // partitions, 1)
    rng = np.random.default_rng(1)
    t = time.perf_counter()
    with Store.open(path, writer="bench", create=True,
                    options=WriterOptions(fsync="never")) as st:
        for p in range(partitions):
            for lo in range(0, n, BATCH):
                m = min(BATCH, n - lo)
                keys = rng.integers(0, 256, (m, KEY), dtype=np.uint8)
                keys[:, :8] = np.arange(lo, lo + m, dtype=np.uint64).view(np.uint8).reshape(m, 8)
                vals = rng.integers(97, 123, (m, VALUE), dtype=np.uint8)
                vcol = BytesColumn.fixed(vals, VALUE)
                if tombstones:
                    tomb = rng.random(m) < tombstones
                    vcol.null = tomb
                    lens = np.where(tomb, 0, VALUE)
                    vcol.offs = np.zeros(m + 1, np.int64)
                    np.cumsum(lens, out=vcol.offs[1:])
                    vcol.buf = vals[~tomb].reshape(-1)
                st.append(RecordBatch.from_columns(TOPIC, p, np.arange(lo, lo + m, dtype=np.int64),
                                                   1_700_000_000_000,
                                                   keys=BytesColumn.fixed(keys, KEY), values=vcol))
        st.flush()
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    with Store.open(path) as st:
        for p in range(partitions):
            Compactor(st, CompactionOptions()).compact_partition(TOPIC, p, force=True)
    shutil.rmtree(os.path.join(path, "commitlog"), ignore_errors=True)
    return {"records": n * partitions, "build_s": build_s,
            "master_compact_s": time.perf_counter() - t}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return dt, r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: int, partitions: int, tombstones: float, workdir: str,
        link_mb_s: float = 0.0) -> dict:
    master = os.path.join(workdir, "master")
    info = build_master(master, size, partitions, tombstones)
    data = dir_bytes(master)
    subprocess.run(["sync"], check=False)
    cp = []
    for i in range(2):
        dst = os.path.join(workdir, f"copy{i}")
        dt, _ = timed(["cp", "-r", master, dst])
        cp.append(dt)
        shutil.rmtree(dst)
    dst = os.path.join(workdir, "copy-sync")
    t = time.perf_counter()
    subprocess.run(["cp", "-r", master, dst], check=True)
    subprocess.run(["sync", "-f", dst], check=True)
    cp_sync = time.perf_counter() - t
    shutil.rmtree(dst)

    token = os.path.join(workdir, "token")
    with open(token, "w") as f:
        f.write(secrets.token_hex(24))
    port = free_port()
    srv = subprocess.Popen([KCOMPACT, "serve", "--store", master, "--listen",
                            f"127.0.0.1:{port}", "--token-file", token],
                           stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stderr.readline()
        if "serving" not in line:
            raise SystemExit(f"kcompact serve did not start: {line}")
        url = f"http://127.0.0.1:{port}"
        replica = os.path.join(workdir, "replica")
        rebuild_cmd, r = timed([KCOMPACT, "replicate", "--from", url, "--token-file", token,
                                "--store", replica])
        rebuild_s = _reported(r.stdout, rebuild_cmd)
        vt, v = timed([KCOMPACT, "verify", "--store", replica, "--against", url,
                       "--token-file", token])
        link = {}
        if link_mb_s:
            shutil.rmtree(replica)
            env = dict(os.environ, KCOMPACT_REPLICATION_RATE=str(int(link_mb_s * 1e6)))
            cmd, lr = timed([KCOMPACT, "replicate", "--from", url, "--token-file", token,
                             "--store", replica], env=env)
            link = {"link_mb_s": link_mb_s, "link_rebuild_s": _reported(lr.stdout, cmd),
                    "link_copy_s": data / (link_mb_s * 1e6)}
    finally:
        srv.terminate()
        srv.wait(30)
    copy_s = min(cp)
    return {**info, "partitions": partitions, "tombstones": tombstones, "bytes": data,
            "cp_s": copy_s, "cp_sync_s": cp_sync, "rebuild_command_s": rebuild_cmd,
            "rebuild_s": rebuild_s, "verify_s": vt,
            "ratio_command_vs_cp": rebuild_cmd / copy_s, "ratio_rebuild_vs_cp": rebuild_s / copy_s,
            "ratio_command_vs_cp_sync": rebuild_cmd / cp_sync,
            "ratio_rebuild_vs_cp_sync": rebuild_s / cp_sync,
            "cp_mb_s": data / copy_s / 1e6, "rebuild_mb_s": data / rebuild_s / 1e6,
            "verify_equal": "EQUAL" in v.stdout,
            "replicate_stderr": r.stderr.strip().splitlines(), **link}


def _side(python: str, a) -> dict:
    """One measurement by the installation of ``python`` (this file run as a worker)."""
    cmd = [python, os.path.abspath(__file__), "--size", str(a.size), "--partitions",
           str(a.partitions), "--tombstones", str(a.tombstones), "--json"]
    if a.workdir:
        cmd += ["--workdir", a.workdir]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])


def _against(a) -> int:
    ours, base = [], []
    for _ in range(a.rounds):
        ours.append(_side(sys.executable, a))
        base.append(_side(a.baseline_python, a))
    doc = {"rounds": a.rounds, "baseline": a.baseline_python}
    for key in ("rebuild_s", "rebuild_command_s"):
        o, b = [r[key] for r in ours], [r[key] for r in base]
        doc[key] = {"ours": o, "baseline": b, "ratios": [x / y for x, y in zip(o, b)],
                    "ratio_of_medians": statistics.median(o) / statistics.median(b)}
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"replica rebuild, {a.rounds} rounds each in turn; baseline: {a.baseline_python}")
    for key, name in (("rebuild_s", "rebuild"), ("rebuild_command_s", "command")):
        d = doc[key]
        print(f"  {name:8s} ours {' / '.join(f'{x:.2f}' for x in d['ours'])} s   baseline "
              f"{' / '.join(f'{x:.2f}' for x in d['baseline'])} s   ratios "
              f"{', '.join(f'{x:.2f}' for x in d['ratios'])}   ratio of the medians "
              f"{d['ratio_of_medians']:.2f} (target <= 1.10)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=_size, default=1 << 30, help="master data size (e.g. 64MiB)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--tombstones", type=float, default=0.01)
    ap.add_argument("--link", type=float, default=0.0, metavar="MB/s",
                    help="also rebuild over an emulated link of this rate (MB/s)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", default=None,
                    help="also write the --json document to FILE (the printed output is unchanged)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show replicate's progress")
    ap.add_argument("--baseline-python", default=None, metavar="PY",
                    help="measure this installation's interpreter in turn, as the baseline")
    ap.add_argument("--rounds", type=int, default=3, help="rounds each with --baseline-python")
    a = ap.parse_args(argv)
    if a.baseline_python:
        return _against(a)
    workdir = tempfile.mkdtemp(prefix="kcompact-bench-repl-", dir=a.workdir)
    try:
        res = run(a.size, a.partitions, a.tombstones, workdir, a.link)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=2)
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"master: {res['records']:,} records, {res['bytes'] / 1e6:,.0f} MB on disk, "
          f"{res['partitions']} partitions, {res['tombstones']:.0%} tombstones")
    print(f"  cp -r                 {res['cp_s']:7.2f} s  {res['cp_mb_s']:8,.0f} MB/s")
    print(f"  cp -r + sync          {res['cp_sync_s']:7.2f} s")
    print(f"  replicate (rebuild)   {res['rebuild_s']:7.2f} s  {res['rebuild_mb_s']:8,.0f} MB/s"
          f"   rebuild / cp = {res['ratio_rebuild_vs_cp']:.2f}   (target <= 2.00)   "
          f"rebuild / (cp + sync) = {res['ratio_rebuild_vs_cp_sync']:.2f}")
    print(f"  replicate (command)   {res['rebuild_command_s']:7.2f} s"
          f"                 command / cp = {res['ratio_command_vs_cp']:.2f}"
          f"   command / (cp + sync) = {res['ratio_command_vs_cp_sync']:.2f}")
    print(f"  verify --against      {res['verify_s']:7.2f} s  "
          f"({'EQUAL' if res['verify_equal'] else 'DIFFERENT'})")
    if a.link:
        print(f"  over a {a.link:,.0f} MB/s link: replicate (rebuild) {res['link_rebuild_s']:7.2f} s"
              f"   the master's bytes at that rate {res['link_copy_s']:7.2f} s"
              f"   rebuild / bytes = {res['link_rebuild_s'] / res['link_copy_s']:.2f}")
    if a.verbose:
        for line in res["replicate_stderr"]:
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
