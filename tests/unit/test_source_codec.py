"""compression.type=producer, the source's codec (issue 52): the default of a new store (store.json
lists the "source-codec" feature) and not of an older one (its default stays zstd); records a
consumer gave are sealed uncompressed; a compaction keeps stored batches' codec; a change of
compression.type re-encodes every sealed segment at the next compaction, records and their
order unchanged, once (each lean index records what it was written for: bcq-v2.md ``target``),
and ``producer`` never asks for a re-encode."""

from __future__ import annotations

import os
import random

import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import ManualClock, Store
from kcompact.reput.codecs import (CODEC_NONE, CODEC_ZSTD, TARGET_PRODUCER, TARGET_UNKNOWN,
                                   needs_recode, target_of)
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import FEATURE_SOURCE_CODEC, StoreMeta

TOPIC = "t"


def _records(n: int, *, random_values: bool = False, keys: int | None = None) -> list[Record]:
    rng = random.Random(52)
    out = []
    for i in range(n):
        value = rng.randbytes(120) if random_values else b"order %d is paid; " % i * 4
        key = b"k%d" % (i if keys is None else i % keys)
        out.append(Record(TOPIC, 0, i, 1_700_000_000_000 + i, key, value, ()))
    return out


def _store(d: str, recs, clock, **cfg) -> Store:
    st = Store.open(d, writer="w", create=True, clock=clock)
    st.set_topic_config(TOPIC, {"segment.bytes": 1 << 14, "min.compaction.lag.ms": 0, **cfg})
    for i in range(0, len(recs), 100):
        st.append(RecordBatch.from_records(TOPIC, recs[i:i + 100]))
    st.flush()
    return st


def _sealed(st: Store) -> list[tuple[int, int]]:
    """(codec, target) of each sealed format-2 segment's lean index."""
    pl = st.partition(TOPIC, 0)
    pl.refresh()
    return [(s.index().codec, s.index().target) for s in pl.sealed_segments
            if s.format == 2]


def _compact(st: Store, clock) -> int:
    res = Compactor(st, CompactionOptions(), clock).compact_partition(TOPIC, 0, force=True)
    assert res.skipped is None
    return res.segments_rewritten


def _legacy(d: str) -> None:
    """Make ``d`` a store created before the feature (store.json without it)."""
    path = os.path.join(d, "store.json")
    with open(path, "rb") as f:
        meta = StoreMeta.from_json(f.read(), d)
    meta.features = [f for f in meta.features if f != FEATURE_SOURCE_CODEC]
    with open(path, "wb") as f:
        f.write(meta.to_json())


def test_a_new_store_keeps_the_source_codec_and_an_older_one_zstd(tmp_path):
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    Store.create(new).close()
    Store.create(old).close()
    _legacy(old)
    clock = ManualClock(1_700_000_000_000)
    with Store.open(new) as st:
        assert FEATURE_SOURCE_CODEC in st.meta.features
        assert st.topic_config("any").compression_type == "producer"
    with Store.open(old) as st:
        assert st.topic_config("any").compression_type == "zstd"
        assert {e.name: e.default for e in st.topic_config_layers("any").describe(
            st.meta.defaults)}["compression.type"] == "zstd"
    recs = _records(600)
    for d, want in ((new, (CODEC_NONE, TARGET_PRODUCER)), (old, (CODEC_ZSTD, 1 + CODEC_ZSTD))):
        st = _store(d, recs, clock)
        try:
            got = _sealed(st)
            assert len(got) >= 2 and set(got) == {want}, (d, got)
            assert list(st.iter_records(TOPIC, 0)) == recs
        finally:
            st.close()


def test_a_change_of_codec_reencodes_every_segment_once(tmp_path):
    """Every key distinct: a compaction drops nothing, so only the change of compression.type
    makes it rewrite; the records read back unchanged after each step."""
    clock = ManualClock(1_700_000_000_000)
    recs = _records(800)
    st = _store(str(tmp_path / "s"), recs, clock)
    try:
        assert {c for c, _ in _sealed(st)} == {CODEC_NONE}
        st.set_topic_config(TOPIC, {"compression.type": "zstd"})
        assert _compact(st, clock) > 0
        assert set(_sealed(st)) == {(CODEC_ZSTD, 1 + CODEC_ZSTD)}
        assert _compact(st, clock) == 0  # nothing changed since: nothing rewritten
        st.set_topic_config(TOPIC, {"compression.type": "producer"})
        assert _compact(st, clock) == 0  # producer keeps what is stored
        assert {c for c, _ in _sealed(st)} == {CODEC_ZSTD}
        st.set_topic_config(TOPIC, {"compression.type": "uncompressed"})
        assert _compact(st, clock) > 0
        assert set(_sealed(st)) == {(CODEC_NONE, 1 + CODEC_NONE)}
        assert list(st.iter_records(TOPIC, 0)) == recs
    finally:
        st.close()


def test_incompressible_segments_are_not_rewritten_at_every_compaction(tmp_path):
    """Random values under zstd are stored uncompressed (compressing did not pay); their
    segments record that they were written for zstd, so no later compaction re-encodes them."""
    clock = ManualClock(1_700_000_000_000)
    recs = _records(600, random_values=True)
    st = _store(str(tmp_path / "s"), recs, clock, **{"compression.type": "zstd"})
    try:
        got = _sealed(st)
        assert {t for _, t in got} == {1 + CODEC_ZSTD} and (CODEC_NONE, 1 + CODEC_ZSTD) in got
        _compact(st, clock)  # (the forced roll: the active segment is written in format 2)
        assert _compact(st, clock) == 0
        assert list(st.iter_records(TOPIC, 0)) == recs
    finally:
        st.close()


def test_producer_keeps_the_codec_of_the_batches_a_compaction_rewrites(tmp_path):
    """zstd segments, then producer: a compaction that drops records re-encodes the batches
    it cuts with the segment's own codec (zstd), not the none a consumer's records get."""
    clock = ManualClock(1_700_000_000_000)
    recs = _records(900, keys=300)
    st = _store(str(tmp_path / "s"), recs, clock, **{"compression.type": "zstd"})
    try:
        st.set_topic_config(TOPIC, {"compression.type": "producer"})
        assert _compact(st, clock) > 0
        got = _sealed(st)
        assert got and {c for c, _ in got} == {CODEC_ZSTD}, got
        live = {r.key: r for r in recs}
        assert list(st.iter_records(TOPIC, 0)) == sorted(live.values(), key=lambda r: r.offset)
    finally:
        st.close()


@pytest.mark.parametrize("ct,codec,target,want", [
    ("producer", 4, 0, False), ("producer", 0, 5, False),
    ("zstd", 4, 5, False), ("zstd", 0, 5, False), ("zstd", 0, 6, True), ("zstd", 0, 1, True),
    ("zstd", 4, 0, False), ("zstd", 0, 0, True), ("uncompressed", 0, 0, False),
    ("gzip", 4, 5, True), ("uncompressed", 0, 6, True)])
def test_needs_recode(ct, codec, target, want):
    assert needs_recode(ct, codec, target) is want
    assert target_of("producer") == TARGET_PRODUCER and TARGET_UNKNOWN == 0


def test_the_source_codec_a_mirror_read_seals_and_compacts_format_1_records(tmp_path):
    """store.json's source_codecs (what the mirror's probe read): a seal of format-1 records
    under producer writes that codec (the writer's background seal and a compaction of what
    stayed format 1), another partition without one stays uncompressed; a codec named on the
    topic still wins; the records read back unchanged."""
    from kcompact.reput.codecs import CODEC_LZ4
    from kcompact.reput.store import WriterOptions
    clock = ManualClock(1_700_000_000_000)
    d = str(tmp_path / "s")
    recs = _records(600)
    with Store.open(d, writer="w", create=True, clock=clock) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 1 << 14, "min.compaction.lag.ms": 0})
        assert st.record_source_codecs(TOPIC, {0: CODEC_ZSTD}) is True
        assert st.record_source_codecs(TOPIC, {0: CODEC_ZSTD}) is False  # unchanged
    with Store.open(d, writer="w", clock=clock, options=WriterOptions(seal="background")) as st:
        assert st.source_codec(TOPIC, 0) == CODEC_ZSTD and st.source_codec(TOPIC, 1) is None
        for i in range(0, len(recs), 100):
            st.append(RecordBatch.from_records(TOPIC, recs[i:i + 100]))
            st.append(RecordBatch.from_records(TOPIC, [
                Record(TOPIC, 1, r.offset, r.timestamp, r.key, r.value, ())
                for r in recs[i:i + 100]]))
        st.flush()
        st.drain_seals()
        assert set(_sealed(st)) == {(CODEC_ZSTD, TARGET_PRODUCER)}
        pl1 = st.partition(TOPIC, 1)
        assert {s.index().codec for s in pl1.sealed_segments if s.format == 2} == {CODEC_NONE}
    with Store.open(d, writer="w", clock=clock) as st:  # what stayed format 1: a compaction
        assert _compact(st, clock) >= 1
        pl = st.partition(TOPIC, 0)
        assert all(s.format == 2 for s in pl.segments if s.log_size)
        assert {c for c, _ in _sealed(st)} == {CODEC_ZSTD}
        assert list(st.iter_records(TOPIC, 0)) == recs
        st.set_topic_config(TOPIC, {"compression.type": "lz4"})  # named: recompresses
        _compact(st, clock)
        assert set(_sealed(st)) == {(CODEC_LZ4, 1 + CODEC_LZ4)}
        assert list(st.iter_records(TOPIC, 0)) == recs


@pytest.mark.parametrize("bad", [{"t": {"0": "brotli"}}, {"t": {"x": "zstd"}}, {"t": ["zstd"]}])
def test_a_damaged_source_codecs_entry_is_refused(tmp_path, bad):
    import json
    from kcompact.reput.errors import StoreFormatError
    d = str(tmp_path / "s")
    Store.create(d).close()
    path = os.path.join(d, "store.json")
    with open(path) as f:
        doc = json.load(f)
    doc.pop("crc32c")
    doc["source_codecs"] = bad
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(StoreFormatError, match="source_codecs"):
        Store.open(d)
