"""What a raw ``fx collaborator start`` / ``fx aggregator start`` must pass before OpenFL imports
anything from the workspace: called by ``_fedcontrast_fx_guard`` (loaded by ``fedcontrast_fx_guard.pth``
at interpreter start-up); the site's policy first, then the package checks of
:mod:`fedcontrast.deploy.trust`. Also how ``fx`` reads its command line (:func:`fx_plan_path`,
:func:`fx_option`). Imports no OpenFL: it runs before OpenFL is imported."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..deploy.trust import PackageRefused, check_policy_for_workspace, check_workspace
from ..errors import SiteRefusal


def fx_plan_path(command: str, argv: list[str] | None = None, cwd: str | Path = ".") -> Path | None:
    """The plan file that this process, ``fx <command> start``, parsed: its ``-p/--plan`` or the
    default ``plan/plan.yaml`` of the workspace it runs in. None when this process is not that."""
    argv = list(sys.argv if argv is None else argv)
    program, args = (argv[0] if argv else ""), argv[1:]
    if Path(program).name != "fx" and "openfl" not in program and "openfl.interface.cli" not in sys.modules:
        return None  # not OpenFL's command line (under whatever name: fx, a renamed link, python -m)
    if command not in args or args.index(command) + 1 >= len(args) or args[args.index(command) + 1] != "start":
        return None
    return Path(cwd) / (fx_option(args, ("-p", "--plan")) or "plan/plan.yaml")


def fx_option(argv: list[str], flags: tuple[str, str]) -> str | None:
    """An ``fx`` option's value in ``argv``: of ``-x VALUE``, ``-xVALUE``, ``--long VALUE`` or
    ``--long=VALUE``, the last one given (as click takes it); None when none is."""
    short, long = flags
    value = None
    for i, arg in enumerate(argv):
        if arg in flags and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(long + "="):
            value = arg.split("=", 1)[1]
        elif arg.startswith(short) and not arg.startswith("--") and len(arg) > len(short):
            value = arg[len(short):]
    return value


def guard_collaborator_start(argv: list[str], cwd: str | Path) -> None:
    """What ``fx collaborator start`` must pass before OpenFL imports anything from the workspace
    (called by ``_fedcontrast_fx_guard``, whatever launched fx): raises :class:`FedContrastError` in one
    sentence."""
    path = fx_plan_path("collaborator", argv, cwd)
    if path is None:
        return
    data_config = Path(cwd) / (fx_option(argv, ("-d", "--data_config")) or "plan/data.yaml")
    guard_collaborator_plan(path, data_config, fx_option(argv, ("-n", "--collaborator_name")), None, cwd)


def guard_collaborator_plan(plan_path: str | Path, data_config: str | Path, name: str | None, built: Any,
                            cwd: str | Path) -> None:
    """The checks of a collaborator's start, wherever OpenFL builds one from a plan (``Plan.get_collaborator``,
    wrapped by ``_fedcontrast_fx_guard``): ``built`` is the plan as OpenFL parsed it (None: not parsed
    yet), whose components are checked too, being what OpenFL will import."""
    from ..deploy.trust import check_workspace_files
    from ..deploy.workspace import load_plan_file

    check_workspace_files(cwd, plan_path, data_config)  # a FIFO or device read by fx would block for ever
    path = Path(plan_path)
    if not path.is_file():
        return  # fx names the missing plan itself
    plan = load_plan_file(path)  # one copy of every setting (a split plan is refused here, before any code runs)
    ws = Path(cwd)
    check_workspace(ws, plan, check_policy_for_workspace(ws), plan_source=str(path))
    if isinstance(built, dict):  # what OpenFL parsed from that file (its defaults merged): only installed code
        from ..deploy.templates import template_problems

        problems = template_problems({k: v for k, v in built.items() if isinstance(v, dict)}, str(path))
        if problems:
            raise PackageRefused("this workspace is refused before anything runs: " + "; ".join(problems))
    data_config = Path(data_config)
    _check_policy_first(ws, plan, name, data_config)
    if name is not None:
        _check_site_files(ws, plan, name, data_config)


def _check_policy_first(ws: Path, plan: Any, name: str | None, data_config: Path) -> None:
    """The site's policy, as its data loader will check it, before anything else can stop the start:
    a plan the privacy officer's policy refuses is refused as that, whatever else is missing."""
    from ..config import RunConfig
    from ..deploy.workspace import read_data_lines
    from ..site.checks import enforce_site_policy

    loader = ((plan.get("data_loader") or {}).get("settings") or {}) if isinstance(plan, dict) else {}
    if "run_config" not in loader:
        return  # not a plan fedcontrast wrote (the template check above names that)
    lines = read_data_lines(data_config) if name is not None and data_config.is_file() else {}
    try:
        enforce_site_policy(RunConfig.from_dict(loader["run_config"]), loader.get("network"),
                            loader.get("model_shape"), lines.get(name, "") if name is not None else "",
                            cwd="." if ws.resolve() == Path.cwd().resolve() else ws)  # named as fx's loader names it
    except SiteRefusal as exc:
        raise PackageRefused(str(exc)) from None


def guard_aggregator_start(argv: list[str], cwd: str | Path) -> None:
    """``fx aggregator start``: its plan file read as fedcontrast reads it, so that one OpenFL would stop
    on with a traceback (not YAML, a key given twice, split copies of a setting) is one sentence."""
    path = fx_plan_path("aggregator", argv, cwd)
    if path is not None:
        guard_aggregator_plan(path, cwd)


def guard_aggregator_plan(plan_path: str | Path, cwd: str | Path) -> None:
    """The aggregator's plan file, wherever OpenFL builds one from it (``Plan.get_aggregator``)."""
    from ..deploy.trust import check_workspace_files
    from ..deploy.workspace import load_plan_file

    check_workspace_files(cwd, plan_path)  # a FIFO or device read by fx would block for ever
    if Path(plan_path).is_file():
        load_plan_file(plan_path)


def _check_site_files(ws: Path, plan: Any, name: str, data_config: Path) -> None:
    """What ``fx collaborator start -n NAME`` would otherwise stop on with a traceback: no data line for
    the site, and (under TLS) its certificate, key or the CA chain not installed yet."""
    from ..deploy.workspace import read_data_lines

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
    from ..deploy.anchor import check_installed_chain
    from ..errors import ConfigError

    try:
        check_installed_chain(cert)  # the CA this site pinned at join, and no other
    except ConfigError as exc:
        raise PackageRefused(str(exc)) from None


# Built by OpenFL's Plan where a fedcontrast plan has no section of its own (its straggler policy).
OPENFL_DEFAULT_TEMPLATES = ("openfl.component.aggregator.straggler_handling.WaitForAllPolicy",)


def accepted_components() -> set[str]:
    """Every component OpenFL's ``Plan`` may build in this environment: the installed fedcontrast's,
    those installed plugins declare under ``fedcontrast.openfl_templates``, and OpenFL's own defaults
    for the sections a fedcontrast plan leaves out (:data:`OPENFL_DEFAULT_TEMPLATES`)."""
    from ..deploy.templates import allowed_templates

    return set(OPENFL_DEFAULT_TEMPLATES).union(*allowed_templates().values())


def component_refusal(template: Any, plan: Any = None, source: str | None = None) -> str | None:
    """Why OpenFL's ``Plan`` may not build (or import) the plan component ``template`` — one sentence —
    or None when it may: wherever a component is built (``Plan.build`` and ``Plan.import_``, which every
    ``get_*`` goes through, wrapped by ``_fedcontrast_fx_guard``). ``plan``: the parsed plan the
    component comes from (None: built without one), whose every component is checked with it, section
    by section, as :func:`guard_collaborator_plan` checks them (``source``: its file, to name it)."""
    refusal = plan_refusal(plan, source) if plan is not None else None
    if refusal is not None:
        return refusal
    if isinstance(template, str) and template in accepted_components():
        return None
    named = f" (in {source})" if source else ""
    return (f"the plan component {template!r}{named} is neither the installed fedcontrast's nor one declared by an "
            "installed plugin (entry points fedcontrast.openfl_templates): refused before its module was imported")


def plan_refusal(plan: Any, source: str | None = None) -> str | None:
    """Why no component of ``plan`` (as OpenFL parsed it) may be built — one sentence naming each
    component that is not the one a fedcontrast plan has in its section — or None."""
    from ..deploy.templates import template_problems

    if not isinstance(plan, dict):
        return None
    problems = template_problems({k: v for k, v in plan.items() if isinstance(v, dict)}, source or "the plan")
    return "this plan is refused before any of its components is imported: " + "; ".join(problems) if problems \
        else None


def _modules(template: str) -> set[str]:
    """The module of a ``package.module.Class`` template and every package above it."""
    parts = template.rsplit(".", 1)[0].split(".") if "." in template else []
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def foreign_modules(plan: Any) -> set[str]:
    """The modules (with their packages) that ``plan``'s components other than the accepted ones
    (:func:`accepted_components`) would import, less those of accepted components: the start-up
    guard refuses to import them by any route once OpenFL parsed the plan (``fx plan initialize``
    imports the data loader with importlib, not through ``Plan.build``)."""
    from ..deploy.templates import plan_templates

    if not isinstance(plan, dict):
        return set()
    accepted = accepted_components()
    named = [t for _, t in plan_templates({k: v for k, v in plan.items() if isinstance(v, dict)}) if isinstance(t, str)]
    ours = set().union(*(_modules(t) for t in accepted))
    return set().union(*(_modules(t) for t in named if t not in accepted)) - ours


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


def torch_guard_installed() -> bool:
    """torch runs ``_fedcontrast_torch_guard`` at its import here (its entry point is installed, and
    ``TORCH_DEVICE_BACKEND_AUTOLOAD`` does not turn torch's entry points off)."""
    import os
    from importlib.metadata import entry_points

    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        return False
    return any(ep.value.startswith(TORCH_GUARD_MODULE) for ep in entry_points(group="torch.backends"))


def covered_launchers() -> tuple[list[str], list[str]]:
    """(the launchers of a collaborator that run the start-up checks first in this environment, those
    that do not): what ``fedcontrast doctor`` reports."""
    pth, torch = guard_installed() is not None, torch_guard_installed()
    everyday = ["fx", "a link to fx under another name", "python -m openfl.interface.cli",
                "fx plan initialize", "a program building the collaborator or any plan component with OpenFL's Plan"]
    covered = (everyday if pth or torch else []) + (["python -S with site-packages on PYTHONPATH"] if torch else [])
    missing = ([] if pth or torch else everyday) + ([] if torch else ["python -S with site-packages on PYTHONPATH"])
    return covered, missing + ["python -S without this environment (nothing of fedcontrast runs there)"]


GUARD_MODULE = "_fedcontrast_fx_guard"
TORCH_GUARD_MODULE = "_fedcontrast_torch_guard"
GUARD_PTH = "fedcontrast_fx_guard.pth"
