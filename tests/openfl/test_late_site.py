"""Issue 46: an OpenFL site started after its federation finished. While the aggregator is still up it
tells the site at once; once it is gone the site waits (the plan's wait_for_aggregator, an aggregator's
restart fits in it) saying what is known: nothing listens at the aggregator's address, which is not a
TLS matter (it used to wait 10 minutes, then blame the network or TLS). With OpenFL's own client and
gRPC server (as patched by fedcontrast)."""

import logging
import socket

import pytest
from openfl.transport.grpc.aggregator_client import AggregatorGRPCClient

from fedcontrast.openfl.collaborator import BoundedRetry, SafeCollaborator
from fedcontrast.openfl.components import SafeAggregator
from fedcontrast.openfl.protocol import CollaboratorStopped

from .test_upload_bounds import FakeAggregator, MiB, serve


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_a_site_whose_aggregator_is_gone_is_told_nothing_listens_not_a_tls_failure(caplog):
    clock = FakeClock()
    client = AggregatorGRPCClient("localhost", closed_port(), "agg", "fed", "site_0", use_tls=False)
    client.sleeping_policy = BoundedRetry(1.0, client.uri, wait=600.0, clock=clock, sleeper=clock.sleep)
    with caplog.at_level(logging.INFO, logger="fedcontrast.openfl.components"):
        with pytest.raises(CollaboratorStopped) as info:
            client.get_tasks()
    sentence = f"the aggregator at {client.uri} is not listening (it may have finished or not started yet)"
    assert str(info.value) == (f"fedcontrast collaborator: error: {sentence} (gave up after 10 min: the plan's "
                               "wait_for_aggregator is 10 min)")
    said = [r.getMessage() for r in caplog.records if r.name == "fedcontrast.openfl.components"]
    assert said[0] == f"{sentence}; trying again for up to 10 min (the plan's wait_for_aggregator)"
    assert not any("TLS" in line or "certificate" in line for line in said)


class FinishedAggregator(FakeAggregator):
    """An aggregator whose federation finished well, still up (telling its sites to quit)."""

    stop_notice = SafeAggregator.stop_notice

    def __init__(self):
        super().__init__(3 * MiB)
        self.failure, self.quit_job_sent_to = None, []

    def get_tasks(self, name):  # OpenFL's answer once every round is done
        self.quit_job_sent_to.append(name)
        return None, 2, 0, True


class _Callbacks:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_site_started_after_the_end_is_told_at_once_while_the_aggregator_is_up(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake = FinishedAggregator()
    server, port = serve(fake)
    try:
        site = SafeCollaborator.__new__(SafeCollaborator)  # its loop, over OpenFL's client
        site.callbacks, site.collaborator_name = _Callbacks(), "site_0"
        site.client = AggregatorGRPCClient("localhost", port, "agg", "fed", "site_0", use_tls=False)
        site.client.sleeping_policy = BoundedRetry(1.0, site.client.uri,
                                                   sleeper=lambda s: pytest.fail("it waited for the aggregator"))
        site.task_runner = type("Runner", (), {"report_dir": tmp_path / "local_state" / "site_report"})()
        site.run()
    finally:
        server.stop(0)
    out = " ".join(capsys.readouterr().out.split())
    assert ("fedcontrast collaborator: the federation finished already (the aggregator had no round left for "
            "site_0): nothing to do") in out
    assert fake.quit_job_sent_to == ["site_0"]
