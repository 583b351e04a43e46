"""The store and compaction model tests (test_store_model.py, test_compaction_model.py) on an S3
store, against the in-memory S3 (``_fake_s3.FakeS3``); tests/integration/test_s3.py runs them
against SeaweedFS.

What differs on S3, and so is checked differently here: a reader in another process sees a
writer's records once they are flushed (``read_only_view_next_to_the_writer`` flushes first);
the active segments are the writer's local, unflushed ones (several, or none), so compaction
without ``force`` may rewrite every flushed segment, ``force`` seals the local ones first, and
"the active segment is untouched" means the local files are.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis.stateful import rule, run_state_machine_as_test

sys.path.insert(0, os.path.dirname(__file__))

import test_compaction_model as CM  # noqa: E402
import test_store_model as SM  # noqa: E402
from _fake_s3 import FakeS3  # noqa: E402

from kcompact.reput import bcq as B  # noqa: E402
from kcompact.reput import bcq2 as B2  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput.s3 import BlockCache, S3Backend, Spool  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402
from kcompact.reput.verify import verify_store  # noqa: E402


def s3_backend_factory():
    """(new S3Backend on a fresh in-memory S3, its URL, a cleanup)."""
    tmp = tempfile.mkdtemp(prefix="kcompact-s3model-")
    old = os.environ.get("KCOMPACT_CACHE_DIR")
    os.environ["KCOMPACT_CACHE_DIR"] = os.path.join(tmp, "cache")
    fs = S3Backend("bucket", "m", client=FakeS3(), grace_ms=0, cache=BlockCache(32 << 20, 1 << 16),
                   spool=Spool(64 << 20, os.path.join(tmp, "spool")))

    def cleanup():
        if old is None:
            os.environ.pop("KCOMPACT_CACHE_DIR", None)
        else:
            os.environ["KCOMPACT_CACHE_DIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
    return fs, "s3://bucket/m", cleanup


def check_manifests(store: Store, fs) -> None:
    """Every partition's manifest matches its objects: sizes, counts, offsets and bitmaps."""
    for t in store.topics():
        for p in store.partitions(t):
            m = M.read_latest(fs, f"partitions/{t}/{p}")
            if m is None:
                continue
            prev = -1
            for e in m.segments:
                pdir = f"partitions/{t}/{p}"
                assert fs.size(f"{pdir}/{e.log}") == e.log_size
                raw = fs.read(f"{pdir}/{e.bcq}")
                assert len(raw) == e.bcq_size
                if B2.is_lean(raw):  # format 2 (bcq-v2.md): checksummed chunks
                    lean = B2.LeanIndex(lambda s, n: raw[s:s + n], e.bcq, len(raw))
                    assert lean.n == e.records and lean.log_size == e.log_size
                    offs = lean.entries["offset"]
                else:
                    idx = np.frombuffer(raw, np.uint8)
                    assert idx.shape[0] == 48 * e.records
                    offs = B.view(idx)["offset"]
                assert offs.tolist() == e.offset_array().tolist()
                if e.records:
                    assert e.first_offset == int(offs[0]) > prev and e.first_offset >= e.base
                    assert e.last_offset == int(offs[-1])
                    prev = e.last_offset
            assert m.next_offset >= prev + 1


class S3StoreMachine(SM.StoreMachine):
    """StoreMachine on an S3 store (module docstring)."""

    backend_factory = staticmethod(s3_backend_factory)

    def __init__(self):
        fs, url, self._cleanup = self.backend_factory()
        self.tmp = None
        self.fs, self.url = fs, url
        super(SM.StoreMachine, self).__init__()  # RuleBasedStateMachine.__init__
        created = Store.create(self.url, fs=self.fs)
        for t in SM.TOPICS:
            created.set_topic_config(t, {"segment.bytes": SM.SEGMENT_BYTES})
        created.close()
        self.store = Store.open(self.url, fs=self.fs, writer="w")
        self.model = {(t, p): {} for t in SM.TOPICS for p in SM.PARTS}
        self.stats = {"appended": 0, "dispatched": 0, "skipped": 0}

    @rule()
    def read_only_view_next_to_the_writer(self):
        self.store.flush()  # another process sees what the writer flushed
        super().read_only_view_next_to_the_writer()

    def teardown(self):
        try:
            self.store.close()
            ro = Store.open(self.url, fs=self.fs)
            self.check_all(ro)
            assert verify_store(ro).ok
            check_manifests(ro, self.fs)
        finally:
            self._cleanup()


class S3CompactionMachine(CM.CompactionMachine):
    """CompactionMachine on an S3 store (module docstring)."""

    backend_factory = staticmethod(s3_backend_factory)

    def __init__(self):
        super().__init__()
        self.fs, self.url, self._cleanup = self.backend_factory()
        # per-partition uploads (what this model checks): a store created without a writer is
        # format 2, so the writer's default upload "auto" uploads per partition
        Store.create(self.url, fs=self.fs).close()

    def teardown(self):
        try:
            super().teardown()
        finally:
            self._cleanup()

    def snapshot(self) -> dict:
        out = {}
        for p in self.store.partitions(CM.TOPIC):
            pl = self.store.partition(CM.TOPIC, p)
            segs, kinds = [], []
            for seg in pl.segments:
                e = seg.entries()
                segs.append((seg.base, seg.log_size,
                             int(e["timestamp"].max()) if e.shape[0] else None,
                             e["offset"].copy()))
                kinds.append(seg.kind)
            local = [(s.base, pl.local_fs.read(s.log_path),
                      pl.local_fs.read(s.bcq_path))
                     for s in pl.segments if s.kind == "file"]
            out[p] = {"segs": segs, "kinds": kinds, "local": local}
        return out

    def expected_horizon(self, p: int, pre: dict, force: bool) -> int:
        segs, kinds = pre["segs"], pre["kinds"]
        h0 = self.horizon[p]
        sealed = [s for s, k in zip(segs, kinds) if k != "file"]
        if force:
            sealed += [s for s, k in zip(segs, kinds) if k == "file" and s[1] > 0]
        lag = self.cfg.min_compaction_lag_ms
        end = None
        if lag > 0:
            limit = self.clock.ms() - lag
            for base, _, tmax, _ in sealed:
                if tmax is not None and tmax > limit:
                    end = base
                    break
        cand = [int(o) for base, _, _, offs in sealed if end is None or base < end
                for o in offs if o > h0]
        return max(cand) if cand else h0

    def check_active_untouched(self, pl, pre: dict) -> None:
        """(g) on S3: the writer's local (active) segments are untouched."""
        now = [(s.base, pl.local_fs.read(s.log_path),
                pl.local_fs.read(s.bcq_path)) for s in pl.segments if s.kind == "file"]
        assert now == pre["local"]

    def after_compaction(self, pre: dict, done: dict, force: bool) -> None:
        super().after_compaction(pre, done, force)
        check_manifests(self.store, self.fs)


def machine_s3(retention: int, lag: int) -> type:
    return type(f"S3CompactionMachine_{retention}_{lag}", (S3CompactionMachine,),
                {"retention": retention, "lag": lag})


S3_MODEL_SETTINGS = settings(SM.MODEL_SETTINGS, max_examples=10)


def test_store_matches_model_on_s3():
    run_state_machine_as_test(S3StoreMachine, settings=S3_MODEL_SETTINGS)


def test_compaction_matches_model_on_s3():
    run_state_machine_as_test(machine_s3(1000, 1500),
                              settings=settings(CM.MODEL_SETTINGS, max_examples=8))


def test_compaction_matches_model_on_s3_tombstones():
    run_state_machine_as_test(machine_s3(0, 0),
                              settings=settings(CM.MODEL_SETTINGS, max_examples=6))
