"""`kcompact inspect`, `dump`, `verify` and `compact` (connectors/cli.py ``main``, in-process)
on a local store and on an S3 store in the in-memory S3 (tests/unit/_stores.py): the same
answers on both, and a corrupted segment is named by `verify` and never dumped.
tests/integration/test_s3.py runs the commands as processes on both kinds of store (SeaweedFS).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend, store_at  # noqa: E402,F401

from kcompact.connectors import cli  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402

TOPIC = "t"


def _fill(url: str) -> None:
    with Store.open(url, writer="w", create=True) as st:
        st.set_topic_config(TOPIC, {"segment.bytes": 16384})
        for lo in range(0, 1200, 300):
            st.append(RecordBatch.from_records(TOPIC, [
                (i % 2, i, 1_000 + i, b"k%d" % (i % 50), None if i % 9 == 0 else b"v%d" % i)
                for i in range(lo, lo + 300)]))
            st.flush()


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _drop_caches() -> None:
    """An S3 reader in this process shares the block cache and spool with the writer."""
    from kcompact.reput.s3 import shared_cache, shared_spool
    shared_cache().clear()
    shared_spool().clear()


def test_inspect_dump_verify_compact(store_at, capsys):
    url = store_at("s")
    _fill(url)
    rc, out, err = _cli(capsys, "inspect", "--store", url, "--json")
    assert rc == 0, err
    parts = {p["partition"]: p for p in json.loads(out)["topics"][0]["partitions"]}
    assert {q: (p["records"], p["first_offset"], p["next_offset"]) for q, p in parts.items()} \
        == {0: (600, 0, 1199), 1: (600, 1, 1200)}
    assert parts[0]["tombstones"] == sum(1 for i in range(0, 1200, 2) if i % 9 == 0)
    rc, out, err = _cli(capsys, "dump", "--store", url, "--topic", TOPIC, "--partition", "1",
                        "--from-offset", "500", "--limit", "3", "--json")
    assert rc == 0, err
    assert [json.loads(line)["offset"] for line in out.splitlines()] == [501, 503, 505]
    rc, out, err = _cli(capsys, "verify", "--store", url, "--json")
    assert rc == 0 and json.loads(out)["ok"] and json.loads(out)["records"] == 1200, out + err
    rc, out, err = _cli(capsys, "compact", "--store", url, "--force", "--json")
    assert rc == 0, err
    assert sum(r["records_kept"] for r in json.loads(out)["partitions"]) == 50
    rc, out, err = _cli(capsys, "dump", "--store", url, "--topic", TOPIC, "--partition", "0",
                        "--json")
    got = [json.loads(line) for line in out.splitlines()]
    # the latest record of each of the partition's 25 keys (tombstones kept): the last 50
    assert [d["offset"] for d in got] == list(range(1150, 1200, 2))
    rc, out, err = _cli(capsys, "verify", "--store", url)
    assert rc == 0 and out.startswith("OK"), out + err


def test_verify_names_a_corrupt_segment_and_dump_refuses_it(store_at, capsys):
    url = store_at("s")
    Store.create(url).close()  # on S3: per-partition uploads (a segment object to damage)
    _fill(url)
    with Store.open(url) as st:
        pl = st.partition(TOPIC, 0)
        seg = pl.segments[1]
        path = seg.log_path
        data = bytearray(st.fs.read(path))
        data[len(data) // 2] ^= 0xFF
        st.fs.write_atomic(path, bytes(data))  # (an S3 object is never rewritten but here)
    _drop_caches()
    rc, out, err = _cli(capsys, "verify", "--store", url)
    assert rc == 1 and path.rsplit("/", 1)[1] in out + err, out + err
    rc, out, err = _cli(capsys, "dump", "--store", url, "--topic", TOPIC, "--partition", "0")
    assert rc == 1 and err.count("\n") == 1 and "corrupt record" in err, err
    assert err.startswith("kcompact: error: ") and path.rsplit("/", 1)[1] in err
