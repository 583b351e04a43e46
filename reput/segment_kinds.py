"""Which kind a listed segment is: the one place that picks a segment's class.

A partition's catalog (reput/catalog.py) lists its segments through ``open_segment``; the kinds
are the implementations of ``Segment`` (reput/segment.py): ``RecordSegment`` (format 1,
reput/segment_v1.py), ``KafkaSegment`` (format 2, reput/segment_v2.py) and
``SharedRangeSegment`` (a format-2 part of a shared S3 object, reput/segment_shared.py). This
module imports them; they import only the interface, so the base module never imports its
implementations (no import circle). Adding a kind: docs/architecture.md, "How to add a kind of
segment".
"""

from __future__ import annotations

from .backend import Backend
from .segment import PartitionContext, Segment, sniff_format
from .segment_desc import SegmentDesc
from .segment_shared import SharedRangeSegment
from .segment_v1 import RecordSegment
from .segment_v2 import KafkaSegment



def segment_class(fmt: int) -> type[Segment]:
    """The class of a segment of store format ``fmt``."""
    return KafkaSegment if fmt == 2 else RecordSegment


def open_segment(ctx: PartitionContext, base: int, log_size: int, index_size: int, *,
                 fs: Backend, log_path: str, bcq_path: str, kind: str = "file",
                 desc: SegmentDesc | None = None, open_tail: bool = False,
                 reuse: Segment | None = None) -> Segment:
    """A listed segment as an object of its kind: the one place a segment's kind is chosen.
    Its catalog entry says its format when it lists one (an open segment is a writer's: format
    1); else its .bcq's first bytes do. ``reuse``: the object this partition held for the
    segment before, kept (with what it cached) when it is still of that kind."""
    if desc is not None:
        fmt = 1 if desc.open else desc.format
    elif reuse is not None and (reuse.log_size, reuse.index_size) == (log_size, index_size):
        fmt = reuse.format
    else:
        fmt = sniff_format(fs, bcq_path, index_size)
    if reuse is not None and reuse.format == fmt:
        reuse.log_size, reuse.index_size, reuse.desc = log_size, index_size, desc
        reuse.open_tail = open_tail
        return reuse
    if kind == "shared":  # a part of a shared upload object (format 2, by its grammar)
        cls: type[Segment] = SharedRangeSegment
    else:
        cls = segment_class(fmt)
    return cls(ctx, base, log_size, index_size, fs=fs, log_path=log_path, bcq_path=bcq_path,
               kind=kind, desc=desc, open_tail=open_tail)


__all__ = ["open_segment", "segment_class"]
