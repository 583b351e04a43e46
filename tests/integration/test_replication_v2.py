"""Replication protocol version 2 end to end: real `kcompact serve` and `kcompact replicate`
processes on 127.0.0.1 (docs/formats/replication-protocol.md, "Version 2: stored batches").

* a format-2 master's sealed segments travel as stored: the bytes a replica pulls are about the
  bytes at rest (counted, never timed), several times fewer than the records of version 1,
  which a replica forced to version 1 still pulls from the same master; both equal the master;
* a damaged batch on the master is refused by the replica with one line naming the master's
  file and byte, and nothing of it is installed;
* a download killed in the middle of a segment resumes at its byte;
* a replica falls back to version 1 against a master that speaks only 1 (saying so once), and
  stops with one line naming both sides' versions against a master speaking only another one.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from kcompact.reput import filenames as fn
from kcompact.reput.record import BytesColumn, RecordBatch
from kcompact.reput.store import Store

from test_replication import TOPIC, T0, Proc, free_port, kc, procs, token  # noqa: F401

PULLED = re.compile(r"protocol (\d): ([\d,]+) bytes, ([\d,]+) of them (\d+) segments as stored")


def build_json_master(path: Path, records: int = 60_000, keys: int = 6_000,
                      segment_bytes: int = 1 << 20) -> None:
    """JSON-like values (compressible) in 2 partitions, zstd, several sealed format-2
    segments and a format-1 active tail each; compacted once, then a dirty tail appended."""
    rng = np.random.default_rng(28)
    statuses = [b"created", b"paid", b"packed", b"shipped", b"delivered"]
    with Store.open(str(path), writer="w", create=True) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": segment_bytes, "compression.type": "zstd"})
        for p in (0, 1):
            for lo in range(0, records, 20_000):
                n = min(20_000, records - lo)
                kid = rng.integers(0, keys, n)
                vals = [b'{"order_id": "o-%08d", "status": "%s", "amount": %d.%02d, '
                        b'"currency": "EUR", "items": %d}' % (k, statuses[k % 5], k % 997,
                                                              k % 100, k % 7)
                        for k in kid]
                k = np.frombuffer(b"".join(b"key-%08d" % i for i in kid), np.uint8)
                st.append(RecordBatch.from_columns(
                    TOPIC, p, np.arange(lo, lo + n, dtype=np.int64), T0,
                    keys=BytesColumn.fixed(k, 12), values=BytesColumn.from_list(vals)))
                st.flush()


def at_rest(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / "partitions").rglob("*")
               if f.is_file() and f.suffix in (".log", ".bcq"))


def formats(store: Path, partition: int) -> list[int]:
    with Store.open(str(store)) as st:
        pl = st.partition(TOPIC, partition)
        return [s.format for s in pl.segments if s.log_size]


def pulled(out: str) -> tuple[int, int, int, int]:
    m = PULLED.search(out)
    assert m, out
    return (int(m[1]), int(m[2].replace(",", "")), int(m[3].replace(",", "")), int(m[4]))


def replicate(url, token_file, replica, env=None):
    return kc("replicate", "--from", url, "--token-file", token_file, "--store", replica,
              env=env)


def equal(url, token_file, replica) -> None:
    v = kc("verify", "--store", replica, "--against", url, "--token-file", token_file)
    assert v.returncode == 0 and "EQUAL" in v.stdout, v.stdout + v.stderr
    assert kc("verify", "--store", replica).returncode == 0


def serve(procs, store: Path, token_file: Path, env=None) -> tuple[Proc, str]:
    port = free_port()
    p = procs.run("serve", "--store", store, "--listen", f"127.0.0.1:{port}", "--token-file",
                  token_file, env=env)
    p.wait_for("serving")
    return p, f"http://127.0.0.1:{port}"


def test_a_format_2_master_ships_stored_batches(tmp_path, procs, token):
    master = tmp_path / "master"
    build_json_master(master)
    for p in (0, 1):
        f = formats(master, p)
        assert f.count(2) >= 2 and f[-1] == 1, f  # sealed segments format 2, the tail format 1
    rest = at_rest(master)
    srv, url = serve(procs, master, token)

    r2 = replicate(url, token, tmp_path / "r2")
    assert r2.returncode == 0, r2.stderr
    proto, nbytes, shipped, segments = pulled(r2.stdout)
    assert proto == 2 and segments >= 4 and shipped > 0
    # everything but the active tails travels as stored: about the bytes at rest
    assert shipped <= nbytes <= rest * 1.05, (shipped, nbytes, rest)
    assert "replication protocol" not in r2.stderr  # no fallback note
    equal(url, token, tmp_path / "r2")

    # a replica forced to version 1 (what a kcompact before version 2 does) is still served:
    # the same records, decoded by the master
    r1 = replicate(url, token, tmp_path / "r1", env={"KCOMPACT_REPLICATION_PROTOCOL": "1"})
    assert r1.returncode == 0, r1.stderr
    proto1, nbytes1, shipped1, segments1 = pulled(r1.stdout)
    assert (proto1, shipped1, segments1) == (1, 0, 0)
    assert nbytes1 > 3 * nbytes, (nbytes1, nbytes)  # format-1 records of compressible JSON
    equal(url, token, tmp_path / "r1")
    for p in (0, 1):
        assert set(formats(tmp_path / "r2", p)) == {2}
    with Store.open(str(tmp_path / "r2")) as a, Store.open(str(master)) as m:
        assert a.meta.secret != m.meta.secret and a.meta.format_version == 2
    assert srv.stop() == 0


def _damage_a_batch(master: Path, partition: int) -> tuple[str, int]:
    """Flip a byte inside the second batch of the first sealed segment (a compressed payload):
    (the .log's store path, the batch's position)."""
    with Store.open(str(master)) as st:
        pl = st.partition(TOPIC, partition)
        seg = pl.segments[0]
        assert seg.format == 2
        bpos, bsize, _ = seg.index().batches()
        assert bpos.shape[0] >= 2
        pos = int(bpos[1])
        rel = seg.log_path
    with open(master / rel, "r+b") as f:
        f.seek(pos + 100)
        b = f.read(1)
        f.seek(pos + 100)
        f.write(bytes([b[0] ^ 0x5A]))
    return rel, pos


def test_a_damaged_batch_on_the_master_is_refused_and_nothing_installed(tmp_path, procs,
                                                                       token):
    master, replica = tmp_path / "master", tmp_path / "replica"
    build_json_master(master, records=30_000)
    with Store.open(str(master), writer="w") as st:  # one batch per 64 KiB: several a segment
        st.set_topic_config(TOPIC, {"segment.bytes": 1 << 20,
                                    "compression.batch.bytes": 65536})
    from kcompact.compaction import Compactor
    with Store.open(str(master)) as st:
        assert Compactor(st).compact_partition(TOPIC, 1, force=True).skipped is None
    rel, pos = _damage_a_batch(master, 1)
    srv, url = serve(procs, master, token)
    r = replicate(url, token, replica)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"{rel}: corrupt record batch at byte {pos}" in last, r.stderr
    assert "nothing of it was installed" in last and "batch CRC" in last, last
    # nothing of partition 1 was installed (partition 0, pulled alongside, may be)
    with Store.open(str(replica)) as st:
        assert st.partition(TOPIC, 1).record_count() == 0
    assert not (replica / fn.replicating_dir(TOPIC, 1) / ".incoming").exists()
    assert kc("verify", "--store", replica).returncode == 0
    assert srv.stop() == 0


def _incoming_bytes(replica: Path) -> int:
    return sum(f.stat().st_size for f in replica.rglob(".incoming/*.log"))


def test_a_download_killed_mid_segment_resumes_at_its_byte(tmp_path, procs, token):
    master, replica = tmp_path / "master", tmp_path / "replica"
    build_json_master(master, records=150_000, keys=40_000, segment_bytes=16 << 20)
    srv, url = serve(procs, master, token)
    slow = {"KCOMPACT_REPLICATION_RATE": str(1 << 20),
            "KCOMPACT_REPLICATION_MAX_BYTES": str(128 << 10),
            "KCOMPACT_REPLICATION_PARALLEL": "1"}
    rep = procs.run("replicate", "--from", url, "--token-file", token, "--store", replica,
                    env=slow)
    deadline = time.monotonic() + 60
    while _incoming_bytes(replica) < 512 << 10:
        assert rep.p.poll() is None, "finished before it could be interrupted:\n" + rep.text
        assert time.monotonic() < deadline, rep.text
        time.sleep(0.01)
    rep.stop(signal.SIGKILL)
    got = _incoming_bytes(replica)
    r = replicate(url, token, replica)
    assert r.returncode == 0, r.stderr
    m = re.search(r"resuming the download of segment \d+ at byte ([\d,]+)", r.stderr)
    assert m and int(m[1].replace(",", "")) >= min(got, 512 << 10), r.stderr
    proto, nbytes, shipped, segments = pulled(r.stdout)
    assert proto == 2 and segments >= 1
    equal(url, token, replica)
    assert srv.stop() == 0


def test_fallback_to_version_1_against_a_master_that_speaks_only_1(tmp_path, procs, token):
    master = tmp_path / "master"
    build_json_master(master, records=20_000)
    srv, url = serve(procs, master, token, env={"KCOMPACT_SERVE_PROTOCOLS": "1"})
    r = replicate(url, token, tmp_path / "replica")
    assert r.returncode == 0, r.stderr
    assert pulled(r.stdout)[0] == 1
    notes = [ln for ln in r.stderr.splitlines() if "speaks replication protocol 1 only" in ln]
    assert len(notes) == 1, r.stderr  # said once, not per partition or request
    equal(url, token, tmp_path / "replica")
    assert srv.stop() == 0


class _FutureMaster(BaseHTTPRequestHandler):
    """A master of a later kcompact that speaks replication protocol 3 only."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"protocol": 3, "protocols": [3], "store_id": "f" * 32,
                           "format_version": 3, "limits": {}, "topics": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Kcompact-Protocol", "3")
        self.send_header("Kcompact-Store-Id", "f" * 32)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_master_speaking_only_another_version_is_one_line(tmp_path, token):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FutureMaster)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        r = replicate(url, token, tmp_path / "replica")
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert "speaks replication protocol 3, this kcompact speaks 1 and 2" in lines[0]
        assert not (tmp_path / "replica").exists()  # refused before touching the replica
    finally:
        httpd.shutdown()
        httpd.server_close()
