"""Reading and checking the federation's certificates: dates, names (a site's one name), fingerprints,
the chain, and what a site's TLS connection will meet, said in one sentence instead of retried. The
OpenFL certificate folder's layout (enrolment, revocation, the aggregator's files) is
:mod:`fedcontrast.openfl.enrolment`."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from ..errors import ConfigError
from ..yamlio import read_bytes


def load_certificates(path: Path) -> list:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(read_bytes(path, "certificate"))
    except ValueError:
        raise ConfigError(f"{path} is not a PEM certificate; make this party's certificates again") from None


def subject(cert) -> str:
    return cert.subject.rfc4514_string()


def out_of_date(cert, now: dt.datetime) -> str | None:
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
        for cert in load_certificates(path):
            problem = out_of_date(cert, now)
            if problem is not None:
                raise ConfigError(f"the certificate {path} ({subject(cert)}) {problem}; " + (
                    "have the federation's CA issue a new one before starting" if problem.startswith("expired")
                    else "check this machine's clock"))


def certificate_names(cert) -> list[str]:
    """The host names (and addresses) a certificate is issued for: its SAN, else its common name."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        names = []
    return [n.lower() for n in names] or [str(a.value).lower()
                                          for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def names_host(names: list[str], host: str) -> bool:
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
    cert = load_certificates(certificate)[0]
    if private_key is not None and private_key.is_file():
        try:
            key = serialization.load_pem_private_key(read_bytes(private_key, "private key"), password=None)
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
    authorities = load_certificates(chain)
    if not signed_by(cert, authorities):
        raise ConfigError(f"the certificate {certificate} ({subject(cert)}) is issued by "
                          f"{cert.issuer.rfc4514_string()}, not by the federation's CA in {chain} "
                          f"({_chain_names(authorities)}); have it signed by the "
                          "federation's CA (or install the federation's cert_chain.crt)")


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
    cert = load_certificates(certificate)[0]
    found = identity(cert, f"the certificate {certificate}")
    if found != name:
        raise ConfigError(f"the certificate {certificate} ({subject(cert)}) is issued for {found}, not for {name}: "
                          f"the aggregator admits {name} only with a certificate for {name}; install the one the "
                          f"operator signed for {name}'s own request")


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
    if der is None:  # no certificate from a TLS server (never with the TLS gRPC speaks): nothing to check
        return f"{where} presents no certificate"
    cert = x509.load_der_x509_certificate(der)
    shown = f"{where} presents a certificate ({subject(cert)})"
    authorities = load_certificates(Path(chain))
    if not signed_by(cert, authorities):
        raise ConfigError(f"{shown} issued by {cert.issuer.rfc4514_string()}, not by the federation's CA in {chain} "
                          f"({_chain_names(authorities)}): this site and the aggregator hold different CAs; get the "
                          "federation's cert_chain.crt from the operator")
    problem = out_of_date(cert, now)
    if problem is not None:
        raise ConfigError(f"{shown} that {problem}; " + (
            "the operator must have the federation's CA issue a new one" if problem.startswith("expired")
            else "check this machine's clock (and the aggregator's)"))
    names = certificate_names(cert)
    if not names_host(names, host):
        raise ConfigError(f"{shown} issued for {', '.join(names) or 'no name'}, not for {host}, the plan's agg_addr; "
                          f"the operator must make the aggregator's certificate for {host}, or the plan name the "
                          "aggregator as its certificate does")
    if accepted is False and certificate is not None:  # only a client certificate is ever refused
        own = load_certificates(Path(certificate))[0]
        raise ConfigError(f"{where} closed the connection after the TLS handshake: it does not accept this site's "
                          f"certificate {certificate} ({subject(own)}, issued by {own.issuer.rfc4514_string()}); ask "
                          "the operator whether it is signed by the federation's CA and the aggregator's CA file")
    return None


def federation_ca_name(federation: str, role: str = "CA"):
    """The X.509 name of a federation's CA, on every engine: ``CN=<federation> fedcontrast <role>``
    (``role``: "CA" for the root, e.g. "signing CA" for OpenFL's intermediate), ``O=<federation>``,
    so that a site's security officer reads whose CA it pins."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    federation = " ".join(str(federation).split())
    if not federation:
        raise ConfigError("the federation's name (its CA's name) must not be empty: give it with --federation NAME")
    if len(federation) > 40:
        raise ConfigError(f"the federation's name {federation!r} is longer than 40 characters; its CA's common name "
                          "must fit in 64: give a shorter one with --federation NAME")
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),  # read CN first: CN=…,O=…
                      x509.NameAttribute(NameOID.COMMON_NAME, f"{federation} fedcontrast {role}")])
