"""Issue 26, the first hour with kcompact, for what needs no server: every flag explained,
``--version``, text ``dump`` telling null from the text "null" and saying when it cuts, a
recorded but empty partition, ``kv get`` of an absent key, and a failed ``kv build`` leaving
nothing behind. Each test drives the installed ``kcompact`` script, as a user does.
(tests/integration/test_first_hour.py has the cases that need a broker or a master.)"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from kcompact.reput import RecordBatch, Store

sys.path.insert(0, os.path.dirname(__file__))
from _stores import flip_byte_in_the_middle  # noqa: E402

KCOMPACT = os.path.join(os.path.dirname(sys.executable), "kcompact")
TOPIC = "orders"


def kcompact(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KCOMPACT, *args], capture_output=True, text=True, timeout=120)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kcompact: error: "), proc.stderr
    return lines[0]


def store_with(tmp_path, rows, name: str = "store") -> str:
    url = str(tmp_path / name)
    with Store.open(url, writer="w", create=True) as s:
        s.append(RecordBatch.from_records(TOPIC, rows))
        s.flush()
    return url


# -- every flag explained ------------------------------------------------------------------------


def _helps() -> dict[tuple[str, ...], str]:
    """Every command's and subcommand's --help text, read from the parents' own --help
    (argparse lists a parser's subcommands indented by four spaces under its positional
    arguments); each command's --help runs once."""
    out: dict[tuple[str, ...], str] = {}
    todo: list[list[str]] = [[]]
    while todo:
        cmd = todo.pop()
        proc = kcompact(*cmd, "--help")
        assert proc.returncode == 0, (cmd, proc.stderr)
        out[tuple(cmd)] = proc.stdout
        todo += [cmd + [name]
                 for name in re.findall(r"^    ([a-z][a-z-]*)(?:\s|$)", proc.stdout, re.M)]
    return out


def _commands(helps: dict[tuple[str, ...], str]) -> list[list[str]]:
    """The commands that have no subcommands."""
    return sorted(list(cmd) for cmd, text in helps.items()
                  if not re.search(r"^    [a-z][a-z-]*(?:\s|$)", text, re.M))


def _options_without_help(help_text: str) -> list[str]:
    """The entries of argparse's option and positional lists that have no text after them
    (an entry's text is on its line after two spaces, or indented on the next line)."""
    lines = help_text.splitlines()
    missing = []
    in_list = False
    for i, line in enumerate(lines):
        if line.endswith(":") and not line.startswith(" "):
            in_list = line in ("options:", "optional arguments:", "positional arguments:")
            continue
        if not in_list or not re.match(r"^  \S", line):
            continue  # not an entry (a subcommand's line is indented by four)
        entry, sep, text = line.strip().partition("  ")
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not text.strip() and not re.match(r"^ {6,}\S", nxt):
            missing.append(entry)
    return missing


def test_issue_every_option_of_every_command_has_help_text():
    helps = _helps()
    names = {" ".join(c) for c in _commands(helps)}
    assert {"demo", "broker", "mirror", "compact", "inspect", "dump", "verify", "serve",
            "replicate", "restore", "kv build", "kv get", "connect standalone"} <= names
    assert {(), ("kv",), ("connect",)} <= set(helps)
    for cmd, text in helps.items():
        assert "--help" in text
        assert _options_without_help(text) == [], (cmd, text)
    # the parser above finds a missing help text (so the test cannot pass by reading nothing)
    assert _options_without_help("options:\n  -h, --help  show\n  --follow\n  --x X  text\n"
                                 ) == ["--follow"]


def test_issue_version():
    proc = kcompact("--version")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"kcompact {version('kcompact')}"
    # the native paths in use (issue 39): kcompact's own Kafka client and the vendored decoder
    assert lines[1].startswith("kafka io: native (librdkafka "), lines
    assert lines[2].startswith("zstd: bulk (vendored 1.5."), lines
    assert len(lines) == 3


# -- text dump: null is not "null", and a cut says so -------------------------------------------


def test_issue_text_dump_tells_a_keyless_record_from_the_key_null_and_says_when_it_cuts(
        tmp_path):
    long_value = b"x" * 59 + b"END-OF-VALUE" + b"y" * 129            # 200 bytes
    url = store_with(tmp_path, [
        (0, 0, 1000, None, b"keyless", []),
        (0, 1, 1001, b"null", b"null", [("h", None), ("h", b"null")]),
        (0, 2, 1002, b"k", None, []),                                # a tombstone
        (0, 3, 1003, b"k", long_value, []),
        (0, 4, 1004, b"\xff\xfe", b"", [("bin", b"\x00\x01")]),
        (0, 5, 1005, b"b64:AAE=", b"x" * 60, []),                    # exactly the limit
    ])
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        '0\t1000\tnull\t"keyless"',
        '1\t1001\t"null"\t"null"\th=null h="null"',
        '2\t1002\t"k"\tnull',
        '3\t1003\t"k"\t"' + "x" * 59 + 'E"... (cut: 200 bytes)',
        '4\t1004\tb64://4=\t""\tbin=b64:AAE=',
        '5\t1005\t"b64:AAE="\t"' + "x" * 60 + '"',
    ]
    # --json prints every byte
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "0", "--json",
                    "--from-offset", "3", "--limit", "1")
    assert json.loads(proc.stdout)["value"] == long_value.decode()
    assert base64.b64decode("//4=") == b"\xff\xfe"


# -- a recorded partition with no record yet ----------------------------------------------------


def test_issue_a_recorded_but_empty_partition_dumps_as_empty(tmp_path):
    url = store_with(tmp_path, [(0, 0, 1000, b"k", b"v", [])])
    raw = open(os.path.join(url, "store.json")).read()
    assert '"partitions"' not in raw      # a store without recorded partitions: layout unchanged
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "2")
    assert proc.returncode == 1
    assert one_error_line(proc) == (f"kcompact: error: {TOPIC}-2 is not in store {url}; "
                                    f"partitions of '{TOPIC}': 0")
    with Store.open(url) as s:           # what a mirror does when it starts (store-json.md)
        assert s.record_partitions(TOPIC, [0, 1, 2]) == [0, 1, 2]
        assert s.record_partitions(TOPIC, [1]) == [0, 1, 2]
    assert json.load(open(os.path.join(url, "store.json")))["partitions"] == {TOPIC: [0, 1, 2]}
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "2")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    proc = kcompact("dump", "--store", url, "--topic", TOPIC, "--partition", "3")
    assert proc.returncode == 1
    assert one_error_line(proc).endswith(f"partitions of '{TOPIC}': 0, 1, 2")
    # inspect lists it, with no record
    doc = json.loads(kcompact("inspect", "--store", url, "--json").stdout)
    parts = {p["partition"]: p["records"] for p in doc["topics"][0]["partitions"]}
    assert parts == {0: 1, 1: 0, 2: 0}
    # a topic recorded before any record is a topic of the store
    with Store.open(url) as s:
        s.record_partitions("later", [0])
    proc = kcompact("dump", "--store", url, "--topic", "later", "--partition", "0")
    assert (proc.returncode, proc.stdout) == (0, ""), proc.stderr


def test_recorded_partitions_must_be_partition_numbers(tmp_path):
    url = store_with(tmp_path, [(0, 0, 1000, b"k", b"v", [])])
    path = os.path.join(url, "store.json")
    doc = json.load(open(path))
    doc["partitions"] = {TOPIC: [0, -1]}
    doc.pop("crc32c", None)  # as written by a kcompact without the checksum: the field is checked
    with open(path, "w") as f:
        json.dump(doc, f)
    proc = kcompact("inspect", "--store", url)
    assert proc.returncode == 1
    assert "store.json has an invalid field" in one_error_line(proc)


# -- kv get of an absent key --------------------------------------------------------------------


def test_issue_kv_get_of_an_absent_key_says_so(tmp_path):
    url = store_with(tmp_path, [(0, 0, 1000, b"here", b"v", []), (0, 1, 1001, b"gone", b"v", []),
                                (0, 2, 1002, b"gone", None, [])])
    db = str(tmp_path / "m.kv")
    assert kcompact("kv", "build", "--store", url, "--topic", TOPIC, "--db", db).returncode == 0
    proc = kcompact("kv", "get", "--db", db, "here")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "v\n", "")
    for key in ("nope", "gone"):
        proc = kcompact("kv", "get", "--db", db, key)
        assert (proc.returncode, proc.stdout) == (1, "")
        assert proc.stderr == (f'kv get: key "{key}" is not in {db} (never written, or deleted '
                               "by a tombstone)\n")
    proc = kcompact("kv", "get", "--db", db, "bm9wZQ==", "--key-base64", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout) == {"key": "nope", "found": False}
    assert "(base64) bm9wZQ==" in proc.stderr


# -- a failed kv build leaves nothing behind ----------------------------------------------------


@pytest.mark.parametrize("existing_dir", [False, True], ids=["new-dir", "empty-dir"])
def test_issue_a_failed_first_kv_build_leaves_nothing_behind(tmp_path, existing_dir):
    # every record is its key's latest, so the bulk build reads each one
    url = store_with(tmp_path, [(0, i, 1000 + i, b"k%d" % i, b"v" * 50, []) for i in range(400)])
    db = tmp_path / "m.kv"
    if existing_dir:
        db.mkdir()
    proc = kcompact("kv", "build", "--store", url, "--topic", "nosuch", "--db", str(db))
    assert proc.returncode == 1
    assert one_error_line(proc) == (f"kcompact: error: topic 'nosuch' is not in store {url} "
                                    f"(topics: {TOPIC})")
    assert os.listdir(db) == [] if existing_dir else not db.exists()

    where = flip_byte_in_the_middle(url, TOPIC, 0)  # damage found in the middle of the bulk build
    proc = kcompact("kv", "build", "--store", url, "--topic", TOPIC, "--db", str(db))
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("kcompact: error:")]
    assert len(errors) == 1 and where in errors[0], proc.stderr
    assert os.listdir(db) == [] if existing_dir else not db.exists()


def test_a_map_that_existed_is_kept_when_a_build_fails(tmp_path):
    url = store_with(tmp_path, [(0, 0, 1000, b"k", b"v", [])])
    other = store_with(tmp_path, [(0, 0, 1000, b"k", b"v", [])], name="other")
    db = str(tmp_path / "m.kv")
    assert kcompact("kv", "build", "--store", url, "--topic", TOPIC, "--db", db).returncode == 0
    proc = kcompact("kv", "build", "--store", other, "--topic", TOPIC, "--db", db)
    assert proc.returncode == 1, proc.stderr   # another store: refused, the map stays
    assert kcompact("kv", "get", "--db", db, "k").stdout == "v\n"
