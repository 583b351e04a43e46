"""The store against a plain dict/bisect model (as Kafka checks OffsetIndex against a TreeMap).

A hypothesis state machine appends random batches over several topics and partitions (null and
empty keys and values, headers, offsets with gaps), re-appends stored offsets, sends batches
whose offsets go backwards, reads from random offsets, flushes, and closes and reopens the store,
on the in-memory backend and on a directory. Segments are small (segment.bytes = 16 KiB) so
reads cross segment boundaries. After every step the store must agree with the model.
"""

from __future__ import annotations

import bisect
import os
import random
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kcompact.reput import bcq as B
from kcompact.reput import bcq2 as B2
from kcompact.reput import filenames as fn
from kcompact.reput.backend import LocalBackend, MemoryBackend
from kcompact.reput.config import FSYNC_POLICIES, WriterOptions
from kcompact.reput.errors import OffsetOrderError
from kcompact.reput.record import Record, RecordBatch, decode_one, key_digest, scan
from kcompact.reput.store import Store

TOPICS = ("orders", "x.y-z_2")
PARTS = (0, 1, 2)
SEGMENT_BYTES = 16384

keys = st.one_of(st.none(), st.just(b""), st.binary(min_size=1, max_size=12))
values = st.one_of(
    st.none(), st.just(b""), st.binary(min_size=1, max_size=40),
    st.tuples(st.integers(200, 5000), st.integers(0, 255)).map(lambda t: bytes([t[1]]) * t[0]))
headers = st.lists(st.tuples(st.sampled_from(["a", "b", "trace-id"]),
                             st.one_of(st.none(), st.binary(max_size=8))), max_size=3)
timestamps = st.integers(-1, 2**42)


def _rec(topic, p, off, ts, k, v, h) -> Record:
    return Record(topic, p, off, ts, k, v, tuple(tuple(x) for x in h))


class StoreMachine(RuleBasedStateMachine):
    local = False

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kcompact-model-") if self.local else None
        self.fs = LocalBackend(self.tmp) if self.local else MemoryBackend()
        self.url = self.tmp if self.local else "memory://x"
        created = Store.create(self.url, fs=self.fs)
        for t in TOPICS:
            created.set_topic_config(t, {"segment.bytes": SEGMENT_BYTES})
        created.close()
        self.store = Store.open(self.url, fs=self.fs, writer="w")
        self.model: dict[tuple[str, int], dict[int, Record]] = {
            (t, p): {} for t in TOPICS for p in PARTS}
        self.stats = {"appended": 0, "dispatched": 0, "skipped": 0}

    # -- helpers ------------------------------------------------------------------------

    def offsets(self, topic, p) -> list[int]:
        return sorted(self.model[(topic, p)])

    def model_next(self, topic, p) -> int:
        o = self.offsets(topic, p)
        return o[-1] + 1 if o else 0

    def expected_from(self, topic, p, frm) -> list[Record]:
        offs = self.offsets(topic, p)
        return [self.model[(topic, p)][o] for o in offs[bisect.bisect_left(offs, frm):]]

    # -- writes -------------------------------------------------------------------------

    @rule(topic=st.sampled_from(TOPICS),
          spec=st.lists(st.tuples(st.sampled_from(PARTS), st.integers(1, 1000).map(
              lambda g: 1 if g < 700 else g % 50 + 1), timestamps, keys, values, headers),
              min_size=1, max_size=8))
    def append(self, topic, spec):
        nxt = {p: self.model_next(topic, p) for p in PARTS}
        rows = []
        for p, gap, ts, k, v, h in spec:
            off = nxt[p] + gap - 1
            nxt[p] = off + 1
            rows.append((p, off, ts, k, v, h))
        n = self.store.append(RecordBatch.from_records(topic, rows))
        assert n == len(rows)
        for p, off, ts, k, v, h in rows:
            self.model[(topic, p)][off] = _rec(topic, p, off, ts, k, v, h)
        self.stats["appended"] += len(rows)
        self.stats["dispatched"] += len(rows)

    @rule(topic=st.sampled_from(TOPICS), seed=st.integers(0, 2**32), n=st.integers(5, 60))
    def append_bulk(self, topic, seed, n):
        """Many records at once (from a seeded generator), so that segments roll often."""
        rng = random.Random(seed)
        nxt = {p: self.model_next(topic, p) for p in PARTS}
        rows = []
        for _ in range(n):
            p = rng.choice(PARTS)
            off = nxt[p] + rng.choice([0, 0, 0, 1, 5])
            nxt[p] = off + 1
            k = rng.choice([None, b"", b"key-%d" % rng.randrange(30)])
            v = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 3000))])
            h = rng.choice([[], [("h", None)], [("h", b"1"), ("h", b"")]])
            rows.append((p, off, rng.randrange(2**41), k, v, h))
        assert self.store.append(RecordBatch.from_records(topic, rows)) == n
        for p, off, ts, k, v, h in rows:
            self.model[(topic, p)][off] = _rec(topic, p, off, ts, k, v, h)
        self.stats["appended"] += n
        self.stats["dispatched"] += n

    @rule(data=st.data())
    def reappend(self, data):
        """Offsets at or below a partition's last one are skipped, whatever their contents."""
        full = sorted(k for k, m in self.model.items() if m)
        if not full:
            return
        topic, p = data.draw(st.sampled_from(full))
        last = self.offsets(topic, p)[-1]
        stored = self.offsets(topic, p)
        olds = data.draw(st.sets(st.one_of(st.sampled_from(stored), st.integers(0, last)),
                                 min_size=1, max_size=6))
        news, o = [], last
        for gap in data.draw(st.lists(st.integers(1, 3), max_size=3)):
            o += gap
            news.append(o)
        rows = [(p, off, 7, b"dup", b"must not be stored", [("dup", None)])
                for off in sorted(olds)] + [(p, off, 8, b"k", b"new", []) for off in news]
        n = self.store.append(RecordBatch.from_records(topic, rows))
        assert n == len(news)
        for off in news:
            self.model[(topic, p)][off] = _rec(topic, p, off, 8, b"k", b"new", [])
        self.stats["appended"] += len(rows)
        self.stats["dispatched"] += len(news)
        self.stats["skipped"] += len(olds)

    @rule(topic=st.sampled_from(TOPICS), p=st.sampled_from(PARTS), data=st.data())
    def bad_order(self, topic, p, data):
        """A batch whose offsets do not strictly increase in one partition is refused whole."""
        base = self.model_next(topic, p) + data.draw(st.integers(0, 5))
        second = max(0, base - data.draw(st.integers(0, 3)))  # equal or smaller
        other = [q for q in PARTS if q != p][0]
        rows = [(other, self.model_next(topic, other), 1, b"k", b"v"),
                (p, base, 1, b"k", b"v"), (other, self.model_next(topic, other) + 1, 1, b"k", b"v"),
                (p, second, 1, b"k", b"v")]
        before = self.store.commitlog.end
        with pytest.raises(OffsetOrderError):
            self.store.append(RecordBatch.from_records(topic, rows))
        assert self.store.commitlog.end == before   # nothing of the batch was written

    @rule()
    def flush(self):
        self.store.flush()

    @rule(read_only_first=st.booleans(), fsync=st.sampled_from(FSYNC_POLICIES),
          small_commit_log=st.booleans())
    def reopen(self, read_only_first, fsync, small_commit_log):
        self.store.close()
        if read_only_first:
            ro = Store.open(self.url, fs=self.fs)
            self.check_all(ro)
            ro.close()
        # small commit-log segments, deleted as soon as they are dispatched, or the defaults
        opts = (WriterOptions(commitlog_segment_bytes=1 << 16, commitlog_retention_ms=0,
                              fsync=fsync) if small_commit_log else WriterOptions(fsync=fsync))
        self.store = Store.open(self.url, fs=self.fs, writer="w", options=opts)
        # everything was flushed by close: nothing to re-dispatch, nothing appended yet
        assert self.store.stats == {"appended": 0, "dispatched": 0, "skipped": 0}
        self.stats = dict(self.store.stats)
        self.check_all(self.store)

    # -- reads --------------------------------------------------------------------------

    @rule(topic=st.sampled_from(TOPICS), p=st.sampled_from(PARTS), data=st.data())
    def read(self, topic, p, data):
        offs = self.offsets(topic, p)
        hi = (offs[-1] if offs else 0) + 3
        frm = data.draw(st.one_of(st.integers(-2, hi), st.sampled_from(offs or [0]),
                                  st.sampled_from(offs or [0]).map(lambda o: o + 1)))
        max_records = data.draw(st.one_of(st.none(), st.integers(1, 40)))
        max_bytes = data.draw(st.one_of(st.none(), st.integers(0, 20000)))
        r = self.store.read(topic, p, frm, max_records=max_records, max_bytes=max_bytes)
        got = list(r.records())
        want = self.expected_from(topic, p, frm)
        if not want:
            assert got == [] and len(r) == 0 and r.nbytes == 0
            assert r.next_offset == max(frm, self.model_next(topic, p))
            return
        assert 1 <= len(got) and got == want[:len(got)]
        if max_records is not None:
            assert len(got) <= max_records
        if max_bytes is not None and len(got) > 1:
            assert r.nbytes <= max_bytes
        assert r.next_offset == got[-1].offset + 1
        self.check_columns(r, got)

    @rule(topic=st.sampled_from(TOPICS), p=st.sampled_from(PARTS),
          frm=st.integers(-1, 400), limit=st.one_of(st.none(), st.integers(0, 30)))
    def iter_records(self, topic, p, frm, limit):
        want = self.expected_from(topic, p, frm)
        got = list(self.store.iter_records(topic, p, frm, limit))
        assert got == (want if limit is None else want[:limit])

    @rule()
    def read_only_view_next_to_the_writer(self):
        ro = Store.open(self.url, fs=self.fs)
        try:
            for t, p in self.model:
                assert ro.next_offset(t, p) == self.model_next(t, p)
                assert list(ro.iter_records(t, p)) == self.expected_from(t, p, 0)
        finally:
            ro.close()

    def check_columns(self, r, recs):
        """A block's columns are its records' fields (reput/reader.py RecordColumns)."""
        assert len(r) == len(recs)
        assert r.offsets.tolist() == [x.offset for x in recs]
        assert r.timestamps.tolist() == [x.timestamp for x in recs]
        assert r.keys.to_list() == [x.key for x in recs]
        assert r.values.to_list() == [x.value for x in recs]
        assert r.header_lists() == [x.headers for x in recs]
        assert r.tombstones.tolist() == [x.value is None for x in recs]
        assert r.keyless.tolist() == [x.key is None for x in recs]
        flags = [(B.FLAG_TOMBSTONE if x.value is None else 0)
                 | (B.FLAG_KEYLESS if x.key is None else 0) for x in recs]
        assert r.flags.tolist() == flags
        digs = [(0, 0) if x.key is None else key_digest(x.key, self.store.secret) for x in recs]
        assert list(zip(r.digest_lo.tolist(), r.digest_hi.tolist())) == digs

    def check_all(self, store):
        for (t, p), m in self.model.items():
            offs = sorted(m)
            assert store.next_offset(t, p) == (offs[-1] + 1 if offs else 0)
            assert store.first_offset(t, p) == (offs[0] if offs else 0)
            assert list(store.iter_records(t, p)) == [m[o] for o in offs]
        for t in TOPICS:
            assert store.partitions(t) == [p for p in PARTS if self.model[(t, p)]]

    @invariant()
    def stats_and_offsets_agree(self):
        assert self.store.stats == self.stats
        for t, p in self.model:
            offs = self.offsets(t, p)
            assert self.store.next_offset(t, p) == (offs[-1] + 1 if offs else 0)
            assert self.store.first_offset(t, p) == (offs[0] if offs else 0)

    def teardown(self):
        try:
            self.store.close()
            self.check_all(Store.open(self.url, fs=self.fs))
            check_segments(self.fs)
        finally:
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)


def check_segments(fs) -> None:
    """Every .log holds at most segment.bytes (or one record), its .bcq indexes all of it, and
    each segment's offsets lie between its base and the next segment's base."""
    for t in fs.listdir(fn.PARTITIONS_DIR):
        for p in fs.listdir(f"{fn.PARTITIONS_DIR}/{t}"):
            d = f"{fn.PARTITIONS_DIR}/{t}/{p}"
            bases = sorted(b for b, kind in filter(None, map(fn.parse_base, fs.listdir(d)))
                           if kind == "log")
            for i, base in enumerate(bases):
                size = fs.size(f"{d}/{fn.base_name(base)}.log")
                raw = fs.read(f"{d}/{fn.base_name(base)}.bcq")
                if B2.is_lean(raw):  # sealed into format 2: a lean index (bcq-v2.md)
                    lean = B2.LeanIndex(lambda a, n: raw[a:a + n], base, len(raw))
                    assert lean.log_size == size
                    e = lean.entries
                else:
                    e = B.view(np.frombuffer(raw, np.uint8))
                    assert len(raw) == e.shape[0] * B.ENTRY_SIZE
                assert size <= SEGMENT_BYTES or e.shape[0] == 1
                assert int(e["size"].sum()) == size
                if e.shape[0]:
                    assert int(e[0]["offset"]) >= base
                    assert np.all(np.diff(e["offset"]) > 0)
                    if i + 1 < len(bases):
                        assert int(e[-1]["offset"]) < bases[i + 1]


class LocalStoreMachine(StoreMachine):
    local = True


MODEL_SETTINGS = settings(max_examples=35, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])


def test_store_matches_model_in_memory():
    run_state_machine_as_test(StoreMachine, settings=MODEL_SETTINGS)


def test_store_matches_model_on_disk():
    run_state_machine_as_test(LocalStoreMachine,
                              settings=settings(MODEL_SETTINGS, max_examples=12))


# -- deterministic: many segments, every read offset ------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_reads_across_many_segments(kind, tmp_path):
    fs = MemoryBackend() if kind == "memory" else LocalBackend(str(tmp_path))
    url = "memory://x" if kind == "memory" else str(tmp_path)
    Store.create(url, fs=fs).close()
    rng = random.Random(1)
    model: dict[int, Record] = {}
    with Store.open(url, fs=fs, writer="w") as s:
        s.set_topic_config("t", {"segment.bytes": SEGMENT_BYTES})
        off = 5
        for _ in range(30):
            rows = []
            for _ in range(rng.randrange(1, 15)):
                v = rng.choice([None, b"", rng.randbytes(rng.randrange(1, 2500))])
                k = rng.choice([None, b"", b"k%d" % rng.randrange(20)])
                rows.append((0, off, off * 10, k, v))
                model[off] = Record("t", 0, off, off * 10, k, v)
                off += rng.choice([1, 1, 1, 2, 7])
            assert s.append(RecordBatch.from_records("t", rows)) == len(rows)
        if kind == "local":
            assert len(os.listdir(tmp_path / "partitions" / "t" / "0")) > 10  # it rolled
    offs = sorted(model)
    for writer in ("w", None):
        with Store.open(url, fs=fs, writer=writer) as s:
            assert len(s.partition("t", 0).segments) > 5
            assert s.first_offset("t", 0) == offs[0] and s.next_offset("t", 0) == offs[-1] + 1
            for frm in range(offs[0] - 2, offs[-1] + 3):
                want = [model[o] for o in offs if o >= frm]
                r = s.read("t", 0, frm, max_records=3)
                got = list(r.records())
                assert got == want[:len(got)] and (len(got) >= 1 or not want)
                assert list(s.iter_records("t", 0, frm, limit=4)) == want[:4]
            assert list(s.iter_records("t", 0)) == [model[o] for o in offs]
    check_segments(fs)


def test_records_larger_than_a_segment(tmp_path):
    """A record bigger than a commit-log or partition segment gets a segment of its own."""
    Store.create(str(tmp_path)).close()
    opts = WriterOptions(commitlog_segment_bytes=1 << 16)
    rows = [(0, 0, 1, b"a", b"x" * 100_000), (0, 1, 1, b"b", b"small"),
            (0, 2, 1, None, b"y" * 70_000), (0, 3, 1, b"d", None), (0, 9, 1, b"e", b"z" * 20_000)]
    want = [Record("t", *r) for r in rows]
    with Store.open(str(tmp_path), writer="w", options=opts) as s:
        s.set_topic_config("t", {"segment.bytes": SEGMENT_BYTES})
        assert s.append(RecordBatch.from_records("t", rows[:2])) == 2
        assert s.append(RecordBatch.from_records("t", rows[2:])) == 3
        assert list(s.iter_records("t", 0)) == want
    with Store.open(str(tmp_path), writer="w", options=opts) as s:
        assert list(s.iter_records("t", 0)) == want
        assert [r.offset for r in s.iter_records("t", 0, 4)] == [9]
        assert s.stats == {"appended": 0, "dispatched": 0, "skipped": 0}
    fs = LocalBackend(str(tmp_path))
    check_segments(fs)
    cl = fn.writer_dir("w")
    for name in fs.listdir(cl):
        if name.endswith(".log"):
            data = np.frombuffer(fs.read(f"{cl}/{name}"), np.uint8)
            assert data.shape[0] <= 1 << 16 or len(scan(data)) == 1


# -- the index search against bisect ----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), unique=True, max_size=200),
       st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20), st.data())
def test_lower_bound_matches_bisect(offsets, targets, data):
    offsets.sort()
    e = np.zeros(len(offsets), dtype=B.BCQ_DTYPE)
    e["offset"] = offsets
    e["position"] = np.arange(len(offsets))
    targets = targets + offsets[:5] + [o + 1 for o in offsets[-5:] if o < 2**63 - 1]
    idx = B.Index(e)
    for t in targets:
        assert B.lower_bound(e, t) == bisect.bisect_left(offsets, t)
        assert idx.lower_bound(t) == bisect.bisect_left(offsets, t)
    # the same through a byte buffer view (as a mapped .bcq is read) and a prefix of it
    raw = np.frombuffer(e.tobytes() + b"\x01\x02\x03", dtype=np.uint8)
    v = B.view(raw)
    k = data.draw(st.integers(0, len(offsets)))
    for t in targets:
        assert B.lower_bound(v, t) == bisect.bisect_left(offsets, t)
        assert B.lower_bound(v[:k], t) == bisect.bisect_left(offsets[:k], t)
