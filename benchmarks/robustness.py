"""Hostile sites: what the aggregator does with each kind of bad upload, and accuracy under poisoning.

    .venv/bin/python benchmarks/robustness.py [--rounds 20] [--seeds 0 1 2] [--parts cases rules inbound]

Part 1 (``cases``) runs each hostile case once through the simulator's aggregator screen (the same
code the OpenFL aggregation function runs) and reports what happened. Part 2 (``rules``): digits, 3
sites, Dir(0.5), FedAvg; site_1 poisons every round by sending ``w − 10·(w_k − w)`` (its update
sign-flipped and boosted: a classic model-poisoning upload that no norm bound relative to the global
model rejects when the bound is off). Global test accuracy after the last round, mean ± std over the
seeds, per aggregation rule. Part 3 (``inbound``, first seed only): attackers that stay inside every
bound — site_1 sends its update sign-flipped at 0.99 × ``max_update_ratio`` × ‖w‖ (in-bound) or at
0.2 × ‖w‖ (sign-flip), every round — at 2, 3 and 5 sites under ``max_update_ratio: 1``, with and
without ``max_update_spread``; final accuracy against the same plan with site_1 honest, which sites
were rejected and which was named as the likely cause (the stop message: the first round with a
rejection), and the honest and hostile updates' cosines to the other sites' (``min_update_cosine``).
Parts 1–2 write the ``robustness`` section of RESULTS.md, part 3 ``robustness_inbound``. The hostile
behaviour lives here (benchmark only), never in the shipped code.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time

import torch
from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.errors import FedContrastError
from fedcontrast.robust import update_cosines, update_norm, update_spreads
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
    extra = ({"hyperparameters": {"fedpcl": {"pretrain_epochs": 2},
                                  "flesd": {"distill_epochs": 1, "upload": "similarity", "probe_epochs": 5}}}
             if algorithm in ("fedpcl", "flesd") else {})
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
    moves = "".join(f"; round {m.round}: site_1's upload noted as an abnormal move of the global model "
                    f"({m.spread:.3g}× the others' median update)" for m in federation.screen.moves)
    return "accepted" + ("" if finite else " — global model NOT finite") + moves


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


# --- part 3: attackers inside every bound -----------------------------------------------------------
BOUND = 1.0  # the plan's max_update_ratio in part 3 (the plan)
SPREAD = 4.0  # max_update_spread where part 3 sets it (honest digits sites measured within 2.6x, seeds 0-2)
ATTACKERS = (("honest", None), ("in-bound", 0.99 * BOUND), ("sign-flip", 0.2))


def flipped(fraction):
    """site_1's update sign-flipped and scaled to ``fraction`` × ‖w‖ (w: the global model it received)."""
    def transform(federation, site, result):
        start = federation.downlink.global_tensors
        norm, ref = update_norm(result.uploads, start)
        if norm == 0:
            return
        result.uploads = {k: start[k] - fraction * ref / norm * (v - start[k])
                          if k.startswith("model.") and k in start and v.is_floating_point() else v
                          for k, v in result.uploads.items()}
    return transform


def spans(rounds):
    """[1, 2, 3, 7] → 'r1–3, r7'."""
    out, start = [], None
    for i, r in enumerate(rounds):
        if start is None:
            start = r
        if i + 1 == len(rounds) or rounds[i + 1] != r + 1:
            out.append(f"r{start}" if start == r else f"r{start}–{r}")
            start = None
    return ", ".join(out)


def inbound_run(sites, fraction, robustness, seed, rounds):
    """One run under ``on_rejected: exclude``; what ``stop`` would have said is the first round with a
    rejection (identical up to then)."""
    config = RunConfig(algorithm="fedavg", seed=seed, rounds=rounds,
                       robustness={**robustness, "on_rejected": "exclude"}, **{**BASE, "clients": sites})
    federation = Federation(config)
    sent = {}

    def change(federation, site, result):
        if site.name == "site_1" and fraction is not None:
            flipped(fraction)(federation, site, result)
        sent[site.name] = result.uploads

    hostile(federation, change)
    first = []
    explain = federation.screen.explain

    def recording(round_num, rejected, accepted):
        out, hint = explain(round_num, rejected, accepted)
        if out and not first:
            first.append((round_num, sorted(out), "; ".join(out[s] for s in sorted(out)) + hint))
        return out, hint

    federation.screen.explain = recording
    moves = []
    note_move = federation.screen.note_move

    def noting(*args, **kwargs):  # every abnormal move (the screen keeps only the last few)
        move = note_move(*args, **kwargs)
        if move is not None:
            moves.append(move.site)
        return move

    federation.screen.note_move = noting
    out = {"rejected": {}, "causes": {}, "cos_honest": [], "cos_site_1": [], "accuracy": None, "diverged": None,
           "last_message": "", "spreads": []}
    for r in range(rounds):
        sent.clear()
        reference = dict(federation.downlink.global_tensors)
        try:
            rows = federation.run_round(r)
        except FedContrastError as exc:  # nothing left to aggregate (every upload non-finite)
            out["diverged"], out["last_message"] = r + 1, str(exc)
            break
        for row in rows:
            if row["task"] in ("rejected", "likely_cause"):
                out["rejected" if row["task"] == "rejected" else "causes"].setdefault(row["site"], []).append(r + 1)
        if fraction is None:  # honest uploads: how far apart their sizes are (max_update_spread)
            out["spreads"] += update_spreads({s: update_norm(u, reference)[0] for s, u in sent.items()}).values()
        if sites >= 3:
            for site, cos in update_cosines(sent, reference).items():
                out["cos_site_1" if site == "site_1" and fraction is not None else "cos_honest"].append(cos)
        out["accuracy"] = next(row["accuracy"] for row in rows if row["site"] == "global")
    out["first"] = first[0] if first else None
    out["moves"] = moves
    return out


def blamed(message):
    """What a stop message names beyond the rejected senders: the likely cause, earlier abnormal movers."""
    causes = sorted(set(re.findall(r"site '([^']+)' is the likely cause", message)))
    earlier = sorted(set(re.findall(r"site '([^']+)''s upload \(rounds? ", message.split("earlier in this run")[-1])))
    if "earlier in this run" not in message:
        earlier = []
    return "".join([f", likely cause {', '.join(causes)}" if causes else "",
                    f", earlier abnormal moves by {', '.join(earlier)}" if earlier else "",
                    ", 'max_update_ratio off?'" if "max_update_ratio off?" in message else ""])


def named(outcome):
    parts = []
    if outcome["first"] is not None:
        round_num, rejected, message = outcome["first"]
        parts.append(f"**stop (default) in round {round_num}: rejected {', '.join(rejected)}{blamed(message)}**")
    else:
        parts.append("nothing rejected")
    for site, rounds in sorted(outcome["rejected"].items()):
        parts.append(f"excluded {site} {spans(rounds)}")
    for site, rounds in sorted(outcome["causes"].items()):
        parts.append(f"{site} named as likely cause {spans(rounds)}")
    if outcome["diverged"]:
        parts.append(f"every upload non-finite in round {outcome['diverged']}{blamed(outcome['last_message'])}")
    for site in sorted(set(outcome["moves"])):
        parts.append(f"{site}'s upload logged as an abnormal move in {outcome['moves'].count(site)} round(s)")
    return "; ".join(parts)


def accuracy_text(outcome):
    if outcome["accuracy"] is None:
        return f"— (diverged, round {outcome['diverged']})"
    until = f" (until round {outcome['diverged'] - 1})" if outcome["diverged"] else ""
    return f"{100 * outcome['accuracy']:.1f} %{until}"


def cosine_text(values):
    if not values:
        return "—"
    below = sum(v < 0 for v in values) / len(values)
    return f"min {min(values):+.2f}, median {statistics.median(values):+.2f}, {100 * below:.0f} % below 0"


def inbound_part(rounds, seed):
    table = ["| sites | site_1 | plan | final accuracy (site_1 honest → attacked) | what the aggregator named |",
             "|---|---|---|---|---|"]
    cosines = ["| sites | uploads | cosine to the others' median direction |", "|---|---|---|"]
    spreads = []
    for sites in (2, 3, 5):
        plans = [("max_update_ratio 1", {"max_update_ratio": BOUND})]
        if sites >= 3:
            plans.append((f"+ max_update_spread {SPREAD:g}", {"max_update_ratio": BOUND, "max_update_spread": SPREAD}))
        for label, robustness in plans:
            honest = None
            for attacker, fraction in ATTACKERS:
                outcome = inbound_run(sites, fraction, robustness, seed, rounds)
                if fraction is None:
                    honest = outcome
                    spreads += outcome["spreads"]
                    line = f"| {sites} | honest | {label} | {accuracy_text(outcome)} | {named(outcome)} |"
                else:
                    line = (f"| {sites} | {attacker} | {label} | {accuracy_text(honest)} → {accuracy_text(outcome)} | "
                            f"{named(outcome)} |")
                print(line, flush=True)
                table.append(line)
                if sites >= 3 and "max_update_spread" not in robustness:
                    if fraction is None:
                        cosines.append(f"| {sites} | honest sites (no attacker) | "
                                       f"{cosine_text(outcome['cos_honest'])} |")
                    else:
                        cosines.append(f"| {sites} | {attacker} site_1 | {cosine_text(outcome['cos_site_1'])} |")
                        cosines.append(f"| {sites} | honest sites beside it | {cosine_text(outcome['cos_honest'])} |")
    return table, cosines, max(spreads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parts", nargs="+", choices=("cases", "rules", "inbound"),
                        default=["cases", "rules", "inbound"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    if {"cases", "rules"} & set(args.parts):
        cases_and_rules(args)
    if "inbound" in args.parts:
        started = time.time()
        table, cosines, spread = inbound_part(args.rounds, args.seeds[0])
        body = "\n".join([
            "## Attackers inside every bound (`benchmarks/robustness.py --parts inbound`)",
            "",
            f"`.venv/bin/python benchmarks/robustness.py --parts inbound --rounds {args.rounds} "
            f"--seeds {args.seeds[0]}` — {time.strftime('%Y-%m-%d')}, {machine()}, {time.time() - started:.0f} s.",
            "",
            f"Digits, Dir(0.5), FedAvg, 2 local epochs, {args.rounds} rounds, seed {args.seeds[0]}, "
            "`max_update_ratio: 1`, `on_rejected: exclude` (the run goes on; with the default `stop` it would have "
            "stopped at the first rejection, with the message naming the sites listed there). site_1 sends, every "
            f"round, its own update sign-flipped and scaled to {0.99 * BOUND:g} × ‖w‖ (in-bound: just inside the "
            "bound) or 0.2 × ‖w‖ (sign-flip); honest: the same plan with site_1 honest.",
            "",
            *table,
            "",
            "Each upload's cosine to the coordinate-wise median of the other sites' update directions (what "
            "`min_update_cosine` compares), over every round of the `max_update_ratio 1` runs above:",
            "",
            *cosines,
            "",
            f"Honest update norms over the median of the other sites' (what `max_update_spread` compares), every "
            f"site and round of the honest runs above: largest {spread:.3g}.",
        ])
        write_section("robustness_inbound", body)
        print(body)


def cases_and_rules(args) -> None:
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
