"""Where each restored record landed: offset map records, and group positions translated exactly.

A restore keeps, for every chunk and store partition, the source (= store) offsets it produced
and the target offset of the first of them (docs/formats/restore-progress.md, "Offset map
records"): the producer counts the acknowledged deliveries of each target partition (lowest and
highest offset, how many), and when the chunk's records of a partition landed one after another
(highest - lowest + 1 = count: no other producer wrote between them) the i-th landed at
lowest + i. The records go with the chunk: to the cluster's progress topic inside its
transaction, and to the store's after the commit, so that a crash at any point leaves the map of
every committed chunk (a rerun catches the store up, as with progress).

:func:`translate`: a source committed offset O of partition p becomes the target offset of the
first restored record of p whose source offset is >= O, or the target's end when there is none
(the offset after p's last restored record; nothing restored: its end offset then). A chunk whose
records did not land contiguously (another producer interleaved) maps a position inside it to
its first record (at least once) and says so.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import zstandard

from .errors import ProgressFormatError

#: version of an offset map record's JSON
MAP_FORMAT_VERSION = 1
#: records of one partition of one chunk per map record at most (worst case ~2 bytes a record
#: after compression: a map record stays far below Kafka's default 1 MB message limit)
PIECE_RECORDS = 65_536
_MARK = "@map/"


def map_prefix(job_key: str) -> str:
    return f"{job_key}{_MARK}"


def map_key(job_key: str, seq: int, partition: int, piece: int) -> str:
    return f"{job_key}{_MARK}{seq}/{partition}/{piece}"


def is_map_key(key: bytes | None, job_key: str) -> bool:
    return key is not None and key.startswith(map_prefix(job_key).encode())


@dataclass(frozen=True)
class MapPiece:
    """Records of one partition of one chunk: ``offsets[i]`` (source) landed at
    ``target_first + i`` when ``contiguous``."""

    job: str
    seq: int
    partition: int
    piece: int
    offsets: np.ndarray   # int64, increasing
    target_first: int
    contiguous: bool

    @property
    def key(self) -> str:
        return map_key(self.job, self.seq, self.partition, self.piece)

    @property
    def target_last(self) -> int:
        return self.target_first + self.offsets.shape[0] - 1 if self.contiguous else \
            self.target_first


def encode_piece(m: MapPiece) -> bytes:
    offs = np.asarray(m.offsets, np.int64)
    deltas = np.diff(offs)
    width = 4 if deltas.shape[0] == 0 or int(deltas.max()) < 1 << 32 else 8
    raw = deltas.astype("<u4" if width == 4 else "<u8").tobytes()
    return json.dumps({
        "version": MAP_FORMAT_VERSION, "job": m.job, "seq": int(m.seq),
        "partition": int(m.partition), "piece": int(m.piece), "count": int(offs.shape[0]),
        "source_first": int(offs[0]), "width": width,
        "deltas": base64.b64encode(zstandard.ZstdCompressor(level=3).compress(raw)).decode(),
        "target_first": int(m.target_first), "contiguous": bool(m.contiguous),
    }, sort_keys=True, separators=(",", ":")).encode()


def decode_piece(raw: bytes | None, where: str) -> MapPiece | None:
    """None for a tombstone; ProgressFormatError for anything unreadable."""
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        if int(d["version"]) > MAP_FORMAT_VERSION:
            raise ProgressFormatError(f"{where}: offset map format {d['version']} is newer "
                                      f"than this kcompact reads ({MAP_FORMAT_VERSION}); upgrade")
        n, width = int(d["count"]), int(d["width"])
        if n < 1 or width not in (4, 8):
            raise ValueError(f"count {n}, width {width}")
        raw_d = zstandard.ZstdDecompressor().decompress(base64.b64decode(d["deltas"]),
                                                        max_output_size=(n - 1) * width + 1)
        deltas = np.frombuffer(raw_d, "<u4" if width == 4 else "<u8")
        if deltas.shape[0] != n - 1 or (n > 1 and int(deltas.min()) < 1):
            raise ValueError("deltas do not match the count")
        offs = np.empty(n, np.int64)
        offs[0] = int(d["source_first"])
        np.cumsum(deltas.astype(np.int64), out=offs[1:])
        offs[1:] += offs[0]
        return MapPiece(str(d["job"]), int(d["seq"]), int(d["partition"]), int(d["piece"]),
                        offs, int(d["target_first"]), bool(d["contiguous"]))
    except ProgressFormatError:
        raise
    except (ValueError, KeyError, TypeError, zstandard.ZstdError) as e:
        raise ProgressFormatError(f"{where}: unreadable offset map record ({e}); restore with "
                                  "--from-scratch to produce (and map) everything again") from None


# ---------------------------------------------------------------------------------------------
# building pieces from a produced chunk


class AckRanges:
    """The confluent-kafka producer's ``on_delivery`` when deliveries are counted: failures go
    to ``reports`` (ClientReports), successes are counted per partition as kcompact's own
    producer counts them in C (``NativeProducer.delivered``). Refers to nothing but its table
    and ``reports`` (framework/kafka_clients.py, ClientReports: why)."""

    __slots__ = ("reports", "ranges")

    def __init__(self, reports: Any):
        self.reports = reports
        self.ranges: dict[tuple[str, int], list[int]] = {}

    def on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.reports.on_delivery(err, msg)
            return
        key = (msg.topic(), msg.partition())
        off = msg.offset()
        r = self.ranges.get(key)
        if r is None:
            self.ranges[key] = [off, off, 1]
        else:
            r[0] = min(r[0], off)
            r[1] = max(r[1], off)
            r[2] += 1

    def delivered(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        out = {k: (v[0], v[1], v[2]) for k, v in self.ranges.items()}
        self.ranges.clear()
        return out


def chunk_pieces(job: str, seq: int, target: str, chunk: Any,
                 acked: Mapping[tuple[str, int], tuple[int, int, int]]) -> tuple[list[MapPiece],
                                                                                 list[int]]:
    """The map pieces of a produced chunk (its blocks' store partitions and offsets, each
    partition produced to the same partition number of ``target``) from the deliveries counted
    for it; and the partitions that did not land contiguously."""
    offsets: dict[int, list[np.ndarray]] = {}
    for b in chunk.blocks:
        offsets.setdefault(int(b.source_partition), []).append(np.asarray(b.source_offsets,
                                                                          np.int64))
    pieces, interleaved = [], []
    for p in sorted(offsets):
        offs = np.concatenate(offsets[p])
        if offs.shape[0] == 0:
            continue
        lo, hi, n = acked.get((target, p), (0, -1, 0))
        if n != offs.shape[0]:
            from .errors import RestoreError
            raise RestoreError(f"{target}-{p}: {n} deliveries acknowledged for {offs.shape[0]} "
                               "records produced; run the same restore again")
        contiguous = hi - lo + 1 == n
        if not contiguous:
            interleaved.append(p)
        for k, a in enumerate(range(0, offs.shape[0], PIECE_RECORDS)):
            part = offs[a:a + PIECE_RECORDS]
            pieces.append(MapPiece(job, seq, p, k, part, lo + a if contiguous else lo,
                                   contiguous))
    return pieces, interleaved


# ---------------------------------------------------------------------------------------------
# translating


@dataclass
class Translation:
    """Per (group, partition): the target offset, and how it was found."""

    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    #: (group, partition) mapped to the first record of a chunk that did not land contiguously
    approximate: list[tuple[str, int]] = field(default_factory=list)


def current_pieces(pieces: Iterable[MapPiece], run_seq: int, last_seq: int) -> list[MapPiece]:
    """The pieces of the job's current run (seq in (run_seq, last_seq]), the latest record per
    key, in (partition, seq, piece) order."""
    by_key = {m.key: m for m in pieces if run_seq < m.seq <= last_seq}
    return sorted(by_key.values(), key=lambda m: (m.partition, m.seq, m.piece))


def translate(positions: Mapping[tuple[str, int], int], pieces: list[MapPiece],
              end_offsets: Mapping[int, int]) -> Translation:
    """``positions``: (group, partition) -> source committed offset O. ``pieces``: the run's
    pieces (``current_pieces``). ``end_offsets``: partition -> the target's end offset, for a
    partition where nothing was restored. Returns the target offsets (module docstring)."""
    out = Translation()
    by_part: dict[int, list[MapPiece]] = {}
    for m in pieces:
        by_part.setdefault(m.partition, []).append(m)
    for (g, p), o in sorted(positions.items()):
        ms = by_part.get(p, [])
        hit = None
        for m in ms:
            if int(m.offsets[-1]) >= o:
                hit = m
                break
        if hit is None:
            if ms:
                last = ms[-1]
                out.offsets[(g, p)] = (last.target_last + 1 if last.contiguous
                                       else int(end_offsets.get(p, last.target_first)))
            else:
                out.offsets[(g, p)] = int(end_offsets.get(p, 0))
            continue
        i = int(np.searchsorted(hit.offsets, o, "left"))
        if hit.contiguous:
            out.offsets[(g, p)] = hit.target_first + i
        else:
            out.offsets[(g, p)] = hit.target_first
            if i > 0:
                out.approximate.append((g, p))
    return out
