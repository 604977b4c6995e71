"""OpenFL's certificate folder as the aggregator judges it: one certificate per site (the exact
certificate the CA signed for each name, ``cert/client/col_NAME.crt``), revocations
(``cert/revoked.jsonl``, ``cert/revoked/``), the aggregator's record of who is enrolled, and its own
server files (``cert/server/agg_ADDR.crt``) as ``fx aggregator start`` looks them up. Reading and
checking a certificate, whatever the engine: :mod:`fedcontrast.deploy.certificates`."""

from __future__ import annotations

import datetime as dt
import logging
import os
from pathlib import Path

from ..deploy.certificates import (
    certificate_names,
    check_own_certificate,
    fingerprint,
    load_certificates,
    names_host,
    out_of_date,
    serial_hex,
    signed_by,
    subject,
)
from ..errors import ConfigError

# --- one certificate per site: its name, the exact certificate signed for it, revocations -----------
# The aggregator admits a connection only with the very certificate the federation's CA signed for the
# name it claims (``cert/client/col_NAME.crt`` at the operator), never one revoked with `fedcontrast ca
# revoke` (recorded in ``cert/revoked.jsonl``, the certificate kept in ``cert/revoked/``).
REVOKED_DIR = "revoked"
logger = logging.getLogger("fedcontrast.openfl.components")  # read by the aggregator: its log names the components

REVOCATION_LOG = "revoked.jsonl"


def revocations(cert_dir: str | Path) -> list[dict]:
    """The records of ``cert/revoked.jsonl`` (one JSON object a line: name, serial, sha256, reason,
    revoked_at), oldest first; [] when nothing was revoked. A line that does not parse raises
    :class:`ConfigError` (the aggregator refuses to guess which certificates are revoked)."""
    import json

    path = Path(cert_dir) / REVOCATION_LOG
    if not path.is_file():
        return []
    from ..yamlio import read_text

    records = []
    for number, line in enumerate(read_text(path, "the revocation record").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
                raise ValueError("no sha256")
        except ValueError:
            raise ConfigError(f"line {number} of the revocation record {path} is not a revocation (JSON with name, "
                              "serial, sha256, reason, revoked_at); restore the file from its backup — it is "
                              "append-only") from None
        records.append(record)
    return records


def revoke_certificate(cert_dir: str | Path, name: str, reason: str, *, now: dt.datetime | None = None) -> dict:
    """Revoke the certificate this CA signed for ``name`` (``cert/client/col_NAME.crt``): one line
    appended to ``cert/revoked.jsonl`` (name, serial, sha256 fingerprint, subject, reason, UTC time),
    then the certificate moved to ``cert/revoked/col_NAME-SERIAL.crt``. The aggregator refuses it from
    then on (even while running); the name can be signed a new certificate. Returns the record."""
    import json

    cert_dir = Path(cert_dir)
    reason = " ".join(str(reason or "").split())
    if not reason:
        raise ConfigError("say why the certificate is revoked (--reason TEXT, e.g. 'key lost with the laptop'): the "
                          "reason is kept in the revocation record")
    path = cert_dir / "client" / f"col_{name}.crt"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: this CA holds no certificate for {name} to revoke (already "
                          "revoked, never signed here, or another name)")
    cert = load_certificates(path)[0]
    now = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    record = {"name": name, "serial": serial_hex(cert), "sha256": fingerprint(cert), "subject": subject(cert),
              "public_key": key_fingerprint(cert.public_key()),  # the key itself is never signed again
              "reason": reason, "revoked_at": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    log = cert_dir / REVOCATION_LOG
    if record["sha256"] not in {r["sha256"] for r in revocations(cert_dir)}:  # a re-run after a crash: once
        with open(log, "a") as f:  # recorded first: a crash before the move leaves it refused, not admitted
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    target = cert_dir / REVOKED_DIR / f"col_{name}-{record['serial']}.crt"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    record["kept"] = str(target)
    return record


def key_fingerprint(public_key) -> str:
    """A public key's fingerprint (``SHA256:`` and the hex SHA-256 of its SubjectPublicKeyInfo), as
    ``fedcontrast site roster`` shows it."""
    from ..privacy.secagg import fingerprint as of_key

    return of_key(public_key)


def revoked_keys(cert_dir: str | Path) -> dict[str, dict]:
    """The public keys of every certificate this CA revoked (their fingerprint → the revocation record):
    from ``cert/revoked.jsonl`` (its ``public_key``), and from the revoked certificates kept in
    ``cert/revoked/`` (records written before the key was recorded, or a record lost). A revoked key is
    never signed again (:func:`refuse_revoked_key`). A record that cannot be read raises :class:`ConfigError`."""
    records = revocations(cert_dir)
    keys = {r["public_key"]: r for r in records if isinstance(r.get("public_key"), str)}
    by_certificate = {r["sha256"]: r for r in records}
    for path in sorted((Path(cert_dir) / REVOKED_DIR).glob("col_*.crt")):
        try:
            cert = load_certificates(path)[0]
        except (ConfigError, IndexError):
            continue  # a damaged copy: its record (if any) still holds the key
        key = key_fingerprint(cert.public_key())
        keys.setdefault(key, by_certificate.get(fingerprint(cert), {"name": path.stem.removeprefix("col_"),
                                                                    "kept": str(path)}))
    return keys


def refuse_revoked_key(cert_dir: str | Path, public_key, what: str) -> None:
    """One :class:`ConfigError` when ``public_key`` (of the request ``what``) is the key of a certificate
    this CA revoked: a revoked key never comes back, whatever name the request carries."""
    key = key_fingerprint(public_key)
    record = revoked_keys(cert_dir).get(key)
    if record is not None:
        when = f" on {record['revoked_at'][:10]}" if record.get("revoked_at") else ""
        why = f" ({record['reason']})" if record.get("reason") else ""
        holder = record.get("name", "a site")
        raise ConfigError(f"refused to sign {what}: its public key {key} is the key of {holder}'s certificate "
                          f"revoked{when}{why}, and a revoked key is never signed again; the site makes a new key and "
                          "request (`fedcontrast site join` again) and reads you its hash")


class EnrolledCertificates:
    """What the aggregator checks about the certificate a collaborator presents, on every call (after
    OpenFL's check that its common name is the name the collaborator claims, a name of cols.yaml):
    it is not revoked (``cert/revoked.jsonl``, and the revoked certificates kept in ``cert/revoked/``,
    which outlive the loss of that record), it is not a certificate this CA signed for another name,
    and it is exactly the one this CA signed for the claimed name and still holds
    (``cert/client/col_NAME.crt``, same SHA-256 fingerprint): a name with no such file is refused.
    Files are re-read when they change: a revocation takes effect on the next call, without a restart."""

    def __init__(self, cert_dir: str | Path) -> None:
        self.cert_dir = Path(cert_dir)
        self._files: dict[Path, tuple[tuple | None, str | None]] = {}  # path -> (stat key, fingerprint or None)
        self._revoked: tuple[tuple | None, dict[str, dict]] | None = None

    @staticmethod
    def _stat(path: Path) -> tuple | None:
        try:
            s = path.stat()
        except OSError:
            return None
        return s.st_ino, s.st_size, s.st_mtime_ns

    def _fingerprint_of(self, path: Path) -> str | None:
        """The fingerprint of the certificate in ``path``; None when it cannot be read as one."""
        key = self._stat(path)
        cached = self._files.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            value = fingerprint(load_certificates(path)[0])
        except (ConfigError, IndexError, OSError):
            value = None
        self._files[path] = (key, value)
        return value

    def revoked(self) -> dict[str, dict]:
        """The revoked certificates by fingerprint (:func:`revocations`; raises on a corrupt record). When
        the record is (re)read, each revoked certificate kept in ``cert/revoked/`` without its line is logged."""
        key = self._stat(self.cert_dir / REVOCATION_LOG)
        if self._revoked is None or self._revoked[0] != key:
            self._revoked = (key, {r["sha256"]: r for r in revocations(self.cert_dir)})
            for problem in self.missing_records():
                logger.error(problem)
        return self._revoked[1]

    def kept_revoked(self) -> dict[str, Path]:
        """The certificates ``fedcontrast ca revoke`` moved to ``cert/revoked/``, by fingerprint: the second
        record of a revocation, which outlives the loss of ``revoked.jsonl``."""
        kept = {}
        for path in sorted((self.cert_dir / REVOKED_DIR).glob("col_*.crt")):
            found = self._fingerprint_of(path)
            if found is not None:
                kept[found] = path
        return kept

    def missing_records(self) -> list[str]:
        """One sentence for each certificate kept in ``cert/revoked/`` that ``revoked.jsonl`` has no line for."""
        records = self._revoked[1] if self._revoked is not None else {}
        return [f"{path} is a certificate this CA revoked, but the revocation record {self.cert_dir / REVOCATION_LOG} "
                "has no line for it (the record is missing or was cut short): it stays refused; restore the record "
                "from its backup" for found, path in self.kept_revoked().items() if found not in records]

    def refusal(self, name: str, pem: bytes | None) -> str | None:
        """One sentence why the client certificate ``pem`` (PEM, as gRPC's ``x509_pem_cert`` gives it)
        may not be used as ``name``; None when it may."""
        from cryptography import x509

        if not pem:
            return None  # no client certificate: OpenFL's own check refuses it
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            return f"refused {name}: the client certificate it presented cannot be read"
        found = fingerprint(cert)
        shown = f"the certificate it presented ({subject(cert)}, serial {serial_hex(cert)}, SHA-256 {found[:16]}…)"
        try:
            record = self.revoked().get(found)
        except ConfigError as exc:  # fail closed: which certificates are revoked is unknown
            return f"refused {name}: {exc}"
        if record is not None:
            return (f"refused {name}: {shown} was revoked on {record.get('revoked_at', '?')} "
                    f"({record.get('reason', 'no reason given')}); the site needs a newly signed certificate")
        own = self.cert_dir / "client" / f"col_{name}.crt"
        if self._stat(own) is not None:
            expected = self._fingerprint_of(own)
            if expected is None:
                return (f"refused {name}: {own}, the certificate this CA signed for {name}, cannot be read; restore it "
                        "or revoke it and sign a new one")
            if expected != found:
                return (f"refused {name}: {shown} is not the certificate this CA signed for {name} ({own}, SHA-256 "
                        f"{expected[:16]}…)")
            return None
        for path in sorted((self.cert_dir / "client").glob("col_*.crt")):  # signed here, but for someone else
            if self._fingerprint_of(path) == found:
                return f"refused {name}: {shown} is the certificate this CA signed for {path.stem[4:]} ({path})"
        kept = self.kept_revoked().get(found)
        if kept is not None:  # revoked, though its line in revoked.jsonl is gone
            return (f"refused {name}: {shown} is a certificate this CA revoked (kept as {kept}); the revocation record "
                    f"{self.cert_dir / REVOCATION_LOG} has no line for it — restore the record from its backup; the "
                    "site needs a newly signed certificate")
        # Admitted only with a certificate this CA signed and still holds: one whose file is gone (revoked, its
        # records lost; or deleted) is never let in on its common name alone.
        return (f"refused {name}: this CA holds no certificate signed for {name} ({own} does not exist), and the "
                "aggregator admits only the certificates its CA signed and still holds; restore the file from the "
                f"CA's backup, or sign {name}'s new request (`fedcontrast ca sign`)")


def check_server_files(cert_dir: str | Path, address: str, *, now: dt.datetime | None = None) -> None:
    """The aggregator's certificate and key for the plan's ``agg_addr`` exist as ``fx aggregator
    start`` looks them up (``cert/server/agg_<addr>.crt/.key``), are within their dates (the CA chain
    too), fit each other and name that address. (A certificate from another CA is named by every site
    that connects: :func:`check_aggregator_certificate`.)"""
    cert_dir, address = Path(cert_dir), address.lower()
    server = cert_dir / "server"
    crt, key = server / f"agg_{address}.crt", server / f"agg_{address}.key"
    missing = [p for p in (crt, key) if not p.is_file()]
    if missing:
        found = sorted(p.stem for p in server.glob("agg_*.crt")) if server.is_dir() else []
        held = (f"{server} holds a certificate for {', '.join(found)}" if found else
                f"{server} holds no aggregator certificate")
        raise ConfigError(f"{held}, but the plan's agg_addr is {address} ({', '.join(map(str, missing))} missing); "
                          f"make the aggregator's certificate for {address} (`fedcontrast ca init --fqdn {address}`)"
                          + (f" or set network.settings.agg_addr to {found[0].removeprefix('agg_')} in the plan"
                             if found else ""))
    # in date (the CA chain too), fitting its key, and signed by the CA the sites trust (the cert_chain.crt the
    # aggregator checks the sites' certificates with)
    check_own_certificate(crt, key, cert_dir / "cert_chain.crt", now=now)
    names = certificate_names(load_certificates(crt)[0])
    if not names_host(names, address):
        raise ConfigError(f"the aggregator's certificate {crt} is issued for {', '.join(names) or 'no name'}, not for "
                          f"{address}, the plan's agg_addr: the sites would refuse it; make it again for {address} "
                          f"(`fedcontrast ca init --fqdn {address}`)")


def check_enrolled_certificates(cert_dir: str | Path, sites: list[str], *, now: dt.datetime | None = None,
                               soon: dt.timedelta = dt.timedelta(days=7)) -> list[str]:
    """The certificates this aggregator's CA signed for the plan's sites (``cert/client/col_NAME.crt``,
    written by ``fedcontrast ca sign``), as the aggregator will judge them: one sentence for each
    that is expired, not yet valid, expiring within ``soon``, issued by another CA than
    ``cert_chain.crt`` or for another name. Sites signed elsewhere have no file here: nothing to say."""
    cert_dir = Path(cert_dir)
    now = now or dt.datetime.now(dt.timezone.utc)
    chain = cert_dir / "cert_chain.crt"
    authorities = load_certificates(chain) if chain.is_file() else []
    problems = []
    for site in sites:
        path = cert_dir / "client" / f"col_{site}.crt"
        if not path.is_file():
            continue
        try:
            cert = load_certificates(path)[0]
        except (ConfigError, IndexError):
            problems.append(f"{site}'s certificate {path} is not a PEM certificate")
            continue
        said = f"{site}'s certificate {path} ({subject(cert)})"
        problem = out_of_date(cert, now)
        if problem is not None:
            problems.append(f"{said} {problem}")
        elif cert.not_valid_after_utc < now + soon:
            problems.append(f"{said} expires on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
        if authorities and not signed_by(cert, authorities):
            problems.append(f"{said} is issued by {cert.issuer.rfc4514_string()}, not by the federation's CA in "
                            f"{chain}")
        names = certificate_names(cert)
        if site.lower() not in names:
            problems.append(f"{said} is issued for {', '.join(names) or 'no name'}, not for {site}")
    return problems
