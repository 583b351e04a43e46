"""One segment of a partition's compaction log: a .log and its .bcq, as a PartitionLog sees them.

Sizes are what the partition last listed (a writer's appends move them); the mapped index is
cached until the files change (``invalidate``). On an object store a committed segment is an
immutable object pair named by the partition manifest (docs/formats/manifest.md), whose entry
answers offset questions without a download; on a local store a segment's entry in the segment
list (docs/formats/segment-list.md) says what its files must be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bcq as B
from .segment_desc import SegmentDesc


@dataclass(eq=False)
class Segment:
    base: int
    log_size: int
    index_size: int
    _map: np.ndarray | None = None
    _map_size: int = -1
    #: a sealed format-2 .log mapped by PartitionLog.log_bytes
    _log_map: np.ndarray | None = None
    _index: "B.Index | None" = None
    _index_log_size: int = -1
    #: "file": <base>.log/.bcq in the partition directory (a local store's segment, or a
    #: writer's active segment on S3); "remote": a sealed object listed by the manifest;
    #: "staged": a compaction output on local disk, not committed yet (S3 only)
    kind: str = "file"
    log_rel: str | None = None   # store-relative paths, for "remote" and "staged"
    bcq_rel: str | None = None
    #: what its catalog lists: its entry in the manifest ("remote") or in the local segment
    #: list (docs/formats/segment-list.md); None without one
    desc: "SegmentDesc | None" = None
    #: the offset of the last record this process appended to this segment, valid while
    #: index_size == _appended_index_size (a writer's cache: no re-mapping of the growing .bcq
    #: to find its last offset before each append)
    last_appended: int | None = None
    _appended_index_size: int = -1
    #: a segment whose files may still grow or hold a crash's torn tail: the active segment of
    #: a writer (listed open), a writer's local segments on an object store. Every other one is
    #: exact: its .bcq lists every record of its .log, the last ending where the .log ends.
    open_tail: bool = False
    #: CRC32C of the first ``bcq_crc_size`` bytes of the .bcq (-1: not known): what a writer
    #: appended, for the list entry it writes when it seals or closes the segment
    bcq_crc: int = 0
    bcq_crc_size: int = -1

    #: the .bcq was read whole and matched its checksum (IndexCursor), until it changes
    bcq_checked: bool = False
    #: store format of this segment (1: records + 48-byte entries; 2: Kafka batches + lean
    #: index, docs/formats/segment-v2.md), told by its .bcq's first bytes; None: not looked yet
    format: int | None = None

    def invalidate(self) -> None:
        self.format = None
        self._map = None
        self._log_map = None
        self._index = None
        self._map_size = -1
        self.last_appended = None
        self.bcq_checked = False

    def listed(self) -> tuple[int, int, int] | None:
        """(records, first offset, last offset) as its manifest or closed segment-list entry
        says, without reading the .bcq; None when nothing says (an open segment)."""
        return self.desc.listed() if self.desc is not None else None

    def expected_bcq(self) -> tuple[int, int] | None:
        """(size, CRC32C) this segment's .bcq must have (its segment-list entry, or its
        manifest entry when that lists one); None when nothing says."""
        return self.desc.expected_bcq() if self.desc is not None else None

    @property
    def bitmap_desc(self) -> "SegmentDesc | None":
        """Its manifest entry, whose offset bitmap answers offset questions without a request;
        None for any other segment."""
        d = self.desc
        return d if d is not None and d.has_bitmap else None

    @property
    def entry_count(self) -> int:
        """Entries of a format-1 .bcq (a lean index's count is ``PartitionLog.index(seg).n``)."""
        return self.index_size // B.ENTRY_SIZE

    @property
    def index_cached(self) -> bool:
        """Whether this segment's index is held in memory (mapped or read) already."""
        return self._index is not None
