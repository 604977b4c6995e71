"""The simulator's driver over a long run: does a round's own part (upload screen, aggregation,
evaluation, checkpoint and records) stay the same from the first rounds to the last, or grow with the
rounds already run? Measured on the code now and on an earlier commit (``--before``, its ``src``
taken with ``git archive`` and put first on ``PYTHONPATH``), one after the other in one run, each run
in a process of its own.

    .venv/bin/python benchmarks/long_runs.py --before 5ca9ea6 --sites 200 --rounds 100

A round's driver part is the round's wall time less its sites' training (the sequential engine, one
thread: the driver's part is then all of the round but the sites' own work). Reported: the median
of rounds 2-11 and of the last ten rounds, per site; the checkpoint's size after the last round.
Writes the section ``long_runs`` of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One run in this process, timed by :func:`ray_executor.timed_run`; prints its per-round figures."""
    import torch
    from ray_executor import timed_run

    from fedcontrast.config import RunConfig, TrainingConfig

    torch.set_num_threads(1)
    config = RunConfig(algorithm=args.algorithm, dataset="digits", clients=args.sites, rounds=args.rounds,
                       device="cpu", executor={"kind": "sequential", "site_cpus": 1}, min_samples=2,
                       training=TrainingConfig(local_epochs=1, batch_size=32))
    with tempfile.TemporaryDirectory() as tmp:
        timing = timed_run(config, Path(tmp) / "run")
        size = sum(p.stat().st_size for p in (Path(tmp) / "run").glob("checkpoint*"))
    print(json.dumps({"round": timing["rounds"], "train": timing["trains"], "checkpoint_bytes": size}))


def run(src: Path | None, args) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, __file__, "--child", "--sites", str(args.sites), "--rounds", str(args.rounds),
           "--algorithm", args.algorithm]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def figures(result: dict, sites: int) -> dict:
    driver = [r - t for r, t in zip(result["round"], result["train"])]
    early, late = driver[1:11], driver[-10:]
    return {"early": 1000 * statistics.median(early) / sites, "late": 1000 * statistics.median(late) / sites,
            "round_early": statistics.median(result["round"][1:11]),
            "round_late": statistics.median(result["round"][-10:]),
            "checkpoint_mib": result["checkpoint_bytes"] / 2 ** 20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", help="an earlier commit to measure beside the code now")
    parser.add_argument("--sites", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--no-section", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if args.rounds < 21:
        parser.error("--rounds must be at least 21 (rounds 2-11 against the last ten)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            subprocess.run(f"git -C {ROOT} archive {args.before} src | tar -x -C {tmp}", shell=True, check=True)
            rows.append((f"before ({args.before})", figures(run(Path(tmp) / "src", args), args.sites)))
        rows.append(("now", figures(run(None, args), args.sites)))
    for label, f in rows:
        print(f"{label}: driver {f['early']:.3f} ms/site in rounds 2-11, {f['late']:.3f} ms/site in the last ten; "
              f"round {f['round_early']:.3f} -> {f['round_late']:.3f} s; checkpoint {f['checkpoint_mib']:.1f} MiB")
    if not args.no_section:
        sys.path.insert(0, str(Path(__file__).parent))
        from _results import machine, write_section

        before = f" --before {args.before}" if args.before else ""
        lines = ["## The simulator's driver over a long run: `benchmarks/long_runs.py`", "",
                 f"Command: `.venv/bin/python benchmarks/long_runs.py{before} "
                 f"--sites {args.sites} --rounds {args.rounds} --algorithm {args.algorithm}` ({machine()}).", "",
                 f"{args.algorithm} on digits, {args.sites} sites (`--min-samples 2`), {args.rounds} rounds of 1 local "
                 "epoch, the sequential engine on one thread, each code in a process of its own, one after the "
                 "other. The driver's part of a round: its wall time less the sites' training (the upload screen, "
                 "aggregation, evaluation, checkpoint and records), per site; medians of rounds 2-11 and of the "
                 "last ten. Checkpoint: checkpoint.pt with what lies beside it, after the last round.", "",
                 "| code | driver per site, rounds 2-11 | driver per site, last ten rounds | growth | "
                 "s per round, rounds 2-11 → last ten | checkpoint |", "|---|---|---|---|---|---|"]
        for label, f in rows:
            lines.append(f"| {label} | {f['early']:.3f} ms | {f['late']:.3f} ms | {f['late'] / f['early']:.2f}× | "
                         f"{f['round_early']:.3f} → {f['round_late']:.3f} s | {f['checkpoint_mib']:.1f} MiB |")
        write_section("long_runs", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
