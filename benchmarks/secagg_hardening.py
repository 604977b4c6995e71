"""What the hardened secure aggregation costs (issue 45): the protocol alone, side by side with the
code before it, at 10 sites (the full graph) and 100 and 1,000 sites (SecAgg+).

    .venv/bin/python benchmarks/secagg_hardening.py [--baseline be864e7] [--sites 10 100 1000]
        [--words 92327] [--repeats 3]

Since the baseline, a round also carries: each dealer's signed Merkle root over its holders' shares
(the holders check their leaf, a reveal carries its path, the aggregator checks every path), the
graph phase of SecAgg+ (every site commits to randomness in its advert and reveals it once all
adverts are in; the graph is drawn from all of it), and decoding that rebuilds a secret from any t
good shares. Each measurement is one round of :func:`fedcontrast.privacy.secagg_sim.secure_sum` (every
party in one process, no dropouts, vectors of ``--words`` values in [-1, 1], 32-bit ring, default
threshold and neighbours) in a fresh process, the baseline (a git worktree of ``--baseline``) and
this tree interleaved, ``--repeats`` times; the table has the medians and their ratio. Writes the
section ``secagg_hardening`` of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

RUNNER = r"""
import json, sys, time
import numpy as np
from fedcontrast.config.sections import SecureAggregationConfig
from fedcontrast.privacy.secagg_sim import secure_sum
sites, words = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
vectors = {f"site_{i:04d}": rng.uniform(-1, 1, words) for i in range(sites)}
began = time.perf_counter()
total, cost = secure_sum(vectors, SecureAggregationConfig(), 1, session=b"benchmark")
wall = time.perf_counter() - began
assert np.abs(total - sum(vectors.values())).max() < 1e-3
print(json.dumps({"wall": wall, "site": cost.site_seconds, "aggregator": cost.aggregator_seconds,
                  "bytes": cost.bytes_per_site, "k": cost.neighbours}))
"""


def measure(src: Path, sites: int, words: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUNNER, str(sites), str(words)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="be864e7", help="the commit before the hardening")
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--words", type=int, default=92327)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline], check=True,
                       capture_output=True)
        try:
            rows = []
            for sites in args.sites:
                got: dict[str, list[dict]] = {"before": [], "now": []}
                for _ in range(args.repeats):
                    got["before"].append(measure(base / "src", sites, args.words))
                    got["now"].append(measure(ROOT / "src", sites, args.words))
                med = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                       for side, runs in got.items()}
                row = (sites, med)
                rows.append(row)
                b, n = med["before"], med["now"]
                print(f"{sites} sites: wall {b['wall']:.2f} → {n['wall']:.2f} s ({n['wall'] / b['wall']:.2f}×), "
                      f"site {1000 * b['site']:.1f} → {1000 * n['site']:.1f} ms, aggregator {b['aggregator']:.3f} → "
                      f"{n['aggregator']:.3f} s, bytes {b['bytes']:.0f} → {n['bytes']:.0f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False,
                           capture_output=True)
    lines = ["## Hardened secure aggregation against the code before it: `benchmarks/secagg_hardening.py`", "",
             f"Command: `.venv/bin/python benchmarks/secagg_hardening.py --baseline {args.baseline} --sites "
             f"{' '.join(map(str, args.sites))} --words {args.words} --repeats {args.repeats}` on {machine()}, "
             f"{time.strftime('%Y-%m-%d')}. One round of the protocol alone, every party in one process, vectors of "
             f"{args.words} values, 32-bit ring, default threshold and neighbours, no dropouts; each measurement in a "
             f"fresh process, the baseline ({args.baseline}) and this tree interleaved, medians of {args.repeats}.", "",
             "| sites | k | round, wall: before | now | ratio | CPU per site: before | now | at the aggregator: "
             "before | now | bytes / site: before | now | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sites, med in rows:
        b, n = med["before"], med["now"]
        k = f"{int(n['k'])}" + (" (full)" if n["k"] >= sites - 1 else "")
        lines.append(f"| {sites} | {k} | {b['wall']:.2f} s | {n['wall']:.2f} s | {n['wall'] / b['wall']:.2f}× | "
                     f"{1000 * b['site']:.1f} ms | {1000 * n['site']:.1f} ms | {b['aggregator']:.3f} s | "
                     f"{n['aggregator']:.3f} s | {b['bytes']:.0f} | {n['bytes']:.0f} | "
                     f"{n['bytes'] / b['bytes']:.3f}× |")
    lines += ["", f"Total {(time.perf_counter() - began) / 60:.1f} min. Goal (issue 45): the protocol's cost within "
              "1.5× of the baseline's at 100 and 1,000 sites. In a deployment each site does its own part at once; "
              "here every site's work adds up in one process, and a verification a site repeats that another already "
              "made in this process is remembered (`secagg.verify`), as before."]
    write_section("secagg_hardening", "\n".join(lines))


if __name__ == "__main__":
    main()
