"""A throwaway certificate authority for TLS tests: a self-signed CA and a server
certificate it signs for 127.0.0.1 and localhost (the `cryptography` package)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertFiles", "make_ca"]


@dataclass(frozen=True)
class CertFiles:
    ca_cert: Path
    """PEM: what clients trust."""
    cert: Path
    """PEM: the server's certificate (for 127.0.0.1 and localhost)."""
    key: Path
    """PEM: the server's private key."""
    other_ca_cert: Path
    """PEM: an unrelated CA (a client trusting only it must refuse the server)."""


def _ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_ca(where: Path) -> CertFiles:
    """Write a CA, a server certificate and key signed by it, and an unrelated CA under `where`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    where.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("fleetrl test CA")
    _, other = _ca("another CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleetrl daemon")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    out = CertFiles(ca_cert=where / "ca.pem", cert=where / "server.pem", key=where / "server.key",
                 other_ca_cert=where / "other-ca.pem")
    out.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    out.other_ca_cert.write_bytes(other.public_bytes(pem))
    out.cert.write_bytes(cert.public_bytes(pem))
    out.key.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    out.key.chmod(0o600)
    return out
