"""An upload larger than the plugin declares is refused while it streams in, before OpenFL holds it
in memory or stores it in its tensor database, and the sender is named."""

import threading

import grpc
import pytest
from openfl.protocols import aggregator_pb2, aggregator_pb2_grpc, base_pb2, utils
from openfl.transport.grpc.aggregator_server import AggregatorGRPCServer

from fedcontrast.construction import attach_public, build_algorithm, initial_model, load_public
from fedcontrast.openfl import components
from fedcontrast.openfl.components import UPLOAD_MARGIN, SafeAggregator, explain_rpc_error, upload_limit
from fedcontrast.openfl.packing import packed_size
from fedcontrast.openfl.plan import build_plan, create_workspace

from .conftest import free_port, small_config

MiB = 1 << 20


@pytest.mark.parametrize("algorithm, larger, wider", [("fedavg", {}, {"num_classes": 20}),  # weights: a wider classifier
                                                      ("flesd", {"public_fraction": 0.2}, {})])  # more public images
def test_the_bound_is_the_plugins_declared_upload_plus_a_margin(algorithm, larger, wider):
    config = small_config(algorithm=algorithm)
    shape = build_plan(config)["aggregator"]["settings"]["model_shape"]
    plugin = build_algorithm(config)
    if plugin.requires_public:
        attach_public(plugin, load_public(config))
    declared = packed_size(plugin.upload_specs(initial_model(config, **shape), shape["num_classes"])) * 4
    assert upload_limit(config, shape) == declared + UPLOAD_MARGIN
    # follows the declaration
    assert upload_limit(config.replace(**larger), {**shape, **wider}) > upload_limit(config, shape)


def test_the_aggregator_openfl_builds_takes_its_bound_from_the_plan(tmp_path, monkeypatch):
    from openfl.federated import Plan

    from fedcontrast.openfl.launch import initialize_plan

    monkeypatch.setattr(components, "MAX_MESSAGE_BYTES", None)  # restored afterwards: the server's option
    config = small_config(algorithm="fedavg")
    ws = create_workspace(tmp_path / "ws", config)
    initialize_plan(ws)
    monkeypatch.chdir(ws)
    plan = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml", cols_config_path=ws / "plan" / "cols.yaml")
    aggregator = plan.get_aggregator()
    expected = upload_limit(config, build_plan(config)["aggregator"]["settings"]["model_shape"])
    assert aggregator.max_upload_bytes == expected and components.MAX_MESSAGE_BYTES == expected
    aggregator.rounds_to_train = 0  # ends its round-timeout watchdog


class FakeAggregator:
    """What the gRPC servicer uses of the aggregator, recording what reaches it."""

    connector = None
    uuid, federation_uuid, single_col_cert_common_name = "agg", "fed", ""
    authorized_cols = ["site_0"]
    refuse_upload = SafeAggregator.refuse_upload

    def __init__(self, max_upload_bytes):
        self.max_upload_bytes = max_upload_bytes
        self.lock = threading.RLock()
        self.stored, self.failures = [], []

    def send_local_task_results(self, *args):
        self.stored.append(args)

    def _fail(self, reason):
        self.failures.append(reason)


def serve(fake):
    """An aggregator gRPC server (no TLS) in this process for ``fake``, made by OpenFL's own functions
    (as patched by fedcontrast); returns ``(server, port)``, started."""
    port = free_port()
    servicer = AggregatorGRPCServer(aggregator=fake, agg_port=port, use_tls=False, require_client_auth=False)
    grpc_server = components.grpc_server.create_grpc_server(servicer.uri, False, None, None, None, False)
    aggregator_pb2_grpc.add_AggregatorServicer_to_server(servicer, grpc_server)
    grpc_server.start()
    return grpc_server, port


@pytest.fixture
def server():
    fake = FakeAggregator(3 * MiB)
    grpc_server, port = serve(fake)
    channel = grpc.insecure_channel(f"localhost:{port}")
    yield fake, aggregator_pb2_grpc.AggregatorStub(channel)
    channel.close()
    grpc_server.stop(0)


def upload(nbytes):
    header = aggregator_pb2.MessageHeader(sender="site_0", receiver="agg", federation_uuid="fed")
    proto = aggregator_pb2.TaskResults(header=header, round_number=0, task_name="train", data_size=10,
                                       tensors=[base_pb2.NamedTensor(name="fedcontrast.global", data_bytes=b"\1" * nbytes)])
    return utils.proto_to_datastream(proto)  # 2 MiB chunks, as OpenFL's client sends them


def test_an_oversized_upload_is_refused_while_it_streams_in(server):
    fake, stub = server
    stub.SendLocalTaskResults(upload(int(2.5 * MiB)), timeout=30)  # within the bound: reaches the aggregator
    assert len(fake.stored) == 1 and fake.stored[0][:4] == ("site_0", 0, "train", 10)
    with pytest.raises(grpc.RpcError) as info:
        stub.SendLocalTaskResults(upload(20 * MiB), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert details.startswith("the client at ") and "'s upload of more than 4194" in details
    assert f"exceeds the {3 * MiB} bytes that the plan's declared upload allows; refused before it was stored" in details
    assert len(fake.stored) == 1  # nothing of it reached the aggregator (nor its tensor database)
    assert fake.failures == [details]  # the federation stops, naming the sender
    message, retry = explain_rpc_error(info.value, "localhost:1")
    assert not retry and "refused this collaborator's upload" in message


def test_a_single_message_over_the_bound_is_refused_by_grpc(monkeypatch):
    monkeypatch.setattr(components, "MAX_MESSAGE_BYTES", MiB)
    fake = FakeAggregator(100 * MiB)
    bounded, port = serve(fake)
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                aggregator_pb2_grpc.AggregatorStub(channel).SendLocalTaskResults(
                    iter([base_pb2.DataStream(npbytes=b"\1" * (2 * MiB), size=2 * MiB)]), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fake.stored == []
    finally:
        bounded.stop(0)
