"""One rule for every party's torch threads (fedcontrast.threads): the cores the process may use (its
CPU affinity), divided among the parties one command starts on one host, unless the user sets it;
printed in one line and recorded with the run."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from fedcontrast import threads as threads_module
from fedcontrast.errors import ConfigError
from fedcontrast.site.report import SiteReport, read_rows
from fedcontrast.threads import (
    SHARED_ENV,
    THREADS_ENV,
    Threads,
    apply_threads,
    choose_threads,
    describe,
    party_env,
    usable_cores,
)


@pytest.fixture
def cores(monkeypatch):
    """A faked CPU affinity of ``n`` cores (the machine's own count left alone)."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv(SHARED_ENV, raising=False)

    def fake(n):
        monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    return fake


def test_the_default_follows_the_affinity_not_the_machine(cores):
    cores(6)
    assert usable_cores() == 6
    assert choose_threads().threads == 6
    cores(1)
    assert choose_threads().threads == 1


def test_the_cores_are_divided_among_the_parties_of_one_command(cores):
    cores(8)
    assert choose_threads(parties=4).threads == 2  # the aggregator and 3 collaborators
    assert choose_threads(parties=3).threads == 2
    cores(2)
    assert choose_threads(parties=4).threads == 1  # never 0
    assert not choose_threads(parties=4).given


def test_a_value_the_user_sets_wins(cores, monkeypatch):
    cores(2)
    assert choose_threads(5, parties=4) == Threads(5, 2, 4, given=True)
    monkeypatch.setenv(THREADS_ENV, "3")
    assert choose_threads() == Threads(3, 2, 1, given=True)
    for bad in (0, -1, "two", "1.5"):
        with pytest.raises(ConfigError, match="--threads must be a whole number"):
            choose_threads(bad)


def test_a_launchers_share_reaches_its_party_as_a_share(cores, monkeypatch):
    cores(8)
    share = choose_threads(parties=4)
    env = party_env(share)
    assert env == {THREADS_ENV: "2", "OMP_NUM_THREADS": "2", SHARED_ENV: "4"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert choose_threads() == Threads(2, 8, 4, given=False)  # in the party: the same share, still the rule's
    assert SHARED_ENV not in party_env(choose_threads(3))  # the user's value is the user's


def test_the_line(cores):
    cores(2)
    assert describe(choose_threads()) == "threads: 2 (of 2 cores this process may use)"
    assert (describe(choose_threads(parties=4))
            == "threads: 1 per party (4 parties share the 2 cores this process may use)")
    assert describe(choose_threads(3)) == "threads: 3 (set; 2 cores this process may use)"
    assert "\n" not in describe(choose_threads(parties=4))


def test_apply_sets_torch(cores, monkeypatch):
    before = torch.get_num_threads()
    try:
        cores(1)
        assert apply_threads().threads == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv(THREADS_ENV, "2")
        assert apply_threads().threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_site_report_records_the_threads(tmp_path):
    report = SiteReport(tmp_path, "hosp1", 2, None, threads=3)
    report.evaluated(0, {"accuracy": 0.5}, 10, 8)
    assert read_rows(tmp_path)[0]["threads"] == 3


def test_a_party_process_follows_its_affinity():
    """A real process pinned to one core (taskset's way, by the affinity) gets 1 thread by default."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from fedcontrast.threads import apply_threads; import torch; c = apply_threads(); "
            "print(c.threads, torch.get_num_threads(), c.line())")
    env = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, SHARED_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "1 1 threads: 1 (of 1 core this process may use)"


def test_opacus_adds_no_second_handler_to_the_root_logger():
    """Under DP a site's checks compute ε before fx sets up its logging: Opacus's import-time
    logging.basicConfig must not leave a handler behind (every line of the site's log twice)."""
    code = ("import logging; from fedcontrast.privacy.accounting import make_accountant; make_accountant('rdp'); "
            "from fedcontrast.privacy.dp_sgd import DPSGDSession; "
            "root = logging.getLogger(); h = logging.StreamHandler(); root.addHandler(h); root.setLevel('INFO'); "
            "logging.getLogger('fedcontrast.x').info('one line'); print(len(root.handlers))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "1"
    assert done.stderr.count("one line") == 1, done.stderr
    logging.getLogger(__name__).debug("ok")
