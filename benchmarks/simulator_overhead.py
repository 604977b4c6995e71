"""Simulator overhead: one simulator round vs a bare PyTorch loop doing the same work.

    .venv/bin/python benchmarks/simulator_overhead.py [--rounds 6] [--repeats 2]

The same process, data, initial model, batches (same seeds) and optimiser: FedAvg on digits,
10 sites, 10 local epochs. The simulator's round is timed end to end as a user sees it (plugin calls,
upload validation, byte accounting, test evaluation, checkpoint, metrics.csv, summary.json,
TensorBoard); the bare loop does local SGD, the weighted average and the test evaluation.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from _results import machine, write_section

from fedcontrast.algorithms.training import batch_indices, site_generator
from fedcontrast.config import RunConfig
from fedcontrast.sim import Federation, derive_seed, run_simulation


def bare_rounds(config: RunConfig, rounds: int) -> list[float]:
    fed = Federation(config)  # only for the identical data split and initial model
    model = fed.site_model
    global_state = {k: v.clone() for k, v in fed.server.model.state_dict().items()}
    cfg = config.training
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        states, sizes = [], []
        for site in fed.sites:
            model.load_state_dict(global_state)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            gen = site_generator(derive_seed(config.seed, r, site.index, 0))
            for _ in range(cfg.local_epochs):
                for idx in batch_indices(len(site.data), cfg.batch_size, gen):
                    _, logits = model(site.data.x[idx])
                    loss = F.cross_entropy(logits, site.data.y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(site.data))
        n = sum(sizes)
        global_state = {k: sum(s[k] * (m / n) for s, m in zip(states, sizes)) for k in global_state}
        model.load_state_dict(global_state)
        model.eval()
        with torch.no_grad():
            (model(fed.test.x)[1].argmax(1) == fed.test.y).float().mean().item()
        times.append(time.perf_counter() - t0)
    return times


def simulator_rounds(config: RunConfig, rounds: int) -> list[float]:
    stamps = []
    tmp = tempfile.mkdtemp()
    try:
        run_simulation(config.replace(rounds=rounds), f"{tmp}/run",
                       progress=lambda done, total, row: stamps.append(time.perf_counter()))
    finally:
        shutil.rmtree(tmp)
    # Round 1 also pays one-off set-up (TensorBoard writer, first plot import); rounds 2.. are the steady state.
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = RunConfig(algorithm="fedavg", dataset="digits", clients=10, rounds=args.rounds, seed=0)
    bare, sim = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides
        bare += bare_rounds(config, args.rounds)[1:]
        sim += simulator_rounds(config, args.rounds + 1)
    b, s = statistics.median(bare), statistics.median(sim)
    print(f"bare loop {b:.3f} s/round, simulator {s:.3f} s/round, ratio {s / b:.3f}")
    write_section("simulator_overhead", "\n".join([
        "## Simulator overhead",
        "",
        f"Command: `.venv/bin/python benchmarks/simulator_overhead.py --rounds {args.rounds} --repeats {args.repeats}` "
        f"on {machine()}.",
        "",
        "FedAvg on digits, 10 sites, Dir(0.5), 10 local epochs, batch 64; median over "
        f"{len(sim)} simulator rounds and {len(bare)} bare-loop rounds (first round of each run dropped).",
        "",
        "| | seconds per round |",
        "|---|---|",
        f"| bare PyTorch loop (local SGD + weighted average + test accuracy) | {b:.3f} |",
        "| `fedcontrast` simulator (same work + validation, byte accounting, checkpoint, metrics, TensorBoard) | "
        f"{s:.3f} |",
        f"| **ratio** (goal ≤ 1.05) | **{s / b:.3f}** |",
    ]))


if __name__ == "__main__":
    main()
