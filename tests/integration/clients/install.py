"""Install the client matrix's clients into the cache directory (test_client_matrix.py; `make
clients`, which `make test` runs): each from its registry, once per version of its sources, reused
between runs.

* kafka-python and aiokafka (PyPI, requirements.txt, as installed: no extras) into a virtualenv
  of their own, so they are not kcompact's dependencies and see none of kcompact's (zstandard);
* kafkajs (npm, kafkajs/package.json) into a node_modules directory;
* kafka-go and sarama (the Go module proxy, goclients/go.mod) built into one program;
* rskafka (crates.io, rskafka/Cargo.toml and Cargo.lock) built with cargo.

The cache is ``$KCOMPACT_CACHE_DIR/clients`` (default ~/.cache/kcompact/clients). Each installer
returns the path to run or raises ``Unavailable`` with the reason (no toolchain, offline, a failed
build): the tests skip with it, ``python install.py`` prints it and still exits 0.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KCOMPACT_CACHE_DIR") or Path.home() / ".cache" / "kcompact"
             ) / "clients"


class Unavailable(Exception):
    """A client that cannot be installed here; the message says why."""


def _digest(*paths: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str, **kw) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"{what}: {e}") from None
    if r.returncode != 0:
        raise Unavailable(f"{what} failed (offline?): {(r.stderr or r.stdout).strip()[-400:]}")


def python_clients() -> Path:
    """The Python of a virtualenv holding kafka-python and aiokafka."""
    req = HERE / "requirements.txt"
    base = getattr(sys, "_base_executable", sys.executable)
    venv = CACHE / f"python-{_digest(req, extra=sys.version)}"
    py = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([base, "-m", "venv", str(venv)], "creating the Python clients' virtualenv")
        _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
              str(req)], "pip install kafka-python aiokafka")
        (venv / ".installed").touch()
    return py


def node_clients() -> Path:
    """The node_modules directory holding kafkajs."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise Unavailable("Node.js (node and npm) is not installed: the kafkajs client needs it")
    pkg = HERE / "kafkajs" / "package.json"
    d = CACHE / f"kafkajs-{_digest(pkg)}"
    if not (d / ".installed").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copy(pkg, d / "package.json")
        _run([npm, "install", "--no-audit", "--no-fund", "--omit=dev"], "npm install kafkajs",
             cwd=d)
        (d / ".installed").touch()
    return d / "node_modules"


def go_clients() -> Path:
    """The goclients program (kafka-go and sarama)."""
    go = shutil.which("go")
    if go is None:
        raise Unavailable("Go is not installed: the kafka-go and sarama clients need it")
    src = HERE / "goclients"
    files = sorted(p for p in src.iterdir() if p.suffix == ".go" or p.name in ("go.mod",
                                                                                "go.sum"))
    exe = CACHE / f"goclients-{_digest(*files)}" / "goclients"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        _run([go, "build", "-o", str(exe), "."], "go build of the kafka-go and sarama clients",
             cwd=src)
    return exe


def rust_clients() -> Path:
    """The rskafka program (crates.io, rskafka/Cargo.toml and its Cargo.lock)."""
    cargo = shutil.which("cargo")
    if cargo is None:
        raise Unavailable("Rust's cargo is not installed: the rskafka client needs it")
    src = HERE / "rskafka"
    d = CACHE / "rskafka-{}".format(_digest(src / "Cargo.toml", src / "Cargo.lock",
                                            src / "src" / "main.rs"))
    exe = d / "release" / "rskafka-client"
    if not exe.exists():
        d.mkdir(parents=True, exist_ok=True)
        _run([cargo, "build", "--release", "--locked", "--quiet", "--manifest-path",
              str(src / "Cargo.toml"), "--target-dir", str(d)], "cargo build of the rskafka client")
    return exe


INSTALLERS = {"kafka-python and aiokafka": python_clients, "kafkajs": node_clients,
              "kafka-go and sarama": go_clients, "rskafka": rust_clients}


def main() -> int:
    for name, install in INSTALLERS.items():
        try:
            print(f"{name}: {install()}")
        except Unavailable as e:
            print(f"{name}: not installed ({e}); its client matrix tests will skip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
