"""NetnsLab: hosts in network namespaces reach each other by name, the root namespace cannot reach
them, and closing the lab leaves nothing behind (namespaces, /etc/netns entries, processes)."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedcontrast.lab.netns import ETC_NETNS, NetnsLab, netns_unavailable

UNAVAILABLE = netns_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")

HOSTS = ["aggregator", "hosp1", "hosp2"]
PORT = 50051  # every namespace has its own port space, so a fixed port cannot clash

# Echoes one message per connection and logs each peer's address ("peer A.B.C.D").
ECHO_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
while True:
    c, peer = s.accept()
    print("peer", peer[0], flush=True)
    try:
        c.settimeout(5)
        c.sendall(c.recv(1024))
    except OSError:
        pass
    c.close()
"""

ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as c:
    c.sendall(sys.argv[3].encode())
    print(c.recv(1024).decode(), end="")
"""


def echo_via_lab(lab: NetnsLab, client: str, server: str, payload: str, cwd: Path,
                 wait_s: float = 60) -> str:
    """Sends ``payload`` from ``client``'s namespace to ``server``'s echo server by FQDN, retrying
    until it answers (``wait_s``: only against a server that never does); returns what came back (last
    error output if nothing)."""
    deadline = time.monotonic() + wait_s
    while True:
        done = lab.run(client, [sys.executable, "-c", ECHO_CLIENT, lab.fqdn(server), str(PORT), payload],
                       cwd=cwd, timeout=10)
        if done.returncode == 0 and done.stdout == payload or time.monotonic() > deadline:
            return done.stdout if done.returncode == 0 else done.stderr
        time.sleep(0.1)


def ip_netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def lab():
    with NetnsLab(HOSTS, domain="fedtest") as lab:
        yield lab


@pytest.fixture(scope="module")
def echo_server(lab, tmp_path_factory):
    """An echo server on hosp1, ready; yields its log path."""
    tmp = tmp_path_factory.mktemp("netns")
    log = tmp / "echo.log"
    proc = lab.popen("hosp1", [sys.executable, "-c", ECHO_SERVER, str(PORT)], cwd=tmp, log_path=log)
    assert echo_via_lab(lab, "aggregator", "hosp1", "ready?", tmp) == "ready?", log.read_text()
    yield log
    proc.kill()
    proc.wait()


def test_names_resolve_to_lab_addresses_in_every_namespace(lab, tmp_path):
    addresses = {lab.address(h) for h in HOSTS}
    assert len(addresses) == len(HOSTS) and all(a.startswith("10.213.") for a in addresses)
    for client in HOSTS:
        for target in HOSTS:
            done = lab.run(client, ["getent", "hosts", lab.fqdn(target)], cwd=tmp_path, timeout=10)
            assert done.returncode == 0, done.stderr
            assert done.stdout.split()[:2] == [lab.address(target), f"{target}.fedtest"]
    localhost = lab.run("hosp2", ["getent", "hosts", "localhost"], cwd=tmp_path).stdout.split()
    assert localhost[0] in ("127.0.0.1", "::1")


def test_hosts_reach_each_other_by_fqdn_over_tcp(lab, echo_server, tmp_path):
    for client in ("aggregator", "hosp2"):
        assert echo_via_lab(lab, client, "hosp1", f"hello from {client}", tmp_path) == f"hello from {client}"
    peers = {line.split()[1] for line in echo_server.read_text().splitlines()}
    assert peers == {lab.address("aggregator"), lab.address("hosp2")}


def test_root_namespace_cannot_reach_the_lab(lab, echo_server):
    # Some sandboxes route unknown addresses to a proxy that accepts every TCP connection, so a
    # successful connect() proves nothing: the proof is that no echo comes back and the server
    # never sees the attempt.
    before = echo_server.read_text()
    echoed = b""
    with pytest.raises(OSError):  # refused, unreachable or timed out
        with socket.create_connection((lab.address("hosp1"), PORT), timeout=2) as c:
            c.sendall(b"from the root namespace")
            echoed = c.recv(1024)
            raise ConnectionResetError("connection closed without an echo")
    assert echoed == b""
    assert echo_server.read_text() == before
    assert lab.address("hosp1") not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout


def test_close_removes_namespaces_etc_netns_entries_and_processes(tmp_path):
    with NetnsLab(["hosp1", "hosp2"], domain="example") as lab:
        names = [lab.namespace(h) for h in lab.hosts]
        server = lab.popen("hosp1", [sys.executable, "-c", ECHO_SERVER, str(PORT)], cwd=tmp_path)
        assert echo_via_lab(lab, "hosp2", "hosp1", "ping", tmp_path) == "ping"
        listed = ip_netns_list()
        assert all(n in listed for n in names)
        assert all((ETC_NETNS / n / "hosts").is_file() for n in names)
    listed = ip_netns_list()
    assert not any(lab.prefix in line for line in listed.splitlines()), listed
    assert not any((ETC_NETNS / n).exists() for n in names)
    assert not ETC_NETNS.exists() or not [p for p in ETC_NETNS.iterdir() if p.name.startswith(lab.prefix)]
    assert server.poll() is not None  # SIGTERMed by close() and reaped
    assert not Path(f"/proc/{server.pid}").exists()
    lab.close()  # idempotent


def test_failed_build_cleans_up_and_leaves_foreign_namespaces_alone():
    lab = NetnsLab(["hosp1", "hosp2"])
    foreign = lab.namespace("hosp2")
    subprocess.run(["ip", "netns", "add", foreign], check=True)  # makes the build fail half-way
    try:
        with pytest.raises(RuntimeError, match="could not build"):
            lab.__enter__()
        listed = ip_netns_list()
        assert foreign in listed
        assert lab.namespace("hosp1") not in listed and lab.prefix + "_switch" not in listed
        assert not (ETC_NETNS / lab.namespace("hosp1")).exists()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=True)
