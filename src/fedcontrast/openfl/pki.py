"""The mutual-TLS PKI of a local development federation, made with OpenFL's own ``fx`` commands.

One workspace plays every party here (CA, aggregator and collaborators on one machine). For a real
multi-site deployment the same commands run at different sites; see ``certs/README.md``.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from pathlib import Path
from typing import cast

from ..errors import FedContrastError
from .fx import fx_executable


def dev_pki_commands(collaborators: list[str], *, fqdn: str = "localhost") -> list[list[str]]:
    """The ``fx`` command lines, in order, run inside the workspace."""
    commands = [["fx", "workspace", "certify"],
                ["fx", "aggregator", "generate-cert-request", "--fqdn", fqdn],
                ["fx", "aggregator", "certify", "--fqdn", fqdn, "--silent"]]
    for name in collaborators:
        commands += [["fx", "collaborator", "generate-cert-request", "-n", name, "--silent", "--skip-package"],
                     ["fx", "collaborator", "certify", "-n", name, "--silent"]]
    return commands


def make_dev_pki(workspace: str | Path, collaborators: list[str], *, fqdn: str = "localhost",
                 log=print) -> None:
    """Run :func:`dev_pki_commands` in ``workspace``; a failing command raises with its output."""
    ws = Path(workspace)
    if (ws / "cert" / "ca").exists():
        raise FedContrastError(f"{ws / 'cert'} already holds a certificate authority; remove it to make a new one")
    if any(name != name.lower() for name in collaborators):
        raise FedContrastError("collaborator names must be lower case: OpenFL's certificate tools lower-case them")
    fx = fx_executable()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for command in dev_pki_commands(collaborators, fqdn=fqdn):
        log("  $ " + " ".join(command))
        proc = subprocess.run([fx, *command[1:]], cwd=ws, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise FedContrastError(f"'{' '.join(command)}' failed in {ws} (exit {proc.returncode}): "
                                   + " | ".join(tail))


# --- TLS diagnostics: say which certificate, which CA, which name, instead of retrying -------------
# A handshake that fails for a certificate reason fails the same way on every retry, and neither gRPC
# nor OpenFL says why; these checks read the files (and the aggregator's certificate) themselves.


def issue_for_key(key_path: str | Path, name: str, *, ca_dir: str | Path | None = None,
                  days: tuple[float, float] = (-1, 30), san: str | None = None):
    """For tests and benchmarks of certificate mistakes: a certificate for the existing private key
    in ``key_path``, issued for ``name`` (SAN ``san`` or ``name``), valid from ``days[0]`` to
    ``days[1]`` days from now, signed by the federation's signing CA in ``ca_dir`` (an operator's
    ``cert/ca``) or, without it, by a new CA of another federation. Returns (certificate, CA certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key: CertificateIssuerPrivateKeyTypes  # a CA's key signs (RSA or EC; fx makes RSA ones)
    if ca_dir is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "other federation ca")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=30))
                   .not_valid_after(now + dt.timedelta(days=365))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(ca_key, hashes.SHA256()))
    else:
        ca_dir = Path(ca_dir)
        ca_key = cast(CertificateIssuerPrivateKeyTypes, serialization.load_pem_private_key(
            (ca_dir / "signing-ca" / "private" / "signing-ca.key").read_bytes(), password=None))
        ca_cert = x509.load_pem_x509_certificate((ca_dir / "signing-ca.crt").read_bytes())
    key = cast(CertificateIssuerPrivateKeyTypes,  # a site's TLS key: RSA or EC
               serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + dt.timedelta(days=days[0])).not_valid_after(now + dt.timedelta(days=days[1]))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(san or name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, ca_cert


def write_certificate(path: str | Path, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    Path(path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
