"""Restore progress (docs/formats/restore-progress.md): one record per chunk, key = the job id
``<store topic>-><target cluster id>/<target topic>``, value = JSON with a sequence number and the
position reached in each store partition, in two compacted topics named
``__kcompact-restore-offsets``: the store's own (:class:`StoreProgress`, appended through the
store's write path by the writer ``restore-<job hash>``, as Connect keeps ``connect-offsets``)
and one on the target cluster (:func:`read_kafka_progress`). A restart takes the record with the
highest sequence number of the two (:func:`newest`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from kcompact.reput import Store, StoreLockedError
from kcompact.reput.record import RecordBatch, key_digest

from .errors import ProgressFormatError, RestoreError
from .kafka import kafka_failure

#: The store's internal topic (and the Kafka topic) that keeps restore progress.
PROGRESS_TOPIC = "__kcompact-restore-offsets"
#: Version of the progress record's JSON (docs/formats/restore-progress.md): 2 adds run_seq
#: and as_of_ms (a version 1 record reads as run_seq 0, as_of_ms null)
PROGRESS_FORMAT_VERSION = 2
#: How long a progress write waits for another restore that is writing the store's progress.
STORE_LOCK_WAIT_S = 30.0


@dataclass(frozen=True)
class RestoreJob:
    """What a restore is: a store topic into a topic of one Kafka cluster."""

    store_id: str
    store_topic: str
    cluster_id: str
    target_topic: str

    @property
    def key(self) -> str:
        """The progress records' key."""
        return f"{self.store_topic}->{self.cluster_id}/{self.target_topic}"

    @property
    def token(self) -> str:
        raw = f"{self.store_id}|{self.key}".encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    @property
    def transactional_id(self) -> str:
        return f"kcompact-restore-{self.token}"

    @property
    def writer(self) -> str:
        """The store writer id that appends this job's progress."""
        return f"restore-{self.token}"


@dataclass
class Progress:
    """One progress record (docs/formats/restore-progress.md)."""

    job: str
    store_id: str
    store_topic: str
    cluster_id: str
    target_topic: str
    mode: str
    seq: int
    positions: dict[int, int]
    produced: int = 0
    done: bool = False
    transactional: bool = False
    updated_ms: int = 0
    version: int = PROGRESS_FORMAT_VERSION
    #: the seq this run of the job started after (0, or the --from-scratch reset's): its
    #: offset map records are those with a higher seq (translation.py)
    run_seq: int = 0
    #: the time of a restore of the state as of a time (None: the latest state)
    as_of_ms: int | None = None
    #: every chunk of this run so far has its offset map records (translation.py)
    mapped: bool = False

    @classmethod
    def start(cls, job: RestoreJob, mode: str, seq: int = 0,
              as_of_ms: int | None = None) -> "Progress":
        return cls(job.key, job.store_id, job.store_topic, job.cluster_id, job.target_topic,
                   mode, seq, {}, run_seq=seq, as_of_ms=as_of_ms, mapped=True)

    def advance(self, positions: Mapping[int, int], produced: int, done: bool,
                transactional: bool, mapped: bool = True) -> "Progress":
        """The next record; ``mapped``: this chunk's offset map records were written."""
        return Progress(self.job, self.store_id, self.store_topic, self.cluster_id,
                        self.target_topic, self.mode, self.seq + 1,
                        {int(p): int(o) for p, o in positions.items()}, self.produced + produced,
                        done, transactional, int(time.time() * 1000), PROGRESS_FORMAT_VERSION,
                        self.run_seq, self.as_of_ms, self.mapped and mapped)


def encode_progress(p: Progress) -> bytes:
    d = asdict(p)
    d["positions"] = {str(k): int(v) for k, v in sorted(p.positions.items())}
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def decode_progress(raw: bytes | None, *, where: str) -> Progress:
    if raw is None:
        raise ProgressFormatError(f"{where}: the progress record is a tombstone")
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        version = int(d["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise ProgressFormatError(f"{where}: unreadable progress record ({e}); restore with "
                                  "--from-scratch to produce everything again") from None
    if version > PROGRESS_FORMAT_VERSION:
        raise ProgressFormatError(f"{where}: progress format {version} is newer than this "
                                  f"kcompact understands ({PROGRESS_FORMAT_VERSION}); upgrade")
    try:
        positions = {int(k): int(v) for k, v in d["positions"].items()}
        if any(p < 0 or o < 0 for p, o in positions.items()):
            raise ValueError("negative partition or position")
        p = Progress(str(d["job"]), str(d["store_id"]), str(d["store_topic"]),
                     str(d["cluster_id"]), str(d["target_topic"]), str(d["mode"]),
                     int(d["seq"]), positions, int(d.get("produced", 0)),
                     bool(d.get("done", False)), bool(d.get("transactional", False)),
                     int(d.get("updated_ms", 0)), version, int(d.get("run_seq", 0)),
                     None if d.get("as_of_ms") is None else int(d["as_of_ms"]),
                     bool(d.get("mapped", False)))
        if p.mode not in ("latest", "all") or p.seq < 0 or not 0 <= p.run_seq <= p.seq:
            raise ValueError(f"mode {p.mode!r}, seq {p.seq}")
        return p
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProgressFormatError(f"{where}: progress record has an invalid field ({e}); "
                                  "restore with --from-scratch to produce everything "
                                  "again") from None


def newest(*candidates: Progress | None) -> Progress | None:
    """The progress record with the highest sequence number (the store's on a tie)."""
    best = None
    for c in candidates:
        if c is not None and (best is None or c.seq > best.seq):
            best = c
    return best


# ---------------------------------------------------------------------------------------------
# progress in the store


class StoreProgress:
    """The job's progress records in the store's internal topic (partition 0)."""

    def __init__(self, url: str, job: RestoreJob, *, topic: str = PROGRESS_TOPIC,
                 commitlog_dir: str | None = None, lock_wait_s: float = STORE_LOCK_WAIT_S):
        self.url, self.job, self.topic = url, job, topic
        self.commitlog_dir, self.lock_wait_s = commitlog_dir, lock_wait_s
        self._writer: Store | None = None

    def read(self) -> Progress | None:
        with Store.open(self.url, commitlog_dir=self.commitlog_dir) as st:
            if self.topic not in st.topics() or 0 not in st.partitions(self.topic):
                return None
            pl = st.partition(self.topic, 0)
            lo, hi = key_digest(self.job.key.encode(), st.secret)
            last = -1
            for seg in pl.segments:
                e = seg.index().entries
                if e.shape[0] == 0:
                    continue
                hit = (e["digest_lo"] == lo) & (e["digest_hi"] == hi)
                if hit.any():
                    last = max(last, int(e["offset"][hit][-1]))
            if last < 0:
                return None
            for rec in pl.iter_records(last, 1):
                if rec.key != self.job.key.encode() or rec.value is None:
                    return None  # a digest collision, or a reset by tombstone
                return decode_progress(rec.value, where=f"{self.url} {self.topic}-0@{rec.offset}")
            return None

    def open_writer(self) -> None:
        """Take the job's commit log (one run per job: a second one fails here, before it
        produces anything or fences the first's transactions)."""
        if self._writer is None:
            try:
                self._writer = Store.open(self.url, writer=self.job.writer,
                                          commitlog_dir=self.commitlog_dir)
            except StoreLockedError:
                raise RestoreError(f"another restore of {self.job.key} is running (its progress "
                                   f"writer {self.job.writer} in {self.url} is locked); stop "
                                   "it first") from None
            # opening re-dispatched what a killed run left in the commit log; let other
            # restores of this store write their progress meanwhile
            self._writer.release_partition(self.topic, 0)

    def read_maps(self) -> dict[bytes, bytes | None]:
        """The job's offset map records in the store (key -> value, the latest per key)."""
        prefix = f"{self.job.key}@map/".encode()
        out: dict[bytes, bytes | None] = {}
        with Store.open(self.url, commitlog_dir=self.commitlog_dir) as st:
            if self.topic not in st.topics() or 0 not in st.partitions(self.topic):
                return out
            for rec in st.iter_records(self.topic, 0):
                if rec.key is not None and rec.key.startswith(prefix):
                    out[rec.key] = rec.value
        return out

    def write(self, p: Progress, maps: list[tuple[bytes, bytes]] = ()) -> None:
        """Append the record (after ``maps``, offset map records: key, value) and make it
        durable (fsync), holding the partition only meanwhile so that restores of other
        topics can write their progress too."""
        self.open_writer()
        st = self._writer
        assert st is not None
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                pl = st.writable_partition(self.topic, 0)
                break
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise RestoreError(f"{self.url}: {self.topic}-0 stayed locked by another "
                                       f"process for {self.lock_wait_s:.0f} s; cannot record "
                                       "restore progress") from None
                time.sleep(0.05)
        try:
            now = p.updated_ms or int(time.time() * 1000)
            nxt = pl.next_offset
            batch = RecordBatch.from_records(self.topic, [
                (0, nxt + i, now, k, v) for i, (k, v) in enumerate(maps)] + [
                (0, nxt + len(maps), now, self.job.key.encode(), encode_progress(p))])
            st.append(batch)
            st.flush()
        finally:
            st.release_partition(self.topic, 0)

    def close(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.close()


#: Consumer settings of the metadata probe, which then reads the progress topic: offset 0 with
#: auto.offset.reset=earliest (a compacted topic may start later) rather than OFFSET_BEGINNING,
#: a short fetch wait, and a consumer that is connected already: ~0.01 s instead of ~1 s.
PROBE_CONSUMER_CONFIG = {"group.id": "kcompact-restore", "enable.auto.commit": False,
                         "enable.partition.eof": True, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10}


def read_kafka_progress(c: Any, topic: str, job: RestoreJob, bootstrap: str,
                        timeout: float, maps: dict | None = None) -> Progress | None:
    """The job's last committed progress record in the cluster's progress topic, read to its
    end with ``c`` (a consumer with PROBE_CONSUMER_CONFIG, read_committed: an open transaction
    of another job is waited for, up to ``timeout``); the job's offset map records go into
    ``maps`` (key -> value) when given."""
    prefix = f"{job.key}@map/".encode()
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka import TopicPartition as KTP
    key = job.key.encode()
    found: Progress | None = None
    try:
        c.assign([KTP(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise RestoreError(f"could not read {topic} on {bootstrap} to its end within "
                                   f"{timeout:.0f} s (a transaction left open by another "
                                   "restore?); try again")
            for m in c.consume(1000, 0.02):  # returns at 1000 messages or the timeout
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return found
                    raise kafka_failure(f"read {topic}", KafkaException(err), bootstrap,
                                        topic=topic)
                if m.key() == key:
                    found = None if m.value() is None else decode_progress(
                        m.value(), where=f"{bootstrap} {topic}-0@{m.offset()}")
                elif maps is not None and m.key() is not None and m.key().startswith(prefix):
                    maps[m.key()] = m.value()
    finally:
        c.unassign()
