"""The Kafka endpoint's principals (sasl.py): SCRAM against RFC 7677's test vector and against a
client written here from RFC 5802, PLAIN against the users file and the token, the users file's
format and errors, and a certificate subject in Java's RFC 2253 form."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat

import pytest

from kcompact.replication.kafka_endpoint.sasl import (
    TOKEN_PRINCIPAL, Authenticator, SaslFailure, ScramServer, UsersFileError, add_user,
    dn_of_peercert, make_credential, parse_users, read_users_file)


def _users(*lines: str) -> dict:
    return parse_users("\n".join(lines), "users")


def test_rfc7677_test_vector():
    cred = make_credential("SCRAM-SHA-256", b"pencil", 4096,
                           base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ=="))
    srv = ScramServer("SCRAM-SHA-256", _users(f"user {cred}"),
                      nonce=lambda: "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0")
    first = srv.step(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    assert first == (b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                     b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    final = srv.step(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                     b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    assert final == b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    assert srv.done and srv.principal == "User:user"


def _client(mech: str, user: str, password: bytes, srv: ScramServer) -> bytes:
    """RFC 5802's client side; the server's final message."""
    h = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}[mech]
    bare = f"n={user},r=clientnonce123"
    first = srv.step(("n,," + bare).encode()).decode()
    f = dict(x.split("=", 1) for x in first.split(","))
    salted = hashlib.pbkdf2_hmac(h, password, base64.b64decode(f["s"]), int(f["i"]))
    ck = hmac.new(salted, b"Client Key", h).digest()
    without = f"c=biws,r={f['r']}"
    auth = f"{bare},{first},{without}".encode()
    sig = hmac.new(hashlib.new(h, ck).digest(), auth, h).digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(ck, sig))).decode()
    out = srv.step(f"{without},p={proof}".encode())
    sk = hmac.new(salted, b"Server Key", h).digest()
    assert out == b"v=" + base64.b64encode(hmac.new(sk, auth, h).digest())
    return out


@pytest.mark.parametrize("mech", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_accepts_the_password_and_refuses_another(mech):
    users = _users(f"alice {make_credential(mech, b'right')}")
    auth = Authenticator(None, users)
    assert auth.mechanisms == [mech]
    s = auth.session(mech)
    _client(mech, "alice", b"right", s)
    assert s.principal == "User:alice"
    with pytest.raises(SaslFailure, match=f"invalid credentials with SASL mechanism {mech}"):
        _client(mech, "alice", b"wrong", auth.session(mech))
    with pytest.raises(SaslFailure, match="invalid credentials"):
        auth.session(mech).step(b"n,,n=nobody,r=abc")
    with pytest.raises(SaslFailure, match="channel binding"):
        auth.session(mech).step(b"p=tls-unique,,n=alice,r=abc")
    assert auth.session("PLAIN") is None  # no PLAIN credential, no token


def test_scram_user_names_are_decoded():
    users = _users(f"a,b=c {make_credential('SCRAM-SHA-256', b'pw')}")
    s = ScramServer("SCRAM-SHA-256", users)
    _client("SCRAM-SHA-256", "a=2Cb=3Dc", b"pw", s)
    assert s.principal == "User:a,b=c"


def test_plain_against_users_and_token():
    users = _users(f"bob {make_credential('PLAIN', b'bobpw', 1000)}")
    auth = Authenticator(b"the-token-0123456789", users)
    s = auth.session("PLAIN")
    s.step(b"\0bob\0bobpw")
    assert s.principal == "User:bob"
    with pytest.raises(SaslFailure, match="invalid username or password"):
        auth.session("PLAIN").step(b"\0bob\0the-token-0123456789")  # bob has his own
    s = auth.session("PLAIN")
    s.step(b"\0anyone\0the-token-0123456789")
    assert s.principal == TOKEN_PRINCIPAL
    with pytest.raises(SaslFailure, match="authorization id"):
        auth.session("PLAIN").step(b"root\0bob\0bobpw")


@pytest.mark.parametrize("line,why", [
    ("alice", "expected `NAME MECHANISM"),
    ("alice SCRAM-SHA-512=[password=x]", "a clear password is never stored"),
    ("alice SCRAM-SHA-1=[salt=AA==]", "mechanism SCRAM-SHA-1"),
    ("alice PLAIN=[salt=AA==,hash=AA==]", "PLAIN needs exactly"),
    ("alice SCRAM-SHA-256=[salt=AA==,stored_key=AA==,server_key=AA==,iterations=4096]",
     "are 32 bytes"),
    ("alice SCRAM-SHA-256=[salt=!!,stored_key=AA==,server_key=AA==,iterations=4096]",
     "salt is not base64"),
])
def test_users_file_errors_name_the_line(line, why):
    with pytest.raises(UsersFileError, match=f"users file users line 2: .*{why}"):
        parse_users("# users\n" + line, "users")
    low = make_credential("SCRAM-SHA-256", b"x", 4096).replace("iterations=4096",
                                                               "iterations=1024")
    with pytest.raises(UsersFileError, match="line 1: iterations 1024: at least 4096"):
        parse_users(f"a {low}", "users")


def test_add_user_writes_a_private_file_and_replaces(tmp_path):
    f = str(tmp_path / "users")
    add_user(f, "alice", "SCRAM-SHA-512", b"one")
    add_user(f, "alice", "PLAIN", b"one")
    add_user(f, "alice", "SCRAM-SHA-512", b"two")
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    users = read_users_file(f)
    assert sorted(users) == [("alice", "PLAIN"), ("alice", "SCRAM-SHA-512")]
    _client("SCRAM-SHA-512", "alice", b"two", ScramServer("SCRAM-SHA-512", users))
    assert b"one" not in open(f, "rb").read() and b"two" not in open(f, "rb").read()
    with pytest.raises(UsersFileError, match="user name"):
        add_user(f, "has space", "PLAIN", b"x")


def test_certificate_subject_as_java_prints_it():
    cert = {"subject": ((("countryName", "US"),), (("organizationName", "Example, Inc."),),
                        (("organizationalUnitName", "eng"), ("organizationalUnitName", "ops")),
                        (("commonName", "alice"),), (("emailAddress", "a@x.io"),))}
    assert dn_of_peercert(cert) == (
        "1.2.840.113549.1.9.1=#16066140782e696f,CN=alice,OU=eng+OU=ops,"
        "O=Example\\, Inc.,C=US")
