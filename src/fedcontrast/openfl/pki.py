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


def certify_workspace(workspace: str | Path, federation: str | None = None, *, days: int = 365) -> Path:
    """The federation's CA in ``workspace/cert`` as ``fx workspace certify`` lays it out (a root CA, a
    signing CA it signs, ``cert_chain.crt``; ``fx aggregator certify`` and ``fx collaborator certify``
    sign with the signing CA), but named after the federation (``CN=<federation> fedcontrast CA``,
    default: the workspace folder's name) instead of fx's fixed ``CN=Simple Root CA, O=Simple Inc``,
    which fx offers no way to change. Returns the chain."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from ..deploy.certificates import federation_ca_name

    cert = Path(workspace) / "cert"
    root_name = federation_ca_name(federation or Path(workspace).resolve().name)
    signing_name = federation_ca_name(federation or Path(workspace).resolve().name, "signing CA")
    now = dt.datetime.now(dt.timezone.utc)
    pem = serialization.Encoding.PEM

    def issue(name, key, issuer, issuer_key):
        return (x509.CertificateBuilder().subject_name(name).issuer_name(issuer).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False),
                               critical=True)
                .sign(issuer_key, hashes.SHA384()))

    files = {}
    root_key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    signing_key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    root = issue(root_name, root_key, root_name, root_key)
    signing = issue(signing_name, signing_key, root_name, root_key)
    for role, key, crt in (("root-ca", root_key, root), ("signing-ca", signing_key, signing)):
        (cert / "ca" / role / "private").mkdir(parents=True, exist_ok=True, mode=0o700)
        (cert / "ca" / role / "db").mkdir(parents=True, exist_ok=True)
        for suffix, text in ((".db", ""), (".db.attr", ""), (".crt.srl", "01"), (".crl.srl", "01")):
            (cert / "ca" / role / "db" / f"{role}{suffix}").write_text(text)  # fx's (unused) CA database
        key_path = cert / "ca" / role / "private" / f"{role}.key"
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                        serialization.NoEncryption()))
        files[role] = crt.public_bytes(pem)
        (cert / "ca" / f"{role}.crt").write_bytes(files[role])
    chain = cert / "cert_chain.crt"
    chain.write_bytes(files["root-ca"] + files["signing-ca"])
    return chain


def dev_pki_commands(collaborators: list[str], *, fqdn: str = "localhost") -> list[list[str]]:
    """The ``fx`` command lines, in order, run inside the workspace (after :func:`certify_workspace`,
    which makes the CA ``fx workspace certify`` would, named after the federation)."""
    commands = [["fx", "aggregator", "generate-cert-request", "--fqdn", fqdn],
                ["fx", "aggregator", "certify", "--fqdn", fqdn, "--silent"]]
    for name in collaborators:
        commands += [["fx", "collaborator", "generate-cert-request", "-n", name, "--silent", "--skip-package"],
                     ["fx", "collaborator", "certify", "-n", name, "--silent"]]
    return commands


def make_dev_pki(workspace: str | Path, collaborators: list[str], *, fqdn: str = "localhost",
                 log=print, federation: str | None = None) -> None:
    """The federation's CA (:func:`certify_workspace`, named ``federation``), then :func:`dev_pki_commands`
    in ``workspace``; a failing command raises with its output."""
    ws = Path(workspace)
    if (ws / "cert" / "ca").exists():
        raise FedContrastError(f"{ws / 'cert'} already holds a certificate authority; remove it to make a new one")
    if any(name != name.lower() for name in collaborators):
        raise FedContrastError("collaborator names must be lower case: OpenFL's certificate tools lower-case them")
    fx = fx_executable()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    chain = certify_workspace(ws, federation)
    log(f"  the federation's CA: {ca_subject(chain)} (in {ws / 'cert' / 'ca'})")
    for command in dev_pki_commands(collaborators, fqdn=fqdn):
        log("  $ " + " ".join(command))
        proc = subprocess.run([fx, *command[1:]], cwd=ws, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise FedContrastError(f"'{' '.join(command)}' failed in {ws} (exit {proc.returncode}): "
                                   + " | ".join(tail))


def ca_subject(chain: Path) -> str:
    """The subject of the root CA in a chain file, e.g. ``CN=fed_moon fedcontrast CA,O=fed_moon``."""
    from cryptography import x509

    return x509.load_pem_x509_certificates(chain.read_bytes())[0].subject.rfc4514_string()


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
