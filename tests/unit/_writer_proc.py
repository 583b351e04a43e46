"""A store writer to be SIGKILLed by test_kill_writer.py (run as a script; not a test module).

    python _writer_proc.py STORE_DIR TRIAL SEED

Appends batches of records from a deterministic generator (the contents of the record at
(topic, partition, offset) and the gap to the next offset depend only on those three values),
resuming after the last offset each partition holds; re-sends some already-stored records (they
must be skipped); calls ``Store.flush()`` now and then and, after each flush returns, prints
``{"flushed": {"topic/partition": last_offset, ...}}`` on one line. Prints ``ready`` once the
store is open. Runs until killed.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kcompact.reput.config import WriterOptions
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store

TOPICS = {"kt": 3, "kt.b-2": 1}    # topic -> number of partitions
SEGMENT_BYTES = 16384


def options(trial: int) -> WriterOptions:
    """Small commit-log segments; odd trials delete dispatched segments at once."""
    return WriterOptions(commitlog_segment_bytes=1 << 16,
                         commitlog_retention_ms=0 if trial % 2 else 3600 * 1000)


def next_offset_after(topic: str, p: int, prev: int) -> int:
    """The generator's offset after ``prev`` (-1: the first one): mostly +1, sometimes a gap."""
    r = random.Random(f"gap:{topic}:{p}:{prev}")
    return prev + 1 + (0 if r.random() < 0.7 else r.randrange(1, 20))


def record(topic: str, p: int, off: int) -> Record:
    r = random.Random(f"rec:{topic}:{p}:{off}")
    key = None if r.random() < 0.1 else b"k%d" % r.randrange(100)
    x = r.random()
    value = None if x < 0.05 else b"" if x < 0.1 else r.randbytes(r.randrange(1, 700))
    headers = () if r.random() < 0.5 else (("off", str(off).encode()), ("n", None))
    return Record(topic, p, off, off * 7 + p, key, value, headers)


def main() -> None:
    root, trial, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    store = Store.open(root, writer="w", options=options(trial))
    last = {(t, p): store.partition(t, p).last_offset for t, n in TOPICS.items() for p in range(n)}
    print("ready", flush=True)
    sent: list[Record] = []
    while True:
        if sent and rng.random() < 0.1:
            # re-send the tail of the last batch of one partition (stored: must be skipped)
            topic, p = sent[-1].topic, sent[-1].partition
            old = [r for r in sent if r.partition == p][-rng.randint(1, 5):]
            parts = [p]
        else:
            topic = rng.choice(sorted(TOPICS))
            old, parts = [], list(range(TOPICS[topic]))
        p_last = {p: last[(topic, p)] for p in parts}
        new = []
        for _ in range(rng.randint(1, 30)):
            p = rng.choice(parts)
            p_last[p] = next_offset_after(topic, p, p_last[p])
            new.append(record(topic, p, p_last[p]))
        recs = old + new
        store.append(RecordBatch.from_records(topic, recs))
        for p in parts:
            last[(topic, p)] = p_last[p]
        sent = new
        if rng.random() < 0.25:
            store.flush()
            print(json.dumps({"flushed": {f"{t}/{p}": o for (t, p), o in last.items()}}),
                  flush=True)
        time.sleep(rng.uniform(0.0005, 0.003))


if __name__ == "__main__":
    main()
