"""The `kcompact` command line as a user runs it (a subprocess per command; no server process):
`dump --json`'s format, `inspect`'s LAST RUN column, `verify` listing every problem,
usage errors, and `compact --engine spark` on a machine without Java."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

import pytest

from kcompact.reput import bcq as B
from kcompact.reput import filenames as fn
from kcompact.reput import segment_list as SL
from kcompact.reput.backend import LocalBackend
from kcompact.reput.config import ManualClock
from kcompact.reput.record import RecordBatch
from kcompact.reput.config import WriterOptions
from kcompact.reput.store import Store

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")
TOPIC = "t"
SEG = 16384


def kcompact(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln]


def keyed_store(tmp_path, partitions: int = 1, n: int = 400, keys: int = 50,
                seal_format: int = 2) -> str:
    """A closed local store: ``n`` records of ~330 bytes over ``keys`` keys per partition, in
    16 KiB segments (about 48 records each), sealed into ``seal_format``."""
    url = str(tmp_path / "s")
    clock = ManualClock()
    s = Store.open(url, writer="w", create=True, clock=clock,
                   options=WriterOptions(seal_format=seal_format))
    s.set_topic_config(TOPIC, {"segment.bytes": SEG})
    for p in range(partitions):
        s.append(RecordBatch.from_records(TOPIC, [
            (p, i, clock.ms() + i, b"k%d" % (i % keys), b"%d:" % i + b"v" * 300)
            for i in range(n)]))
    s.flush()
    s.close()
    return url


# -- dump --json ---------------------------------------------------------------------------------


def test_dump_json_one_object_per_line_text_or_base64(tmp_path):
    url = str(tmp_path / "s")
    rows = [
        (0, 0, 1000, b"user-1", b'{"a": 1}', [("h", b"text"), ("h", b"\xff\x00"), ("n", None)]),
        (0, 1, 1001, b"\xff\xfekey", b"\x80binary", []),
        (0, 2, 1002, None, b"keyless", [("caf\u00e9", b"\xc3\xa9")]),
        (0, 5, 1005, b"user-1", None, []),              # tombstone; offsets 3-4 are a gap
        (0, 6, 1006, b"", b"", []),                     # empty key and empty value: text ""
        (0, 7, 1007, "\u00fcber".encode(), "\u2603".encode(), []),
    ]
    with Store.open(url, writer="w", create=True) as s:
        s.append(RecordBatch.from_records(TOPIC, rows))
        s.flush()
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(rows) and proc.stdout.endswith("\n")
    got = [json.loads(ln) for ln in lines]  # each line is one whole JSON object
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    assert got == [
        {"topic": TOPIC, "partition": 0, "offset": 0, "timestamp": 1000, "key": "user-1",
         "value": '{"a": 1}', "headers": [{"key": "h", "value": "text"},
                                          {"key": "h", "value": None,
                                           "value_b64": b64(b"\xff\x00")},
                                          {"key": "n", "value": None}]},
        {"topic": TOPIC, "partition": 0, "offset": 1, "timestamp": 1001,
         "key": None, "key_b64": b64(b"\xff\xfekey"),
         "value": None, "value_b64": b64(b"\x80binary"), "headers": []},
        {"topic": TOPIC, "partition": 0, "offset": 2, "timestamp": 1002, "key": None,
         "value": "keyless", "headers": [{"key": "caf\u00e9", "value": "\u00e9"}]},
        {"topic": TOPIC, "partition": 0, "offset": 5, "timestamp": 1005, "key": "user-1",
         "value": None, "headers": []},
        {"topic": TOPIC, "partition": 0, "offset": 6, "timestamp": 1006, "key": "",
         "value": "", "headers": []},
        {"topic": TOPIC, "partition": 0, "offset": 7, "timestamp": 1007, "key": "\u00fcber",
         "value": "\u2603", "headers": []},
    ]
    # null is told from binary by the absence of *_b64; --from-offset in a gap and --limit
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "0", "--json",
                    "--from-offset", "3", "--limit", "2")
    assert [json.loads(ln)["offset"] for ln in proc.stdout.splitlines()] == [5, 6]


# -- inspect: the last run -----------------------------------------------------------------------


def test_inspect_text_shows_the_last_run(tmp_path):
    url = keyed_store(tmp_path, partitions=2)
    proc = kcompact("inspect", "--store", url)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()[1:]
    assert header.split()[-2:] == ["LAST", "RUN"]
    assert len(rows) == 2 and all(r.endswith("  never") for r in rows)

    proc = kcompact("compact", "--store", url, "--topic", TOPIC, "--partition", "0", "--force")
    assert proc.returncode == 0, proc.stderr
    ckpt = os.path.join(url, fn.compaction_checkpoint(TOPIC, 0))
    when = time.strftime("%Y-%m-%d %H:%M:%SZ",
                         time.gmtime(os.stat(ckpt).st_mtime_ns // 1_000_000 / 1000))

    proc = kcompact("inspect", "--store", url)
    lines = proc.stdout.splitlines()
    col = lines[1].index("LAST RUN")
    p0 = next(ln for ln in lines[2:] if ln.split()[:2] == [TOPIC, "0"])
    p1 = next(ln for ln in lines[2:] if ln.split()[:2] == [TOPIC, "1"])
    assert p0[col:] == f"{when} kept 50 dropped 350"
    assert p1[col:] == "never"

    doc = json.loads(kcompact("inspect", "--store", url, "--json").stdout)
    parts = {p["partition"]: p for p in doc["topics"][0]["partitions"]}
    assert parts[0]["last_compaction"]["records_kept"] == 50
    assert parts[0]["last_compaction_ms"] == os.stat(ckpt).st_mtime_ns // 1_000_000
    assert parts[1]["last_compaction"] is None and parts[1]["last_compaction_ms"] is None


# -- verify: every problem, with file and byte position ------------------------------------------


def _flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_lists_every_problem_with_file_and_position(tmp_path):
    url = keyed_store(tmp_path, seal_format=1)  # format 1: a record's bytes are where it lies
    s = Store.open(url)
    pl = s.partition(TOPIC, 0)
    sealed = pl.sealed_segments
    assert len(sealed) >= 4
    entries = {seg.base: seg.entries().copy() for seg in sealed[:3]}
    logs = {seg.base: seg.log_path for seg in sealed[:3]}
    idxs = {seg.base: seg.bcq_path for seg in sealed[:3]}
    s.close()
    a, b, c = (seg.base for seg in sealed[:3])
    # a record's value in segment a and another in segment c: CRC failures at those records;
    # the timestamp of entry 2 of segment b's .bcq: an index entry that does not match its record
    rec_a, rec_c = entries[a][3], entries[c][5]
    _flip(os.path.join(url, logs[a]), int(rec_a["position"]) + int(rec_a["size"]) - 10)
    _flip(os.path.join(url, logs[c]), int(rec_c["position"]) + int(rec_c["size"]) - 10)
    _flip(os.path.join(url, idxs[b]), 2 * B.ENTRY_SIZE + B.BCQ_DTYPE.fields["timestamp"][1])
    # the segment list's checksum of b's .bcq no longer matches (docs/formats/segment-list.md)
    listed = SL.read(LocalBackend(url), fn.partition_dir(TOPIC, 0)).by_base()[b].bcq_crc32c
    with open(os.path.join(url, idxs[b]), "rb") as f:
        now = SL.crc32c(f.read())
    want = [
        (logs[a], int(rec_a["position"]), "corrupt record (CRC or header check failed)"),
        (idxs[b], 0, f"the .bcq does not match its checksum in the segment list (crc32c "
                     f"{now:08x}, listed {listed:08x})"),
        (idxs[b], 2 * B.ENTRY_SIZE, f"index entry 2 does not match the record at byte "
                                    f"{int(entries[b][2]['position'])} of the .log "
                                    "(rebuild the .bcq)"),
        (logs[c], int(rec_c["position"]), "corrupt record (CRC or header check failed)"),
    ]

    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout.splitlines()
    assert out[:-1] == [f"{path}: byte {pos}: {msg}" for path, pos, msg in want]
    assert out[-1].startswith("CORRUPT: 1 partitions,") and out[-1].endswith("4 problems")

    proc = kcompact("verify", "--store", url, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False
    assert [(p["path"], p["position"], p["message"]) for p in doc["problems"]] == want
    assert doc["records"] == 400 - 2  # every record but the two corrupt ones was checked


def test_verify_reports_a_damaged_format_2_batch_and_lean_index(tmp_path):
    url = keyed_store(tmp_path)
    s = Store.open(url)
    pl = s.partition(TOPIC, 0)
    sealed = pl.sealed_segments
    assert len(sealed) >= 3 and all(seg.format == 2 for seg in sealed)
    log_a, idx_b = sealed[0].log_path, sealed[1].bcq_path
    size_a = sealed[0].log_size
    s.close()
    assert kcompact("verify", "--store", url).returncode == 0
    _flip(os.path.join(url, log_a), size_a - 3)       # inside segment a's last batch
    _flip(os.path.join(url, idx_b), os.path.getsize(os.path.join(url, idx_b)) - 2)  # a chunk
    proc = kcompact("verify", "--store", url)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout.splitlines()
    assert len(out) == 4, out
    assert out[0].startswith(f"{log_a}: byte ") and "batch CRC mismatch" in out[0]
    # the segment list's checksum of the whole lean index, then the chunk's own CRC
    assert out[1].startswith(f"{idx_b}: byte 0: ") and "does not match its checksum" in out[1]
    assert out[2].startswith(f"{idx_b}: byte ") and "lean index chunk 0" in out[2]
    assert out[-1].startswith("CORRUPT: 1 partitions,") and out[-1].endswith("3 problems")


# -- usage errors --------------------------------------------------------------------------------


def test_verify_against_without_token_file_is_a_usage_error(tmp_path):
    url = keyed_store(tmp_path, n=10)
    proc = kcompact("verify", "--store", url, "--against", "http://127.0.0.1:9")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: kcompact verify ")
    assert proc.stderr.splitlines()[-1] == ("kcompact verify: error: --against needs "
                                            "--token-file F (the file holding the master's "
                                            "bearer token)")
    proc = kcompact("verify", "--store", url, "--token-file", str(tmp_path / "token"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("kcompact verify: error: --token-file applies to "
                                            "--against only")


# -- compact --engine spark without Java ---------------------------------------------------------


def no_java_env(tmp_path, java_home: bool) -> dict[str, str]:
    """This environment as on a machine without Java: no ``java`` on PATH (only the
    virtualenv's bin/), and JAVA_HOME unset or naming a directory with no Java in it."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    env.pop("JAVA_HOME", None)
    if java_home:
        env["JAVA_HOME"] = str(tmp_path / "no-java-here")
    return env


@pytest.mark.parametrize("java_home", [False, True], ids=["no-java", "java-home-nowhere"])
def test_compact_engine_spark_without_java_fails_in_one_line(tmp_path, java_home):
    url = keyed_store(tmp_path)
    env = no_java_env(tmp_path, java_home)
    proc = kcompact("compact", "--store", url, "--engine", "spark", "--force", env=env)
    assert proc.returncode == 1, proc.stderr
    why = (f"JAVA_HOME={env['JAVA_HOME']} has no bin/java; point JAVA_HOME at a Java 17 "
           "installation or unset it" if java_home else
           "Java 17 is not installed (apt-get install -y openjdk-17-jre-headless, or set "
           "JAVA_HOME)")
    assert error_lines(proc) == [f"kcompact: error: --engine spark: {why}; or use --engine local"]
    assert proc.stdout == ""
    # nothing was compacted behind the user's back by another engine
    assert not os.path.exists(os.path.join(url, fn.compaction_checkpoint(TOPIC, 0)))
    with Store.open(url) as s:
        assert sum(1 for _ in s.iter_records(TOPIC, 0)) == 400


def test_java_problem_follows_spark_launcher_rules(tmp_path, monkeypatch):
    from kcompact.connectors.apps.spark.session import java_problem
    home = tmp_path / "jdk"
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert "has no bin/java" in java_problem()
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text("#!/bin/sh\n")
    assert "has no bin/java" in java_problem()  # not executable
    (home / "bin" / "java").chmod(0o755)
    assert java_problem() is None
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert java_problem().startswith("Java 17 is not installed")
    monkeypatch.setenv("PATH", str(home / "bin"))
    assert java_problem() is None


@pytest.mark.parametrize("given, expect", [(None, "1"), ("3", "3")])
def test_the_command_line_keeps_openblas_to_one_thread_unless_told(given, expect):
    """numpy's OpenBLAS threads spin a tenth of a second of CPU each at import; the command line
    (which never calls BLAS) starts one, and a user's OPENBLAS_NUM_THREADS is left alone."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    code = ("import sys; assert 'numpy' not in sys.modules; import kcompact.connectors.cli, os, "
            "numpy; print(os.environ['OPENBLAS_NUM_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expect
