"""Shared upload objects on S3 (issue 43; docs/formats/shared-upload.md), on the in-memory S3.

* a flush is 2 requests (one object, one journal entry) whatever the partition count;
* the records read back from shared objects, after the split into per-partition segments, and
  from a store written with per-partition uploads are the same (hypothesis over partition
  counts, flush sizes, keys, tombstones and offset gaps);
* a writer that dies between the upload and the commit, or after the commit before it drops its
  local segments, and a split that dies before its manifest commit, lose and duplicate nothing
  and leave only what the collector deletes;
* two writers of different partitions share nothing they can corrupt; a second process under
  the same writer id is refused; the garbage collector deletes an object only once every
  partition has split it; store.json says format 3 and ``shared-upload``; inspect counts each
  partition's shared objects.

The SIGKILLed writer and split on SeaweedFS: tests/integration/test_s3_shared.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend_env, store_url  # noqa: E402

from kcompact.compaction import Compactor  # noqa: E402
from kcompact.compaction.planner import compact_store  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput import active_memory as AM  # noqa: E402
from kcompact.reput import segment_recycle as SR  # noqa: E402
from kcompact.reput import shared as SH  # noqa: E402
from kcompact.reput.errors import ConfigError  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402

SHARED = WriterOptions(upload="shared")
PARTITION = WriterOptions(upload="partition")


@pytest.fixture
def s3(tmp_path):
    """(make_url, root): stores in the in-memory S3 of this test."""
    with backend_env("s3", str(tmp_path)) as fake:
        def make(name="store", grace_ms=None):
            url = store_url("s3", tmp_path, name)
            return url if grace_ms is None else f"{url}?grace_ms={grace_ms}"
        make.fake = fake
        yield make, str(tmp_path)


def _batch(topic, rows):
    """rows: (partition, offset, key, value) -> a batch (value None: a tombstone)."""
    return RecordBatch.from_records(topic, [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows])


def _read(st, topic, partition):
    return [(r.offset, r.timestamp, r.key, r.value) for r in st.iter_records(topic, partition)]


def _write(url, cl, flushes, options, writer="w"):
    """flushes: [[(partition, offset, key, value), ...], ...], one flush each."""
    with Store.open(url, writer=writer, create=True, options=options, commitlog_dir=cl) as st:
        for rows in flushes:
            if rows:
                st.append(_batch("t", rows))
            st.flush()


def _flushes(parts: int, sizes: list[int], keys: int, gaps: bool, seed: int):
    import random
    rnd = random.Random(seed)
    nxt = {p: 0 for p in range(parts)}
    out = []
    for n in sizes:
        rows = []
        for _ in range(n):
            p = rnd.randrange(parts)
            o = nxt[p]
            nxt[p] = o + 1 + (rnd.randrange(3) if gaps else 0)
            value = None if rnd.random() < 0.1 else b"v%d" % rnd.randrange(1000)
            rows.append((p, o, b"k%d" % rnd.randrange(keys), value))
        out.append(rows)
    return out


def _crash(st):
    """What a killed process leaves: its files as they are, its locks released (no flush, no
    seal)."""
    for pl in st._partitions.values():
        pl.close(publish=False)
    st._partitions.clear()
    st._writable.clear()
    st.commitlog.close()
    st.commitlog = None


def _split_all(url, cl):
    """The split alone (no deduplication): every partition's parts joined and committed."""
    with Store.open(url, writer="splitter", commitlog_dir=cl) as st:
        for p in st.partitions("t"):
            pl = st.writable_partition("t", p)
            if pl._catalog.stage_split():
                assert pl.commit_staged("splitter")


# -- requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [1, 24])
def test_a_flush_is_two_requests_whatever_the_partition_count(s3, parts):
    make, root = s3
    url = make()
    with Store.open(url, writer="w", create=True, options=SHARED,
                    commitlog_dir=f"{root}/cl") as st:
        st.append(_batch("t", [(p, 0, b"k", b"v") for p in range(parts)]))
        st.flush()  # the first: store.json becomes format 3 as well
        for f in range(1, 4):
            st.fs.stats.reset()
            st.append(_batch("t", [(p, f, b"k", b"v%d" % f) for p in range(parts)]))
            st.flush()
            snap = st.fs.stats.snapshot()
            assert snap["requests"] == {"PutObject": 2}, snap
        st.fs.stats.reset()
        st.flush()  # nothing new: nothing sent
        assert st.fs.stats.total == 0
        st.append(_batch("t", [(p, 4, b"k", b"v4") for p in range(parts)]))
        st.roll()  # a batch job's last roll seals through the shared object too
        assert st.fs.stats.snapshot()["requests"] == {"PutObject": 2}
        fs = st.fs
    assert fs.stats.snapshot()["requests"] == {"PutObject": 2}  # the close: nothing more
    with Store.open(url) as st:
        # per partition only the empty manifest its first flush created (so listing the store
        # finds it), no per-partition segment object
        assert sorted(n for n, _, _ in st.fs.list_objects("partitions")) == sorted(
            f"t/{p}/manifest/00000000000000000001.json" for p in range(parts))
        assert st.meta.format_version == 3 and SH.FEATURE in st.meta.features
        assert st.partitions("t") == list(range(parts))
        for p in range(parts):
            assert _read(st, "t", p) == [(f, 1_000 + f, b"k", b"v" if f == 0 else b"v%d" % f)
                                         for f in range(5)]
            assert st.partition("t", p).shared_objects == 5


def test_upload_shared_needs_seal_format_2():
    with pytest.raises(ConfigError, match="seal_format 2"):
        WriterOptions(upload="shared", seal_format=1)
    with pytest.raises(ConfigError, match="upload"):
        WriterOptions(upload="both")


# -- the model ------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(parts=st.integers(1, 5), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       keys=st.integers(1, 12), gaps=st.booleans(), seed=st.integers(0, 2**16),
       more=st.lists(st.integers(0, 20), max_size=3),
       memory=st.sampled_from([0, 200, 1 << 28]))
def test_shared_parts_split_segments_and_per_partition_uploads_read_the_same(
        tmp_path_factory, parts, sizes, keys, gaps, seed, more, memory):
    """``memory``: the writer's budget for active segments in memory (bytes; 0: on disk, 200:
    some of a flush's segments in memory and the rest on disk; reput/active_memory.py)."""
    root = str(tmp_path_factory.mktemp("model"))
    with backend_env("s3", root), pytest.MonkeyPatch.context() as mp:
        mp.setattr(AM, "budget_bytes", lambda: memory)
        flushes = _flushes(parts, sizes + more, keys, gaps, seed)
        first, later = flushes[:len(sizes)], flushes[len(sizes):]
        shared, per = store_url("s3", root, "shared"), store_url("s3", root, "per")
        _write(shared, f"{root}/cl-s", first, SHARED)
        _write(per, f"{root}/cl-p", flushes, PARTITION)
        _split_all(shared, f"{root}/cl-x")  # the first flushes split ...
        _write(shared, f"{root}/cl-s", later, SHARED)  # ... the later ones still shared
        with Store.open(shared) as a, Store.open(per) as b:
            assert a.partitions("t") == b.partitions("t")
            for p in b.partitions("t"):
                assert _read(a, "t", p) == _read(b, "t", p)
                assert a.next_offset("t", p) == b.next_offset("t", p)
                assert a.first_offset("t", p) == b.first_offset("t", p)
                for o in (1, 7, 30):  # a lookup by offset, then to the end
                    assert [r.offset for r in a.iter_records("t", p, o)] == \
                        [r.offset for r in b.iter_records("t", p, o)]
        _split_all(shared, f"{root}/cl-x")
        with Store.open(shared) as a, Store.open(per) as b:
            for p in b.partitions("t"):
                assert _read(a, "t", p) == _read(b, "t", p)
                assert a.partition("t", p).shared_objects == 0


def test_a_compaction_of_a_shared_store_keeps_what_one_of_a_per_partition_store_keeps(s3):
    make, root = s3
    flushes = _flushes(3, [30, 25, 40, 10], 6, True, 7)
    shared, per = make("shared"), make("per")
    _write(shared, f"{root}/cl-s", flushes, SHARED)
    _write(per, f"{root}/cl-p", flushes, PARTITION)
    for url, cl in ((shared, "cl-a"), (per, "cl-b")):
        with Store.open(url, writer="c", commitlog_dir=f"{root}/{cl}") as st:
            compact_store(st, force=True)
    with Store.open(shared) as a, Store.open(per) as b:
        for p in b.partitions("t"):
            assert _read(a, "t", p) == _read(b, "t", p)
            assert not [s for s in a.partition("t", p).segments if s.kind == "shared"]
            assert a.partition("t", p).manifest.split_to == {"w": 3}


def test_the_planner_splits_a_partition_once_it_depends_on_enough_shared_objects(s3, monkeypatch):
    make, root = s3
    monkeypatch.setenv("KCOMPACT_S3_SHARED_SPLIT_OBJECTS", "3")
    url = make()
    # one key per record: nothing to deduplicate, only the split is due
    flushes = [[(0, f, b"k%d" % f, b"v")] for f in range(2)]
    _write(url, f"{root}/cl", flushes, SHARED)
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        from kcompact.compaction.planner import plan
        assert not [c for c in plan(st) if "shared objects" in c.reasons]
    _write(url, f"{root}/cl", [[(0, 2, b"k2", b"v")]], SHARED)
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        from kcompact.compaction.planner import plan
        due = plan(st)
        assert [c.reasons for c in due] and "3 shared objects" in due[0].reasons
        res = compact_store(st)
        assert [r.shared_parts_split for r in res] == [3]
    with Store.open(url) as st:
        assert st.partition("t", 0).shared_objects == 0
        assert _read(st, "t", 0) == [(o, 1_000 + o, b"k%d" % o, b"v") for o in range(3)]


def test_active_segments_are_kept_in_memory_within_the_budget_and_on_disk_past_it(
        s3, monkeypatch):
    """A writer with shared uploads keeps its partitions' active segments in memory while they
    hold less than its budget (KCOMPACT_S3_ACTIVE_MEMORY_MB; here 300 bytes), then starts the
    next ones on the local disk; a flush commits both kinds in one object and frees the budget;
    a crash before the flush loses nothing (the commit log is dispatched again)."""
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    monkeypatch.setattr(AM, "budget_bytes", lambda: 300)

    def on_disk(p):
        d = os.path.join(cl, "partitions", "t", str(p))
        return sorted(n for n in os.listdir(d) if n.endswith((".log", ".bcq"))) \
            if os.path.isdir(d) else []
    rows = [(p, o, b"k%d" % o, b"v" * 40) for o in range(3) for p in range(6)]
    st = Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=cl)
    mem = st.publisher.active
    st.append(_batch("t", rows))
    in_memory = [p for p in range(6) if not on_disk(p)]
    assert 0 < len(in_memory) < 6  # (the budget ran out part of the way through)
    assert mem.used >= 300
    st.flush()
    assert mem.used == 0  # (committed: dropped)
    st.append(_batch("t", [(p, 3, b"k3", b"w") for p in range(6)]))
    assert mem.used > 0
    _crash(st)  # (the last records only in memory and in the commit log)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=cl) as st:
        st.flush()
    with Store.open(url) as st:
        for p in range(6):
            assert _read(st, "t", p) == [(o, 1_000 + o, b"k%d" % o, b"v" * 40) for o in range(3)] \
                + [(3, 1_003, b"k3", b"w")]


# -- crashes -------------------------------------------------------------------------------------


def test_a_writer_dying_between_upload_and_commit_loses_nothing_and_leaves_a_collectable_orphan(
        s3, monkeypatch):
    make, root = s3
    url = make(grace_ms=0)
    cl = f"{root}/cl"
    _write(url, cl, [[(0, 0, b"a", b"1"), (1, 0, b"b", b"1")]], SHARED)
    real = SH.commit_object

    def dies(fs, journal, writer, builder, ospath, created_ms):
        obj = f"{SH.fn.SHARED_DIR}/{writer}/{builder.name}"
        fs.upload_file(obj, ospath)  # uploaded ...
        raise OSError("killed before the journal entry")  # ... never committed
    monkeypatch.setattr(SH, "commit_object", dies)
    st = Store.open(url, writer="w", options=SHARED, commitlog_dir=cl)
    st.append(_batch("t", [(0, 1, b"a", b"2"), (1, 1, b"b", b"2")]))
    with pytest.raises(OSError, match="killed"):
        st.flush()
    _crash(st)
    monkeypatch.setattr(SH, "commit_object", real)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=cl) as st:  # re-uploads
        st.flush()
        j = SH.journal_for(st.fs)
        j.fetch_all()
        orphans = [k for k in j.objects if k not in {e.object_path for e in j.entries.values()}]
        assert len(orphans) == 1
    with Store.open(url) as st:
        for p, k in ((0, b"a"), (1, b"b")):
            assert _read(st, "t", p) == [(0, 1_000, k, b"1"), (1, 1_001, k, b"2")]
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        deleted = st.collect_shared_garbage()
        assert orphans[0] in deleted
        for p, k in ((0, b"a"), (1, b"b")):
            assert _read(st, "t", p) == [(0, 1_000, k, b"1"), (1, 1_001, k, b"2")]


def test_a_writer_dying_after_the_commit_before_dropping_its_local_segments_duplicates_nothing(
        s3, monkeypatch):
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    from kcompact.reput.catalog_manifest import ManifestCatalog

    def dies(self, local, ups):
        raise OSError("killed after the commit")
    monkeypatch.setattr(ManifestCatalog, "shared_committed", dies)
    st = Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=cl)
    st.append(_batch("t", [(0, 0, b"a", b"1"), (0, 1, b"b", b"1")]))
    with pytest.raises(OSError, match="killed"):
        st.flush()
    _crash(st)
    monkeypatch.undo()
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=cl) as st:
        st.append(_batch("t", [(0, 2, b"c", b"1")]))
        st.flush()
    with Store.open(url) as st:
        assert [o for o, *_ in _read(st, "t", 0)] == [0, 1, 2]


def test_the_next_local_segment_takes_over_the_committed_ones_files(s3, monkeypatch):
    """A flush commits each partition's active segment; the partition's next segment reuses
    its two files (emptied in the background and renamed: reput/segment_recycle.py) instead of
    deleting them and creating new ones; files not emptied yet are not waited for. Whatever
    moment a writer dies at (the committed files still there, or already taken over), the next
    open duplicates and loses nothing."""
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    pdir = os.path.join(cl, "partitions", "t", "0")
    monkeypatch.setenv("KCOMPACT_S3_ACTIVE_MEMORY_MB", "0")  # (on disk, not in memory)

    def local_files():
        return sorted(n for n in os.listdir(pdir) if n.endswith((".log", ".bcq")))
    st = Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=cl)
    st.append(_batch("t", [(0, 0, b"a", b"1"), (0, 1, b"b", b"1")]))
    st.flush()
    SR.drain()  # (emptied in the background)
    spare = local_files()  # the committed segment's files, kept for the next one
    assert spare == ["00000000000000000000.bcq", "00000000000000000000.log"]
    inode = os.stat(os.path.join(pdir, spare[1])).st_ino
    st.append(_batch("t", [(0, 2, b"a", b"2")]))
    assert local_files() == ["00000000000000000002.bcq", "00000000000000000002.log"]
    assert os.stat(os.path.join(pdir, "00000000000000000002.log")).st_ino == inode
    assert os.path.getsize(os.path.join(pdir, "00000000000000000002.log")) > 0
    want = [(0, 1_000, b"a", b"1"), (1, 1_001, b"b", b"1"), (2, 1_002, b"a", b"2")]
    assert _read(st, "t", 0) == want
    st.flush()
    st.append(_batch("t", [(0, 3, b"b", b"3")]))  # a killed writer: one flushed, one not
    _crash(st)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=cl) as st:
        assert _read(st, "t", 0) == want + [(3, 1_003, b"b", b"3")]
        st.flush()
    with Store.open(url) as st:
        assert _read(st, "t", 0) == want + [(3, 1_003, b"b", b"3")]
    held = []  # the background thread held back: the files keep their committed records
    monkeypatch.setattr(SR._RECYCLER, "put", held.append)
    st = Store.open(url, writer="w", options=SHARED, commitlog_dir=cl)
    st.append(_batch("t", [(0, 4, b"a", b"4")]))
    st.flush()
    st.append(_batch("t", [(0, 5, b"b", b"5")]))  # not emptied yet: new files of its own
    assert _read(st, "t", 0)[-2:] == [(4, 1_004, b"a", b"4"), (5, 1_005, b"b", b"5")]
    st.flush()
    left = {n: open(os.path.join(pdir, n), "rb").read() for n in local_files()}
    assert sorted(left) == ["00000000000000000004.bcq", "00000000000000000004.log",
                            "00000000000000000005.bcq", "00000000000000000005.log"]
    for spare in held:
        spare.done.set()
    monkeypatch.undo()
    _crash(st)  # (a close drops them: put back what a SIGKILL leaves)
    # ... and what a kill between the emptying's and the renames' steps leaves: an empty .log
    # without its .bcq (the committed segment's), an empty .bcq without its .log (the next's)
    left["00000000000000000001.log"] = left["00000000000000000009.bcq"] = b""
    for n, raw in left.items():
        with open(os.path.join(pdir, n), "wb") as f:
            f.write(raw)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=cl) as st:
        assert local_files() == []  # (committed or empty: dropped by the open)
        st.append(_batch("t", [(0, 6, b"a", b"6")]))
        st.flush()
    assert local_files() == []  # a close drops them
    with Store.open(url) as st:
        assert [r[0] for r in _read(st, "t", 0)] == [0, 1, 2, 3, 4, 5, 6]


def test_a_split_dying_before_its_manifest_commit_changes_nothing(s3, monkeypatch):
    make, root = s3
    url = make(grace_ms=0)
    flushes = _flushes(2, [10, 10, 10], 50, False, 3)
    _write(url, f"{root}/cl", flushes, SHARED)
    with Store.open(url) as st:
        before = {p: _read(st, "t", p) for p in st.partitions("t")}
    real = M.commit

    def dies(*a, **kw):
        raise OSError("killed before the manifest commit")
    monkeypatch.setattr(M, "commit", dies)
    from kcompact.reput import catalog_manifest as PM
    monkeypatch.setattr(PM.M, "commit", dies)
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        with pytest.raises(OSError, match="killed"):
            Compactor(st).compact_partition("t", 0)
    monkeypatch.setattr(PM.M, "commit", real)
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        assert {p: _read(st, "t", p) for p in st.partitions("t")} == before
        assert st.partition("t", 0).shared_objects == 3
        assert st.collect_shared_garbage() == []  # nothing split: every object still needed
        res = Compactor(st).compact_partition("t", 0)
        assert res.shared_parts_split == 3
    with Store.open(url) as st:
        assert {p: _read(st, "t", p) for p in st.partitions("t")} == before


# -- writers -------------------------------------------------------------------------------------


def test_two_writers_of_different_partitions_share_nothing_they_can_corrupt(s3):
    make, root = s3
    url = make(grace_ms=0)
    import threading
    errors = []

    def writer(name, parts):
        try:
            with Store.open(url, writer=name, create=True, options=SHARED,
                            commitlog_dir=f"{root}/cl-{name}") as st:
                for f in range(6):
                    st.append(_batch("t", [(p, f, b"k%d" % f, b"%s-%d" % (name.encode(), f))
                                           for p in parts]))
                    st.flush()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=writer, args=("a", [0, 1])),
          threading.Thread(target=writer, args=("b", [2, 3]))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    with Store.open(url) as st:
        j = SH.journal_for(st.fs)
        j.fetch_all()
        assert {w for w, _ in j.entries} == {"a", "b"}
        for p in range(4):
            name = b"a" if p < 2 else b"b"
            assert _read(st, "t", p) == [(f, 1_000 + f, b"k%d" % f, name + b"-%d" % f)
                                         for f in range(6)]
    _split_all(url, f"{root}/cl-x")
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        deleted = st.collect_shared_garbage()
        # every object split: all deleted; each writer's newest entry is kept
        assert sum(p.endswith(".kso") for p in deleted) == 12
        assert sorted(SH.journal_for(st.fs).entries) == [("a", 5), ("b", 5)]
        for p in range(4):
            assert len(_read(st, "t", p)) == 6
    # the writers go on numbering after their kept entry
    with Store.open(url, writer="a", options=WriterOptions(), commitlog_dir=f"{root}/cl-a") as st:
        assert st.shared_uploads  # auto: the store uses shared uploads
        st.append(_batch("t", [(0, 6, b"k6", b"a-6")]))
        st.flush()
        assert SH.journal_for(st.fs).next_seq("a") == 7
    with Store.open(url) as st:
        assert [o for o, *_ in _read(st, "t", 0)] == list(range(7))


def test_a_second_process_under_the_same_writer_id_is_refused(s3):
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, 0, b"a", b"1")]], SHARED)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=f"{root}/cl") as st:
        # another process with this id committed entry 1 meanwhile
        st.fs.create_exclusive(SH.fn.journal_path("w", 1), b"{}")
        st.append(_batch("t", [(0, 1, b"a", b"2")]))
        with pytest.raises(SH.SharedWriterConflictError, match="writer 'w'"):
            st.flush()
        st.fs.delete(SH.fn.journal_path("w", 1))
        SH.journal_for(st.fs).refresh(0.0)


def test_a_partition_whose_next_offset_moves_without_records_keeps_it(s3):
    """Transaction markers: the source goes on past the last record; a part with no records
    carries the next offset."""
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    with Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=cl) as st:
        st.append(_batch("t", [(0, 0, b"a", b"1")]))
        st.flush()
        st.advance_next_offset("t", 0, 5)
        st.flush()
    with Store.open(url) as st:
        assert st.next_offset("t", 0) == 5
        SH.journal_for(st.fs).fetch_all()
        entries = SH.journal_for(st.fs).entries
        assert [p.records for p in entries[("w", 1)].parts] == [0]
    _split_all(url, f"{root}/cl-x")
    with Store.open(url) as st:
        assert st.next_offset("t", 0) == 5
        assert st.partition("t", 0).manifest.next_offset == 5


# -- the store -----------------------------------------------------------------------------------


def test_a_store_written_per_partition_goes_on_with_shared_uploads(s3):
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    _write(url, cl, [[(0, 0, b"a", b"1")]], PARTITION)
    with Store.open(url) as st:
        assert st.meta.format_version == 2 and SH.FEATURE not in st.meta.features
    _write(url, cl, [[(0, 1, b"a", b"2")]], WriterOptions())  # auto: still per partition
    with Store.open(url) as st:
        assert st.meta.format_version == 2
    _write(url, cl, [[(0, 2, b"a", b"3")]], SHARED)
    with Store.open(url) as st:
        assert st.meta.format_version == 3 and SH.FEATURE in st.meta.features
        kinds = [s.kind for s in st.partition("t", 0).segments]
        assert kinds == ["remote", "remote", "shared"]
        assert [v for *_, v in _read(st, "t", 0)] == [b"1", b"2", b"3"]


def test_the_journal_entry_is_validated_and_names_itself(s3):
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, 0, b"a", b"1")]], SHARED)
    with Store.open(url) as st:
        path = SH.fn.journal_path("w", 0)
        raw = st.fs.read(path)
        e = SH.Entry.from_json(raw, path, "w", 0)
        assert e.parts[0].desc.records == 1
        body = json.loads(raw)
        body["parts"][0]["log_pos"] = 10**9
        with pytest.raises(SH.CorruptRecordError, match="checksum"):
            SH.Entry.from_json(json.dumps(body).encode(), path, "w", 0)
        footer = SH.read_footer(st.fs, e.object_path, e.object_size)
        assert [p["topic"] for p in footer] == ["t"]
        assert footer[0]["log_pos"] == e.parts[0].log_pos


def test_inspect_counts_each_partitions_shared_objects(s3, capsys):
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, f, b"a", b"1"), (1, f, b"b", b"1")] for f in range(3)],
           SHARED)
    from kcompact.connectors.cli import main
    assert main(["inspect", "--store", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["shared_objects"] for p in doc["topics"][0]["partitions"]] == [3, 3]
    assert main(["inspect", "--store", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "SHARED" in out[1].split()
    assert out[2].split()[3] == "3"


def test_a_part_older_than_max_compaction_lag_is_split_whatever_the_count(s3):
    from kcompact.reput import ManualClock
    from kcompact.compaction.planner import plan
    make, root = s3
    url = make()
    clock = ManualClock()
    with Store.open(url, writer="w", create=True, options=SHARED, clock=clock,
                    commitlog_dir=f"{root}/cl") as st:
        # a delete topic: no dirty-ratio trigger, only the split's age is due
        st.set_topic_config("t", {"cleanup.policy": "delete", "retention.ms": -1,
                                  "max.compaction.lag.ms": 60_000})
        st.append(_batch("t", [(0, 0, b"a", b"1")]))
        st.flush()
    with Store.open(url, writer="c", clock=clock, commitlog_dir=f"{root}/cl-c") as st:
        assert plan(st, clock=clock) == []
        clock.advance(61_000)
        due = plan(st, clock=clock)
        assert [c.partition for c in due] == [0] and "1 shared objects" in due[0].reasons
        assert [r.shared_parts_split for r in compact_store(st, clock=clock)] == [1]
    with Store.open(url) as st:
        assert st.partition("t", 0).shared_objects == 0
        assert _read(st, "t", 0) == [(0, 1_000, b"a", b"1")]


def test_a_reader_of_a_split_partition_fetches_no_journal_entry(s3):
    """A journal entry is fetched only by a partition it may hold a part of: one above the
    partition's split_to."""
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, f, b"a", b"1"), (1, f, b"b", b"1")] for f in range(4)],
           SHARED)
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        pl = st.writable_partition("t", 0)
        assert pl._catalog.stage_split() == 4 and pl.commit_staged("c")
    with Store.open(url) as st:
        j = SH.journal_for(st.fs)
        assert len(_read(st, "t", 0)) == 4
        assert j.entries == {}  # listed, not fetched: all below partition 0's split_to
        assert len(_read(st, "t", 1)) == 4
        assert len(j.entries) == 4


def test_objects_are_collected_a_grace_period_after_their_split_however_often_it_splits(s3):
    """A busy partition splits more often than the grace period: each object goes once the
    split covering it is older than the grace period (the manifest's split_log), not when the
    partition's latest manifest is."""
    from kcompact.reput import ManualClock
    make, root = s3
    url = make(grace_ms=60_000)
    clock = ManualClock()

    def flush_and_split(f):
        with Store.open(url, writer="w", create=True, options=SHARED, clock=clock,
                        commitlog_dir=f"{root}/cl") as st:
            st.append(_batch("t", [(0, f, b"k%d" % f, b"v")]))
        with Store.open(url, writer="c", clock=clock, commitlog_dir=f"{root}/cl-c") as st:
            pl = st.writable_partition("t", 0)
            assert pl._catalog.stage_split() == 1 and pl.commit_staged("c")
    for f in range(3):  # splits at 0 s, 40 s, 80 s
        flush_and_split(f)
        clock.advance(40_000)
    with Store.open(url, writer="gc", clock=clock, commitlog_dir=f"{root}/cl-gc") as st:
        deleted = st.collect_shared_garbage()  # at 120 s: the splits at 0 and 40 s are old
        assert sorted(p.rsplit("/", 1)[1][:20] for p in deleted if p.endswith(".kso")) == [
            "%020d" % 0, "%020d" % 1]
        assert [o for o, *_ in _read(st, "t", 0)] == [0, 1, 2]
        log = st.partition("t", 0).manifest.split_log
        # as pruned by the split at 80 s: the newest one older than the grace period (0 s)
        # and the younger ones
        assert [(r["seq"], r["ms"] - log[0]["ms"]) for r in log] == [
            (0, 0), (1, 40_000), (2, 80_000)]


def test_auto_with_seal_format_1_stays_per_partition_on_a_shared_store(s3):
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, 0, b"a", b"1")]], SHARED)
    with Store.open(url, writer="w", options=WriterOptions(seal_format=1),
                    commitlog_dir=f"{root}/cl") as st:
        assert not st.shared_uploads
        st.append(_batch("t", [(0, 1, b"a", b"2")]))
    with Store.open(url) as st:
        assert [v for *_, v in _read(st, "t", 0)] == [b"1", b"2"]


def test_a_reader_opened_before_shared_uploads_began_reads_them(s3, monkeypatch):
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, 0, b"a", b"1")]], PARTITION)
    monkeypatch.setattr(SH, "RECHECK_S", 0.0)
    with Store.open(url) as reader:
        assert SH.journal_for(reader.fs) is None
        assert len(_read(reader, "t", 0)) == 1
        _write(url, f"{root}/cl", [[(0, 1, b"a", b"2")]], SHARED)  # another process
        assert [v for *_, v in _read(reader, "t", 0)] == [b"1", b"2"]


def test_the_split_keeps_segments_within_segment_bytes(s3):
    make, root = s3
    url = make()
    cl = f"{root}/cl"
    with Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=cl) as st:
        st.set_topic_config("t", {"segment.bytes": 1 << 14})
        for f in range(8):
            st.append(_batch("t", [(0, f * 40 + i, b"k%d" % (f * 40 + i), os.urandom(200))
                                   for i in range(40)]))
            st.flush()
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        pl = st.writable_partition("t", 0)
        before = _read(st, "t", 0)
        res = Compactor(st).compact_partition("t", 0)
        assert res.shared_parts_split == 8
        assert len(pl.segments) > 1 and all(s.log_size <= 1 << 14 for s in pl.segments)
        assert _read(st, "t", 0) == before


def test_a_per_partition_writer_on_a_shared_store_commits_no_empty_manifest_version(s3):
    """Parts above the manifest count as committed: a writer with upload=partition that has
    nothing new writes no manifest version (the seal at its close)."""
    make, root = s3
    url = make()
    _write(url, f"{root}/cl", [[(0, 0, b"a", b"1")], [(0, 1, b"a", b"2")]], SHARED)
    with Store.open(url) as st:
        before = st.partition("t", 0).manifest.version
    with Store.open(url, writer="p", options=PARTITION, commitlog_dir=f"{root}/cl-p") as st:
        st.writable_partition("t", 0)
    with Store.open(url) as st:
        assert st.partition("t", 0).manifest.version == before
        assert [v for *_, v in _read(st, "t", 0)] == [b"1", b"2"]


def test_a_compaction_of_one_topic_collects_the_objects_it_finished_splitting(s3):
    """`kcompact compact --topic` (compact_store with a topic) collects too once it split: an
    object whose parts are all split goes; one still holding another topic's part stays."""
    make, root = s3
    url = make(grace_ms=0)
    with Store.open(url, writer="w", create=True, options=SHARED,
                    commitlog_dir=f"{root}/cl") as st:
        st.append(_batch("t", [(0, 0, b"a", b"1"), (1, 0, b"b", b"1")]))
        st.flush()  # object 0: t's parts only
        st.append(_batch("t", [(0, 1, b"a", b"2")]))
        st.append(_batch("u", [(0, 0, b"c", b"1")]))
        st.flush()  # object 1: t-0's and u-0's parts
    with Store.open(url, writer="c", commitlog_dir=f"{root}/cl-c") as st:
        res = compact_store(st, topic="t", force=True)
        assert sorted(r.shared_parts_split for r in res) == [1, 2]
        j = SH.journal_for(st.fs)
        j.refresh(0.0)
        objects = sorted(p.rsplit("/", 1)[1][:20] for p in j.objects)
        assert objects == ["%020d" % 1]  # object 0 collected; object 1 waits for u-0
    with Store.open(url) as st:
        assert _read(st, "t", 0) == [(1, 1_001, b"a", b"2")]
        assert _read(st, "u", 0) == [(0, 1_000, b"c", b"1")]
