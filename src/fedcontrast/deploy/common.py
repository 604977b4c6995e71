"""A cross-silo deployment, party by party, with OpenFL's own commands underneath: what the
operator (:mod:`.operator_flows`) and each institution (:mod:`.institution_flows`) share.

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
import subprocess
import zipfile
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
    private keys, DER PKCS#1/PKCS#8 keys, PKCS#12 bundles; :func:`fedcontrast.deploy.trust.key_material`); in a
    workspace package also any file under ``cert/`` other than the CA chain."""
    from .trust import archive_findings

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


