"""Consumer group offsets kept in the store (docs/formats/group-offsets.md).

An internal compacted store topic, ``__kcompact-group-offsets`` (partition 0), one record per
(origin, group, topic, partition): ``endpoint`` for offsets committed on the Kafka endpoint,
``source`` for offsets a mirror captured from the source cluster. ``GroupOffsets`` reads the topic
once (latest record per key, tombstones delete), merges the origins (the endpoint's own commit
wins) and appends new commits through the store's normal write path, flushed before it returns,
as restore progress is kept (connectors/plugins/store_source/progress.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Iterable, NamedTuple

from kcompact.reput import Store, StoreLockedError
from kcompact.reput.record import RecordBatch

from .errors import ReplicationError

TOPIC = "__kcompact-group-offsets"
FORMAT_VERSION = 1
ORIGINS = ("endpoint", "source")
#: how long a commit waits for another process appending to the topic (a capturing mirror)
LOCK_WAIT_S = 10.0


class GroupOffsetsError(ReplicationError):
    """A group offsets record that cannot be read, or a commit that cannot be kept."""


class GroupOffset(NamedTuple):
    offset: int
    metadata: str = ""
    leader_epoch: int = -1
    commit_ms: int = 0


Key = tuple  # (origin, group, topic, partition)


def encode_key(origin: str, group: str, topic: str, partition: int) -> bytes:
    if origin not in ORIGINS:
        raise ValueError(f"origin {origin!r}: one of {ORIGINS}")
    return json.dumps([origin, group, topic, int(partition)], separators=(",", ":"),
                      ensure_ascii=False).encode()


def encode_value(o: GroupOffset) -> bytes:
    return json.dumps({"version": FORMAT_VERSION, "offset": int(o.offset),
                       "metadata": o.metadata or "", "leader_epoch": int(o.leader_epoch),
                       "commit_ms": int(o.commit_ms)}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False).encode()


def decode(key: bytes | None, value: bytes | None, where: str
           ) -> tuple[Key, GroupOffset | None]:
    """(key tuple, offset or None for a tombstone) of one record; GroupOffsetsError names it."""
    try:
        k = json.loads(key) if key is not None else None
        if (not isinstance(k, list) or len(k) != 4 or k[0] not in ORIGINS
                or not isinstance(k[1], str) or not isinstance(k[2], str)
                or not isinstance(k[3], int) or k[3] < 0):
            raise ValueError(f"key {key!r} is not [origin, group, topic, partition]")
        if value is None:
            return tuple(k), None
        d = json.loads(value)
        if not isinstance(d, dict):
            raise ValueError("value is not a JSON object")
        if int(d["version"]) > FORMAT_VERSION:
            raise GroupOffsetsError(f"{where}: group offsets format {d['version']} is newer "
                                    f"than this kcompact reads ({FORMAT_VERSION}); upgrade")
        o = GroupOffset(int(d["offset"]), str(d.get("metadata") or ""),
                        int(d.get("leader_epoch", -1)), int(d.get("commit_ms", 0)))
        if o.offset < 0:
            raise ValueError(f"offset {o.offset}")
        return tuple(k), o
    except GroupOffsetsError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise GroupOffsetsError(f"{where}: unreadable group offsets record ({e})") from None


class GroupOffsets:
    """The store's group offsets: ``load()``, ``get(group)``, ``commit(group, offsets)``.
    Thread-safe; ``commit`` blocks until the records are durable."""

    def __init__(self, url: str, store_id: str, *, commitlog_dir: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S):
        self.url, self.commitlog_dir, self.lock_wait_s = url, commitlog_dir, lock_wait_s
        token = hashlib.blake2b(f"{store_id}|endpoint".encode(), digest_size=6).hexdigest()
        self.writer_id = f"group-offsets-{token}"
        self._by_origin: dict[str, dict[tuple[str, str, int], GroupOffset]] = {
            o: {} for o in ORIGINS}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._writer: Store | None = None

    def load(self) -> int:
        """Read the topic (both origins); returns the records applied."""
        n = 0
        with Store.open(self.url, commitlog_dir=self.commitlog_dir) as st:
            if TOPIC not in st.topics() or 0 not in st.partitions(TOPIC):
                return 0
            for rec in st.iter_records(TOPIC, 0, 0):
                k, o = decode(rec.key, rec.value, f"{self.url} {TOPIC}-0@{rec.offset}")
                self._apply(k, o)
                n += 1
        return n

    def _apply(self, k: Key, o: GroupOffset | None) -> None:
        origin, rest = k[0], (k[1], k[2], int(k[3]))
        with self._lock:
            if o is None:
                self._by_origin[origin].pop(rest, None)
            else:
                self._by_origin[origin][rest] = o

    def get(self, group: str) -> dict[tuple[str, int], GroupOffset]:
        """(topic, partition) -> offset of ``group``: the endpoint's commits over the source's."""
        with self._lock:
            out = {(t, p): o for (g, t, p), o in self._by_origin["source"].items() if g == group}
            out.update({(t, p): o for (g, t, p), o in self._by_origin["endpoint"].items()
                        if g == group})
        return out

    def groups(self) -> set[str]:
        with self._lock:
            return {g for m in self._by_origin.values() for (g, _, _) in m}

    def commit(self, group: str, offsets: Iterable[tuple[str, int, GroupOffset]]) -> None:
        """Append the ``endpoint`` records of a commit and flush them, then apply them."""
        rows = [(t, int(p), o) for t, p, o in offsets]
        if not rows:
            return
        now = int(time.time() * 1000)
        rows = [(t, p, o._replace(commit_ms=o.commit_ms or now)) for t, p, o in rows]
        with self._write_lock:
            st = self._open_writer()
            pl = self._partition(st)
            try:
                nxt = pl.next_offset
                batch = RecordBatch.from_records(TOPIC, [
                    (0, nxt + i, o.commit_ms, encode_key("endpoint", group, t, p),
                     encode_value(o)) for i, (t, p, o) in enumerate(rows)])
                st.append(batch)
                st.flush()
            finally:
                st.release_partition(TOPIC, 0)
        for t, p, o in rows:
            self._apply(("endpoint", group, t, p), o)

    def remember(self, group: str, offsets: Iterable[tuple[str, int, GroupOffset]]) -> None:
        """Apply ``endpoint`` commits another process made durable (a fleet's offsets
        writer, replication/fleet/offsets.py)."""
        for t, p, o in offsets:
            self._apply(("endpoint", group, t, int(p)), o)

    def reopen(self) -> None:
        """Drop the writer: the next commit opens the store afresh (a fleet's writer that
        takes over from another node)."""
        self.close()

    def _open_writer(self) -> Store:
        if self._writer is None:
            try:
                self._writer = Store.open(self.url, writer=self.writer_id,
                                          commitlog_dir=self.commitlog_dir)
            except StoreLockedError:
                raise GroupOffsetsError(
                    f"another Kafka endpoint keeps the group offsets of {self.url} (its writer "
                    f"{self.writer_id} is locked): commit through that one, or stop it") from None
            self._writer.release_partition(TOPIC, 0)
        return self._writer

    def _partition(self, st: Store):
        return hold_partition(st, self.url, self.lock_wait_s, "the commit was not kept")

    def close(self) -> None:
        with self._write_lock:
            if self._writer is not None:
                w, self._writer = self._writer, None
                w.close()


def hold_partition(st: Store, url: str, wait_s: float, lost: str):
    """The topic's partition 0 of ``st`` for writing, waiting up to ``wait_s`` for another
    process appending to it (the endpoint, a capturing mirror); GroupOffsetsError saying what
    was ``lost`` otherwise."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return st.writable_partition(TOPIC, 0)
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise GroupOffsetsError(f"{url}: {TOPIC}-0 stayed locked by another process "
                                        f"for {wait_s:.0f} s; {lost}") from None
            time.sleep(0.02)
