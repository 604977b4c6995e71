"""A plan as the parties read it: the plan file, its data lines, the check that every component was
given the same settings, and the plugin's shared files pinned in it.

Every party reads these (operator, site, the site's pre-flight checks, the audit), whatever runs the
federation; nothing here imports an engine. Plans are written by :mod:`fedcontrast.openfl.plan`; an
OpenFL workspace's own files (``plan/cols.yaml``, fx) are read by :mod:`fedcontrast.openfl.fx`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..config.run import EVALUATE_TASK  # the engine's own task (its home was here: imported from here too)
from ..errors import ConfigError, DataError

# plan/data.yaml's "NAME,shard:N": shard N of the partition the run configuration defines (the demo)
SHARD_PREFIX = "shard:"

# Settings OpenFL writes into ``network.settings`` itself at start-up (certificate paths, identities),
# whatever the file says: they are no part of what the sites' copies must agree on.
OPENFL_NETWORK_KEYS = frozenset({"root_certificate", "certificate", "private_key", "aggregator_uuid",
                                 "federation_uuid", "collaborator_name"})
_MISSING = object()

def _get(plan: Any, path: str) -> Any:
    node = plan
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node

def _differences(reference: Any, copy: Any, ignore: frozenset[str] = frozenset()) -> list[str]:
    """The top-level keys in which two copies of a section differ ("its value" for non-mappings)."""
    if not (isinstance(reference, dict) and isinstance(copy, dict)):
        return [] if reference == copy else ["its value"]
    keys = sorted((set(reference) | set(copy)) - ignore, key=str)
    return [str(k) for k in keys if reference.get(k, _MISSING) != copy.get(k, _MISSING)]

def check_plan_consistency(plan: Any, source: str = "plan.yaml") -> None:
    """Refuse a plan whose components would not run the same settings.

    Every OpenFL component reads its own copy: the run configuration (data loader, task runner,
    aggregator, each task's aggregation function), the network settings (the data loader's, which
    a site's policy is checked against, and ``network.settings``, which the connection uses), the
    model shape, and the number of rounds (``aggregator.settings.rounds_to_train``). The generated
    plan makes each one YAML anchor; a hand-edited plan can split them, and then a site's policy
    would be checked against settings that do not take effect. Any difference raises
    :class:`ConfigError` naming the copies and the keys that differ."""
    if not isinstance(plan, dict):
        raise ConfigError(f"{source} is not a plan: its top level is a {type(plan).__name__}, not a mapping of "
                          "sections; regenerate it with `fedcontrast workspace create`")
    with_defaults = [section for section, body in plan.items() if isinstance(body, dict) and "defaults" in body]
    if with_defaults:
        raise ConfigError(f"{source} takes {', '.join(map(str, with_defaults))} from OpenFL `defaults` files, which "
                          "fedcontrast plans do not use (their settings would not be checked); remove them")
    reference_path = "task_runner.settings.run_config"
    reference = _get(plan, reference_path)
    if not isinstance(reference, dict):
        raise ConfigError(f"{source} is not a fedcontrast plan (no {reference_path}); regenerate it with "
                          "`fedcontrast workspace create`")
    problems: list[str] = []

    def compare(what: str, copies: list[tuple[str, Any]], ignore: frozenset[str] = frozenset()) -> None:
        (first_path, first), *others = copies
        for path, value in others:
            if value is _MISSING:
                problems.append(f"{path} is missing (every component must be given the same {what})")
            elif first is not _MISSING and (diff := _differences(first, value, ignore)):
                problems.append(f"{path} differs from {first_path} in: {', '.join(diff)}")

    tasks = given if isinstance(given := plan.get("tasks"), dict) else {}
    aggregations = [f"tasks.{name}.aggregation_type.settings" for name, task in tasks.items()
                    if isinstance(task, dict) and isinstance(task.get("aggregation_type"), dict)]
    compare("run configuration", [(reference_path, reference)] + [
        (p, _get(plan, p)) for p in ("data_loader.settings.run_config", "aggregator.settings.run_config",
                                     *(f"{a}.run_config" for a in aggregations))])
    compare("network settings", [("network.settings", _get(plan, "network.settings")),
                                 ("data_loader.settings.network", _get(plan, "data_loader.settings.network"))],
            ignore=OPENFL_NETWORK_KEYS)
    compare("model shape", [("aggregator.settings.model_shape", _get(plan, "aggregator.settings.model_shape"))] + [
        (p, _get(plan, p)) for p in ("data_loader.settings.model_shape", *(f"{a}.model_shape" for a in aggregations))])
    rounds = RunConfig.from_dict(reference).rounds
    rounds_to_train = _get(plan, "aggregator.settings.rounds_to_train")
    if rounds_to_train != rounds:
        shown = "missing" if rounds_to_train is _MISSING else repr(rounds_to_train)
        problems.append(f"aggregator.settings.rounds_to_train ({shown}) differs from the run configuration's "
                        f"rounds ({rounds}), for which the sites' privacy budget is planned")
    train_tasks = _get(plan, "assigner.settings.train_tasks")
    for name in [EVALUATE_TASK, *(train_tasks if isinstance(train_tasks, list) else [])]:
        if not isinstance(tasks.get(name), dict) or "function" not in tasks[name]:
            problems.append(f"tasks.{name} is missing (the assigner hands out that task)")
    if problems:
        raise ConfigError(f"{source} does not give every component the same settings: {'; '.join(problems)}; "
                          "each must be one copy (the generated plan makes them one YAML anchor): regenerate the "
                          "plan with `fedcontrast workspace create`")

def load_plan_file(path: str | Path) -> dict[str, Any]:
    """A plan file as OpenFL reads it (YAML; a key given twice, which OpenFL would silently resolve,
    is refused), checked with :func:`check_plan_consistency`; a missing, unreadable or invalid file
    raises :class:`ConfigError`."""
    from ..yamlio import load_yaml_file

    plan = load_yaml_file(path, "plan")
    check_plan_consistency(plan, str(path))
    return plan

def read_data_lines(path: Path) -> dict[str, str]:
    """A ``NAME,PATH`` data file (``plan/data.yaml``) read as OpenFL's ``Plan.parse`` reads it: each
    line right-stripped, empty lines and lines starting with ``#`` skipped, the name everything up to
    the first comma (spaces included: a line fx would not match is not matched here), a later line for
    the same name winning. A line without a comma, on which fx would stop, raises :class:`ConfigError`."""
    from ..yamlio import read_text

    lines = {}
    for number, line in enumerate(read_text(path, "the data file").split("\n"), start=1):  # the lines fx iterates
        line = line.rstrip()
        if not line or line.startswith("#"):
            continue
        if "," not in line:
            raise ConfigError(f"line {number} of {path} is not NAME,PATH ({line!r}); OpenFL would stop on it: "
                              "correct it, or write this site's line again with `fedcontrast site join`")
        name, data = line.split(",", 1)
        lines[name] = data.strip()
    return lines


def shard_index(data_path: str, clients: int) -> int:
    text = data_path[len(SHARD_PREFIX):].strip()
    if not text.isdigit() or not 0 <= int(text) < clients:
        raise DataError(f"data path {data_path!r} in plan/data.yaml must be shard:N with 0 <= N < {clients}")
    return int(text)


def pin_shared_files(config: RunConfig, ws: Path, *, log=print) -> RunConfig:
    """The plugin's files that every site must hold identically (e.g. FedPCL's frozen backbones),
    made or copied into the workspace's ``save/`` (which the workspace package ships) and pinned in
    the plan by their SHA-256 (the :class:`~fedcontrast.algorithms.SharedFiles` capability)."""
    from ..algorithms.capabilities import share_files
    from ..construction import algorithm_class, load_public

    cls = algorithm_class(config)
    settings = dict(config.hyperparameters.get(config.algorithm, {}))
    pinned = share_files(cls, settings, ws, public=lambda: load_public(config, base_dir=ws), seed=config.seed, log=log)
    if pinned == settings:
        return config
    return config.replace(hyperparameters={**config.hyperparameters, config.algorithm: pinned})
