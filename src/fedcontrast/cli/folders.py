"""``report`` and ``doctor`` on whatever folder they are given: an OpenFL workspace (the aggregator's or
a site's), a Flower operator's folder or its run folder, a Flower site's work folder. The kind is read
off the files; a Flower folder is read without importing OpenFL (nor Flower)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

NEITHER = ("{folder} is neither an OpenFL workspace (plan/plan.yaml) nor a Flower folder (an operator's folder with "
           "deployment.json, its run/ folder with metrics.csv and rounds.jsonl, or a site's --workdir with "
           "site_report/NAME/): give the folder a federation was created or run in")


def folder_kind(folder: Path) -> str:
    """``openfl`` (a workspace), a Flower kind (:mod:`fedcontrast.flower.folders`), or one sentence."""
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder: give the federation's workspace or folder")
    if (folder / "plan" / "plan.yaml").is_file() or (folder / "save" / "rounds.jsonl").is_file() \
            or (folder / "local_state" / "site_report").is_dir():
        return "openfl"
    from ..flower.folders import folder_kind as flower_kind

    kind = flower_kind(folder)
    if kind is None:
        raise ConfigError(NEITHER.format(folder=folder))
    return kind


def _report_score(ws: Path, name: str | None) -> int:
    """``report --score``: the final model a site took home, scored again on its own held-out data."""
    from ..site.report import score_in_workspace

    def show(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    name, scored, reported = score_in_workspace(ws, name)
    print(f"final model on {name}'s held-out data: accuracy {show(scored.get('accuracy'))} (the site's report says "
          f"{show(reported.get('accuracy'))})")
    others = {k: v for k, v in sorted(scored.items()) if k != "accuracy"}
    if others:
        print("other metrics: " + ", ".join(f"{k} {show(v)}" for k, v in others.items()))
    return 0


def _flower_report(folder: Path, kind: str, args: argparse.Namespace) -> int:
    from ..flower import folders

    if args.score:
        raise ConfigError(f"--score reads an OpenFL site workspace's plan and data line; {folder} is a {kind}: its "
                          "final model and its score are in site_report/NAME/ (final_model.pt, final_model.json)")
    if kind == folders.SITE:
        print("\n".join(folders.site_report_lines(folder, args.name)))
        return 0
    run = folders.run_folder(folder)
    print("\n".join(folders.run_report(run)))
    if args.out:  # the run folder holds its outputs already: a copy where asked
        import shutil

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        copied = [n for n in ("metrics.csv", "summary.json", "rounds.jsonl", "accuracy.png") if (run / n).is_file()]
        for name in copied:
            shutil.copy2(run / name, out / name)
        print(f"copied {', '.join(copied)} to {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    ws = Path(args.workspace)
    kind = folder_kind(ws) if ws.is_dir() or not args.score else "openfl"  # --score: an OpenFL site's workspace
    if kind != "openfl":
        return _flower_report(ws, kind, args)
    from ..openfl.launch import export_results, format_round, read_rounds
    from ..site.report import pick_site_report, site_report_folders

    if args.score:
        return _report_score(ws, args.name)
    records = read_rounds(ws)
    folders = [] if records else site_report_folders(ws)
    if folders:  # a site's workspace: its own report (--name: that site's, refused if it has none here)
        from ..flower.folders import report_lines  # engine-free: the same lines on both engines

        print("\n".join(report_lines([pick_site_report(ws, args.name)] if args.name is not None else folders)))
        return 0
    if not records:
        raise ConfigError(f"{ws / 'save' / 'rounds.jsonl'} holds no finished round yet, nor does a site report "
                          f"under {ws / 'local_state' / 'site_report'} (is this a federation's workspace, and has a "
                          "round finished?)")
    for record in records:
        print(format_round(record))
    out = Path(args.out) if args.out else ws / "report"
    summary = export_results(ws, out)
    files = "accuracy.png, rounds.csv and summary.json" if summary["plot"] else "rounds.csv and summary.json"
    print(f"{summary['rounds_completed']} rounds; {files} in {out}")
    for key, reason in summary["why_null"].items():  # also in summary.json: why a value is null
        print(f"{'no accuracy.png' if key == 'plot' else f'{key} is null'}: {reason}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    ws = Path(args.workspace)
    kind = folder_kind(ws)
    if kind == "openfl":
        from ..openfl.doctor import FAIL, is_operator_workspace, operator_checks, report_check, run_checks

        if (ws / "plan" / "plan.yaml").is_file() and is_operator_workspace(ws):  # the aggregator's, not a site's
            checks: list[Any] = operator_checks(ws)
            what = "before starting the aggregator"
        else:
            checks = run_checks(ws, name=args.name) + report_check(ws, args.name)
            what = "before starting this site"
    else:
        from ..flower import folders

        if kind == folders.RUN and (ws / ".." / "deployment.json").is_file():  # the operator's run/: its folder's
            ws, kind = ws.resolve().parent, folders.OPERATOR
            print(f"{args.workspace} is the run folder of the Flower operator's folder {ws}: checking that folder")
        if kind == folders.RUN:
            raise ConfigError(f"{ws} is a Flower run folder: run the doctor on the operator's folder above it (its "
                              f"certificates and registered sites), or `fedcontrast report {ws}` for its rounds")
        FAIL = folders.FAIL
        checks = (folders.operator_checks(ws.resolve()) if kind == folders.OPERATOR
                  else folders.site_checks(ws.resolve(), args.name))
        what = "before the run" if kind == folders.OPERATOR else "before starting this site's SuperNode"
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        print(f"fedcontrast doctor: {len(failed)} check{'s' if len(failed) > 1 else ''} failed ({', '.join(failed)}); "
              f"fix what the FAIL lines say {what}", file=sys.stderr)
        return 1
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="a federation's rounds so far: in the aggregator's workspace or a Flower "
                                      "operator's (or run) folder every round's held-out accuracy, plot, CSV, "
                                      "summary; in a site's workspace or Flower work folder its own report")
    p.add_argument("workspace", metavar="FOLDER")
    p.add_argument("--out", help="folder for accuracy.png, rounds.csv, summary.json (default: WORKSPACE/report; a "
                                 "Flower run folder holds its own: copied there)")
    p.add_argument("--score", action="store_true", help="in an OpenFL site's workspace: score the final model it "
                                                        "took home on its own held-out data, next to its report")
    p.add_argument("--name", help="the site whose report to show or score, when the folder holds several")
    p.set_defaults(func=cmd_report)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="checks before a federation runs: a site's certificate and key, the "
                                      "aggregator's certificate, its data, its policy (an OpenFL workspace); the CA, "
                                      "the SuperLink's certificate and the registered sites (a Flower operator's "
                                      "folder); its reports and keys (a Flower site's folder); exit 1 when one fails")
    p.add_argument("workspace", nargs="?", default=".", metavar="FOLDER", help="the folder (default: here)")
    p.add_argument("--name", help="this site's name (default: the one site plan/data.yaml names)")
    p.set_defaults(func=cmd_doctor)


COMMANDS = {"report": _add_report, "doctor": _add_doctor}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    """Add this group's sub-commands to ``subparsers`` (``names``: only those, in that order)."""
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
