"""An upload larger than the plugin declares is refused while it streams in, before OpenFL holds it
in memory or stores it in its tensor database, and the sender is named."""

import threading
from types import SimpleNamespace

import grpc
import pytest
from openfl.protocols import aggregator_pb2, aggregator_pb2_grpc, base_pb2, utils
from openfl.transport.grpc.aggregator_server import AggregatorGRPCServer

from fedcontrast.construction import build_algorithm, build_algorithm_with_public, initial_model, load_public
from fedcontrast.openfl import grpc_bounds
from fedcontrast.openfl.collaborator import explain_rpc_error
from fedcontrast.openfl.components import SafeAggregator
from fedcontrast.openfl.packing import packed_size
from fedcontrast.openfl.plan import build_plan, create_workspace
from fedcontrast.openfl.protocol import MESSAGE_ALLOWANCE, UPLOAD_MARGIN
from fedcontrast.openfl.startup_checks import upload_limit

from .conftest import free_port, small_config

MiB = 1 << 20


@pytest.mark.parametrize("algorithm, larger, wider", [
    ("fedavg", {}, {"num_classes": 20}),  # weights: a wider classifier
    ("flesd", {"public_fraction": 0.2}, {})])  # more public images
def test_the_bound_is_the_plugins_declared_upload_plus_a_margin(algorithm, larger, wider):
    config = small_config(algorithm=algorithm)
    shape = build_plan(config)["aggregator"]["settings"]["model_shape"]
    plugin = build_algorithm(config)
    if plugin.requires_public:
        plugin = build_algorithm_with_public(config, load_public(config))
    declared = packed_size(plugin.upload_specs(initial_model(config, **shape), shape["num_classes"])) * 4
    assert upload_limit(config, shape) == declared + UPLOAD_MARGIN
    # follows the declaration
    assert upload_limit(config.replace(**larger), {**shape, **wider}) > upload_limit(config, shape)


def test_the_aggregator_openfl_builds_takes_its_bound_from_the_plan(tmp_path, monkeypatch):
    from openfl.federated import Plan

    from fedcontrast.openfl.launch import initialize_plan

    monkeypatch.setattr(grpc_bounds, "MAX_MESSAGE_BYTES", None)  # restored afterwards: the server's option
    config = small_config(algorithm="fedavg")
    ws = create_workspace(tmp_path / "ws", config)
    initialize_plan(ws)
    monkeypatch.chdir(ws)
    plan = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml", cols_config_path=ws / "plan" / "cols.yaml")
    aggregator = plan.get_aggregator()
    expected = upload_limit(config, build_plan(config)["aggregator"]["settings"]["model_shape"])
    assert aggregator.max_upload_bytes == expected
    assert grpc_bounds.MAX_MESSAGE_BYTES == expected + MESSAGE_ALLOWANCE  # one of OpenFL's messages above: see below
    aggregator.rounds_to_train = 0  # ends its round-timeout watchdog


def test_an_upload_whose_first_message_exceeds_the_bound_is_named_at_once(tmp_path, monkeypatch):
    """A digits model's bound (≈ 1.4 MB) is smaller than one of the 2 MiB messages OpenFL's client
    sends: gRPC, limited to the bound, refused such a message before Python saw it, so the aggregator
    learnt nothing and waited out its round_timeout. Now the sender and the size are named at once,
    the federation stops (robustness.on_rejected: stop), and every site asking next is told why."""
    from openfl.federated import Plan

    from fedcontrast.openfl.launch import initialize_plan

    monkeypatch.setattr(grpc_bounds, "MAX_MESSAGE_BYTES", None)  # restored afterwards: the server's option
    ws = create_workspace(tmp_path / "ws", small_config(algorithm="fedavg"))
    initialize_plan(ws)
    monkeypatch.chdir(ws)
    aggregator = Plan.parse(plan_config_path=ws / "plan" / "plan.yaml",
                            cols_config_path=ws / "plan" / "cols.yaml").get_aggregator()
    assert aggregator.max_upload_bytes < 2 * MiB
    grpc_server, port = serve(aggregator)
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            stub = aggregator_pb2_grpc.AggregatorStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.SendLocalTaskResults(upload(3 * MiB, aggregator), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = info.value.details()
            assert details.startswith("the client at ") and f"'s upload of more than {2 * MiB} bytes exceeds the " \
                f"{aggregator.max_upload_bytes} bytes that the plan's declared upload allows" in details
            assert aggregator.failure == details
            header = aggregator_pb2.MessageHeader(sender="site_0", receiver=aggregator.uuid,
                                                  federation_uuid=aggregator.federation_uuid)
            with pytest.raises(grpc.RpcError) as info:  # the next call of any site: why the federation stopped
                stub.GetTasks(aggregator_pb2.GetTasksRequest(header=header), timeout=30)
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert info.value.details() == f"the aggregator stopped the federation: {details}"
            assert explain_rpc_error(info.value, "localhost:1") == (info.value.details(), False)
            assert "site_0" in aggregator.quit_job_sent_to
    finally:
        grpc_server.stop(0)
        aggregator.rounds_to_train = 0


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
    grpc_server = grpc_bounds.grpc_server.create_grpc_server(servicer.uri, False, None, None, None, False)
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


def upload(nbytes, aggregator=None):
    header = aggregator_pb2.MessageHeader(sender="site_0", receiver=getattr(aggregator, "uuid", "agg"),
                                          federation_uuid=getattr(aggregator, "federation_uuid", "fed"))
    tensor = base_pb2.NamedTensor(name="fedcontrast.global", data_bytes=b"\1" * nbytes)
    proto = aggregator_pb2.TaskResults(header=header, round_number=0, task_name="train", data_size=10, tensors=[tensor])
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
    assert (f"exceeds the {3 * MiB} bytes that the plan's declared upload allows; refused before it was stored"
            in details)
    assert len(fake.stored) == 1  # nothing of it reached the aggregator (nor its tensor database)
    assert fake.failures == [details]  # the federation stops, naming the sender
    message, retry = explain_rpc_error(info.value, "localhost:1")
    assert not retry and "refused this collaborator's upload" in message


def test_a_single_message_over_the_bound_is_refused_by_grpc(monkeypatch):
    monkeypatch.setattr(grpc_bounds, "MAX_MESSAGE_BYTES", MiB)
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


def test_an_oversized_upload_in_a_federation_stops_it_at_once_and_every_site_says_why(make_workspace, test_plugins):
    """site_1 uploads 3 MiB more than its plugin declares, under the default round_timeout (30 min, far
    beyond FEDERATION_TIMEOUT): the aggregator names it and the size at once and stops (exit code 3),
    site_1 says its upload was refused, and site_0 says why the federation stopped: the aggregator's
    sentence, not "see its log"."""
    import time

    from fedcontrast.openfl.launch import start, stop_all
    from fedcontrast.openfl.protocol import FAILURE_EXIT_CODE

    from .conftest import FEDERATION_TIMEOUT

    ws = make_workspace(small_config(algorithm="oversized_upload", rounds=2))
    started = time.monotonic()
    procs = {"aggregator": start(ws, ["aggregator", "start"], "aggregator.log")}
    for name in ("site_0", "site_1"):
        procs[name] = start(ws, ["collaborator", "start", "-n", name], f"{name}.log")
    ended: set[str] = set()
    try:
        while len(ended) < len(procs) and time.monotonic() < started + FEDERATION_TIMEOUT:  # only against a hang
            ended.update(party for party, proc in procs.items() if proc.poll() is not None)
            time.sleep(0.2)
    finally:
        stop_all(procs)
    codes = {party: proc.poll() for party, proc in procs.items()}
    assert ended == set(procs), codes
    # told and gone at once: the aggregator does not wait for the refused site to ask for its next task (its
    # refusal is its stop notice: test_a_refused_upload_is_its_senders_stop_notice, below)
    logs = {party: " ".join((ws / "logs" / f"{party}.log").read_text(errors="replace").split()) for party in procs}
    shape = build_plan(small_config())["aggregator"]["settings"]["model_shape"]
    bound = upload_limit(small_config(algorithm="fedavg"), shape)  # the test plugin declares FedAvg's upload
    reason = (f"collaborator site_1's upload of more than {2 * MiB} bytes exceeds the {bound} bytes that the plan's "
              "declared upload allows; refused before it was stored")
    assert codes["aggregator"] == FAILURE_EXIT_CODE and reason in logs["aggregator"], logs["aggregator"][-3000:]
    assert codes["site_1"] != 0 and f"refused this collaborator's upload: {reason}" in logs["site_1"]
    assert codes["site_0"] != 0
    assert f"fedcontrast collaborator: error: the aggregator stopped the federation: {reason}" in logs["site_0"]
    assert logs["site_0"].count("the aggregator stopped the federation") == 1  # once, not retried


class Refusing(FakeAggregator):
    """An aggregator of two sites with SafeAggregator's refusal of an upload and its stop path."""

    authorized_cols = ["site_0", "site_1"]
    stop_notice = SafeAggregator.stop_notice
    all_quit_jobs_sent = SafeAggregator.all_quit_jobs_sent

    def __init__(self):
        super().__init__(MiB)
        self.failure, self.quit_job_sent_to, self.absent, self.quit_since = None, [], set(), None

    def _fail(self, reason):
        self.failure = reason

    def _time_to_quit(self):
        return self.failure is not None


def test_a_refused_upload_is_its_senders_stop_notice(monkeypatch):
    """The aggregator ends once every other site is told why, without waiting for the refused sender
    to ask again (it ends on its refusal): on a clock that does not move, the 60 s an untold site is
    waited for never pass."""
    from fedcontrast.openfl.protocol import FAILURE_EXIT_CODE, STOP_GRACE_S

    slept: list[float] = []
    monkeypatch.setattr("fedcontrast.openfl.aggregator.time", SimpleNamespace(monotonic=lambda: 0.0,
                                                                              sleep=slept.append))
    aggregator = Refusing()
    over_tls = SimpleNamespace(auth_context=lambda: {"x509_common_name": [b"site_1"]})  # its client certificate
    aggregator.refuse_upload("site_1", 2 * MiB, over_tls)
    assert aggregator.quit_job_sent_to == ["site_1"] and not aggregator.all_quit_jobs_sent()  # site_0 is not told yet
    aggregator.stop_notice("site_0")  # its next call
    with pytest.raises(SystemExit) as ended:
        aggregator.all_quit_jobs_sent()
    assert ended.value.code == FAILURE_EXIT_CODE and slept == [STOP_GRACE_S]  # the reason served a moment longer
