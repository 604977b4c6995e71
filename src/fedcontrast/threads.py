"""How many torch threads a party computes with: one rule for every party of every engine.

The default is the cores this process may use (its CPU affinity, ``os.sched_getaffinity(0)``: a
container's or ``taskset``'s limit, not the machine's count), divided among the parties when one
command starts several on one host (``fedcontrast federation``: the aggregator and each
collaborator get ``max(1, cores // parties)``). A value the user gives (``--threads N``) wins. A
command that starts a party in another process hands the value on in ``FEDCONTRAST_THREADS`` (and
``OMP_NUM_THREADS``, for OpenMP itself); the party applies it with :func:`apply_threads`, which
says it in one line (:func:`describe`) and returns what to record with the run.

The thread count changes the last bits of float sums: runs compare bit for bit only at the same count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

THREADS_ENV = "FEDCONTRAST_THREADS"
SHARED_ENV = "FEDCONTRAST_THREADS_PARTIES"  # set beside it when the value is the launcher's share, not the user's


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where the platform
    has no affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Threads:
    """A party's thread count and where it came from."""

    threads: int
    cores: int  # the cores this process may use
    parties: int = 1  # the parties started together on this host, sharing those cores
    given: bool = False  # set by the user (--threads, FEDCONTRAST_THREADS), not the default rule

    def line(self) -> str:
        """The one line a party prints at start."""
        return describe(self)

    def record(self) -> dict[str, int | bool]:
        """What is recorded with the run (its summary, the site's report)."""
        return {"threads": self.threads, "cores": self.cores, "parties": self.parties, "threads_given": self.given}


def check_threads(value: int | str | None, source: str = "--threads") -> int | None:
    """A thread count the user gave, checked: a whole number ≥ 1 (None: not given)."""
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() != str(n):
        from .errors import ConfigError

        raise ConfigError(f"{source} must be a whole number of threads, at least 1; got {value!r}")
    return n


def choose_threads(given: int | str | None = None, *, parties: int = 1, cores: int | None = None) -> Threads:
    """The thread count of each of ``parties`` parties this command starts on this host: ``given``
    (the user's ``--threads``), else ``FEDCONTRAST_THREADS``, else ``max(1, cores // parties)``."""
    cores = usable_cores() if cores is None else cores
    parties = max(1, int(parties))
    n = check_threads(given)
    if n is None:
        n = check_threads(os.environ.get(THREADS_ENV), THREADS_ENV)
        if n is not None:
            shared = check_threads(os.environ.get(SHARED_ENV), SHARED_ENV)
            return Threads(n, cores, shared or parties, given=shared is None)
        return Threads(max(1, cores // parties), cores, parties)
    return Threads(n, cores, parties, given=True)


def describe(choice: Threads) -> str:
    """``threads: 2 (of 2 cores this process may use)``; with several parties, each one's share."""
    cores = f"{choice.cores} core{'s' if choice.cores != 1 else ''} this process may use"
    if choice.given:
        return f"threads: {choice.threads} (set; {cores})"
    if choice.parties > 1:
        return f"threads: {choice.threads} per party ({choice.parties} parties share the {cores})"
    return f"threads: {choice.threads} (of {cores})"


def party_env(choice: Threads) -> dict[str, str]:
    """The environment that hands ``choice`` to a party started in another process."""
    env = {THREADS_ENV: str(choice.threads), "OMP_NUM_THREADS": str(choice.threads)}
    if not choice.given:
        env[SHARED_ENV] = str(choice.parties)
    return env


def apply_threads(given: int | str | None = None) -> Threads:
    """This party's thread count (:func:`choose_threads` for one party: ``given``, else what its
    launcher handed on in ``FEDCONTRAST_THREADS``, else the cores it may use), set in torch."""
    import torch

    choice = choose_threads(given)
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice
