"""A cross-silo deployment, party by party, with OpenFL's own commands underneath.

Each function is what one party runs on its own machine, and says which file travels where:

* operator: :func:`init_ca` (the federation's CA and the aggregator's certificate: ``fx workspace
  certify``, ``fx aggregator generate-cert-request/certify``), :func:`export_workspace`
  (``fx plan initialize``, ``fx workspace export`` → the package every institution gets),
  :func:`sign_request` (``fx collaborator certify --request-pkg`` → the signed certificate, for the
  name the request's CSR carries, once per name), :func:`revoke_site` (a site's certificate revoked);
* institution: :func:`join` (``fx workspace import``, its own ``plan/data.yaml`` line, its data
  checked against the plan's schema, ``fx collaborator generate-cert-request`` → the request to
  send), :func:`import_certificate` (``fx collaborator certify --import`` of a certificate for its
  own name, then the certificate is checked against its key and the CA chain).

Private keys are made where they are used and never put in any package: every archive is checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, FedContrastError
from .pki import fx_executable

SECRET_SUFFIXES = (".key", ".pem")


class DeploymentError(FedContrastError):
    """A step of the deployment flow cannot be done; the message says why and what to do."""


def run_fx(workspace: Path, args: list[str], *, timeout: float = 600) -> str:
    """``fx ARGS`` in ``workspace``; its output, or :class:`DeploymentError` with the last lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.run([fx_executable(), *args], cwd=workspace, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        raise DeploymentError(f"'fx {' '.join(args)}' failed in {workspace} (exit {proc.returncode}): {tail}")
    return proc.stdout + proc.stderr


def _plan(workspace: Path) -> dict:
    path = workspace / "plan" / "plan.yaml"
    if not path.is_file():
        raise ConfigError(f"{workspace} is not a workspace: {path} does not exist")
    from ..yamlio import load_yaml_file

    return load_yaml_file(path, "plan")


def aggregator_name(workspace: Path) -> str:
    """The aggregator's host name in the plan (its certificate is issued for that name)."""
    return str(_plan(workspace)["network"]["settings"]["agg_addr"]).lower()


def secrets_in(archive: Path, *, workspace_package: bool = False) -> list[str]:
    """Names of the files inside a zip archive that hold private-key material: by their name (a
    ``.key``/``.pem`` file, anything of a CA folder) or by their content whatever they are called (PEM
    private keys, DER PKCS#1/PKCS#8 keys, PKCS#12 bundles; :func:`.package_trust.key_material`); in a
    workspace package also any file under ``cert/`` other than the CA chain."""
    from .package_trust import archive_findings

    with zipfile.ZipFile(archive) as z:
        named = {n for n in z.namelist() if n.endswith(SECRET_SUFFIXES) or "/ca/" in f"/{n}"}
    _, keys = archive_findings(archive, workspace_package=workspace_package)
    return sorted(named | {k.path for k in keys})


def _refuse_secrets(archive: Path, *, workspace_package: bool = False) -> None:
    found = secrets_in(archive, workspace_package=workspace_package)
    if found:
        archive.unlink()
        raise DeploymentError(f"{archive.name} would carry private key material ({', '.join(found[:3])}); it was "
                              "deleted — nothing was sent")


# --- the operator -------------------------------------------------------------------------------
def init_ca(workspace: str | Path, *, fqdn: str | None = None, log: Callable[[str], None] = print) -> Path:
    """Make the federation's certificate authority and the aggregator's certificate in ``workspace``
    (the CA's keys stay in ``cert/ca``, the aggregator's in ``cert/server``). Returns the CA chain."""
    ws = Path(workspace)
    name = (fqdn or aggregator_name(ws)).lower()
    if name != aggregator_name(ws):
        raise ConfigError(f"the aggregator certificate must be for the plan's agg_addr {aggregator_name(ws)!r}, "
                          f"not {name!r}")
    if (ws / "cert" / "ca").exists():
        raise DeploymentError(f"{ws / 'cert' / 'ca'} already holds a certificate authority; keep it (its "
                              "certificates stay valid) or move it away to make a new one")
    for args in (["workspace", "certify"], ["aggregator", "generate-cert-request", "--fqdn", name],
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
    _plan(ws)
    # `fx workspace export` ships save/ whole: results of a run there (every site's figures) would go
    # to every institution. Only the initial model and the pinned shared files belong in a package.
    results = sorted(p.name for p in (ws / "save").iterdir()
                     if p.name not in ("init.pbuf", "backbones")) if (ws / "save").is_dir() else []
    if results:
        raise DeploymentError(f"{ws / 'save'} holds results of a run ({', '.join(results[:3])}): the package would "
                              "send them to every institution; export from a fresh workspace")
    from .package_trust import code_files, template_problems

    code = code_files(ws / "src") + code_files(ws / "plan") + code_files(ws / "save")
    if code:  # every site refuses a package with code in it: say so here, before anything is packed
        raise DeploymentError(f"{code[0]} is Python code, which the package would carry to every site (sites run "
                              "only the fedcontrast they installed, and refuse such a package); remove it")
    problems = template_problems(_plan(ws), str(ws / "plan" / "plan.yaml"))
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
    _refuse_secrets(archive, workspace_package=True)
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
    from openfl.cryptography.io import get_csr_hash

    from .pki import identity, subject

    request_zip = Path(request_zip)
    try:
        with zipfile.ZipFile(request_zip) as z:
            csrs = [n for n in z.namelist() if n.endswith(".csr")]
            if len(csrs) != 1 or any(n.endswith(SECRET_SUFFIXES) for n in z.namelist()):
                raise DeploymentError(f"{request_zip} is not a certificate request package (one .csr, no key)")
            pem = z.read(csrs[0])
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
    return CertificateRequest(site, get_csr_hash(csr), subject(csr), csrs[0], pem)


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
    from .pki import _certificates, fingerprint, identity, serial_hex

    ws = Path(workspace).resolve()
    request = Path(request_zip).resolve()
    if not request.is_file():
        raise DeploymentError(f"request package {request} does not exist")
    config = RunConfig.from_dict(_plan(ws)["task_runner"]["settings"]["run_config"])
    read = read_request(request, claimed=site)
    site = read.site
    if site not in site_names(config):
        raise DeploymentError(f"{request.name} asks for a certificate for {site!r}, which is not a site of this plan "
                              f"({', '.join(site_names(config))})")
    if not (ws / "cert" / "ca" / "signing-ca.crt").exists():
        raise DeploymentError(f"{ws} has no certificate authority yet: run `fedcontrast ca init {ws}` first")
    issued = ws / "cert" / "client" / f"col_{site}.crt"
    if issued.exists():
        try:
            held = _certificates(issued)[0]
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
    _refuse_secrets(signed)
    cert = _certificates(issued)[0]
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if (identity(cert, str(issued)) != site or cert.public_key().public_bytes(*der)
            != x509.load_pem_x509_csr(read.pem).public_key().public_bytes(*der)):
        raise DeploymentError(f"{issued} is not the certificate of {request.name}'s request for {site}; do not send "
                              f"{signed.name}, revoke it (`fedcontrast ca revoke {ws} {site}`) and sign again")
    return SignedRequest(site, read.csr_hash, signed, serial_hex(cert), fingerprint(cert))


# --- an institution -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Joined:
    workspace: Path
    request: Path | None  # the package to send to the operator (None: an earlier certificate reused)
    csr_hash: str
    summary: object  # fedcontrast.data.schema.FolderSummary of the site's folder


def join(package: str | Path, *, name: str, data: str | Path, public: str | Path | None = None,
         into: str | Path = ".", cert_from: str | Path | None = None, policy: str | Path | None = None,
         log: Callable[[str], None] = print) -> Joined:
    """An institution joins with the operator's package: ``fx workspace import``, its own data line
    (the folder checked against the plan's schema first), the public folder linked (fingerprint
    checked), and ``fx collaborator generate-cert-request`` (the key stays in ``cert/client``).

    ``cert_from``: this site's workspace of an earlier experiment of the same federation, whose key
    and certificate are reused (copied on this machine; nothing to send, ``request`` is None).

    ``policy``: this site's policy file, checked now and installed as the workspace's
    ``site_policy.yaml`` (else ``$FEDCONTRAST_SITE_POLICY``, if set, is checked). The package is
    refused before anything is unpacked if it carries code or key material, names a component this
    site has not installed, pins code this site does not run, or turns TLS off (unless the policy
    allows it: :func:`.package_trust.check_package`)."""
    from ..config import site_names
    from ..construction import build_algorithm
    from ..data.schema import folder_fingerprint, public_folder_path, summarise_folder
    from ..privacy.policy import POLICY_ENV, SitePolicy
    from .package_trust import check_package

    archive = Path(package).resolve()
    config = package_config(archive)
    policy_path = Path(policy).expanduser().resolve() if policy is not None else (
        Path(os.environ[POLICY_ENV]) if os.environ.get(POLICY_ENV) else None)
    site_policy = SitePolicy.from_yaml(policy_path) if policy_path is not None else None
    check_package(archive, package_plan(archive), site_policy)
    problems = requirement_problems(package_requirements(archive))
    if problems:
        raise DeploymentError(f"{archive.name} is refused, nothing was unpacked: {'; '.join(problems)}")
    if name not in site_names(config):
        raise DeploymentError(f"{name!r} is not a site of this plan ({', '.join(site_names(config))}); "
                              "use the name the operator gave you")
    if config.data_schema is None:
        raise DeploymentError("this plan has no data schema (it is the embedded demo); ask the operator for a "
                              "plan made with --input-shape and --classes")
    folder = Path(data).expanduser().resolve()
    summary = summarise_folder(folder, config.data_schema)  # before anything is unpacked
    source = None
    if config.public_data is not None:
        if public is None:
            raise DeploymentError("this plan names a public data set: pass --public FOLDER (the operator's files, "
                                  f"fingerprint {config.public_data.sha256[:16]}…)")
        source = Path(public).expanduser().resolve()
        found = folder_fingerprint(source)
        if found != config.public_data.sha256:
            raise DeploymentError(f"the public folder {source} has fingerprint {found[:16]}… but the plan expects "
                                  f"{config.public_data.sha256[:16]}…: get exactly the operator's files")
    parent = Path(into).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    ws = parent / archive.name.split(".")[0]  # where `fx workspace import` unpacks it
    if ws.exists():
        raise DeploymentError(f"{ws} already exists; join into another folder (--into) or remove it")
    log(f"  $ fx workspace import --archive {archive}")
    run_fx(parent, ["workspace", "import", "--archive", str(archive)])
    try:
        if source is not None:
            target = public_folder_path(config.public_data, ws)
            if target != source:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(source, target_is_directory=True)
        build_algorithm(config).check_shared_files(ws)  # e.g. FedPCL's backbone files against the plan's hashes
        (ws / "plan" / "data.yaml").write_text(_data_yaml(ws, name, folder))
        if policy is not None:  # the site's own conditions travel with its workspace (checked at every start)
            shutil.copyfile(policy_path, ws / "site_policy.yaml")
        if cert_from is not None:
            old = Path(cert_from).resolve() / "cert"
            (ws / "cert" / "client").mkdir(parents=True, exist_ok=True)
            for rel in (f"client/col_{name}.key", f"client/col_{name}.crt", "cert_chain.crt"):
                if not (old / rel).is_file():
                    raise DeploymentError(f"{old / rel} is missing: {cert_from} is not {name}'s certified workspace")
                shutil.copy2(old / rel, ws / "cert" / rel)
            verify_site_certificate(ws, name)
            return Joined(ws, None, "", summary)
        log(f"  $ fx collaborator generate-cert-request -n {name} --silent")
        run_fx(ws, ["collaborator", "generate-cert-request", "-n", name, "--silent"])
    except BaseException:
        shutil.rmtree(ws, ignore_errors=True)  # nothing half-joined is left behind
        raise
    request = ws / f"col_{name}_to_agg_cert_request.zip"
    if not request.exists():
        raise DeploymentError(f"'fx collaborator generate-cert-request' did not write {request}")
    _refuse_secrets(request)
    _, csr_hash = request_site(request)
    return Joined(ws, request, csr_hash, summary)


def package_plan(archive: Path) -> dict:
    """A workspace package's plan, read without unpacking it."""
    from ..yamlio import loads_yaml

    if not archive.is_file():
        raise DeploymentError(f"workspace package {archive} does not exist")
    try:
        with zipfile.ZipFile(archive) as z:
            plan = loads_yaml(z.read("plan/plan.yaml").decode(), f"the plan in {archive}")
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError):
        plan = None
    if not isinstance(plan, dict):
        raise DeploymentError(f"{archive} is not a fedcontrast workspace package (no readable plan/plan.yaml; "
                              "the operator makes it with `fedcontrast workspace export`)")
    return plan


def package_config(archive: Path):
    """The run configuration of a workspace package's plan, read without unpacking it."""
    from ..config import RunConfig

    plan = package_plan(archive)
    try:
        return RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    except (KeyError, TypeError):
        raise DeploymentError(f"{archive} is not a fedcontrast workspace package (its plan has no run "
                              "configuration; the operator makes it with `fedcontrast workspace export`)") from None


def package_requirements(archive: Path) -> list[str]:
    """The requirement lines of a package's ``requirements.txt`` (comments and blank lines dropped)."""
    with zipfile.ZipFile(archive) as z:
        if "requirements.txt" not in z.namelist():
            return []
        text = z.read("requirements.txt").decode(errors="replace")
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def requirement_problems(lines: list[str]) -> list[str]:
    """Each requirement of the package that is not a distribution installed here at exactly the pinned
    version: a site installs the code it runs itself, after review, and never from the operator's list."""
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    for line in lines:
        name, sep, pinned = line.partition("==")
        name, pinned = name.strip(), pinned.strip()
        if not sep or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or not pinned \
                or any(c in pinned for c in ",;<>=!~ @"):
            problems.append(f"requirements.txt asks for {line!r}, not one distribution at one version (NAME==VERSION)")
            continue
        try:
            installed = version(name)
        except PackageNotFoundError:
            problems.append(f"requirements.txt asks for {name}=={pinned}, which this site has not installed (review "
                            "and install it yourself first, or ask the operator why it is needed)")
            continue
        if installed != pinned:
            problems.append(f"requirements.txt pins {name}=={pinned} but this site runs {name} {installed}")
    return problems


def _data_yaml(ws: Path, name: str, folder: Path) -> str:
    """The site's ``plan/data.yaml``: the operator's comment lines and this site's one data line."""
    comments = [l for l in (ws / "plan" / "data.yaml").read_text().splitlines() if l.lstrip().startswith("#")]
    return "\n".join([*comments, f"{name},{folder}"]) + "\n"


def import_certificate(workspace: str | Path, signed_zip: str | Path, *, log: Callable[[str], None] = print) -> str:
    """``fx collaborator certify --import`` the operator's signed package, then check that the
    certificate belongs to this site's key and is signed by the federation's CA. The certificate must
    be issued for the name of this site's key (``cert/client/col_NAME.key``), and for nothing else:
    checked before anything is installed. Returns the name."""
    from cryptography import x509

    from .pki import identity, subject

    ws = Path(workspace).resolve()
    archive = Path(signed_zip).resolve()
    if not archive.is_file():
        raise DeploymentError(f"signed certificate package {archive} does not exist")
    if secrets_in(archive):
        raise DeploymentError(f"{archive} holds private key material; do not use it and tell the operator")
    with zipfile.ZipFile(archive) as z:
        crts = [n for n in z.namelist() if n.startswith("client/") and n.endswith(".crt")]
        pem = z.read(crts[0]) if len(crts) == 1 else b""
    if len(crts) != 1:
        raise DeploymentError(f"{archive} is not a signed certificate package (client/col_NAME.crt)")
    name = Path(crts[0]).stem.removeprefix("col_")
    key = ws / "cert" / "client" / f"col_{name}.key"
    if not key.exists():
        raise DeploymentError(f"{archive.name} is for {name!r}, but this workspace has no key {key}: import it in the "
                              f"workspace that made {name}'s request")
    try:
        cert = x509.load_pem_x509_certificate(pem)
        issued_for = identity(cert, f"the certificate {crts[0]} in {archive.name}")
    except ValueError:
        raise DeploymentError(f"{crts[0]} in {archive} is not a PEM certificate: not installed; ask the operator to "
                              "send the signed package again") from None
    except ConfigError as exc:
        raise DeploymentError(f"{exc}: not installed") from None
    if issued_for != name:
        raise DeploymentError(f"{archive.name} holds a certificate issued for {issued_for} ({subject(cert)}), but this "
                              f"site is {name} (its key {key}): not installed; a site may only use a certificate for "
                              f"its own name — ask the operator for the certificate signed from {name}'s own request")
    # what the import overwrites, restored if the certificate is refused: a refused one is never left installed
    installed = [ws / "cert" / "client" / f"col_{name}.crt", ws / "cert" / "cert_chain.crt"]
    before = {path: path.read_bytes() if path.is_file() else None for path in installed}
    log(f"  $ fx collaborator certify --import {archive}")
    try:
        run_fx(ws, ["collaborator", "certify", "--import", str(archive)])
        verify_site_certificate(ws, name)
    except BaseException:
        for path, data in before.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)
        raise
    return name


def verify_site_certificate(workspace: Path, name: str) -> None:
    """The site's certificate is within its dates, matches its private key, is signed by the CA in
    ``cert_chain.crt`` (:func:`~.pki.check_own_certificate`) and is issued for ``name`` alone
    (:func:`~.pki.check_certificate_name`)."""
    from .pki import check_certificate_name, check_own_certificate

    cert_dir = workspace / "cert"
    crt, key = cert_dir / "client" / f"col_{name}.crt", cert_dir / "client" / f"col_{name}.key"
    chain = cert_dir / "cert_chain.crt"
    for path in (crt, key, chain):
        if not path.exists():
            raise DeploymentError(f"{path} is missing after the import")
    try:
        check_own_certificate(crt, key, chain)
        check_certificate_name(crt, name)
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None


def revoke_site(workspace: str | Path, name: str, *, reason: str) -> dict:
    """The operator revokes the certificate its CA signed for ``name`` (``fedcontrast ca revoke``):
    recorded in ``cert/revoked.jsonl`` with its serial, fingerprint, reason and time, the certificate
    kept in ``cert/revoked/`` (:func:`~.pki.revoke_certificate`). The aggregator refuses it from its next
    call on; ``name`` may then be signed a new certificate. Returns the record."""
    from .pki import revoke_certificate

    ws = Path(workspace).resolve()
    _plan(ws)
    if not (ws / "cert" / "ca").is_dir():
        raise DeploymentError(f"{ws} holds no certificate authority (cert/ca): revoke in the operator's workspace "
                              "whose CA signed the certificate")
    return revoke_certificate(ws / "cert", name, reason)
