"""OpenFL plans and workspaces generated from the typed run configuration.

A plan is never edited by hand: ``build_plan(config)`` writes every section from the same
:class:`RunConfig` the simulator uses, so the two cannot drift apart. The run configuration is
embedded once (YAML anchor) and read by the runner, the data loader, the aggregation function and
the aggregator; any change to it changes the plan's hash, i.e. the federation id, as it should.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import RunConfig
from ..construction import build_algorithm, load_splits, site_name
from ..errors import ConfigError

PACKAGE = "fedcontrast.openfl"
DEFAULT_PORT = 50551
WORKSPACE_DIRS = ("plan", "save", "local_state", "logs", "cert")


def model_shape(config: RunConfig) -> dict[str, int]:
    """Input channels, image size and classes of the configured data set: the global model's shape."""
    splits = load_splits(config)
    return {"in_channels": splits.in_channels, "image_size": splits.image_size, "num_classes": splits.num_classes}


def deployment_defaults(*, address: str = "localhost", port: int = DEFAULT_PORT, tls: bool = True,
                        max_retries: int = 30) -> dict[str, Any]:
    """The parts of a plan that do not depend on the algorithm: components, network, persistence."""
    return {
        "aggregator": {"template": f"{PACKAGE}.components.SafeAggregator", "settings": {
            "init_state_path": "save/init.pbuf", "best_state_path": "save/best.pbuf",
            "last_state_path": "save/last.pbuf", "report_dir": "save",
            "use_delta_updates": False,  # whole tensors, not float32-rounded deltas
            "persist_checkpoint": True, "persistent_db_path": "local_state/tensor.db",
        }},
        "collaborator": {"template": f"{PACKAGE}.components.SafeCollaborator", "settings": {
            "max_retries": max_retries, "use_delta_updates": False, "opt_treatment": "RESET",
        }},
        "network": {"settings": {
            "agg_addr": address, "agg_port": port, "use_tls": tls, "require_client_auth": tls,
            "client_reconnect_interval": 1,
        }},
        "compression_pipeline": {"template": "openfl.pipelines.NoCompressionPipeline", "settings": {}},
    }


def build_plan(config: RunConfig, *, shape: dict[str, int] | None = None, **network: Any) -> dict[str, Any]:
    """The complete plan.yaml content for ``config`` (TLS and client authentication on by default)."""
    if config.sample_fraction != 1.0:
        raise ConfigError("sample_fraction < 1 is not supported in an OpenFL deployment yet: every "
                          "collaborator takes part in every round")
    algorithm = build_algorithm(config)
    shape = shape or model_shape(config)
    run_config = config.to_dict()  # one object, referenced four times: YAML writes it once
    plan = deployment_defaults(**network)
    plan["aggregator"]["settings"].update(run_config=run_config, model_shape=shape, rounds_to_train=config.rounds)
    plan["data_loader"] = {"template": f"{PACKAGE}.loader.SiteDataLoader", "settings": {"run_config": run_config}}
    plan["task_runner"] = {"template": f"{PACKAGE}.runner.PluginTaskRunner",
                           "settings": {"run_config": run_config, "state_dir": "local_state/sites"}}
    plan["assigner"] = {"template": "openfl.component.RandomGroupedAssigner", "settings": {
        "task_groups": [{"name": "learning", "percentage": 1.0, "tasks": list(algorithm.tasks)}]}}
    aggregation = {"template": f"{PACKAGE}.aggregation.PluginAggregation",
                   "settings": {"run_config": run_config, "model_shape": shape}}
    plan["tasks"] = {task: {"function": task, "kwargs": {}, "aggregation_type": aggregation}
                     for task in algorithm.tasks}
    return plan


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def create_workspace(directory: str | Path, config: RunConfig, *, collaborators: int | None = None,
                     **network: Any) -> Path:
    """A ready OpenFL workspace: ``plan/{plan,cols,data}.yaml`` and the folders ``fx`` expects.

    Collaborators are named ``site_0`` … and read shard ``i`` of the configured partition
    (``plan/data.yaml``; an institution replaces its line with its own folder).
    """
    n = collaborators if collaborators is not None else config.clients
    if n < 1:
        raise ConfigError(f"a federation needs at least one collaborator, got {n}")
    if n != config.clients:
        config = config.replace(clients=n)
    ws = Path(directory)
    if (ws / "plan" / "plan.yaml").exists():
        raise ConfigError(f"{ws} already holds a workspace (plan/plan.yaml); choose another folder")
    plan = build_plan(config, **network)
    for sub in WORKSPACE_DIRS:
        (ws / sub).mkdir(parents=True, exist_ok=True)
    (ws / "plan" / "plan.yaml").write_text(dump_yaml(plan))
    names = [site_name(i) for i in range(n)]
    (ws / "plan" / "cols.yaml").write_text(dump_yaml({"collaborators": names}))
    (ws / "plan" / "data.yaml").write_text("".join(f"{name},shard:{i}\n" for i, name in enumerate(names)))
    return ws


def read_workspace_config(workspace: str | Path) -> RunConfig:
    """The run configuration embedded in a workspace's plan."""
    path = Path(workspace) / "plan" / "plan.yaml"
    if not path.is_file():
        raise ConfigError(f"{workspace} is not a workspace: {path} does not exist")
    plan = yaml.safe_load(path.read_text())
    try:
        return RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"])
    except (KeyError, TypeError):
        raise ConfigError(f"{path} is not a fedcontrast plan (no task_runner.settings.run_config)") from None


def collaborator_names(workspace: str | Path) -> list[str]:
    data = yaml.safe_load((Path(workspace) / "plan" / "cols.yaml").read_text()) or {}
    return list(data.get("collaborators") or [])
