"""Secure aggregation's cost on a Flower deployment on localhost (SuperLink + one SuperNode per site,
TLS, SuperNode authentication): the same job with and without it, one after the other.

    .venv/bin/python benchmarks/secure_aggregation_flower.py [--rounds 5] [--algorithm moon]
                                                             [--flower-venv .venv-flower]

Run from the OpenFL environment (`.venv`); the Flower parties run from the Flower environment
(`--flower-venv`). Each site pins every member's SuperNode key in its policy
(`require_secure_aggregation: true` and the `peers:` block `fedcontrast site roster` prints), as a
careful site would. Figures: seconds per round (median of rounds 2 …, from the ServerApp's round
lines), the bytes a site sends per round (plain: its float32 upload and count; secure: the five
protocol messages' payloads, from the ServerApp's secure-sum lines), and the sites' held-out accuracy
of the final model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _results import machine, write_section
from flower_engine import ROUND_LINE, SITES, LocalNet

from fedcontrast.config import RunConfig
from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab
from fedcontrast.openfl.packing import packed_size
from fedcontrast.sim import Federation

SECURE_LINE = re.compile(r"secure sum of .*?(\d+) bytes per site")


def deployment(lab, rounds: int, port: int, venv: Path, algorithm: str, secure: bool) -> dict:
    fc = str(venv / "bin" / "fedcontrast")
    env = {**lab.env, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}
    name = f"fl{port}"
    folder = lab.disk(OPERATOR) / name

    def run(party, *args, timeout=300):
        done = lab.net.run(party, [fc, *args], cwd=lab.disk(party), env=env, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"{party}: fedcontrast {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
        return done.stdout

    run(OPERATOR, "flower", "init", "--algorithm", algorithm, "--sites", ",".join(SITES), "--input-shape", "1x32x32",
        "--classes", "10", "--rounds", str(rounds), "--address", "localhost", "--port", str(port),
        *(["--secure-aggregation"] if secure else []), name)
    lab.net.popen(OPERATOR, [fc, "flower", "superlink", name], cwd=lab.disk(OPERATOR), env=env,
                  log_path=lab.disk(OPERATOR) / f"{name}_superlink.log")
    for site in SITES:
        if not (lab.disk(site) / f"{site}.key").exists():
            run(site, "flower", "site-key", "--name", site)
        shutil.copyfile(lab.disk(site) / f"{site}.pub", lab.disk(OPERATOR) / f"{site}.pub")
        shutil.copyfile(folder / "certs" / "ca.crt", lab.disk(site) / f"{name}_ca.crt")
    for site in SITES:  # each site pins every member's key, from the keys the hospitals exchanged
        for other in SITES:
            if other != site:
                shutil.copyfile(lab.disk(other) / f"{other}.pub", lab.disk(site) / f"{other}.pub")
        roster = run(site, "site", "roster", *[f"{s}.pub" for s in SITES])
        (lab.disk(site) / "policy.yaml").write_text(("require_secure_aggregation: true\n" if secure else "")
                                                    + roster[roster.index("peers:"):])
    deadline = time.monotonic() + 60
    for site in SITES:
        while True:
            done = lab.net.run(OPERATOR, [fc, "flower", "register", name, f"{site}.pub", "--site", site],
                               cwd=lab.disk(OPERATOR), env=env)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
    threads = max(1, (os.cpu_count() or 1) // len(SITES))
    for i, site in enumerate(SITES):
        lab.net.popen(site, [fc, "flower", "supernode", "--superlink", f"localhost:{port}", "--ca", f"{name}_ca.crt",
                             "--key", f"{site}.key", "--name", site, "--data", "images", "--workdir", name,
                             "--threads", str(threads), "--policy", "policy.yaml", "--port", str(port + 10 + i)],
                      cwd=lab.disk(site), env=env, log_path=lab.disk(site) / f"{name}.log")
    time.sleep(3)
    proc = subprocess.Popen(lab.net.command(OPERATOR, [fc, "flower", "run", name]), cwd=lab.disk(OPERATOR), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds, sent, out = [], [], []
    for line in proc.stdout:
        out.append(line)
        if ROUND_LINE.search(line):
            seconds.append(float(ROUND_LINE.search(line).group(3)))
        if SECURE_LINE.search(line):
            sent.append(int(SECURE_LINE.search(line).group(1)))
    if proc.wait() != 0:
        raise SystemExit(f"the Flower federation failed; see {folder}:\n{''.join(out)[-3000:]}")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    return {"round_s": statistics.median(seconds[1:]), "bytes": statistics.mean(sent) if sent else None,
            "accuracy": summary["final_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--algorithm", default="moon")
    parser.add_argument("--flower-venv", default=".venv-flower")
    args = parser.parse_args()
    venv = Path(args.flower_venv).resolve()
    if not (venv / "bin" / "fedcontrast").exists():
        raise SystemExit(f"secure_aggregation_flower benchmark: no Flower environment at {venv} (python3 -m venv "
                         ".venv-flower && .venv-flower/bin/pip install -e '.[flower]')")
    tmp = Path(tempfile.mkdtemp())
    lab = CrossSiloLab(tmp / "lab", SITES)
    lab.net = LocalNet(lab.parties)
    with lab:
        plain = deployment(lab, args.rounds, 9610, venv, args.algorithm, False)
        print("plain", plain, flush=True)
        secure = deployment(lab, args.rounds, 9630, venv, args.algorithm, True)
        print("secure", secure, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    config = RunConfig(algorithm=args.algorithm, dataset="digits", clients=len(SITES))
    plain_bytes = packed_size(Federation(config).upload_specs) * 4 + 4
    lines = ["## Secure aggregation on a Flower deployment: `benchmarks/secure_aggregation_flower.py`", "",
             f"Command: `.venv/bin/python benchmarks/secure_aggregation_flower.py --rounds {args.rounds} --algorithm "
             f"{args.algorithm}` on {machine()}, {time.strftime('%Y-%m-%d')}; flwr 1.42 in `.venv-flower`. SuperLink "
             f"and {len(SITES)} SuperNodes on localhost (TLS, SuperNode authentication), digits shards of a Dir(0.5) "
             "partition, the default 10 local epochs, 32-bit ring, default threshold ⌊2n/3⌋ + 1 with the "
             "consistency round; every site pins every member's key in its policy; plain and secure one after the "
             "other.", "",
             "| algorithm | s / round plain | secure | ratio | bytes / site / round plain | secure | ratio | "
             "final accuracy plain | secure |", "|---|---|---|---|---|---|---|---|---|",
             f"| {args.algorithm} | {plain['round_s']:.2f} | {secure['round_s']:.2f} | "
             f"**{secure['round_s'] / plain['round_s']:.2f}×** | {plain_bytes} | {secure['bytes']:.0f} | "
             f"**{secure['bytes'] / plain_bytes:.3f}×** | {100 * plain['accuracy']:.2f} % | "
             f"{100 * secure['accuracy']:.2f} % |", "",
             "Bytes are the payloads the ServerApp received from a site (Flower's message framing comes on top); "
             "the secure round is five messages per site (its keys with its training reply, then four "
             "`query.secagg` exchanges) instead of one, each paying Flower's polling transport."]
    write_section("secure_aggregation_flower", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
