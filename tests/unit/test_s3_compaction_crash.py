"""Crash points of a compaction on an S3 store (docs/formats/manifest.md), against the
in-memory S3: test_compaction_crash.py's store and compaction, on S3.

On S3 a compaction stages every round's outputs locally and commits one manifest version per
partition at its end (``commit_staged``), so the states a crash may leave are only: before,
partition 0 compacted, both compacted (the reference run records them). The crash points are the
S3 side of that commit: the N-th output upload, the manifest's conditional create, the removal
of the local staging after the commit, the garbage collection after it. At the crash the objects
and the compactor's local directory are copied as they are (an exception in-process would
otherwise run cleanup a killed process never runs), and the copy must:

* read as exactly one of the reference states (readers never see a partial compaction);
* after a writer's open (recovery: stale local staging removed, garbage collected with a grace
  period of 0) verify clean, list only the objects its manifest names (the dead compaction's
  uploads were orphans and are gone), and hold the model's live keys;
* compact to exactly the reference's final state.

SIGKILLs of a compaction process at random moments run on SeaweedFS in
tests/integration/test_s3_suite.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend_env  # noqa: E402

from kcompact.compaction import Compactor  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput.backend import LocalBackend  # noqa: E402
from kcompact.reput.config import ManualClock  # noqa: E402
from kcompact.reput.partition import PartitionLog  # noqa: E402
from kcompact.reput.s3 import S3Backend  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402
from kcompact.reput.verify import verify_store  # noqa: E402

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_compact_proc", HERE / "_compact_proc.py")
proc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc)
_spec = importlib.util.spec_from_file_location("_crash_local", HERE / "test_compaction_crash.py")
CC = importlib.util.module_from_spec(_spec)   # its store builder and constants (not its tests)
_spec.loader.exec_module(CC)

TOPIC, NOW, MAP_BYTES, MAX_LOAD = CC.TOPIC, CC.NOW, CC.MAP_BYTES, CC.MAX_LOAD


class Crash(Exception):
    """Stands for the process dying at this point."""


def compact(url: str, cl: str) -> None:
    """A forced compaction of every partition, as `kcompact compact --force` (_compact_proc)."""
    clock = ManualClock(NOW)
    with Store.open(url, clock=clock, commitlog_dir=cl) as store:
        c = Compactor(store, proc.options(MAP_BYTES, MAX_LOAD), clock)
        for p in store.partitions(TOPIC):
            assert c.compact_partition(TOPIC, p, force=True).skipped is None
            store.release_partition(TOPIC, p)


def fingerprint(url: str, cl: str) -> dict:
    """Per partition: the horizon and the bytes of every non-empty segment (base, .log, .bcq)."""
    out = {}
    with Store.open(url, commitlog_dir=cl) as s:
        for p in s.partitions(TOPIC):
            pl = s.partition(TOPIC, p)
            h = hashlib.sha256()
            for seg in pl.segments:
                if seg.log_size:
                    h.update(b"%d|" % seg.base + s.fs.read(seg.log_path) + b"|"
                             + s.fs.read(seg.bcq_path))
            out[p] = (pl.checkpoint()[0], h.hexdigest())
    return out


class S3Base:
    """The built store on the in-memory S3, copies of it, and the reference run's states."""

    def __init__(self, fake, root: str):
        self.fake, self.root, self.n = fake, root, 0
        self.url = "s3://bucket/base?grace_ms=0"
        Store.create(self.url).close()  # format 2: per-partition uploads, what this test crashes
        self.appended = CC._build(self.url)
        self.states = []
        url, cl = self.copy()
        self.states.append(fingerprint(url, cl))
        orig = PartitionLog.commit_staged

        def recording(pl, *a, **kw):
            ok = orig(pl, *a, **kw)
            self.states.append(fingerprint(url, cl))
            return ok
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PartitionLog, "commit_staged", recording)
            compact(url, cl)
        assert len(self.states) == 3 and len(set(map(str, self.states))) == 3
        self.final = self.states[-1]

    def copy(self, url: str | None = None, cl: str | None = None) -> tuple[str, str]:
        """A copy of the store at ``url`` (default: the built one) under a new prefix, and of
        the local directory ``cl`` of the process working on it; returns (url, local dir)."""
        self.n += 1
        src = (url or self.url).split("://", 1)[1].split("?", 1)[0].split("/", 1)[1] + "/"
        dst = f"c{self.n}/"
        objs = self.fake.objects["bucket"]
        for k in [k for k in objs if k.startswith(src)]:
            objs[dst + k[len(src):]] = objs[k]
        new_cl = os.path.join(self.root, f"cl{self.n}")
        if cl and os.path.isdir(cl):
            shutil.copytree(cl, new_cl)
        else:
            os.makedirs(new_cl)
        return f"s3://bucket/{dst[:-1]}?grace_ms=0", new_cl

    def live(self, p: int) -> dict:
        return CC.Base.live(self, p)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("s3crash"))
    with backend_env("s3", root) as fake:
        yield S3Base(fake, root)


def crash_at(base: S3Base, target: tuple, n: int):
    """Compact a fresh copy; at the n-th call of ``target`` (object, attribute) copy the store
    and the local directory as they are and raise Crash. Returns (url, local dir, partitions
    committed before the crash, calls of ``target`` before the last of those commits), or
    None when the compaction finished first."""
    url, cl = base.copy()
    st = {"calls": 0, "commits": 0, "calls_at_commit": 0, "fired": None}
    orig_commit = M.commit

    def counting(*a, **kw):
        new = orig_commit(*a, **kw)
        if new is not None:  # a manifest version was created
            st["commits"] += 1
            st["calls_at_commit"] = st["calls"]
        return new
    obj, name = target
    orig = getattr(obj, name)

    def hooked(*a, **kw):
        st["calls"] += 1
        if st["calls"] == n and st["fired"] is None:
            st["fired"] = (*base.copy(url, cl), st["commits"], st["calls_at_commit"])
            raise Crash(f"{name} #{n}")
        return orig(*a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "commit", counting)
        mp.setattr(obj, name, hooked)
        try:
            compact(url, cl)
        except Crash:
            pass
    return st["fired"]


def objects(fs, pdir: str) -> set[str]:
    """The partition's segment objects (not its manifest versions, ledger or damage record)."""
    return {n for n, _, _ in fs.list_objects(pdir) if "/" not in n
            and n not in ("ledger.json", "damage.json")}


def recover_and_check(base: S3Base, url: str, cl: str) -> dict:
    """Read the crashed store (one of the reference states), then open it with a writer
    (recovery and garbage collection) and check it against the model."""
    before = fingerprint(url, cl)
    assert before in base.states
    with Store.open(url, writer="w", clock=ManualClock(NOW), commitlog_dir=cl) as s:
        for p in s.partitions(TOPIC):
            pl = s.writable_partition(TOPIC, p)
            assert not os.path.exists(os.path.join(cl, pl.staging_dir))
            m = M.read_latest(s.fs, pl.dir)
            assert objects(s.fs, pl.dir) == m.names(), "orphans left after recovery"
        rep = verify_store(s)
        assert rep.ok, [str(x) for x in rep.problems]
        for p in s.partitions(TOPIC):
            h = s.partition(TOPIC, p).checkpoint()[0]
            latest, seen = {}, set()
            for r in s.iter_records(TOPIC, p):
                assert base.appended[p][r.offset] == r
                if r.key is None:
                    continue
                latest[r.key] = (r.offset, r.value)
                if r.offset <= h:
                    assert r.key not in seen, (p, r.key, "twice at or below the horizon")
                    seen.add(r.key)
            assert {k: v for k, v in latest.items() if v[1] is not None} == base.live(p)
    after = fingerprint(url, cl)
    assert after == before  # recovery changes no state
    return after


def finish_and_check(base: S3Base, url: str, cl: str) -> None:
    compact(url, cl)
    assert fingerprint(url, cl) == base.final


@pytest.mark.parametrize("n", [1, 2, 3, 4])  # 2 partitions x (.log, .bcq)
def test_crash_mid_upload_leaves_the_old_version(base, n):
    """Outputs partly uploaded, no commit: the manifest (and every reader) is where it was;
    the uploads are orphans that recovery deletes."""
    got = crash_at(base, (S3Backend, "upload_file"), n)
    assert got is not None
    url, cl, committed, uploaded_before = got
    fs = S3Backend.from_url(url)
    orphans = sum(len(objects(fs, f"partitions/{TOPIC}/{p}")
                      - M.read_latest(fs, f"partitions/{TOPIC}/{p}").names()) for p in (0, 1))
    assert orphans == n - 1 - uploaded_before  # this partition's uploads so far
    assert recover_and_check(base, url, cl) == base.states[committed]
    finish_and_check(base, url, cl)


@pytest.mark.parametrize("n", [1, 2])
def test_crash_at_the_manifest_commit(base, n):
    """Every output uploaded, the conditional create of the new version not done: old state."""
    got = crash_at(base, (S3Backend, "create_exclusive"), n)
    assert got is not None
    url, cl, committed, _ = got
    assert committed == n - 1
    assert recover_and_check(base, url, cl) == base.states[n - 1]
    finish_and_check(base, url, cl)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_crash_at_local_staging_removal(base, n):
    """Staging is removed before a partition's rounds and after its commit: a crash at either
    leaves local files behind, never a different state."""
    got = crash_at(base, (LocalBackend, "remove_tree"), n)
    assert got is not None
    url, cl, committed, _ = got
    assert recover_and_check(base, url, cl) == base.states[committed]
    finish_and_check(base, url, cl)


@pytest.mark.parametrize("n", [1, 2])
def test_crash_during_garbage_collection(base, n):
    """After a partition's commit its replaced segments are collected: a crash there keeps
    the new state; the garbage goes at the next collection."""
    got = crash_at(base, (S3Backend, "delete_many"), n)
    assert got is not None
    url, cl, committed, _ = got
    assert committed == n
    assert recover_and_check(base, url, cl) == base.states[n]
    finish_and_check(base, url, cl)
