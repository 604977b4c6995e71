"""Issue 46: docs/flower.md's ``--pki-from`` steps with a site's SuperNode running, on this host.

The operator stops its SuperLink and starts the next experiment's at the same address (the same CA,
a new SuperLink certificate, a new Flower state), then registers the carried keys. Every running
SuperNode used to stop: one with Flower's traceback, the others silently. Now each says what
happened and is connected again with the same key, without a restart at the site; a SuperLink of
another CA ends it with one sentence and exit code 1. (The loop's other cases, against a stand-in
of the Fleet API: test_flower_link.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from fedcontrast.lab.deployment import executable

FLOWER_PORTS = (9091, 9093)  # the SuperLink's own ServerAppIo and Control APIs (Flower's defaults)


def busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytestmark = pytest.mark.skipif(any(busy(p) for p in FLOWER_PORTS),
                                reason="another SuperLink runs on this host (ports 9091/9093)")


def fedcontrast(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([executable("fedcontrast"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def start(cwd: Path, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([executable("fedcontrast"), *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(what, timeout: float, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(step)
    return what()


def superlink(cwd: Path, name: str) -> subprocess.Popen:
    return start(cwd, cwd / f"{name}_superlink.log", "flower", "superlink", name)


def register(cwd: Path, *args: str) -> str:
    """`flower register`, asked again until the SuperLink just started answers."""
    def once():
        done = fedcontrast(cwd, "flower", "register", *args)
        return done.stdout if done.returncode == 0 else None

    out = wait_for(once, 40, step=1.0)
    assert out, f"register {args} failed"
    return out


def test_the_next_experiments_superlink_takes_over_the_running_sites(tmp_path):
    port = free_port()
    (tmp_path / "images" / "a").mkdir(parents=True)  # the node reads nothing before a run's first message
    init = ["--algorithm", "fedavg", "--sites", "hosp1", "--input-shape", "1x8x8", "--classes", "2", "--rounds", "1",
            "--address", "localhost", "--port", str(port)]
    assert fedcontrast(tmp_path, "flower", "init", *init, "fa").returncode == 0
    assert fedcontrast(tmp_path, "flower", "site-key", "--name", "hosp1").returncode == 0
    procs = {"fa": superlink(tmp_path, "fa")}
    node_log = tmp_path / "hosp1.log"
    try:
        register(tmp_path, "fa", "hosp1.pub", "--site", "hosp1")
        procs["node"] = start(tmp_path, node_log, "flower", "supernode", "--superlink", f"localhost:{port}",
                              "--ca", "fa/certs/ca.crt", "--key", "hosp1.key", "--name", "hosp1", "--data", "images",
                              "--workdir", "site")
        said = lambda: node_log.read_text(errors="replace")  # noqa: E731
        assert wait_for(lambda: "connected to the SuperLink" in said(), 60), said()

        stop(procs.pop("fa"))  # the operator switches to the next experiment (docs/flower.md, --pki-from)
        assert fedcontrast(tmp_path, "flower", "init", *init, "--pki-from", "fa", "fb").returncode == 0
        procs["fb"] = superlink(tmp_path, "fb")
        register(tmp_path, "fb", "--carried")
        assert wait_for(lambda: "connected again to the SuperLink" in said(), 40), said()
        log = said()
        assert "no longer knows this SuperNode (it restarted, or the next experiment's SuperLink took its place); " \
               "connecting again with the same key" in log
        assert "Traceback" not in log and procs["node"].poll() is None

        stop(procs.pop("fb"))  # a SuperLink of another federation (a new CA) at the same address
        assert fedcontrast(tmp_path, "flower", "init", *init, "fc").returncode == 0
        procs["fc"] = superlink(tmp_path, "fc")
        assert procs["node"].wait(timeout=60) == 1
        log = said()
        assert f"error: hosp1: the SuperLink at localhost:{port} now presents a certificate issued by CN=fc " \
               "fedcontrast CA,O=fc, not by the federation's CA this site holds (CN=fa fedcontrast CA,O=fa" in log, log
        assert "Traceback" not in log
    finally:
        for proc in procs.values():
            stop(proc)
