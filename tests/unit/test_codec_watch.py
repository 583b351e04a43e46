"""The store sink's source-codec watch (connectors/plugins/codec_watch.py, issue 52) on a real
store with a stand-in probe: what it reads goes to store.json and to the open partitions; a
topic whose compression.type names a codec is never probed; a partition is probed again after
``reprobe_bytes`` of records and at its first records when it showed none; a failed probe falls
back to the codec read before, then to the source topic's compression.type, then to none, in
one line per failure streak."""

from __future__ import annotations

import io

import numpy as np

from kcompact.connectors.framework.codec_probe import CodecProbeError
from kcompact.connectors.plugins.codec_watch import SinkCodecWatch
from kcompact.reput import Store
from kcompact.reput.codecs import CODEC_GZIP, CODEC_LZ4, CODEC_ZSTD
from kcompact.reput.record import Record, RecordBatch

T = "orders"


class Probe:
    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, conf, topic, offsets, *, timeout):
        self.calls.append((topic, dict(offsets)))
        if isinstance(self.answer, Exception):
            raise self.answer
        return {p: self.answer.get(p) for p in offsets}


def _watch(probe, describe=None, **kw):
    out = io.StringIO()
    return SinkCodecWatch({"bootstrap.servers": "127.0.0.1:1"}, out=out, prefix="mirror",
                          probe=probe, describe=describe or (lambda t: {}), **kw), out


def _batch(partition: int, first: int, n: int, size: int = 100) -> RecordBatch:
    return RecordBatch.from_records(T, [Record(T, partition, first + i, 0, b"k", b"v" * size, ())
                                        for i in range(n)])


def test_what_it_reads_is_recorded_and_reaches_open_partitions(tmp_path):
    with Store.open(str(tmp_path / "s"), writer="w", create=True) as st:
        pl = st.writable_partition(T, 0)
        probe = Probe({0: CODEC_ZSTD, 1: None})
        w, out = _watch(probe, reprobe_bytes=1000)
        w.opened(st, {(T, 0): 5, (T, 1): -2})
        assert probe.calls == [(T, {0: 5, 1: 0})]
        assert st.source_codec(T, 0) == CODEC_ZSTD and st.source_codec(T, 1) is None
        assert pl.source_codec == CODEC_ZSTD
        assert out.getvalue().splitlines() == [
            f"mirror: topic {T}: the source's batches are zstd (partition 0), unknown "
            "(partition 1): sealed with that codec (compression.type=producer); partition 1 "
            "shows no batch yet: read again at its first records"]
        # partition 1's first records: probed at once, at its last offset; partition 0 only
        # once it is past reprobe_bytes
        probe.answer = {0: CODEC_LZ4, 1: CODEC_GZIP}
        w.appended(st, _batch(1, 0, 3))
        w.appended(st, _batch(0, 5, 3))
        w.drain()
        assert probe.calls[1:] == [(T, {1: 2})]
        w.appended(st, _batch(0, 8, 10))  # 10 x 100+ bytes: past 1000
        w.drain()
        assert probe.calls[2:] == [(T, {0: 17})]
        w.stop()
        assert (st.source_codec(T, 0), st.source_codec(T, 1)) == (CODEC_LZ4, CODEC_GZIP)
        assert pl.source_codec == CODEC_LZ4
    with Store.open(str(tmp_path / "s")) as st:  # in store.json, for any process
        assert (st.source_codec(T, 0), st.source_codec(T, 1)) == (CODEC_LZ4, CODEC_GZIP)
        assert st.partition(T, 0).source_codec == CODEC_LZ4


def test_a_topic_naming_a_codec_is_not_probed(tmp_path):
    with Store.open(str(tmp_path / "s"), writer="w", create=True) as st:
        st.set_topic_config(T, {"compression.type": "lz4"})
        probe = Probe({0: CODEC_ZSTD})
        w, out = _watch(probe)
        w.opened(st, {(T, 0): 0})
        w.appended(st, _batch(0, 0, 3))
        w.drain()
        assert probe.calls == [] and out.getvalue() == ""


def test_failures_fall_back_in_one_line(tmp_path):
    with Store.open(str(tmp_path / "s"), writer="w", create=True) as st:
        fail = CodecProbeError("cannot connect to 127.0.0.1:1 (Connection refused)")
        # the source topic's compression.type is producer: stored uncompressed
        w, out = _watch(Probe(fail), reprobe_bytes=100)
        w.opened(st, {(T, 0): 0})
        assert st.source_codec(T, 0) is None
        lines = out.getvalue().splitlines()
        assert lines == [f"mirror: warning: topic {T}: cannot read the source's batch codec "
                         "(cannot connect to 127.0.0.1:1 (Connection refused)); the source "
                         "topic's compression.type is producer (or unreadable): its records are "
                         "stored uncompressed (set compression.type on the store's topic, "
                         "`kcompact configs --alter`, to choose a codec)"]
        w.appended(st, _batch(0, 0, 5))  # failing again: no second line
        w.drain()
        assert out.getvalue().splitlines() == lines
        w.stop()
    with Store.open(str(tmp_path / "s2"), writer="w", create=True) as st:
        # the source topic names a codec (not synced: --no-sync-configs): that codec
        w, out = _watch(Probe(fail), describe=lambda t: {"compression.type": "gzip"})
        w.opened(st, {(T, 0): 0, (T, 1): 0})
        assert (st.source_codec(T, 0), st.source_codec(T, 1)) == (CODEC_GZIP, CODEC_GZIP)
        assert "sealing with the source topic's compression.type=gzip" in out.getvalue()
        # a codec read before is kept
        w2, out2 = _watch(Probe(fail), describe=lambda t: {"compression.type": "lz4"})
        w2.opened(st, {(T, 0): 9})
        assert st.source_codec(T, 0) == CODEC_GZIP
        assert "sealing with the codec read before: gzip (partition 0)" in out2.getvalue()
        # and a probe that works again says so
        w.probe = Probe({0: CODEC_ZSTD, 1: CODEC_ZSTD})
        w.appended(st, _batch(0, 0, 3, size=10))
        w.drain()
        w.stop()
        assert "the source's batches are zstd" not in out.getvalue()  # not due yet
        w.reprobe_bytes = 1
        w._since[(T, 0)] = 10 ** 9
        w.appended(st, _batch(0, 3, 3))
        w.drain()
        w.stop()
        assert st.source_codec(T, 0) == CODEC_ZSTD
        assert out.getvalue().splitlines()[-1].startswith(
            f"mirror: topic {T}: the source's batches are zstd (partition 0)")


def test_appended_counts_each_partition_of_a_mixed_batch(tmp_path):
    with Store.open(str(tmp_path / "s"), writer="w", create=True) as st:
        probe = Probe({0: CODEC_ZSTD, 1: CODEC_ZSTD})
        w, _ = _watch(probe, reprobe_bytes=10 ** 9)
        w.opened(st, {(T, 0): 0, (T, 1): 0})
        recs = [Record(T, p, o, 0, b"k", b"v", ()) for o, p in
                zip(range(6), (0, 1, 0, 1, 1, 0))]
        b = RecordBatch.from_records(T, recs)
        w._since[(T, 1)] = None  # unknown: probed at its last offset in the batch
        w.appended(st, b)
        w.drain()
        w.stop()
        assert probe.calls[1:] == [(T, {1: 4})]
        assert 0 < w._since[(T, 0)] < int(b.keys.offs[-1] + b.values.offs[-1])
        assert np.all(b.partitions == [0, 1, 0, 1, 1, 0])
