"""A cross-silo deployment, party by party, with OpenFL's own commands underneath.

Each function is what one party runs on its own machine, and says which file travels where:

* operator: :func:`init_ca` (the federation's CA and the aggregator's certificate: ``fx workspace
  certify``, ``fx aggregator generate-cert-request/certify``), :func:`export_workspace`
  (``fx plan initialize``, ``fx workspace export`` → the package every institution gets),
  :func:`sign_request` (``fx collaborator certify --request-pkg`` → the signed certificate);
* institution: :func:`join` (``fx workspace import``, its own ``plan/data.yaml`` line, its data
  checked against the plan's schema, ``fx collaborator generate-cert-request`` → the request to
  send), :func:`import_certificate` (``fx collaborator certify --import``, then the certificate is
  checked against its key and the CA chain).

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


def secrets_in(archive: Path) -> list[str]:
    """Names of private-key files inside a zip archive."""
    with zipfile.ZipFile(archive) as z:
        return [n for n in z.namelist() if n.endswith(SECRET_SUFFIXES) or "/ca/" in f"/{n}"]


def _refuse_secrets(archive: Path) -> None:
    found = secrets_in(archive)
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
    _refuse_secrets(archive)
    return archive


@dataclass(frozen=True)
class SignedRequest:
    site: str
    csr_hash: str
    signed: Path  # the archive to send back to the site


def request_site(request_zip: Path) -> tuple[str, str]:
    """The site name and CSR hash inside a request package ``col_NAME_to_agg_cert_request.zip``."""
    from cryptography import x509
    from openfl.cryptography.io import get_csr_hash

    try:
        with zipfile.ZipFile(request_zip) as z:
            csrs = [n for n in z.namelist() if n.endswith(".csr")]
            if len(csrs) != 1 or any(n.endswith(SECRET_SUFFIXES) for n in z.namelist()):
                raise DeploymentError(f"{request_zip} is not a certificate request package (one .csr, no key)")
            csr = x509.load_pem_x509_csr(z.read(csrs[0]))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise DeploymentError(f"{request_zip} is not a readable certificate request package ({exc})") from None
    site = Path(csrs[0]).stem.removeprefix("col_")
    return site, get_csr_hash(csr)


def sign_request(workspace: str | Path, request_zip: str | Path, *, confirm: Callable[[str, str], bool],
                 log: Callable[[str], None] = print) -> SignedRequest:
    """Sign a site's request with the federation's CA (``fx collaborator certify --request-pkg``)
    once ``confirm(site, csr_hash)`` says the hash is the one the site read out by another channel.
    The site must be one of the plan's sites; the signed package is ``agg_to_col_NAME_signed_cert.zip``."""
    from ..config import RunConfig, site_names

    ws = Path(workspace).resolve()
    request = Path(request_zip).resolve()
    if not request.is_file():
        raise DeploymentError(f"request package {request} does not exist")
    config = RunConfig.from_dict(_plan(ws)["task_runner"]["settings"]["run_config"])
    site, csr_hash = request_site(request)
    if site not in site_names(config):
        raise DeploymentError(f"{request.name} asks for a certificate for {site!r}, which is not a site of this plan "
                              f"({', '.join(site_names(config))})")
    if not (ws / "cert" / "ca" / "signing-ca.crt").exists():
        raise DeploymentError(f"{ws} has no certificate authority yet: run `fedcontrast ca init {ws}` first")
    stale = sorted((ws / "cert" / "client").glob("*.csr"))
    if stale:  # fx signs the first .csr it finds there: never let it be another site's
        raise DeploymentError(f"{stale[0]} is an unsigned request left in {stale[0].parent}; remove it first")
    if not confirm(site, csr_hash):
        raise DeploymentError(f"not signed: the request's hash did not match what {site} read out")
    log(f"  $ fx collaborator certify --request-pkg {request} --silent")
    run_fx(ws, ["collaborator", "certify", "--request-pkg", str(request), "--silent"])
    signed = ws / f"agg_to_col_{site}_signed_cert.zip"
    if not signed.exists():
        raise DeploymentError(f"'fx collaborator certify' did not write {signed}")
    _refuse_secrets(signed)
    return SignedRequest(site, csr_hash, signed)


# --- an institution -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Joined:
    workspace: Path
    request: Path | None  # the package to send to the operator (None: an earlier certificate reused)
    csr_hash: str
    summary: object  # fedcontrast.data.schema.FolderSummary of the site's folder


def join(package: str | Path, *, name: str, data: str | Path, public: str | Path | None = None,
         into: str | Path = ".", cert_from: str | Path | None = None, log: Callable[[str], None] = print) -> Joined:
    """An institution joins with the operator's package: ``fx workspace import``, its own data line
    (the folder checked against the plan's schema first), the public folder linked (fingerprint
    checked), and ``fx collaborator generate-cert-request`` (the key stays in ``cert/client``).

    ``cert_from``: this site's workspace of an earlier experiment of the same federation, whose key
    and certificate are reused (copied on this machine; nothing to send, ``request`` is None)."""
    from ..config import site_names
    from ..construction import build_algorithm
    from ..data.schema import folder_fingerprint, public_folder_path, summarise_folder

    archive = Path(package).resolve()
    config = package_config(archive)
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


def package_config(archive: Path):
    """The run configuration of a workspace package's plan, read without unpacking it."""
    from ..config import RunConfig

    if not archive.is_file():
        raise DeploymentError(f"workspace package {archive} does not exist")
    from ..yamlio import loads_yaml

    try:
        with zipfile.ZipFile(archive) as z:
            plan = loads_yaml(z.read("plan/plan.yaml").decode(), f"the plan in {archive}")
        return RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    except (zipfile.BadZipFile, KeyError, TypeError, UnicodeDecodeError):
        raise DeploymentError(f"{archive} is not a fedcontrast workspace package (no readable plan/plan.yaml; "
                              "the operator makes it with `fedcontrast workspace export`)") from None


def _data_yaml(ws: Path, name: str, folder: Path) -> str:
    """The site's ``plan/data.yaml``: the operator's comment lines and this site's one data line."""
    comments = [l for l in (ws / "plan" / "data.yaml").read_text().splitlines() if l.lstrip().startswith("#")]
    return "\n".join([*comments, f"{name},{folder}"]) + "\n"


def import_certificate(workspace: str | Path, signed_zip: str | Path, *, log: Callable[[str], None] = print) -> str:
    """``fx collaborator certify --import`` the operator's signed package, then check that the
    certificate belongs to this site's key and is signed by the federation's CA. Returns the name."""
    ws = Path(workspace).resolve()
    archive = Path(signed_zip).resolve()
    if not archive.is_file():
        raise DeploymentError(f"signed certificate package {archive} does not exist")
    if secrets_in(archive):
        raise DeploymentError(f"{archive} holds private key material; do not use it and tell the operator")
    with zipfile.ZipFile(archive) as z:
        crts = [n for n in z.namelist() if n.startswith("client/") and n.endswith(".crt")]
    if len(crts) != 1:
        raise DeploymentError(f"{archive} is not a signed certificate package (client/col_NAME.crt)")
    name = Path(crts[0]).stem.removeprefix("col_")
    key = ws / "cert" / "client" / f"col_{name}.key"
    if not key.exists():
        raise DeploymentError(f"{archive.name} is for {name!r}, but this workspace has no key {key}: import it in the "
                              f"workspace that made {name}'s request")
    log(f"  $ fx collaborator certify --import {archive}")
    run_fx(ws, ["collaborator", "certify", "--import", str(archive)])
    verify_site_certificate(ws, name)
    return name


def verify_site_certificate(workspace: Path, name: str) -> None:
    """The site's certificate is within its dates, matches its private key and is signed by the CA in
    ``cert_chain.crt`` (:func:`~.pki.check_own_certificate`)."""
    from .pki import check_own_certificate

    cert_dir = workspace / "cert"
    crt, key = cert_dir / "client" / f"col_{name}.crt", cert_dir / "client" / f"col_{name}.key"
    chain = cert_dir / "cert_chain.crt"
    for path in (crt, key, chain):
        if not path.exists():
            raise DeploymentError(f"{path} is missing after the import")
    try:
        check_own_certificate(crt, key, chain)
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None
