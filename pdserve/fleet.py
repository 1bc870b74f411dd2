"""Membership of a deployment: the fleet secret that lets only its own processes in.

The launcher makes one secret per deployment (or takes the operator's, from
``$PDSERVE_FLEET_SECRET``) and hands it to each worker in that environment variable, never in
argv (which every user of the host can read). A worker takes it out of its environment at start
(`take_fleet_secret`), so nothing it starts inherits it; then
- its HTTP API answers only requests signed with it (`api.signing`: an HMAC over the request
  with a timestamp and a nonce, never the secret), except ``GET /health`` (up or down,
  nothing more: probes need no secret);
- its KV server admits only peers that prove they hold it, and its KV connections prove it,
  by an HMAC challenge-response (`kv_transfer.wire`): the secret itself never crosses the wire.
The router signs every leg (prefill, decode, health checks, scrapes, /tokenize, role and drain
calls) and proves it when it releases a KV lease nobody claimed. The shared store's password
and its namespace's secret reach workers the same way (`launch.deployment.worker_secrets`).

With ``--fleet-tls`` the traffic is encrypted too: the launcher makes a CA for the deployment
(`FleetCA`) and a certificate for each worker and the router (`FleetTLS`), handed over like
the secret (``$PDSERVE_FLEET_TLS_*``); workers serve HTTPS and wrap every KV connection in
mutual TLS verified against that CA alone.
"""

from __future__ import annotations

import datetime
import os
import secrets
import ssl
import tempfile
from dataclasses import dataclass, field

FLEET_SECRET_ENV = "PDSERVE_FLEET_SECRET"


def deployment_secret() -> str:
    """The operator's secret from the environment, else a new random one (256 bits)."""
    return os.environ.get(FLEET_SECRET_ENV) or secrets.token_urlsafe(32)


def take_fleet_secret() -> str | None:
    """This process's fleet secret, removed from its environment (None: not a member of a
    guarded deployment)."""
    return os.environ.pop(FLEET_SECRET_ENV, None) or None


def fleet_secret_from_env() -> str | None:
    """The fleet secret a router started by hand presents (left in place)."""
    return os.environ.get(FLEET_SECRET_ENV) or None


# --fleet-tls: each member's TLS credentials (PEM), handed over like the secret.
FLEET_TLS_CA_ENV = "PDSERVE_FLEET_TLS_CA"
FLEET_TLS_CERT_ENV = "PDSERVE_FLEET_TLS_CERT"
FLEET_TLS_KEY_ENV = "PDSERVE_FLEET_TLS_KEY"
FLEET_TLS_ENV = (FLEET_TLS_CA_ENV, FLEET_TLS_CERT_ENV, FLEET_TLS_KEY_ENV)
# Longer than a deployment runs (the CA's key dies with its launcher).
CERT_LIFETIME = datetime.timedelta(days=365)
# Tolerated clock difference between the launcher's node and a worker's.
_CLOCK_SLACK = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class FleetTLS:
    """One member's TLS credentials (`--fleet-tls`): the deployment's CA certificate, this
    member's certificate and its private key, all PEM.

    Every connection between members is mutual TLS (1.3) verified against the deployment's
    CA and nothing else: a certificate says "a member of this deployment", not which one, so
    host names are not checked (Ray workers listen on addresses the launcher learns only once
    they run). The secret's checks still run inside: HTTP signatures, the KV handshake and its
    per-frame tags."""

    ca_pem: str
    cert_pem: str
    key_pem: str = field(repr=False)

    def to_env(self) -> dict[str, str]:
        return {
            FLEET_TLS_CA_ENV: self.ca_pem,
            FLEET_TLS_CERT_ENV: self.cert_pem,
            FLEET_TLS_KEY_ENV: self.key_pem,
        }

    def server_context(self) -> ssl.SSLContext:
        """Accepts only peers presenting a certificate of the deployment's CA."""
        context = self._context(ssl.PROTOCOL_TLS_SERVER)
        context.num_tickets = 0  # no resumption; nothing but records after the handshake
        return context

    def client_context(self) -> ssl.SSLContext:
        """Presents this member's certificate; trusts only servers of the deployment's CA."""
        context = self._context(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False  # the CA is the deployment's alone (class docstring)
        return context

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca_pem)
        # `ssl` loads a key only from a file: a private one (in memory where Linux has a
        # tmpfs for it, never on disk then), gone once it is read.
        memory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="pdserve-tls-", dir=memory) as directory:
            path = os.path.join(directory, "member.pem")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
                file.write(self.key_pem + self.cert_pem)
            context.load_cert_chain(path)
        return context


def take_fleet_tls() -> FleetTLS | None:
    """This process's TLS credentials, removed from its environment (None: no --fleet-tls)."""
    values = [os.environ.pop(name, None) for name in FLEET_TLS_ENV]
    if not any(values):
        return None
    if not all(values):
        raise ValueError(f"--fleet-tls: a member needs all of {', '.join(FLEET_TLS_ENV)}")
    return FleetTLS(*values)


class FleetCA:
    """A deployment's own certificate authority, made by its launcher (`--fleet-tls`); its
    key never leaves the launcher's memory. Needs the `cryptography` package."""

    def __init__(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(
                    x509.NameOID.COMMON_NAME, f"pdserve fleet CA {secrets.token_hex(4)}"
                )
            ]
        )
        public = self._key.public_key()
        self._cert = (
            _builder(name, name, public)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(is_ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> str:
        from cryptography.hazmat.primitives.serialization import Encoding

        return self._cert.public_bytes(Encoding.PEM).decode()

    def issue(self, member: str) -> FleetTLS:
        """A new key and certificate for `member` (a worker's or the router's name)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        public = key.public_key()
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, member)])
        usages = [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            _builder(self._cert.subject, subject, public)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(is_ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(member)]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        return FleetTLS(self.cert_pem, cert_pem.decode(), key_pem.decode())


def _builder(issuer, subject, public_key):
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .issuer_name(issuer)
        .subject_name(subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SLACK)
        .not_valid_after(now + CERT_LIFETIME)
    )


def _key_usage(*, is_ca: bool):
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not is_ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        encipher_only=False,
        decipher_only=False,
    )
