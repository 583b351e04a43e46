"""An in-memory S3 for unit tests: the boto3 client calls ``kcompact.reput.s3.S3Backend`` makes, with
S3's answers (NoSuchKey, NoSuchBucket, 412 on If-None-Match, ranged GETs, paged listings),
in the style of ``kcompact.reput.MemoryBackend``. No network, no process."""

from __future__ import annotations

import datetime as _dt
import io
import threading
import time
from collections import Counter
from types import SimpleNamespace

from botocore.exceptions import ClientError


def _err(code: str, status: int, op: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class _Body:
    def __init__(self, data: bytes, delay: float = 0.0):
        self._f = io.BytesIO(data)
        self._delay = delay

    def read(self, n: int | None = None) -> bytes:
        if self._delay:
            time.sleep(self._delay)
            self._delay = 0.0
        return self._f.read() if n is None else self._f.read(n)

    def close(self) -> None:
        pass


class FakeS3:
    """``FakeS3(buckets=("b",))``; ``.objects[bucket][key] = (bytes, mtime)``; ``.calls``
    counts operations; ``.get_delay`` slows every GET (to make requests overlap);
    ``.before_put(key)`` may raise to simulate a crash before an upload."""

    def __init__(self, buckets=("bucket",), page_size: int = 1000):
        self.objects: dict[str, dict[str, tuple[bytes, _dt.datetime]]] = {b: {} for b in buckets}
        self.lock = threading.Lock()
        self.calls: Counter = Counter()
        self.meta = SimpleNamespace(endpoint_url="memory://fake-s3")
        self.get_delay = 0.0
        self.page_size = page_size
        self.before_put = None
        self.clock = lambda: _dt.datetime.now(_dt.timezone.utc)

    def _bucket(self, bucket: str, op: str) -> dict:
        if bucket not in self.objects:
            raise _err("NoSuchBucket", 404, op)
        return self.objects[bucket]

    def get_object(self, Bucket, Key, Range=None):
        self.calls["GetObject"] += 1
        objs = self._bucket(Bucket, "GetObject")
        if Key not in objs:
            raise _err("NoSuchKey", 404, "GetObject")
        data = objs[Key][0]
        if Range:
            spec = Range.split("=", 1)[1]
            a, _, b = spec.partition("-")
            a = int(a)
            if a >= len(data):
                raise _err("InvalidRange", 416, "GetObject")
            data = data[a:(int(b) + 1 if b else len(data))]
        return {"Body": _Body(data, self.get_delay), "ContentLength": len(data)}

    def head_object(self, Bucket, Key):
        self.calls["HeadObject"] += 1
        objs = self.objects.get(Bucket)
        if objs is None or Key not in objs:
            raise _err("404", 404, "HeadObject")
        return {"ContentLength": len(objs[Key][0])}

    def put_object(self, Bucket, Key, Body, IfNoneMatch=None, ContentLength=None):
        self.calls["PutObject"] += 1
        objs = self._bucket(Bucket, "PutObject")
        if self.before_put is not None:
            self.before_put(Key)
        data = Body if isinstance(Body, (bytes, bytearray)) else Body.read()
        with self.lock:
            if IfNoneMatch == "*" and Key in objs:
                raise _err("PreconditionFailed", 412, "PutObject")
            objs[Key] = (bytes(data), self.clock())
        return {}

    def copy_object(self, Bucket, Key, CopySource):
        self.calls["CopyObject"] += 1
        src = self._bucket(CopySource["Bucket"], "CopyObject")
        if CopySource["Key"] not in src:
            raise _err("NoSuchKey", 404, "CopyObject")
        self._bucket(Bucket, "CopyObject")[Key] = (src[CopySource["Key"]][0], self.clock())
        return {}

    def delete_object(self, Bucket, Key):
        self.calls["DeleteObject"] += 1
        self._bucket(Bucket, "DeleteObject").pop(Key, None)
        return {}

    def delete_objects(self, Bucket, Delete):
        self.calls["DeleteObjects"] += 1
        objs = self._bucket(Bucket, "DeleteObjects")
        for o in Delete["Objects"]:
            objs.pop(o["Key"], None)
        return {}

    def list_objects_v2(self, Bucket, Prefix="", Delimiter=None, MaxKeys=None, StartAfter=None,
                        ContinuationToken=None):
        self.calls["ListObjectsV2"] += 1
        objs = self._bucket(Bucket, "ListObjectsV2")
        keys = sorted(k for k in objs if k.startswith(Prefix))
        items: list[tuple[str, str]] = []  # (sort key, kind)
        seen = set()
        for k in keys:
            if StartAfter and k <= StartAfter:
                continue
            rest = k[len(Prefix):]
            if Delimiter and Delimiter in rest:
                cp = Prefix + rest.split(Delimiter, 1)[0] + Delimiter
                if cp not in seen:
                    seen.add(cp)
                    items.append((cp, "prefix"))
            else:
                items.append((k, "key"))
        start = int(ContinuationToken or 0)
        limit = min(MaxKeys or self.page_size, self.page_size)
        page = items[start:start + limit]
        out = {"KeyCount": len(page), "IsTruncated": start + limit < len(items),
               "Contents": [{"Key": k, "Size": len(objs[k][0]), "LastModified": objs[k][1]}
                            for k, kind in page if kind == "key"],
               "CommonPrefixes": [{"Prefix": k} for k, kind in page if kind == "prefix"]}
        if out["IsTruncated"]:
            out["NextContinuationToken"] = str(start + limit)
        return out
