"""The operator's run folder on a Flower deployment: one run per folder, never mixed with another,
and a run that can be resumed.

After every round the ServerApp writes ``checkpoint.pt`` (the downlink, the aggregator's state, the
metrics rows, the run's label) and ``progress.json`` (rounds done of how many, the label, the plan's
digest) beside its records. ``fedcontrast flower run`` reads ``progress.json`` before it starts
anything: a folder that holds an earlier run is refused in one sentence, unless ``--resume`` asks to
continue it (or to re-report it, when it finished). A resumed run carries the same label to the
sites, so each finds its own state again (:meth:`~fedcontrast.flower.site_app.SiteRuntime.store`).
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from pathlib import Path
from typing import Any

import torch

from ..algorithms import Downlink
from ..atomic import atomic_write_bytes, atomic_write_text
from ..config import RunConfig
from ..errors import ConfigError

CHECKPOINT, PROGRESS, RECORDS = "checkpoint.pt", "progress.json", "rounds.jsonl"


def plan_digest(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def new_label() -> str:
    """A run's label: what the sites key their state by, kept when the run is resumed."""
    return uuid.uuid4().hex[:12]


def progress(out: Path) -> dict[str, Any] | None:
    """What ``out`` holds of an earlier run (None: no run there)."""
    from ..yamlio import check_regular_file, read_text

    path = Path(out) / PROGRESS
    if not path.exists():
        if (Path(out) / RECORDS).exists():  # records of a run from before progress.json: still another run's
            check_regular_file(Path(out) / RECORDS, "the run's round records", limit=None)  # never a FIFO
            return {"rounds_done": sum(1 for _ in (Path(out) / RECORDS).open()), "rounds": None, "label": None}
        return None
    try:
        return json.loads(read_text(path, "the run's progress", limit=1 << 20))  # a FIFO: refused, not read
    except (OSError, ValueError):
        raise ConfigError(f"{path} cannot be read: this run folder's progress is damaged; move the folder away "
                          "to start a new run") from None


def check_run_folder(out: Path, config: RunConfig, *, resume: bool) -> str:
    """What ``flower run`` does with ``out``: ``new`` (empty), ``resume`` or ``finished`` (re-report);
    a folder holding another run without ``--resume``, or a run of another plan, is refused."""
    held = progress(out)
    if held is None:
        return "new"
    done, total = held.get("rounds_done", 0), held.get("rounds")
    what = f"{done} of {total} rounds" if total else f"{done} rounds"
    if not resume:
        raise ConfigError(f"{out} holds an earlier run ({what} done): pass --resume to continue it, or move that "
                          "folder away to start a new run (a run never writes into another run's files)")
    if held.get("plan") not in (None, plan_digest(config)):
        raise ConfigError(f"{out} holds a run of another plan than this folder's now: it cannot be resumed with this "
                          "plan; move that folder away to start a new run")
    if held.get("label") is None:
        raise ConfigError(f"{out} holds a run from an earlier fedcontrast without a checkpoint; it cannot be resumed: "
                          "move that folder away to start a new run")
    if total is not None and done >= total:
        return "finished"
    state = read_checkpoint(out, torch.device("cpu"))  # what the ServerApp will resume from: readable, this
    read_records(out, state["label"], state["rounds_done"])  # run's records only, before anything is started
    return "resume"


def save(out: Path, config: RunConfig, label: str, rounds_done: int, downlink: Downlink, core_state: dict[str, Any],
         rows: list[dict[str, Any]], timing: dict[str, float] | None = None) -> None:
    """The run after ``rounds_done`` rounds: its checkpoint, then its progress (both atomic).
    ``timing``: the rounds' own seconds and how many were timed, kept for a resumed run's summary."""
    buffer = io.BytesIO()
    torch.save({"rounds_done": rounds_done, "label": label, "plan": plan_digest(config), "timing": dict(timing or {}),
                "downlink": {"global": downlink.global_tensors, "personal": downlink.personal,
                             "metrics": downlink.metrics},
                "core": core_state, "rows": rows}, buffer)
    atomic_write_bytes(Path(out) / CHECKPOINT, buffer.getvalue())
    atomic_write_text(Path(out) / PROGRESS, json.dumps({"rounds_done": rounds_done, "rounds": config.rounds,
                                                        "label": label, "plan": plan_digest(config)}) + "\n")


def read_checkpoint(out: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint of the run in ``out``, as written by :func:`save`; a file that is empty, cut short,
    not a checkpoint or lacking what a resume reads is one :class:`ConfigError` naming it."""
    from ..yamlio import check_regular_file

    path = Path(out) / CHECKPOINT
    check_regular_file(path, "the run's checkpoint", limit=None)  # never a FIFO (torch.load would block)
    advice = "it was left untouched: move the run folder away to start a new run"
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - EOFError (empty), UnpicklingError, RuntimeError (cut short), …
        raise ConfigError(f"cannot resume from {path}: it is not a readable checkpoint ({type(exc).__name__}"
                          f"{': ' + str(exc).splitlines()[0] if str(exc) else ''}); {advice}") from None
    downlink = state.get("downlink") if isinstance(state, dict) else None
    problems = [] if isinstance(state, dict) else ["it holds no mapping"]
    if isinstance(state, dict):
        problems += [f"no {key}" for key, kind in (("rounds_done", int), ("label", str), ("rows", list),
                                                   ("downlink", dict), ("core", dict))
                     if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool)]
        if isinstance(downlink, dict):
            problems += [f"no downlink.{key}" for key in ("global", "personal", "metrics")
                         if not isinstance(downlink.get(key), dict)]
    if problems:
        raise ConfigError(f"cannot resume from {path}: it is not a checkpoint of a Flower run ({', '.join(problems)}); "
                          f"{advice}")
    return state


def read_records(out: Path, label: str, rounds_done: int) -> list[str]:
    """The lines of the run's records (``rounds.jsonl``) of the rounds its checkpoint counts, each bound
    to the run ``label`` and its round (:func:`~fedcontrast.jsonl.read_run_records`: a line of another
    run, or a second line of a round that differs, is one :class:`ConfigError` naming the file and the
    line; so is a line that is not JSON, but a last line a crash cut short); a round that did not finish
    leaves no line behind."""
    from ..jsonl import read_run_records

    records = read_run_records(Path(out) / RECORDS, "the run's round records", label)
    return [text for r, (_, text, _) in sorted(records.items()) if r <= rounds_done]


def load(out: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint of the run in ``out``; its records keep only the rounds it holds."""
    state = read_checkpoint(out, device)
    kept = read_records(out, state["label"], state["rounds_done"])
    state["downlink"] = Downlink(dict(state["downlink"]["global"]), dict(state["downlink"]["personal"]),
                                 dict(state["downlink"]["metrics"]))
    records = Path(out) / RECORDS
    if records.exists():  # a round that did not finish leaves no record behind
        atomic_write_text(records, "".join(line + "\n" for line in kept))
    return state
