"""Run a whole federation on this machine with the stock ``fx`` commands, and watch it.

``fx plan initialize`` once, then ``fx aggregator start`` and one ``fx collaborator start -n NAME``
per collaborator, each its own OS process talking mutual TLS over localhost. Progress is read from
the aggregator's ``save/rounds.jsonl``; if any process fails, the others are stopped and the reason
is reported in one sentence.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FedContrastError
from ..threads import SHARED_ENV, Threads, choose_threads, party_env, usable_cores
from .fx import collaborator_names, fx_executable, read_workspace_config
from .records import FINAL_DOWNLINK, FINAL_MODEL, ROUNDS_FILE, describe_withheld, metric_kind


class FederationFailed(FedContrastError):
    """A party of the federation exited with an error; the message says which and why."""

    exit_code = 1


def _env(threads: int | Threads | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a party: ``threads`` handed on (:func:`fedcontrast.threads.party_env`; a bare
    number counts as the user's)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(extra or {})}
    if threads is not None:
        choice = threads if isinstance(threads, Threads) else Threads(int(threads), usable_cores(), given=True)
        env.pop(SHARED_ENV, None)
        env.update(party_env(choice))
    return env


def federation_threads(collaborators: int, given: int | None = None) -> Threads:
    """Each party's threads when the aggregator and ``collaborators`` collaborators all run on this
    machine at once (:func:`fedcontrast.threads.choose_threads`: ``given``, else the cores this process
    may use, divided among them). Several processes each using every core fight over them (OpenMP
    spin-waits); one share each is faster. The count changes the last bits of float sums: a simulator
    run matches a federation bit for bit only at the same count."""
    return choose_threads(given, parties=max(1, collaborators) + 1)


def threads_per_collaborator(collaborators: int) -> int:
    """The thread count of each party of :func:`federation_threads`."""
    return federation_threads(collaborators).threads


def initialize_plan(workspace: Path) -> None:
    proc = subprocess.run([fx_executable(), "plan", "initialize"], cwd=workspace, env=_env(), capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=600)
    if proc.returncode != 0 or not (workspace / "save" / "init.pbuf").exists():
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        raise FederationFailed(f"'fx plan initialize' failed in {workspace} (exit {proc.returncode}): {tail}")


def read_rounds(workspace: Path) -> list[dict[str, Any]]:
    from ..jsonl import read_jsonl

    return read_jsonl(workspace / "save" / ROUNDS_FILE, "the aggregator's round records")


def failure_reason(log_path: Path) -> str:
    """The last line a fedcontrast component wrote as an error, else the log's last line."""
    if not log_path.exists():
        return "no log was written"
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "fedcontrast" in line and "error:" in line:
            return line.split("error:", 1)[1].strip()
    if (lines and lines[-1].startswith("KeyError:")
            and any("cols_data_paths[collaborator_name]" in line for line in lines)):
        name = lines[-1].split(":", 1)[1].strip().strip("'\"")  # OpenFL found no data line for this name
        return (f"plan/data.yaml has no line for collaborator {name}: add one ({name},PATH to its data), e.g. "
                "with `fedcontrast site join`")
    for line in reversed(lines):
        if "No such file" in line and "cert/" in line:
            return (f"a certificate or key file is missing ({line.rsplit(':', 1)[-1].strip()}): make this "
                    "party's certificate with the PKI steps before starting it")
    return lines[-1] if lines else "its log is empty"


def start(workspace: Path, args: list[str], log_name: str, threads: int | Threads | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """``fx ARGS`` in ``workspace``, logging to ``logs/LOG_NAME``; ``env``: variables added to this one
    process's environment (e.g. a site's own ``FEDCONTRAST_SITE_POLICY``)."""
    with open(workspace / "logs" / log_name, "a") as log:
        return subprocess.Popen([fx_executable(), *args], cwd=workspace, env=_env(threads, env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop_all(processes: dict[str, subprocess.Popen], grace: float = 10.0) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in processes.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _log_path(ws: Path, party: str) -> Path:
    return ws / "logs" / ("aggregator.log" if party == "aggregator" else f"{party}.log")


def _explain_failure(ws: Path, processes: dict[str, subprocess.Popen], failed: list[str]) -> str:
    """The root cause: when the aggregator stops a failed federation, collaborators exit first
    saying only that; give the aggregator a moment and report its reason instead."""
    aggregator = processes["aggregator"]
    if "aggregator" not in failed:
        try:
            aggregator.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        if aggregator.poll() not in (None, 0):
            failed = ["aggregator"]
    party = failed[0]
    who = "the aggregator" if party == "aggregator" else f"collaborator {party}"
    code = processes[party].poll()
    log = _log_path(ws, party)
    return f"{who} exited with code {code}: {failure_reason(log)} (log: {log})"


def run_federation(workspace: str | Path, *, timeout: float = 3600, poll: float = 0.1,
                   on_round: Callable[[dict[str, Any]], None] | None = None,
                   collaborators: list[str] | None = None, threads: Threads | None = None) -> list[dict[str, Any]]:
    """Start the aggregator and the collaborators of ``workspace`` and wait for the end (``threads``:
    each party's, default :func:`federation_threads`).

    Returns the per-round records (``save/rounds.jsonl``). Raises :class:`FederationFailed` naming
    the party that failed (the others are stopped) or on ``timeout``.
    """
    ws = Path(workspace)
    config = read_workspace_config(ws)
    names = collaborators if collaborators is not None else collaborator_names(ws)
    (ws / "logs").mkdir(exist_ok=True)
    threads = threads or federation_threads(len(names))
    processes = {"aggregator": start(ws, ["aggregator", "start"], "aggregator.log", threads)}
    for name in names:
        processes[name] = start(ws, ["collaborator", "start", "-n", name], f"{name}.log", threads)
    seen = len(read_rounds(ws))
    deadline = time.monotonic() + timeout
    try:
        while True:
            records = read_rounds(ws)
            for record in records[seen:]:
                if on_round is not None:
                    on_round(record)
            seen = len(records)
            failed = [party for party, proc in processes.items() if proc.poll() not in (None, 0)]
            if failed:
                raise FederationFailed(_explain_failure(ws, processes, failed))
            if all(proc.poll() == 0 for proc in processes.values()):
                break
            if time.monotonic() > deadline:
                raise FederationFailed(f"the federation did not finish within {timeout:.0f} s; logs in {ws / 'logs'}")
            time.sleep(poll)
    finally:
        stop_all(processes)
    records = read_rounds(ws)
    for record in records[seen:]:
        if on_round is not None:
            on_round(record)
    if len(records) < config.rounds:
        raise FederationFailed(f"the federation ended after {len(records)} of {config.rounds} rounds; "
                               f"logs in {ws / 'logs'}")
    check_records(ws, records, config.rounds)
    return records


def check_records(ws: Path, records: list[dict[str, Any]], rounds: int) -> None:
    """Refuse to report a federation whose aggregator lost a round's end (its model export and
    record, e.g. to a full disk) after its database had already moved past that round: a resume
    cannot redo it, and exporting would hand out an earlier round's model as the final one."""
    lost = [r["round"] for r in records if "trained_at" not in r]
    if [r["round"] for r in records] != list(range(1, rounds + 1)) or lost:
        which = f"round(s) {', '.join(map(str, lost))}" if lost else "some rounds"
        raise FederationFailed(f"the federation ran to its end, but the aggregator never wrote the results of {which} "
                               "(the model export and record failed, e.g. on a full disk; see "
                               f"{ws / 'logs' / 'aggregator.log'}), so {ws / 'save'} does not hold the final model: "
                               "run the federation afresh with --overwrite")


def site_curves(records: list[dict[str, Any]], key: str = "accuracy") -> dict[str, list[float | None]]:
    """Each site's evaluation ``key`` per round (None where it did not report)."""
    sites = sorted({s for r in records for s in r.get("sites", {})})
    return {s: [r.get("sites", {}).get(s, {}).get("evaluation", {}).get(key) for r in records] for s in sites}


def format_round(record: dict[str, Any]) -> str:
    """One progress line: the aggregator's own test accuracy (when it has test data, else why not) and
    every site's accuracy on its own held-out data, with their weighted mean (over the sites that
    released theirs), and which sites withheld which kinds of metrics."""
    parts = [f"round {record['round']}/{record['rounds']}"]
    if record.get("accuracy") is not None:
        parts.append(f"global test accuracy {record['accuracy']:.4f}")
    elif record.get("no_global_accuracy"):
        parts.append(f"no global accuracy ({record['no_global_accuracy']})")
    sites = {s: v["evaluation"]["accuracy"] for s, v in record.get("sites", {}).items()
             if "accuracy" in v.get("evaluation", {})}
    if sites:
        parts.append("sites' held-out accuracy " + " ".join(f"{s} {a:.4f}" for s, a in sites.items())
                     + (f" (weighted mean over {len(sites)} sites {record['site_accuracy']:.4f})" if len(sites) > 1
                        else ""))  # one site's number is no mean
    elif record.get("sites") and not record.get("incomplete"):
        parts.append("no site released its held-out accuracy")
    if record.get("site_val_accuracy") is not None:
        parts.append(f"validation {record['site_val_accuracy']:.4f}")
    if record.get("withheld"):
        parts.append(describe_withheld(record["withheld"]))
    if record.get("absent"):
        parts.append(f"without {', '.join(record['absent'])}")
    if record.get("not_evaluated"):  # RoundReport.write_record: a site whose evaluation of the model is not in it
        missing = ", ".join(record["not_evaluated"])
        parts.append(f"incomplete: the federation stopped before {missing} evaluated this model"
                     if record.get("incomplete")
                     else f"not evaluated by {missing} (no answer in time)")
    return "  ".join(parts)


def null_reasons(records: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, str]:
    """Why each null value of ``summary`` (see :func:`export_results`) is null, one sentence each:
    ``final_site_accuracy.SITE`` for a site's, ``plot`` for a missing accuracy.png."""
    if not records:
        return {k: "no round has finished yet" for k in ("final_accuracy", "best_round", "final_site_accuracy_mean",
                                                           "final_model", "plot")}
    last, why = records[-1], {}
    no_global = next((r["no_global_accuracy"] for r in reversed(records) if r.get("no_global_accuracy")), None)
    if summary["final_accuracy"] is None:
        why["final_accuracy"] = (last.get("no_global_accuracy")
                                 or "the last round's record holds no global test accuracy")
    if summary["best_round"] is None:
        why["best_round"] = ("no site released a validation accuracy (validation_fraction 0, or every site withheld "
                             "its evaluation): the best round is chosen on validation data only, never on test data")
    elif summary["best_accuracy"] is None:
        why["best_accuracy"] = no_global or "the round validation picks holds no global test accuracy"
    kept = {s: [n for n in names if metric_kind(n) == "evaluation"] for s, names in last.get("withheld", {}).items()}
    kept = {s: names for s, names in kept.items() if names}
    for site, value in summary["final_site_accuracy"].items():
        if value is None:
            why[f"final_site_accuracy.{site}"] = (
                f"{site} withheld its evaluation metrics (its policy; under DP the default)" if site in kept else
                f"{site} did not answer in the last round" if site in last.get("absent", []) else
                f"{site} sent no accuracy for the final model")
    if summary["final_site_accuracy_mean"] is None:
        why["final_site_accuracy_mean"] = "no site released its held-out accuracy for the final model" + (
            f" ({describe_withheld(kept)})" if kept else "")
    if summary["final_model"] is None:
        why["final_model"] = ("the global downlink holds no model weights (the plugin shares other tensors: see "
                              "final_downlink)")
    if summary["plot"] is None:
        why["plot"] = "nothing to plot: no global test accuracy ({}) and no site released its held-out accuracy".format(
            no_global or "none recorded")
    return why


def export_results(workspace: str | Path, out_dir: str | Path, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy the final model and write accuracy.png (the aggregator's test accuracy when it has test
    data, every site's held-out accuracy and their sample-weighted mean), rounds.csv and
    summary.json into ``out_dir`` (``facts``: recorded in it too, e.g. each party's threads)."""
    from ..outputs import best_by_validation, plot_curves, write_json

    ws, out = Path(workspace), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = read_workspace_config(ws)
    records = read_rounds(ws)
    for name in (FINAL_MODEL, FINAL_DOWNLINK):  # FedPCL-like plugins have no global model, only prototypes
        if (ws / "save" / name).exists():
            shutil.copyfile(ws / "save" / name, out / name)
    curve = [r.get("accuracy") for r in records]
    mean_curve = [r.get("site_accuracy") for r in records]
    per_site = site_curves(records)
    with open(out / "rounds.csv", "w") as f:
        f.write("round,accuracy,loss,site_accuracy" + "".join(f",{s}_accuracy" for s in per_site) + "\n")
        for i, r in enumerate(records):
            cells = [r["round"], r.get("accuracy"), r.get("loss"), r.get("site_accuracy"),
                     *(per_site[s][i] for s in per_site)]
            f.write(",".join("" if c is None else str(c) for c in cells) + "\n")
    curves: dict[str, list[float | None]] = {}
    styles: dict[str, dict[str, Any]] = {}
    if any(a is not None for a in curve):
        curves["global model (aggregator's test split)"] = curve
        styles["global model (aggregator's test split)"] = {"color": "black", "linewidth": 2.2}
    if any(a is not None for a in mean_curve):
        curves["sites, weighted mean"] = mean_curve
        styles["sites, weighted mean"] = {"color": "black", "linestyle": "--", "linewidth": 2.2}
    for s, values in per_site.items():
        if any(a is not None for a in values):  # a site that withheld every evaluation has no line
            curves[s] = values
            styles[s] = {"linewidth": 1.0, "alpha": 0.8}
    plot = out / "accuracy.png"
    if curves:
        plot_curves(plot, curves, styles=styles, ylabel="accuracy",
                    title=f"{config.algorithm}: {config.clients} sites, OpenFL with mutual TLS")
    else:  # an empty plot says nothing; summary.json says why there is none
        plot.unlink(missing_ok=True)
    final_sites = {s: v[-1] for s, v in per_site.items()} if records else {}
    validation = [r.get("site_val_accuracy") for r in records]  # the sites' validation parts, weighted
    best = best_by_validation(validation)  # the round validation picks; the test curve never chooses
    summary = {"algorithm": config.algorithm, "dataset": config.dataset, "collaborators": config.clients,
               "rounds_completed": len(records), "final_accuracy": curve[-1] if curve else None,
               "final_val_accuracy": validation[-1] if validation else None,
               "best_round": records[best]["round"] if best is not None else None,
               "best_val_accuracy": validation[best] if best is not None else None,
               "best_accuracy": curve[best] if best is not None else None,
               "best_site_accuracy": mean_curve[best] if best is not None else None,
               "final_site_accuracy": final_sites, "final_site_accuracy_mean": mean_curve[-1] if records else None,
               "final_model": str(out / FINAL_MODEL) if (out / FINAL_MODEL).exists() else None,
               "final_downlink": str(out / FINAL_DOWNLINK), "accuracy_curve": curve,
               "site_accuracy_curve": mean_curve, "val_accuracy_curve": validation,
               "plot": str(plot) if curves else None}
    summary["why_null"] = null_reasons(records, summary)
    summary.update(facts or {})
    write_json(out / "summary.json", summary)
    return summary
