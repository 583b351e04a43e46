"""aiokafka (PyPI ``aiokafka``, as installed: no extras) for the client matrix; the command
line and the lines printed are clientlib.py's."""

from __future__ import annotations

import asyncio
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from clientlib import (SETTLE_S, Tracker, deadline, emit, error_text, fail, parse_lasts)

COMMON = dict(enable_auto_commit=False, isolation_level="read_committed",
              auto_offset_reset="earliest")


async def _poll_into(c, t: Tracker, limit: int | None = None) -> list:
    added = []
    for tp, recs in (await c.getmany(timeout_ms=300)).items():
        for r in recs:
            if limit is not None and t.count >= limit:
                return added
            t.add(tp.partition, r.offset, r.timestamp, r.key, r.value, list(r.headers))
            added.append((tp.partition, r.offset))
    return added


async def _to_end(c, t: Tracker, tps: list) -> dict:
    end = deadline()
    while not t.done():
        if time.monotonic() > end:
            fail(f"not every record came in 30 s: {t.missing()}")
        await _poll_into(c, t)
    hwm = await c.end_offsets(tps)
    settle = deadline(SETTLE_S)

    async def behind():
        return any([await c.position(tp) < hwm[tp] for tp in tps])
    while time.monotonic() < settle and await behind():
        await _poll_into(c, t)
    return {tp.partition: await c.position(tp) for tp in tps}


async def read(bs, topic, lasts, quiet=False):
    t = Tracker(topic, parse_lasts(lasts), quiet)
    tps = [TopicPartition(topic, p) for p in range(len(t.lasts))]
    c = AIOKafkaConsumer(bootstrap_servers=bs, group_id=None, **COMMON)
    await c.start()
    c.assign(tps)
    for tp in tps:
        c.seek(tp, 0)
    return c, t, tps, await _to_end(c, t, tps)


async def cmd_read(bs, topic, lasts):
    c, _, _, positions = await read(bs, topic, lasts)
    emit({"positions": positions})
    await c.stop()


async def cmd_group(bs, topic, lasts, group, n):
    t = Tracker(topic, parse_lasts(lasts))
    tps = [TopicPartition(topic, p) for p in range(len(t.lasts))]
    kw = dict(bootstrap_servers=bs, group_id=group, session_timeout_ms=10000,
              heartbeat_interval_ms=1000, **COMMON)
    c = AIOKafkaConsumer(topic, **kw)
    await c.start()
    end = deadline()
    nexts = {}
    while t.count < int(n):
        if time.monotonic() > end:
            fail(f"the first member got {t.count} of {n} records in 30 s")
        for p, o in await _poll_into(c, t, int(n)):
            nexts[p] = o + 1
    await c.commit({TopicPartition(topic, p): o for p, o in nexts.items()})
    await c.stop()
    c = AIOKafkaConsumer(topic, **kw)
    await c.start()
    await _to_end(c, t, tps)
    await c.commit()
    committed = {tp.partition: await c.committed(tp) for tp in tps}
    await c.stop()
    emit({"committed": committed})


async def cmd_offsets(bs, topic, partitions):
    tps = [TopicPartition(topic, p) for p in range(int(partitions))]
    c = AIOKafkaConsumer(bootstrap_servers=bs, group_id=None)
    await c.start()
    emit({"earliest": {tp.partition: o for tp, o in (await c.beginning_offsets(tps)).items()},
          "latest": {tp.partition: o for tp, o in (await c.end_offsets(tps)).items()}})
    await c.stop()


async def cmd_produce(bs, topic):
    p = AIOKafkaProducer(bootstrap_servers=bs, request_timeout_ms=20000)
    try:
        await p.start()
        await p.send_and_wait(topic, key=b"k", value=b"v")
    except Exception as e:  # noqa: BLE001 - what the client raises is the output
        emit({"produce_error": error_text(e)})
        return
    finally:
        await p.stop()
    emit({"produced": True})


async def cmd_idle(bs, topic, lasts, seconds):
    c, t, _, _ = await read(bs, topic, lasts, quiet=True)
    emit({"idle": "start"})
    before = t.count
    stop = time.monotonic() + float(seconds)
    while time.monotonic() < stop:
        await _poll_into(c, t)
    emit({"idle": "end", "records": t.count - before})
    await c.stop()


def main(argv: list[str]) -> None:
    cmd = {"read": cmd_read, "group": cmd_group, "offsets": cmd_offsets,
           "produce": cmd_produce, "idle": cmd_idle}[argv[0]]
    try:
        asyncio.run(cmd(*argv[1:]))
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the client's error is the output
        fail(error_text(e))


if __name__ == "__main__":
    main(sys.argv[1:])
