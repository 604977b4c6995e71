"""Sites wait for a restarted aggregator: kill -9, down for minutes, the same sites go on.

    sudo .venv/bin/python benchmarks/aggregator_restart.py [--down 120] [--rounds 3] [--algorithm moon]

An operator and three hospitals, each on its own network namespace with its own directory, set up
with the documented commands and the default plan (the sites' `wait_for_aggregator`: 600 s). When
every site has started the second round, the aggregator is killed with SIGKILL, left down for
``--down`` seconds and started again (`fx aggregator start`, resuming from its checkpoint); the site
processes are left running throughout.

Figures, all from the aggregator's restart: when it listens again, when each site reaches it again,
and when each site receives its next round's tasks (the sites' next round); plus the lines each site
logged while it waited, and whether the federation then finished every round with the same site
processes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab, Experiment
from fedcontrast.lab.netns import netns_unavailable

SITES = ["hosp1", "hosp2", "hosp3"]
RECORD = re.compile(r"^(?:\[[^\]]*\])?\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s", re.M)  # one per log record


class LogWatch:
    """What a party's log gains from now on, and when each awaited phrase first appeared in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.text = ""
        self.seen: dict[str, float] = {}

    def poll(self, phrases: list[str]) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        self.text += chunk.decode(errors="replace")
        flat = " ".join(self.text.split())  # rich wraps long lines
        for phrase in phrases:
            if phrase not in self.seen and phrase in flat:
                self.seen[phrase] = time.monotonic()


def log_path(lab: CrossSiloLab, exp: Experiment, party: str) -> Path:
    return exp.workspace(lab, party) / "logs" / ("aggregator.log" if party == OPERATOR else f"{party}.log")


def wait_for(watches: dict[str, LogWatch], phrases: dict[str, list[str]], deadline: float) -> None:
    while True:
        for party, watch in watches.items():
            watch.poll(phrases[party])
        if all(p in watches[party].seen for party in watches for p in phrases[party]):
            return
        if time.monotonic() > deadline:
            missing = {party: [p for p in phrases[party] if p not in watches[party].seen] for party in watches}
            raise SystemExit(f"aggregator_restart benchmark: timed out waiting for {missing}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", type=float, default=120.0, help="seconds the aggregator stays down (120)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--algorithm", default="moon")
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"aggregator_restart benchmark: {reason}")
    tmp = Path(tempfile.mkdtemp())
    with CrossSiloLab(tmp / "lab", SITES) as lab:
        exp = lab.deploy("fed", algorithm=args.algorithm, port=50551,
                         options=["--rounds", str(args.rounds), "--local-epochs", "1"])
        watches = {party: LogWatch(log_path(lab, exp, party)) for party in (OPERATOR, *SITES)}
        start = time.monotonic()
        lab.start(exp)
        listening = "Starting Aggregator gRPC Server"
        wait_for({OPERATOR: watches[OPERATOR]}, {OPERATOR: [listening]}, start + 600)
        first_listen = watches[OPERATOR].seen[listening] - start
        second = "Round: 1 Received Tasks"  # OpenFL counts rounds from 0
        wait_for({s: watches[s] for s in SITES}, {s: [second] for s in SITES}, start + 1200)

        site_procs = {s: exp.processes[s] for s in SITES}
        os.killpg(exp.processes[OPERATOR].pid, signal.SIGKILL)
        exp.processes[OPERATOR].wait()
        killed = time.monotonic()
        watches = {party: LogWatch(log_path(lab, exp, party)) for party in (OPERATOR, *SITES)}
        time.sleep(args.down)
        for s in SITES:
            watches[s].poll([])
        waiting_lines = {s: len(RECORD.findall(watches[s].text)) for s in SITES}
        gave_up = [s for s, proc in site_procs.items() if proc.poll() is not None]
        if gave_up:
            raise SystemExit(f"aggregator_restart benchmark: {', '.join(gave_up)} gave up while the aggregator was "
                             "down")
        restarted = time.monotonic()
        lab.start_aggregator(exp)
        address = f"{lab.net.fqdn(OPERATOR)}:{exp.port}"
        reached, next_round = f"reached the aggregator at {address} again after", "Received Tasks"
        phrases = {OPERATOR: [listening], **{s: [reached, next_round] for s in SITES}}
        wait_for(watches, phrases, restarted + 900)
        codes = lab.wait(exp, 1200)
        records = exp.records(lab)
        same = all(exp.processes[s] is site_procs[s] for s in SITES)

    shutil.rmtree(tmp, ignore_errors=True)
    listen = watches[OPERATOR].seen[listening] - restarted
    reach = {s: watches[s].seen[reached] - restarted for s in SITES}
    rounds = {s: watches[s].seen[next_round] - restarted for s in SITES}
    down = restarted - killed
    finished = [r["round"] for r in records] == list(range(1, args.rounds + 1)) and all(c == 0 for c in codes.values())
    print(f"aggregator killed (SIGKILL) at the start of round 2, down {down:.0f} s, restarted; the same site "
          f"processes: {same}; federation finished every round: {finished} (exit codes {codes})")
    print(f"  restart → listening: {listen:.1f} s (its first start: {first_listen:.1f} s)")
    for s in SITES:
        print(f"  {s}: reached it again {reach[s]:.1f} s after the restart, next round's tasks at {rounds[s]:.1f} s; "
              f"{waiting_lines[s]} log lines in {down:.0f} s of waiting")
    print(f"  restart → every site's next round: {max(rounds.values()):.1f} s")

    lines = [f"## Sites wait for a restarted aggregator ({args.algorithm}, {len(SITES)} sites, aggregator down "
             f"{down:.0f} s)", "",
             f"Command: `.venv/bin/python benchmarks/aggregator_restart.py --down {args.down:.0f} "
             f"--rounds {args.rounds} --algorithm {args.algorithm}` (as root) on {machine()}, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "An operator and three hospitals, each on its own Linux network namespace with its own directory, set up "
             "with the documented commands and the default plan (`wait_for_aggregator` 600 s; back-off from 1 s "
             "doubling to at most 5 s between attempts). When every site had started round 2, the aggregator was "
             f"killed with SIGKILL, left down {down:.0f} s, and started again with `fx aggregator start` (it resumes "
             "from `local_state/tensor.db`); the site processes were left running. Times are from the restart; a "
             "site's next round is when it received that round's tasks.", "",
             "| | after the restart |", "|---|---|",
             f"| aggregator listening (`Starting Aggregator gRPC Server`) | {listen:.1f} s (its first start: "
             f"{first_listen:.1f} s) |"]
    for s in SITES:
        lines.append(f"| {s} reaches it again / receives its next round | {reach[s]:.1f} s / {rounds[s]:.1f} s |")
    lines += [f"| **every site in its next round** | **{max(rounds.values()):.1f} s** |", "",
              f"Same site processes throughout: {'yes' if same else 'no'}; every round finished "
              f"({', '.join(str(r['round']) for r in records)} of {args.rounds}), every party exit code 0: "
              f"{'yes' if finished else 'no'}. Log records each site wrote while it waited {down:.0f} s: "
              + ", ".join(f"{s} {waiting_lines[s]}" for s in SITES)
              + " (the first failure with its reason, then one a minute, plus any line of the round it was "
              "finishing)."]
    write_section("aggregator_restart", "\n".join(lines))


if __name__ == "__main__":
    main()
