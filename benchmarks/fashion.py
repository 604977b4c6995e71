"""Fashion-MNIST: every algorithm against FedAvg on label skew and on feature shift, each tuned on the
sites' validation parts over a small grid from its paper, over seeds, with paired intervals.

    .venv/bin/python benchmarks/fashion.py [--jobs 2] [--seeds 0 1 2] [--settings dir0.1 dir0.5 scanner]
                                           [--algorithms fedavg moon ...] [--grid full|small]
                                           [--rounds 30] [--local-epochs 5] [--train-samples 10000] [--no-section]

The data are the real Fashion-MNIST from Debian's package (`apt-get install dataset-fashion-mnist`),
read with no flag. Settings: 10 sites with Dirichlet β = 0.1 and β = 0.5 label skew, and a feature
shift in which the labels are split IID but every site has a scanner of its own (contrast,
brightness, blur, noise; the test split divided among the scanners). Runs land in
benchmarks/runs/fashion (finished ones are reused, interrupted ones resumed), each in a process of
its own with one torch thread, `--jobs` at a time.

Tuning and reporting: for each setting and algorithm, the grid point with the highest mean final
validation accuracy (the sites' validation parts, never the test split) is chosen; its final test
accuracy is reported as mean ± sd over the seeds, and the paired difference against FedAvg (same
seed: same partition, same initial model) with a 95 % t interval. Each seed's runs share the
partition. FedPCL is scored as its paper scores it, per site on its own labels (personalised), and
set beside FedAvg's local models scored the same way; FLESD by the linear probe of its encoder.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from _results import machine, write_section

OUT = Path(__file__).parent / "runs" / "fashion"
SETTINGS = {  # label → the run's split of the data among the sites
    "dir0.1": {"partition": "dirichlet", "beta": 0.1},
    "dir0.5": {"partition": "dirichlet", "beta": 0.5},
    "scanner": {"partition": "iid", "feature_shift": "scanner"},
}
SETTING_NAMES = {"dir0.1": "label skew, Dir(0.1)", "dir0.5": "label skew, Dir(0.5)",
                 "scanner": "feature shift (a scanner per site, labels IID)"}
# each algorithm's grid, from its paper's own sweep (MOON: μ ∈ {0.1, 1, 5, 10}; FedProx as MOON tuned
# it, μ ∈ {0.001, 0.01, 0.1, 1}; FedSiam-DA's μ = 0.1 and a tenfold larger; FedSSC's MOON weight;
# FedPCL's temperature; FLESD's target temperature), cut to what 2 cores allow
GRID: dict[str, list[dict[str, Any]]] = {
    "fedavg": [{}],
    "fedprox": [{"mu": 0.001}, {"mu": 0.01}, {"mu": 0.1}],
    "moon": [{"mu": 0.1}, {"mu": 1.0}, {"mu": 5.0}],
    "fedssc": [{"mu_moon": 1.0}, {"mu_moon": 5.0}],
    "fedsiam_da": [{"mu": 0.1}, {"mu": 1.0}],
    "fedpcl": [{"temperature": 0.07}, {"temperature": 0.5}],
    "flesd": [{"target_temperature": 0.1}],
}
# --grid small: what fitted 2 cores (MOON's three μ, FedProx's two; one point, the paper's, for the others)
SMALL_GRID: dict[str, list[dict[str, Any]]] = {
    "fedavg": [{}],
    "fedprox": [{"mu": 0.01}, {"mu": 0.1}],
    "moon": [{"mu": 0.1}, {"mu": 1.0}, {"mu": 5.0}],
    "fedssc": [{"mu_moon": 1.0}],
    "fedsiam_da": [{"mu": 0.1}],
    "fedpcl": [{"temperature": 0.07}],
    "flesd": [{"target_temperature": 0.1}],
}
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "moon": "MOON", "fedssc": "FedSSC", "fedsiam_da": "FedSiam-DA",
          "fedpcl": "FedPCL (personalised)", "flesd": "FLESD (linear probe)"}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def grid_of(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    return GRID if args.grid == "full" else SMALL_GRID


def run_name(setting: str, algorithm: str, grid_point: dict[str, Any], seed: int) -> str:
    point = "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in grid_point.items())
    return f"{setting}/{algorithm}{'-' + point if point else ''}-s{seed}"


def config_for(args: argparse.Namespace, setting: str, algorithm: str, grid_point: dict[str, Any], seed: int):
    from fedcontrast.config import RunConfig

    training = {"local_epochs": args.local_epochs, "batch_size": 64, "lr": 0.01}
    rounds = args.rounds
    if algorithm == "flesd":  # its paper's protocol: two rounds, as many local epochs in all as the others
        rounds, training = 2, {**training, "local_epochs": max(1, args.rounds * args.local_epochs // 2)}
    return RunConfig(algorithm=algorithm, dataset="fashion_mnist",
                     dataset_settings={"train_samples": args.train_samples}, clients=args.clients, rounds=rounds,
                     seed=seed, training=training,
                     hyperparameters={algorithm: dict(grid_point)} if grid_point else {},
                     executor={"site_cpus": 1}, **SETTINGS[setting])


def one_run(args: argparse.Namespace, setting: str, algorithm: str, grid_point: dict[str, Any], seed: int):
    """A run in this worker process (resumed where it stopped); returns its summary."""
    from fedcontrast.sim import run_simulation

    config = config_for(args, setting, algorithm, grid_point, seed)
    path = Path(args.out) / run_name(setting, algorithm, grid_point, seed)
    summary_file = path / "summary.json"
    if summary_file.exists():
        done = json.loads(summary_file.read_text())
        if done.get("rounds_completed") == config.rounds and "threads_per_site" in done:
            if algorithm == "fedavg":
                done["final_probe_accuracy"] = final_probe(config, path)
            return done
    summary = run_simulation(config, path, resume=path.exists(), local_evaluation=algorithm == "fedavg")
    if algorithm == "fedavg":  # FLESD is scored by a linear probe: FedAvg's final encoder probed alike
        summary["final_probe_accuracy"] = final_probe(config, path)
    return summary


def final_probe(config, path: Path) -> float:
    """The linear probe of the run's final global encoder, as FLESD's is scored (its own protocol: the
    sites' training data without their validation parts, the test split), kept in probe.json."""
    from fedcontrast.algorithms import load_weights
    from fedcontrast.algorithms.simclr import probe
    from fedcontrast.sim.checkpoint import load_checkpoint
    from fedcontrast.sim.federation import Federation

    kept = path / "probe.json"
    if kept.exists():
        return float(json.loads(kept.read_text())["probe_accuracy"])
    federation = Federation(config)
    load_weights(federation.server.model, load_checkpoint(path / "checkpoint.pt")["federation"]["downlink"]["global"])
    measured = probe(federation.server.model, federation.server, federation.test, 100)
    kept.write_text(json.dumps(measured) + "\n")
    return float(measured["probe_accuracy"])


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of a − b over the seeds and its 95 % t interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, sd = mean_sd(diffs)
    half = T_975.get(len(diffs) - 1, 1.96) * sd / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return mean, mean - half, mean + half


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}"


def report(args: argparse.Namespace, results: dict[tuple, dict[str, Any]], wall: float) -> str:
    lines = ["## Fashion-MNIST: contrastive and representation-sharing FL against FedAvg (`benchmarks/fashion.py`)", "",
             f"Command: `.venv/bin/python benchmarks/fashion.py --jobs {args.jobs} --seeds "
             f"{' '.join(map(str, args.seeds))} --rounds {args.rounds} --local-epochs {args.local_epochs} "
             f"--train-samples {args.train_samples} --grid {args.grid}` ({wall / 3600:.1f} h for the runs not "
             f"already in benchmarks/runs/fashion, {args.jobs} runs at a time with one torch thread each, on "
             f"{machine()}; "
             f"the runs' own wall time added up: {sum(r.get('wall_time_s') or 0 for r in results.values()) / 3600:.1f} "
             "h).", "",
             f"Data: the real Fashion-MNIST (Debian's `dataset-fashion-mnist`), **sub-sampled to fit 2 cores**: "
             f"{args.train_samples:,} training images (stratified), of which 10 % are the public split (FedPCL's "
             f"backbone, FLESD's distillation set; no site trains on it) and each site holds out 10 % of its share as "
             f"its validation part; the whole official test split (10,000 images). {args.clients} sites, "
             f"{args.rounds} rounds of {args.local_epochs} local epochs (FLESD: 2 rounds of "
             f"{args.rounds * args.local_epochs // 2}, its paper's protocol), batch 64, SGD lr 0.01 momentum 0.9, "
             "MOON's simple CNN on 28×28 images, every run from the same initial model at a seed. The full-size "
             "version (54,000 images, 100 rounds) needs a GPU: `--train-samples 60000 --rounds 100`.", "",
             "Tuning: the grid point with the best mean **final validation accuracy** is chosen per setting; the "
             "test split chooses nothing. Test accuracy: mean ± sd over seeds "
             f"{', '.join(map(str, args.seeds))}; Δ: the paired difference against FedAvg at the same seed, with its "
             "95 % t interval. **Beats FedAvg** means Δ ≥ +2 points with the interval above 0."
             + (" With `--grid small` only MOON (μ 0.1, 1, 5) and FedProx (μ 0.01, 0.1) are tuned; the others run "
                "their paper's setting (`--grid full` sweeps two or three points each)."
                if args.grid == "small" else ""),
             ""]
    verdicts = []
    for setting in args.settings:
        lines += [f"### {SETTING_NAMES[setting]}", "",
                  "| algorithm | chosen (by validation) | validation | test | Δ vs FedAvg [95 % CI] | verdict |",
                  "|---|---|---|---|---|---|"]
        base = {s: results.get((setting, "fedavg", 0, s)) for s in args.seeds}
        base_test = [base[s]["final_accuracy"] for s in args.seeds if base[s]]
        for algorithm in args.algorithms:
            points = grid_of(args)[algorithm]
            scored = []
            for i in range(len(points)):
                runs = [results.get((setting, algorithm, i, s)) for s in args.seeds]
                if all(runs) and all(r.get("final_val_accuracy") is not None for r in runs):
                    scored.append((statistics.fmean(r["final_val_accuracy"] for r in runs), i, runs))
            if not scored:
                lines.append(f"| {LABELS[algorithm]} | (runs missing) | | | | |")
                continue
            _, chosen, runs = max(scored, key=lambda t: (t[0], -t[1]))
            point = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in points[chosen].items())
            val_m, val_s = mean_sd([r["final_val_accuracy"] for r in runs])
            test = [r["final_accuracy"] for r in runs]
            test_m, test_s = mean_sd(test)
            if algorithm == "fedavg" or len(base_test) != len(test):
                delta, verdict = "—", "reference"
            else:
                reference = base_test
                if algorithm == "fedpcl":  # personalised: against FedAvg's local models on their own labels
                    reference = [base[s]["final_metrics"].get("local_accuracy", math.nan) for s in args.seeds]
                if algorithm == "flesd":  # a linear probe: against the probe of FedAvg's encoder
                    reference = [base[s].get("final_probe_accuracy", math.nan) for s in args.seeds]
                d, lo, hi = paired(test, reference)
                delta = f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                verdict = ("**beats FedAvg**" if d >= 0.02 and lo > 0 else "better (interval above 0)" if lo > 0
                           else "worse (interval below 0)" if hi < 0 else "no difference shown")
                if algorithm == "fedpcl":
                    delta += " vs FedAvg's local models"
                if algorithm == "flesd":
                    delta += " vs FedAvg's encoder probed"
                verdicts.append((setting, algorithm, verdict, d))
            lines.append(f"| {LABELS[algorithm]} | {point or 'its defaults'} | {100 * val_m:.2f} ± {100 * val_s:.2f} % "
                         f"| {100 * test_m:.2f} ± {100 * test_s:.2f} % | {delta} | {verdict} |")
        local = [base[s]["final_metrics"].get("local_accuracy") for s in args.seeds if base[s]]
        probes = [base[s].get("final_probe_accuracy") for s in args.seeds if base[s]]
        notes = []
        if local and all(v is not None for v in local):
            m, sd = mean_sd(local)
            notes.append(f"FedAvg's local models scored per site on its own labels (what FedPCL is set beside): "
                         f"{100 * m:.2f} ± {100 * sd:.2f} %")
        if probes and all(v is not None for v in probes):
            m, sd = mean_sd(probes)
            notes.append(f"FedAvg's final encoder under FLESD's linear probe (what FLESD is set beside): "
                         f"{100 * m:.2f} ± {100 * sd:.2f} %")
        if notes:
            lines += ["", "; ".join(notes) + "."]
        lines.append("")
    lines += ["### Every grid point (mean over seeds)", "",
              "| setting | algorithm | grid point | validation | test |", "|---|---|---|---|---|"]
    for setting in args.settings:
        for algorithm in args.algorithms:
            for i, point in enumerate(grid_of(args)[algorithm]):
                runs = [results.get((setting, algorithm, i, s)) for s in args.seeds]
                if not all(runs):
                    continue
                vals = [r["final_val_accuracy"] for r in runs if r.get("final_val_accuracy") is not None]
                lines.append(f"| {setting} | {LABELS[algorithm]} | "
                             f"{', '.join(f'{k} {v}' for k, v in point.items()) or '—'} | "
                             f"{pct(statistics.fmean(vals)) if vals else 'n/a'} | "
                             f"{pct(statistics.fmean(r['final_accuracy'] for r in runs))} |")
    winners = [(s, a, d) for s, a, v, d in verdicts if v == "**beats FedAvg**"]
    against = {"fedpcl": "FedAvg's local models (each site on its own labels)",
               "flesd": "FedAvg's final encoder under the same linear probe"}
    lines += ["", "**Verdict:** " + ("; ".join(f"{LABELS[a]} beats {against.get(a, 'FedAvg')} by {100 * d:.1f} points "
                                                 f"under {SETTING_NAMES[s]}" for s, a, d in winners)
                                     if winners else "no method beats FedAvg by ≥ 2 points with its interval above 0 "
                                                     "in these settings.")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--algorithms", nargs="+", default=list(GRID), choices=list(GRID))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--train-samples", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--grid", choices=["full", "small"], default="full",
                        help="full: each paper's small sweep (default); small: what fits 2 cores in an hour")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--out", default=None, help="where the runs land (default: benchmarks/runs/fashion/ and "
                        "a folder named by --rounds, --local-epochs, --train-samples, so other budgets never meet)")
    parser.add_argument("--no-section", action="store_true", help="print the report, leave RESULTS.md alone")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(OUT / f"r{args.rounds}-e{args.local_epochs}-n{args.train_samples}")
    if "fedavg" not in args.algorithms:
        args.algorithms.insert(0, "fedavg")  # the reference every Δ is paired with
    grid = grid_of(args)
    jobs = [(setting, algorithm, i, seed) for seed in args.seeds for setting in args.settings
            for algorithm in args.algorithms for i in range(len(grid[algorithm]))]
    results: dict[tuple, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(one_run, args, s, a, grid[a][i], seed): (s, a, i, seed) for s, a, i, seed in jobs}
        for n, future in enumerate(as_completed(futures), start=1):
            key = futures[future]
            try:
                results[key] = future.result()
            except Exception as exc:  # one failed run is reported, the others go on
                print(f"[{n}/{len(jobs)}] {run_name(key[0], key[1], grid[key[1]][key[2]], key[3])} failed: {exc}",
                      file=sys.stderr, flush=True)
                continue
            done = results[key]
            print(f"[{n}/{len(jobs)}] {run_name(key[0], key[1], grid[key[1]][key[2]], key[3])}: test "
                  f"{pct(done['final_accuracy'])} %, validation {pct(done.get('final_val_accuracy'))} % "
                  f"({(time.perf_counter() - t0) / 60:.0f} min so far)", file=sys.stderr, flush=True)
    text = report(args, results, time.perf_counter() - t0)
    print(text)
    if not args.no_section:
        write_section("fashion", text)


if __name__ == "__main__":
    main()
