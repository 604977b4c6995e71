"""Once the aggregator has stopped a federation, every site that calls is told why (issue 21): the
aggregator answers with an ABORTED status carrying its one-sentence reason, and the collaborator
ends with that sentence, at once, without retrying. Over the servicer OpenFL builds (as patched by
fedcontrast); the real federations are in test_refusals.py, test_upload_bounds.py and test_crosssilo.py."""

import grpc
import pytest
from openfl.protocols import aggregator_pb2, aggregator_pb2_grpc

from fedcontrast.openfl.collaborator import BoundedRetry, explain_rpc_error
from fedcontrast.openfl.components import SafeAggregator
from fedcontrast.openfl.protocol import CollaboratorStopped

from .test_upload_bounds import FakeAggregator, MiB, serve, upload

REASON = "round 3 did not complete within 60 s (the plan's round_timeout): no answer from site_1"


class StoppedAggregator(FakeAggregator):
    """A fake aggregator whose federation has stopped, with SafeAggregator's stop path."""

    stop_notice = SafeAggregator.stop_notice
    send_local_task_results = SafeAggregator.send_local_task_results

    def __init__(self):
        super().__init__(3 * MiB)
        self.failure, self.quit_job_sent_to = REASON, []

    def get_tasks(self, name):  # OpenFL's answer once it is time to quit
        self.quit_job_sent_to.append(name)
        return None, 3, 0, True


@pytest.fixture
def stopped():
    fake = StoppedAggregator()
    server, port = serve(fake)
    channel = grpc.insecure_channel(f"localhost:{port}")
    yield fake, aggregator_pb2_grpc.AggregatorStub(channel)
    channel.close()
    server.stop(0)


def test_every_call_after_the_stop_is_answered_with_the_reason(stopped):
    fake, stub = stopped
    header = aggregator_pb2.MessageHeader(sender="site_0", receiver="agg", federation_uuid="fed")
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTasks(aggregator_pb2.GetTasksRequest(header=header), timeout=30)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert info.value.details() == f"the aggregator stopped the federation: {REASON}"
    with pytest.raises(grpc.RpcError) as info:  # a site that was still training: its upload is not taken
        stub.SendLocalTaskResults(upload(1000), timeout=30)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert info.value.details() == f"the aggregator stopped the federation: {REASON}"
    assert fake.stored == [] and fake.quit_job_sent_to == ["site_0"]  # told: not waited for


def test_the_collaborator_ends_with_the_aggregators_sentence_without_retrying(stopped):
    _, stub = stopped
    header = aggregator_pb2.MessageHeader(sender="site_0", receiver="agg", federation_uuid="fed")
    retry = BoundedRetry(1.0, "agg.example:50051", sleeper=lambda s: pytest.fail("it retried"))
    try:
        stub.GetTasks(aggregator_pb2.GetTasksRequest(header=header), timeout=30)
    except grpc.RpcError as error:  # BoundedRetry.sleep runs inside OpenFL's client's `except grpc.RpcError`
        assert explain_rpc_error(error, "agg.example:50051") == (f"the aggregator stopped the federation: {REASON}",
                                                                 False)
        with pytest.raises(CollaboratorStopped) as info:
            retry.sleep()
    assert str(info.value) == f"fedcontrast collaborator: error: the aggregator stopped the federation: {REASON}"
    assert retry.failures == 0
