"""A sealed format-2 segment shipped as stored (replication protocol version 2), on the replica.

Spec: docs/formats/replication-protocol.md, "Version 2: stored batches". The replica downloads
the master's ``.log`` (Kafka record batches, compressed) and lean index byte for byte into
``.replicating/.incoming/`` (``Incoming``: resumable, the segment's id in ``segment.json``), the
index first; ``ShippedInstall`` then checks the ``.log`` a block at a time as it arrives (the
next block is on the wire meanwhile) and, once it is whole, puts the segment into the pull's
staging partition log (``.replicating/``) as a format-2 segment, **without re-encoding a
batch**:

* the lean index: its header, directory and chunk CRCs, and that it describes a ``.log`` of the
  size received (``IncomingSegment``);
* every batch (``IncomingSegment.check``, reput/segment_v2.py: the format-2 segment's own
  checks): its CRC-32C, every record walked, offsets against its header;
  and against the master's index: each batch at the position, of the size and with the record
  count the index lists, each record with the offset, timestamp and tombstone/keyless flags of
  its entry;
* the index is then rebuilt with the replica's own key digests (the master's are under the
  master's secret), tombstones at or below the pull's horizon stamped as the records path
  stamps them (``PartitionLog.append``'s ``clean_upto``); the ``.log`` is then moved into place
  as downloaded (every batch of it checked: the batches as stored, not a byte re-written).

Nothing of a segment that fails a check is installed. The segment goes in with the compaction
swap (``.replicating/.compacting/swap.json``, compaction-swap.md), so a crash leaves it either
installed or not; the staging log then rolls past it, so that records pulled afterwards never
land in a format-2 segment.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from kcompact.reput import bcq as B
from kcompact.reput import filenames as fn
from kcompact.reput import swap
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.partition import PartitionLog
from kcompact.reput.segment_v2 import IncomingSegment

from .errors import ProtocolError

INCOMING_DIR = ".incoming"
INCOMING_FILE = "segment.json"
#: bytes of batches checked and copied at once
INSTALL_BLOCK = 8 << 20
#: what a listing names each file of a segment, and the suffix it is kept under
FILES = {"log": fn.LOG_SUFFIX, "index": fn.INDEX_SUFFIX}


class ShippedSegmentError(ProtocolError):
    """A shipped segment failed a check (nothing of it was installed). ``position``: the byte
    of the master's file where, when known."""

    def __init__(self, message: str, position: int | None = None):
        super().__init__(message)
        self.position = position


def master_path(topic: str, partition: int, base: int, file: str) -> str:
    """The master's file a listing's segment names (for messages)."""
    return f"{fn.partition_dir(topic, partition)}/{fn.base_name(base)}{FILES[file]}"


def stamp_clean(entries: np.ndarray, clean_upto: int, clean_time_s: int) -> None:
    """Keyed tombstones at or below ``clean_upto`` first cleaned at ``clean_time_s`` (the rule of
    a records pull, ``PartitionLog.append``'s ``clean_upto``: what the master had compacted)."""
    if clean_upto < 0 or clean_time_s <= 0 or entries.shape[0] == 0:
        return
    stamp = (entries["flags"] & (B.FLAG_TOMBSTONE | B.FLAG_KEYLESS)) == B.FLAG_TOMBSTONE
    stamp &= entries["offset"] <= clean_upto
    entries["clean_time"][stamp] = np.uint32(clean_time_s)


class Incoming:
    """The download of one segment in ``.replicating/.incoming/`` (local files, ``fs``)."""

    def __init__(self, fs, topic: str, partition: int):
        self.fs = fs
        self.dir = f"{fn.replicating_dir(topic, partition)}/{INCOMING_DIR}"
        self._files: dict = {}  # path -> its append file, open while the download goes on
        self._lock = threading.Lock()  # (a close waits for a write under way in the pool)

    def path(self, base: int, file: str) -> str:
        return f"{self.dir}/{fn.base_name(base)}{FILES[file]}"

    def prepare(self, seg: dict) -> dict[str, int]:
        """Bytes of each file already downloaded for this very segment version (a resumed
        download); anything else there is dropped first."""
        have = {"log": 0, "index": 0}
        try:
            doc = json.loads(self.fs.read(f"{self.dir}/{INCOMING_FILE}"))
        except (FileNotFoundError, ValueError):
            doc = None
        if isinstance(doc, dict) and doc.get("base") == seg["base"] and doc.get("id") == seg["id"]:
            for file, size_key in (("log", "log_size"), ("index", "index_size")):
                try:
                    have[file] = self.fs.size(self.path(seg["base"], file))
                except FileNotFoundError:
                    have[file] = 0
            if all(have[f] <= seg[k] for f, k in (("log", "log_size"), ("index", "index_size"))):
                return have
            have = {"log": 0, "index": 0}
        self.drop()
        self.fs.write_atomic(f"{self.dir}/{INCOMING_FILE}",
                             json.dumps({"base": seg["base"], "id": seg["id"]}).encode())
        return have

    def write(self, base: int, file: str, data) -> None:
        """Append ``data`` to the download of ``file``, and queue it for writeback to the
        device without waiting (the install's fsync then finds little left to write)."""
        path = self.path(base, file)
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = self.fs.open_append(path)
            f.write(data)
            f.start_writeback()

    def close(self) -> None:
        """Close the files being downloaded (what was written stays)."""
        with self._lock:
            files, self._files = list(self._files.values()), {}
            for f in files:
                f.close()

    def drop(self) -> None:
        self.close()
        self.fs.remove_tree(self.dir)


def _batch_groups(sizes: np.ndarray, limit: int):
    """(lo, hi) runs of batches of about ``limit`` bytes (at least one batch each)."""
    lo, n = 0, sizes.shape[0]
    ends = np.cumsum(sizes)
    while lo < n:
        done = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, done + limit, side="right")))
        yield lo, min(hi, n)
        lo = min(hi, n)


def _check(cond: bool, where: str, why: str, position: int | None = None) -> None:
    if not cond:
        at = f" at byte {position}" if position is not None else ""
        raise ShippedSegmentError(f"{where}: {why}{at}", position)


class ShippedInstall:
    """One downloaded segment checked as its ``.log`` arrives and then installed (module
    docstring). Made once its lean index is downloaded whole (the index's own checks, and its
    agreement with the listing ``seg``, are done here); ``feed(have)`` checks the batches that
    lie whole in the first ``have`` bytes of the ``.log`` and indexes them, so a pull checks one
    block while the next is on the wire; ``finish()`` checks the rest and installs the segment.
    Nothing is written outside ``incoming`` before ``finish``. Every step raises
    ShippedSegmentError naming the master's file and byte when a check fails."""

    def __init__(self, store, staging: PartitionLog, incoming: Incoming, topic: str,
                 partition: int, seg: dict, clean_upto: int, clean_time_s: int):
        fs = incoming.fs
        self.store, self.staging, self.incoming, self.seg = store, staging, incoming, seg
        self.topic, self.partition = topic, partition
        self.clean_upto, self.clean_time_s = clean_upto, clean_time_s
        self.base = base = int(seg["base"])
        self.mlog, midx = (master_path(topic, partition, base, f) for f in ("log", "index"))
        self.log_path = incoming.path(base, "log")
        # mapped, not read: the index is read a chunk at a time as its blocks are checked
        raw_idx = fs.map(incoming.path(base, "index"))
        _check(len(raw_idx) == seg["index_size"], midx, f"{len(raw_idx)} bytes received of "
               f"{seg['index_size']}")
        try:
            idx = IncomingSegment(raw_idx, midx, fs.local_path(incoming.dir))
        except CorruptRecordError as e:
            raise ShippedSegmentError(str(e), e.position) from None
        _check(idx.log_size == seg["log_size"] and idx.n == seg["records"] and idx.n > 0, midx,
               f"the lean index describes {idx.n} records in {idx.log_size} bytes, the listing "
               f"{seg['records']} in {seg['log_size']}")
        first, self.last = idx.first, idx.last
        _check(first == seg["first_offset"] and self.last == seg["last_offset"], midx,
               "the lean index's offsets are not the listing's")
        self.at = max(base, staging.next_offset)
        _check(self.at <= first, self.mlog, f"offset {first} is not past what was pulled "
               f"before ({staging.next_offset})")
        self.idx = idx
        # blocks of whole chunks (a chunk holds whole batches, and says where they start in
        # the .log): each chunk of the master's index is decoded once, when its block is
        # checked (decoded whole it was 48 bytes a record of fresh memory)
        starts, ends = idx.chunk_starts, idx.chunk_ends
        self.groups = list(_batch_groups(ends - starts, INSTALL_BLOCK))
        self.group_starts = [int(starts[lo]) for lo, _ in self.groups]
        self.ends = [int(ends[hi - 1]) for _, hi in self.groups]
        self.done = 0  # groups checked and indexed

    def ready(self, have: int) -> bool:
        """Does the first ``have`` bytes of the ``.log`` hold a block not yet checked?"""
        return self.done < len(self.groups) and self.ends[self.done] <= have

    def feed(self, have: int) -> None:
        """Check and index the blocks that lie whole in the first ``have`` bytes received."""
        if not self.ready(have):
            return
        whole = self.incoming.fs.map(self.log_path, have)
        while self.ready(have):
            lo, hi = self.groups[self.done]
            try:
                m, bpos, bsize, bcount = self.idx.chunk_batches(lo, hi)
            except CorruptRecordError as e:
                raise ShippedSegmentError(str(e), e.position) from None
            first = np.zeros(bcount.shape[0] + 1, np.int64)  # each batch's first entry in m
            np.cumsum(bcount, out=first[1:])
            # (a chunk of large records is checked a bounded block of its batches at a time)
            for blo, bhi in _batch_groups(bsize, INSTALL_BLOCK):
                self._check_block(whole, bpos[blo:bhi], bsize[blo:bhi], bcount[blo:bhi],
                                  m[first[blo]:first[bhi]])
            self.done += 1

    def _check_block(self, whole: np.ndarray, bpos: np.ndarray, bsize: np.ndarray,
                     bcount: np.ndarray, m: np.ndarray) -> None:
        """Check the batches at ``bpos`` (whole in ``whole``, the .log received) against their
        master's index entries ``m``, and index them under this store's secret."""
        start, end = int(bpos[0]), int(bpos[-1] + bsize[-1])
        try:
            t, e = IncomingSegment.check(whole[start:end], start, self.topic.encode(),
                                         self.partition, self.mlog, self.store.secret)
        except CorruptRecordError as err:
            raise ShippedSegmentError(str(err), err.position) from None
        _check(t.shape[0] == bpos.shape[0] and bool(np.array_equal(t[:, 0], bpos))
               and bool(np.array_equal(t[:, 1], bsize))
               and bool(np.array_equal(t[:, 6], bcount)),
               self.mlog, "the batches are not the ones the lean index lists", start)
        n = m.shape[0]
        bad = (np.flatnonzero((e["offset"] != m["offset"]) | (e["timestamp"] != m["timestamp"]))
               if e.shape[0] == n else np.zeros(1, np.int64))
        _check(e.shape[0] == n and bad.size == 0, self.mlog,
               "a record's offset or timestamp is not its index entry's",
               int(m["position"][bad[0]]) if bad.size and e.shape[0] == n else start)
        mask = B.FLAG_TOMBSTONE | B.FLAG_KEYLESS
        bad = np.flatnonzero((e["flags"] & mask) != (m["flags"] & mask))
        _check(bad.size == 0, self.mlog, "a record's tombstone/keyless flags are not its "
               "index entry's", int(m["position"][bad[0]]) if bad.size else None)
        stamp_clean(e, self.clean_upto, self.clean_time_s)
        self.idx.add_batches(start, bsize, bcount, e)

    def finish(self) -> int:
        """Check what is left, then install the segment into the staging log (the .log as
        downloaded, the index rebuilt under this store's secret) with the compaction swap, and
        roll the staging log past it. Returns its record count."""
        fs, staging, seg = self.incoming.fs, self.staging, self.seg
        size = fs.size(self.log_path)
        _check(size == seg["log_size"], self.mlog, f"{size} bytes received of "
               f"{seg['log_size']}")
        self.incoming.close()
        self.feed(size)
        self.store.require_format(2)
        staging.roll(self.at)
        sdir = swap.staging_dir(staging.dir)
        fs.remove_tree(sdir)
        name = fn.base_name(self.at)
        try:
            # the .log goes in as downloaded (every batch checked by feed); the index is this one
            out = fs.open_append(f"{sdir}/{name}{fn.INDEX_SUFFIX}")
            try:
                self.idx.write_index(out)  # (the codec of its batches)
                out.sync()
            finally:
                out.close()
            staged_log = f"{sdir}/{name}{fn.LOG_SUFFIX}"
            fs.rename(self.log_path, staged_log)  # (a crash from here: the download restarts)
            out = fs.open_append(staged_log)
            try:
                out.sync()
            finally:
                out.close()
        except BaseException:
            fs.remove_tree(sdir)
            raise
        fs.sync_dir(sdir)
        plan = swap.SwapPlan([self.at], [self.at], None)
        swap.commit(fs, staging.dir, plan)  # a crash from here on installs it at the next open
        swap.apply(fs, staging.dir, plan)
        staging.reload_after_swap()
        swap.empty_trash(fs, staging.dir)
        staging.roll(self.last + 1)  # later records go to a format-1 segment
        self.incoming.drop()
        return self.idx.n


def install_shipped(store, staging: PartitionLog, incoming: Incoming, topic: str,
                    partition: int, seg: dict, clean_upto: int, clean_time_s: int) -> int:
    """Check the downloaded segment ``seg`` (a listing entry, its files downloaded whole) and
    install it into ``staging`` as a format-2 segment (ShippedInstall at once). Returns its
    record count. Raises ShippedSegmentError naming the master's file and byte when a check
    fails."""
    return ShippedInstall(store, staging, incoming, topic, partition, seg, clean_upto,
                          clean_time_s).finish()


def roll_past_shipped(staging: PartitionLog) -> None:
    """After a crash between a shipped segment's install and the roll past it, the staging
    log's last segment is format 2: roll, so that no record is appended to it."""
    if staging.segments and staging.segments[-1].log_size \
            and not staging.segments[-1].appendable:
        staging.roll()


__all__ = ["INCOMING_DIR", "Incoming", "ShippedInstall", "ShippedSegmentError", "install_shipped",
           "master_path", "roll_past_shipped", "stamp_clean"]
