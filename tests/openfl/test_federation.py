"""End to end: fx aggregator + fx collaborators as separate OS processes over mutual TLS on localhost.

The exported final model is compared with the simulator's for the same config and seed: the same
plugin code, shards, seeds and aggregation order make them identical bit for bit on the CPU.
"""

import json
import math
import os
import signal
import time

import pytest
import torch

from fedcontrast.algorithms.base import WEIGHT_PREFIX
from fedcontrast.evaluation import evaluate_classifier
from fedcontrast.models import build_model
from fedcontrast.openfl.fx import read_workspace_config
from fedcontrast.openfl.launch import (
    FederationFailed,
    export_results,
    read_rounds,
    run_federation,
    start,
    stop_all,
    threads_per_collaborator,
)
from fedcontrast.sim import Federation

from .conftest import FEDERATION_TIMEOUT, small_config


def simulate(config):
    """The same federation in the simulator, at the collaborators' thread count (the count changes
    the last bits of float sums)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_collaborator(config.clients))
    try:
        federation = Federation(config)
        for r in range(config.rounds):
            federation.last_rows = federation.run_round(r + 1)
    finally:
        torch.set_num_threads(previous)
    return federation


def simulator_final_weights(config):
    federation = simulate(config)
    weights = {k[len(WEIGHT_PREFIX):]: v for k, v in federation.downlink.global_tensors.items()
               if k.startswith(WEIGHT_PREFIX)}  # the exported model; FedSSC's class representations aside
    return weights, federation


def assert_same_weights(exported, simulated):
    for key, value in simulated.items():
        assert torch.equal(exported[key], value), f"{key} differs by {(exported[key] - value).abs().max()}"


@pytest.mark.parametrize("algorithm", ["moon", "fedssc", "fedsiam_da"])  # FedAvg's path: MOON's, and every test below
def test_federation_equals_simulator_bit_for_bit(make_workspace, tmp_path, algorithm):
    config = small_config(algorithm=algorithm)
    ws = make_workspace(config)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    summary = export_results(ws, tmp_path / "out")
    exported = torch.load(tmp_path / "out" / "final_model.pt", weights_only=True)
    simulated, federation = simulator_final_weights(read_workspace_config(ws))
    assert_same_weights(exported, simulated)
    # ...so the exported model's accuracy is the simulator's.
    model = build_model("simple_cnn", in_channels=1, image_size=32, num_classes=10)
    model.load_state_dict(exported)
    sim_accuracy = federation.algorithm.evaluate(federation.downlink, federation.server, federation.test)["accuracy"]
    assert evaluate_classifier(model, federation.test, torch.device("cpu"))["accuracy"] == sim_accuracy
    assert summary["final_accuracy"] == sim_accuracy
    assert (tmp_path / "out" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    if federation.algorithm.evaluates_local_models:  # FedSiam-DA: the sites' local models, on the aggregator
        sim_row = json.loads(next(r for r in federation.last_rows if r["site"] == "global")["extra"])
        for key in ("local_balanced_accuracy", "local_balanced_accuracy_std"):  # metrics.csv keeps 6 decimals
            assert records[-1][key] == pytest.approx(sim_row[key], abs=1e-6)


def _wait_for_rounds(ws, n, deadline):
    while len(read_rounds(ws)) < n:
        assert time.monotonic() < deadline, "federation made no progress"
        time.sleep(0.2)


def test_killed_aggregator_and_collaborator_resume_without_loss(make_workspace):
    # MOON needs each site's previous model: a collaborator that lost it would train differently, so
    # bit-for-bit equality with the simulator also proves the per-site state survived the restart.
    config = small_config(rounds=3)
    ws = make_workspace(config, max_retries=120)
    deadline = time.monotonic() + FEDERATION_TIMEOUT
    threads = threads_per_collaborator(2)
    procs = {"aggregator": start(ws, ["aggregator", "start"], "aggregator.log", threads)}
    for name in ("site_0", "site_1"):
        procs[name] = start(ws, ["collaborator", "start", "-n", name], f"{name}.log", threads)
    try:
        _wait_for_rounds(ws, 1, deadline)
        for party in ("aggregator", "site_1"):  # kill -9: no chance to clean up
            os.killpg(procs[party].pid, signal.SIGKILL)
            procs[party].wait()
        finished = len(read_rounds(ws))
        procs["aggregator"] = start(ws, ["aggregator", "start"], "aggregator.log", threads)
        procs["site_1"] = start(ws, ["collaborator", "start", "-n", "site_1"], "site_1.log", threads)
        for party, proc in procs.items():
            assert proc.wait(timeout=max(1, deadline - time.monotonic())) == 0, party
    finally:
        stop_all(procs)
    rounds = [r["round"] for r in read_rounds(ws)]
    assert rounds[:finished] == list(range(1, finished + 1)) and max(rounds) == 3  # no finished round lost
    exported = torch.load(ws / "save" / "final_model.pt", weights_only=True)
    simulated, _ = simulator_final_weights(read_workspace_config(ws))
    assert_same_weights(exported, simulated)


@pytest.mark.parametrize("algorithm, said, kept", [
    ("disk_full_once", ["No space left on device", "round 2 could not be aggregated"], [1]),
    ("disk_full_at_checkpoint", ["No space left on device", "round 1 could not be aggregated"], [1])])
def test_aggregator_whose_disk_filled_redoes_the_round_on_resume(make_workspace, test_plugins, algorithm, said, kept):
    # The round's files are written before OpenFL commits the round: a full disk leaves it uncommitted,
    # and the restarted aggregator redoes its end from the saved uploads (no round lost, no stale model).
    # disk_full_at_checkpoint: the disk fills after round 1's model was exported, before any site evaluated
    # it; the record the stopping aggregator kept is incomplete, and the resumed round writes it whole
    # (issue 21.6). (A kill -9 at that point was already safe: the pending file covers it.)
    ws = make_workspace(small_config(algorithm=algorithm, rounds=2))
    with pytest.raises(FederationFailed) as info:
        run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert all(part in str(info.value) for part in said), str(info.value)
    assert [r["round"] for r in read_rounds(ws)] == kept
    run_federation(ws, timeout=FEDERATION_TIMEOUT)  # what `fedcontrast federation --resume` runs
    records = read_rounds(ws)
    assert [r["round"] for r in records] == [1, 2] and all(r["sites"] for r in records)
    assert all("training" in v for v in records[1]["sites"].values())
    for record in records:  # written whole: every site's evaluation of the round's model, across the failure
        assert sorted(record["sites"]) == ["site_0", "site_1"] and not record.get("withheld"), record
        assert not record.get("incomplete") and not record.get("not_evaluated"), record
        assert all(0.0 <= v.get("evaluation", {}).get("accuracy", -1) <= 1.0 for v in record["sites"].values()), record
    exported = torch.load(ws / "save" / "final_model.pt", weights_only=True)
    simulated, _ = simulator_final_weights(read_workspace_config(ws))
    assert_same_weights(exported, simulated)


def test_per_site_downlinks_reach_only_their_site(make_workspace, test_plugins):
    config = small_config(algorithm="personal_echo", rounds=3)
    ws = make_workspace(config)
    run_federation(ws, timeout=FEDERATION_TIMEOUT)
    federation = Federation(read_workspace_config(ws))
    for r in range(config.rounds):
        federation.run_round(r + 1)
    for i in (0, 1):
        seen = torch.load(ws / "local_state" / "sites" / f"site_{i}.pt", weights_only=True)["echo.seen"]
        assert seen == [0.0, 1.0 + 100 * i, 2.0 + 100 * i]  # its own number each round, no other site's
        assert federation.sites[i].state["echo.seen"] == seen  # what the simulator delivers


def test_fedpcl_federation_two_tasks_per_round_matches_simulator(make_workspace, tmp_path):
    # Two collaborator tasks per round (train, then prototypes), prototypes only on the wire.
    config = small_config(algorithm="fedpcl", public_fraction=0.1,
                          hyperparameters={"fedpcl": {"projection_hidden": [32, 64], "pretrain_epochs": 3}})
    ws = make_workspace(config)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    summary = export_results(ws, tmp_path / "out")
    assert summary["final_model"] is None  # FedPCL has no global model
    exported = torch.load(tmp_path / "out" / "final_downlink.pt", weights_only=True)
    federation = simulate(read_workspace_config(ws))
    for name, value in federation.downlink.global_tensors.items():
        assert torch.allclose(exported[name], value, atol=1e-6), name


def test_flesd_federation_similarities_up_distilled_weights_down(make_workspace, tmp_path):
    # Two collaborator tasks (SimCLR, similarity inference); int8 representations on the wire (a
    # quarter of float32's bytes, carried bit for bit); distillation on the aggregator from the
    # model OpenFL stored for the round.
    config = small_config(algorithm="flesd", public_fraction=0.1,
                          hyperparameters={"flesd": {"quantize": "int8", "distill_epochs": 2, "probe_epochs": 20}})
    ws = make_workspace(config)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    assert all(0.0 < r["accuracy"] <= 1.0 and r["accuracy"] == r["probe_accuracy"] for r in records)
    export_results(ws, tmp_path / "out")
    exported = torch.load(tmp_path / "out" / "final_model.pt", weights_only=True)
    simulated, _ = simulator_final_weights(read_workspace_config(ws))
    for key, value in simulated.items():  # the aggregator distils at its own thread count
        assert torch.allclose(exported[key], value, atol=1e-5), key


def test_representation_dp_under_fx_each_site_records_the_audited_epsilon(make_workspace):
    # FedPCL with DP on its prototypes through fx: each site's accountant history is kept on the
    # site's disk, and its ε equals what the audit predicts for that site from the plan alone.
    from fedcontrast.audit.report import audit_plan, load_plan
    from fedcontrast.privacy import epsilon, history_of

    config = small_config(algorithm="fedpcl", public_fraction=0.1,
                          hyperparameters={"fedpcl": {"pretrain_epochs": 3}},
                          privacy={"representations": {"noise_multiplier": 2.0, "clip": 1.0}})
    ws = make_workspace(config)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    plan, workspace = load_plan(ws)
    report = audit_plan(plan, source=str(ws), workspace=workspace)
    for line in report.sites:
        state = torch.load(ws / "local_state" / "sites" / f"{line.name}.pt", weights_only=True)
        recorded = epsilon(history_of(state), delta=config.privacy.delta)
        assert math.isfinite(recorded) and recorded == pytest.approx(line.epsilon_total, rel=1e-6)
