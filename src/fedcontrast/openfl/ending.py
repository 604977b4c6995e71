"""What an OpenFL party says when it ends, instead of OpenFL's bare ``✔️ OK``: where its outputs are
(the aggregator's final model, round records and log; a site's own report folder), and, of a
federation that finished already (an aggregator restarted after the end, a site started against
it), that it did."""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

NEW_RUN = "create a new workspace (`fedcontrast workspace create`, then `fx plan initialize`)"


def output_log() -> str | None:
    """The file this process's output goes to (``logs/aggregator.log`` under ``fedcontrast
    federation``), or None for a terminal or a pipe."""
    try:
        target = Path(os.readlink("/proc/self/fd/1"))
    except OSError:
        return None
    return str(target) if target.is_file() else None


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def aggregator_outputs(out_dir: str | Path) -> str:
    """Where the aggregator's outputs are, as one clause."""
    from .records import FINAL_DOWNLINK, FINAL_MODEL, ROUNDS_FILE

    out = Path(out_dir)
    model = out / FINAL_MODEL if (out / FINAL_MODEL).is_file() else out / FINAL_DOWNLINK
    log = output_log()
    workspace = Path.cwd()
    return (f"final model {_shown(model)}, round records {_shown(out / ROUNDS_FILE)} (`fedcontrast report "
            f"{workspace}` prints them and writes accuracy.png, rounds.csv and summary.json)"
            f"{f', log {log}' if log else ''}; each site's outputs are in its own workspace, "
            "local_state/site_report/<site>/<run>/")


def say(line: str) -> None:
    print(f"fedcontrast aggregator: {line}", flush=True)


class EndingLines:
    """A mixin of :class:`~.aggregator.SafeAggregator` over OpenFL's ``Aggregator``: what it says at the end."""

    if TYPE_CHECKING:  # what the class this mixes into provides
        report: Any
        round_number: int
        rounds_to_train: int
        failure: str | None

    def _recover(self) -> bool:
        """OpenFL's recovery; a federation whose every round is done already (an aggregator restarted
        after the end) is said so, and the process ends with exit code 0 instead of serving nothing."""
        recovered = super()._recover()  # type: ignore[misc]  # OpenFL's Aggregator, next in the MRO
        if recovered and self.round_number >= self.rounds_to_train:
            from .records import read_records

            records = read_records(self.report.out_dir)
            last = records[-1] if records else {}
            when = (dt.datetime.fromtimestamp(last["time"]).strftime("%Y-%m-%d %H:%M") if "time" in last
                    else "date unknown")
            rounds = self.report.rounds
            say(f"federation {Path.cwd().name} finished already (round {last.get('round', rounds)} of {rounds}, "
                f"{when}): nothing to run; {aggregator_outputs(self.report.out_dir)}; to run it again, {NEW_RUN}")
            raise SystemExit(0)
        return recovered

    def ended(self) -> bool:
        """The federation ended well (every site still there told to quit): where the outputs are, once. True."""
        if self.failure is None and not self.__dict__.get("_ended_said"):
            self.__dict__["_ended_said"] = True
            rounds = self.report.rounds
            say(f"federation finished ({rounds} round{'' if rounds == 1 else 's'}); "
                f"{aggregator_outputs(self.report.out_dir)}")
        return True


def site_outputs(collaborator: Any, finished_already: bool = False) -> None:
    """A collaborator's last line: where this site's outputs are (``finished_already``: told to quit
    before its first task, the federation had finished already)."""
    runner = getattr(collaborator, "task_runner", None)
    name = getattr(collaborator, "collaborator_name", "this site")
    folder = getattr(runner, "report_dir", None)
    run = getattr(runner, "run_id", None)
    if folder is not None and callable(run):  # this run's own folder (site/report.py)
        from ..site.report import run_folder_name

        folder = Path(folder) / name / run_folder_name(run())
    elif folder is not None:
        folder = Path(folder) / name
    where = f"{_shown(folder)}/" if folder is not None else "its report folder"
    log = output_log()
    files = (f"its outputs are in {where} (rounds.csv, rounds.jsonl, accuracy.png, final_model.pt; `fedcontrast "
             f"report {Path.cwd()}` prints its rows){f', log {log}' if log else ''}")
    if finished_already:
        line = (f"the federation finished already (the aggregator had no round left for {name}): nothing to do; "
                f"{files}; to take part in a new run, the operator must {NEW_RUN}")
    else:
        rounds = getattr(getattr(runner, "config", None), "rounds", None)
        count = f" ({rounds} round{'' if rounds == 1 else 's'})" if rounds else ""
        line = f"{name} finished the federation{count}; {files}"
    print(f"fedcontrast collaborator: {line}", file=sys.stdout, flush=True)
