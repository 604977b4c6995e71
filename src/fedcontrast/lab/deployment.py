"""A real cross-silo deployment on one Linux machine, for tests and benchmarks: an operator and
several institutions, each on its own host (a network namespace, see :mod:`.netns`) with its own
directory standing for its own disk, running exactly the documented commands.

Files move between parties only through :meth:`CrossSiloLab.send`, which logs every transfer: the
workspace package (operator → sites), certificate requests (site → operator) and signed
certificates (operator → site). The operator's directory holds no private data; each site's holds
its own image folder (``images/``, written from the embedded digits with a non-IID split) and, like
every party, the public folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from .netns import NetnsLab

OPERATOR = "aggregator"  # the operator's host (it runs the aggregator)


class LabCommandFailed(RuntimeError):
    """A party's command failed; the message holds its output's last lines."""


def executable(name: str) -> str:
    """A command of this environment (`fx`, `fedcontrast`), by absolute path."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


@dataclass
class Experiment:
    """One plan run by the lab's parties."""

    name: str  # the operator's workspace folder, e.g. fed_moon (also the package's name)
    port: int
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: float = 0.0

    def workspace(self, lab: CrossSiloLab, party: str) -> Path:
        return lab.disk(party) / self.name

    def records(self, lab: CrossSiloLab) -> list[dict[str, Any]]:
        from ..openfl.records import read_records  # the lab serves the Flower environment too: no OpenFL there

        return read_records(self.workspace(lab, OPERATOR) / "save")


class CrossSiloLab:
    """``CrossSiloLab(root, sites=["hosp1", "hosp2", "hosp3"])`` — use as a context manager; it
    builds the hosts, writes each site's image folder and the public folder, and tears everything
    down (processes, namespaces) at the end."""

    def __init__(self, root: str | Path, sites: list[str], *, beta: float = 0.5, seed: int = 0,
                 domain: str = "fedtest") -> None:
        self.root = Path(root)
        self.sites = list(sites)
        self.parties = [OPERATOR, *self.sites]
        self.net = NetnsLab(self.parties, domain=domain)
        self.data_config = RunConfig(dataset="digits", clients=len(sites), sites=tuple(sites), beta=beta, seed=seed)
        self.transfers: list[tuple[str, str, str]] = []  # (from, to, file name)
        self._lock = threading.Lock()
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                    "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}

    # --- set-up ---------------------------------------------------------------------------------
    def __enter__(self) -> CrossSiloLab:
        self.net.__enter__()
        try:
            self._write_data()
        except BaseException:
            self.net.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.net.close()

    def disk(self, party: str) -> Path:
        return self.root / party

    def _write_data(self) -> None:
        from ..data.folders import write_site_folders

        staging = self.root / "_staging"
        folders = write_site_folders(self.data_config, staging)
        for party in self.parties:
            self.disk(party).mkdir(parents=True, exist_ok=True)
            shutil.copytree(folders["public"], self.disk(party) / "public")  # every party holds the public set
        for site in self.sites:
            shutil.move(str(folders[site]), self.disk(site) / "images")  # a site's own data, on its disk only
        shutil.rmtree(staging)

    # --- parties act ----------------------------------------------------------------------------
    def run(self, party: str, argv: list[str], *, cwd: Path | None = None, timeout: float = 600) -> str:
        """``argv`` on the party's host, in its directory (or ``cwd``); its output, or LabCommandFailed."""
        done = self.net.run(party, argv, cwd=cwd or self.disk(party), env=self.env, timeout=timeout)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            raise LabCommandFailed(f"{party}: {' '.join(argv)} exited {done.returncode}:\n{tail}")
        return done.stdout + done.stderr

    def fedcontrast(self, party: str, *args: str, cwd: Path | None = None) -> str:
        return self.run(party, [executable("fedcontrast"), *args], cwd=cwd)

    def send(self, sender: str, path: Path, receiver: str) -> Path:
        """Copy one file from ``sender``'s disk to ``receiver``'s (the only way files travel)."""
        if not Path(path).is_relative_to(self.disk(sender)):
            raise ValueError(f"{path} is not on {sender}'s disk")
        target = self.disk(receiver) / Path(path).name
        shutil.copyfile(path, target)
        with self._lock:
            self.transfers.append((sender, receiver, Path(path).name))
        return target

    def deploy(self, name: str, *, algorithm: str, port: int, options: list[str],
               reuse: Experiment | None = None) -> Experiment:
        """The documented flow for one plan: the operator creates and exports the workspace (a new
        CA, or ``reuse``'s), every site joins with its own data (and, the first time, its own key:
        request → operator signs → certificate back)."""
        exp = Experiment(name, port)
        create = ["workspace", "create", "--algorithm", algorithm, "--sites", ",".join(self.sites),
                  "--input-shape", "1x32x32", "--classes", "10", "--address", self.net.fqdn(OPERATOR),
                  "--port", str(port), *options, name]
        if reuse is not None:
            create[-1:-1] = ["--pki-from", reuse.name]
        self.fedcontrast(OPERATOR, *create)
        if reuse is None:
            self.fedcontrast(OPERATOR, "ca", "init", name)
        self.fedcontrast(OPERATOR, "workspace", "export", name)
        package = self.disk(OPERATOR) / name / f"{name}.zip"

        from ..deploy.anchor import fingerprint_of_chain, shown

        chain = self.disk(OPERATOR) / name / "cert" / "cert_chain.crt"
        ca = shown(fingerprint_of_chain(chain.read_bytes(), str(chain))[0])  # what the operator reads out by phone

        def join(site: str) -> None:  # the sites act at the same time, as separate institutions would
            local = self.send(OPERATOR, package, site)
            argv = ["site", "join", local.name, "--name", site, "--data", "images", "--public", "public",
                    "--ca-fingerprint", ca]
            self.fedcontrast(site, *argv, *(["--cert-from", reuse.name] if reuse is not None else []))

        def import_cert(site: str) -> None:
            signed = self.send(OPERATOR, exp.workspace(self, OPERATOR) / f"agg_to_col_{site}_signed_cert.zip", site)
            self.fedcontrast(site, "site", "import-cert", signed.name, "--workspace", name)

        with ThreadPoolExecutor(len(self.sites)) as pool:
            list(pool.map(join, self.sites))
            if reuse is None:
                for site in self.sites:  # the operator signs one request after the other
                    request = self.send(site, exp.workspace(self, site) / f"col_{site}_to_agg_cert_request.zip",
                                        OPERATOR)
                    self.fedcontrast(OPERATOR, "ca", "sign", name, request.name, "--site", site, "--yes")
                list(pool.map(import_cert, self.sites))
        return exp

    def start(self, exp: Experiment, *, sites: list[str] | None = None, threads: int | None = None) -> None:
        """``fx aggregator start`` on the operator's host, ``fedcontrast site start WS --name NAME``
        (which runs ``fx collaborator start -n NAME``) on each site's host (``sites``: a subset), each
        writing its log in its workspace's ``logs/``. All share this host's cores: each party's threads
        are ``threads``, else its share (:func:`fedcontrast.threads.choose_threads`)."""
        from ..threads import choose_threads, party_env

        env = {**self.env, **party_env(choose_threads(threads, parties=len(self.sites) + 1))}
        exp.started = time.time()
        self.start_aggregator(exp, env=env)
        for site in sites if sites is not None else self.sites:
            self.start_site(exp, site, env=env)

    def start_aggregator(self, exp: Experiment, *, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``fx aggregator start`` on the operator's host (also: again, after it was killed), its log
        appended to its workspace's ``logs/aggregator.log``."""
        ws = exp.workspace(self, OPERATOR)
        proc = self.net.popen(OPERATOR, [executable("fx"), "aggregator", "start"], cwd=ws, env=env or self.env,
                              log_path=ws / "logs" / "aggregator.log")
        exp.processes[OPERATOR] = proc
        return proc

    def start_site(self, exp: Experiment, site: str, *, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``fedcontrast site start WS --name SITE`` (its checks, then ``fx collaborator start -n SITE``
        in the same process) on the site's host."""
        ws = exp.workspace(self, site)
        proc = self.net.popen(site, [executable("fedcontrast"), "site", "start", str(ws), "--name", site], cwd=ws,
                              env=env or self.env, log_path=ws / "logs" / f"{site}.log")
        exp.processes[site] = proc
        return proc

    def wait(self, exp: Experiment, timeout: float) -> dict[str, int | None]:
        """Wait until the aggregator exits (then give the sites a moment); every party's exit code
        (None: still running when the time was up; it is then stopped)."""
        deadline = time.monotonic() + timeout
        aggregator = exp.processes[OPERATOR]
        try:
            aggregator.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        codes: dict[str, int | None] = {}
        for party, proc in exp.processes.items():
            try:
                codes[party] = proc.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes[party] = None
                proc.kill()
                proc.wait()
        return codes

    def log(self, exp: Experiment, party: str) -> str:
        name = "aggregator.log" if party == OPERATOR else f"{party}.log"
        path = exp.workspace(self, party) / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def private_keys(self) -> dict[str, list[Path]]:
        """Every private-key file on each party's disk."""
        return {party: sorted(p for p in self.disk(party).rglob("*.key")) for party in self.parties}
