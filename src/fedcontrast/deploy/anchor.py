"""A site's trust anchor: the federation's CA, pinned by its SHA-256 fingerprint when the site joins.

The operator reads its CA's fingerprint to every institution by another channel (``fedcontrast ca
init`` and ``workspace export`` print it), as each institution reads its request's hash to the
operator. ``site join`` pins the CA the site confirmed (``cert/pinned_ca.json``); from then on the CA
chain a site installs or uses — ``site import-cert``'s signed package, ``--cert-from``, the chain in
``cert/cert_chain.crt`` at ``doctor`` and at every start — must be that CA's: its one self-signed
certificate is the pinned one, and every other certificate in it is signed (directly or through the
others) by it, since gRPC trusts every certificate of the file as a root.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

from ..errors import ConfigError
from ..yamlio import read_bytes

PIN_FILE = "pinned_ca.json"  # in the site's cert/ folder
_HEX = re.compile(r"[0-9a-f]{64}")


def normalise_fingerprint(text: str) -> str:
    """A SHA-256 fingerprint as given (``SHA256:…``, ``sha256:…``, colon-separated as openssl prints it,
    or 64 hex digits) in lower-case hex; a malformed one is one sentence."""
    value = str(text).strip()
    value = re.sub(r"(?i)^sha-?256[:=]?", "", value).replace(":", "").strip().lower()
    if not _HEX.fullmatch(value):
        raise ConfigError(f"{text!r} is not a SHA-256 fingerprint (SHA256: and 64 hex digits, as `fedcontrast ca init` "
                          "prints it)")
    return value


def shown(fingerprint: str) -> str:
    return f"SHA256:{fingerprint}"


def chain_root(pem: bytes, what: str):
    """The one root (self-signed) certificate of a CA chain, after checking that every other
    certificate in it is signed by it (directly or through the others); else :class:`ConfigError`."""
    from cryptography import x509

    from .certificates import subject

    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise ConfigError(f"{what} holds no readable PEM certificate") from None
    roots = [c for c in certs if c.subject == c.issuer]
    if len(roots) != 1:
        raise ConfigError(f"{what} holds {len(roots)} self-signed CA certificates ("
                          f"{', '.join(subject(c) for c in roots) or 'none'}); a federation's chain has one root")
    root = roots[0]
    for cert in certs:
        current, seen = cert, 0
        while current is not root:
            issuers = [c for c in certs if c.subject == current.issuer and c is not current]
            try:
                if not issuers or seen > len(certs):
                    raise ValueError("no issuer")
                current.verify_directly_issued_by(issuers[0])
            except Exception:
                raise ConfigError(f"{what} holds a certificate ({subject(cert)}) that is not signed by its root CA "
                                  f"({subject(root)}): every certificate of the chain is trusted as a root, so "
                                  "all must come from the federation's CA") from None
            current, seen = issuers[0], seen + 1
    return root


def fingerprint_of_chain(pem: bytes, what: str) -> tuple[str, str]:
    """(the SHA-256 fingerprint of the chain's root, its subject)."""
    from .certificates import fingerprint, subject

    root = chain_root(pem, what)
    return fingerprint(root), subject(root)


def read_pin(cert_dir: str | Path) -> dict | None:
    """The CA pinned at join (``cert/pinned_ca.json``: sha256, subject, pinned_at, how); None when none."""
    path = Path(cert_dir) / PIN_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(read_bytes(path, "the pinned CA", limit=1 << 20).decode("utf-8"))  # never a FIFO
        record["sha256"] = normalise_fingerprint(record["sha256"])
    except (ValueError, KeyError, TypeError, OSError, ConfigError):
        raise ConfigError(f"{path}, the federation's CA this site pinned at join, cannot be read: restore it from a "
                          "backup (or join again), checking the CA's fingerprint with the operator") from None
    return record


def pin_ca(cert_dir: str | Path, fingerprint: str, subject: str, how: str) -> Path:
    """Record the CA this site trusts (written whole; an existing pin is never replaced by another CA)."""
    from ..atomic import atomic_write_text

    cert_dir = Path(cert_dir)
    current = read_pin(cert_dir)
    if current is not None and current["sha256"] != fingerprint:
        raise ConfigError(f"this site already pinned the CA {shown(current['sha256'])} ({cert_dir / PIN_FILE}); "
                          f"it does not replace it with {shown(fingerprint)}")
    cert_dir.mkdir(parents=True, exist_ok=True)
    record = {"sha256": fingerprint, "subject": subject, "how": how,
              "pinned_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    path = cert_dir / PIN_FILE
    atomic_write_text(path, json.dumps(record, sort_keys=True) + "\n")
    return path


def check_against_pin(cert_dir: str | Path, pem: bytes, what: str) -> tuple[str, str]:
    """A chain (``pem``) is the pinned CA's: (its root's fingerprint, subject), else :class:`ConfigError`
    naming both CAs. Without a pin, only its shape is checked."""
    found, subject = fingerprint_of_chain(pem, what)
    pin = read_pin(cert_dir)
    if pin is not None and pin["sha256"] != found:
        raise ConfigError(f"{what} is from another CA ({subject}, {shown(found)}) than the federation's CA this site "
                          f"pinned at join ({pin.get('subject', '?')}, {shown(pin['sha256'])}, in "
                          f"{Path(cert_dir) / PIN_FILE})")
    return found, subject


def check_installed_chain(cert_dir: str | Path) -> None:
    """``cert/cert_chain.crt`` is the pinned CA's (nothing replaced it since the join); no pin, or no
    chain yet: nothing to check."""
    chain = Path(cert_dir) / "cert_chain.crt"
    if read_pin(cert_dir) is None or not chain.is_file():
        return
    try:
        check_against_pin(cert_dir, read_bytes(chain, "the CA chain"), f"the CA chain {chain}")
    except ConfigError as exc:
        raise ConfigError(f"{exc}: it was replaced after the join; put back the federation's chain (`fedcontrast site "
                          "import-cert` of the operator's signed package)") from None
