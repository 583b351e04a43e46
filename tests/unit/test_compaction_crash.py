"""Crashes and I/O faults in the middle of a compaction (docs/formats/compaction-swap.md).

The store: two partitions of a few thousand records over a few hundred keys (tombstones,
keyless records, offset gaps), compacted once at T0 (so tombstones carry a clean_time), then
appended to again. The compaction under test runs at T0 + 20 s, forced, with a map of 51 keys:
dozens of rounds, so dozens of stage/commit/apply swaps, and it drops the expired tombstones.

A reference run of that compaction, uninterrupted, records the state of the store after every
swap (segment bases and the bytes of every non-empty .log and .bcq, plus each partition's
compaction horizon). A crash must leave a store that reopens (a writer's open runs the
recovery) to exactly one of those states — old or new, never a mix — and:

* ``verify_store`` is clean, no ``.compacting/`` is left;
* the live key -> (offset, latest value) map equals the model's already, before compaction is
  run again; every record is byte-identical to what was appended at its offset; keyless records
  and everything after the horizon are all there; at most one record per key up to the horizon;
* compacting again to completion gives exactly the reference's final state.

Crashes are (1) SIGKILLs of a compaction child process after a random delay, and (2)
deterministic in-process crash points: an exception raised at the N-th swap commit (staged, no
swap.json: rolled back), at the N-th apply or the K-th rename inside apply (swap.json written,
apply half done: completed), at checkpoint writes and staging-directory removals, with the
store directory copied at that instant. Then a full disk and a read error mid-compaction: the
error names the problem and the old segments stay in place.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kcompact.compaction import CompactionError, CompactionOptions, Compactor
from kcompact.reput import backend as backend_mod
from kcompact.reput import filenames as fn
from kcompact.reput import swap
from kcompact.reput.backend import BackendError, LocalBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

HERE = Path(__file__).resolve().parent
PROC = HERE / "_compact_proc.py"
_spec = importlib.util.spec_from_file_location("_compact_proc", PROC)
proc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc)

TOPIC = proc.TOPIC
T0 = 1_700_000_000_000
NOW = T0 + 20_000           # the crashing compaction's clock: batch A's tombstones have expired
RETENTION_MS = 10_000
MAP_BYTES, MAX_LOAD = 4096, 0.2  # 51 keys a round
TRIALS = 25


class Crash(Exception):
    """Stands for the process dying at this point."""


# -- the prepared store, its model, and the reference run -----------------------------------


def _scratch_root(tmp_path_factory) -> str:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="kcompact-crash-", dir="/dev/shm")
    return str(tmp_path_factory.mktemp("crash"))


def _build(d: str) -> dict[int, dict[int, Record]]:
    clock = ManualClock(T0)
    s = Store.open(d, writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "delete.retention.ms": RETENTION_MS})
    rng = random.Random(5)
    appended: dict[int, dict[int, Record]] = {0: {}, 1: {}}
    off = {0: 0, 1: 0}
    for batch in range(2):
        recs = []
        for _ in range(3000):
            p = rng.randrange(2)
            k = None if rng.random() < 0.03 else b"key-%d" % rng.randrange(400)
            v = None if rng.random() < 0.1 else b"v%d-" % off[p] * rng.randrange(1, 20)
            h = rng.choice([(), (("h", b"%d" % off[p]),)])
            r = Record(TOPIC, p, off[p], clock.ms(), k, v, h)
            recs.append(r)
            appended[p][off[p]] = r
            off[p] += rng.choice([1, 1, 1, 3])
        s.append(RecordBatch.from_records(TOPIC, recs))
        s.flush()
        if batch == 0:  # clean batch A: its tombstones get clean_time = T0
            for p in (0, 1):
                Compactor(s, CompactionOptions(offset_map_memory=1 << 20), clock) \
                    .compact_partition(TOPIC, p, force=True)
            clock.advance(1000)
    s.close()
    return appended


def fingerprint(d: str) -> dict:
    """Per partition: horizon and the exact bytes of every non-empty segment (base, .log, .bcq).
    Read with a fresh read-only store, only on a store that is not mid-swap."""
    s = Store.open(d)
    out = {}
    for p in s.partitions(TOPIC):
        pl = s.partition(TOPIC, p)
        h = hashlib.sha256()
        for seg in pl.segments:
            if seg.log_size == 0:
                continue  # a forced compaction's freshly rolled (empty) active segment
            h.update(b"%d|" % seg.base)
            h.update(s.fs.read(pl.log_path(seg.base)))
            h.update(b"|")
            h.update(s.fs.read(pl.index_path(seg.base)))
        out[p] = (swap.read_checkpoint(s.fs, pl.dir)[0], h.hexdigest())
    s.close()
    return out


class Base:
    def __init__(self, root: str):
        self.root = root
        self.dir = os.path.join(root, "base")
        self.appended = _build(self.dir)
        self.n = 0
        self.states: list[dict] = []
        self.reference()

    def copy(self) -> str:
        self.n += 1
        d = os.path.join(self.root, f"w{self.n}")
        shutil.copytree(self.dir, d)
        return d

    def reference(self) -> None:
        """The compaction without a crash: the store's state after every swap."""
        d = self.copy()
        self.states = [fingerprint(d)]
        orig = swap.apply

        def recording_apply(*a, **kw):
            orig(*a, **kw)
            self.states.append(fingerprint(d))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(swap, "apply", recording_apply)
            proc.compact(d, NOW, MAP_BYTES, MAX_LOAD)
        assert fingerprint(d) == self.states[-1]
        assert len(self.states) > 20  # many rounds, many swaps
        self.final = self.states[-1]

    def live(self, p: int) -> dict:
        latest = {}
        for o in sorted(self.appended[p]):
            r = self.appended[p][o]
            if r.key is not None:
                latest[r.key] = (o, r.value)
        return {k: v for k, v in latest.items() if v[1] is not None}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = _scratch_root(tmp_path_factory)
    try:
        yield Base(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def recover_and_check(base: Base, d: str) -> dict:
    """Open with a writer (recovery), then check the store against the model, before any new
    compaction. Returns the fingerprint of the recovered state."""
    s = Store.open(d, writer="w", clock=ManualClock(NOW))
    for p in s.partitions(TOPIC):
        pl = s.writable_partition(TOPIC, p)
        assert not s.fs.isdir(f"{pl.dir}/{fn.COMPACTING_DIR}")
        assert s.fs.listdir(swap.trash_dir(pl.dir)) == []
    rep = verify_store(s)
    assert rep.ok, [str(x) for x in rep.problems]
    for p in s.partitions(TOPIC):
        A = base.appended[p]
        h = swap.read_checkpoint(s.fs, s.partition(TOPIC, p).dir)[0]
        recs = list(s.iter_records(TOPIC, p))
        offs = [r.offset for r in recs]
        assert offs == sorted(set(offs))
        latest, seen_le_h = {}, set()
        for r in recs:
            assert A[r.offset] == r, (p, r.offset)  # bytes and offset unchanged
            if r.key is None:
                continue
            latest[r.key] = (r.offset, r.value)
            if r.offset <= h:
                assert r.key not in seen_le_h, (p, r.key, "twice at or below the horizon")
                seen_le_h.add(r.key)
        have = set(offs)
        assert all(o in have for o, r in A.items() if r.key is None or o > h)
        live = {k: v for k, v in latest.items() if v[1] is not None}
        assert live == base.live(p), p
    s.close()
    return fingerprint(d)


def finish_and_check(base: Base, d: str) -> None:
    proc.compact(d, NOW, MAP_BYTES, MAX_LOAD)
    assert fingerprint(d) == base.final
    s = Store.open(d)
    assert verify_store(s).ok
    s.close()


# -- SIGKILL at random points ---------------------------------------------------------------


class Server:
    """The fork server of _compact_proc.py (one interpreter; each trial is a forked child)."""

    def __init__(self):
        self.p = subprocess.Popen([sys.executable, str(PROC), "serve"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        assert self.readline() == "serving"

    def send(self, line: str) -> None:
        self.p.stdin.write((line + "\n").encode())

    def readline(self, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            assert left > 0, "the compaction child did not answer"
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if r:
                chunk = os.read(self.p.stdout.fileno(), 4096)
                assert chunk, f"fork server exited ({self.p.poll()})"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def test_sigkill_at_random_points(base):
    rng = random.Random(int(os.environ.get("KCOMPACT_CRASH_SEED", "20240601")))
    server = Server()
    try:
        warm = base.copy()  # loads the compiled kernels in the server, before any fork
        server.send(f"warm {warm} {NOW} {MAP_BYTES} {MAX_LOAD}")
        assert server.readline() == "warm"
        assert fingerprint(warm) == base.final
        killed_midway, kinds, recovered_at = 0, {}, set()
        for trial in range(TRIALS):
            d = base.copy()
            server.send(f"go {d} {NOW} {MAP_BYTES} {MAX_LOAD}")
            word, pid = server.readline().split()
            assert word == "ready"
            pid = int(pid)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(pid, signal.SIGKILL)  # the child is not reaped yet: the pid is still ours
            server.send(f"reap {pid}")
            lines = []
            while True:
                line = server.readline()
                assert not line.startswith("error"), line
                lines.append(line)
                if line.startswith(f"exit {pid} "):
                    break
            status = int(lines[-1].split()[2])
            finished = f"done {pid}" in lines
            if not finished:
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                killed_midway += 1
            pdirs = [os.path.join(d, fn.partition_dir(TOPIC, p)) for p in (0, 1)]
            kind = ("swap.json" if any(os.path.exists(os.path.join(x, fn.COMPACTING_DIR,
                                                                   swap.PLAN_NAME))
                                       for x in pdirs)
                    else "staging" if any(os.path.isdir(os.path.join(x, fn.COMPACTING_DIR))
                                          for x in pdirs)
                    else "between swaps")
            kinds[kind] = kinds.get(kind, 0) + 1
            state = recover_and_check(base, d)
            assert state in base.states, f"trial {trial}: a state no uninterrupted run has"
            recovered_at.add(base.states.index(state))
            finish_and_check(base, d)
            shutil.rmtree(d)
        print(f"\n{TRIALS} trials: {killed_midway} killed mid-compaction, on-disk states {kinds}, "
              f"{len(recovered_at)} distinct recovered states of {len(base.states)}")
        assert killed_midway >= TRIALS // 5
        assert len(recovered_at) >= 3
    finally:
        server.close()


# -- deterministic crash points, in-process -----------------------------------------------------


def crash_at(base: Base, target: tuple, n: int):
    """Run the compaction on a fresh copy; at the n-th call of ``target`` (object, attribute),
    copy the store directory as it is at that instant and raise Crash. Returns (the copy,
    swaps committed before the crash) or None when the compaction finished first."""
    d = base.copy()
    crash_dir = d + "-crash"
    st = {"calls": 0, "commits": 0, "fired": None}
    orig_commit = swap.commit

    def counting_commit(*a, **kw):
        r = orig_commit(*a, **kw)
        st["commits"] += 1
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(swap, "commit", counting_commit)
        obj, name = target
        orig = getattr(obj, name)

        def hooked(*a, **kw):
            st["calls"] += 1
            if st["calls"] == n and st["fired"] is None:
                shutil.copytree(d, crash_dir)
                st["fired"] = st["commits"]
                raise Crash(f"{name} #{n}")
            return orig(*a, **kw)

        mp.setattr(obj, name, hooked)
        try:
            proc.compact(d, NOW, MAP_BYTES, MAX_LOAD)
        except Crash:
            pass
    shutil.rmtree(d)
    if st["fired"] is None:
        return None
    return crash_dir, st["fired"]


def _on_disk(d: str) -> dict:
    out = {}
    for p in (0, 1):
        sdir = os.path.join(d, fn.partition_dir(TOPIC, p), fn.COMPACTING_DIR)
        out[p] = (os.path.exists(os.path.join(sdir, swap.PLAN_NAME)),
                  sorted(os.listdir(sdir)) if os.path.isdir(sdir) else None)
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 30])
def test_crash_before_commit_rolls_back(base, n):
    """Outputs staged and fsynced, no swap.json: open deletes .compacting/, the old state."""
    got = crash_at(base, (swap, "commit"), n)
    assert got is not None
    d, committed = got
    assert committed == n - 1
    disk = _on_disk(d)
    staged = [names for plan, names in disk.values() if names]
    assert staged and not any(plan for plan, _ in disk.values())
    assert any(x.endswith(".log") for names in staged for x in names)
    assert recover_and_check(base, d) == base.states[n - 1]  # rolled back
    finish_and_check(base, d)


@pytest.mark.parametrize("n", [1, 4, 25])
def test_crash_after_commit_before_apply_completes(base, n):
    got = crash_at(base, (swap, "apply"), n)
    assert got is not None
    d, committed = got
    assert committed == n
    assert any(plan for plan, _ in _on_disk(d).values())
    assert recover_and_check(base, d) == base.states[n]  # completed
    finish_and_check(base, d)


def test_crash_at_every_rename_of_the_first_swaps(base):
    """swap.json written, apply half done (some outputs renamed, some inputs still there):
    open re-runs apply, the new state."""
    half_done = 0
    for k in range(1, 25):
        got = crash_at(base, (LocalBackend, "rename"), k)
        assert got is not None
        d, committed = got
        disk = _on_disk(d)
        assert any(plan for plan, _ in disk.values()), "renames happen only after the commit"
        half_done += any(plan and any(x.endswith((".log", ".bcq")) for x in names)
                         for plan, names in disk.values())
        assert recover_and_check(base, d) == base.states[committed], k
        if k % 8 == 0:
            finish_and_check(base, d)
        shutil.rmtree(d)
    assert half_done >= 6


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_crash_at_checkpoint_write(base, n):
    got = crash_at(base, (swap, "write_checkpoint"), n)
    assert got is not None
    d, committed = got
    assert recover_and_check(base, d) == base.states[committed]
    finish_and_check(base, d)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 11])
def test_crash_at_staging_removal(base, n):
    """remove_tree runs before staging (stale leftovers) and after apply (swap.json deleted)."""
    got = crash_at(base, (LocalBackend, "remove_tree"), n)
    assert got is not None
    d, committed = got
    assert recover_and_check(base, d) == base.states[committed]
    finish_and_check(base, d)


# -- a full disk, a read error ------------------------------------------------------------------


class _OsProxy:
    """kcompact.reput.backend's ``os`` with write() failing on chosen descriptors."""

    def __init__(self, fail_fds: set, err: int, after: int):
        self.fail_fds, self.err, self.after = fail_fds, err, after
        self.writes = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if fd in self.fail_fds:
            self.writes += 1
            if self.writes >= self.after:
                raise OSError(self.err, os.strerror(self.err))
        return os.write(fd, data)


@pytest.mark.parametrize("after", [1, 40])
def test_disk_full_while_staging(base, after):
    d = base.copy()
    staged_fds: set = set()
    orig_init = backend_mod._LocalAppendFile.__init__
    committed = {"n": 0}
    orig_commit = swap.commit

    def init(self, ospath, display, *args, **kwargs):
        orig_init(self, ospath, display, *args, **kwargs)
        if f"/{fn.COMPACTING_DIR}/" in ospath:
            staged_fds.add(self._fd)

    def counting_commit(*a, **kw):
        orig_commit(*a, **kw)
        committed["n"] += 1

    s = Store.open(d, clock=ManualClock(NOW))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend_mod._LocalAppendFile, "__init__", init)
        mp.setattr(backend_mod, "os", _OsProxy(staged_fds, errno.ENOSPC, after))
        mp.setattr(swap, "commit", counting_commit)
        c = Compactor(s, proc.options(MAP_BYTES, MAX_LOAD), ManualClock(NOW))
        with pytest.raises((CompactionError, BackendError)) as ei:
            for p in s.partitions(TOPIC):
                c.compact_partition(TOPIC, p, force=True)
    msg = str(ei.value)
    # one line: what failed and where, that nothing was lost, and what to do
    assert "\n" not in msg, msg
    assert msg.startswith("cannot write ") and f"/{fn.COMPACTING_DIR}/" in msg, msg
    assert msg.endswith(": the disk is full; the compaction stopped and nothing was lost: the "
                        "old segments are still in place (its partial output in .compacting/ "
                        "is discarded); free space on the disk, then run the compaction "
                        "again"), msg
    # the failed round's inputs are in place: the store is in the state of the last swap
    assert fingerprint(d) == base.states[committed["n"]]
    assert verify_store(s).ok
    s.close()
    assert recover_and_check(base, d) == base.states[committed["n"]]
    finish_and_check(base, d)


class _FailingReader:
    """A .log stream whose reads fail with EIO past ``at`` bytes."""

    def __init__(self, f, at: int):
        self.f, self.at, self.pos = f, at, 0

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def seek(self, pos, whence=0):
        self.pos = self.f.seek(pos, whence)
        return self.pos

    def readinto(self, b):
        if self.pos + len(b) > self.at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        n = self.f.readinto(b)
        self.pos += n or 0
        return n

    def read(self, n=-1):
        if n is None or n < 0 or self.pos + n > self.at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        data = self.f.read(n)
        self.pos += len(data)
        return data


@pytest.mark.parametrize("what", ["log", "bcq"])
def test_read_error_mid_compaction(base, what):
    d = base.copy()
    orig = LocalBackend.open_read
    victim = {}

    def open_read(self, path, start=0):
        f = orig(self, path, start)
        if path.endswith(f".{what}") and "/1/" in path and not victim:
            victim["path"] = path
            return _FailingReader(f, 2000)
        return f

    orig_read = LocalBackend.read

    def read(self, path, start=0, length=None):
        # a format-2 segment's lean index is read by range (its chunks), not streamed
        if path.endswith(f".{what}") and "/1/" in path and start > 0 and not victim:
            victim["path"] = path
            raise BackendError(f"{path}: read failed: I/O error")
        return orig_read(self, path, start, length)

    s = Store.open(d, clock=ManualClock(NOW))
    before = fingerprint(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalBackend, "open_read", open_read)
        if what == "bcq":
            mp.setattr(LocalBackend, "read", read)
        c = Compactor(s, proc.options(MAP_BYTES, MAX_LOAD), ManualClock(NOW))
        with pytest.raises((CompactionError, BackendError)) as ei:
            c.compact_partition(TOPIC, 1, force=True)
    msg = str(ei.value)
    assert victim["path"] in msg and ("I/O error" in msg or "Input/output error" in msg), msg
    assert fingerprint(d) == before  # partition 1 failed in its first round: nothing replaced
    assert verify_store(s).ok
    s.close()
    assert recover_and_check(base, d) == before
    finish_and_check(base, d)
