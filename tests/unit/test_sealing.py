"""The storage layer is sealed: nothing outside reput/ imports a private name of reput, and
nothing outside compaction/ a private name of compaction (issue 18; docs/architecture.md: "nothing
imports a `_private` name of another package").

Imports are read with ``ast`` from every Python file of the installed layers, the facade and
bench/: ``from kcompact.reput._kernels import x``, ``from kcompact.reput import _native``,
``from kcompact.reput.record import _VarColumn`` and ``import kcompact.reput._jit`` are all
private imports. Tests are white-box and may compare a layer's private kernels (C against
numba); they are not checked.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = ("reput", "compaction", "replication", "connectors")
SEALED = ("reput", "compaction")
CHECKED = LAYERS + ("kcompact", "bench")


def _python_files():
    for top in CHECKED:
        for dp, dns, files in os.walk(os.path.join(ROOT, top)):
            dns[:] = sorted(d for d in dns if not d.startswith((".", "__")))
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dp, f)
                    yield top, os.path.relpath(path, ROOT), path


def _private_imports(owner: str, path: str) -> list[tuple[int, str]]:
    """(line, what) of each import of a private name of a sealed layer other than ``owner``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if len(parts) < 2 or parts[0] != "kcompact" or parts[1] not in SEALED \
                    or parts[1] == owner:
                continue
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts[2:]) or any(n.startswith("_") for n in names):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if len(parts) > 2 and parts[0] == "kcompact" and parts[1] in SEALED \
                        and parts[1] != owner and any(p.startswith("_") for p in parts[2:]):
                    found.append((node.lineno, f"import {a.name}"))
    return found


def test_no_layer_imports_a_private_name_of_reput_or_compaction():
    bad = [f"{rel}:{line}: {what}" for owner, rel, path in _python_files()
           for line, what in _private_imports(owner, path)]
    assert not bad, "private imports across layers:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,owner,private", [
    ("from kcompact.reput._kernels import crc32c", "compaction", True),
    ("from kcompact.reput import _native", "connectors", True),
    ("from kcompact.reput.record import BytesColumn, _VarColumn", "bench", True),
    ("import kcompact.compaction._kernels", "replication", True),
    ("from kcompact.compaction.offset_map import OffsetMap", "replication", False),
    ("from kcompact.reput.reader import PartitionReader", "connectors", False),
    ("from kcompact.reput import _kernels", "reput", False),  # its own
    ("from kcompact.connectors.cli import _size", "bench", False),  # not a sealed layer
])
def test_the_check_sees_private_imports(tmp_path, source, owner, private):
    """The check itself: it flags each form of a private import and nothing else."""
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert bool(_private_imports(owner, str(f))) == private


# ---------------------------------------------------------------------------------------------
# nothing outside the segment implementations parses a segment's bytes (issue 39)

#: what reads a segment's bytes: the Kafka batch decoders, the lean index reader, the record
#: check and scans, and the C kernels behind them (reached as ``_N.x`` or ``K.x``)
SEGMENT_PARSERS = frozenset({
    "parse_head", "open_batch", "walk_batch", "walk_opened", "decode_run", "decode_walked",
    "decode_batches", "span_entries", "span_fields", "batch_size_at",  # reput/batch.py
    "LeanIndex",                                                       # reput/bcq2.py
    "verify_records", "mismatch", "scan", "field_spans",               # format 1's records
    "kafka_read_one", "lean_decode", "kafka_scan_many", "kafka_fields_many",
    "kafka_entries_many", "count_records", "scan_records",            # their C/numba kernels
})
#: the modules that may: the segment implementations (reput/segment.py's interface, one class
#: per kind) and the codecs that define the parsers
SEGMENT_IMPLEMENTATIONS = frozenset({
    "reput/segment_v1.py", "reput/segment_v2.py",
    "reput/batch.py", "reput/bcq2.py", "reput/record.py", "reput/_kernels.py",
    "reput/jit.py",
})
#: records that are not a segment's, parsed by the format-1 record codec (name: why)
NOT_A_SEGMENT = {
    "reput/commitlog.py": ({"scan", "count_records"}, "the commit log's records"),
    "reput/reput_service.py": ({"scan"}, "the commit log's records, dispatched by reput"),
    "reput/verify.py": ({"count_records"}, "the commit log's records"),
    "reput/columns.py": ({"field_spans"}, "a block's records in memory, already checked"),
    "reput/__init__.py": ({"scan"}, "the record codec's public API, re-exported"),
    "reput/partition.py": ({"scan"}, "records handed to the writer (append_block)"),
    "replication/protocol.py": ({"scan", "field_spans"}, "records on the wire"),
    "connectors/plugins/store_sink.py": ({"scan"}, "a batch the sink just encoded"),
    # issue 44: salvage reads a DAMAGED segment record by record, past the first error the
    # segment interface stops at (one walker for both formats, docs/operations-damage.md)
    "reput/salvage.py": ({"walk_batch", "decode_walked", "scan", "LeanIndex"},
                         "a damaged segment's records, salvaged one by one"),
    "reput/salvage_store.py": ({"count_records"}, "the commit log's records"),
    "reput/repair_kinds.py": ({"LeanIndex"}, "a staged repaired segment's offsets, for its "
                              "manifest entry (an S3 repair's install)"),
}


def _module_of(rel: str) -> list[str]:
    """The package path (``kcompact.reput``...) of the module at ``rel``."""
    parts = rel[:-3].split("/")
    return ["kcompact"] + parts[:-1] if parts[0] != "kcompact" else parts[:-1]


def _segment_parsing(rel: str, path: str) -> list[tuple[int, str, str]]:
    """(line, parser, what) of each use of a segment parser: imported by name from a kcompact.reput
    module, taken as an attribute of an alias of one (``KB.decode_batches``) or of a native
    kernel module (``_N = native()``), or any import of reput._kafka_kernels."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    pkg = _module_of(rel)
    aliases: set[str] = set()
    found = []

    def absolute(node: ast.ImportFrom) -> list[str]:
        base = pkg[:len(pkg) - node.level + 1] if node.level else []
        return base + (node.module.split(".") if node.module else [])

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = absolute(node)
            if mod[:2] != ["kcompact", "reput"]:
                continue
            for a in node.names:
                full = mod + [a.name]
                if "_kafka_kernels" in full:
                    found.append((node.lineno, "_kafka_kernels", f"imports {'.'.join(full)}"))
                elif len(mod) == 2 or a.name.startswith("_"):  # a module: its alias
                    aliases.add(a.asname or a.name)
                elif a.name in SEGMENT_PARSERS:
                    found.append((node.lineno, a.name, f"imports {a.name} from "
                                  f"{'.'.join(mod)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kcompact.reput"):
                    if "_kafka_kernels" in a.name:
                        found.append((node.lineno, "_kafka_kernels", f"imports {a.name}"))
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "native":
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SEGMENT_PARSERS:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append((node.lineno, node.attr, f"uses {ast.unparse(node)}"))
    return found


def test_nothing_outside_the_segment_implementations_parses_a_segments_bytes():
    """Issue 39: a kind of segment is a type (reput/segment.py); only its implementation reads
    its bytes (docs/architecture.md, "The segment interface"), so a new kind is one new class."""
    bad = []
    for _owner, rel, path in _python_files():
        if rel in SEGMENT_IMPLEMENTATIONS:
            continue
        allowed = NOT_A_SEGMENT.get(rel, (set(), ""))[0]
        for line, name, what in _segment_parsing(rel, path):
            if name not in allowed:
                bad.append(f"{rel}:{line}: {what}")
    assert not bad, "segment bytes parsed outside reput/segment_v*.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,rel,parses", [
    ("from kcompact.reput.batch import decode_batches", "replication/x.py", True),
    ("from kcompact.reput import batch as KB\nKB.span_fields(1)", "compaction/x.py", True),
    ("from . import bcq2 as B2\nB2.LeanIndex(1, 2, 3)", "reput/x.py", True),
    ("from .jit import native\n_N = native()\n_N.kafka_read_one(1)", "reput/x.py", True),
    ("from kcompact.reput import _kafka_kernels", "connectors/x.py", True),
    ("from .reader import PartitionReader\nPartitionReader(1).read(0)", "reput/x.py", False),
    ("from kcompact.reput.batch import encode_batch", "replication/x.py", False),
    ("from kcompact.reput import bcq2 as B2\nB2.IndexBuilder()", "replication/x.py", False),
])
def test_the_check_sees_segment_parsing(tmp_path, source, rel, parses):
    """The check itself: each form of a parser's use is flagged, encoders and readers not."""
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert bool(_segment_parsing(rel, str(f))) == parses


# -- a backend is an implementation, not a flag (issue 48) -------------------------------------

#: the files that implement a kind of backend: the publishers and the partition catalogs (and
#: the backends themselves); everything else calls them and never asks which kind it holds
BACKEND_IMPLEMENTATIONS = {
    "reput/publisher.py", "reput/catalog.py", "reput/catalog_local.py",
    "reput/catalog_manifest.py", "reput/backend.py", "reput/s3.py",
}
#: what asking looks like: a store's or a partition's "remote" flag, or "manifest_mode"
KIND_FLAG = re.compile(r"\.remote\b|manifest_mode")


def _kind_flags(path: str) -> list[tuple[int, str]]:
    """(line, text) of each line that tests a backend's kind by its flag."""
    with open(path, encoding="utf-8") as f:
        return [(i, line.strip()) for i, line in enumerate(f, 1) if KIND_FLAG.search(line)]


def test_nothing_outside_the_backend_implementations_asks_which_kind_it_holds():
    """Issue 48: local, S3 per partition and S3 shared are one publisher each
    (reput/publisher.py), chosen where the store opens; the write path, compaction's swap,
    repair and a replica's install call it (``grep -rnE "\\.remote\\b|manifest_mode" reput
    compaction replication connectors`` outside these files: nothing)."""
    bad = [f"{rel}:{line}: {text}" for top, rel, path in _python_files() if top in LAYERS
           and rel not in BACKEND_IMPLEMENTATIONS for line, text in _kind_flags(path)]
    assert not bad, "a backend's kind asked outside its implementation:\n" + "\n".join(bad)


#: repair and salvage: they read and replace a partition through its store kind's
#: implementation (reput/repair_kinds.py: ``LocalRepair``, ``ManifestRepair``), so they do not
#: ask whether the store's files can be appended to either
REPAIR_CODE = ("reput/quarantine.py", "reput/salvage.py", "reput/salvage_sources.py",
               "reput/salvage_store.py", "replication/repair.py")
REPAIR_KIND_FLAG = re.compile(r"\.remote\b|manifest_mode|\.appendable\b")


def test_repair_and_salvage_ask_no_kind_outside_their_implementations():
    """Issue 48: salvage's sources and repair's install are the store kind's
    (reput/repair_kinds.py, picked once by ``repair_kind_for``); the repair's own modules test
    no ``remote``, ``manifest_mode`` or ``appendable``."""
    bad = []
    for rel in REPAIR_CODE:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            bad += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                    if REPAIR_KIND_FLAG.search(line)]
    assert not bad, "a store's kind asked in repair code:\n" + "\n".join(bad)


#: where a store or a partition opens and picks its implementations by what its backend can do
#: (``fs.appendable``: a local directory): the publisher, the repair kind, the partition's catalog
#: and store.json's features; and swap.py's functions, which both kinds call with their backend
OPENING_CODE = {"reput/publisher.py", "reput/repair_kinds.py", "reput/partition.py",
                "reput/store.py", "reput/swap.py"}
APPENDABLE_FS = re.compile(r"\bfs\.appendable\b")


def test_only_the_opening_code_asks_whether_the_backend_appends():
    """Issue 48: past the store's open, code asks the publisher (``store_catalog()``,
    ``follower()``, ``cheap_metadata``, ``checkpoint_file``...) what its kind does, not whether
    the backend's files can be appended to (a segment's own ``appendable``, the open segment,
    is another question)."""
    bad = []
    for top, rel, path in _python_files():
        if top not in LAYERS or rel in OPENING_CODE or rel in BACKEND_IMPLEMENTATIONS:
            continue
        with open(path, encoding="utf-8") as f:
            bad += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                    if APPENDABLE_FS.search(line)]
    assert not bad, "a backend's kind asked past the store's open:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,asks", [
    ("if self.remote:\n    pass", True),
    ("local_fs = store.local_fs if store.remote else None", True),
    ("if pl.manifest_mode:\n    pl.publish()", True),
    ("getattr(live, 'manifest_mode', False)", True),
    ("self.remote_url = url", False),
    ("store.publisher.publish_all()", False),
])
def test_the_check_sees_a_kind_flag(tmp_path, source, asks):
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert bool(_kind_flags(str(f))) == asks
