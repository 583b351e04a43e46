"""`kcompact demo` end to end: the README's first command must keep working.

It starts its own embedded broker (and Spark when Java is present, else the local engine), so it
needs nothing from the session fixtures; it runs in a subprocess exactly as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _demo(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KCOMPACT_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "kcompact", "demo", "--workdir",
                           str(tmp_path / "demo"), "--records", "4000", *extra],
                          capture_output=True, text=True, timeout=900, env=env)


def test_demo_runs_every_step(tmp_path):
    p = _demo(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    for step in range(1, 9):
        assert f"[{step}/8]" in out
    assert "EQUAL: 4 partitions" in out                    # replica verified against the master
    assert "identical to the store" in out                 # restored topic consumed back
    assert "kcompact kv get" in out                        # KV lookups shown
    assert "reclaimed" in out                              # before/after sizes table
    # the stores it leaves behind verify clean
    v = subprocess.run([sys.executable, "-m", "kcompact", "verify", "--store",
                        str(tmp_path / "demo" / "store")], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def test_demo_on_s3(tmp_path):
    p = _demo(tmp_path, "--s3")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "identical to the store" in p.stdout and "s3://" in p.stdout
