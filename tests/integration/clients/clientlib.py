"""What the Python client programs of the client matrix share (kafka_python_client.py,
aiokafka_client.py; run by the clients' own virtualenv, not kcompact's): the command line and
the JSON lines they print. The Go and JavaScript programs print the same lines.

    PROG read    BOOTSTRAP TOPIC LASTS             every partition from offset 0 (assign)
    PROG group   BOOTSTRAP TOPIC LASTS GROUP N     a group member reads N records, commits,
                                                   closes; a second one resumes to the end
    PROG offsets BOOTSTRAP TOPIC PARTITIONS        ListOffsets earliest and latest
    PROG produce BOOTSTRAP TOPIC                   one record with the client's default producer
    PROG idle    BOOTSTRAP TOPIC LASTS SECONDS     read to the end, then poll SECONDS idle

LASTS: each partition's last record offset, comma-separated (-1: no record): reading ends when
every partition delivered its last record and, where the client exposes it, its position reached
the high watermark (``settle`` seconds at most). Lines printed: one per record ``{"topic",
"partition", "offset", "timestamp", "key", "value", "headers": [[name, value]]}`` (key, values
base64, null for null), then ``{"positions": {p: next offset}}`` (null where the client does not
say), ``{"committed": {p: offset}}``, ``{"earliest": .., "latest": ..}``, ``{"produce_error":
"Type: message"}`` or ``{"produced": true}``, ``{"idle": "start"}`` / ``{"idle": "end",
"records": n}``. A failure prints ``{"error": "..."}`` and exits 1; a record delivered twice
(an offset at or below one already delivered) is such a failure.
"""

from __future__ import annotations

import base64
import json
import sys
import time

#: the longest a read may take to deliver every partition's last record
READ_TIMEOUT_S = 30.0
#: how long, after the last records, a read waits for positions to reach the high watermark
SETTLE_S = 8.0


def b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def fail(msg: str) -> None:
    emit({"error": msg})
    sys.exit(1)


def parse_lasts(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


class Tracker:
    """Records delivered per partition: prints each, fails on a re-delivery, says when every
    partition delivered its last record."""

    def __init__(self, topic: str, lasts: list[int], quiet: bool = False):
        self.topic, self.lasts, self.quiet = topic, lasts, quiet
        self.seen = {p: -1 for p in range(len(lasts))}
        self.count = 0

    def add(self, partition: int, offset: int, timestamp: int, key, value, headers) -> None:
        if offset <= self.seen[partition]:
            fail(f"partition {partition}: offset {offset} delivered again (after offset "
                 f"{self.seen[partition]}; {self.count} records delivered)")
        self.seen[partition] = offset
        self.count += 1
        if not self.quiet:
            emit({"topic": self.topic, "partition": partition, "offset": offset,
                  "timestamp": timestamp, "key": b64(key), "value": b64(value),
                  "headers": [[k, b64(v)] for k, v in (headers or [])]})

    def done(self) -> bool:
        return all(self.seen[p] >= last for p, last in enumerate(self.lasts))

    def missing(self) -> str:
        return ", ".join(f"partition {p} at offset {self.seen[p]} (last record {last})"
                         for p, last in enumerate(self.lasts) if self.seen[p] < last)


def deadline(s: float = READ_TIMEOUT_S) -> float:
    return time.monotonic() + s


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
