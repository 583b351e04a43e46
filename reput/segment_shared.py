"""A part of a shared upload object as a segment (docs/formats/shared-upload.md).

A part is byte for byte a sealed format-2 segment - Kafka batches, then their lean index - that
lies inside an object shared by several partitions. ``SharedRangeSegment`` is a
``KafkaSegment`` whose files are the part's two byte ranges, seen through a ``RangeView``
(reput/shared.py): only where the bytes lie differs, so every reader, verify, the compactor and
replication read it as they read any format-2 segment, and a read of one partition fetches only
its ranges of the object (through the S3 block cache, each 4 MiB block once).
"""

from __future__ import annotations

from .segment_v2 import KafkaSegment


class SharedRangeSegment(KafkaSegment):
    """A partition's part of a shared object (kind "shared"; see the module docstring)."""

    #: the writer, journal entry and object it lies in (reput/shared.py ``Part``)
    part = None


__all__ = ["SharedRangeSegment"]
