"""Test certificates made with ``cryptography``: a CA, a server certificate for 127.0.0.1, a
client's from the CA and one from another CA, as PEM and PKCS12 files (the REST API's https
listener: test_connect_rest_api.py, tests/integration/test_connect_rest.py)."""

from __future__ import annotations


def make_certs(tmp) -> dict[str, str]:
    """A CA, the server's certificate for 127.0.0.1, a client's from the CA and one from
    another CA; as PEM and PKCS12 files."""
    import datetime
    import ipaddress
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)

    def make(cn, issuer=None, issuer_key=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        b = (x509.CertificateBuilder().subject_name(name)
             .issuer_name(issuer.subject if issuer is not None else name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = b.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())
        return key, cert

    def pem(key=None, certs=(), password=None):
        out = b""
        if key is not None:
            enc = serialization.BestAvailableEncryption(password.encode()) if password else \
                serialization.NoEncryption()
            out += key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8, enc)
        return out + b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)

    ca_key, ca = make("kcompact test CA", ca=True)
    other_key, other = make("another CA", ca=True)
    skey, scert = make("127.0.0.1", ca, ca_key,
                       san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    ckey, ccert = make("operator", ca, ca_key)
    xkey, xcert = make("intruder", other, other_key)
    files = {"ca.pem": pem(certs=[ca]), "server.pem": pem(skey, [scert, ca]),
             "server-enc.pem": pem(skey, [scert], password="kpw"),
             "client.pem": pem(ckey, [ccert]), "intruder.pem": pem(xkey, [xcert]),
             "server.p12": pkcs12.serialize_key_and_certificates(
                 b"server", skey, scert, [ca], serialization.BestAvailableEncryption(b"serverpw")),
             "trust.p12": pkcs12.serialize_key_and_certificates(
                 None, None, None, [ca], serialization.BestAvailableEncryption(b"trustpw"))}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return {name: str(tmp / name) for name in files}
