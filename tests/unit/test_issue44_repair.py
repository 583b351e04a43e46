"""Issue 44, "Damage stays in its partition, and a damaged partition can be repaired": the
mutation campaign as a test, and regressions named after the defects.

The campaign: every kind of file of a small store (store.json, a partition's segment list and
compaction checkpoint, sealed segments of store format 2 and 1 (.log and .bcq), the active
segment, a commit-log segment and its reput checkpoint; on S3 the manifest and the segment
objects) x every mutation (a flipped byte, a zeroed 4 KiB range, a truncation, appended bytes,
the file deleted), a file and a position drawn from a seeded generator. After each:

* ``compact --force`` compacts every partition the damage is not in, and skips the damaged
  one (or, when compaction could not see the damage, e.g. a flipped byte in a record it drops,
  compacts it into a partition that verifies);
* ``repair --salvage`` exits 0, the store then verifies, every record it holds is the pristine
  store's at that offset, a partition the damage is not in is left as it was, and the offsets
  it lost are exactly the pristine offsets inside the ranges its report gives.

The CLI runs in this process (``kcompact.connectors.cli.main``): no server, no subprocess but
the SIGKILL test's own. A default run takes one seed of each (kind, mutation) on a local store
and a representative half on the in-memory S3; ``-m slow`` runs three seeds of everything on both.
``repair --from`` (against a real `kcompact serve`) and SeaweedFS: tests/integration/
test_issue44_repair_e2e.py.

On S3 the campaign damages per-partition segment objects: its compactions upload them
(``KCOMPACT_S3_COMPACTION_OBJECTS=partition``), not one compaction object for every partition
(docs/formats/compaction-object.md); ``test_issue49_campaign_s3_compaction_objects`` damages a
store compacted into compaction objects (the default) and its objects.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

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
from kcompact.reput.repair_kinds import COMMIT_SUFFIX  # noqa: E402
from kcompact.reput.store import Store, WriterOptions  # noqa: E402

TOPIC = "t"
MUTATIONS = ("flip", "zero4k", "truncate", "append", "delete")
LOCAL_KINDS = ("store.json", "segments.json", "ledger.json", "compaction.checkpoint", "log2",
               "bcq2", "log1", "bcq1", "active.log", "active.bcq", "commitlog",
               "reput.checkpoint")
S3_KINDS = ("store.json", "manifest", "ledger", "log2", "bcq2", "log1", "bcq1")


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def build(url: str) -> None:
    """test_fuzz_store's store: two partitions, keys, headers, tombstones and keyless records
    in 16 KiB segments; the first part compacted (store format 2: Kafka batches, lean indexes;
    a checkpoint), more records after it sealed in store format 1, and an active segment."""
    from test_fuzz_store import build as fuzz_build
    fuzz_build(url)


def records(url: str, p: int) -> dict[int, dict]:
    code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", str(p),
                         "--json")
    assert code == 0, err
    return {r["offset"]: r for r in map(json.loads, out.splitlines())}


# -- the files of each kind ----------------------------------------------------------------------


def local_files(url: str) -> dict[str, list[tuple[str, int | None]]]:
    """kind -> [(store-relative path, its partition or None)]."""
    out: dict[str, list] = {k: [] for k in LOCAL_KINDS}
    out["store.json"].append((fn.STORE_JSON, None))
    fs = LocalBackend(url)
    for p in range(2):
        pdir = fn.partition_dir(TOPIC, p)
        out["segments.json"].append((f"{pdir}/{fn.SEGMENT_LIST}", p))
        out["ledger.json"].append((f"{pdir}/{LG.NAME}", p))
        out["compaction.checkpoint"].append((f"{pdir}/{fn.COMPACTION_CHECKPOINT}", p))
        segs = SL.read(fs, pdir).segments
        for i, m in enumerate(segs):
            name = f"{pdir}/{fn.base_name(m.base)}"
            if i == len(segs) - 1:
                out["active.log"].append((name + ".log", p))
                out["active.bcq"].append((name + ".bcq", p))
            elif m.records:
                out[f"log{m.format}"].append((name + ".log", p))
                out[f"bcq{m.format}"].append((name + ".bcq", p))
    for w in fs.listdir(fn.COMMITLOG_DIR):
        for name in fs.listdir(fn.writer_dir(w)):
            if name.endswith(".log"):
                out["commitlog"].append((f"{fn.writer_dir(w)}/{name}", None))
        out["reput.checkpoint"].append((fn.reput_checkpoint(w), None))
    assert all(out.values()), {k: v for k, v in out.items() if not v}
    return out


def mutate_bytes(data: bytes | None, mutation: str, rnd: random.Random) -> bytes | None:
    """The bytes after ``mutation`` (None: deleted)."""
    if mutation == "delete" or data is None:
        return None
    size = len(data)
    at = rnd.randrange(max(size, 1))
    if mutation == "append":
        return data + bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 64)))
    if mutation == "truncate":
        return data[:at]
    b = bytearray(data)
    if mutation == "flip" and size:
        b[at] ^= rnd.randint(1, 255)
    elif mutation == "zero4k" and size:
        b[at:at + 4096] = bytes(len(b[at:at + 4096]))
    return bytes(b)


def mutate_local(url: str, kind: str, mutation: str, seed: int) -> int | None:
    """Mutate a file of ``kind``; returns its partition (None: not a partition's)."""
    rnd = random.Random(f"{kind}/{mutation}/{seed}")
    rel, p = rnd.choice(local_files(url)[kind])
    path = os.path.join(url, rel)
    with open(path, "rb") as f:
        new = mutate_bytes(f.read(), mutation, rnd)
    if new is None:
        os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(new)
    return p


def s3_objects(fake, url: str) -> dict[str, list[tuple[str, int | None]]]:
    """kind -> [(bucket key, partition)] for an S3 store in the in-memory fake."""
    bucket, prefix = url.split("/", 3)[2:]
    objs = fake.objects[bucket]
    out: dict[str, list] = {k: [] for k in S3_KINDS}
    out["store.json"].append((f"{prefix}/{fn.STORE_JSON}", None))
    for p in range(2):
        pdir = f"{prefix}/{fn.partition_dir(TOPIC, p)}"
        latest = max(k for k in objs if k.startswith(f"{pdir}/manifest/") and objs[k][0])
        out["manifest"].append((latest, p))
        out["ledger"].append((f"{pdir}/{LG.NAME}", p))
        for e in json.loads(objs[latest][0])["segments"]:
            if e["records"]:
                f = e.get("format", 1)
                out[f"log{f}"].append((f"{pdir}/{e['log']}", p))
                out[f"bcq{f}"].append((f"{pdir}/{e['bcq']}", p))
    assert all(out.values()), {k: v for k, v in out.items() if not v}
    return out


def mutate_s3(fake, url: str, kind: str, mutation: str, seed: int) -> int | None:
    rnd = random.Random(f"s3/{kind}/{mutation}/{seed}")
    key, p = rnd.choice(s3_objects(fake, url)[kind])
    mutate_key(fake, key, mutation, rnd)
    return p


def mutate_key(fake, key: str, mutation: str, rnd: random.Random) -> None:
    """``mutation`` applied to the object ``key`` of the in-memory S3 (deleted when it says so),
    and this process's block cache and spool emptied (they took the objects as immutable)."""
    from kcompact.reput.s3_cache import shared_cache, shared_spool
    objs = fake.objects["bucket"]
    new = mutate_bytes(objs[key][0], mutation, rnd)
    if new is None:
        del objs[key]
    else:
        objs[key] = (new, objs[key][1])
    shared_cache().clear()
    shared_spool().clear()


# -- the invariant -------------------------------------------------------------------------------


def check_compaction(url: str, damaged: int | None, kind: str) -> None:
    code, out, err = run("compact", "--store", url, "--force", "--json")
    if kind == "store.json" and code:  # the store cannot open: nothing is compacted
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kcompact: error: ") \
            and "store.json" in lines[0], err
        return
    doc = json.loads(out)
    res = {r["partition"]: r for r in doc["partitions"]}
    assert set(res) == {0, 1}, doc
    for p, r in res.items():
        if p != damaged:  # the damage is not in it: compacted
            assert not r["damaged"] and not r["skipped"], (p, r)
    bad = [p for p, r in res.items() if r["damaged"]]
    assert bad in ([], [damaged]), (bad, damaged)
    if bad:
        lines = err.strip().splitlines()
        assert code == 1 and lines[-1].startswith("kcompact: error: ")
        assert f"{TOPIC}-{damaged} is damaged" in lines[-1], lines[-1]
        assert any(ln.startswith(f"{TOPIC}-{damaged}: damaged, not compacted: ")
                   for ln in lines), err
        for ln in lines:  # (issue 44: an error and a progress line never share a line)
            assert ln.count("compacting ") <= 1 and not (
                "damaged" in ln and "compacting " in ln), ln
    else:
        assert code == 0, err
        # compaction could not see it (a flipped byte in a record it dropped): what it wrote
        # verifies
        if damaged is not None:
            assert run("verify", "--store", url)[0] == 0 or kind in (
                "commitlog", "reput.checkpoint")


def check_salvage(url: str, pristine: dict[int, dict[int, dict]], damaged: int | None,
                  before: dict) -> dict:
    code, out, err = run("repair", "--store", url, "--salvage", "--json")
    assert code == 0, err
    doc = json.loads(out)
    code, vout, verr = run("verify", "--store", url)
    assert code == 0, (vout[-2000:], verr, doc)
    lost_ranges: dict[int, list] = {0: [], 1: []}
    for e in doc["repaired"]:
        lost_ranges[e["partition"]] += [(x["first"], x["last"]) for x in e["lost"]]
    for p in range(2):
        got = records(url, p)
        want = pristine[p]
        for off, r in got.items():  # every record kept is the pristine one
            assert want.get(off) == r, (p, off)
        missing = set(want) - set(got)
        covered = {o for o in want
                   if any(a <= o and (b is None or o <= b) for a, b in lost_ranges[p])}
        assert missing == covered, (p, sorted(missing)[:20], sorted(covered)[:20],
                                    lost_ranges[p])
        if p != damaged and not doc["store_json"]:
            assert p not in {e["partition"] for e in doc["repaired"]}, doc
            assert partition_files(url, p) == before[p]
    return doc


def partition_files(url: str, p: int) -> dict[str, bytes]:
    d = os.path.join(url, fn.partition_dir(TOPIC, p))
    out = {}
    for name in sorted(os.listdir(d)):
        # (damage.json: what a finder recorded, repair's own verify among them: issue 51)
        if os.path.isfile(os.path.join(d, name)) and not name.endswith(".lock") \
                and name != "damage.json":
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out


@pytest.fixture(autouse=True)
def _per_partition_objects(monkeypatch):
    """(The module docstring's last paragraph.)"""
    monkeypatch.setenv("KCOMPACT_S3_COMPACTION_OBJECTS", "partition")


@pytest.fixture(scope="module")
def pristine_local(tmp_path_factory):
    root = tmp_path_factory.mktemp("issue44")
    url = str(root / "store")
    build(url)
    return url, {p: records(url, p) for p in range(2)}


def _local_cases(seeds: int):
    return [(k, m, s) for k in LOCAL_KINDS for m in MUTATIONS for s in range(seeds)]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind,mutation,seed", [
    *_local_cases(1),
    *[pytest.param(k, m, s, marks=SLOW) for k, m, s in _local_cases(3) if s > 0]])
def test_issue44_campaign_local(pristine_local, tmp_path, kind, mutation, seed):
    url0, pristine = pristine_local
    url = str(tmp_path / "store")
    shutil.copytree(url0, url)
    damaged = mutate_local(url, kind, mutation, seed)
    mutated = str(tmp_path / "mutated")
    shutil.copytree(url, mutated)
    check_compaction(url, damaged, kind)
    before = {p: partition_files(mutated, p) for p in range(2)}
    check_salvage(mutated, pristine, damaged, before)


def check_s3_salvage(fake, url: str, pristine: dict[int, dict[int, dict]], kind: str,
                     mutation: str, damaged: int | None) -> dict:
    """``repair --salvage`` of the S3 store as the mutation left it: exit 0, the store then
    verifies, every record it holds is the pristine store's, and the offsets it lost are
    exactly the pristine offsets inside the ranges its report gives."""
    objs = fake.objects["bucket"]
    from kcompact.reput.s3_cache import shared_cache, shared_spool
    shared_cache().clear()
    shared_spool().clear()
    named = []
    if (kind, mutation) == ("manifest", "delete"):
        # a deleted newest manifest version cannot be told from one never committed (the
        # partition reads as of the version before, which verifies): nothing finds it, but
        # a repair of the partition named recovers what the lost version listed from its
        # segment objects (reput/salvage.py, orphans)
        named = ["--topic", TOPIC, "--partition", str(damaged)]
    code, out, err = run("repair", "--store", url, "--salvage", "--json", *named)
    assert code == 0, err
    doc = json.loads(out)
    if named:
        assert doc["repaired"] and not doc["repaired"][0]["lost"], doc
    code, vout, verr = run("verify", "--store", url)
    assert code == 0, (vout[-2000:], verr, doc)
    for p in range(2):
        got = records(url, p)
        ranges = [(x["first"], x["last"]) for e in doc["repaired"] if e["partition"] == p
                  for x in e["lost"]]
        for off, r in got.items():
            assert pristine[p].get(off) == r, (p, off)
        missing = set(pristine[p]) - set(got)
        assert missing == {o for o in pristine[p] if any(
            a <= o and (b is None or o <= b) for a, b in ranges)}, (p, ranges)
    if doc["quarantine"]:
        prefix = url.split("/", 3)[3]
        assert any(k.startswith(f"{prefix}/{doc['quarantine']}/") for k in objs)
    return doc


def _s3_cases(seeds: int, every: int):
    cases = [(k, m, s) for k in S3_KINDS for m in MUTATIONS for s in range(seeds)]
    return [c for i, c in enumerate(cases) if i % every == 0]


@pytest.mark.parametrize("kind,mutation,seed", [
    *_s3_cases(1, 2),
    *[pytest.param(k, m, s, marks=SLOW) for k, m, s in _s3_cases(3, 1)
      if (k, m, s) not in _s3_cases(1, 2)]])
def test_issue44_campaign_s3(tmp_path, kind, mutation, seed):
    with backend_env("s3", tmp_path) as fake:
        url = store_url("s3", tmp_path)
        Store.create(url).close()  # per-partition uploads: the segment objects it damages
        build(url)
        pristine = {p: records(url, p) for p in range(2)}
        damaged = mutate_s3(fake, url, kind, mutation, seed)
        objs = fake.objects["bucket"]
        snap = dict(objs)
        check_compaction(url, damaged, kind)
        objs.clear()
        objs.update(snap)  # the salvage runs on the store as the mutation left it
        check_s3_salvage(fake, url, pristine, kind, mutation, damaged)


# -- compaction objects (issue 49): a run's partitions in one object ---------------------------


def _compaction_object_keys(fake, url: str) -> list[str]:
    bucket, prefix = url.split("/", 3)[2:]
    return sorted(k for k in fake.objects[bucket]
                  if k.startswith(f"{prefix}/{fn.COMPACTED_DIR}/") and k.endswith(".kco"))


@pytest.mark.parametrize("kind,mutation", [
    *[("manifest", m) for m in ("flip", "truncate", "delete")],
    *[("object", m) for m in MUTATIONS]])
def test_issue49_campaign_s3_compaction_objects(tmp_path, monkeypatch, kind, mutation):
    """A store compacted the default way on S3 (one compaction object per run for every
    partition): the newest manifest version of a partition damaged, or the compaction object
    itself. Salvage reads the segments the readable manifest version places in the object (once
    taken for missing: a manifest damage lost every compacted record of the partition), and
    loses exactly what the damage took."""
    monkeypatch.setenv("KCOMPACT_S3_COMPACTION_OBJECTS", "store")
    with backend_env("s3", tmp_path) as fake:
        url = store_url("s3", tmp_path)
        Store.create(url).close()
        build(url)
        assert _compaction_object_keys(fake, url)  # (else the case tests nothing)
        pristine = {p: records(url, p) for p in range(2)}
        if kind == "manifest":
            damaged = mutate_s3(fake, url, "manifest", mutation, 0)
        else:
            rnd = random.Random(f"kco/{mutation}")
            mutate_key(fake, rnd.choice(_compaction_object_keys(fake, url)), mutation, rnd)
            damaged = None
        doc = check_s3_salvage(fake, url, pristine, kind, mutation, damaged)
        if kind == "manifest" and mutation != "delete":
            # the damaged version's segments past the compacted ones: what the report says;
            # the compacted records themselves are all kept
            (e,) = [e for e in doc["repaired"] if e["partition"] == damaged]
            assert all(x["last"] is None for x in e["lost"]), e


# -- double faults (issue 51): pairs of files of one partition deleted or truncated together -------
#
# Losing the segment list *and* the segments it named, or either with a forged replacement,
# must never read as a shorter partition: ``verify`` exits 1, and ``dump`` of the partition
# either refuses it (exit 1, one error line) or prints exactly the pristine records; the other
# partition dumps as it was. The ledger (reput/ledger.py) is what tells the list's loss apart.

PAIR_KINDS = ("segments.json", "ledger.json", "log2", "bcq2", "log1", "bcq1", "active.log",
              "active.bcq")


def _pair_cases():
    import itertools
    pairs = list(itertools.combinations(PAIR_KINDS, 2))
    cases = [(a, b, m) for a, b in pairs for m in ("delete", "truncate")]
    # by default the pairs with the segment list or the ledger (the double faults); -m slow: all
    return [c if c[0] in ("segments.json", "ledger.json") else pytest.param(*c, marks=SLOW)
            for c in cases] + [pytest.param("forge", "log2", "delete"),
                               pytest.param("forge", "log1", "delete")]


def _mutate_pair(url: str, a: str, b: str, mutation: str) -> None:
    files = local_files(url)
    rnd = random.Random(f"pair/{a}/{b}/{mutation}")
    if a == "forge":  # a segment gone, the list rewritten without it (its checksum right)
        rel, p = next(f for f in files[b] if f[1] == 0)
        pdir = fn.partition_dir(TOPIC, 0)
        fs = LocalBackend(url)
        lst = SL.read(fs, pdir)
        base = fn.parse_base(os.path.basename(rel))[0]
        os.remove(os.path.join(url, rel))
        os.remove(os.path.join(url, rel[:-4] + fn.INDEX_SUFFIX))
        fs.write_atomic(SL.path(pdir), SL.SegmentList(
            [m for m in lst.segments if m.base != base], lst.next_offset, lst.version).to_json())
        return
    for kind in (a, b):
        rel, _p = next(f for f in files[kind] if f[1] == 0)
        path = os.path.join(url, rel)
        with open(path, "rb") as f:
            new = mutate_bytes(f.read(), mutation, rnd)
        if new is None:
            os.remove(path)
        else:
            with open(path, "wb") as f:
                f.write(new)


@pytest.mark.parametrize("a,b,mutation", _pair_cases())
def test_issue51_pairs_of_files_lost_together_are_never_served_short(pristine_local, tmp_path,
                                                                     a, b, mutation):
    url0, pristine = pristine_local
    url = str(tmp_path / "store")
    shutil.copytree(url0, url)
    _mutate_pair(url, a, b, mutation)
    code, out, _ = run("verify", "--store", url)
    assert code == 1, out[-2000:]
    assert any(fn.partition_dir(TOPIC, 0) in ln for ln in out.splitlines()[:-1]), out[-2000:]
    code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", "0",
                         "--json")
    if code == 0:  # (what it serves is whole)
        assert {r["offset"]: r for r in map(json.loads, out.splitlines())} == pristine[0]
    else:
        (line,) = err.strip().splitlines()
        assert code == 1 and line.startswith("kcompact: error: ") and \
            fn.partition_dir(TOPIC, 0) in line, err
    assert records(url, 1) == pristine[1]


@pytest.mark.parametrize("a,b", [("manifest", "log2"), ("manifest", "bcq1"),
                                 ("ledger", "log1")])
def test_issue51_s3_pairs_of_objects_lost_together_are_never_served_short(tmp_path, a, b):
    with backend_env("s3", tmp_path) as fake:
        url = store_url("s3", tmp_path)
        build(url)
        pristine = {p: records(url, p) for p in range(2)}
        objs = fake.objects["bucket"]
        kinds = s3_objects(fake, url)
        if a == "manifest":  # every version of it: the partition has no manifest left
            key = next(k for k, p in kinds[a] if p == 0)
            for k in [k for k in objs if k.startswith(key.rsplit("/", 1)[0] + "/")]:
                del objs[k]
        else:
            del objs[next(k for k, p in kinds[a] if p == 0)]
        del objs[next(k for k, p in kinds[b] if p == 0)]
        from kcompact.reput.s3_cache import shared_cache, shared_spool
        shared_cache().clear()
        shared_spool().clear()
        code, out, _ = run("verify", "--store", url)
        assert code == 1, out[-2000:]
        code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", "0",
                             "--json")
        if code == 0:
            assert {r["offset"]: r for r in map(json.loads, out.splitlines())} == pristine[0]
        else:
            assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert records(url, 1) == pristine[1]


# -- a repair killed: the old partition or the repaired one, never a mix ---------------------------

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")


def _big_store(url: str, n: int = 60_000) -> None:
    """Two partitions of ``n`` records (~250 bytes) in 1 MiB format-1 segments."""
    clock = ManualClock()
    with Store.open(url, writer="w", create=True, clock=clock,
                    options=WriterOptions(seal_format=1)) as s:
        s.set_topic_config(TOPIC, {"segment.bytes": 1 << 20})
        for a in range(0, n, 10_000):
            s.append(RecordBatch.from_records(TOPIC, [
                (p, i, 1000 + i, b"k%d" % (i % 5000), b"%d-" % i + b"x" * 230)
                for p in range(2) for i in range(a, min(n, a + 10_000))]))
        s.flush()


def _flip_in_partition(url: str, p: int, seg: int, at: int) -> None:
    d = os.path.join(url, fn.partition_dir(TOPIC, p))
    logs = sorted(x for x in os.listdir(d) if x.endswith(".log"))
    with open(os.path.join(d, logs[seg]), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _state(url: str) -> tuple[dict, dict]:
    return partition_files(url, 0), partition_files(url, 1)


def test_issue44_sigkill_during_repair_leaves_the_old_or_the_repaired_partition(tmp_path):
    base = str(tmp_path / "base")
    _big_store(base, n=40_000)
    _flip_in_partition(base, 0, 3, 5000)
    old0, old1 = partition_files(base, 0), partition_files(base, 1)
    # the reference: the repaired partition an uninterrupted run leaves
    ref = str(tmp_path / "ref")
    shutil.copytree(base, ref)
    proc = subprocess.run([KCOMPACT, "repair", "--store", ref, "--salvage"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(records(ref, 0)) == 40_000 - 1  # one format-1 record lost to the flipped byte
    new0 = _logs(ref)  # (the same records in the same segments: the same bytes)
    outcomes = {"old": 0, "repaired": 0}
    pdir = fn.partition_dir(TOPIC, 0)
    # The kill points are states the run is seen in, not fractions of a wall time (a slower
    # machine moved every timed kill past the commit): as soon as its staging of partition 0
    # shows (nothing committed yet), then 5-80 ms into the staging, then as soon as its commit
    # marker shows (the swap committed, maybe not finished).
    points = [("staged", 0.0), ("staged", 0.0), ("staged", 0.005), ("staged", 0.02),
              ("staged", 0.08), ("commit", 0.0), ("commit", 0.0), ("commit", 0.001)]
    for k, (state, delay) in enumerate(points):
        url = str(tmp_path / f"k{k}")
        shutil.copytree(base, url)
        p = subprocess.Popen([KCOMPACT, "repair", "--store", url, "--salvage"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pattern = os.path.join(url, fn.REPAIR_DIR, "*", pdir + (COMMIT_SUFFIX if state == "commit"
                                                                  else ""))
        deadline = time.monotonic() + 120
        while p.poll() is None and not glob.glob(pattern):
            assert time.monotonic() < deadline, f"the repair never reached {state}"
            time.sleep(0.0005)
        if delay:
            time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        with Store.open(url):  # an open finishes a committed swap, drops an uncommitted one
            pass
        assert not os.path.exists(os.path.join(url, fn.REPAIR_DIR))
        assert partition_files(url, 1) == old1  # (the damage is not in it: never touched)
        if partition_files(url, 0) == old0:
            outcomes["old"] += 1
            assert run("verify", "--store", url)[0] == 1
        else:
            outcomes["repaired"] += 1
            assert run("verify", "--store", url)[0] == 0
            assert _logs(url) == new0
            qd = os.path.join(url, fn.QUARANTINE_DIR)
            (run_dir,) = os.listdir(qd)
            assert partition_files(os.path.join(qd, run_dir), 0) == old0  # the evidence
        # and a repair run again ends repaired
        code, _, err = run("repair", "--store", url, "--salvage")
        assert code == 0, err
        assert _logs(url) == new0 and run("verify", "--store", url)[0] == 0
    assert outcomes["old"] and outcomes["repaired"], outcomes


def _logs(url: str) -> dict[str, bytes]:
    return {k: v for k, v in partition_files(url, 0).items() if k.endswith(".log")}


@pytest.mark.parametrize("crash_at", ["staged", "committed", "exchanged", "moved_aside"])
def test_issue44_every_crash_state_of_the_swap_recovers_on_open(tmp_path, crash_at):
    """The on-disk states a kill leaves around the commit point (reput/quarantine.py), made
    here step by step: an open completes a committed swap and drops an uncommitted one."""
    from kcompact.reput import quarantine as Q
    from kcompact.reput import repair_kinds as RK  # (the local swap's steps)
    url = str(tmp_path / "s")
    _big_store(url, n=3000)
    _flip_in_partition(url, 0, 0, 300)
    old0 = partition_files(url, 0)
    st = Store.open(url)
    run_ = Q.RepairRun(st.fs, st.local_fs, st.clock, report={"mode": "salvage"})
    staged = run_.stage(TOPIC, 0, st.secret, st.topic_config(TOPIC))
    from kcompact.reput.salvage import salvage_partition
    got = salvage_partition(st.fs, TOPIC, 0, st.secret,
                            lambda buf, s: staged.log.append(buf, s, 0, len(s)))
    staged.log.sync()
    staged.log.close(publish=False)
    pdir = fn.partition_dir(TOPIC, 0)
    entry = {"topic": TOPIC, "partition": 0,
             "quarantine": f"{Q.quarantine_dir(run_.run)}/{pdir}"}
    if crash_at != "staged":
        RK._commit_local(st.fs, run_.stage_fs, run_.run, TOPIC, 0, entry)
        staged_dir = RK._staged_dir(run_.run, TOPIC, 0)
        if crash_at == "exchanged":
            assert RK._exchange(st.fs, pdir, staged_dir)
        elif crash_at == "moved_aside":  # (the two-rename path: the old one aside first)
            st.fs.rename(pdir, entry["quarantine"])
    run_._lock.release()  # the run dies here (its lock goes with the process)
    st.close()
    with Store.open(url):
        pass
    assert not os.path.exists(os.path.join(url, fn.REPAIR_DIR))
    if crash_at == "staged":
        assert partition_files(url, 0) == old0
    else:
        assert run("verify", "--store", url)[0] == 0
        assert len(records(url, 0)) == got.kept
        assert partition_files(os.path.join(url, entry["quarantine"]).rsplit(
            "/partitions/", 1)[0], 0) == old0


# -- regressions: what the issue measured ---------------------------------------------------------


def _three_partitions(tmp_path) -> str:
    sys.path.insert(0, os.path.dirname(__file__))
    from test_cli import keyed_store
    return keyed_store(tmp_path, partitions=3)


def _truncate_a_sealed_log(url: str, p: int) -> str:
    d = os.path.join(url, fn.partition_dir(TOPIC, p))
    name = sorted(x for x in os.listdir(d) if x.endswith(".log"))[-2]
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, name)) - 100)
    return name


def test_issue44_one_damaged_partition_does_not_stop_the_others(tmp_path):
    url = _three_partitions(tmp_path)
    name = _truncate_a_sealed_log(url, 0)
    code, out, err = run("compact", "--store", url, "--force")
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("kcompact: error: t-0 is damaged"), err
    assert name in lines[-1] and "kcompact repair" in lines[-1]
    assert [ln for ln in lines if ln.startswith("kcompact: error: ")] == lines[-1:]
    skip = next(ln for ln in lines if ln.startswith("t-0: damaged, not compacted: "))
    assert name in skip and "byte" in skip
    # every line is one thing: the damage line and the next partition's progress apart
    assert lines[lines.index(skip) + 1] == "compacting t-1 (forced)", lines
    assert "t-1 (forced): 1 rounds" in out and "t-2 (forced): 1 rounds" in out
    with Store.open(url) as st:  # the others compacted: their checkpoints moved
        assert st.partition(TOPIC, 1).checkpoint()[0] >= 0
        assert st.partition(TOPIC, 2).checkpoint()[0] >= 0


def test_issue44_inspect_shows_every_partition_and_marks_the_damaged(tmp_path):
    url = _three_partitions(tmp_path)
    name = _truncate_a_sealed_log(url, 0)
    code, out, err = run("inspect", "--store", url)
    assert code == 1 and name in err.strip().splitlines()[-1]
    rows = out.splitlines()[2:]
    assert rows[0].split()[:2] == ["t", "0"] and rows[0].endswith("DAMAGED (below)")
    assert [r.split()[:3] for r in rows[1:3]] == [["t", "1", "9"], ["t", "2", "9"]]
    assert rows[3].startswith("t-0: DAMAGED: ") and name in rows[3]
    code, out, err = run("inspect", "--store", url, "--json")
    assert code == 1
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    assert parts[0]["damaged"]["path"].endswith(name)
    assert parts[0]["damaged"]["position"] is not None and parts[0]["damaged"]["reason"]
    assert parts[1]["damaged"] is None and parts[1]["records"] == 400


def test_issue44_the_scheduler_skips_a_damaged_partition_and_counts_it(tmp_path, capsys):
    from prometheus_client.parser import text_string_to_metric_families

    from kcompact.compaction import Scheduler
    from kcompact.replication.ops import Ops, compaction_metrics
    url = _three_partitions(tmp_path)
    name = _truncate_a_sealed_log(url, 0)
    with Store.open(url) as st:
        sched = Scheduler(st)
        ops = Ops("test")
        ops.add(lambda: compaction_metrics(sched))
        res = sched.run_once()
        assert sorted(r.partition for r in res) == [1, 2] and not sched.errors
        sched.run_once()  # said once, not at every run
        err = capsys.readouterr().err
        assert err.count("t-0: damaged, not compacted") == 1 and name in err
        fams = {f.name: f for f in text_string_to_metric_families(ops.exposition().decode())}
        assert fams["kcompact_uncleanable_partitions"].samples[0].value == 1
        (s,) = fams["kcompact_uncleanable_partition"].samples
        assert s.labels["partition"] == "0" and s.labels["file"].endswith(name)
    code, _, err = run("repair", "--store", url, "--salvage")
    assert code == 0, err
    with Store.open(url) as st:
        sched2 = Scheduler(st)
        sched2.uncleanable = sched.uncleanable  # (the same process, after the repair)
        sched2.run_once()
        assert len(sched2.uncleanable) == 0


def test_issue44_kv_build_and_restore_refuse_a_topic_with_a_damaged_partition(tmp_path):
    url = _three_partitions(tmp_path)
    name = _truncate_a_sealed_log(url, 2)
    db = str(tmp_path / "db")
    code, _, err = run("kv", "build", "--store", url, "--topic", TOPIC, "--db", db)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith("kcompact: error: kv build refuses topic 't'")
    assert "t-2" in line and name in line and not os.path.exists(db)
    # before a producer is made: the broker named is never contacted
    code, _, err = run("restore", "--store", url, "--topic", TOPIC, "--bootstrap-servers",
                       "127.0.0.1:1", "--to-topic", "t2")
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith("kcompact: error: restore refuses topic 't'"), line
    assert "t-2" in line and name in line


def test_issue44_repair_usage_and_nothing_to_repair(tmp_path):
    url = _three_partitions(tmp_path)
    with pytest.raises(SystemExit) as ei:
        with contextlib.redirect_stderr(io.StringIO()):
            main(["repair", "--store", url])
    assert ei.value.code == 2
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            main(["repair", "--store", url, "--salvage", "--partition", "1"])
    code, out, _ = run("repair", "--store", url, "--salvage")
    assert code == 0 and out.startswith("nothing to repair")
    assert not os.path.exists(os.path.join(url, fn.QUARANTINE_DIR))
    # a partition named is repaired whether or not it is damaged: nothing is lost
    before = records(url, 1)
    code, out, err = run("repair", "--store", url, "--salvage", "--topic", TOPIC,
                         "--partition", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [e["partition"] for e in doc["repaired"]] == [1] and not doc["repaired"][0]["lost"]
    assert records(url, 1) == before
    report = json.loads(open(os.path.join(url, doc["report"])).read())
    assert report["partitions"][0]["partition"] == 1 and report["mode"] == "salvage"


# -- S3 stores whose partitions are still parts of shared objects (issue 49) ----------------------


def build_shared(url: str, cl: str) -> None:
    """Two partitions written by shared uploads (a new S3 store's default), four flushes, not
    compacted: every record is in a part of a shared object (docs/formats/shared-upload.md)."""
    rnd = random.Random(49)
    nxt = [0, 0]
    with Store.open(url, writer="w", create=True, commitlog_dir=cl) as st:
        for _ in range(4):
            rows = []
            for p in range(2):
                for _ in range(60):
                    key = None if rnd.random() < 0.05 else b"k%d" % rnd.randrange(40)
                    value = None if key is not None and rnd.random() < 0.1 else \
                        bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))
                    rows.append((p, nxt[p], 1_000 + nxt[p], key, value,
                                 [("h", b"x")] if rnd.random() < 0.2 else []))
                    nxt[p] += 1
            st.append(RecordBatch.from_records(TOPIC, rows))
            st.flush()


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_issue49_campaign_s3_shared_objects(tmp_path, mutation, seed):
    """A shared object damaged (each mutation, a seeded position) while the partitions are
    still its parts: ``compact --force`` compacts what the damage is not in and refuses the
    damaged partition (never copies a damaged batch into a segment), ``repair --salvage``
    keeps every record that verifies and says exactly which offsets it lost, and the store then
    verifies."""
    with backend_env("s3", tmp_path) as fake:
        url = store_url("s3", tmp_path)
        build_shared(url, str(tmp_path / "cl"))
        pristine = {p: records(url, p) for p in range(2)}
        objs = fake.objects["bucket"]
        rnd = random.Random(f"kso/{mutation}/{seed}")
        mutate_key(fake, rnd.choice(sorted(k for k in objs if k.endswith(".kso"))), mutation, rnd)
        snap = dict(objs)
        code, out, err = run("compact", "--store", url, "--force", "--json")
        doc = json.loads(out)
        if code == 0:  # the damage was in nothing a record needs (e.g. the footer)
            assert run("verify", "--store", url)[0] == 0
        else:
            assert all(r["damaged"] or not r["skipped"] for r in doc["partitions"]), doc
        objs.clear()
        objs.update(snap)  # the salvage runs on the store as the mutation left it
        doc = check_s3_salvage(fake, url, pristine, "shared", mutation, None)
        # and it stays repaired: a forced compaction then splits what is left, and what it
        # keeps is still the pristine records at their offsets
        code, out, err = run("compact", "--store", url, "--force")
        assert code == 0, err
        assert run("verify", "--store", url)[0] == 0
        for p in range(2):
            got = records(url, p)
            assert got and all(pristine[p].get(o) == r for o, r in got.items()), p
