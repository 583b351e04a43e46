"""`kcompact verify --store REPLICA --against MASTER_URL --token-file F [--json]`.

Compares, per partition, the replica's *live state* with the master's below the master's next
offset ``upto`` (read once, at the start; see replication/live.py for the definition):

1. **Live offsets**: the roaring bitmaps (pyroaring ``BitMap64``) of the offsets of the latest
   record of each key (a tombstone counts as a deletion, not as a live record) plus every keyless
   record. Equal bitmaps mean the same keys were last written at the same offsets.
2. **Per-record digests** of those live records: SipHash-2-4-128 of each record's bytes (header,
   key, value, headers: everything its CRC covers) under a fresh random salt that both sides use
   for this run only. The master streams them (``/digests``); the replica computes its own; the
   two streams are merged by offset, so memory stays bounded by a few frames.

Raw segments are *not* compared: a side that compacted more recently, or still keeps a tombstone
the other purged, has the same live state. A partition on one side only, a replica whose next
offset is behind ``upto``, a live offset on one side only or a record whose digest differs is a
difference; each is printed with topic, partition, counts and the first few offsets and keys.
A side that cannot read its store for a partition (the replica's damage, or the master's: its 500
or the error frame ending its digests body, MasterStoreError) makes that partition a difference,
named with the file and byte, and the comparison goes on with the next partition. The master's
whole partition list is compared: one it holds but does not serve (its store document's
``unavailable``: a symlink out of the store, damage) is a difference naming it.
Exit 1 when any difference is found, 0 when every partition is equal.

Against a master that keeps writing and compacting, the comparison is of the state below
``upto``; a key the master rewrites above ``upto`` and compacts away below it during the run shows
as a transient difference: run verify again (or stop the writer) to confirm.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kcompact.reput.errors import ReputError
from kcompact.reput.store import Store

from .client import MasterClient, check_master_url, unavailable_partitions
from .errors import MasterStoreError, ReplicationError
from .live import bitmap_array, digest_frames, live_offsets
from .protocol import DigestFrame, FrameReader, new_salt, read_token_file

SAMPLES = 5


def show_key(key: bytes | None, limit: int = 40) -> str:
    if key is None:
        return "(keyless)"
    try:
        s = key.decode("utf-8")
        if not s.isprintable():
            raise UnicodeDecodeError("utf-8", key, 0, 1, "unprintable")
        s = repr(s)
    except UnicodeDecodeError:
        s = "b64:" + base64.b64encode(key).decode()
    return s if len(s) <= limit else s[:limit - 3] + "..."


@dataclass
class PartitionDiff:
    topic: str
    partition: int
    upto: int = 0
    master_next: int | None = None
    replica_next: int | None = None
    master_live: int = 0
    replica_live: int = 0
    only_master: int = 0
    only_replica: int = 0
    differing: int = 0
    samples: dict = field(default_factory=lambda: {"only_master": [], "only_replica": [],
                                                   "differing": []})
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.only_master or self.only_replica or self.differing or self.problems)

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    def lines(self) -> list[str]:
        if self.ok:
            return [f"{self.name}: equal ({self.master_live:,} live records below offset "
                    f"{self.upto:,})"]
        out = [f"{self.name}: {p}" for p in self.problems]
        for what, count, label in (("only_master", self.only_master,
                                    "live records only on the master"),
                                   ("only_replica", self.only_replica,
                                    "live records only on the replica"),
                                   ("differing", self.differing,
                                    "records that differ (same offset, other bytes)")):
            if count:
                first = ", ".join(f"offset {s['offset']} key {s['key']}"
                                  for s in self.samples[what])
                out.append(f"{self.name}: {count:,} {label}; first: {first}")
        return out

    def to_dict(self) -> dict:
        return {"topic": self.topic, "partition": self.partition, "ok": self.ok,
                "upto": self.upto, "master_next_offset": self.master_next,
                "replica_next_offset": self.replica_next, "master_live": self.master_live,
                "replica_live": self.replica_live, "only_master": self.only_master,
                "only_replica": self.only_replica, "differing": self.differing,
                "samples": self.samples, "problems": self.problems}


@dataclass
class AgainstReport:
    store: str
    master: str
    partitions: list[PartitionDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.partitions)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "store": self.store, "master": self.master,
                "compared": "live state below the master's next offset: latest record per key "
                            "(tombstones as deletions) and keyless records; offsets as roaring "
                            "bitmaps, records as salted SipHash-128 digests",
                "partitions": [p.to_dict() for p in self.partitions],
                "differences": [line for p in self.partitions if not p.ok for line in p.lines()]}


class _Side:
    """Pending digest entries of one side, in offset order, with their frames for key lookup."""

    def __init__(self):
        self.offsets = np.zeros(0, np.int64)
        self.lo = np.zeros(0, np.uint64)
        self.hi = np.zeros(0, np.uint64)
        self.fid = np.zeros(0, np.int64)
        self.idx = np.zeros(0, np.int64)
        self.frames: dict[int, DigestFrame] = {}
        self.last = -1
        self.done = False
        self._next_id = 0

    def add(self, f: DigestFrame) -> None:
        e = f.entries
        if e.shape[0] and int(e["offset"][0]) <= self.last:
            raise ReplicationError("digests: offsets out of order across frames")
        i = self._next_id
        self._next_id += 1
        self.frames[i] = f
        n = e.shape[0]
        self.offsets = np.concatenate([self.offsets, e["offset"]])
        self.lo = np.concatenate([self.lo, e["hash_lo"]])
        self.hi = np.concatenate([self.hi, e["hash_hi"]])
        self.fid = np.concatenate([self.fid, np.full(n, i, np.int64)])
        self.idx = np.concatenate([self.idx, np.arange(n, dtype=np.int64)])
        if n:
            self.last = int(e["offset"][-1])

    def key(self, j: int) -> bytes | None:
        return self.frames[int(self.fid[j])].key(int(self.idx[j]))

    def take(self, bound: int | None):
        """Pop the entries with offset <= bound (all when None): (offsets, lo, hi, keyfn)."""
        k = self.offsets.shape[0] if bound is None else int(
            np.searchsorted(self.offsets, bound, side="right"))
        offs, lo, hi = self.offsets[:k], self.lo[:k], self.hi[:k]
        fid, idx = self.fid[:k], self.idx[:k]
        frames = self.frames

        def keyfn(j: int) -> bytes | None:
            return frames[int(fid[j])].key(int(idx[j]))
        self.offsets, self.lo, self.hi = self.offsets[k:], self.lo[k:], self.hi[k:]
        self.fid, self.idx = self.fid[k:], self.idx[k:]
        live_ids = set(np.unique(self.fid).tolist())
        self.frames = {i: f for i, f in frames.items() if i in live_ids}
        return offs, lo, hi, keyfn


def _compare_window(d: PartitionDiff, m, r, want: dict[int, str]) -> None:
    mo, mlo, mhi, mkey = m
    ro, rlo, rhi, rkey = r
    common, im, ir = np.intersect1d(mo, ro, assume_unique=True, return_indices=True)
    bad = (mlo[im] != rlo[ir]) | (mhi[im] != rhi[ir])
    nbad = int(bad.sum())
    if nbad:
        d.differing += nbad
        for j in np.nonzero(bad)[0][:SAMPLES - len(d.samples["differing"])]:
            mk, rk = mkey(int(im[j])), rkey(int(ir[j]))
            key = show_key(mk) if mk == rk else f"{show_key(mk)} (replica: {show_key(rk)})"
            d.samples["differing"].append({"offset": int(common[j]), "key": key})
    # keys of the sampled offsets that are on one side only (counted from the bitmaps)
    for offs, keyfn in ((mo, mkey), (ro, rkey)):
        if not want:
            break
        hits = np.nonzero(np.isin(offs, np.fromiter(want, np.int64)))[0]
        for j in hits:
            want[int(offs[j])] = show_key(keyfn(int(j)))


async def compare_partition(client: MasterClient, store: Store, pool: ThreadPoolExecutor,
                            topic: str, partition: int, info: dict,
                            map_memory: int = 64 << 20) -> PartitionDiff:
    try:
        return await _compare_partition(client, store, pool, topic, partition, info, map_memory)
    except MasterStoreError as e:
        d = PartitionDiff(topic, partition, upto=int(info["next_offset"]),
                          master_next=int(info["next_offset"]))
        # "the master's store is damaged: FILE: corrupt record at byte N ..."
        d.problems.append(e.detail if e.detail.startswith("the master")
                          else f"the master failed: {e.detail}")
        return d


async def _compare_partition(client: MasterClient, store: Store, pool: ThreadPoolExecutor,
                             topic: str, partition: int, info: dict,
                             map_memory: int) -> PartitionDiff:
    loop = asyncio.get_running_loop()
    run = lambda f, *a: loop.run_in_executor(pool, f, *a)  # noqa: E731
    upto = int(info["next_offset"])
    d = PartitionDiff(topic, partition, upto=upto, master_next=upto)
    pl = store.open_view(topic, partition)
    d.replica_next = pl.next_offset
    if d.replica_next < upto:
        d.problems.append(f"the replica is behind: next offset {d.replica_next:,}, the master's "
                          f"{upto:,}")
    m_bm, _ = await client.live(topic, partition, upto)
    try:
        r_bm, _ = await run(live_offsets, pl, upto, map_memory)
    except ReputError as e:
        d.problems.append(f"the replica cannot be read: {e}")
        return d
    d.master_live, d.replica_live = len(m_bm), len(r_bm)
    only_m, only_r = m_bm - r_bm, r_bm - m_bm
    d.only_master, d.only_replica = len(only_m), len(only_r)
    want: dict[int, str] = {}
    sample_m = bitmap_array(only_m[:SAMPLES]) if len(only_m) else np.zeros(0, np.int64)
    sample_r = bitmap_array(only_r[:SAMPLES]) if len(only_r) else np.zeros(0, np.int64)
    for o in list(sample_m) + list(sample_r):
        want[int(o)] = "?"

    salt = new_salt()
    local = digest_frames(pl, r_bm, upto, salt)
    remote = client.digests(topic, partition, upto, salt).__aiter__()
    M, R = _Side(), _Side()
    try:
        while True:
            if M.done and R.done:
                _compare_window(d, M.take(None), R.take(None), want)
                break
            # read from the side that is behind (or the only one still going)
            if not M.done and (R.done or M.last <= R.last):
                try:
                    M.add(await remote.__anext__())
                except StopAsyncIteration:
                    M.done = True
            else:
                raw = await run(next, local, None)
                if raw is None:
                    R.done = True
                else:
                    for frame in FrameReader().feed(raw):
                        R.add(frame)
            going = [x.last for x in (M, R) if not x.done]
            if going:
                # every entry <= the smallest last offset of a side still going has arrived
                bound = min(going)
                _compare_window(d, M.take(bound), R.take(bound), want)
    except ReputError as e:
        d.problems.append(f"the replica cannot be read: {e}")
        await remote.aclose()
        return d
    d.samples["only_master"] = [{"offset": int(o), "key": want.get(int(o), "?")}
                                for o in sample_m]
    d.samples["only_replica"] = [{"offset": int(o), "key": want.get(int(o), "?")}
                                 for o in sample_r]
    return d


async def compare_stores(store: Store, master_url: str, token: bytes) -> AgainstReport:
    report = AgainstReport(store.url, master_url)
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kcompact-verify")
    try:
        async with MasterClient(master_url, token, retry_s=30.0) as client:
            doc = await client.store_doc()
            master = {(t["topic"], int(p["partition"])): p
                      for t in doc["topics"] for p in t["partitions"]}
            local = {(t, p) for t in store.topics() for p in store.partitions(t)}
            # partitions the master holds but does not serve: a difference, never skipped
            unserved = {(t, p): why for t, p, why in unavailable_partitions(doc)}
            for key in sorted(set(master) | local | set(unserved)):
                t, p = key
                if key in unserved:
                    d = PartitionDiff(t, p)
                    d.problems.append(f"the master holds it but does not serve it: "
                                      f"{unserved[key]}")
                elif key not in local:
                    d = PartitionDiff(t, p, master_next=int(master[key]["next_offset"]))
                    d.problems.append("missing on the replica")
                elif key not in master:
                    d = PartitionDiff(t, p)
                    d.problems.append("on the replica but not on the master")
                else:
                    d = await compare_partition(client, store, pool, t, p, master[key])
                report.partitions.append(d)
    finally:
        pool.shutdown(wait=True)
    return report


@dataclass(frozen=True)
class VerifyAgainstOptions:
    """``kcompact verify --against``'s options."""

    store: str
    against: str                     # the master's URL
    token_file: str
    json: bool = False


def verify_against(opts: VerifyAgainstOptions) -> int:
    """`kcompact verify --store URL --against URL --token-file F [--json]`: exit 1 on any
    difference."""
    if not opts.token_file:
        raise ReplicationError("--against needs --token-file (the token the master serves with)")
    check_master_url(opts.against)
    token = read_token_file(opts.token_file)
    try:
        store = Store.open(opts.store)
    except ReputError as e:
        raise ReplicationError(f"replica store {opts.store}: {e}") from None
    try:
        report = asyncio.run(compare_stores(store, opts.against, token))
    finally:
        store.close()
    if opts.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for p in report.partitions:
            for line in p.lines():
                print(line)
        bad = sum(1 for p in report.partitions if not p.ok)
        print(f"{'EQUAL' if report.ok else 'DIFFERENT'}: {len(report.partitions)} partitions "
              f"compared with {opts.against}, {bad} differ (live state: latest record per key, "
              "tombstones as deletions, keyless records)")
    return 0 if report.ok else 1
