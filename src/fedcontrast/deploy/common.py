"""What a deployment's parties share whatever the engine: :class:`DeploymentError` (a step that cannot be
done, in one sentence) and the check that no archive a party sends carries private-key material
(:func:`secrets_in`, :func:`refuse_secrets`). Private keys are made where they are used and never put
in any package: every archive is checked. OpenFL's flows: :mod:`fedcontrast.openfl.operator_flows`,
:mod:`fedcontrast.openfl.institution_flows`.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import FedContrastError

SECRET_SUFFIXES = (".key", ".pem")

# One line of `fedcontrast doctor` on any folder (an OpenFL workspace, a Flower folder).
OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.message}"


class DeploymentError(FedContrastError):
    """A step of the deployment flow cannot be done; the message says why and what to do."""


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


def refuse_secrets(archive: Path, *, workspace_package: bool = False) -> None:
    """Delete ``archive`` and raise :class:`DeploymentError` when it holds private-key material."""
    found = secrets_in(archive, workspace_package=workspace_package)
    if found:
        archive.unlink()
        raise DeploymentError(f"{archive.name} would carry private key material ({', '.join(found[:3])}); it was "
                              "deleted — nothing was sent")
