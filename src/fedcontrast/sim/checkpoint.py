"""Round checkpoints: everything needed to continue a run exactly where it stopped.

Written atomically (temporary file, then rename) so a kill during the write leaves the previous
checkpoint intact; read with ``weights_only=True`` so a checkpoint cannot execute code.

The metrics rows of the finished rounds, and the digests of the sites' uploads (the replay screen's
memory), are not in ``checkpoint.pt`` (format 2): each round appends its own rows and fresh digests to
:data:`ROWS_FILE` beside it, one line per round, before the checkpoint that counts the round is
written. A round then costs its own rows, not the run's: at 1,000 sites the rows of 100 rounds took
0.4 s to write into every checkpoint. A resume reads the lines of the rounds the
checkpoint counts and drops any later one (a round that did not finish). Format 1 checkpoints, with
the rows inside, still resume.

Every line names its run (``"run"``, the id the run's checkpoint holds) and its round: on resume a line
of another run, or a second line of a round that differs from the first, is refused in one sentence
naming the file and the line (:func:`~fedcontrast.jsonl.read_run_records`), never read in place of the
run's own; an identical duplicate is dropped.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_torch_save, write_failure
from ..errors import CheckpointError, ConfigError, FedContrastError
from ..jsonl import append_jsonl, read_run_records, rewrite_jsonl

FORMAT = 2
FORMATS = (1, 2)  # what load_checkpoint reads: 1 holds the rows itself
ROWS_FILE = "checkpoint.rows.jsonl"  # beside checkpoint.pt: {"round": r, "run": id, "rows": [...], "digests": {...}}


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    atomic_torch_save({"format": FORMAT, **payload}, path)


class CheckpointWriter:
    """Writes a round's checkpoint now, or (``background``) in a thread of its own while the next
    round's sites train away from this process (the Ray executor): at 1,000 MOON sites a checkpoint
    holds every site's previous model, 0.4 GB, 1.6 s to write. One write at a time: :meth:`save`
    and :meth:`join` wait for the one before, and :meth:`join` raises what it failed with (a full
    disk: :class:`~fedcontrast.errors.OutputError`). The caller joins before anything the checkpoint
    refers to can change in place (the aggregator's state, in the next round's aggregation)."""

    def __init__(self, *, background: bool) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def save(self, path: Path, payload: dict[str, Any]) -> None:
        """Writes ``payload`` as the checkpoint ``path``, after the round's line of :data:`ROWS_FILE`
        beside it is on the disk itself (fsync: a power cut must not keep a checkpoint whose rows
        were lost)."""
        self.join()
        if not self.background:
            _write(path, payload)
            return

        def write() -> None:
            try:
                _write(path, payload)
            except BaseException as exc:  # raised by join(), in the run's own thread
                self._failed = exc

        # not a daemon: a run that ends or is interrupted still finishes the write, never cuts it short
        self._thread = threading.Thread(target=write, name="checkpoint")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()  # an interrupt here leaves the thread to a later join (the run's error path)
            self._thread = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed


def _write(path: Path, payload: dict[str, Any]) -> None:
    rows = path.with_name(ROWS_FILE)
    if rows.exists():
        try:
            with open(rows, "rb") as f:
                os.fsync(f.fileno())
        except OSError as exc:
            raise write_failure(rows, exc) from None
    save_checkpoint(path, payload)


def new_run_id() -> str:
    """A run's id: in its checkpoint and in every line of its :data:`ROWS_FILE`, kept when it is resumed."""
    import uuid

    return uuid.uuid4().hex[:12]


def _line(round_num: int, run: str | None, rows: list[dict[str, Any]], digests: dict[str, str]) -> dict[str, Any]:
    return {"round": round_num, **({"run": run} if run is not None else {}), "rows": rows, "digests": digests}


def append_round_rows(path: Path, round_num: int, rows: list[dict[str, Any]],
                      digests: dict[str, str] | None = None, run: str | None = None) -> None:
    """Round ``round_num``'s metrics rows and ``digests`` (site → the digest of its upload, first sent
    this round: the replay screen's memory), as one line of :data:`ROWS_FILE` beside the checkpoint
    ``path``, bound to the run ``run`` (None: a run from before runs had ids); written before the
    checkpoint that counts the round."""
    target = path.with_name(ROWS_FILE)
    try:
        append_jsonl(target, _line(round_num, run, rows, digests or {}), allow_nan=True, sync=False)
    except OSError as exc:
        raise write_failure(target, exc) from None


def checkpoint_rows(path: Path, data: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """The metrics rows of the rounds the checkpoint ``data`` (read from ``path``) counts, in round
    order, and the digests of the uploads first sent in them (site → digest → round); :data:`ROWS_FILE`
    is rewritten to hold only those rounds (a round after them did not finish). :class:`CheckpointError`
    when a counted round's rows are missing, a line is another run's, or a round has two lines that differ."""
    digests = {site: dict(seen) for site, seen in data["federation"].get("upload_digests", {}).items()}
    fresh: dict[int, dict] = {}
    if data["format"] == 1:
        rows = list(data["rows"])
        by_round: dict[int, list] = {}
        for row in rows:
            by_round.setdefault(int(row["round"]), []).append(row)
        for site, seen in digests.items():  # kept in the lines from now on, as format 2 keeps them
            for digest, r in seen.items():
                fresh.setdefault(r, {})[site] = digest
    else:
        source = path.with_name(ROWS_FILE)
        if not source.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {source}, which holds the metrics rows of its "
                                  "rounds, is missing; it was left untouched: start a new run with another --name")
        try:
            records = read_run_records(source, "metrics rows of the finished rounds", data.get("run"))
        except ConfigError as exc:
            raise CheckpointError(f"cannot resume from {path}: {exc}; it was left untouched") from None
        except OSError as exc:
            raise CheckpointError(f"cannot resume from {path}: {source} cannot be read "
                                  f"({exc.strerror or exc})") from None
        by_round = {}
        for number, _, record in records.values():  # one line per round, of this run (read_run_records)
            if not isinstance(record.get("rows"), list) or not _digests(record.get("digests", {})):
                raise CheckpointError(f"cannot resume from {path}: line {number} of {source} is not a round's record "
                                      "(round, rows, digests); the file is damaged and was left untouched")
            by_round[record["round"]] = record["rows"]
            fresh[record["round"]] = record.get("digests") or {}
        missing = [r for r in range(1, data["rounds_done"] + 1) if r not in by_round]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete (no rows of round {missing[0]} in {source}); it "
                                  "was left untouched: start a new run with another --name")
        rows = [row for r in range(1, data["rounds_done"] + 1) for row in by_round[r]]
        for r in range(1, data["rounds_done"] + 1):
            for site, digest in fresh.get(r, {}).items():
                digests.setdefault(site, {}).setdefault(digest, r)
    kept = [_line(r, data.get("run"), by_round.get(r, []), fresh.get(r, {})) for r in range(1, data["rounds_done"] + 1)]
    try:
        rewrite_jsonl(path.with_name(ROWS_FILE), kept, allow_nan=True)
    except OSError as exc:
        raise write_failure(path.with_name(ROWS_FILE), exc) from None
    return rows, digests


def _digests(value: Any) -> bool:
    """``value`` is a round's digests as :func:`append_round_rows` writes them: site → hex digest."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(exc).__name__}); "
                              "it was left untouched: start a new run with another --name") from None
    if not isinstance(data, dict) or data.get("format") not in FORMATS:
        raise CheckpointError(f"checkpoint {path} is not a fedcontrast checkpoint of format "
                              f"{' or '.join(map(str, FORMATS))}")
    if not isinstance(data.get("run", ""), str):
        raise CheckpointError(f"checkpoint {path} is damaged (its run id is not text); it was left untouched: start a "
                              "new run with another --name")
    missing = _missing_keys(data)
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {', '.join(missing)}); it was left untouched: "
                              "start a new run with another --name")
    return data


# What a resume reads; a checkpoint lacking any of it (edited, or written by a broken tool) is refused
# here rather than met as a KeyError half-way through restoring the federation.
REQUIRED = {"config": dict, "rounds_done": int, "elapsed": float, "federation": dict}  # format 1: "rows" too
FEDERATION_REQUIRED = {"downlink": dict, "server_state": dict, "site_states": dict}
DOWNLINK_REQUIRED = ("global", "personal", "metrics")


def _missing_keys(data: dict[str, Any]) -> list[str]:
    required = {**REQUIRED, "rows": list} if data.get("format") == 1 else REQUIRED
    missing = [k for k, kind in required.items()
               if not isinstance(data.get(k), (int, float) if kind is float else kind)]
    federation = data.get("federation")
    if isinstance(federation, dict):
        missing += [f"federation.{k}" for k, kind in FEDERATION_REQUIRED.items()
                    if not isinstance(federation.get(k), kind)]
        downlink = federation.get("downlink")
        if isinstance(downlink, dict):
            missing += [f"federation.downlink.{k}" for k in DOWNLINK_REQUIRED if not isinstance(downlink.get(k), dict)]
        states = federation.get("site_states")
        if isinstance(states, dict) and isinstance(data.get("config"), dict):
            from ..config import RunConfig, site_names

            try:
                names = site_names(RunConfig.from_dict(data["config"]))
            except FedContrastError:
                missing.append("a valid config")
            else:
                missing += [f"federation.site_states.{n}" for n in names if n not in states]
    return missing
