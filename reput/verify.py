"""Check a whole store without modifying its data: every record's CRC, every .bcq entry, offset order,
and each partition's files against its segment list (docs/formats/segment-list.md) or manifest.

Like LevelDB's log reader, a problem is reported with its file and byte position and the check
keeps going (resynchronising on the next index entry), so one run lists every problem. Each
segment checks itself (``Segment.verify``: reput/segment_v1.py, segment_v2.py); this module
walks the store, its partitions and their commit logs. Safe to
run next to a live writer: bytes past the last index entry of a segment a writer has open that
form a torn record are an append in progress, not corruption. Against the segment list: a listed
segment whose files are missing, a file the list does not name that holds bytes, sizes, the
.bcq's checksum, record count, first and last offsets, offsets outside [base, next), a damaged
or missing list; the list against the partition's ledger (reput/ledger.py). The first problem of
a partition is recorded beside it as its damage (reput/damage_record.py), so that `kcompact
inspect` and the metrics show it until it is repaired.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import damage_record as DR
from . import filenames as fn
from . import swap
from .errors import CorruptRecordError, ReputError
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


def verify_partition(store: Store, topic: str, partition: int, report: VerifyReport, *,
                     found_by: str | None = "verify") -> None:
    """Check one partition, adding what is wrong to ``report``; the first problem found is
    recorded beside the partition as its damage (reput/damage_record.py; ``found_by`` None:
    not recorded)."""
    before = len(report.problems)
    try:
        _verify_partition(store, topic, partition, report)
    finally:
        if found_by and len(report.problems) > before:
            first = report.problems[before]
            DR.write(store.fs, topic, partition, path_=first.path, position=first.position,
                     reason=str(first), found_by=found_by, found_ms=store.clock.ms())


def _verify_partition(store: Store, topic: str, partition: int, report: VerifyReport) -> None:
    try:
        pl = store.open_view(topic, partition, strict=False)
        # the partition's own manifest objects, not the store catalog's copy of the newest
        # (docs/formats/store-catalog.md): a lost version is damage, as without a catalog
        pl.reload_manifest(0.0, from_first=True)
    except ReputError as e:  # an unreadable manifest
        report.partitions += 1
        report.problems.append(Problem(getattr(e, "path", None) or
                                       fn.partition_dir(topic, partition), 0, str(e)))
        return
    report.partitions += 1
    if store.publisher.checkpoint_file:  # (else the manifest's, validated when read)
        try:
            swap.read_checkpoint(store.fs, pl.dir)
        except CorruptRecordError as e:
            report.problems.append(Problem(e.path, 0, str(e).split(": ", 1)[-1]))
    for d in pl.problems:
        report.problems.append(Problem(d.path, d.position or 0,
                                       getattr(d, "what", None) or str(d).split(": ", 1)[-1]))

    def problem(path: str, position: int, message: str) -> None:
        report.problems.append(Problem(path, position, message))

    prev_last = -1
    segs = pl.segments
    for si, seg in enumerate(segs):
        report.segments += 1
        report.bytes += seg.log_size
        nxt = segs[si + 1].base if si + 1 < len(segs) else None
        records, prev_last = seg.verify(store.secret, problem, prev_last, nxt)
        report.records += records


def verify_commitlogs(store: Store, report: VerifyReport) -> None:
    from .salvage_store import commitlog_segments
    for writer, base, _size, stop, what in commitlog_segments(store.commitlog_fs):
        report.commitlog_segments += 1
        if stop is not None:
            report.problems.append(Problem(fn.commitlog_segment(writer, base), stop,
                                           "corrupt record in the commit log"
                                           if what == "corrupt record" else "torn record"))


def verify_store(store: Store, topic: str | None = None, *,
                 found_by: str | None = "verify") -> VerifyReport:
    report = VerifyReport()
    for t in ([topic] if topic else store.topics()):
        for p in store.partitions(t):
            verify_partition(store, t, p, report, found_by=found_by)
    if topic is None:
        verify_commitlogs(store, report)
    return report
