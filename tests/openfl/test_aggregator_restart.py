"""A site waits for a restarted aggregator: the plan's ``wait_for_aggregator`` (default 10 min), with
back-off capped at a few seconds and one line a minute; certificate errors still stop at once.

Unit tests of the back-off and deadline on a fake clock. The real federation across network
namespaces whose aggregator is killed with SIGKILL in round 2 and left down longer than the old
30 × 1 s retries, restarted, and finished by the very same site processes (one of which withholds
its metrics: the replayed round of mixed releases must not crash the aggregator) is in
tests/openfl/test_crosssilo.py, on that lab's hosts and PKI.
"""

import logging

import grpc
import pytest
import yaml

from fedcontrast.cli import main
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.collaborator import BoundedRetry, QuietClientLog
from fedcontrast.openfl.plan import DEFAULT_WAIT_FOR_AGGREGATOR, build_plan, deployment_defaults
from fedcontrast.openfl.protocol import CollaboratorStopped

from .conftest import small_config


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses"


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def fail(retry):
    try:
        raise Unavailable()
    except grpc.RpcError:
        retry.sleep()


def fake_retry(clock, **kwargs):
    options = {"wait": 600.0, "max_interval": 5.0} | kwargs
    return BoundedRetry(1.0, "agg.example.org:50551", None, clock=clock, sleeper=clock.sleep, **options)


def test_back_off_doubles_up_to_the_cap_and_gives_up_at_the_plans_wait(caplog):
    clock = FakeClock()
    retry = fake_retry(clock)
    with caplog.at_level(logging.INFO, logger="fedcontrast.openfl.components"):
        with pytest.raises(CollaboratorStopped) as info:
            for _ in range(1000):
                fail(retry)
    assert clock.slept[:5] == [1.0, 2.0, 4.0, 5.0, 5.0] and set(clock.slept[3:-1]) == {5.0}
    assert clock.slept[-1] == 3.0  # the last wait ends at the deadline
    assert clock.now - 1000.0 == 600.0  # the last attempt is made at the deadline, then it gives up
    assert str(info.value) == ("fedcontrast collaborator: error: cannot reach the aggregator at agg.example.org:50551: "
                               "it is not running, the address is wrong, or the TLS handshake failed (for example a "
                               "certificate signed by another CA, or no client certificate) (gave up after 10 min: "
                               "the plan's wait_for_aggregator is 10 min)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("cannot reach the aggregator at agg.example.org:50551: ")
    assert lines[0].endswith("; trying again for up to 10 min (the plan's wait_for_aggregator)")
    waiting = lines[1:]
    assert len(waiting) == 9  # one a minute, not one per attempt (≈ 120 attempts)
    assert waiting[0] == ("waiting for the aggregator at agg.example.org:50551: not reachable for 62 s "
                          "(gives up after 10 min)")
    assert waiting[1] == ("waiting for the aggregator at agg.example.org:50551: not reachable for 2 min "
                          "(gives up after 10 min)")
    assert waiting[-1].endswith("not reachable for 9 min (gives up after 10 min)")


def test_a_call_that_goes_through_starts_a_new_wait(caplog):
    clock = FakeClock()
    retry = fake_retry(clock, wait=30.0)
    for _ in range(5):
        fail(retry)  # 1 + 2 + 4 + 5 + 5 = 17 s
    assert retry.waiting
    with caplog.at_level(logging.INFO, logger="fedcontrast.openfl.components"):
        retry.succeeded()
    assert not retry.waiting and caplog.records[-1].getMessage() == (
        "reached the aggregator at agg.example.org:50551 again after 17 s")
    clock.now += 3600  # a long round later the aggregator is lost again: a fresh 30 s and a fresh back-off
    clock.slept.clear()
    for _ in range(5):
        fail(retry)
    assert clock.slept == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(CollaboratorStopped, match=r"gave up after 30 s: the plan's wait_for_aggregator is 30 s"):
        for _ in range(10):
            fail(retry)
    assert clock.slept[-1] == 3.0  # the last wait stops at the deadline


def test_max_retries_still_bounds_the_attempts_when_given():
    clock = FakeClock()
    retry = BoundedRetry(0.0, "localhost:1", 2, clock=clock, sleeper=clock.sleep)
    fail(retry)
    fail(retry)
    with pytest.raises(CollaboratorStopped, match="gave up after 2 retries"):
        fail(retry)


def test_what_retrying_cannot_fix_stops_at_once():
    clock = FakeClock()
    retry = fake_retry(clock, diagnose=lambda: "the aggregator at agg.example.org:50551 presents a certificate "
                                               "(CN=agg.example.org) that expired on 2020-01-01")
    with pytest.raises(CollaboratorStopped) as info:
        fail(retry)
    assert clock.slept == [] and "expired on 2020-01-01" in str(info.value) and "gave up" not in str(info.value)

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self):
            return "refused site_9: its certificate was revoked"

    retry = fake_retry(clock)
    with pytest.raises(CollaboratorStopped, match="refused site_9"):
        try:
            raise Refused()
        except grpc.RpcError:
            retry.sleep()
    assert clock.slept == []


def test_polling_lines_at_most_once_a_minute_and_no_reconnection_chatter():
    clock = FakeClock()
    quiet = QuietClientLog(clock=clock)

    def passes(msg, *args):
        return quiet.filter(logging.LogRecord(QuietClientLog.LOGGER, logging.INFO, __file__, 1, msg, args, None))

    seen = []
    for _ in range(20 * 150):  # 20 polls a second for 150 s
        seen.append(passes("Requesting tasks..."))
        clock.now += 0.05
    assert sum(seen) == 3  # at 0, 60 and 120 s
    assert not passes("Failed to send data request to aggregator %s, error code %s", "agg:1", "UNAVAILABLE")
    assert not passes("Reconnecting to aggregator") and not passes("Connecting to gRPC at %s", "agg:1")
    assert passes("Round: %d Received Tasks: %s", 3, ["train"])


def test_the_wait_is_a_plan_setting_checked_in_one_sentence(tmp_path):
    settings = deployment_defaults()["collaborator"]["settings"]
    assert settings["wait_for_aggregator"] == DEFAULT_WAIT_FOR_AGGREGATOR == 600.0
    assert settings["reconnect_interval_max"] == 5.0 and "max_retries" not in settings
    plan = build_plan(small_config(), wait_for_aggregator=90)
    assert plan["collaborator"]["settings"]["wait_for_aggregator"] == 90.0
    for bad in (0, -5, float("inf"), float("nan"), "10 min", True):
        with pytest.raises(ConfigError, match=r"^wait_for_aggregator must be a number of seconds > 0 "):
            build_plan(small_config(), wait_for_aggregator=bad)
    with pytest.raises(ConfigError, match=r"^max_retries must be a whole number"):
        build_plan(small_config(), max_retries=-1)
    assert main(["workspace", "create", "--algorithm", "fedavg", "--collaborators", "2", "--wait-for-aggregator", "120",
                 str(tmp_path / "ws")]) == 0
    plan = yaml.safe_load((tmp_path / "ws" / "plan" / "plan.yaml").read_text())
    assert plan["collaborator"]["settings"]["wait_for_aggregator"] == 120.0


class _Callbacks:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_site_told_to_quit_before_any_task_says_the_federation_had_finished(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from fedcontrast.openfl.collaborator import SafeCollaborator

    monkeypatch.chdir(tmp_path)
    site = SafeCollaborator.__new__(SafeCollaborator)  # its loop only: the aggregator answers "quit" at once
    site.callbacks, site.collaborator_name = _Callbacks(), "site_0"
    site.client = SimpleNamespace(get_tasks=lambda: (None, 2, 0, True))
    site.task_runner = SimpleNamespace(report_dir=tmp_path / "local_state" / "site_report")
    site.run()
    out = " ".join(capsys.readouterr().out.split())
    assert ("fedcontrast collaborator: the federation finished already (the aggregator had no round left for "
            "site_0): nothing to do; its outputs are in local_state/site_report/site_0/ (rounds.csv") in out
    assert "to take part in a new run, the operator must create a new workspace" in out
