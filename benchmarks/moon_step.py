"""MOON local step ÷ FedAvg local step on the same batches, with and without cached references.

    .venv/bin/python benchmarks/moon_step.py [--repeats 5]

One site of 640 digits images (10 batches of 64), 10 local epochs, a previous local model that
differs from the global one (a site's second round and later: both frozen models are needed). Each
figure is a whole collaborator task (``run_task("train")``) divided by its number of SGD steps, so
the cached variant includes its once-per-round pass over the site's data.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _results import machine, write_section

from fedcontrast.algorithms import SiteContext, get_algorithm, weight_tensors
from fedcontrast.algorithms.moon import PREVIOUS_WEIGHTS
from fedcontrast.config import TrainingConfig
from fedcontrast.data import load_dataset
from fedcontrast.models import build_model

VARIANTS = {"fedavg": ("fedavg", {}),
            "moon (per-step references)": ("moon", {"cache_reference_representations": False}),
            "moon (cached references)": ("moon", {"cache_reference_representations": True})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    splits = load_dataset("digits")
    data = splits.train.subset(torch.arange(640))
    torch.manual_seed(0)
    model = build_model("simple_cnn", in_channels=1, image_size=32, num_classes=10)
    global_w = weight_tensors(model)
    torch.manual_seed(1)
    previous = weight_tensors(build_model("simple_cnn", in_channels=1, image_size=32, num_classes=10))
    training = TrainingConfig(local_epochs=10, batch_size=64)
    times = {name: [] for name in VARIANTS}
    for rep in range(args.repeats + 1):
        for name, (alg_name, settings) in VARIANTS.items():
            alg = get_algorithm(alg_name).from_settings(settings)
            site = SiteContext(name="s", data=data, model=model, training=training, round_num=1, seed=rep,
                               device=torch.device("cpu"), state={PREVIOUS_WEIGHTS: previous})
            t0 = time.perf_counter()
            result = alg.run_task("train", site, global_w)
            elapsed = time.perf_counter() - t0
            if rep:  # the first pass warms up allocators and kernels
                times[name].append(elapsed / (10 * 10))
            assert result.weight == 640
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["fedavg"]
    for name, t in med.items():
        print(f"{name:28s} {1e3 * t:7.2f} ms/step  ratio {t / base:.3f}")
    rows = [f"| {name} | {1e3 * t:.2f} | {t / base:.3f} |" for name, t in med.items()]
    write_section("moon_step", "\n".join([
        "## MOON local step vs FedAvg local step",
        "",
        f"Command: `.venv/bin/python benchmarks/moon_step.py --repeats {args.repeats}` on {machine()}.",
        "",
        "Digits 32×32, MOON's simple CNN, batch 64, 10 batches × 10 local epochs; median of "
        f"{args.repeats} whole local-training tasks ÷ 100 steps (cached: includes computing the references once).",
        "",
        "| variant | ms per step | ÷ FedAvg |",
        "|---|---|---|",
        *rows,
        "",
        "Goals: per-step references ≤ 1.7×, cached references ≤ 1.15×.",
    ]))


if __name__ == "__main__":
    main()
