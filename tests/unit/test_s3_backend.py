"""The S3 backend, manifests and S3 stores against an in-memory S3 (``_fake_s3.FakeS3``).

No network and no process: the block cache (LRU bound in bytes, merged concurrent requests,
failures not cached), the spool, ranged reads and request counts, error translation, URL
options, the manifest codec and its conditional commit (two committers racing: one wins, the
other rebases or abandons), a writer killed between upload and manifest commit (only orphans
left, cleaned by the next open; readers see the old state), and compaction on S3 against the
same compaction on a local directory. tests/integration/test_s3.py runs the same kind of checks
against a real S3 server (SeaweedFS).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import FakeS3  # noqa: E402

from kcompact.compaction import CompactionOptions, Compactor, compact_store  # noqa: E402
from kcompact.reput import filenames as fn  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput.segment_desc import SegmentDesc  # noqa: E402
from kcompact.reput.backend import BackendError  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3 import (BlockCache, S3AccessError, S3Backend, S3BucketNotFoundError,  # noqa: E402
                      Spool)
from kcompact.reput.config import WriterOptions  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402
from kcompact.reput.verify import verify_store  # noqa: E402

#: these tests are about per-partition uploads (a new S3 store uses shared ones by default)
PARTITION = WriterOptions(upload="partition")


@pytest.fixture
def fake():
    return FakeS3(buckets=("bucket",))


@pytest.fixture
def make_fs(fake, tmp_path):
    """S3Backend factory on the fake, each with its own cache/spool and request counters."""
    def make(prefix="s", grace_ms=0, block=4 << 20, cache_bytes=64 << 20):
        return S3Backend("bucket", prefix, client=fake, grace_ms=grace_ms,
                         cache=BlockCache(cache_bytes, block),
                         spool=Spool(1 << 30, str(tmp_path / f"spool-{time.monotonic_ns()}")))
    os.environ["KCOMPACT_CACHE_DIR"] = str(tmp_path / "cache")
    yield make
    os.environ.pop("KCOMPACT_CACHE_DIR", None)


# -- the block cache --------------------------------------------------------------------------


def test_block_cache_lru_is_bounded_in_bytes():
    c = BlockCache(capacity_bytes=3000, block_size=1000)
    fetched = []

    def fetch(k, b):
        def run():
            fetched.append((k, b))
            return bytes([b]) * 1000
        return run
    for b in range(5):
        assert c.get("obj", b, fetch("obj", b)) == bytes([b]) * 1000
    assert c.used <= 3000 and len(c) == 3 and c.evictions == 2
    # 2, 3, 4 cached: no fetch; 0 was evicted: fetched again
    for b in (2, 3, 4):
        c.get("obj", b, fetch("obj", b))
    assert len(fetched) == 5
    c.get("obj", 0, fetch("obj", 0))
    assert len(fetched) == 6 and c.used <= 3000
    # touching 3 makes it most recent: the next insert evicts 4's elder, not 3
    c.get("obj", 3, fetch("obj", 3))
    c.get("obj", 9, fetch("obj", 9))
    n = len(fetched)
    c.get("obj", 3, fetch("obj", 3))
    assert len(fetched) == n
    # a block larger than the whole cache is returned but not kept
    big = BlockCache(capacity_bytes=10, block_size=1000)
    assert big.get("o", 0, lambda: b"x" * 1000) == b"x" * 1000 and len(big) == 0


def test_block_cache_merges_concurrent_requests_for_a_block():
    c = BlockCache(capacity_bytes=1 << 20, block_size=1000)
    calls = []
    gate = threading.Event()

    def fetch():
        calls.append(1)
        gate.wait(5)
        return b"y" * 1000
    out = []
    threads = [threading.Thread(target=lambda: out.append(c.get("obj", 7, fetch)))
               for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while c.merged < 7 and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join()
    assert calls == [1] and c.merged == 7 and out == [b"y" * 1000] * 8


def test_block_cache_failure_reaches_every_waiter_and_is_not_cached():
    c = BlockCache(capacity_bytes=1 << 20, block_size=10)
    gate = threading.Event()

    def boom():
        gate.wait(5)
        raise FileNotFoundError("gone")
    errors = []

    def get():
        try:
            c.get("obj", 0, boom)
        except FileNotFoundError as e:
            errors.append(e)
    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while c.merged < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join()
    assert len(errors) == 4 and len(c) == 0
    assert c.get("obj", 0, lambda: b"ok") == b"ok"


# -- the backend ------------------------------------------------------------------------------


def test_ranged_reads_go_through_the_cache_and_are_counted(make_fs):
    fs = make_fs(block=1000)
    data = bytes(range(256)) * 20  # 5120 bytes: 6 blocks
    name = fn.segment_object(0, "0123456789abcdef", fn.LOG_SUFFIX)
    fs.write_atomic(f"d/{name}", data)
    fs.stats.reset()
    assert fs.read(f"d/{name}", 990, 20) == data[990:1010]        # blocks 0 and 1
    assert fs.stats.requests["GetObject"] == 2
    assert fs.read(f"d/{name}", 0, 2000) == data[:2000]           # cached
    assert fs.stats.requests["GetObject"] == 2
    assert fs.read(f"d/{name}", 5000, 1000) == data[5000:]        # the short last block
    assert fs.read(f"d/{name}", 6000, 10) == b""                   # past the end
    assert fs.stats.bytes_down == 2000 + 120
    arr = np.zeros(300, np.uint8)
    assert fs.read_into(f"d/{name}", 1900, arr) == 300
    assert arr.tobytes() == data[1900:2200]
    # a mutable key (store.json) is never cached
    fs.write_atomic("store.json", b"v1")
    assert fs.read("store.json") == b"v1"
    fs.write_atomic("store.json", b"v2")
    assert fs.read("store.json") == b"v2"
    with pytest.raises(FileNotFoundError):
        fs.read(f"d/{fn.segment_object(1, '0123456789abcdef', fn.LOG_SUFFIX)}", 0, 10)


def test_map_spools_once_and_stream_reads_the_spooled_copy(make_fs):
    fs = make_fs()
    name = f"d/{fn.segment_object(5, 'aaaaaaaaaaaaaaaa', fn.INDEX_SUFFIX)}"
    fs.write_atomic(name, b"z" * 5000)
    fs.stats.reset()
    m = fs.map(name)
    assert m.tobytes() == b"z" * 5000 and fs.stats.requests["GetObject"] == 1
    assert fs.map(name, 100).tobytes() == b"z" * 100
    with fs.open_read(name, 4990) as f:
        assert f.read() == b"z" * 10
    assert fs.read(name, 10, 5) == b"zzzzz"
    assert fs.stats.total == 1
    # an unspooled object streams with one GET
    other = f"d/{fn.segment_object(6, 'aaaaaaaaaaaaaaaa', fn.LOG_SUFFIX)}"
    fs.write_atomic(other, bytes(range(200)))
    fs.stats.reset()
    with fs.open_read(other, 50) as f:
        buf = bytearray(100)
        assert f.readinto(buf) == 100 and bytes(buf) == bytes(range(50, 150))
        assert f.read() == bytes(range(150, 200))
    assert fs.stats.requests == {"GetObject": 1}


def test_create_exclusive_listing_and_deletes(make_fs):
    fs = make_fs()
    assert fs.create_exclusive("m/1.json", b"a") is True
    assert fs.create_exclusive("m/1.json", b"b") is False
    assert fs.read("m/1.json") == b"a"
    for k in ("a/x", "a/y", "a/sub/z", "b"):
        fs.write_atomic(k, b"1")
    assert fs.listdir("a") == ["sub", "x", "y"] and fs.listdir("") == ["a", "b", "m"]
    assert fs.isdir("a") and not fs.isdir("c") and fs.listdir("c") == []
    assert [n for n, _, _ in fs.list_objects("a")] == ["sub/z", "x", "y"]
    assert fs.size("a/x") == 1 and fs.exists("a/x") and not fs.exists("a/nope")
    fs.remove_tree("a")
    assert fs.listdir("a") == []
    fs.delete("nope")  # missing is fine
    with pytest.raises(BackendError):
        fs.open_append("x.log")


def test_listing_pages(fake, make_fs):
    fake.page_size = 3
    fs = make_fs()
    for i in range(10):
        fs.write_atomic(f"p/{i:02d}", b"")
    fs.stats.reset()
    assert fs.listdir("p") == [f"{i:02d}" for i in range(10)]
    assert fs.stats.requests["ListObjectsV2"] == 4


def test_errors_are_one_clear_line(fake, tmp_path):
    fs = S3Backend("nobucket", "x", client=fake)
    with pytest.raises(S3BucketNotFoundError, match="bucket 'nobucket' does not exist"):
        fs.read("store.json")
    from botocore.exceptions import ClientError

    class Denied(FakeS3):
        def get_object(self, **kw):
            raise ClientError({"Error": {"Code": "SignatureDoesNotMatch", "Message": "no"},
                               "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    fs = S3Backend("bucket", "x", client=Denied())
    with pytest.raises(S3AccessError, match="access denied") as e:
        fs.read("store.json")
    assert "\n" not in str(e.value)


def test_url_options():
    fs = S3Backend.from_url("s3://bkt/a/b/?endpoint=http://127.0.0.1:9&region=eu-west-1"
                            "&grace_ms=0")
    assert (fs.bucket, fs.prefix, fs.endpoint, fs.region, fs.grace_ms) == (
        "bkt", "a/b", "http://127.0.0.1:9", "eu-west-1", 0)
    assert fs.url == "s3://bkt/a/b" and fs._key("store.json") == "a/b/store.json"
    assert S3Backend.from_url("s3://bkt")._key("x") == "x"
    with pytest.raises(BackendError, match="unknown option 'endpont'"):
        S3Backend.from_url("s3://bkt/p?endpont=x")
    with pytest.raises(BackendError):
        S3Backend.from_url("s3:///p")


# -- manifests --------------------------------------------------------------------------------


def test_manifest_round_trip_and_bitmap_lookups():
    offs = np.array([100, 101, 105, 4000, 70000], np.int64)
    e = SegmentDesc.from_entries(100, "a.log", "a.bcq", 1234, offs)
    m = M.Manifest(version=3, created_ms=1, writer="w", cleaned_offset=50, next_offset=70001,
                   segments=[e], retired=[{"log": "x.log", "bcq": "x.bcq", "since_ms": 5}])
    back = M.Manifest.from_json(m.to_json(), "here")
    assert back == m
    se = back.segments[0]
    assert (se.records, se.first_offset, se.last_offset, se.bcq_size) == (5, 100, 70000, 240)
    assert se.holds(105) and not se.holds(104) and not se.holds(99)
    assert [se.rank_below(o) for o in (0, 100, 101, 102, 106, 70000, 70001, 1 << 40)] == \
        [0, 0, 1, 2, 3, 4, 5, 5]
    assert se.offset_array().tolist() == offs.tolist()
    with pytest.raises(Exception, match="unreadable partition manifest"):
        M.Manifest.from_json(b"{", "here")


def test_two_committers_race_for_one_version(make_fs):
    """Both start from version 1; the first gets version 2, the second's conditional create
    fails (412), it re-reads version 2 and rebases its change on top as version 3."""
    fs = make_fs()
    pdir = "partitions/t/0"
    seg = lambda b: SegmentDesc.from_entries(b, f"{b}.log", f"{b}.bcq", 10,  # noqa: E731
                                             np.array([b], np.int64))
    v1 = M.commit(fs, pdir, None, lambda cur: M.Manifest(segments=[seg(0)], next_offset=1),
                  writer="a", grace_ms=0)
    assert v1.version == 1
    a = M.commit(fs, pdir, v1, lambda cur: M.Manifest(segments=cur.segments + [seg(5)],
                                                      next_offset=6), writer="a", grace_ms=0)
    seen = []

    def change_b(cur):
        seen.append(cur.version)
        return M.Manifest(segments=cur.segments + [seg(9)], next_offset=10,
                          cleaned_offset=cur.cleaned_offset)
    b = M.commit(fs, pdir, v1, change_b, writer="b", grace_ms=0)
    assert (a.version, b.version, seen) == (2, 3, [1, 2])
    latest = M.read_latest(fs, pdir)
    assert latest.version == 3 and [s.base for s in latest.segments] == [0, 5, 9]
    assert M.list_versions(fs, pdir) == [1, 2, 3] and M.list_versions(fs, pdir, 2) == [3]

    def conflict(cur):
        raise M.ManifestConflictError("inputs gone")
    with pytest.raises(M.ManifestConflictError):
        M.commit(fs, pdir, v1, conflict, writer="c", grace_ms=0)


def test_concurrent_committers_threads(make_fs):
    """Eight threads append one segment each from the same stale base: every append lands
    exactly once, in eight consecutive versions."""
    fs = make_fs()
    pdir = "partitions/t/1"
    M.commit(fs, pdir, None, lambda cur: M.Manifest(), writer="x", grace_ms=0)
    base = M.read_latest(fs, pdir)

    def one(i):
        e = SegmentDesc.from_entries(i * 10, f"{i}.log", f"{i}.bcq", 1,
                                     np.array([i * 10], np.int64))
        M.commit(fs, pdir, base, lambda cur: M.Manifest(segments=cur.segments + [e]),
                 writer=str(i), grace_ms=0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latest = M.read_latest(fs, pdir)
    assert latest.version == 9 and sorted(s.base for s in latest.segments) == \
        [i * 10 for i in range(8)]


# -- stores on the fake S3 --------------------------------------------------------------------


def _rows(n, start=0, parts=3, keys=40, vlen=30):
    return [(i % parts, start + i, 1_000 + i, b"k%d" % (i % keys),
             None if i % 17 == 0 else b"v%d." % i * (vlen // 4)) for i in range(n)]


def _content(store, topic="t"):
    return {p: [(r.offset, r.key, r.value) for r in store.iter_records(topic, p)]
            for p in store.partitions(topic)}


def test_writer_flush_seals_and_readers_see_only_flushed(make_fs):
    fs = make_fs()
    st = Store.open("s3://bucket/s", fs=fs, writer="w", create=True,
                    options=PARTITION)
    st.set_topic_config("t", {"segment.bytes": 16384})
    st.append(RecordBatch.from_records("t", _rows(600)))
    assert Store.open("s3://bucket/s", fs=make_fs()).partitions("t") == []  # not flushed
    assert st.partitions("t") == [0, 1, 2]                                  # the writer sees them
    st.flush()
    ro = Store.open("s3://bucket/s", fs=make_fs())
    assert _content(ro) == _content(st)
    pl = ro.partition("t", 0)
    assert pl.manifest.version == 1 and all(s.kind == "remote" for s in pl.segments)
    assert pl.record_count() == 200 and pl.first_offset == 0 and pl.next_offset == 598
    # the local directory holds the commit log only
    local = st.local_fs
    assert all(not any(fn.parse_base(n) for n in local.listdir(f"partitions/t/{p}"))
               for p in range(3))
    st.append(RecordBatch.from_records("t", _rows(30, start=600)))
    st.close()
    ro.partition("t", 0).refresh()
    assert _content(Store.open("s3://bucket/s", fs=make_fs())) == _content(ro)
    assert ro.partition("t", 0).manifest.version == 2
    assert verify_store(ro).ok


def test_writer_killed_between_upload_and_commit_leaves_only_orphans(make_fs, fake,
                                                                     monkeypatch):
    fs = make_fs(grace_ms=0)
    st = Store.open("s3://bucket/s", fs=fs, writer="w", create=True,
                    options=PARTITION)
    st.append(RecordBatch.from_records("t", _rows(90)))
    st.flush()
    before = _content(Store.open("s3://bucket/s", fs=make_fs()))
    st.append(RecordBatch.from_records("t", _rows(90, start=90)))

    class Killed(BaseException):
        pass

    def die(*a, **k):
        raise Killed()
    from kcompact.reput.catalog_manifest import ManifestCatalog
    monkeypatch.setattr(M, "commit", die)  # dies after the uploads, before the commit ...
    monkeypatch.setattr(ManifestCatalog, "_delete_objects", lambda *a: None)  # ... and cleanup
    with pytest.raises(Killed):
        st.flush()
    monkeypatch.undo()
    # "killed": the process is gone without cleaning up (locks released with it)
    for pl in st._partitions.values():
        pl._writer_lock.release()
    st.commitlog.close()
    objs = [k for k in fake.objects["bucket"] if k.endswith(".log")]
    orphans = [k for k in objs if k.rsplit("/", 1)[1] not in {
        e.log for p in range(3) for e in M.read_latest(fs, f"partitions/t/{p}").segments}]
    assert orphans  # uploaded, never committed
    ro = Store.open("s3://bucket/s", fs=make_fs())
    assert _content(ro) == before  # readers see the old state
    # the next run: local segments uploaded again and committed; orphans deleted (grace 0)
    st2 = Store.open("s3://bucket/s", fs=make_fs(grace_ms=0), writer="w")
    st2.close()
    left = [k for k in fake.objects["bucket"] if k in orphans]
    assert left == []
    after = _content(Store.open("s3://bucket/s", fs=make_fs()))
    assert {p: len(v) for p, v in after.items()} == {0: 60, 1: 60, 2: 60}
    assert all(after[p][:30] == before[p] for p in range(3))
    listed = {e.log for p in range(3) for e in M.read_latest(fs, f"partitions/t/{p}").segments}
    assert {k.rsplit("/", 1)[1] for k in fake.objects["bucket"] if k.endswith(".log")} == listed


def test_killed_after_commit_before_local_cleanup(make_fs, monkeypatch):
    """The manifest lists the segment but the local copy is still there: the next open drops
    the local copy instead of uploading it twice."""
    fs = make_fs()
    st = Store.open("s3://bucket/s", fs=fs, writer="w", create=True,
                    options=PARTITION)
    st.append(RecordBatch.from_records("t", _rows(60)))
    from kcompact.reput.catalog_manifest import ManifestCatalog
    monkeypatch.setattr(ManifestCatalog, "_hand_over", lambda *a: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        st.flush()
    monkeypatch.undo()
    for pl in st._partitions.values():
        if pl._writer_lock:
            pl._writer_lock.release()
    st.commitlog.close()
    st2 = Store.open("s3://bucket/s", fs=make_fs(), writer="w")
    st2.close()
    got = _content(Store.open("s3://bucket/s", fs=make_fs()))
    assert {p: [o for o, _, _ in v] for p, v in got.items()} == {
        p: list(range(p, 60, 3)) for p in range(3)}


def _fill(st, n=3000, keys=50):
    st.set_topic_config("t", {"segment.bytes": 16384})
    for lo in range(0, n, 500):
        st.append(RecordBatch.from_records("t", _rows(500, start=lo, keys=keys)))
        st.flush()


def test_compaction_on_s3_equals_local(make_fs, tmp_path):
    s3 = Store.open("s3://bucket/c", fs=make_fs(), writer="w", create=True,
                    options=PARTITION)
    loc = Store.open(str(tmp_path / "local"), writer="w", create=True,
                    options=PARTITION)
    for st in (s3, loc):
        _fill(st)
        st.close()
    fs = make_fs()
    s3 = Store.open("s3://bucket/c", fs=fs)
    loc = Store.open(str(tmp_path / "local"))
    fs.stats.reset()
    r_s3 = {r.partition: r for r in compact_store(s3, force=True)}
    reqs = fs.stats.snapshot()
    r_loc = {r.partition: r for r in compact_store(loc, force=True)}
    assert {p: (r.records_kept, r.records_dropped, r.tombstones_dropped, r.cleaned_offset)
            for p, r in r_s3.items()} == \
        {p: (r.records_kept, r.records_dropped, r.tombstones_dropped, r.cleaned_offset)
         for p, r in r_loc.items()}
    fresh = Store.open("s3://bucket/c", fs=make_fs())
    assert _content(fresh) == _content(Store.open(str(tmp_path / "local")))
    assert verify_store(fresh).ok
    segs = sum(r.segments_before for r in r_s3.values())
    # two GETs per input segment, two PUTs per output, a few per partition
    assert reqs["requests"]["GetObject"] <= 2 * segs + 2 * 3 + 1
    assert reqs["total"] <= 4 * segs + 6 * 3 + 3, reqs
    from kcompact.compaction import partition_status
    st = partition_status(fresh, "t", 0)
    assert st["compaction_horizon"] == r_s3[0].cleaned_offset
    assert st["last_compaction"]["records_kept"] == r_s3[0].records_kept


def test_compactor_loses_the_race_to_another_compaction(make_fs, fake, tmp_path):
    st = Store.open("s3://bucket/r", fs=make_fs(), writer="w", create=True,
                    options=PARTITION)
    _fill(st)
    st.close()
    # two machines: each its own local directory
    hour = 3_600_000  # b's replaced segments stay readable for a (the grace period)
    a = Store.open("s3://bucket/r", fs=make_fs(grace_ms=hour), commitlog_dir=str(tmp_path / "a"))
    b = Store.open("s3://bucket/r", fs=make_fs(grace_ms=hour), commitlog_dir=str(tmp_path / "b"))
    ca = Compactor(a, CompactionOptions(offset_map_memory=1 << 20))
    cb = Compactor(b, CompactionOptions(offset_map_memory=1 << 20))
    pa = a.writable_partition("t", 0)  # a reads version N
    assert pa.manifest is not None
    rb = cb.compact_partition("t", 0, force=True)  # b commits N+1
    assert rb.skipped is None
    pa._manifest_read_at = time.monotonic() + 3600  # a does not refresh: it commits on N
    ra = ca.compact_partition("t", 0, force=True)
    assert ra.skipped and "another compaction" in ra.skipped
    fresh = Store.open("s3://bucket/r", fs=make_fs())
    keys = [r.key for r in fresh.iter_records("t", 0)]
    assert len(keys) == len(set(keys))
    assert verify_store(fresh).ok
    # a's abandoned outputs were deleted: only listed objects remain (grace 0)
    listed = {n for e in M.read_latest(a.fs, "partitions/t/0").segments for n in (e.log, e.bcq)}
    listed |= {n for r in M.read_latest(a.fs, "partitions/t/0").retired
               for n in (r["log"], r["bcq"])}
    objs = {k.rsplit("/", 1)[1] for k in fake.objects["bucket"]
            if k.startswith("r/partitions/t/0/") and "/manifest/" not in k}
    assert objs <= listed


def test_writer_rebases_on_a_compaction_in_another_process(make_fs, tmp_path):
    """A compactor commits while a writer has unsealed records: the writer's seal loses the
    conditional create, re-reads, and appends its segments on top of the compacted list."""
    w = Store.open("s3://bucket/w", fs=make_fs(), writer="w", create=True,
                    options=PARTITION)
    _fill(w)
    w.append(RecordBatch.from_records("t", _rows(90, start=3000)))
    other = Store.open("s3://bucket/w", fs=make_fs(), commitlog_dir=str(tmp_path / "other"))
    compact_store(other, force=True)
    w.close()
    fresh = Store.open("s3://bucket/w", fs=make_fs())
    offs = [o for o, _, _ in _content(fresh)[0]]
    assert offs[-30:] == list(range(3000, 3090, 3))
    assert len(offs) == len(set(offs)) and offs == sorted(offs)
    assert verify_store(fresh).ok


def test_grace_period_keeps_replaced_objects(make_fs, fake):
    st = Store.open("s3://bucket/g", fs=make_fs(grace_ms=3_600_000), writer="w", create=True,
                    options=PARTITION)
    _fill(st)
    st.close()
    fs = make_fs(grace_ms=3_600_000)
    ro = Store.open("s3://bucket/g", fs=fs)
    old = ro.partition("t", 0)
    old_names = [s.log_path for s in old.segments]
    n_before = len(list(old.iter_records()))
    compact_store(Store.open("s3://bucket/g", fs=make_fs(grace_ms=3_600_000)), force=True)
    # a reader still holding the old manifest reads the replaced objects
    assert all(f"{fs.prefix}/{n}" in fake.objects["bucket"] for n in old_names)
    for seg in old.segments:
        seg.invalidate()
    old.fs.spool.clear()  # nothing local: read the objects again
    old.fs.cache.clear()
    assert len(list(old.iter_records())) == n_before
    m = M.read_latest(fs, "partitions/t/0")
    assert {r["log"] for r in m.retired} == {n.rsplit("/", 1)[1] for n in old_names}
    # past the grace period they go
    gone = M.collect_garbage(fs, "partitions/t/0", grace_ms=3_600_000,
                             now_ms=int(time.time() * 1000) + 3_700_000)
    assert all(f"partitions/t/0/{n.rsplit('/', 1)[1]}" in gone for n in old_names)
    assert len([v for v in M.list_versions(fs, "partitions/t/0")]) == M.KEEP_VERSIONS


def test_verify_names_a_corrupt_object_and_a_manifest_mismatch(make_fs, fake):
    st = Store.open("s3://bucket/v", fs=make_fs(), writer="w", create=True,
                    options=PARTITION)
    st.append(RecordBatch.from_records("t", _rows(300)))
    st.close()
    fs = make_fs()
    pl = Store.open("s3://bucket/v", fs=fs).partition("t", 0)
    seg = pl.segments[0]
    key = f"{fs.prefix}/{seg.log_path}"
    data, mtime = fake.objects["bucket"][key]
    bad = bytearray(data)
    bad[100] ^= 0xFF
    fake.objects["bucket"][key] = (bytes(bad), mtime)
    rep = verify_store(Store.open("s3://bucket/v", fs=make_fs()))
    assert not rep.ok and any(p.path == seg.log_path for p in rep.problems)
    from kcompact.reput.errors import CorruptRecordError
    with pytest.raises(CorruptRecordError, match=seg.log_path):
        list(Store.open("s3://bucket/v", fs=make_fs()).iter_records("t", 0))
    # an object shorter than the manifest says
    fake.objects["bucket"][key] = (data[:-10], mtime)
    rep = verify_store(Store.open("s3://bucket/v", fs=make_fs()))
    assert any("the manifest says" in p.message for p in rep.problems)
    # a listed object that is gone
    del fake.objects["bucket"][key]
    rep = verify_store(Store.open("s3://bucket/v", fs=make_fs()))
    assert any("missing" in p.message for p in rep.problems)
