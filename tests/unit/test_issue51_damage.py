"""Issue 51, "inspect forgets what compaction found" and "a loss verify calls whole": the two
Checks scripted as a user runs them (the CLI's ``main`` in this process, the Kafka endpoint in
a thread of it), on a local store and, where the code differs, on the in-memory S3.

* (a) a 4 KiB range of partition 0's first sealed ``.log`` zeroed: ``compact --force`` skips
  partition 0 and exits 1; ``inspect`` then exits 1 naming it (its damage is recorded beside it,
  reput/damage_record.py), the metric counts it, ``repair`` clears it.
* (b) partition 0's ``segments.json`` and its first segment (``.log`` + ``.bcq``, holding every
  live record after a forced compaction) deleted: ``verify`` exits 1, ``dump --partition 0``
  refuses it in one line, and the Kafka endpoint answers KAFKA_STORAGE_ERROR for partition 0
  in Fetch and ListOffsets while it serves partition 1 (reput/ledger.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend_env, store_url  # noqa: E402

from kcompact.connectors.cli import main  # noqa: E402
from kcompact.reput import filenames as fn  # noqa: E402
from kcompact.reput import ledger as LG  # noqa: E402
from kcompact.reput import segment_list as SL  # noqa: E402
from kcompact.reput.backend import LocalBackend  # noqa: E402
from kcompact.reput.config import ManualClock  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402

TOPIC = "t"
N, KEYS = 2500, 250
KAFKA_STORAGE_ERROR = 56


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def build(url: str) -> None:
    """Two partitions of N records over KEYS keys each (about 330 bytes a record), closed: one
    sealed segment and an empty active one per partition."""
    clock = ManualClock()
    s = Store.open(url, writer="w", create=True, clock=clock)
    for p in range(2):
        s.append(RecordBatch.from_records(TOPIC, [
            (p, i, clock.ms() + i, b"k%d" % (i % KEYS), b"%d:" % i + b"v" * 300)
            for i in range(N)]))
    s.flush()
    s.close()


def pdir(url: str, p: int) -> str:
    return os.path.join(url, fn.partition_dir(TOPIC, p))


def sealed(url: str, p: int) -> list[str]:
    """The partition's segments holding records, by base (store-relative .log paths)."""
    lst = SL.read(LocalBackend(url), fn.partition_dir(TOPIC, p))
    return [f"{fn.partition_dir(TOPIC, p)}/{fn.base_name(m.base)}.log" for m in lst.segments
            if not m.open and m.records]


def dumped(url: str, p: int) -> dict[int, dict]:
    code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", str(p),
                         "--json")
    assert code == 0, err
    return {r["offset"]: r for r in map(json.loads, out.splitlines())}


# -- (a) damage found is remembered until repaired -------------------------------------------------


def test_issue51_zeroed_range_compaction_skips_it_inspect_remembers_it(tmp_path):
    url = str(tmp_path / "s")
    build(url)
    first = sealed(url, 0)[0]
    path = os.path.join(url, first)
    size = os.path.getsize(path)
    at = size - 8192  # in the batches of the live records (the newest value of every key)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(4096))
    code, out, err = run("inspect", "--store", url)
    assert code == 0, err  # (nothing shows without reading records: the issue's starting point)

    code, out, err = run("compact", "--store", url, "--force", "--json")
    assert code == 1 and "t-0 is damaged" in err.strip().splitlines()[-1], err
    res = {r["partition"]: r for r in json.loads(out)["partitions"]}
    assert res[0]["damaged"]["path"] == first and not res[1]["damaged"]
    assert os.path.exists(os.path.join(pdir(url, 0), "damage.json"))
    assert not os.path.exists(os.path.join(pdir(url, 1), "damage.json"))

    code, out, err = run("inspect", "--store", url)
    assert code == 1, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("kcompact: error: t-0 is damaged") and first in last, err
    row0 = next(r for r in out.splitlines() if r.split()[:2] == ["t", "0"])
    assert row0.endswith("DAMAGED (below)")
    (why,) = [r for r in out.splitlines() if r.startswith("t-0: DAMAGED: ")]
    assert first in why and "(found by compact at " in why
    code, out, _ = run("inspect", "--store", url, "--json")
    assert code == 1
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    d = parts[0]["damaged"]
    assert d["path"] == first and d["found_by"] == "compact" and d["found_ms"] > 0
    assert d["position"] is not None and d["reason"]
    assert parts[1]["damaged"] is None and parts[1]["records"] == KEYS  # compacted

    # the metric counts it, in a process that never met the damage itself
    from prometheus_client.parser import text_string_to_metric_families

    from kcompact.compaction import Scheduler
    from kcompact.replication.ops import Ops, compaction_metrics
    with Store.open(url) as st:
        sched = Scheduler(st)
        ops = Ops("test")
        ops.add(lambda: compaction_metrics(sched))
        sched.run_once()
        fams = {f.name: f for f in text_string_to_metric_families(ops.exposition().decode())}
        assert fams["kcompact_uncleanable_partitions"].samples[0].value == 1
        (s,) = fams["kcompact_uncleanable_partition"].samples
        assert s.labels["partition"] == "0" and s.labels["file"] == first

    # repair clears it
    code, out, err = run("repair", "--store", url, "--salvage")
    assert code == 0, err
    assert not os.path.exists(os.path.join(pdir(url, 0), "damage.json"))
    code, out, err = run("inspect", "--store", url)
    assert code == 0, err


def test_issue51_inspect_verify_reads_every_record_and_records_what_it_finds(tmp_path):
    url = str(tmp_path / "s")
    build(url)
    first = sealed(url, 1)[0]
    path = os.path.join(url, first)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(bytes(4096))  # in records a compaction would drop: only a full read sees it
    code, out, err = run("inspect", "--store", url, "--verify")
    assert code == 1 and "t-1 is damaged" in err, err
    hdr, *rows = out.splitlines()[1:]
    assert hdr.split()[-1] == "VERIFIED"
    row = {r.split()[1]: r for r in rows if r.startswith("t ")}
    assert row["0"].endswith(f"ok ({N} records)") and "problems" in row["1"]
    code, out, _ = run("inspect", "--store", url, "--json")  # remembered, without --verify
    assert code == 1
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    assert parts[1]["damaged"]["found_by"] == "inspect --verify"
    assert parts[1]["damaged"]["path"] == first and "verify" not in parts[1]
    code, out, _ = run("inspect", "--store", url, "--verify", "--json")
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    assert parts[0]["verify"] == {"ok": True, "records": N, "problems": []}
    assert not parts[1]["verify"]["ok"] and parts[1]["verify"]["problems"]


def test_issue51_a_compaction_that_rewrites_the_damaged_file_clears_the_record(tmp_path):
    url = str(tmp_path / "s")
    build(url)
    first = sealed(url, 1)[0]
    with open(os.path.join(url, first), "r+b") as f:
        f.seek(100)
        f.write(bytes(4096))  # records the compaction drops: it never reads them
    assert run("verify", "--store", url)[0] == 1  # verify records it
    assert run("inspect", "--store", url)[0] == 1
    code, _, err = run("compact", "--store", url, "--force")
    assert code == 0, err  # (the damaged records were superseded: dropped, never read)
    assert run("inspect", "--store", url)[0] == 0
    assert run("verify", "--store", url)[0] == 0


# -- (b) double faults are not silent --------------------------------------------------------------


def _double_fault(url: str) -> str:
    """After a forced compaction: partition 0's segment list and its first segment deleted."""
    code, _, err = run("compact", "--store", url, "--force")
    assert code == 0, err
    (first,) = sealed(url, 0)  # every live record is in it
    os.remove(os.path.join(url, first))
    os.remove(os.path.join(url, first[:-4] + ".bcq"))
    os.remove(os.path.join(pdir(url, 0), fn.SEGMENT_LIST))
    return first


def test_issue51_double_fault_verify_dump_and_the_endpoint_refuse_partition_0(tmp_path):
    from test_kafka_endpoint_model import Client, Served

    url = str(tmp_path / "s")
    build(url)
    _double_fault(url)
    keep1 = dumped(url, 1)
    assert len(keep1) == KEYS

    code, out, err = run("verify", "--store", url)
    assert code == 1, out
    assert any(ln.startswith(f"{fn.partition_dir(TOPIC, 0)}/segments.json: byte 0: missing, "
                             "and the partition's ledger") for ln in out.splitlines()), out
    assert "CORRUPT" in out.splitlines()[-1]

    code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", "0")
    (line,) = err.strip().splitlines()
    assert code == 1 and out == "" and line.startswith("kcompact: error: ")
    assert fn.partition_dir(TOPIC, 0) + "/" in line and f"{KEYS} records" in line, line

    srv = Served(url)
    try:
        c = Client(srv.port)
        for version in (10, 12):
            err0, *_ = c.fetch(version, 0, 1 << 20, partition=0)
            assert err0 == KAFKA_STORAGE_ERROR
            err1, hwm, start, raw = c.fetch(version, 0, 1 << 20, partition=1)
            assert (err1, hwm, start) == (0, N, 0) and raw
        assert c.list_offsets(-1, partition=0) == (KAFKA_STORAGE_ERROR, -1)
        assert c.list_offsets(-2, partition=0)[0] == KAFKA_STORAGE_ERROR
        assert c.list_offsets(-1, partition=1) == (0, N)
        c.close()
    finally:
        srv.close()
    # every reader that met it recorded it: inspect shows it
    code, out, err = run("inspect", "--store", url, "--json")
    assert code == 1
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    assert parts[0]["damaged"]["path"].endswith("segments.json")
    assert dumped(url, 1) == keep1


def test_issue51_a_forged_segment_list_is_refused(tmp_path):
    """The segment list replaced by one that agrees with the files left (the first segment
    deleted, the list rewritten without it, its checksum right): only the ledger tells."""
    url = str(tmp_path / "s")
    build(url)
    assert run("compact", "--store", url, "--force")[0] == 0
    fs = LocalBackend(url)
    d = fn.partition_dir(TOPIC, 0)
    lst = SL.read(fs, d)
    gone = lst.segments[0]
    os.remove(os.path.join(url, d, fn.base_name(gone.base) + ".log"))
    os.remove(os.path.join(url, d, fn.base_name(gone.base) + ".bcq"))
    forged = SL.SegmentList(lst.segments[1:], lst.next_offset, lst.version)
    fs.write_atomic(SL.path(d), forged.to_json())  # same version, no ledger write
    code, out, _ = run("verify", "--store", url)
    assert code == 1 and "disagrees with the partition's ledger" in out, out
    assert run("dump", "--store", url, "--topic", TOPIC, "--partition", "0")[0] == 1
    # repair rebuilds the partition (and its ledger) from what verifies
    code, _, err = run("repair", "--store", url, "--salvage")
    assert code == 0, err
    assert run("verify", "--store", url)[0] == 0


def test_issue51_the_ledger_follows_every_list_write_and_absent_means_unchecked(tmp_path):
    url = str(tmp_path / "s")
    build(url)
    fs = LocalBackend(url)
    for p in range(2):
        d = fn.partition_dir(TOPIC, p)
        led, lst = LG.read(fs, d), SL.read(fs, d)
        assert led["version"] == lst.version and led["records"] == N
        assert led["first_offset"] == 0 and led["next_offset"] == N
    assert run("compact", "--store", url, "--force")[0] == 0
    led, lst = LG.read(fs, fn.partition_dir(TOPIC, 0)), SL.read(fs, fn.partition_dir(TOPIC, 0))
    assert led["version"] == lst.version and led["records"] == KEYS
    # a store written before ledgers: no ledger, no check (the list still checks the files)
    os.remove(os.path.join(pdir(url, 0), LG.NAME))
    assert run("verify", "--store", url)[0] == 0
    assert len(dumped(url, 0)) == KEYS
    # a write brings it back
    with Store.open(url, writer="w") as st:
        st.append(RecordBatch.from_records(TOPIC, [(0, N, 10**6, b"k0", b"new")]))
        st.flush()
    assert LG.read(fs, fn.partition_dir(TOPIC, 0))["version"] == \
        SL.read(fs, fn.partition_dir(TOPIC, 0)).version
    # a damaged ledger is damage (the partition cannot be checked)
    with open(os.path.join(pdir(url, 0), LG.NAME), "r+b") as f:
        f.truncate(10)
    code, out, _ = run("verify", "--store", url)
    assert code == 1 and "damaged partition ledger" in out


# -- on S3 (the in-memory S3): the manifest's ledger --------------------------------------------------


def test_issue51_s3_lost_manifest_and_segment_are_refused(tmp_path):
    with backend_env("s3", str(tmp_path)) as fake:
        url = store_url("s3", tmp_path)
        build(url)
        assert run("compact", "--store", url, "--force")[0] == 0
        objs = fake.objects["bucket"]
        prefix = url.split("/", 3)[3]
        p0 = f"{prefix}/{fn.partition_dir(TOPIC, 0)}"
        led = json.loads(objs[f"{p0}/{LG.NAME}"][0])
        top = max(k for k in objs if k.startswith(f"{p0}/manifest/"))
        assert top.endswith(f"{fn.base_name(led['version'])}.json")
        # the newest manifest version and the segments it lists deleted: it reads as of the
        # version before, which the ledger says is not the partition's
        for e in json.loads(objs[top][0])["segments"]:
            objs.pop(f"{p0}/{e['log']}", None)
            objs.pop(f"{p0}/{e['bcq']}", None)
        del objs[top]
        from kcompact.reput.s3_cache import shared_cache, shared_spool
        shared_cache().clear()
        shared_spool().clear()
        code, out, _ = run("verify", "--store", url)
        # (a store with a catalog never wrote an empty version 1 below it: none is left)
        assert code == 1 and ("older than version" in out or "missing, and the partition's "
                                                             "ledger" in out), out
        code, _, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", "0")
        if code == 0:  # (the store catalog's copy of the lost version: served whole, not short)
            assert len(dumped(url, 0)) == KEYS
        else:
            assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert len(dumped(url, 1)) == KEYS
        # every manifest version gone too: the ledger says what it held
        for k in [k for k in objs if k.startswith(f"{p0}/manifest/")]:
            del objs[k]
        code, out, _ = run("verify", "--store", url)
        assert code == 1 and f"{KEYS} records" in out, out


# -- a model: a crash between a catalog write and its ledger's is never damage ---------------------


class Crash(BaseException):
    """A process killed at the ledger write (the catalog before it is written, the ledger not)."""


def _exists(url: str) -> bool:
    try:
        Store.open(url).close()
        return True
    except Exception:  # noqa: BLE001 - not created yet (or killed creating it)
        return False


def _crash_run(url: str, ops: list[str]) -> None:
    from kcompact.compaction import compact_store
    clock = ManualClock()
    nxt = {0: 0, 1: 0}
    st = None
    try:
        for op in ops:
            if op == "compact":
                if st is None and not _exists(url):
                    continue
                if st is not None:
                    st.close()
                    st = None
                with Store.open(url, clock=clock) as s:
                    compact_store(s, force=True, clock=clock)
                continue
            if st is None:
                st = Store.open(url, writer="w", create=not _exists(url), clock=clock)
                st.set_topic_config(TOPIC, {"segment.bytes": 16384})
            if op == "append":
                rows = [(p, nxt[p] + i, clock.ms(), b"k%d" % (i % 7), b"v" * 900)
                        for p in range(2) for i in range(12)]
                for p in range(2):
                    nxt[p] += 12
                st.append(RecordBatch.from_records(TOPIC, rows))
            elif op == "flush":
                st.flush()
            elif op == "roll":
                st.flush()
                st.roll()
        if st is not None:
            st.close()
    except Crash:
        pass
    import gc
    gc.collect()  # (the killed store's open files and locks go with it)


def test_issue51_a_crash_between_a_catalog_write_and_its_ledger_is_never_damage(tmp_path):
    """Any sequence of appends, flushes, rolls and forced compactions, killed at any ledger
    write (the catalog written, its ledger not yet): every partition opens, `verify` finds
    nothing wrong with the ledgers, and the next write brings each ledger up to its catalog.
    (A local store: the killed writer's locks stay with the copy it leaves; on S3 the same
    write-after-commit order is taken by reput/manifest.py's commit.)"""
    backend = "local"
    import shutil

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hst

    real = LG.write
    n = {"runs": 0}

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ops=hst.lists(hst.sampled_from(["append", "append", "flush", "roll", "compact"]),
                         min_size=1, max_size=10),
           crash=hst.integers(1, 40))
    def case(ops, crash):
        n["runs"] += 1
        with backend_env(backend, str(tmp_path)) as fake:
            url = (store_url(backend, tmp_path, f"c{n['runs']}") if backend == "s3"
                   else str(tmp_path / f"c{n['runs']}"))
            calls = {"n": 0}

            def write(*a, **k):
                calls["n"] += 1
                if calls["n"] == crash:
                    raise Crash()
                return real(*a, **k)
            LG.write = write
            try:
                _crash_run(url, ops + ["append", "flush"])
            finally:
                LG.write = real
            if backend == "local":
                if not os.path.exists(os.path.join(url, fn.STORE_JSON)):
                    return
                after = str(tmp_path / f"c{n['runs']}-after")
                shutil.copytree(url, after)  # (the killed process's locks are not copied)
                url = after
            else:
                from kcompact.reput.s3_cache import shared_cache, shared_spool
                shared_cache().clear()
                shared_spool().clear()
                bucket, prefix = url.split("/", 3)[2:]
                if f"{prefix}/{fn.STORE_JSON}" not in fake.objects[bucket]:
                    return
            code, out, err = run("verify", "--store", url)
            assert "ledger" not in out, (ops, crash, out)
            with Store.open(url) as s:
                for p in s.partitions(TOPIC):
                    s.partition(TOPIC, p)  # opens: no LedgerMismatchError
            _crash_run(url, ["append", "flush"])
            with Store.open(url) as s:
                for p in s.partitions(TOPIC):
                    pl = s.partition(TOPIC, p)
                    led = LG.read(s.fs, pl.dir)
                    if backend == "local":
                        assert led is not None and led["version"] == pl.seglist.version
                    elif led is not None:
                        assert led["version"] <= pl.manifest.version
    case()


def test_issue51_a_background_compaction_on_s3_reads_only_the_damage_records_it_knows_of(
        tmp_path):
    """On an object store the scheduler's first run reads every partition's damage record
    (one GET each); after that a compacted partition's record is read again only when this
    process knows it has one (it found it, or recorded it): a split of 512 partitions no longer
    GETs 1,024 keys that do not exist. A known record is still cleared by the compaction that
    rewrites the partition."""
    from kcompact.compaction import Scheduler
    from kcompact.reput import damage_record as DR
    with backend_env("s3", str(tmp_path)) as fake:
        url = store_url("s3", tmp_path)
        build(url)
        with Store.open(url) as st:
            assert DR.write(st.fs, TOPIC, 1, path_=None, position=None, reason="found earlier",
                            found_by="verify", found_ms=1)
        got = []
        real = fake.get_object

        def get_object(Bucket, Key, Range=None):
            if Key.endswith("/" + DR.NAME):
                got.append(Key.split("/")[-2])
            return real(Bucket=Bucket, Key=Key, Range=Range)
        fake.get_object = get_object

        def more(st):
            st.append(RecordBatch.from_records(TOPIC, [
                (p, st.next_offset(TOPIC, p) + i, 10**12 + i, b"k%d" % (i % KEYS), b"w" * 300)
                for p in range(2) for i in range(N)]))
            st.flush()
        with Store.open(url, writer="w") as st:
            sched = Scheduler(st)
            done = {(r.topic, r.partition) for r in sched.run_once()}
            assert done == {(TOPIC, 0), (TOPIC, 1)}
            # every partition's once (the first run's look), then 1's again after its compaction
            assert got.count("0") == 1 and got.count("1") >= 2, got
            assert DR.read(st.fs, TOPIC, 1) is None  # (cleared: nothing damaged any more)
            got.clear()
            more(st)
            assert {(r.topic, r.partition) for r in sched.run_once()} == done
            assert got == []
