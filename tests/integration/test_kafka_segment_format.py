"""Store format 2 (docs/formats/segment-v2.md): Kafka's own ``kafka.tools.DumpLogSegments``
(the real-Kafka tier's jars) reads a sealed kcompact segment, with every codec.

A store gets records with gaps, keyless records, tombstones, empty values and headers; a forced
compaction writes them as one format-2 segment of the topic's codec; DumpLogSegments
``--deep-iteration --print-data-log`` must report every batch valid (its CRC-32C checked by
Kafka), with Kafka's name of the codec, and list exactly the records kcompact reads back
(offset, timestamp, key and value sizes, header keys).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from brokers import apache_kafka_unavailable
from kcompact.compaction import Compactor
from kcompact.connectors.devtools import apache_kafka
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store

pytestmark = pytest.mark.skipif(apache_kafka_unavailable() is not None,
                                reason=str(apache_kafka_unavailable()))

TOPIC = "orders"
#: Kafka's names of the codecs in DumpLogSegments' batch lines
KAFKA_CODEC = {"uncompressed": "none", "gzip": "gzip", "snappy": "snappy", "lz4": "lz4",
               "zstd": "zstd"}


def _records() -> list[Record]:
    out, off = [], 7
    for i in range(3000):
        key = None if i % 97 == 5 else b"order-%d" % (i % 700)
        value = (None if i % 53 == 1 and key is not None else b"" if i % 211 == 3 else
                 b'{"order_id": %d, "status": "shipped", "amount": %d.5}' % (i, i * 7))
        headers = (("trace", b"%d" % i), ("empty", None)) if i % 10 == 0 else ()
        out.append(Record(TOPIC, 0, off, 1_700_000_000_000 + i * 3 - (i % 5), key, value,
                          headers))
        off += 1 if i % 17 else 4  # gaps, as a cleaned Kafka log has
    return out


def _dump(path: Path) -> str:
    cmd = apache_kafka.tool_command("kafka.tools.DumpLogSegments",
                                    ["--files", str(path), "--deep-iteration",
                                     "--print-data-log"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("codec", sorted(KAFKA_CODEC))
def test_dump_log_segments_reads_a_sealed_segment(tmp_path, codec):
    url = str(tmp_path / "store")
    recs = _records()
    with Store.open(url, writer="w", create=True) as s:
        s.set_topic_config(TOPIC, {"compression.type": codec, "compression.batch.bytes": 65536,
                                   "delete.retention.ms": 1 << 40})
        s.append(RecordBatch.from_records(TOPIC, recs))
        s.flush()
        # a map too large to drop anything but superseded keys; --force seals everything
        res = Compactor(s).compact_partition(TOPIC, 0, force=True)
        assert res.skipped is None
    with Store.open(url) as s:
        pl = s.partition(TOPIC, 0)
        sealed = [seg for seg in pl.segments if seg.log_size]
        assert len(sealed) == 1 and sealed[0].format == 2
        kept = list(pl.iter_records())
        log = Path(url) / sealed[0].log_path
    assert 600 < len(kept) < len(recs)
    out = _dump(log)
    batches = [ln for ln in out.splitlines() if ln.startswith("baseOffset:")]
    rows = [ln for ln in out.splitlines() if ln.startswith("| offset:")]
    assert len(batches) > 1  # 64 KiB batches
    for b in batches:
        assert "isvalid: true" in b and "magic: 2" in b, b
        assert "isTransactional: false" in b and "isControl: false" in b
    # a batch whose records do not compress is stored uncompressed (segment-v2.md)
    assert {re.search(r"compresscodec: (\w+)", b).group(1) for b in batches} <= \
        {KAFKA_CODEC[codec], "none"}
    if codec != "uncompressed":
        assert any(f"compresscodec: {KAFKA_CODEC[codec]}" in b for b in batches)
    assert len(rows) == len(kept)
    for row, r in zip(rows, kept):
        f = dict(re.findall(r"(\w+): (\S*)", row.split(" key:")[0]))
        assert int(f["offset"]) == r.offset and int(f["CreateTime"]) == r.timestamp
        assert int(f["keySize"]) == (-1 if r.key is None else len(r.key))
        assert int(f["valueSize"]) == (-1 if r.value is None else len(r.value))
        keys = re.search(r"headerKeys: \[([^\]]*)\]", row).group(1)
        assert (keys.replace(" ", "").split(",") if keys else []) == [h for h, _ in r.headers]
        if r.key is not None:
            assert f" key: {r.key.decode()}" in row
        if r.value:
            assert row.endswith(f" payload: {r.value.decode()}")
