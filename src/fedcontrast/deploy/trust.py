"""What a site accepts from the operator: a package that carries no code and no key, a plan whose
every component is code the site installed itself, and a connection with TLS and client
authentication on (unless the site's own policy allows otherwise).

OpenFL builds each plan section from its ``template`` (``import_module`` + call, with the workspace
first on ``sys.path``), so a package could run the operator's code at the hospital — with its data —
through a class shipped in its ``src/``, or through any callable of an installed package. A site
therefore accepts exactly the components ``fedcontrast workspace create`` writes (and those a
third-party plugin it installed declares under the entry-point group
``fedcontrast.openfl_templates``: ``data_loader = "pkg.module:Class"``), and no Python file at all in
its workspace. The same checks run at ``site join`` (on the archive, before anything is unpacked),
``doctor``, ``site start`` and a raw ``fx collaborator start`` (``_fedcontrast_fx_guard``, loaded by a
``.pth`` file at interpreter start-up, before OpenFL imports anything from the workspace).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FedContrastError
from .templates import template_problems

# Files Python can import or execute from a folder on sys.path (OpenFL puts the workspace first).
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".so", ".pth")
# The one file a workspace package may hold under cert/: the federation's CA chain (public).
PACKAGE_CERT_FILES = ("cert/cert_chain.crt",)
_PKCS7_DATA_OID = bytes.fromhex("06092a864886f70d010701")  # in every PKCS#12 bundle's first ContentInfo


class PackageRefused(FedContrastError):
    """A package or workspace that a site must not run; the message names the file or setting."""


# --- files ----------------------------------------------------------------------------------------
def key_material(data: bytes) -> str | None:
    """What private-key material ``data`` is (a PEM private key, a DER PKCS#1/PKCS#8 key, a PKCS#12
    bundle), whatever the file is called; None when it is none of these."""
    if b"PRIVATE KEY-----" in data:
        return "a PEM private key"
    if len(data) < 4 or data[0] != 0x30 or len(data) > 1 << 20:
        return None
    header = 2 + (data[1] & 0x7F if data[1] & 0x80 else 0)  # a DER SEQUENCE: tag, length
    if data[header:header + 4] == b"\x02\x01\x03\x30" and _PKCS7_DATA_OID in data[:96]:
        return "a PKCS#12 bundle"
    from cryptography.hazmat.primitives import serialization

    try:
        serialization.load_der_private_key(data, password=None)
        return "a DER private key"
    except TypeError:  # "Password was not given but private key is encrypted"
        return "an encrypted DER private key"
    except Exception:
        return None


@dataclass(frozen=True)
class Finding:
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path} ({self.what})"


def archive_findings(archive: Path, *, workspace_package: bool = True) -> tuple[list[Finding], list[Finding]]:
    """(code files, key material) inside a zip archive. In a workspace package anything under
    ``cert/`` other than the CA chain counts as key material too."""
    code, keys = [], []
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            name = info.filename
            if name.lower().endswith(CODE_SUFFIXES):
                code.append(Finding(name, "Python code"))
            if workspace_package and (name.startswith("cert/") or "/cert/" in name) \
                    and name not in PACKAGE_CERT_FILES:
                keys.append(Finding(name, "a file under cert/ other than the CA chain"))
                continue
            what = entry_key_material(z, info)
            if what is not None:
                keys.append(Finding(name, what))
    return code, keys


def entry_key_material(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> str | None:
    """:func:`key_material` of an archive's entry, read in a stream (never whole): a DER key or PKCS#12
    bundle is at most 1 MiB, read whole only up to that; a PEM key's marker is looked for in every chunk."""
    from ..archives import scan_entry

    marker = b"PRIVATE KEY-----"
    head, tail = b"", b""
    for chunk in scan_entry(z, info):
        if marker in tail + chunk:
            return "a PEM private key"
        if len(head) <= 1 << 20:
            head += chunk[:(1 << 20) + 1 - len(head)]
        tail = chunk[-len(marker):]
    return key_material(head) if len(head) <= 1 << 20 else None


# What a party's start reads in its workspace, besides its plan and data files (fx's -p and -d): every file
# under these folders, and these files.
WORKSPACE_FOLDERS = ("plan", "cert", "save")
WORKSPACE_FILES = ("requirements.txt",)


def check_workspace_files(workspace: str | Path, *files: str | Path | None) -> None:
    """Every file a party's start will read in ``workspace`` — everything under ``plan/``, ``cert/`` and
    ``save/``, ``requirements.txt``, the site's policy, and ``files`` (a plan or data file given on the
    command line) — is a regular file: a FIFO, a device or a socket there would block whoever reads it
    (OpenFL's own ``Plan.parse``, a TLS handshake) for ever, so it is refused before anything is opened,
    in one :class:`~fedcontrast.errors.ConfigError` naming it. ``plan/cols.yaml``, which OpenFL parses
    itself, is parsed once here through the bounded YAML reader. Missing files are left to the checks
    that name them."""
    from ..privacy.policy import site_policy_path
    from ..yamlio import check_regular_file, load_yaml_file

    ws = Path(workspace)
    paths = [Path(f) for f in files if f is not None] + [ws / name for name in WORKSPACE_FILES]
    policy = site_policy_path(ws)
    paths += [policy] if policy is not None else []
    for folder in WORKSPACE_FOLDERS:
        if (ws / folder).is_dir():
            for root, dirs, names in os.walk(ws / folder):
                dirs.sort()
                paths += [Path(root) / name for name in sorted(names)]
    for path in paths:
        if os.path.exists(path):  # missing, or a link to nothing: named by the checks that need it
            check_regular_file(path, "workspace file", limit=None)
    cols = ws / "plan" / "cols.yaml"
    if cols.exists():
        load_yaml_file(cols, "collaborator list")


def code_files(root: Path, *, limit: int = 5) -> list[Path]:
    """Python files (what could be imported from ``root`` on sys.path) under ``root``, not following
    symbolic links (a site's data or public folder may be linked in); at most ``limit``."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != ".venv")  # an environment kept in the workspace is the site's own
        for name in sorted(files):
            if name.lower().endswith(CODE_SUFFIXES):
                found.append(Path(folder) / name)
                if len(found) >= limit:
                    return found
    return found


# --- the connection -------------------------------------------------------------------------------
def transport_problems(plan: Any, policy: Any, source: str) -> list[str]:
    """TLS off or client authentication off in ``plan``'s network settings, unless ``policy`` (the
    site's :class:`~fedcontrast.privacy.policy.SitePolicy`, None: the default one) allows it
    explicitly (``require_tls: false`` / ``require_client_auth: false``)."""
    from ..privacy.policy import SitePolicy

    policy = policy if policy is not None else SitePolicy()
    network = (plan.get("network") or {}).get("settings") or {} if isinstance(plan, dict) else {}
    problems = []
    if not network.get("use_tls", True) and policy.require_tls:
        problems.append(f"{source} turns TLS off (network.settings.use_tls: false): everything this site sends would "
                        "travel in the clear; a site allows that only with require_tls: false in its site policy")
    elif not network.get("require_client_auth", True) and policy.require_client_auth:
        problems.append(f"{source} turns client authentication off (network.settings.require_client_auth: false): "
                        "anyone could connect as this site; a site allows that only with require_client_auth: false "
                        "in its site policy")
    return problems


# --- the checks, where a site runs them -----------------------------------------------------------
def check_package(archive: Path, plan: Any, policy: Any = None) -> None:
    """Before a site unpacks the operator's package: no Python file, no key material, only installed
    components, TLS and client authentication on (unless ``policy`` allows them off)."""
    code, keys = archive_findings(archive)
    problems = []
    if code:
        problems.append(f"it carries code ({', '.join(map(str, code[:3]))}{' …' if len(code) > 3 else ''}): a "
                        "site runs only the fedcontrast it installed itself")
    if keys:
        problems.append(f"it carries private-key material ({', '.join(map(str, keys[:3]))}): keys never travel")
    problems += template_problems(plan, "its plan")
    problems += transport_problems(plan, policy, "its plan")
    if problems:
        raise PackageRefused(f"{archive.name} is refused, nothing was unpacked: {'; '.join(problems)}; tell the "
                             "operator")


def check_workspace(workspace: Path, plan: Any, policy: Any = None, *, plan_source: str | None = None) -> None:
    """Before a site starts: the workspace holds no Python file, the plan names only installed
    components, TLS and client authentication are on (unless ``policy`` allows them off)."""
    source = plan_source or str(workspace / "plan" / "plan.yaml")
    problems = []
    code = code_files(workspace)
    if code:
        problems.append(f"the workspace holds Python code ({', '.join(map(str, code[:3]))}), which fx would import "
                        "before the installed packages; remove it (a site runs only the fedcontrast it installed)")
    problems += template_problems(plan, source)
    problems += transport_problems(plan, policy, source)
    if problems:
        raise PackageRefused("this workspace is refused before anything runs: " + "; ".join(problems))


def check_policy_for_workspace(workspace: Path) -> Any:
    """The site's policy (None without one) read as the collaborator will read it; an unreadable one raises."""
    from ..privacy.policy import SitePolicy, site_policy_path

    path = site_policy_path(workspace)
    return None if path is None else SitePolicy.from_yaml(path)


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
