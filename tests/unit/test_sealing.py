"""The storage layer is sealed: nothing outside reput/ imports a private name of reput, and
nothing outside compaction/ a private name of compaction (issue 18; ARCHITECTURE.md: "nothing
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
