"""A throw-away multi-host network made of Linux network namespaces, for tests and benchmarks.

``NetnsLab(["aggregator", "hosp1", "hosp2"])`` stands in for separate machines: each host gets its
own network namespace, an address in a private /24 and a host name ``<host>.<domain>`` that every
host of the lab resolves, so an OpenFL aggregator and its collaborators can talk gRPC/TLS by name.

Topology: one extra *switch* namespace holds a Linux bridge ``br0``; every host namespace is wired
to it by a veth pair whose host end is ``eth0`` (address ``10.213.<n>.<i+1>/24``) and whose switch
end is ``p<i>``. Each veth pair is created directly inside the two namespaces, never in the root
namespace, so its names only need to be unique within a namespace. The hosts have no default route
and nothing connects the root namespace to the bridge: only the lab's hosts can reach each other.

Names resolve through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` bind-mounts over
``/etc/hosts`` for the command it runs (``ip -n`` and plain ``setns`` do not), so start programs
with :meth:`NetnsLab.popen`, :meth:`NetnsLab.run` or :meth:`NetnsLab.command`.

Everything needs root and iproute2; :func:`netns_unavailable` says why not, as a pytest skip reason.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

__all__ = ["NetnsLab", "netns_unavailable"]

ETC_NETNS = Path("/etc/netns")
# Left in /etc/netns by whichever lab created that directory, so that the last lab to close removes
# it even when labs of several processes overlap; `ip netns exec` only reads /etc/netns/<ns>/.
CREATED_MARKER = ".created-by-fedcontrast-netnslab"
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # one DNS label, lower case
_counter = itertools.count()
_GRACE_S = 1.0  # between SIGTERM and SIGKILL when closing


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``ip ARGS``; with ``check``, a failure raises RuntimeError naming the command."""
    done = subprocess.run([shutil.which("ip") or "ip", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)
    if check and done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {reason}")
    return done


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """None when this process can build namespaces (root, ``ip`` on PATH, and a probe namespace
    with a bridge and a veth pair can be created and deleted); otherwise one sentence saying why not
    (used as a pytest skip reason). The answer is computed once per process."""
    if os.geteuid() != 0:
        return f"network namespaces need root, and this process runs as uid {os.geteuid()}."
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not on PATH."
    probe = f"fcprobe{os.getpid()}x{next(_counter)}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot create a network namespace ({e})."
    why = None
    try:
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        why = f"cannot create a bridge and a veth pair in a network namespace ({e})."
    if _ip("netns", "del", probe, check=False).returncode != 0:
        why = why or f"cannot delete the probe network namespace {probe}."
    return why


class NetnsLab:
    """Context manager for a private network of hosts, one network namespace each (see module doc).

    Namespaces are named ``fc<pid>x<k>-<host>`` (and ``fc<pid>x<k>-_switch``), so parallel labs and
    parallel test processes never collide; host ``i`` gets ``10.213.<n>.<i+1>`` with a per-instance
    ``<n>`` (labs are isolated from each other anyway; distinct subnets only make logs clearer).
    """

    def __init__(self, hosts: list[str], domain: str = "fedtest") -> None:
        hosts = list(hosts)
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError(f"a lab needs 1 to 250 distinct host names, not {hosts!r}")
        bad = [name for name in [*hosts, *domain.split(".")] if not _LABEL.match(name)]
        if bad:
            raise ValueError(f"host and domain labels must be lower-case DNS labels, not {bad!r}")
        k = next(_counter)
        self.hosts, self.domain = hosts, domain
        self.prefix = f"fc{os.getpid()}x{k}-"
        self.subnet = f"10.213.{(os.getpid() * 7 + k) % 254 + 1}"
        self._switch = self.prefix + "_switch"  # '_' is not allowed in host names: no clash
        self._created_ns: list[str] = []
        self._created_dirs: list[Path] = []
        self._procs: list[subprocess.Popen] = []
        self._entered = False

    # ---- names -------------------------------------------------------------------------------
    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise KeyError(f"{host!r} is not a host of this lab ({', '.join(self.hosts)})") from None

    def fqdn(self, host: str) -> str:
        """``<host>.<domain>``, resolvable inside every namespace of the lab."""
        self._index(host)
        return f"{host}.{self.domain}"

    def address(self, host: str) -> str:
        """The host's IPv4 address on the lab's segment."""
        return f"{self.subnet}.{self._index(host) + 1}"

    def namespace(self, host: str) -> str:
        """The name of the host's network namespace (as ``ip netns list`` shows it)."""
        self._index(host)
        return self.prefix + host

    # ---- building ----------------------------------------------------------------------------
    def __enter__(self) -> NetnsLab:
        """Builds the lab; on any failure removes what it made and raises RuntimeError."""
        if self._entered:
            raise RuntimeError("a NetnsLab can be entered only once.")
        self._entered = True
        atexit.register(self.close)
        try:
            self._build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            self.close()
            raise RuntimeError(f"could not build the network namespace lab {self.prefix}*: {e}") from e
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created_ns.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        hosts_text = "".join(["127.0.0.1\tlocalhost\n", "::1\tlocalhost ip6-localhost ip6-loopback\n",
                              *(f"{self.address(h)}\t{self.fqdn(h)}\t{h}\n" for h in self.hosts)])
        self._add_namespace(self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            self._add_namespace(ns)
            etc = self._make_etc_dir(ns)
            (etc / "hosts").write_text(f"# fedcontrast NetnsLab {self.prefix} host {host}\n" + hosts_text)
            _ip("-n", self._switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self._switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _make_etc_dir(self, ns: str) -> Path:
        """Creates /etc/netns/<ns> (and /etc/netns, with CREATED_MARKER, if missing)."""
        etc = ETC_NETNS / ns
        for _ in range(3):  # another lab may remove an empty /etc/netns between our two mkdirs
            try:
                ETC_NETNS.mkdir(mode=0o755)
                (ETC_NETNS / CREATED_MARKER).touch()
            except FileExistsError:
                pass
            try:
                etc.mkdir(mode=0o755)  # a leftover of a crashed run raises FileExistsError: not ours
            except FileNotFoundError:
                continue
            self._created_dirs.append(etc)
            return etc
        raise RuntimeError(f"could not create {etc}")

    # ---- running programs on a host ----------------------------------------------------------
    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside the host's namespace (and with its /etc/hosts):
        ``[ip, "netns", "exec", namespace, *argv]``, ``ip`` resolved to an absolute path so that an
        ``env`` without /usr/sbin on its PATH still finds it."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
              log_path: str | os.PathLike | None = None) -> subprocess.Popen:
        """Starts ``argv`` on the host in a new session (kill its process group to stop it);
        stdout and stderr are appended to ``log_path``, or discarded; stdin is /dev/null."""
        log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.command(host, argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if not isinstance(log, int):  # a file of ours, not subprocess.DEVNULL
                log.close()
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Runs ``argv`` on the host to completion; text output captured, exit status not checked."""
        return subprocess.run(self.command(host, argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)

    # ---- cleanup -----------------------------------------------------------------------------
    def _pids(self) -> list[int]:
        found = (_ip("netns", "pids", ns, check=False).stdout.split() for ns in self._created_ns)
        return sorted({int(p) for out in found for p in out if p.isdigit()} - {os.getpid()})

    def _signal_all(self, sig: int) -> None:
        for pid in self._pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kills every process left in the lab's namespaces (SIGTERM, then SIGKILL after a short
        grace), deletes the namespaces it created (their veths and bridge go with them) and the
        /etc/netns entries it made (and /etc/netns itself when a lab created it and it is now empty
        of entries). Idempotent, tolerates a partial build, never raises: what it could not remove
        is reported with a RuntimeWarning."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        while self._created_ns and self._pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for proc in self._procs:  # reap our own children so no zombie outlives the lab
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        problems, made_dirs = [], bool(self._created_dirs)
        for ns in reversed(self._created_ns):
            if _ip("netns", "del", ns, check=False).returncode != 0:
                problems.append(f"namespace {ns}")
        self._created_ns.clear()
        for etc in reversed(self._created_dirs):
            try:
                (etc / "hosts").unlink(missing_ok=True)
                etc.rmdir()
            except OSError:
                problems.append(str(etc))
        self._created_dirs.clear()
        try:  # remove /etc/netns if a lab created it and no entry but the marker is left
            if made_dirs and [p.name for p in ETC_NETNS.iterdir()] == [CREATED_MARKER]:
                (ETC_NETNS / CREATED_MARKER).unlink()
                ETC_NETNS.rmdir()
        except OSError:
            pass  # absent, or another lab raced us: it is that lab's to remove
        atexit.unregister(self.close)
        if problems:
            warnings.warn(f"NetnsLab {self.prefix} could not remove: {', '.join(problems)}", RuntimeWarning,
                          stacklevel=2)

    def __exit__(self, *exc: object) -> None:
        self.close()
