"""Every time that decides what is kept comes from the injected clock (Kafka's ``Time``), read once
per operation: a ManualClock moves it, no sleeps.

* S3: a compaction's commit retires the replaced objects at the store clock's "now"
  (``commit_staged``), and ``collect_garbage`` keeps them until the grace period has passed on
  that clock (their own age is the object store's: LastModified, aged here in the fake).
* A replica's pull stamps the tombstones its master had already compacted as cleaned at the
  replica store clock's "now" (what ``delete.retention.ms`` then counts from).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _fake_s3 import FakeS3  # noqa: E402

from kcompact.compaction import CompactionOptions, Compactor  # noqa: E402
from kcompact.reput import ManualClock, Store  # noqa: E402
from kcompact.reput.config import WriterOptions  # noqa: E402
from kcompact.reput import manifest as M  # noqa: E402
from kcompact.reput.reader import PartitionReader  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.s3 import BlockCache, S3Backend, Spool  # noqa: E402
from kcompact.replication.client import Chunk  # noqa: E402
from kcompact.replication.replica import ReplicaOptions, Replicator  # noqa: E402

TOPIC = "t"
HOUR = 3_600_000
T0 = 1_800_000_000_000  # the manual clock's start: far from the wall clock on purpose


def _rows(n: int):
    # 10 keys, every 4th record a tombstone
    return [(0, i, T0 + i, b"k%d" % (i % 10), None if i % 4 == 3 else b"v%d" % i, [])
            for i in range(n)]


@pytest.fixture
def s3(tmp_path):
    fake = FakeS3(buckets=("bucket",))
    os.environ["KCOMPACT_CACHE_DIR"] = str(tmp_path / "cache")

    def make():
        return S3Backend("bucket", "c", client=fake, grace_ms=HOUR,
                         cache=BlockCache(64 << 20, 4 << 20),
                         spool=Spool(1 << 30, str(tmp_path / f"spool-{time.monotonic_ns()}")))
    yield fake, make
    os.environ.pop("KCOMPACT_CACHE_DIR", None)


def _age_objects(fake: FakeS3, ms: int) -> None:
    """Time passes on the object store: every object is ``ms`` older."""
    objs = fake.objects["bucket"]
    for k, (data, mtime) in list(objs.items()):
        objs[k] = (data, mtime - datetime.timedelta(milliseconds=ms))


def test_retired_objects_go_when_the_grace_period_passes_on_the_store_clock(s3):
    fake, make = s3
    clock = ManualClock(T0)
    # per-partition uploads: one segment object per flush (a new S3 store's default is shared)
    st = Store.open("s3://bucket/c", fs=make(), writer="w", create=True, clock=clock,
                    options=WriterOptions(upload="partition"))
    for i in range(0, 400, 100):
        st.append(RecordBatch.from_records(TOPIC, _rows(400)[i:i + 100]))
        st.flush()  # one segment object per flush
    res = Compactor(st, CompactionOptions(offset_map_memory=1 << 16)).compact_partition(
        TOPIC, 0, force=True)
    assert res.skipped is None and res.segments_rewritten >= 2
    pl = st.partition(TOPIC, 0)
    m = M.read_latest(st.fs, pl.dir)
    retired = {n for r in m.retired for n in (r["log"], r["bcq"])}
    assert retired and {r["since_ms"] for r in m.retired} == {T0}  # the store's clock
    prefix = "c/" + pl.dir + "/"

    def present() -> set:
        return {k[len(prefix):] for k in fake.objects["bucket"] if k.startswith(prefix)}
    assert retired <= present()
    _age_objects(fake, 2 * HOUR)       # old on the object store ...
    clock.advance(HOUR - 1)            # ... but retired less than the grace period ago
    pl.collect_garbage()
    assert retired <= present()
    clock.advance(2)                   # now the grace period has passed on the store clock
    gone = pl.collect_garbage()
    assert retired.isdisjoint(present()) and len(gone) >= len(retired)
    assert [r.offset for r in pl.iter_records()] == [
        o for o in range(400) if o >= 390]  # the latest record of each of the 10 keys
    st.close()


class _MasterClient:
    """Records responses read from a master store in-process (what `kcompact serve` sends)."""

    url = "http://master.invalid:1"

    def __init__(self, master: Store):
        self.master, self.store_id = master, master.meta.store_id

    async def records(self, topic, partition, from_offset, max_bytes, **_):
        raw = PartitionReader(self.master.partition(topic, partition)).read_raw(from_offset,
                                                                                max_bytes)
        body = raw.buf[:raw.nbytes].copy() if raw.buf is not None else np.zeros(0, np.uint8)
        return Chunk(body, raw.next_offset, raw.count, self.master.next_offset(topic, partition))


def test_a_pull_stamps_the_masters_cleaned_tombstones_at_the_replica_clock(tmp_path):
    master = Store.open(str(tmp_path / "m"), writer="w", create=True)
    master.append(RecordBatch.from_records(TOPIC, _rows(200)))
    master.flush()
    clock = ManualClock(T0 + 5 * HOUR)
    replica = Store.open(str(tmp_path / "r"), create=True, clock=clock)
    rep = Replicator(_MasterClient(master), replica, ReplicaOptions())
    try:
        state, staging = rep._prepare(TOPIC, 0)
        assert state == "pull"
        horizon = 120
        asyncio.run(rep._pull(TOPIC, 0, staging, 0, 200, "t-0", horizon))
        e = np.concatenate([s.entries() for s in staging.segments])
        tomb = (e["flags"] & 3) == 1
        stamped = e["clean_time"][tomb & (e["offset"] <= horizon)]
        assert stamped.size > 10 and (stamped == clock.ms() // 1000).all()
        assert (e["clean_time"][~(tomb & (e["offset"] <= horizon))] == 0).all()
        staging.close()
    finally:
        rep.close()
        replica.close()
        master.close()
