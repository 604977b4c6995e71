"""A free-riding site against the upload screen: what it costs, whether it is rejected and named, and
whether an honest site is ever blamed (issue 46).

    .venv/bin/python benchmarks/free_rider.py [--seeds 0 1 2] [--rounds 6] [--parts attack honest]
                                              [--datasets digits fashion_mnist] [--no-section]

Part ``attack``: 3 sites, Dir(0.5), FedAvg, TrainingConfig's defaults (10 local epochs),
``on_rejected: exclude`` so that the run goes on. site_1 trains honestly in round 1, then sends, every
round, its round-1 upload altered — plus fresh Gaussian noise of norm 2 × 10⁻⁵ of the upload's (twice
the fixed near-copy radius, ``noise``), or scaled by 1 + (−1)ᵗ·10⁻⁴·(1 + (t − 2)/5) in round t
(``scale±``: 1 + 10⁻⁴, 1 − 1.2 × 10⁻⁴, 1 + 1.4 × 10⁻⁴…, a different copy each round, since the same
copy twice is an exact replay that the digest catches). Each is
run with the screen as it was (``min_progress`` off: the fixed radius 10⁻⁵ only, *before*) and as it
is by default (``min_progress`` 0.1, *after*), against the same plan with site_1 honest; on digits
and on Fashion-MNIST (Debian's package; 3,000 training images, stratified). Part ``honest``: the
default MOON and FedAvg runs on digits (10 local epochs, 3 sites Dir(0.5), and 10 small sites
Dir(0.1)), nobody hostile: every rejection is an honest site blamed.

Reported: final global accuracy (mean ± sd over the seeds) and the free-rider's cost (honest −
attacked, paired by seed); the rounds in which site_1 was rejected and the first rejection's
sentence; honest sites rejected (must be 0); the smallest ratio, over every honest site and every
pair of its rounds, of the distance between its two uploads to the distance the global model moved
between them, as the screen's sketches measure it (what ``min_progress`` compares; the free-rider's
in the same units). Writes the ``free_rider`` section of RESULTS.md. The hostile behaviour lives
here, never in the shipped code.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import statistics
import time
from typing import Any

import torch
from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.robust.replay import NEAR_REPLAY
from fedcontrast.sim.federation import Federation

FREE_RIDER = "site_1"
ATTACKS = {"noise": ("round-1 upload + noise of norm 2e-5 × its norm", ("noise", 2 * NEAR_REPLAY)),
           "scale±": ("round-1 upload × (1 ± 1e-4·(1 + (t−2)/5)), sign alternating", ("scale", 1e-4))}
SCREENS = {"before": {"min_progress": None}, "after": {}}  # after: the default min_progress
DATASETS = {"digits": {"dataset": "digits"},
            "fashion_mnist": {"dataset": "fashion_mnist", "dataset_settings": {"train_samples": 3000}}}
NAMES = {"digits": "digits", "fashion_mnist": "Fashion-MNIST"}


def _floating_norm(upload: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.detach().double().pow(2).sum()) for v in upload.values() if v.is_floating_point()))


def free_rider(federation: Federation, how: tuple[str, float] | None) -> None:
    """site_1 keeps its round-1 upload and from round 2 on sends it altered (``how``: ("noise", relative
    norm) or ("scale", ε)); the screen measures what it sends, as a deployed aggregator would."""
    if how is None:
        return
    kept: dict[str, torch.Tensor] = {}
    train_site = federation.train_site

    def patched(site, round_num, received, reference=None):
        outcome = train_site(site, round_num, received, reference)
        if site.name != FREE_RIDER:
            return outcome
        if not kept:
            kept.update({k: v.detach().clone() for k, v in outcome.uploads.items()})
            return outcome
        kind, size = how
        if kind == "noise":
            g = torch.Generator().manual_seed(1000 + round_num)
            noise = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in kept.items()
                     if v.is_floating_point()}
            scale = size * _floating_norm(kept) / _floating_norm(noise)
            sent = {k: (v.double() + scale * noise[k]).to(v.dtype) if k in noise else v.clone()
                    for k, v in kept.items()}
        else:  # a different copy each round, + and − by turns (the same one twice would be an exact replay)
            factor = 1 + (-1) ** round_num * size * (1 + (round_num - 2) / 5)
            sent = {k: v * factor if v.is_floating_point() else v.clone() for k, v in kept.items()}
        outcome.uploads = sent
        if outcome.measured is not None:
            outcome.measured = federation.screen.measure(sent, reference)
        return outcome

    federation.train_site = patched  # type: ignore[method-assign]


def progress_ratios(federation: Federation) -> dict[str, float]:
    """Site → the smallest ratio, over every pair of its accepted uploads, of their sketches' distance to
    the distance between the sketches of the global models they were made from (what min_progress
    compares)."""
    out = {}
    for site, history in federation.screen.sketches.items():
        n = history.count
        if n < 2:
            continue
        uploads, received = history.matrix[:n], history.received[:n]
        ratios = [float(torch.linalg.vector_norm(uploads[i] - uploads[j])
                        / torch.linalg.vector_norm(received[i] - received[j])) for i in range(n) for j in range(i)]
        ratios = [r for r in ratios if math.isfinite(r)]
        if ratios:
            out[site] = min(ratios)
    return out


def one_run(base: dict[str, Any], seed: int, rounds: int, screen: dict[str, Any], how: tuple[str, float] | None
            ) -> dict[str, Any]:
    robustness = {**screen, "on_rejected": "exclude"}
    config = RunConfig(seed=seed, rounds=rounds, robustness=robustness, **base)
    federation = Federation(config)
    free_rider(federation, how)
    first: list[str] = []
    explain = federation.screen.explain

    def recording(round_num, rejected, accepted):
        out, hint = explain(round_num, rejected, accepted)
        if FREE_RIDER in out and not first:
            first.append(out[FREE_RIDER])
        return out, hint

    federation.screen.explain = recording  # type: ignore[method-assign]
    rejected: dict[str, list[int]] = {}
    rows: list[dict[str, Any]] = []
    for r in range(1, rounds + 1):
        rows = federation.run_round(r)
        for row in rows:
            if row["task"] == "rejected":
                rejected.setdefault(row["site"], []).append(r)
    accuracy = next(row["accuracy"] for row in rows if row["site"] == "global")
    ratios = progress_ratios(federation)
    honest = {s: v for s, v in ratios.items() if how is None or s != FREE_RIDER}
    return {"accuracy": accuracy, "rejected": rejected, "first": first[0] if first else "",
            "honest_ratio": min(honest.values(), default=math.inf)}


def mean_sd(values: list[float]) -> str:
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * sd:.1f} %"


def spans(rounds: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(rounds):
        start = r if start is None else start
        if i + 1 == len(rounds) or rounds[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}–{r}")
            start = None
    return ", ".join(out)


def attack_part(args) -> tuple[list[str], str, list[str]]:
    table = ["| data | site_1 | screen | final accuracy | cost (honest − attacked, paired) | site_1 rejected in rounds "
             "(seeds) | honest sites rejected |", "|---|---|---|---|---|---|---|"]
    ratios_table = ["| data | site_1 | its ratio in round 2 (per seed) | smallest honest ratio (every honest site and "
                    "pair of its rounds, in every run on these data) |", "|---|---|---|---|"]
    sentence = ""
    for dataset in args.datasets:
        base = {**DATASETS[dataset], "algorithm": "fedavg", "clients": 3, "beta": 0.5,
                "training": {"local_epochs": args.local_epochs}}
        honest = [one_run(base, seed, args.rounds, {}, None) for seed in args.seeds]
        honest_blamed = sum(len(v) for h in honest for v in h["rejected"].values())
        honest_ratios = [h["honest_ratio"] for h in honest]
        own: list[tuple[str, str]] = []
        line = (f"| {NAMES[dataset]} | honest | after | {mean_sd([h['accuracy'] for h in honest])} | — | — | "
                f"{honest_blamed} |")
        print(line, flush=True)
        table.append(line)
        for label, how in ATTACKS.values():
            for screen, settings in SCREENS.items():
                runs = [one_run(base, seed, args.rounds, settings, how) for seed in args.seeds]
                costs = [h["accuracy"] - a["accuracy"] for h, a in zip(honest, runs)]
                caught = "; ".join(spans(a["rejected"].get(FREE_RIDER, [])) or "never" for a in runs)
                blamed = sum(len(v) for a in runs for s, v in a["rejected"].items() if s != FREE_RIDER)
                honest_ratios += [a["honest_ratio"] for a in runs]
                cost = statistics.mean(costs)
                line = (f"| {NAMES[dataset]} | {label} | {screen} | {mean_sd([a['accuracy'] for a in runs])} | "
                        f"{100 * cost:+.1f} points (per seed {', '.join(f'{100 * c:+.1f}' for c in costs)}) | "
                        f"{caught} | {blamed} |")
                print(line, flush=True)
                table.append(line)
                if screen == "after":
                    sentence = sentence or runs[0]["first"]
                    found = [re.search(r"it moved (\S+)× the global model's move", a["first"]) for a in runs]
                    own.append((label, ", ".join(m.group(1) if m else "not measured" for m in found)))
        for label, ratios in own:
            line = f"| {NAMES[dataset]} | {label} | {ratios} | {min(honest_ratios):.3g} |"
            ratios_table.append(line)
            print(line, flush=True)
    return table, sentence, ratios_table


def honest_part(args) -> list[str]:
    table = ["| algorithm | sites | final accuracy | honest uploads rejected | smallest progress ratio |",
             "|---|---|---|---|---|"]
    for algorithm in ("fedavg", "moon"):
        for clients, beta in ((3, 0.5), (10, 0.1)):
            base = {"dataset": "digits", "algorithm": algorithm, "clients": clients, "beta": beta}
            runs = [one_run(base, seed, args.rounds, {}, None) for seed in args.seeds]
            blamed = sum(len(v) for a in runs for v in a["rejected"].values())
            line = (f"| {algorithm} | {clients}, Dir({beta:g}) | {mean_sd([a['accuracy'] for a in runs])} | {blamed} | "
                    f"{min(a['honest_ratio'] for a in runs):.3g} |")
            print(line, flush=True)
            table.append(line)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-epochs", type=int, default=10, help="the attack part's (the honest part: 10)")
    parser.add_argument("--parts", nargs="+", choices=("attack", "honest"), default=["attack", "honest"])
    parser.add_argument("--datasets", nargs="+", choices=tuple(DATASETS), default=list(DATASETS))
    parser.add_argument("--no-section", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    torch.set_num_threads(2)
    logging.getLogger("fedcontrast").setLevel(logging.ERROR)  # each rejection is also logged as a warning
    started = time.time()
    body = ["## A free-riding site (`benchmarks/free_rider.py`)", "",
            f"`.venv/bin/python benchmarks/free_rider.py --seeds {' '.join(map(str, args.seeds))} "
            f"--rounds {args.rounds} --local-epochs {args.local_epochs} --parts {' '.join(args.parts)} "
            f"--datasets {' '.join(args.datasets)}` — {time.strftime('%Y-%m-%d')}, {machine()}, WALL s.", ""]
    if "attack" in args.parts:
        table, sentence, ratios = attack_part(args)
        body += [f"3 sites, Dir(0.5), FedAvg, {args.local_epochs} local epochs, {args.rounds} rounds, "
                 "`on_rejected: exclude` (with the default `stop` the federation stops at the first rejection, "
                 "naming site_1). site_1 trains in round 1, then resends its round-1 upload altered, every round. "
                 "*before*: the fixed near-copy radius only (`min_progress: null`); *after*: the default "
                 "`min_progress` 0.1. Fashion-MNIST: 3,000 training images.", "", *table, "",
                 "The first rejection (seed 0, *after*):", "", f"> {sentence}", "",
                 "Progress ratio: an upload's distance to an earlier upload of its site over the distance the "
                 "global model moved between the two (sketches, as the screen measures them; `min_progress` "
                 "rejects below 0.1):", "", *ratios, ""]
    if "honest" in args.parts:
        body += [f"Honest runs with the defaults (digits, 10 local epochs, {args.rounds} rounds, seeds "
                 f"{', '.join(map(str, args.seeds))}; nobody hostile):", "", *honest_part(args), ""]
    text = "\n".join(body).replace("WALL s", f"{time.time() - started:.0f} s")
    print(text)
    if not args.no_section:
        write_section("free_rider", text)


if __name__ == "__main__":
    main()
