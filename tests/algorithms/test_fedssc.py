"""FedSSC: the shared-representation rule, the μ_glob schedule, data minimisation, upload checks."""

import numpy as np
import pytest
import torch

from fedcontrast.algorithms import InvalidUploadError, get_algorithm, validate_uploads, weight_tensors
from fedcontrast.algorithms.fedssc import (
    CLASS_COUNTS,
    CLASS_MEANS,
    CLASS_PRESENT,
    CLASS_REPS,
    mu_glob_schedule,
    sample_class_representations,
)
from fedcontrast.config import TrainingConfig


def test_class_representations_hand_computed():
    means = {"a": torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 2.0]]),
             "b": torch.tensor([[3.0, 2.0], [0.0, 0.0], [0.0, 0.0]])}
    counts = {"a": torch.tensor([10, 0, 12]), "b": torch.tensor([20, 0, 0])}
    reps, present = sample_class_representations(means, counts, k=3, rng=np.random.default_rng(0))
    # class 0: both sent (fewer than k) → plain mean (not count-weighted); class 1: nobody; class 2: only a.
    assert torch.equal(reps, torch.tensor([[2.0, 1.0], [0.0, 0.0], [2.0, 2.0]]))
    assert torch.equal(present, torch.tensor([1.0, 0.0, 1.0]))


def test_k_random_senders_are_averaged_and_the_draw_is_seeded():
    means = {f"s{i}": torch.full((1, 1), float(i)) for i in range(6)}
    counts = {f"s{i}": torch.tensor([10]) for i in range(6)}
    draws = set()
    for seed in range(30):
        reps, _ = sample_class_representations(means, counts, k=2, rng=np.random.default_rng(seed))
        value = reps.item()
        assert value * 2 == int(value * 2) and 0.5 <= value <= 4.5  # a mean of 2 distinct senders
        draws.add(value)
        again, _ = sample_class_representations(means, counts, k=2, rng=np.random.default_rng(seed))
        assert again.item() == value  # same seed, same draw
    assert len(draws) > 3  # and different seeds draw different senders


@pytest.mark.parametrize("t,expected", [(0, 1.0), (50, 0.55), (100, 0.1), (500, 0.1)])
def test_linear_mu_glob_schedule(t, expected):
    assert mu_glob_schedule(t, start=1.0, end=0.1, warmup_rounds=100) == pytest.approx(expected)


def test_cosine_and_constant_schedules():
    assert mu_glob_schedule(50, start=1.0, end=0.0, warmup_rounds=100, schedule="cosine") == pytest.approx(0.5)
    assert mu_glob_schedule(10, start=1.0, end=0.0, warmup_rounds=100, schedule="cosine") > 0.9
    assert mu_glob_schedule(70, start=0.3, end=0.0, warmup_rounds=100, schedule="constant") == 0.3


def test_uploads_only_classes_above_threshold_with_last_epoch_means(make_site):
    # lr ≈ 0 keeps the model fixed, so the last epoch's class means are those of the initial model
    # (of the images as they are: no augmentation).
    site = make_site(training=TrainingConfig(local_epochs=1, batch_size=16, lr=1e-12, augmentation="none"))
    alg = get_algorithm("fedssc").from_settings({"min_class_samples": 10})
    received = {**weight_tensors(site.model), CLASS_REPS: torch.zeros(10, 32), CLASS_PRESENT: torch.zeros(10)}
    with torch.no_grad():
        z = site.model.represent(site.data.x)
    result = alg.run_task("train", site, received)
    validate_uploads(site.name, result.uploads, alg.upload_specs(site.model, 10))
    counts = torch.bincount(site.data.y, minlength=10)
    for c in range(10):
        if counts[c] >= 10:
            assert result.uploads[CLASS_COUNTS][c] == counts[c]
            assert torch.allclose(result.uploads[CLASS_MEANS][c], z[site.data.y == c].mean(0), atol=1e-4)
        else:  # never leaves the site
            assert result.uploads[CLASS_COUNTS][c] == 0 and not result.uploads[CLASS_MEANS][c].any()


def test_global_term_is_off_in_round_zero_and_on_later(make_site):
    alg = get_algorithm("fedssc")()
    site = make_site()
    received = {**weight_tensors(site.model), CLASS_REPS: torch.zeros(10, 32), CLASS_PRESENT: torch.zeros(10)}
    assert "global_contrastive" not in alg.run_task("train", site, received).metrics
    received[CLASS_REPS], received[CLASS_PRESENT] = torch.randn(10, 32), torch.ones(10)
    site = make_site()
    assert alg.run_task("train", site, received).metrics["global_contrastive"] > 0


@pytest.mark.parametrize("counts,means_row,weight,match", [
    ([-1] + [0] * 9, None, 100, "negative"),
    ([5] + [0] * 9, None, 100, "fewer than 10"),
    ([0] * 10, 1.0, 100, "count of 0"),
    ([60, 60] + [0] * 8, None, 100, "more than its 100"),
])
def test_inconsistent_uploads_are_rejected_naming_the_sender(counts, means_row, weight, match):
    alg = get_algorithm("fedssc")()
    means = torch.zeros(10, 4)
    if means_row is not None:
        means[0] = means_row
    with pytest.raises(InvalidUploadError, match=f"site 'x'.*{match}"):
        alg.check_upload("x", {CLASS_MEANS: means, CLASS_COUNTS: torch.tensor(counts)}, weight)


def test_under_dp_sgd_the_class_sums_take_every_sample_through_the_final_model(make_site):
    # DP-SGD's Poisson batches leave out some samples each epoch: sums over them would depend on its
    # hidden draws. Under DP-SGD every sample enters once, through the final local model.
    from fedcontrast.algorithms.moon import represent_all
    from fedcontrast.config import PrivacyConfig
    from fedcontrast.privacy import SitePrivacy
    from fedcontrast.privacy.dp_sgd import make_dp_compatible

    site = make_site(training=TrainingConfig(local_epochs=2, batch_size=16), n=96)
    site.model = make_dp_compatible(site.model)  # as every engine builds it under DP-SGD
    site.privacy = SitePrivacy(PrivacyConfig(dp_sgd={"noise_multiplier": 1.0}), site.state, round_num=0, noise_seed=1)
    alg = get_algorithm("fedssc").from_settings({"min_class_samples": 1})
    received = {**weight_tensors(site.model), CLASS_REPS: torch.zeros(10, 32), CLASS_PRESENT: torch.zeros(10)}
    result = alg.run_task("train", site, received)
    counts = torch.bincount(site.data.y, minlength=10)
    assert torch.equal(result.uploads[CLASS_COUNTS], counts)  # every sample, exactly once
    site.model.eval()
    with torch.no_grad():
        z = represent_all(site.model, site.data.x)  # the final model, as uploaded
    for c in range(10):
        if counts[c]:
            assert torch.allclose(result.uploads[CLASS_MEANS][c], z[site.data.y == c].mean(0), atol=1e-5)


def test_last_epoch_means_are_refused_under_dp_sgd():
    from fedcontrast.config import RunConfig
    from fedcontrast.construction import build_algorithm
    from fedcontrast.errors import ConfigError

    config = RunConfig(algorithm="fedssc", hyperparameters={"fedssc": {"class_means": "last_epoch"}},
                       privacy={"dp_sgd": {"noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match="last_epoch does not compose with DP-SGD"):
        build_algorithm(config)
    assert build_algorithm(config.replace(hyperparameters={"fedssc": {"class_means": "auto"}})) is not None
