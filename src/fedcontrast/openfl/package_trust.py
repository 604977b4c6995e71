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
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FedContrastError

TEMPLATE_ENTRY_POINT_GROUP = "fedcontrast.openfl_templates"
# Each plan section (a dotted path; ``*`` one task name) and the one class a fedcontrast plan builds there.
BUILT_IN_TEMPLATES: dict[str, str] = {
    "aggregator": "fedcontrast.openfl.components.SafeAggregator",
    "collaborator": "fedcontrast.openfl.components.SafeCollaborator",
    "data_loader": "fedcontrast.openfl.loader.SiteDataLoader",
    "task_runner": "fedcontrast.openfl.runner.PluginTaskRunner",
    "assigner": "fedcontrast.openfl.components.RoundAssigner",
    "compression_pipeline": "openfl.pipelines.NoCompressionPipeline",
    "tasks.*.aggregation_type": "fedcontrast.openfl.aggregation.PluginAggregation",
}
# Files Python can import or execute from a folder on sys.path (OpenFL puts the workspace first).
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".so", ".pth")
# The one file a workspace package may hold under cert/: the federation's CA chain (public).
PACKAGE_CERT_FILES = ("cert/cert_chain.crt",)
_PKCS7_DATA_OID = bytes.fromhex("06092a864886f70d010701")  # in every PKCS#12 bundle's first ContentInfo


class PackageRefused(FedContrastError):
    """A package or workspace that a site must not run; the message names the file or setting."""


# --- the plan's components ------------------------------------------------------------------------
def plan_templates(plan: Any) -> list[tuple[str, Any]]:
    """Every ``template`` in a plan, with the dotted path of the section that holds it."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "template":
                    found.append((path, value))
                else:
                    walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(plan, "")
    return found


def allowed_templates() -> dict[str, set[str]]:
    """Section pattern → the templates a site accepts there: fedcontrast's own, plus those declared
    by installed plugins under :data:`TEMPLATE_ENTRY_POINT_GROUP`."""
    from importlib.metadata import entry_points

    allowed = {section: {template} for section, template in BUILT_IN_TEMPLATES.items()}
    for ep in entry_points(group=TEMPLATE_ENTRY_POINT_GROUP):
        allowed.setdefault(ep.name, set()).add(ep.value.replace(":", "."))
    return allowed


def _section_pattern(path: str, patterns: Iterable[str]) -> str | None:
    for pattern in patterns:
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.\[\]]+"), path):
            return pattern
    return None


def template_problems(plan: Any, source: str) -> list[str]:
    """One sentence per component of ``plan`` that is not code this site installed (empty: all are)."""
    if not isinstance(plan, dict):
        return [f"{source} is not a plan (a mapping of sections)"]
    problems = []
    for section, value in plan.items():
        if isinstance(value, dict) and "defaults" in value:
            problems.append(f"{source}'s {section} section reads its defaults from another file "
                            f"({value['defaults']!r}); a fedcontrast plan is complete in itself")
    allowed = allowed_templates()
    for path, template in plan_templates(plan):
        pattern = _section_pattern(path, allowed)
        if pattern is None:
            problems.append(f"{source} builds a component at {path} ({template!r}), where fedcontrast's plans have "
                            "none")
        elif template not in allowed[pattern]:
            expected = " or ".join(sorted(allowed[pattern]))
            problems.append(f"{source}'s {path}.template names {template!r}, which is not the installed "
                            f"fedcontrast's component ({expected}) nor one declared by an installed plugin")
    return problems


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
            what = key_material(z.read(info))
            if what is not None:
                keys.append(Finding(name, what))
    return code, keys


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


def guard_collaborator_start(argv: list[str], cwd: str | Path) -> None:
    """What ``fx collaborator start`` must pass before OpenFL imports anything from the workspace
    (called by ``_fedcontrast_fx_guard``): raises :class:`FedContrastError` in one sentence."""
    from .plan import fx_option, fx_plan_path, load_plan_file

    path = fx_plan_path("collaborator", argv, cwd)
    if path is None:
        return
    if not path.is_file():
        return  # fx names the missing plan itself
    plan = load_plan_file(path)  # one copy of every setting (a split plan is refused here, before any code runs)
    ws = Path(cwd)
    check_workspace(ws, plan, check_policy_for_workspace(ws), plan_source=str(path))
    name = fx_option(argv, ("-n", "--collaborator_name"))
    data_config = ws / (fx_option(argv, ("-d", "--data_config")) or "plan/data.yaml")
    _check_policy_first(ws, plan, name, data_config)
    if name is not None:
        _check_site_files(ws, plan, name, data_config)


def _check_policy_first(ws: Path, plan: Any, name: str | None, data_config: Path) -> None:
    """The site's policy, as its data loader will check it, before anything else can stop the start:
    a plan the privacy officer's policy refuses is refused as that, whatever else is missing."""
    from ..config import RunConfig
    from .plan import read_data_lines
    from .sitecheck import CollaboratorStopped, enforce_site_policy

    loader = ((plan.get("data_loader") or {}).get("settings") or {}) if isinstance(plan, dict) else {}
    if "run_config" not in loader:
        return  # not a plan fedcontrast wrote (the template check above names that)
    lines = read_data_lines(data_config) if name is not None and data_config.is_file() else {}
    try:
        enforce_site_policy(RunConfig.from_dict(loader["run_config"]), loader.get("network"),
                            loader.get("model_shape"), lines.get(name, ""),
                            cwd="." if ws.resolve() == Path.cwd().resolve() else ws)  # named as fx's loader names it
    except CollaboratorStopped as exc:
        raise PackageRefused(str(exc.code).removeprefix("fedcontrast collaborator: error: ")) from None


def guard_aggregator_start(argv: list[str], cwd: str | Path) -> None:
    """``fx aggregator start``: its plan file read as fedcontrast reads it, so that one OpenFL would stop
    on with a traceback (not YAML, a key given twice, split copies of a setting) is one sentence."""
    from .plan import fx_plan_path, load_plan_file

    path = fx_plan_path("aggregator", argv, cwd)
    if path is not None and path.is_file():
        load_plan_file(path)


def _check_site_files(ws: Path, plan: Any, name: str, data_config: Path) -> None:
    """What ``fx collaborator start -n NAME`` would otherwise stop on with a traceback: no data line for
    the site, and (under TLS) its certificate, key or the CA chain not installed yet."""
    from .plan import read_data_lines

    if data_config.is_file() and name not in read_data_lines(data_config):
        shown = data_config.relative_to(ws) if data_config.is_relative_to(ws) else data_config
        raise PackageRefused(f"{shown} has no line for collaborator {name}: add one ({name},PATH to its data), e.g. "
                             "with `fedcontrast site join`")
    network = (plan.get("network") or {}).get("settings") or {} if isinstance(plan, dict) else {}
    if not network.get("use_tls", True):
        return
    cert = ws / "cert"
    missing = [p for p in (cert / "client" / f"col_{name}.key", cert / "client" / f"col_{name}.crt",
                           cert / "cert_chain.crt") if not p.is_file()]
    if missing:
        first = ("make this site's key and request with `fedcontrast site join`, then " if missing[0].suffix == ".key"
                 else "")
        raise PackageRefused(f"{', '.join(map(str, missing))} missing, and the plan uses TLS: {first}install the "
                             f"certificate the operator signed with `fedcontrast site import-cert "
                             f"agg_to_col_{name}_signed_cert.zip --workspace {ws}`")


def guard_installed() -> Path | None:
    """The ``.pth`` file that makes every ``fx collaborator start`` in this environment run
    :func:`guard_collaborator_start`; None when it is not installed here."""
    import site
    import sys

    for folder in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        candidate = Path(folder) / GUARD_PTH
        if candidate.is_file() and GUARD_MODULE in candidate.read_text():
            return candidate
    return None


GUARD_MODULE = "_fedcontrast_fx_guard"
GUARD_PTH = "fedcontrast_fx_guard.pth"
