"""Issue 44: every count and length read from a file is bounded by the file's size before
anything is allocated. Each format's decoder gets random inputs and *checksum-valid* ones (a
real file with a count or length changed and its checksums recomputed, as a crafted file would
have): the only errors allowed are kcompact's own (``ReputError`` and its subclasses, the
replication ``ProtocolError``), never ``MemoryError``, ``ValueError``, ``IndexError`` and the
like. The address space is limited while they run (2 GiB above what the process uses), so an
allocation a file's claim would make fails here as a MemoryError instead of succeeding lazily.

Formats: the lean index (bcq-v2.md), Kafka record batches (segment-v2.md), records (record.md:
the commit log and format-1 segments), the segment list, the manifest, store.json, the swap
plan and the compaction checkpoint, and replication's digest frames.
"""

from __future__ import annotations

import base64
import contextlib
import json
import resource
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcompact.reput.segment_desc import SegmentDesc
from kcompact.reput import batch as KB
from kcompact.reput import bcq as B
from kcompact.reput import bcq2 as B2
from kcompact.reput import manifest as M
from kcompact.reput import segment_list as SL
from kcompact.reput import swap
from kcompact.reput.backend import MemoryBackend
from kcompact.reput.codecs import zstd_compress, zstd_decompress
from kcompact.reput.errors import ReputError
from kcompact.reput.record import (RecordBatch, decode_all, decode_one, encode_batch, scan)
from kcompact.reput.store import StoreMeta
from kcompact.replication.errors import ReplicationError

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
OURS = (ReputError, ReplicationError)


@contextlib.contextmanager
def bounded_memory(extra: int = 2 << 30):
    """RLIMIT_AS at the process's size now + ``extra``, restored after."""
    with open("/proc/self/statm") as f:
        vsz = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vsz + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def only_ours(fn, *args) -> None:
    with bounded_memory():
        try:
            fn(*args)
        except OURS:
            pass


# -- the lean index --------------------------------------------------------------------------


def lean_index(n: int = 300, chunk: int = 64) -> bytes:
    b = B2.IndexBuilder(chunk_entries=chunk)
    e = np.zeros(n, B.BCQ_DTYPE)
    e["offset"] = np.arange(n) * 2 + 5
    e["timestamp"] = 1000 + np.arange(n)
    e["digest_lo"] = np.arange(n) * 7
    sizes = np.full(n // 3, 100, np.int64)
    counts = np.full(n // 3, 3, np.int64)
    e["position"] = np.repeat(np.arange(n // 3) * 100, 3)
    b.add_batches(0, sizes, counts, e)
    b.log_size = int(sizes.sum())
    return b.finish(0)


def read_lean(raw: bytes) -> None:
    idx = B2.LeanIndex(lambda a, n: raw[a:a + n], "x.bcq", len(raw))
    idx.entries
    for i in range(idx.chunk_count):
        idx.chunk(i)
    idx.batches()
    idx.lower_bound(100)


def with_header(raw: bytes, **fields) -> bytes:
    """``raw`` with header fields changed and the header CRC recomputed."""
    names = ("magic", "version", "codec", "reserved", "chunks", "records", "log_size",
             "dir_crc", "head_crc")
    vals = dict(zip(names, B2.HEADER.unpack_from(raw, 0)))
    vals.update(fields)
    head = B2.HEADER.pack(*(vals[k] for k in names))
    head = head[:36] + struct.pack("<I", B2._crc(head[:36]))
    return head + raw[B2.HEADER_SIZE:]


def with_dir(raw: bytes, i: int, **fields) -> bytes:
    """``raw`` with directory row ``i`` changed, the directory and header CRCs recomputed."""
    chunks = B2.HEADER.unpack_from(raw, 0)[4]
    d = np.frombuffer(raw[B2.HEADER_SIZE:B2.HEADER_SIZE + chunks * 48], B2.DIR_DTYPE).copy()
    for k, v in fields.items():
        d[i][k] = v
    out = raw[:B2.HEADER_SIZE] + d.tobytes() + raw[B2.HEADER_SIZE + d.nbytes:]
    return with_header(out, dir_crc=B2._crc(d.tobytes()))


def with_chunk_body(raw: bytes, i: int, change) -> bytes:
    """``raw`` with chunk ``i``'s decompressed body changed by ``change`` and every checksum
    and position recomputed."""
    chunks = B2.HEADER.unpack_from(raw, 0)[4]
    d = np.frombuffer(raw[B2.HEADER_SIZE:B2.HEADER_SIZE + chunks * 48], B2.DIR_DTYPE).copy()
    bodies = [raw[int(r["chunk_pos"]):int(r["chunk_pos"]) + int(r["chunk_len"])] for r in d]
    bodies[i] = zstd_compress(change(bytearray(zstd_decompress(bodies[i]))), 3)
    pos = B2.HEADER_SIZE + d.nbytes
    for j, body in enumerate(bodies):
        d[j]["chunk_pos"], d[j]["chunk_len"], d[j]["chunk_crc"] = pos, len(body), B2._crc(body)
        pos += len(body)
    out = raw[:B2.HEADER_SIZE] + d.tobytes() + b"".join(bodies)
    return with_header(out, dir_crc=B2._crc(d.tobytes()))


def test_issue44_lean_index_claiming_2_40_records_is_refused_before_allocating():
    raw = with_header(lean_index(), records=1 << 40)
    with bounded_memory():
        with pytest.raises(ReputError):
            read_lean(raw)
    # the last chunk's share of such a claim, the directory and the header agreeing
    raw = lean_index()
    chunks = B2.HEADER.unpack_from(raw, 0)[4]
    with bounded_memory():
        with pytest.raises(ReputError):
            read_lean(with_header(with_dir(raw, chunks - 1, first_entry=1), records=1 << 40))


@SETTINGS
@given(st.binary(max_size=400))
def test_issue44_lean_index_random_bytes(junk):
    only_ours(read_lean, junk)
    only_ours(read_lean, B2.MAGIC + junk)


@SETTINGS
@given(st.sampled_from(["chunks", "records", "log_size"]),
       st.sampled_from([0, 1, 2, 7, 300, 301, 2 ** 20, 2 ** 31, 2 ** 40, 2 ** 63 - 1]))
def test_issue44_lean_index_header_fields_checksum_valid(field, value):
    if field == "chunks":
        value %= 2 ** 32
    only_ours(read_lean, with_header(lean_index(), **{field: value}))


@SETTINGS
@given(st.integers(0, 4), st.sampled_from(["first_offset", "last_offset", "first_entry",
                                           "chunk_pos", "first_position", "chunk_len"]),
       st.sampled_from([0, 1, 63, 64, 65, 2 ** 31, 2 ** 40, 2 ** 62]))
def test_issue44_lean_index_directory_checksum_valid(i, field, value):
    if field == "chunk_len":
        value %= 2 ** 32
    only_ours(read_lean, with_dir(lean_index(), i, **{field: value}))


@SETTINGS
@given(st.integers(0, 4), st.integers(0, 3000), st.binary(min_size=1, max_size=8))
def test_issue44_lean_index_chunk_bodies_checksum_valid(i, at, junk):
    def change(body: bytearray) -> bytes:
        p = at % (len(body) + 1)
        return bytes(body[:p] + junk + body[p + len(junk):])
    only_ours(read_lean, with_chunk_body(lean_index(), i, change))
    # the counts at the body's start: records and batches
    only_ours(read_lean, with_chunk_body(lean_index(), i, lambda b: struct.pack(
        "<II", at * 1000003, len(junk) * 999983) + bytes(b[8:])))


# -- Kafka record batches --------------------------------------------------------------------


def batches(n: int = 20, codec: int = 0) -> bytes:
    rb = RecordBatch.from_records("t", [(0, i, 1000 + i, b"k%d" % i, b"v" * (i % 9), [])
                                        for i in range(n)])
    buf, pos = encode_batch(rb)
    s = scan(buf)
    out = KB.encode_batch(buf, s.positions, 0, len(s), s.offsets, s.timestamps, codec, 3)
    return bytes(out.data) if hasattr(out, "data") else bytes(out[0])


def decode(raw: bytes) -> None:
    buf = np.frombuffer(raw, np.uint8)
    KB.decode_batches(buf, 0, b"t", 0, "x.log")
    p = 0
    while p < len(raw):
        w = KB.walk_batch(buf, p, p, 1, "x.log")
        KB.decode_walked([w], b"t", 0)
        p += w.head.size


def with_batch(raw: bytes, **fields) -> bytes:
    """The first batch with header fields changed and its CRC-32C recomputed."""
    names = ("base", "length", "epoch", "magic", "crc", "attrs", "last_delta", "base_ts",
             "max_ts", "pid", "pepoch", "seq", "count")
    vals = dict(zip(names, KB.BATCH_HEADER.unpack_from(raw, 0)))
    vals.update(fields)
    b = bytearray(KB.BATCH_HEADER.pack(*(vals[k] for k in names)) + raw[KB.HEADER_SIZE:])
    end = min(len(b), KB.LOG_OVERHEAD + vals["length"]) if vals["length"] > 0 else len(b)
    end = max(end, KB.CRC_START)
    crc = KB.crc32c(np.frombuffer(bytes(b), np.uint8), KB.CRC_START, end)
    struct.pack_into(">I", b, 17, crc)
    return bytes(b)


def test_issue44_batch_sample_decodes():
    for codec in (0, 4):
        decode(batches(codec=codec))


@SETTINGS
@given(st.binary(max_size=300))
def test_issue44_batches_random_bytes(junk):
    only_ours(decode, junk)
    only_ours(decode, batches()[:61] + junk)


@SETTINGS
@given(st.sampled_from(["count", "last_delta", "length", "base", "attrs"]),
       st.sampled_from([-1, 0, 1, 19, 20, 21, 2 ** 20, 2 ** 31 - 1]), st.sampled_from([0, 4]))
def test_issue44_batch_header_checksum_valid(field, value, codec):
    if field == "attrs":
        value %= 2 ** 15
    only_ours(decode, with_batch(batches(codec=codec), **{field: value}))


@SETTINGS
@given(st.integers(61, 400), st.binary(min_size=1, max_size=6))
def test_issue44_batch_records_checksum_valid(at, junk):
    raw = bytearray(batches())
    p = at % len(raw)
    raw[p:p + len(junk)] = junk
    only_ours(decode, with_batch(bytes(raw)))


# -- records (format-1 segments, the commit log) ---------------------------------------------


def records_bytes() -> bytes:
    rb = RecordBatch.from_records("t", [(0, i, 1000 + i, b"k%d" % i, b"v" * i, [("h", b"x")])
                                        for i in range(5)])
    return bytes(encode_batch(rb)[0])


def read_records(raw: bytes) -> None:
    buf = np.frombuffer(raw, np.uint8)
    s = scan(buf)
    for p in s.positions.tolist():
        decode_one(buf, int(p))
    decode_all(raw)
    for p in range(0, len(raw), 7):
        decode_one(buf, p)


@SETTINGS
@given(st.integers(0, 600), st.binary(min_size=1, max_size=8), st.booleans())
def test_issue44_records_random_and_checksum_valid(at, junk, fix_crc):
    raw = bytearray(records_bytes())
    p = at % len(raw)
    raw[p:p + len(junk)] = junk
    if fix_crc:  # the first record's CRC recomputed over its (claimed) size
        size = min(struct.unpack_from("<I", raw, 0)[0], len(raw))
        from kcompact.reput import _kernels as K
        crc = int(K.crc32c(np.frombuffer(bytes(raw), np.uint8), 8, max(size, 8), K.CRC_TABLES))
        struct.pack_into("<I", raw, 4, crc)
    only_ours(read_records, bytes(raw))


# -- JSON metadata: segment list, manifest, store.json, swap plan, checkpoint -----------------


def json_mutations():
    ints = st.sampled_from([-1, 0, 1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 70, 10 ** 30])
    leaves = st.one_of(ints, st.none(), st.booleans(), st.text(max_size=5), st.floats())
    return st.recursive(leaves, lambda c: st.one_of(st.lists(c, max_size=3),
                                                    st.dictionaries(st.text(max_size=4), c,
                                                                    max_size=3)), max_leaves=8)


def seglist_doc() -> dict:
    lst = SL.SegmentList([SegmentDesc(0, 10, 3, 0, 9, 300, 144, 0x1234abcd),
                          SegmentDesc(10)], 10, 4)
    return json.loads(lst.to_json())


def rechecked(doc: dict) -> bytes:
    doc = dict(doc)
    doc.pop("crc32c", None)
    doc["crc32c"] = f"{SL.crc32c(SL.canonical(doc)):08x}"
    return json.dumps(doc).encode()


@SETTINGS
@given(st.sampled_from(["version", "next_offset", "segments"]), json_mutations(),
       st.integers(0, 1), st.sampled_from(["base", "next", "records", "first_offset",
                                           "last_offset", "log_size", "bcq_size", "format"]))
def test_issue44_segment_list_checksum_valid(top, value, i, key):
    doc = seglist_doc()
    only_ours(SL.SegmentList.from_json, rechecked(dict(doc, **{top: value})), "s.json")
    seg = dict(doc["segments"][i], **{key: value})
    doc["segments"] = [seg if j == i else s for j, s in enumerate(doc["segments"])]
    only_ours(SL.SegmentList.from_json, rechecked(doc), "s.json")


def manifest_doc() -> dict:
    e = SegmentDesc.from_entries(100, "00000000000000000100-0123456789abcdef.log",
                                    "00000000000000000100-0123456789abcdef.bcq", 500,
                                    np.array([100, 101, 105], "int64"))
    m = M.Manifest(version=3, created_ms=1, writer="w", next_offset=106, segments=[e])
    return json.loads(m.to_json())


@SETTINGS
@given(st.sampled_from(["version", "next_offset", "cleaned_offset", "segments", "retired",
                        "last_run"]), json_mutations(),
       st.sampled_from(["base", "log_size", "bcq_size", "records", "first_offset",
                        "last_offset", "offsets", "format"]), st.binary(max_size=64))
def test_issue44_manifest_checksum_valid(top, value, key, bitmap):
    doc = manifest_doc()
    only_ours(M.Manifest.from_json, json.dumps(dict(doc, **{top: value})).encode(), "m.json")
    seg = dict(doc["segments"][0], **{key: value})
    only_ours(M.Manifest.from_json, json.dumps(dict(doc, segments=[seg])).encode(), "m.json")
    seg = dict(doc["segments"][0], offsets=base64.b64encode(bitmap).decode())
    only_ours(M.Manifest.from_json, json.dumps(dict(doc, segments=[seg])).encode(), "m.json")


@SETTINGS
@given(st.sampled_from(["format_version", "store_id", "digest", "created_ms", "topics",
                        "topic_configs", "partitions", "topic_ids", "features"]),
       json_mutations())
def test_issue44_store_json_checksum_valid(key, value):
    doc = json.loads(StoreMeta("id", bytes(16), 1, {"t": {}}).to_json())
    only_ours(StoreMeta.from_json, rechecked(dict(doc, **{key: value})), "store.json")


@SETTINGS
@given(json_mutations(), st.sampled_from(["inputs", "outputs", "cleaned_offset", "last_run",
                                          "segments", "version"]))
def test_issue44_swap_plan_and_checkpoint(value, key):
    plan = json.loads(swap.SwapPlan([0], [0], 5, None, None).to_json())
    only_ours(swap.SwapPlan.from_json, json.dumps(dict(plan, **{key: value})).encode(), "p")
    fs = MemoryBackend()
    fs.write_atomic("p/compaction.checkpoint", json.dumps(
        {"version": 1, "cleaned_offset": value, "last_run": value}).encode())
    only_ours(swap.read_checkpoint, fs, "p")


# -- replication: digest frames ----------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 32 - 1), st.binary(max_size=200))
def test_issue44_digest_frames(n, klen, body):
    from kcompact.replication.protocol import FrameReader
    head = b"KCD1" + struct.pack("<II", n, klen)
    only_ours(lambda: list(FrameReader().feed(head + body)))


# -- the issue's case, through the command line -------------------------------------------------


def test_issue44_a_crafted_lean_index_is_one_line_in_every_command(tmp_path):
    """A lean index whose header claims 2^40 records, its header CRC and the segment list's
    checksum recomputed to match: verify reports it, dump, kv build and compact fail with one
    line naming it (they raised MemoryError: 'Unable to allocate 48.0 TiB')."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_issue44_repair import build, run

    from kcompact.reput import filenames as fn
    from kcompact.reput.backend import LocalBackend
    url = str(tmp_path / "s")
    build(url)
    fs = LocalBackend(url)
    pdir = fn.partition_dir("t", 0)
    lst = SL.read(fs, pdir)
    i, m = next((i, m) for i, m in enumerate(lst.segments) if m.format == 2 and m.records)
    path = f"{pdir}/{fn.base_name(m.base)}{fn.INDEX_SUFFIX}"
    raw = with_header(fs.read(path), records=1 << 40)
    fs.write_atomic(path, raw)
    from dataclasses import replace
    segs = list(lst.segments)
    segs[i] = replace(m, bcq_size=len(raw), bcq_crc32c=SL.crc32c(raw))
    SL.write(fs, pdir, replace(lst, segments=segs))
    with bounded_memory():
        code, out, _ = run("verify", "--store", url)
        assert code == 1 and path in out and out.splitlines()[-1].startswith("CORRUPT:")
        for argv in (["dump", "--store", url, "--topic", "t", "--partition", "0"],
                     ["kv", "build", "--store", url, "--topic", "t", "--db",
                      str(tmp_path / "db")],
                     ["compact", "--store", url, "--force"]):
            code, _, err = run(*argv)
            last = err.strip().splitlines()[-1]
            assert code == 1 and last.startswith("kcompact: error: ") and path in last, err
            assert "MemoryError" not in err and "KCOMPACT_DEBUG" not in err
