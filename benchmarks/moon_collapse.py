"""Why MOON collapsed on the README's main job, measured: every local step of a run, instrumented.

    .venv/bin/python benchmarks/moon_collapse.py [--seed 4] [--rounds 50] [--no-check] [--no-section]

The job is the README's main command (MOON on the digits, 3 sites, Dirichlet β = 0.5, 10 local epochs
of SGD at lr 0.01, μ = 5, τ = 0.5) in the simulator at one thread per site, which equals the OpenFL
run bit for bit. It runs three times: MOON with the defaults before issue 44 (a constant learning
rate, no clipping, no augmentation), MOON with today's defaults, and FedAvg with the old defaults.
Recorded:

- every local step: cross-entropy, the contrastive term, the norm of the representation z, the
  norm of d = n(z_prev) − n(z_glob) (0 where R_prev = R_global), the norms of the gradients of CE
  and of μ·l_con apart and of the whole step, the largest logit;
- every site and round: how far its weights moved, and the mean cosine of its uploaded model's
  representations of 256 fixed test images with those of its uploads one and two rounds before.

The instrumentation only reads: each run's metrics are checked equal to a plain run's (`--no-check`
skips that; a run benchmarks/main_job.py made of the same job, where there is one, is the plain run:
its accuracy after every round must equal the instrumented run's). Writes section `moon_collapse` of RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import machine, write_section
from main_job import OLD, run_name
from main_job import OUT as MAIN_JOB  # benchmarks/main_job.py's runs: the plain reference

import fedcontrast.algorithms.fedavg as fedavg_module
import fedcontrast.algorithms.moon as moon_module
import fedcontrast.algorithms.training as training_module
from fedcontrast.algorithms.base import load_weights
from fedcontrast.config import RunConfig
from fedcontrast.construction import load_splits
from fedcontrast.sim import run_simulation


class Recorder:
    """Hooks on the simulator's own code: they read tensors, never change one."""

    def __init__(self, probe: torch.Tensor) -> None:
        self.probe = probe  # (256, C, H, W) fixed test images
        self.steps: list[dict] = []
        self.uploads: dict[tuple[str, int], torch.Tensor] = {}  # (site, round) → representations of the probe
        self.site: dict = {}
        self.pending: dict = {}

    def install(self):
        real_task, real_loss, real_step = (fedavg_module.FedAvg.task_train, moon_module.Moon.local_loss,
                                           training_module.optimizer_step)
        real_difference = moon_module.moon_loss_from_difference
        recorder = self

        def task_train(algorithm, site, received):
            params = [p for p in site.model.parameters() if p.requires_grad]
            recorder.site = {"name": site.name, "round": site.round_num, "params": params, "y": site.data.y,
                             "start": None, "epoch": 0}
            seen: dict = {}
            hook = site.model.classifier.register_forward_hook(
                lambda module, inputs, output: seen.update(z=inputs[0].detach(), logits=output.detach()))
            recorder.site["seen"] = seen
            try:
                result = real_task(algorithm, site, received)
            finally:
                hook.remove()
            model = copy.deepcopy(site.model).eval()
            load_weights(model, result.uploads)
            with torch.no_grad():
                recorder.uploads[(site.name, site.round_num)] = model.represent(recorder.probe)
            return result

        def local_loss(algorithm, site, received):
            extra = real_loss(algorithm, site, received)

            def measured(x, idx, z, logits, epoch):
                term, parts = extra(x, idx, z, logits, epoch)
                params, y = recorder.site["params"], recorder.site["y"][idx]
                ce = F.cross_entropy(logits, y)
                g_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
                g_con = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
                recorder.pending.update(g_ce=_norm(g_ce), g_con=_norm(g_con), ce=float(ce.detach()),  # beside d
                                        con=float(parts["contrastive"]), epoch=epoch)
                return term, parts

            return measured

        def loss_from_difference(z, d, *, temperature):
            recorder.pending["d"] = float(d.norm(dim=1).mean())
            return real_difference(z, d, temperature=temperature)

        def optimizer_step(optimizer, cfg, *, clip=True):
            params = recorder.site["params"]
            if recorder.site["start"] is None:
                recorder.site["start"] = torch.cat([p.detach().flatten() for p in params]).clone()
            seen = recorder.site["seen"]
            row = {"site": recorder.site["name"], "round": recorder.site["round"], "g": _norm([p.grad for p in params]),
                   "z": float(seen["z"].norm(dim=1).mean()), "logit": float(seen["logits"].abs().max()),
                   **recorder.pending}
            recorder.pending = {}
            real_step(optimizer, cfg, clip=clip)
            row["moved"] = float((torch.cat([p.detach().flatten() for p in params]) - recorder.site["start"]).norm())
            recorder.steps.append(row)

        fedavg_module.FedAvg.task_train = task_train
        moon_module.Moon.local_loss = local_loss
        moon_module.moon_loss_from_difference = loss_from_difference
        training_module.optimizer_step = optimizer_step

        def uninstall():
            fedavg_module.FedAvg.task_train, moon_module.Moon.local_loss = real_task, real_loss
            moon_module.moon_loss_from_difference, training_module.optimizer_step = real_difference, real_step

        return uninstall


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))


def read_rows(run: Path) -> tuple[list[float], list[tuple[int, float]]]:
    """The global test curve, and each site-round's mean cross-entropy (round, CE) from metrics.csv."""
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    curve = [float(r["accuracy"]) for r in rows if r["site"] == "global"]
    ce = [(int(r["round"]), json.loads(r["extra"])["ce"]) for r in rows if r["task"] == "train"]
    return curve, ce


def measure(config: RunConfig, out: Path, check: bool, reference: Path | None = None) -> dict:
    probe = load_splits(config).test.x[:256]
    recorder = Recorder(probe)
    uninstall = recorder.install()
    try:
        summary = run_simulation(config, out / "instrumented", overwrite=True)
    finally:
        uninstall()
    curve, ce = read_rows(out / "instrumented")
    if check:  # the same run without the hooks: the instrumentation only read
        if reference is not None and (reference / "summary.json").exists():  # benchmarks/main_job.py's own run
            plain = json.loads((reference / "summary.json").read_text())["accuracy_curve"]
            if plain != curve:
                raise SystemExit(f"the instrumented run of {config.algorithm} differs from {reference}: "
                                 "not a measurement")
        else:
            run_simulation(config, out / "plain", overwrite=True)
            a, b = (open(out / n / "metrics.csv").read() for n in ("instrumented", "plain"))
            if a != b:
                raise SystemExit(f"the instrumented run of {config.algorithm} differs from the plain run: "
                                 "not a measurement")
    return {"summary": summary, "steps": recorder.steps, "uploads": recorder.uploads, "curve": curve, "ce": ce}


def statistics_of(result: dict, rounds: int) -> dict:
    steps, uploads = result["steps"], result["uploads"]
    sites = sorted({s["site"] for s in steps})
    by_round: dict[tuple[str, int], list[dict]] = {}
    for s in steps:
        by_round.setdefault((s["site"], s["round"]), []).append(s)
    later = [(k, v) for k, v in by_round.items() if k[1] >= 10]
    cos1, cos2 = [], []
    for site in sites:
        for r in range(5, rounds + 1):
            if (site, r - 2) in uploads:
                cos1.append(float(F.cosine_similarity(uploads[(site, r)], uploads[(site, r - 1)], dim=1).mean()))
                cos2.append(float(F.cosine_similarity(uploads[(site, r)], uploads[(site, r - 2)], dim=1).mean()))
    first = [v[0] for _, v in later]
    acc = result["curve"]
    drops = [r + 1 for r in range(4, len(acc)) if acc[r] < acc[r - 1] - 0.05]
    return {
        "final": acc[-1], "lowest_after_30": min(acc[30:]) if len(acc) > 30 else min(acc), "drops": drops,
        "max_g": max(s["g"] for s in steps), "steps_g_over_20": sum(s["g"] > 20 for s in steps),
        "z_start": statistics.median(v[0]["z"] for _, v in later),
        "z_peak": statistics.median(max(s["z"] for s in v) for _, v in later),
        "d_start": statistics.fmean(s["d"] for s in first) if first and "d" in first[0] else None,
        "g_con_start": statistics.median(s["g_con"] for s in first) if first and "g_con" in first[0] else None,
        "g_ce_start": statistics.median(s.get("g_ce", s["g"]) for s in first),
        "moved": statistics.median(v[-1]["moved"] for _, v in later),
        "cos1": statistics.fmean(cos1), "cos2": statistics.fmean(cos2),
        "site_rounds_ce": sum(ce > 0.05 for r, ce in result["ce"] if r >= 10),
        "site_rounds": sum(r >= 10 for r, _ in result["ce"]),
    }


def worst_steps(result: dict, around: int = 6) -> list[str]:
    steps = result["steps"]
    peak = max(range(len(steps)), key=lambda i: steps[i]["g"])
    lines = ["| round | site | step of the round | CE | l_con | ‖z‖ | ‖d‖ | ‖∇CE‖ | ‖∇μ·l_con‖ | ‖∇‖ | max logit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    site, rnd = steps[peak]["site"], steps[peak]["round"]
    of_round = [i for i, s in enumerate(steps) if s["site"] == site and s["round"] == rnd]
    for i in range(max(peak - around, of_round[0]), min(peak + around, of_round[-1]) + 1):
        s = steps[i]
        cells = [f"{s[k]:{fmt}}" if k in s else "—" for k, fmt in
                 (("ce", ".3f"), ("con", ".3f"), ("z", ".1f"), ("d", ".2f"), ("g_ce", ".2f"), ("g_con", ".2f"),
                  ("g", ".2f"), ("logit", ".1f"))]
        lines.append(f"| {s['round']} | {s['site']} | {i - of_round[0] + 1} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=4, help="a seed whose old run collapses (benchmarks/main_job.py)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--no-check", action="store_true", help="skip the plain runs that check the hooks read only")
    parser.add_argument("--no-section", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    job = RunConfig(algorithm="moon", dataset="digits", clients=3, partition="dirichlet", beta=0.5, rounds=args.rounds,
                    seed=args.seed, executor={"site_cpus": 1})
    runs = {"MOON, defaults before issue 44": job.replace(training=OLD),
            "MOON, today's defaults": job,
            "FedAvg, defaults before issue 44": job.replace(algorithm="fedavg", training=OLD)}
    t0 = time.perf_counter()
    results, stats = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, config) in enumerate(runs.items()):
            results[label] = measure(config, Path(tmp) / str(i), check=not args.no_check,
                                     reference=MAIN_JOB / run_name(label, args.seed))
            stats[label] = statistics_of(results[label], args.rounds)
            print(label, json.dumps(stats[label]), flush=True)
    wall = time.perf_counter() - t0

    def cell(v, fmt):
        return "—" if v is None else format(v, fmt)

    lines = ["## Why MOON collapsed on the README's main job: `benchmarks/moon_collapse.py`", "",
             f"Command: `.venv/bin/python benchmarks/moon_collapse.py --seed {args.seed} --rounds {args.rounds}` "
             f"({wall / 60:.1f} min on {machine()}; each instrumented run checked equal to a plain run of the job: "
             f"{'no' if args.no_check else 'yes'}). The README's job in the simulator at one thread per site, seed "
             f"{args.seed}. Medians over site-rounds from round 10 on unless said.", "",
             "| | MOON, old defaults | MOON, today's defaults | FedAvg, old defaults |", "|---|---|---|---|"]
    keys = list(runs)
    rows = [("final test accuracy", "final", ".2%"), ("lowest test accuracy after round 30", "lowest_after_30", ".2%"),
            ("rounds ≥ 5 points below the one before", "drops", None),
            ("largest step gradient ‖∇‖", "max_g", ".1f"), ("steps with ‖∇‖ > 20", "steps_g_over_20", "d"),
            ("‖z‖ at a round's start → its peak in the round", None, None),
            ("‖d‖ = ‖n(z_prev) − n(z_glob)‖ at a round's start (mean; 0 when R_prev = R_global)", "d_start", ".2f"),
            ("‖∇ μ·l_con‖ / ‖∇ CE‖ at a round's start", None, None),
            ("weights moved in a round (L2)", "moved", ".2f"),
            ("cos(upload r, upload r − 1) of a site's representations (mean, rounds 5+)", "cos1", "+.2f"),
            ("cos(upload r, upload r − 2)", "cos2", "+.2f"),
            ("site-rounds (round 10 on) whose mean cross-entropy exceeds 0.05", None, None)]
    for name, key, fmt in rows:
        if key == "drops":
            values = [", ".join(map(str, stats[k]["drops"])) or "none" for k in keys]
        elif name.startswith("‖z‖"):
            values = [f"{stats[k]['z_start']:.1f} → {stats[k]['z_peak']:.1f}" for k in keys]
        elif name.startswith("‖∇ μ"):
            values = [f"{stats[k]['g_con_start']:.2f} / {stats[k]['g_ce_start']:.2f}" if stats[k]["g_con_start"]
                      is not None else f"— / {stats[k]['g_ce_start']:.2f}" for k in keys]
        elif name.startswith("site-rounds"):
            values = [f"{stats[k]['site_rounds_ce']} of {stats[k]['site_rounds']}" for k in keys]
        else:
            values = [cell(stats[k][key], fmt) for k in keys]
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    lines += ["", "The steps around the largest gradient of the old MOON run:", "", *worst_steps(results[keys[0]])]
    text = "\n".join(lines)
    print(text)
    if not args.no_section:
        write_section("moon_collapse", text)


if __name__ == "__main__":
    main()
