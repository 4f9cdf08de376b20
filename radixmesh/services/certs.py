"""`radixmesh certs --out DIR [--hosts h1,h2] [--days N] [--ca-cert C --ca-key K]`: certificates for mutual TLS
between the mesh's services (services.common.auth). Writes into DIR:

  ca.crt, ca.key    a new CA (or, with --ca-cert/--ca-key, the CA given is used and not written again)
  tls.crt, tls.key  one leaf certificate, for server and client authentication, signed by the CA, naming
                    localhost, 127.0.0.1, ::1, radixmesh.internal (the name a chart's pods verify with
                    --tls-server-name) and the given hosts

The names match a Kubernetes TLS Secret's keys (tls.crt, tls.key, ca.crt). Keys are ECDSA P-256, written 0600.
Every service may share the leaf certificate: it is both the server's and the client's."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

MESH_SERVER_NAME = "radixmesh.internal"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", MESH_SERVER_NAME)


def _names(hosts: list[str]):
    from cryptography import x509

    out, seen = [], set()
    for host in [*DEFAULT_HOSTS, *hosts]:
        if host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _builder(subject: str, issuer, public_key, days: int):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clocks a little behind
            .not_valid_after(now + datetime.timedelta(days=days)))


def make_ca(days: int):
    """(CA certificate, its key): self-signed, may sign leaf certificates only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _new_key()
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "radixmesh internal CA")])
    cert = (_builder("radixmesh internal CA", name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_leaf(ca_cert, ca_key, hosts: list[str], days: int):
    """(certificate, key) for server and client authentication, naming DEFAULT_HOSTS and `hosts`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _new_key()
    cert = (_builder("radixmesh service", ca_cert.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_ca(cert_path: str, key_path: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    return cert, key


def write_certs(out: Path, hosts: list[str], days: int = 365, ca: tuple | None = None) -> dict[str, Path]:
    """Write the files into `out` (made if missing); `ca` (certificate, key) signs instead of a new CA. Returns
    {"ca": ca.crt, "cert": tls.crt, "key": tls.key} paths."""
    out.mkdir(parents=True, exist_ok=True)
    if ca is None:
        ca = make_ca(days)
        _write(out / "ca.key", _key_pem(ca[1]), private=True)
    _write(out / "ca.crt", _cert_pem(ca[0]), private=False)
    cert, key = make_leaf(*ca, hosts, days)
    _write(out / "tls.crt", _cert_pem(cert), private=False)
    _write(out / "tls.key", _key_pem(key), private=True)
    return {"ca": out / "ca.crt", "cert": out / "tls.crt", "key": out / "tls.key"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixmesh certs", description="A CA and a certificate for mutual TLS between "
                                "radixmesh services (--tls-cert tls.crt --tls-key tls.key --tls-ca ca.crt).")
    p.add_argument("--out", required=True, help="directory to write ca.crt, ca.key, tls.crt, tls.key into")
    p.add_argument("--hosts", default="", help="more names or addresses the certificate is valid for, "
                   "comma-separated (always: " + ", ".join(DEFAULT_HOSTS) + ")")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--ca-cert", help="sign with this CA instead of making one (e.g. a new leaf, same CA)")
    p.add_argument("--ca-key", help="the key of --ca-cert")
    args = p.parse_args(argv)
    if bool(args.ca_cert) != bool(args.ca_key):
        p.error("--ca-cert and --ca-key go together")
    if args.days < 1:
        p.error("--days must be at least 1")
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        ca = _load_ca(args.ca_cert, args.ca_key) if args.ca_cert else None
        paths = write_certs(Path(args.out), hosts, args.days, ca)
    except (OSError, ValueError) as e:
        print(f"radixmesh certs: {e}", file=sys.stderr)
        return 1
    print(f"--tls-cert {paths['cert']} --tls-key {paths['key']} --tls-ca {paths['ca']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
