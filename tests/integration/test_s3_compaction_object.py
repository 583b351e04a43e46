"""Compaction objects on real S3 (SeaweedFS; issue 49, docs/formats/compaction-object.md).

* `kcompact compact --force` on a store written with shared uploads writes one object for
  every partition; `kcompact dump`, the Kafka endpoint's reads (``PartitionReader``) and
  `verify` see the records a forced compaction keeps;
* a compaction process SIGKILLed between the object's upload and its manifest commits (none
  made, or some) loses nothing: each partition reads as before or as after, the collector
  deletes the object only when no manifest lists it, and a rerun reaches the compacted state.

The same properties in-process on the in-memory S3: tests/unit/test_compaction_object.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kcompact.reput import compaction_object as CO
from kcompact.reput import filenames as fn
from kcompact.reput import manifest as M
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store, WriterOptions

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")
ROOT = Path(__file__).resolve().parents[2]
PARTS = 4


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=timeout)


def _write(url: str, cl: str) -> None:
    with Store.open(url, writer="w", create=True, commitlog_dir=cl,
                    options=WriterOptions(upload="shared")) as st:
        for f in range(3):
            st.append(RecordBatch.from_records("t", [
                (p, f * 20 + o, 1000 + o, b"k%d" % (o % 9), b"v%d-%d-%d" % (p, f, o), [])
                for p in range(PARTS) for o in range(20)]))
            st.flush()


def _read(url: str) -> dict[int, list[tuple]]:
    with Store.open(url) as st:
        return {p: [(r.offset, r.key, r.value) for r in st.iter_records("t", p)]
                for p in st.partitions("t")}


def _dedup(rows):
    last = {k: o for o, k, _ in rows}
    return [(o, k, v) for o, k, v in rows if last[k] == o]


# a child that runs `kcompact compact --force`'s compaction and SIGKILLs itself once the
# object is uploaded and ``commits`` partitions' manifests are committed
KILLER = textwrap.dedent('''
    import os, signal, sys
    from kcompact.compaction.planner import compact_store
    from kcompact.reput import Store
    from kcompact.reput import catalog_manifest as PM
    url, cl, commits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = PM.ManifestCatalog.commit_staged
    made = [0]
    def commit(self, *a, **kw):
        if kw.get("placed") is not None and made[0] == commits:
            os.kill(os.getpid(), signal.SIGKILL)
        made[0] += 1
        return real(self, *a, **kw)
    PM.ManifestCatalog.commit_staged = commit
    with Store.open(url, commitlog_dir=cl) as st:
        compact_store(st, force=True)
''')


def _objects(url: str) -> list[str]:
    with Store.open(url) as st:
        return [f"{fn.COMPACTED_DIR}/{n}" for n, _, _ in st.fs.list_objects(fn.COMPACTED_DIR)]


def test_compact_force_writes_one_object_that_every_reader_reads(tmp_path, s3_store_url):
    url = s3_store_url()
    _write(url, str(tmp_path / "cl"))
    want = {p: _dedup(rs) for p, rs in _read(url).items()}
    p = run("compact", "--store", url, "--force")
    assert p.returncode == 0, p.stderr
    objs = _objects(url)
    assert len(objs) == 1
    assert _read(url) == want
    d = run("dump", "--store", url, "--topic", "t", "--partition", "2", "--json")
    assert d.returncode == 0, d.stderr
    dumped = [json.loads(line) for line in d.stdout.splitlines()]
    assert [(r["offset"], r["key"].encode(), r["value"].encode()) for r in dumped] == want[2]
    v = run("verify", "--store", url)
    assert v.returncode == 0, v.stdout + v.stderr
    with Store.open(url) as st:
        assert st.meta.format_version == 4 and CO.FEATURE in st.meta.features


@pytest.mark.parametrize("commits", [0, 2])
def test_a_compaction_killed_between_upload_and_commit_loses_nothing(tmp_path, s3_store_url,
                                                                     commits):
    url = s3_store_url(grace_ms=0)
    _write(url, str(tmp_path / "cl"))
    before = _read(url)
    after = {p: _dedup(rs) for p, rs in before.items()}
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    killed = subprocess.run([sys.executable, str(script), url, str(tmp_path / "cc"),
                             str(commits)], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    objs = _objects(url)
    assert len(objs) == 1  # uploaded, then killed
    got = _read(url)
    # each partition reads as before or as after (never a mix), ``commits`` of them after
    assert all(rs in (before[p], after[p]) for p, rs in got.items())
    assert sum(rs == after[p] != before[p] for p, rs in got.items()) == commits
    with Store.open(url, commitlog_dir=str(tmp_path / "gc")) as st:
        deleted = st.collect_compaction_garbage()
    assert deleted == (objs if commits == 0 else [])
    assert _read(url) == got
    p = run("compact", "--store", url, "--force")
    assert p.returncode == 0, p.stderr
    assert _read(url) == after
    with Store.open(url, commitlog_dir=str(tmp_path / "gc")) as st:
        listed = {s.object for q in st.partitions("t")
                  for s in M.read_latest(st.fs, fn.partition_dir("t", q)).segments}
    assert set(_objects(url)) == listed  # the rerun's garbage pass left only listed objects
    v = run("verify", "--store", url)
    assert v.returncode == 0, v.stdout + v.stderr
