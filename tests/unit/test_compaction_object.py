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
def test_forced_compaction_writes_one_object_for_every_partition(s3, upload, monkeypatch):
    """(A store with per-partition uploads keeps per-partition objects by default: it stays
    format 2; ``KCOMPACT_S3_COMPACTION_OBJECTS=store`` packs it too.)"""
    fake, root = s3
    if upload is PARTITION:
        monkeypatch.setenv("KCOMPACT_S3_COMPACTION_OBJECTS", "store")
    url = "s3://bucket/one"
    _write(url, f"{root}/cl", _flushes(12, [200, 200, 200], 30, 1), upload)
    before = fake.calls.copy()
    res = _compact(url, f"{root}/cc")
    calls = fake.calls - before
    objs = _objects(fake, "one")
    kco = [k for k in objs if k.startswith(fn.COMPACTED_DIR + "/")]
    assert len(kco) == 1
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


def test_a_store_without_shared_uploads_keeps_per_partition_objects(s3):
    fake, root = s3
    url = "s3://bucket/fmt2"
    _write(url, f"{root}/cl", _flushes(4, [100, 100], 10, 8), PARTITION)
    _compact(url, f"{root}/cc")
    assert not [k for k in _objects(fake, "fmt2") if k.startswith("compacted/")]
    with Store.open(url) as st:
        assert st.meta.format_version == 2 and CO.FEATURE not in st.meta.features


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
    # each partition reads as before or as after (never a mix), ``commits`` of them after
    assert all(rs in (before[p], after_ref[p]) for p, rs in got.items())
    assert sum(rs == after_ref[p] != before[p] for p, rs in got.items()) == commits
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


def test_a_compaction_streams_a_large_segment_inside_an_object_with_one_ranged_get(s3):
    """Its input segment inside an object is read with one ranged GET of its .log (not block
    by block through the cache, nor held whole in memory): blocks of 4 KiB here."""
    from kcompact.reput.s3 import S3Backend
    from kcompact.reput.s3_cache import BlockCache, Spool
    fake, root = s3
    fs = S3Backend("bucket", "big", client=fake, grace_ms=0, cache=BlockCache(1 << 20, 1 << 12),
                   spool=Spool(0, os.path.join(root, "spool")))
    url = "s3://bucket/big"
    flushes = _flushes(2, [400, 400], 5_000, 9, value_bytes=300)
    with Store.open(url, writer="w", create=True, options=SHARED, commitlog_dir=f"{root}/cl",
                    fs=fs) as st:
        for rows in flushes[:1]:
            st.append(RecordBatch.from_records(
                "t", [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows]))
            st.flush()
    with Store.open(url, commitlog_dir=f"{root}/cc", fs=fs) as st:
        compact_store(st, force=True)
    with Store.open(url, writer="w", options=SHARED, commitlog_dir=f"{root}/cl", fs=fs) as st:
        for rows in flushes[1:]:
            st.append(RecordBatch.from_records(
                "t", [(p, o, 1_000 + o, k, v, []) for p, o, k, v in rows]))
            st.flush()
    fs.cache.clear()
    ranges = []
    orig = fake.get_object

    def get(Bucket, Key, Range=None):
        if Key.endswith(".kco") and Range:
            a, b = map(int, Range.split("=")[1].split("-"))
            ranges.append(b - a + 1)
        return orig(Bucket, Key, Range)
    fake.get_object = get
    try:
        with Store.open(url, commitlog_dir=f"{root}/cc", fs=fs) as st:
            compact_store(st, force=True)
    finally:
        fake.get_object = orig
    assert any(n > 4 * (1 << 12) for n in ranges), ranges
    want = {}
    for rows in flushes:
        for p, o, k, v in rows:
            want.setdefault(p, []).append((o, k, v))
    assert _records(url) == {p: _dedup(rs) for p, rs in want.items()}


# -- every read path ---------------------------------------------------------------------------------


def _dump(url: str, p: int) -> list[tuple]:
    import base64
    import contextlib
    import io
    import json
    from kcompact.connectors.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["dump", "--store", url, "--topic", "t", "--partition", str(p),
                     "--json"]) == 0
    rows = []
    for line in out.getvalue().splitlines():
        r = json.loads(line)
        key = base64.b64decode(r["key_b64"]) if "key_b64" in r else r["key"].encode()
        value = (base64.b64decode(r["value_b64"]) if "value_b64" in r
                 else None if r["value"] is None else r["value"].encode())
        rows.append((r["offset"], key, value))
    return rows


def _endpoint(url: str, parts: int, want: int) -> dict:
    """Every partition from the beginning through the Kafka endpoint (in this process), one
    confluent-kafka consumer."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from test_kafka_endpoint_model import Served
    srv = Served(url)
    c = Consumer({"bootstrap.servers": f"127.0.0.1:{srv.port}", "group.id": "catchup",
                  "enable.auto.commit": False})
    got: dict = {p: [] for p in range(parts)}
    try:
        c.assign([TopicPartition("t", p, OFFSET_BEGINNING) for p in range(parts)])
        n, idle = 0, 0
        while n < want and idle < 50:
            msgs = c.consume(1000, 0.2)
            idle = 0 if msgs else idle + 1
            for m in msgs:
                if m.error() is None:
                    got[m.partition()].append((m.offset(), m.key(), m.value()))
                    n += 1
    finally:
        c.close()
        srv.close()
    return got


def _replicate(url: str, root: str) -> dict:
    """`kcompact replicate` of the store from `kcompact serve`'s server (both in this process)
    into a local replica; the replica's records."""
    import asyncio
    import threading
    from kcompact.replication.replica import ReplicateOptions, replicate
    from kcompact.replication.server import run_server
    token = b"t" * 32
    tf = os.path.join(root, "token")
    with open(tf, "wb") as f:
        f.write(token)
    loop = asyncio.new_event_loop()
    stop: list = []
    ready = threading.Event()
    where: list = []

    def serve():
        asyncio.set_event_loop(loop)
        ev = asyncio.Event()
        stop.append(ev)
        loop.run_until_complete(run_server(url, "127.0.0.1:0", token, stop=ev,
                                           ready=lambda u: (where.append(u), ready.set())))
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(30)
    replica = os.path.join(root, "replica")
    try:
        assert replicate(ReplicateOptions(where[0], tf, replica)) == 0
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        t.join(30)
    return _records(replica)


@pytest.mark.parametrize("split", [False, True], ids=["as-written", "split"])
def test_every_read_path_reads_what_a_local_store_holds(tmp_path, split):
    """dump, the Kafka endpoint and replicate of the S3 store (shared objects as written, or
    compacted into one object) against a local store of the same writes and compactions (a
    replica force-compacts what it pulled: the local store's compacted records)."""
    root = str(tmp_path)
    parts = 5
    flushes = _flushes(parts, [150, 150, 150], 40, 11)
    got = {}
    for backend in ("local", "s3"):
        with backend_env(backend, root):
            url = store_url(backend, root, f"r-{backend}")
            _write(url, f"{root}/cl-{backend}", flushes,
                   SHARED if backend == "s3" else WriterOptions())
            if split:
                _compact(url, f"{root}/cc-{backend}")
            if backend == "local":
                want = _records(url)
                continue
            if split:
                assert _objects_of(url) == 1
            _cold()
            got["reader"] = _records(url)
            got["dump"] = {p: _dump(url, p) for p in range(parts)}
            got["endpoint"] = _endpoint(url, parts, sum(map(len, want.values())))
            got["replica"] = _replicate(url, root)
    for path in ("reader", "dump", "endpoint"):
        assert got[path] == want, path
    assert got["replica"] == {p: _dedup(rs) for p, rs in want.items()}


def _objects_of(url: str) -> int:
    with Store.open(url) as st:
        return len(st.fs.list_objects(fn.COMPACTED_DIR))


def test_a_spark_task_publishes_its_partitions_in_one_object(s3):
    """``compact --engine spark``'s task body (connectors/apps/spark/compact_job.py, run here in
    this process as an executor runs it): the partitions it compacts go into one compaction
    object, and read as the local engine's forced compaction of the same store leaves them."""
    from kcompact.connectors.apps.spark.compact_job import _compact_task
    fake, root = s3
    flushes = _flushes(8, [300, 300, 300], 25, 5)
    a, b = "s3://bucket/spark-a", "s3://bucket/spark-b"
    _write(a, f"{root}/cla", flushes, SHARED)
    _write(b, f"{root}/clb", flushes, SHARED)
    run = _compact_task(a, 1 << 20, True)
    # two tasks, as a session of parallelism 2 splits 8 partitions
    got = [r for share in ([("t", p) for p in range(0, 8, 2)], [("t", p) for p in range(1, 8, 2)])
           for r in run(share)]
    assert len(got) == 8 and all(not r.get("skipped") for r in got), got
    assert len([k for k in _objects(fake, "spark-a") if k.startswith("compacted/")]) == 2
    _compact(b, f"{root}/ccb")
    assert _records(a) == _records(b)
