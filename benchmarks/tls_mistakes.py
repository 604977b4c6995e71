"""How long each certificate mistake takes to end, and what each side says, across hosts.

    sudo .venv/bin/python benchmarks/tls_mistakes.py

An operator and one hospital on separate network namespaces (the documented set-up, as in
benchmarks/crosssilo.py); each mistake is made on a copy of the good files and undone afterwards.
Figures: seconds from starting the refused party (`fedcontrast site start` / `fx aggregator start`)
until it exits, against the seconds a bare `python -c "import fedcontrast.openfl.components"`
takes (the start-up any party pays before it can say anything), and the sentence each side logs.
Before fedcontrast's checks, each site-side mistake ended after 30 retries (~40 s) in the same
generic sentence, and the aggregator said "BLOCK_TYPE_IS_NOT_01" or nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import machine, write_section

from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab
from fedcontrast.lab.netns import netns_unavailable
from fedcontrast.openfl.launch import failure_reason
from fedcontrast.openfl.pki import issue_for_key, write_certificate

SITE = "hosp1"
PORT = 50561


def flat(text: str) -> str:
    """A log as one line, without rich's wrapping and source column."""
    return " ".join(re.sub(r"\s\S+\.py:\d+\s", " ", text).split())


def refusals(text: str) -> list[str]:
    return re.findall(r"refused a TLS connection from .*?(?=\[\d\d/|$| INFO | WARNING )", flat(text))


def timed(proc: subprocess.Popen, limit: float = 120.0) -> tuple[int | None, float]:
    started = time.monotonic()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return code, time.monotonic() - started


def main() -> None:
    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"tls_mistakes benchmark: {reason}")
    start_up = []
    for _ in range(3):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import fedcontrast.openfl.components"], check=True)
        start_up.append(time.monotonic() - t)
    baseline = min(start_up)
    rows = []
    tmp = Path(tempfile.mkdtemp())
    with CrossSiloLab(tmp / "lab", [SITE]) as lab:
        exp = lab.deploy("fed", algorithm="fedavg", port=PORT, options=["--rounds", "2", "--min-samples", "5"])
        ws, op = exp.workspace(lab, SITE), exp.workspace(lab, OPERATOR)
        client, server = ws / "cert" / "client", op / "cert" / "server"
        ca_dir = op / "cert" / "ca"
        keep = {p: p.read_bytes() for p in [*client.iterdir(), ws / "cert" / "cert_chain.crt", *server.iterdir()]}

        def restore() -> None:
            for path, data in keep.items():
                path.write_bytes(data)

        def site_case(label: str, mistake) -> None:
            mistake()
            proc = lab.start_site(exp, SITE)
            code, seconds = timed(proc)
            log = lab.log(exp, SITE)
            retries = len(re.findall(r"retry", log))
            said = failure_reason(ws / "logs" / f"{SITE}.log").replace(f"{ws}/", "")  # paths as in the workspace
            rows.append((label, SITE, code, seconds, retries, said))
            restore()

        lab.start(exp, sites=[])  # the aggregator, waiting for the site
        key = client / f"col_{SITE}.key"
        site_case("site certificate from another federation's CA",
                  lambda: write_certificate(client / f"col_{SITE}.crt", issue_for_key(key, SITE)[0]))
        site_case("site certificate expired",
                  lambda: write_certificate(client / f"col_{SITE}.crt",
                                            issue_for_key(key, SITE, ca_dir=ca_dir, days=(-30, -1))[0]))

        def other_federation() -> None:  # the site holds another federation's chain and a certificate from it
            cert, ca_cert = issue_for_key(key, SITE)
            write_certificate(client / f"col_{SITE}.crt", cert)
            write_certificate(ws / "cert" / "cert_chain.crt", ca_cert)

        site_case("site holds another federation's CA (does not trust the aggregator)", other_federation)
        aggregator_log = lab.log(exp, OPERATOR)
        proc = exp.processes[OPERATOR]
        proc.kill()
        proc.wait()

        host = lab.net.fqdn(OPERATOR)
        agg_key = server / f"agg_{host}.key"
        for label, days, san in (("aggregator certificate for another name", (-1, 30), "otherhost.fedtest"),
                                 ("aggregator certificate expired", (-30, -1), None)):
            write_certificate(server / f"agg_{host}.crt", issue_for_key(agg_key, host, ca_dir=ca_dir, days=days,
                                                                        san=san)[0])
            (op / "logs" / "aggregator.log").unlink(missing_ok=True)
            lab.start(exp, sites=[])
            code, seconds = timed(exp.processes[OPERATOR])
            rows.append((label, OPERATOR, code, seconds, 0, failure_reason(op / "logs" / "aggregator.log")))
            restore()
    shutil.rmtree(tmp, ignore_errors=True)

    said = refusals(aggregator_log)
    lines = [f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}. "
             "Command: `sudo .venv/bin/python benchmarks/tls_mistakes.py`.", "",
             "Start-up of any party before it can say anything "
             f"(`python -c \"import fedcontrast.openfl.components\"`): {baseline:.1f} s.", "",
             "| mistake | party that ends | exit code | seconds to exit | retries | its sentence |",
             "|---|---|---|---|---|---|"]
    for label, party, code, seconds, retries, sentence in rows:
        lines.append(f"| {label} | {party} | {code} | {seconds:.1f} | {retries} | {sentence[:220]} |")
    lines += ["", "What the aggregator logged meanwhile (sites with a bad certificate of their own stop before "
              "connecting; the site holding another federation's CA presented that CA's certificate while checking "
              "the aggregator's):", ""]
    lines += [f"- {s[:300]}" for s in dict.fromkeys(said)] or ["- nothing"]
    body = "## TLS mistakes across hosts\n\n" + "\n".join(lines)
    print(body)
    write_section("tls_mistakes", body)


if __name__ == "__main__":
    main()
