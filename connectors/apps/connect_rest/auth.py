"""HTTP Basic authentication of the Connect REST API (``rest.basic.auth.users.file``).

The users file has one ``USER:HASH`` line per user (``#`` comments and blank lines ignored);
HASH is ``pbkdf2_sha256$ITERATIONS$SALT$DIGEST`` (SALT and DIGEST base64, PBKDF2-HMAC-SHA256 of
the UTF-8 password), as printed by ``python -m kcompact.connectors.apps.connect_rest.auth USER``
(reads the password from stdin). A clear-text password is refused: the file must not hold one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import sys

from ...errors import ConfigError

SCHEME = "pbkdf2_sha256"
ITERATIONS = 200_000


def hash_password(password: str, *, iterations: int = ITERATIONS, salt: bytes | None = None
                  ) -> str:
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return (f"{SCHEME}${iterations}${base64.b64encode(salt).decode()}$"
            f"{base64.b64encode(digest).decode()}")


def load_users(path: str) -> dict[str, tuple[int, bytes, bytes]]:
    """user -> (iterations, salt, digest); a malformed line is an error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"rest.basic.auth.users.file: cannot read {path}: "
                          f"{e.strerror or e}", key="rest.basic.auth.users.file") from None
    users = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        parts = hashed.strip().split("$")
        try:
            if not sep or not user.strip() or len(parts) != 4 or parts[0] != SCHEME:
                raise ValueError
            users[user.strip()] = (int(parts[1]), base64.b64decode(parts[2], validate=True),
                                   base64.b64decode(parts[3], validate=True))
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}:{n}: expected USER:{SCHEME}$ITERATIONS$SALT$DIGEST (a "
                              "hashed password: python -m kcompact.connectors.apps.connect_rest"
                              ".auth USER prints one)", key="rest.basic.auth.users.file"
                              ) from None
    if not users:
        raise ConfigError(f"rest.basic.auth.users.file: {path} has no user",
                          key="rest.basic.auth.users.file")
    return users


class BasicAuth:
    """Checks a request's ``Authorization: Basic ...`` against the users file."""

    def __init__(self, path: str):
        self.users = load_users(path)

    def check(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True
                                                 ).decode().partition(":")
        except (ValueError, binascii.Error, UnicodeDecodeError):
            return False
        entry = self.users.get(user)
        if entry is None:
            return False
        iterations, salt, digest = entry
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
        return hmac.compare_digest(got, digest)

    def __call__(self, request) -> bool:
        return self.check(request.headers.get("Authorization"))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or ":" in argv[0]:
        print("usage: python -m kcompact.connectors.apps.connect_rest.auth USER < password",
              file=sys.stderr)
        return 2
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        print("auth: no password on stdin", file=sys.stderr)
        return 2
    print(f"{argv[0]}:{hash_password(password)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
