"""Fixtures for federations of real OS processes (fx aggregator / fx collaborator) over mutual TLS.

The PKI is made once per session with the fx commands (it is the slow part) and copied into every
test's workspace; each federation test gets a fresh workspace, port and ``fx plan initialize``.
"""

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from fedcontrast.config import RunConfig
from fedcontrast.openfl.launch import initialize_plan
from fedcontrast.openfl.pki import fx_executable, make_dev_pki
from fedcontrast.openfl.plan import create_workspace

FEDERATION_TIMEOUT = 240  # seconds; every federation in these tests runs under it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_config(**changes) -> RunConfig:
    """Digits, 2 collaborators, 2 rounds of 1 local epoch: a real federation in seconds of compute."""
    base = RunConfig(algorithm="moon", dataset="digits", clients=2, rounds=2, min_samples=5,
                     training={"local_epochs": 1})
    return base.replace(**changes) if changes else base


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """cert/ of a CA with aggregator, site_0, site_1 and intruder certificates, plus a client
    certificate for site_1 signed by a second, unrelated CA."""
    root = tmp_path_factory.mktemp("pki")
    main = create_workspace(root / "main", small_config())
    make_dev_pki(main, ["site_0", "site_1", "intruder"], log=lambda m: None)
    other = create_workspace(root / "other", small_config())
    fx = fx_executable()
    for args in (["workspace", "certify"],
                 ["collaborator", "generate-cert-request", "-n", "site_1", "--silent", "--skip-package"],
                 ["collaborator", "certify", "-n", "site_1", "--silent"]):
        subprocess.run([fx, *args], cwd=other, check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    return {"cert": main / "cert", "other_ca_client": other / "cert" / "client"}


def workspace_factory(root: Path, pki: dict):
    """Makes ready workspaces (plan, PKI, init.pbuf) under ``root``; ``max_retries`` bounds
    collaborator retries."""

    def make(config: RunConfig, *, name: str = "ws", max_retries: int = 30) -> Path:
        ws = create_workspace(root / name, config, port=free_port(), max_retries=max_retries)
        shutil.rmtree(ws / "cert")
        shutil.copytree(pki["cert"], ws / "cert")
        cols = {"collaborators": [f"site_{i}" for i in range(config.clients)]}
        (ws / "plan" / "cols.yaml").write_text(yaml.safe_dump(cols))  # the PKI run also listed 'intruder'
        initialize_plan(ws)
        return ws

    return make


@pytest.fixture
def make_workspace(tmp_path, pki):
    return workspace_factory(tmp_path, pki)
