"""The answers to every API the endpoint serves but Fetch (fetch.py) and the SASL exchange
(server.py): ApiVersions, Metadata, ListOffsets, Produce (refused), FindCoordinator and the
group APIs (groups.py). Each builds its response's fields as plain values; ``answer`` counts
the error codes they carry (the endpoint's errors metric) and encodes the frame.
docs/kafka-endpoint.md says what each answers.
"""

from __future__ import annotations

import uuid
from typing import Any

from .wire import (API_NAMES, API_VERSIONS, CLUSTER_AUTHORIZATION_FAILED, FETCH,
                   FIND_COORDINATOR, HEARTBEAT, INIT_PRODUCER_ID, INVALID_REQUEST, JOIN_GROUP, LEAVE_GROUP, LIST_OFFSETS, METADATA, NONE,
                   OFFSET_COMMIT, OFFSET_FETCH, POLICY_VIOLATION, PRODUCE, SYNC_GROUP,
                   TRANSACTIONAL_ID_AUTHORIZATION_FAILED, UNKNOWN_TOPIC_OR_PARTITION, Request,
                   api_keys, respond)

NODE_ID = 0
READ_ONLY = ("this Kafka endpoint serves a kcompact store read-only: produce to the source "
             "cluster, which the store mirrors")
#: ListOffsets' special timestamps
LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3
#: offset and timestamp Kafka answers when no record is at or after a timestamp
NO_OFFSET = -1
#: FindCoordinator's key types
GROUP_KEY, TRANSACTION_KEY = 0, 1


def topic_uuid(tid: str | None) -> uuid.UUID:
    """A recorded topic id (Kafka's text form: 16 bytes in URL-safe base64 without padding, or
    a hex UUID) as a UUID; the zero UUID when unknown or unreadable (Kafka's "no id")."""
    import base64
    if not tid:
        return uuid.UUID(int=0)
    try:
        if len(tid) == 22:
            return uuid.UUID(bytes=base64.urlsafe_b64decode(tid + "=="))
        return uuid.UUID(tid)
    except ValueError:
        return uuid.UUID(int=0)


class Handlers:
    """``endpoint``: the running endpoint (its store view, coordinator, advertised address and
    thread pool runner)."""

    def __init__(self, endpoint: Any):
        self.ep = endpoint

    async def answer(self, req: Request, conn: Any = None) -> bytes | list | None:
        """The response frame (buffers for Fetch); None: nothing can be answered (a produce
        with acks=0). ``conn``: the server's Connection (the address it reached)."""
        k = req.api_key
        if k == FETCH:
            from .fetch import handle_fetch
            return await handle_fetch(
                self.ep.view, self.ep.run, req.version, req.correlation_id, req.body,
                self.ep.stopping, lambda codes: self.ep.count_errors(API_NAMES[FETCH], codes))
        values = await self._values(req, conn)
        if values is None:
            return None
        self.ep.count_errors(API_NAMES[k], _error_codes(values))
        return respond(k, req.version, req.correlation_id, throttle_time=0, **values)

    async def _values(self, req: Request, conn: Any) -> dict | None:
        """The response's fields as plain values (wire.build's), or None: nothing to answer."""
        k = req.api_key
        if k == API_VERSIONS:
            return {"error_code": NONE, "api_keys": api_keys()}
        if k == METADATA:
            return await self.metadata(req, conn)
        if k == LIST_OFFSETS:
            return await self.list_offsets(req)
        if k == PRODUCE:
            return self.produce(req)
        if k == INIT_PRODUCER_ID:
            return self.init_producer_id(req)
        if k == FIND_COORDINATOR:
            return self.find_coordinator(req, conn)
        co = self.ep.coordinator
        if k == JOIN_GROUP:
            return await co.join(req.version, req.body, req.client_id or "")
        if k == SYNC_GROUP:
            got = await co.sync(req.body)
            return {"error_code": got["error_code"], "assignment": got["assignment"]}
        if k == HEARTBEAT:
            return {"error_code": co.heartbeat(req.body)}
        if k == LEAVE_GROUP:
            return {"error_code": co.leave(req.body)}
        if k == OFFSET_COMMIT:
            return {"topics": await co.commit(req.body)}
        if k == OFFSET_FETCH:
            return {"error_code": NONE, "topics": co.fetch_offsets(req.body)}
        raise AssertionError(f"API key {k} is listed as served but has no handler")

    def find_coordinator(self, req: Request, conn: Any) -> dict:
        """Node 0 coordinates every group. A transaction coordinator (key type 1) is refused:
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED, non-retriable, with the read-only message (a
        transactional producer then fails at once rather than retrying); any other key type:
        INVALID_REQUEST, as Kafka answers an unknown one."""
        key_type = int(getattr(req.body, "key_type", GROUP_KEY))
        if key_type != GROUP_KEY:
            code = TRANSACTIONAL_ID_AUTHORIZATION_FAILED if key_type == TRANSACTION_KEY \
                else INVALID_REQUEST
            why = READ_ONLY if key_type == TRANSACTION_KEY else \
                f"unknown coordinator key type {key_type} (0: group, 1: transaction)"
            return {"error_code": code, "error_message": why, "node_id": -1, "host": "",
                    "port": -1}
        host, port = self.ep.advertised_for(conn)
        return {"error_code": NONE, "error_message": None, "node_id": NODE_ID, "host": host,
                "port": port}

    async def metadata(self, req: Request, conn: Any = None) -> dict:
        view = self.ep.view
        names = None if req.body.topics is None else [t.name for t in req.body.topics]

        def topics() -> list[dict]:
            have = view.topics()
            out = []
            for name in (have if names is None else names):
                parts = view.partitions(name) if name in have else []
                if not parts:
                    out.append({"error_code": UNKNOWN_TOPIC_OR_PARTITION, "name": name,
                                "topic_id": uuid.UUID(int=0), "partitions": []})
                    continue
                tid = view.topic_id(name)
                out.append({"error_code": NONE, "name": name, "is_internal": False,
                            "topic_id": topic_uuid(tid),
                            "partitions": [{"error_code": NONE, "partition_index": p,
                                            "leader_id": NODE_ID, "leader_epoch": -1,
                                            "replica_nodes": [NODE_ID], "isr_nodes": [NODE_ID],
                                            "offline_replicas": []} for p in parts]})
            return out

        host, port = self.ep.advertised_for(conn)
        return {"brokers": [{"node_id": NODE_ID, "host": host, "port": port, "rack": None}],
                "cluster_id": self.ep.cluster_id, "controller_id": NODE_ID,
                "topics": await self.ep.run(topics)}

    async def list_offsets(self, req: Request) -> dict:
        view = self.ep.view

        def answer() -> list[dict]:
            out = []
            for t in req.body.topics:
                have = set(view.partitions(t.name))
                parts = []
                for p in t.partitions:
                    pi, ts = int(p.partition_index), int(p.timestamp)
                    row = {"partition_index": pi, "error_code": NONE, "timestamp": -1,
                           "offset": NO_OFFSET, "leader_epoch": -1}
                    if pi not in have:
                        row["error_code"] = UNKNOWN_TOPIC_OR_PARTITION
                    else:
                        b = view.bounds(t.name, pi)
                        if ts == LATEST:
                            row["offset"] = b.high_watermark
                        elif ts == EARLIEST:
                            row["offset"] = b.log_start
                        elif ts == MAX_TIMESTAMP:
                            hit = view.max_timestamp(t.name, pi)
                            if hit is not None:
                                row["offset"], row["timestamp"] = hit
                        elif ts >= 0:
                            hit = view.offset_for_timestamp(t.name, pi, ts)
                            if hit is not None:
                                row["offset"], row["timestamp"] = hit
                        else:  # another negative timestamp (e.g. KIP-1005's -4, -5)
                            row["error_code"] = INVALID_REQUEST
                    parts.append(row)
                out.append({"name": t.name, "partitions": parts})
            return out

        return {"topics": await self.ep.run(answer)}

    def produce(self, req: Request) -> dict | None:
        """Every partition refused with POLICY_VIOLATION and a message saying why; nothing is
        written. A produce with acks=0 expects no answer: None (the connection is closed, as
        Kafka closes it when such a produce fails)."""
        self.ep.count_refused_produce()
        if int(req.body.acks) == 0:
            return None
        return {"responses": [
            {"name": t.name, "partition_responses": [
                {"index": p.index, "error_code": POLICY_VIOLATION, "base_offset": -1,
                 "log_start_offset": -1, "record_errors": [], "error_message": READ_ONLY}
                for p in t.partition_data]} for t in req.body.topic_data]}

    def init_producer_id(self, req: Request) -> dict:
        """Refused, as Kafka refuses a principal without write access: an idempotent producer
        (no transactional id) CLUSTER_AUTHORIZATION_FAILED (Kafka's answer without
        IdempotentWrite on the cluster), a transactional one
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED. The response has no message field; both codes
        are fatal in every client (none retries), which prints the code's name
        (docs/kafka-endpoint.md lists what each prints)."""
        self.ep.count_refused_produce()
        tid = getattr(req.body, "transactional_id", None)
        code = TRANSACTIONAL_ID_AUTHORIZATION_FAILED if tid else CLUSTER_AUTHORIZATION_FAILED
        return {"error_code": code, "producer_id": -1, "producer_epoch": -1}


def _error_codes(values):
    """Every ``error_code`` in a response's plain values (nested dicts and lists)."""
    if isinstance(values, dict):
        for k, v in values.items():
            if k == "error_code":
                yield int(v)
            elif isinstance(v, (dict, list, tuple)):
                yield from _error_codes(v)
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from _error_codes(v)
