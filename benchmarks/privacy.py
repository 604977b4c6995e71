"""Accuracy vs ε: representation DP for FedPCL and FedSSC, DP-SGD for MOON and FedSSC; the cost of DP.

    .venv/bin/python benchmarks/privacy.py [--rounds 20] [--seeds 0 1 2]

digits, 10 sites, Dir(0.5), mean ± std over the seeds (each seed its own partition). ε is each site's
cumulative ε at δ = 1e-5 after the last round (RDP accountant), from the sites' own recorded
histories — every release included, the once-noised sample count too: the mean and the largest over
sites and seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.sim import run_simulation
from fedcontrast.sim.federation import Federation

DELTA = 1e-5
REP_SIGMAS = (0.5, 2.0, 8.0)  # σ of the Gaussian mechanism on class sums (C = 1)
SGD_SIGMAS = (0.7, 1.5)  # DP-SGD noise multipliers (max grad norm 1)


def variants():
    """(algorithm, label, privacy, changes to the config)."""
    for alg in ("fedpcl", "fedssc"):
        yield alg, f"{alg}, no DP", None, {}
        for s in REP_SIGMAS:
            yield (alg, f"{alg}, σ={s:g}, C=1",
                   {"delta": DELTA, "representations": {"noise_multiplier": s, "clip": 1.0}}, {})
    # FedSSC with both mechanisms: end to end; its class sums come from one pass over every sample
    # with the final model (under DP-SGD the last epoch's batches would not compose).
    yield ("fedssc", "fedssc DP-SGD σ=1 + σ=2, C=1",
           {"delta": DELTA, "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
            "representations": {"noise_multiplier": 2.0, "clip": 1.0}}, {})
    yield "moon", "moon, no DP", None, {}
    for s in SGD_SIGMAS:
        yield ("moon", f"moon DP-SGD, σ={s:g}, clip 1",
               {"delta": DELTA, "dp_sgd": {"noise_multiplier": s, "max_grad_norm": 1.0}}, {})
    # The noise on a prototype has norm ≈ σC√d / n_c: a smaller representation keeps more signal.
    yield "fedpcl", "fedpcl d=32, no DP", None, {"projection_dim": 32}
    for s in REP_SIGMAS[1:]:
        yield ("fedpcl", f"fedpcl d=32, σ={s:g}, C=1",
               {"delta": DELTA, "representations": {"noise_multiplier": s, "clip": 1.0}}, {"projection_dim": 32})


def final_epsilons(metrics_csv: Path, rounds: int) -> list[float]:
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["site"] != "global" and int(r["round"]) == rounds]
    per_site: dict[str, float] = {}  # a site's last task of the round has its cumulative ε
    for r in rows:
        e = json.loads(r["extra"]).get("dp_epsilon")
        if e is not None:
            per_site[r["site"]] = max(e, per_site.get(r["site"], 0.0))
    return list(per_site.values())


COST_VARIANTS = {  # (algorithm, privacy) timed against the same algorithm without DP
    "fedpcl + representation DP": ("fedpcl", {"representations": {"noise_multiplier": 2.0}}),
    "fedssc + representation DP": ("fedssc", {"representations": {"noise_multiplier": 2.0}}),
    "fedssc + DP-SGD + representation DP": ("fedssc", {"dp_sgd": {"noise_multiplier": 1.0},
                                                       "representations": {"noise_multiplier": 2.0}}),
    "moon + DP-SGD": ("moon", {"dp_sgd": {"noise_multiplier": 1.0}}),
}


def round_cost(local_epochs: int, seed: int, repeats: int = 3) -> list[tuple[str, float, float]]:
    """Seconds per round with and without DP: one warm-up round each, then rounds alternating between
    the two federations (the CPU is shared, so interleaving keeps the comparison fair); the minimum."""
    out = []
    for label, (alg, privacy) in COST_VARIANTS.items():
        feds = [Federation(RunConfig(algorithm=alg, dataset="digits", clients=10, beta=0.5, seed=seed,
                                     training={"local_epochs": local_epochs}, privacy=p)) for p in (None, privacy)]
        times: list[list[float]] = [[], []]
        for r in range(repeats + 1):
            for i, fed in enumerate(feds):
                t = time.perf_counter()
                fed.run_round(r)
                if r:  # round 0 is the warm-up (FedPCL pre-trains its backbone there)
                    times[i].append(time.perf_counter() - t)
        out.append((label, min(times[0]), min(times[1])))
        print(f"{label}: {min(times[0]):.2f} s → {min(times[1]):.2f} s per round", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--local-epochs", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "runs" / "privacy"))
    parser.add_argument("--skip", nargs="*", default=[], help="leave out runs whose label contains one of these")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    for alg, label, privacy, changes in variants():
        if any(part in label for part in args.skip):
            continue
        accuracies, eps = [], []
        for seed in args.seeds:
            config = RunConfig(algorithm=alg, dataset="digits", clients=10, beta=0.5, rounds=args.rounds, seed=seed,
                               training={"local_epochs": args.local_epochs}, privacy=privacy, **changes)
            name = label.replace(" ", "").replace(",", "-").replace("=", "").replace("+", "")
            run_dir = Path(args.out) / f"{name}-r{args.rounds}-e{args.local_epochs}-s{seed}"
            summary = run_simulation(config, run_dir, resume=True)
            accuracies.append(summary["final_accuracy"])
            eps += final_epsilons(run_dir / "metrics.csv", args.rounds)
        rows.append((alg, label, accuracies, eps))
        print(f"{label}: {100 * statistics.fmean(accuracies):.2f} %, ε {max(eps) if eps else '∞'}", flush=True)
    costs = round_cost(args.local_epochs, args.seeds[0])
    seeds = " ".join(map(str, args.seeds))
    lines = ["## Privacy: accuracy vs ε, and the cost of DP", "",
             f"Command: `.venv/bin/python benchmarks/privacy.py --rounds {args.rounds} --seeds {seeds} "
             f"--local-epochs {args.local_epochs}` ({(time.perf_counter() - t0) / 60:.1f} min for runs not already "
             f"in benchmarks/runs, on {machine()}).", "",
             f"digits, 10 sites, Dirichlet β=0.5, {args.rounds} rounds (not 50: shared CPU), mean ± std over seeds "
             f"{seeds} (each its own partition), {args.local_epochs} local epochs, batch 64, SGD lr 0.01. FedPCL: 1 "
             "simple-CNN backbone pre-trained on the public split, accuracy personalised (nearest prototype by "
             "squared distance, each site on its own label distribution). FedSSC and MOON: global-model test "
             "accuracy. Representation DP: each sample's representation clipped to L2 ≤ C = 1, noise std σC on every "
             "per-class sum and σ on every count, every round (the weights FedSSC also uploads are *not* protected "
             "by it unless DP-SGD is on too; then its class sums come from one pass over every sample with the final "
             "model). DP-SGD: Opacus, per-sample clipping 1, Poisson batches q = 1/⌈n/64⌉. Under DP each site's "
             "sample count is released once with noise σ = 10 (accounted). ε at δ = "
             f"{DELTA:g} from each site's recorded accountant history (RDP) after the last round: mean and largest "
             "over the 10 sites and the seeds (sites differ in size, which matters for DP-SGD only).", "",
             "| run | final accuracy | ε (mean over sites) | ε (largest site) |",
             "|---|---|---|---|"]
    for _, label, accs, eps in rows:
        e_mean = f"{statistics.fmean(eps):.3g}" if eps else "∞ (no DP)"
        e_max = f"{max(eps):.3g}" if eps else "∞"
        spread = f" ± {100 * statistics.stdev(accs):.2f}" if len(accs) > 1 else ""
        lines.append(f"| {label} | {100 * statistics.fmean(accs):.2f}{spread} % | {e_mean} | {e_max} |")
    lines += ["", "Cost of DP per round (10 sites in one process, the whole round: local training, uploads, "
              "aggregation, evaluation; rounds of the two federations interleaved, the fastest of "
              "3 after a warm-up round; σ = 2 for representations, σ = 1 for DP-SGD):", "",
              "| run | s / round without DP | s / round with DP | cost |", "|---|---|---|---|"]
    for label, plain, private in costs:
        lines.append(f"| {label} | {plain:.2f} | {private:.2f} | {private / plain:.2f}× |")
    write_section("privacy", "\n".join(lines))


if __name__ == "__main__":
    main()
