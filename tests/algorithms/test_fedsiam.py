"""FedSiam-DA: the local objective's gradient paths, μ = 0 ≡ FedAvg's local training, the local
model kept across rounds, uploads, and the dual-aggregation log (ξ, fall-back)."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import ServerContext, get_algorithm, validate_uploads
from fedcontrast.algorithms.fedsiam import LOCAL_MODEL, PREDICTOR_PREFIX, siamese_objective
from fedcontrast.losses.siamese import negative_cosine
from fedcontrast.models import PredictionHead


def _received(algorithm, site):
    server = ServerContext(model=site.model, round_num=0, seed=3, device=torch.device("cpu"), num_classes=10)
    return algorithm.initial_downlink(server).global_tensors


def test_objective_gradients_follow_the_stop_gradient_wiring(make_site):
    site = make_site()
    torch.manual_seed(1)
    local, glob = copy.deepcopy(site.model), copy.deepcopy(site.model)
    with torch.no_grad():  # make the two copies differ
        for p in glob.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lh, gh = PredictionHead(32, 8), PredictionHead(32, 8)
    x, y = site.data.x[:16], site.data.y[:16]
    z_prev = torch.randn(16, 32)
    mu = 0.7
    loss, *_ = siamese_objective(local, lh, glob, gh, x, y, z_prev, mu)
    modules = [local, lh, glob, gh]
    grads = torch.autograd.grad(loss, [p for m in modules for p in m.parameters()], allow_unused=True)

    # Reference, built independently: the global copy only sees ½ μ D(h_f(z_f), sg(z_k));
    # the local model sees CE + μ (L_hist + ½ D(h_k(z_k), sg(z_f))).
    z_k, logits = local(x)
    z_f = glob.represent(x)
    local_loss = (F.cross_entropy(logits, y) + mu * F.cosine_similarity(z_prev, z_k, dim=1).mean()
                  + mu * 0.5 * negative_cosine(lh(z_k), z_f.detach()))
    global_loss = mu * 0.5 * negative_cosine(gh(z_f), z_k.detach())
    ref_local = torch.autograd.grad(local_loss, [p for m in (local, lh) for p in m.parameters()])
    ref_global = torch.autograd.grad(global_loss, [p for m in (glob, gh) for p in m.parameters()], allow_unused=True)
    n_local = len(ref_local)
    for got, ref in zip(grads[:n_local], ref_local):
        torch.testing.assert_close(got, ref)
    for got, ref in zip(grads[n_local:], ref_global):
        if ref is None:  # the global copy's classifier gets no gradient
            assert got is None or got.abs().sum() == 0
        else:
            torch.testing.assert_close(got, ref)


def test_mu_zero_is_fedavg_local_training(make_site):
    fedavg, siam = get_algorithm("fedavg")(), get_algorithm("fedsiam_da").from_settings({"mu": 0.0})
    site_a, site_b = make_site(seed=5), make_site(seed=5)
    received = _received(siam, site_b)
    expected = fedavg.task_train(site_a, received).uploads
    got = siam.task_train(site_b, received).uploads
    assert set(expected) < set(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_uploads_declared_and_local_model_kept_for_the_next_round(make_site):
    siam = get_algorithm("fedsiam_da").from_settings({"local_start": "previous"})
    site = make_site(seed=1)
    received = _received(siam, site)
    first = siam.task_train(site, received)
    validate_uploads("site_0", first.uploads, siam.upload_specs(site.model, 10))
    assert any(k.startswith(PREDICTOR_PREFIX) for k in first.uploads)
    assert set(first.metrics) >= {"loss", "ce", "stop", "hist", "accuracy"}
    kept = site.state[LOCAL_MODEL]
    assert all(torch.equal(kept[k], v) for k, v in first.uploads.items())

    # Round 2 with the same downlink and seed: "previous" continues from the kept model, so the
    # result differs; "global" restarts from the downlink every round, so it repeats itself.
    second = siam.task_train(site, received)
    assert not torch.equal(second.uploads["model.classifier.weight"], first.uploads["model.classifier.weight"])
    fresh = get_algorithm("fedsiam_da").from_settings({"local_start": "global"})
    site_g = make_site(seed=1)
    a = fresh.task_train(site_g, received).uploads
    b = fresh.task_train(site_g, received).uploads
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_initial_downlink_is_reproducible_and_carries_the_predictor(make_site):
    siam = get_algorithm("fedsiam_da")()
    site = make_site()
    a, b = _received(siam, site), _received(siam, site)
    heads = [k for k in a if k.startswith(PREDICTOR_PREFIX)]
    assert heads and all(torch.equal(a[k], b[k]) for k in a)


def test_aggregate_logs_xi_and_falls_back_when_no_cosine_is_positive(caplog):
    siam = get_algorithm("fedsiam_da")()
    server = ServerContext(model=None, round_num=4, seed=0, device=torch.device("cpu"), num_classes=2)
    uploads = {"a": {"model.w": torch.tensor([1.0, 0.0])}, "b": {"model.w": torch.tensor([1.0, 1.0])}}
    with caplog.at_level(logging.INFO, logger="fedcontrast.algorithms.fedsiam"):
        down = siam.aggregate(uploads, {"a": 1.0, "b": 1.0}, server)
    assert down.metrics["dual_fallback"] == 0.0
    assert down.metrics["xi_a"] + down.metrics["xi_b"] == pytest.approx(1.0)
    assert "ξ" in caplog.text and "round 4" in caplog.text
    # Two opposite models: the first-pass average is 0, every cosine is 0 → fall back, logged.
    opposite = {"a": {"model.w": torch.tensor([1.0, -1.0])}, "b": {"model.w": torch.tensor([-1.0, 1.0])}}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedcontrast.algorithms.fedsiam"):
        down = siam.aggregate(opposite, {"a": 1.0, "b": 1.0}, server)
    assert down.metrics["dual_fallback"] == 1.0
    assert torch.equal(down.global_tensors["model.w"], torch.zeros(2))
    assert "fell back to the first pass" in caplog.text


@pytest.mark.parametrize("bad", [{"mu": -1}, {"first_pass": "median"}, {"local_start": "random"},
                                 {"predictor_hidden": 0}])
def test_bad_settings_are_one_sentence_config_errors(bad):
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match="fedsiam_da"):
        get_algorithm("fedsiam_da").from_settings(bad)
