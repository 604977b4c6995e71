"""A site's report folder, read (:mod:`.report` writes it): ``site_report/<name>/<run>/``, one run
folder per run, ``site_report/<name>/latest`` pointing at the run written last (:func:`report_folder`
follows it, or takes the newest run folder where a copy lost the link), a folder from before per-run
folders (:func:`old_layout`), the rows of a run (:func:`read_rows`), a table whose rows come from
several runs (:func:`mixed_runs`), and the sites' report folders under a ``site_report/`` folder or in
a workspace (:func:`site_folders`, :func:`pick_site_report`). Imports neither torch nor any engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError, FedContrastError

REPORT_DIR = "site_report"  # beside the state folder: local_state/site_report/<name>/
ROWS_FILE = "rounds.jsonl"
FINAL_INFO = "final_model.json"
RUN_FILE = "run.json"  # which run a run folder holds (run id, site, engine, start, rounds)
LATEST = "latest"  # site_report/<name>/latest: a symbolic link to the run folder written last


def run_folder_name(run: str) -> str:
    """The folder name of run ``run`` (letters, digits, ``-``, ``_`` and ``.`` of it; never a path)."""
    name = "".join(c for c in str(run) if c.isalnum() or c in "-_.").lstrip(".")[:80]
    return name if name and name != LATEST else "run"


def run_folders(site_folder: str | Path) -> list[Path]:
    """The run folders under a site's report folder (``site_report/<name>/<run>/`` holding a
    ``rounds.jsonl``), oldest first (by when their rows were last written)."""
    root = Path(site_folder)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name != LATEST and not p.is_symlink() and (p / ROWS_FILE).is_file()]
    return sorted(found, key=lambda p: ((p / ROWS_FILE).stat().st_mtime, p.name))


def old_layout(site_folder: str | Path) -> bool:
    """``site_folder`` holds a report written before reports were kept per run (``rounds.jsonl`` in it)."""
    return (Path(site_folder) / ROWS_FILE).is_file() and not (Path(site_folder) / RUN_FILE).is_file()


def report_folder(folder: str | Path) -> Path:
    """The folder a site's report is in: a site's report folder's ``latest`` run (the link, or the
    newest run folder where a copy lost the link), else ``folder`` itself (a run folder, or a table
    from before per-run folders, or none)."""
    folder = Path(folder)
    latest = folder / LATEST
    if latest.is_dir() and ((latest / ROWS_FILE).is_file() or (latest / FINAL_INFO).is_file()):
        return latest
    if (folder / ROWS_FILE).is_file() or (folder / FINAL_INFO).is_file():
        return folder
    runs = run_folders(folder)
    return runs[-1] if runs else folder


def read_rows(folder: str | Path) -> list[dict[str, Any]]:
    """The rows of ``rounds.jsonl`` in ``folder`` (a run folder, or a site's report folder: its latest
    run's), in round order (empty when there are none)."""
    return _read_table(report_folder(folder))


def _read_table(folder: Path) -> list[dict[str, Any]]:
    """The rows of ``folder/rounds.jsonl`` itself, in round order."""
    from ..jsonl import read_jsonl

    rows = {row["round"]: row for row in read_jsonl(Path(folder) / ROWS_FILE, "the site's round report")
            if isinstance(row, dict) and isinstance(row.get("round"), int)}
    return [rows[r] for r in sorted(rows)]


def mixed_runs(folder: str | Path) -> str | None:
    """Why the rows of the report in ``folder`` (a run folder, or a site's latest) come from more than
    one run (None: one run, or none): rows labelled with several runs, or — in a folder from before
    per-run folders, whose rows carry no run — rows that plan different round counts."""
    path = Path(folder) if (Path(folder) / ROWS_FILE).is_file() else report_folder(folder)  # its own table
    try:
        rows = _read_table(path)
    except FedContrastError:
        return None  # unreadable: said by whoever reads it
    runs = sorted({str(r["run"]) for r in rows if r.get("run") is not None})
    unlabelled = [r["round"] for r in rows if r.get("run") is None]
    if len(runs) > 1 or (runs and unlabelled):
        named = ", ".join(runs) + (" and rows without a run" if runs and unlabelled else "")
        return f"{path / ROWS_FILE} holds rows of {len(runs) + bool(runs and unlabelled)} runs ({named})"
    counts = sorted({int(r["rounds"]) for r in rows if isinstance(r.get("rounds"), int)})
    if not runs and len(counts) > 1:
        return (f"{path / ROWS_FILE} holds rows of at least {len(counts)} runs (rows planning "
                f"{' and '.join(map(str, counts))} rounds, with no run label)")
    return None


def site_folders(root: str | Path) -> list[Path]:
    """The sites' report folders under ``root`` (a ``site_report/`` folder): ``<name>/`` holding a run
    folder with a ``rounds.jsonl``, or one itself (the layout from before per-run folders)."""
    root = Path(root)
    found = {p.parent for p in root.glob(f"*/{ROWS_FILE}")} | {p.parent.parent for p in root.glob(f"*/*/{ROWS_FILE}")}
    return sorted(found)


def site_report_folders(workspace: str | Path) -> list[Path]:
    """The site reports in a workspace made by ``fedcontrast workspace create`` (one per collaborator
    that ran there): each site's report folder, ``local_state/site_report/<name>/``."""
    return site_folders(Path(workspace) / "local_state" / REPORT_DIR)


def describe_runs(site_folder: str | Path) -> str | None:
    """One sentence about the runs a site's report folder holds, when it is not simply one run in its
    own folder: several runs (which one is shown), or the layout from before per-run folders."""
    site_folder = Path(site_folder)
    runs = run_folders(site_folder)
    notes = []
    if old_layout(site_folder):
        notes.append(f"{site_folder / ROWS_FILE} is a report from before reports were kept per run: its rows carry "
                     f"no run label (rows of several experiments may be mixed in it); later runs write to "
                     f"{site_folder}/<run>/")
    if len(runs) > 1 or (runs and notes):
        shown = report_folder(site_folder).resolve()
        notes.append(f"{site_folder} holds {len(runs)} run{'s' if len(runs) > 1 else ''} "
                     f"({', '.join(p.name for p in runs)}); shown: {shown.name}, the latest ({site_folder / LATEST})")
    return "; ".join(notes) or None


def pick_site_report(workspace: str | Path, name: str | None = None) -> Path:
    """The site report folder of ``name`` in a workspace, or of the one site that has one there."""
    ws = Path(workspace)
    folders = {p.name: p for p in site_report_folders(ws)}
    root = ws / "local_state" / REPORT_DIR
    if name is not None:
        if name not in folders:
            held = f"it holds {', '.join(folders)}'s" if folders else "it holds none"
            raise ConfigError(f"{root} holds no report of {name} ({held}): a site's report is written in its own "
                              "workspace once its first round has run there")
        return folders[name]
    if not folders:
        raise ConfigError(f"{ws} holds no site report under {root}: run this in a site's workspace once the "
                          "federation has run there")
    if len(folders) > 1:
        raise ConfigError(f"{root} holds the reports of {len(folders)} sites ({', '.join(folders)}); say which one "
                          "with --name")
    return next(iter(folders.values()))
