"""Check a whole store without modifying it: every record's CRC, every .bcq entry, offset order,
and each partition's files against its segment list (docs/formats/segment-list.md) or manifest.

Like LevelDB's log reader, a problem is reported with its file and byte position and the check
keeps going (resynchronising on the next index entry), so one run lists every problem. Safe to
run next to a live writer: bytes past the last index entry of a segment a writer has open that
form a torn record are an append in progress, not corruption. Against the segment list: a listed
segment whose files are missing, a file the list does not name that holds bytes, sizes, the
.bcq's checksum, record count, first and last offsets, offsets outside [base, next), a damaged
or missing list.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from . import _kernels as K
from . import _native as _N
from . import bcq as B
from . import filenames as fn
from . import swap
from .errors import CorruptRecordError, ReputError
from .partition import PartitionLog
from .record import scan
from .segment_list import crc32c
from .store import Store


@dataclass
class Problem:
    path: str
    position: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}: byte {self.position}: {self.message}"


@dataclass
class VerifyReport:
    problems: list[Problem] = field(default_factory=list)
    partitions: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    commitlog_segments: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "partitions": self.partitions, "segments": self.segments,
                "records": self.records, "bytes": self.bytes,
                "commitlog_segments": self.commitlog_segments,
                "problems": [asdict(p) for p in self.problems]}


_CMP_FIELDS = ("offset", "timestamp", "digest_lo", "digest_hi", "position", "size", "flags")


def verify_partition(store: Store, topic: str, partition: int, report: VerifyReport) -> None:
    try:
        pl = PartitionLog(store.fs, topic, partition, store.secret,
                          require_list=store.require_list, strict=False)
    except ReputError as e:  # an unreadable manifest
        report.partitions += 1
        report.problems.append(Problem(getattr(e, "path", None) or
                                       fn.partition_dir(topic, partition), 0, str(e)))
        return
    report.partitions += 1
    if store.fs.appendable:  # (on S3 the horizon is the manifest's, validated when read)
        try:
            swap.read_checkpoint(store.fs, pl.dir)
        except CorruptRecordError as e:
            report.problems.append(Problem(e.path, 0, str(e).split(": ", 1)[-1]))
    for d in pl.problems:
        report.problems.append(Problem(d.path, d.position or 0,
                                       getattr(d, "what", None) or str(d).split(": ", 1)[-1]))
    prev_last = -1
    for si, seg in enumerate(pl.segments):
        report.segments += 1
        report.bytes += seg.log_size
        # a segment a writer may still append to (or a crash left torn): its tail is its own
        is_active = seg.open_tail
        log_path, idx_path = pl.seg_log_path(seg), pl.seg_index_path(seg)
        fs = pl.seg_fs(seg)
        try:
            fmt = pl.seg_format(seg)
        except FileNotFoundError:
            fmt = 1  # reported below
        if fmt == 2:
            prev_last = _verify_v2(store, pl, seg, si, prev_last, report)
            continue
        if seg.index_size % B.ENTRY_SIZE:
            report.problems.append(Problem(idx_path, seg.index_size - seg.index_size % B.ENTRY_SIZE,
                                           "partial index entry at the end of the .bcq"))
        try:
            raw = fs.map(idx_path, seg.entry_count * B.ENTRY_SIZE) if seg.entry_count else \
                np.zeros(0, np.uint8)
            buf = fs.map(log_path, seg.log_size) if seg.log_size else np.zeros(0, np.uint8)
        except FileNotFoundError as e:
            report.problems.append(Problem(e.filename or log_path, 0, "listed by the partition "
                                           "manifest but missing from the store"))
            continue
        idx = B.view(raw)
        if seg.entry is not None:
            _check_manifest_entry(seg, idx, buf, log_path, idx_path, report)
        if seg.meta is not None and not seg.meta.open:
            _check_list_entry(seg.meta, raw, idx, idx_path, report)
        pos = 0
        i = 0  # next index entry expected
        log_size = min(seg.log_size, int(buf.shape[0]))
        while pos < log_size:
            s = scan(buf, pos, log_size, secret=store.secret, verify_crc=True)
            n = len(s)
            report.records += n
            if n:
                exp = B.entries_from_scan(s, 0, n, 0)
                got = idx[i:i + n]
                m = min(n, got.shape[0])
                bad = np.zeros(m, dtype=bool)
                for f in _CMP_FIELDS:
                    bad |= exp[f][:m] != got[f][:m]
                for j in np.nonzero(bad)[0][:20]:
                    report.problems.append(Problem(
                        idx_path, int(i + j) * B.ENTRY_SIZE,
                        f"index entry {int(i + j)} does not match the record at byte "
                        f"{int(exp[j]['position'])} of the .log (rebuild the .bcq)"))
                if got.shape[0] < n and not is_active:
                    report.problems.append(Problem(
                        idx_path, got.shape[0] * B.ENTRY_SIZE,
                        f"{n - got.shape[0]} records of the .log have no index entry"))
                offs = s.offsets[:n]
                if offs[0] <= prev_last or np.any(np.diff(offs) <= 0):
                    report.problems.append(Problem(log_path, int(s.positions[0]),
                                                   "offsets do not strictly increase"))
                end = seg.meta.next if seg.meta is not None and not seg.meta.open else (
                    pl.segments[si + 1].base if si + 1 < len(pl.segments) else None)
                if offs[0] < seg.base or (not is_active and end is not None
                                          and offs[-1] >= end):
                    report.problems.append(Problem(log_path, int(s.positions[0]),
                                                   "offsets outside the segment's range"))
                prev_last = int(offs[-1])
                i += n
            if s.status == K.SCAN_OK:
                break
            stop = int(s.stop)
            indexed_end = (int(idx[-1]["position"]) + int(idx[-1]["size"])) if idx.shape[0] else 0
            if s.status == K.SCAN_TORN and is_active and stop >= indexed_end:
                break  # an append in progress (or a torn tail the writer will cut on open)
            report.problems.append(Problem(
                log_path, stop, "corrupt record (CRC or header check failed)"
                if s.status == K.SCAN_CORRUPT else "record runs past the end of the segment"))
            # resynchronise on the next index entry after the bad record
            later = np.nonzero(idx["position"].astype(np.int64) > stop)[0]
            if later.size == 0:
                break
            i = int(later[0])
            pos = int(idx[i]["position"])
        if i < idx.shape[0]:
            report.problems.append(Problem(idx_path, i * B.ENTRY_SIZE,
                                           f"{idx.shape[0] - i} index entries point past the "
                                           "last valid record of the .log"))
        del buf, raw


def _check_list_entry(m, raw: np.ndarray, idx: np.ndarray, idx_path: str,
                      report: VerifyReport) -> None:
    """A local segment's segment-list entry (docs/formats/segment-list.md) against its .bcq
    (its size was compared when the partition was opened)."""
    if m.format != 1:
        report.problems.append(Problem(idx_path, 0, f"the segment list says format {m.format}, "
                                       "the .bcq is not a lean index"))
        return
    if raw.shape[0] == m.bcq_size and crc32c(raw) != m.bcq_crc32c:
        report.problems.append(Problem(idx_path, 0, f"the .bcq does not match its checksum in "
                                       f"the segment list (crc32c {crc32c(raw):08x}, listed "
                                       f"{m.bcq_crc32c:08x})"))
        return
    if idx.shape[0] == m.records and m.records and (
            int(idx[0]["offset"]), int(idx[-1]["offset"])) != (m.first_offset, m.last_offset):
        report.problems.append(Problem(idx_path, 0, "the segment list's first/last offsets do "
                                       "not match the .bcq"))


_CMP_V2 = ("offset", "timestamp", "digest_lo", "digest_hi", "flags")


def _verify_v2(store: Store, pl: PartitionLog, seg, si: int, prev_last: int,
               report: VerifyReport) -> int:
    """A format-2 segment (docs/formats/segment-v2.md, bcq-v2.md): the lean index's header,
    directory and chunk CRCs, every batch's CRC-32C and records, each record against its entry
    (offset, timestamp, key digest, flags). Returns the last offset seen."""
    from .batch import decode_batches
    from .errors import CorruptRecordError
    log_path, idx_path = pl.seg_log_path(seg), pl.seg_index_path(seg)
    try:
        idx = pl.index(seg)
    except CorruptRecordError as e:
        report.problems.append(Problem(idx_path, e.position or 0, f"{e} (the lean index is "
                                       "damaged: rebuild the partition from a replica)"))
        return prev_last
    except FileNotFoundError as e:
        report.problems.append(Problem(e.filename or log_path, 0, "listed by the partition "
                                       "manifest but missing from the store"))
        return prev_last
    if seg.entry is not None:
        try:
            size = pl.seg_fs(seg).size(log_path)
        except FileNotFoundError:
            report.problems.append(Problem(log_path, 0, "listed by the partition manifest but "
                                           "missing from the store"))
            return prev_last
        if size != seg.entry.log_size:
            report.problems.append(Problem(log_path, size, f"the .log object holds {size} "
                                           f"bytes, the manifest says {seg.entry.log_size}"))
        if idx.n != seg.entry.records:
            report.problems.append(Problem(idx_path, 0, f"the lean index lists {idx.n} records, "
                                           f"the manifest says {seg.entry.records}"))
        elif idx.n and not np.array_equal(idx.entries["offset"], seg.entry.offset_array()):
            report.problems.append(Problem(idx_path, 0, "the manifest's offset bitmap does not "
                                           "match the lean index's offsets"))
    expect = seg.expected_bcq()  # (size, CRC32C) its segment-list or manifest entry gives
    if expect is not None:
        try:
            raw = pl.seg_fs(seg).read(idx_path)
        except FileNotFoundError:
            raw = b""
        if (len(raw), crc32c(raw)) != expect:
            report.problems.append(Problem(idx_path, 0, f"the lean index does not match its "
                                           f"checksum ({len(raw)} bytes, crc32c "
                                           f"{crc32c(raw):08x}; listed {expect[0]} bytes, "
                                           f"{expect[1]:08x})"))
    m = seg.meta if seg.meta is not None and not seg.meta.open else None
    if m is not None:
        first = int(idx.dir["first_offset"][0]) if idx.chunk_count else -1
        last = int(idx.dir["last_offset"][-1]) if idx.chunk_count else -1
        if m.format != 2:
            report.problems.append(Problem(idx_path, 0, f"the segment list says format "
                                           f"{m.format}, the .bcq is a lean index (format 2)"))
        elif idx.n != m.records or (first, last) != (m.first_offset, m.last_offset):
            report.problems.append(Problem(idx_path, 0, f"the lean index lists {idx.n} records, "
                                           f"offsets {first}..{last}; the segment list says "
                                           f"{m.records}, {m.first_offset}..{m.last_offset}"))
    topic = pl.topic.encode()
    nxt_base = m.next if m is not None else (
        pl.segments[si + 1].base if si + 1 < len(pl.segments) else None)
    for i in range(idx.chunk_count):
        try:
            e = idx.chunk(i)
        except CorruptRecordError as err:
            report.problems.append(Problem(idx_path, err.position or 0, str(err)))
            continue
        start = int(idx.dir["first_position"][i])
        end = (int(idx.dir["first_position"][i + 1]) if i + 1 < idx.chunk_count
               else idx.log_size)
        try:
            data = np.frombuffer(pl.read_log(seg, start, end - start), np.uint8)
            d = decode_batches(data, start, topic, pl.partition, log_path)
        except CorruptRecordError as err:
            report.problems.append(Problem(log_path, err.position or start,
                                           f"{err} (rebuild the partition from a replica)"))
            continue
        report.records += d.offsets.shape[0]
        sc = scan(d.data, 0, d.data.shape[0], secret=store.secret, verify_crc=True)
        exp = B.entries_from_scan(sc, 0, len(sc), 0)
        if len(sc) != e.shape[0] or sc.status != K.SCAN_OK:
            report.problems.append(Problem(log_path, start, f"the batches at byte {start} hold "
                                           f"{len(sc)} records, the lean index lists "
                                           f"{e.shape[0]}"))
            continue
        bad = np.zeros(e.shape[0], dtype=bool)
        for f in _CMP_V2:
            bad |= exp[f] != e[f]
        heads = d.heads.positions
        bad |= heads[d.batch_of] != e["position"].astype(np.int64)
        for j in np.nonzero(bad)[0][:20]:
            report.problems.append(Problem(idx_path, int(idx.dir["chunk_pos"][i]),
                                           f"lean index entry {int(idx.chunk_first_entry(i) + j)}"
                                           f" does not match record {int(d.offsets[j])} of the "
                                           "batches (rebuild the partition from a replica)"))
        offs = d.offsets
        if offs.shape[0] and (offs[0] <= prev_last or offs[0] < seg.base
                              or (nxt_base is not None and offs[-1] >= nxt_base)):
            report.problems.append(Problem(log_path, start, "offsets outside the segment's "
                                           "range or not increasing"))
        if offs.shape[0]:
            prev_last = int(offs[-1])
    return prev_last


def _check_manifest_entry(seg, idx: np.ndarray, buf: np.ndarray, log_path: str, idx_path: str,
                          report: VerifyReport) -> None:
    """An S3 segment's manifest entry (docs/formats/manifest.md) against its objects."""
    e = seg.entry
    if buf.shape[0] != e.log_size:
        report.problems.append(Problem(log_path, int(buf.shape[0]), f"the .log object holds "
                                       f"{buf.shape[0]} bytes, the manifest says {e.log_size}"))
    if idx.shape[0] != e.records:
        report.problems.append(Problem(idx_path, int(idx.shape[0]) * B.ENTRY_SIZE,
                                       f"the .bcq holds {idx.shape[0]} entries, the manifest "
                                       f"says {e.records} records"))
        return
    if e.records and not np.array_equal(idx["offset"], e.offset_array()):
        report.problems.append(Problem(idx_path, 0, "the manifest's offset bitmap does not "
                                       "match the .bcq's offsets"))
    elif e.records and (int(idx[0]["offset"]), int(idx[-1]["offset"])) != (e.first_offset,
                                                                           e.last_offset):
        report.problems.append(Problem(idx_path, 0, "the manifest's first/last offsets do not "
                                       "match the .bcq"))


def verify_commitlogs(store: Store, report: VerifyReport) -> None:
    fs = store.commitlog_fs
    for writer in fs.listdir(fn.COMMITLOG_DIR):
        try:
            fn.validate_writer(writer)
        except Exception:
            continue
        bases = sorted(b for b, kind in filter(None, map(fn.parse_base,
                                                          fs.listdir(fn.writer_dir(writer))))
                       if kind == "log")
        for k, base in enumerate(bases):
            path = fn.commitlog_segment(writer, base)
            size = fs.size(path)
            report.commitlog_segments += 1
            if size == 0:
                continue
            buf = fs.map(path, size)
            _, stop, status = _N.count_records(buf, 0, size, True)
            if status == K.SCAN_OK:
                continue
            if status == K.SCAN_TORN and k == len(bases) - 1:
                continue  # a torn tail in the active segment: the writer truncates it on open
            report.problems.append(Problem(path, int(stop), "corrupt record in the commit log"
                                           if status == K.SCAN_CORRUPT else "torn record"))


def verify_store(store: Store, topic: str | None = None) -> VerifyReport:
    report = VerifyReport()
    for t in ([topic] if topic else store.topics()):
        for p in store.partitions(t):
            verify_partition(store, t, p, report)
    if topic is None:
        verify_commitlogs(store, report)
    return report
