"""Where a damaged partition's segments are, for salvage (reput/salvage.py): what a local
store's directory and segment list, an object store's manifest versions (and orphans past the
newest that reads), the shared objects' parts and a writer's local directory hold, each as a
``Source``; and what salvage reports (``Salvaged``, ``Loss``, ``Damage``).

Which of these a partition's salvage reads is its store kind's (reput/repair_kinds.py
``salvage_sources``); nothing here asks which kind the store is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from . import filenames as fn
from . import manifest as M
from . import segment_list as SL
from .backend import Backend
from .errors import CorruptRecordError, ReputError


@dataclass
class Loss:
    """Offsets ``first``..``last`` (inclusive; ``last`` None: up to the partition's end, unknown)
    held records that were not kept: ``records`` of them when the index says how many."""

    first: int
    last: int | None
    records: int | None
    path: str
    reason: str

    def text(self) -> str:
        rng = (f"offsets {self.first}..{self.last}" if self.last is not None
               else f"offsets from {self.first} on")
        n = f"{self.records} records" if self.records is not None else "records"
        return f"{rng} ({n}): {self.path}: {self.reason}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Damage:
    """A problem met while reading (file, byte, what), kept for the quarantine report."""

    path: str
    position: int
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Salvaged:
    """What ``salvage_partition`` found."""

    topic: str
    partition: int
    kept: int = 0
    first_kept: int | None = None
    last_kept: int = -1
    #: where the partition continues (module docstring, "Next offset")
    next_offset: int = 0
    losses: list[Loss] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    #: the partition's files (store-relative, with the backend holding each): the evidence
    files: list[tuple[Backend, str]] = field(default_factory=list)
    #: the compaction horizon the damaged partition had (-1: unknown or never)
    old_horizon: int = -1
    #: (path, reason) when what followed the records kept is unknown (a lost manifest version)
    unknown_tail: tuple[str, str] | None = None
    #: an S3 store with shared uploads: per writer the highest journal entry whose part of the
    #: partition was read (the repaired manifest's ``split_to``: those parts are replaced)
    split_to: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"topic": self.topic, "partition": self.partition, "kept": self.kept,
                "first_kept": self.first_kept, "last_kept": self.last_kept,
                "next_offset": self.next_offset,
                "lost": [x.to_dict() for x in self.losses],
                "damage": [d.to_dict() for d in self.damage]}


@dataclass
class Source:
    """A segment as found: from the segment list or manifest, the directory, or both."""

    base: int
    fs: Backend
    log: str
    bcq: str
    end: int | None = None               # first offset past its range
    listed_log_size: int | None = None   # what the list or manifest says
    listed_records: int | None = None
    listed_first: int | None = None
    listed_last: int | None = None
    listed_bcq: tuple[int, int] | None = None   # (size, crc32c) the list gives its .bcq
    exact: np.ndarray | None = None      # the offsets it holds, when known exactly
    open: bool = False                   # a writer's active segment (a torn tail is normal)
    #: an object no manifest version that reads lists, past the newest one's end: records
    #: it holds that verify are kept (a newest version lost), nothing of it counts as lost
    orphan: bool = False


def local_sources(fs: Backend, pdir: str, out: Salvaged, *, listed: bool = True
                   ) -> tuple[list[Source], int]:
    lst = None
    if listed:
        try:
            lst = SL.read(fs, pdir)
        except CorruptRecordError as e:
            out.damage.append(Damage(e.path or f"{pdir}/{fn.SEGMENT_LIST}", e.position or 0,
                                     str(e)))
        try:
            from .swap import read_checkpoint
            out.old_horizon = read_checkpoint(fs, pdir)[0]
        except CorruptRecordError as e:
            out.damage.append(Damage(e.path or pdir, 0, str(e)))
    bases: set[int] = set()
    for name in fs.listdir(pdir):
        parsed = fn.parse_base(name)
        if parsed:
            bases.add(parsed[0])
        if not fs.isdir(f"{pdir}/{name}"):
            out.files.append((fs, f"{pdir}/{name}"))
    by_base = lst.by_base() if lst is not None else {}
    bases |= set(by_base)
    sources = []
    for base in sorted(bases):
        name = fn.base_name(base)
        src = Source(base, fs, f"{pdir}/{name}{fn.LOG_SUFFIX}", f"{pdir}/{name}{fn.INDEX_SUFFIX}")
        m = by_base.get(base)
        if m is not None and not m.open:
            src.end, src.listed_log_size, src.listed_records = m.next, m.log_size, m.records
            src.listed_first, src.listed_last = m.first_offset, m.last_offset
            src.listed_bcq = (m.bcq_size, m.bcq_crc32c)
        else:
            src.open = m is not None or lst is None
        sources.append(src)
    return sources, (lst.next_offset if lst is not None else 0)


def manifest_sources(fs: Backend, pdir: str, out: Salvaged) -> tuple[list[Source], int]:
    """The newest manifest version that reads; damaged ones above it are damage (their
    segments, unknown, are a loss from the readable version's end on)."""
    for name in fs.listdir(fn.manifest_dir(pdir)):
        out.files.append((fs, f"{fn.manifest_dir(pdir)}/{name}"))
    damaged_above = False
    for v in reversed(M.list_versions(fs, pdir)):
        try:
            m = M.read_version(fs, pdir, v)
        except CorruptRecordError as e:
            out.damage.append(Damage(e.path or fn.manifest_path(pdir, v), 0, str(e)))
            damaged_above = True
            continue
        except FileNotFoundError:
            continue
        if m is None:
            continue
        out.old_horizon = m.cleaned_offset
        sources = []
        for e in m.segments:
            src = Source(e.base, fs, f"{pdir}/{e.log}", f"{pdir}/{e.bcq}",
                          listed_log_size=e.log_size, listed_records=e.records,
                          listed_first=e.first_offset, listed_last=e.last_offset,
                          exact=e.offset_array())
            if e.object is not None:
                src.fs = _in_compaction_object(fs, e, src.log, src.bcq)
                out.files.append((fs, e.object))
            else:
                out.files += [(fs, src.log), (fs, src.bcq)]
            sources.append(src)
        sources += orphans(fs, pdir, m, out)
        if damaged_above:
            # a newer version could not be read: what it listed past the records kept (this
            # version's, and those of its segment objects found) is unknown
            out.unknown_tail = (fn.manifest_dir(pdir), "a newer manifest version is damaged; "
                                "what it listed past the records kept is unknown")
        return sources, m.next_offset
    if damaged_above:
        out.losses.append(Loss(0, None, None, fn.manifest_dir(pdir),
                               "no manifest version of the partition reads"))
    return [], 0


def _in_compaction_object(fs: Backend, e, log: str, bcq: str) -> Backend:
    """A manifest entry's segment inside a compaction object (docs/formats/compaction-object.md):
    its .log and .bcq as the two byte ranges of the object the entry gives, read through a
    ``RangeView`` as the partition's reader does; cut to the object as it is (a missing object
    reads as a missing segment, a truncated one as a segment cut short)."""
    from . import shared as SH
    try:
        size = fs.size(e.object)
    except FileNotFoundError:
        size = None
    view = SH.RangeView(fs)
    add_cut(view, e.object, size, (log, e.log_pos, e.log_size), (bcq, e.bcq_pos, e.bcq_size))
    return view


def add_cut(view, obj: str, size: int | None, *ranges: tuple[str, int, int]) -> None:
    """Add each (path, position, length) range of ``obj`` to ``view``, cut to the object's
    ``size`` as it is (None: missing): a range of a missing object is missing, of a cut one
    cut short."""
    if size is None:
        return
    for path, pos, length in ranges:
        n = max(0, min(length, size - pos))
        if n:
            view.add(path, obj, pos, n)


def shared_sources(fs: Backend, topic: str, partition: int, out: Salvaged
                    ) -> tuple[list[Source], int]:
    """A store with shared uploads (docs/formats/shared-upload.md): the partition's parts of
    shared objects above its manifest's ``split_to``, each a source reading its byte ranges of
    the object (a ``RangeView``), and the next offset they reach. ``out.split_to`` gets, per
    writer, the highest entry holding one of them (the repaired manifest replaces them)."""
    from . import shared as SH
    j = SH.journal_for(fs)
    if j is None:
        return [], 0
    j.refresh(0.0)
    pdir = fn.partition_dir(topic, partition)
    try:
        m = M.read_latest(fs, pdir)
    except (CorruptRecordError, ReputError):
        m = None  # (a damaged manifest: manifest_sources reports it)
    split_to = dict(m.split_to) if m is not None else {}
    parts = j.parts(topic, partition, split_to)
    view = SH.RangeView(fs)
    srcs = []
    for p in parts:
        out.split_to[p.writer] = max(out.split_to.get(p.writer, -1), p.seq)
        d = p.desc
        if d is None:
            continue
        lrel, brel = f"{pdir}/{d.log}", f"{pdir}/{d.bcq}"
        # the object as listed
        add_cut(view, p.object, j.objects.get(p.object, (None, 0))[0],
                (lrel, p.log_pos, d.log_size), (brel, p.bcq_pos, d.bcq_size))
        srcs.append(Source(d.base, view, lrel, brel, listed_log_size=d.log_size,
                            listed_records=d.records, listed_first=d.first_offset,
                            listed_last=d.last_offset, exact=d.offset_array()))
        out.files.append((fs, p.object))
    return srcs, max((p.next_offset for p in parts), default=0)


def orphans(fs: Backend, pdir: str, m: "M.Manifest", out: Salvaged) -> list[Source]:
    """Segment objects of the partition that ``m`` does not list, based at or past its next
    offset: what a newer version listed when that version is lost (deleted, or damaged), or an
    upload whose commit never came. Their records that verify are past everything listed."""
    lister = getattr(fs, "list_objects", None)
    if lister is None:
        return []
    listed = m.names() | {n for r in m.retired for n in (r.get("log"), r.get("bcq")) if n}
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, _size, _mtime in lister(pdir):
        parsed = fn.parse_segment_object(name) if "/" not in name else None
        if parsed and name not in listed and parsed[0] >= m.next_offset:
            found.setdefault(parsed[:2], {})[parsed[2]] = name
    srcs = []
    for (base, _tag), files in sorted(found.items()):
        if "log" in files:
            src = Source(base, fs, f"{pdir}/{files['log']}",
                          f"{pdir}/{files.get('bcq', files['log'][:-4] + fn.INDEX_SUFFIX)}",
                          open=True, orphan=True)
            out.files += [(fs, src.log)] + ([(fs, src.bcq)] if "bcq" in files else [])
            srcs.append(src)
    return srcs
