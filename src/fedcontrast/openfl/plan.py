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

from ..config import RunConfig, site_names
from ..config.run import is_plugin_file
from ..construction import build_algorithm, data_shape
from ..deploy.workspace import EVALUATE_TASK, pin_shared_files
from ..errors import ConfigError

PACKAGE = "fedcontrast.openfl"
DEFAULT_ROUND_TIMEOUT = 1800.0  # seconds a round may take (aggregator.settings.round_timeout)
DEFAULT_PORT = 50551
# How long a site keeps trying to reach the aggregator (at start, or after losing it mid-federation)
# before it gives up: long enough for an aggregator's restart (collaborator.settings.wait_for_aggregator).
DEFAULT_WAIT_FOR_AGGREGATOR = 600.0
DEFAULT_RECONNECT_INTERVAL_MAX = 5.0  # seconds: the back-off between attempts doubles up to this
WORKSPACE_DIRS = ("plan", "save", "local_state", "logs", "cert", "src")


def check_wait_settings(wait_for_aggregator: Any, reconnect_interval_max: Any = DEFAULT_RECONNECT_INTERVAL_MAX,
                        max_retries: Any = None) -> None:
    """Refuse, in one sentence, settings a site could not wait for the aggregator with."""
    def seconds(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")

    if not seconds(wait_for_aggregator):
        raise ConfigError(f"wait_for_aggregator must be a number of seconds > 0 (how long a site keeps trying to "
                          f"reach the aggregator), got {wait_for_aggregator!r}")
    if not seconds(reconnect_interval_max):
        raise ConfigError(f"reconnect_interval_max must be a number of seconds > 0, got {reconnect_interval_max!r}")
    if max_retries is not None and not (isinstance(max_retries, int) and not isinstance(max_retries, bool)
                                        and max_retries >= 0):
        raise ConfigError(f"max_retries must be a whole number >= 0 or absent, got {max_retries!r}")


def deployment_defaults(*, address: str = "localhost", port: int = DEFAULT_PORT, tls: bool = True,
                        wait_for_aggregator: float = DEFAULT_WAIT_FOR_AGGREGATOR,
                        max_retries: int | None = None) -> dict[str, Any]:
    """The parts of a plan that do not depend on the algorithm: components, network, persistence.

    ``wait_for_aggregator``: seconds a site keeps trying to reach the aggregator (at start, or after
    losing it) before it gives up, with back-off from the network's ``client_reconnect_interval`` up to
    ``reconnect_interval_max``; ``max_retries`` (tests): also give up after that many failed attempts."""
    check_wait_settings(wait_for_aggregator, DEFAULT_RECONNECT_INTERVAL_MAX, max_retries)
    retries = {} if max_retries is None else {"max_retries": max_retries}
    return {
        "aggregator": {"template": f"{PACKAGE}.components.SafeAggregator", "settings": {
            "init_state_path": "save/init.pbuf", "best_state_path": "save/best.pbuf",
            "last_state_path": "save/last.pbuf", "report_dir": "save",
            "use_delta_updates": False,  # whole tensors, not float32-rounded deltas
            "persist_checkpoint": True, "persistent_db_path": "local_state/tensor.db",
        }},
        "collaborator": {"template": f"{PACKAGE}.components.SafeCollaborator", "settings": {
            "wait_for_aggregator": float(wait_for_aggregator), "reconnect_interval_max": DEFAULT_RECONNECT_INTERVAL_MAX,
            **retries, "poll_interval": 0.05, "use_delta_updates": False, "opt_treatment": "RESET",
        }},
        "network": {"settings": {
            "agg_addr": address, "agg_port": port, "use_tls": tls, "require_client_auth": tls,
            "client_reconnect_interval": 1,
        }},
        "compression_pipeline": {"template": "openfl.pipelines.NoCompressionPipeline", "settings": {}},
    }


def build_plan(config: RunConfig, *, shape: dict[str, int] | None = None,
               round_timeout: float = DEFAULT_ROUND_TIMEOUT, min_sites: int | None = None,
               **network: Any) -> dict[str, Any]:
    """The complete plan.yaml content for ``config`` (TLS and client authentication on by default).

    ``round_timeout``: seconds a round may take before the federation stops naming the sites that did
    not answer; ``min_sites``: how many answering sites let such a round be aggregated without the
    others instead (None: all are needed)."""
    files = [plugin for plugin in config.plugins if is_plugin_file(plugin)]
    if files:
        raise ConfigError(f"plugins names the file {files[0]}, but every party of a federation imports the plan's "
                          f"plugins by module name: name the module ({Path(files[0]).stem}) and install it on every "
                          "host, or put its folder on PYTHONPATH")
    if config.secure_aggregation is not None and not network.get("tls", True):
        raise ConfigError("secure aggregation needs the federation's mutual TLS (each site signs its keys with its "
                          "certificate's private key): leave TLS on")
    if config.secure_aggregation is not None and min_sites is not None and \
            min_sites < config.secure_aggregation.sites_needed(config.clients):
        raise ConfigError(f"min_sites {min_sites} is below secure_aggregation's threshold "
                          f"{config.secure_aggregation.sites_needed(config.clients)}: a round with fewer sites cannot "
                          "be unmasked; raise min_sites or lower the threshold")
    if config.sample_fraction != 1.0:
        raise ConfigError("sample_fraction < 1 is not supported in an OpenFL deployment yet: every "
                          "collaborator takes part in every round")
    if not (isinstance(round_timeout, (int, float)) and round_timeout > 0):
        raise ConfigError(f"round_timeout must be a number of seconds > 0, got {round_timeout!r}")
    if min_sites is not None and not (isinstance(min_sites, int) and 1 <= min_sites <= config.clients):
        raise ConfigError(f"min_sites must be an integer between 1 and the {config.clients} sites, got {min_sites!r}")
    algorithm = build_algorithm(config)
    if EVALUATE_TASK in algorithm.tasks:
        raise ConfigError(f"{algorithm.name} names a task {EVALUATE_TASK!r}, which the engine reserves for the "
                          "sites' own evaluation; rename it")
    shape = shape or data_shape(config)  # from the data schema when there is one: no data read
    run_config = config.to_dict()  # one object, referenced four times: YAML writes it once
    run_config.pop("executor", None)  # the simulator's setting: a plan's sites run under OpenFL
    plan = deployment_defaults(**network)
    plan["aggregator"]["settings"].update(run_config=run_config, model_shape=shape, rounds_to_train=config.rounds,
                                          round_timeout=float(round_timeout), min_sites=min_sites)
    # The loader checks the site's policy before reading data: it gets the very network settings and
    # model shape of this plan (the same objects: YAML writes them once and refers to them).
    plan["data_loader"] = {"template": f"{PACKAGE}.loader.SiteDataLoader", "settings": {
        "run_config": run_config, "network": plan["network"]["settings"], "model_shape": shape}}
    plan["task_runner"] = {"template": f"{PACKAGE}.runner.PluginTaskRunner",
                           "settings": {"run_config": run_config, "state_dir": "local_state/sites"}}
    # Each round: evaluate (the sites' own held-out data), then the plugin's tasks; and one final
    # evaluation-only round (see components.RoundAssigner).
    plan["assigner"] = {"template": f"{PACKAGE}.components.RoundAssigner",
                        "settings": {"train_tasks": list(algorithm.tasks)}}
    aggregation = {"template": f"{PACKAGE}.aggregation.PluginAggregation",
                   "settings": {"run_config": run_config, "model_shape": shape}}
    plan["tasks"] = {EVALUATE_TASK: {"function": EVALUATE_TASK, "kwargs": {}}}
    plan["tasks"].update({task: {"function": task, "kwargs": {}, "aggregation_type": aggregation}
                          for task in algorithm.tasks})
    return plan


TEMPLATE_HEADER = ("# Generated by `fedcontrast plan write` from fedcontrast's typed configuration; do not edit.\n"
                   "# A workspace's plan is written the same way: `fedcontrast workspace create`.\n")


def plan_templates(collaborators: int = 3) -> dict[str, dict[str, Any]]:
    """``defaults`` (the algorithm-independent part) and one plan per registered algorithm, for the
    default configuration (digits, ``collaborators`` sites)."""
    from ..algorithms import available_algorithms

    templates = {"defaults": deployment_defaults()}
    base = RunConfig(clients=collaborators)
    shape = data_shape(base)
    for name in available_algorithms():
        templates[name] = build_plan(base.replace(algorithm=name), shape=shape)
    return templates


def write_plan_templates(directory: str | Path, collaborators: int = 3) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plan in plan_templates(collaborators).items():
        path = out / f"{name}.yaml"
        path.write_text(TEMPLATE_HEADER + dump_yaml(plan))
        written.append(path)
    return written


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


DATA_YAML_HEADER = ("# Each collaborator's data, one line per site on that site's own machine: NAME,PATH\n"
                    "# (PATH: its image folder, one sub-folder per class of the plan's data schema;\n"
                    "#  `fedcontrast site join` writes this line). The operator holds no data.\n")
SRC_README = ("The federation's code is the installed `fedcontrast` package (version {version}), named in\n"
              "../requirements.txt; the plan (plan/plan.yaml) says which of its classes run. Nothing here to edit.\n")
PLUGINS_README = ("Every party (the aggregator and each site) also imports the plan's plugin module(s) {modules}\n"
                  "by name before it builds the algorithm: install them on every host (or put their folder on\n"
                  "PYTHONPATH). A site runs no code from this package.\n")


def create_workspace(directory: str | Path, config: RunConfig, *, collaborators: int | None = None,
                     round_timeout: float = DEFAULT_ROUND_TIMEOUT, min_sites: int | None = None,
                     public_source: str | Path | None = None, log=print, **network: Any) -> Path:
    """A ready OpenFL workspace: ``plan/{plan,cols,data}.yaml``, the folders ``fx`` expects, and
    what ``fx workspace export`` packs (``src/``, ``requirements.txt``, ``.workspace``).

    Sites are the plan's ``sites`` (default ``site_0`` …). Without a data schema each reads shard
    ``i`` of the configured partition (``plan/data.yaml``, the embedded demo); with one, the
    operator writes no data line: each institution adds its own (``fedcontrast site join``).
    """
    from .. import __version__

    n = collaborators if collaborators is not None else config.clients
    if n < 1:
        raise ConfigError(f"a federation needs at least one collaborator, got {n}")
    if n != config.clients:
        if config.sites:
            raise ConfigError(f"{n} collaborators asked for, but the plan names {len(config.sites)} sites")
        config = config.replace(clients=n)
    ws = Path(directory)
    if (ws / "plan" / "plan.yaml").exists():
        raise ConfigError(f"{ws} already holds a workspace (plan/plan.yaml); choose another folder")
    build_plan(config, round_timeout=round_timeout, min_sites=min_sites, **network)  # refuse bad settings first
    for sub in WORKSPACE_DIRS:
        (ws / sub).mkdir(parents=True, exist_ok=True)
    if config.public_data is not None and public_source is not None:
        from ..data.schema import public_folder_path

        link = public_folder_path(config.public_data, ws)
        if not link.exists() and Path(public_source).resolve() != link.resolve():
            link.symlink_to(Path(public_source).resolve(), target_is_directory=True)
    if config.data_schema is not None:  # files every site must hold alike (FedPCL's backbones), pinned in the plan
        config = pin_shared_files(config, ws, log=log)
    plan = build_plan(config, round_timeout=round_timeout, min_sites=min_sites, **network)
    (ws / "plan" / "plan.yaml").write_text(dump_yaml(plan))
    names = site_names(config)  # lower case (RunConfig checks): OpenFL's certificate tools lower-case names
    (ws / "plan" / "cols.yaml").write_text(dump_yaml({"collaborators": names}))
    if config.data_schema is None:
        (ws / "plan" / "data.yaml").write_text("".join(f"{name},shard:{i}\n" for i, name in enumerate(names)))
    else:
        (ws / "plan" / "data.yaml").write_text(DATA_YAML_HEADER)
    from ..provenance import requirements_text

    (ws / "requirements.txt").write_text(requirements_text(config.algorithm))
    (ws / "src" / "README.md").write_text(SRC_README.format(version=__version__) + (
        PLUGINS_README.format(modules=", ".join(config.plugins)) if config.plugins else ""))
    (ws / ".workspace").write_text("current_plan_name: default\n")
    return ws
