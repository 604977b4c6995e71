"""OpenFL's ``fx`` command and the workspace files the parties' commands read around it.

A cross-silo deployment runs party by party with ``fx`` underneath: the operator
(:mod:`.operator_flows`: the CA, the exported package, each site's request signed, a certificate
revoked) and each institution (:mod:`.institution_flows`: join, import-cert) share what is here —
:func:`run_fx` in a workspace, the workspace's ``plan/plan.yaml`` (:func:`read_workspace_plan`, its
run configuration, the aggregator's name) and ``plan/cols.yaml`` (:func:`collaborator_names`).
How any party reads a plan's contents, whatever the engine, is :mod:`fedcontrast.deploy.workspace`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..deploy.common import DeploymentError
from ..deploy.workspace import load_plan_file
from ..errors import ConfigError, FedContrastError

OPENFL_MISSING = ("this command runs OpenFL, which is not installed in this environment: "
                  "pip install -e \".[openfl]\" (or pip install 'fedcontrast[openfl]')")


def fx_executable() -> str:
    """``fx`` from this environment (the one fedcontrast is installed in); one sentence when OpenFL
    (an install extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("openfl") is None:
        raise FedContrastError(OPENFL_MISSING)
    candidate = Path(sys.executable).with_name("fx")
    return str(candidate) if candidate.exists() else "fx"


def run_fx(workspace: Path, args: list[str], *, timeout: float = 600) -> str:
    """``fx ARGS`` in ``workspace``; its output, or :class:`DeploymentError` with the last lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.run([fx_executable(), *args], cwd=workspace, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        raise DeploymentError(f"'fx {' '.join(args)}' failed in {workspace} (exit {proc.returncode}): {tail}")
    return proc.stdout + proc.stderr


def unchecked_plan(workspace: Path) -> dict:
    """A workspace's ``plan/plan.yaml`` as YAML, without :func:`~fedcontrast.deploy.workspace.load_plan_file`'s
    consistency check (the operator's commands read it before fx does)."""
    path = workspace / "plan" / "plan.yaml"
    if not path.is_file():
        raise ConfigError(f"{workspace} is not a workspace: {path} does not exist")
    from ..yamlio import load_yaml_file

    return load_yaml_file(path, "plan")


def aggregator_name(workspace: Path) -> str:
    """The aggregator's host name in the plan (its certificate is issued for that name)."""
    return str(unchecked_plan(workspace)["network"]["settings"]["agg_addr"]).lower()


def read_workspace_plan(workspace: str | Path) -> tuple[dict[str, Any], RunConfig]:
    """A workspace's plan (checked: one copy of every setting, what each party will run) and the run
    configuration embedded in it."""
    path = Path(workspace) / "plan" / "plan.yaml"
    if not path.is_file():
        raise ConfigError(f"{workspace} is not a workspace: {path} does not exist")
    plan = load_plan_file(path)
    return plan, RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])


def read_workspace_config(workspace: str | Path) -> RunConfig:
    """The run configuration embedded in a workspace's plan."""
    return read_workspace_plan(workspace)[1]


def collaborator_names(workspace: str | Path) -> list[str]:
    """The collaborators' names in a workspace's ``plan/cols.yaml``."""
    from ..yamlio import load_yaml_file

    path = Path(workspace) / "plan" / "cols.yaml"
    if not path.is_file():
        raise ConfigError(f"{workspace} is not a workspace: {path} does not exist (make one with "
                          "`fedcontrast workspace create`)")
    data = load_yaml_file(path, "collaborator list") or {}
    names = (data.get("collaborators") or []) if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path} must list the collaborators' names under collaborators:")
    return names
