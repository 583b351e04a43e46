"""Group positions translated through a restore's offset map records, against a plain model
(connectors/plugins/store_source/translation.py, docs/formats/restore-progress.md).

The model: a restore produced, per partition, a sorted list of source offsets, chunk after chunk,
each chunk's records landing one after another in the target from some offset (with gaps
between chunks for transaction markers); a source committed offset O becomes the target offset
of the first record with source offset >= O, or the offset after the last restored record.
The map records are encoded, decoded (the store's and the cluster's copies), filtered to the
job's current run, and translated: every O must come out as the model says.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.plugins.store_source.errors import ProgressFormatError
from kcompact.connectors.plugins.store_source.progress import (Progress, RestoreJob,
                                                               decode_progress, encode_progress)
from kcompact.connectors.plugins.store_source.translation import (
    AckRanges, MapPiece, PIECE_RECORDS, chunk_pieces, current_pieces, decode_piece,
    encode_piece, translate)

JOB = "orders->lkc-1/orders-restored"


class _Block:
    def __init__(self, p, offs):
        self.source_partition, self.source_offsets = p, np.asarray(offs, np.int64)


class _Chunk:
    def __init__(self, blocks):
        self.blocks = blocks


@settings(max_examples=60, deadline=None)
@given(data=st.data(), parts=st.integers(1, 3), chunks=st.integers(1, 5))
def test_translation_matches_model(data, parts, chunks):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pieces, model = [], {p: [] for p in range(parts)}   # model: [(source, target)]
    nxt_src = {p: int(rng.integers(0, 50)) for p in range(parts)}
    nxt_tgt = {p: int(rng.integers(0, 5)) for p in range(parts)}
    for seq in range(1, chunks + 1):
        blocks, acked = [], {}
        for p in range(parts):
            n = int(rng.integers(0, 40))
            if n == 0:
                continue
            gaps = rng.choice([1, 1, 1, 2, 9, 1 << 33], n)  # compaction gaps, even huge ones
            offs = nxt_src[p] + np.cumsum(gaps) - gaps[0]
            nxt_src[p] = int(offs[-1]) + int(rng.integers(1, 20))
            # the chunk's records in two blocks, as a chunk may read them
            cut = int(rng.integers(0, n + 1))
            blocks += [_Block(p, offs[:cut]), _Block(p, offs[cut:])]
            t0 = nxt_tgt[p]
            acked[("target", p)] = (t0, t0 + n - 1, n)
            model[p] += [(int(o), t0 + i) for i, o in enumerate(offs)]
            nxt_tgt[p] = t0 + n + 1  # the transaction's commit marker
        got, interleaved = chunk_pieces(JOB, seq, "target", _Chunk(blocks), acked)
        assert interleaved == []
        pieces += got
    # through the wire format
    decoded = [decode_piece(encode_piece(m), "test") for m in pieces]
    for a, b in zip(pieces, decoded):
        assert np.array_equal(a.offsets, b.offsets) and a.key == b.key
    positions, want = {}, {}
    for p in range(parts):
        hi = nxt_src[p] + 3
        for o in sorted(set(rng.integers(0, hi, 12).tolist()) | {0, hi}):
            positions[(f"g{o}", p)] = o
            hit = [t for s, t in model[p] if s >= o]
            want[(f"g{o}", p)] = hit[0] if hit else (model[p][-1][1] + 1 if model[p] else 77)
    tr = translate(positions, current_pieces(decoded, 0, chunks), {p: 77 for p in range(parts)})
    assert tr.offsets == want and tr.approximate == []


def test_pieces_of_a_long_partition_and_the_current_run():
    offs = np.arange(0, 3 * PIECE_RECORDS + 5, 2, dtype=np.int64)
    got, _ = chunk_pieces(JOB, 4, "t", _Chunk([_Block(0, offs)]),
                          {("t", 0): (100, 100 + offs.shape[0] - 1, offs.shape[0])})
    assert [m.piece for m in got] == [0, 1] and got[1].target_first == 100 + PIECE_RECORDS
    old = MapPiece(JOB, 2, 0, 0, np.array([1, 2], np.int64), 5, True)    # an earlier run
    ahead = MapPiece(JOB, 9, 0, 0, np.array([1, 2], np.int64), 5, True)  # never committed
    cur = current_pieces(got + [old, ahead], 3, 4)
    assert [m.seq for m in cur] == [4, 4]
    tr = translate({("g", 0): 2 * PIECE_RECORDS + 1}, cur, {})
    assert tr.offsets[("g", 0)] == 100 + PIECE_RECORDS + 1


def test_interleaved_chunk_maps_inside_positions_to_its_first_record():
    offs = np.array([10, 11, 12], np.int64)
    got, interleaved = chunk_pieces(JOB, 1, "t", _Chunk([_Block(0, offs)]),
                                    {("t", 0): (50, 60, 3)})  # 3 records over 11 offsets
    assert interleaved == [0] and not got[0].contiguous
    tr = translate({("a", 0): 10, ("b", 0): 12, ("c", 0): 13}, got, {0: 61})
    assert tr.offsets == {("a", 0): 50, ("b", 0): 50, ("c", 0): 61}
    assert tr.approximate == [("b", 0)]


def test_acks_that_do_not_match_the_chunk_are_an_error():
    with pytest.raises(Exception, match="2 deliveries acknowledged for 3 records"):
        chunk_pieces(JOB, 1, "t", _Chunk([_Block(0, [1, 2, 3])]), {("t", 0): (0, 1, 2)})


def test_damaged_map_record_is_named():
    m = MapPiece(JOB, 1, 0, 0, np.array([3, 4, 9], np.int64), 0, True)
    raw = encode_piece(m).replace(b'"count":3', b'"count":4')
    with pytest.raises(ProgressFormatError, match="where: unreadable offset map record"):
        decode_piece(raw, "where")
    assert decode_piece(None, "where") is None


def test_ack_ranges_count_successes_and_pass_failures_on():
    class Msg:
        def __init__(self, p, o):
            self.p, self.o = p, o

        def topic(self):
            return "t"

        def partition(self):
            return self.p

        def offset(self):
            return self.o

    class Reports:
        failed = []

        def on_delivery(self, err, msg):
            self.failed.append(err)

    a = AckRanges(Reports())
    for o in (7, 5, 6):
        a.on_delivery(None, Msg(0, o))
    a.on_delivery("boom", Msg(1, -1))
    assert a.delivered() == {("t", 0): (5, 7, 3)} and a.delivered() == {}
    assert Reports.failed == ["boom"]


def test_progress_version_2_fields_and_version_1_records():
    job = RestoreJob("sid", "orders", "c1", "orders2")
    p = Progress.start(job, "latest", 7, as_of_ms=123).advance({0: 5}, 3, False, True)
    q = decode_progress(encode_progress(p), where="x")
    assert (q.run_seq, q.as_of_ms, q.seq, q.version) == (7, 123, 8, 2)
    old = (b'{"cluster_id":"c1","done":false,"job":"orders->c1/orders2","mode":"latest",'
           b'"positions":{"0":5},"produced":3,"seq":2,"store_id":"sid","store_topic":"orders",'
           b'"target_topic":"orders2","transactional":true,"updated_ms":1,"version":1}')
    q = decode_progress(old, where="x")
    assert (q.run_seq, q.as_of_ms) == (0, None)
