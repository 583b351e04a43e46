"""Pass 1 of a compaction round (building the offset map) reads only .bcq indexes, never .log
data: the key digest is in the index (DESIGN.md, "Compaction"; README "Pass 1 reads only .bcq
indexes"). Every read of the store goes through its backend, so a backend that logs each read
with its path shows which files a phase touched. The phases are told apart at the compactor's
seam between them: ``Compactor._rewrite`` (pass 2) is called once the round's map is built."""

from __future__ import annotations

import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import filenames as fn
from kcompact.reput.backend import LocalBackend, MemoryBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import RecordBatch
from kcompact.reput.store import Store

TOPIC = "t"
PASS2 = "-- pass 2 --"


def counting(base: type) -> type:
    """``base`` with every read (read, read_into, open_read, map) logged as its path."""

    class Counting(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.log: list[str] = []

        def read(self, path, start=0, length=None):
            self.log.append(path)
            return super().read(path, start, length)

        def read_into(self, path, start, out):
            self.log.append(path)
            return super().read_into(path, start, out)

        def open_read(self, path, start=0):
            self.log.append(path)
            return super().open_read(path, start)

        def map(self, path, size=None):
            self.log.append(path)
            return super().map(path, size)

    return Counting


class MarkingCompactor(Compactor):
    """Marks in the backend's log where each round's pass 2 starts and ends."""

    def __init__(self, *a, log: list[str], **kw):
        super().__init__(*a, **kw)
        self.log = log
        self.rounds = 0

    def _rewrite(self, pl, cfg, last_mapped, res, *more):
        self.rounds += 1
        self.log.append(PASS2)
        try:
            return super()._rewrite(pl, cfg, last_mapped, res, *more)
        finally:
            self.log.append("-- pass 2 done --")


def pass1_reads(log: list[str]) -> list[list[str]]:
    """The reads of each round before its pass 2 (from the start, or the previous pass 2)."""
    out, cur, in_pass2 = [], [], False
    for entry in log:
        if entry == PASS2:
            out.append(cur)
            cur, in_pass2 = [], True
        elif entry == "-- pass 2 done --":
            in_pass2 = False
        elif not in_pass2:
            cur.append(entry)
    return out


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("map_bytes", [1 << 20, 4096], ids=["one-round", "many-rounds"])
def test_pass1_reads_only_bcq_files(kind, map_bytes, tmp_path):
    clock = ManualClock()
    url = str(tmp_path / "s") if kind == "local" else "memory://s"
    fs = counting(LocalBackend)(url) if kind == "local" else counting(MemoryBackend)()
    s = Store.open(url, fs=fs, writer="w", create=True, clock=clock)
    # (zstd: the segment sizes this test was sized for; the default stores them uncompressed)
    s.set_topic_config(TOPIC, {"segment.bytes": 16384, "compression.type": "zstd"})
    n = 3000  # 1000 keys, each written 3 times, ~110-byte records: ~20 segments
    s.append(RecordBatch.from_records(TOPIC, [
        (0, i, clock.ms(), b"key-%04d" % (i % 1000), b"%d:" % i + b"v" * 80) for i in range(n)]))
    s.flush()
    s.close()

    # a fresh open: nothing cached, every index is read through the backend during the run
    s = Store.open(url, fs=fs, writer="w", clock=clock)
    fs.log.clear()
    c = MarkingCompactor(s, CompactionOptions(offset_map_memory=map_bytes), clock, log=fs.log)
    r = c.compact_partition(TOPIC, 0, force=True)
    assert r.skipped is None and r.records_kept == 1000 and c.rounds == r.rounds
    assert r.rounds >= (1 if map_bytes > 4096 else 5)

    rounds = pass1_reads(fs.log)
    assert len(rounds) == r.rounds
    for k, reads in enumerate(rounds):
        data = [p for p in reads if p.endswith(fn.LOG_SUFFIX)]
        assert data == [], f"round {k + 1}'s pass 1 read record data: {data[:3]}"
        assert any(p.endswith(fn.INDEX_SUFFIX) for p in reads), f"round {k + 1}: no .bcq read"
    # the log does see .log reads: pass 2 copies the records it keeps
    assert any(p.endswith(fn.LOG_SUFFIX) and p.startswith("partitions/") for p in fs.log)
    assert [rec.key for rec in s.iter_records(TOPIC, 0)] == sorted(
        b"key-%04d" % k for k in range(1000))
    s.close()
