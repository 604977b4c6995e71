"""Fixtures for federations of real OS processes (fx aggregator / fx collaborator) over mutual TLS.

The PKI is made once per test run with the fx commands (it is the slow part; the xdist workers share
it) and copied into every test's workspace; each federation test gets a fresh workspace, port and
``fx plan initialize``.
"""

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fedcontrast.algorithms import registry
from fedcontrast.config import RunConfig
from fedcontrast.openfl.launch import failure_reason, initialize_plan, start, stop_all
from fedcontrast.openfl.pki import certify_workspace, dev_pki_commands
from fedcontrast.openfl.plan import create_workspace
from tests.plans import small_config  # noqa: F401  (the openfl tests import it from here)

FEDERATION_TIMEOUT = 240  # seconds; every federation in these tests runs under it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FX_IN_ONE_PROCESS = """
import json, sys
from openfl.interface.cli import entry
for args in json.loads(sys.argv[1]):
    sys.argv = ["fx", *args]
    try:
        entry()
    except SystemExit as done:  # fx exits after each command; 0 is success
        if done.code:
            raise
"""


def run_fx(workspace: Path, commands: list[list[str]]) -> None:
    """The ``fx`` command lines (``fx`` left out) in ``workspace``, in order, in one Python process: the
    same fx code as one ``fx`` per line, but OpenFL is imported once, not once per line (the slow part)."""
    done = subprocess.run([sys.executable, "-c", FX_IN_ONE_PROCESS, json.dumps(commands)], cwd=workspace,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, f"fx {commands} in {workspace}: {(done.stdout + done.stderr)[-3000:]}"


def make_pki(root: Path) -> None:
    """``root/main/cert``: the CA of :func:`make_dev_pki` and the fx certificates of aggregator, site_0,
    site_1, site_2 and intruder; ``root/other/cert/client``: site_1's, from a second CA of the same name."""
    main = create_workspace(root / "main", small_config())
    certify_workspace(main)
    run_fx(main, [command[1:] for command in dev_pki_commands(["site_0", "site_1", "site_2", "intruder"])])
    other = create_workspace(root / "other", small_config())
    certify_workspace(other, "main")  # another CA of the same name as main's (a forgery, as TLS sees it)
    run_fx(other, [["collaborator", "generate-cert-request", "-n", "site_1", "--silent", "--skip-package"],
                   ["collaborator", "certify", "-n", "site_1", "--silent"]])


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """cert/ of a CA with aggregator, site_0, site_1, site_2 and intruder certificates, plus a client
    certificate for site_1 signed by a second, unrelated CA. Made once per test run: under pytest-xdist,
    the first worker to ask makes it (under a lock) in the folder the workers share; tests only read it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder (each worker's own is popen-gwN inside it)
    root = shared / "pki"
    with open(shared / "pki.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "made").exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            make_pki(root)
            (root / "made").touch()
    return {"cert": root / "main" / "cert", "other_ca_client": root / "other" / "cert" / "client"}


def workspace_factory(root: Path, pki: dict):
    """Makes ready workspaces (plan, PKI, init.pbuf) under ``root``; ``max_retries`` bounds
    collaborator retries."""

    def make(config: RunConfig, *, name: str = "ws", max_retries: int = 30, **plan_options) -> Path:
        ws = create_workspace(root / name, config, port=free_port(), max_retries=max_retries, **plan_options)
        shutil.rmtree(ws / "cert")
        shutil.copytree(pki["cert"], ws / "cert")
        cols = {"collaborators": [f"site_{i}" for i in range(config.clients)]}
        (ws / "plan" / "cols.yaml").write_text(yaml.safe_dump(cols))  # the PKI run also listed 'intruder'
        initialize_plan(ws)
        return ws

    return make


def run_collaborator(ws, name, timeout=150):
    """``fx collaborator start -n NAME`` in ``ws`` until it exits: its exit code and the reason its log gives."""
    proc = start(ws, ["collaborator", "start", "-n", name], f"{name}.log")
    try:
        code = proc.wait(timeout=timeout)
    finally:
        stop_all({name: proc})
    return code, failure_reason(ws / "logs" / f"{name}.log")


@pytest.fixture
def make_workspace(tmp_path, pki):
    return workspace_factory(tmp_path, pki)


PLUGINS = '''
import torch
from fedcontrast.algorithms import TensorSpec
from fedcontrast.algorithms.fedavg import FedAvg


class NanUpload(FedAvg):
    """site_1 uploads NaN weights in the second round."""
    name = "nan_upload"

    def task_train(self, site, received):
        result = super().task_train(site, received)
        if site.name == "site_1" and site.round_num == 2:
            key = next(iter(result.uploads))
            result.uploads[key] = torch.full_like(result.uploads[key], float("nan"))
        return result


class PoisonScale(FedAvg):
    """Hostile (test only): site_1 uploads its weights × 1e30 (finite) in the second round."""
    name = "poison_scale"

    def task_train(self, site, received):
        result = super().task_train(site, received)
        if site.name == "site_1" and site.round_num == 2:
            result.uploads = {k: v * 1e30 for k, v in result.uploads.items()}
        return result


class ClaimsHuge(FedAvg):
    """Hostile (test only): site_1 claims 1e9 samples in the second round (≈ 100 % of the average; the
    largest count OpenFL's int32 data-size field carries)."""
    name = "claims_huge"

    def task_train(self, site, received):
        result = super().task_train(site, received)
        if site.name == "site_1" and site.round_num == 2:
            result.weight = 1e9
        return result


def fail_once(module, attribute, marker):
    """The aggregator's disk is "full" the next time ``module.attribute`` writes a file, once per
    workspace (``save/MARKER`` records that it happened); the stock function comes back at once."""
    import errno
    import os

    if not os.path.isdir("save") or os.path.exists(f"save/{marker}"):
        return
    open(f"save/{marker}", "w").close()
    stock = getattr(module, attribute)

    def full(*args):
        setattr(module, attribute, stock)
        raise OSError(errno.ENOSPC, "No space left on device", str(args[-1]))

    setattr(module, attribute, full)


class DiskFullOnce(FedAvg):
    """Test only: the aggregator's disk is full when it writes round 2's results, once per workspace."""
    name = "disk_full_once"

    def aggregate(self, uploads, weights, server):
        from fedcontrast.openfl import records

        if server.round_num == 2:
            fail_once(records, "atomic_torch_save", "disk_was_full")
        return super().aggregate(uploads, weights, server)


class DiskFullAtCheckpoint(FedAvg):
    """Test only: the aggregator's disk fills after round 1's model and pending record were written, while
    OpenFL writes its last.pbuf (before any site has evaluated that model), once per workspace."""
    name = "disk_full_at_checkpoint"

    def aggregate(self, uploads, weights, server):
        from openfl.protocols import utils

        if server.round_num == 1:
            fail_once(utils, "dump_proto", "disk_was_full")
        return super().aggregate(uploads, weights, server)


class FailingTask(FedAvg):
    """site_1's training raises in the second round."""
    name = "failing_task"

    def task_train(self, site, received):
        if site.name == "site_1" and site.round_num == 2:
            raise RuntimeError("deliberate failure in site_1's task")
        return super().task_train(site, received)


class BrokenAggregator(FedAvg):
    """The aggregator task raises in the first round."""
    name = "broken_aggregator"

    def aggregate(self, uploads, weights, server):
        raise RuntimeError("deliberate failure in the aggregator task")


class OversizedUpload(FedAvg):
    """Hostile (test only): site_1's upload in the second round carries 3 MiB more than its declaration;
    its first message (OpenFL sends 2 MiB each) alone is larger than a digits model's declared bound."""
    name = "oversized_upload"

    def task_train(self, site, received):
        result = super().task_train(site, received)
        if site.name == "site_1" and site.round_num == 2:
            key = next(iter(result.uploads))
            result.uploads[key] = torch.cat([result.uploads[key].reshape(-1), torch.zeros(3 << 18)])
        return result


class PersonalEcho(FedAvg):
    """Sends each site its own number (100 × site index + round) and records what each site got."""
    name = "personal_echo"

    def download_specs(self, model, num_classes):
        return super().download_specs(model, num_classes) + [
            TensorSpec("echo.count", (1,), "float32", "download", per_site=True)]

    def initial_downlink(self, server):
        downlink = super().initial_downlink(server)
        downlink.personal = {s: {"echo.count": torch.zeros(1)} for s in server.sites}
        return downlink

    def task_train(self, site, received):
        site.state.setdefault("echo.seen", []).append(float(received["echo.count"]))
        return super().task_train(site, received)

    def aggregate(self, uploads, weights, server):
        downlink = super().aggregate(uploads, weights, server)
        downlink.personal = {s: {"echo.count": torch.tensor([float(server.round_num) + 100 * int(s.split("_")[1])])}
                             for s in uploads}
        return downlink
'''


@pytest.fixture
def test_plugins(tmp_path, monkeypatch):
    """Test plugins installed as a third-party package (entry points), for every process."""
    pkg = tmp_path / "plugins"
    pkg.mkdir()
    (pkg / "test_only_plugins.py").write_text(textwrap.dedent(PLUGINS))
    dist = pkg / "test_only_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: test-only-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedcontrast.algorithms]\n"
                                           "nan_upload = test_only_plugins:NanUpload\n"
                                           "broken_aggregator = test_only_plugins:BrokenAggregator\n"
                                           "failing_task = test_only_plugins:FailingTask\n"
                                           "poison_scale = test_only_plugins:PoisonScale\n"
                                           "claims_huge = test_only_plugins:ClaimsHuge\n"
                                           "disk_full_once = test_only_plugins:DiskFullOnce\n"
                                           "disk_full_at_checkpoint = test_only_plugins:DiskFullAtCheckpoint\n"
                                           "personal_echo = test_only_plugins:PersonalEcho\n"
                                           "oversized_upload = test_only_plugins:OversizedUpload\n")
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    yield
    sys.modules.pop("test_only_plugins", None)
