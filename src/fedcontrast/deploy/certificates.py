"""Reading and checking the federation's certificates: dates, names, the chain, the aggregator's
server files, and what a site's TLS connection will meet, said in one sentence instead of retried."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from ..errors import ConfigError


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
        raise ConfigError(f"the certificate {certificate} ({subject(cert)}) is issued by "
                          f"{cert.issuer.rfc4514_string()}, not by the federation's CA in {chain} "
                          f"({_chain_names(authorities)}); have it signed by the "
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
            problems.append(f"{said} is issued by {cert.issuer.rfc4514_string()}, not by the federation's CA in "
                            f"{chain}")
        names = certificate_names(cert)
        if site.lower() not in names:
            problems.append(f"{said} is issued for {', '.join(names) or 'no name'}, not for {site}")
    return problems


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
    if accepted is False and certificate is not None:  # only a client certificate is ever refused
        own = _certificates(Path(certificate))[0]
        raise ConfigError(f"{where} closed the connection after the TLS handshake: it does not accept this site's "
                          f"certificate {certificate} ({subject(own)}, issued by {own.issuer.rfc4514_string()}); ask "
                          "the operator whether it is signed by the federation's CA and the aggregator's CA file")
    return None
