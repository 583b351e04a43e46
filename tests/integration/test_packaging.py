"""The distribution: one top-level import name, ``kcompact`` (docs/architecture.md): the wheel that
``pip install .`` builds holds ``kcompact/...`` and its metadata, nothing else, and the C
extensions land inside it; and ``pip install kcompact`` gets the native paths on a machine
without librdkafka-dev and libzstd-dev (issue 39).

The wheel is built once for this module, from an sdist (so that MANIFEST.in is tested too), in
a fresh virtualenv, inside ``unshare -m`` with an empty directory mounted over
/usr/include/librdkafka and /dev/null over /usr/include/zstd.h: the machine state of a user who
never installed those packages. It is then installed, with its dependencies, in that virtualenv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENV = dict(os.environ, PYTHONWARNINGS="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1")
_ENV.pop("KCOMPACT_KAFKA_IO", None)
_ENV.pop("KCOMPACT_LIBRDKAFKA", None)
#: what a machine without librdkafka-dev and libzstd-dev lacks
_HIDE = ("mkdir -p {empty} && "
         "if [ -d /usr/include/librdkafka ]; then mount --bind {empty} /usr/include/librdkafka; fi"
         " && if [ -e /usr/include/zstd.h ]; then mount --bind /dev/null /usr/include/zstd.h; fi"
         " && test ! -s /usr/include/zstd.h && test -z \"$(ls -A /usr/include/librdkafka "
         "2>/dev/null)\" && ")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, env=_ENV, **kw)
    assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
    return p


def _can_hide_headers() -> str:
    """Why the headers cannot be hidden here ('' when they can): unshare -m needs root."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    p = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"unshare -m fails here: {p.stderr.strip()}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the wheel's path, the fresh virtualenv it is installed in, why the headers were not
    hidden or '')."""
    tmp = tmp_path_factory.mktemp("packaging")
    # a copy of the source tree, so that the build leaves nothing in the checkout
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.so", "*.egg-info", "__pycache__", "demo-work",
        ".hypothesis"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q"]
    # --no-compile: the tests import little of what they install, and compiling every module
    # of the dependencies (pyspark's thousands) was most of this fixture's CPU
    _run(pip + ["install", "--no-compile", "setuptools>=77", "wheel"], timeout=600)
    sdist_dir, out = tmp / "sdist", tmp / "dist"
    _run([str(venv / "bin" / "python"), "-c", "import sys; from setuptools import build_meta;"
          " print(build_meta.build_sdist(sys.argv[1]))", str(sdist_dir)], cwd=src, timeout=600)
    (sdist,) = sdist_dir.iterdir()
    wheel_cmd = pip + ["wheel", "--no-deps", "--no-cache-dir", "-w", str(out), str(sdist)]
    why = _can_hide_headers()
    if why:
        _run(wheel_cmd, timeout=1200)
    else:
        script = _HIDE.format(empty=tmp / "empty") + " ".join(f"'{a}'" for a in wheel_cmd)
        _run(["unshare", "-m", "sh", "-c", script], timeout=1200)
    (wheel,) = out.glob("*.whl")
    _run(pip + ["install", "--no-compile", str(wheel)], timeout=1200)
    return wheel, venv, why


def test_wheel_has_one_top_level_name(built):
    wheel = built[0]
    with zipfile.ZipFile(wheel) as z:
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
    assert not any(n.startswith(("kcompact/tests", "kcompact/bench", "third_party"))
                   for n in names)


def test_the_native_paths_need_no_dev_headers(built):
    """Built where rdkafka.h and zstd.h are absent, the installed kcompact still runs kcompact's
    own Kafka client and the bulk zstd reads (the vendored headers and decoder), and its
    extension links no libzstd."""
    wheel, venv, why = built
    if why:
        pytest.skip(f"cannot hide librdkafka-dev's and libzstd-dev's headers: {why}")
    p = _run([str(venv / "bin" / "kcompact"), "--version"], cwd=venv)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("kcompact "), lines
    assert lines[1].startswith("kafka io: native (librdkafka 2."), lines
    assert "via confluent-kafka" in lines[1] and "rdkafka.h 2.6.0" in lines[1], lines
    assert lines[2].startswith("zstd: bulk (vendored 1.5.7"), lines
    # a zstd payload decoded by the compiled-in decoder: one batch row of kafka_heads (position,
    # size, ..., codec 4) over 61 header bytes and the frame
    code = ("import numpy as np, zstandard\n"
            "from kcompact.reput import _native\n"
            "from kcompact.connectors.framework import _rdkafka\n"
            "from kcompact.connectors.framework.native_kafka import NativeConsumer\n"
            "c = NativeConsumer({'bootstrap.servers': '127.0.0.1:1'}); c.close()\n"
            "data = bytes(range(256)) * 64\n"
            "frame = zstandard.ZstdCompressor().compress(data)\n"
            "buf = np.frombuffer(bytes(61) + frame, np.uint8)\n"
            "heads = np.array([0, buf.size, 0, 0, 0, 0, 1, 4], np.int64)\n"
            "sizes = np.empty(1, np.int64)\n"
            "assert _native.kafka_payload_sizes(buf, heads, 0, sizes) == 1, sizes\n"
            "out, starts = np.empty(int(sizes[0]), np.uint8), np.array([0, sizes[0]], np.int64)\n"
            "assert _native.kafka_unpack_many(buf, heads, 0, out, starts, 0, 1) == -1\n"
            "assert out.tobytes() == data\n"
            "print(_native.__file__, _rdkafka.__file__)\n")
    p = _run([str(venv / "bin" / "python"), "-c", code], cwd=venv)
    native_so, rdkafka_so = p.stdout.split()[:2]
    assert native_so.startswith(str(venv)) and rdkafka_so.startswith(str(venv)), p.stdout
    ldd = _run(["ldd", native_so]).stdout
    assert "libzstd" not in ldd, ldd


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


def test_a_failed_native_build_stops_the_install_with_what_to_install(tmp_path):
    """No C compiler (CC names none): pip fails, and its output says which extension and what
    to install; never an install that quietly lacks the kernels (issue 39)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.so", "*.egg-info", "__pycache__", "demo-work",
        ".hypothesis", "tests", "bench", "docs"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                       timeout=900, env=dict(_ENV, CC=str(tmp_path / "no-such-cc")))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "kcompact: building the C extension kcompact." in out, out[-3000:]
    assert "needs a C compiler and Python's headers" in out and "apt-get install gcc" in out
    assert not list(tmp_path.glob("dist/*.whl"))
