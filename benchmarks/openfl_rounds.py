"""OpenFL deployment round time ÷ simulator round time for the same work; bytes per site per round.

    .venv/bin/python benchmarks/openfl_rounds.py [--collaborators 2 3 5] [--rounds 6]

MOON on digits, Dir(0.5), 10 local epochs. The federation is the real thing: `fx aggregator start`
and one `fx collaborator start` per site, separate processes, mutual TLS on localhost, the PKI made
with fx. Round time = median interval between consecutive round ends (stamped by the aggregator) (round 1,
which includes process start-up, is reported separately). The simulator runs the same rounds in one
process, sites one after another.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.algorithms import nbytes
from fedcontrast.config import RunConfig
from fedcontrast.openfl.launch import initialize_plan, run_federation
from fedcontrast.openfl.pki import make_dev_pki
from fedcontrast.openfl.plan import create_workspace
from fedcontrast.sim import Federation, run_simulation


def simulator_rounds(config: RunConfig, tmp: Path) -> list[float]:
    stamps: list[float] = []
    run_simulation(config, tmp / f"sim-{config.clients}", progress=lambda d, t, row: stamps.append(time.time()))
    return [b - a for a, b in zip(stamps, stamps[1:])][1:]  # drop the set-up call and round 1


def federation_rounds(config: RunConfig, tmp: Path, cert: Path, port: int) -> tuple[list[float], float]:
    ws = create_workspace(tmp / f"fl-{config.clients}", config, port=port)
    shutil.rmtree(ws / "cert")
    shutil.copytree(cert, ws / "cert")
    initialize_plan(ws)
    t0 = time.time()
    records = run_federation(ws, timeout=3600)
    stamps = [r["trained_at"] for r in records]  # stamped by the aggregator when it aggregates each round
    return [b - a for a, b in zip(stamps, stamps[1:])], stamps[0] - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collaborators", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    pki_ws = create_workspace(tmp / "pki", RunConfig(clients=max(args.collaborators)))
    make_dev_pki(pki_ws, [f"site_{i}" for i in range(max(args.collaborators))], log=lambda m: None)
    rows = []
    for i, n in enumerate(args.collaborators):
        config = RunConfig(algorithm="moon", dataset="digits", clients=n, rounds=args.rounds)
        sim = statistics.median(simulator_rounds(config, tmp))
        fl_rounds, first = federation_rounds(config, tmp, pki_ws / "cert", 50600 + i)
        fl = statistics.median(fl_rounds)
        fed = Federation(config)
        up = sum(s.nbytes for s in fed.upload_specs)
        down = nbytes(fed.downlink.for_site("site_0"))
        rows.append((n, sim, fl, first, up, down))
        print(f"{n} collaborators: simulator {sim:.2f} s/round, OpenFL {fl:.2f} s/round, ratio {fl / sim:.2f}; "
              f"first round {first:.1f} s after launch; {up} B up, {down} B down per site per round", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    lines = ["## OpenFL deployment vs simulator: round time", "",
             f"Command: `.venv/bin/python benchmarks/openfl_rounds.py --collaborators "
             f"{' '.join(map(str, args.collaborators))} --rounds {args.rounds}` on {machine()}.", "",
             "MOON on digits (Dir(0.5) over the collaborators, 10 local epochs, batch 64). OpenFL: `fx aggregator "
             "start` + one `fx collaborator start` per site, separate processes, mutual TLS on localhost, each "
             "collaborator given `cores ÷ collaborators` threads (at least 1); simulator: one process, 2 threads, "
             f"sites in turn. Medians over rounds 2–{args.rounds}. Each OpenFL round includes every site's "
             "evaluation of the model it received on its own held-out data (the engine's `evaluate` task); the "
             "simulator does no such evaluation.", "",
             "| collaborators | simulator s/round | OpenFL s/round | ratio | OpenFL launch → round 1 "
             "| uploaded / site / round | downloaded / site / round |",
             "|---|---|---|---|---|---|---|"]
    for n, sim, fl, first, up, down in rows:
        lines.append(f"| {n} | {sim:.2f} | {fl:.2f} | **{fl / sim:.2f}** | {first:.1f} s | {up / 1024:.1f} KiB | "
                     f"{down / 1024:.1f} KiB |")
    lines += ["", "Goal: ≤ 1.3× at 3 collaborators. Bytes are the float32 tensors the plugin declares (the "
              "model's weights each way); gRPC/protobuf framing adds a few hundred bytes per message."]
    write_section("openfl_rounds", "\n".join(lines))


if __name__ == "__main__":
    main()
