"""Issue 27, "No silent loss": regressions named after the defects (the command line as a user
runs it, one subprocess per command, on a closed local store).

* a deleted segment (.log gone, its .bcq left) went unnoticed by `verify` and `dump`;
* a zeroed 4 KiB range of a .bcq made `dump` skip good records with exit 0, and `compact
  --force` then wrote a partition that no longer read;
* opening a store for write repaired sealed segments (truncated a .log at a bad CRC, deleted an
  orphan .bcq): the evidence `verify` needs;
* metadata files that raised untyped errors (a nested store.json or manifest, a manifest's empty
  bitmap or absurd offsets).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import pytest

from kcompact.reput import bcq as B
from kcompact.reput import filenames as fn
from kcompact.reput import manifest as M
from kcompact.reput.segment_desc import SegmentDesc
from kcompact.reput import segment_list as SL
from kcompact.reput.backend import LocalBackend
from kcompact.reput.errors import CorruptRecordError, StoreFormatError
from kcompact.reput.store import Store, StoreMeta

sys.path.insert(0, os.path.dirname(__file__))

from test_cli import TOPIC, error_lines, kcompact, keyed_store  # noqa: E402


def snapshot(url: str) -> dict[str, bytes]:
    """Every file of a store and its bytes (lock files are created empty by readers)."""
    out = {}
    for root, _dirs, files in os.walk(url):
        for name in files:
            p = os.path.join(root, name)
            if name.endswith(".lock") or name == "damage.json":
                continue  # (damage.json: damage a reader or compaction found, recorded: issue 51)
            with open(p, "rb") as f:
                out[os.path.relpath(p, url)] = f.read()
    return out


def sealed_files(url: str) -> list[str]:
    """The partition's segment files, in order: [.bcq, .log, .bcq, .log, ...]."""
    d = os.path.join(url, fn.partition_dir(TOPIC, 0))
    return sorted(n for n in os.listdir(d) if n.endswith((".log", ".bcq")))


def dump(url: str):
    return kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "0", "--json")


def assert_one_line_error(proc, *, names: str) -> str:
    assert proc.returncode == 1, (proc.stdout[-500:], proc.stderr)
    lines = error_lines(proc)  # (compact's progress lines come first)
    assert [ln for ln in lines if ln.startswith("kcompact: error: ")] == lines[-1:], lines
    assert "KCOMPACT_DEBUG" not in lines[-1]  # a typed error, not an unexpected exception
    assert names in lines[-1], lines[-1]
    return lines[-1]


def test_issue27_deleted_segment_is_refused_not_skipped(tmp_path):
    url = keyed_store(tmp_path)
    files = sealed_files(url)
    first_log = files[1]
    assert first_log.endswith(".log") and len(files) >= 8
    os.remove(os.path.join(url, fn.partition_dir(TOPIC, 0), first_log))
    before = snapshot(url)

    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 1, proc.stdout
    assert any(first_log in ln and "missing" in ln for ln in proc.stdout.splitlines()[:-1])
    assert proc.stdout.splitlines()[-1].startswith("CORRUPT:")

    assert_one_line_error(dump(url), names=first_log)
    assert_one_line_error(kcompact("compact", "--store", url, "--topic", TOPIC, "--partition",
                                   "0", "--force"), names=first_log)
    assert_one_line_error(kcompact("kv", "build", "--store", url, "--topic", TOPIC, "--db",
                                   str(tmp_path / "db")), names=first_log)
    assert snapshot(url) == before


@pytest.mark.parametrize("seal_format", [1, 2])
def test_issue27_zeroed_bcq_range_dumps_the_prefix_then_fails_and_compaction_refuses(
        tmp_path, seal_format):
    """Format 1: the records before the damaged entry are dumped. Format 2: a lean index is
    checked whole (header, directory, chunk CRCs), so the records of the segments before it."""
    url = keyed_store(tmp_path, n=1400, keys=200, seal_format=seal_format)
    d = os.path.join(url, fn.partition_dir(TOPIC, 0))
    files = sealed_files(url)
    # a sealed segment in the middle whose .bcq holds more than 4 KiB: zero [48, 48 + 4096)
    bcqs = [n for n in files if n.endswith(".bcq")]
    victim = bcqs[len(bcqs) // 2]
    path = os.path.join(d, victim)
    assert os.path.getsize(path) >= 48 + 4096 or os.path.getsize(path) > 96
    with open(path, "r+b") as f:
        f.seek(B.ENTRY_SIZE)
        f.write(bytes(min(4096, os.path.getsize(path) - B.ENTRY_SIZE)))
    before = snapshot(url)
    victim_base = int(victim.split(".")[0])

    proc = dump(url)
    line = assert_one_line_error(proc, names=victim.replace(".bcq", ""))
    got = [json.loads(ln)["offset"] for ln in proc.stdout.splitlines()]
    # the good prefix: every record before the damaged entry, in order, nothing after it
    if seal_format == 1:
        assert got == list(range(victim_base + 1)), (got[-3:], line)
        assert f"up to offset {victim_base}" in line
    else:
        assert got == list(range(victim_base)), (got[-3:], line)
        assert "lean index" in line

    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 1 and victim in proc.stdout

    proc = kcompact("compact", "--store", url, "--topic", TOPIC, "--partition", "0", "--force")
    assert_one_line_error(proc, names=victim)
    assert snapshot(url) == before  # refused before anything was written

    proc = kcompact("kv", "build", "--store", url, "--topic", TOPIC, "--db",
                    str(tmp_path / "db"))
    assert_one_line_error(proc, names=victim.replace(".bcq", ""))
    assert snapshot(url) == before


def test_issue27_open_for_write_does_not_repair_a_sealed_segment(tmp_path):
    url = keyed_store(tmp_path)
    d = os.path.join(url, fn.partition_dir(TOPIC, 0))
    files = sealed_files(url)
    bcq = os.path.join(d, files[2])  # the second segment's .bcq, sealed
    with open(bcq, "r+b") as f:
        f.truncate(os.path.getsize(bcq) - B.ENTRY_SIZE)
    before = snapshot(url)
    with pytest.raises(CorruptRecordError) as ei:
        with Store.open(url, writer="w") as s:
            s.writable_partition(TOPIC, 0)
    assert files[2] in str(ei.value)
    assert snapshot(url) == before  # the .log was not cut, nothing rebuilt


def test_issue27_open_for_write_keeps_an_orphan_bcq(tmp_path):
    url = keyed_store(tmp_path)
    d = os.path.join(url, fn.partition_dir(TOPIC, 0))
    files = sealed_files(url)
    os.remove(os.path.join(d, files[3]))  # the second segment's .log
    before = snapshot(url)
    with pytest.raises(CorruptRecordError) as ei:
        with Store.open(url, writer="w") as s:
            s.writable_partition(TOPIC, 0)
    assert files[3] in str(ei.value)
    assert snapshot(url) == before
    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 1 and files[3] in proc.stdout


def test_issue27_active_segment_torn_tail_is_still_repaired(tmp_path):
    """Repair on open touches the active segment: a crash's torn tail is cut."""
    url = keyed_store(tmp_path)
    d = os.path.join(url, fn.partition_dir(TOPIC, 0))
    # the state a crashed writer leaves: its active segment listed open, a torn tail
    fs = LocalBackend(url)
    lst = SL.read(fs, fn.partition_dir(TOPIC, 0))
    last = lst.segments[-1]
    SL.write(fs, fn.partition_dir(TOPIC, 0), replace(lst, segments=lst.segments[:-1]
                                                     + [SegmentDesc(last.base)]))
    active = os.path.join(fn.partition_dir(TOPIC, 0), fn.base_name(last.base) + ".log")
    with open(os.path.join(url, active), "ab") as f:
        f.write(b"\x00torn")
    with Store.open(url, writer="w") as s:
        s.writable_partition(TOPIC, 0)
    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 0, proc.stdout
    assert len([json.loads(ln) for ln in dump(url).stdout.splitlines()]) == 400


# -- metadata that raised untyped errors -----------------------------------------------------


def test_issue27_nested_store_json_is_a_format_error(tmp_path):
    with pytest.raises(StoreFormatError, match="nested too deeply"):
        StoreMeta.from_json(b"[" * 100_000 + b"]" * 100_000, "s/store.json")
    url = keyed_store(tmp_path, n=10)
    with open(os.path.join(url, fn.STORE_JSON), "wb") as f:
        f.write(b'{"a":' * 50_000 + b"1" + b"}" * 50_000)
    assert_one_line_error(kcompact("inspect", "--store", url), names="store.json")


def test_issue27_store_json_checksum(tmp_path):
    url = keyed_store(tmp_path, n=10)
    p = os.path.join(url, fn.STORE_JSON)
    doc = json.loads(open(p, "rb").read())
    assert "crc32c" in doc
    doc["created_ms"] += 1
    with open(p, "w") as f:
        json.dump(doc, f)
    assert_one_line_error(kcompact("verify", "--store", url), names="checksum")


def _manifest(**over) -> bytes:
    e = SegmentDesc.from_entries(100, fn.segment_object(100, "0123456789abcdef", ".log"),
                                 fn.segment_object(100, "0123456789abcdef", ".bcq"), 500,
                                 __import__("numpy").array([100, 101, 105], "int64"))
    d = {"format_version": 1, "version": 3, "created_ms": 1, "writer": "w",
         "cleaned_offset": -1, "next_offset": 106, "last_run": None,
         "segments": [e.to_manifest_dict()], "retired": []}
    for k, v in over.items():
        if k.startswith("seg_"):
            d["segments"][0][k[4:]] = v
        else:
            d[k] = v
    return json.dumps(d).encode()


@pytest.mark.parametrize("over, what", [
    ({"seg_offsets": ""}, "offsets"),
    ({"seg_offsets": "AAAA"}, "bitmap"),
    ({"seg_last_offset": 2 ** 70}, "last_offset"),
    ({"next_offset": 2 ** 70}, "next_offset"),
    ({"seg_records": 7}, "bitmap holds"),
    ({"seg_log": "../../etc/passwd"}, "segment object"),
    ({"segments": {"a": 1}}, "not a list"),
])
def test_issue27_manifest_is_validated(over, what):
    assert M.Manifest.from_json(_manifest(), "m.json").next_offset == 106
    with pytest.raises(CorruptRecordError, match=what) as ei:
        M.Manifest.from_json(_manifest(**over), "m.json")
    assert str(ei.value).startswith("m.json: ")


def test_issue27_nested_manifest_is_a_corruption_error():
    with pytest.raises(CorruptRecordError, match="nested too deeply"):
        M.Manifest.from_json(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "m.json")


@pytest.mark.parametrize("over, what", [
    ({"seg_offsets": ""}, "offsets"),
    ({"seg_last_offset": 2 ** 70}, "last_offset"),
])
def test_issue27_damaged_s3_manifest_through_the_cli(tmp_path, over, what):
    """On S3 (the in-memory fake, the CLI run in-process): `inspect`, `verify` and `dump` on a
    manifest with an empty bitmap or an offset beyond 2^63 each exit 1 with one line naming the
    manifest (they raised IndexError / ValueError, or showed the absurd offset and exited 0)."""
    import contextlib
    import io

    from _stores import backend_env, store_url

    from kcompact.connectors.cli import main
    with backend_env("s3", tmp_path) as fake:
        url = store_url("s3", tmp_path)
        Store.create(url).close()  # per-partition uploads: a manifest that lists the records
        with Store.open(url, writer="w", create=True) as s:
            s.append(__import__("kcompact.reput.record", fromlist=["RecordBatch"]).RecordBatch
                     .from_records(TOPIC, [(0, i, 1000 + i, b"k%d" % (i % 7), b"v") for i in
                                           range(50)]))
            s.flush()
        objs = fake.objects["bucket"]
        key = max(k for k in objs if "/manifest/" in k and objs[k][0])
        doc = json.loads(objs[key][0])
        for k, v in over.items():
            doc["segments"][0][k[4:]] = v
        objs[key] = (json.dumps(doc).encode(), objs[key][1])
        for argv in (["inspect", "--store", url], ["verify", "--store", url],
                     ["dump", "--store", url, "--topic", TOPIC, "--partition", "0"]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
            assert code == 1 and "KCOMPACT_DEBUG" not in err.getvalue(), (argv, err.getvalue())
            if argv[0] == "verify":  # the problem listed, naming the manifest
                lines = out.getvalue().splitlines()
                assert lines[-1].startswith("CORRUPT:") and any(
                    "/manifest/" in ln and what in ln for ln in lines[:-1]), lines
            else:
                lines = err.getvalue().splitlines()
                # inspect names the damaged partition first (issue 44: every partition shown)
                head = "kcompact: error: t-0 is damaged: s3://" if argv[0] == "inspect" else \
                    "kcompact: error: s3://"
                assert len(lines) == 1 and lines[0].startswith(head), lines
                assert "/manifest/" in lines[0] and what in lines[0], lines
