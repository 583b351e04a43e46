"""README's Python examples run as written (each ```python block in a fresh interpreter).

They use the public facade (``from kcompact import ...``) and temporary directories only; the
Spark block starts a local Spark session, hence the integration tier.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


BLOCKS = _python_blocks()


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3
    assert all("from kcompact import" in b for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(block, tmp_path):
    # outside the repository, so that only the installed kcompact is importable
    p = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 0, block + "\n---\n" + p.stdout[-2000:] + p.stderr[-3000:]
