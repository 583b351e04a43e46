"""TLS of the Connect REST API: an ``https://`` listener with Connect's
``listeners.https.ssl.*`` keys (framework/worker.py's WORKER_CONFIG).

Keystores and truststores are PEM (Kafka's ``ssl.keystore.type=PEM``: a file holding the private
key and the certificate chain, or the same as PEM text in ``ssl.keystore.key`` and
``ssl.keystore.certificate.chain``) or PKCS12 (read with ``cryptography``, which kcompact has
through authlib). JKS, Java's own format, is refused with the keytool command that converts it.
A type left empty is told from the file: JKS's magic number, PEM's ``-----BEGIN``, else PKCS12.

``listeners.https.ssl.client.auth``: ``none``, ``requested`` (a certificate given must be signed
by the truststore) or ``required`` (every client must present one), as Connect's.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from typing import Any, Mapping

from ...errors import ConfigError

PREFIX = "listeners.https."
JKS_MAGIC = b"\xfe\xed\xfe\xed"


def _key(name: str) -> str:
    return f"{PREFIX}ssl.{name}"


def _kind(path: str, given: str, key: str) -> tuple[str, bytes]:
    """(PEM | PKCS12, the file's bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}", key=key) from None
    kind = given.strip().upper()
    if kind not in ("", "PEM", "PKCS12", "JKS"):
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.type: {given!r} is not PEM or PKCS12",
                          key=key)
    if kind == "JKS" or (not kind and data.startswith(JKS_MAGIC)):
        raise ConfigError(f"{key}: {path} is a JKS keystore, which kcompact cannot read: "
                          f"convert it (keytool -importkeystore -srckeystore {path} "
                          "-destkeystore store.p12 -deststoretype PKCS12) or give PEM files",
                          key=key)
    if not kind:
        kind = "PEM" if b"-----BEGIN" in data[:4096] else "PKCS12"
    return kind, data


def _pkcs12(data: bytes, password: str, key: str):
    from cryptography.hazmat.primitives.serialization import pkcs12
    try:
        return pkcs12.load_key_and_certificates(data, password.encode() if password else None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: not a PKCS12 store this password opens ({e})",
                          key=key) from None


def _pem_of(private_key, certs) -> bytes:
    from cryptography.hazmat.primitives import serialization
    out = b""
    if private_key is not None:
        out += private_key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
    for c in certs:
        out += c.public_bytes(serialization.Encoding.PEM)
    return out


def _load_chain(ctx: ssl.SSLContext, pem: bytes, password: str | None, key: str) -> None:
    """``load_cert_chain`` from PEM bytes (through a file only this user can read, removed at
    once: the ssl module reads chains from files only)."""
    d = tempfile.mkdtemp(prefix="kcompact-tls-")
    path = os.path.join(d, "chain.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            ctx.load_cert_chain(path, password=password or None)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"{key}: no private key with its certificate chain in it "
                              f"({e}; a PEM keystore holds both, the key encrypted with "
                              f"{_key('key.password')} if it is)", key=key) from None
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.rmdir(d)


def server_context(config: Mapping[str, Any]) -> ssl.SSLContext:
    """The https listener's context from the worker's ``listeners.https.ssl.*`` keys."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    loc = config[_key("keystore.location")]
    chain, pkey = config[_key("keystore.certificate.chain")], config[_key("keystore.key")]
    if loc and (chain or pkey):
        raise ConfigError(f"{_key('keystore.location')} and {_key('keystore.key')}/"
                          f"{_key('keystore.certificate.chain')}: give one of them",
                          key=_key("keystore.location"))
    if loc:
        kind, data = _kind(loc, config[_key("keystore.type")], _key("keystore.location"))
        if kind == "PEM":
            _load_chain(ctx, data, config[_key("key.password")], _key("keystore.location"))
        else:
            private_key, cert, extra = _pkcs12(data, config[_key("keystore.password")],
                                               _key("keystore.location"))
            if private_key is None or cert is None:
                raise ConfigError(f"{_key('keystore.location')}: {loc} holds no private key "
                                  "with its certificate", key=_key("keystore.location"))
            _load_chain(ctx, _pem_of(private_key, [cert, *extra]), None,
                        _key("keystore.location"))
    elif chain and pkey:
        _load_chain(ctx, (pkey.strip() + "\n" + chain.strip() + "\n").encode(),
                    config[_key("key.password")], _key("keystore.key"))
    else:
        raise ConfigError(f"listeners: an https listener needs the server's key and "
                          f"certificate: set {_key('keystore.location')} (a PEM or PKCS12 "
                          f"file), or {_key('keystore.key')} and "
                          f"{_key('keystore.certificate.chain')}", key="listeners")
    auth = config[_key("client.auth")]
    tloc, tpem = config[_key("truststore.location")], config[_key("truststore.certificates")]
    if tloc:
        kind, data = _kind(tloc, config[_key("truststore.type")], _key("truststore.location"))
        if kind == "PKCS12":
            _k, cert, extra = _pkcs12(data, config[_key("truststore.password")],
                                      _key("truststore.location"))
            data = _pem_of(None, ([cert] if cert is not None else []) + list(extra))
        _load_cas(ctx, data.decode("ascii", "replace"), _key("truststore.location"))
    elif tpem:
        _load_cas(ctx, tpem, _key("truststore.certificates"))
    elif auth != "none":
        raise ConfigError(f"{_key('client.auth')}={auth}: client certificates are checked "
                          f"against a truststore: set {_key('truststore.location')}",
                          key=_key("client.auth"))
    ctx.verify_mode = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL,
                       "required": ssl.CERT_REQUIRED}[auth]
    return ctx


def _load_cas(ctx: ssl.SSLContext, pem: str, key: str) -> None:
    try:
        ctx.load_verify_locations(cadata=pem)
    except (ssl.SSLError, ValueError) as e:
        raise ConfigError(f"{key}: no CA certificate in it ({e})", key=key) from None
