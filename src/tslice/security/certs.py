"""A development CA, a server certificate and client certificates (``tslice certs``).

Enough for a laptop, a test cluster or CI; production clusters should take theirs from
their own PKI (cert-manager, Vault, SPIFFE...). What tslice reads from a certificate:

- servers: the subject alternative names (DNS names and IP addresses) clients check;
- clients: the identity, a URI SAN ``tslice:<identity>`` (``tslice:orchestrator``,
  ``tslice:admin``, ``tslice:job:<job-id>``), which the servers' verifier maps to roles
  (``tslice.security.identities``). The common name repeats it when it fits (64 characters).

Keys are ECDSA P-256 (fast to make, accepted by every gRPC); private keys are written
with mode 0600. An existing CA in the directory is reused, so certificates can be added
later; certificates already there are kept unless ``--force``.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tslice.common import errors, validation
from tslice.security import identities

#: Names every server certificate carries (the servers' loopback addresses).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DEFAULT_CLIENTS = ("orchestrator", "admin")
_CN_MAX = 64


@dataclasses.dataclass(frozen=True)
class Pair:
    """A certificate and its key, as files."""

    cert: Path
    key: Path


def _lib() -> types.SimpleNamespace:
    """The parts of ``cryptography`` used here, imported on use (``tslice --help`` stays
    fast; without the package only this command fails, naming the fix)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ModuleNotFoundError as err:
        raise errors.ConfigError(
            "tslice certs needs the cryptography package: pip install cryptography"
        ) from err
    return types.SimpleNamespace(
        x509=x509,
        hashes=hashes,
        serialization=serialization,
        ec=ec,
        eku=ExtendedKeyUsageOID,
        name_oid=NameOID,
    )


def _write_pair(pair: Pair, cert: Any, key: Any) -> None:
    ser = _lib().serialization
    pair.cert.parent.mkdir(parents=True, exist_ok=True)
    pem_key = key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    # Written 0600 from the start (never readable by others, even for a moment).
    fd = os.open(pair.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem_key)
    pair.cert.write_bytes(cert.public_bytes(ser.Encoding.PEM))


def _signed(
    *, common_name: str, issuer: Any, signer: Any, extensions: Sequence[tuple[Any, bool]], days: int
) -> tuple[Any, Any]:
    """A new key and its certificate (``signer``: the issuer's key; None: self-signed)."""
    lib = _lib()
    x509 = lib.x509
    key = lib.ec.generate_private_key(lib.ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(lib.name_oid.COMMON_NAME, common_name[:_CN_MAX])])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signer or key, lib.hashes.SHA256()), key


def make_ca(directory: Path, *, days: int = 365) -> Pair:
    """``ca.pem`` / ``ca.key`` in ``directory``: the existing CA, else a new one."""
    pair = Pair(directory / "ca.pem", directory / "ca.key")
    if pair.cert.exists() and pair.key.exists():
        return pair
    x509 = _lib().x509
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert, key = _signed(
        common_name="tslice development CA",
        issuer=None,
        signer=None,
        extensions=[(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)],
        days=days,
    )
    _write_pair(pair, cert, key)
    return pair


def _issue(
    ca: Pair, pair: Pair, *, common_name: str, sans: Sequence[Any], client: bool, days: int
) -> Pair:
    lib = _lib()
    try:
        ca_cert = lib.x509.load_pem_x509_certificate(ca.cert.read_bytes())
        ca_key = lib.serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    except (OSError, ValueError) as err:
        raise errors.ConfigError(
            f"cannot use the CA in {ca.cert.parent} ({err}); remove ca.pem and ca.key there "
            "to make a new one, or choose another --out"
        ) from err
    usage = lib.eku.CLIENT_AUTH if client else lib.eku.SERVER_AUTH
    cert, key = _signed(
        common_name=common_name,
        issuer=ca_cert.subject,
        signer=ca_key,
        extensions=[
            (lib.x509.BasicConstraints(ca=False, path_length=None), True),
            (lib.x509.SubjectAlternativeName(list(sans)), False),
            (lib.x509.ExtendedKeyUsage([usage]), False),
        ],
        days=days,
    )
    _write_pair(pair, cert, key)
    return pair


def _host_name(host: str) -> Any:
    x509 = _lib().x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_server(ca: Pair, pair: Pair, *, hosts: Sequence[str] = (), days: int = 365) -> Pair:
    """A server certificate for the loopback names and ``hosts`` (names or addresses)."""
    names = list(dict.fromkeys([*LOOPBACK_NAMES, *hosts]))
    return _issue(
        ca,
        pair,
        common_name=hosts[0] if hosts else "localhost",
        sans=[_host_name(h) for h in names],
        client=False,
        days=days,
    )


def check_identity(identity: str) -> str:
    """``orchestrator``, ``admin``, ``job:<job-id>`` or any other id the verifier maps."""
    try:
        return validation.check_id("identity", identity)
    except validation.InvalidIdError as err:
        raise errors.ConfigError(
            f"{err}; an identity is e.g. orchestrator, admin or job:<job-id>"
        ) from err


def make_client(ca: Pair, pair: Pair, *, identity: str, days: int = 365) -> Pair:
    """A client certificate naming ``identity`` (URI SAN ``tslice:<identity>``)."""
    uri = _lib().x509.UniformResourceIdentifier(
        identities.IDENTITY_SCHEME + check_identity(identity)
    )
    return _issue(ca, pair, common_name=identity, sans=[uri], client=True, days=days)


def file_stem(identity: str) -> str:
    """A file name for an identity (``job:team/a`` -> ``job-team-a``)."""
    return re.sub(r"[^A-Za-z0-9_.=+@-]+", "-", identity)
