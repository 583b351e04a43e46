"""The store catalog (issue 49; docs/formats/store-catalog.md), on the in-memory S3.

* opening a store with a catalog costs the same requests at 4 and at 64 partitions (without
  one: a LIST and a GET more per partition);
* every manifest commit is recorded, a batch of them as one version; a writer folds its journal
  entries, so a reader opening the store GETs none of them;
* a committer killed between its manifest commit and the catalog's loses nothing: readers see
  the partition as it was, the collector brings the catalog up to date before it deletes;
* a damaged newest version is passed over; old versions are collected after the grace period;
* a kcompact that knows only formats up to 4 refuses the store with one line;
* no request per partition: a new store's first writer (no partition in the catalog yet: one
  listing of the topic's directory), a catch-up read of every partition through the Kafka
  endpoint's view (folded or not, as written and after the split: the same requests at 4 and
  64 partitions, reading what was written); a partition the catalog never listed but with a
  manifest of its own is read from it.

The same records from every read path (hypothesis): tests/unit/test_s3_follow.py
``test_a_follower_reads_what_a_local_store_holds`` (with and without a catalog).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend_env, store_url  # noqa: E402

from kcompact.compaction.planner import compact_store  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import s3_follow as S3F  # noqa: E402
from kcompact.reput import store_meta as store_mod  # noqa: E402
from kcompact.reput import store_catalog as SC  # noqa: E402
from kcompact.reput.errors import StoreFormatError  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402


@pytest.fixture
def s3(tmp_path):
    with backend_env("s3", str(tmp_path)) as fake:
        yield fake, str(tmp_path)


def _batch(rows, topic="t"):
    return RecordBatch.from_records(topic, [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows])


def _rows(parts, start, n=1):
    return [(p, start + i, b"k%d" % ((start + i) % 5), b"v%d-%d" % (p, start + i))
            for p in range(parts) for i in range(n)]


def _records(st, partition, topic="t"):
    return [(r.offset, r.key, r.value) for r in st.iter_records(topic, partition)]


def _write(url, cl, flushes, writer="w", options=WriterOptions()):
    with Store.open(url, writer=writer, create=True, commitlog_dir=cl, options=options) as st:
        for rows in flushes:
            st.append(_batch(rows))
            st.flush()


def _delta(fake, before):
    return {k: fake.calls[k] - before.get(k, 0) for k in fake.calls
            if fake.calls[k] != before.get(k, 0)}


def _hold_listings(monkeypatch):
    """Listings and polls do not age during a test that counts requests: the catalog is
    listed, and its next version and the journal's next key looked for, once (a slower read
    would look again): the requests counted are the code's, not the clock's."""
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "600000")
    monkeypatch.setenv("KCOMPACT_S3_FOLLOW_MS", "60000")


def _open_all(url, parts):
    """What a reader does to serve the store: open it, list topics and partitions, and learn
    every partition's next offset."""
    st = Store.open(url)
    assert st.topics() == ["t"]
    ps = st.partitions("t")
    assert ps == list(range(parts))
    offsets = [st.partition("t", p).next_offset for p in ps]
    return st, offsets


@pytest.mark.parametrize("catalog", [True, False])
def test_opening_costs_the_same_requests_at_4_and_64_partitions(s3, catalog, monkeypatch):
    fake, root = s3
    # (on a busy machine opening 64 partitions took longer than the 200 ms a listing is
    # reused, and listed again)
    _hold_listings(monkeypatch)
    made = {}
    for parts in (4, 64):
        url = store_url("s3", root, f"s{parts}")
        Store.create(url, shared_uploads=True, catalog=catalog).close()
        _write(url, f"{root}/cl{parts}", [_rows(parts, i) for i in range(6)])
        before = dict(fake.calls)
        st, offsets = _open_all(url, parts)
        made[parts] = _delta(fake, before)
        assert offsets == [6] * parts
        assert [_records(st, p)[-1][0] for p in range(parts)] == [5] * parts
        st.close()
    total = {p: sum(m.values()) for p, m in made.items()}
    if catalog:
        # store.json, LIST catalog/, GET it, LIST shared/ (no journal entry: all folded)
        assert made[4] == made[64], made
        assert total[64] <= 4 + 1, made
    else:
        assert total[64] - total[4] >= 2 * (64 - 4), made


def test_a_writer_folds_its_entries_every_few_flushes(s3, monkeypatch):
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "3")
    url = store_url("s3", root)
    st = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl")
    cat = SC.for_store(st.fs)
    for i in range(7):
        st.append(_batch(_rows(2, i)))
        st.flush()
    # entries 0..5 folded (two folds), 6 not yet
    cur = cat.refresh(0.0)
    assert cur.folded == {"w": 5}
    assert [e["seq"] for e in cur.entries["w"]] == list(range(6))
    assert cur.partitions == {"t": {0: None, 1: None}}  # no manifest written: no split yet
    st.close()  # folds what is left
    assert cat.refresh(0.0).folded == {"w": 6}
    # a reader: no GET of a journal entry
    before = dict(fake.calls)
    rd, offsets = _open_all(url, 2)
    assert offsets == [7, 7]
    got = _delta(fake, before)
    assert got.get("GetObject", 0) == 2, got  # store.json and the catalog
    assert [len(_records(rd, p)) for p in range(2)] == [7, 7]
    rd.close()


def test_a_compaction_records_its_manifests_as_one_catalog_version(s3):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(6, i) for i in range(3)])
    with Store.open(url) as st:
        cat = SC.for_store(st.fs)
        v0 = cat.refresh(0.0).version
        with cat.batch():
            compact_store(st, force=True)
        cur = cat.refresh(0.0)
        assert cur.version == v0 + 1
        assert all(cur.manifest("t", p) is not None and cur.manifest("t", p).split_to == {"w": 2}
                   for p in range(6))
        assert cur.entries == {"w": []}  # every partition split them: none still needed
    rd, offsets = _open_all(url, 6)
    assert offsets == [3] * 6 and [len(_records(rd, p)) for p in range(6)] == [3] * 6
    rd.close()


def test_a_committer_killed_before_the_catalog_commit_loses_nothing(s3, monkeypatch):
    """The manifest commit is the commit point; the catalog only lags (store-catalog.md,
    "Lagging"): readers see the partitions as they were, the collector catches it up before
    it deletes anything the catalog lists."""
    fake, root = s3
    url = store_url("s3", root) + "?grace_ms=0"
    _write(url, f"{root}/cl", [_rows(3, i) for i in range(4)])
    with Store.open(url) as ref:
        want = [_records(ref, p) for p in range(3)]

    # each manifest commit done, none of the catalog's (the state a committer SIGKILLed
    # between the two leaves, for every partition at once)
    with Store.open(url) as st:
        monkeypatch.setattr(SC, "after_manifest_commit", lambda *a, **k: None)
        # (killed before the collector's pass at the end of the run)
        monkeypatch.setattr(Store, "collect_shared_garbage", lambda self: [])
        monkeypatch.setattr(Store, "collect_compaction_garbage", lambda self: [])
        compact_store(st, force=True)
        monkeypatch.undo()
    rd = Store.open(url)
    cat = SC.for_store(rd.fs)
    assert cat.refresh(0.0).manifest("t", 0) is None  # the catalog lags ...
    assert [_records(rd, p) for p in range(3)] == want  # ... and shows every record
    rd.close()
    with Store.open(url) as st:
        assert st.collect_shared_garbage() is not None
        cur = SC.for_store(st.fs).refresh(0.0)
        assert cur.manifest("t", 0) is not None and cur.manifest("t", 0).split_to == {"w": 3}
    # what the split made collectable is collected (grace 0): every object, and every entry
    # but the writer's newest (its seq numbers the writer's next flush)
    keys = list(fake.objects["bucket"])
    assert not [k for k in keys if k.endswith(".kso")]
    assert len([k for k in keys if "/journal/" in k]) == 1
    rd = Store.open(url)
    assert [_records(rd, p) for p in range(3)] == want
    rd.close()


def test_a_follower_learns_of_a_compaction_from_the_catalog(s3, monkeypatch):
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "10")
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(8, i) for i in range(2)])
    f = Store.open(url)
    S3F.follow(f.fs)
    pls = [f.partition("t", p) for p in range(8)]
    assert [pl.next_offset for pl in pls] == [2] * 8
    with Store.open(url) as st:
        with SC.for_store(st.fs).batch():
            compact_store(st, force=True)
    import time
    time.sleep(0.02)  # (the catalog poll interval above: not a wait for a condition)
    before = dict(fake.calls)
    S3F.follower_for(f.fs).poll(0.0)
    for pl in pls:
        pl.refresh()
    got = _delta(fake, before)
    assert got.get("ListObjectsV2", 0) == 0, got
    # a journal GET (404), the catalog's next version, and its next (404)
    assert got.get("GetObject", 0) <= 3, got
    assert all(pl.manifest is not None and pl.manifest.split_to == {"w": 1}
               for pl in pls)
    assert [len(_records(f, p)) for p in range(8)] == [2] * 8
    f.close()


def test_a_follower_behind_by_several_versions_reads_only_the_newest(s3, monkeypatch):
    """Every catalog version is a whole checkpoint: a follower that finds versions N+1..N+3
    written since its last poll GETs N+1 (it looked for it), HEADs N+2, N+3 and N+4 (a 404),
    and reads only N+3, the newest, whose manifests it takes."""
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_POLL_MS", "10")
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(4, 0)])
    f = Store.open(url)
    cat = SC.for_reading(f.fs)
    v = cat.refresh(0.0).version
    with Store.open(url) as st:
        w = SC.for_store(st.fs)
        for i in range(3):  # three versions, each listing one more partition
            w.record({("t", 10 + i): None}, "test")
        assert w.refresh(0.0).version == v + 3
    seen = []
    real_get, real_head = fake.get_object, fake.head_object

    def get_object(Bucket, Key, Range=None):
        seen.append(("GET", Key.rsplit("/", 1)[-1]))
        return real_get(Bucket=Bucket, Key=Key, Range=Range)

    def head_object(Bucket, Key):
        seen.append(("HEAD", Key.rsplit("/", 1)[-1]))
        return real_head(Bucket=Bucket, Key=Key)
    fake.get_object, fake.head_object = get_object, head_object
    assert cat.poll_next(0.0)
    name = lambda n: f"{n:020d}.json"  # noqa: E731
    assert [x for x in seen if x[1].endswith(".json") and x[1][0].isdigit()] == [
        ("GET", name(v + 1)), ("HEAD", name(v + 2)), ("HEAD", name(v + 3)),
        ("HEAD", name(v + 4)), ("GET", name(v + 3))]
    assert cat.latest.version == v + 3
    assert cat.latest.holds("t", 12)
    f.close()


def test_a_damaged_newest_version_is_passed_over(s3):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(2, 0)])
    with Store.open(url) as st:
        cat = SC.for_store(st.fs)
        v = cat.refresh(0.0).version
        st.fs.write_atomic(SC.catalog_path(v + 1), b'{"format": 1, "version": 99}')
    with Store.open(url) as st:
        cat = SC.for_store(st.fs)
        assert cat.latest.version == v
        assert [len(_records(st, p)) for p in range(2)] == [1, 1]
        cat.record({("t", 5): None}, "test")  # the next commit goes past it
        assert cat.latest.version == v + 2 and cat.latest.holds("t", 5)


def test_old_versions_are_collected_after_the_grace_period(s3):
    fake, root = s3
    url = store_url("s3", root) + "?grace_ms=0"
    _write(url, f"{root}/cl", [_rows(2, i) for i in range(12)])  # folds: 3 + close
    with Store.open(url) as st:
        before = sorted(k for k in fake.objects["bucket"] if "/catalog/" in k)
        assert len(before) > SC.KEEP_VERSIONS
        st.collect_shared_garbage()
        after = sorted(k for k in fake.objects["bucket"] if "/catalog/" in k)
        assert after == before[-SC.KEEP_VERSIONS:]
        assert [len(_records(st, p)) for p in range(2)] == [12, 12]


def test_a_kcompact_that_knows_format_4_refuses_the_store(s3, monkeypatch):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(1, 0)])
    monkeypatch.setattr(store_mod, "KNOWN_FORMAT_VERSION", 4)
    with pytest.raises(StoreFormatError) as e:
        Store.open(url)
    msg = str(e.value)
    assert "\n" not in msg and "format version 5" in msg and "upgrade" in msg


def test_a_damaged_catalog_is_refused_naming_it(s3):
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(1, 0)])
    key = next(k for k in fake.objects["bucket"] if "/catalog/" in k)
    for k in [k for k in fake.objects["bucket"] if "/catalog/" in k]:
        raw, mtime = fake.objects["bucket"][k]
        body = json.loads(raw)
        body["writer"] = "someone else"  # (its checksum no longer matches)
        fake.objects["bucket"][k] = (json.dumps(body).encode(), mtime)
    from kcompact.reput.errors import CorruptRecordError
    with pytest.raises(CorruptRecordError) as e:
        Store.open(url)
    assert "store catalog" in str(e.value) and "checksum" in str(e.value)
    assert key.split("/", 1)[1] in str(e.value) or "catalog/" in str(e.value)


def test_a_committer_with_an_old_view_never_writes_a_collected_versions_key(s3):
    """(found by the model test) Another committer's versions above this one's view were
    written and collected (grace 0): this one's next commit lists first, so it lands above the
    newest with both changes, instead of re-creating a collected key and forking the catalog."""
    fake, root = s3
    url = store_url("s3", root) + "?grace_ms=0"
    _write(url, f"{root}/cl", [_rows(2, 0)])
    a_st, b_st = Store.open(url), Store.open(url)
    a, b = SC.for_store(a_st.fs), SC.for_store(b_st.fs)
    assert a is not b
    a.record({("t", 7): None}, "a")
    for i in range(SC.KEEP_VERSIONS + 2):
        b.record({("t", 10 + i): None}, "b")
    gone = b.collect_garbage(grace_ms=0, now_ms=b_st.fs.clock_ms() + 1)
    assert SC.catalog_path(a.latest.version + 1) in {g.split("/", 1)[-1] for g in gone} or \
        any(g.endswith(SC.catalog_path(a.latest.version + 1)) for g in gone)
    a.record({("t", 99): None}, "a")
    newest = SC.StoreCatalog(a_st.fs).refresh(0.0)
    assert newest.version == b.latest.version + 1
    assert {7, 99} | set(range(10, 10 + SC.KEEP_VERSIONS + 2)) <= newest.partitions["t"].keys()
    a_st.close()
    b_st.close()


def test_a_listing_reader_sees_the_partitions_not_split_yet(s3, monkeypatch):
    """(found by bench/s3_live.py at 512 partitions) A reader with KCOMPACT_S3_FOLLOW=list (the
    refresh before issue 49) still takes a catalog store's partitions from the catalog and
    the journal: a partition not split yet has no manifest, so no directory to list."""
    fake, root = s3
    url = store_url("s3", root)
    _write(url, f"{root}/cl", [_rows(5, 0)])
    monkeypatch.setenv("KCOMPACT_S3_FOLLOW", "list")
    with Store.open(url) as rd:
        assert rd.partitions("t") == list(range(5))
        assert [len(_records(rd, p)) for p in range(5)] == [1] * 5


# -- no request per partition: a new store's first writer, the Kafka endpoint's catch-up read ---


def _by_key(fake):
    """The fake's calls with their keys: (operation, key) appended to the list returned."""
    log = []
    for name in ("get_object", "list_objects_v2", "head_object", "put_object"):
        orig = getattr(fake, name)

        def call(*a, _orig=orig, _name=name, **k):
            log.append((_name, k.get("Key") or k.get("Prefix") or ""))
            return _orig(*a, **k)
        setattr(fake, name, call)
    return log


def _per_partition(log):
    """The requests of ``log`` naming one partition (``partitions/<topic>/<p>/...``)."""
    return [(op, key) for op, key in log
            if len(key.split("/")) > 4 and key.split("/")[1] == "partitions"]


def test_a_new_stores_first_writer_makes_no_request_per_partition(s3, monkeypatch):
    """(bench/s3_writes.py: 1 LIST and 1 GET a partition at a following mirror's start) A
    partition the catalog does not list yet (a new store, before the writer's first fold) has
    no object of its own: one listing of the topic's directory says so for all of them,
    instead of a LIST of each one's manifests and a GET of its ledger."""
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")  # (listings do not age: see above)
    log = _by_key(fake)
    made = {}
    for parts in (4, 64):
        url = store_url("s3", root, f"s{parts}")
        before = dict(fake.calls)
        del log[:]
        _write(url, f"{root}/cl{parts}", [_rows(parts, i) for i in range(3)])
        made[parts] = _delta(fake, before)
        assert _per_partition(log) == [], _per_partition(log)[:4]
        assert ("list_objects_v2", url.split("/", 3)[3] + "/partitions/t/") in log
    assert made[4] == made[64], made
    rd, offsets = _open_all(url, 64)
    assert offsets == [3] * 64
    assert [_records(rd, p) for p in range(64)] == [
        [(i, b"k%d" % (i % 5), b"v%d-%d" % (p, i)) for i in range(3)] for p in range(64)]
    rd.close()


def _endpoint_read(url, parts, monkeypatch):
    """What the Kafka endpoint does for one consumer reading every partition from the
    beginning (ListOffsets, then Fetch until the high watermark), on a fresh view of the
    store: the records by partition."""
    from _kafka_wire import decode_batches

    from kcompact.replication.kafka_endpoint.store_view import StoreView
    from kcompact.reput.s3_cache import shared_cache, shared_spool
    shared_cache().clear()
    shared_spool().clear()
    sv = StoreView(url)
    try:
        got = {}
        for p in sv.partitions("t"):
            b = sv.bounds("t", p)
            off, out = b.log_start, []
            while off < b.high_watermark:
                f = sv.fetch("t", p, off, 1 << 20)
                recs = [r for kb in decode_batches(b"".join(bytes(x) for x in f.parts))
                        for r in kb.records if r.offset >= off]
                if not recs:
                    break  # (a marker ending a gap)
                out += [(r.offset, r.key, r.value) for r in recs]
                off = recs[-1].offset + 1
            got[p] = out
        return got
    finally:
        sv.close()


@pytest.mark.parametrize("split", [False, True], ids=["as-written", "after-split"])
@pytest.mark.parametrize("folded", [True, False], ids=["folded", "unfolded"])
def test_a_catch_up_read_makes_no_request_per_partition(s3, monkeypatch, split, folded):
    """(bench/s3_catchup.py) A consumer reading the whole store through the Kafka endpoint
    costs the same requests at 4 and at 64 partitions, as written (the partitions listed by
    the catalog, or, before the writer folds, only by its journal entries) and after `compact
    --force` (one compaction object); it reads what was written."""
    fake, root = s3
    _hold_listings(monkeypatch)
    if not folded:
        monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "1000")
    log = _by_key(fake)
    made = {}
    for parts in (4, 64):
        url = store_url("s3", root, f"s{parts}")
        w = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl{parts}")
        for i in range(6):
            w.append(_batch(_rows(parts, i)))
            w.flush()
        if folded:
            w.close()
        if split:
            with Store.open(url, commitlog_dir=f"{root}/cc{parts}") as st:
                compact_store(st, force=True)
        want = {p: _records(w, p) for p in range(parts)} if not folded else None
        before = dict(fake.calls)
        del log[:]
        got = _endpoint_read(url, parts, monkeypatch)
        made[parts] = _delta(fake, before)
        assert _per_partition(log) == [], _per_partition(log)[:4]
        if split:  # the newest record of each key
            assert got == {p: [(o, b"k%d" % (o % 5), b"v%d-%d" % (p, o)) for o in range(1, 6)]
                           for p in range(parts)}
        else:
            assert got == {p: [(o, b"k%d" % (o % 5), b"v%d-%d" % (p, o)) for o in range(6)]
                           for p in range(parts)}
        if want is not None:
            assert want == {p: [(o, b"k%d" % (o % 5), b"v%d-%d" % (p, o)) for o in range(6)]
                            for p in range(parts)}
        if not folded:
            w.close()
    assert made[4] == made[64], made


def test_a_partition_the_catalog_does_not_list_is_read_from_its_own_manifest(s3, monkeypatch):
    """A committer killed between its manifest commit and the catalog's, on a partition the
    catalog never listed (a per-partition upload's first commit): the partition has a
    directory, so it is read from its manifest (not taken for empty), and the catalog is
    brought up to date."""
    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")
    url = store_url("s3", root)
    Store.create(url, shared_uploads=True).close()
    monkeypatch.setattr(SC, "after_manifest_commit", lambda *a, **k: None)
    _write(url, f"{root}/cl", [_rows(3, i) for i in range(2)],
           options=WriterOptions(upload="partition"))
    monkeypatch.undo()
    monkeypatch.setenv("KCOMPACT_S3_REFRESH_MS", "600000")
    with Store.open(url) as rd:
        cat = SC.for_store(rd.fs)
        assert not cat.latest.holds("t", 0)
        assert _records(rd, 0) == [(0, b"k0", b"v0-0"), (1, b"k1", b"v0-1")]
        assert cat.refresh(0.0).manifest("t", 0) is not None  # (recorded by the read)


def _old_layout(cat: SC.Catalog) -> bytes:
    """A catalog version as kcompact wrote it before its canonical JSON was assembled from
    cached pieces: the body in insertion order, ``crc32c`` over its canonical JSON."""
    from kcompact.reput.segment_list import canonical, crc32c
    parts = {t: {str(p): (None if m is None else json.loads(m.to_json()))
                 for p, m in sorted(ps.items())} for t, ps in sorted(cat.partitions.items()) if ps}
    journal = {w: {"folded": cat.folded[w], "entries": cat.entries.get(w, [])}
               for w in sorted(cat.folded)}
    body = {"format": 1, "version": cat.version, "created_ms": cat.created_ms,
            "writer": cat.writer, "partitions": parts, "journal": journal}
    body["crc32c"] = f"{crc32c(canonical(body)):08x}"
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def test_a_catalog_version_is_the_same_object_as_before_and_both_layouts_read(s3):
    """A version is written as its canonical JSON (assembled from each entry's and manifest's,
    kept across versions) with ``crc32c`` last: the same object, and the same checksum, as the
    body encoded whole; a reader checks it over the bytes, and still reads a version written
    in the old key order; a flipped byte is refused in both."""
    from kcompact.reput.segment_list import canonical
    fake, tmp = s3
    url = store_url("s3", tmp, "canon")
    cl = os.path.join(tmp, "cl")
    # two topics' partitions over 12 partitions, split and not, two writers' entries
    _write(url, cl, [_rows(12, 0), _rows(12, 1), _rows(12, 2), _rows(12, 3), _rows(12, 4)])
    _write(url, os.path.join(tmp, "cl2"), [_rows(12, 5)], writer="w2")
    for p in (3, 11):
        with Store.open(url, writer="c", commitlog_dir=os.path.join(tmp, "cl3")) as st:
            compact_store(st, topic="t", partition=p, force=True)
    _write(url, cl, [[(p, 6, b"k", b"v") for p in (0, 10, 11)]])
    with Store.open(url) as st:
        cat = SC.for_store(st.fs).refresh(0.0)
        written = st.fs.read(SC.catalog_path(cat.version))  # (by the writer, from its pieces)
    assert cat.entries and any(m is not None for ps in cat.partitions.values()
                               for m in ps.values())
    raw = cat.to_json()
    assert raw == written
    body = json.loads(raw)
    crc = body.pop("crc32c")
    assert cat.canonical() == canonical(body)
    assert raw.endswith(b',"crc32c":"' + crc.encode() + b'"}\n')
    old = _old_layout(cat)
    assert json.loads(old) == json.loads(raw)
    for layout in (raw, old):
        got = SC.Catalog.from_json(layout, "v", cat.version)
        assert got.to_json() == raw
        i = layout.index(b'"next_offset":') + len(b'"next_offset":')
        bad = layout[:i] + bytes([layout[i] ^ 1]) + layout[i + 1:]
        with pytest.raises(Exception, match="checksum"):
            SC.Catalog.from_json(bad, "v", cat.version)


@pytest.mark.parametrize("dies", ["before the put", "after the put"])
def test_a_writer_killed_in_its_background_fold_loses_nothing(s3, monkeypatch, dies):
    """``WriterOptions(fold="background")`` (the mirror's store sink): the fold runs in a
    thread of the writer, and its flushes go on while it is under way. A writer killed in it
    (before its catalog PUT lands, or after it but before it knows) loses nothing: the fold is
    not a commit point, every record is read from the journal, the writer's next process
    folds what was left, and nothing is left but valid catalog versions and objects the
    journal names."""
    import threading

    fake, root = s3
    monkeypatch.setenv("KCOMPACT_S3_CATALOG_FOLD", "2")
    url = store_url("s3", root)
    stuck, release = threading.Event(), threading.Event()
    real_fold = SC.StoreCatalog.fold

    class Killed(Exception):
        pass

    def fold(self, writer, entries, partitions=()):
        if threading.current_thread().name != "kcompact-catalog-fold":
            return real_fold(self, writer, entries, partitions)
        if dies == "after the put":
            real_fold(self, writer, entries, partitions)
        stuck.set()
        release.wait(30)
        raise Killed  # (the process is gone: nothing more of this fold happens)

    monkeypatch.setattr(SC.StoreCatalog, "fold", fold)
    st = Store.open(url, writer="w", create=True, commitlog_dir=f"{root}/cl",
                    options=WriterOptions(fold="background"))
    for i in range(2):
        st.append(_batch(_rows(3, i)))
        st.flush()
    assert stuck.wait(30)  # the fold of entries 0 and 1 is under way ...
    for i in range(2, 5):  # ... and the writer's flushes go on
        st.append(_batch(_rows(3, i)))
        st.flush()
    folded = {"before the put": -1, "after the put": 1}[dies]
    with Store.open(url) as look:
        assert SC.for_store(look.fs).refresh(0.0).folded.get("w", -1) == folded
    release.set()  # the writer is killed: its store is never closed
    monkeypatch.undo()
    rd = Store.open(url)
    assert [[o for o, _k, _v in _records(rd, p)] for p in range(3)] == [list(range(5))] * 3
    rd.close()
    # the writer's next process folds what its killed one left (entries above folded)
    st2 = Store.open(url, writer="w", commitlog_dir=f"{root}/cl-next",
                     options=WriterOptions(fold="background"))
    assert [e.seq for e in st2.left_unfolded()] == list(range(folded + 1, 5))
    st2.append(_batch(_rows(3, 5)))
    st2.flush()
    st2.close()  # (waits for the fold under way, then folds the rest)
    before = dict(fake.calls)
    rd, offsets = _open_all(url, 3)
    assert offsets == [6, 6, 6]
    assert SC.for_store(rd.fs).latest.folded == {"w": 5}
    assert _delta(fake, before).get("GetObject", 0) == 2  # store.json, the catalog: no entry
    assert [[o for o, _k, _v in _records(rd, p)] for p in range(3)] == [list(range(6))] * 3
    rd.close()
    keys = list(fake.objects["bucket"])
    entries = {k.rsplit("/", 1)[1][:20] for k in keys if "/journal/" in k}
    objects = {k.rsplit("/", 1)[1][:20] for k in keys if k.endswith(".kso")}
    assert objects == entries == {f"{i:020d}" for i in range(6)}
    with Store.open(url) as chk:
        for k in keys:
            if "/catalog/" in k:
                v = SC.parse_catalog_name(k.rsplit("/", 1)[1])
                SC.Catalog.from_json(chk.fs.read(SC.catalog_path(v)), k, v)
