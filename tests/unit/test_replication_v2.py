"""Replication protocol version 2, the pieces (docs/formats/replication-protocol.md,
"Version 2: stored batches"): the segments paths and queries, the version negotiation, the
master's listing and ranged reads, and the replica's check-and-install of a shipped segment
(replication/shipped.py) on real stores: the .log installed byte for byte, the lean index
rebuilt under the replica's secret, a damaged batch or index refused with nothing installed.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kcompact.replication.client import negotiate
from kcompact.replication.errors import ProtocolError, ReplicationError, RequestError
from kcompact.replication.master_store import MasterStore
from kcompact.replication.protocol import (ServerLimits, parse_path, parse_query,
                                           segment_file_path, serve_protocols)
from kcompact.replication import shipped
from kcompact.replication.shipped import (Incoming, ShippedInstall, ShippedSegmentError,
                                          install_shipped, roll_past_shipped)
from kcompact.reput import filenames as fn
from kcompact.reput.partition import PartitionLog
from kcompact.reput.record import Record, RecordBatch
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

from .test_cli import _flip

TOPIC = "t"
URL = "http://127.0.0.1:1"


# -- paths, queries, versions ------------------------------------------------------------------


def test_segments_paths():
    r = parse_path("/v1/topics/t/partitions/3/segments")
    assert (r.kind, r.topic, r.partition) == ("segments", "t", 3)
    r = parse_path(segment_file_path("t", 3, 1200, "log"))
    assert (r.kind, r.base, r.file) == ("segment_file", 1200, "log")
    assert parse_path("/v1/topics/t/partitions/3/segments/0/index").file == "index"
    for bad, status in (("/v1/topics/t/partitions/3/segments/-1/log", 400),
                        ("/v1/topics/t/partitions/3/segments/x/log", 400),
                        ("/v1/topics/t/partitions/3/segments/99999999999999999999/log", 400),
                        ("/v1/topics/t/partitions/3/segments/0/data", 404),
                        ("/v1/topics/t/partitions/3/segments/0", 404)):
        with pytest.raises(RequestError) as e:
            parse_path(bad)
        assert e.value.status == status, bad


def test_segment_file_query_needs_the_id():
    lim = ServerLimits()
    q = parse_query("segment_file", {"id": "1f-0a0b0c0d", "from": "10"}, lim)
    assert (q.segment_id, q.from_offset, q.max_bytes) == ("1f-0a0b0c0d", 10,
                                                         lim.default_max_bytes)
    for params, status in (({}, 400), ({"id": "../x"}, 400), ({"id": "1-0", "from": "1"}, 400),
                           ({"id": "1f-0a0b0c0d", "max_bytes": str(lim.max_bytes + 1)}, 413),
                           ({"id": "1f-0a0b0c0d", "check": "1"}, 400)):
        with pytest.raises(RequestError) as e:
            parse_query("segment_file", params, lim)
        assert e.value.status == status, params


def test_negotiate():
    assert negotiate({"protocol": 1, "protocols": [1, 2]}, URL) == (2, None)
    assert negotiate({"protocol": 1, "protocols": [1, 2]}, URL, 1) == (1, None)  # forced
    v, note = negotiate({"protocol": 1}, URL)  # a master before version 2
    assert v == 1 and "speaks replication protocol 1 only" in note and URL in note
    v, note = negotiate({"protocol": 1, "protocols": [1]}, URL)
    assert v == 1 and note
    assert negotiate({"protocol": 1, "protocols": [1, 2, 3]}, URL) == (2, None)
    with pytest.raises(ProtocolError, match="protocol 3, this kcompact speaks 1 and 2"):
        negotiate({"protocol": 3, "protocols": [3]}, URL)
    with pytest.raises(ProtocolError, match="not a list"):
        negotiate({"protocols": "2"}, URL)


def test_serve_protocols():
    assert serve_protocols({}) == (1, 2)
    assert serve_protocols({"KCOMPACT_SERVE_PROTOCOLS": "1"}) == (1,)
    assert serve_protocols({"KCOMPACT_SERVE_PROTOCOLS": "2,1"}) == (1, 2)
    for bad in ("2", "1 3", "x"):
        with pytest.raises(ReplicationError, match="KCOMPACT_SERVE_PROTOCOLS"):
            serve_protocols({"KCOMPACT_SERVE_PROTOCOLS": bad})


# -- the master's listing and ranges, the replica's install -----------------------------------


def _records(n: int, start: int = 0) -> list[Record]:
    out = []
    for o in range(start, start + n):
        key = None if o % 41 == 7 else b"k%04d" % (o % 700)
        value = None if o % 13 == 2 and key is not None else b'{"n": %d, "s": "shipped"}' % o
        hdr = (("h", b"%d" % o),) if o % 9 == 0 else ()
        out.append(Record(TOPIC, 0, 3 * o, 1_700_000_000_000 + o, key, value, hdr))
    return out


@pytest.fixture
def master(tmp_path):
    """A store whose partition 0 has sealed format-2 segments (zstd, 8 KiB batches) and a
    format-1 active tail."""
    path = str(tmp_path / "master")
    with Store.open(path, writer="w", create=True) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 65536, "compression.batch.bytes": 8192})
        st.append(RecordBatch.from_records(TOPIC, _records(5000)))
        st.flush()
    return path


def _listing(path: str) -> dict:
    ms = MasterStore(path, ServerLimits())
    try:
        return ms.segments(TOPIC, 0), ms
    except BaseException:
        ms.store.close()
        raise


def _download(ms: MasterStore, incoming: Incoming, seg: dict, chunk: int = 5000) -> None:
    have = incoming.prepare(seg)
    for file, size in (("index", seg["index_size"]), ("log", seg["log_size"])):
        pos = have[file]
        while pos < size:
            data, total = ms.segment_file(TOPIC, 0, seg["base"], file, seg["id"], pos, chunk)
            assert total == size and data
            incoming.write(seg["base"], file, data)
            pos += len(data)


def _range(ms: MasterStore, *args, zero_copy: bool) -> tuple[bytes, int]:
    """``segment_file``'s bytes, read from the fd it hands out for sendfile with zero_copy."""
    got, size = ms.segment_file(TOPIC, 0, *args, zero_copy=zero_copy)
    if not zero_copy:
        return got, size
    try:
        return os.pread(got.fd, got.nbytes, got.start), size
    finally:
        got.close()


@pytest.mark.parametrize("zero_copy", [False, True])
def test_listing_and_ranges(master, zero_copy):
    doc, ms = _listing(master)
    try:
        segs = doc["segments"]
        sealed = [s for s in segs if s["format"] == 2 and s["sealed"]]
        assert len(sealed) >= 2 and segs[-1]["format"] == 1 and not segs[-1]["sealed"]
        assert all("id" not in s for s in segs if not s["sealed"])
        assert doc["next_offset"] == 3 * 4999 + 1
        s = sealed[0]
        pl = ms.store.partition(TOPIC, 0)
        log = open(os.path.join(master, pl.log_path(s["base"])), "rb").read()
        data, size = _range(ms, s["base"], "log", s["id"], 100, 1000, zero_copy=zero_copy)
        assert size == len(log) == s["log_size"] and data == log[100:1100]
        data, _ = _range(ms, s["base"], "log", s["id"], size - 10, 1000, zero_copy=zero_copy)
        assert data == log[-10:]
        idx = open(os.path.join(master, pl.log_path(s["base"])[:-4] + ".bcq"), "rb").read()
        data, isize = _range(ms, s["base"], "index", s["id"], 0, 1 << 20, zero_copy=zero_copy)
        assert isize == len(idx) == s["index_size"] and data == idx
        for args, status in (((s["base"], "log", "0-00000000", 0, 10), 409),
                             ((s["base"] + 1, "log", s["id"], 0, 10), 404),
                             ((segs[-1]["base"], "log", s["id"], 0, 10), 404),
                             ((s["base"], "log", s["id"], size + 1, 10), 416)):
            with pytest.raises(RequestError) as e:
                ms.segment_file(TOPIC, 0, *args, zero_copy=zero_copy)
            assert e.value.status == status, args
    finally:
        ms.store.close()


def test_a_file_replaced_while_its_range_is_checked_is_not_handed_out(master, monkeypatch):
    """The fd for sendfile is opened before the version check: a swap that renames another
    file over the path meanwhile is a 409 (list again), never the other file's bytes."""
    doc, ms = _listing(master)
    try:
        s = next(x for x in doc["segments"] if x["format"] == 2 and x["sealed"])
        path = os.path.join(master, ms.store.partition(TOPIC, 0).log_path(s["base"]))
        checks = MasterStore._segment_checks

        def swapped(*args):
            with open(path + ".new", "wb") as f:
                f.write(open(path, "rb").read())  # same bytes and size: only the file differs
            os.rename(path + ".new", path)
            return checks(*args)
        monkeypatch.setattr(MasterStore, "_segment_checks", staticmethod(swapped))
        before = len(os.listdir(f"/proc/{os.getpid()}/fd"))
        with pytest.raises(RequestError) as e:
            ms.segment_file(TOPIC, 0, s["base"], "log", s["id"], 0, 100, zero_copy=True)
        assert e.value.status == 409 and "changed while it was read" in str(e.value)
        assert len(os.listdir(f"/proc/{os.getpid()}/fd")) == before  # its fd closed
        monkeypatch.setattr(MasterStore, "_segment_checks", staticmethod(checks))
        data, _ = _range(ms, s["base"], "log", s["id"], 0, 100, zero_copy=True)
        assert data == open(path, "rb").read(100)
    finally:
        ms.store.close()


def _replica(tmp_path):
    st = Store.open(str(tmp_path / "replica"), create=True)
    staging = PartitionLog(st.fs, TOPIC, 0, st.secret, st.topic_config(TOPIC), writable=True,
                           sub=fn.REPLICATING_DIR, clock=st.clock)
    return st, staging


def test_install_shipped_copies_batches_and_reindexes_under_its_own_secret(master, tmp_path):
    doc, ms = _listing(master)
    st, staging = _replica(tmp_path)
    try:
        sealed = [s for s in doc["segments"] if s["format"] == 2 and s["sealed"]]
        incoming = Incoming(staging.fs, TOPIC, 0)
        total = 0
        for s in sealed:
            _download(ms, incoming, s)
            total += install_shipped(st, staging, incoming, TOPIC, 0, s, -1, 0)
            assert not st.fs.exists(incoming.dir)
        assert total == sum(s["records"] for s in sealed)
        mpl = ms.store.partition(TOPIC, 0)
        staging.sync()
        for s in sealed:
            mine = [g for g in staging.segments if g.base == s["base"]][0]
            assert mine.format == 2
            a = open(os.path.join(master, mpl.log_path(s["base"])), "rb").read()
            b = open(os.path.join(str(tmp_path / "replica"), staging.log_path(s["base"])),
                     "rb").read()
            assert a == b  # byte for byte
            theirs = [g for g in mpl.segments if g.base == s["base"]][0].entries()
            ours = mine.entries()
            for col in ("offset", "timestamp", "flags", "position", "size"):
                assert np.array_equal(ours[col], theirs[col]), col
            keyed = (ours["flags"] & 2) == 0
            assert not np.array_equal(ours["digest_lo"][keyed], theirs["digest_lo"][keyed])
        # the records read back are the master's, and later records go to a format-1 segment
        assert staging.segments[-1].format == 1
        got = [(r.offset, r.key, r.value, r.headers) for r in staging.iter_records()]
        want = [(r.offset, r.key, r.value, r.headers)
                for r in mpl.iter_records() if r.offset <= sealed[-1]["last_offset"]]
        assert got == want
        assert st.meta.format_version == 2
    finally:
        staging.close()
        st.close()
        ms.store.close()
    # the replica store, with the staging as it stands, verifies (key digests under its secret)
    shutil.copytree(tmp_path / "replica" / fn.replicating_dir(TOPIC, 0),
                    tmp_path / "replica" / fn.partition_dir(TOPIC, 0), dirs_exist_ok=True)
    with Store.open(str(tmp_path / "replica")) as rs:
        assert verify_store(rs).ok


@pytest.mark.parametrize("what", ["log", "index"])
def test_a_damaged_segment_is_refused_and_nothing_installed(master, tmp_path, what):
    doc, ms = _listing(master)
    st, staging = _replica(tmp_path)
    try:
        s = next(s for s in doc["segments"] if s["format"] == 2 and s["sealed"])
        incoming = Incoming(staging.fs, TOPIC, 0)
        _download(ms, incoming, s)
        local = os.path.join(str(tmp_path / "replica"), incoming.path(s["base"], what))
        bpos = ms.store.partition(TOPIC, 0).segments[0].index().batches()[0]
        at = int(bpos[2]) + 70 if what == "log" else s["index_size"] - 5
        _flip(local, at)
        before = sorted(os.listdir(os.path.join(str(tmp_path / "replica"), staging.dir)))
        with pytest.raises(ShippedSegmentError) as e:
            install_shipped(st, staging, incoming, TOPIC, 0, s, -1, 0)
        if what == "log":
            assert f"corrupt record batch at byte {int(bpos[2])}" in str(e.value)
            assert "batch CRC mismatch" in str(e.value)
            assert e.value.position == int(bpos[2])
        else:
            assert "lean index chunk" in str(e.value)
        assert f"{fn.base_name(s['base'])}" in str(e.value)
        assert staging.record_count() == 0
        after = sorted(os.listdir(os.path.join(str(tmp_path / "replica"), staging.dir)))
        assert [n for n in after if n.endswith(".log") and os.path.getsize(
            os.path.join(str(tmp_path / "replica"), staging.dir, n))] == []
        assert ".compacting" not in after and set(before) <= set(after)
    finally:
        staging.close()
        st.close()
        ms.store.close()


@pytest.fixture
def master_chunked(tmp_path, monkeypatch):
    """``master``, its lean indexes in chunks of 64 entries (several a segment)."""
    from kcompact.reput import bcq2
    monkeypatch.setattr(bcq2, "CHUNK_ENTRIES", 64)
    path = str(tmp_path / "master")
    with Store.open(path, writer="w", create=True) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 65536, "compression.batch.bytes": 8192})
        st.append(RecordBatch.from_records(TOPIC, _records(5000)))
        st.flush()
    monkeypatch.undo()
    return path


def _download_log_to(ms: MasterStore, incoming: Incoming, seg: dict, upto: int,
                     chunk: int = 5000) -> None:
    """The index whole, the .log up to byte ``upto`` (a download under way)."""
    path = incoming.fs.local_path(incoming.path(seg["base"], "log"))
    have = incoming.prepare(seg)
    for file, size in (("index", seg["index_size"]), ("log", upto)):
        pos = os.path.getsize(path) if file == "log" and os.path.exists(path) else have[file]
        while pos < size:
            data, _ = ms.segment_file(TOPIC, 0, seg["base"], file, seg["id"], pos,
                                      min(chunk, size - pos))
            incoming.write(seg["base"], file, data)
            pos += len(data)


def test_a_segment_checked_a_block_at_a_time_as_it_arrives_installs_the_same(
        master_chunked, tmp_path, monkeypatch):
    doc, ms = _listing(master_chunked)
    s = max((s for s in doc["segments"] if s["format"] == 2 and s["sealed"]),
            key=lambda s: s["log_size"])
    whole = {}
    for mode in ("at once", "as it arrives"):
        st, staging = _replica(tmp_path / mode)
        try:
            incoming = Incoming(staging.fs, TOPIC, 0)
            if mode == "at once":
                _download(ms, incoming, s)
                install_shipped(st, staging, incoming, TOPIC, 0, s, -1, 0)
            else:
                monkeypatch.setattr(shipped, "INSTALL_BLOCK", 2048)  # several blocks
                _download_log_to(ms, incoming, s, 0)
                inst = ShippedInstall(st, staging, incoming, TOPIC, 0, s, -1, 0)
                assert len(inst.groups) > 3 and not inst.ready(0)
                fed = []
                for upto in range(0, s["log_size"] + 1, 1500):
                    _download_log_to(ms, incoming, s, upto)
                    if inst.ready(upto):
                        inst.feed(upto)
                        fed.append(inst.done)
                    assert inst.done < len(inst.groups) or upto >= inst.ends[-1]
                assert len(fed) > 2 and fed == sorted(fed)  # blocks checked before the end
                assert staging.record_count() == 0  # nothing installed before finish
                _download_log_to(ms, incoming, s, s["log_size"])
                inst.finish()
            mine = [g for g in staging.segments if g.base == s["base"]][0]
            root = tmp_path / mode / "replica"
            whole[mode] = [open(root / staging.log_path(mine.base), "rb").read(),
                           mine.entries()]
        finally:
            staging.close()
            st.close()
    ms.store.close()
    a, b = whole["at once"], whole["as it arrives"]
    assert a[0] == b[0]
    for col in ("offset", "timestamp", "flags", "position", "size", "clean_time"):
        assert np.array_equal(a[1][col], b[1][col]), col


def test_a_damaged_batch_is_found_while_the_rest_is_still_on_the_wire(master_chunked, tmp_path,
                                                                       monkeypatch):
    doc, ms = _listing(master_chunked)
    s = max((s for s in doc["segments"] if s["format"] == 2 and s["sealed"]),
            key=lambda s: s["log_size"])
    st, staging = _replica(tmp_path)
    monkeypatch.setattr(shipped, "INSTALL_BLOCK", 2048)
    try:
        incoming = Incoming(staging.fs, TOPIC, 0)
        _download_log_to(ms, incoming, s, 0)
        inst = ShippedInstall(st, staging, incoming, TOPIC, 0, s, -1, 0)
        k = len(inst.groups) // 2
        bad = inst.group_starts[k]  # the first batch of a block in the middle
        upto = inst.ends[k]
        _download_log_to(ms, incoming, s, upto)
        _flip(str(tmp_path / "replica" / incoming.path(s["base"], "log")), bad + 70)
        with pytest.raises(ShippedSegmentError) as e:
            inst.feed(upto)
        assert f"corrupt record batch at byte {bad}" in str(e.value)
        assert e.value.position == bad and upto < s["log_size"]
        assert inst.done == k  # the blocks before it were checked
        assert staging.record_count() == 0
        assert not (tmp_path / "replica" / staging.dir / ".compacting").exists()
    finally:
        staging.close()
        st.close()
        ms.store.close()


def test_a_resumed_download_continues_and_a_crash_before_the_roll_is_rolled(master, tmp_path):
    doc, ms = _listing(master)
    st, staging = _replica(tmp_path)
    try:
        s = next(s for s in doc["segments"] if s["format"] == 2 and s["sealed"])
        incoming = Incoming(staging.fs, TOPIC, 0)
        have = incoming.prepare(s)
        assert have == {"log": 0, "index": 0}
        data, _ = ms.segment_file(TOPIC, 0, s["base"], "log", s["id"], 0, 3000)
        incoming.write(s["base"], "log", data)
        assert incoming.prepare(s) == {"log": 3000, "index": 0}  # same version: resumed
        other = {**s, "id": "1-00000000"}
        assert incoming.prepare(other) == {"log": 0, "index": 0}  # another version: dropped
        _download(ms, incoming, s)
        install_shipped(st, staging, incoming, TOPIC, 0, s, -1, 0)
    finally:
        ms.store.close()
    last = staging.segments[-1]
    assert last.log_size == 0
    staging.close()
    # the pull's log opens again with the shipped segment sealed (no segment list there: the
    # lean index checks itself, the format-1 index rules do not apply)
    staging = PartitionLog(st.fs, TOPIC, 0, st.secret, st.topic_config(TOPIC), writable=True,
                           sub=fn.REPLICATING_DIR, clock=st.clock)
    assert [g.format for g in staging.segments] == [2, 1]
    staging.close()
    # as if the process died between the install and the roll past it
    rdir = os.path.join(str(tmp_path / "replica"), fn.replicating_dir(TOPIC, 0))
    for suffix in (".log", ".bcq"):
        os.unlink(os.path.join(rdir, fn.base_name(last.base) + suffix))
    staging = PartitionLog(st.fs, TOPIC, 0, st.secret, st.topic_config(TOPIC), writable=True,
                           sub=fn.REPLICATING_DIR, clock=st.clock)
    try:
        assert staging.segments[-1].format == 2
        roll_past_shipped(staging)
        assert staging.segments[-1].log_size == 0
        assert staging.segments[-1].base == s["last_offset"] + 1
    finally:
        staging.close()
        st.close()
