"""Following an S3 store with shared uploads (issue 49; reput/s3_follow.py,
docs/formats/shared-upload.md "Following a store"), on the in-memory S3.

* a new S3 store written with the default ``upload`` ``auto`` uses shared uploads; an existing
  store keeps what it uses;
* a follower's steady-state refresh of every partition costs O(writers) requests and no LIST,
  whatever the partition count (and the old LIST-polling path, kept for comparison, costs at
  least one LIST a partition);
* the records a follower reads as a writer flushes, with splits (and the garbage collector
  deleting what was split under it) in between, are those of a local store of the same
  records (hypothesis over partition counts, flush sizes, splits);
* a follower that misses notifications converges: a dropped GET, a writer restart, a new
  writer (from the writers registry), a registry that lost a writer (the periodic listing).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import _err  # noqa: E402
from _stores import backend_env, store_url  # noqa: E402

from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import s3_follow as S3F  # noqa: E402
from kcompact.reput import shared as SH  # noqa: E402
from kcompact.reput import store_catalog as SC  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402

PARTITION = WriterOptions(upload="partition")


@pytest.fixture
def s3(tmp_path):
    with backend_env("s3", str(tmp_path)) as fake:
        yield fake, str(tmp_path)


def _batch(topic, rows):
    return RecordBatch.from_records(topic, [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows])


def _rows(parts, start, n=1):
    """n records for every partition from offset ``start``."""
    return [(p, start + i, b"k%d" % ((start + i) % 7), b"v%d-%d" % (p, start + i))
            for p in range(parts) for i in range(n)]


def _records(st, topic, partition):
    return [(r.offset, r.key, r.value) for r in st.iter_records(topic, partition)]


class Follow:
    """A read-only store following ``url``: every partition opened, its follower's own polls
    only when the test asks (``round``: one poll, then a refresh of every partition)."""

    def __init__(self, url, parts, topic="t"):
        self.st = Store.open(url)
        S3F.follow(self.st.fs)  # (as the Kafka endpoint, kcompact serve, kv build --follow)
        self.topic, self.parts = topic, parts
        self.pls = [self.st.partition(topic, p) for p in range(parts)]
        self.follower = S3F.follower_for(self.st.fs)
        assert self.follower is not None, "the store should use shared uploads"
        self.follower.interval_s = 3600.0  # the partitions' refreshes never poll by themselves

    def round(self):
        self.follower.poll(0.0)
        for pl in self.pls:
            pl.refresh()

    def next_offsets(self):
        return [pl.next_offset for pl in self.pls]

    def close(self):
        self.st.close()


# -- the default -------------------------------------------------------------------------------


def test_a_new_s3_store_uses_shared_uploads_and_an_existing_one_keeps_its_own(s3):
    fake, root = s3
    new = store_url("s3", root, "new")
    with Store.open(new, writer="w", create=True, commitlog_dir=f"{root}/cl1") as st:
        assert st.shared_uploads and st.publisher.kind == "s3-shared"  # (reput/publisher.py)
        st.append(_batch("t", _rows(3, 0)))
        st.flush()
    with Store.open(new) as st:
        # (format 4: with a store catalog, docs/formats/store-catalog.md)
        assert st.meta.format_version == SC.STORE_FORMAT and SH.FEATURE in st.meta.features
        assert SC.FEATURE in st.meta.features
        assert [len(_records(st, "t", p)) for p in range(3)] == [1, 1, 1]
    assert any("/shared/w/journal/" in k for k in fake.objects["bucket"])
    assert SH.read_writers(Store.open(new).fs) == {"w"}

    old = store_url("s3", root, "old")  # a store made by per-partition uploads keeps them
    _write(old, f"{root}/cl2", [_rows(2, 0)], PARTITION)
    with Store.open(old, writer="w2", create=True, commitlog_dir=f"{root}/cl3") as st:
        assert not st.shared_uploads and st.publisher.kind == "s3"
        st.append(_batch("t", _rows(2, 1)))
        st.flush()
    with Store.open(old) as st:
        assert SH.FEATURE not in st.meta.features
        assert [len(_records(st, "t", p)) for p in range(2)] == [2, 2]
    assert not any(k.startswith(old.split("/", 3)[3] + "/shared/")
                   for k in fake.objects["bucket"])


def _write(url, cl, flushes, options=WriterOptions(), writer="w"):
    with Store.open(url, writer=writer, create=True, options=options, commitlog_dir=cl) as st:
        for rows in flushes:
            if rows:
                st.append(_batch("t", rows))
            st.flush()


# -- requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("catalog", [False, True])
@pytest.mark.parametrize("parts", [4, 48])
@pytest.mark.parametrize("writers", [1, 2])
def test_steady_state_refresh_is_o_writers_gets_and_no_list(s3, parts, writers, catalog,
                                                            monkeypatch):
    fake, root = s3
    url = store_url("s3", root)
    # (catalog: a store catalog, docs/formats/store-catalog.md; its next version is polled
    # once a minute here, so that every round's requests are the journal's)
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "60000")
    Store.create(url, shared_uploads=True, catalog=catalog).close()
    # each writer owns a share of the partitions
    owned = {f"w{i}": [p for p in range(parts) if p % writers == i] for i in range(writers)}
    stores = {w: Store.open(url, writer=w, create=True, commitlog_dir=f"{root}/cl-{w}")
              for w in owned}
    try:
        def flush_all(offset):
            for w, st in stores.items():
                st.append(_batch("t", [r for r in _rows(parts, offset) if r[0] in owned[w]]))
                st.flush()

        flush_all(0)
        f = Follow(url, parts)
        f.round()
        assert f.next_offsets() == [1] * parts
        for rnd in range(1, 4):
            flush_all(rnd)
            before = dict(fake.calls)
            f.round()
            made = {k: fake.calls[k] - before.get(k, 0) for k in fake.calls
                    if fake.calls[k] != before.get(k, 0)}
            assert made.get("ListObjectsV2", 0) == 0, made
            # one GET that finds each writer's new entry, at most one more that 404s
            assert made.get("GetObject", 0) <= 2 * writers, made
            assert sum(made.values()) <= 2 * writers, made
            assert f.next_offsets() == [rnd + 1] * parts
            # nothing new: the poll is one GET per writer, each a 404
            before = dict(fake.calls)
            f.round()
            made = {k: fake.calls[k] - before.get(k, 0) for k in fake.calls
                    if fake.calls[k] != before.get(k, 0)}
            assert made == {"GetObject": writers}, made
        assert [_records(f.st, "t", p)[-1][0] for p in range(parts)] == [3] * parts
        f.close()

        # the old path, for comparison: every refresh of every partition lists
        os.environ["KCOMPACT_S3_FOLLOW"] = "list"
        try:
            old = Store.open(url)
            pls = [old.partition("t", p) for p in range(parts)]
            flush_all(4)
            SH.journal_for(old.fs)._listed_at = None  # (it reuses a listing for 0.2 s)
            before = fake.calls["ListObjectsV2"]
            for pl in pls:
                pl.refresh()
            # (a store catalog is not read either: the path before issue 49)
            assert fake.calls["ListObjectsV2"] - before >= parts
            assert [pl.next_offset for pl in pls] == [5] * parts
            old.close()
        finally:
            del os.environ["KCOMPACT_S3_FOLLOW"]
    finally:
        for st in stores.values():
            st.close()


# -- the same records ----------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.integers(1, 6), sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8),
       splits=st.lists(st.booleans(), min_size=8, max_size=8), collect=st.booleans(),
       seed=st.integers(0, 1 << 16), catalog=st.booleans(), fold=st.integers(1, 5),
       background=st.booleans())
def test_a_follower_reads_what_a_local_store_holds(tmp_path_factory, parts, sizes, splits,
                                                   collect, seed, catalog, fold, background):
    """... and so does a reader opening the store afterwards, with a store catalog
    (docs/formats/store-catalog.md: folded every ``fold`` flushes, by the flush or by a
    thread of the writer while the splits commit theirs) or without one."""
    import random
    rnd = random.Random(seed)
    root = str(tmp_path_factory.mktemp("follow"))
    nxt = {p: 0 for p in range(parts)}
    flushes = []
    for n in sizes:
        rows = []
        for _ in range(n):
            p = rnd.randrange(parts)
            rows.append((p, nxt[p], b"k%d" % rnd.randrange(5), b"v%d" % rnd.randrange(99)))
            nxt[p] += 1 + rnd.randrange(2)
        flushes.append(rows)
    local = os.path.join(root, "local")
    _write(local, None, flushes)
    # the writer's first commit may come after the follower started: it finds the writer in
    # the registry (read at every round here, every 5 s by default)
    writers_s, S3F.WRITERS_S = S3F.WRITERS_S, 0.0
    os.environ["KCOMPACT_S3_CATALOG_FOLD"] = str(fold)
    with backend_env("s3", root):
        url = store_url("s3", root) + ("?grace_ms=0" if collect else "")
        Store.create(url, shared_uploads=True, catalog=catalog).close()
        writer = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl",
                            options=WriterOptions(fold="background" if background else "flush"))
        f = None
        try:
            for i, rows in enumerate(flushes):
                if rows:
                    writer.append(_batch("t", rows))
                writer.flush()
                if f is None:
                    f = Follow(url, parts)
                f.round()
                if splits[i]:  # split every partition; with grace 0 the collector deletes
                    _split(url, root, parts, collect)  # the objects under the follower
            f.round()
            fresh = Store.open(url)  # (not following: the catalog and one listing)
            with Store.open(local) as lst:
                assert fresh.partitions("t") == lst.partitions("t")
                for p in range(parts):
                    assert _records(f.st, "t", p) == _records(lst, "t", p), p
                    assert f.pls[p].next_offset == lst.partition("t", p).next_offset
                    assert _records(fresh, "t", p) == _records(lst, "t", p), p
            fresh.close()
        finally:
            S3F.WRITERS_S = writers_s
            del os.environ["KCOMPACT_S3_CATALOG_FOLD"]
            writer.close()
            if f is not None:
                f.close()


def _split(url, root, parts, collect):
    with Store.open(url, writer="splitter", commitlog_dir=f"{root}/cl-split") as st:
        for p in range(parts):
            if p not in st.partitions("t"):
                continue
            pl = st.writable_partition("t", p)
            if pl._catalog.stage_split():
                assert pl.commit_staged("splitter")
        if collect:
            st.collect_shared_garbage()
            for p in st.partitions("t"):
                st.partition("t", p).collect_garbage()


# -- missed notifications ------------------------------------------------------------------------


def test_a_dropped_get_is_asked_again(s3):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(3, 0)])
    f = Follow(url, 3)
    f.round()
    _write(url, f"{root}/cl", [_rows(3, 1)])  # a writer restart, too: it goes on at seq 1
    real, failed = fake.get_object, []

    def flaky(Bucket, Key, Range=None):
        if "/journal/" in Key and not failed:
            failed.append(Key)
            raise _err("InternalError", 500, "GetObject")
        return real(Bucket=Bucket, Key=Key, Range=Range)

    fake.get_object = flaky
    try:
        f.round()
        assert failed and f.next_offsets() == [1, 1, 1]  # the GET was lost
        f.round()
        assert f.next_offsets() == [2, 2, 2]
    finally:
        fake.get_object = real
    f.close()


def test_a_new_writer_is_found_in_the_registry(s3, monkeypatch):
    fake, root = s3
    monkeypatch.setattr(S3F, "WRITERS_S", 0.0)
    url = store_url("s3", root)
    _write(url, f"{root}/cl-a", [[r for r in _rows(4, 0) if r[0] < 2]], writer="a")
    f = Follow(url, 4)
    f.round()
    assert f.next_offsets() == [1, 1, 0, 0]
    _write(url, f"{root}/cl-b", [[r for r in _rows(4, 0) if r[0] >= 2]], writer="b")
    before = fake.calls["ListObjectsV2"]
    f.round()
    assert f.next_offsets() == [1, 1, 1, 1]
    assert fake.calls["ListObjectsV2"] - before == 1  # writer b's journal, once
    assert SH.read_writers(f.st.fs) == {"a", "b"}
    _write(url, f"{root}/cl-b", [[r for r in _rows(4, 1) if r[0] >= 2]], writer="b")
    before = fake.calls["ListObjectsV2"]
    f.round()
    assert f.next_offsets() == [1, 1, 2, 2] and fake.calls["ListObjectsV2"] == before
    f.close()


def test_a_writer_the_registry_lost_is_found_by_the_periodic_listing(s3, monkeypatch):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl-a", [_rows(2, 0)], writer="a")
    f = Follow(url, 2)
    f.round()
    # writer b registers, then a racing registration of another writer overwrites it
    _write(url, f"{root}/cl-b", [_rows(2, 1)], writer="b")
    f.st.fs.write_atomic(SH.WRITERS_PATH, SH._writers_json({"a": 1}))
    monkeypatch.setattr(S3F, "WRITERS_S", 0.0)
    f.round()
    assert f.next_offsets() == [1, 1]  # b unknown yet
    monkeypatch.setattr(S3F, "RELIST_S", 0.0)
    f.round()
    assert f.next_offsets() == [2, 2]
    f.close()


def test_a_store_without_a_registry_is_listed_at_the_legacy_interval(s3, monkeypatch):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl-a", [_rows(2, 0)], writer="a")
    f = Follow(url, 2)
    f.st.fs.delete(SH.WRITERS_PATH)  # as a store written before the registry
    monkeypatch.setattr(S3F, "WRITERS_S", 0.0)
    f.round()
    _write(url, f"{root}/cl-b", [_rows(2, 1)], writer="b")
    f.st.fs.delete(SH.WRITERS_PATH)
    f.round()
    assert f.follower.registry is False and f.next_offsets() == [1, 1]
    monkeypatch.setattr(S3F, "LEGACY_RELIST_S", 0.0)
    f.round()
    assert f.next_offsets() == [2, 2]
    f.close()


def test_a_damaged_registry_is_one_line(s3):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(1, 0)])
    st = Store.open(url)
    st.fs.write_atomic(SH.WRITERS_PATH, b'{"format": 1, "writers": {"a": 1}, "crc32c": "0"}')
    from kcompact.reput.errors import CorruptRecordError
    with pytest.raises(CorruptRecordError, match="unreadable writers registry"):
        SH.read_writers(st.fs)
    st.close()


def test_the_kafka_endpoints_long_poll_costs_o_writers_requests(s3):
    """The endpoint's wake-up path (apis/fetch.py ``grew``: every partition's bounds, again and
    again; ``read_partitions``: the topic's partitions) on 32 partitions: no LIST, and one GET
    per writer per follower poll, however many times the partitions are looked at."""
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    fake, root = s3
    url = store_url("s3", root)
    parts = 32
    with Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl") as writer:
        writer.append(_batch("t", _rows(parts, 0)))
        writer.flush()
        view = StoreView(url)
        try:
            assert view.partitions("t") == list(range(parts))
            for p in range(parts):
                view.bounds("t", p)
            follower = S3F.follower_for(view.store.fs)
            follower.interval_s = 3600.0  # polls only when the test says
            writer.append(_batch("t", _rows(parts, 1)))
            writer.flush()
            follower.poll(0.0)
            before = dict(fake.calls)
            for _ in range(5):  # five wake-ups of a long poll, nothing new
                assert view.partitions("t", 0) == list(range(parts))
                assert [view.bounds("t", p).high_watermark for p in range(parts)] == [2] * parts
            assert {k: v - before.get(k, 0) for k, v in fake.calls.items()
                    if v != before.get(k, 0)} == {}
            writer.append(_batch("t", _rows(parts, 2)))
            writer.flush()
            before = dict(fake.calls)
            follower.poll(0.0)
            for _ in range(5):
                assert [view.bounds("t", p).high_watermark for p in range(parts)] == [3] * parts
            made = {k: v - before.get(k, 0) for k, v in fake.calls.items()
                    if v != before.get(k, 0)}
            assert made == {"GetObject": 1}, made  # the new entry (caught up: no second GET)
            got = view.fetch("t", 5, 2, 1 << 20)
            assert got.nbytes > 0
        finally:
            view.close()


def test_a_store_created_before_its_writers_says_how_they_upload(s3):
    """The store sink creates the store before its tasks open it (no writer yet): it says
    whether the new store uses shared uploads (store.upload: auto or shared) or not."""
    fake, root = s3
    shared, per_partition = store_url("s3", root, "a"), store_url("s3", root, "b")
    Store.open(shared, create=True, shared_uploads=True).close()
    Store.open(per_partition, create=True, shared_uploads=False).close()
    with Store.open(shared, writer="w", create=True, commitlog_dir=f"{root}/cl1") as st:
        assert st.shared_uploads and st.meta.format_version == SC.STORE_FORMAT
    with Store.open(per_partition, writer="w", create=True, commitlog_dir=f"{root}/cl2") as st:
        assert not st.shared_uploads and SH.FEATURE not in st.meta.features
    # without a writer and without saying: as before, format 2 (a replica's new store)
    plain = store_url("s3", root, "c")
    Store.open(plain, create=True).close()
    with Store.open(plain) as st:
        assert SH.FEATURE not in st.meta.features


@pytest.mark.parametrize("catalog", [False, True])
def test_a_followers_partition_listing_costs_no_list_per_round(s3, catalog, monkeypatch):
    """``kv build --follow`` asks for the topic's partitions at every poll round: a process
    that follows the store answers from the store catalog, or (a store without one) from a
    listing kept for PARTITIONS_RELIST_S plus the partitions the journal names, so a round
    lists nothing; a partition a writer starts is found at the next round."""
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "60000")
    url = store_url("s3", root)
    Store.create(url, shared_uploads=True, catalog=catalog).close()
    w = Store.open(url, writer="w", commitlog_dir=f"{root}/cl")
    try:
        w.append(_batch("t", _rows(2, 0)))
        w.flush()
        rd = Store.open(url)
        S3F.follow(rd.fs)
        assert rd.partitions("t") == [0, 1]
        w.append(_batch("t", [(2, 0, b"k", b"v")]))  # a new partition
        w.flush()
        before = fake.calls["ListObjectsV2"]
        for _ in range(5):
            S3F.follower_for(rd.fs).poll(0.0)
            got = rd.partitions("t")
        assert fake.calls["ListObjectsV2"] == before
        assert got == [0, 1, 2]
        assert _records(rd, "t", 2) == [(0, b"k", b"v")]
        rd.close()
    finally:
        w.close()


def test_a_waiting_fetch_looks_at_its_partitions_only_when_the_store_moved(s3, monkeypatch):
    """apis/fetch.py's long poll on a followed store: while the store's signal
    (``StoreView.changes``, the follower's generation) does not move, a waiting fetch looks
    at none of its partitions again (no O(partitions) work a tick); a flush moves it, and the
    fetch then returns the new records of every partition before its wait ends."""
    import asyncio
    from types import SimpleNamespace as NS

    from kcompact.replication.kafka_endpoint.apis import fetch as F
    from kcompact.replication.kafka_endpoint.store_view import StoreView
    fake, root = s3
    url = store_url("s3", root)
    parts = 8
    monkeypatch.setattr(F, "LOOK_ANYWAY_S", 3600.0)  # only the signal wakes a fetch here
    monkeypatch.setattr(F, "encode_fetch", lambda version, correlation_id, seen: seen)
    with Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl") as writer:
        writer.append(_batch("t", _rows(parts, 0)))
        writer.flush()
        view = StoreView(url)
        try:
            assert [view.bounds("t", p).high_watermark for p in range(parts)] == [1] * parts
            follower = S3F.follower_for(view.store.fs)
            follower.interval_s = 3600.0  # polls only when the test says
            looked = []
            bounds = view.bounds
            monkeypatch.setattr(view, "bounds", lambda t, p: looked.append(p) or bounds(t, p))

            async def run(fn, *args):
                return fn(*args)

            def request(wait_ms):
                return NS(topics=[NS(topic="t", partitions=[
                    NS(partition=p, fetch_offset=1, partition_max_bytes=1 << 20)
                    for p in range(parts)])], max_wait=wait_ms, min_bytes=1, max_bytes=1 << 24)

            seen = asyncio.run(F.handle_fetch(view, run, 12, 1, request(400), lambda: False))
            assert [r.nbytes for _, rs in seen for r in rs] == [0] * parts
            assert sorted(looked) == list(range(parts))  # the first read only

            async def flush_then_fetch():
                waiting = asyncio.ensure_future(
                    F.handle_fetch(view, run, 12, 2, request(20_000), lambda: False))
                await asyncio.sleep(0.2)
                await asyncio.to_thread(lambda: (writer.append(_batch("t", _rows(parts, 1))),
                                                 writer.flush()))
                follower.interval_s = 0.0  # the next tick's poll finds the new entry
                return await waiting
            seen = asyncio.run(flush_then_fetch())
            assert all(r.nbytes > 0 for _, rs in seen for r in rs), seen
            assert [r.bounds.high_watermark for _, rs in seen for r in rs] == [2] * parts
        finally:
            view.close()


def test_on_entry_tells_when_a_follower_first_holds_each_entry(s3, monkeypatch):
    """``shared.on_entry`` (what bench/s3_live.py times a reader's stages with): called once
    per journal for each entry, when it first holds it (the writer's own commit; a follower's
    poll), with that journal's backend; ``off_entry`` stops it."""
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "2")  # (entries from the catalog too)
    fake, root = s3
    url = store_url("s3", root)
    seen = []
    hook = SH.on_entry(lambda fs, e: seen.append((fs, e.writer, e.seq)))
    try:
        writer = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl")
        writer.append(_batch("t", _rows(2, 0)))
        writer.flush()
        f = Follow(url, 2)
        for i in range(1, 4):
            writer.append(_batch("t", _rows(2, i)))
            writer.flush()
            f.round()
        assert f.next_offsets() == [4, 4]
        assert [s for fs, *s in seen if fs is writer.fs] == [["w", i] for i in range(4)]
        assert sorted(s for fs, *s in seen if fs is f.st.fs) == [["w", i] for i in range(4)]
    finally:
        SH.off_entry(hook)
    n = len(seen)
    writer.append(_batch("t", _rows(2, 4)))
    writer.flush()
    f.round()
    assert len(seen) == n and f.next_offsets() == [5, 5]
    writer.close()
    f.close()
