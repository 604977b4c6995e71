"""A cross-silo federation across hosts (network namespaces) ÷ the simulator on the same data.

    sudo .venv/bin/python benchmarks/crosssilo.py [--rounds 20] [--algorithm moon]

An operator and three hospitals, each on its own network namespace with its own directory, set up
with exactly the documented commands (`fedcontrast workspace create/ca init/workspace export`,
`site join`, `ca sign`, `site import-cert`), then `fx aggregator start` and `fx collaborator start`
on each host, mutual TLS across the namespaces' network. The hospitals hold the digits shards of a
Dir(0.5) partition as image folders (train/ = exactly the simulator's shard; test/ = a held-out set
with the site's own label distribution); the operator holds no data.

Figures: seconds per round (median interval between consecutive aggregations, rounds 2 … R) ÷ the
simulator's (the same config, digits, same shards and seed, one process); time from `fx aggregator
start` to the end of the first round; every site's held-out accuracy after the last round.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab
from fedcontrast.lab.netns import netns_unavailable
from fedcontrast.sim import run_simulation

SITES = ["hosp1", "hosp2", "hosp3"]


def simulator(config: RunConfig, tmp: Path) -> tuple[list[float], dict]:
    stamps: list[float] = []
    summary = run_simulation(config, tmp / "sim", progress=lambda d, t, row: stamps.append(time.time()))
    return [b - a for a, b in zip(stamps, stamps[1:])][1:], summary  # drop the set-up call and round 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--algorithm", default="moon")
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"crosssilo benchmark: {reason}")
    tmp = Path(tempfile.mkdtemp())
    with CrossSiloLab(tmp / "lab", SITES) as lab:
        t0 = time.time()
        exp = lab.deploy("fed", algorithm=args.algorithm, port=50551, options=["--rounds", str(args.rounds)])
        setup = time.time() - t0
        lab.start(exp)
        codes = lab.wait(exp, 3600)
        if any(code != 0 for code in codes.values()):
            raise SystemExit(f"the federation failed: {codes}\n{lab.log(exp, OPERATOR)[-3000:]}")
        records = exp.records(lab)
        wall = records[-1]["time"] - exp.started
    trained = [r["trained_at"] for r in records]
    fl = statistics.median([b - a for a, b in zip(trained, trained[1:])])
    first = trained[0] - exp.started
    config = RunConfig(algorithm=args.algorithm, dataset="digits", clients=len(SITES), sites=tuple(SITES),
                       rounds=args.rounds)
    sim_rounds, summary = simulator(config, tmp)
    sim = statistics.median(sim_rounds)
    shutil.rmtree(tmp, ignore_errors=True)
    last = records[-1]
    print(f"cross-silo {fl:.2f} s/round vs simulator {sim:.2f} s/round: ratio {fl / sim:.2f}; first round done "
          f"{first:.1f} s after `fx aggregator start`; set-up by the documented commands {setup:.0f} s")
    for site, values in last["sites"].items():
        print(f"  {site}: held-out accuracy {values['evaluation']['accuracy']:.4f} on "
              f"{values['evaluation']['samples']:.0f} images ({values['samples']:.0f} training images)")
    print(f"  weighted mean {last['site_accuracy']:.4f}; simulator's global test accuracy "
          f"{summary['final_accuracy']:.4f}")

    lines = [f"## Cross-silo federation across hosts ({args.algorithm}, {len(SITES)} sites, {args.rounds} rounds)", "",
             f"Command: `.venv/bin/python benchmarks/crosssilo.py --rounds {args.rounds} --algorithm {args.algorithm}` "
             f"(as root) on {machine()}, {time.strftime('%Y-%m-%d')}.", "",
             "An operator and three hospitals, each on its own Linux network namespace with its own directory, set "
             "up with the documented commands (workspace create → ca init → workspace export → site join → ca sign → "
             "site import-cert), then `fx aggregator start` and `fx collaborator start -n NAME` on each host, mutual "
             "TLS over the namespaces' network. The hospitals hold the digits shards of a Dir(0.5) partition as PNG "
             "folders (train/ = the simulator's shard; test/ = held out with the site's own label distribution); the "
             "operator holds no data. Each collaborator gets `cores ÷ sites` threads (at least 1); the simulator runs "
             "the same config (digits, same shards, same seed) in one process with 2 threads. Every federation round "
             "also includes each site's evaluation of the model it received, which the simulator does not do.", "",
             "| | seconds per round (median, rounds 2 …) | ratio | `fx aggregator start` → first round aggregated | "
             "set-up (documented commands, all parties) |", "|---|---|---|---|---|",
             f"| cross-silo (3 hosts) | {fl:.2f} | **{fl / sim:.2f}** | {first:.1f} s | {setup:.0f} s |",
             f"| simulator | {sim:.2f} | 1.00 | | |", "",
             f"Goal: ratio ≤ 1.3. Total wall time of the federation: {wall:.0f} s.", "",
             f"Held-out accuracy at each site after round {args.rounds} (the final model, measured by the site "
             "on its own test/ folder):", "",
             "| site | training images | held-out images | held-out accuracy |", "|---|---|---|---|"]
    for site, values in last["sites"].items():
        lines.append(f"| {site} | {values['samples']:.0f} | {values['evaluation']['samples']:.0f} | "
                     f"{100 * values['evaluation']['accuracy']:.2f} % |")
    lines.append(f"| weighted mean | | | **{100 * last['site_accuracy']:.2f} %** |")
    lines += ["", f"For scale: the simulator's global model on the shared digits test split after {args.rounds} "
              f"rounds: {100 * summary['final_accuracy']:.2f} %."]
    write_section(f"crosssilo_{args.algorithm}", "\n".join(lines))


if __name__ == "__main__":
    main()
