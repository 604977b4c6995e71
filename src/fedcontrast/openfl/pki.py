"""The mutual-TLS PKI of a local development federation, made with OpenFL's own ``fx`` commands.

One workspace plays every party here (CA, aggregator and collaborators on one machine). For a real
multi-site deployment the same commands run at different sites; see ``certs/README.md``.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError, FedContrastError


def fx_executable() -> str:
    """``fx`` from this environment (the one fedcontrast is installed in)."""
    candidate = Path(sys.executable).with_name("fx")
    return str(candidate) if candidate.exists() else "fx"


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


def _certificates(path: Path) -> list:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError:
        raise ConfigError(f"{path} is not a PEM certificate; make this party's certificates again") from None


def subject(cert) -> str:
    return cert.subject.rfc4514_string()


def _out_of_date(cert, now: dt.datetime) -> str | None:
    """"expired on DATE UTC" or "is not valid before DATE UTC" (None: within its dates)."""
    if cert.not_valid_after_utc < now:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_before_utc > now:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    return None


def check_certificate_dates(paths: list[str | Path], *, now: dt.datetime | None = None) -> None:
    """Refuse at once, in one sentence naming the file and the date, a certificate that has expired
    or is not valid yet (the TLS handshake would fail on every retry without ever saying why).
    Files that do not exist are left to OpenFL, which names them."""
    now = now or dt.datetime.now(dt.timezone.utc)
    for path in map(Path, paths):
        if not path.is_file():
            continue
        for cert in _certificates(path):
            problem = _out_of_date(cert, now)
            if problem is not None:
                raise ConfigError(f"the certificate {path} ({subject(cert)}) {problem}; " + (
                    "have the federation's CA issue a new one before starting" if problem.startswith("expired")
                    else "check this machine's clock"))


# --- TLS diagnostics: say which certificate, which CA, which name, instead of retrying -------------
# A handshake that fails for a certificate reason fails the same way on every retry, and neither gRPC
# nor OpenFL says why; these checks read the files (and the aggregator's certificate) themselves.


def certificate_names(cert) -> list[str]:
    """The host names (and addresses) a certificate is issued for: its SAN, else its common name."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        names = []
    return [n.lower() for n in names] or [str(a.value).lower() for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def _names_host(names: list[str], host: str) -> bool:
    host = host.lower().rstrip(".")
    return any(n == host or (n.startswith("*.") and host.count(".") >= 1 and host.split(".", 1)[1] == n[2:])
               for n in names)


def signed_by(cert, authorities: list) -> bool:
    """``cert`` is issued (and signed) by one of ``authorities`` (the federation's CA chain)."""
    for ca in authorities:
        try:
            if cert.issuer == ca.subject and cert.verify_directly_issued_by(ca) is None:
                return True
        except Exception:  # a wrong signature, or a key type that cannot have signed it
            continue
    return False


def _chain_names(authorities: list) -> str:
    return " / ".join(subject(ca) for ca in authorities) or "no certificate"


def check_own_certificate(certificate: str | Path, private_key: str | Path | None, chain: str | Path | None, *,
                          now: dt.datetime | None = None) -> None:
    """This party's certificate is within its dates, fits its private key and (unless ``chain`` is
    None) is signed by the CA in ``chain`` (the ``cert_chain.crt`` it trusts): each of these would
    otherwise end in the same failed TLS handshake on every retry. Files that do not exist are left
    to OpenFL, which names them."""
    from cryptography.hazmat.primitives import serialization

    certificate = Path(certificate)
    private_key = Path(private_key) if private_key is not None else None
    chain = Path(chain) if chain is not None else None
    check_certificate_dates([certificate] if chain is None else [chain, certificate], now=now)
    if not certificate.is_file():
        return
    cert = _certificates(certificate)[0]
    if private_key is not None and private_key.is_file():
        try:
            key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"the private key {private_key} cannot be read ({exc}); make this party's key and "
                              "certificate again") from None
        der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(*der) != cert.public_key().public_bytes(*der):
            raise ConfigError(f"the certificate {certificate} ({subject(cert)}) does not belong to the private key "
                              f"{private_key} (it was signed for another key); install the certificate made from "
                              "this key's request")
    if chain is None or not chain.is_file():
        return
    authorities = _certificates(chain)
    if not signed_by(cert, authorities):
        raise ConfigError(f"the certificate {certificate} ({subject(cert)}) is issued by {cert.issuer.rfc4514_string()}, "
                          f"not by the federation's CA in {chain} ({_chain_names(authorities)}); have it signed by the "
                          "federation's CA (or install the federation's cert_chain.crt)")


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
    names = certificate_names(_certificates(crt)[0])
    if not _names_host(names, address):
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
    authorities = _certificates(chain) if chain.is_file() else []
    problems = []
    for site in sites:
        path = cert_dir / "client" / f"col_{site}.crt"
        if not path.is_file():
            continue
        try:
            cert = _certificates(path)[0]
        except (ConfigError, IndexError):
            problems.append(f"{site}'s certificate {path} is not a PEM certificate")
            continue
        said = f"{site}'s certificate {path} ({subject(cert)})"
        problem = _out_of_date(cert, now)
        if problem is not None:
            problems.append(f"{said} {problem}")
        elif cert.not_valid_after_utc < now + soon:
            problems.append(f"{said} expires on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
        if authorities and not signed_by(cert, authorities):
            problems.append(f"{said} is issued by {cert.issuer.rfc4514_string()}, not by the federation's CA in {chain}")
        names = certificate_names(cert)
        if site.lower() not in names:
            problems.append(f"{said} is issued for {', '.join(names) or 'no name'}, not for {site}")
    return problems


# --- one certificate per site: its name, the exact certificate signed for it, revocations -----------
# The aggregator admits a connection only with the very certificate the federation's CA signed for the
# name it claims (``cert/client/col_NAME.crt`` at the operator), never one revoked with `fedcontrast ca
# revoke` (recorded in ``cert/revoked.jsonl``, the certificate kept in ``cert/revoked/``).
REVOKED_DIR = "revoked"
REVOCATION_LOG = "revoked.jsonl"


def fingerprint(cert) -> str:
    """The certificate's SHA-256 fingerprint (of its DER encoding), in hex: what
    ``openssl x509 -noout -fingerprint -sha256`` shows, without the colons."""
    from cryptography.hazmat.primitives import hashes

    return cert.fingerprint(hashes.SHA256()).hex()


def serial_hex(cert) -> str:
    return format(cert.serial_number, "x")


def identity(obj, what: str) -> str:
    """The one name a site's certificate or certificate request (CSR) carries: its subject's single
    common name (CN), which every name in its subject alternative name, if any, must repeat. More
    than one CN, none, or a SAN naming anything else raise :class:`ConfigError` naming ``what``."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cns = [str(a.value) for a in obj.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if len(cns) != 1:
        raise ConfigError(f"{what} has {len(cns)} common names in its subject ({subject(obj) or 'empty'}); a site's "
                          "certificate (and its request) names exactly one, the site's name")
    try:
        san = obj.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = []
    others = [str(getattr(n, "value", n)) for n in san if not (isinstance(n, x509.DNSName) and n.value == cns[0])]
    if others:
        raise ConfigError(f"{what} ({subject(obj)}) also names {', '.join(others)} in its subject alternative name; a "
                          f"site's certificate (and its request) names only the site ({cns[0]})")
    return cns[0]


def check_certificate_name(certificate: str | Path, name: str) -> None:
    """The certificate in ``certificate`` is issued for ``name`` and nothing else (:func:`identity`);
    else :class:`ConfigError` naming both. A missing file is left to the caller."""
    certificate = Path(certificate)
    if not certificate.is_file():
        return
    cert = _certificates(certificate)[0]
    found = identity(cert, f"the certificate {certificate}")
    if found != name:
        raise ConfigError(f"the certificate {certificate} ({subject(cert)}) is issued for {found}, not for {name}: "
                          f"the aggregator admits {name} only with a certificate for {name}; install the one the "
                          f"operator signed for {name}'s own request")


def revocations(cert_dir: str | Path) -> list[dict]:
    """The records of ``cert/revoked.jsonl`` (one JSON object a line: name, serial, sha256, reason,
    revoked_at), oldest first; [] when nothing was revoked. A line that does not parse raises
    :class:`ConfigError` (the aggregator refuses to guess which certificates are revoked)."""
    import json

    path = Path(cert_dir) / REVOCATION_LOG
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
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
    cert = _certificates(path)[0]
    now = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    record = {"name": name, "serial": serial_hex(cert), "sha256": fingerprint(cert), "subject": subject(cert),
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


class EnrolledCertificates:
    """What the aggregator checks about the certificate a collaborator presents, on every call (after
    OpenFL's check that its common name is the name the collaborator claims, a name of cols.yaml):
    it is not revoked (``cert/revoked.jsonl``), it is not a certificate this CA signed for another
    name, and where this CA signed one for the claimed name (``cert/client/col_NAME.crt``) it is
    exactly that one (same SHA-256 fingerprint). Files are re-read when they change: a revocation
    takes effect on the next call, without a restart."""

    def __init__(self, cert_dir: str | Path) -> None:
        self.cert_dir = Path(cert_dir)
        self._files: dict[Path, tuple[tuple, str | None]] = {}  # path -> (stat key, fingerprint or None)
        self._revoked: tuple[tuple, dict[str, dict]] | None = None

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
            value = fingerprint(_certificates(path)[0])
        except (ConfigError, IndexError, OSError):
            value = None
        self._files[path] = (key, value)
        return value

    def revoked(self) -> dict[str, dict]:
        """The revoked certificates by fingerprint (:func:`revocations`; raises on a corrupt record)."""
        key = self._stat(self.cert_dir / REVOCATION_LOG)
        if self._revoked is None or self._revoked[0] != key:
            self._revoked = (key, {r["sha256"]: r for r in revocations(self.cert_dir)})
        return self._revoked[1]

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
        return None  # signed elsewhere: OpenFL's check (its common name is the claimed name) decides


def check_aggregator_certificate(host: str, port: int, chain: str | Path, *, certificate: str | Path | None = None,
                                 private_key: str | Path | None = None, timeout: float = 3.0,
                                 now: dt.datetime | None = None) -> str | None:
    """Connect to the aggregator at ``host:port`` with plain TLS and check what it presents: a
    certificate signed by the CA in ``chain``, within its dates, issued for ``host``; with
    ``certificate``, also that the aggregator accepts this site's certificate. A problem raises
    :class:`ConfigError` in one sentence (retrying cannot fix it). Returns None when all is well,
    or why nothing could be reached (not started yet, a wrong address: retrying may help)."""
    import socket
    import ssl

    from cryptography import x509

    now = now or dt.datetime.now(dt.timezone.utc)
    where = f"the aggregator at {host}:{port}"
    try:
        socket.getaddrinfo(host, port)
    except OSError as exc:
        return f"its name {host} does not resolve ({exc})"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # checked below, with reasons
    context.set_alpn_protocols(["h2"])
    if certificate is not None and private_key is not None:
        try:
            context.load_cert_chain(str(certificate), str(private_key))
        except (OSError, ssl.SSLError):
            certificate = None  # check_own_certificate or OpenFL names the files
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
            accepted = None
            if certificate is not None:  # a refused client certificate closes the connection after the handshake
                try:
                    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # HTTP/2's preface: gRPC answers it
                    accepted = bool(tls.recv(1))
                except TimeoutError:
                    pass  # no answer either way: nothing to conclude
                except OSError:  # a TLS alert or a reset
                    accepted = False
    except (OSError, ssl.SSLError) as exc:
        return f"{where} cannot be reached ({exc})"
    cert = x509.load_der_x509_certificate(der)
    shown = f"{where} presents a certificate ({subject(cert)})"
    authorities = _certificates(Path(chain))
    if not signed_by(cert, authorities):
        raise ConfigError(f"{shown} issued by {cert.issuer.rfc4514_string()}, not by the federation's CA in {chain} "
                          f"({_chain_names(authorities)}): this site and the aggregator hold different CAs; get the "
                          "federation's cert_chain.crt from the operator")
    problem = _out_of_date(cert, now)
    if problem is not None:
        raise ConfigError(f"{shown} that {problem}; " + (
            "the operator must have the federation's CA issue a new one" if problem.startswith("expired")
            else "check this machine's clock (and the aggregator's)"))
    names = certificate_names(cert)
    if not _names_host(names, host):
        raise ConfigError(f"{shown} issued for {', '.join(names) or 'no name'}, not for {host}, the plan's agg_addr; "
                          f"the operator must make the aggregator's certificate for {host}, or the plan name the "
                          "aggregator as its certificate does")
    if accepted is False:
        own = _certificates(Path(certificate))[0]
        raise ConfigError(f"{where} closed the connection after the TLS handshake: it does not accept this site's "
                          f"certificate {certificate} ({subject(own)}, issued by {own.issuer.rfc4514_string()}); ask "
                          "the operator whether it is signed by the federation's CA and the aggregator's CA file")
    return None


def issue_for_key(key_path: str | Path, name: str, *, ca_dir: str | Path | None = None,
                  days: tuple[float, float] = (-1, 30), san: str | None = None):
    """For tests and benchmarks of certificate mistakes: a certificate for the existing private key
    in ``key_path``, issued for ``name`` (SAN ``san`` or ``name``), valid from ``days[0]`` to
    ``days[1]`` days from now, signed by the federation's signing CA in ``ca_dir`` (an operator's
    ``cert/ca``) or, without it, by a new CA of another federation. Returns (certificate, CA certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
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
        ca_key = serialization.load_pem_private_key((ca_dir / "signing-ca" / "private" / "signing-ca.key").read_bytes(),
                                                    password=None)
        ca_cert = x509.load_pem_x509_certificate((ca_dir / "signing-ca.crt").read_bytes())
    key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + dt.timedelta(days=days[0])).not_valid_after(now + dt.timedelta(days=days[1]))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(san or name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, ca_cert


def write_certificate(path: str | Path, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    Path(path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
