"""Certificates for tests, made on the spot: a CA, and leaves that serve 127.0.0.1/localhost and act as clients."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    cert: str
    key: str
    x509_cert: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(directory: Path, cn: str, issuer: Pem | None = None) -> Pem:
    """A CA named `cn` (issuer None), or a leaf with CN `cn` signed by `issuer`, written as `cn`.crt / .key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    if issuer is None:
        builder = builder.issuer_name(_name(cn)).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        cert = builder.sign(key, hashes.SHA256())
    else:
        builder = (builder.issuer_name(issuer.x509_cert.subject)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), False))
        cert = builder.sign(issuer.private_key, hashes.SHA256())
    cert_path, key_path = directory / f"{cn}.crt", directory / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Pem(str(cert_path), str(key_path), cert, key)


@dataclass(frozen=True)
class MeshPki:
    ca: Pem
    coordinator: Pem  # CN coordinator.graphmesh.internal: a mesh role name of graphmesh_server.policy
    kvstore: Pem
    executor: Pem
    client: Pem  # CN client: signed by the same CA, no mesh role


def issue_mesh(directory: Path) -> MeshPki:
    ca = issue(directory, "graphmesh-test-ca")
    roles = ("coordinator.graphmesh.internal", "kvstore.graphmesh.internal", "executor.graphmesh.internal", "client")
    return MeshPki(ca, *(issue(directory, cn, ca) for cn in roles))
