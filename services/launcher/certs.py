"""A throwaway certificate authority for `rtp-serve up --tls` (and tests).

    ca.pem                       self-signed CA, valid a day; its key is never written
    cluster.pem, cluster-key.pem one certificate every member serves and calls with:
                                 SAN 127.0.0.1, ::1, localhost; server and client auth

One certificate for the whole local cluster is enough: mutual TLS here answers "is the
caller a member of this cluster?" (signed by this CA), not "which member is it?". The CA's
private key lives only in memory, so nothing can issue another member certificate later.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=1)
LOCAL_NAMES = ("localhost",)
LOCAL_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def issue_cluster_certs(
    out_dir: Path,
    name: str = "rtp-serve",
    dns_names: tuple[str, ...] = LOCAL_NAMES,
    ips: tuple[str, ...] = LOCAL_IPS,
) -> CertFiles:
    """Write a fresh CA and one member certificate (+ key) under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{name} CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName(d) for d in dns_names]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} member"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = CertFiles(out_dir / "cluster.pem", out_dir / "cluster-key.pem", out_dir / "ca.pem")
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.key, _key_pem(key))
    return files
