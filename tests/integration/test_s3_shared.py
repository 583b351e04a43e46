"""Shared upload objects on real S3 (SeaweedFS; issue 43, docs/formats/shared-upload.md).

* ``kcompact mirror --upload shared`` from a broker: every record stored, a flush is one object
  for all the partitions, `inspect` counts each partition's shared objects, `kcompact compact`
  splits them, `verify` passes, a rerun resumes (auto stays shared);
* a writer SIGKILLed between the upload of its object and its journal entry, and a compaction
  SIGKILLed between the upload of its split segment and its manifest commit, lose and duplicate
  nothing, and leave only orphans the collector deletes;
* writers SIGKILLed at random moments while flushing: every flushed record is read back once;
* two writer processes of different partitions at once.

The same properties on the in-memory S3, in-process: tests/unit/test_shared_upload.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kcompact.reput import shared as SH
from kcompact.reput import store_catalog as SC
from kcompact.reput.store import Store

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=timeout)


def _read(url: str, topic: str = "t") -> dict[int, list[tuple]]:
    with Store.open(url) as st:
        return {p: [(r.offset, r.key, r.value) for r in st.iter_records(topic, p)]
                for p in st.partitions(topic)}


# a child that writes 4 partitions with shared uploads; ``KILL_AT``: where it SIGKILLs itself
WRITER = textwrap.dedent('''
    import os, signal, sys
    from kcompact.reput import Store, WriterOptions
    from kcompact.reput import shared as SH
    from kcompact.reput.record import RecordBatch
    url, cl, writer, first, flushes, parts, kill_at = sys.argv[1:8]
    first, flushes = int(first), int(flushes)
    parts = [int(p) for p in parts.split(",")]
    if kill_at == "commit":  # the object is uploaded, the journal entry never created
        real = SH.commit_object
        def dies(fs, journal, w, builder, ospath, created_ms):
            fs.upload_file(f"shared/{w}/{builder.name}", ospath)
            os.kill(os.getpid(), signal.SIGKILL)
        SH.commit_object = dies
    with Store.open(url, writer=writer, create=True, commitlog_dir=cl,
                    options=WriterOptions(upload="shared")) as st:
        if first < 0:  # where the store is (what a killed run committed, or recovered)
            first = st.next_offset("t", parts[0])
        for f in range(first, first + flushes):
            st.append(RecordBatch.from_records("t", [
                (p, f, 1000 + f, b"k%d" % (f % 7), b"v%d-%d" % (p, f), []) for p in parts]))
            st.flush()
            print(f, flush=True)
''')

# a child that compacts partition 0 and SIGKILLs itself at its manifest commit (the split
# segment uploaded, the manifest version never created)
SPLITTER = textwrap.dedent('''
    import os, signal, sys
    from kcompact.reput import Store
    from kcompact.reput import manifest as M
    from kcompact.reput import catalog_manifest as PM
    from kcompact.compaction import Compactor
    url, cl = sys.argv[1:3]
    def dies(*a, **kw):
        os.kill(os.getpid(), signal.SIGKILL)
    PM.M.commit = dies
    with Store.open(url, writer="splitter", commitlog_dir=cl) as st:
        Compactor(st).compact_partition("t", 0)
''')


def _child(tmp_path: Path, script: str, *args: str) -> subprocess.Popen:
    path = tmp_path / f"child-{abs(hash(script)) % 10**8}.py"
    path.write_text(script)
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _want(parts, flushes):
    return {p: [(f, b"k%d" % (f % 7), b"v%d-%d" % (p, f)) for f in range(flushes)]
            for p in parts}


def test_a_writer_killed_between_upload_and_commit_loses_nothing(tmp_path, s3_store_url):
    url = s3_store_url(grace_ms=0)
    cl = str(tmp_path / "cl")
    ok = _child(tmp_path, WRITER, url, cl, "w", "0", "3", "0,1,2,3", "-")
    assert ok.wait(120) == 0, ok.stderr.read()
    killed = _child(tmp_path, WRITER, url, cl, "w", "3", "1", "0,1,2,3", "commit")
    assert killed.wait(120) == -signal.SIGKILL
    with Store.open(url) as st:
        j = SH.journal_for(st.fs)
        j.fetch_all()
        named = {e.object_path for e in j.entries.values()}
        orphans = sorted(set(j.objects) - named)
        assert len(orphans) == 1 and len(j.entries) == 3
    # the next open of the writer uploads the records again (its commit log still has them)
    again = _child(tmp_path, WRITER, url, cl, "w", "4", "1", "0,1,2,3", "-")
    assert again.wait(120) == 0, again.stderr.read()
    assert _read(url) == _want(range(4), 5)
    with Store.open(url, writer="gc", commitlog_dir=str(tmp_path / "cl-gc")) as st:
        assert st.collect_shared_garbage() == orphans  # only the orphan: nothing is split yet
    assert _read(url) == _want(range(4), 5)


def test_a_split_killed_before_its_manifest_commit_changes_nothing(tmp_path, s3_store_url):
    url = s3_store_url(grace_ms=0)
    cl = str(tmp_path / "cl")
    w = _child(tmp_path, WRITER, url, cl, "w", "0", "4", "0,1", "-")
    assert w.wait(120) == 0, w.stderr.read()
    before = _read(url)
    killed = _child(tmp_path, SPLITTER, url, str(tmp_path / "cl-s"))
    assert killed.wait(120) == -signal.SIGKILL
    assert _read(url) == before
    with Store.open(url) as st:
        assert st.partition("t", 0).shared_objects == 4  # nothing was split
        orphans = [n for n, _, _ in st.fs.list_objects("partitions/t/0") if n.endswith(".log")]
        assert len(orphans) == 1  # the split's uploaded segment, never committed
        assert st.collect_shared_garbage() == []  # every shared object is still needed
    p = run("compact", "--store", url)
    assert p.returncode == 0, p.stderr
    assert _read(url) == before
    with Store.open(url, writer="gc", commitlog_dir=str(tmp_path / "cl-gc")) as st:
        pl = st.partition("t", 0)
        assert pl.shared_objects == 0
        # the orphan is gone (the compaction's collection), the new segment is listed
        logs = [n for n, _, _ in st.fs.list_objects("partitions/t/0") if n.endswith(".log")]
        # (the segments inside the run's compaction object have no object of their own)
        assert orphans[0] not in logs and logs == [s.log for s in pl.manifest.segments
                                                   if s.object is None]
        # `compact` split both partitions: every object but the newest entry's went already
        assert not SH.journal_for(st.fs).objects
    p = run("verify", "--store", url)
    assert p.returncode == 0, p.stdout + p.stderr


def test_writers_killed_at_random_moments_lose_no_flushed_record(tmp_path, s3_store_url):
    url = s3_store_url()
    cl = str(tmp_path / "cl")
    rnd = random.Random(43)
    printed = -1
    for _ in range(4):
        proc = _child(tmp_path, WRITER, url, cl, "w", "-1", "40", "0,1,2", "-")
        time.sleep(rnd.uniform(0.5, 2.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        printed = max([int(x) for x in out.split()] + [printed])
        got = _read(url) if printed >= 0 else {}
        # one journal entry commits a flush of every partition: all or none of it is seen,
        # every flush the child reported is, and nothing twice
        lens = {len(recs) for recs in got.values()}
        assert len(lens) <= 1, got
        for recs in got.values():
            assert [o for o, _, _ in recs] == list(range(len(recs)))
            assert len(recs) >= printed + 1
    final = _child(tmp_path, WRITER, url, cl, "w", "-1", "1", "0,1,2", "-")
    out, err = final.communicate(timeout=120)
    assert final.returncode == 0, err
    n = int(out.split()[-1]) + 1
    assert n >= printed + 2
    assert _read(url) == _want(range(3), n)


def test_two_writer_processes_of_different_partitions(tmp_path, s3_store_url):
    url = s3_store_url()
    a = _child(tmp_path, WRITER, url, str(tmp_path / "cl-a"), "a", "0", "8", "0,1", "-")
    b = _child(tmp_path, WRITER, url, str(tmp_path / "cl-b"), "b", "0", "8", "2,3", "-")
    assert a.wait(120) == 0, a.stderr.read()
    assert b.wait(120) == 0, b.stderr.read()
    assert _read(url) == _want(range(4), 8)
    with Store.open(url) as st:
        SH.journal_for(st.fs).fetch_all()
        assert sorted({w for w, _ in SH.journal_for(st.fs).entries}) == ["a", "b"]


def test_cli_mirror_with_shared_uploads(kafka_bootstrap, make_topic, s3_store_url):
    from confluent_kafka import Producer
    topic = make_topic(partitions=4)
    prod = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    model: dict[int, list] = {q: [] for q in range(4)}

    def send(n: int, start: int) -> None:
        for i in range(start, start + n):
            q = i % 4
            key, value = b"k%d" % (i % 30), (None if i % 13 == 0 else b"v%d" % i)
            prod.produce(topic, key=key, value=value, partition=q)
            model[q].append((len(model[q]), key, value))
        assert prod.flush(60) == 0
    send(400, 0)
    url = s3_store_url()
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
            "--engine", "local", "--upload", "shared")
    assert p.returncode == 0, p.stderr
    assert _read(url, topic) == model
    with Store.open(url) as st:
        # a new store: shared uploads with a store catalog (format 5, docs/formats/store-catalog.md)
        assert st.meta.format_version == SC.STORE_FORMAT
        assert SH.FEATURE in st.meta.features and SC.FEATURE in st.meta.features
        assert not [k for k in st.fs.list_objects("partitions") if k[0].endswith(".log")], \
            "per-partition segment objects from a shared-upload mirror"
    p = run("inspect", "--store", url, "--json")
    assert p.returncode == 0, p.stderr
    parts = json.loads(p.stdout)["topics"][0]["partitions"]
    assert all(q["shared_objects"] >= 1 for q in parts)
    send(40, 400)  # a rerun (auto): still shared, resumes where it stopped
    p = run("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store", url,
            "--engine", "local")
    assert p.returncode == 0, p.stderr
    assert _read(url, topic) == model
    p = run("compact", "--store", url, "--force")
    assert p.returncode == 0, p.stderr
    p = run("inspect", "--store", url, "--json")
    parts = json.loads(p.stdout)["topics"][0]["partitions"]
    assert [q["shared_objects"] for q in parts] == [0, 0, 0, 0]
    latest = {q: {k: (o, v) for o, k, v in recs} for q, recs in model.items()}
    got = _read(url, topic)
    assert {q: {k: (o, v) for o, k, v in recs} for q, recs in got.items()} == latest
    p = run("verify", "--store", url)
    assert p.returncode == 0, p.stdout + p.stderr
