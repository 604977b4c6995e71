"""FLESD: the public-set fingerprint refusal, what is uploaded (form, quantisation, never weights),
upload checks naming the sender, the ensemble from either upload form, and the distillation."""

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import InvalidUploadError, RunFacts, ServerContext, get_algorithm, validate_uploads
from fedcontrast.algorithms.flesd import (
    FINGERPRINT,
    REPRESENTATIONS,
    SIMILARITY,
    PublicDataMismatch,
    distill,
    public_fingerprint,
    quantise,
)
from fedcontrast.config import TrainingConfig
from fedcontrast.losses import ensemble_similarity, esd_loss


def flesd(public_size, **settings):
    return get_algorithm("flesd").from_settings(settings, RunFacts(public_size=public_size))


@pytest.fixture
def public(synthetic):
    return synthetic.train.subset(torch.arange(100, 140))  # 40 "public" samples


def server_for(model, public):
    return ServerContext(model=model, round_num=0, seed=7, device=torch.device("cpu"), num_classes=10, public=public)


def test_site_refuses_when_its_public_set_differs(make_site, public, synthetic):
    site = make_site(training=TrainingConfig(local_epochs=1, batch_size=32))
    algorithm = flesd(len(public))
    received = algorithm.initial_downlink(server_for(site.model, public)).global_tensors
    site.public = synthetic.train.subset(torch.arange(100, 140).flip(0))  # same samples, other order
    algorithm.task_train(site, received)
    with pytest.raises(PublicDataMismatch, match="site 'site_0' refuses similarity inference: its public data set"):
        algorithm.task_similarity(site, received)
    site.public = public
    result = algorithm.task_similarity(site, received)
    assert set(result.uploads) == {REPRESENTATIONS}


def test_fingerprint_depends_on_content_and_order(public):
    same = public_fingerprint(public)
    assert same.dtype == torch.uint8 and same.shape == (32,)
    assert torch.equal(same, public_fingerprint(public.subset(torch.arange(len(public)))))
    assert not torch.equal(same, public_fingerprint(public.subset(torch.arange(len(public) - 1))))


@pytest.mark.parametrize("quantize,dtype,bytes_per_value", [("none", "float32", 4), ("fp16", "float16", 2),
                                                            ("int8", "int8", 1)])
def test_upload_is_the_cheaper_form_and_quantised(make_site, public, quantize, dtype, bytes_per_value):
    site = make_site(training=TrainingConfig(local_epochs=1, batch_size=32))
    site.public = public
    # d = 32 < N = 40: representations (N×d) are cheaper than the N×N matrix.
    algorithm = flesd(len(public), quantize=quantize)
    specs = algorithm.upload_specs(site.model, 10)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [(REPRESENTATIONS, (40, 32), dtype)]
    assert specs[0].nbytes == 40 * 32 * bytes_per_value
    assert not any(s.name.startswith("model.") for s in specs)  # never weights
    received = algorithm.initial_downlink(server_for(site.model, public)).global_tensors
    algorithm.task_train(site, received)
    uploads = algorithm.task_similarity(site, received).uploads
    validate_uploads("site_0", uploads, specs)
    algorithm.check_upload("site_0", uploads, float(len(site.data)))
    # A public set smaller than d: the N×N matrix is cheaper.
    small = flesd(16)
    assert [s.name for s in small.upload_specs(site.model, 10)] == [SIMILARITY]
    assert flesd(16, upload="representations").upload_specs(site.model, 10)[0].shape == (16, 32)


def test_bad_similarity_uploads_are_rejected_naming_the_sender():
    algorithm = flesd(3, upload="similarity")
    good = torch.tensor([[1.0, 0.2, -0.5], [0.2, 1.0, 0.1], [-0.5, 0.1, 1.0]])
    algorithm.check_upload("site_1", {SIMILARITY: good}, 10.0)
    asymmetric = good.clone()
    asymmetric[0, 1] = 0.9
    with pytest.raises(InvalidUploadError, match="site 'site_1' uploaded a similarity matrix that is not symmetric"):
        algorithm.check_upload("site_1", {SIMILARITY: asymmetric}, 10.0)
    with pytest.raises(InvalidUploadError, match=r"site 'site_2' uploaded similarities outside \[−1, 1\]"):
        algorithm.check_upload("site_2", {SIMILARITY: good * 2}, 10.0)
    with pytest.raises(InvalidUploadError, match="not N×N"):
        algorithm.check_upload("site_3", {SIMILARITY: good[:2]}, 10.0)
    nan = good.clone()
    nan[1, 1] = float("nan")
    from fedcontrast.algorithms import TensorSpec

    spec = [TensorSpec(SIMILARITY, (3, 3), "float32", "upload")]
    with pytest.raises(InvalidUploadError, match="site 'site_4' uploaded 'flesd.similarity' with NaN"):
        validate_uploads("site_4", {SIMILARITY: nan}, spec)
    with pytest.raises(InvalidUploadError, match=r"site 'site_5' uploaded 'flesd.similarity' with shape \(2, 3\)"):
        validate_uploads("site_5", {SIMILARITY: good[:2]}, spec)


def test_representations_must_be_unit_vectors():
    algorithm = flesd(4)
    z = F.normalize(torch.randn(4, 8), dim=1)
    algorithm.check_upload("a", {REPRESENTATIONS: z}, 1.0)
    with pytest.raises(InvalidUploadError, match="site 'a' uploaded representations that are not unit vectors"):
        algorithm.check_upload("a", {REPRESENTATIONS: z * 3}, 1.0)
    int8 = flesd(4, quantize="int8")
    int8.check_upload("a", {REPRESENTATIONS: quantise(z, "int8")}, 1.0)  # quantisation error is tolerated


def test_ensemble_from_either_upload_form_matches_the_formula():
    algorithm = flesd(5)
    zs = {s: F.normalize(torch.randn(5, 3, generator=torch.Generator().manual_seed(i)), dim=1)
          for i, s in enumerate(["a", "b", "c"])}
    from_reps = {s: algorithm.site_matrix({REPRESENTATIONS: z}, torch.device("cpu")) for s, z in zs.items()}
    from_sims = {s: algorithm.site_matrix({SIMILARITY: z @ z.T}, torch.device("cpu")) for s, z in zs.items()}
    tau = 0.1
    ensembled = ensemble_similarity([from_reps[s] for s in sorted(zs)], target_temperature=tau)
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for i in range(5):
        for j in range(5):
            expected[i, j] = sum(float(zs[s][i] @ zs[s][j]) for s in zs) / 3 / tau  # (1/|S|) Σ_k M_k / τ_T
    torch.testing.assert_close(ensembled.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ensemble_similarity([from_sims[s] for s in sorted(zs)], target_temperature=tau),
                               ensembled)


def _kl_to_target(model, x, target, tau):
    with torch.no_grad():
        z = F.normalize(model.represent(x), dim=1)
        idx = torch.arange(len(x))
        return esd_loss(z, idx, z, idx, target, student_temperature=tau).item()


def test_distillation_moves_the_student_towards_the_ensemble_and_is_deterministic(make_site, public):
    site = make_site()
    teacher = make_site().model
    with torch.no_grad():  # a different encoder whose similarities are the target
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tau = 0.1
    z = F.normalize(teacher.represent(public.x), dim=1).detach()
    target = ensemble_similarity([z @ z.T], target_temperature=tau)
    hp = flesd(len(public), distill_epochs=15, distill_batch_size=16, distill_augment=False, distill_lr=3e-3).hp
    student = site.model
    before = _kl_to_target(student, public.x, target, tau)
    loss = distill(student, public.x, target, hp, seed=3)
    after = _kl_to_target(student, public.x, target, tau)
    assert loss > 0 and after < 0.8 * before
    again = make_site().model
    distill(again, public.x, target, hp, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(student.state_dict().values(), again.state_dict().values()))


def test_aggregate_starts_from_the_received_global_model(make_site, public):
    site = make_site()
    algorithm = flesd(len(public), distill_epochs=1, distill_batch_size=16)
    server = server_for(site.model, public)
    down = algorithm.initial_downlink(server)
    with pytest.raises(Exception, match="global model"):
        algorithm.aggregate({"a": {REPRESENTATIONS: torch.eye(40, 32)}}, {"a": 1.0}, server)
    server.previous = down.global_tensors
    z = F.normalize(torch.randn(40, 32), dim=1)
    new = algorithm.aggregate({"a": {REPRESENTATIONS: z}, "b": {REPRESENTATIONS: z}}, {"a": 1.0, "b": 1.0}, server)
    assert new.metrics["sites_answered"] == 2.0 and new.metrics["esd_loss"] > 0
    assert torch.equal(new.global_tensors[FINGERPRINT], down.global_tensors[FINGERPRINT])
    assert not torch.equal(new.global_tensors["model.projection.net.0.weight"],
                           down.global_tensors["model.projection.net.0.weight"])


@pytest.mark.parametrize("bad", [{"upload": "both"}, {"quantize": "int4"}, {"target_temperature": 0},
                                 {"momentum": 1.0}, {"site_models": ["vgg"]}, {"crop_scale": [0.5, 2.0]}])
def test_bad_settings_are_config_errors(bad):
    from fedcontrast.errors import ConfigError

    with pytest.raises(ConfigError):
        get_algorithm("flesd").from_settings(bad)


def test_sites_with_other_encoder_architectures_federate(tmp_path):
    # Only similarities travel, so a ResNet-18 site and simple-CNN sites take part in one federation;
    # the ResNet site keeps its own encoder from round to round.
    from fedcontrast.config import RunConfig
    from fedcontrast.sim import Federation

    config = RunConfig(algorithm="flesd", dataset="synthetic", image_size=16, clients=3, rounds=2, min_samples=5,
                       projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={"flesd": {"site_models": ["simple_cnn", "resnet18"], "distill_epochs": 1,
                                                  "probe_epochs": 10}})
    federation = Federation(config)
    rows = federation.run_round(1)
    resnet_state = federation.sites[1].state["flesd.local_model"]
    assert any("layer1" in k for k in resnet_state)
    assert not any("layer1" in k for k in federation.sites[0].state["flesd.local_model"])
    first = {k: v.clone() for k, v in resnet_state.items()}
    rows += federation.run_round(2)
    second = federation.sites[1].state["flesd.local_model"]
    assert any(not torch.equal(first[k], second[k]) for k in first)  # kept training its own encoder
    evaluation = [r for r in rows if r["site"] == "global"][-1]
    assert 0.0 <= evaluation["accuracy"] <= 1.0


def test_representation_dp_noises_z_before_it_leaves_and_is_accounted(tmp_path):
    # Under representation DP the site's Z_k is noised (one Gaussian release per round, accounted),
    # then re-normalised (post-processing), so the aggregator's checks still hold; DP-SGD is refused.
    from fedcontrast.config import RunConfig
    from fedcontrast.errors import ConfigError
    from fedcontrast.privacy.accounting import planned_epsilon
    from fedcontrast.sim import Federation

    base = RunConfig(algorithm="flesd", dataset="synthetic", image_size=16, clients=2, rounds=1, min_samples=5,
                     projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                     hyperparameters={"flesd": {"distill_epochs": 1, "probe_epochs": 5}})
    private = base.replace(privacy={"representations": {"noise_multiplier": 0.5}})
    clean_fed, dp_fed = Federation(base), Federation(private)
    clean_rows, dp_rows = clean_fed.run_round(1), dp_fed.run_round(1)
    # Same local training, so without noise the uploads would be identical: the global models differ.
    assert not torch.equal(clean_fed.downlink.global_tensors["model.projection.net.0.weight"],
                           dp_fed.downlink.global_tensors["model.projection.net.0.weight"])
    site = dp_fed.sites[0]
    expected = planned_epsilon(private.privacy, private.training, n=len(site.data), rounds=1, representations=True,
                               representation_releases=1).total
    row = next(r for r in dp_rows if r["site"] == site.name and r["task"] == "similarity")
    assert f'"dp_epsilon":{round(expected, 6)}' in row["extra"]
    assert not any("dp_epsilon" in r["extra"] for r in clean_rows)
    with pytest.raises(ConfigError, match="flesd does not support privacy.dp_sgd"):
        Federation(base.replace(privacy={"dp_sgd": {"noise_multiplier": 1.0}}))
