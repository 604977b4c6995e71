"""FedSiam-DA vs FedAvg vs MOON on digits, 10 sites, Dir(0.5), several seeds: the global model's
test accuracy and the sites' local models' accuracy (issue #5).

    .venv/bin/python benchmarks/fedsiam_accuracy.py [--rounds 50] [--seeds 0 1 2]

Every run evaluates each site's uploaded local model after every round (the model the site holds
after local training) on the test split: on the site's own label distribution (per-class accuracy
weighted by its class counts: "local") and on the balanced split. Runs land in
benchmarks/runs/fedsiam (reused if present).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.sim import run_simulation
from fedcontrast.sim.compare import variant_config

VARIANTS = ["fedavg", "moon:mu=1", "fedsiam_da"]


def mean_std(values):
    values = [100 * v for v in values]
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "runs" / "fedsiam"))
    parser.add_argument("--section", default="fedsiam", help="section of RESULTS.md to write")
    parser.add_argument("--title", default="FedSiam-DA vs FedAvg vs MOON on digits (global and local accuracy)")
    args = parser.parse_args()

    base = RunConfig(dataset="digits", clients=10, partition="dirichlet", beta=0.5, rounds=args.rounds)
    t0 = time.perf_counter()
    table = []
    for spec in args.variants:
        summaries = []
        for seed in args.seeds:
            config = variant_config(base, spec, seed)
            run = Path(args.out) / f"{spec.replace(':', '-').replace('=', '')}-s{seed}"
            print(f"== {spec} seed {seed}", file=sys.stderr)
            summaries.append(run_simulation(config, run, resume=True, local_evaluation=True))
        final = [s["final_metrics"] for s in summaries]
        table.append({
            "variant": spec,
            "global": mean_std([s["final_accuracy"] for s in summaries]),
            "local": mean_std([m["local_accuracy"] for m in final]),
            "spread": statistics.mean(100 * m["local_accuracy_std"] for m in final),
            "balanced": mean_std([m["local_balanced_accuracy"] for m in final]),
            "wall": statistics.mean(s["wall_time_s"] for s in summaries),
        })
    wall = time.perf_counter() - t0
    lines = [
        f"## {args.title}",
        "",
        f"Command: `.venv/bin/python benchmarks/fedsiam_accuracy.py --rounds {args.rounds} --seeds "
        f"{' '.join(map(str, args.seeds))} --variants {' '.join(args.variants)}"
        + (f" --section {args.section} --title '{args.title}'" if args.section != "fedsiam" else "")
        + f"` ({wall / 60:.1f} min for the runs not already in benchmarks/runs, "
        f"on {machine()}).",
        "",
        f"Setting: digits (32×32), {base.clients} sites, Dirichlet β={base.beta}, {args.rounds} rounds, "
        f"{base.training.local_epochs} local epochs, batch {base.training.batch_size}, SGD lr {base.training.lr} "
        "momentum 0.9 — the same for every method. FedSiam-DA μ = 0.1 (paper), prediction head 256→64→256 with "
        "BatchNorm, dual aggregation with a sample-weighted first pass. Global: the aggregated model on the "
        "test split. Local: each site's model after its local training in the last round, on the test split "
        "re-weighted to the site's own label distribution (mean over sites; spread = std over sites); "
        f"balanced: the same models on the plain test split. Mean ± std over seeds {', '.join(map(str, args.seeds))}.",
        "",
        "| method | global accuracy (%) | local accuracy, own distribution (%) | spread over sites "
        "| local, balanced test (%) | wall s per run |",
        "|---|---|---|---|---|---|",
    ]
    for row in table:
        g, lo, b = row["global"], row["local"], row["balanced"]
        lines.append(f"| {row['variant']} | {g[0]:.2f} ± {g[1]:.2f} | {lo[0]:.2f} ± {lo[1]:.2f} | "
                     f"{row['spread']:.2f} | {b[0]:.2f} ± {b[1]:.2f} | {row['wall']:.0f} |")
    write_section(args.section, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
