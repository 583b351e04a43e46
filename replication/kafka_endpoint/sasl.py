"""Principals of the Kafka endpoint: the users file, SASL/SCRAM and PLAIN server side, and the
principal of a TLS client certificate.

* ``read_users_file`` / ``add_user``: ``--kafka-users-file`` (spec: docs/formats/users-file.md),
  one credential a line, ``NAME MECHANISM=[key=value,...]``: a SCRAM credential as Kafka keeps it
  (salt, stored_key, server_key in base64, iterations) or, for PLAIN, a PBKDF2-HMAC-SHA256 hash
  of the password (salt, iterations, hash). No clear password is ever stored.
* ``ScramServer``: RFC 5802 / RFC 7677 server side (SCRAM-SHA-256 and SCRAM-SHA-512, no channel
  binding, as Kafka): client-first -> server-first -> client-final -> server-final.
* ``Authenticator``: a SASL session per connection for the mechanisms enabled (PLAIN against
  the users file or the single ``--kafka-token-file`` token, SCRAM); a failure is a
  ``SaslFailure`` whose message the client gets in its SaslAuthenticate answer.
* ``dn_of_peercert``: a client certificate's subject as Java prints an X500Principal (RFC 2253:
  the last RDN first, CN/OU/O/L/ST/C/STREET/DC/UID keywords, other attributes as OID=#hex),
  which Kafka's default principal builder makes ``User:<DN>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass

from ..errors import ReplicationError

SCRAM_MECHANISMS = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
#: Kafka's minimum and the iterations ``users add`` writes (Kafka's kafka-configs default 4096)
SCRAM_MIN_ITERATIONS = 4096
SCRAM_ITERATIONS = 8192
PLAIN_ITERATIONS = 200_000
TOKEN_PRINCIPAL = "User:token"
ANONYMOUS = "User:ANONYMOUS"

_LINE = re.compile(r"(\S+)\s+([A-Z0-9-]+)=\[([^\]]*)\]")


class UsersFileError(ReplicationError):
    """A users file that cannot be used: the message names the file and line."""


class SaslFailure(Exception):
    """An authentication that failed: ``str(e)`` is what the client is told."""


@dataclass(frozen=True)
class ScramCredential:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int


@dataclass(frozen=True)
class PlainCredential:
    salt: bytes
    hash: bytes
    iterations: int


def _b64(v: str, what: str) -> bytes:
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:
        raise ValueError(f"{what} is not base64") from None


def parse_credential(mechanism: str, body: str):
    """The credential of ``MECHANISM=[body]``; ValueError saying what is wrong."""
    kv = {}
    for item in body.split(","):
        k, eq, v = item.strip().partition("=")
        if not eq:
            raise ValueError(f"{item.strip()!r} is not key=value")
        kv[k] = v
    if "password" in kv:
        raise ValueError("a clear password is never stored: make the line with "
                         "`kcompact users add`")
    if mechanism in SCRAM_MECHANISMS:
        need = {"salt", "stored_key", "server_key", "iterations"}
        if set(kv) != need:
            raise ValueError(f"{mechanism} needs exactly {', '.join(sorted(need))}")
        it = int(kv["iterations"])
        if it < SCRAM_MIN_ITERATIONS:
            raise ValueError(f"iterations {it}: at least {SCRAM_MIN_ITERATIONS}")
        n = hashlib.new(SCRAM_MECHANISMS[mechanism]).digest_size
        cred = ScramCredential(_b64(kv["salt"], "salt"), _b64(kv["stored_key"], "stored_key"),
                               _b64(kv["server_key"], "server_key"), it)
        if len(cred.stored_key) != n or len(cred.server_key) != n:
            raise ValueError(f"stored_key and server_key of {mechanism} are {n} bytes")
        return cred
    if mechanism == "PLAIN":
        need = {"salt", "hash", "iterations"}
        if set(kv) != need:
            raise ValueError(f"PLAIN needs exactly {', '.join(sorted(need))} (a "
                             "PBKDF2-HMAC-SHA256 hash)")
        it = int(kv["iterations"])
        if it < 1000:
            raise ValueError(f"iterations {it}: at least 1000")
        return PlainCredential(_b64(kv["salt"], "salt"), _b64(kv["hash"], "hash"), it)
    raise ValueError(f"mechanism {mechanism}: use one of {', '.join(MECHANISMS)}")


def parse_users(text: str, source: str) -> dict[tuple[str, str], object]:
    """{(user, mechanism): credential} of a users file's text."""
    out: dict[tuple[str, str], object] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        try:
            if m is None:
                raise ValueError("expected `NAME MECHANISM=[key=value,...]`")
            name, mech = m.group(1), m.group(2)
            if (name, mech) in out:
                raise ValueError(f"a second {mech} credential for {name}")
            out[(name, mech)] = parse_credential(mech, m.group(3))
        except ValueError as e:
            raise UsersFileError(f"users file {source} line {n}: {e}") from None
    return out


def read_users_file(path: str) -> dict[tuple[str, str], object]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsersFileError(f"cannot read users file {path}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    return parse_users(text, path)


def make_credential(mechanism: str, password: bytes, iterations: int | None = None,
                    salt: bytes | None = None) -> str:
    """``MECHANISM=[...]`` for a password (the text of a users-file line after the name)."""
    salt = salt if salt is not None else secrets.token_bytes(32)
    enc = lambda b: base64.b64encode(b).decode()  # noqa: E731
    if mechanism in SCRAM_MECHANISMS:
        h = SCRAM_MECHANISMS[mechanism]
        it = iterations or SCRAM_ITERATIONS
        salted = hashlib.pbkdf2_hmac(h, password, salt, it)
        client_key = hmac.new(salted, b"Client Key", h).digest()
        stored = hashlib.new(h, client_key).digest()
        server = hmac.new(salted, b"Server Key", h).digest()
        return (f"{mechanism}=[salt={enc(salt)},stored_key={enc(stored)},"
                f"server_key={enc(server)},iterations={it}]")
    if mechanism == "PLAIN":
        it = iterations or PLAIN_ITERATIONS
        digest = hashlib.pbkdf2_hmac("sha256", password, salt, it)
        return f"PLAIN=[salt={enc(salt)},hash={enc(digest)},iterations={it}]"
    raise UsersFileError(f"--mechanism {mechanism}: use one of {', '.join(MECHANISMS)}")


def add_user(path: str, name: str, mechanism: str, password: bytes) -> None:
    """Write (or replace) ``name``'s ``mechanism`` credential in the users file ``path``,
    created with mode 0600; written whole to a temporary file, then renamed."""
    if not re.fullmatch(r"[^\s#\[\]]+", name):
        raise UsersFileError(f"user name {name!r}: no spaces, '#', '[' or ']'")
    if not password:
        raise UsersFileError("an empty password (give it on stdin)")
    lines: list[str] = []
    if os.path.exists(path):
        read_users_file(path)  # refuses to rewrite a file it cannot read
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    new = f"{name} {make_credential(mechanism, password)}"
    kept = [ln for ln in lines if not (ln.split() and ln.split()[0] == name and
                                       ln.split()[1].startswith(mechanism + "=["))]
    kept.append(new)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(kept) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- the SASL exchanges ---------------------------------------------------------------------

_FAILED = "Authentication failed: invalid username or password"


def _saslname(s: str) -> str:
    """RFC 5802's saslname decoded (=2C is ',', =3D is '=')."""
    if re.search(r"=(?!2C|3D)", s):
        raise SaslFailure("Authentication failed: malformed SCRAM user name")
    return s.replace("=2C", ",").replace("=3D", "=")


class ScramServer:
    """One SCRAM exchange; ``step(bytes) -> bytes``; ``principal`` once ``done``."""

    def __init__(self, mechanism: str, users: dict, nonce=lambda: secrets.token_urlsafe(18)):
        self.mechanism, self.users, self._new_nonce = mechanism, users, nonce
        self.hash = SCRAM_MECHANISMS[mechanism]
        self.state = 0
        self.done = False
        self.principal: str | None = None

    def step(self, data: bytes) -> bytes:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise SaslFailure("Authentication failed: SCRAM message is not UTF-8") from None
        if self.state == 0:
            return self._first(text)
        if self.state == 1:
            return self._final(text)
        raise SaslFailure("Authentication failed: SCRAM exchange already finished")

    def _first(self, msg: str) -> bytes:
        # gs2-header: "n,," or "y,," (no channel binding) [a=authzid]
        parts = msg.split(",", 2)
        if len(parts) < 3 or parts[0] not in ("n", "y"):
            raise SaslFailure("Authentication failed: SCRAM client-first message without a "
                              "gs2 header 'n,,' (channel binding is not supported)")
        self.gs2 = f"{parts[0]},{parts[1]},"
        bare = parts[2]
        fields = dict(f.split("=", 1) for f in bare.split(",") if "=" in f)
        if "n" not in fields or "r" not in fields:
            raise SaslFailure("Authentication failed: SCRAM client-first message without "
                              "n= and r=")
        self.user = _saslname(fields["n"])
        cred = self.users.get((self.user, self.mechanism))
        if not isinstance(cred, ScramCredential):
            raise SaslFailure(f"Authentication failed during authentication due to invalid "
                              f"credentials with SASL mechanism {self.mechanism}")
        self.cred = cred
        self.nonce = fields["r"] + self._new_nonce()
        self.client_first_bare = bare
        self.server_first = (f"r={self.nonce},s={base64.b64encode(cred.salt).decode()},"
                             f"i={cred.iterations}")
        self.state = 1
        return self.server_first.encode()

    def _final(self, msg: str) -> bytes:
        without_proof, sep, proof = msg.rpartition(",p=")
        if not sep:
            raise SaslFailure("Authentication failed: SCRAM client-final message without p=")
        fields = dict(f.split("=", 1) for f in without_proof.split(",") if "=" in f)
        if fields.get("r") != self.nonce:
            raise SaslFailure("Authentication failed: SCRAM nonce mismatch")
        if fields.get("c") != base64.b64encode(self.gs2.encode()).decode():
            raise SaslFailure("Authentication failed: SCRAM channel binding mismatch")
        auth = f"{self.client_first_bare},{self.server_first},{without_proof}".encode()
        h = self.hash
        try:
            client_proof = base64.b64decode(proof, validate=True)
        except ValueError:
            raise SaslFailure("Authentication failed: SCRAM proof is not base64") from None
        sig = hmac.new(self.cred.stored_key, auth, h).digest()
        if len(client_proof) != len(sig):
            raise SaslFailure(_scram_failed(self.mechanism))
        client_key = bytes(a ^ b for a, b in zip(client_proof, sig))
        if not hmac.compare_digest(hashlib.new(h, client_key).digest(), self.cred.stored_key):
            raise SaslFailure(_scram_failed(self.mechanism))
        self.state, self.done = 2, True
        self.principal = f"User:{self.user}"
        server_sig = hmac.new(self.cred.server_key, auth, h).digest()
        return b"v=" + base64.b64encode(server_sig)


def _scram_failed(mech: str) -> str:
    # Kafka's own words (ScramSaslServer / SaslServerAuthenticator)
    return ("Authentication failed during authentication due to invalid credentials with "
            f"SASL mechanism {mech}")


class PlainServer:
    """One SASL/PLAIN exchange (authzid NUL user NUL password, RFC 4616)."""

    def __init__(self, users: dict, token: bytes | None):
        self.users, self.token = users, token
        self.done = False
        self.principal: str | None = None

    def step(self, data: bytes) -> bytes:
        parts = bytes(data).split(b"\0")
        if len(parts) != 3:
            raise SaslFailure("Authentication failed: a SASL/PLAIN message is "
                              "authzid NUL user NUL password")
        authzid, user_b, password = parts
        user = user_b.decode("utf-8", "replace")
        if authzid and authzid != user_b:
            raise SaslFailure("Authentication failed: the authorization id must be empty or "
                              "the user name")
        cred = self.users.get((user, "PLAIN"))
        if isinstance(cred, PlainCredential):
            got = hashlib.pbkdf2_hmac("sha256", password, cred.salt, cred.iterations)
            if hmac.compare_digest(got, cred.hash):
                self.done, self.principal = True, f"User:{user}"
                return b""
            raise SaslFailure(_FAILED)
        if self.token is not None and hmac.compare_digest(password, self.token):
            self.done, self.principal = True, TOKEN_PRINCIPAL
            return b""
        raise SaslFailure(_FAILED)


class Authenticator:
    """The SASL mechanisms an endpoint enables: PLAIN with a token and/or a users file, SCRAM
    with SCRAM credentials in the users file."""

    def __init__(self, token: bytes | None, users: dict | None):
        self.token, self.users = token, users or {}
        mechs = {m for (_, m) in self.users}
        self.mechanisms = [m for m in MECHANISMS if m in mechs]
        if token is not None and "PLAIN" not in self.mechanisms:
            self.mechanisms.append("PLAIN")

    @property
    def enabled(self) -> bool:
        return bool(self.mechanisms)

    def session(self, mechanism: str):
        """A new exchange, or None when ``mechanism`` is not enabled."""
        if mechanism not in self.mechanisms:
            return None
        if mechanism == "PLAIN":
            return PlainServer(self.users, self.token)
        return ScramServer(mechanism, self.users)


# -- TLS client certificates ----------------------------------------------------------------

_KEYWORDS = {"commonName": "CN", "countryName": "C", "localityName": "L",
             "stateOrProvinceName": "ST", "organizationName": "O",
             "organizationalUnitName": "OU", "streetAddress": "STREET",
             "domainComponent": "DC", "userId": "UID"}
#: attributes Java prints as OID=#hex (of the DER value); emailAddress is an IA5String (0x16)
_OIDS = {"emailAddress": ("1.2.840.113549.1.9.1", 0x16), "serialNumber": ("2.5.4.5", 0x13),
         "title": ("2.5.4.12", 0x0C), "givenName": ("2.5.4.42", 0x0C),
         "surname": ("2.5.4.4", 0x0C)}


def _escape(v: str) -> str:
    out = re.sub(r'([,+"\\<>;])', r"\\\1", v)
    if out.startswith("#") or out.startswith(" "):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def _der_hex(tag: int, value: str) -> str:
    b = value.encode("utf-8")
    n = len(b)
    length = bytes([n]) if n < 0x80 else bytes([0x81, n]) if n < 0x100 else \
        bytes([0x82, n >> 8, n & 0xFF])
    return "#" + (bytes([tag]) + length + b).hex()


def dn_of_peercert(cert: dict) -> str:
    """The subject of ``SSLObject.getpeercert()`` in Java's RFC 2253 form."""
    rdns = []
    for rdn in reversed(cert.get("subject", ())):
        avas = []
        for name, value in rdn:
            if name in _KEYWORDS:
                avas.append(f"{_KEYWORDS[name]}={_escape(value)}")
            elif name in _OIDS:
                oid, tag = _OIDS[name]
                avas.append(f"{oid}={_der_hex(tag, value)}")
            else:
                avas.append(f"{name}={_escape(value)}")
        rdns.append("+".join(avas))
    return ",".join(rdns)
