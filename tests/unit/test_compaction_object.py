"""Compaction objects on S3 (issue 49; docs/formats/compaction-object.md), on the in-memory S3.

* a forced compaction (and the split) of every partition writes ONE object, however many
  partitions, rolled to another one beyond ``KCOMPACT_S3_COMPACTION_OBJECT_MB``; <= 4 requests
  per segment; store.json says format 4 and ``compaction-objects``, which a kcompact knowing
  only format 3 refuses with one line;
* a whole-store read of the compacted store costs GETs by 4 MiB blocks, not 2 per partition
  (``KCOMPACT_S3_COMPACTION_OBJECTS=partition``, the old layout, next to it);
* the records read back equal a local store's after the same writes and compactions
  (hypothesis over partition counts, flush sizes, keys, tombstones and repeated compactions);
* a compaction killed between the object's upload and the manifest commits (none of them, or
  some) loses nothing; every state reads as before or after per partition, and the garbage
  collector deletes the object once no manifest lists it;
* a damaged footer is one line naming the object, and the collector keeps such an object.

SIGKILLs of a compaction process between upload and commit on SeaweedFS:
tests/integration/test_s3_compaction_object.py.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend_env, store_url  # noqa: E402

from kcompact.compaction.planner import compact_store  # noqa: E402
from kcompact.reput import Store, WriterOptions  # noqa: E402
from kcompact.reput import compaction_object as CO  # noqa: E402
from kcompact.reput import filenames as fn  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput import store_meta as store_meta_mod  # noqa: E402
from kcompact.reput.errors import CorruptRecordError, StoreFormatError  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3_cache import shared_cache, shared_spool  # noqa: E402

SHARED = WriterOptions(upload="shared")
PARTITION = WriterOptions(upload="partition")


@pytest.fixture
def s3(tmp_path):
    with backend_env("s3", str(tmp_path)) as fake:
        yield fake, str(tmp_path)


def _flushes(parts: int, sizes: list[int], keys: int, seed: int, value_bytes: int = 8):
    import random
    rnd = random.Random(seed)
    nxt = {p: 0 for p in range(parts)}
    out = []
    for n in sizes:
        rows = []
        for _ in range(n):
            p = rnd.randrange(parts)
            o = nxt[p]
            nxt[p] = o + 1
            value = None if rnd.random() < 0.1 else rnd.randbytes(value_bytes)
            rows.append((p, o, b"k%d" % rnd.randrange(keys), value))
        out.append(rows)
    return out


def _write(url, cl, flushes, options, writer="w"):
    with Store.open(url, writer=writer, create=True, options=options, commitlog_dir=cl) as st:
        for rows in flushes:
            if rows:
                st.append(RecordBatch.from_records(
                    "t", [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows]))
            st.flush()


def _records(url) -> dict:
    with Store.open(url) as st:
        return {p: [(r.offset, r.key, r.value) for r in st.iter_records("t", p)]
                for p in st.partitions("t")}


def _compact(url, cl, **kw):
    with Store.open(url, commitlog_dir=cl) as st:
        res = compact_store(st, force=True, **kw)
        assert all(r.skipped is None for r in res), [r.skipped for r in res]
        return res


def _objects(fake, prefix: str) -> dict:
    return {k[len(prefix) + 1:]: v for k, v in fake.objects["bucket"].items()
            if k.startswith(prefix + "/")}


def _cold():
    shared_cache().clear()
    shared_spool().clear()


# -- one object per run ------------------------------------------------------------------------


@pytest.mark.parametrize("upload", [SHARED, PARTITION], ids=["shared", "partition"])
def test_forced_compaction_writes_one_object_for_every_partition(s3, upload):
    fake, root = s3
    url = "s3://bucket/one"
    _write(url, f"{root}/cl", _flushes(12, [200, 200, 200], 30, 1), upload)
    before = fake.calls.copy()
    res = _compact(url, f"{root}/cc")
    calls = fake.calls - before
    objs = _objects(fake, "one")
    kco = [k for k in objs if k.startswith(fn.COMPACTED_DIR + "/")]
    assert len(kco) == 1
    assert not [k for k in objs if k.startswith("partitions/") and k.endswith(".log")
                and objs[k][0] and k > "partitions/t/" and "manifest" not in k
                and upload is SHARED]
    segments = sum(r.segments_before for r in res)
    assert sum(calls.values()) <= 4 * segments, (dict(calls), segments)
    with Store.open(url) as st:
        assert st.meta.format_version == 4 and CO.FEATURE in st.meta.features
        for p in st.partitions("t"):
            m = st.partition("t", p).manifest
            assert [s.object for s in m.segments] == [kco[0]]
        entries = CO.read_footer(st.fs, kco[0], len(objs[kco[0]][0]))
    assert sorted({(e.topic, e.partition) for e in entries}) == [("t", p) for p in range(12)]


def test_an_object_beyond_the_bound_rolls_to_another(s3, monkeypatch):
    fake, root = s3
    url = "s3://bucket/roll"
    _write(url, f"{root}/cl", _flushes(6, [600, 600], 10_000, 2, value_bytes=2_000), SHARED)
    want = _records(url)
    monkeypatch.setenv("KCOMPACT_S3_COMPACTION_OBJECT_MB", "1")
    _compact(url, f"{root}/cc")
    kco = {k: v[0] for k, v in _objects(fake, "roll").items() if k.startswith("compacted/")}
    assert len(kco) >= 2
    with Store.open(url) as st:
        per_object = [CO.read_footer(st.fs, k, len(v)) for k, v in kco.items()]
    # a partition is never cut: each lies in one object, and an object passes the bound by at
    # most the partition that filled it
    owners = [{(e.topic, e.partition) for e in es} for es in per_object]
    assert sum(map(len, owners)) == len(set().union(*owners)) == 6
    largest_partition = max(sum(e.desc.log_size + e.desc.bcq_size for e in es
                                if (e.topic, e.partition) == tp)
                            for es in per_object for tp in {(e.topic, e.partition) for e in es})
    assert all(len(v) <= (1 << 20) + largest_partition + 65_536 for v in kco.values())
    assert _records(url) == {p: _dedup(rs) for p, rs in want.items()}


def _dedup(rows):
    """A forced compaction's result of ``rows`` (offset order): the latest record per key,
    tombstones kept (delete.retention.ms has not passed)."""
    last = {}
    for o, k, v in rows:
        last[k] = o
    return [(o, k, v) for o, k, v in rows if last[k] == o]


def test_whole_store_read_costs_blocks_not_partitions(s3, monkeypatch):
    """Data GETs (everything but the JSON metadata: manifests, ledgers, whose count per
    partition is the store-level metadata's to remove)."""
    fake, root = s3
    flushes = _flushes(40, [400, 400], 200, 3)
    keys: list[str] = []
    orig = fake.get_object

    def get(Bucket, Key, Range=None):
        keys.append(Key)
        return orig(Bucket, Key, Range)
    monkeypatch.setattr(fake, "get_object", get)
    gets = {}
    for mode in ("partition", "store"):
        monkeypatch.setenv("KCOMPACT_S3_COMPACTION_OBJECTS", mode)
        url = f"s3://bucket/read-{mode}"
        _write(url, f"{root}/cl-{mode}", flushes, SHARED)
        _compact(url, f"{root}/cc-{mode}")
        _cold()
        with Store.open(url) as st:
            del keys[:]
            for p in st.partitions("t"):
                assert list(st.iter_records("t", p))
            gets[mode] = [k for k in keys if not k.endswith(".json")]
    # the old layout: a .bcq and a .log GET per partition
    assert len(gets["partition"]) >= 2 * 40
    # one object of a few hundred KB: one 4 MiB block for all 40 partitions
    assert len(gets["store"]) == 1 and gets["store"][0].endswith(".kco"), gets["store"]


def test_a_kcompact_that_knows_format_3_refuses_the_store_with_one_line(s3, monkeypatch):
    fake, root = s3
    url = "s3://bucket/old"
    _write(url, f"{root}/cl", _flushes(3, [50], 10, 4), SHARED)
    _compact(url, f"{root}/cc")
    monkeypatch.setattr(store_meta_mod, "KNOWN_FORMAT_VERSION", 3)  # (store.json: store_meta.py)
    with pytest.raises(StoreFormatError) as e:
        Store.open(url)
    msg = str(e.value)
    assert "\n" not in msg and "version 4" in msg and "upgrade kcompact" in msg


# -- the same records as a local store -------------------------------------------------------------


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(parts=st.integers(1, 6), sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
       keys=st.integers(1, 40), compactions=st.integers(1, 3), seed=st.integers(0, 1 << 30))
def test_records_equal_a_local_stores_after_the_same_compactions(tmp_path_factory, parts, sizes,
                                                                 keys, compactions, seed):
    root = str(tmp_path_factory.mktemp("model"))
    flushes = _flushes(parts, sizes, keys, seed)
    # the compactions fall between the flushes: the first after the first flush, and so on
    cuts = [min(len(flushes), 1 + i) for i in range(compactions)]
    got = {}
    for backend in ("local", "s3"):
        with backend_env(backend, root):
            url = store_url(backend, root, f"m-{backend}")
            done = 0
            for cut in cuts + [len(flushes)]:
                _write(url, f"{root}/cl-{backend}", flushes[done:cut],
                       SHARED if backend == "s3" else WriterOptions())
                done = cut
                if done < len(flushes) or cut == cuts[-1]:
                    _compact(url, f"{root}/cc-{backend}")
            _cold()
            got[backend] = _records(url)
            if backend == "s3":
                with Store.open(url + "?grace_ms=0", commitlog_dir=f"{root}/cc-s3") as st:
                    st.collect_compaction_garbage()  # what no manifest lists goes; reads stay
                assert _records(url) == got["s3"]
    assert {p: r for p, r in got["s3"].items() if r} == {p: r for p, r in got["local"].items()
                                                          if r}


# -- a compaction killed between the upload and the commits ---------------------------------------


class Killed(BaseException):
    """Stands for SIGKILL at this point (nothing after it runs)."""


def _copy_prefix(fake, src: str, dst: str) -> None:
    objs = fake.objects["bucket"]
    for k in [k for k in objs if k.startswith(src + "/")]:
        objs[dst + k[len(src):]] = objs[k]


@pytest.mark.parametrize("commits", [0, 1, 3])
def test_a_compaction_killed_after_its_upload_loses_nothing(s3, monkeypatch, commits):
    """``commits`` manifests committed when it dies (0: right after the object's upload)."""
    fake, root = s3
    url = "s3://bucket/kill"
    _write(url, f"{root}/cl", _flushes(5, [120, 120], 20, 5), SHARED)
    before = _records(url)
    after_ref = {p: _dedup(rs) for p, rs in before.items()}
    from kcompact.reput.catalog_manifest import ManifestCatalog
    orig = ManifestCatalog.commit_staged
    state = {"n": 0}

    def snapshot_and_die():
        _copy_prefix(fake, "kill", "dead")  # the store as the killed process left it
        shutil.copytree(f"{root}/cc", f"{root}/cc-dead")
        raise Killed()

    def counting(self, *a, **kw):
        if state["n"] == commits:
            snapshot_and_die()
        state["n"] += 1
        return orig(self, *a, **kw)
    monkeypatch.setattr(ManifestCatalog, "commit_staged", counting)
    with pytest.raises(Killed):
        _compact(url, f"{root}/cc")
    monkeypatch.setattr(ManifestCatalog, "commit_staged", orig)
    dead = "s3://bucket/dead"
    kco = [k for k in _objects(fake, "dead") if k.startswith("compacted/")]
    assert len(kco) == 1  # uploaded before the first commit
    got = _records(dead)
    for p, rs in got.items():  # each partition reads as before or as after, never a mix
        assert rs == (after_ref[p] if p < commits else before[p])
    # recovery: the collector, grace period over, keeps the object while a manifest lists it
    with Store.open(dead + "?grace_ms=0", commitlog_dir=f"{root}/cc-dead") as st:
        deleted = st.collect_compaction_garbage()
    assert (kco[0] in deleted) == (commits == 0)
    assert _records(dead) == got
    # compacting again reaches the reference state; then nothing lists the dead run's object
    _compact(dead + "?grace_ms=0", f"{root}/cc-dead")
    assert _records(dead) == after_ref
    with Store.open(dead + "?grace_ms=0", commitlog_dir=f"{root}/cc-dead") as st:
        st.collect_compaction_garbage()
        listed = {s.object for p in st.partitions("t")
                  for s in M.read_latest(st.fs, fn.partition_dir("t", p)).segments}
    left = {k for k in _objects(fake, "dead") if k.startswith("compacted/")}
    # (a partition committed into it before the kill has nothing left to compact: it stays)
    assert left == listed and (kco[0] in left) == (commits > 0)


# -- a damaged footer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["footer", "magic", "short"])
def test_a_damaged_footer_is_one_line_naming_the_object(s3, damage, capsys):
    fake, root = s3
    url = "s3://bucket/dmg"
    _write(url, f"{root}/cl", _flushes(3, [60], 10, 6), SHARED)
    _compact(url, f"{root}/cc")
    objs = fake.objects["bucket"]
    key = next(k for k in objs if k.startswith("dmg/compacted/"))
    data, mtime = objs[key]
    b = bytearray(data)
    if damage == "footer":
        b[-CO.TRAILER.size - 5] ^= 0xFF
    elif damage == "magic":
        b[-1] ^= 0xFF
    else:
        b = b[:10]
    objs[key] = (bytes(b), mtime)
    _cold()
    path = key[len("dmg/"):]
    with Store.open(url + "?grace_ms=0", commitlog_dir=f"{root}/cc") as st:
        with pytest.raises(CorruptRecordError) as e:
            CO.read_footer(st.fs, path, len(b))
        msg = str(e.value)
        assert "\n" not in msg and path in msg
        assert {"footer": "footer does not match its checksum", "magic": "bad magic",
                "short": "shorter than"}[damage] in msg
        # the collector reports it in one line and keeps it
        for p in st.partitions("t"):  # nothing lists it any more...
            st.partition("t", p)
        monkey_manifest = {}
        assert CO.collect_garbage(st.fs, lambda t, p: monkey_manifest.get((t, p)), grace_ms=0,
                                  now_ms=st.clock.ms(), objects_now_ms=st.fs.clock_ms(),
                                  warn=lambda line: print(line)) == []
    assert path in capsys.readouterr().out
    assert key in objs
