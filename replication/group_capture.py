"""Group offsets captured from the source cluster, kept in the store (docs/formats/group-offsets.md).

The store's ``__kcompact-group-offsets`` topic holds two origins (group_offsets.py): ``endpoint``
(commits made on the Kafka endpoint) and ``source`` (this module's: positions a mirror read from
the source cluster's ``__consumer_offsets`` with the Admin API). Here:

* :class:`CaptureWriter` appends ``source`` records for the positions that changed since the
  last capture (the record's timestamp and ``commit_ms`` = when it was captured), through the
  store's normal write path, holding the partition only for the append, flushed before it
  returns, so a Kafka endpoint committing into the same topic interleaves;
* :func:`kept_offsets` reads them back, merged as the endpoint merges them (an ``endpoint``
  commit overrides the captured position of its group on its partition), either now or **as of
  a time** (the records with a timestamp <= TIME: positions as captured then; exact while
  compaction of the topic has not cleaned history past TIME, compaction/history.py).

Store offsets are source offsets, so a kept position is valid on the store as it is; restore
translates it to the target's offsets (connectors/plugins/store_source/translation.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from kcompact.reput import Store

from .group_offsets import TOPIC, GroupOffset, GroupOffsetsError, decode, encode_key, encode_value
from .internal_topic import InternalTopicWriter, read_records

SOURCE = "source"
#: how long a capture waits for another process appending to the topic (a Kafka endpoint)
LOCK_WAIT_S = 10.0


@dataclass(frozen=True)
class KeptOffset:
    """One kept position: ``offset`` is the next store (= source) offset the group reads."""

    group: str
    topic: str
    partition: int
    offset: int
    commit_ms: int      # when it was committed (endpoint) or captured (source)
    origin: str         # "endpoint" or "source"
    metadata: str = ""


def _merge(rows: Iterable[tuple[tuple, GroupOffset | None]]) -> dict[tuple[str, str, int],
                                                                     KeptOffset]:
    """The latest record per key (``rows`` in offset order; None deletes), then per (group,
    topic, partition) the endpoint's over the source's."""
    latest: dict[tuple, GroupOffset] = {}
    for k, o in rows:
        if o is None:
            latest.pop(k, None)
        else:
            latest[k] = o
    out: dict[tuple[str, str, int], KeptOffset] = {}
    for origin in ("source", "endpoint"):  # endpoint last: it wins
        for (o_, g, t, p), o in latest.items():
            if o_ == origin:
                out[(g, t, int(p))] = KeptOffset(g, t, int(p), o.offset, o.commit_ms, origin,
                                                 o.metadata)
    return out


def kept_offsets(store: Store, *, as_of_ms: int | None = None, allow_inexact: bool = False
                 ) -> dict[tuple[str, str, int], KeptOffset]:
    """(group, topic, partition) -> the kept position, now or as of ``as_of_ms`` (then
    AsOfInexactError when compaction cleaned the topic's history past it, unless
    ``allow_inexact``). Empty when the store keeps no group offsets."""
    where = f"{store.url} {TOPIC}-0"
    recs = read_records(store, TOPIC, as_of_ms=as_of_ms, allow_inexact=allow_inexact,
                        what="the kept group offsets")
    return _merge(decode(r.key, r.value, f"{where}@{r.offset}") for r in recs)


class CaptureWriter(InternalTopicWriter):
    """Appends captured ``source`` positions to a store (``capture(rows)``); remembers what it
    last kept so that an unchanged position is not written again. One per mirror process; its
    writer id is the caller's (the mirror's own)."""

    topic = TOPIC

    def __init__(self, url: str, writer: str, *, commitlog_dir: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S):
        super().__init__(url, writer, commitlog_dir=commitlog_dir, lock_wait_s=lock_wait_s,
                         error=GroupOffsetsError, what="the captured group offsets")
        self._kept: dict[tuple[str, str, int], int] | None = None

    def _open(self) -> Store:
        return self.store()

    def kept(self) -> dict[tuple[str, str, int], int]:
        """(group, topic, partition) -> offset of the ``source`` positions kept now."""
        if self._kept is None:
            st = self._open()
            self._kept = {}
            if TOPIC in st.topics() and 0 in st.partitions(TOPIC):
                rows = []
                for r in st.iter_records(TOPIC, 0):
                    k, o = decode(r.key, r.value, f"{self.url} {TOPIC}-0@{r.offset}")
                    if k[0] == SOURCE:
                        rows.append((k, o))
                self._kept = {key: v.offset for key, v in _merge(rows).items()}
        return self._kept

    def capture(self, rows: Iterable[tuple[str, str, int, int, str]],
                now_ms: int | None = None) -> int:
        """Keep ``rows`` ((group, topic, partition, offset, metadata) read from the source) whose
        offset differs from the one kept; returns how many records were appended (durable when
        this returns)."""
        kept = self.kept()
        now = int(time.time() * 1000) if now_ms is None else int(now_ms)
        new = [(g, t, int(p), int(o), m or "") for g, t, p, o, m in rows
               if kept.get((g, t, int(p))) != int(o)]
        if not new:
            return 0
        self.append([(encode_key(SOURCE, g, t, p), encode_value(GroupOffset(o, m, -1, now)))
                     for g, t, p, o, m in new], now)
        for g, t, p, o, _ in new:
            kept[(g, t, p)] = o
        return len(new)
