"""Fetch (key 1): versions 4-12, flexible from 12. The records of a read, the response written
by hand.

The response is laid out field by field (Kafka's FetchResponse.json, versions 4-12; v12 is the
first flexible one: compact lengths and empty tagged-field sections), so that the record section
of each partition is the stored batch bytes themselves, handed to the transport as the buffers
``StoreView.fetch`` returned (memoryviews of a mapped segment on a local store): no copy and no
re-encoding of a batch. Semantics (docs/kafka-endpoint.md):

* the batch holding the fetch offset or, in a gap, the next one; the first batch of the response
  whole even past the limits (KIP-74), later ones only while within the partition's and the
  response's ``max_bytes``; a gap after the last batch is ended as a Kafka log ending in
  transaction markers ends: a COMMIT control batch at the high watermark - 1
  (StoreView.fetch, reput/batch.control_batch), served after the partition's last data in the
  same answer when it fits whole within the limits, as Kafka's markers come with the data,
  else alone to the next fetch, in the gap;
* an offset below the log start offset or above the high watermark: OFFSET_OUT_OF_RANGE;
  a partition that fails its checks (damaged, or its ledger disagrees with its segments:
  reput/ledger.py): KAFKA_STORAGE_ERROR, as Kafka answers for an offline log;
  a topic or partition the store does not have: UNKNOWN_TOPIC_OR_PARTITION; in a fleet, a
  partition another node leads: NOT_LEADER_OR_FOLLOWER, not read (cluster.py);
* LastStableOffset = high watermark, AbortedTransactions empty, PreferredReadReplica -1,
  SessionId 0 (no fetch sessions: clients send full fetches);
* a Fetch below v10 of a topic whose compression.type is zstd: UNSUPPORTED_COMPRESSION_TYPE for
  each partition, records null, offsets -1, byte for byte as Kafka answers it (KIP-110; captured
  in tests/integration/test_kafka_endpoint.py; Kafka decides by the
  topic's config, not by the batches: zstd batches of a ``producer`` topic are served to any
  version, there as here); nothing is recompressed on the fly (docs/kafka-endpoint.md says why);
* fewer than ``min_bytes`` found: the fetch waits up to ``max_wait_ms`` for any of its
  partitions to grow (each ``POLL_S``; on S3 with shared uploads the store's one signal each
  ``SIGNAL_POLL_S``, ``StoreView.changes``, and its partitions only when it moved), then
  reads again (long poll);
* a fetch naming no topic (the Java consumer's on close) gets an empty answer at once;
* a waiting fetch whose client closed its connection stops waiting (and polling the store) at
  its next look, not at its ``max_wait_ms``;
* with ACLs: READ on each topic; a fetch naming a topic not allowed is read once, without the
  long poll, its denied topics' partitions TOPIC_AUTHORIZATION_FAILED (authorize.Gate).

Version notes:
* v4: isolation_level, last_stable_offset and aborted_transactions (v0-3's message sets are
  not served: every stored batch is a RecordBatch v2);
* v5: log_start_offset; v6: the same fields;
* v7: fetch sessions (error_code, session_id: 0 here, no sessions); v8: the same fields;
* v9: current_leader_epoch in the request; v10: zstd allowed (KIP-110);
* v11: rack_id, preferred_read_replica (-1);
* v12: flexible (compact lengths, empty tagged-field sections); the last version that names
  topics: v13 names them by topic id, not served.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any, Callable

from kcompact.reput.errors import CorruptRecordError

from ..store_view import Bounds, StoreView
from ..wire import (KAFKA_STORAGE_ERROR, NONE, OFFSET_OUT_OF_RANGE, TOPIC_AUTHORIZATION_FAILED,
                    UNKNOWN_TOPIC_OR_PARTITION, UNSUPPORTED_COMPRESSION_TYPE, ms)
from ..cluster import NOT_LEADER_OR_FOLLOWER, fleet_of
from ..cluster import leads as _leads
from .base import register

KEY, NAME = 1, "Fetch"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 4, 12, 12

#: how often a waiting fetch looks at its partitions again
POLL_S = 0.1
#: ... and how often it asks the store's signal (``StoreView.changes``: S3 with shared uploads),
#: which costs no partition's refresh; every partition is looked at only when the signal moved,
#: or LOOK_ANYWAY_S after the last look (a partition the signal does not cover)
SIGNAL_POLL_S = 0.05
LOOK_ANYWAY_S = 1.0
#: the longest wait a fetch may ask for (Kafka clients ask for 500 ms by default)
MAX_WAIT_S = 30.0

_I16, _I32, _I64 = struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_PART_V4 = struct.Struct(">ihqq")      # partition error hwm lso


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class PartitionResult:
    __slots__ = ("partition", "error", "bounds", "parts", "nbytes")

    def __init__(self, partition: int, error: int, bounds: Bounds, parts=(), nbytes: int = 0):
        self.partition, self.error, self.bounds = partition, error, bounds
        self.parts, self.nbytes = list(parts), nbytes


_NO_BOUNDS = Bounds(-1, -1)


def read_partitions(view: StoreView, version: int, topics: list, max_bytes: int,
                    leads: Callable[[str, int], bool] | None = None) -> tuple[list, int]:
    """One pass over the request's partitions (blocking): [(topic, [PartitionResult])], bytes."""
    out, budget, first = [], max(0, max_bytes), True
    total = 0
    for t in topics:
        name = t.topic
        parts = list(t.partitions)
        known = set(view.partitions(name, int(parts[0].partition))) if parts else set()
        # KIP-110 as Kafka applies it (KafkaApis.maybeConvertFetchedData): a Fetch below v10
        # of a topic whose compression.type is zstd is refused, whatever its batches hold
        zstd_refused = version < 10 and bool(known) and view.zstd_topic(name)
        results = []
        for p in parts:
            pi = int(p.partition)
            if pi not in known:
                known = set(view.partitions(name, pi))  # listed again, at most every second
            if pi not in known:
                results.append(PartitionResult(pi, UNKNOWN_TOPIC_OR_PARTITION, _NO_BOUNDS))
                continue
            if leads is not None and not leads(name, pi):  # a fleet: another node leads it
                results.append(PartitionResult(pi, NOT_LEADER_OR_FOLLOWER, _NO_BOUNDS))
                continue
            offset = int(p.fetch_offset)
            try:
                b = view.bounds(name, pi)
            except CorruptRecordError:  # damaged: an offline log, never a shorter one
                results.append(PartitionResult(pi, KAFKA_STORAGE_ERROR, _NO_BOUNDS))
                continue
            if offset < b.log_start or offset > b.high_watermark:
                results.append(PartitionResult(pi, OFFSET_OUT_OF_RANGE, b))
                continue
            if zstd_refused:
                results.append(PartitionResult(pi, UNSUPPORTED_COMPRESSION_TYPE, _NO_BOUNDS))
                continue
            limit = min(max(0, int(p.partition_max_bytes)), budget)
            if offset == b.high_watermark or (limit <= 0 and not first):
                results.append(PartitionResult(pi, NONE, b))
                continue
            try:
                got = view.fetch(name, pi, offset, limit)
            except CorruptRecordError:
                results.append(PartitionResult(pi, KAFKA_STORAGE_ERROR, _NO_BOUNDS))
                continue
            if got.nbytes and not first and got.nbytes > budget:
                got = got._replace(parts=[], nbytes=0)  # only the first batch may overflow
            results.append(PartitionResult(pi, NONE, got.bounds, got.parts, got.nbytes))
            if got.nbytes:
                first = False
                budget = max(0, budget - got.nbytes)
                total += got.nbytes
        out.append((name, results))
    return out, total


def grew(view: StoreView, topics: list, seen: list) -> bool:
    """Whether any partition of the request has records past where it was fetched (blocking)."""
    for (name, results), t in zip(seen, topics):
        for r, p in zip(results, t.partitions):
            if r.error != NONE:
                continue
            try:
                b = view.bounds(name, r.partition)
            except Exception:  # noqa: BLE001 - the next read reports it
                return True
            if b.high_watermark > int(p.fetch_offset) or b != r.bounds:
                return True
    return False


async def handle(ep, req, conn) -> list:
    """The registered handler: the ACLs (``ep.gate``), then ``handle_fetch``."""
    gate = ep.gate
    leads = None if fleet_of(ep) is None else (lambda t, p: _leads(ep, t, p))
    if gate is not None:
        denied = gate.fetch_denied(req, conn)
        if denied:
            ep.count_errors(NAME, [TOPIC_AUTHORIZATION_FAILED])
            return await gate.fetch_with_denied(ep, req, denied, leads)
    gone = getattr(conn, "gone", None)
    stopping = ep.stopping if gone is None else (lambda: ep.stopping() or gone())
    return await handle_fetch(ep.view, ep.run, req.version, req.correlation_id, req.body,
                              stopping, lambda codes: ep.count_errors(NAME, codes),
                              leads=leads)


async def handle_fetch(view: StoreView, run: Callable, version: int, correlation_id: int,
                       req: Any, stopping: Callable[[], bool],
                       count_errors: Callable[[list], None] | None = None,
                       leads: Callable[[str, int], bool] | None = None) -> list:
    """The response buffers of a Fetch request (``run(fn, *args)`` runs blocking work in the
    endpoint's thread pool; ``count_errors`` is handed the partitions' error codes)."""
    topics = list(req.topics or ())
    if not topics:
        return encode_fetch(version, correlation_id, [])
    max_bytes = int(getattr(req, "max_bytes", 0x7FFFFFFF))
    wait_s = min(MAX_WAIT_S, max(0, ms(req.max_wait)) / 1000.0)
    min_bytes = max(0, int(req.min_bytes))
    deadline = time.monotonic() + wait_s
    # (taken before the read: whatever arrives after it moves the mark)
    changes = getattr(view, "changes", None) if wait_s > 0 else None
    mark = await run(changes) if changes is not None else None
    seen, total = await run(read_partitions, view, version, topics, max_bytes, leads)
    at_edge = getattr(view, "at_edge", None)
    if total < max(1, min_bytes) and at_edge is not None:  # it waits: the store's polls
        await run(at_edge)                                   # keep the follow interval
    looked = time.monotonic()
    while total < max(1, min_bytes) and time.monotonic() < deadline and not stopping():
        tick = POLL_S if mark is None else SIGNAL_POLL_S
        await asyncio.sleep(min(tick, max(0.0, deadline - time.monotonic())))
        if mark is not None:  # the store's one signal first, not every partition's bounds
            now_mark = await run(changes)
            if now_mark == mark and time.monotonic() - looked < LOOK_ANYWAY_S:
                continue
            mark = now_mark
        looked = time.monotonic()
        if await run(grew, view, topics, seen):
            seen, total = await run(read_partitions, view, version, topics, max_bytes, leads)
    if count_errors is not None:
        count_errors([r.error for _, results in seen for r in results])
    return encode_fetch(version, correlation_id, seen)


def encode_fetch(version: int, correlation_id: int, topics: list) -> list:
    """The response frame as a list of buffers (size prefix first)."""
    flexible = version >= FLEXIBLE_FROM
    head = bytearray()
    if flexible:
        head += _I32.pack(correlation_id) + b"\0"   # response header v1: empty tagged fields
    else:
        head += _I32.pack(correlation_id)
    head += _I32.pack(0)                            # throttle_time_ms
    if version >= 7:
        head += _I16.pack(NONE) + _I32.pack(0)      # error_code, session_id
    head += _uvarint(len(topics) + 1) if flexible else _I32.pack(len(topics))
    out: list = [None, head]
    cur = head
    for name, results in topics:
        nb = name.encode()
        cur += (_uvarint(len(nb) + 1) if flexible else _I16.pack(len(nb))) + nb
        cur += _uvarint(len(results) + 1) if flexible else _I32.pack(len(results))
        for r in results:
            hwm = r.bounds.high_watermark
            cur += _PART_V4.pack(r.partition, r.error, hwm, hwm)
            if version >= 5:
                cur += _I64.pack(r.bounds.log_start)
            cur += b"\x01" if flexible else _I32.pack(0)  # aborted_transactions: empty
            if version >= 11:
                cur += _I32.pack(-1)                      # preferred_read_replica
            if r.error == UNSUPPORTED_COMPRESSION_TYPE:   # (below v10: never flexible)
                cur += _I32.pack(-1)                      # records: null, as Kafka's
            else:
                cur += _uvarint(r.nbytes + 1) if flexible else _I32.pack(r.nbytes)
            if r.nbytes:
                out.extend(r.parts)
                cur = bytearray()
                out.append(cur)
            if flexible:
                cur += b"\0"                              # partition's tagged fields
        if flexible:
            cur += b"\0"                                  # topic's tagged fields
    if flexible:
        cur += b"\0"                                      # response's tagged fields
    size = sum(memoryview(b).nbytes for b in out[1:])
    out[0] = _I32.pack(size)
    return [b for b in out if len(b)]


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle, encodes_itself=True)
