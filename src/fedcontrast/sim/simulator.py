"""``fedcontrast simulate``: run a federation in one process, with outputs, checkpoints and resume."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import yaml

from ..atomic import atomic_write_text
from ..config import RunConfig
from ..errors import CheckpointError, ConfigError
from ..outputs import (
    GLOBAL_SITE,
    SummaryTally,
    TensorBoardLog,
    append_metrics_csv,
    plot_curves,
    write_json,
    write_metrics_csv,
)
from ..rounds import RoundOutcome
from ..rounds.transport import Replies, run_rounds
from .checkpoint import ROWS_FILE, CheckpointWriter, append_round_rows, checkpoint_rows, load_checkpoint, new_run_id
from .federation import Federation

logger = logging.getLogger(__name__)

OUTPUT_FILES = ("metrics.csv", "summary.json", "accuracy.png", "config.yaml", "checkpoint.pt", ROWS_FILE,
                "tensorboard")
RESULT_FILES = ("metrics.csv", "summary.json", "accuracy.png")  # what a finished round leaves
# Settings that may change when a run is resumed: more rounds, another device.
RESUMABLE_CHANGES = {"rounds", "device", "target_accuracy", "executor"}  # the executor: results are equal

# (rounds done, total, the round's global row): called once with row None when set-up has succeeded
# (``rounds done`` is then the round a resumed run starts from), then after every round.
Progress = Callable[[int, int, dict[str, Any] | None], None]


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an earlier run unless asked: its results are somebody's data."""
    existing = [n for n in OUTPUT_FILES if (run_dir / n).exists()]
    if existing and not resume:
        if not overwrite:
            raise ConfigError(f"{run_dir} already holds a run ({', '.join(existing)}); continue it with "
                              "--resume, choose another --name, or replace it with --overwrite")
        for n in existing:
            target = run_dir / n
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def _check_resumable(saved: dict[str, Any], config: RunConfig, path: Path) -> None:
    current = config.to_dict()
    differing = sorted(k for k in set(saved) | set(current)
                       if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
    if differing:
        raise CheckpointError(f"cannot resume from {path}: it was made with different settings "
                              f"({', '.join(differing)}); use the original settings or another --name")
    schedule = (saved.get("training") or {}).get("lr_schedule", "constant")
    if schedule != "constant" and saved.get("rounds") != config.rounds:
        planned = saved.get("rounds")
        raise CheckpointError(f"cannot resume from {path} with {config.rounds} rounds: its learning rate follows a "
                              f"{schedule} schedule over {planned} round{'s' if planned != 1 else ''}, which other "
                              "rounds would change for the rounds already run; resume with the same --rounds, or "
                              "start afresh")


def run_simulation(config: RunConfig, run_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
                   progress: Progress | None = None, stop_after: int | None = None,
                   local_evaluation: bool | None = None, linear_probe: bool = False,
                   executor: Any = None) -> dict[str, Any]:
    """Run (or continue) ``config`` in ``run_dir``; returns the summary.

    ``local_evaluation``: also evaluate every site's uploaded local model each round (see
    :class:`Federation`; default: when the plugin asks for it); ``linear_probe``: also report the
    global encoder's linear-probe accuracy each round.

    ``stop_after`` ends the call after that many rounds in total have finished, as a kill would
    (used by tests of resume). ``executor``: who trains a round's sites (default: the one
    ``config.executor`` names, started here and stopped at the end; ``compare`` passes its own).
    """
    run_dir = Path(run_dir)
    prepare_run_dir(run_dir, resume=resume, overwrite=overwrite)
    ckpt_path = run_dir / "checkpoint.pt"
    if resume and not ckpt_path.exists():
        results = [n for n in RESULT_FILES if (run_dir / n).exists()]
        if results:  # starting again from the first round would overwrite them
            raise CheckpointError(f"cannot resume {run_dir}: it holds results ({', '.join(results)}) but no "
                                  "checkpoint.pt to continue from; they were left untouched: start afresh with "
                                  "another --name, or replace them with --overwrite instead of --resume")
    checkpoint = load_checkpoint(ckpt_path) if resume and ckpt_path.exists() else None
    if checkpoint is not None:
        _check_resumable(checkpoint["config"], config, ckpt_path)
        # the counted rounds' rows and upload digests, read before anything is written
        checkpoint["rows"], checkpoint["federation"]["upload_digests"] = checkpoint_rows(ckpt_path, checkpoint)

    from ..threads import usable_cores
    from .ray_executor import Threads, make_executor

    # the run's torch threads per site (the driver's too: results equal), never whatever this process
    # was left with: site_cpus, 1 per Ray site, else the cores this process may use (recorded in summary.json)
    threads = config.executor.threads if config.executor.threads is not None else usable_cores()
    with Threads(threads):
        # data, partition, model: fails early on bad input
        federation = Federation(config, local_evaluation=local_evaluation, linear_probe=linear_probe)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
        own = executor is None
        federation.executor = make_executor(config, progress=site_progress_for(progress)) if own else executor
        try:
            # a full disk: OutputError
            return _run_rounds(config, run_dir, federation, checkpoint, progress, stop_after)
        finally:
            if own:
                federation.executor.close()


def site_progress_for(progress: Progress | None):
    """A per-round bar of sites done where the run shows progress (the ray executor calls it)."""
    if progress is None:
        return None
    from .ray_executor import site_progress

    return site_progress()


def _run_rounds(config: RunConfig, run_dir: Path, federation: Federation, checkpoint: dict[str, Any] | None,
                progress: Progress | None, stop_after: int | None) -> dict[str, Any]:
    start, elapsed = 0, 0.0
    tally = SummaryTally()  # summary.json and the plot after each round, from each round's rows once
    run_id = new_run_id() if checkpoint is None else checkpoint.get("run")  # every line of its rows names it
    if checkpoint is not None:
        federation.load_state_dict(checkpoint["federation"])
        start, elapsed = checkpoint["rounds_done"], checkpoint["elapsed"]
        write_metrics_csv(run_dir / "metrics.csv", checkpoint["rows"])  # drop rows of a round that did not finish
        tally.add(checkpoint["rows"])

    tb = TensorBoardLog(run_dir / "tensorboard", purge_step=start + 1 if start else None)
    end = config.rounds if stop_after is None else min(config.rounds, stop_after)
    federation.last_round = end
    if progress is not None:
        progress(start, config.rounds, None)
    # sites that train away from here (Ray): the checkpoint is written while the next round's train,
    # done before that round's aggregation (Federation.before_aggregate); else now, as they train here
    writer = CheckpointWriter(background=getattr(federation.executor, "start", None) is not None)
    federation.before_aggregate = writer.join
    recorder = RunRecorder(config, run_dir, federation, writer, tally, tb, progress, run_id, elapsed)
    try:
        # the round's loop (fedcontrast.rounds): the federation is the transport, the recorder writes each round
        run_rounds(federation.core, federation, recorder, federation.downlink, start + 1, end)  # rounds count from 1
        writer.join()  # the last round's checkpoint, written (or its failure raised) before the run ends
    except BaseException:  # a kill or a full disk: report that, not a second failure of the outputs below
        with contextlib.suppress(Exception):
            federation.cancel_ahead()
        try:
            writer.join()  # a checkpoint on its way is finished, not cut short
        except Exception as exc:  # said, not hidden behind the error that stops the run
            logger.error("the checkpoint of the last round was not written (%s); --resume continues from the one "
                         "before", exc)
        with contextlib.suppress(Exception):
            tb.close()
        with contextlib.suppress(Exception):
            _plot(config, run_dir, tally)
        raise
    tb.close()
    _plot(config, run_dir, tally)
    elapsed = recorder.elapsed
    summary = _timed(tally.summary(config=config.to_dict(), wall_time_s=elapsed, rounds_total=config.rounds), elapsed,
                     end)
    summary["threads_per_site"] = torch.get_num_threads()  # what the seed reproduces metrics at
    described = getattr(federation.executor, "summary", None)  # the Ray executor: its slots and tasks per round
    if callable(described):
        summary["executor"] = described()
    write_json(run_dir / "summary.json", summary)
    return summary


class RunRecorder:
    """What ``fedcontrast simulate`` keeps of each round (:class:`~fedcontrast.rounds.transport.RoundRecorder`):
    the federation's rows and evaluation, the rows and upload digests beside the checkpoint, the
    checkpoint (written in the background while sites train elsewhere), metrics.csv, summary.json,
    TensorBoard and the progress line. ``elapsed``: the rounds' own time so far (a resumed run's
    earlier parts included), without what is written after each."""

    def __init__(self, config: RunConfig, run_dir: Path, federation: Federation, writer: CheckpointWriter,
                 tally: SummaryTally, tb: TensorBoardLog, progress: Progress | None, run_id: str | None,
                 elapsed: float) -> None:
        self.config, self.run_dir, self.federation, self.writer = config, run_dir, federation, writer
        self.tally, self.tb, self.progress, self.run_id = tally, tb, progress, run_id
        self.elapsed, self.mark = elapsed, time.perf_counter()

    def record(self, round_num: int, replies: Replies, outcome: RoundOutcome) -> None:
        config, run_dir, r = self.config, self.run_dir, round_num
        self.federation.record(r, replies, outcome)
        new_rows = replies.rows
        self.elapsed += time.perf_counter() - self.mark
        ckpt_path = run_dir / "checkpoint.pt"
        # before the checkpoint that counts round r: its rows and the digests of its fresh uploads
        append_round_rows(ckpt_path, r, new_rows, self.federation.screen.fresh, run=self.run_id)
        self.writer.save(ckpt_path, {"config": config.to_dict(), "rounds_done": r, "elapsed": self.elapsed,
                                     **({"run": self.run_id} if self.run_id is not None else {}),
                                     "federation": self.federation.state_dict(digests=False)})
        append_metrics_csv(run_dir / "metrics.csv", new_rows)  # the round's rows (a resume rewrites the file)
        self.tally.add(new_rows)
        write_json(run_dir / "summary.json", _timed(self.tally.summary(config=config.to_dict(),
                                                                       wall_time_s=self.elapsed,
                                                                       rounds_total=config.rounds), self.elapsed, r))
        glob = next(row for row in new_rows if row["site"] == GLOBAL_SITE)
        sites = [row for row in new_rows if row["site"] != GLOBAL_SITE]
        self.tb.scalars(r, {"test/accuracy": glob["accuracy"], "test/loss": glob["loss"],
                            "train/loss": sum(s["loss"] for s in sites) / max(len(sites), 1),
                            "bytes/uploaded": sum(s["bytes_uploaded"] for s in sites)})
        if self.progress is not None:
            self.progress(r, config.rounds, glob)
        self.mark = time.perf_counter()


def _timed(summary: dict[str, Any], elapsed: float, rounds_done: int) -> dict[str, Any]:
    """``summary`` with ``seconds_per_round``: the rounds' own time over the rounds done, in every part
    of a resumed run (``elapsed`` is kept in the checkpoint, so a resume adds its rounds to the earlier ones)."""
    summary["seconds_per_round"] = round(elapsed / max(1, rounds_done), 3)
    return summary


def _plot(config: RunConfig, run_dir: Path, tally: SummaryTally) -> None:
    curve, validation = tally.curve(), tally.validation_curve()
    if curve:
        curves: dict[str, list[float | None]] = {f"{config.algorithm}, test": list(curve)}
        styles: dict[str, dict[str, Any]] = {f"{config.algorithm}, test": {"color": "C0"}}
        if any(v is not None for v in validation):
            curves[f"{config.algorithm}, validation"] = validation
            styles[f"{config.algorithm}, validation"] = {"color": "C0", "linestyle": "--", "linewidth": 1.0}
        plot_curves(run_dir / "accuracy.png", curves, styles=styles, ylabel="global model's accuracy",
                    title=f"{config.algorithm} on {config.dataset} ({config.clients} sites)")


def print_progress(header: str = "", stream: TextIO | None = None) -> Progress:
    """A progress bar on a terminal, one line per round otherwise (logs, CI); ``header`` is
    printed once set-up has succeeded. ``stream``: standard error as it is when the run starts."""
    bar = None
    stream = stream if stream is not None else sys.stderr

    def show(done: int, total: int, row: dict[str, Any] | None) -> None:
        nonlocal bar
        if row is None:
            if header:
                print(header, file=stream, flush=True)
            if done:
                print(f"resuming after round {done} of {total}", file=stream, flush=True)
            if stream.isatty() and done < total:
                from tqdm import tqdm

                bar = tqdm(total=total, initial=done, desc="rounds", unit="round", file=stream)
            return
        if bar is not None:
            bar.update(1)
            bar.set_postfix(accuracy=f"{row['accuracy']:.4f}", loss=f"{row['loss']:.3f}")
            if done == total:
                bar.close()
        else:
            loss = "" if row["loss"] != row["loss"] else f"  test loss {row['loss']:.4f}"  # NaN: none
            print(f"round {done}/{total}  test accuracy {row['accuracy']:.4f}{loss}", file=stream, flush=True)

    return show
