"""Hostile sites: what the aggregator does with each kind of bad upload, and accuracy under poisoning.

    .venv/bin/python benchmarks/robustness.py [--rounds 20] [--seeds 0 1 2]

Part 1 runs each hostile case once through the simulator's aggregator screen (the same code the
OpenFL aggregation function runs) and reports what happened. Part 2: digits, 3 sites, Dir(0.5),
FedAvg; site_1 poisons every round by sending ``w − 10·(w_k − w)`` (its update sign-flipped and
boosted: a classic model-poisoning upload that no norm bound relative to the global model rejects
when the bound is off). Global test accuracy after the last round, mean ± std over the seeds, per
aggregation rule. The hostile behaviour lives here (benchmark only), never in the shipped code.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.errors import FedContrastError
from fedcontrast.robust import update_norm
from fedcontrast.sim.federation import Federation

BASE = dict(dataset="digits", clients=3, beta=0.5, min_samples=20, training={"local_epochs": 2})


def hostile(federation: Federation, change) -> None:
    run_task = federation.algorithm.run_task

    def patched(task, site, received):
        result = run_task(task, site, received)
        change(federation, site, result)
        return result

    federation.algorithm.run_task = patched


def on_site_1(at_round, transform):
    def change(federation, site, result):
        if site.name == "site_1" and site.round_num == at_round:
            transform(federation, site, result)
    return change


def scaled(factor):
    def transform(federation, site, result):
        result.uploads = {k: v * factor for k, v in result.uploads.items()}
    return transform


def boosted(factor):
    def transform(federation, site, result):
        start = federation.downlink.global_tensors
        result.uploads = {k: start[k] + factor * (v - start[k]) if k in start else v for k, v in result.uploads.items()}
    return transform


def claims(weight):
    def transform(federation, site, result):
        result.weight = weight
    return transform


def replay():
    kept = {}

    def change(federation, site, result):
        if site.name != "site_1":
            return
        if site.round_num == 0:
            kept.update({k: v.clone() for k, v in result.uploads.items()})
        elif site.round_num == 1:
            result.uploads = dict(kept)
    return change


def nan_upload(federation, site, result):
    key = next(iter(result.uploads))
    result.uploads[key] = torch.full_like(result.uploads[key], float("nan"))


def fedpcl_scaled(federation, site, result):
    result.uploads = {k: v * 1e6 if v.is_floating_point() else v for k, v in result.uploads.items()}


def flesd_anti(federation, site, result):
    m = next((v for k, v in result.uploads.items() if k.endswith("similarity")), None)
    if m is None:  # the train task (the similarity task uploads)
        return
    anti = -torch.ones_like(m) + 2 * torch.eye(m.shape[0])
    result.uploads = {k: anti if k.endswith("similarity") else v for k, v in result.uploads.items()}


def cases():
    """(label, algorithm, robustness settings, change)."""
    yield "weights × 1e30 (finite)", "fedavg", {}, on_site_1(1, scaled(1e30))
    yield "NaN in the weights", "fedavg", {}, on_site_1(1, nan_upload)
    yield "update × 20, default bound (10)", "fedavg", {}, on_site_1(1, boosted(20))
    yield "update × 20, max_update_ratio 0.3", "fedavg", {"max_update_ratio": 0.3}, on_site_1(1, boosted(20))
    yield "claims 1e12 samples, no max_samples", "fedavg", {}, on_site_1(1, claims(1e12))
    yield "claims 1e12 samples, max_samples 2000", "fedavg", {"max_samples": 2000}, on_site_1(1, claims(1e12))
    yield "negative sample count", "fedavg", {}, on_site_1(1, claims(-5.0))
    yield "replays its round-1 upload in round 2", "fedavg", {}, replay()
    yield "FedPCL prototypes × 1e6", "fedpcl", {}, on_site_1(1, fedpcl_scaled)
    yield "FLESD similarities −1 off the diagonal", "flesd", {}, on_site_1(1, flesd_anti)


def run_case(label, algorithm, robustness, change, seed):
    extra = {"hyperparameters": {"fedpcl": {"pretrain_epochs": 2}, "flesd": {"distill_epochs": 1, "upload": "similarity", "probe_epochs": 5}}} \
        if algorithm in ("fedpcl", "flesd") else {}
    config = RunConfig(algorithm=algorithm, seed=seed, rounds=2, robustness={**robustness, "on_rejected": "exclude"},
                       **BASE, **extra)
    federation = Federation(config)
    hostile(federation, change)
    rejected = []
    try:
        for r in range(2):
            rows = federation.run_round(r)
            rejected += [f"round {row['round']}: {row['site']}" for row in rows if row["task"] == "rejected"]
    except FedContrastError as exc:
        return f"stopped: {exc}"
    if rejected:
        return "rejected (" + ", ".join(rejected) + "), the others aggregated"
    finite = all(bool(torch.isfinite(v).all()) for v in federation.downlink.global_tensors.values()
                 if v.is_floating_point())
    return "accepted" + ("" if finite else " — global model NOT finite")


def poisoned_accuracy(rule, poison, seed, rounds):
    robustness = {"rule": rule, "max_update_ratio": None}
    config = RunConfig(algorithm="fedavg", seed=seed, rounds=rounds, robustness=robustness, **BASE)
    federation = Federation(config)
    ratios = []

    def change(federation, site, result):
        start = federation.downlink.global_tensors
        if site.name != "site_1" or not poison:
            norm, ref = update_norm(result.uploads, start)
            ratios.append(norm / ref)
            return
        boosted(-10)(federation, site, result)

    hostile(federation, change)
    for r in range(rounds):
        try:
            rows = federation.run_round(r)
        except FedContrastError:  # every upload non-finite: the global model the sites received diverged
            return None, ratios, r + 1
    accuracy = next(row["accuracy"] for row in rows if row["site"] == "global")
    return accuracy, ratios, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.time()

    lines = ["| hostile site_1 | what the aggregator did |", "|---|---|"]
    for label, algorithm, robustness, change in cases():
        outcome = run_case(label, algorithm, robustness, change, seed=0)
        print(f"{label}: {outcome}", flush=True)
        lines.append(f"| {label} | {outcome.replace('|', '/')} |")

    table = ["| rule | site_1 | final accuracy (mean ± std) |", "|---|---|---|"]
    honest_ratios = []
    for rule in ("mean", "median", "trimmed_mean"):
        for poison in (False, True):
            accs, diverged = [], []
            for seed in args.seeds:
                acc, ratios, failed_at = poisoned_accuracy(rule, poison, seed, args.rounds)
                honest_ratios += ratios
                if acc is None:
                    diverged.append(failed_at)
                else:
                    accs.append(acc)
            who = "poisons every round (w − 10·update)" if poison else "honest"
            if accs:
                mean, std = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
                figure = f"{100 * mean:.1f} ± {100 * std:.1f} %"
            else:
                figure = "—"
            if diverged:
                figure += (f"; diverged in {len(diverged)} of {len(args.seeds)} seeds (every site's upload NaN from "
                           f"round {min(diverged)})")
            print(f"{rule:13s} {who:38s} {figure}", flush=True)
            table.append(f"| {rule} | {who} | {figure} |")
    top = max(honest_ratios)
    q = sorted(honest_ratios)[math.ceil(0.99 * len(honest_ratios)) - 1]
    body = "\n".join([
        "## Hostile sites (`benchmarks/robustness.py`)",
        "",
        f"`.venv/bin/python benchmarks/robustness.py --rounds {args.rounds} --seeds {' '.join(map(str, args.seeds))}` "
        f"— {time.strftime('%Y-%m-%d')}, {machine()}, {time.time() - started:.0f} s.",
        "",
        "Each hostile case once (digits, 3 sites, 2 rounds, `on_rejected: exclude` so that the run goes on; "
        "with the default `stop` the federation stops after the round, naming the sender):",
        "",
        *lines,
        "",
        f"Accuracy with one of three sites poisoned (digits, Dir(0.5), FedAvg, 2 local epochs, {args.rounds} rounds, "
        "`max_update_ratio` off so that only the rule acts):",
        "",
        *table,
        "",
        f"Honest update sizes ‖w_k − w‖/‖w‖ over every site and round: largest {top:.3g}, 99th percentile {q:.3g} "
        "(the default `max_update_ratio` 10 is far above them; a hostile-site plan can set it near them).",
    ])
    write_section("robustness", body)
    print(body)


if __name__ == "__main__":
    main()
