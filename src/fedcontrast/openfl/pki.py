"""The mutual-TLS PKI of a local development federation, made with OpenFL's own ``fx`` commands.

One workspace plays every party here (CA, aggregator and collaborators on one machine). For a real
multi-site deployment the same commands run at different sites; see ``certs/README.md``.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError, FedContrastError


def fx_executable() -> str:
    """``fx`` from this environment (the one fedcontrast is installed in)."""
    candidate = Path(sys.executable).with_name("fx")
    return str(candidate) if candidate.exists() else "fx"


def dev_pki_commands(collaborators: list[str], *, fqdn: str = "localhost") -> list[list[str]]:
    """The ``fx`` command lines, in order, run inside the workspace."""
    commands = [["fx", "workspace", "certify"],
                ["fx", "aggregator", "generate-cert-request", "--fqdn", fqdn],
                ["fx", "aggregator", "certify", "--fqdn", fqdn, "--silent"]]
    for name in collaborators:
        commands += [["fx", "collaborator", "generate-cert-request", "-n", name, "--silent", "--skip-package"],
                     ["fx", "collaborator", "certify", "-n", name, "--silent"]]
    return commands


def make_dev_pki(workspace: str | Path, collaborators: list[str], *, fqdn: str = "localhost",
                 log=print) -> None:
    """Run :func:`dev_pki_commands` in ``workspace``; a failing command raises with its output."""
    ws = Path(workspace)
    if (ws / "cert" / "ca").exists():
        raise FedContrastError(f"{ws / 'cert'} already holds a certificate authority; remove it to make a new one")
    if any(name != name.lower() for name in collaborators):
        raise FedContrastError("collaborator names must be lower case: OpenFL's certificate tools lower-case them")
    fx = fx_executable()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for command in dev_pki_commands(collaborators, fqdn=fqdn):
        log("  $ " + " ".join(command))
        proc = subprocess.run([fx, *command[1:]], cwd=ws, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise FedContrastError(f"'{' '.join(command)}' failed in {ws} (exit {proc.returncode}): "
                                   + " | ".join(tail))


def check_certificate_dates(paths: list[str | Path], *, now: dt.datetime | None = None) -> None:
    """Refuse at once, in one sentence naming the file and the date, a certificate that has expired
    or is not valid yet (the TLS handshake would fail on every retry without ever saying why).
    Files that do not exist are left to OpenFL, which names them."""
    from cryptography import x509

    now = now or dt.datetime.now(dt.timezone.utc)
    for path in map(Path, paths):
        if not path.is_file():
            continue
        try:
            certificates = x509.load_pem_x509_certificates(path.read_bytes())
        except ValueError:
            raise ConfigError(f"{path} is not a PEM certificate; make this party's certificates again") from None
        for cert in certificates:
            subject = cert.subject.rfc4514_string()
            if cert.not_valid_after_utc < now:
                raise ConfigError(f"the certificate {path} ({subject}) expired on "
                                  f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; have the federation's CA issue "
                                  "a new one before starting")
            if cert.not_valid_before_utc > now:
                raise ConfigError(f"the certificate {path} ({subject}) is not valid before "
                                  f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; check this machine's clock")
