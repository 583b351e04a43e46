"""The store catalog on real S3 (SeaweedFS; issue 49, docs/formats/store-catalog.md).

* a reader opening a 48-partition store (topics, partitions, every next offset) makes the
  same 4 requests as at 4 partitions;
* a writer SIGKILLed between the upload of its object and its journal entry, one SIGKILLed in
  its catalog fold (after the entry's commit), and a compaction SIGKILLed between its manifest
  commit and the catalog's lose and duplicate nothing; what they leave is either read (the
  catalog lags, never loses) or collected (an orphan object);
* a new store's first writer and a consumer reading it all through the Kafka endpoint's view
  (as written and after `compact --force`) make the same requests at 4 and at 48 partitions;

The same on the in-memory S3, in-process: tests/unit/test_store_catalog.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kcompact.reput import shared as SH
from kcompact.reput import store_catalog as SC
from kcompact.reput.store import Store

ROOT = Path(__file__).resolve().parents[2]

# a child that writes partitions with the defaults (a new store: shared uploads, a catalog);
# ``KILL_AT``: where it SIGKILLs itself
WRITER = textwrap.dedent('''
    import os, signal, sys
    from kcompact.reput import Store
    from kcompact.reput import shared as SH
    from kcompact.reput import store_catalog as SC
    from kcompact.reput.record import RecordBatch
    url, cl, first, flushes, parts, kill_at = sys.argv[1:7]
    first, flushes, parts = int(first), int(flushes), int(parts)
    def dies(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    if kill_at == "commit":  # the object is uploaded, the journal entry never created
        def commit(fs, journal, w, builder, ospath, created_ms):
            fs.upload_file(f"shared/{w}/{builder.name}", ospath)
            dies()
        SH.commit_object = commit
    elif kill_at == "fold":  # the entry committed, the catalog's fold never written
        SC.StoreCatalog.fold = dies
    with Store.open(url, writer="w", create=True, commitlog_dir=cl) as st:
        for f in range(first, first + flushes):
            st.append(RecordBatch.from_records("t", [
                (p, f, 1000 + f, b"k%d" % (f % 3), b"v%d-%d" % (p, f), [])
                for p in range(parts)]))
            st.flush()
''')

# a compaction of every partition SIGKILLed at its first catalog record (the manifest of the
# partition committed, the catalog not)
COMPACTOR = textwrap.dedent('''
    import os, signal, sys
    from kcompact.reput import Store
    from kcompact.reput import store_catalog as SC
    from kcompact.compaction.planner import compact_store
    url = sys.argv[1]
    def dies(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    SC.StoreCatalog.record = dies
    with Store.open(url) as st:
        compact_store(st, force=True)
''')


def _child(tmp_path: Path, script: str, *args: str, env=None) -> subprocess.Popen:
    path = tmp_path / f"child-{abs(hash(script)) % 10**8}.py"
    path.write_text(script)
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, **(env or {})))


def _read(url: str, parts: int) -> dict[int, list[tuple]]:
    with Store.open(url) as st:
        assert st.partitions("t") == list(range(parts))
        return {p: [(r.offset, r.key, r.value) for r in st.iter_records("t", p)]
                for p in range(parts)}


def _want(parts: int, flushes: int) -> dict[int, list[tuple]]:
    return {p: [(f, b"k%d" % (f % 3), b"v%d-%d" % (p, f)) for f in range(flushes)]
            for p in range(parts)}


def test_opening_costs_the_same_requests_at_4_and_48_partitions(tmp_path, s3_store_url,
                                                                 monkeypatch):
    # a reader lists again once its listing is older than KCOMPACT_S3_REFRESH_MS: on a loaded
    # machine opening 48 partitions can outlast the default 200 ms, so the count is taken
    # with listings that do not age during the open, and the catalog's next version and the
    # journal's next key looked for once (KCOMPACT_S3_CATALOG_POLL_MS, KCOMPACT_S3_FOLLOW_MS):
    # what is compared is the partition count
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_FOLLOW_MS", "60000")
    made = {}
    for parts in (4, 48):
        url = s3_store_url()
        ok = _child(tmp_path, WRITER, url, str(tmp_path / f"cl{parts}"), "0", "5", str(parts),
                    "-")
        assert ok.wait(180) == 0, ok.stderr.read()
        st = Store.open(url)  # (a backend of its own: nothing of another open reused)
        assert st.partitions("t") == list(range(parts))
        assert [st.partition("t", p).next_offset for p in range(parts)] == [5] * parts
        made[parts] = st.fs.stats.snapshot()["requests"]
        st.close()
    assert made[4] == made[48], made
    assert sum(made[48].values()) <= 4, made


def test_writers_and_a_compaction_killed_around_the_catalog_lose_nothing(tmp_path,
                                                                          s3_store_url):
    url = s3_store_url(grace_ms=0)
    cl = str(tmp_path / "cl")
    fold_each = {"KCOMPACT_S3_CATALOG_FOLD": "1"}
    ok = _child(tmp_path, WRITER, url, cl, "0", "3", "4", "-", env=fold_each)
    assert ok.wait(120) == 0, ok.stderr.read()
    for at, first in (("commit", 3), ("fold", 4)):
        killed = _child(tmp_path, WRITER, url, cl, str(first), "1", "4", at, env=fold_each)
        assert killed.wait(120) == -signal.SIGKILL, (at, killed.stderr.read())
        # the next open of the writer uploads what the killed one had not committed (its
        # commit log still has it), or folds what it committed and did not fold
        again = _child(tmp_path, WRITER, url, cl, "0", "0", "4", "-", env=fold_each)
        assert again.wait(120) == 0, again.stderr.read()
        assert _read(url, 4) == _want(4, first + 1), at
        with Store.open(url, writer="gc", commitlog_dir=str(tmp_path / "cl-gc")) as st:
            cat = SC.for_store(st.fs).refresh(0.0)
            j = SH.journal_for(st.fs)
            assert cat.folded["w"] == max(s for w, s in j.listed_keys() if w == "w"), at
    killed = _child(tmp_path, COMPACTOR, url)
    assert killed.wait(180) == -signal.SIGKILL, killed.stderr.read()
    assert _read(url, 4) == _want(4, 5)  # the catalog lags: the partitions as they were
    with Store.open(url, writer="gc", commitlog_dir=str(tmp_path / "cl-gc")) as st:
        st.collect_shared_garbage()  # reconciles the catalog, then deletes
        st.collect_compaction_garbage()
        j = SH.journal_for(st.fs)
        j.refresh(0.0)
        j.fetch_all()
        named = {e.object_path for e in j.entries.values()}
        assert set(j.objects) <= named  # no orphan left
    # the catalog caught up: the partition the killed compaction committed reads compacted
    # (the newest record of each key), the others as they were
    got, want = _read(url, 4), _want(4, 5)
    compacted = [p for p in range(4) if got[p] != want[p]]
    assert len(compacted) == 1, got
    for p in compacted:
        newest = {k: (o, k, v) for o, k, v in want[p]}
        assert got[p] == sorted(newest.values()), p


def _endpoint_read(url: str) -> tuple[dict[int, int], dict]:
    """What the Kafka endpoint does for one consumer reading every partition from the
    beginning (ListOffsets, then Fetch until the high watermark), on a view of its own, with
    the process's block cache and spool emptied: (records read by partition, the view's S3
    requests by operation)."""
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    from kcompact.reput.s3_cache import shared_cache, shared_spool
    shared_cache().clear()
    shared_spool().clear()
    sv = StoreView(url)
    try:
        got = {}
        for p in sv.partitions("t"):
            b = sv.bounds("t", p)
            off, n = b.log_start, 0
            while off < b.high_watermark:
                f = sv.fetch("t", p, off, 1 << 20)
                assert f.nbytes, (p, off)
                hwm = f.bounds.high_watermark
                with sv.store.views.reading("t", p) as pl:
                    n += sum(1 for r in pl.iter_records() if off <= r.offset < hwm)
                off = f.bounds.high_watermark
            got[p] = n
        return got, sv.store.fs.stats.snapshot()["requests"]
    finally:
        sv.close()


def test_a_new_store_is_written_and_read_with_no_request_per_partition(tmp_path, s3_store_url,
                                                                       monkeypatch):
    """(bench/s3_writes.py, bench/s3_catchup.py) A new store's first writer (no partition in
    the catalog yet) and a consumer reading it all through the Kafka endpoint, as written and
    after `compact --force`, make the same requests at 4 and at 48 partitions."""
    from kcompact.compaction.planner import compact_store
    from kcompact.reput.record import RecordBatch
    # (listings do not age, and a follower looks for the catalog's next version and the
    # journal's next key once: above)
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_FOLLOW_MS", "60000")
    made: dict = {}
    for parts in (4, 48):
        url = s3_store_url()
        with Store.open(url, writer="w", create=True,
                        commitlog_dir=str(tmp_path / f"cl{parts}")) as w:
            for f in range(5):
                w.append(RecordBatch.from_records("t", [
                    (p, f, 1000 + f, b"k%d" % (f % 3), b"v%d-%d" % (p, f), [])
                    for p in range(parts)]))
                w.flush()
            made[(parts, "write")] = w.fs.stats.snapshot()["requests"]
        got, made[(parts, "read")] = _endpoint_read(url)
        assert got == {p: 5 for p in range(parts)}
        with Store.open(url, commitlog_dir=str(tmp_path / f"cc{parts}")) as st:
            compact_store(st, force=True)
        got, made[(parts, "read after the split")] = _endpoint_read(url)
        assert got == {p: 3 for p in range(parts)}  # the newest record of each of 3 keys
    for what in ("write", "read", "read after the split"):
        assert made[(4, what)] == made[(48, what)], (what, made)
