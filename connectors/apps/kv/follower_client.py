"""Reading a map that a follower holds: the address file it leaves in the map directory, and
the client ``kcompact kv get`` uses when LevelDB's lock keeps it out.

A follower (``kcompact kv serve``, ``kcompact kv build --follow``) writes ``ADDRESS_FILE`` in
the map directory once its read API listens, and removes it when it stops: its URL as seen from
this machine, a token of its own (random per run; the file is mode 0600, readable by whoever may
read the map's files anyway), its pid. LevelDB never touches a file whose name is not one of its
own. Format: docs/formats/kv-map.md ("Follower address"); the API: docs/formats/kv-http.md.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ...plugins.leveldb_sink import KVError, KVLockedError

ADDRESS_FILE = "kcompact-follower.json"
#: seconds a `kv get` waits for the follower's answer
CLIENT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class FollowerAddress:
    """Where the process holding a map answers reads (the address file's content)."""

    url: str
    token: str
    pid: int
    command: str

    @staticmethod
    def path(db: str) -> str:
        return os.path.join(db, ADDRESS_FILE)

    def write(self, db: str) -> None:
        """Atomically (a new file renamed over the old one), mode 0600."""
        tmp = self.path(db) + f".{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": self.pid,
                       "command": self.command}, f)
            f.write("\n")
        os.replace(tmp, self.path(db))

    def remove(self, db: str) -> None:
        """Remove the file if it is still this process's (a newer follower may own it)."""
        cur = FollowerAddress.read(db)
        if cur is not None and cur.pid == self.pid and cur.url == self.url:
            try:
                os.unlink(self.path(db))
            except FileNotFoundError:
                pass

    @classmethod
    def read(cls, db: str) -> "FollowerAddress | None":
        try:
            with open(cls.path(db), encoding="utf-8") as f:
                d = json.load(f)
            return cls(url=str(d["url"]), token=str(d["token"]), pid=int(d["pid"]),
                       command=str(d.get("command", "")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KVError(f"{cls.path(db)}: unreadable follower address ({e}); the process "
                          "holding the map writes it again when it restarts") from None


@dataclass(frozen=True)
class RemoteValue:
    """A value read through a follower: bytes or None, the map's topic, and whether its bulk
    build was unfinished."""

    value: bytes | None
    topic: str
    building: bool


def get_through_follower(db: str, key: bytes, locked: KVLockedError) -> RemoteValue:
    """Look ``key`` up through the process holding the map at ``db`` (``GET /v1/raw``);
    ``locked`` is the error to raise, more precise, when no follower left its address."""
    addr = FollowerAddress.read(db)
    if addr is None:
        raise locked
    u = urllib.parse.urlsplit(addr.url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    if u.scheme == "https":  # a --listen on a public address with TLS: this machine's own
        import ssl
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        conn = conn_cls(u.hostname, u.port, timeout=CLIENT_TIMEOUT_S, context=ctx)
    else:
        conn = conn_cls(u.hostname, u.port, timeout=CLIENT_TIMEOUT_S)
    target = "/v1/raw?key_b64=" + urllib.parse.quote(base64.b64encode(key).decode())
    try:
        conn.request("GET", target, headers={"Authorization": f"Bearer {addr.token}"})
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise KVLockedError(f"{db} is held by `kcompact {addr.command}` (pid {addr.pid}), whose "
                            f"reader at {addr.url} does not answer ({type(e).__name__}: {e}); "
                            "is it still running?") from None
    finally:
        conn.close()
    topic = resp.getheader("X-Kcompact-Topic", "")
    building = resp.getheader("X-Kcompact-Building") == "1"
    if resp.status == 200:
        return RemoteValue(body, topic, building)
    if resp.status == 404 and resp.getheader("X-Kcompact-Found") == "0":
        return RemoteValue(None, topic, building)
    raise KVError(f"{db}: the follower at {addr.url} answered {resp.status}: "
                  f"{_error_text(body)}")


def _error_text(body: bytes) -> str:
    try:
        doc: Any = json.loads(body)
        return str(doc.get("error", body[:200]))
    except ValueError:
        return body[:200].decode("utf-8", "replace")
