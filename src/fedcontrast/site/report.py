"""What a site takes home from a federation, written in its own workspace; nothing here leaves it.

Each collaborator keeps ``site_report/<name>/<run>/`` next to its state folder (``local_state/`` in a
workspace made by ``fedcontrast workspace create``), one folder per run: ``<run>`` is the run's id
(a Flower run's label, the same across ``--resume``; an OpenFL federation's id), in the folder's name
and in every row (``run``), so that two experiments never share a table. ``site_report/<name>/latest``
is a symbolic link to the run written last (:func:`report_folder` follows it; where a copy lost the
link, the newest run folder is taken). A folder from before this layout (``site_report/<name>/``
holding ``rounds.jsonl`` itself, rows without ``run``) is still read. Each run folder holds:

* ``rounds.jsonl`` and ``rounds.csv``: one row per round ``r`` (0 … ``rounds``; rounds count from 1, 0
  is the initial model): what the site did in round ``r`` (its training metrics, the bytes it
  received and sent, its ε for the round and spent so far, against its policy's budget), and how the
  model after round ``r`` scored on its own held-out split when it came back (``accuracy``;
  ``personal_accuracy`` where the plugin has a personal model) — at the start of round ``r + 1``, or
  in the evaluation after the last round for the final model. Row 0 scores the initial model.
  Rows are keyed by round: a restarted collaborator updates its rows, it does not repeat them.
* ``accuracy.png``: that accuracy per round;
* the final round's model: ``final_model.pt`` (a torch ``state_dict`` of the run's model, where the
  plugin sends weights: the distilled encoder for FLESD), ``final_received.pt`` (everything received
  in the final round, e.g. FedPCL's prototypes), ``final_state.pt`` (the site's own state then, e.g.
  FedPCL's personal head), ``config.yaml`` and ``final_model.json`` (what loads and scores them:
  :func:`load_final_model`, :func:`score_final_model`);
* ``run.json``: which run, site and engine it is, when it started, how many rounds it plans (and, on
  Flower, the plan it ran under in ``plan.json``: what ``fedcontrast audit`` reads in a site's folder).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import yaml

from ..algorithms import SiteContext, load_weights
from ..algorithms.base import WEIGHT_PREFIX
from ..atomic import atomic_torch_save, atomic_write_text
from ..config import RunConfig
from ..errors import CheckpointError, ConfigError
from ..models import ContrastiveNet
from .report_runs import (  # noqa: F401 (the folder read: site/report_runs.py; every name re-exported)
    FINAL_INFO,
    LATEST,
    REPORT_DIR,
    ROWS_FILE,
    RUN_FILE,
    _read_table,
    describe_runs,
    mixed_runs,
    old_layout,
    pick_site_report,
    read_rows,
    report_folder,
    run_folder_name,
    run_folders,
    site_folders,
    site_report_folders,
)

logger = logging.getLogger(__name__)

# the run folder's files (rounds.jsonl, run.json, final_model.json, latest: site/report_runs.py)
CSV_FILE = "rounds.csv"
PLOT_FILE = "accuracy.png"
FINAL_MODEL = "final_model.pt"
FINAL_RECEIVED = "final_received.pt"
FINAL_STATE = "final_state.pt"
CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"  # the plan a run ran under, where the engine gives it (Flower: its run config, transport)
CSV_COLUMNS = ("run", "round", "rounds", "held_out_samples", "accuracy", "personal_accuracy", "val_accuracy",
               "train_accuracy", "bytes_received", "bytes_sent", "epsilon_round", "epsilon_spent", "epsilon_budget",
               "evaluation", "training")


def _number(value: Any) -> Any:
    """A float JSON can hold (NaN and infinities become None)."""
    value = float(value)
    return value if math.isfinite(value) else None


class SiteReport:
    """One collaborator's per-round table, updated by the task runner after each of its tasks.

    ``folder``: the site's report folder (``site_report/<name>/``); with ``run`` (the run's id) the
    table goes to ``folder/<run>/``, every row names the run, and ``folder/latest`` points at it
    (``facts``: recorded in its ``run.json``; ``plan``: the run's plan, kept as ``plan.json``)."""

    def __init__(self, folder: str | Path, site: str, rounds: int, budget: float | None, *,
                 threads: int | None = None, run: str | None = None, facts: dict[str, Any] | None = None,
                 plan: dict[str, Any] | None = None) -> None:
        self.site_folder = Path(folder)
        self.run = None if run is None else str(run)
        self.folder = self.site_folder / run_folder_name(self.run) if self.run is not None else self.site_folder
        self.site, self.rounds, self.budget = site, rounds, budget
        self.threads = threads  # the torch threads it computed with (fedcontrast.threads), in every row
        self.facts, self.plan = dict(facts or {}), plan
        self.rows = {row["round"]: row for row in _read_table(self.folder)}  # this run's (a restart goes on)
        self._marked = False

    def row(self, round_num: int) -> dict[str, Any]:
        row = self.rows.setdefault(round_num, {"round": round_num})
        if self.run is not None:
            row.setdefault("run", self.run)
        row["rounds"] = self.rounds  # this run's round count, never an earlier run's
        return row

    def _mark(self) -> None:
        """This run's ``run.json`` (and plan), and ``latest`` pointing at it: once, at its first write."""
        if self._marked or self.run is None:
            return
        import time

        self._marked = True
        kept = self.folder / RUN_FILE
        if not kept.is_file():
            atomic_write_text(kept, json.dumps({"run": self.run, "site": self.site, "rounds": self.rounds,
                                                "started": time.time(), **self.facts}, indent=2) + "\n")
        if self.plan is not None:
            atomic_write_text(self.folder / PLAN_FILE, json.dumps(self.plan, indent=2, sort_keys=True) + "\n")
        point_latest(self.site_folder, self.folder.name)

    def evaluated(self, after: int, metrics: dict[str, float], samples: int, sent_bytes: int) -> None:
        """The ``evaluate`` task's result: the model after round ``after`` (what the site received at
        the start of round ``after + 1``, or after the last round), scored on its held-out split."""
        row = self.row(after)
        row["evaluation"] = {k: _number(v) for k, v in sorted(metrics.items())}
        row["accuracy"] = row["evaluation"].get("accuracy")
        row["personal_accuracy"] = row["evaluation"].get("local_accuracy")
        # the same model on the part of its training data the site holds out (tuning, the best round)
        row["val_accuracy"] = row["evaluation"].get("val_accuracy")
        row["held_out_samples"] = samples
        row.setdefault("bytes_sent_by_task", {})["evaluate"] = sent_bytes
        self._write()

    def trained(self, round_num: int, task: str, metrics: dict[str, float], received_bytes: int, sent_bytes: int,
                epsilon: dict[str, float]) -> None:
        """A plugin task's result in round ``round_num`` (a redone task replaces its first attempt's figures)."""
        row = self.row(round_num)
        row.setdefault("training", {}).update({f"{task}_{k}": _number(v) for k, v in sorted(metrics.items())})
        if task == "train" and "accuracy" in metrics:  # on its own training data, over the last local epoch
            row["train_accuracy"] = _number(metrics["accuracy"])
        row["bytes_received"] = received_bytes
        row.setdefault("bytes_sent_by_task", {})[task] = sent_bytes
        if epsilon:  # cumulative after this task: the round's last task has the round's figures
            row["epsilon_round"] = _number(epsilon.get("dp_epsilon_round", 0.0))
            row["epsilon_spent"] = _number(epsilon.get("dp_epsilon", 0.0))
        self._write()

    def finish(self, round_num: int) -> None:
        """Round ``round_num``'s row is complete (its model scored): the plot, and one line in the log."""
        row = self.row(round_num)
        curves = {"what it received": [self.rows.get(r, {}).get("accuracy") for r in range(1, self.rounds + 1)]}
        if any(r.get("personal_accuracy") is not None for r in self.rows.values()):
            curves["its personal model"] = [self.rows.get(r, {}).get("personal_accuracy")
                                            for r in range(1, self.rounds + 1)]
        if any(c is not None for curve in curves.values() for c in curve):
            from ..outputs import plot_curves

            plot_curves(self.folder / PLOT_FILE, curves, title=f"{self.site}: accuracy on its own held-out data",
                        ylabel="held-out accuracy at this site")
        logger.info("%s", format_row(row, self.site))

    def _write(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._mark()
        rows = [self.rows[r] for r in sorted(self.rows)]
        for row in rows:
            row["bytes_sent"] = sum(row.get("bytes_sent_by_task", {}).values())
            row["epsilon_budget"] = self.budget
            if self.threads is not None:
                row["threads"] = self.threads
        atomic_write_text(self.folder / ROWS_FILE, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "evaluation": json.dumps(row.get("evaluation", {}), separators=(",", ":")),
                             "training": json.dumps(row.get("training", {}), separators=(",", ":"))})
        atomic_write_text(self.folder / CSV_FILE, text.getvalue())


def point_latest(site_folder: Path, name: str) -> None:
    """``site_folder/latest`` → ``name`` (a relative symbolic link, replaced atomically)."""
    link = site_folder / LATEST
    try:
        if link.is_symlink() and os.readlink(link) == name:
            return
        temporary = site_folder / f".{LATEST}.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        os.symlink(name, temporary)
        os.replace(temporary, link)
    except OSError as exc:  # a file system without links: readers take the newest run folder
        logger.warning("%s could not point at the run %s (%s); the newest run folder is read instead", link, name, exc)


def format_row(row: dict[str, Any], site: str) -> str:
    """One line: ``hosp1, round 2/2 (final model): held-out accuracy 0.8123 …``."""
    r = row["round"]
    label = "final model" if r >= row["rounds"] else "initial model" if r == 0 else f"model after round {r}"
    parts = []
    if row.get("accuracy") is not None:
        personal = row.get("personal_accuracy")
        parts.append(f"held-out accuracy {row['accuracy']:.4f}" + (f" (personal model {personal:.4f})"
                                                                      if personal is not None else "")
                     + (f", validation {row['val_accuracy']:.4f}" if row.get("val_accuracy") is not None else ""))
    parts.append(f"received {row.get('bytes_received', 0) / 1e6:.3g} MB, sent {row.get('bytes_sent', 0) / 1e6:.3g} MB")
    if row.get("epsilon_spent") is not None:
        budget = row.get("epsilon_budget")
        parts.append(f"ε this round {row['epsilon_round']:.4g} (its steps alone), spent so far "
                     f"{row['epsilon_spent']:.4g}" + (f" of budget {budget:g}" if budget is not None else ""))
    return f"{site}, round {row['round']}/{row['rounds']} ({label}): {'; '.join(parts)}"


def write_final_model(folder: str | Path, *, site: SiteContext, config: RunConfig, shape: dict[str, int],
                      model: torch.nn.Module, received: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
    """The final round's model at the site, and what loads and scores it. ``model`` already holds
    the received weights (when the plugin sends any)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"received": FINAL_RECEIVED, "state": FINAL_STATE, "config": CONFIG_FILE}
    if any(name.startswith(WEIGHT_PREFIX) for name in received):
        atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, folder / FINAL_MODEL)
        files["model"] = FINAL_MODEL
    atomic_torch_save({k: v.detach().cpu() for k, v in received.items()}, folder / FINAL_RECEIVED)
    atomic_torch_save(_to_cpu(site.state), folder / FINAL_STATE)
    atomic_write_text(folder / CONFIG_FILE, yaml.safe_dump(config.to_dict(), sort_keys=False))
    info = {"site": site.name, "round": site.round_num - 1, "algorithm": config.algorithm, "model": config.model,
            "model_shape": dict(shape), "index": site.index, "seed": site.seed, "files": files,
            "evaluation": {k: _number(v) for k, v in sorted(metrics.items())}}
    atomic_write_text(folder / FINAL_INFO, json.dumps(info, indent=2) + "\n")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist (a site writes it in the federation's final round)") from None
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}); "
                              "it is not a final model a site wrote") from None


def load_final_model(folder: str | Path) -> tuple[ContrastiveNet, RunConfig, dict[str, Any]]:
    """The run's model with the final weights loaded (the initial model where the plugin sends none,
    e.g. FedPCL), its run configuration and ``final_model.json``."""
    from ..construction import initial_model

    folder = report_folder(folder)  # a site's report folder: its latest run's
    info_path = folder / FINAL_INFO
    if not info_path.is_file():
        raise CheckpointError(f"{info_path} does not exist: no final round has reached this site yet")
    from ..yamlio import load_yaml_file, read_json

    info = read_json(info_path, "the final model's record")
    config = RunConfig.from_dict(load_yaml_file(folder / info["files"]["config"], "the final model's configuration"))
    model = initial_model(config, **info["model_shape"])
    if "model" in info["files"]:
        model.load_state_dict(_load(folder / info["files"]["model"]))
    return model, config, info


def measure_held_out(algorithm: Any, site: SiteContext, received: dict[str, torch.Tensor], test: Any,
                     validation: Any = None) -> dict[str, float]:
    """What a site measures of what it received: the plugin's ``evaluate_at_site`` on its held-out
    split ``test`` and, given its validation part, the same there (``val_`` before each name, and
    ``val_samples``)."""
    measured = dict(algorithm.evaluate_at_site(site, received, test))
    if validation is not None:
        measured.update({f"val_{k}": v for k, v in algorithm.evaluate_at_site(site, received, validation).items()})
        measured["val_samples"] = float(len(validation))
    return measured


def score_final_model(folder: str | Path, train: Any, test: Any, *, public: Any = None,
                      device: str | torch.device | None = "cpu", validation: Any = None) -> dict[str, float]:
    """Score the final model in ``folder`` as the site did in its final round (the plugin's
    ``evaluate_at_site`` with the same state and seed): ``train`` and ``test`` are the site's own
    splits (FLESD's probe trains on ``train``), ``validation`` its validation part (scored too when
    given), ``public`` the plan's public set when it has one; ``device`` None: the run's own device
    setting."""
    from ..construction import build_algorithm_with_public
    from ..devices import resolve_device

    folder = report_folder(folder)
    model, config, info = load_final_model(folder)
    algorithm = build_algorithm_with_public(config, public)
    device = resolve_device(config.device) if device is None else torch.device(device)
    site = SiteContext(name=info["site"], data=train, model=model.to(device), training=config.training,
                       round_num=info["round"], seed=info["seed"], device=device,
                       state=_load(folder / info["files"]["state"]), public=public, index=info["index"])
    received = {k: v.to(device) for k, v in _load(folder / info["files"]["received"]).items()}
    return measure_held_out(algorithm, site, received, test, validation)


def snapshot(model: torch.nn.Module, received: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``model`` holding the received weights: what the final evaluation scores (a plugin's
    evaluation may load other weights into the shared model afterwards, e.g. FedSiam's local model)."""
    final = copy.deepcopy(model)
    load_weights(final, received)
    return final



def score_in_workspace(workspace: str | Path, name: str | None = None) -> tuple[str, dict[str, float], dict[str, Any]]:
    """Score the final model a site took home on its own held-out split, read by the data loader
    its collaborator uses (the plan's ``data_loader`` settings and its ``plan/data.yaml`` line, with
    the workspace as the folder relative paths start from). Returns the site's name, the scores and
    its report's row for the final round (``final_model.json``'s figures when the row is missing)."""
    import os

    from ..deploy.workspace import SHARD_PREFIX, load_plan_file, read_data_lines
    from .data import SiteData

    ws = Path(workspace).resolve()
    site_folder = pick_site_report(ws, name)
    name = site_folder.name
    folder = report_folder(site_folder)  # its latest run's
    if not (folder / FINAL_INFO).is_file():
        done = [r for r in read_rows(folder) if r.get("evaluation") is not None]
        last = (f"the last model it scored is the one after round {done[-1]['round']} of {done[-1]['rounds']}"
                if done else "no model scored yet")
        raise ConfigError(f"{folder} holds no final model yet ({last}): a site takes the final model home in the "
                          "federation's final round; score it once the federation has finished")
    settings = load_plan_file(ws / "plan" / "plan.yaml").get("data_loader", {}).get("settings") or {}
    data_file = ws / "plan" / "data.yaml"
    data = (read_data_lines(data_file) if data_file.is_file() else {}).get(name)
    if data is None:
        raise ConfigError(f"{ws / 'plan' / 'data.yaml'} has no line for {name}, so its held-out data is not known "
                          f"here: add {name},PATH_TO_ITS_IMAGES")
    if not data.startswith(SHARD_PREFIX) and not (ws / data).is_dir():  # ws / an absolute path is that path
        raise ConfigError(f"{name}'s data folder {ws / data} (plan/data.yaml: {name},{data}) does not exist: the "
                          "final model is scored on the held-out split of the folder the site trained with")
    before = os.getcwd()
    os.chdir(ws)  # the plan's relative paths (data, public folder, backbone files) are the workspace's
    try:
        loader = SiteData(data_path=data, run_config=settings.get("run_config"),  # SiteRefusal: one sentence
                          network=settings.get("network"), model_shape=settings.get("model_shape"))
        scored = score_final_model(folder, loader.train, loader.test, public=loader.public, device=None,
                                   validation=loader.validation)
    finally:
        os.chdir(before)
    from ..yamlio import read_json

    info = read_json(folder / FINAL_INFO, "the final model's record")
    by_round = {r["round"]: r for r in read_rows(folder)}
    reported = by_round.get(info["round"]) or {"round": info["round"], "evaluation": info.get("evaluation", {}),
                                           "accuracy": info.get("evaluation", {}).get("accuracy")}
    return name, scored, reported
