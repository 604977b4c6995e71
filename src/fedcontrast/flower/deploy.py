"""A Flower deployment, party by party: what the operator and each site run on their own machine.

* operator: :func:`init_operator` (the federation's CA, the SuperLink's certificate for its host
  name, the Flower App folder — a ``pyproject.toml`` naming fedcontrast's installed components, no
  code —, the ``flwr`` CLI's connection), :func:`superlink_command` (TLS on, SuperNode
  authentication on: only registered keys connect; no dependency installed at run time),
  :func:`register_site` (``flwr supernode register``: a site's public key, recorded with its node id
  so that the ServerApp knows which node is which site), :func:`run_federation` (``flwr run``);
* site: :func:`make_site_key` (its EC P-384 key pair: the private key stays, the public key goes to
  the operator), :func:`supernode_command` (its SuperNode: the operator's CA, its key, its folders).

Each refusal is one sentence (:class:`~fedcontrast.errors.ConfigError`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..config import RunConfig, site_names
from ..errors import ConfigError
from ..yamlio import check_regular_file, read_bytes
from .pki import CERT_DIR, SITES_FILE  # the certificates' folder, the registered sites' file

CONNECTION = "fedcontrast"  # the flwr CLI's name for this federation's SuperLink
APP_DIR, FLWR_HOME, RUN_DIR = "app", "flwr_home", "run"
DEFAULT_PORT = 9092
OUTCOME_FILE = "outcome.json"


def flower_bin(name: str) -> str:
    """A Flower executable of this environment, or one sentence saying how to install Flower."""
    found = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        from .records import INSTALL_HINT

        raise ConfigError(INSTALL_HINT)
    return found


def flower_env(folder: Path | None = None) -> dict[str, str]:
    """The environment Flower's programs need: this environment's executables first on ``PATH``
    (the SuperLink and SuperNode start ``flower-superexec``, ``flwr-serverapp``, ``flwr-clientapp``),
    and the operator's ``FLWR_HOME`` (the CLI's connection) when ``folder`` is given."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")  # Flower's default, 1 s, adds up to 1 s per message
    if folder is not None:
        env["FLWR_HOME"] = str(Path(folder).resolve() / FLWR_HOME)
    return env


# --- keys and certificates (the `cryptography` package; the operator's CA and its reuse: pki.py) -------
def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def key_fingerprint(public_key_file: str | Path) -> str:
    """``SHA256:<hex>`` of an OpenSSH public key (what both parties read to each other)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = Path(public_key_file)
    data = read_bytes(path, "public key file", limit=1 << 20)  # a folder, a FIFO, a huge file: one sentence
    try:
        key = serialization.load_ssh_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ConfigError(f"{path} is not an OpenSSH public key "
                          "(make one with `fedcontrast flower site-key`)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ConfigError(f"{path} is not an EC public key; Flower's SuperNode keys are EC (P-384)")
    raw = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "SHA256:" + hashlib.sha256(raw).hexdigest()


def make_site_key(folder: str | Path, name: str) -> tuple[Path, Path, str]:
    """A site's SuperNode key pair in ``folder``: ``NAME.key`` (private, mode 600, stays here) and
    ``NAME.pub`` (sent to the operator); refuses to overwrite a key. Returns both paths and the
    fingerprint."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    if private.exists():
        raise ConfigError(f"{private} exists already; a site keeps its key (move it away to make a new one, then "
                          "ask the operator to register the new public key)")
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                       + b"\n")
    return private, public, key_fingerprint(public)


def check_private_key_mode(private_key: Path) -> None:
    """Refuse, as ssh does, a private key that its group or others may read or write: whoever else can
    read it can connect as this site (one sentence with the mode and the fix)."""
    mode = private_key.stat().st_mode & 0o777
    if mode & 0o077:
        who = ("its group and others" if mode & 0o070 and mode & 0o007 else "its group" if mode & 0o070
               else "others")
        raise ConfigError(f"this site's private key {private_key} has permissions {mode:04o}, which let {who} "
                          f"use it (ssh refuses such keys too): run `chmod 600 {private_key}`, and if others could "
                          "read it, make a new key (`fedcontrast flower site-key`) and have the operator register it")


def public_of_private(private_key: Path) -> Path:
    """The public key file beside a private key (``NAME.key`` → ``NAME.pub``), written if missing."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    public = private_key.with_suffix(".pub")
    if not public.exists():
        try:
            key = serialization.load_ssh_private_key(read_bytes(private_key, "private key", limit=1 << 20), None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise ConfigError(f"{private_key} is not an OpenSSH private key (make one with `fedcontrast flower "
                              "site-key`)") from None
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                         serialization.PublicFormat.OpenSSH) + b"\n")
    return public


# --- the operator ------------------------------------------------------------------------------------
def init_operator(folder: str | Path, config: RunConfig, *, host: str, port: int = DEFAULT_PORT,
                  round_timeout: float = 1800.0, start_timeout: float = 600.0, threads: int | None = None,
                  min_sites: int | None = None, federation: str | None = None,
                  pki_from: str | Path | None = None) -> Path:
    """The operator's folder: certificates (a CA named after ``federation``, default the folder's name;
    or ``pki_from``'s CA and its sites' registered keys, :func:`.pki.reuse_pki`), the Flower App (run
    config = the typed run configuration), the flwr CLI's connection. Refuses a folder that holds one
    already."""
    from .pki import make_certificates, reuse_pki

    folder = Path(folder).resolve()
    if (folder / APP_DIR / "pyproject.toml").exists():
        raise ConfigError(f"{folder} holds a Flower deployment already; choose a new folder")
    check_min_sites(config, min_sites)
    folder.mkdir(parents=True, exist_ok=True)
    if pki_from is not None:
        reuse_pki(folder, pki_from, host=host, sites=site_names(config))
    else:
        make_certificates(folder / CERT_DIR, host, federation=federation or folder.name)
    settings = {"host": host, "port": port, "round-timeout": float(round_timeout),
                "start-timeout": float(start_timeout), "threads": int(threads or 0), "min-sites": int(min_sites or 0)}
    atomic_write_text(folder / "deployment.json", json.dumps(settings, indent=2) + "\n")
    atomic_write_text(folder / SITES_FILE, "{}\n")
    home = folder / FLWR_HOME
    home.mkdir(exist_ok=True)
    atomic_write_text(home / "config.toml", f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                            f'address = "{host}:{port}"\n'
                                            f'root-certificates = "{folder / CERT_DIR / "ca.crt"}"\n')
    write_app(folder, config)
    return folder


def check_min_sites(config: RunConfig, min_sites: int | None) -> None:
    """``min_sites``: how many sites must answer for a round to go on without the silent ones (None:
    every site); at least 1, at most the plan's sites, and not below the secure sum's threshold."""
    if min_sites is None:
        return
    sites = len(site_names(config))
    if not 1 <= min_sites <= sites:
        raise ConfigError(f"--min-sites must be from 1 to the plan's {sites} sites, got {min_sites}")
    secure = config.secure_aggregation
    if secure is not None and min_sites < secure.sites_needed(sites):
        raise ConfigError(f"--min-sites {min_sites} is below the secure-aggregation threshold "
                          f"{secure.sites_needed(sites)}: a round that small could never be unmasked; raise min_sites "
                          "or lower the threshold")


def write_app(folder: Path, config: RunConfig) -> None:
    """The Flower App folder: ``pyproject.toml`` only (components are the installed fedcontrast's)."""
    settings = json.loads((folder / "deployment.json").read_text())
    nodes = json.loads((folder / SITES_FILE).read_text())
    run_config = {"fedcontrast-config": json.dumps(config.to_dict(), sort_keys=True),
                  "site-nodes": json.dumps({s: v["node_id"] for s, v in nodes.items()}, sort_keys=True),
                  "site-keys": json.dumps({s: v.get("public_key", "") for s, v in nodes.items()}, sort_keys=True),
                  "out-dir": str(folder / RUN_DIR), "base-dir": str(folder),
                  "round-timeout": settings["round-timeout"], "start-timeout": settings["start-timeout"],
                  "threads": settings["threads"], "min-sites": int(settings.get("min-sites", 0)),
                  "resume": "false"}  # `flower run --resume` sets it for one run
    lines = ["[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
             "[project]", f'name = "fedcontrast-{config.algorithm}"', 'version = "1.0.0"',
             f'description = "fedcontrast {config.algorithm} ({", ".join(site_names(config))})"',
             'license = "Apache-2.0"', "dependencies = []", "",
             "[tool.flwr.app]", 'publisher = "fedcontrast"', "",
             "[tool.flwr.app.components]", 'serverapp = "fedcontrast.flower.server_app:server"',
             'clientapp = "fedcontrast.flower.client_app:client"', "", "[tool.flwr.app.config]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in run_config.items()]
    (folder / APP_DIR).mkdir(exist_ok=True)
    atomic_write_text(folder / APP_DIR / "pyproject.toml", "\n".join(lines) + "\n")
    atomic_write_text(folder / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")


def load_operator(folder: str | Path) -> tuple[Path, RunConfig, dict[str, Any]]:
    folder = Path(folder).resolve()
    if not (folder / "deployment.json").is_file():
        raise ConfigError(f"{folder} is not a Flower deployment folder (make one with `fedcontrast flower init`)")
    config = RunConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return folder, config, json.loads((folder / "deployment.json").read_text())


def pin_shared(config: RunConfig, folder: Path) -> RunConfig:
    """The plugin's files every site must hold identically (FedPCL's frozen backbones), made in the
    operator's folder and pinned by SHA-256 in the configuration; the ServerApp sends them to each
    site with its first message."""
    from ..deploy.workspace import pin_shared_files

    folder.mkdir(parents=True, exist_ok=True)
    return pin_shared_files(config, folder)


def superlink_command(folder: str | Path) -> list[str]:
    folder, _, settings = load_operator(folder)
    certs = folder / CERT_DIR
    return [flower_bin("flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "superlink.crt"), "--ssl-keyfile", str(certs / "superlink.key"),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--database", str(folder / "superlink.db"), "--host", "0.0.0.0", "--port", str(settings["port"])]


def register_carried(folder: str | Path) -> list[tuple[str, int, str]]:
    """Registers at the running SuperLink each site key carried over by ``init --pki-from`` and not
    registered yet: (site, node id, fingerprint) of each."""
    from .pki import carried_keys

    folder, config, _ = load_operator(folder)
    nodes = json.loads((folder / SITES_FILE).read_text())
    carried = {s: p for s, p in carried_keys(folder).items() if s in site_names(config) and s not in nodes}
    if not carried:
        raise ConfigError(f"{folder} holds no carried key left to register (keys/ is filled by `flower init "
                          "--pki-from OLD_FOLDER`): register each site's key with `fedcontrast flower register "
                          f"{folder} SITE.pub --site SITE`")
    return [(site, *register_site(folder, path, site)) for site, path in carried.items()]


def register_site(folder: str | Path, public_key: str | Path, site: str) -> tuple[int, str]:
    """Registers ``site``'s public key at the running SuperLink; its node id and key fingerprint."""
    folder, config, _ = load_operator(folder)
    if site not in site_names(config):
        raise ConfigError(f"{site!r} is not a site of this deployment ({', '.join(site_names(config))})")
    fingerprint = key_fingerprint(public_key)
    nodes = json.loads((folder / SITES_FILE).read_text())
    for other, entry in nodes.items():
        if entry["fingerprint"] == fingerprint and other != site:
            raise ConfigError(f"this key ({fingerprint[:23]}…) is registered for site {other} already; each site has "
                              "its own key")
    if site in nodes:
        raise ConfigError(f"site {site} is registered already (key {nodes[site]['fingerprint'][:23]}…)")
    done = subprocess.run([flower_bin("flwr"), "supernode", "register", str(Path(public_key).resolve()), CONNECTION,
                           "--name", site, "--format", "json"], env=flower_env(folder), capture_output=True, text=True,
                          timeout=120, check=False)
    answer = _last_json(done.stdout)
    if done.returncode != 0 or not answer.get("success"):
        reason = answer.get("error-message") or (done.stdout + done.stderr).strip().splitlines()[-1:] or ["?"]
        raise ConfigError(f"the SuperLink did not register {site}'s key: "
                          f"{reason if isinstance(reason, str) else reason[0]}"
                          " (is `fedcontrast flower superlink` running?)")
    node_id = int(answer["node-id"])
    nodes[site] = {"node_id": node_id, "fingerprint": fingerprint,  # the key: peers check its secure-aggregation
                   "public_key": " ".join(Path(public_key).read_text().split()[:2])}  # signatures against it
    atomic_write_text(folder / SITES_FILE, json.dumps(nodes, indent=2) + "\n")
    write_app(folder, config)
    return node_id, fingerprint


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    try:
        value = json.loads(text[text.index("{"):])
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}


def run_command(folder: str | Path) -> list[str]:
    folder, config, _ = load_operator(folder)
    nodes = json.loads((folder / SITES_FILE).read_text())
    missing = [s for s in site_names(config) if s not in nodes]
    if missing:
        raise ConfigError(f"site(s) {', '.join(missing)} have no registered key yet: `fedcontrast flower register "
                          f"{folder} SITE.pub --site SITE` for each")
    return [flower_bin("flwr"), "run", str(folder / APP_DIR), CONNECTION, "--stream"]


def _check_free(port: int) -> None:
    """The SuperNode's local port (its ClientApp's API) must be free on this machine."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the SuperNode binds it
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(f"port {port} on this machine is in use (another SuperNode?); give this one another "
                              "with --port") from None


def site_env() -> dict[str, str]:
    """A site's SuperNode environment: Flower's, plus FEDCONTRAST_FLOWER_SITE=1, which makes every
    ClientApp process it starts refuse code from the operator's app bundle (``_fedcontrast_fx_guard``)."""
    return {**flower_env(), "FEDCONTRAST_FLOWER_SITE": "1"}


def worker_address(workdir: Path) -> tuple[str, str]:
    """Where the site's long-lived worker (:mod:`.worker`) will listen: (socket, key file)."""
    import tempfile

    sock = workdir.resolve() / ".fedcontrast-worker.sock"
    if len(str(sock)) > 100:  # a Unix socket's path is at most 107 bytes
        sock = Path(tempfile.mkdtemp(prefix="fedcontrast-")) / "worker.sock"
    return str(sock), str(workdir.resolve() / ".fedcontrast-worker.key")


def start_worker(address: tuple[str, str] | None, threads: int | None, *,
                 runtime_api: str | None = None) -> subprocess.Popen:
    """The site's worker at ``address``, with a new random key readable by this user only; with
    ``runtime_api`` (a SuperNode started with ``--isolation process``), the worker that takes that
    SuperNode's tasks itself (:mod:`.runner`) instead."""
    import secrets

    if runtime_api is not None:
        return subprocess.Popen([sys.executable, "-m", "fedcontrast.flower.worker", "--runtime-api", runtime_api,
                                 *(["--threads", str(threads)] if threads else [])], env=flower_env())
    assert address is not None  # (socket, key file)
    sock, key = address
    _write_private(Path(key), secrets.token_bytes(32))
    return subprocess.Popen([sys.executable, "-m", "fedcontrast.flower.worker", "--socket", sock, "--key", key,
                             *(["--threads", str(threads)] if threads else [])], env=flower_env())


# --- a site ------------------------------------------------------------------------------------------
ISOLATIONS = ("node", "process", "subprocess")  # fedcontrast flower supernode --isolation


def supernode_command(*, superlink: str, ca: str | Path, key: str | Path, name: str, data: str | Path,
                      workdir: str | Path, public: str | Path | None = None, policy: str | Path | None = None,
                      port: int = 9094, wait: float = 600.0, threads: int | None = None,
                      worker: tuple[str, str] | None = None, isolation: str = "subprocess") -> list[str]:
    """The site's SuperNode, after checking that each file it names exists (one sentence each).
    ``isolation``: ``node`` (the site's own process is its Flower node, :mod:`.node`: no
    ``flower-supernode``), Flower's ``process`` (the site's worker takes the SuperNode's tasks itself:
    :func:`start_worker` with ``runtime_api``) or Flower's ``subprocess`` (its SuperExec starts a
    ``flwr-clientapp`` process per message)."""
    if isolation not in ISOLATIONS:
        raise ConfigError(f"isolation {isolation!r} is not one of: {', '.join(ISOLATIONS)}")
    for label, path in (("the federation's CA certificate (--ca)", ca), ("this site's private key (--key)", key),
                        ("this site's data folder (--data)", data), ("the public folder (--public)", public),
                        ("this site's policy (--policy)", policy)):
        if path is not None and not Path(path).exists():
            raise ConfigError(f"{label} {path} does not exist")
    for label, path in (("the federation's CA certificate (--ca)", ca), ("this site's private key (--key)", key),
                        ("this site's policy (--policy)", policy)):
        if path is not None:  # a file, not a folder, a FIFO or a device (one sentence, never a traceback or a hang)
            check_regular_file(path, label)
    if ":" not in superlink:
        raise ConfigError(f"--superlink {superlink!r} must be HOST:PORT (the operator's SuperLink)")
    check_private_key_mode(Path(key))
    public_of_private(Path(key))  # also checks the key's format
    if isolation != "node":  # the node serves no Runtime API
        _check_free(port)
    node_config = {"site-name": name, "data": str(Path(data).resolve()), "workdir": str(Path(workdir).resolve()),
                   "tls": "true", "node-auth": "true", "threads": str(int(threads or 0) or ""),
                   "signing-key": str(Path(key).resolve())}  # signs its secure-aggregation keys (flower/secure.py)
    if public is not None:
        node_config["public"] = str(Path(public).resolve())
    if policy is not None:
        node_config["policy"] = str(Path(policy).resolve())
    if worker is not None:  # (socket, key file) of the site's long-lived worker
        node_config["worker"], node_config["worker-key"] = worker
    config = " ".join(f"{k}={json.dumps(v)}" for k, v in node_config.items())
    if isolation == "node":  # the site's own process is its Flower node (flower/node.py)
        return [sys.executable, "-m", "fedcontrast.flower.node", "--root-certificates", str(Path(ca).resolve()),
                "--superlink", superlink, "--auth-supernode-private-key", str(Path(key).resolve()),
                "--node-config", config, "--max-wait-time", str(wait),
                *(["--threads", str(threads)] if threads else [])]
    return [flower_bin("flower-supernode"), "--root-certificates", str(Path(ca).resolve()), "--superlink", superlink,
            "--auth-supernode-private-key", str(Path(key).resolve()),
            "--node-config", config, "--port", str(port), "--max-wait-time", str(wait), "--isolation", isolation]


def runtime_api_address(port: int) -> str:
    """Where a SuperNode started with ``--port PORT`` serves its Runtime API (Flower's default host)."""
    return f"127.0.0.1:{port}"
