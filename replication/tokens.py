"""``--tokens-file``: named bearer tokens, each limited to topic patterns, hashed at rest.

Spec: docs/formats/tokens-file.md. One token a line, ``NAME sha256:HEX PATTERN[,PATTERN...]``:
the SHA-256 of the token (tokens are random, >= 16 characters: a plain hash is enough, as for
API keys; no clear token is stored), and the topics it may list, replicate or read: a name,
``prefix*`` (every topic starting with prefix) or ``*`` (every topic). ``kcompact tokens add``
makes a token and its line. ``TokenSet.find(header)`` is the token an ``Authorization: Bearer``
header carries (compared in constant time against every entry), ``Token.allows(topic)`` its
scope. The single ``--token-file`` token is an entry allowed every topic.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass

from .errors import ReplicationError
from .protocol import parse_bearer

_LINE = re.compile(r"(\S+)\s+sha256:([0-9a-f]{64})\s+(\S+)")
_PATTERN = re.compile(r"\*|[A-Za-z0-9._-]+\*?")


class TokensFileError(ReplicationError):
    """A tokens file that cannot be used: the message names the file and line."""


@dataclass(frozen=True)
class Token:
    name: str
    digest: bytes
    patterns: tuple[str, ...]

    def allows(self, topic: str) -> bool:
        for p in self.patterns:
            if p == "*" or p == topic or (p.endswith("*") and topic.startswith(p[:-1])):
                return True
        return False


class TokenSet:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens

    @classmethod
    def single(cls, token: bytes) -> "TokenSet":
        return cls([Token("token-file", hashlib.sha256(token).digest(), ("*",))])

    def find(self, header: str | None) -> tuple[int, Token | None]:
        """(0, the token) when the header carries one of these; (401, None) when it carries
        none; (403, None) when an unknown one."""
        got = parse_bearer(header)
        if got is None:
            return 401, None
        digest = hashlib.sha256(got.encode("utf-8", "replace")).digest()
        hit = None
        for t in self.tokens:  # every entry compared, in constant time
            if hmac.compare_digest(digest, t.digest):
                hit = t
        return (0, hit) if hit is not None else (403, None)

    def __add__(self, other: "TokenSet") -> "TokenSet":
        return TokenSet(self.tokens + other.tokens)


def parse_tokens(text: str, source: str) -> TokenSet:
    out, names = [], set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise TokensFileError(f"tokens file {source} line {n}: expected `NAME sha256:HEX "
                                  "TOPIC[,TOPIC...]` (make lines with `kcompact tokens add`)")
        name, digest, pats = m.groups()
        patterns = tuple(pats.split(","))
        bad = [p for p in patterns if not _PATTERN.fullmatch(p)]
        if bad:
            raise TokensFileError(f"tokens file {source} line {n}: topic pattern {bad[0]!r}: "
                                  "use a topic name, prefix* or *")
        if name in names:
            raise TokensFileError(f"tokens file {source} line {n}: a second token named {name}")
        names.add(name)
        out.append(Token(name, bytes.fromhex(digest), patterns))
    if not out:
        raise TokensFileError(f"tokens file {source} holds no token")
    return TokenSet(out)


def read_tokens_file(path: str) -> TokenSet:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokensFileError(f"cannot read tokens file {path}: "
                              f"{getattr(e, 'strerror', None) or e}") from None
    return parse_tokens(text, path)


def add_token(path: str, name: str, topics: str) -> str:
    """A new random token for ``topics`` (comma-separated patterns), its hash written to the
    tokens file ``path`` (mode 0600; a token of the same name is replaced). Returns the token:
    the only time it is shown."""
    if not re.fullmatch(r"[A-Za-z0-9._@-]+", name):
        raise TokensFileError(f"token name {name!r}: letters, digits and . _ @ - only")
    token = secrets.token_hex(32)
    line = f"{name} sha256:{hashlib.sha256(token.encode()).hexdigest()} {topics}"
    parse_tokens(line, "(the new line)")
    lines: list[str] = []
    if os.path.exists(path):
        read_tokens_file(path)
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if not (ln.split() and
                                                                 ln.split()[0] == name)]
    lines.append(line)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return token
