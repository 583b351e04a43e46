"""Reading a damaged partition: every record that still verifies, and what was lost.

``kcompact repair`` (docs/operations-damage.md) rebuilds a damaged partition from what this
module finds in its files, the way LevelDB's ``RepairDB`` and Kafka's log recovery keep what
verifies. Its rules:

* **The .log is the truth.** Each segment's ``.log`` is read from byte 0, record by record
  (store format 1: record.md, every record's CRC) or batch by batch (format 2: segment-v2.md,
  every batch's CRC-32C and records walked); a record is kept when it verifies, belongs to this
  topic-partition, lies in its segment's offset range and comes after every record kept before
  it. The index is not needed to read: it is rebuilt, with the store's secret.
* **Damage is skipped, not the rest.** After a record or batch that fails, reading resumes at
  the next position where one verifies (the index's positions first, then a search byte by
  byte for the header's fixed fields, each candidate checked whole), so one flipped byte loses
  one record (format 1) or one batch (format 2), not the segment.
* **What was lost is said as offset ranges.** Where the segment's offsets are known exactly (a
  ``.bcq`` that matches its checksum in the segment list, a lean index whose own CRCs pass, an
  S3 manifest's offset bitmap), a loss is exactly the listed offsets not kept; elsewhere it is
  the range between the kept records around the damage (bounded by the segment's range), which
  holds every record that could have been there. A ``.log`` missing whole loses its segment's
  range; bytes past the size the segment list gives (appended) are damage that loses nothing.
* **Next offset.** The partition continues where it did (the segment list's or manifest's next
  offset), unless the loss reaches its end: then at the record after the last one kept, so a
  mirror re-reads the lost tail from Kafka if the topic still has it.

Where the segments are (the directory and its segment list, the manifest versions, shared
objects' parts) is the store kind's (reput/repair_kinds.py, reput/salvage_sources.py); this
module reads the segments it is given.

``salvage_partition`` reads and hands each run of verified records (format-1 bytes and their
``Scan``) to a sink (repair appends them to a fresh ``PartitionLog``); memory is one segment's
``.log`` mapped (a local file, or an S3 object spooled to local disk) plus a run's records.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import bcq as B
from . import bcq2 as B2
from . import segment_list as SL
from .backend import Backend
from .batch import HEADER_SIZE as BATCH_HEADER_SIZE
from .batch import MAGIC as BATCH_MAGIC
from .batch import decode_walked, walk_batch
from .errors import CorruptRecordError, ReputError  # noqa: F401 (ReputError: exported)
from .record import HEADER_SIZE as RECORD_HEADER_SIZE
from .record import SCAN_CORRUPT, SCAN_OK, Scan, gather, scan
from .repair_kinds import repair_kind_for
from .salvage_sources import Damage, Loss, Salvaged, Source

#: the record header's fixed bytes (record.md): magic at 8, topic_len at 10, reserved at 11
_R_MAGIC, _R_TLEN, _R_RESERVED, _R_PARTITION = 8, 10, 11, 12
#: a Kafka batch header's magic byte (segment-v2.md)
_B_MAGIC = 16
#: records handed to the sink at most at once (a run is cut there)
RUN_RECORDS = 1 << 16


#: a sink takes (buffer of format-1 records back to back, its Scan)
Sink = Callable[[np.ndarray, Scan], None]


def salvage_partition(fs: Backend, topic: str, partition: int, secret: bytes, sink: Sink, *,
                      local_fs: Backend | None = None) -> Salvaged:
    """Read every verifiable record of ``topic``-``partition`` in ``fs`` (a local store, or an
    object store whose partition is its manifest; ``local_fs``: a writer's local directory
    there) into ``sink``, in offset order; returns what was kept and lost (module docstring).
    Never writes."""
    out = Salvaged(topic, partition)
    sources, next_offset = repair_kind_for(fs).salvage_sources(fs, topic, partition, out,
                                                               local_fs)
    sources.sort(key=lambda s: s.base)
    for i, src in enumerate(sources):
        nxt_base = sources[i + 1].base if i + 1 < len(sources) else None
        if nxt_base is not None:
            src.end = nxt_base if src.end is None else min(src.end, nxt_base)
        _salvage_segment(src, topic, partition, secret, sink, out)
    if out.unknown_tail is not None:
        out.losses.append(Loss(out.last_kept + 1, None, None, *out.unknown_tail))
    out.losses = _merged(out.losses)
    out.next_offset = max(next_offset, out.last_kept + 1)
    if any(x.last is None or x.last > out.last_kept for x in out.losses):
        # the loss reaches the end: continue after the last record kept (re-read from Kafka)
        out.next_offset = out.last_kept + 1
    return out


# -- one segment ---------------------------------------------------------------------------------


class _Reader:
    """Keeps what one segment gave: kept offsets, damage regions (by byte), the last kept."""

    def __init__(self, src: Source, out: Salvaged, topic: str, partition: int, secret: bytes,
                 sink: Sink):
        self.src, self.out, self.sink, self.secret = src, out, sink, secret
        self.topic = topic.encode()
        self.partition = partition
        self.kept: list[np.ndarray] = []
        #: (last offset kept before the damage, first offset kept after it or None) per region
        self.regions: list[list] = []
        self.open_region: list | None = None

    def damage(self, path: str, position: int, reason: str, *, region: bool = True) -> None:
        """Note a problem; ``region``: records may have been lost from here until the next
        record kept (else it loses nothing by itself: an index, bytes past the listed size)."""
        reason = reason.removeprefix(f"{path}: ")
        self.out.damage.append(Damage(path, position, reason))
        if region and self.open_region is None:
            self.open_region = [self.out.last_kept, None, path, reason]
            self.regions.append(self.open_region)

    def keep(self, buf: np.ndarray, s: Scan) -> None:
        """Hand the records of ``s`` (in ``buf``) that belong here to the sink."""
        n = len(s)
        if n == 0:
            return
        offs = s.offsets[:n]
        lo = max(self.src.base, self.out.last_kept + 1)
        ok = (offs >= lo) & (s.partitions[:n] == self.partition)
        if self.src.end is not None:
            ok &= offs < self.src.end
        ok &= _topic_matches(buf, s, self.topic)
        # strictly increasing: a record at or below one kept before it is not kept
        if n > 1:
            ok[1:] &= np.diff(offs) > 0
        if not ok.all():
            bad = int(np.argmin(ok))
            self.damage(self.src.log, int(s.positions[bad]), "a record that verifies but "
                        "does not belong here (another partition, out of its segment's range, "
                        "or out of order)")
            if not ok.any():
                return
            idx = np.nonzero(ok)[0]
            buf = gather(buf, s.positions[idx], s.sizes[idx])
            s = scan(buf, 0, buf.shape[0], secret=self.secret, verify_crc=False)
            n, offs = len(s), s.offsets[:len(s)]
        if self.open_region is not None:
            self.open_region[1] = int(offs[0])
            self.open_region = None
        self.sink(buf, s)
        self.kept.append(offs.copy())
        self.out.kept += n
        if self.out.first_kept is None:
            self.out.first_kept = int(offs[0])
        self.out.last_kept = int(offs[-1])


def _topic_matches(buf: np.ndarray, s: Scan, topic: bytes) -> np.ndarray:
    n = len(s)
    tl = len(topic)
    pos = s.positions[:n]
    ok = buf[pos + _R_TLEN] == tl
    last = buf.shape[0] - 1
    for j in range(tl):  # (topic names are short: a column per byte)
        ok &= buf[np.minimum(pos + RECORD_HEADER_SIZE + j, last)] == topic[j]
    return ok


def _salvage_segment(src: Source, topic: str, partition: int, secret: bytes, sink: Sink,
                     out: Salvaged) -> None:
    r = _Reader(src, out, topic, partition, secret, sink)
    hints, lean = _index_hints(src, r)
    try:
        size = src.fs.size(src.log)
    except FileNotFoundError:
        size = None
    if size is None:
        if src.listed_records == 0 or (src.open and not src.listed_bcq and src.exact is None
                                       and not hints.size):
            return  # nothing was there to lose (an empty segment, an empty open one)
        r.damage(src.log, 0, "the segment's .log is missing")
        _account(src, r, out)
        return
    end = size
    listed = src.listed_log_size
    if listed is not None and size > listed:
        # bytes past the listed size were appended: read up to it, they lose nothing
        r.damage(src.log, listed, f"the .log holds {size} bytes, the segment list or manifest "
                 f"says {listed}: the bytes past it are ignored", region=False)
        end = listed
    buf = src.fs.map(src.log, size) if size else np.zeros(0, np.uint8)
    try:
        if lean or (not _looks_v1(buf) and _looks_v2(buf)):
            _read_v2(buf, end, src, r, hints)
        else:
            _read_v1(buf, end, src, r, hints)
    finally:
        del buf
    if listed is not None and size < listed:
        r.open_region = None  # (a new region: from the last record kept to the segment's end)
        r.damage(src.log, size, f"the .log holds {size} bytes, the segment list or manifest "
                 f"says {listed}: cut short")
    _account(src, r, out)


def _looks_v1(buf: np.ndarray) -> bool:
    return buf.shape[0] >= RECORD_HEADER_SIZE and int(buf[_R_MAGIC]) == 1 \
        and int(buf[_R_RESERVED]) == 0


def _looks_v2(buf: np.ndarray) -> bool:
    return buf.shape[0] >= BATCH_HEADER_SIZE and int(buf[_B_MAGIC]) == BATCH_MAGIC


def _index_hints(src: Source, r: _Reader) -> tuple[np.ndarray, bool]:
    """(byte positions of records or batches the .bcq gives, whether it is a lean index); the
    exact offsets of the segment when the .bcq can be trusted (module docstring)."""
    try:
        size = src.fs.size(src.bcq)
    except FileNotFoundError:
        if not src.open:
            r.damage(src.bcq, 0, "the segment's .bcq is missing", region=False)
        return np.zeros(0, np.int64), False
    head = src.fs.read(src.bcq, 0, min(size, 8))
    if B2.is_lean(head):
        try:
            idx = B2.LeanIndex(lambda a, n: src.fs.read(src.bcq, a, n), src.bcq, size)
            e = idx.entries
        except CorruptRecordError as e:
            r.damage(src.bcq, e.position or 0, str(e), region=False)
            return np.zeros(0, np.int64), True
        if src.exact is None:
            src.exact = e["offset"].copy()  # its header, directory and chunk CRCs passed
        return np.unique(e["position"].astype(np.int64)), True
    raw = np.frombuffer(src.fs.read(src.bcq), np.uint8)
    e = B.view(raw)
    trusted = src.listed_bcq is not None and (raw.shape[0], SL.crc32c(raw)) == src.listed_bcq
    if src.listed_bcq is not None and not trusted:
        r.damage(src.bcq, 0, "the .bcq does not match its checksum in the segment list",
                 region=False)
    if trusted and src.exact is None:
        src.exact = e["offset"].copy()
    return e["position"].astype(np.int64), False


def _read_v1(buf: np.ndarray, end: int, src: Source, r: _Reader, hints: np.ndarray) -> None:
    pos = 0
    while pos < end:
        s = scan(buf, pos, end, secret=r.secret, verify_crc=True)
        for a in range(0, len(s), RUN_RECORDS):
            z = min(len(s), a + RUN_RECORDS)
            lo, hi = int(s.positions[a]), int(s.positions[z - 1] + s.sizes[z - 1])
            r.keep(buf[lo:hi], scan(buf[lo:hi], 0, hi - lo, secret=r.secret, verify_crc=False))
        if s.status == SCAN_OK:
            return
        stop = int(s.stop)
        nxt = _record_after(buf, stop + 1, end, r, hints)
        if s.status == SCAN_CORRUPT or nxt is not None or not src.open:
            # (a torn record at the end of a writer's open segment is an append cut by a
            # crash, not damage: reput dispatches it again from the commit log)
            r.damage(src.log, stop, "corrupt record (CRC or header check failed)"
                     if s.status == SCAN_CORRUPT else "record cut short")
        if nxt is None:
            return
        pos = nxt


def _record_after(buf: np.ndarray, start: int, end: int, r: _Reader, hints: np.ndarray
                  ) -> int | None:
    """The first position >= ``start`` where a whole record of this topic-partition verifies:
    the index's positions first, then every position whose header bytes fit (record.md)."""
    for p in hints[(hints >= start) & (hints < end)][:64].tolist():
        if _record_at(buf, p, end, r.secret):
            return p
    tl = len(r.topic)
    part = np.frombuffer(np.int32(r.partition).tobytes(), np.uint8)
    lo = start + _R_MAGIC
    hi = end - RECORD_HEADER_SIZE + _R_MAGIC - tl + 1
    step = 1 << 22
    while lo < hi:
        z = min(hi, lo + step)
        cand = np.nonzero(buf[lo:z] == 1)[0] + lo - _R_MAGIC
        if cand.size:
            cand = cand[buf[cand + _R_TLEN] == tl]
            cand = cand[buf[cand + _R_RESERVED] == 0]
            for j in range(4):
                cand = cand[buf[cand + _R_PARTITION + j] == part[j]]
            for j in range(tl):
                cand = cand[buf[cand + RECORD_HEADER_SIZE + j] == r.topic[j]]
            for p in cand.tolist():
                if _record_at(buf, p, end, r.secret):
                    return p
        lo = z
    return None


def _record_at(buf: np.ndarray, p: int, end: int, secret: bytes) -> bool:
    s = scan(buf[p:end], 0, end - p, secret=secret, verify_crc=True)
    return len(s) > 0


def _read_v2(buf: np.ndarray, end: int, src: Source, r: _Reader, hints: np.ndarray) -> None:
    pos = 0
    while pos < end:
        try:
            w = walk_batch(buf[:end], pos, pos, len(r.topic), src.log)
        except CorruptRecordError as e:
            r.damage(src.log, pos, str(e))
            nxt = _batch_after(buf, pos + 1, end, r, hints, src.log)
            if nxt is None:
                return
            pos = nxt
            continue
        d = decode_walked([w], r.topic, r.partition)
        s = scan(d.data, 0, d.data.shape[0], secret=r.secret, verify_crc=True)
        r.keep(d.data, s)
        pos += w.head.size


def _batch_after(buf: np.ndarray, start: int, end: int, r: _Reader, hints: np.ndarray,
                 where: str) -> int | None:
    """The first position >= ``start`` where a whole batch verifies (CRC-32C, records
    walked): the index's batch positions first, then every position with the magic byte."""
    def ok(p: int) -> bool:
        try:
            walk_batch(buf[:end], p, p, len(r.topic), where)
            return True
        except CorruptRecordError:
            return False
    for p in hints[(hints >= start) & (hints < end)][:64].tolist():
        if ok(p):
            return p
    lo, hi = start + _B_MAGIC, end - BATCH_HEADER_SIZE + _B_MAGIC + 1
    step = 1 << 22
    while lo < hi:
        z = min(hi, lo + step)
        for p in (np.nonzero(buf[lo:z] == BATCH_MAGIC)[0] + lo - _B_MAGIC).tolist():
            if ok(p):
                return p
        lo = z
    return None


def _account(src: Source, r: _Reader, out: Salvaged) -> None:
    """The segment's losses: exact when its offsets are known, else the damage regions."""
    if src.orphan:
        return  # (not the partition's as its manifest says: nothing of it is lost)
    kept = np.concatenate(r.kept) if r.kept else np.zeros(0, np.int64)
    if src.exact is not None:
        lost_mask = ~np.isin(src.exact, kept)
        if lost_mask.any():
            why = r.regions[0][3] if r.regions else "records listed but not found"
            path = r.regions[0][2] if r.regions else src.log
            for a, z in _runs(lost_mask):
                out.losses.append(Loss(int(src.exact[a]), int(src.exact[z - 1]), z - a, path,
                                       why))
        return
    for before, after, path, why in r.regions:
        if src.listed_records is not None and kept.shape[0] >= src.listed_records:
            break  # every record the segment list counts was kept
        first = max(before + 1, src.base)
        if src.listed_first is not None and src.listed_first >= 0:
            first = max(first, src.listed_first)
        if after is not None:
            last = after - 1
        elif src.listed_last is not None and src.listed_last >= 0:
            last = src.listed_last
        elif src.end is not None:
            last = src.end - 1
        else:
            last = None
        if last is not None and last < first:
            continue  # nothing could have been there
        out.losses.append(Loss(first, last, None, path, why))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[a, z) ranges where ``mask`` is true."""
    d = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


def _merged(losses: list[Loss]) -> list[Loss]:
    out: list[Loss] = []
    for x in sorted(losses, key=lambda x: x.first):
        if out and out[-1].last is not None and x.first <= out[-1].last + 1 \
                and out[-1].path == x.path:
            y = out[-1]
            y.last = None if x.last is None else max(y.last, x.last)
            y.records = (None if y.records is None or x.records is None
                         else y.records + x.records)
            continue
        out.append(x)
    return out


__all__ = ["Damage", "Loss", "Salvaged", "salvage_partition", "ReputError"]
