"""The ``kcompact`` Python data source: a store topic as a DataFrame.

``spark.read.format("kcompact").option("store", URL).option("topic", T).load()`` ->
``topic, partition, offset, timestamp, key, value, headers``, one input partition per
topic-partition, batches through Arrow. ``mode=latest`` (default): one row per live key
(compacted segments plus the not-yet-compacted tail; tombstoned keys and keyless records absent);
``mode=all``: every stored record. Every record is read through the partition reader, which
checks it against its index entry and its CRC.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .errors import SparkEngineError

SCHEMA = ("topic string, partition int, offset long, timestamp timestamp, key binary, "
          "value binary, headers array<struct<key:string,value:binary>>")
ARROW_BATCH_BYTES = 8 << 20


def _arrow_batches(store, topic: str, partition: int, mode: str) -> Iterator:
    """Arrow RecordBatches of a partition (mode 'all' or 'latest'): the partition reader's
    verified blocks of each segment's selected entries (reput/reader.py), as Arrow columns."""
    import pyarrow as pa
    from kcompact.compaction.latest import latest_selection
    from kcompact.reput.reader import PartitionReader

    pl = store.partition(topic, partition)
    if mode == "all":
        selection = [(seg, None) for seg in pl.segments]
    else:
        selection = latest_selection(pl)
    reader = PartitionReader(pl)
    topic_arr_cache: dict[int, object] = {}
    for seg, which in selection:
        idx = seg.index()
        e = idx.entries if which is None else idx.entries[which]
        if e.shape[0] == 0:
            continue
        with reader.segment(seg, block_bytes=ARROW_BATCH_BYTES) as src:
            for block in src.select(e):
                m = len(block)
                headers = [[{"key": k, "value": v} for k, v in h]
                           for h in block.header_lists()]
                if m not in topic_arr_cache:
                    topic_arr_cache[m] = pa.array([topic] * m, pa.string())
                yield pa.RecordBatch.from_arrays([
                    topic_arr_cache[m],
                    pa.array(np.full(m, partition, np.int32)),
                    pa.array(block.offsets.astype(np.int64)),
                    pa.array(block.timestamps.astype(np.int64) * 1000,
                             pa.timestamp("us", tz="UTC")),
                    _binary(pa, block.keys), _binary(pa, block.values),
                    pa.array(headers, _HEADERS_TYPE(pa)),
                ], names=["topic", "partition", "offset", "timestamp", "key", "value",
                          "headers"])


def _HEADERS_TYPE(pa):
    # Spark's Arrow schema names the list item field "element"
    return pa.list_(pa.field("element", pa.struct([("key", pa.string()),
                                                   ("value", pa.binary())])))


def _binary(pa, col):
    """A pyarrow BinaryArray of a BytesColumn (one buffer, n+1 offsets, nulls)."""
    nulls = col.null
    offs = (col.offs - col.offs[0]).astype(np.int32)
    validity = pa.py_buffer(np.packbits(~nulls, bitorder="little").tobytes())
    return pa.BinaryArray.from_buffers(pa.binary(), nulls.shape[0],
                                       [validity, pa.py_buffer(offs.tobytes()),
                                        pa.py_buffer(col.buf[int(col.offs[0]):int(col.offs[-1])]
                                                     .tobytes())],
                                       null_count=int(nulls.sum()))


def _make_data_source():
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class KcompactReader(DataSourceReader):
        def __init__(self, options):
            self.store_url = options.get("store")
            self.topic = options.get("topic")
            self.mode = options.get("mode", "latest")
            if not self.store_url or not self.topic:
                raise SparkEngineError("the kcompact data source needs .option('store', URL) "
                                       "and .option('topic', T)")
            if self.mode not in ("latest", "all"):
                raise SparkEngineError(f"mode must be 'latest' or 'all', not {self.mode!r}")

        def partitions(self):
            from kcompact.reput import Store
            st = Store.open(self.store_url)
            if self.topic not in st.topics():
                raise SparkEngineError(f"topic {self.topic!r} is not in store {self.store_url}")
            return [InputPartition(p) for p in st.partitions(self.topic)]

        def read(self, partition):
            from kcompact.reput import Store
            st = Store.open(self.store_url)
            yield from _arrow_batches(st, self.topic, partition.value, self.mode)

    class KcompactDataSource(DataSource):
        @classmethod
        def name(cls):
            return "kcompact"

        def schema(self):
            return SCHEMA

        def reader(self, schema):
            return KcompactReader(self.options)

    return KcompactDataSource


_DS = None


_REGISTERED: set[int] = set()  # SparkContexts (by id) the data source is registered with


def register_data_source(spark) -> None:
    """Register the ``kcompact`` data source with this session's context (once: registering
    again makes Spark warn that it replaced the source)."""
    global _DS
    if _DS is None:
        _DS = _make_data_source()
    key = id(spark.sparkContext)
    if key in _REGISTERED:
        return
    spark.dataSource.register(_DS)
    _REGISTERED.add(key)
