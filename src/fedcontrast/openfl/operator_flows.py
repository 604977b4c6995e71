"""What the operator runs: the federation's CA, the workspace package it exports, each site's
certificate request read and signed (its name bound to its CSR), and a site's certificate revoked."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..deploy.common import SECRET_SUFFIXES, DeploymentError, refuse_secrets
from ..errors import ConfigError
from .fx import aggregator_name, run_fx, unchecked_plan


# --- the operator -------------------------------------------------------------------------------
def init_ca(workspace: str | Path, *, fqdn: str | None = None, log: Callable[[str], None] = print,
            federation: str | None = None) -> Path:
    """Make the federation's certificate authority, named ``CN=<federation> fedcontrast CA`` (default: the
    workspace folder's name; :func:`.pki.certify_workspace`), and the aggregator's certificate in
    ``workspace`` (the CA's keys stay in ``cert/ca``, the aggregator's in ``cert/server``). Returns the CA chain."""
    ws = Path(workspace)
    name = (fqdn or aggregator_name(ws)).lower()
    if name != aggregator_name(ws):
        raise ConfigError(f"the aggregator certificate must be for the plan's agg_addr {aggregator_name(ws)!r}, "
                          f"not {name!r}")
    if (ws / "cert" / "ca").exists():
        raise DeploymentError(f"{ws / 'cert' / 'ca'} already holds a certificate authority; keep it (its "
                              "certificates stay valid) or move it away to make a new one")
    from .pki import certify_workspace

    certify_workspace(ws, federation)  # what `fx workspace certify` makes, named after the federation
    for args in (["aggregator", "generate-cert-request", "--fqdn", name],
                 ["aggregator", "certify", "--fqdn", name, "--silent"]):
        log("  $ fx " + " ".join(args))
        run_fx(ws, args)
    return ws / "cert" / "cert_chain.crt"


def reuse_pki(workspace: str | Path, previous: str | Path) -> None:
    """A new experiment of an existing federation: copy the CA and the certificates of the operator's
    earlier workspace ``previous`` (same machine) into ``workspace`` instead of making new ones. The
    aggregator's certificate must be for this plan's ``agg_addr``."""
    ws, old = Path(workspace), Path(previous)
    source = old / "cert"
    if not (source / "ca").is_dir():
        raise DeploymentError(f"{old} holds no certificate authority (cert/ca) to reuse")
    name = aggregator_name(ws)
    if not (source / "server" / f"agg_{name}.crt").exists():
        raise DeploymentError(f"{old}'s aggregator certificate is not for this plan's agg_addr {name!r}")
    if (ws / "cert" / "ca").exists():
        raise DeploymentError(f"{ws / 'cert'} already holds a certificate authority")
    shutil.copytree(source, ws / "cert", dirs_exist_ok=True)


def export_workspace(workspace: str | Path, *, log: Callable[[str], None] = print) -> Path:
    """``fx plan initialize`` (when ``save/init.pbuf`` is missing) and ``fx workspace export``:
    the package every institution gets. Refused if it would hold any private key."""
    ws = Path(workspace).resolve()
    unchecked_plan(ws)
    # `fx workspace export` ships save/ whole: results of a run there (every site's figures) would go
    # to every institution. Only the initial model and the pinned shared files belong in a package.
    results = sorted(p.name for p in (ws / "save").iterdir()
                     if p.name not in ("init.pbuf", "backbones")) if (ws / "save").is_dir() else []
    if results:
        raise DeploymentError(f"{ws / 'save'} holds results of a run ({', '.join(results[:3])}): the package would "
                              "send them to every institution; export from a fresh workspace")
    from ..deploy.templates import template_problems
    from ..deploy.trust import code_files

    code = code_files(ws / "src") + code_files(ws / "plan") + code_files(ws / "save")
    if code:  # every site refuses a package with code in it: say so here, before anything is packed
        raise DeploymentError(f"{code[0]} is Python code, which the package would carry to every site (sites run "
                              "only the fedcontrast they installed, and refuse such a package); remove it")
    problems = template_problems(unchecked_plan(ws), str(ws / "plan" / "plan.yaml"))
    if problems:
        raise DeploymentError(f"{problems[0]}; every site would refuse this package: write the plan with "
                              "`fedcontrast workspace create`")
    if not (ws / "save" / "init.pbuf").exists():
        log("  $ fx plan initialize")
        run_fx(ws, ["plan", "initialize"])
    archive = ws / f"{ws.name}.zip"
    if archive.exists():
        archive.unlink()
    log("  $ fx workspace export")
    run_fx(ws, ["workspace", "export"])
    if not archive.exists():
        raise DeploymentError(f"'fx workspace export' did not write {archive}")
    chain = ws / "cert" / "cert_chain.crt"
    if chain.is_file():  # the federation's CA (public): each site checks its fingerprint at join and pins it
        with zipfile.ZipFile(archive, "a") as z:
            z.write(chain, "cert/cert_chain.crt")
    refuse_secrets(archive, workspace_package=True)
    return archive


@dataclass(frozen=True)
class SignedRequest:
    site: str  # the name read from the CSR itself
    csr_hash: str
    signed: Path  # the archive to send back to the site
    serial: str = ""  # the signed certificate's serial number (hex)
    sha256: str = ""  # its SHA-256 fingerprint: the one certificate the aggregator admits for `site`


@dataclass(frozen=True)
class CertificateRequest:
    """A site's certificate request package, read and checked by :func:`read_request`."""
    site: str  # the name the CSR itself carries: its subject's one common name (CN)
    csr_hash: str  # SHA-384 of the CSR, as OpenFL prints it for the site to read out
    subject: str  # the CSR's whole subject, e.g. "CN=hosp1"
    csr_file: str  # the .csr's name inside the package (col_SITE.csr)
    pem: bytes  # the CSR


def read_request(request_zip: str | Path, *, claimed: str | None = None) -> CertificateRequest:
    """A request package ``col_NAME_to_agg_cert_request.zip`` (one ``col_NAME.csr``, no key). The site
    is the name the CSR itself carries (exactly one CN; a subject alternative name may only repeat it);
    the package's file name (when it has OpenFL's form), the CSR file's name and ``claimed`` (the site
    the operator means to sign for) must all be that name, else :class:`DeploymentError` naming each."""
    import re

    from cryptography import x509

    from ..archives import check_archive, read_entry
    from ..deploy.certificates import identity, subject

    request_zip = Path(request_zip)
    if request_zip.is_file():  # its sizes, from its directory, before any entry is read
        check_archive(request_zip, what=f"the request package {request_zip}")
    try:
        with zipfile.ZipFile(request_zip) as z:
            csrs = [n for n in z.namelist() if n.endswith(".csr")]
            if len(csrs) != 1 or any(n.endswith(SECRET_SUFFIXES) for n in z.namelist()):
                raise DeploymentError(f"{request_zip} is not a certificate request package (one .csr, no key)")
            pem = read_entry(z, csrs[0], max_bytes=1 << 20, what="the certificate request")
        csr = x509.load_pem_x509_csr(pem)
    except (zipfile.BadZipFile, ValueError) as exc:
        raise DeploymentError(f"{request_zip} is not a readable certificate request package ({exc})") from None
    what = f"the request {csrs[0]} in {request_zip.name}"
    if not csr.is_signature_valid:
        raise DeploymentError(f"{what} is not signed by its own key (damaged or altered): not signed; ask the site "
                              "for a new request")
    try:
        site = identity(csr, what)
    except ConfigError as exc:
        raise DeploymentError(f"not signed: {exc}") from None
    said = []  # (what, the name it gives)
    archive = re.fullmatch(r"col_(.+)_to_agg_cert_request\.zip", request_zip.name)
    if archive is not None:
        said.append((f"its file name is for {archive.group(1)!r}", archive.group(1)))
    csr_site = Path(csrs[0]).stem.removeprefix("col_")
    said.append((f"the CSR inside is {csrs[0]} (for {csr_site!r})", csr_site))
    said.append((f"the CSR's subject is {subject(csr)} ({site!r})", site))
    if claimed is not None:
        said.append((f"you are signing it for {claimed!r}", claimed))
    if len({name for _, name in said}) > 1:
        parts = [text for text, _ in said]
        raise DeploymentError(f"refused to sign {request_zip.name}: {', '.join(parts[:-1])} and {parts[-1]} — they "
                              "must all name the same site; ask that site for its own request (`fedcontrast site "
                              "join ... --name NAME` makes it)")
    return CertificateRequest(site, csr_sha384(csr), subject(csr), csrs[0], pem)


def request_site(request_zip: Path) -> tuple[str, str]:
    """The site name (read from the CSR itself, checked against the file names: :func:`read_request`)
    and the CSR hash of a request package ``col_NAME_to_agg_cert_request.zip``."""
    request = read_request(request_zip)
    return request.site, request.csr_hash


def sign_request(workspace: str | Path, request_zip: str | Path, *, confirm: Callable[[str, str], bool],
                 site: str | None = None, log: Callable[[str], None] = print) -> SignedRequest:
    """Sign a site's request with the federation's CA (``fx collaborator certify --request-pkg``)
    once ``confirm(site, csr_hash)`` says the hash is the one the site read out by another channel;
    ``site`` there is the name read from the CSR itself. The CSR's name, its file names and ``site``
    (the site the operator means to sign for) must agree (:func:`read_request`); the site must be one
    of the plan's sites and hold no certificate of this CA yet (a second one only after `fedcontrast
    ca revoke`: :func:`revoke_site`). Only the CSR is handed to fx, never other files of the package.
    The signed package is ``agg_to_col_NAME_signed_cert.zip``."""
    import tempfile

    from ..config import RunConfig, site_names
    from ..deploy.certificates import fingerprint, identity, load_certificates, serial_hex

    ws = Path(workspace).resolve()
    request = Path(request_zip).resolve()
    if not request.is_file():
        raise DeploymentError(f"request package {request} does not exist")
    config = RunConfig.from_dict(unchecked_plan(ws)["task_runner"]["settings"]["run_config"])
    read = read_request(request, claimed=site)
    site = read.site
    if site not in site_names(config):
        raise DeploymentError(f"{request.name} asks for a certificate for {site!r}, which is not a site of this plan "
                              f"({', '.join(site_names(config))})")
    if not (ws / "cert" / "ca" / "signing-ca.crt").exists():
        raise DeploymentError(f"{ws} has no certificate authority yet: run `fedcontrast ca init {ws}` first")
    from cryptography import x509

    from .enrolment import refuse_revoked_key

    try:  # a key whose certificate was revoked never comes back, under this name or another
        refuse_revoked_key(ws / "cert", x509.load_pem_x509_csr(read.pem).public_key(), request.name)
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None
    issued = ws / "cert" / "client" / f"col_{site}.crt"
    if issued.exists():
        try:
            held = load_certificates(issued)[0]
            held = f", serial {serial_hex(held)}, valid until {held.not_valid_after_utc:%Y-%m-%d}"
        except (ConfigError, IndexError):
            held = ""
        raise DeploymentError(f"{site} already has a certificate signed by this CA ({issued}{held}), so a second one "
                              f"is not signed; if that one is lost or compromised, revoke it first: `fedcontrast ca "
                              f"revoke {ws} {site} --reason TEXT`")
    stale = sorted((ws / "cert" / "client").glob("*.csr"))
    if stale:  # fx signs the first .csr it finds there: never let it be another site's
        raise DeploymentError(f"{stale[0]} is an unsigned request left in {stale[0].parent}; remove it first")
    if not confirm(site, read.csr_hash):
        raise DeploymentError(f"not signed: the request's hash did not match what {site} read out")
    with tempfile.TemporaryDirectory() as tmp:  # the CSR alone: nothing else of the package lands in cert/client
        only_csr = Path(tmp) / f"col_{site}_to_agg_cert_request.zip"
        with zipfile.ZipFile(only_csr, "w") as z:
            z.writestr(f"col_{site}.csr", read.pem)
        log(f"  $ fx collaborator certify --request-pkg {only_csr.name} --silent   (the CSR of {request.name}, "
            f"{read.subject})")
        run_fx(ws, ["collaborator", "certify", "--request-pkg", str(only_csr), "--silent"])
    signed = ws / f"agg_to_col_{site}_signed_cert.zip"
    if not signed.exists() or not issued.exists():
        raise DeploymentError(f"'fx collaborator certify' did not write {signed if not issued.exists() else issued}")
    refuse_secrets(signed)
    cert = load_certificates(issued)[0]
    from cryptography.hazmat.primitives import serialization

    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if (identity(cert, str(issued)) != site or cert.public_key().public_bytes(*der)
            != x509.load_pem_x509_csr(read.pem).public_key().public_bytes(*der)):
        raise DeploymentError(f"{issued} is not the certificate of {request.name}'s request for {site}; do not send "
                              f"{signed.name}, revoke it (`fedcontrast ca revoke {ws} {site}`) and sign again")
    return SignedRequest(site, read.csr_hash, signed, serial_hex(cert), fingerprint(cert))


def revoke_site(workspace: str | Path, name: str, *, reason: str) -> dict:
    """The operator revokes the certificate its CA signed for ``name`` (``fedcontrast ca revoke``):
    recorded in ``cert/revoked.jsonl`` with its serial, fingerprint, reason and time, the certificate
    kept in ``cert/revoked/`` (:func:`~.enrolment.revoke_certificate`). The aggregator refuses it from its next
    call on; ``name`` may then be signed a new certificate. Returns the record."""
    from .enrolment import revoke_certificate

    ws = Path(workspace).resolve()
    unchecked_plan(ws)
    if not (ws / "cert" / "ca").is_dir():
        raise DeploymentError(f"{ws} holds no certificate authority (cert/ca): revoke in the operator's workspace "
                              "whose CA signed the certificate")
    return revoke_certificate(ws / "cert", name, reason)


def csr_sha384(csr) -> str:
    """The SHA-384 hash of a CSR's PEM encoding: the hash ``fx collaborator generate-cert-request``
    shows the site, for the operator to compare by another channel."""
    import hashlib

    from cryptography.hazmat.primitives import serialization

    return hashlib.sha384(csr.public_bytes(serialization.Encoding.PEM)).hexdigest()
