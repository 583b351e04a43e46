"""The S3 backend: a store under ``s3://bucket/prefix`` (boto3), with a block cache and a spool.

Spec: docs/formats/manifest.md (object layout, manifests, reads, garbage). In short:

* Keys are the local layout's paths under ``prefix/``. Objects are written whole (one PUT each:
  no multipart, a segment is < 4 GiB); ``create_exclusive`` is ``PUT If-None-Match: *``, which is
  how a manifest version is committed (two committers cannot both win). Nothing is appended
  (``appendable = False``): a writer's commit log and active segments stay in a local directory.
* **Block cache** (``BlockCache``, in s3_cache.py): ranged reads of sealed segment objects page 4 MiB aligned
  blocks through a process-wide LRU (``KCOMPACT_S3_CACHE_MB``, default 256) that merges
  concurrent requests for the same block. Sealed objects are immutable (their names carry a
  random tag), so a cached block never goes stale; mutable keys (store.json) are never cached.
* **Spool** (``Spool``, in s3_cache.py): ``map()`` of a sealed object (a ``.bcq`` index) downloads it whole, once,
  into a local file and maps that (bounded memory: the pages are the OS's to drop), LRU-bounded
  on disk (``KCOMPACT_S3_SPOOL_MB``, default 4096). A segment this process uploaded is moved
  into the spool rather than deleted, so reading it back costs no request.
* ``open_read`` is one streamed GET for the rest of the object (or the spooled copy): compaction
  reads each input ``.log`` once.
* ``stats`` counts requests by S3 operation and bytes each way (the benchmark and the tests read
  it); ``cache``/``spool`` count hits and merged requests.

Credentials, region and endpoint follow boto3's usual configuration (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``); the URL query
options ``endpoint``, ``region``, ``profile`` and ``grace_ms`` override them. Wrong credentials, a
missing bucket or an unreachable endpoint raise an ``S3Error`` subclass whose message is one
line saying which, within a few seconds (connect timeout 3 s, 3 attempts).
"""

from __future__ import annotations

import errno
import io
import os
import threading
from typing import Callable, Iterator
from urllib.parse import parse_qs, urlsplit

import numpy as np

from . import env as _env
from . import filenames as fn
from .backend import AppendFile, Backend, BackendError
from .s3_cache import (BlockCache, RequestStats, Spool, block_source, shared_cache,
                       shared_spool)

DEFAULT_GRACE_MS = _env.ENV["KCOMPACT_S3_GRACE_MS"].default
MAX_PUT_BYTES = 5 << 30          # S3's single-PUT limit; a segment is < 4 GiB (bcq positions)
CONNECT_TIMEOUT_S = 3
READ_TIMEOUT_S = 60
MAX_ATTEMPTS = 3
_ACCESS_CODES = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403",
                 "InvalidToken", "ExpiredToken", "InvalidClientTokenId",
                 "UnrecognizedClientException",
                 "AuthorizationHeaderMalformed", "InvalidSecurity", "AllAccessDisabled"}
_URL_OPTIONS = ("endpoint", "region", "profile", "grace_ms")


class S3Error(BackendError):
    """An S3 request failed; the message names the store, the operation and the reason.
    ``code`` is S3's error code (or the HTTP status) when the server answered."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class S3AccessError(S3Error):
    """The credentials were refused (or none were found): fix AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_PROFILE, or the bucket policy."""


class S3BucketNotFoundError(S3Error):
    """The bucket does not exist at this endpoint: create it, or fix the URL / endpoint."""


class S3UnreachableError(S3Error):
    """No connection to the endpoint: check ``?endpoint=`` / AWS_ENDPOINT_URL and the network."""


# ---------------------------------------------------------------------------------------------
# boto3 clients


_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _resolve_endpoint(endpoint: str | None) -> str | None:
    return (endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            or None)


def make_client(endpoint: str | None = None, region: str | None = None,
                profile: str | None = None):
    """A boto3 S3 client (cached per endpoint/region/profile/credentials in the environment).

    Timeouts and retries are short so that a wrong endpoint fails in seconds; checksums are
    computed only where S3 requires them (S3-compatible servers differ on the newer ones)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise BackendError(f"S3 stores need boto3: pip install boto3 ({e})") from None
    env = tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_SESSION_TOKEN", "AWS_PROFILE",
                                            "AWS_DEFAULT_REGION", "AWS_REGION",
                                            "AWS_MAX_ATTEMPTS"))
    ck = (endpoint, region, profile, env, os.getpid())
    with _clients_lock:
        c = _clients.get(ck)
        if c is not None:
            return c
    try:
        session = (boto3.session.Session(profile_name=profile) if profile
                   else boto3.session.Session())
    except Exception as e:  # botocore.exceptions.ProfileNotFound and friends
        raise S3AccessError(f"AWS profile {profile!r}: {e}") from None
    attempts = MAX_ATTEMPTS
    if os.environ.get("AWS_MAX_ATTEMPTS", "").strip().isdigit():
        attempts = max(1, int(os.environ["AWS_MAX_ATTEMPTS"]))
    kw = dict(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
              retries={"max_attempts": attempts, "mode": "standard"},
              max_pool_connections=64,
              request_checksum_calculation="when_required",
              response_checksum_validation="when_required")
    if endpoint:
        kw["s3"] = {"addressing_style": "path"}
    try:
        cfg = Config(**kw)
    except TypeError:  # an older botocore without the checksum options
        kw.pop("request_checksum_calculation")
        kw.pop("response_checksum_validation")
        cfg = Config(**kw)
    c = session.client("s3", endpoint_url=endpoint,
                       region_name=region or session.region_name or "us-east-1", config=cfg)
    with _clients_lock:
        _clients[ck] = c
    return c


# ---------------------------------------------------------------------------------------------
# streams


class _ObjectStream(io.RawIOBase):
    """One streamed GET read sequentially (``readinto``); read errors surface as OSError."""

    def __init__(self, body, on_bytes: Callable[[int], None], where: str):
        self._body = body
        self._on = on_bytes
        self._where = where

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        mv = memoryview(b).cast("B")
        if len(mv) == 0:
            return 0
        try:
            data = self._body.read(len(mv))
        except Exception as e:  # urllib3/botocore read errors: a broken or timed-out stream
            raise OSError(errno.EIO, f"S3 stream of {self._where} broke: {e}") from None
        n = len(data)
        mv[:n] = data
        self._on(n)
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._body.close()
            finally:
                super().close()


# ---------------------------------------------------------------------------------------------


class S3Backend(Backend):
    """A store under ``s3://bucket/prefix`` (module docstring)."""

    appendable = False

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 region: str | None = None, profile: str | None = None,
                 grace_ms: int | None = None, client=None, cache: BlockCache | None = None,
                 spool: Spool | None = None):
        if not bucket:
            raise BackendError("an S3 store URL needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = _resolve_endpoint(endpoint)
        self.region, self.profile = region, profile
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if grace_ms is None:
            grace_ms = _env.value("KCOMPACT_S3_GRACE_MS")
        #: how long replaced and orphaned objects are kept (docs/formats/manifest.md, Garbage)
        self.grace_ms = int(grace_ms)
        self._client = client
        self.cache = cache if cache is not None else shared_cache()
        self.spool = spool if spool is not None else shared_spool()
        self.stats = RequestStats()

    @classmethod
    def from_url(cls, url: str) -> "S3Backend":
        """``s3://bucket/prefix[?endpoint=URL&region=R&profile=P&grace_ms=N]``."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise BackendError(f"{url!r}: expected s3://bucket/prefix[?endpoint=...&region=...]")
        q = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = sorted(set(q) - set(_URL_OPTIONS))
        if unknown:
            raise BackendError(f"{url}: unknown option {unknown[0]!r} (known: "
                               f"{', '.join(_URL_OPTIONS)})")
        grace = q.get("grace_ms")
        if grace is not None and not grace.isdigit():
            raise BackendError(f"{url}: grace_ms must be a whole number of milliseconds")
        return cls(parts.netloc, parts.path, endpoint=q.get("endpoint") or None,
                   region=q.get("region") or None, profile=q.get("profile") or None,
                   grace_ms=None if grace is None else int(grace))

    # -- plumbing --------------------------------------------------------------------------

    @property
    def client(self):
        if self._client is None:
            self._client = make_client(self.endpoint, self.region, self.profile)
        return self._client

    def _key(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise BackendError(f"refusing a path outside the store: {path!r}")
        return f"{self.prefix}/{path}" if self.prefix and path else (self.prefix or path)

    def _dir_key(self, path: str) -> str:
        k = self._key(path.rstrip("/")) if path else self.prefix
        return f"{k}/" if k else ""

    def _cache_key(self, path: str) -> str:
        return f"{self.endpoint or ''}|{self.bucket}/{self._key(path)}"

    def _endpoint_name(self) -> str:
        try:
            return self.client.meta.endpoint_url
        except Exception:  # noqa: BLE001 - only for a message
            return self.endpoint or "the default AWS endpoint"

    def _error(self, e: BaseException, op: str, path: str) -> BaseException:
        """Translate a botocore exception into FileNotFoundError or an S3Error (one line)."""
        from botocore import exceptions as bx
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = str(err.get("Message", "") or "").splitlines()[0] if err.get("Message") else ""
            if code == "NoSuchBucket":
                return S3BucketNotFoundError(
                    f"{self.url}: bucket {self.bucket!r} does not exist at {self._endpoint_name()}"
                    "; create it or fix the store URL")
            if code == "NoSuchKey" or (status == 404 and op == "HeadObject"):
                return FileNotFoundError(errno.ENOENT, "no such object", path)
            if status == 404:
                # S3 names every 404 of a GET or a listing (NoSuchKey, NoSuchBucket): a bare
                # one comes from something that is not an S3 server
                return S3UnreachableError(
                    f"{self.url}: {self._endpoint_name()} answered {op} with a bare 404 Not "
                    f"Found: it does not look like an S3 endpoint; check ?endpoint= / "
                    "AWS_ENDPOINT_URL")
            if code in _ACCESS_CODES or status == 403:
                return S3AccessError(
                    f"{self.url}: access denied by {self._endpoint_name()} ({code or status}): "
                    "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or "
                    "AWS_PROFILE) and that they may use this bucket")
            return S3Error(f"{self.url}: S3 {op} of {path or '/'} failed: {code or status}"
                           + (f" ({msg})" if msg else ""), code=code or str(status))
        if isinstance(e, bx.NoCredentialsError):
            return S3AccessError(f"{self.url}: no AWS credentials found: set AWS_ACCESS_KEY_ID "
                                 "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                          bx.ConnectionClosedError, bx.ReadTimeoutError, bx.ProxyConnectionError)):
            reason = str(e).splitlines()[0]
            return S3UnreachableError(
                f"{self.url}: cannot reach the S3 endpoint {self._endpoint_name()} ({reason}); "
                "check ?endpoint= / AWS_ENDPOINT_URL and that the server is up")
        if isinstance(e, bx.ParamValidationError):
            return S3Error(f"{self.url}: invalid S3 request for {path!r}: "
                           f"{str(e).splitlines()[0]}")
        if isinstance(e, bx.BotoCoreError):
            return S3Error(f"{self.url}: S3 {op} of {path or '/'} failed: "
                           f"{str(e).splitlines()[0]}")
        return e

    def _call(self, op: str, path: str, fn_, **kw):
        from botocore import exceptions as bx
        self.stats.count(op)
        try:
            return fn_(Bucket=self.bucket, **kw)
        except (bx.ClientError, bx.BotoCoreError) as e:
            raise self._error(e, op, path) from None

    # -- reads -----------------------------------------------------------------------------

    def _get(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """One GET (ranged when start/length say so); past the end is b''."""
        kw = {}
        if length is not None:
            if length <= 0:
                return b""
            kw["Range"] = f"bytes={start}-{start + length - 1}"
        elif start:
            kw["Range"] = f"bytes={start}-"
        try:
            r = self._call("GetObject", path, self.client.get_object, Key=self._key(path), **kw)
        except S3Error as e:
            if e.code in ("InvalidRange", "416"):
                return b""
            raise
        try:
            data = r["Body"].read()
        except Exception as e:  # noqa: BLE001 - a broken stream
            raise S3Error(f"{self.url}: reading {path} failed mid-stream: {e}") from None
        self.stats.count("", down=len(data))
        return data

    def _spooled(self, path: str) -> tuple[str, int] | None:
        if not fn.is_immutable_object(path):
            return None
        return self.spool.get(self._cache_key(path))

    @property
    def block_size(self) -> int:
        """The block cache's block: a ranged read of an immutable object fetches whole blocks
        (the partition reader reads a few .bcq entries by range when the .bcq is larger)."""
        return self.cache.block_size

    def has_local_copy(self, path: str) -> bool:
        """Whether ``map``/``read`` of this object would be served from the spool (no request)."""
        return self._spooled(path) is not None

    def read(self, path, start=0, length=None):
        hit = self._spooled(path)
        if hit is not None:
            with open(hit[0], "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        if length is None and not start and fn.is_journal_entry(path) \
                and block_source() is not None:  # written once and small: one block
            blk = self._block_miss(path, 0)
            if len(blk) < self.cache.block_size:
                return blk
        if length is None or not fn.is_immutable_object(path):
            return self._get(path, start, length)
        if length <= 0:
            return b""
        bs = self.cache.block_size
        ck = self._cache_key(path)
        end = start + length
        out = []
        for b in range(start // bs, (end - 1) // bs + 1):
            blk = self.cache.get(ck, b, lambda b=b: self._block_miss(path, b))
            lo = max(0, start - b * bs)
            hi = min(len(blk), end - b * bs)
            if lo >= len(blk):
                break
            out.append(blk[lo:hi] if (lo, hi) != (0, len(blk)) else blk)
            if len(blk) < bs:
                break  # the object's last block
        return out[0] if len(out) == 1 else b"".join(out)

    def _block_miss(self, path: str, b: int) -> bytes:
        """Block ``b`` of an immutable object not in the cache: through the block source when
        one is installed (s3_cache.set_block_source), else one GET."""
        bs = self.cache.block_size
        src = block_source()
        if src is None:
            return self._get(path, b * bs, bs)
        return src.fetch(self, path, b, lambda: self._get(path, b * bs, bs))

    def read_block(self, path: str, b: int) -> bytes:
        """Block ``b`` of the immutable object ``path`` from the spool, the cache or one GET,
        never through the block source (how a fleet's owner node answers for its blocks)."""
        bs = self.cache.block_size
        hit = self._spooled(path)
        if hit is not None:
            with open(hit[0], "rb") as f:
                f.seek(b * bs)
                return f.read(bs)
        return self.cache.get(self._cache_key(path), b, lambda: self._get(path, b * bs, bs))

    def has_block(self, path: str, b: int) -> bool:
        """Whether ``read_block(path, b)`` would send no request."""
        return self._spooled(path) is not None or self.cache.has(self._cache_key(path), b)

    def open_read(self, path, start=0):
        hit = self._spooled(path)
        if hit is not None:
            f = open(hit[0], "rb", buffering=0)
            if start:
                f.seek(start)
            return f
        kw = {"Range": f"bytes={start}-"} if start else {}
        try:
            r = self._call("GetObject", path, self.client.get_object, Key=self._key(path), **kw)
        except S3Error as e:
            if e.code in ("InvalidRange", "416"):
                return io.BytesIO(b"")
            raise
        return _ObjectStream(r["Body"], lambda n: self.stats.count("", down=n), path)

    def _download(self, path: str) -> Callable[[str], int]:
        if block_source() is not None:
            return self._download_blocks(path)

        def run(dst: str) -> int:
            r = self._call("GetObject", path, self.client.get_object, Key=self._key(path))
            body = r["Body"]
            n = 0
            try:
                with open(dst, "wb") as f:
                    while True:
                        chunk = body.read(1 << 20)
                        if not chunk:
                            break
                        f.write(chunk)
                        n += len(chunk)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken stream
                raise S3Error(f"{self.url}: downloading {path} failed mid-stream: {e}") from None
            finally:
                body.close()
            self.stats.count("", down=n)
            return n
        return run

    def _download_blocks(self, path: str) -> Callable[[str], int]:
        """``_download`` block by block through the block source (a fleet's owner nodes)."""
        def run(dst: str) -> int:
            bs, n, b = self.cache.block_size, 0, 0
            with open(dst, "wb") as f:
                while True:
                    blk = self._block_miss(path, b)
                    f.write(blk)
                    n += len(blk)
                    if len(blk) < bs:
                        return n
                    b += 1
        return run

    def map(self, path, size=None):
        if not fn.is_immutable_object(path):
            data = self._get(path, 0, size) if size is not None else self._get(path)
            return np.frombuffer(data, dtype=np.uint8)
        ospath, have = self.spool.fetch(self._cache_key(path), self._download(path))
        n = have if size is None else min(size, have)
        if n == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(ospath, dtype=np.uint8, mode="r", shape=(n,))

    def size(self, path):
        hit = self._spooled(path)
        if hit is not None:
            return hit[1]
        r = self._call("HeadObject", path, self.client.head_object, Key=self._key(path))
        return int(r["ContentLength"])

    def isdir(self, path):
        r = self._call("ListObjectsV2", path, self.client.list_objects_v2,
                       Prefix=self._dir_key(path), MaxKeys=1)
        return int(r.get("KeyCount", 0)) > 0

    def _pages(self, path: str, **kw) -> Iterator[dict]:
        token = None
        while True:
            extra = dict(kw)
            if token:
                extra["ContinuationToken"] = token
            r = self._call("ListObjectsV2", path, self.client.list_objects_v2,
                           Prefix=self._dir_key(path), **extra)
            yield r
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")

    def listdir(self, path):
        pre = self._dir_key(path)
        names = set()
        for r in self._pages(path, Delimiter="/"):
            for c in r.get("Contents", []):
                name = c["Key"][len(pre):]
                if name:
                    names.add(name)
            for cp in r.get("CommonPrefixes", []):
                name = cp["Prefix"][len(pre):].rstrip("/")
                if name:
                    names.add(name)
        return sorted(names)

    def list_objects(self, path: str, start_after: str | None = None
                     ) -> list[tuple[str, int, int]]:
        """Every object under ``path/`` (recursively): (name relative to it, size, last modified
        in ms since the epoch), sorted by name. ``start_after``: only names after this one."""
        pre = self._dir_key(path)
        kw = {"StartAfter": pre + start_after} if start_after else {}
        out = []
        for r in self._pages(path, **kw):
            for c in r.get("Contents", []):
                out.append((c["Key"][len(pre):], int(c.get("Size", 0)),
                            int(c["LastModified"].timestamp() * 1000)))
        return sorted(out)

    # -- writes ----------------------------------------------------------------------------

    def write_atomic(self, path, data):
        data = bytes(data)
        self._call("PutObject", path, self.client.put_object, Key=self._key(path), Body=data)
        self.stats.count("", up=len(data))

    def create_exclusive(self, path, data):
        data = bytes(data)
        try:
            self._call("PutObject", path, self.client.put_object, Key=self._key(path), Body=data,
                       IfNoneMatch="*")
        except S3Error as e:
            # 412: it exists. 409: a concurrent conditional write to the same key is in flight;
            # either way this one did not create it (the caller re-reads and decides).
            if e.code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            if "IfNoneMatch" in str(e):
                raise S3Error(f"{self.url}: this boto3 cannot make conditional writes "
                              "(If-None-Match); pip install -U 'boto3>=1.35'") from None
            raise
        self.stats.count("", up=len(data))
        return True

    def upload_file(self, path: str, ospath: str) -> int:
        """Upload a local file as one object with a single PUT; returns its size."""
        size = os.path.getsize(ospath)
        if size > MAX_PUT_BYTES:
            raise S3Error(f"{self.url}: {path} is {size} bytes, over S3's single-PUT limit")
        with open(ospath, "rb") as f:
            self._call("PutObject", path, self.client.put_object, Key=self._key(path), Body=f,
                       ContentLength=size)
        self.stats.count("", up=size)
        return size

    def seed(self, path: str, ospath: str) -> None:
        """Hand a local file holding exactly the bytes of the immutable object ``path`` to the
        spool (it is moved): reading that object back then costs no request."""
        if fn.is_immutable_object(path):
            self.spool.seed(self._cache_key(path), ospath)

    def delete(self, path):
        self._call("DeleteObject", path, self.client.delete_object, Key=self._key(path))

    def delete_many(self, paths: list[str]) -> None:
        """Delete objects, up to 1000 per request; missing ones are fine."""
        for i in range(0, len(paths), 1000):
            batch = paths[i:i + 1000]
            if len(batch) == 1:
                self.delete(batch[0])
                continue
            r = self._call("DeleteObjects", batch[0], self.client.delete_objects,
                           Delete={"Objects": [{"Key": self._key(p)} for p in batch],
                                   "Quiet": True})
            errs = r.get("Errors") or []
            if errs:
                e = errs[0]
                raise S3Error(f"{self.url}: deleting {e.get('Key')} failed: {e.get('Code')} "
                              f"{e.get('Message', '')}".rstrip())

    def rename(self, src, dst):
        """Copy then delete: not atomic on S3 (stores on S3 never rely on a rename)."""
        self._call("CopyObject", src, self.client.copy_object, Key=self._key(dst),
                   CopySource={"Bucket": self.bucket, "Key": self._key(src)})
        self.delete(src)

    def open_append(self, path) -> AppendFile:
        raise BackendError(f"{self.url}: S3 objects cannot be appended to ({path}); a writer's "
                           "commit log and active segments live in its local commitlog_dir")

    def remove_tree(self, path):
        self.delete_many([f"{path.rstrip('/')}/{name}" if path else name
                          for name, _, _ in self.list_objects(path)])
