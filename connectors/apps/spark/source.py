"""The ``kcompact`` Python data source: a store topic as a DataFrame.

``spark.read.format("kcompact").option("store", URL).option("topic", T).load()`` ->
``topic, partition, offset, timestamp, key, value, headers``, one input partition per
topic-partition, batches through Arrow. ``mode=latest`` (default): one row per live key
(compacted segments plus the not-yet-compacted tail; tombstoned keys and keyless records absent);
``mode=all``: every stored record. Every record's CRC is checked as it is read.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .errors import SparkEngineError

SCHEMA = ("topic string, partition int, offset long, timestamp timestamp, key binary, "
          "value binary, headers array<struct<key:string,value:binary>>")
ARROW_BATCH_BYTES = 8 << 20


def _arrow_batches(store, topic: str, partition: int, mode: str) -> Iterator:
    """Arrow RecordBatches of a partition (mode 'all' or 'latest')."""
    import pyarrow as pa
    from kcompact.compaction.latest import latest_selection
    from kcompact.reput.record import decode_headers

    pl = store.partition(topic, partition)
    if mode == "all":
        selection = [(seg, None) for seg in pl.segments]
    else:
        selection = latest_selection(pl)
    topic_arr_cache: dict[int, object] = {}
    for seg, which in selection:
        idx = pl.index(seg)
        e = idx.entries if which is None else idx.entries[which]
        if e.shape[0] == 0:
            continue
        path = pl.log_path(seg.base)
        # contiguous runs of selected entries are read in bounded slices
        pos = e["position"].astype(np.int64)
        ends = pos + e["size"].astype(np.int64)
        i = 0
        n = e.shape[0]
        while i < n:
            j = int(np.searchsorted(ends, pos[i] + ARROW_BATCH_BYTES, side="right"))
            j = max(j, i + 1)
            start, stop = int(pos[i]), int(ends[j - 1])
            data = np.frombuffer(store.fs.read(path, start, stop - start), np.uint8)
            rel = pos[i:j] - start
            spans = _spans(data, rel)
            _check_crcs(data, rel, e["size"][i:j].astype(np.int64), path, start)
            m = j - i
            kl, vl, hl = spans["klen"], spans["vlen"], spans["hlen"]
            keys = _binary(pa, data, spans["kstart"], kl, (spans["attrs"] & 2) != 0)
            values = _binary(pa, data, spans["vstart"], vl, (spans["attrs"] & 1) != 0)
            headers = []
            for r in range(m):
                if hl[r]:
                    s = int(spans["hstart"][r])
                    headers.append([{"key": k, "value": v} for k, v in
                                    decode_headers(data[s:s + int(hl[r])].tobytes())])
                else:
                    headers.append([])
            if m not in topic_arr_cache:
                topic_arr_cache[m] = pa.array([topic] * m, pa.string())
            batch = pa.RecordBatch.from_arrays([
                topic_arr_cache[m],
                pa.array(np.full(m, partition, np.int32)),
                pa.array(e["offset"][i:j].astype(np.int64)),
                pa.array(e["timestamp"][i:j].astype(np.int64) * 1000,
                         pa.timestamp("us", tz="UTC")),
                keys, values,
                pa.array(headers, _HEADERS_TYPE(pa)),
            ], names=["topic", "partition", "offset", "timestamp", "key", "value", "headers"])
            yield batch
            i = j


def _HEADERS_TYPE(pa):
    # Spark's Arrow schema names the list item field "element"
    return pa.list_(pa.field("element", pa.struct([("key", pa.string()),
                                                   ("value", pa.binary())])))


def _check_crcs(data, rel, sizes, path, file_start) -> None:
    from kcompact.reput import _kernels as K
    from kcompact.reput.errors import CorruptRecordError
    bad = _crc_mismatch(data, rel, sizes, K.CRC_TABLES)
    if bad >= 0:
        raise CorruptRecordError(f"{path}: corrupt record at byte {file_start + int(rel[bad])}",
                                 path, file_start + int(rel[bad]))


def _spans(data, rel):
    from kcompact.reput._kernels import field_spans
    n = rel.shape[0]
    out = {k: np.empty(n, np.int64) for k in ("kstart", "klen", "vstart", "vlen", "hstart",
                                               "hlen")}
    out["attrs"] = np.empty(n, np.uint8)
    field_spans(data, rel, out["kstart"], out["klen"], out["vstart"], out["vlen"],
                out["hstart"], out["hlen"], out["attrs"])
    return out


def _crc_mismatch(data, rel, sizes, tables):
    from kcompact.reput._kernels import first_crc_mismatch
    return int(first_crc_mismatch(data, rel, sizes, tables))


def _binary(pa, data, starts, lens, nulls):
    """A pyarrow BinaryArray gathered from (start, len) spans of data (nulls where flagged)."""
    from kcompact.reput._kernels import gather_ranges
    lens = np.where(nulls, 0, lens)
    offs = np.zeros(lens.shape[0] + 1, np.int32)
    np.cumsum(lens, out=offs[1:])
    buf = np.empty(int(offs[-1]), np.uint8)
    gather_ranges(data, starts, lens, buf)
    validity = pa.py_buffer(np.packbits(~nulls, bitorder="little").tobytes())
    return pa.BinaryArray.from_buffers(pa.binary(), lens.shape[0],
                                       [validity, pa.py_buffer(offs.tobytes()),
                                        pa.py_buffer(buf.tobytes())],
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
