"""What a Flower folder holds, read without Flower (and without OpenFL): ``fedcontrast report`` and
``fedcontrast doctor`` on the operator's folder (``flower init``), its run folder (``run/``; the
simulator's run folders hold the same outputs) or a site's work folder (``--workdir``:
``site_report/<name>/<run>/``, ``local_state/``).

Only files are read (``deployment.json``, ``config.json``, ``sites.json``, ``certs/``, the run's
``metrics.csv``, ``rounds.jsonl``, ``summary.json``, ``progress.json``, ``outcome.json``), so a run
folder copied to any machine with fedcontrast can be reported there.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path
from typing import Any

from ..deploy.common import FAIL, OK, WARN, Check
from ..errors import ConfigError
from ..outputs import one_site
from ..site.report_checks import report_checks  # engine-free, shared with OpenFL's doctor (its home was here)

OPERATOR, RUN, SITE = "Flower operator's folder", "run folder", "Flower site's work folder"
RUN_FILES = ("progress.json", "outcome.json", "summary.json", "metrics.csv", "rounds.jsonl")


def folder_kind(folder: str | Path) -> str | None:
    """Which Flower folder ``folder`` is (:data:`OPERATOR`, :data:`RUN`, :data:`SITE`), None for
    none. A folder with an OpenFL plan (``plan/plan.yaml``) is never a Flower one."""
    path = Path(folder)
    if (path / "plan" / "plan.yaml").is_file():
        return None
    if (path / "deployment.json").is_file():
        return OPERATOR
    if any((path / name).is_file() for name in RUN_FILES[:3]) and (path / "metrics.csv").is_file() \
            or (path / "progress.json").is_file():  # a Flower run (or the simulator's: the same outputs)
        return RUN
    if site_reports(path) or any((path / "local_state").glob("*.run*.pt")):
        return SITE
    return None


def site_reports(workdir: Path) -> list[Path]:
    """A Flower site's reports in its work folder: ``site_report/<name>/``, one run folder each
    (``<name>/<run>/rounds.jsonl``), or from before per-run folders (``<name>/rounds.jsonl``)."""
    from ..site.report import REPORT_DIR, site_folders

    return site_folders(Path(workdir) / REPORT_DIR)


def run_folder(folder: Path) -> Path:
    """The run folder of an operator's folder (``run/``), or ``folder`` itself when it is one."""
    from .deploy import RUN_DIR

    return folder / RUN_DIR if (folder / "deployment.json").is_file() else folder


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError):
        raise ConfigError(f"{path} cannot be read as JSON: the run's file is damaged") from None
    return value if isinstance(value, dict) else {}


def _number(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if value != value else value  # NaN: not measured


def run_report(run: Path) -> list[str]:
    """The lines of ``fedcontrast report`` on a Flower run folder: a line per round (the sites'
    held-out accuracy of the model after it, weighted and each site's, who was left out), then the
    outcome and where the files are."""
    from ..jsonl import read_jsonl

    rows = []
    if (run / "metrics.csv").is_file():
        with (run / "metrics.csv").open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    records = {r.get("round"): r for r in read_jsonl(run / "rounds.jsonl", "the run's round records")} \
        if (run / "rounds.jsonl").is_file() else {}
    held = _json(run / "progress.json")
    summary, outcome = _json(run / "summary.json"), _json(run / "outcome.json")
    total = held.get("rounds") or summary.get("rounds_planned")
    evaluated = sorted({int(r["round"]) for r in rows if r.get("task") == "evaluate"} | set(map(int, records)))
    lines = []
    for r in evaluated:
        scores = {row["site"]: _number(row["accuracy"]) for row in rows
                  if row.get("task") == "evaluate" and int(row["round"]) == r}
        weighted = scores.pop("global", None)
        label = "final model" if total and r >= int(total) else f"model after round {r}"
        parts = [f"round {r}/{total or '?'}"]
        if weighted is not None:
            each = ", ".join(f"{s} {v:.4f}" for s, v in sorted(scores.items()) if v is not None)
            parts.append(f"sites' held-out accuracy of the {label} {weighted:.4f}"
                         + (f" (weighted by their held-out sizes; {each})" if len(scores) > 1 else
                            f" (1 site: {each})" if each else ""))
        excluded = (records.get(r) or {}).get("excluded") or {}
        if excluded:
            parts.append("left out: " + "; ".join(f"{s} ({why})" for s, why in sorted(excluded.items())))
        if (records.get(r) or {}).get("secure_sum_of"):
            parts.append(f"secure sum of {', '.join(records[r]['secure_sum_of'])}")
        if (records.get(r) or {}).get("withheld"):  # who kept which metrics in round r's replies (DP, policies)
            from ..privacy.releases import describe_withheld

            parts.append(describe_withheld(records[r]["withheld"]))
        if len(parts) > 1:
            lines.append(": ".join(parts[:2]) + "".join(f"; {p}" for p in parts[2:]))
    done = held.get("rounds_done", summary.get("rounds_completed", len(records)))
    if not lines and not done:
        raise ConfigError(f"{run} holds no finished round yet (no record in {run / 'rounds.jsonl'} nor "
                          f"{run / 'metrics.csv'}): report it once a round has finished")
    status = outcome.get("status") or ("finished" if summary and total and done >= int(total) else None)
    final = summary.get("final_accuracy", outcome.get("final_accuracy"))
    if status == "finished":
        best = summary.get("best_accuracy")
        last = max((int(r["round"]) for r in rows if r.get("task") == "evaluate" and r.get("site") == "global"),
                   default=None)
        sites = outcome.get("final_sites", sum(1 for r in rows if r.get("task") == "evaluate" and last is not None
                                                and r.get("site") != "global" and int(r["round"]) == last
                                                and _number(r.get("accuracy")) is not None))
        lines.append(f"finished: {done} of {total} rounds; the sites' held-out accuracy of the final model "
                     + ("n/a" if final is None else f"{final:.4f}{one_site(sites)}")
                     + (f" ({best:.4f} after round {summary.get('best_round')}, the round the sites' validation "
                        "parts pick)" if best is not None else ""))
    elif status == "failed":
        lines.append(f"stopped after {done} of {total} rounds: {outcome.get('error')} (continue it with --resume)")
    else:
        lines.append(f"{done} of {total or '?'} rounds done so far (running, or stopped: --resume continues it)")
    files = [n for n in ("metrics.csv", "summary.json", "rounds.jsonl", "accuracy.png") if (run / n).is_file()]
    lines.append(f"{', '.join(files) or 'no output files yet'} in {run}")
    return lines


def site_report_lines(workdir: Path, name: str | None) -> list[str]:
    """``fedcontrast report`` in a Flower site's work folder: each site report's rows (or ``name``'s)."""
    folders = {p.name: p for p in site_reports(workdir)}
    if name is not None and name not in folders:
        raise ConfigError(f"{workdir / 'site_report'} holds no report of {name} (it holds "
                          f"{', '.join(folders) or 'none'}): a site's report is written in its --workdir once its "
                          "first round has run")
    return report_lines([folders[name]] if name is not None else list(folders.values()))


def report_lines(site_folders: list[Path]) -> list[str]:
    """Each site report's rows (its latest run's), the files beside them and, where the folder holds
    several runs or a report from before per-run folders, one sentence saying so."""
    from ..site.report import describe_runs, format_row, read_rows, report_folder

    lines = []
    for site_folder in site_folders:
        folder = report_folder(site_folder)
        lines += [format_row(row, site_folder.name) for row in read_rows(folder)]
        files = ", ".join(p.name for p in sorted(folder.iterdir()) if p.is_file())
        lines.append(f"{site_folder.name}: {files} in {folder}")
        note = describe_runs(site_folder)
        if note:
            lines.append(note)
    return lines


# --- audit -------------------------------------------------------------------------------------------
def audit_plan_of(folder: Path, site: str | None = None) -> dict[str, Any]:
    """What ``fedcontrast audit`` audits in a Flower folder, as :func:`~fedcontrast.audit.report.audit_plan`'s
    arguments: the operator's plan (``config.json``; its run folder's, from the operator's folder above
    it), or the plan a site's latest run ran under (``site_report/<name>/<run>/plan.json``, with the
    transport its SuperNode ran with and its data folder, counted when it is on this machine)."""
    from ..construction import data_shape
    from ..site.report import PLAN_FILE, report_folder
    from .deploy import CERT_DIR

    folder = Path(folder)
    kind = folder_kind(folder)
    if kind == RUN:
        if not (folder.parent / "deployment.json").is_file():
            raise ConfigError(f"{folder} is a run folder without the operator's folder around it, which holds the plan "
                              "(config.json): audit the operator's folder")
        folder, kind = folder.parent, OPERATOR
    if kind == OPERATOR:
        from ..config import RunConfig

        if site is not None:
            raise ConfigError(f"--site {site}: {folder} is the Flower operator's folder, which holds no site's data; "
                              "audit the site's work folder (its --workdir) on its own machine")
        try:
            config = RunConfig.from_dict(_json(folder / "config.json"))
        except ConfigError as exc:
            raise ConfigError(f"{folder / 'config.json'}: {exc}") from None
        network = {"use_tls": True, "require_client_auth": True}  # the SuperLink: TLS, only registered node keys
        plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": network},
                "aggregator": {"settings": {"model_shape": data_shape(config), "rounds_to_train": config.rounds}}}
        return {"plan": plan, "workspace": folder, "cert_dir": folder / CERT_DIR,
                "source": f"{folder} (Flower operator's folder)"}
    if kind != SITE:
        raise ConfigError(f"{folder} is not a Flower folder with a plan")
    reports = {p.name: p for p in site_reports(folder)}
    if site is not None and site not in reports:
        raise ConfigError(f"{folder / 'site_report'} holds no report of {site} (it holds "
                          f"{', '.join(reports) or 'none'})")
    if site is None and len(reports) > 1:
        raise ConfigError(f"{folder / 'site_report'} holds the reports of {len(reports)} sites ({', '.join(reports)}); "
                          "say which one with --site")
    if not reports:
        raise ConfigError(f"{folder} holds no site report yet, so no plan a run of this site ran under: audit it once "
                          "the run's first message has reached the site")
    name, run = next(iter(reports.items())) if site is None else (site, reports[site])
    held = _json(report_folder(run) / PLAN_FILE)
    if not held.get("run_config"):
        raise ConfigError(f"{report_folder(run)} holds no {PLAN_FILE} (a report from before the plan was kept with "
                          "each run): audit the operator's folder, or this folder after the next run")
    config_dict = held["run_config"]
    from ..config import RunConfig

    shape = held.get("model_shape") or data_shape(RunConfig.from_dict(config_dict))
    plan = {"task_runner": {"settings": {"run_config": config_dict}},
            "network": {"settings": held.get("network") or {}},
            "aggregator": {"settings": {"model_shape": shape, "rounds_to_train": config_dict.get("rounds")}}}
    data = str(held.get("data") or "")
    here = bool(data) and Path(data).is_dir()
    return {"plan": plan, "workspace": folder, "sites": [(name, data or "its own folder (not here)")],
            "site": name if here else None, "cert_dir": folder,
            "source": f"{report_folder(run)} (the plan {name}'s latest run ran under, on Flower)"}


# --- doctor ------------------------------------------------------------------------------------------
def _certificate(path: Path, what: str, now: dt.datetime) -> tuple[Check, Any]:
    from ..deploy.certificates import load_certificates, out_of_date, subject

    if not path.is_file():
        return Check(what, FAIL, f"{path} is missing: make the deployment again with `fedcontrast flower init`"), None
    try:
        cert = load_certificates(path)[0]
    except (ConfigError, IndexError):
        return Check(what, FAIL, f"{path} is not a PEM certificate"), None
    late = out_of_date(cert, now)
    if late:
        return Check(what, FAIL, f"{path} ({subject(cert)}) {late}: make a new deployment folder (`flower init "
                                 "--pki-from` keeps the sites' keys)"), cert
    return Check(what, OK, f"{subject(cert)}, valid until {cert.not_valid_after_utc:%Y-%m-%d}"), cert


def _private_mode(path: Path, what: str) -> Check:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return Check(what, FAIL, f"{path} has permissions {mode:04o}: others on this machine may read it; run "
                                 f"`chmod 600 {path}`")
    return Check(what, OK, f"{path} readable by its owner only")


def operator_checks(folder: Path) -> list[Check]:
    """The operator's folder: its plan, the CA and the SuperLink's certificate (dates, signature,
    host name), the CA key's permissions, which sites are registered, the run folder's state."""
    from ..config import RunConfig, site_names
    from ..deploy.certificates import certificate_names, names_host, signed_by
    from .deploy import CERT_DIR, RUN_DIR, SITES_FILE

    now = dt.datetime.now(dt.timezone.utc)
    settings = _json(folder / "deployment.json")
    try:
        config = RunConfig.from_dict(_json(folder / "config.json"))
    except ConfigError as exc:
        return [Check("plan", FAIL, f"{folder / 'config.json'}: {exc}")]
    sites = site_names(config)
    checks = [Check("plan", OK, f"{config.algorithm}, {len(sites)} sites ({', '.join(sites)}), {config.rounds} rounds"
                                + (", secure aggregation" if config.secure_aggregation is not None else "")
                                + (f", DP ({', '.join(sorted(config.privacy.kinds))})" if config.privacy else ""))]
    ca_check, ca = _certificate(folder / CERT_DIR / "ca.crt", "CA", now)
    checks.append(ca_check)
    if (folder / CERT_DIR / "ca.key").is_file():
        checks.append(_private_mode(folder / CERT_DIR / "ca.key", "CA key"))
    link_check, link = _certificate(folder / CERT_DIR / "superlink.crt", "SuperLink certificate", now)
    host = str(settings.get("host", ""))
    if link is not None and ca is not None and not signed_by(link, [ca]):
        link_check = Check(link_check.name, FAIL, f"{folder / CERT_DIR / 'superlink.crt'} is not signed by the "
                                                  f"federation's CA {folder / CERT_DIR / 'ca.crt'}")
    elif link is not None and host and not names_host(certificate_names(link), host):
        link_check = Check(link_check.name, FAIL, f"it names {', '.join(certificate_names(link))}, not the "
                                                  f"SuperLink's address {host} the sites connect to")
    checks.append(link_check)
    nodes = _json(folder / SITES_FILE)
    missing = [s for s in sites if s not in nodes]
    carried = [s for s in missing if (folder / "keys" / f"{s}.pub").is_file()]
    if missing:
        how = (f"; {', '.join(carried)} carried over by --pki-from: `fedcontrast flower register {folder} --carried` "
               "with the SuperLink running" if carried else "")
        checks.append(Check("sites", WARN, f"registered: {', '.join(s for s in sites if s in nodes) or 'none'}; not "
                                           f"yet: {', '.join(missing)} (`fedcontrast flower register {folder} S.pub "
                                           f"--site S`){how}"))
    else:
        checks.append(Check("sites", OK, "every site's SuperNode key is registered: " + ", ".join(
            f"{s} {nodes[s].get('fingerprint', '?')[:23]}…" for s in sites)))
    held = _json(folder / RUN_DIR / "progress.json")
    outcome = _json(folder / RUN_DIR / "outcome.json")
    state = ("no run yet" if not held else f"{held.get('rounds_done')} of {held.get('rounds')} rounds done"
             + (f", {outcome['status']}" if outcome.get("status") else ""))
    checks.append(Check("run", OK, f"{state} ({folder / RUN_DIR}; `fedcontrast report {folder}`)"))
    return checks


def site_checks(workdir: Path, name: str | None) -> list[Check]:
    """A site's work folder: its reports, its state, any key file's permissions, a CA certificate's
    dates. (Its policy, the audit and its data are checked at the run's first message, and its key,
    CA and folders by ``fedcontrast flower supernode`` before it starts.)"""
    now = dt.datetime.now(dt.timezone.utc)
    reports = {p.name: p for p in site_reports(workdir)}
    if name is not None and name not in reports:
        return [Check("report", FAIL, f"{workdir / 'site_report'} holds no report of {name} (it holds "
                                      f"{', '.join(reports) or 'none'})")]
    checks = report_checks([folder for site, folder in reports.items() if name is None or site == name])
    states = sorted((workdir / "local_state").glob("*.run*.pt"))
    checks.append(Check("state", OK, f"{len(states)} run state file(s) in {workdir / 'local_state'}" if states
                        else "no run state kept here"))
    for key in sorted(workdir.glob("*.key")):
        checks.append(_private_mode(key, f"key {key.name}"))
    for ca in [p for p in (workdir / "ca.crt",) if p.is_file()]:
        checks.append(_certificate(ca, "CA", now)[0])
    checks.append(Check("before start", OK, "`fedcontrast flower supernode` checks this site's key, the CA and its "
                                            "folders before it starts; its policy, the audit and its data are checked "
                                            "at the run's first message, before any data is read"))
    return checks
