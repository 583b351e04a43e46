"""A partition as of a time: what compaction has forgotten, and the state at TIME.

**The history horizon** (docs/formats/compaction-swap.md, ``last_run.cleaned_timestamp``): the
highest timestamp among the keyed records any completed compaction round mapped in this
partition (a round may drop a record only because a later record of its key was in its map, or
because it is a tombstone cleaned more than ``delete.retention.ms`` ago, which a round mapped
earlier). So a record r that the state as of TIME needs (its key's highest-offset record with a
timestamp <= TIME) is gone only if a later record of its key with a timestamp > TIME was
mapped: for every TIME >= the horizon nothing the answer needs is gone, whatever order the
timestamps came in (CreateTime is not monotonic; the horizon is a maximum, not the last
record's). ``min.compaction.lag.ms`` keeps the newest records out of every round, so it keeps
the horizon that far behind.

Values: -1 when nothing was ever cleaned, an int otherwise, None when unknown (a partition
compacted before kcompact recorded it, or a replica pulled from a master that did not say).
Unknown is sticky: what was dropped then cannot be known later.

**The state as of TIME** (:func:`as_of_selection`): per key its latest record (highest offset)
with a timestamp <= TIME, absent when that is a tombstone; keyless records with a timestamp
<= TIME as they are. Decided from the .bcq entries alone, like ``latest_selection``.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from kcompact.reput import bcq as B
from kcompact.reput.partition import PartitionLog, Segment

from .errors import CompactionError

#: the member of a compaction checkpoint's ``last_run`` (and of an S3 manifest's) that holds the
#: history horizon; it travels wherever ``last_run`` does (swap plans, manifests, replicas)
HISTORY_KEY = "cleaned_timestamp"
#: "nothing cleaned": exact for any TIME
NOTHING_CLEANED = -1


class AsOfInexactError(CompactionError):
    """The store no longer holds the history needed to answer as of the time asked: a
    compaction already removed records that the state at that time had. The message names the
    earliest time it can answer exactly (``--allow-inexact`` answers anyway)."""

    def __init__(self, message: str, earliest_ms: int | None):
        super().__init__(message)
        self.earliest_ms = earliest_ms


def horizon_of(cleaned_offset: int, last_run: dict | None) -> int | None:
    """The history horizon recorded with a checkpoint (module docstring): its ``last_run``'s
    ``cleaned_timestamp`` when present (an int, or null: unknown); else -1 for a partition
    never compacted, and unknown for one compacted before the field existed."""
    if isinstance(last_run, dict) and HISTORY_KEY in last_run:
        v = last_run[HISTORY_KEY]
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        return None  # not a number: treated as unknown, never as "nothing cleaned"
    return NOTHING_CLEANED if cleaned_offset < 0 else None


def combine(a: int | None, b: int | None) -> int | None:
    """The horizon after both (the maximum; unknown if either is)."""
    if a is None or b is None:
        return None
    return max(a, b)


def with_horizon(last_run: dict | None, horizon: int | None) -> dict:
    """``last_run`` with its horizon set (a copy)."""
    out = dict(last_run or {})
    out[HISTORY_KEY] = horizon
    return out


def mapped_max_timestamp(entries: np.ndarray) -> int:
    """The highest timestamp of the keyed entries (-1 when there is none): what a round that
    maps ``entries`` adds to the horizon (a keyless record supersedes nothing)."""
    if entries.shape[0] == 0:
        return NOTHING_CLEANED
    keyed = (entries["flags"] & B.FLAG_KEYLESS) == 0
    if not keyed.any():
        return NOTHING_CLEANED
    return max(NOTHING_CLEANED, int(entries["timestamp"][keyed].max()))


def partition_horizon(pl: PartitionLog) -> int | None:
    cleaned, last_run = pl.checkpoint()
    return horizon_of(cleaned, last_run)


# ---------------------------------------------------------------------------------------------
# TIME on the command line


_EPOCH_MS = re.compile(r"^-?\d+$")


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ``text``: epoch milliseconds, or ISO 8601
    (``2026-11-28T14:29``, ``...:05.250``, a ``Z`` or ``+01:00`` offset; without one the local
    time zone, as Kafka's tools read ``--to-datetime``; a date alone is its midnight)."""
    t = text.strip()
    if _EPOCH_MS.match(t):
        return int(t)
    iso = t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t
    try:
        d = _dt.datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give ISO 8601 (2026-11-28T14:29:00Z, "
                         "2026-11-28T14:29:00+01:00; local time without an offset) or epoch "
                         "milliseconds") from None
    if d.tzinfo is None:
        d = d.astimezone()  # local time, as Kafka's tools take a time without a zone
    return int(round(d.timestamp() * 1000))


def format_time(ms: int) -> str:
    """ISO 8601 in UTC with milliseconds, and the epoch milliseconds: how messages name a time."""
    d = _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)
    return f"{d.strftime('%Y-%m-%dT%H:%M:%S')}.{ms % 1000:03d}Z ({ms})"


# ---------------------------------------------------------------------------------------------
# the check


@dataclass(frozen=True)
class Exactness:
    """Whether TIME can be answered exactly over some partitions."""

    as_of_ms: int
    #: the earliest TIME answered exactly (-1: any; None: none, a horizon is unknown)
    earliest_ms: int | None
    #: the partitions that decide it ((topic, partition) -> horizon)
    horizons: dict

    @property
    def exact(self) -> bool:
        return self.earliest_ms is not None and self.as_of_ms >= self.earliest_ms

    def message(self, what: str) -> str:
        if self.earliest_ms is None:
            unknown = sorted(f"{t}-{p}" for (t, p), h in self.horizons.items() if h is None)
            return (f"cannot answer {what} as of {format_time(self.as_of_ms)} exactly: "
                    f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} "
                    "was compacted without a record of how much history it cleaned (a store "
                    "compacted before kcompact kept it, or a replica of such a master), so no "
                    "time can be answered exactly there; pass --allow-inexact to answer from "
                    "what the store still holds")
        worst = sorted((f"{t}-{p}" for (t, p), h in self.horizons.items()
                        if h is not None and h > self.as_of_ms))
        return (f"cannot answer {what} as of {format_time(self.as_of_ms)} exactly: compaction "
                f"already cleaned history of {', '.join(worst[:5])}"
                f"{' ...' if len(worst) > 5 else ''} up to records of "
                f"{format_time(self.earliest_ms)}; the earliest time answered exactly is "
                f"{format_time(self.earliest_ms)} (raise min.compaction.lag.ms with `kcompact "
                "configs` to keep more history; --allow-inexact answers from what is left)")


def exactness(parts: Iterable[PartitionLog], as_of_ms: int) -> Exactness:
    horizons = {(pl.topic, pl.partition): partition_horizon(pl) for pl in parts}
    earliest: int | None = NOTHING_CLEANED
    for h in horizons.values():
        earliest = combine(earliest, h)
    return Exactness(as_of_ms, earliest, horizons)


def check_exact(parts: Iterable[PartitionLog], as_of_ms: int, what: str, *,
                allow_inexact: bool = False) -> Exactness:
    """Raise AsOfInexactError unless every partition still holds the history back to
    ``as_of_ms`` (or ``allow_inexact``); returns the finding either way."""
    ex = exactness(parts, as_of_ms)
    if not ex.exact and not allow_inexact:
        raise AsOfInexactError(ex.message(what), ex.earliest_ms)
    return ex


# ---------------------------------------------------------------------------------------------
# the selection


def as_of_selection(pl: PartitionLog, as_of_ms: int, *, include_keyless: bool = True,
                    include_tombstones: bool = False, from_offset: int = 0
                    ) -> list[tuple[Segment, np.ndarray]]:
    """[(segment, sorted indices of its selected entries)] in offset order: per key the
    highest-offset entry with a timestamp <= ``as_of_ms`` (a tombstone only with
    ``include_tombstones``), keyless entries with a timestamp <= ``as_of_ms`` (with
    ``include_keyless``); only entries at or after ``from_offset`` are returned (the winners
    are decided over the whole partition). The offset map of ``latest_selection``, fed only
    the entries old enough: memory bounded by the partition's keys, index reads only."""
    from .latest import latest_selection
    out = []
    for seg, sel in latest_selection(pl, include_keyless=include_keyless, as_of_ms=as_of_ms,
                                     include_tombstones=include_tombstones):
        if from_offset > 0 and sel.shape[0]:
            sel = sel[seg.index().entries["offset"][sel] >= from_offset]
        if sel.shape[0]:
            out.append((seg, sel))
    return out


def tombstone_winners(pl: PartitionLog, as_of_ms: int, from_offset: int = 0
                      ) -> dict[int, np.ndarray]:
    """{segment base: indices} of the keyed tombstones that are their key's state as of
    ``as_of_ms`` (what a restore into an existing topic re-publishes to delete stale values)."""
    out = {}
    for seg, sel in as_of_selection(pl, as_of_ms, include_keyless=False,
                                    include_tombstones=True, from_offset=from_offset):
        e = seg.index().entries
        t = sel[(e["flags"][sel] & B.FLAG_TOMBSTONE) != 0]
        if t.shape[0]:
            out[seg.base] = t
    return out


def iter_as_of(store, topic: str, partition: int, as_of_ms: int, *, from_offset: int = 0,
               limit: int | None = None, attempts: int = 4):
    """The records of the state as of ``as_of_ms`` (``as_of_selection``), decoded, in offset
    order, from ``from_offset`` on, at most ``limit``. A compaction that swaps segments under
    the read is retried from the next offset (the selection decided again)."""
    from kcompact.reput.errors import CorruptRecordError
    from kcompact.reput.reader import PartitionReader
    done, nxt, tries = 0, from_offset, 0
    while True:
        pl = store.partition(topic, partition)
        try:
            for seg, sel in as_of_selection(pl, as_of_ms, from_offset=nxt):
                entries = seg.index().entries[sel]
                with PartitionReader(pl).segment(seg) as src:
                    for block in src.select(entries):
                        for r in block.records():
                            if limit is not None and done >= limit:
                                return
                            yield r
                            done += 1
                            nxt = r.offset + 1
            return
        except (CorruptRecordError, FileNotFoundError):
            tries += 1
            if tries >= attempts:
                raise
            store.release_partition(topic, partition)
