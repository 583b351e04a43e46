"""The baseline of bench/kv.py: a quixstreams application that consumes a topic into its RocksDB
state (``State.set`` per message) until it has seen every message, then stops.

Run by bench/kv.py inside its own virtual environment (bench/.venv-quix: quixstreams pins
confluent-kafka below the project's version), never imported by kcompact:

    python kv_quix_peer.py --bootstrap-servers B --topic T --expected N --state-dir DIR

Prints ``READY`` as soon as ``app.run()`` returns (the final checkpoint has flushed the state
to RocksDB and closed it: the map is ready), then one JSON line: seconds from process start to
the first message, to the last message and to ready, and the number of keys found in the state
afterwards (not timed).

Settings favour the peer: no changelog topics (quixstreams' default writes every state update
to a changelog topic as well), ``session.timeout.ms=6000`` (the embedded broker assigns a group
after about half the session timeout; librdkafka's default 45 s would add ~20 s), one commit at
the end rather than every 5 s, values stored as raw bytes (no JSON encoding).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

T0 = time.perf_counter()

import logging  # noqa: E402

from quixstreams import Application  # noqa: E402
from quixstreams.state.rocksdb import RocksDBOptions  # noqa: E402
from quixstreams.utils.json import dumps as _json_dumps  # noqa: E402


def _dumps(v):
    # state keys (strings) keep quixstreams' JSON encoding; values pass as the bytes they are
    return v if isinstance(v, bytes) else _json_dumps(v)


def _same(b):
    return b


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--expected", type=int, required=True, help="messages in the topic")
    ap.add_argument("--state-dir", required=True)
    a = ap.parse_args()
    group = f"kv-bench-{uuid.uuid4().hex[:8]}"
    app = Application(
        broker_address=a.bootstrap_servers, consumer_group=group, auto_offset_reset="earliest",
        state_dir=a.state_dir, use_changelog_topics=False, loglevel=logging.WARNING,
        commit_interval=3600.0,
        # values are stored as the bytes they are (quixstreams' default JSON-encodes them)
        rocksdb_options=RocksDBOptions(dumps=_dumps, loads=_same),
        consumer_extra_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})
    topic = app.topic(a.topic, key_deserializer="bytes", value_deserializer="bytes")
    sdf = app.dataframe(topic)
    seen = {"n": 0, "first": None, "last": None}

    def put(value, state):
        state.set("value", value)
        n = seen["n"] = seen["n"] + 1
        if n == 1:
            seen["first"] = time.perf_counter()
        if n >= a.expected:
            seen["last"] = time.perf_counter()
            app.stop()

    sdf.update(put, stateful=True)
    app.run()
    done = time.perf_counter()
    print("READY", flush=True)   # the state is committed and closed: the parent times this line
    keys = 0
    for root, _dirs, files in os.walk(a.state_dir):
        if "CURRENT" in files:  # one RocksDB per store partition
            from rocksdict import AccessType, Options, Rdict
            db = Rdict(root, options=Options(raw_mode=True), access_type=AccessType.read_only())
            keys += sum(1 for k in db.keys() if not k.startswith(b"__"))
            db.close()
    print(json.dumps({"messages": seen["n"], "keys_in_state": keys,
                      "first_message_s": (seen["first"] or done) - T0,
                      "last_message_s": (seen["last"] or done) - T0,
                      "ready_s": done - T0}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
