"""The unit tests that take a store URL fixture, run on SeaweedFS (real S3, conftest.py).

tests/unit/_stores.py gives those tests ``store_at`` (a local store and one in the in-memory S3)
and ``shared_store_at`` (stores that child processes open too: local only there). Here both
fixtures yield stores on the session's SeaweedFS server, and the tests are imported unchanged:

* recovery after a SIGKILLed writer (test_kill_writer.py; the writer is a child process);
* the compaction planner and its CLI report (test_planner.py), the MD5-collision test;
* the KV map built from a store: bulk, catch-up, following through a compaction, an interrupted
  build, a follower SIGKILLed and resumed, the `kv build` CLI (test_kv.py);
* compaction crash points: test_s3_compaction_crash.py's states and checks, with a compaction
  *process* SIGKILLed at random moments on SeaweedFS (what the in-memory S3 cannot do).
"""

from __future__ import annotations

import importlib.util
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "unit"
sys.path.insert(0, str(UNIT))

import test_kill_writer as KW  # noqa: E402
import test_kv as KV  # noqa: E402
import test_md5_collision as MD5  # noqa: E402
import test_planner as PL  # noqa: E402
import test_s3_compaction_crash as S3CC  # noqa: E402

from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput.s3 import S3Backend  # noqa: E402
from kcompact.reput.store import Store, default_commitlog_dir  # noqa: E402


def _factory(s3_store_url):
    urls: dict[str, str] = {}

    def make(name: str = "store") -> str:
        if name not in urls:
            urls[name] = s3_store_url()
        return urls[name]
    make.backend = "s3"  # type: ignore[attr-defined]
    return make


@pytest.fixture
def store_at(s3_store_url):
    """``store_at(name)`` -> an S3 store URL on SeaweedFS (the same one for the same name)."""
    return _factory(s3_store_url)


@pytest.fixture
def shared_store_at(s3_store_url):
    return _factory(s3_store_url)


# -- the unit tests, on SeaweedFS ---------------------------------------------------------------

test_sigkilled_writer_loses_nothing_flushed = KW.test_sigkilled_writer_loses_nothing_flushed
test_md5_colliding_keys_both_survive_compaction = MD5.test_md5_colliding_keys_both_survive_compaction

test_dirty_ratio_threshold_and_filthiest_first = PL.test_dirty_ratio_threshold_and_filthiest_first
test_max_compaction_lag_forces_a_pick = PL.test_max_compaction_lag_forces_a_pick
test_dirty_small_segments_are_merged = PL.test_dirty_small_segments_are_merged
test_clean_small_segments_are_merged = PL.test_clean_small_segments_are_merged
test_compact_delete_drops_segments_older_than_retention = \
    PL.test_compact_delete_drops_segments_older_than_retention
test_delete_only_policy_never_deduplicates = PL.test_delete_only_policy_never_deduplicates
test_cli_compact_and_inspect_json = PL.test_cli_compact_and_inspect_json

test_kv_large_build_several_runs_and_batches = KV.test_large_build_several_runs_and_batches
test_kv_cross_partition_key_is_resolved_by_timestamp_then_partition = \
    KV.test_cross_partition_key_is_resolved_by_timestamp_then_partition
test_kv_empty_value_is_a_value_and_keyless_records_are_counted = \
    KV.test_empty_value_is_a_value_and_keyless_records_are_counted
test_kv_follow_store_through_appends_and_compaction = \
    KV.test_follow_store_through_appends_and_compaction
test_kv_interrupted_bulk_build_resumes_exactly = KV.test_interrupted_bulk_build_resumes_exactly
test_kv_cli_build_and_get = KV.test_cli_build_and_get
test_kv_sigkill_during_follow_then_resume_gives_the_model = \
    KV.test_sigkill_during_follow_then_resume_gives_the_model
test_kv_cli_follow_store_stops_cleanly_on_a_signal = \
    KV.test_cli_follow_store_stops_cleanly_on_a_signal


# -- a compaction process SIGKILLed at random moments ------------------------------------------


class SeaweedBase(S3CC.S3Base):
    """test_s3_compaction_crash's S3Base on SeaweedFS: copies are server-side object copies;
    every copy shares the store id, so the compaction processes (``_compact_proc.py run``,
    which opens the store as `kcompact compact` does) share one local directory, the default
    one for that id, used one at a time."""

    def __init__(self, make_url):
        self.make_url, self.n = make_url, 0
        self.url = make_url(grace_ms=0)
        Store.create(self.url).close()  # format 2: per-partition uploads, what this test crashes
        self.appended = S3CC.CC._build(self.url)
        with Store.open(self.url) as st:
            self.cl = default_commitlog_dir(st.meta.store_id)
        self.states = []
        url, cl = self.copy()
        self.states.append(S3CC.fingerprint(url, cl))
        t0 = time.monotonic()
        for p in (0, 1):  # one manifest version per partition: before, p0 done, both done
            _compact_one(url, cl, p)
            self.states.append(S3CC.fingerprint(url, cl))
        self.compaction_s = time.monotonic() - t0
        assert len(set(map(str, self.states))) == 3
        self.final = self.states[-1]

    def copy(self, url: str | None = None, cl: str | None = None) -> tuple[str, str]:
        src = S3Backend.from_url(url or self.url)
        dst_url = self.make_url(grace_ms=0)
        dst = S3Backend.from_url(dst_url)
        for name, _, _ in src.list_objects(""):
            src.client.copy_object(Bucket=dst.bucket, Key=dst._key(name),
                                   CopySource={"Bucket": src.bucket, "Key": src._key(name)})
        return dst_url, self.cl


def _compact_one(url: str, cl: str, p: int) -> None:
    from kcompact.compaction import Compactor
    from kcompact.reput.config import ManualClock
    clock = ManualClock(S3CC.NOW)
    with Store.open(url, clock=clock, commitlog_dir=cl) as st:
        Compactor(st, S3CC.proc.options(S3CC.MAP_BYTES, S3CC.MAX_LOAD), clock) \
            .compact_partition(S3CC.TOPIC, p, force=True)


def test_compaction_sigkilled_at_random_points(s3_store_url):
    base = SeaweedBase(s3_store_url)
    rng = random.Random(20251122)
    killed, seen = 0, set()
    for trial in range(4):
        url, cl = base.copy()
        p = subprocess.Popen([sys.executable, str(UNIT / "_compact_proc.py"), "run", url,
                              str(S3CC.NOW), str(S3CC.MAP_BYTES), str(S3CC.MAX_LOAD)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rng.uniform(0.0, base.compaction_s))
        finally:
            p.send_signal(signal.SIGKILL)
            out, err = p.communicate(timeout=60)
        killed += p.returncode == -signal.SIGKILL and "done" not in out
        state = S3CC.recover_and_check(base, url, cl)
        seen.add(base.states.index(state))
        S3CC.finish_and_check(base, url, cl)
        fs = S3Backend.from_url(url)
        for q in (0, 1):
            pdir = f"partitions/{S3CC.TOPIC}/{q}"
            assert S3CC.objects(fs, pdir) == M.read_latest(fs, pdir).names()
    assert killed >= 1, "every compaction finished before its kill: the kills proved nothing"
    print(f"\nkilled mid-compaction: {killed}/4, recovered states {sorted(seen)}")

