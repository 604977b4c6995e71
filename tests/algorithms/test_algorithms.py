"""The built-in plugins: what they upload, what they keep, and that their losses are the paper's."""

import copy
import math

import pytest
import torch

from fedcontrast.algorithms import InvalidUploadError, get_algorithm, validate_uploads, weight_tensors
from fedcontrast.algorithms.moon import PREVIOUS_WEIGHTS
from fedcontrast.config import TrainingConfig
from fedcontrast.errors import ConfigError


def initial_weights(site):
    return weight_tensors(site.model)


def test_fedavg_uploads_exactly_its_declaration(make_site):
    site = make_site()
    alg = get_algorithm("fedavg")()
    result = alg.run_task("train", site, initial_weights(site))
    validate_uploads(site.name, result.uploads, alg.upload_specs(site.model, 10))
    assert result.weight == len(site.data)
    assert set(result.metrics) >= {"loss", "accuracy"}


def test_moon_first_round_contrastive_term_is_log_two(make_site):
    # Round 0: R_prev is the global model, so sim(z, z_glob) = sim(z, z_prev) at every step.
    site = make_site()
    alg = get_algorithm("moon").from_settings({"mu": 5.0})
    result = alg.run_task("train", site, initial_weights(site))
    assert result.metrics["contrastive"] == pytest.approx(math.log(2), abs=1e-5)
    assert result.metrics["loss"] == pytest.approx(result.metrics["ce"] + 5.0 * math.log(2), rel=1e-4)


def test_moon_keeps_the_uploaded_model_as_previous(make_site):
    site = make_site()
    alg = get_algorithm("moon")()
    result = alg.run_task("train", site, initial_weights(site))
    kept = site.state[PREVIOUS_WEIGHTS]
    assert set(kept) == set(result.uploads)
    assert all(torch.equal(kept[k], result.uploads[k]) for k in kept)
    # Second round: previous != global, so the contrastive term is no longer the constant log 2.
    site.round_num, site.seed = 1, 1
    again = alg.run_task("train", site, initial_weights(make_site()))
    assert abs(again.metrics["contrastive"] - math.log(2)) > 1e-3


@pytest.mark.parametrize("with_previous", [False, True])
def test_moon_cached_references_equal_per_step_references(make_site, with_previous):
    state = {}
    if with_previous:
        prev_site = make_site()
        get_algorithm("fedavg")().run_task("train", prev_site, initial_weights(prev_site))
        state = {PREVIOUS_WEIGHTS: weight_tensors(prev_site.model)}
    results = {}
    for cache in (True, False):  # the cache is exact without augmentation
        site = make_site(state=copy.deepcopy(state), training=TrainingConfig(local_epochs=2, batch_size=32,
                                                                             augmentation="none"))
        alg = get_algorithm("moon").from_settings({"cache_reference_representations": cache})
        results[cache] = alg.run_task("train", site, initial_weights(site))
    assert results[True].metrics["contrastive"] == pytest.approx(results[False].metrics["contrastive"], rel=1e-4)
    for k, v in results[True].uploads.items():
        assert torch.allclose(v, results[False].uploads[k], atol=1e-5), k


def test_moon_cache_rejected_with_augmentation(make_site):
    alg = get_algorithm("moon").from_settings({"cache_reference_representations": True})
    with pytest.raises(ConfigError, match="augmentation"):
        alg.validate_training(TrainingConfig(augmentation="crop"))
    auto = get_algorithm("moon")()
    assert auto.uses_cache(TrainingConfig(augmentation="none")) and not auto.uses_cache(TrainingConfig())


def test_fedprox_large_mu_stays_near_global(make_site):
    drift = {}
    for name, settings in (("fedavg", {}), ("fedprox", {"mu": 10.0})):
        site = make_site(training=TrainingConfig(local_epochs=3, batch_size=16, lr=0.05))
        start = initial_weights(site)
        result = get_algorithm(name).from_settings(settings).run_task("train", site, start)
        drift[name] = sum((result.uploads[k] - start[k]).pow(2).sum().item() for k in start)
    assert drift["fedprox"] < 0.5 * drift["fedavg"]


@pytest.mark.parametrize("name,settings,match", [
    ("moon", {"mu": -1}, "mu"), ("moon", {"temperature": 0}, "temperature"),
    ("moon", {"cache_reference_representations": "yes"}, "cache"), ("fedprox", {"mu": float("nan")}, "mu"),
    ("moon", {"tau": 0.5}, "no setting"), ("fedavg", {"mu": 1}, "no setting"),
])
def test_invalid_hyperparameters_raise_config_error(name, settings, match):
    with pytest.raises(ConfigError, match=match):
        get_algorithm(name).from_settings(settings)


def test_validate_uploads_rejects_and_names_the_sender(make_site):
    site = make_site()
    alg = get_algorithm("fedavg")()
    specs = alg.upload_specs(site.model, 10)
    good = weight_tensors(site.model)
    name = next(iter(good))
    bad = dict(good, **{name: torch.full_like(good[name], float("nan"))})
    with pytest.raises(InvalidUploadError, match="site 'x'.*NaN"):
        validate_uploads("x", bad, specs)
    wrong = dict(good, **{name: torch.zeros(3)})
    with pytest.raises(InvalidUploadError, match="site 'y'.*shape"):
        validate_uploads("y", wrong, specs)
    with pytest.raises(InvalidUploadError, match="undeclared"):
        validate_uploads("z", dict(good, extra=torch.zeros(1)), specs)
    with pytest.raises(InvalidUploadError, match="did not upload"):
        validate_uploads("z", {k: v for k, v in good.items() if k != name}, specs)


def test_declared_bytes_match_the_weights(make_site):
    site = make_site()
    specs = get_algorithm("moon")().upload_specs(site.model, 10)
    assert sum(s.nbytes for s in specs) == sum(t.numel() * 4 for t in weight_tensors(site.model).values())


def test_a_reused_frozen_copy_equals_a_fresh_deep_copy_and_is_the_callers_own_per_thread():
    """MOON's frozen R_global / R_prev (and FedSiam-DA's snapshot) reuse one copy per slot and
    architecture: after each call it holds exactly the model's weights and buffers (BatchNorm's running
    statistics included), in eval mode with gradients off, as a deep copy would; it does not follow
    later changes to the model; another slot or another thread gets another copy."""
    import threading

    from fedcontrast.algorithms.moon import frozen_copy
    from fedcontrast.models import build_model

    torch.manual_seed(0)
    model = build_model("simple_cnn", in_channels=1, image_size=16, num_classes=4, projection_dim=8)
    x = torch.randn(5, 1, 16, 16)
    model.train()(x)  # moves BatchNorm's running statistics away from their start, if the model has any
    first = frozen_copy(model, "test slot")
    fresh = frozen_copy(model)
    for (name, a), b in zip(first.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert not first.training and not any(p.requires_grad for p in first.parameters())
    assert torch.equal(first.represent(x), fresh.represent(x))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(next(first.parameters()), next(model.parameters()))  # a copy, not a view
    again = frozen_copy(model, "test slot")
    assert again is first and all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                                     model.state_dict().values()))
    assert frozen_copy(model, "other slot") is not first
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(frozen_copy(model, "test slot")))
    thread.start()
    thread.join()
    assert elsewhere[0] is not first
