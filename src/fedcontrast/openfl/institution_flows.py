"""What an institution runs: join the operator's package (checked before anything is unpacked; its
own data, folder and key), and import the certificate the operator signed for it."""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..deploy.common import DeploymentError, refuse_secrets, secrets_in
from ..deploy.trust import requirement_problems
from ..errors import ConfigError
from ..yamlio import read_bytes
from .fx import run_fx
from .operator_flows import request_site

if TYPE_CHECKING:
    from ..data.schema import FolderSummary


# --- an institution -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Joined:
    workspace: Path
    request: Path | None  # the package to send to the operator (None: an earlier certificate reused)
    csr_hash: str
    summary: FolderSummary  # of the site's folder


def join(package: str | Path, *, name: str, data: str | Path, public: str | Path | None = None,
         into: str | Path = ".", cert_from: str | Path | None = None, policy: str | Path | None = None,
         ca_fingerprint: str | None = None, confirm_ca: Callable[[str, str], bool] | None = None,
         log: Callable[[str], None] = print) -> Joined:
    """An institution joins with the operator's package: ``fx workspace import``, its own data line
    (the folder checked against the plan's schema first), the public folder linked (fingerprint
    checked), and ``fx collaborator generate-cert-request`` (the key stays in ``cert/client``).

    ``cert_from``: this site's workspace of an earlier experiment of the same federation, whose key
    and certificate are reused (copied on this machine; nothing to send, ``request`` is None).

    ``policy``: this site's policy file, checked now and installed as the workspace's
    ``site_policy.yaml`` (else ``$FEDCONTRAST_SITE_POLICY``, if set, is checked). The package is
    refused before anything is unpacked if it carries code or key material, names a component this
    site has not installed, pins code this site does not run, turns TLS off (unless the policy
    allows it: :func:`fedcontrast.deploy.trust.check_package`), or imports a plugin module the policy
    does not list under ``plugins:``.

    The federation's CA (the package's ``cert/cert_chain.crt``) is pinned
    (:mod:`fedcontrast.deploy.anchor`) once the site confirmed its fingerprint: ``ca_fingerprint``,
    the one the operator read out, must be it; else ``confirm_ca(subject, fingerprint)`` is asked (the
    command line asks the person joining). A package without the chain pins ``ca_fingerprint`` when
    given, else the first ``import-cert`` pins it."""
    from ..algorithms.capabilities import check_shared_files
    from ..archives import ArchiveLimits, check_archive
    from ..config import site_names
    from ..construction import build_algorithm
    from ..data.schema import folder_fingerprint, public_folder_path, summarise_folder
    from ..deploy.trust import check_package
    from ..privacy.policy import POLICY_ENV, SitePolicy, plugin_violation

    archive = Path(package).resolve()
    policy_path = Path(policy).expanduser().resolve() if policy is not None else (
        Path(os.environ[POLICY_ENV]) if os.environ.get(POLICY_ENV) else None)
    site_policy = SitePolicy.from_yaml(policy_path) if policy_path is not None else None
    if not archive.is_file():
        raise DeploymentError(f"workspace package {archive} does not exist")
    # Its sizes first, from its central directory: nothing of it is read, let alone unpacked, beyond them.
    check_archive(archive, ArchiveLimits.from_mapping(getattr(site_policy, "package_limits", None)),
                  what=f"the package {archive.name}")
    config = package_config(archive)
    check_package(archive, package_plan(archive), site_policy)
    unlisted = plugin_violation(config.plugins, site_policy)  # before build_algorithm below imports them
    if unlisted is not None:
        raise DeploymentError(f"{archive.name} is refused, nothing was unpacked: {unlisted}")
    if ca_fingerprint is None and cert_from is not None:  # the next experiment: the CA that site pinned before
        from ..deploy.anchor import read_pin

        ca_fingerprint = (read_pin(Path(cert_from).resolve() / "cert") or {}).get("sha256")
    pin = package_ca(archive, ca_fingerprint, confirm_ca)
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
        check_shared_files(build_algorithm(config), ws)  # e.g. FedPCL's backbone files against the plan's hashes
        (ws / "plan" / "data.yaml").write_text(_data_yaml(ws, name, folder))
        if pin is not None:  # the CA this site confirmed: no other CA chain is installed or used from now on
            from ..deploy.anchor import pin_ca

            pin_ca(ws / "cert", *pin)
        if policy is not None and policy_path is not None:  # the site's own conditions travel with its workspace
            shutil.copyfile(policy_path, ws / "site_policy.yaml")  # (checked at every start)
        if cert_from is not None:
            old = Path(cert_from).resolve() / "cert"
            (ws / "cert" / "client").mkdir(parents=True, exist_ok=True)
            for rel in (f"client/col_{name}.key", f"client/col_{name}.crt", "cert_chain.crt"):
                if not (old / rel).is_file():
                    raise DeploymentError(f"{old / rel} is missing: {cert_from} is not {name}'s certified workspace")
                shutil.copy2(old / rel, ws / "cert" / rel)
            if pin is None:  # the earlier workspace's chain, confirmed when that one joined
                from ..deploy.anchor import fingerprint_of_chain, pin_ca, read_pin

                earlier = read_pin(old)
                found, subject = fingerprint_of_chain(read_bytes(ws / "cert" / "cert_chain.crt", "the CA chain"),
                                                      f"the CA chain of {cert_from}")
                pin_ca(ws / "cert", (earlier or {}).get("sha256", found), subject,
                       f"from {cert_from}'s pin" if earlier else f"from {cert_from}'s CA chain")
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
    refuse_secrets(request)
    _, csr_hash = request_site(request)
    return Joined(ws, request, csr_hash, summary)


def package_ca(archive: Path, given: str | None, confirm: Callable[[str, str], bool] | None
               ) -> tuple[str, str, str] | None:
    """The CA to pin at join: (fingerprint, subject, how it was confirmed), or None when the package
    brings no CA chain and none was given. Refused, nothing unpacked, when the package's CA is not the
    one whose fingerprint was given, or the person joining does not confirm it."""
    from ..archives import read_entry
    from ..deploy.anchor import fingerprint_of_chain, normalise_fingerprint, shown

    expected = normalise_fingerprint(given) if given is not None else None
    with zipfile.ZipFile(archive) as z:
        pem = read_entry(z, "cert/cert_chain.crt", max_bytes=1 << 20, what="the CA chain") \
            if "cert/cert_chain.crt" in z.namelist() else None
    if pem is None:
        return None if expected is None else (expected, "", "the fingerprint given at join")
    found, subject = fingerprint_of_chain(pem, f"the CA chain in {archive.name}")
    if expected is not None and found != expected:
        raise DeploymentError(f"{archive.name} is refused, nothing was unpacked: its CA ({subject}, {shown(found)}) is "
                              f"not the federation's CA whose fingerprint you were given ({shown(expected)}); "
                              "check the fingerprint with the operator by phone or another channel")
    if expected is None and confirm is not None and not confirm(subject, found):
        raise DeploymentError(f"{archive.name} is refused, nothing was unpacked: its CA ({subject}, {shown(found)}) "
                              "was not confirmed; ask the operator to read you its CA's fingerprint")
    how = "--ca-fingerprint at join" if expected is not None else "confirmed at join" if confirm else "taken at join"
    return found, subject, how


def package_plan(archive: Path) -> dict:
    """A workspace package's plan, read without unpacking it."""
    from ..yamlio import loads_yaml

    if not archive.is_file():
        raise DeploymentError(f"workspace package {archive} does not exist")
    from ..archives import read_entry

    try:
        with zipfile.ZipFile(archive) as z:
            plan = loads_yaml(read_entry(z, "plan/plan.yaml", what="the plan").decode(), f"the plan in {archive}")
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
    from ..archives import read_entry

    with zipfile.ZipFile(archive) as z:
        if "requirements.txt" not in z.namelist():
            return []
        text = read_entry(z, "requirements.txt", what="requirements.txt").decode(errors="replace")
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def _data_yaml(ws: Path, name: str, folder: Path) -> str:
    """The site's ``plan/data.yaml``: the operator's comment lines and this site's one data line."""
    from ..yamlio import read_text

    comments = [line for line in read_text(ws / "plan" / "data.yaml", "the package's data file").splitlines()
                if line.lstrip().startswith("#")]
    return "\n".join([*comments, f"{name},{folder}"]) + "\n"


def import_certificate(workspace: str | Path, signed_zip: str | Path, *, ca_fingerprint: str | None = None,
                       confirm_ca: Callable[[str, str], bool] | None = None,
                       log: Callable[[str], None] = print) -> str:
    """``fx collaborator certify --import`` the operator's signed package, then check that the
    certificate belongs to this site's key and is signed by the federation's CA. The certificate must
    be issued for the name of this site's key (``cert/client/col_NAME.key``), and for nothing else,
    and its CA chain must be the CA this site pinned at join (:mod:`fedcontrast.deploy.anchor`; without a pin:
    ``ca_fingerprint``, else ``confirm_ca(subject, fingerprint)``, and it is pinned now): checked before
    anything is installed. Returns the name."""
    from cryptography import x509

    from ..deploy.certificates import identity, subject

    ws = Path(workspace).resolve()
    archive = Path(signed_zip).resolve()
    if not archive.is_file():
        raise DeploymentError(f"signed certificate package {archive} does not exist")
    from ..archives import check_archive, read_entry

    check_archive(archive, what=f"the signed certificate package {archive.name}")  # its sizes, before any entry
    if secrets_in(archive):
        raise DeploymentError(f"{archive} holds private key material; do not use it and tell the operator")
    with zipfile.ZipFile(archive) as z:
        crts = [n for n in z.namelist() if n.startswith("client/") and n.endswith(".crt")]
        pem = read_entry(z, crts[0], max_bytes=1 << 20, what="the certificate") if len(crts) == 1 else b""
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
    pin = _signed_package_ca(ws, archive, ca_fingerprint, confirm_ca)
    # what the import overwrites, restored if the certificate is refused: a refused one is never left installed
    installed = [ws / "cert" / "client" / f"col_{name}.crt", ws / "cert" / "cert_chain.crt"]
    before = {path: path.read_bytes() if path.is_file() else None for path in installed}
    log(f"  $ fx collaborator certify --import {archive}")
    try:
        run_fx(ws, ["collaborator", "certify", "--import", str(archive)])
        if pin is not None:
            from ..deploy.anchor import pin_ca

            pin_ca(ws / "cert", *pin)
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
    ``cert_chain.crt`` (:func:`~fedcontrast.deploy.certificates.check_own_certificate`) and is issued for ``name`` alone
    (:func:`~fedcontrast.deploy.certificates.check_certificate_name`)."""
    from ..deploy.anchor import check_installed_chain
    from ..deploy.certificates import check_certificate_name, check_own_certificate

    cert_dir = workspace / "cert"
    crt, key = cert_dir / "client" / f"col_{name}.crt", cert_dir / "client" / f"col_{name}.key"
    chain = cert_dir / "cert_chain.crt"
    for path in (crt, key, chain):
        if not path.exists():
            raise DeploymentError(f"{path} is missing after the import")
    try:
        check_installed_chain(cert_dir)  # the CA pinned at join, and no other
        check_own_certificate(crt, key, chain)
        check_certificate_name(crt, name)
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None


def _signed_package_ca(ws: Path, archive: Path, given: str | None, confirm: Callable[[str, str], bool] | None
                       ) -> tuple[str, str, str] | None:
    """The signed package's CA chain checked before anything is installed: the CA pinned at join, and no
    other, in one sentence. Without a pin: the one ``given`` or confirmed, to be pinned (returned)."""
    from ..archives import read_entry
    from ..deploy.anchor import check_against_pin, normalise_fingerprint, read_pin, shown

    with zipfile.ZipFile(archive) as z:
        if "cert_chain.crt" not in z.namelist():
            return None  # fx's import and the checks after it name the missing chain
        pem = read_entry(z, "cert_chain.crt", max_bytes=1 << 20, what="the CA chain")
    cert_dir = ws / "cert"
    try:
        found, subject = check_against_pin(cert_dir, pem, f"the CA chain in {archive.name}")
    except ConfigError as exc:
        raise DeploymentError(f"{exc}: not installed; a site trusts only the CA it confirmed at join — ask the "
                              "operator for the package signed by the federation's CA") from None
    expected = normalise_fingerprint(given) if given is not None else None
    if expected is not None and found != expected:
        raise DeploymentError(f"the CA chain in {archive.name} is from {subject} ({shown(found)}), not the CA whose "
                              f"fingerprint you were given ({shown(expected)}): not installed")
    if read_pin(cert_dir) is not None:
        return None
    if expected is None and confirm is not None and not confirm(subject, found):
        raise DeploymentError(f"the CA of {archive.name} ({subject}, {shown(found)}) was not confirmed: not installed; "
                              "ask the operator to read you its CA's fingerprint")
    return found, subject, ("--ca-fingerprint at import-cert" if expected is not None
                            else "confirmed at import-cert" if confirm else "taken at import-cert")
