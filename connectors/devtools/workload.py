"""A deterministic keyed workload: updates, tombstones and keyless records over partitions.

Used by ``kcompact demo``, the benchmarks and the tests, so that the same seed always gives the
same records and a test can recompute what any offset must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kcompact.reput.record import RecordBatch, BytesColumn


@dataclass(frozen=True)
class Workload:
    records: int = 20_000            # total, over all partitions
    keys: int = 2_000                # distinct keys
    partitions: int = 4
    tombstone_ratio: float = 0.1
    keyless_ratio: float = 0.02
    value_size: int = 100
    seed: int = 7
    start_ms: int = 1_700_000_000_000

    def key(self, k: int) -> bytes:
        return b"user-%08d" % k

    def partition_of(self, k: int) -> int:
        return k % self.partitions

    def batches(self, topic: str, batch_size: int = 50_000):
        """Yield RecordBatches, per partition, offsets 0.. in order (vectorised)."""
        rng = np.random.default_rng(self.seed)
        n = self.records
        key_ids = rng.zipf(1.3, n) % self.keys  # a few hot keys, a long tail, as in real topics
        kind = rng.random(n)
        tomb = kind < self.tombstone_ratio
        keyless = (kind >= self.tombstone_ratio) & (kind < self.tombstone_ratio + self.keyless_ratio)
        parts = np.where(keyless, rng.integers(0, self.partitions, n), key_ids % self.partitions)
        body = rng.integers(97, 123, (n, max(self.value_size - 24, 1)), dtype=np.uint8)
        for p in range(self.partitions):
            idx = np.nonzero(parts == p)[0]
            for lo in range(0, idx.shape[0], batch_size):
                sel = idx[lo:lo + batch_size]
                offsets = np.arange(lo, lo + sel.shape[0], dtype=np.int64)
                keys = [None if keyless[i] else self.key(int(key_ids[i])) for i in sel]
                values = [None if tomb[i] else b'{"seq":%9d,"v":"' % i + body[i].tobytes() + b'"}'
                          for i in sel]
                yield RecordBatch.from_columns(
                    topic, p, offsets, self.start_ms + sel.astype(np.int64) * 10,
                    keys=BytesColumn.from_list(keys), values=BytesColumn.from_list(values))

    def produce_args(self, topic: str):
        """(partition, key, value, timestamp) tuples in produce order, for a Kafka producer."""
        for b in self.batches(topic):
            for r in b.records():
                yield r.partition, r.key, r.value, r.timestamp
