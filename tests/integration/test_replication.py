"""Replication end to end: real `kcompact serve` and `kcompact replicate` processes on 127.0.0.1.

* rebuild of a multi-partition master compacted several times (offset gaps, tombstones inside
  and past delete.retention.ms, a trailing purged tombstone, an empty partition), compared with
  a model and with `kcompact verify --against`; a tampered replica record is named;
* follow mode picks up records and partitions written to the master after the rebuild;
* security: 401/403, traversal 400, oversized max_bytes 413, bad partition 400/404, TLS;
* faults: SIGKILL of the replica and of the master mid-transfer, compaction of the master
  mid-transfer; the replica completes and equals the master.

Every server is started by a fixture and stopped by it (SIGTERM, then SIGKILL), so nothing is
left running.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import batch as KB
from kcompact.reput import filenames as fn
from kcompact.reput.config import ManualClock, WriterOptions
from kcompact.reput.partition import PartitionLog
from kcompact.reput.record import Record, RecordBatch, BytesColumn
from kcompact.reput.store import Store
from kcompact.replication.live import bitmap_array, live_offsets

KCOMPACT = str(Path(sys.executable).parent / "kcompact")
TOPIC = "orders"
T0 = 1_700_000_000_000
TIMEOUT = 180


# -- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A kcompact subprocess whose stdout/stderr are collected by threads."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.args = args
        self.p = subprocess.Popen([KCOMPACT, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})})
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                         for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf):
        for line in stream:
            buf.append(line)

    def wait_for(self, text: str, where: str = "err", timeout: float = 60) -> None:
        buf = self.err if where == "err" else self.out
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in buf):
                return
            if self.p.poll() is not None:
                time.sleep(0.2)
                if any(text in line for line in buf):
                    return
                raise AssertionError(f"{self.args[0]} exited {self.p.returncode} before "
                                     f"{text!r}:\n{self.text}")
            time.sleep(0.02)
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.text}")

    def wait(self, timeout: float = TIMEOUT) -> int:
        rc = self.p.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc

    def stop(self, sig=signal.SIGTERM) -> int | None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        for t in self._threads:
            t.join(5)
        return self.p.returncode

    @property
    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


class Serve(Proc):
    def __init__(self, store: str, token_file: str, port: int, extra: tuple = ()):
        self.port = port
        super().__init__(["serve", "--store", store, "--listen", f"127.0.0.1:{port}",
                          "--token-file", token_file, *extra])
        self.wait_for("serving")
        self.url = f"{'https' if extra else 'http'}://127.0.0.1:{port}"


@pytest.fixture
def procs():
    """Start kcompact processes; every one is stopped at the end of the test."""
    started: list[Proc] = []

    class Factory:
        def serve(self, store, token_file, port=None, extra=()) -> Serve:
            s = Serve(str(store), str(token_file), port or free_port(), extra)
            started.append(s)
            return s

        def run(self, *args, env=None) -> Proc:
            p = Proc([str(a) for a in args], env)
            started.append(p)
            return p

    yield Factory()
    for p in started:
        p.stop(signal.SIGTERM)
        if p.p.poll() is None:
            p.p.kill()


def kc(*args, env=None, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def token(tmp_path) -> Path:
    f = tmp_path / "token"
    f.write_text(os.urandom(24).hex() + "\n")
    f.chmod(0o600)
    return f


# -- stores and the model ---------------------------------------------------------------------


def model_live(recs: list[Record]) -> dict[int, Record]:
    latest: dict[bytes, Record] = {}
    live = {}
    for r in recs:
        if r.key is None:
            live[r.offset] = r
        else:
            latest[r.key] = r
    live.update({r.offset: r for r in latest.values() if r.value is not None})
    return live


def build_compacted_master(path: Path) -> tuple[dict[int, list[Record]], dict[int, int]]:
    """3 partitions compacted three times with appends in between (offset gaps, tombstones
    stamped in one round and purged past delete.retention.ms in the next, some still inside it),
    partition 1 ending in a purged tombstone (next offset beyond its last record), partition 3
    empty. Returns (records appended per partition, next offset per partition)."""
    clock = ManualClock(T0 + 250)
    rng = random.Random(11)
    model: dict[int, list[Record]] = {0: [], 1: [], 2: []}
    nxt = {0: 0, 1: 500, 2: 7}
    with Store.open(str(path), writer="w", create=True, clock=clock) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 16384, "delete.retention.ms": 1000,
                                    "compression.type": "uncompressed"})
        st.writable_partition(TOPIC, 3)  # an empty partition
        for rnd in range(3):
            recs = []
            for p in (0, 1, 2):
                for _ in range(1500):
                    nxt[p] += rng.choice([1, 1, 1, 2, 6])
                    key = None if rng.random() < 0.03 else b"key-%03d" % rng.randrange(250)
                    value = None if rng.random() < 0.15 else (b"v%d." % nxt[p]) * rng.randint(1, 9)
                    hdrs = (("src", b"x"), ("n", None)) if rng.random() < 0.1 else ()
                    recs.append(Record(TOPIC, p, nxt[p], clock.ms() - rng.randint(0, 99), key,
                                       value, hdrs))
            if rnd == 2:  # partition 1 ends in a tombstone of an existing key
                nxt[1] += 3
                recs.append(Record(TOPIC, 1, nxt[1], clock.ms(), b"key-001", None))
            st.append(RecordBatch.from_records(TOPIC, recs))
            st.flush()
            for r in recs:
                model[r.partition].append(r)
            for p in (0, 1, 2):
                res = Compactor(st, CompactionOptions(offset_map_memory=1 << 16),
                                clock).compact_partition(TOPIC, p, force=True)
                assert res.skipped is None
            clock.advance(5000)  # this round's tombstones pass delete.retention.ms
        # partition 1 once more: its last tombstones (the trailing one too) are purged
        Compactor(st, CompactionOptions(), clock).compact_partition(TOPIC, 1, force=True)
        nexts = {p: st.partition(TOPIC, p).next_offset for p in (0, 1, 2, 3)}
    assert nexts[1] > model[1][-1].offset  # the trailing tombstone is gone, the offset stays
    return model, nexts


def build_big_master(path: Path, partitions: int = 2, records: int = 150_000,
                     keys: int = 20_000, value: int = 120) -> None:
    """~40 MB quickly (columns, no per-record Python work), not compacted (duplicates)."""
    rng = np.random.default_rng(3)
    with Store.open(str(path), writer="w", create=True) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 8 << 20})
        for p in range(partitions):
            for lo in range(0, records, 50_000):
                n = min(50_000, records - lo)
                kid = rng.integers(0, keys, n)
                k = np.frombuffer(b"".join(b"key-%08d" % i for i in kid), np.uint8)
                v = rng.integers(97, 123, (n, value), dtype=np.uint8)
                st.append(RecordBatch.from_columns(
                    TOPIC, p, np.arange(lo, lo + n, dtype=np.int64) * 2, T0,
                    keys=BytesColumn.fixed(k, 12), values=BytesColumn.fixed(v, value)))
        st.flush()


def live_records(store_path: Path, partition: int) -> tuple[dict[int, Record], int]:
    with Store.open(str(store_path)) as st:
        pl = PartitionLog(st.fs, TOPIC, partition, st.secret)
        bm, upto = live_offsets(pl)
        live = set(bitmap_array(bm).tolist())
        recs = {r.offset: r for r in pl.iter_records() if r.offset in live}
        assert set(recs) == live
        return recs, pl.next_offset


def assert_equal_to_model(replica: Path, model: dict[int, list[Record]], nexts: dict[int, int]):
    for p, recs in model.items():
        got, nxt = live_records(replica, p)
        want = model_live(recs)
        assert sorted(got) == sorted(want), f"partition {p}: live offsets differ"
        for o, r in want.items():
            g = got[o]
            assert (g.key, g.value, g.headers, g.timestamp) == (r.key, r.value, r.headers,
                                                                r.timestamp), (p, o)
        assert nxt == nexts[p], f"partition {p}: next offset {nxt}, master {nexts[p]}"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.log") if f.is_file())


# -- rebuild ----------------------------------------------------------------------------------


def test_rebuild_of_a_compacted_master_equals_it(tmp_path, procs, token):
    master, replica = tmp_path / "master", tmp_path / "replica"
    model, nexts = build_compacted_master(master)
    srv = procs.serve(master, token)
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 0, r.stderr
    assert "rebuilt" in r.stdout
    assert_equal_to_model(replica, model, {**nexts})
    assert live_records(replica, 3)[1] == 0  # the empty partition exists, empty
    # a tombstone the master had cleaned is stamped when pulled: the replica keeps it at least
    # as long as the master does (its clean_time is never earlier than the master's)
    for p in (0, 1, 2):
        mine, theirs = _tombstone_clean_times(replica, p), _tombstone_clean_times(master, p)
        assert set(mine) == set(theirs)
        for off, ct in mine.items():
            assert ct != 0 and ct >= theirs[off], (p, off, ct, theirs[off])
    with Store.open(str(replica)) as st, Store.open(str(master)) as ms:
        assert st.meta.secret != ms.meta.secret  # its own digest secret
        assert st.topic_config(TOPIC) == ms.topic_config(TOPIC)
        # the master's configs are synced from it, not local overrides of the replica
        ly = st.topic_config_layers(TOPIC)
        assert dict(ly.synced) == {"segment.bytes": 16384, "delete.retention.ms": 1000,
                                   "compression.type": "uncompressed"}
        assert not ly.overrides and ly.synced_from.startswith("master http")
        for p in (0, 1, 2):
            assert not (replica / fn.replicating_dir(TOPIC, p)).exists()
    assert kc("verify", "--store", replica).returncode == 0

    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "EQUAL" in v.stdout
    vj = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token, "--json")
    doc = json.loads(vj.stdout)
    assert vj.returncode == 0 and doc["ok"] and len(doc["partitions"]) == 4

    # a second replicate merges with what is local (master wins) and is still equal
    r2 = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r2.returncode == 0, r2.stderr
    assert_equal_to_model(replica, model, nexts)

    # tamper with one live record of the replica (valid CRC, same size, other value): in its
    # batch (the topic is uncompressed, so the value lies as it is), the batch CRC recomputed
    live, _ = live_records(replica, 0)
    victim = next(r for o, r in sorted(live.items()) if r.key and r.value and o > 100)
    with Store.open(str(replica)) as st:
        pl = PartitionLog(st.fs, TOPIC, 0, st.secret)
        seg = pl.segments[pl.segment_for(victim.offset)]
        assert seg.format == 2
        e = seg.entries()
        bpos = int(e["position"][np.searchsorted(e["offset"], victim.offset)])
        bsize = int(seg.index().batches()[1][np.searchsorted(seg.index().batches()[0],
                                                               bpos)])
        path = replica / pl.log_path(seg.base)
    log = bytearray(path.read_bytes())
    batch = log[bpos:bpos + bsize]
    at = bytes(batch).index(victim.value, KB.HEADER_SIZE)
    batch[at:at + len(victim.value)] = bytes(b ^ 0x20 for b in victim.value)
    struct.pack_into(">I", batch, 17, KB.crc32c(np.frombuffer(bytes(batch), np.uint8),
                                                KB.CRC_START, len(batch)))
    log[bpos:bpos + bsize] = batch
    path.write_bytes(bytes(log))
    pos = bpos
    assert kc("verify", "--store", replica).returncode == 0  # still a valid store...
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 1, v.stdout  # ...but not the master's data
    assert f"{TOPIC}-0: 1 records that differ" in v.stdout
    assert f"offset {victim.offset} key '{victim.key.decode()}'" in v.stdout
    assert f"{TOPIC}-1: equal" in v.stdout

    # a corrupt byte (CRC fails) is reported as a difference naming the file, not a crash
    with open(path, "r+b") as f:
        f.seek(pos + 50)
        b = f.read(1)
        f.seek(pos + 50)
        f.write(bytes([b[0] ^ 0xFF]))
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 1
    assert "cannot be read" in v.stdout and "corrupt record" in v.stdout
    assert srv.stop() == 0
    assert "stopped" in srv.text


def _formats(store_path: Path, partition: int) -> list[int]:
    with Store.open(str(store_path)) as st:
        pl = st.partition(TOPIC, partition)
        return [seg.format for seg in pl.segments if seg.log_size]


def test_a_format_2_replica_of_a_format_1_master(tmp_path, procs, token):
    """A master as a kcompact before store format 2 left it (store.json version 1, every
    segment format 1) serves unchanged; its replica seals what it pulls into format 2 and
    equals it; the master's files stay format 1."""
    master, replica = tmp_path / "master", tmp_path / "replica"
    rng = random.Random(28)
    recs = [Record(TOPIC, p, o, T0 + o, None if o % 31 == 0 else b"key-%03d" % rng.randrange(200),
                   None if o % 11 == 0 else b'{"o": %d, "status": "paid"}' % o)
            for p in (0, 1) for o in range(0, 6000, rng.choice([1, 2]))]
    with Store.open(str(master), writer="w", create=True,
                    options=WriterOptions(seal_format=1)) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 16384})
        st.append(RecordBatch.from_records(TOPIC, recs))
        st.flush()
    doc = json.loads((master / "store.json").read_text())
    doc["format_version"] = 1
    doc.pop("crc32c")  # (a hand edit: main's kcompact would refuse the checksum it no longer fits)
    doc["topics"][TOPIC] = {k: v for k, v in doc["topics"][TOPIC].items()
                            if not k.startswith("compression.")}
    (master / "store.json").write_text(json.dumps(doc))
    before = {p.name: p.read_bytes() for p in (master / "partitions").rglob("*") if p.is_file()}
    assert set(_formats(master, 0)) == {1}
    srv = procs.serve(master, token)
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 0, r.stderr
    for p in (0, 1):
        f = _formats(replica, p)
        assert f and set(f) == {2}, f  # the replica's rebuild compacted: every segment sealed
    assert json.loads((replica / "store.json").read_text())["format_version"] == 2
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0 and "EQUAL" in v.stdout, v.stdout + v.stderr
    assert srv.stop() == 0
    after = {p.name: p.read_bytes() for p in (master / "partitions").rglob("*") if p.is_file()}
    assert after == before
    assert json.loads((master / "store.json").read_text())["format_version"] == 1


def _tombstone_clean_times(store_path: Path, partition: int) -> dict[int, int]:
    """offset -> clean_time of every tombstone of the partition's .bcq files."""
    out = {}
    with Store.open(str(store_path)) as st:
        pl = PartitionLog(st.fs, TOPIC, partition, st.secret)
        for seg in pl.segments:
            e = seg.entries()
            t = (e["flags"] & 3) == 1
            out.update(zip(e["offset"][t].tolist(), e["clean_time"][t].tolist()))
    return out


def _records(port: int, token: str, partition: int, frm: int, max_bytes: int, check: bool):
    q = f"from={frm}&max_bytes={max_bytes}" + ("&check=1" if check else "")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", f"/v1/topics/{TOPIC}/partitions/{partition}/records?{q}",
              headers={"Authorization": f"Bearer {token}"})
    r = c.getresponse()
    body = r.read()
    heads = {k: r.getheader(k) for k in ("Kcompact-Next-Offset", "Kcompact-Record-Count",
                                         "Kcompact-High-Watermark")}
    c.close()
    return r.status, heads, body


def _checkpoint(store_path: Path, partition: int) -> tuple[int, dict | None]:
    from kcompact.reput import swap
    with Store.open(str(store_path)) as st:
        return swap.read_checkpoint(st.fs, fn.partition_dir(TOPIC, partition))


def test_rebuild_compacts_only_what_the_master_had_not(tmp_path, procs, token):
    """The pulled records are clean up to the master's compaction horizon: the replica's
    force compaction maps only the offsets past it (partition 0: a dirty tail appended after
    the master's last compaction; partition 2: nothing dirty, no round at all)."""
    master, replica = tmp_path / "master", tmp_path / "replica"
    model, nexts = build_compacted_master(master)
    tail = [Record(TOPIC, 0, nexts[0] + i, T0 + i, b"key-%03d" % (i % 40), b"tail-%d" % i)
            for i in range(300)]
    with Store.open(str(master), writer="w") as st:
        st.append(RecordBatch.from_records(TOPIC, tail))
        st.flush()
    horizons = {p: _checkpoint(master, p)[0] for p in (0, 2)}
    assert horizons[0] == model[0][-1].offset and horizons[2] == model[2][-1].offset
    srv = procs.serve(master, token)
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 0, r.stderr
    cleaned, run = _checkpoint(replica, 0)
    assert cleaned == tail[-1].offset
    assert run["rounds"] == 1 and run["map_keys_max"] == 40  # the tail's keys, not all 250
    cleaned, run = _checkpoint(replica, 2)
    assert cleaned == horizons[2] and "rounds" not in (run or {})  # installed, not compacted
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr


def test_issue_zero_copy_records_equal_checked_ones_and_a_damaged_master_is_named(
        tmp_path, procs, token):
    """The master sends a local store's records with sendfile (no CRC check of its own); with
    ``check=1`` it reads and checks them. Both answers are the same bytes and headers, from any
    offset. A damaged record is caught by the replica, which asks again with check=1 and fails
    with the master's one-line diagnosis (file and byte), writing nothing of the bad chunk."""
    master = tmp_path / "master"
    build_compacted_master(master)
    srv = procs.serve(master, token)
    tok = token.read_text().strip()
    for part in (0, 1, 2, 3):
        frm = 0
        while True:
            a = _records(srv.port, tok, part, frm, 3000, False)
            b = _records(srv.port, tok, part, frm, 3000, True)
            assert a[0] == b[0] == 200 and a[1] == b[1] and a[2] == b[2], (part, frm)
            if int(a[1]["Kcompact-Record-Count"]) == 0:
                break
            frm = int(a[1]["Kcompact-Next-Offset"]) - 1 + random.Random(frm).choice([1, 2])
    assert _records(srv.port, tok, 0, 0, 3000, False)[0] == 200
    status, body = _get(srv.port, f"/v1/topics/{TOPIC}/partitions/0/records?check=yes", tok)
    assert status == 400 and b"check" in body

    # damage one byte of a record in the middle of a sealed segment of partition 2
    with Store.open(str(master)) as st:
        pl = PartitionLog(st.fs, TOPIC, 2, st.secret)
        seg = pl.segments[0]
        e = seg.entries()
        mid = e.shape[0] // 2
        assert seg.format == 2  # a Kafka batch: a byte of its payload (segment-v2.md)
        pos = int(e["position"][mid]) + 64
        path = master / pl.log_path(seg.base)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
    replica = tmp_path / "replica"
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "corrupt record" in last, r.stderr
    assert f"{fn.base_name(seg.base)}.log" in last and "byte" in last, r.stderr
    assert kc("verify", "--store", replica).returncode == 0  # nothing half-written


def test_follow_picks_up_new_records_and_partitions(tmp_path, procs, token):
    master, replica = tmp_path / "master", tmp_path / "replica"
    model, nexts = build_compacted_master(master)
    srv = procs.serve(master, token)
    fol = procs.run("replicate", "--from", srv.url, "--token-file", token, "--store", replica,
                    "--follow")
    fol.wait_for("rebuilt", where="out", timeout=120)
    # the master keeps mirroring: new records on existing partitions, and a new partition
    rng = random.Random(5)
    with Store.open(str(master), writer="w2") as st:
        recs = []
        for p in (0, 1, 2, 4):
            start = nexts.get(p, 0) + 10
            for i in range(300):
                key = b"key-%03d" % rng.randrange(250)
                recs.append(Record(TOPIC, p, start + i, T0 + 10**6, key,
                                   None if i % 17 == 0 else b"new-%d" % i))
        st.append(RecordBatch.from_records(TOPIC, recs))
        st.flush()
        for r in recs:
            model.setdefault(r.partition, []).append(r)
        nexts = {p: st.partition(TOPIC, p).next_offset for p in (0, 1, 2, 3, 4)}
    deadline = time.monotonic() + 90
    while True:
        with Store.open(str(replica)) as st:
            have = {p: st.partition(TOPIC, p).next_offset for p in st.partitions(TOPIC)}
        if all(have.get(p) == n for p, n in nexts.items()):
            break
        assert fol.p.poll() is None, fol.text
        assert time.monotonic() < deadline, f"follow did not catch up: {have} vs {nexts}"
        time.sleep(0.2)
    assert fol.stop(signal.SIGTERM) == 0, fol.text
    assert_equal_to_model(replica, model, nexts)
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr


# -- security ---------------------------------------------------------------------------------


def _get(port: int, path: str, token: str | None, method: str = "GET") -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    c.putrequest(method, path, skip_accept_encoding=True)  # the path is sent as written
    for k, v in headers.items():
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def test_security_auth_traversal_and_limits(tmp_path, procs, token):
    master = tmp_path / "master"
    build_compacted_master(master)
    (tmp_path / "secret.txt").write_text("outside the store")
    srv = procs.serve(master, token)
    tok = token.read_text().strip()
    base = f"/v1/topics/{TOPIC}/partitions/0/records"
    assert _get(srv.port, "/v1/store", None)[0] == 401
    assert _get(srv.port, base, None)[0] == 401
    assert _get(srv.port, "/v1/store", "x" * 48)[0] == 403
    assert _get(srv.port, "/v1/store", tok[:-1])[0] == 403
    status, body = _get(srv.port, "/v1/store", tok)
    assert status == 200 and json.loads(body)["topics"][0]["topic"] == TOPIC
    for path in ("/v1/topics/../partitions/0/records", "/v1/topics/%2e%2e/partitions/0/records",
                 "/v1/topics/%2E%2E/partitions/0/live", "/v1/topics/a/b/partitions/0/records",
                 "/v1/topics/a%2Fb/partitions/0/records",
                 "/v1/topics/..%2F..%2Fsecret.txt/partitions/0",
                 "/v1/topics/%252e%252e/partitions/0/records",
                 "/v1/../../secret.txt", "/v1/topics/orders/partitions/x/records",
                 "/v1/topics/orders/partitions/-1/records",
                 f"{base}?from=-5", f"{base}?from=abc", f"{base}?nope=1",
                 f"/v1/topics/{TOPIC}/partitions/0/digests?salt=zz"):
        status, body = _get(srv.port, path, tok)
        assert status == 400, (path, status, body)
        assert b"outside the store" not in body
    assert _get(srv.port, f"/v1/topics/{TOPIC}/partitions/99/records", tok)[0] == 404
    assert _get(srv.port, "/v1/topics/nosuchtopic/partitions/0/records", tok)[0] == 404
    assert _get(srv.port, f"{base}?max_bytes={(64 << 20) + 1}", tok)[0] == 413
    assert _get(srv.port, "/v1/store", tok, method="POST")[0] == 405
    assert _get(srv.port, "/v1/" + "x" * 5000, tok)[0] in (400, 414)
    # a legal request: raw records, the next offset in a header
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    c.request("GET", f"{base}?from=0&max_bytes=65536", headers={"Authorization": f"Bearer {tok}"})
    r = c.getresponse()
    body = r.read()
    assert r.status == 200 and 0 < len(body) <= 65536 + 10_000
    assert int(r.getheader("Kcompact-Next-Offset")) > 0
    assert int(r.getheader("Kcompact-Record-Count")) > 0

    # the replica side: one clear line and exit 1
    bad = tmp_path / "bad-token"
    bad.write_text("not-the-token-0123456789\n")
    r = kc("replicate", "--from", srv.url, "--token-file", bad, "--store", tmp_path / "r1")
    assert r.returncode == 1 and "403" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = kc("replicate", "--from", f"http://127.0.0.1:{free_port()}", "--token-file", token,
           "--store", tmp_path / "r2")
    assert r.returncode == 1 and "cannot reach the master" in r.stderr, r.stderr
    r = kc("replicate", "--from", "127.0.0.1:80", "--token-file", token, "--store",
           tmp_path / "r3")
    assert r.returncode == 1 and "expected http://HOST:PORT" in r.stderr
    r = kc("verify", "--store", master, "--against", srv.url, "--token-file", bad)
    assert r.returncode == 1 and "403" in r.stderr
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", master)
    assert r.returncode == 1 and "master's own store" in r.stderr


def test_tls(tmp_path, procs, token):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    master = tmp_path / "master"
    model, nexts = build_compacted_master(master)
    srv = procs.serve(master, token, extra=("--tls-cert", str(cert), "--tls-key", str(key)))
    assert srv.url.startswith("https://")
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", tmp_path / "r0")
    assert r.returncode == 1 and "certificate" in r.stderr.lower(), r.stderr  # not trusted
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", tmp_path / "r",
           env={"SSL_CERT_FILE": str(cert)})
    assert r.returncode == 0, r.stderr
    assert_equal_to_model(tmp_path / "r", model, nexts)


# -- faults -----------------------------------------------------------------------------------


def _wait_pulled(replica: Path, nbytes: int, proc: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while dir_bytes(replica) < nbytes:
        assert proc.p.poll() is None, "the replica finished before it could be interrupted:\n" \
            + proc.text
        assert time.monotonic() < deadline, proc.text
        time.sleep(0.01)


SLOW = {"KCOMPACT_REPLICATION_RATE": str(8 << 20), "KCOMPACT_REPLICATION_MAX_BYTES": str(1 << 20)}


def _slow_pull(tmp_path, procs, token, pulled: int, **master) -> tuple[Path, Path, Serve, Proc]:
    """A big master served, and a rate-limited replicate of it that has pulled ``pulled``
    bytes: (master, replica, server, replicate process)."""
    m, replica = tmp_path / "master", tmp_path / "replica"
    build_big_master(m, **master)
    srv = procs.serve(m, token)
    rep = procs.run("replicate", "--from", srv.url, "--token-file", token, "--store", replica,
                    env=SLOW)
    _wait_pulled(replica, pulled, rep)
    return m, replica, srv, rep


def test_sigkill_replica_mid_transfer_then_resume(tmp_path, procs, token):
    master, replica, srv, rep = _slow_pull(tmp_path, procs, token, 6 << 20)
    rep.stop(signal.SIGKILL)
    assert any((replica / fn.replicating_dir(TOPIC, p)).is_dir() for p in (0, 1))
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 0, r.stderr
    # records resume at an offset; a segment shipped as stored (protocol 2) at its byte
    assert "resuming at offset" in r.stderr or "resuming the download of segment" in r.stderr
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr
    assert kc("verify", "--store", replica).returncode == 0


def test_sigkill_master_mid_transfer_then_restart(tmp_path, procs, token):
    master, replica, srv, rep = _slow_pull(tmp_path, procs, token, 6 << 20)
    srv.stop(signal.SIGKILL)
    time.sleep(1.5)
    assert rep.p.poll() is None, rep.text  # still waiting for the master
    srv2 = procs.serve(master, token, port=srv.port)
    assert rep.wait() == 0, rep.text
    assert "unreachable" in rep.text and "retrying" in rep.text
    v = kc("verify", "--store", replica, "--against", srv2.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr


def test_resumed_pull_after_the_master_compacted_is_compacted_in_full(tmp_path, procs, token):
    """Records pulled before the master compacted are not clean up to the master's new
    horizon: the resumed rebuild keeps the lower one (-1 here), and the replica's compaction
    drops the duplicates the first pull brought."""
    master, replica, srv, rep = _slow_pull(tmp_path, procs, token, 6 << 20, records=120_000,
                                           keys=3_000)

    def staged(p: int) -> bool:  # records in .replicating/ (not a segment still downloading)
        return any(f.stat().st_size for f in (replica / fn.replicating_dir(TOPIC, p))
                   .glob("*.log"))
    deadline = time.monotonic() + 60
    while not any(staged(p) for p in (0, 1)):
        assert rep.p.poll() is None and time.monotonic() < deadline, rep.text
        time.sleep(0.01)
    rep.stop(signal.SIGKILL)
    pulled = [p for p in (0, 1) if staged(p)]
    assert pulled
    with Store.open(str(master)) as st:
        for p in (0, 1):
            assert Compactor(st).compact_partition(TOPIC, p, force=True).records_dropped > 0
            assert _checkpoint(master, p)[0] > 0
    r = kc("replicate", "--from", srv.url, "--token-file", token, "--store", replica)
    assert r.returncode == 0, r.stderr
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr
    for p in pulled:  # the first pull's duplicates, dropped by the replica's own compaction
        assert _checkpoint(replica, p)[1]["records_dropped"] > 0


def test_master_compacts_while_a_replica_pulls(tmp_path, procs, token):
    """A pull never sees a half-swapped segment: the master is force-compacted (records
    dropped, segments merged and renamed) while the replica reads it."""
    master, replica, srv, rep = _slow_pull(tmp_path, procs, token, 3 << 20, records=120_000,
                                           keys=3_000)
    with Store.open(str(master)) as st:
        for p in (0, 1):
            res = Compactor(st).compact_partition(TOPIC, p, force=True)
            assert res.skipped is None and res.records_dropped > 0
    assert rep.p.poll() is None, "the pull ended before the compaction: nothing was tested"
    assert rep.wait() == 0, rep.text
    v = kc("verify", "--store", replica, "--against", srv.url, "--token-file", token)
    assert v.returncode == 0, v.stdout + v.stderr
