"""SIGKILL a writer process at random moments; every flushed record must survive exactly once.

The writer (``_writer_proc.py``) appends deterministic records and prints what it has flushed;
after each kill the test reopens the store with the same writer id (commit-log tail repair and
re-dispatch) and checks each partition against the generator: its offsets are exactly a prefix
of the generated sequence (no duplicate, no gap, no stray record), every record is the generated
one, and that prefix reaches at least the last flushed offset. The next trial's writer resumes
on the same store, so recoveries stack up.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kcompact.reput import _kernels as K
from kcompact.reput import filenames as fn
from kcompact.reput.record import scan
from kcompact.reput.store import Store, default_commitlog_dir

WRITER = str(Path(__file__).with_name("_writer_proc.py"))
# the writer script's generator, loaded by path (tests/unit is not a package)
_spec = importlib.util.spec_from_file_location("_writer_proc", WRITER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)
TRIALS = 8

sys.path.insert(0, str(Path(__file__).parent))
from _stores import shared_store_at  # noqa: E402,F401  (SeaweedFS in test_s3_suite.py)


def _wait_ready(proc: subprocess.Popen, out: Path, err: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_text().startswith("ready\n"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"writer exited with {proc.returncode}: {err.read_text()}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("writer did not open the store in time")


def _last_flushed(out: Path) -> dict[tuple[str, int], int]:
    """The state of the last complete ``flushed`` line (a torn last line is ignored)."""
    state: dict[tuple[str, int], int] = {}
    text = out.read_text()
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.startswith("{"):
            d = json.loads(line)["flushed"]
            state = {(k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])): v for k, v in d.items()}
    return state


def _wait_flushed(proc: subprocess.Popen, out: Path, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not _last_flushed(out):
        assert proc.poll() is None, f"writer died: {err.read_text()}"
        assert time.monotonic() < deadline, f"the writer never flushed in {timeout:.0f} s"
        time.sleep(0.05)


def _records_after_checkpoint(root: Path) -> int:
    """Whole, CRC-valid records in the commit log after the reput checkpoint (what a reopen
    must dispatch or skip), stopping at a torn or corrupt tail."""
    d = root / fn.writer_dir("w")
    segs = sorted((fn.parse_base(p.name)[0], p) for p in d.glob("*.log"))
    if not segs:
        return 0
    cp_file = d / fn.REPUT_CHECKPOINT
    cp = json.loads(cp_file.read_text())["position"] if cp_file.exists() else segs[0][0]
    n = 0
    for base, path in segs:
        buf = np.fromfile(path, dtype=np.uint8)
        if base + buf.shape[0] <= cp:
            continue
        s = scan(buf, max(cp - base, 0))
        n += len(s)
        if s.status != K.SCAN_OK:
            break
    return n


def _generated_offsets(topic: str, p: int, count: int) -> list[int]:
    out, prev = [], -1
    for _ in range(count):
        prev = W.next_offset_after(topic, p, prev)
        out.append(prev)
    return out


def _check_store(s: Store, flushed: dict[tuple[str, int], int]) -> int:
    total = 0
    for topic, nparts in W.TOPICS.items():
        for p in range(nparts):
            recs = list(s.iter_records(topic, p))
            offsets = [r.offset for r in recs]
            assert offsets == _generated_offsets(topic, p, len(recs)), (topic, p)
            for r in recs:
                assert r == W.record(topic, p, r.offset), (topic, p, r.offset)
            if (topic, p) in flushed and flushed[(topic, p)] >= 0:
                assert offsets and offsets[-1] >= flushed[(topic, p)], (
                    f"{topic}-{p}: flushed up to {flushed[(topic, p)]}, store ends at "
                    f"{offsets[-1] if offsets else None}")
            assert s.next_offset(topic, p) == (offsets[-1] + 1 if offsets else 0)
            total += len(recs)
    return total


def test_sigkilled_writer_loses_nothing_flushed(tmp_path, shared_store_at):
    root = shared_store_at("store")  # a directory here; test_s3_suite.py: on SeaweedFS
    with Store.create(str(root)) as s:
        for t in W.TOPICS:
            s.set_topic_config(t, {"segment.bytes": W.SEGMENT_BYTES})
        # the commit log: in the store, or in the writer's local directory (S3)
        cl_root = Path(root if s.fs.appendable else default_commitlog_dir(s.meta.store_id))
    rng = random.Random(20261121)
    flushed: dict[tuple[str, int], int] = {}
    total = 0
    for trial in range(TRIALS):
        out, err = tmp_path / f"out{trial}.txt", tmp_path / f"err{trial}.txt"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen([sys.executable, WRITER, str(root), str(trial),
                                     str(rng.randrange(2**32))], stdout=fo, stderr=fe)
        try:
            _wait_ready(proc, out, err)
            if trial == TRIALS - 1 and not flushed:
                # on a loaded machine every earlier kill can land before the writer's first
                # flush: the last one waits for a flush, so the trials always prove something
                _wait_flushed(proc, out, err)
            time.sleep(rng.uniform(0.05, 1.5))
            assert proc.poll() is None, f"writer died: {err.read_text()}"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        for k, v in _last_flushed(out).items():
            flushed[k] = max(flushed.get(k, -1), v)
        pending = _records_after_checkpoint(cl_root)

        with Store.open(str(root), writer="w", options=W.options(trial)) as s:
            st = s.stats
            assert st["appended"] == 0
            assert st["dispatched"] + st["skipped"] == pending, (st, pending)
            assert 0 <= st["dispatched"] <= pending
            new_total = _check_store(s, flushed)
        assert new_total >= total        # recovery never loses what an earlier trial had
        total = new_total
        # a read-only open after the recovery sees the same (and repairs nothing)
        with Store.open(str(root)) as s:
            for topic, nparts in W.TOPICS.items():
                for p in range(nparts):
                    assert s.next_offset(topic, p) >= 0
            assert _check_store(s, flushed) == total
    assert total > 0 and flushed, "the writer never flushed: the kills proved nothing"
