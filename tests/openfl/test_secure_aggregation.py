"""Secure aggregation over a real OpenFL federation (fx aggregator + fx collaborators, mutual TLS, on
localhost): the aggregator's relay routes the protocol's messages over OpenFL's own calls and unmasks
only the sum; the result is the simulator's secure run bit for bit; a site that never answers is
dropped at the round's deadline when min_sites allows, and named."""

import torch

from fedcontrast.deploy.workspace import read_workspace_config
from fedcontrast.openfl.launch import export_results, run_federation

from .conftest import FEDERATION_TIMEOUT, small_config
from .test_federation import assert_same_weights, simulator_final_weights


def test_secure_federation_equals_the_simulators_secure_run_and_the_plain_mean(make_workspace, tmp_path):
    config = small_config(algorithm="fedavg", secure_aggregation={"bits": 64})
    ws = make_workspace(config)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT)
    assert [r["round"] for r in records] == [1, 2]
    export_results(ws, tmp_path / "out")
    exported = torch.load(tmp_path / "out" / "final_model.pt", weights_only=True)
    secure, _ = simulator_final_weights(read_workspace_config(ws))
    assert_same_weights(exported, secure)  # the same masked sums, decoded alike: identical
    plain, _ = simulator_final_weights(read_workspace_config(ws).replace(secure_aggregation=None))
    for key, value in plain.items():  # and the plain weighted mean within float32 rounding
        assert torch.allclose(exported[key].double(), value.double(), atol=1e-5, rtol=1e-5), key
    log = (ws / "logs" / "aggregator.log").read_text()
    assert "aggregated the secure sum of site_0, site_1" in log
    for site in ("site_0", "site_1"):
        assert "took part in the secure sum" in (ws / "logs" / f"{site}.log").read_text()


def test_a_site_that_never_answers_is_dropped_from_the_secure_sum_and_named(make_workspace):
    config = small_config(algorithm="fedavg", clients=3, rounds=1, secure_aggregation={"threshold": 2})
    ws = make_workspace(config, round_timeout=20, min_sites=2)
    records = run_federation(ws, timeout=FEDERATION_TIMEOUT, collaborators=["site_0", "site_1"])
    assert [r["round"] for r in records] == [1]
    log = (ws / "logs" / "aggregator.log").read_text()
    assert "no advert message from site_2 within 20 s; the secure sum goes on without them" in log
    assert "aggregated the secure sum of site_0, site_1" in log
