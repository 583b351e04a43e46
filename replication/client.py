"""HTTP client of the replication protocol (aiohttp), with the replica's retry policy.

* The first request fails fast: a master that is down, a bad URL or a refused token is reported
  at once as one line (``MasterUnavailableError``, ``AuthError``, ``ReplicationError``).
* Once the master has answered, a connection error, a cut-short body, a timeout or a 502/503/504
  is retried with exponential backoff (0.2 s .. 5 s) for up to ``retry_s`` seconds (None:
  forever, as `replicate --follow` does), so a master restart mid-transfer only pauses the rebuild.
* 401/403 raise ``AuthError``; other 4xx raise with the master's own message; a 500, or an
  error frame ending a digests body, raises ``MasterStoreError`` (the master's store cannot serve
  it: the message names the master's file and byte), never retried. A records body cut short is
  asked for again with ``check=1``, so a master that cannot send a range (an I/O error during
  sendfile) answers the retry with that 500 instead of being retried for minutes.
* Every body is read with our own idle bound (about ``read_timeout_s`` without a byte): aiohttp's
  ``sock_read`` timer is stopped when its parser fails inside a body, and that body's stream is
  then never ended, so a read without this bound could wait forever (issue 26).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from pyroaring import BitMap64

from kcompact.reput.env import ENV

from .errors import AuthError, MasterUnavailableError, ProtocolError, ReplicationError
from .protocol import (API_PREFIX, CT_BITMAP, CT_DIGESTS, CT_RECORDS, CT_SEGMENT_FILE,
                       H_FILE_SIZE, H_HIGH_WATERMARK, H_LIVE_COUNT, H_NEXT_OFFSET, H_PROTOCOL,
                       H_RECORD_COUNT, H_SEGMENT_ID, H_STORE_ID, H_UPTO, PROTOCOL_VERSIONS,
                       SEGMENTS_VERSION, DigestFrame, FrameReader, master_error, partition_path,
                       segment_file_path)

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout below 3.11; same API
    from async_timeout import timeout as _timeout

DEFAULT_RETRY_S = ENV["KCOMPACT_REPLICATION_RETRY_S"].default
_RETRY_STATUSES = (502, 503, 504)
_SPOKEN = {str(v) for v in PROTOCOL_VERSIONS}


class SegmentChanged(ReplicationError):
    """409: the segment a version-2 request named was compacted or resealed since it was
    listed (the replica lists the partition's segments again)."""


def versions_line(url: str, theirs: list) -> str:
    """The one line for a master that speaks no version this kcompact speaks."""
    named = ", ".join(str(v) for v in theirs) or "none"
    ours = " and ".join(str(v) for v in PROTOCOL_VERSIONS)
    return (f"master {url} speaks replication protocol {named}, this kcompact speaks {ours}: "
            "use the same kcompact version on both sides (upgrade the older one)")


def negotiate(doc: dict, url: str, wanted: int | None = None) -> tuple[int, str | None]:
    """(the protocol version to use with the master whose ``/v1/store`` is ``doc``, a note to
    print once or None). A master without ``protocols`` predates version 2: version 1, said
    once. ``wanted`` (KCOMPACT_REPLICATION_PROTOCOL) caps the version (1: records only)."""
    theirs = doc.get("protocols")
    if theirs is None:
        theirs = [doc.get("protocol", 1)]
    if not isinstance(theirs, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in theirs):
        raise ProtocolError(f"master {url}: /v1/store's protocols is not a list of versions")
    common = sorted(set(theirs) & set(PROTOCOL_VERSIONS))
    if not common:
        raise ProtocolError(versions_line(url, theirs))
    best = common[-1] if wanted is None else max(v for v in common if v <= wanted)
    note = None
    if best < SEGMENTS_VERSION and (wanted is None or wanted >= SEGMENTS_VERSION):
        note = (f"master {url} speaks replication protocol {', '.join(map(str, theirs))} only: "
                "pulling records (version 1), not stored batches; upgrade its kcompact to "
                "pull less")
    return best, note


def check_master_url(url: str) -> str:
    """``http(s)://HOST:PORT`` without path, query or credentials; returns it without a trailing
    slash. Raises ReplicationError naming what is wrong."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        u, port = None, None
    if (u is None or u.scheme not in ("http", "https") or not u.hostname or u.username
            or u.password or u.query or u.fragment or u.path not in ("", "/")):
        raise ReplicationError(f"master URL {url!r}: expected http://HOST:PORT or "
                               "https://HOST:PORT (what `kcompact serve` printed)")
    del port
    return url.rstrip("/")


@dataclass
class Chunk:
    body: np.ndarray  # uint8, the records byte for byte
    next_offset: int
    count: int
    high_watermark: int


def _int_header(resp: aiohttp.ClientResponse, name: str) -> int:
    v = resp.headers.get(name)
    if v is None or not v.isdigit():
        raise ProtocolError(f"{resp.url}: response without a valid {name} header "
                            "(is this a kcompact server of the same version?)")
    return int(v)


async def body_chunks(resp: aiohttp.ClientResponse, idle_s: float) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, for a caller that works between chunks (verify's
    digests). No byte for ``idle_s`` seconds raises asyncio.TimeoutError; the bound is armed only
    while waiting for the network, and it holds whatever state aiohttp's parser is in."""
    content = resp.content
    while True:
        data = content.read_nowait()
        if not data:
            if content.at_eof():
                return
            async with _timeout(idle_s):
                data = await content.readany()
            if not data:
                return
        yield data


async def _read_into(resp: aiohttp.ClientResponse, idle_s: float, sink: Callable) -> None:
    """``sink(chunk)`` for every chunk of the body (a sink that does not wait); no byte for
    about ``idle_s`` seconds (idle_s/2 .. idle_s) raises asyncio.TimeoutError. One timer for
    the whole body, moved forward at most every idle_s/2: a timer per read costs ~10% of the
    client's CPU on a records pull."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + idle_s
    async with _timeout(idle_s) as cm:
        async for chunk in resp.content.iter_any():
            sink(chunk)
            now = loop.time()
            if now > deadline - idle_s / 2:
                deadline = now + idle_s
                cm.reschedule(deadline)


async def read_all(resp: aiohttp.ClientResponse, idle_s: float) -> bytes:
    parts: list[bytes] = []
    await _read_into(resp, idle_s, parts.append)
    return b"".join(parts)


async def _read_body(resp: aiohttp.ClientResponse, idle_s: float,
                     into: np.ndarray | None = None):
    """The body as a uint8 array filled chunk by chunk as it arrives (one copy; ``read()``
    keeps every chunk and joins them, a second copy of a response of up to 64 MiB): in the
    front of ``into`` when it is large enough (a caller's reused buffer: fresh memory costs a
    page fault every 4 KiB), else a new array. A body that ends before its Content-Length
    raises ClientPayloadError (retried by ``_request``)."""
    length = resp.content_length
    if length is None:
        return np.frombuffer(await read_all(resp, idle_s), np.uint8)
    out = (into[:length] if into is not None and into.shape[0] >= length
           else np.empty(length, np.uint8))
    pos = 0

    def sink(chunk: bytes) -> None:
        nonlocal pos
        n = len(chunk)
        if pos + n > length:
            raise ProtocolError(f"{resp.url}: body longer than its Content-Length {length}")
        out[pos:pos + n] = np.frombuffer(chunk, np.uint8)
        pos += n
    await _read_into(resp, idle_s, sink)
    if pos != length:
        raise aiohttp.ClientPayloadError(f"body cut short: {pos} of {length} bytes")
    return out


class MasterClient:
    def __init__(self, url: str, token: bytes, *, retry_s: float | None = None,
                 read_timeout_s: float = 120.0,
                 on_retry: Callable[[str], None] | None = None):
        self.url = check_master_url(url)
        self.token = token
        self.retry_s = DEFAULT_RETRY_S if retry_s is None else retry_s
        self.read_timeout_s = read_timeout_s
        self.on_retry = on_retry
        self.contacted = False
        self.store_id: str | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "MasterClient":
        ctx: ssl.SSLContext | bool = True
        if self.url.startswith("https:"):
            ctx = ssl.create_default_context()  # honours SSL_CERT_FILE for a private CA
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token.decode()}"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                          sock_read=self.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=16, ssl=ctx),
            auto_decompress=False, raise_for_status=False,
            read_bufsize=1 << 20)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the one request loop -----------------------------------------------------------------

    async def _request(self, path: str, params: dict, handle, *, forever: bool = False,
                       retry_params: dict | None = None):
        """GET ``path``; ``handle(resp)`` reads the response (inside the retry loop, so a body
        cut short is retried too; ``retry_params`` are added to the retries' query). Returns
        what ``handle`` returns."""
        assert self._session is not None, "use `async with MasterClient(...)`"
        first_fail = None
        delay = 0.2
        while True:
            try:
                async with self._session.get(self.url + path, params=params) as resp:
                    if resp.status in (401, 403):
                        raise AuthError(
                            f"master {self.url} refused the request: "
                            + ("no token was sent (401)" if resp.status == 401 else
                               "wrong token (403); pass the --token-file the master uses"))
                    if resp.status in _RETRY_STATUSES:
                        raise _Retry(f"HTTP {resp.status}: {await self._message(resp)}")
                    if resp.status == 409:
                        raise SegmentChanged(await self._message(resp))
                    if resp.status != 200:
                        raise await self._refusal(resp, path)
                    proto = resp.headers.get(H_PROTOCOL)
                    if proto not in _SPOKEN:
                        raise ProtocolError(versions_line(self.url, [proto]))
                    sid = resp.headers.get(H_STORE_ID)
                    if self.store_id is not None and sid != self.store_id:
                        raise ReplicationError(f"master {self.url} now serves another store "
                                               f"({sid}, was {self.store_id}); start again")
                    self.store_id = sid
                    out = await handle(resp)
                    self.contacted = True
                    return out
            except aiohttp.ClientResponseError as e:  # a status line or headers aiohttp refuses
                raise _not_http(self.url + path, e) from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                    asyncio.TimeoutError, _Retry) as e:
                reason = _reason(e)
                if not self.contacted:
                    raise MasterUnavailableError(
                        f"cannot reach the master at {self.url}: {reason}; is `kcompact serve` "
                        "running there?") from None
                now = time.monotonic()
                if first_fail is None:
                    first_fail = now
                    if self.on_retry:
                        self.on_retry(f"master {self.url} unreachable ({reason}); retrying"
                                      + ("" if forever else f" for up to {self.retry_s:.0f}s"))
                if not forever and now - first_fail > self.retry_s:
                    raise MasterUnavailableError(
                        f"the master at {self.url} has been unreachable for "
                        f"{now - first_fail:.0f}s ({reason}); run `kcompact replicate` again "
                        "when it is back: it resumes where it stopped") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                if retry_params:
                    params = {**params, **retry_params}

    async def _error_doc(self, resp: aiohttp.ClientResponse) -> dict | None:
        """The JSON error document of a non-200 answer (None when there is none)."""
        raw = bytearray()
        try:
            async for chunk in body_chunks(resp, self.read_timeout_s):
                raw += chunk
                if len(raw) > 64 * 1024:
                    return None
            doc = json.loads(raw)
        except Exception:  # noqa: BLE001 - best effort: the status is reported anyway
            return None
        return doc if isinstance(doc, dict) else None

    async def _message(self, resp: aiohttp.ClientResponse, doc: dict | None = None) -> str:
        doc = doc or await self._error_doc(resp)
        return str(doc["error"]) if doc and "error" in doc else (resp.reason or "")

    async def _refusal(self, resp: aiohttp.ClientResponse, path: str) -> ReplicationError:
        """The error of a non-200 answer that is not retried: a 500 is the master's store
        failing (MasterStoreError, naming its file and byte), anything else the request."""
        where = f"master {self.url}{path}"
        doc = await self._error_doc(resp)
        if resp.status == 500:
            return master_error(doc, 500, where)
        return ReplicationError(f"{where}: HTTP {resp.status}: {await self._message(resp, doc)}")

    # -- resources ------------------------------------------------------------------------------

    async def store_doc(self, forever: bool = False) -> dict:
        async def handle(resp):
            try:
                doc = json.loads(await read_all(resp, self.read_timeout_s))
            except ValueError:
                doc = None
            check_store_doc(doc, self.url)
            return doc
        return await self._request(f"{API_PREFIX}/store", {}, handle, forever=forever)

    async def partition_info(self, topic: str, partition: int) -> dict:
        async def handle(resp):
            return json.loads(await read_all(resp, self.read_timeout_s))
        return await self._request(partition_path(topic, partition), {}, handle)

    async def records(self, topic: str, partition: int, from_offset: int, max_bytes: int,
                      wait_ms: int = 0, forever: bool = False, check: bool = False) -> Chunk:
        """One records response. ``check``: ask the master to CRC-check what it sends (it
        answers 500 naming file and byte if its store is damaged there; a retry always asks
        for that)."""
        async def handle(resp):
            if resp.content_type != CT_RECORDS:
                raise ProtocolError(f"{resp.url}: content type {resp.content_type!r}")
            nxt = _int_header(resp, H_NEXT_OFFSET)
            count = _int_header(resp, H_RECORD_COUNT)
            hwm = _int_header(resp, H_HIGH_WATERMARK)
            return Chunk(await _read_body(resp, self.read_timeout_s), nxt, count, hwm)
        params = {"from": str(from_offset), "max_bytes": str(max_bytes)}
        if wait_ms:
            params["wait_ms"] = str(wait_ms)
        if check:
            params["check"] = "1"
        return await self._request(partition_path(topic, partition, "records"), params, handle,
                                   forever=forever, retry_params={"check": "1"})

    async def segments(self, topic: str, partition: int) -> dict:
        """Version 2: the partition's segments (``GET .../segments``), shape-checked."""
        async def handle(resp):
            try:
                doc = json.loads(await read_all(resp, self.read_timeout_s))
            except ValueError:
                doc = None
            return check_segments_doc(doc, f"{self.url}{path}")
        path = partition_path(topic, partition, "segments")
        return await self._request(path, {}, handle)

    async def segment_file(self, topic: str, partition: int, base: int, file: str, sid: str,
                           start: int, max_bytes: int, into: np.ndarray | None = None
                           ) -> np.ndarray | None:
        """Version 2: bytes [start, start + max_bytes) of a sealed segment's ``file`` (log or
        index) as the master stores it (in the front of ``into`` when it is large enough: valid
        until the caller's next request into it); None when the segment changed since it was
        listed (409). Retried as records are (a cut body is asked for again)."""
        async def handle(resp):
            if resp.content_type != CT_SEGMENT_FILE:
                raise ProtocolError(f"{resp.url}: content type {resp.content_type!r}")
            size = _int_header(resp, H_FILE_SIZE)
            if resp.headers.get(H_SEGMENT_ID) != sid:
                raise ProtocolError(f"{resp.url}: the master sent another segment version")
            body = await _read_body(resp, self.read_timeout_s, into)
            want = max(0, min(max_bytes, size - start))
            if body.shape[0] != want:
                raise ProtocolError(f"{resp.url}: {body.shape[0]} bytes of the {file} from byte "
                                    f"{start}, expected {want}")
            return body
        params = {"id": sid, "from": str(start), "max_bytes": str(max_bytes)}
        try:
            return await self._request(segment_file_path(topic, partition, base, file), params,
                                       handle)
        except SegmentChanged:
            return None

    async def live(self, topic: str, partition: int, upto: int | None) -> tuple[BitMap64, int]:
        async def handle(resp):
            if resp.content_type != CT_BITMAP:
                raise ProtocolError(f"{resp.url}: content type {resp.content_type!r}")
            up = _int_header(resp, H_UPTO)
            count = _int_header(resp, H_LIVE_COUNT)
            body = await read_all(resp, self.read_timeout_s)
            try:
                bm = BitMap64.deserialize(body)
            except Exception:  # noqa: BLE001 - pyroaring raises several types
                raise ProtocolError(f"{resp.url}: the live bitmap does not deserialize") from None
            if len(bm) != count:
                raise ProtocolError(f"{resp.url}: live bitmap holds {len(bm)} offsets, the "
                                    f"header says {count}")
            return bm, up
        params = {} if upto is None else {"upto": str(upto)}
        return await self._request(partition_path(topic, partition, "live"), params, handle)

    async def digests(self, topic: str, partition: int, upto: int, salt: bytes
                      ) -> AsyncIterator[DigestFrame]:
        """Frames of the master's digests body, as they arrive (not retried: a verify that loses
        its master mid-stream fails and can simply be run again)."""
        assert self._session is not None
        path = partition_path(topic, partition, "digests")
        try:
            async with self._session.get(self.url + path,
                                         params={"upto": str(upto), "salt": salt.hex()}) as resp:
                if resp.status in (401, 403):
                    raise AuthError(f"master {self.url} refused the request ({resp.status})")
                if resp.status != 200:
                    raise await self._refusal(resp, path)
                if resp.content_type != CT_DIGESTS:
                    raise ProtocolError(f"{resp.url}: content type {resp.content_type!r}")
                reader = FrameReader(f"master {self.url}{path}")
                async for data in body_chunks(resp, self.read_timeout_s):
                    for frame in reader.feed(data):
                        yield frame
                if not reader.done:
                    raise ProtocolError(f"{self.url}{path}: the digests body was cut short")
        except aiohttp.ClientResponseError as e:
            raise _not_http(self.url + path, e) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.TimeoutError) as e:
            raise MasterUnavailableError(f"lost the master at {self.url} while reading "
                                         f"{topic}-{partition} digests: {_reason(e)}") from None


def unavailable_partitions(doc: dict) -> list[tuple[str, int, str]]:
    """(topic, partition, reason) of each partition a store document lists as held by the
    master but not served (``unavailable``: replication-protocol.md)."""
    return [(t["topic"], int(u["partition"]), u["reason"]) for t in doc.get("topics", [])
            for u in t.get("unavailable", [])]


def check_store_doc(doc, url: str) -> None:
    """Refuse a store document whose shape is not what protocol 1 sends (names, ints >= 0)."""
    from kcompact.reput.record import validate_topic

    def ok() -> bool:
        if not isinstance(doc, dict) or not isinstance(doc.get("store_id"), str) \
                or not isinstance(doc.get("topics"), list):
            return False
        for t in doc["topics"]:
            if not isinstance(t, dict) or not isinstance(t.get("partitions"), list) \
                    or not isinstance(t.get("config", {}), dict):
                return False
            validate_topic(t.get("topic"))
            for p in t["partitions"]:
                if not isinstance(p, dict) or not all(
                        isinstance(p.get(k), int) and p[k] >= 0
                        for k in ("partition", "first_offset", "next_offset")):
                    return False
            for u in t.get("unavailable", []):  # (absent before issue 44)
                if not isinstance(u, dict) or not isinstance(u.get("partition"), int) \
                        or u["partition"] < 0 or not isinstance(u.get("reason"), str):
                    return False
        return True
    try:
        good = ok()
    except ValueError:
        good = False
    if not good:
        raise ProtocolError(f"master {url}: /v1/store is not a valid store document")


def check_segments_doc(doc, where: str) -> dict:
    """Refuse a segments listing whose shape is not what protocol 2 sends."""
    ints = ("base", "format", "records", "first_offset", "last_offset")
    sealed2 = ("log_size", "index_size")

    def ok() -> bool:
        if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list) \
                or not isinstance(doc.get("next_offset"), int):
            return False
        for s in doc["segments"]:
            if not isinstance(s, dict) or not all(isinstance(s.get(k), int) for k in ints):
                return False
            if s["format"] == 2 and s.get("sealed") is True and not (
                    all(isinstance(s.get(k), int) and s[k] >= 0 for k in sealed2)
                    and isinstance(s.get("id"), str)):
                return False
        return True
    if not ok():
        raise ProtocolError(f"master {where}: not a valid segments listing")
    return doc


class _Retry(Exception):
    pass


def _not_http(where: str, e: aiohttp.ClientResponseError) -> ProtocolError:
    return ProtocolError(f"master {where}: not a valid HTTP response ({' '.join(e.message.split())}"
                         "); is a kcompact serve of the same version at that address?")


def _reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        return str(e.os_error.strerror or e.os_error) if e.os_error else str(e)
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the response body was cut short"
    return str(e) or type(e).__name__


__all__ = ["Chunk", "MasterClient", "SegmentChanged", "check_master_url", "negotiate",
           "versions_line"]
