"""The operator's PKI on Flower (the `cryptography` package): the federation's CA, named after the
federation (``CN=<federation> fedcontrast CA``), the SuperLink's certificate, and an earlier
experiment's PKI reused (``flower init --pki-from OLD``): its CA, so that the sites keep the CA
certificate (and fingerprint) they hold, and the SuperNode keys its sites had registered, carried into
``keys/`` and registered at the new SuperLink with ``flower register DIR --carried``, with no new key
exchange with the sites."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import ConfigError

CERT_DIR, SITES_FILE = "certs", "sites.json"  # in the operator's folder: its certificates, its registered sites
CARRIED_DIR = "keys"  # the public keys an earlier experiment's sites had registered


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def make_ca(cert_dir: Path, federation: str, *, days: int = 365) -> None:
    """The federation's CA: ``ca.crt`` (sent to every site) and ``ca.key`` (stays, mode 600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from ..deploy.certificates import federation_ca_name

    name = federation_ca_name(federation)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "ca.crt").write_bytes(ca.public_bytes(pem))
    _write_private(cert_dir / "ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))


def make_superlink_certificate(cert_dir: Path, host: str, *, days: int = 365) -> None:
    """The SuperLink's server certificate for ``host`` (``superlink.crt``/``.key``), signed by the CA
    in ``cert_dir``. The SuperLink's own ServerApp process reaches it at 127.0.0.1 over the same TLS:
    named too."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    ca_key: Any = serialization.load_pem_private_key((cert_dir / "ca.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[Any] = [x509.DNSName(h) for h in dict.fromkeys([host, "localhost"])]
    addresses = {"127.0.0.1"}
    try:
        addresses.add(str(ipaddress.ip_address(host)))
    except ValueError:
        pass
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(addresses)]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    (cert_dir / "superlink.crt").write_bytes(cert.public_bytes(pem))
    _write_private(cert_dir / "superlink.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                 serialization.NoEncryption()))


def make_certificates(cert_dir: Path, host: str, *, federation: str = "fedcontrast", days: int = 365) -> None:
    """The federation's CA (``ca.crt``; its key ``ca.key`` stays with the operator), named after
    ``federation``, and the SuperLink's server certificate for ``host``."""
    make_ca(cert_dir, federation, days=days)
    make_superlink_certificate(cert_dir, host, days=days)


def reuse_pki(folder: Path, previous: str | Path, *, host: str, sites: list[str]) -> tuple[list[str], list[str]]:
    """A new experiment of an existing federation: the CA of the operator's earlier folder ``previous``
    copied into ``folder/certs`` (a new SuperLink certificate for ``host``, signed by it), and the
    public keys its ``sites`` had registered (or had carried) copied into ``folder/keys/``. Returns the
    sites carried and those of ``sites`` with no key to carry (they send theirs)."""
    old = Path(previous).resolve()
    if not (old / "deployment.json").is_file():
        raise ConfigError(f"--pki-from {previous}: it is not a Flower operator's folder (no deployment.json; made by "
                          "`fedcontrast flower init`)")
    if not (old / CERT_DIR / "ca.crt").is_file() or not (old / CERT_DIR / "ca.key").is_file():
        raise ConfigError(f"--pki-from {previous}: it holds no CA to reuse ({old / CERT_DIR / 'ca.crt'} and its "
                          "key ca.key)")
    certs = folder / CERT_DIR
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(old / CERT_DIR / "ca.crt", certs / "ca.crt")
    _write_private(certs / "ca.key", (old / CERT_DIR / "ca.key").read_bytes())
    make_superlink_certificate(certs, host)
    try:
        nodes = json.loads((old / SITES_FILE).read_text()) if (old / SITES_FILE).is_file() else {}
    except ValueError:
        raise ConfigError(f"{old / SITES_FILE} cannot be read: the earlier folder's registered sites are "
                          "damaged") from None
    carried, missing = [], []
    for site in sites:
        key = str(nodes.get(site, {}).get("public_key") or "")
        earlier = old / CARRIED_DIR / f"{site}.pub"
        if not key and earlier.is_file():  # carried into the earlier folder and never registered there
            key = " ".join(earlier.read_text().split()[:2])
        if not key:
            missing.append(site)
            continue
        target = folder / CARRIED_DIR / f"{site}.pub"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(key + "\n")
        carried.append(site)
    return carried, missing


def carried_keys(folder: Path) -> dict[str, Path]:
    """The public keys carried over by ``--pki-from``, by site."""
    return {p.stem: p for p in sorted((Path(folder) / CARRIED_DIR).glob("*.pub"))}
