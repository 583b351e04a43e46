"""kafka-python (PyPI ``kafka-python``, as installed: no extras) for the client matrix; the
command line and the lines printed are clientlib.py's."""

from __future__ import annotations

import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata

from clientlib import (SETTLE_S, Tracker, deadline, emit, error_text, fail, parse_lasts)

COMMON = dict(enable_auto_commit=False, isolation_level="read_committed",
              auto_offset_reset="earliest")


def _poll_into(c: KafkaConsumer, t: Tracker, limit: int | None = None) -> list:
    """Poll once; add the records (at most ``limit``); return the records added."""
    added = []
    for tp, recs in c.poll(timeout_ms=300).items():
        for r in recs:
            if limit is not None and t.count >= limit:
                return added
            t.add(tp.partition, r.offset, r.timestamp, r.key, r.value, r.headers)
            added.append((tp.partition, r.offset))
    return added


def _to_end(c: KafkaConsumer, t: Tracker, tps: list) -> dict:
    """Poll until every last record came, then until the positions reach the high watermark
    (SETTLE_S at most); the positions."""
    end = deadline()
    while not t.done():
        if time.monotonic() > end:
            fail(f"not every record came in 30 s: {t.missing()}")
        _poll_into(c, t)
    hwm = c.end_offsets(tps)
    settle = deadline(SETTLE_S)
    while time.monotonic() < settle and any(c.position(tp) < hwm[tp] for tp in tps):
        _poll_into(c, t)
    return {tp.partition: c.position(tp) for tp in tps}


def read(bs: str, topic: str, lasts: str, quiet: bool = False) -> tuple:
    t = Tracker(topic, parse_lasts(lasts), quiet)
    tps = [TopicPartition(topic, p) for p in range(len(t.lasts))]
    c = KafkaConsumer(bootstrap_servers=bs, group_id=None, **COMMON)
    c.assign(tps)
    for tp in tps:
        c.seek(tp, 0)
    return c, t, tps, _to_end(c, t, tps)


def cmd_read(bs, topic, lasts):
    c, _, _, positions = read(bs, topic, lasts)
    emit({"positions": positions})
    c.close()


def cmd_group(bs, topic, lasts, group, n):
    t = Tracker(topic, parse_lasts(lasts))
    tps = [TopicPartition(topic, p) for p in range(len(t.lasts))]
    kw = dict(bootstrap_servers=bs, group_id=group, session_timeout_ms=10000,
              heartbeat_interval_ms=1000, **COMMON)
    c = KafkaConsumer(topic, **kw)
    end = deadline()
    nexts = {}
    while t.count < int(n):
        if time.monotonic() > end:
            fail(f"the first member got {t.count} of {n} records in 30 s")
        for p, o in _poll_into(c, t, int(n)):
            nexts[p] = o + 1
    c.commit({TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in nexts.items()})
    c.close(autocommit=False)
    c = KafkaConsumer(topic, **kw)
    _to_end(c, t, tps)
    c.commit()
    committed = {tp.partition: c.committed(tp) for tp in tps}
    c.close(autocommit=False)
    emit({"committed": committed})


def cmd_offsets(bs, topic, partitions):
    tps = [TopicPartition(topic, p) for p in range(int(partitions))]
    c = KafkaConsumer(bootstrap_servers=bs, group_id=None)
    emit({"earliest": {tp.partition: o for tp, o in c.beginning_offsets(tps).items()},
          "latest": {tp.partition: o for tp, o in c.end_offsets(tps).items()}})
    c.close()


def cmd_produce(bs, topic):
    try:
        p = KafkaProducer(bootstrap_servers=bs)
        p.send(topic, key=b"k", value=b"v").get(timeout=20)
    except Exception as e:  # noqa: BLE001 - what the client raises is the output
        emit({"produce_error": error_text(e)})
        return
    p.close(timeout=5)
    emit({"produced": True})


def cmd_idle(bs, topic, lasts, seconds):
    c, t, _, _ = read(bs, topic, lasts, quiet=True)
    emit({"idle": "start"})
    before = t.count
    stop = time.monotonic() + float(seconds)
    while time.monotonic() < stop:
        _poll_into(c, t)
    emit({"idle": "end", "records": t.count - before})
    c.close()


def main(argv: list[str]) -> None:
    cmd = {"read": cmd_read, "group": cmd_group, "offsets": cmd_offsets,
           "produce": cmd_produce, "idle": cmd_idle}[argv[0]]
    try:
        cmd(*argv[1:])
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the client's error is the output
        fail(error_text(e))


if __name__ == "__main__":
    main(sys.argv[1:])
