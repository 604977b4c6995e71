"""The simulator on a real two-machine Ray cluster: a Ray head and a Ray worker node on two hosts of
the network-namespace lab (token authentication on, as a cluster across machines should run), the
driver (``fedcontrast simulate --executor ray --ray-address HEAD:PORT``) on the head's host. 8 sites
spread over both nodes, FedAvg and MOON, 2 rounds: metrics and final weights equal to the sequential
run. A driver without the cluster's token is refused in one sentence. Every namespace and Ray process
the test started is gone afterwards."""

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fedcontrast import device_check
from fedcontrast.cli import main
from fedcontrast.lab.deployment import executable
from fedcontrast.lab.netns import NetnsLab, netns_unavailable

pytest.importorskip("ray", reason="Ray is an install extra (pip install -e '.[ray]'; included in .[test])")
pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

PORT = 6380
SETTINGS = ["--dataset", "digits", "--clients", "8", "--rounds", "2", "--local-epochs", "1", "--min-samples", "5",
            "--site-cpus", "1", "--quiet"]


RAY_NAMES = ("raylet", "gcs_server", "ray::", "default_worker.py")


def is_ray(pid: int) -> bool:
    """Whether ``pid`` is alive and one of Ray's daemons or workers."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(name in args for name in RAY_NAMES)


def lab_ray_processes(lab: NetnsLab) -> set[int]:
    """The Ray processes inside this test's own network namespaces: those it started (another user's
    Ray run on the machine is not counted)."""
    pids: set[int] = set()
    for host in lab.hosts:
        out = subprocess.run(["ip", "netns", "pids", lab.namespace(host)], capture_output=True, text=True).stdout
        pids |= {int(p) for p in out.split() if p.isdigit() and is_ray(int(p))}
    return pids


def start_node(lab: NetnsLab, host: str, args: list[str], env: dict[str, str], cwd: Path) -> None:
    done = lab.run(host, [executable("ray"), "start", f"--node-ip-address={lab.address(host)}", "--num-cpus=1",
                          "--disable-usage-stats", *args], cwd=cwd, env=env, timeout=120)
    assert done.returncode == 0, f"ray start on {host} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_sites_spread_over_a_ray_head_and_worker_on_two_hosts_equal_the_sequential_run(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="fcray"))  # Ray's sockets need a short path
    token = short / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    fedcontrast = executable("fedcontrast")
    try:
        with NetnsLab(["head", "worker"]) as lab:
            head = f"{lab.address('head')}:{PORT}"
            start_node(lab, "head", ["--head", f"--port={PORT}", "--include-dashboard=false",
                                     f"--temp-dir={short / 'head'}"], env, tmp_path)
            start_node(lab, "worker", [f"--address={head}", f"--temp-dir={short / 'worker'}"], env, tmp_path)
            for algorithm in ("fedavg", "moon"):
                ray_run = lab.run("head", [fedcontrast, "simulate", "--algorithm", algorithm, *SETTINGS,
                                           "--executor", "ray", "--ray-address", head, "--runs-dir", str(tmp_path),
                                           "--name", f"{algorithm}-ray"], cwd=tmp_path, env=env, timeout=300)
                assert ray_run.returncode == 0, ray_run.stderr[-3000:]
                assert f"executor: ray ({head}); each site 1 CPU thread(s); 2 site(s) at once" in ray_run.stderr
                assert "executor: sites ran on 2 Ray node(s)" in ray_run.stderr  # the head's and the worker's
                assert main(["simulate", "--algorithm", algorithm, *SETTINGS, "--runs-dir", str(tmp_path),
                             "--name", f"{algorithm}-sequential"]) == 0  # the reference, in this process
                assert device_check.differences(device_check._metrics(tmp_path / f"{algorithm}-sequential"),
                                                device_check._metrics(tmp_path / f"{algorithm}-ray")) == []
            stranger = lab.run("head", [fedcontrast, "simulate", *SETTINGS, "--executor", "ray", "--ray-address",
                                        head, "--runs-dir", str(tmp_path), "--name", "stranger"], cwd=tmp_path,
                               env={**env, "RAY_AUTH_MODE": "disabled", "RAY_NUM_REDIS_GET_RETRIES": "2"},
                               timeout=300)
            assert stranger.returncode != 0
            assert f"the Ray cluster at {head} refused this machine: it asks for its token" in stranger.stderr
            assert "Traceback" not in stranger.stderr and len(stranger.stderr.strip().splitlines()) == 1
            namespaces = [lab.namespace(h) for h in lab.hosts]
            started = lab_ray_processes(lab)
            assert started  # the head's and the worker's daemons, seen where the test started them
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in listed for ns in namespaces)
        deadline = time.monotonic() + 10
        while any(is_ray(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if is_ray(p)]  # the lab killed every Ray process the test started
    finally:
        shutil.rmtree(short, ignore_errors=True)
