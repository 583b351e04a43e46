"""Damage stays in its partition: the partitions compaction finds damaged (Kafka's
*uncleanable* partitions).

Kafka's log cleaner marks a partition it cannot clean uncleanable, goes on with the others and
exposes the count (``uncleanable-partitions-count``). kcompact does the same: when compacting a
partition (or assessing it for the planner) raises ``CorruptRecordError``, the partition is
skipped with one line naming the file, the byte and the reason (``Damage.line``), every other
partition is compacted, and the damage is remembered here (``Uncleanable``): `kcompact compact`
exits 1 at the end, the background ``Scheduler`` keeps the list for the metric
``kcompact_uncleanable_partitions`` (replication/ops.py) and says each damage once. A partition
that compacts again (after `kcompact repair`) leaves the list.

Damage found is also recorded beside the partition until it is repaired (``remember``,
``recorded``, ``compacted``: reput/damage_record.py, docs/formats/damage-record.md), so that
`kcompact inspect`, the metric and `kv build`/`restore` know of it in any process.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

from kcompact.reput import damage_record as DR
from kcompact.reput.errors import CorruptRecordError
from kcompact.reput.reader import IndexCursor
from kcompact.reput.store import Store

from .errors import CompactionError

#: what a damage line tells the operator to do (docs/operations-damage.md)
REPAIR_HINT = ("repair it with `kcompact repair --store URL --from MASTER_URL --token-file F` "
               "or `kcompact repair --store URL --salvage` (docs/operations-damage.md)")


@dataclass(frozen=True)
class Damage:
    """Where a partition is damaged: the file, the byte and the reason of the first problem
    met (``kcompact verify`` lists them all)."""

    topic: str
    partition: int
    path: str | None
    position: int | None
    reason: str
    #: who found it and when (ms), as its record says (reput/damage_record.py); not part of
    #: what the damage is
    found_by: str | None = field(default=None, compare=False)
    found_ms: int | None = field(default=None, compare=False)

    @classmethod
    def of(cls, topic: str, partition: int, err: CorruptRecordError) -> "Damage":
        return cls(topic, partition, err.path, err.position, str(err).strip().splitlines()[0]
                   if str(err).strip() else type(err).__name__)

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    def where(self) -> str:
        """``path: byte N: reason`` (the reason alone when it already names the file)."""
        if self.path and not self.reason.startswith(self.path):
            pos = f"byte {self.position}: " if self.position is not None else ""
            return f"{self.path}: {pos}{self.reason}"
        return self.reason

    def found(self) -> str:
        """`` (found by verify at 2026-12-01 21:40:00Z)``, or nothing when unknown."""
        if not self.found_by:
            return ""
        import time
        when = (time.strftime(" at %Y-%m-%d %H:%M:%SZ", time.gmtime(self.found_ms / 1000))
                if self.found_ms is not None else "")
        return f" (found by {self.found_by}{when})"

    def line(self) -> str:
        """The one line that says the partition was skipped, and why."""
        return f"{self.name}: damaged, not compacted: {self.where()}"

    def to_dict(self) -> dict:
        return asdict(self)


def damage_in(topic: str, partition: int, err: BaseException) -> Damage | None:
    """``err`` as the partition's damage, or None when it is not damage: a record or index
    that fails its checks (CorruptRecordError), or a segment file its list or manifest names
    that is gone (a compaction's read of it failed with FileNotFoundError)."""
    if isinstance(err, CorruptRecordError):
        return Damage.of(topic, partition, err)
    cause = err.__cause__ if isinstance(err, CompactionError) else None
    if isinstance(cause, FileNotFoundError) or isinstance(err, FileNotFoundError):
        gone = cause if cause is not None else err
        return Damage(topic, partition, gone.filename, 0,
                      f"{gone.filename}: listed by the partition but missing from the store")
    return None


def remember(store: Store, d: Damage, found_by: str) -> bool:
    """Record ``d`` beside its partition until it is repaired (reput/damage_record.py: best
    effort, only when it is news); whether it was written."""
    return DR.write(store.fs, d.topic, d.partition, path_=d.path, position=d.position,
                    reason=d.reason, found_by=found_by, found_ms=store.clock.ms())


def recorded(store: Store, topic: str, partition: int) -> Damage | None:
    """The partition's recorded damage (found earlier by anyone, not repaired since)."""
    rec = DR.read(store.fs, topic, partition)
    if rec is None:
        return None
    return Damage(**rec)


def compacted(store: Store, topic: str, partition: int) -> bool:
    """After a compaction of the partition succeeded: when it has a damage record, the
    partition is read whole as `kcompact verify` reads it, and the record goes when nothing is
    found (what the damage was in was rewritten or dropped: a flipped byte in records the
    compaction superseded). Damage compaction left as it is (in a record it did not need to
    read) stays recorded until `kcompact repair`. Whether the record was cleared."""
    if DR.read(store.fs, topic, partition) is None:
        return False
    from kcompact.reput.verify import VerifyReport, verify_partition
    rep = VerifyReport()
    verify_partition(store, topic, partition, rep, found_by=None)
    if rep.problems:
        return False
    return DR.clear(store.fs, topic, partition)


def unique(damages: list[Damage]) -> list[Damage]:
    """One damage per partition (the first met), in the order met."""
    out: dict[tuple[str, int], Damage] = {}
    for d in damages:
        out.setdefault((d.topic, d.partition), d)
    return list(out.values())


class Uncleanable:
    """The partitions found damaged, as of the last look at each (thread-safe: a metrics
    scrape reads it while the scheduler's thread writes it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._damaged: dict[tuple[str, int], Damage] = {}

    def mark(self, damage: Damage) -> bool:
        """Remember ``damage``; True when it is news (a new partition, or other damage)."""
        key = (damage.topic, damage.partition)
        with self._lock:
            news = self._damaged.get(key) != damage
            self._damaged[key] = damage
            return news

    def clear(self, topic: str, partition: int) -> None:
        with self._lock:
            self._damaged.pop((topic, partition), None)

    def snapshot(self) -> dict[tuple[str, int], Damage]:
        with self._lock:
            return dict(self._damaged)

    def __len__(self) -> int:
        with self._lock:
            return len(self._damaged)


def find_damage(store: Store, topic: str, partition: int) -> Damage | None:
    """The partition's damage that shows without reading its records: its files against its
    segment list (or manifest), every index against its listed checksum, its compaction
    checkpoint (what compaction checks before it writes). None when none shows."""
    try:
        pl = store.partition(topic, partition)
        pl.checkpoint()
        cursor = IndexCursor(pl)
        for seg in pl.segments:
            cursor.check(seg)
        return None
    except CorruptRecordError as e:
        store.release_partition(topic, partition)
        return Damage.of(topic, partition, e)


def refusal(store: Store, topic: str, what: str) -> str | None:
    """The one line with which ``what`` (``kv build``, ``restore``) refuses ``topic`` when a
    partition of it is damaged (``find_damage``), before it writes anything: it could not be
    complete. None when every partition looks whole (damage found later, reading a record,
    still stops it with the file and byte)."""
    for p in store.partitions(topic):
        d = find_damage(store, topic, p) or recorded(store, topic, p)
        if d is not None:
            remember(store, d, what)
            return (f"{what} refuses topic {topic!r}: partition {d.name} is damaged "
                    f"({d.where()}), so the result could not be complete; {REPAIR_HINT}")
    return None
