"""FLESD with 2 rounds vs FedAvg with 10 rounds (same total local epochs, SimCLR local training for
both): linear-probe accuracy and bytes uploaded per site; and the time of one ESD step vs N.

    .venv/bin/python benchmarks/flesd.py [--total-epochs 100] [--seeds 0 1 2] [--sizes 256 1024 4096]

Runs land in benchmarks/runs/flesd (reused if present). digits, 10 sites, Dirichlet β=0.5; the
public set is the run's held-out public split (10 % of the training split, 144 images), which no
site trains on. The linear probe trains on the labelled training split and reports test accuracy.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import machine, write_section

from fedcontrast.algorithms.flesd import distill
from fedcontrast.config import RunConfig
from fedcontrast.construction import build_algorithm, initial_model, load_splits
from fedcontrast.evaluation import linear_probe
from fedcontrast.losses import ensemble_similarity
from fedcontrast.sim import run_simulation
from fedcontrast.sim.simulator import print_progress


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(values, scale=100.0):
    m, s = mean_std([scale * v for v in values])
    return f"{m:.2f} ± {s:.2f}"


def accuracy_runs(args, base):
    variants = {
        "FLESD, 2 rounds": base.replace(algorithm="flesd", rounds=2,
                                        training={"local_epochs": args.total_epochs // 2}),
        "FLESD, 2 rounds, int8 upload": base.replace(algorithm="flesd", rounds=2,
                                                     training={"local_epochs": args.total_epochs // 2},
                                                     hyperparameters={"flesd": {"quantize": "int8"}}),
        "FedAvg (SimCLR), 10 rounds": base.replace(algorithm="fedavg_simclr", rounds=10,
                                                  training={"local_epochs": args.total_epochs // 10}),
    }
    if args.heterogeneous:
        variants["FLESD, 2 rounds, site 9 on ResNet-18"] = base.replace(
            algorithm="flesd", rounds=2, training={"local_epochs": args.total_epochs // 2},
            hyperparameters={"flesd": {"site_models": ["simple_cnn"] * 9 + ["resnet18"]}})
    results = {}
    for label, config in variants.items():
        seeds = args.seeds if "ResNet" not in label else args.seeds[:1]
        folder = label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        for seed in seeds:
            run = Path(args.out) / f"{folder}-s{seed}"
            print(f"== {label}, seed {seed}", file=sys.stderr)
            summary = run_simulation(config.replace(seed=seed), run, resume=True, progress=print_progress())
            results.setdefault(label, []).append(summary)
    return results


SWEEP = {  # ESD settings tried around the defaults (the local training is the same in every row)
    "defaults (20 ESD epochs, τ_T 0.1, m 0.9, augmented)": {},
    "5 ESD epochs": {"distill_epochs": 5},
    "τ_T = τ_S = 0.2": {"target_temperature": 0.2},
    "τ_T = τ_S = 0.05": {"target_temperature": 0.05},
    "m = 0.99": {"momentum": 0.99},
    "no augmentation during ESD": {"distill_augment": False},
}


def sweep(args, base):
    rows = []
    for label, settings in SWEEP.items():
        finals = []
        for seed in args.seeds:
            name = "sweep-" + "-".join(f"{k}{v}" for k, v in settings.items()) if settings else "sweep-defaults"
            config = base.replace(algorithm="flesd", rounds=2, seed=seed,
                                  training={"local_epochs": args.total_epochs // 2},
                                  hyperparameters={"flesd": settings})
            print(f"== sweep {label}, seed {seed}", file=sys.stderr)
            summary = run_simulation(config, Path(args.out) / f"{name}-s{seed}", resume=True)
            finals.append(summary["final_accuracy"])
        rows.append((label, finals))
    return rows


def random_encoder_probe(base, seeds):
    """The floor: the linear probe on the untrained (randomly initialised) encoder."""
    splits = load_splits(base)
    accs = []
    for seed in seeds:
        model = initial_model(base.replace(seed=seed), in_channels=splits.in_channels, image_size=splits.image_size,
                              num_classes=splits.num_classes)
        probe = linear_probe(model.encoder, splits.train, splits.test, torch.device("cpu"), module=model)
        accs.append(probe["probe_accuracy"])
    return accs


def esd_timing(sizes, sites=10, repeats=3):
    """Seconds for: the ensemble of ``sites`` uploads (N×d representations → N×N), one ESD step
    (a batch of 64 against the anchor queue), and one ESD epoch over P, for public sets of N images."""
    config = RunConfig(algorithm="flesd")
    algorithm = build_algorithm(config)
    rows = []
    for n in sizes:
        algorithm.public_size = n
        torch.manual_seed(0)
        model = initial_model(config, in_channels=1, image_size=32, num_classes=10)
        x = torch.randn(n, 1, 32, 32)
        zs = [F.normalize(torch.randn(n, model.projection_dim), dim=1) for _ in range(sites)]
        t0 = time.perf_counter()
        for _ in range(repeats):
            target = ensemble_similarity([z @ z.T for z in zs], target_temperature=algorithm.hp.target_temperature)
        ensemble_s = (time.perf_counter() - t0) / repeats
        hp = algorithm.hp
        one_epoch = type(hp)(**{**hp.__dict__, "distill_epochs": 1})
        student = copy.deepcopy(model)
        distill(student, x[:128], target[:128, :128], one_epoch, seed=0)  # warm-up
        t0 = time.perf_counter()
        distill(student, x, target, one_epoch, seed=0)
        epoch_s = time.perf_counter() - t0
        steps = max(1, n // hp.distill_batch_size)
        rows.append((n, ensemble_s, epoch_s / steps, epoch_s, n * n * 4))
        print(f"N={n}: ensemble {ensemble_s:.3f} s, step {1000 * epoch_s / steps:.1f} ms, epoch {epoch_s:.2f} s",
              file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-epochs", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--heterogeneous", action="store_true", help="also a run with one ResNet-18 site (slow on CPU)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "runs" / "flesd"))
    parser.add_argument("--sweep", action="store_true", help="only the ESD settings sweep (section flesd_sweep)")
    parser.add_argument("--public-fraction", type=float, default=0.1,
                        help="share of the training split held out as the public set (another value: section "
                             "flesd_public<percent>, no timing table)")
    args = parser.parse_args()

    base = RunConfig(dataset="digits", clients=10, partition="dirichlet", beta=0.5,
                     public_fraction=args.public_fraction)
    default_public = args.public_fraction == 0.1
    if not default_public:
        args.out = str(Path(args.out) / f"public{round(100 * args.public_fraction)}")
    public_n = len(load_splits(base).public)
    if args.sweep:
        t0 = time.perf_counter()
        rows = sweep(args, base)
        lines = ["## FLESD: ESD settings sweep on digits", "",
                 f"Command: `.venv/bin/python benchmarks/flesd.py --sweep --total-epochs {args.total_epochs} --seeds "
                 f"{' '.join(map(str, args.seeds))}` ({(time.perf_counter() - t0) / 60:.1f} min, on {machine()}). "
                 "Same setting as the FLESD section above (2 rounds × "
                 f"{args.total_epochs // 2} local SimCLR epochs); one ESD setting changed per row.", "",
                 "| ESD setting | linear-probe accuracy (%) | per seed |", "|---|---|---|"]
        for label, finals in rows:
            lines.append(f"| {label} | {fmt(finals)} | {' / '.join(f'{100 * f:.2f}' for f in finals)} |")
        write_section("flesd_sweep", "\n".join(lines))
        print("\n".join(lines))
        return
    t0 = time.perf_counter()
    results = accuracy_runs(args, base)
    floor = random_encoder_probe(base, args.seeds)
    wall = time.perf_counter() - t0
    timing = esd_timing(args.sizes) if default_public else []

    lines = [
        "## FLESD vs FedAvg with SimCLR local training on digits"
        + ("" if default_public else f", public set {100 * args.public_fraction:g} % of the training split"),
        "",
        f"Command: `.venv/bin/python benchmarks/flesd.py --total-epochs {args.total_epochs} --seeds "
        f"{' '.join(map(str, args.seeds))} --sizes {' '.join(map(str, args.sizes))}"
        + ("" if default_public else f" --public-fraction {args.public_fraction:g}")
        + (" --heterogeneous" if args.heterogeneous else "") + f"` ({wall / 60:.1f} min for the runs not already in "
        f"benchmarks/runs, on {machine()}).",
        "",
        f"Setting: digits (32×32), {base.clients} sites, Dirichlet β={base.beta}, {args.total_epochs} local epochs in "
        "total for every method (FLESD 2 rounds × "
        f"{args.total_epochs // 2}, FedAvg 10 rounds × {args.total_epochs // 10}), SimCLR local training for both "
        "(NT-Xent τ 0.5, Adam 1e-3, batch 64, random resized crop + shift + brightness/contrast jitter). FLESD: "
        f"public set = the held-out public split ({public_n} images, not trained on by any site), τ_T = τ_S = 0.1, "
        "20 ESD epochs per round, Adam 1e-3, momentum encoder m = 0.9, anchor queue min(1024, N) = "
        f"{min(1024, public_n)}. Accuracy: linear probe "
        "(frozen encoder features, L-BFGS logistic regression on the labelled training split, test accuracy). "
        f"Mean ± std over seeds {', '.join(map(str, args.seeds))}.",
        "",
        "| method | rounds | linear-probe accuracy (%) | bytes uploaded per site per round | per site, whole run "
        "| wall s per run |",
        "|---|---|---|---|---|---|",
    ]
    for label, summaries in results.items():
        finals = [s["final_accuracy"] for s in summaries]
        up = summaries[0]["bytes_uploaded_per_site_per_round"]
        rounds = summaries[0]["rounds_completed"]
        wall_s = statistics.mean(s["wall_time_s"] for s in summaries)
        lines.append(f"| {label} | {rounds} | {fmt(finals)} | {up:,.0f} B | {up * rounds:,.0f} B | {wall_s:.0f} |")
    lines.append(f"| untrained encoder (floor) | 0 | {fmt(floor)} | – | – | – |")
    flesd = [s["final_accuracy"] for s in results["FLESD, 2 rounds"]]
    fedavg = [s["final_accuracy"] for s in results["FedAvg (SimCLR), 10 rounds"]]
    gap = 100 * (statistics.mean(flesd) - statistics.mean(fedavg))
    lines += ["", f"FLESD − FedAvg: {gap:+.2f} points linear-probe accuracy (goal ≥ 0, as the paper reports).", ""]
    if not default_public:
        write_section(f"flesd_public{round(100 * args.public_fraction)}", "\n".join(lines))
        print("\n".join(lines))
        return
    lines += [
        "### One ESD step on the aggregator vs the public set size N",
        "",
        "Random images and representations (the cost does not depend on their values); 10 sites' N×d uploads; "
        "batch 64, anchor queue min(1024, N), simple CNN, CPU.",
        "",
        "| N | ensemble of 10 uploads (s) | one ESD step (ms) | one ESD epoch over P (s) | target matrix (MiB) |",
        "|---|---|---|---|---|",
    ]
    for n, ens, step, epoch, nbytes in timing:
        lines.append(f"| {n:,} | {ens:.3f} | {1000 * step:.1f} | {epoch:.2f} | {nbytes / 2**20:.1f} |")
    write_section("flesd", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
