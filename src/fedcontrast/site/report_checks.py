"""``fedcontrast doctor``'s line per site report (``site_report/<name>/``), whatever engine wrote it:
the same check on a Flower site's work folder (:mod:`fedcontrast.flower.folders`) and an OpenFL
site's workspace (:mod:`fedcontrast.openfl.doctor`), read from files only."""

from __future__ import annotations

from pathlib import Path

from ..deploy.common import FAIL, OK, WARN, Check
from ..errors import ConfigError


def report_checks(site_folders: list[Path]) -> list[Check]:
    """A line per site report (``site_report/<name>/``): the latest run it reaches, and a problem where
    rows of several runs share one table (one sentence naming the file and the runs)."""
    from .report import describe_runs, mixed_runs, old_layout, read_rows, report_folder, run_folders

    checks = []
    for site_folder in site_folders:
        site = site_folder.name
        try:
            folder = report_folder(site_folder)
            rows = read_rows(folder)
        except ConfigError as exc:
            checks.append(Check("report", FAIL, f"{site}: {exc}"))
            continue
        mixed = [why for why in (mixed_runs(f) for f in [*run_folders(site_folder), *([site_folder] if old_layout(
            site_folder) else [])]) if why]
        if mixed:
            checks.append(Check("report", FAIL, f"{site}: {'; '.join(mixed)}: its rounds.csv mixes experiments; move "
                                                "that folder away (each run now writes its own folder, "
                                                f"{site_folder}/<run>/)"))
            continue
        last = f"round {rows[-1]['round']} of {rows[-1]['rounds']}" if rows else "no round yet"
        final = " and the final model" if (folder / "final_model.json").is_file() else ""
        run = f"run {rows[-1]['run']}: " if rows and rows[-1].get("run") else ""
        note = describe_runs(site_folder)
        checks.append(Check("report", WARN if old_layout(site_folder) else OK,
                            f"{site}: {run}its report reaches {last}{final} ({folder})"
                            + (f"; {note}" if note else "")))
    return checks
