"""Replication protocol and live-state functions, without a server (docs/formats/replication-protocol.md).

* request parsing: traversal, Kafka's topic rule, partitions, query limits (400/404/413), auth;
* records responses: what a replica accepts (CRC, topic, partition, order, headers);
* digests bodies: framing round trip, cut-short and trailing data, the error frame (and that a
  reader knowing only the digest frame refuses it);
* the live state (replication/live.py) against a dict model (hypothesis), with a tiny offset map
  so that many rounds run, and its invariance under compaction (tombstones inside and past
  delete.retention.ms);
* merge_logs against a model: the master wins on an offset both hold.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput import filenames as fn
from kcompact.reput.backend import MemoryBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.partition import PartitionLog
from kcompact.reput.reader import PartitionReader
from kcompact.reput.record import Record, RecordBatch, encode, scan
from kcompact.reput.store import Store
from kcompact.replication.errors import (MasterStoreError, ProtocolError, ReplicationError,
                                         RequestError)
from kcompact.replication.live import bitmap_array, digest_frames, live_offsets
from kcompact.replication.protocol import (DIGEST_MAGIC, END_FRAME, ERROR_HEADER, FRAME_HEADER,
                                           MAX_ERROR_BYTES, FrameReader, Route, ServerLimits,
                                           check_records, check_token, digest_frame, error_doc,
                                           error_frame, parse_bearer, parse_path, parse_query,
                                           partition_path, read_token_file)
from kcompact.replication.replica import merge_logs
from kcompact.replication.client import check_master_url

TOPIC = "orders"
T0 = 1_700_000_000_000
LIMITS = ServerLimits()


# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,route", [
    ("/v1/store", Route("store")),
    ("/v1/topics", Route("topics")),
    ("/v1/topics/orders", Route("topic", "orders")),
    ("/v1/topics/orders/partitions", Route("topic", "orders")),
    ("/v1/topics/orders/partitions/3", Route("partition", "orders", 3)),
    ("/v1/topics/or.d_e-rs/partitions/0/records?from=5", Route("records", "or.d_e-rs", 0)),
    ("/v1/topics/orders/partitions/0/live", Route("live", "orders", 0)),
    ("/v1/topics/orders/partitions/2147483647/digests", Route("digests", "orders", 2147483647)),
    ("/v1/topics/orders/partitions/0/records/", Route("records", "orders", 0)),
])
def test_parse_path_routes(path, route):
    assert parse_path(path) == route


@pytest.mark.parametrize("path", [
    "/v1/topics/../partitions/0/records",
    "/v1/topics/%2e%2e/partitions/0/records",
    "/v1/topics/%2E%2E/partitions/0/records",
    "/v1/topics/%252e%252e/partitions/0/records",   # double-encoded: '%' is not a topic char
    "/v1/topics/.%2e/partitions/0",
    "/v1/topics/./partitions/0",
    "/v1/topics/a%2Fb/partitions/0/records",
    "/v1/topics/a%2fb/partitions/0/records",
    "/v1/topics/a%5Cb/partitions/0",
    "/v1/topics/a/b/partitions/0/records",           # a topic with '/' in it
    "/v1/topics/..%2F..%2Fetc/partitions/0",
    "/v1/../v1/store",
    "/v1/topics/%00/partitions/0",
    "/v1/topics/a%ZZ/partitions/0",
    "/v1/topics/" + "x" * 250 + "/partitions/0",    # Kafka's 249-character limit
    "/v1/topics/bad topic/partitions/0",
    "/v1/topics/orders/partitions/x/records",
    "/v1/topics/orders/partitions/-1/records",
    "/v1/topics/orders/partitions/1.5",
    "/v1/topics/orders/partitions/99999999999",
    "/v1//store",
])
def test_parse_path_rejects_traversal_and_bad_names(path):
    with pytest.raises(RequestError) as e:
        parse_path(path)
    assert e.value.status == 400, path


@pytest.mark.parametrize("path", ["/", "/v2/store", "/v1/nothing", "/v1/topics/o/partitions/0/x",
                                  "/v1/topics/o/partitions/0/records/more"])
def test_parse_path_unknown_is_404(path):
    with pytest.raises(RequestError) as e:
        parse_path(path)
    assert e.value.status == 404


def test_partition_path_builds_what_parse_path_reads():
    for action in (None, "records", "live", "digests"):
        r = parse_path(partition_path("t.x_1", 7, action))
        assert (r.topic, r.partition, r.kind) == ("t.x_1", 7, action or "partition")
    with pytest.raises(ValueError):
        partition_path("../x", 0)


# -- query ------------------------------------------------------------------------------------


def test_query_defaults_and_limits():
    q = parse_query("records", {}, LIMITS)
    assert (q.from_offset, q.max_bytes, q.wait_ms) == (0, LIMITS.default_max_bytes, 0)
    q = parse_query("records", {"from": "42", "max_bytes": str(LIMITS.max_bytes),
                                "wait_ms": "100"}, LIMITS)
    assert (q.from_offset, q.max_bytes, q.wait_ms) == (42, LIMITS.max_bytes, 100)


@pytest.mark.parametrize("params,status", [
    ({"max_bytes": str(LIMITS.max_bytes + 1)}, 413),     # oversized: refused, not clamped
    ({"max_bytes": "99999999999999999999"}, 400),      # not even an int64
    ({"max_bytes": "0"}, 400),
    ({"from": "-1"}, 400),
    ({"from": "1e3"}, 400),
    ({"from": "9223372036854775808"}, 400),
    ({"wait_ms": "300001"}, 400),
    ({"bogus": "1"}, 400),
])
def test_query_rejections(params, status):
    with pytest.raises(RequestError) as e:
        parse_query("records", params, LIMITS)
    assert e.value.status == status


def test_query_repeated_unknown_and_salt():
    with pytest.raises(RequestError):
        parse_query("records", {"from": "1"}, LIMITS, {"from": 2})
    with pytest.raises(RequestError):
        parse_query("store", {"from": "1"}, LIMITS)
    with pytest.raises(RequestError):
        parse_query("digests", {}, LIMITS)
    with pytest.raises(RequestError):
        parse_query("digests", {"salt": "abc"}, LIMITS)
    q = parse_query("digests", {"salt": "00" * 16, "upto": "9"}, LIMITS)
    assert q.salt == bytes(16) and q.upto == 9


def test_limits_are_validated():
    with pytest.raises(ReplicationError):
        ServerLimits(max_bytes=1 << 31)
    with pytest.raises(ReplicationError):
        ServerLimits(default_max_bytes=LIMITS.max_bytes + 1)
    assert (LIMITS.max_connections, LIMITS.client_timeout_s) == (256, 30.0)
    for bad in ({"max_connections": 0}, {"max_connections": 70000}, {"client_timeout_s": 0},
                {"client_timeout_s": 4000}):
        with pytest.raises(ReplicationError, match="--max-connections|--client-timeout"):
            ServerLimits(**bad)


# -- auth -------------------------------------------------------------------------------------


def test_check_token():
    tok = b"s3cret-token-0123456789"
    assert check_token(None, tok) == 401
    assert check_token("", tok) == 401
    assert check_token("Basic abc", tok) == 401
    assert check_token("Bearer", tok) == 401
    assert check_token("Bearer wrong", tok) == 403
    assert check_token("Bearer s3cret-token-012345678", tok) == 403   # a prefix
    assert check_token("Bearer s3cret-token-0123456789x", tok) == 403
    assert check_token("Bearer s\u00e9cret", tok) == 403
    assert check_token("Bearer s3cret-token-0123456789", tok) == 0
    assert check_token("bearer   s3cret-token-0123456789 ", tok) == 0
    assert parse_bearer("Bearer abc") == "abc"


def test_read_token_file(tmp_path):
    f = tmp_path / "tok"
    f.write_text("  0123456789abcdef0123\n")
    assert read_token_file(str(f)) == b"0123456789abcdef0123"
    for bad in ("short", "", "two words here 0123456789", "x" * 5000):
        f.write_text(bad)
        with pytest.raises(ReplicationError):
            read_token_file(str(f))
    with pytest.raises(ReplicationError, match="cannot read"):
        read_token_file(str(tmp_path / "missing"))


@pytest.mark.parametrize("url", ["ftp://h:1", "h:1", "http://", "http://h:1/path",
                                 "http://u:p@h:1", "http://h:1?x=1", "http://h:notaport"])
def test_master_url_is_checked(url):
    with pytest.raises(ReplicationError):
        check_master_url(url)


def test_master_url_ok():
    assert check_master_url("https://127.0.0.1:8470/") == "https://127.0.0.1:8470"


# -- records responses ------------------------------------------------------------------------


def _body(recs) -> bytes:
    return encode(recs)


def _recs(n=5, topic=TOPIC, partition=0, start=10):
    return [Record(topic, partition, start + 2 * i, T0 + i, b"k%d" % i,
                   None if i == 3 else b"v%d" % i) for i in range(n)]


def test_check_records_accepts_a_valid_body():
    body = _body(_recs())
    s = check_records(body, TOPIC, 0, 10, 19, 5, bytes(16))
    assert list(s.offsets[:5]) == [10, 12, 14, 16, 18]
    check_records(b"", TOPIC, 0, 10, 50, 0, bytes(16))


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b[:-1], "torn"),
    (lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:], "corrupt"),
])
def test_check_records_rejects_damaged_bodies(mutate, match):
    with pytest.raises(ProtocolError, match=match):
        check_records(mutate(_body(_recs())), TOPIC, 0, 10, 19, 5, bytes(16))


def test_check_records_rejects_wrong_headers_and_other_partitions():
    body = _body(_recs())
    with pytest.raises(ProtocolError, match="announced"):
        check_records(body, TOPIC, 0, 10, 19, 4, bytes(16))
    with pytest.raises(ProtocolError, match="next offset"):
        check_records(body, TOPIC, 0, 10, 25, 5, bytes(16))
    with pytest.raises(ProtocolError, match="out of order"):
        check_records(body, TOPIC, 0, 11, 19, 5, bytes(16))
    with pytest.raises(ProtocolError, match="another partition"):
        check_records(body, TOPIC, 1, 10, 19, 5, bytes(16))
    with pytest.raises(ProtocolError, match="another topic"):
        check_records(body, "orderz", 0, 10, 19, 5, bytes(16))
    mixed = _body(_recs(2) + _recs(2, topic="other", start=100))
    with pytest.raises(ProtocolError, match="another topic"):
        check_records(mixed, TOPIC, 0, 10, 103, 4, bytes(16))
    backwards = _body(list(reversed(_recs(3))))
    with pytest.raises(ProtocolError, match="out of order"):
        check_records(backwards, TOPIC, 0, 0, 11, 3, bytes(16))
    with pytest.raises(ProtocolError):
        check_records(b"", TOPIC, 0, 10, 5, 0, bytes(16))


# -- digests frames ---------------------------------------------------------------------------


def _frame_of(recs, salt=bytes(range(16))):
    body = np.frombuffer(_body(recs), np.uint8)
    s = scan(body)
    return digest_frame(body, s.positions, s.sizes, s.offsets, salt)


def test_digest_frames_round_trip_in_any_split():
    recs = _recs(7) + [Record(TOPIC, 0, 99, T0, None, b"keyless"),
                       Record(TOPIC, 0, 100, T0, b"", b"empty key")]
    raw = _frame_of(recs[:4]) + _frame_of(recs[4:]) + END_FRAME
    for step in (1, 3, 7, 64, len(raw)):
        r = FrameReader()
        frames = [f for i in range(0, len(raw), step) for f in r.feed(raw[i:i + step])]
        assert r.done
        offs = np.concatenate([f.entries["offset"] for f in frames]).tolist()
        assert offs == [x.offset for x in recs]
        keys = [f.key(i) for f in frames for i in range(f.entries.shape[0])]
        assert keys == [x.key for x in recs]


def test_digest_hash_covers_the_whole_record():
    a = _frame_of(_recs(3))
    b = _frame_of([r if r.offset != 12 else Record(TOPIC, 0, 12, r.timestamp, r.key, b"other")
                   for r in _recs(3)])
    fa, fb = next(FrameReader().feed(a)), next(FrameReader().feed(b))
    diff = (fa.entries["hash_lo"] != fb.entries["hash_lo"]).tolist()
    assert diff == [False, True, False]
    # another salt: other hashes (a replica cannot be prepared for a salt it never saw)
    fc = next(FrameReader().feed(_frame_of(_recs(3), salt=bytes(16))))
    assert not np.any(fa.entries["hash_lo"] == fc.entries["hash_lo"])


def test_frame_reader_rejects_bad_bodies():
    good = _frame_of(_recs(2))
    with pytest.raises(ProtocolError, match="magic"):
        list(FrameReader().feed(b"XXXX" + good[4:]))
    with pytest.raises(ProtocolError, match="after the end"):
        list(FrameReader().feed(good + END_FRAME + b"x"))
    r = FrameReader()
    list(r.feed(good + END_FRAME[:5]))
    assert not r.done  # cut short: the caller reports it
    bad = bytearray(good)
    bad[12 + 24:12 + 28] = (10_000).to_bytes(4, "little")  # key_pos of entry 0 past the block
    with pytest.raises(ProtocolError, match="outside"):
        list(FrameReader().feed(bytes(bad)))


# The error frame: the master's 500 after the status line (issue 26)
DAMAGE = error_doc(500, "the master's store is damaged: partitions/orders/0/"
                        "00000000000000000002.log: corrupt record at byte 7237\n(CRC)",
                   "partitions/orders/0/00000000000000000002.log", 7237)


def test_an_error_frame_ends_a_digests_body_with_the_masters_error_in_any_split():
    raw = _frame_of(_recs(3)) + error_frame(DAMAGE)
    for step in (1, 5, 12, 13, len(raw)):
        r = FrameReader("master http://m:1/v1/x")
        got = []
        with pytest.raises(MasterStoreError) as e:
            for i in range(0, len(raw), step):
                got.extend(r.feed(raw[i:i + step]))
        assert [int(o) for f in got for o in f.entries["offset"]] == [x.offset for x in _recs(3)]
        assert not r.done
        assert e.value.path == "partitions/orders/0/00000000000000000002.log"
        assert e.value.position == 7237
        assert str(e.value).startswith("master http://m:1/v1/x: the master's store is damaged: "
                                       "partitions/orders/0/00000000000000000002.log")
        assert "\n" not in str(e.value) and e.value.detail.startswith("the master's store")


def test_an_error_frame_is_not_data_to_a_reader_of_digest_frames_only():
    """A protocol-1 reader without error frames checks the magic of every frame header (the
    same 12-byte shape) before anything else: the error frame's is not DIGEST_MAGIC."""
    frame = error_frame(DAMAGE)
    magic, n, klen = FRAME_HEADER.unpack_from(frame, 0)
    assert FRAME_HEADER.size == ERROR_HEADER.size and magic != DIGEST_MAGIC
    assert frame[:4] == b"KCE1" and n == 500 and klen == len(frame) - 12


def test_bad_error_frames_are_protocol_errors():
    big = ERROR_HEADER.pack(b"KCE1", 500, MAX_ERROR_BYTES + 1)
    with pytest.raises(ProtocolError, match="over the limit"):
        list(FrameReader().feed(big))
    junk = ERROR_HEADER.pack(b"KCE1", 500, 3) + b"{{{"
    with pytest.raises(MasterStoreError, match="without a valid error document") as e:
        list(FrameReader().feed(junk))
    assert e.value.path is None
    r = FrameReader()
    assert list(r.feed(error_frame(DAMAGE)[:20])) == [] and not r.done  # not whole yet: wait
    # a document too large for a frame keeps its message, shortened
    huge = error_doc(500, "x" * 3000, "p" * (MAX_ERROR_BYTES + 10), 1)
    with pytest.raises(MasterStoreError, match="x{100}"):
        list(FrameReader().feed(error_frame(huge)))


# -- the live state against a model -----------------------------------------------------------


def _store(clock=None, **cfg) -> Store:
    clock = clock or ManualClock(T0 + 123)
    st_ = Store.open("memory://r", fs=MemoryBackend(), writer="w", create=True, clock=clock)
    st_.set_topic_config(TOPIC, {"segment.bytes": 16384, **cfg})
    return st_


def _gen_records(seed: int, n: int, nkeys: int, p_tomb: float, p_keyless: float,
                 partition: int = 0, start: int = 0, ts: int = T0) -> list[Record]:
    rng = random.Random(seed)
    out, off = [], start
    for _ in range(n):
        off += rng.choice([1, 1, 1, 2, 9])
        key = None if rng.random() < p_keyless else b"key-%d" % rng.randrange(nkeys)
        value = None if rng.random() < p_tomb else b"v%d-" % off * rng.randint(0, 30)
        out.append(Record(TOPIC, partition, off, ts, key, value))
    return out


def _model_live(recs, upto) -> set[int]:
    latest: dict[bytes, Record] = {}
    live = set()
    for r in recs:
        if r.offset >= upto:
            continue
        if r.key is None:
            live.add(r.offset)
        else:
            latest[r.key] = r
    return live | {r.offset for r in latest.values() if r.value is not None}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(0, 600), nkeys=st.sampled_from([1, 5, 40, 300]),
       p_tomb=st.sampled_from([0.0, 0.1, 0.5]), p_keyless=st.sampled_from([0.0, 0.05, 0.4]),
       map_memory=st.sampled_from([256, 1024, 1 << 16]), cut=st.floats(0, 1.2))
def test_live_offsets_match_the_model(seed, n, nkeys, p_tomb, p_keyless, map_memory, cut):
    recs = _gen_records(seed, n, nkeys, p_tomb, p_keyless)
    st_ = _store()
    if recs:
        st_.append(RecordBatch.from_records(TOPIC, recs))
        st_.flush()
    pl = PartitionLog(st_.fs, TOPIC, 0, st_.secret)
    nxt = pl.next_offset
    upto = int(nxt * cut)
    got, used = live_offsets(pl, upto, map_memory=map_memory)
    assert used == upto
    assert set(bitmap_array(got).tolist()) == _model_live(recs, upto)
    full, used = live_offsets(pl, None, map_memory=map_memory)
    assert used == nxt and set(bitmap_array(full).tolist()) == _model_live(recs, nxt)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), rounds=st.integers(1, 4),
       advance=st.sampled_from([0, 500, 1500, 5000]))
def test_live_state_survives_compaction(seed, rounds, advance):
    """Compaction (several times, tombstones inside and past delete.retention.ms) never changes
    the live state: this is why verify --against compares it instead of raw segments."""
    clock = ManualClock(T0 + 321)
    st_ = _store(clock, **{"delete.retention.ms": 1000})
    rng = random.Random(seed)
    recs: list[Record] = []
    for r in range(rounds):
        batch = _gen_records(rng.randrange(2**31), rng.randint(50, 400), rng.choice([3, 50]),
                             0.2, 0.05, start=recs[-1].offset if recs else 0, ts=clock.ms())
        recs += batch
        st_.append(RecordBatch.from_records(TOPIC, batch))
        st_.flush()
        expect = _model_live(recs, recs[-1].offset + 1)
        pl = PartitionLog(st_.fs, TOPIC, 0, st_.secret)
        assert set(bitmap_array(live_offsets(pl, None, 256)[0]).tolist()) == expect
        Compactor(st_, CompactionOptions(offset_map_memory=4096, max_load=0.3),
                  clock).compact_partition(TOPIC, 0, force=bool(rng.getrandbits(1)))
        clock.advance(advance)
        pl = PartitionLog(st_.fs, TOPIC, 0, st_.secret)
        assert set(bitmap_array(live_offsets(pl, None, 256)[0]).tolist()) == expect


def test_digest_frames_equal_across_secrets_and_name_a_tampered_record():
    recs = _gen_records(5, 500, 30, 0.1, 0.05)
    live_keyed = sorted(o for o in _model_live(recs, 10**9)
                        if next(r for r in recs if r.offset == o).key is not None)
    victim = live_keyed[len(live_keyed) // 2]
    a, b = _store(), _store()
    assert a.secret != b.secret
    a.append(RecordBatch.from_records(TOPIC, recs))
    tampered = [r if r.offset != victim else
                Record(TOPIC, 0, r.offset, r.timestamp, r.key, b"evil") for r in recs]
    b.append(RecordBatch.from_records(TOPIC, tampered))
    a.flush()
    b.flush()
    salt = bytes(range(16))
    out = []
    for s in (a, b):
        pl = PartitionLog(s.fs, TOPIC, 0, s.secret)
        live, upto = live_offsets(pl)
        frames = [f for raw in digest_frames(pl, live, upto, salt, read_bytes=4096)
                  for f in FrameReader().feed(raw)]
        e = np.concatenate([f.entries for f in frames])
        out.append(e)
    ea, eb = out
    assert np.array_equal(ea["offset"], eb["offset"])
    assert set(ea["offset"].tolist()) == _model_live(recs, 10**9)
    differ = ea["offset"][(ea["hash_lo"] != eb["hash_lo"]) | (ea["hash_hi"] != eb["hash_hi"])]
    assert differ.tolist() == [victim]


# -- merge ------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n_local=st.integers(0, 300), n_master=st.integers(0, 300))
def test_merge_logs_master_wins_on_equal_offsets(seed, n_local, n_master):
    rng = random.Random(seed)
    st_ = _store()
    fs = st_.fs

    def fill(sub, n, tag):
        recs, off = [], rng.randrange(0, 50)
        for _ in range(n):
            off += rng.choice([1, 2, 3])
            recs.append(Record(TOPIC, 0, off, T0, b"k%d" % rng.randrange(20), tag + b"%d" % off))
        pl = PartitionLog(fs, TOPIC, 0, st_.secret, st_.topic_config(TOPIC), writable=True,
                          sub=sub)
        if recs:
            buf = np.frombuffer(encode(recs), np.uint8)
            pl.append(buf, scan(buf, secret=st_.secret), 0, len(recs))
        pl.sync()
        return pl, recs

    local, lrecs = fill(None, n_local, b"local-")
    master, mrecs = fill(fn.REPLICATING_DIR, n_master, b"master-")
    bases = merge_logs(fs, TOPIC, 0, st_, local, master, read_bytes=2048)
    model = {r.offset: r for r in lrecs}
    model.update({r.offset: r for r in mrecs})
    merged = PartitionLog(fs, TOPIC, 0, st_.secret, sub=fn.COMPACTING_DIR)
    got = list(merged.iter_records())
    assert [(r.offset, r.value) for r in got] == [(o, model[o].value) for o in sorted(model)]
    assert bases == [s.base for s in merged.segments if s.entry_count]


# -- crash states of an install (replica.py), without a server ----------------------------------


class _FakeClient:
    url = "http://master.invalid:1"

    def __init__(self, store_id):
        self.store_id = store_id


def _pull_into(master: Store, staging: PartitionLog, secret: bytes, upto_bytes: int = 8192):
    """What the replica's pull does, reading the master in-process."""
    pl = PartitionLog(master.fs, TOPIC, 0, master.secret)
    reader = PartitionReader(pl)
    off = 0
    while True:
        r = reader.read_raw(off, upto_bytes)
        if r.count == 0:
            return pl.next_offset
        body = r.buf[:r.nbytes].tobytes()
        s = check_records(body, TOPIC, 0, off, r.next_offset, r.count, secret)
        staging.append(np.frombuffer(body, np.uint8), s, 0, len(s))
        off = r.next_offset


@pytest.mark.parametrize("crash", ["moved_half", "committed", "installed", "pulled"])
def test_install_resumes_from_every_crash_point(tmp_path, crash):
    import json as _json

    from kcompact.reput import swap
    from kcompact.replication.replica import INSTALL_MARKER, ReplicaOptions, Replicator
    recs = _gen_records(9, 3000, 200, 0.1, 0.03)
    master = Store.open(str(tmp_path / "m"), writer="w", create=True)
    master.set_topic_config(TOPIC, {"segment.bytes": 16384})
    master.append(RecordBatch.from_records(TOPIC, recs))
    master.flush()
    replica = Store.open(str(tmp_path / "r"), create=True)
    replica.set_topic_config(TOPIC, {"segment.bytes": 16384})
    rep = Replicator(_FakeClient(master.meta.store_id), replica, ReplicaOptions())
    state, staging = rep._prepare(TOPIC, 0)
    assert state == "pull"
    target = _pull_into(master, staging, replica.secret)
    staging.sync()
    fs = replica.fs
    rdir, pdir = fn.replicating_dir(TOPIC, 0), fn.partition_dir(TOPIC, 0)
    sdir = swap.staging_dir(pdir)
    bases = [s.base for s in staging.segments if s.entry_count]
    assert len(bases) > 4
    if crash != "pulled":  # replay _install by hand up to the crash point
        replica.writable_partition(TOPIC, 0)
        fs.write_atomic(f"{rdir}/{INSTALL_MARKER}", _json.dumps(
            {"version": 1, "state": "installing", "mode": "rename", "bases": bases}).encode())
        staging.close()
        moved = bases if crash != "moved_half" else bases[: len(bases) // 2]
        for b in moved:
            for suffix in (fn.LOG_SUFFIX, fn.INDEX_SUFFIX):
                name = f"{fn.base_name(b)}{suffix}"
                fs.rename(f"{rdir}/{name}", f"{sdir}/{name}")
        if crash in ("committed", "installed"):
            plan = swap.SwapPlan([s.base for s in replica.partition(TOPIC, 0).segments], bases, -1)
            swap.commit(fs, pdir, plan)
            if crash == "installed":
                swap.apply(fs, pdir, plan)
                fs.write_atomic(f"{rdir}/{INSTALL_MARKER}",
                                _json.dumps({"version": 1, "state": "installed"}).encode())
    else:
        staging.close()
    replica.close()  # the crash: every lock released, nothing in memory survives

    replica = Store.open(str(tmp_path / "r"))
    rep = Replicator(_FakeClient(master.meta.store_id), replica, ReplicaOptions())
    state, staging = rep._prepare(TOPIC, 0)
    if crash in ("committed", "installed"):
        assert state == "installed"
    else:
        assert state == "pull"
        assert staging.next_offset == recs[-1].offset + 1  # nothing to pull again
        rep._install(TOPIC, 0, staging)
    rep._finish(TOPIC, 0, target)
    rep.close()
    pl = PartitionLog(replica.fs, TOPIC, 0, replica.secret)
    live, _ = live_offsets(pl)
    assert set(bitmap_array(live).tolist()) == _model_live(recs, 10**9)
    assert pl.next_offset == target
    assert not fs.exists(f"{rdir}/{INSTALL_MARKER}") and not fs.isdir(sdir)
    replica.close()
    master.close()


def test_store_doc_shape_is_checked():
    from kcompact.replication.client import check_store_doc
    good = {"store_id": "x", "topics": [{"topic": "a", "config": {}, "partitions": [
        {"partition": 0, "first_offset": 0, "next_offset": 3}]}]}
    check_store_doc(good, "u")
    for bad in (None, [], {"store_id": "x"}, {"store_id": "x", "topics": [{"topic": "..",
                                                                            "partitions": []}]},
                {"store_id": "x", "topics": [{"topic": "a", "partitions": [
                    {"partition": -1, "first_offset": 0, "next_offset": 3}]}]},
                {"store_id": "x", "topics": [{"topic": "a", "partitions": [{"partition": 0}]}]}):
        with pytest.raises(ProtocolError):
            check_store_doc(bad, "u")


def test_a_rebuild_starts_the_next_pull_while_a_partition_compacts(tmp_path):
    """--parallel bounds pulls and installs+compactions separately: with one of each, partition
    1's pull starts while partition 0 still compacts (its compaction here waits for that pull
    to start: one semaphore over the whole partition would never let it, and time out)."""
    import asyncio
    import threading
    import types

    from kcompact.replication.replica import ReplicaOptions, Replicator
    replica = Store.open(str(tmp_path / "r"), create=True)
    rep = Replicator(_FakeClient("x"), replica, ReplicaOptions(parallel=1))
    events, lock = [], threading.Lock()
    pulling = {p: threading.Event() for p in range(3)}

    def note(what, p):
        with lock:
            events.append((what, p))

    def prepare(topic, p):
        note("pull", p)
        pulling[p].set()
        return "pull", types.SimpleNamespace(next_offset=0, record_count=lambda: 0)

    async def pull(topic, p, *args):
        note("pulled", p)

    def finish(topic, p, target):
        if p + 1 in pulling:
            assert pulling[p + 1].wait(10), f"partition {p + 1}'s pull waited for {p}'s end"
        note("compacted", p)
        return types.SimpleNamespace(to_dict=dict, records_kept=0)

    rep._prepare, rep._pull, rep._finish = prepare, pull, finish
    rep._note_horizon = lambda *a: None
    rep._install = lambda *a: False
    rep._live_next = lambda *a: 0
    rep.master_doc = {"topics": [{"topic": TOPIC, "partitions": [
        {"partition": p, "first_offset": 0, "next_offset": 0} for p in range(3)]}]}
    try:
        results = asyncio.run(rep.rebuild())
    finally:
        rep.close()
        replica.close()
    assert [r.partition for r in results] == [0, 1, 2]
    # one pull at a time, in order; each partition compacted after the next one's pull began
    pulls = [p for what, p in events if what == "pull"]
    assert pulls == [0, 1, 2]
    for p in (0, 1):
        assert events.index(("pull", p + 1)) < events.index(("compacted", p))
        assert events.index(("pulled", p)) < events.index(("pull", p + 1))
