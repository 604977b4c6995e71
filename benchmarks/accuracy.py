"""FedAvg vs FedProx vs MOON on digits, 10 sites, Dir(0.5), several seeds (issue #2's accuracy goal).

    .venv/bin/python benchmarks/accuracy.py [--rounds 50] [--seeds 0 1 2]

Runs land in benchmarks/runs/accuracy (reused if present: the script resumes unfinished runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.sim import run_simulation
from fedcontrast.sim.compare import format_table, run_comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedprox", "moon", "moon:mu=1"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "runs" / "accuracy"))
    parser.add_argument("--section", default="accuracy", help="section of RESULTS.md to write")
    parser.add_argument("--title", default="Accuracy: FedAvg vs FedProx vs MOON on digits")
    args = parser.parse_args()

    base = RunConfig(dataset="digits", clients=10, partition="dirichlet", beta=0.5, rounds=args.rounds)
    t0 = time.perf_counter()
    table = run_comparison(base, args.algorithms, args.seeds, args.out,
                           progress_factory=lambda label: print(f"== {label}", file=sys.stderr) or None)
    wall = time.perf_counter() - t0
    # The ceiling: the same CNN trained on the union of the sites' data (one site, IID), as many epochs.
    ceiling = [run_simulation(base.replace(algorithm="fedavg", clients=1, partition="iid", seed=seed,
                                           rounds=max(1, args.rounds // 10),
                                           training={"local_epochs": 10 * base.training.local_epochs}),
                              Path(args.out) / f"centralised-s{seed}", resume=True)["final_accuracy"]
               for seed in args.seeds]
    md = format_table(args.out)
    print(md)
    rows = {r["algorithm"]: r for r in table}
    ref = args.algorithms[0]
    lines = [
        f"## {args.title}",
        "",
        f"Command: `.venv/bin/python benchmarks/accuracy.py --rounds {args.rounds} --seeds "
        f"{' '.join(map(str, args.seeds))} --algorithms {' '.join(args.algorithms)}"
        + (f" --section {args.section} --title '{args.title}'" if args.section != "accuracy" else "") + "` "
        f"({wall / 60:.1f} min for the runs not already in benchmarks/runs, on {machine()}).",
        "",
        f"Setting: scikit-learn digits (32×32), {base.clients} sites, Dirichlet β={base.beta}, "
        f"{args.rounds} rounds, {base.training.local_epochs} local epochs, batch {base.training.batch_size}, "
        f"SGD lr {base.training.lr} momentum {base.training.momentum} wd {base.training.weight_decay}, "
        "MOON μ=5 τ=0.5, FedProx μ=0.01 (the paper's CIFAR-10 defaults; `moon:mu=1` is the paper's CIFAR-100 "
        "value). Mean ± std over seeds "
        f"{', '.join(map(str, args.seeds))}; each seed is its own partition, shared by all algorithms.",
        "",
        md,
        "Ceiling — the same CNN trained centrally on all sites' data for "
        f"{10 * base.training.local_epochs * max(1, args.rounds // 10)} epochs: "
        f"{100 * sum(ceiling) / len(ceiling):.2f} % (mean over the seeds).",
        "",
    ]
    if "fedssc" in rows and "moon" in rows:
        gap = 100 * (rows["fedssc"]["final_accuracy_mean"] - rows["moon"]["final_accuracy_mean"])
        lines += [f"FedSSC − MOON: {gap:+.2f} points final accuracy (goal ≥ 0).", ""]
    if "moon" in rows and ref in rows and "fedssc" not in rows:
        gap = 100 * (rows["moon"]["final_accuracy_mean"] - rows[ref]["final_accuracy_mean"])
        reach = rows["moon"][f"rounds_to_{ref}_final"]
        lines += [f"MOON − {ref}: {gap:+.2f} points final accuracy (goal ≥ +2). Rounds for MOON to reach "
                  f"{ref}'s final accuracy: {reach if reach is not None else 'not reached in every seed'} "
                  f"of {args.rounds} (goal ≤ half).", ""]
    write_section(args.section, "\n".join(lines))


if __name__ == "__main__":
    main()
