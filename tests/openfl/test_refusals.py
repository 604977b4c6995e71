"""Bad parties and bad input in a real federation: each is refused with one clear sentence and a
non-zero exit, and nothing already written is damaged."""

import re
import shutil
import socket
import time

import grpc
import pytest
import torch
import yaml

from fedcontrast.openfl.launch import FederationFailed, read_rounds, run_federation, start, stop_all

from .conftest import FEDERATION_TIMEOUT, run_collaborator, small_config, workspace_factory


def wait_for_port(port, proc, deadline=90):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert proc.poll() is None, "the aggregator died while starting"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError("the aggregator did not start listening")


@pytest.fixture(scope="module")
def aggregator(tmp_path_factory, pki):
    """One running aggregator (mutual TLS) that the refused parties below try to join."""
    make = workspace_factory(tmp_path_factory.mktemp("refusals"), pki)
    ws = make(small_config(algorithm="fedavg", rounds=1), max_retries=2)
    with open(ws / "plan" / "data.yaml", "a") as f:
        f.write("intruder,shard:0\n")  # it has data and a valid certificate, but is not in cols.yaml
    proc = start(ws, ["aggregator", "start"], "aggregator.log")
    port = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())["network"]["settings"]["agg_port"]
    wait_for_port(port, proc)
    yield {"ws": ws, "proc": proc, "port": port, "pki": pki}
    stop_all({"aggregator": proc})


def copy_workspace(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("logs", "local_state"))
    (dst / "logs").mkdir()
    (dst / "local_state").mkdir()
    return dst


def test_collaborator_not_in_cols_yaml_is_refused(aggregator):
    code, reason = run_collaborator(aggregator["ws"], "intruder")
    assert code != 0
    assert "refused this collaborator" in reason and "cols.yaml" in reason


def test_certificate_signed_by_another_ca_is_refused(aggregator, tmp_path):
    ws = copy_workspace(aggregator["ws"], tmp_path / "other_ca")
    for suffix in ("crt", "key"):
        shutil.copyfile(aggregator["pki"]["other_ca_client"] / f"col_site_1.{suffix}",
                        ws / "cert" / "client" / f"col_site_1.{suffix}")
    code, reason = run_collaborator(ws, "site_1")
    assert code != 0  # named before connecting (test_tls_diagnostics), not retried
    assert "col_site_1.crt (CN=site_1) is issued by" in reason and "not by the federation's CA in" in reason
    assert "retries" not in reason


def test_missing_client_certificate_is_named(aggregator, tmp_path):
    ws = copy_workspace(aggregator["ws"], tmp_path / "no_cert")
    for suffix in ("crt", "key"):
        (ws / "cert" / "client" / f"col_site_1.{suffix}").unlink()
    code, reason = run_collaborator(ws, "site_1")
    assert code != 0
    # said before fx starts (the guard), not a FileNotFoundError traceback after its start-up
    assert "col_site_1.key" in reason and "missing, and the plan uses TLS" in reason and "site import-cert" in reason


def aggregator_says(aggregator, words, timeout=20.0):
    """The aggregator's log once it contains ``words`` (its sentences are logged asynchronously)."""
    log = aggregator["ws"] / "logs" / "aggregator.log"
    end = time.monotonic() + timeout
    while True:  # rich wraps its lines and puts the source file:line at the end of the first
        text = " ".join(re.sub(r"\s\S+\.py:\d+\s", " ", log.read_text(errors="replace")).split())
        if " ".join(words.split()) in text or time.monotonic() > end:
            return text


def get_tasks(channel):
    from openfl.protocols import aggregator_pb2, aggregator_pb2_grpc

    with pytest.raises(grpc.RpcError) as info:
        aggregator_pb2_grpc.AggregatorStub(channel).GetTasks(aggregator_pb2.GetTasksRequest(), timeout=15)
    channel.close()
    return info.value.code()


def test_tls_client_without_certificate_is_refused_by_the_aggregator(aggregator):
    root = (aggregator["ws"] / "cert" / "cert_chain.crt").read_bytes()
    channel = grpc.secure_channel(f"127.0.0.1:{aggregator['port']}",
                                  grpc.ssl_channel_credentials(root_certificates=root),
                                  options=[("grpc.ssl_target_name_override", "localhost")])
    assert get_tasks(channel) == grpc.StatusCode.UNAVAILABLE
    # and the aggregator says so, in one sentence naming where it came from
    log = aggregator_says(aggregator, "it presented no certificate (its plan or client does not use mutual TLS")
    assert re.search(r"refused a TLS connection from 127\.0\.0\.1 (\(localhost\) )?\(port \d+\): it presented no "
                     r"certificate", log), log[-2000:]


def test_a_certificate_from_another_ca_is_named_by_the_aggregator_too(aggregator):
    """A client that does not check its own certificate first (not fedcontrast's collaborator, which
    stops before connecting) reaches the handshake: the aggregator names the cause, not gRPC's code."""
    other = aggregator["pki"]["other_ca_client"]
    credentials = grpc.ssl_channel_credentials((aggregator["ws"] / "cert" / "cert_chain.crt").read_bytes(),
                                               (other / "col_site_1.key").read_bytes(),
                                               (other / "col_site_1.crt").read_bytes())
    assert get_tasks(grpc.secure_channel(f"localhost:{aggregator['port']}", credentials)) == grpc.StatusCode.UNAVAILABLE
    # Both CAs carry the same name (the fixture names the other one as main's): gRPC's TLS library
    # reports a bad signature (BLOCK_TYPE_IS_NOT_01 for RSA, DATA_TOO_LARGE_FOR_MODULUS for about 7 % of the CA
    # pairs a session draws: both are named alike, see tls_log.FORGED_REASONS), not an unknown issuer.
    words = "but that CA's signature does not verify: another CA of the same name signed it"
    log = aggregator_says(aggregator, words)
    assert "the certificate it presented names the federation's CA (cert/cert_chain.crt) as its issuer, " + words in log


def test_a_plain_text_client_is_named_by_the_aggregator(aggregator):
    assert get_tasks(grpc.insecure_channel(f"localhost:{aggregator['port']}")) == grpc.StatusCode.UNAVAILABLE
    assert "it does not speak TLS (its plan has network.settings.use_tls: false" in aggregator_says(
        aggregator, "it does not speak TLS")


def test_the_aggregator_log_holds_no_raw_handshake_errors(aggregator):
    # after the refusals above (file order): gRPC's own lines were replaced by the sentences
    log = aggregator_says(aggregator, "it does not speak TLS")
    assert "Handshake failed with fatal error" not in log and "handshake_manager" not in log
    assert "refused a TLS connection" in log


def test_plan_that_differs_from_the_aggregators_is_refused(aggregator, tmp_path):
    ws = copy_workspace(aggregator["ws"], tmp_path / "other_plan")
    plan = yaml.safe_load((ws / "plan" / "plan.yaml").read_text())
    plan["collaborator"]["settings"]["poll_interval"] = 0.06  # any edit changes the plan's hash
    (ws / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan))
    code, reason = run_collaborator(ws, "site_0")
    assert code != 0
    assert "plan differs from the aggregator's" in reason


def test_a_certificate_for_the_name_that_is_not_the_one_signed_for_it_is_refused(aggregator, tmp_path):
    """A certificate from the federation's CA with CN=site_0 (the impostor of issue 20 held one), but not
    the one the operator signed for site_0 and keeps in cert/client: `fx aggregator start` refuses the
    call, naming both, and the collaborator stops at once with that sentence."""
    from fedcontrast.openfl.pki import issue_for_key, write_certificate

    ws = copy_workspace(aggregator["ws"], tmp_path / "not_on_file")
    crt = ws / "cert" / "client" / "col_site_0.crt"
    write_certificate(crt, issue_for_key(crt.with_suffix(".key"), "site_0", ca_dir=ws / "cert" / "ca")[0])
    code, reason = run_collaborator(ws, "site_0")
    assert code != 0 and "retries" not in reason
    assert "refused site_0: the certificate it presented (CN=site_0, serial" in reason
    words = "is not the certificate this CA signed for site_0"
    assert words in reason and words in aggregator_says(aggregator, words)


def test_a_second_aggregator_on_a_port_in_use_is_refused_naming_the_port(aggregator, tmp_path):
    """gRPC binds with SO_REUSEPORT: without the check a second `fx aggregator start` would listen beside
    the first, and sites would reach either one."""
    from fedcontrast.errors import ConfigError
    from fedcontrast.openfl.launch import failure_reason
    from fedcontrast.openfl.startup_checks import check_port_free

    with pytest.raises(ConfigError, match=f"port {aggregator['port']} .* is taken on this machine"):
        check_port_free(aggregator["port"])
    ws = copy_workspace(aggregator["ws"], tmp_path / "second")
    proc = start(ws, ["aggregator", "start"], "aggregator.log")
    try:
        code = proc.wait(timeout=120)
    finally:
        stop_all({"second": proc})
    assert code != 0
    assert failure_reason(ws / "logs" / "aggregator.log").startswith(
        f"port {aggregator['port']} (the plan's network.settings.agg_port) is taken on this machine")
    with socket.socket() as s:  # a free port passes
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_port_free(free)


def test_an_oversized_upload_from_a_certificate_not_admitted_does_not_stop_the_federation(aggregator):
    """Refused by size, named, but only an admitted site's oversized upload stops the federation: a
    certificate of the CA that is not in cols.yaml (or revoked) cannot end it for the others."""
    from openfl.protocols import aggregator_pb2, aggregator_pb2_grpc, base_pb2, utils

    client = aggregator["ws"] / "cert" / "client"
    credentials = grpc.ssl_channel_credentials((aggregator["ws"] / "cert" / "cert_chain.crt").read_bytes(),
                                               (client / "col_intruder.key").read_bytes(),
                                               (client / "col_intruder.crt").read_bytes())
    header = aggregator_pb2.MessageHeader(sender="intruder")
    results = aggregator_pb2.TaskResults(header=header, task_name="train", tensors=[
        base_pb2.NamedTensor(name="fedcontrast.global", data_bytes=b"\1" * (3 << 20))])
    with grpc.secure_channel(f"localhost:{aggregator['port']}", credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:
            aggregator_pb2_grpc.AggregatorStub(channel).SendLocalTaskResults(utils.proto_to_datastream(results),
                                                                               timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith(f"collaborator intruder's upload of more than {2 << 20} bytes exceeds the ")
    assert "(not an admitted site of this federation, which goes on)" in aggregator_says(aggregator, "which goes on")
    assert aggregator["proc"].poll() is None


def test_refusals_left_the_aggregator_unharmed(aggregator):
    # Runs after the refusals above (file order): the aggregator is still up and still waiting for round 0.
    assert aggregator["proc"].poll() is None
    assert read_rounds(aggregator["ws"]) == []


def test_unreachable_aggregator_gives_up_with_a_clear_message(make_workspace):
    ws = make_workspace(small_config(), max_retries=2)  # no aggregator is started
    code, reason = run_collaborator(ws, "site_0")
    assert code != 0
    # nothing listens at its port: said as such, not blamed on TLS (a late site after the end reads the same)
    assert "is not listening (it may have finished or not started yet)" in reason and "TLS" not in reason
    assert "gave up after 2 retries" in reason


def test_bad_upload_is_rejected_with_the_sender_named(make_workspace, test_plugins):
    ws = make_workspace(small_config(algorithm="nan_upload", rounds=3))
    with pytest.raises(FederationFailed) as info:
        run_federation(ws, timeout=FEDERATION_TIMEOUT)
    message = str(info.value)
    assert "the aggregator exited with code 3" in message
    assert "site 'site_1'" in message and "NaN" in message
    # Round 2 was aggregated from site_0 alone (not poisoned), exported, and then the federation stopped.
    assert [r["round"] for r in read_rounds(ws)] == [1, 2]
    final = torch.load(ws / "save" / "final_model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())


def test_finite_poisoned_upload_is_rejected_and_the_honest_site_not_blamed(make_workspace, test_plugins):
    # Weights × 1e30 are finite: before the plan's bounds they were averaged in, and the next round every
    # site's upload was NaN, so the aggregator rejected the honest site_0 by name.
    ws = make_workspace(small_config(algorithm="poison_scale", rounds=3))
    with pytest.raises(FederationFailed) as info:
        run_federation(ws, timeout=FEDERATION_TIMEOUT)
    message = str(info.value)
    assert "site 'site_1' uploaded a model update of norm" in message and "max_update_ratio 10 " in message
    assert "site_0" not in message
    records = read_rounds(ws)
    assert [r["round"] for r in records] == [1, 2] and list(records[-1]["rejected"]) == ["site_1"]
    final = torch.load(ws / "save" / "final_model.pt", weights_only=True)
    assert max(float(v.abs().max()) for v in final.values() if v.is_floating_point()) < 1e3


def test_inflated_sample_count_is_excluded_and_the_federation_goes_on(make_workspace, test_plugins):
    robustness = {"max_samples": 2000, "on_rejected": "exclude"}
    ws = make_workspace(small_config(algorithm="claims_huge", rounds=3, robustness=robustness))
    run_federation(ws, timeout=FEDERATION_TIMEOUT)
    records = read_rounds(ws)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert [list(r.get("rejected", {})) for r in records] == [[], ["site_1"], []]
    assert ("site 'site_1' claimed 1e+09 samples, more than the plan's max_samples 2000"
            in records[1]["rejected"]["site_1"])


def test_exception_in_aggregator_task_stops_the_federation(make_workspace, test_plugins):
    ws = make_workspace(small_config(algorithm="broken_aggregator"))
    with pytest.raises(FederationFailed) as info:
        run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert "deliberate failure in the aggregator task" in str(info.value)
    assert "round 1 could not be aggregated" in str(info.value)
    assert str(info.value).startswith("the aggregator exited with code ")  # it stopped itself, did not hang
    for site in ("site_0", "site_1"):  # every site is told why, in the aggregator's words (issue 21)
        assert ("fedcontrast collaborator: error: the aggregator stopped the federation: round 1 could not be "
                "aggregated: RuntimeError: deliberate failure in the aggregator task"
                ) in (ws / "logs" / f"{site}.log").read_text()


def test_a_failing_task_ends_the_federation_at_once_naming_the_site(make_workspace, test_plugins):
    ws = make_workspace(small_config(algorithm="failing_task", rounds=3))
    with pytest.raises(FederationFailed) as info:
        run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert "collaborator site_1 reported that its task 'train' failed in round 2" in str(info.value)
    # told at once: the aggregator stopped on the site's report, not on a round timeout
    assert str(info.value).startswith("the aggregator exited with code ")
    assert "did not complete within" not in (ws / "logs" / "aggregator.log").read_text()
    log = (ws / "logs" / "site_1.log").read_text()
    assert ("fedcontrast collaborator: error: task 'train' of round 2 failed: RuntimeError: deliberate failure "
            "in site_1's task (traceback in logs/site_1_error.txt)") in log
    assert "Traceback" not in log and "Traceback" in (ws / "logs" / "site_1_error.txt").read_text()
    assert [r["round"] for r in read_rounds(ws)] == [1]  # what finished before is kept
    assert ("fedcontrast collaborator: error: the aggregator stopped the federation: collaborator site_1 reported that "
            "its task 'train' failed in round 2") in (ws / "logs" / "site_0.log").read_text()  # the other site: why
