"""The distribution installs one top-level import name, ``kcompact`` (docs/architecture.md): the
wheel that ``pip install .`` builds holds ``kcompact/...`` and its metadata, nothing else, and the C
extensions land inside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wheel_has_one_top_level_name(tmp_path):
    # a copy of the source tree, so that the build leaves nothing in the checkout
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.so", "__pycache__", "demo-work", ".hypothesis"))
    out = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(out), str(src)], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    with zipfile.ZipFile(out / wheel) as z:
        names = z.namelist()
        top = {n.split("/", 1)[0] for n in names}
        dist_info = next(t for t in top if t.endswith(".dist-info"))
        assert top == {"kcompact", dist_info}, top
        assert z.read(f"{dist_info}/top_level.txt").decode().split() == ["kcompact"]
    for layer in ("reput", "compaction", "replication", "connectors"):
        assert f"kcompact/{layer}/__init__.py" in names
    assert "kcompact/__main__.py" in names
    assert any(n.startswith("kcompact/reput/_native") and n.endswith(".so") for n in names)
    assert any(n.startswith("kcompact/connectors/framework/_rdkafka") and n.endswith(".so")
               for n in names)
    for room in ("framework", "plugins", "apps", "devtools"):
        assert f"kcompact/connectors/{room}/__init__.py" in names
    assert not any(n.startswith(("kcompact/tests", "kcompact/bench")) for n in names)


def test_python_m_kcompact_is_the_script(tmp_path):
    a = subprocess.run([sys.executable, "-m", "kcompact", "--help"], capture_output=True,
                       text=True, cwd=tmp_path)
    b = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kcompact"), "--help"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and "COMMAND" in a.stdout


def test_facade_names_resolve():
    code = ("import kcompact; missing = [n for n in kcompact.__all__ if getattr(kcompact, n, None)"
            " is None]; print(missing, kcompact.__version__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split(" ", 1)[0] == "[]", p.stdout
