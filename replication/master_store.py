"""The store side of `kcompact serve`: thread-safe, read-only access to the served store.

``MasterStore`` opens the store read-only (``Store.open(url)``), so it serves next to the mirror
and the compactor that keep writing it: each call re-lists the partition's segments, and the
server (server.py, the HTTP side) calls it from its thread pool, never from the event loop. A
local store's root is resolved once; a topic or partition any of whose paths resolves outside it
(a symlink) is neither served nor listed. The live-record computations of a partition
(live.py) are cached per partition until a compaction swap changes it.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Any

from kcompact.compaction.history import horizon_of
from kcompact.reput import swap
from kcompact.reput import filenames as fn
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import BufferPool, Located, PartitionReader
from kcompact.reput.s3_follow import follow, follow_mode
from kcompact.reput.store import Store, StoreMeta

from .connections import log
from .errors import ReplicationError
from .live import live_offsets
from .errors import RequestError
from .protocol import PROTOCOL_VERSION, PROTOCOL_VERSIONS, ServerLimits, segment_id


#: on an S3 store a partition found listed is served without listing the store again for this
#: long (s): a replica following the master costs no LIST per request
PARTITIONS_S = 300.0


class MasterStore:
    """Thread-safe, read-only access to the served store (all blocking calls)."""

    def __init__(self, url: str, limits: ServerLimits, protocols: tuple[int, ...] = PROTOCOL_VERSIONS):
        self.protocols = tuple(protocols)
        self.store = Store.open(url)
        self.fs = self.store.fs
        follow(self.fs)  # it only reads the store, following it (reput/s3_follow.py)
        self.limits = limits
        self._lock = threading.Lock()
        self._live_cache: OrderedDict = OrderedDict()
        self.buffers = BufferPool()
        self._reported: set[str] = set()
        self._link_cache: dict[str, tuple[int, list[str]]] = {}
        #: an S3 store followed without listing (reput/s3_follow.py): (topic, partition) ->
        #: when it was last found listed, so a request for it lists nothing
        self._served: dict[tuple[str, int | None], float] = {}
        # a local store's root, resolved once: nothing that resolves outside it is served
        local = self.fs.local_path("")
        self.root = os.path.realpath(local) if local is not None else None
        if self.root is not None:
            why = self._escapes(fn.STORE_JSON)
            if why:
                self.store.close()
                raise ReplicationError(f"cannot serve {url}: {why}")

    def _escapes(self, path: str) -> str | None:
        """Why ``path`` (store-relative) must not be served: it resolves outside the root.
        No component of it a symlink (one lstat each, the usual case): inside; else realpath."""
        cur = self.root
        for name in path.split("/"):
            cur = os.path.join(cur, name)
            try:
                if stat.S_ISLNK(os.lstat(cur).st_mode):
                    break
            except FileNotFoundError:
                return None  # nothing there, so nothing to serve from elsewhere
        else:
            return None
        real = os.path.realpath(os.path.join(self.root, path))
        if real == self.root or real.startswith(self.root + os.sep):
            return None
        return f"{path} resolves to {real}, outside the store {self.root} (a symlink?)"

    def outside(self, topic: str, partition: int | None = None) -> str | None:
        """Why a topic (or one of its partitions) is not served: its directory, or a symlink
        in the partition's directory, resolves outside the store root; None when it is inside.
        Each reason is logged once."""
        if self.root is None:
            return None  # an object store has no symlinks
        if partition is None:
            why = self._escapes(fn.topic_dir(topic))
        else:  # the partition's directory, so the topic's too
            pdir = fn.partition_dir(topic, partition)
            why = self._escapes(pdir)
            if why is None:
                for name in self._links(pdir):
                    why = self._escapes(f"{pdir}/{name}")
                    if why:
                        break
        if why is not None:
            with self._lock:
                new = why not in self._reported
                self._reported.add(why)
            if new:
                log.warning("not serving %s: %s", topic if partition is None
                            else f"{topic}-{partition}", why)
        return why

    def _links(self, pdir: str) -> list[str]:
        """The symlinks in a partition's directory, listed again only when it changed."""
        path = os.path.join(self.root, pdir)
        try:
            mtime = os.stat(path).st_mtime_ns
            hit = self._link_cache.get(pdir)
            if hit is not None and hit[0] == mtime:
                return hit[1]
            with os.scandir(path) as it:
                links = [e.name for e in it if e.is_symlink()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        with self._lock:
            self._link_cache[pdir] = (mtime, links)
        return links

    def topics(self) -> list[str]:
        return [t for t in self.store.topics() if self.outside(t) is None]

    def partitions(self, topic: str) -> list[int]:
        return [p for p in self.store.partitions(topic) if self.outside(topic, p) is None]

    @property
    def store_id(self) -> str:
        return self.store.meta.store_id

    def meta(self) -> StoreMeta:
        return StoreMeta.from_json(self.fs.read(fn.STORE_JSON), self.fs.url)

    def has_partition(self, topic: str, partition: int | None = None) -> str | None:
        """None when the store serves the topic (partition), else why not (for a 404)."""
        what = f"topic {topic!r}" if partition is None else f"partition {topic}-{partition}"
        follow = self.root is None and follow_mode() == "journal"
        seen = self._served.get((topic, partition)) if follow else None
        if seen is None or time.monotonic() - seen >= PARTITIONS_S:
            if topic not in self.store.topics() or (partition is not None and partition
                                                     not in self.store.partitions(topic)):
                return f"{what} is not in this store"
            if follow:
                self._served[(topic, partition)] = time.monotonic()
        why = self.outside(topic, partition)
        # the client is not told where the link points; the master's log line says it
        return (f"{what} is not served: a path of it resolves outside the store (a symlink?); "
                "the master's log names it") if why else None

    def _part(self, topic: str, partition: int) -> tuple[threading.Lock, PartitionLog]:
        """(its lock, the partition's view): the store's one door (``Store.views``)."""
        return self.store.views.get(topic, partition)

    def partition_info(self, topic: str, partition: int) -> dict[str, Any]:
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            cleaned, last_run = swap.read_checkpoint(self.fs, pl.dir)
            return {"partition": partition, "first_offset": pl.first_offset,
                    "next_offset": pl.next_offset, "compaction_horizon": cleaned,
                    # history compaction cleaned (--as-of): a replica keeps it with the records
                    "cleaned_timestamp": horizon_of(cleaned, last_run),
                    "segments": len(pl.segments), "bytes": pl.size_bytes()}

    def topic_doc(self, topic: str, meta: StoreMeta) -> dict[str, Any]:
        """The topic's entry of ``/v1/store``: ``partitions``, those served, and
        ``unavailable``, those the store holds but does not serve (a path outside the store,
        or damage that keeps the partition from opening), each with its reason, so that a
        replica names them instead of going without them (issue 44)."""
        from kcompact.reput.config import TopicConfig
        from kcompact.reput.errors import CorruptRecordError
        served, unavailable = [], []
        for p in self.store.partitions(topic):
            if self.outside(topic, p) is not None:
                unavailable.append({"partition": p, "reason": "not served: a path of it "
                                    "resolves outside the store (a symlink?); the master's log "
                                    "names it"})
                continue
            try:
                served.append(self.partition_info(topic, p))
            except CorruptRecordError as e:
                self.store.views.forget(topic, p)
                unavailable.append({"partition": p, "reason": f"damaged on the master: {e}"})
        return {"topic": topic, "config": TopicConfig.from_dict(meta.topics.get(topic)).to_dict(),
                "partitions": served, "unavailable": unavailable}

    def store_doc(self) -> dict[str, Any]:
        meta = self.meta()
        return {"protocol": PROTOCOL_VERSION, "protocols": list(self.protocols),
                "store_id": meta.store_id,
                "format_version": meta.format_version, "limits": self.limits.to_dict(),
                "topics": [self.topic_doc(t, meta) for t in self.topics()]}

    # -- version 2: sealed segments as stored ---------------------------------------------------

    def segments(self, topic: str, partition: int) -> dict[str, Any]:
        """The partition's segments in offset order (``GET .../segments``): base, format,
        whether sealed, records, first and last offset (-1: none), and for a sealed format-2
        segment its files' sizes, codec and id (what ``segment_file`` requests name)."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            sealed = {id(s) for s in pl.sealed_segments}
            out = []
            for seg in pl.segments:
                out.append(self._describe(pl, seg, id(seg) in sealed))
            return {"partition": partition, "next_offset": pl.next_offset, "segments": out}

    @staticmethod
    def _describe(pl: PartitionLog, seg, sealed: bool) -> dict[str, Any]:
        n = int(seg.index().n)
        first, last = seg.first_last()
        doc = {"base": seg.base, "format": seg.format, "sealed": sealed, "records": n,
               "first_offset": first, "last_offset": last}
        version = seg.stored_version() if sealed and seg.ships_as_stored else None
        if version is not None:
            doc.update({"log_size": seg.log_size, "index_size": seg.index_size,
                        "codec": seg.codec_name(), "id": segment_id(*version)})
        return doc

    def segment_file(self, topic: str, partition: int, base: int, file: str, sid: str,
                     start: int, max_bytes: int, zero_copy: bool = False
                     ) -> tuple[bytes | Located, int]:
        """(bytes [start, start + max_bytes) of a sealed format-2 segment's ``file`` (log or
        index) as stored, the file's size). 404: no such sealed format-2 segment; 409: the
        segment at ``base`` is no longer the version ``sid`` names (compacted or resealed
        since it was listed); 416: ``start`` past the end of the file. With ``zero_copy`` (a
        local store), the range is a Located (an fd open on the file, to send with sendfile
        and close), not bytes read."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            seg = next((s for s in pl.sealed_segments if s.base == base), None)
            if seg is None or not seg.ships_as_stored:
                raise RequestError(404, f"{topic}-{partition} has no sealed format-2 segment "
                                        f"at base {base}; list its segments again")
            fs = seg.fs
            try:
                if zero_copy:
                    return self._segment_range(pl, seg, fs, topic, partition, base, file, sid,
                                               start, max_bytes)
                return self._segment_bytes(pl, seg, fs, topic, partition, base, file, sid,
                                           start, max_bytes)
            except FileNotFoundError:  # replaced by a swap since the listing
                raise RequestError(409, f"{topic}-{partition} segment {base} changed; list "
                                        "its segments again") from None

    @classmethod
    def _segment_range(cls, pl, seg, fs, topic, partition, base, file, sid, start, max_bytes):
        """``_segment_bytes``'s checks, the range left in the file: an fd opened before the
        version check pins the file (a swap renames, never rewrites), and must still be the
        file at its path after it, of the listed size."""
        path = fs.local_path(seg.log_path if file == "log" else seg.bcq_path)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size, n = cls._segment_checks(pl, seg, fs, topic, partition, base, file, sid, start,
                                          max_bytes)
            st = os.fstat(fd)
            if st.st_size != size or os.stat(path).st_ino != st.st_ino:
                raise RequestError(409, f"{topic}-{partition} segment {base} changed while "
                                        "it was read; list its segments again")
        except BaseException:
            os.close(fd)
            raise
        return Located(fd, start, n, 0, 0), size

    @classmethod
    def _segment_bytes(cls, pl, seg, fs, topic, partition, base, file, sid, start, max_bytes):
        size, n = cls._segment_checks(pl, seg, fs, topic, partition, base, file, sid, start,
                                      max_bytes)
        path = seg.log_path if file == "log" else seg.bcq_path
        data = fs.read(path, start, n) if n else b""
        if len(data) != n:  # replaced under us after the check: the client lists again
            raise RequestError(409, f"{topic}-{partition} segment {base} changed while "
                                    "it was read; list its segments again")
        return data, size

    @staticmethod
    def _segment_checks(pl, seg, fs, topic, partition, base, file, sid, start, max_bytes):
        """(the file's size, bytes to send from ``start``) once the segment is the version
        ``sid`` names and ``start`` lies in the file."""
        version = seg.stored_version()
        if version is None:
            raise RequestError(409, f"{topic}-{partition} segment {base} changed; list "
                                    "its segments again")
        have = segment_id(*version)
        if have != sid:
            raise RequestError(409, f"{topic}-{partition} segment {base} is not version "
                                    f"{sid} any more (compacted since it was listed); "
                                    "list its segments again")
        size = seg.log_size if file == "log" else seg.index_size
        if start > size:
            raise RequestError(416, f"from={start} is past the end of the {file} "
                                    f"({size} bytes)")
        n = min(max_bytes, size - start)
        return size, n

    def read(self, topic: str, partition: int, from_offset: int, max_bytes: int):
        """(buffer or None, nbytes, record count, next offset, high watermark); the caller gives
        the buffer back to ``self.buffers`` once it is sent (``PartitionReader.read_raw``)."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            r = PartitionReader(pl).read_raw(from_offset, max_bytes, self.buffers)
            return r.buf, r.nbytes, r.count, r.next_offset, pl.next_offset

    def locate(self, topic: str, partition: int, from_offset: int, max_bytes: int):
        """(Located or None, next offset, high watermark): the zero-copy twin of ``read``."""
        lock, pl = self._part(topic, partition)
        with lock:
            pl.refresh()
            loc = PartitionReader(pl).locate(from_offset, max_bytes)
            nxt = loc.next_offset if loc is not None else max(from_offset, pl.next_offset)
            return loc, nxt, pl.next_offset

    @property
    def local(self) -> bool:
        """A store in a local directory: its .log files can be sent with sendfile."""
        return self.fs.local_path(fn.STORE_JSON) is not None

    def live(self, topic: str, partition: int, upto: int | None):
        """(BitMap64 of live offsets, upto), cached while the segments stay the same."""
        pl = self.store.open_view(topic, partition)
        if upto is None:
            upto = pl.next_offset
        sig = tuple((s.base, s.log_size, s.index_size) for s in pl.segments)
        key = (topic, partition, upto, sig)
        with self._lock:
            hit = self._live_cache.get(key)
        if hit is not None:
            return hit, upto, pl
        bm, upto = live_offsets(pl, upto, self.limits.live_map_memory)
        with self._lock:
            self._live_cache[key] = bm
            while len(self._live_cache) > 8:
                self._live_cache.popitem(last=False)
        return bm, upto, pl
