"""Stores on S3 against a real S3 server: SeaweedFS (``s3_store_url`` fixture, conftest.py).

* the store and compaction model tests on S3 (tests/unit/test_s3_model.py's machines, here on
  SeaweedFS), and deterministic reads parametrized by backend (local directory vs S3);
* compaction on S3 equals the same compaction on a local directory; requests per segment stay
  under 4 plus a few per partition, and do not grow with the record count;
* a writer killed (os._exit) between uploading its segments and committing the manifest leaves
  only orphans, readers see the old state, and the next run cleans up and commits;
* two committers racing for one manifest version: one wins, the other rebases;
* offset lookups answer from the manifest bitmaps (request counts, as
  tests/unit/test_s3_lookups.py);
* the CLI on s3:// URLs: inspect (and --plot), dump, verify, compact (local and Spark engines),
  the same commands on a local store for comparison, the Spark data source, kv build (and
  --follow while a mirror --follow appends; both stop on SIGTERM), serve from an S3 master,
  replicate into local and S3 replicas, mirror from Kafka, restore into Kafka; bad input (wrong
  credentials, missing bucket, unreachable endpoint): exit 1 and one line.

tests/integration/test_s3_suite.py runs the backend-parametrized unit tests on SeaweedFS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kcompact.compaction import CompactionOptions, compact_store
from kcompact.reput import WriterOptions
from kcompact.reput import manifest as M
from kcompact.reput import shared as SH
from kcompact.reput.segment_desc import SegmentDesc
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.s3 import S3Backend
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

UNIT = Path(__file__).resolve().parents[1] / "unit"
sys.path.insert(0, str(UNIT))

import test_compaction_model as CM  # noqa: E402
import test_s3_model as S3M  # noqa: E402
import test_store_model as SM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KCOMPACT = str(Path(sys.executable).parent / "kcompact")
TOPIC = "t"


def run(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def rows(n: int, start: int = 0, parts: int = 3, keys: int = 60, vlen: int = 40):
    return [((start + i) % parts, start + i, 1_000 + start + i, b"k%d" % ((start + i) % keys),
             None if (start + i) % 17 == 0 else b"v%d." % (start + i) * (vlen // 6))
            for i in range(n)]


#: a partition's objects beside its segments and manifest versions: its ledger and damage record
#: (docs/formats/ledger.md, damage-record.md)
_NOT_SEGMENTS = ("ledger.json", "damage.json")

#: per-partition uploads, for the tests of a partition's manifest commits (a new S3 store uses
#: shared uploads by default: test_s3_shared.py)
PARTITION = WriterOptions(upload="partition")


def fill(url: str, n: int = 6000, batch: int = 1000, segment_bytes: int = 16384,
         options: WriterOptions | None = None, **kw) -> None:
    with Store.open(url, writer="w", create=True, options=options or WriterOptions()) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": segment_bytes})
        for lo in range(0, n, batch):
            st.append(RecordBatch.from_records(TOPIC, rows(batch, start=lo, **kw)))
            st.flush()


def content(url: str, topic: str = TOPIC) -> dict[int, list[tuple]]:
    with Store.open(url) as st:
        return {p: [(r.offset, r.timestamp, r.key, r.value, r.headers)
                    for r in st.iter_records(topic, p)] for p in st.partitions(topic)}


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path, s3_store_url) -> str:
    return str(tmp_path / "store") if request.param == "local" else s3_store_url()


# -- the store ------------------------------------------------------------------------------------


def test_reads_across_many_segments(store_url):
    """As test_store_model.test_reads_across_many_segments, with a flush per batch (on S3 a
    reader sees what the writer flushed), by the writer and by a reader."""
    import random
    rng = random.Random(1)
    model: dict[int, Record] = {}
    with Store.open(store_url, writer="w", create=True) as s:
        s.set_topic_config(TOPIC, {"segment.bytes": SM.SEGMENT_BYTES})
        off = 5
        for _ in range(30):
            batch = []
            for _ in range(rng.randrange(1, 15)):
                v = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 2500))])
                k = rng.choice([None, b"", b"k%d" % rng.randrange(20)])
                batch.append((0, off, off * 10, k, v))
                model[off] = Record(TOPIC, 0, off, off * 10, k, v)
                off += rng.choice([1, 1, 1, 2, 7])
            assert s.append(RecordBatch.from_records(TOPIC, batch)) == len(batch)
            s.flush()
    offs = sorted(model)
    for writer in ("w", None):
        with Store.open(store_url, writer=writer) as s:
            assert len(s.partition(TOPIC, 0).segments) > 5
            assert s.first_offset(TOPIC, 0) == offs[0]
            assert s.next_offset(TOPIC, 0) == offs[-1] + 1
            for frm in range(offs[0] - 2, offs[-1] + 3, 3):
                want = [model[o] for o in offs if o >= frm]
                got = list(s.read(TOPIC, 0, frm, max_records=3).records())
                assert got == want[:len(got)] and (len(got) >= 1 or not want)
            assert list(s.iter_records(TOPIC, 0)) == [model[o] for o in offs]
    with Store.open(store_url) as s:
        assert verify_store(s).ok


def _seaweed_factory(make_url):
    def factory():
        url = make_url(grace_ms=0)
        return S3Backend.from_url(url), url, lambda: None
    return factory


def test_store_matches_model_on_s3(s3_store_url):
    m = type("SeaweedStoreMachine", (S3M.S3StoreMachine,),
             {"backend_factory": staticmethod(_seaweed_factory(s3_store_url))})
    run_state_machine_as_test(m, settings=settings(SM.MODEL_SETTINGS, max_examples=4,
                                                   stateful_step_count=30))


@pytest.mark.parametrize("retention,lag", [(1000, 1500), (0, 0)])
def test_compaction_matches_model_on_s3(s3_store_url, retention, lag):
    m = type("SeaweedCompactionMachine", (S3M.S3CompactionMachine,),
             {"backend_factory": staticmethod(_seaweed_factory(s3_store_url)),
              "retention": retention, "lag": lag})
    run_state_machine_as_test(m, settings=settings(CM.MODEL_SETTINGS, max_examples=3,
                                                   stateful_step_count=25))


# -- compaction -----------------------------------------------------------------------------------


def test_compaction_on_s3_equals_local(s3_store_url, tmp_path):
    s3, local = s3_store_url(), str(tmp_path / "local")
    for url in (s3, local):
        fill(url)
    with Store.open(s3) as st:
        r3 = {r.partition: r.to_dict() for r in compact_store(st, force=True)}
    with Store.open(local) as st:
        rl = {r.partition: r.to_dict() for r in compact_store(st, force=True)}
    # segment counts differ by design: on S3 every flush seals a segment, locally they roll
    # at segment.bytes (and force leaves an empty active segment); so do the bytes, since a
    # sealed segment is compressed in batches (store format 2) and the active one is not
    same = ("records_kept", "records_dropped", "tombstones_dropped", "cleaned_offset", "rounds")
    assert {p: {k: r[k] for k in same} for p, r in r3.items()} == \
        {p: {k: r[k] for k in same} for p, r in rl.items()}
    assert content(s3) == content(local)
    with Store.open(s3) as st:
        assert verify_store(st).ok
    # and the CLI agrees on the S3 store: nothing left to do, same records
    out = run("inspect", "--store", s3, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    parts = {p["partition"]: p for p in doc["topics"][0]["partitions"]}
    assert {p: v["records"] for p, v in parts.items()} == \
        {p: r["records_kept"] for p, r in rl.items()}
    assert all(v["dirty_ratio"] == 0 for v in parts.values())


def _compaction_requests(url: str) -> tuple[dict, int, int]:
    with Store.open(url) as st:
        fs = st.fs
        fs.stats.reset()
        fs.cache.clear()
        fs.spool.clear()  # cold: nothing local from the writer that filled the store
        res = compact_store(st, force=True)
        snap = fs.stats.snapshot()
    return snap, sum(r.segments_before for r in res), len(res)


def test_requests_per_segment_do_not_grow_with_records(s3_store_url):
    """The same number of segments, 10x the records: the same number of requests, at most
    4 per segment plus a few per partition."""
    small, big = s3_store_url(), s3_store_url()
    # per-partition uploads: segments of a partition's own (a shared store's compaction first
    # splits its parts: test_s3_shared.py)
    fill(small, n=1500, batch=250, vlen=40, options=PARTITION)  # 6 flushes: 6 small segments
    fill(big, n=15000, batch=2500, vlen=4, segment_bytes=1 << 20,
         options=PARTITION)  # 6 flushes, 10x records
    a, segs_a, parts_a = _compaction_requests(small)
    b, segs_b, parts_b = _compaction_requests(big)
    assert (segs_a, parts_a) == (segs_b, parts_b) == (18, 3)
    assert a["requests"] == b["requests"], (a, b)
    per_partition = 6  # list + get manifest, put manifest, GC listing and delete, spare
    assert a["total"] <= 4 * segs_a + per_partition * parts_a + 3, a
    assert a["requests"].get("GetObject", 0) <= 2 * segs_a + parts_a + 1


def test_offset_lookups_use_the_manifest_bitmaps(s3_store_url):
    """tests/unit/test_s3_lookups.py's counts on SeaweedFS: counts, bounds, holds(o) and
    offset_at_or_after(o) cost no request; a read from a gap at the end of a segment fetches
    the next segment's .bcq and .log only; a read past the end fetches nothing."""
    import test_s3_lookups as LK
    url = s3_store_url()
    segs = LK._gapped_store(url)
    with Store.open(url) as st:
        pl = st.partition(TOPIC, 0)
        fs = st.fs
        fs.cache.clear()
        fs.spool.clear()  # cold: nothing local from the writer that filled the store
        fs.stats.reset()
        assert pl.record_count() == sum(map(len, segs.values())) == 1100
        assert (pl.first_offset, pl.next_offset) == (0, 1200)
        assert pl.holds(120) and not pl.holds(170) and not pl.holds(1200)
        assert pl.offset_at_or_after(170) == 200 and pl.offset_at_or_after(1200) is None
        assert fs.stats.total == 0
        assert len(pl.read(1200, max_records=1)) == 0
        assert fs.stats.total == 0
        r = pl.read(170, max_records=1)
        assert r.offsets.tolist() == [200]
        assert fs.stats.snapshot()["requests"] == {"GetObject": 2}


# -- faults ---------------------------------------------------------------------------------------


_KILLED_WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from kcompact.reput import manifest as M
    from kcompact.reput.record import RecordBatch
    from kcompact.reput.store import Store
    def rows(n, start=0):
        return [(i % 3, start + i, 1000 + start + i, b"k%d" % (i % 60), b"v" * 30)
                for i in range(n)]
    from kcompact.reput.config import WriterOptions
    # per-partition uploads (a manifest commit per partition; a new S3 store's default is shared)
    st = Store.open({url!r}, writer="w", create=True, commitlog_dir={cl!r},
                    options=WriterOptions(upload="partition"))
    st.append(RecordBatch.from_records("t", rows(300)))
    st.flush()                       # version 1 of every partition
    st.append(RecordBatch.from_records("t", rows(300, start=300)))
    st.commitlog.sync()
    real = M.commit
    def die(fs, pdir, *a, **k):       # the segments are uploaded: die before the commit
        os._exit(9)
    M.commit = die
    st.flush()
""")


def test_writer_killed_between_upload_and_commit(s3_store_url, tmp_path):
    url = s3_store_url(grace_ms=0)
    cl = str(tmp_path / "cl")
    code = _KILLED_WRITER.format(root=str(ROOT), url=url, cl=cl)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 9, p.stderr
    fs = S3Backend.from_url(url)
    listed, objects = set(), set()
    for part in range(3):
        pdir = f"partitions/t/{part}"
        m = M.read_latest(fs, pdir)
        assert m.version == 1
        listed |= {f"{pdir}/{n}" for n in m.names()}
        objects |= {f"{pdir}/{n}" for n, _, _ in fs.list_objects(pdir) if "/" not in n and n not in _NOT_SEGMENTS}
    orphans = objects - listed
    assert orphans, "the killed flush uploaded segments"
    old = content(url)
    assert {p: [r[0] for r in v] for p, v in old.items()} == \
        {p: list(range(p, 300, 3)) for p in range(3)}   # readers see the old state
    # the next run: the local segments are uploaded again and committed, orphans deleted
    with Store.open(url, writer="w", commitlog_dir=cl):
        pass
    left = set()
    for part in range(3):
        pdir = f"partitions/t/{part}"
        left |= {f"{pdir}/{n}" for n, _, _ in fs.list_objects(pdir) if "/" not in n and n not in _NOT_SEGMENTS}
    assert not (left & orphans)
    new = content(url)
    assert {p: [r[0] for r in v] for p, v in new.items()} == \
        {p: list(range(p, 600, 3)) for p in range(3)}
    with Store.open(url) as st:
        assert verify_store(st).ok


def test_two_committers_race_for_one_version(s3_store_url):
    """Two committers read version 1 and both create version 2 at the same moment (a
    barrier): S3's conditional create lets exactly one win; the other re-reads version 2 and
    commits its change on top as version 3."""
    url = s3_store_url()
    pdir = "partitions/t/0"
    fs = S3Backend.from_url(url)
    e = lambda b: SegmentDesc.from_entries(b, f"{b:020d}-{b:016x}.log",  # noqa: E731
                                           f"{b:020d}-{b:016x}.bcq", 1,
                                           np.array([b], np.int64))
    v1 = M.commit(fs, pdir, None, lambda cur: M.Manifest(segments=[e(0)], next_offset=1),
                  writer="x", grace_ms=0)
    barrier = threading.Barrier(2)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    results = {}

    def committer(name, base):
        mine = S3Backend.from_url(url)

        def change(cur):
            seen[name].append(cur.version)
            if len(seen[name]) == 1:
                barrier.wait(10)
            return M.Manifest(segments=cur.segments + [e(base)], next_offset=base + 1)
        results[name] = M.commit(mine, pdir, v1, change, writer=name, grace_ms=0)
    ts = [threading.Thread(target=committer, args=(n, b)) for n, b in (("a", 10), ("b", 20))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(r.version for r in results.values()) == [2, 3]
    loser = max(results, key=lambda k: results[k].version)
    assert seen[loser] == [1, 2]     # lost the race on version 1, rebased on version 2
    latest = M.read_latest(fs, pdir)
    assert latest.version == 3 and sorted(s.base for s in latest.segments) == [0, 10, 20]


def test_an_aborted_manifest_upload_is_skipped_then_replaced(s3_store_url, monkeypatch):
    """A zero-byte manifest version (what SeaweedFS can leave of a commit whose writer was
    SIGKILLed mid-PUT): readers see the version below it; the next committer deletes it once
    ABORTED_VERSION_AGE_MS old and commits under its number; the garbage collector copes."""
    url = s3_store_url(grace_ms=0)
    fill(url, n=600, batch=300, options=PARTITION)
    fs = S3Backend.from_url(url)
    pdir = f"partitions/{TOPIC}/0"
    top = M.read_latest(fs, pdir)
    before = content(url)
    fs.write_atomic(f"{pdir}/manifest/{top.version + 1:020d}.json", b"")
    assert M.list_versions(fs, pdir)[-1] == top.version + 1
    assert M.read_latest(fs, pdir).version == top.version
    assert content(url) == before
    assert M.collect_garbage(fs, pdir, grace_ms=0, now_ms=int(time.time() * 1000)) is not None
    monkeypatch.setattr(M, "ABORTED_VERSION_AGE_MS", 300)
    with Store.open(url, writer="w") as st:
        st.append(RecordBatch.from_records(TOPIC, rows(300, start=600)))
        st.flush()
    m = M.read_latest(fs, pdir)
    assert m.version == top.version + 1 and m.next_offset > top.next_offset
    assert {p: [r[0] for r in v] for p, v in content(url).items()} == \
        {p: list(range(p, 900, 3)) for p in range(3)}


_KILLED_COMPACTOR = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from kcompact.compaction import CompactionOptions, compact_store
    from kcompact.reput import manifest as M
    from kcompact.reput.store import Store
    def die(*a, **k):                 # the outputs are uploaded: die before the commit
        os._exit(9)
    M.commit = die
    with Store.open({url!r}, commitlog_dir={cl!r}) as st:
        compact_store(st, force=True, options=CompactionOptions(offset_map_memory=4096))
""")


def test_compactor_killed_before_its_commit_changes_nothing(s3_store_url, tmp_path):
    url = s3_store_url(grace_ms=0)
    fill(url, n=3000, batch=500, options=PARTITION)
    before = content(url)
    versions = {q: M.read_latest(S3Backend.from_url(url), f"partitions/t/{q}").version
                for q in range(3)}
    code = _KILLED_COMPACTOR.format(root=str(ROOT), url=url, cl=str(tmp_path / "cl"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 9, p.stderr
    fs = S3Backend.from_url(url)
    assert {q: M.read_latest(fs, f"partitions/t/{q}").version for q in range(3)} == versions
    assert content(url) == before
    with Store.open(url) as st:
        res = compact_store(st, force=True)
        assert all(r.skipped is None for r in res)
    for q in range(3):  # the dead compactor's uploads were collected (grace 0)
        pdir = f"partitions/t/{q}"
        m = M.read_latest(fs, pdir)
        objs = {n for n, _, _ in fs.list_objects(pdir) if "/" not in n and n not in _NOT_SEGMENTS}
        assert objs == m.names(), objs - m.names()


def test_readers_never_see_a_partial_compaction(s3_store_url):
    """A multi-round compaction (a 4 KiB offset map) is one manifest commit: readers that open
    the store while it runs see the whole old state or the whole new one."""
    url = s3_store_url()
    fill(url, n=6000, batch=1000, keys=400)
    old = content(url)
    seen, stop, errors = [], threading.Event(), []

    def reader():
        try:
            while not stop.is_set():
                with Store.open(url) as st:
                    seen.append([r.offset for r in st.iter_records(TOPIC, 0)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=reader)
    t.start()
    try:
        with Store.open(url) as st:
            res = compact_store(st, topic=TOPIC, partition=0, force=True,
                                options=CompactionOptions(offset_map_memory=4096))
        assert res[0].rounds > 1
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    new = [x[0] for x in content(url)[0]]
    olds = [x[0] for x in old[0]]
    assert new != olds
    assert seen and all(s in (olds, new) for s in seen)
    assert olds in seen  # some reads ran while the compaction did


# -- the command line -----------------------------------------------------------------------------


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("kcompact: error: "), p.stderr
    return lines[0]


def test_cli_bad_input(s3_store_url):
    url = s3_store_url()
    fill(url, n=300, batch=300)
    t0 = time.monotonic()
    msg = _one_line_error(run("inspect", "--store", url,
                              env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}))
    assert "access denied" in msg and "SignatureDoesNotMatch" in msg
    msg = _one_line_error(run("verify", "--store", url, env={"AWS_ACCESS_KEY_ID": "nobody"}))
    assert "access denied" in msg
    msg = _one_line_error(run("dump", "--store", "s3://no-such-bucket-here/x", "--topic", TOPIC,
                              "--partition", "0"))
    assert "bucket 'no-such-bucket-here' does not exist" in msg
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    msg = _one_line_error(run("compact", "--store", f"{url}?endpoint=http://127.0.0.1:{port}"))
    assert "cannot reach the S3 endpoint" in msg and str(port) in msg
    msg = _one_line_error(run("inspect", "--store", url + "/elsewhere"))
    assert "not a kcompact store" in msg
    msg = _one_line_error(run("inspect", "--store", url + "?endpont=x"))
    assert "unknown option 'endpont'" in msg
    assert time.monotonic() - t0 < 60  # each fails within seconds (a few of them start Python)


def test_cli_inspect_dump_verify_compact(store_url, tmp_path):
    """The same commands and answers on a local store and on an S3 one; compared with a
    local reference store compacted in-process."""
    url = store_url
    fill(url, n=3000, batch=500)
    local = str(tmp_path / "reference")
    fill(local, n=3000, batch=500)
    p = run("inspect", "--store", url)
    assert p.returncode == 0 and "t  " in p.stdout and url in p.stdout, p.stderr
    png = tmp_path / "store.png"
    p = run("inspect", "--store", url, "--plot", str(png))
    assert p.returncode == 0 and f"wrote {png}" in p.stderr, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = run("dump", "--store", url, "--topic", TOPIC, "--partition", "1", "--json")
    assert p.returncode == 0, p.stderr
    got = [json.loads(line) for line in p.stdout.splitlines()]
    assert [d["offset"] for d in got] == list(range(1, 3000, 3))
    p = run("dump", "--store", url, "--topic", TOPIC, "--partition", "1", "--from-offset",
            "1500", "--limit", "2")
    assert [line.split("\t")[0] for line in p.stdout.splitlines()] == ["1501", "1504"]
    p = run("verify", "--store", url, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["ok"] and \
        json.loads(p.stdout)["records"] == 3000
    p = run("compact", "--store", url, "--force", "--json")
    assert p.returncode == 0, p.stderr
    done = json.loads(p.stdout)["partitions"]
    assert len(done) == 3 and all(r["skipped"] is None for r in done)
    with Store.open(local) as st:
        compact_store(st, force=True)
    assert content(url) == content(local)
    p = run("verify", "--store", url)
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stdout
    p = run("compact", "--store", url)
    assert p.returncode == 0 and "nothing to compact" in p.stdout


def _have_java() -> bool:
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


@pytest.mark.skipif(not _have_java(), reason="Spark needs Java 17")
def test_cli_compact_spark_and_the_data_source(s3_store_url, tmp_path):
    # the S3 store written with shared uploads (issue 43): Spark's compaction splits them and
    # the command collects the objects it split (no grace period here)
    url = s3_store_url(grace_ms=0)
    fill(url, n=3000, batch=500, options=WriterOptions(upload="shared"))
    local = str(tmp_path / "local")
    fill(local, n=3000, batch=500)
    with Store.open(url) as st:
        SH.journal_for(st.fs).refresh(0.0)
        assert len(SH.journal_for(st.fs).objects) == 6  # a flush each
    p = run("compact", "--store", url, "--force", "--engine", "spark", "--spark-master",
            "local[2]", "--json", timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["engine"] == "spark"
    with Store.open(local) as st:
        compact_store(st, force=True)
    assert content(url) == content(local)
    with Store.open(url) as st:
        SH.journal_for(st.fs).refresh(0.0)
        assert SH.journal_for(st.fs).objects == {}  # every object split, then collected
    code = textwrap.dedent(f"""
        from kcompact.connectors.apps.spark import spark_session
        spark = spark_session("local[2]")
        for mode in ("latest", "all"):
            df = (spark.read.format("kcompact").option("store", {url!r})
                  .option("topic", "t").option("mode", mode).load())
            rows = sorted((r.partition, r.offset) for r in df.select("partition", "offset")
                          .collect())
            print(mode, len(rows), rows[:3])
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line[:3] in ("lat", "all"))
    c = content(local)
    all_n = sum(len(v) for v in c.values())
    live = sum(1 for v in c.values() for r in v if r[3] is not None)
    assert int(out["all"].split()[0]) == all_n and int(out["latest"].split()[0]) == live


def test_cli_kv_build_from_s3(s3_store_url, tmp_path):
    url = s3_store_url()
    fill(url, n=3000, batch=500)
    db = str(tmp_path / "kv")
    p = run("kv", "build", "--store", url, "--topic", TOPIC, "--db", db)
    assert p.returncode == 0, p.stderr
    latest: dict[bytes, bytes | None] = {}
    for _p, v in content(url).items():
        for off, _ts, k, val, _h in v:
            latest[k] = (off, val) if k not in latest or latest[k][0] < off else latest[k]
    for k, (_off, val) in list(latest.items())[:10]:
        g = run("kv", "get", "--db", db, k.decode())
        if val is None:
            assert g.returncode == 1
        else:
            assert g.returncode == 0 and g.stdout.strip() == val.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Serve:
    """`kcompact serve` of a store on a free loopback port (stopped on exit)."""

    def __init__(self, store: str, tmp_path: Path):
        self.token = tmp_path / "token"
        self.token.write_text("s3-replication-token-0123456789")
        self.token.chmod(0o600)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen([KCOMPACT, "serve", "--store", store, "--listen",
                                   f"127.0.0.1:{self.port}", "--token-file", str(self.token)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> "_Serve":
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                if self.p.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise AssertionError(f"kcompact serve did not start: {self.p.stdout.read()}")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        _stop(self.p)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def test_serve_from_s3_and_replicate_into_local_and_s3(s3_store_url, tmp_path):
    master = s3_store_url()
    fill(master, n=3000, batch=500)
    with Store.open(master) as st:
        compact_store(st, force=True)
    with _Serve(master, tmp_path) as srv:
        src, token = srv.url, srv.token
        for replica in (str(tmp_path / "replica"), s3_store_url()):
            p = run("replicate", "--from", src, "--token-file", str(token), "--store", replica)
            assert p.returncode == 0, p.stderr
            # the master's sealed format-2 objects travel as stored (replication protocol 2)
            assert re.search(r"protocol 2: [\d,]+ bytes, [\d,]+ of them [1-9]\d* segments as "
                             r"stored", p.stdout), p.stdout
            p = run("verify", "--store", replica, "--against", src, "--token-file", str(token))
            assert p.returncode == 0 and "EQUAL" in p.stdout, p.stdout + p.stderr
            assert content(replica) == content(master)
        # more records on the master, then the S3 replica again: merged with what it has
        with Store.open(master, writer="w2") as st:
            st.append(RecordBatch.from_records(TOPIC, rows(300, start=3000)))
        # the serving process learns of the new writer w2 from the store's writers registry,
        # read every few seconds (docs/s3-shared-uploads.md, "The live edge"): a replicate run
        # then pulls what it has not, merged with what the replica holds
        deadline = time.monotonic() + 60
        while True:
            p = run("replicate", "--from", src, "--token-file", str(token), "--store", replica)
            assert p.returncode == 0, p.stderr
            with Store.open(replica) as st:
                if [st.next_offset(TOPIC, q) for q in range(3)] == [3298, 3299, 3300]:
                    break
            assert time.monotonic() < deadline, "the master's new records never reached it"
            time.sleep(1.0)
        p = run("verify", "--store", replica, "--against", src, "--token-file", str(token))
        assert p.returncode == 0 and "EQUAL" in p.stdout, p.stdout + p.stderr
        with Store.open(replica) as st:
            assert verify_store(st).ok
            assert [st.next_offset(TOPIC, q) for q in range(3)] == [3298, 3299, 3300]


def test_replicate_follow_into_s3(s3_store_url, tmp_path):
    """--follow into an S3 replica: what it pulls is sealed (uploaded and committed) about once
    a second, so a reader of the replica sees the master's new records while it runs."""
    master, replica = s3_store_url(), s3_store_url()
    fill(master, n=600, batch=300)
    with _Serve(master, tmp_path) as srv:
        rep = subprocess.Popen([KCOMPACT, "replicate", "--from", srv.url, "--token-file",
                                str(srv.token), "--store", replica, "--follow"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            def replica_next():
                try:
                    with Store.open(replica) as st:
                        return [st.next_offset(TOPIC, q) for q in range(3)]
                except Exception:  # noqa: BLE001 - not created yet
                    return None
            deadline = time.monotonic() + 120
            while replica_next() != [598, 599, 600]:
                assert rep.poll() is None and time.monotonic() < deadline, rep.stdout.read()
                time.sleep(0.5)
            with Store.open(master, writer="w2") as st:
                st.append(RecordBatch.from_records(TOPIC, rows(90, start=600)))
            while replica_next() != [688, 689, 690]:
                assert rep.poll() is None and time.monotonic() < deadline, rep.stdout.read()
                time.sleep(0.5)
        finally:
            _stop(rep)
        assert rep.returncode == 0, rep.stdout.read()
        p = run("verify", "--store", replica, "--against", srv.url, "--token-file",
                str(srv.token))
        assert p.returncode == 0 and "EQUAL" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("engine", ["local", pytest.param("spark", marks=pytest.mark.skipif(
    not _have_java(), reason="Spark needs Java 17"))])
def test_cli_mirror_into_s3(kafka_bootstrap, make_topic, s3_store_url, engine):
    """The local engine stores every record; the Spark engine also compacts after the mirror,
    so there each partition holds the latest record of each key (tombstones kept)."""
    from confluent_kafka import Producer
    topic = make_topic(partitions=3)
    prod = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    model: dict[int, list[tuple[int, bytes, bytes | None]]] = {0: [], 1: [], 2: []}

    def send(key: bytes, value: bytes | None, q: int) -> None:
        prod.produce(topic, key=key, value=value, partition=q, timestamp=1_700_000_000_000)
        model[q].append((len(model[q]), key, value))

    def latest(recs) -> dict:
        return {k: (o, v) for o, k, v in recs}

    def check(url: str) -> None:
        got = {q: [(o, k, v) for o, _ts, k, v, _h in recs]
               for q, recs in content(url, topic).items()}
        if engine == "local":
            assert got == model
            return
        for q, recs in got.items():  # compacted (maybe with a dirty tail): the same live state
            assert all(model[q][o] == (o, k, v) for o, k, v in recs)
            assert latest(recs) == latest(model[q])
    for i in range(900):
        send(b"k%d" % (i % 50), None if i % 11 == 0 else b"v%d" % i, i % 3)
    assert prod.flush(60) == 0
    url = s3_store_url()
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
            "--engine", engine, timeout=300)
    assert p.returncode == 0, p.stderr
    check(url)
    # again: resumes from the store's own offsets, nothing duplicated
    for i in range(30):
        send(b"new", b"%d" % i, i % 3)
    assert prod.flush(60) == 0
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
            "--engine", engine, timeout=300)
    assert p.returncode == 0, p.stderr
    check(url)
    p = run("verify", "--store", url)
    assert p.returncode == 0, p.stdout


# -- restore, mirror --follow, kv build --follow on S3 ---------------------------------------------


def _wait(cond, what: str, timeout: float, *procs: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args[1:3]} exited ({p.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _stored(url: str, topic: str) -> int:
    """Records of ``topic`` a reader of the store sees (0 before the first flush)."""
    try:
        with Store.open(url) as st:
            return sum(st.partition(topic, q).record_count() for q in st.partitions(topic))
    except Exception:  # noqa: BLE001 - the store is not created yet
        return 0


def _produce(bootstrap: str, topic: str, rows_) -> None:
    from confluent_kafka import Producer
    prod = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for q, key, value in rows_:
        prod.produce(topic, key=key, value=value, partition=q, timestamp=1_700_000_000_000)
    assert prod.flush(60) == 0


def test_cli_restore_from_s3(kafka_bootstrap, make_topic, s3_store_url):
    """`kcompact restore` of an S3 store (one partition compacted, the others not) into an
    existing topic re-publishes the latest record of each key per partition (tombstones
    included); its progress goes into the S3 store, so a rerun publishes nothing again."""
    sys.path.insert(0, str(Path(__file__).parent))
    from topics import read_topic
    url = s3_store_url()
    fill(url, n=3000, batch=500)
    with Store.open(url) as st:
        compact_store(st, topic=TOPIC, partition=0, force=True)
    target = make_topic(partitions=3)
    p = run("restore", "--store", url, "--topic", TOPIC, "--bootstrap-servers", kafka_bootstrap,
            "--to-topic", target, timeout=300)
    assert p.returncode == 0, p.stderr
    want = {}
    for q, recs in content(url).items():
        last = {}
        for off, ts, k, v, h in recs:
            last[k] = (off, ts, k, v, tuple(h))
        # into an existing topic a key whose latest record is a tombstone gets the tombstone
        want[q] = [(ts, k, v, h) for off, ts, k, v, h in sorted(last.values())]
    assert read_topic(kafka_bootstrap, target, 3, offsets=False) == want
    with Store.open(url) as st:
        assert len(st.topics()) == 2  # the topic and the restore's internal progress topic
    again = run("restore", "--store", url, "--topic", TOPIC, "--bootstrap-servers",
                kafka_bootstrap, "--to-topic", target, timeout=300)
    assert again.returncode == 0, again.stderr
    assert read_topic(kafka_bootstrap, target, 3, offsets=False) == want  # nothing twice


def test_cli_mirror_follow_and_kv_build_follow_on_s3(kafka_bootstrap, make_topic, s3_store_url,
                                                     tmp_path):
    """`mirror --follow` into an S3 store: what it flushes appears in S3 while it runs. A
    `kv build --follow` of that S3 store applies the records as the mirror appends them. Both
    stop cleanly on SIGTERM (exit 0), and the map and the store equal the topic."""
    topic = make_topic(partitions=3)
    first = [(i % 3, b"p%d-k%d" % (i % 3, i % 40), None if i % 13 == 0 else b"a%d" % i)
             for i in range(300)]
    more = [(i % 3, b"p%d-k%d" % (i % 3, i % 55), None if i % 11 == 0 else b"b%d" % i)
            for i in range(200)]
    _produce(kafka_bootstrap, topic, first)
    url, db = s3_store_url(), str(tmp_path / "kv")
    kv_err = tmp_path / "kv.err"
    mirror = subprocess.Popen([KCOMPACT, "mirror", "--bootstrap-servers", kafka_bootstrap,
                               "--topic", topic, "--store", url, "--follow"],
                              stderr=subprocess.PIPE, text=True)
    kv = None
    try:
        _wait(lambda: _stored(url, topic) == 300, "the first records in S3", 120, mirror)
        with open(kv_err, "w") as f:
            kv = subprocess.Popen([KCOMPACT, "kv", "build", "--store", url, "--topic", topic,
                                   "--db", db, "--follow"], stdout=subprocess.PIPE, stderr=f,
                                  text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _wait(lambda: "following" in kv_err.read_text(), "kv build to follow", 120, kv, mirror)
        _produce(kafka_bootstrap, topic, more)
        _wait(lambda: _stored(url, topic) == 500, "the new records in S3", 120, mirror, kv)

        def applied() -> int:
            return sum(int(line.split()[3].replace(",", "")) for line in
                       kv_err.read_text().splitlines() if line.startswith("kv build: applied "))
        _wait(lambda: applied() >= len(more), "the follower to apply them", 120, kv, mirror)
        kv.send_signal(signal.SIGTERM)
        kv.communicate(timeout=60)
        mirror.send_signal(signal.SIGTERM)
        _, merr = mirror.communicate(timeout=60)
    finally:
        for p in (kv, mirror):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert kv.returncode == 0, kv_err.read_text()
    assert mirror.returncode == 0, merr
    assert "stopped by SIGTERM" in merr and "flushed" in merr
    model: dict[bytes, bytes | None] = {}
    for _q, k, v in first + more:
        model[k] = v
    from kcompact.connectors.apps.kv import KVMap
    with KVMap(db) as m:
        assert dict(m.items()) == {k: v for k, v in model.items() if v is not None}
    got = content(url, topic)
    assert {q: [(k, v) for _o, _ts, k, v, _h in recs] for q, recs in got.items()} == \
        {q: [(k, v) for qq, k, v in first + more if qq == q] for q in range(3)}
    assert run("verify", "--store", url).returncode == 0
