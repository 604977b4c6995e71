"""FedPCL: prototype aggregation and fill, the loss, never uploading weights, differing sites, backbones."""

import math

import pytest
import torch

from fedcontrast.aggregation import fill_missing_prototypes, global_prototypes
from fedcontrast.algorithms import InvalidUploadError, ServerContext, get_algorithm
from fedcontrast.algorithms.fedpcl import COUNTS, GLOBAL_PROTOTYPES, HEAD, LOCAL_PROTOTYPES, LOCAL_SETS, PRESENT
from fedcontrast.config import RunConfig, TrainingConfig
from fedcontrast.errors import ConfigError, DataError
from fedcontrast.losses import prototype_contrastive_loss
from fedcontrast.models.backbones import load_backbone, pretrain_backbone
from fedcontrast.sim import run_simulation


def test_global_prototypes_hand_computed_and_fill():
    protos = {"a": torch.tensor([[1.0, 0.0], [0.0, 0.0], [4.0, 4.0]]),
              "b": torch.tensor([[0.0, 1.0], [2.0, 2.0], [0.0, 0.0]])}
    counts = {"a": torch.tensor([1, 0, 5]), "b": torch.tensor([3, 2, 0])}
    g, present = global_prototypes(protos, counts)
    # class 0: (1·[1,0] + 3·[0,1]) / 4; class 1: only b; class 2: only a
    assert torch.allclose(g, torch.tensor([[0.25, 0.75], [2.0, 2.0], [4.0, 4.0]]))
    assert torch.equal(present, torch.ones(3))
    eq6, _ = global_prototypes(protos, counts, weighting="paper_eq6")  # divided by |N_c| = 2, 1, 1
    assert torch.allclose(eq6, torch.tensor([[0.125, 0.375], [2.0, 2.0], [4.0, 4.0]]))
    filled = fill_missing_prototypes(protos["a"], counts["a"], g)
    assert torch.equal(filled, torch.tensor([[1.0, 0.0], [2.0, 2.0], [4.0, 4.0]]))  # class 1 filled from G


def test_global_prototypes_match_an_explicit_loop():
    gen = torch.Generator().manual_seed(0)
    protos = {f"s{i}": torch.randn(4, 3, generator=gen, dtype=torch.float64) for i in range(5)}
    counts = {f"s{i}": torch.randint(0, 4, (4,), generator=gen) for i in range(5)}
    g, _ = global_prototypes(protos, counts)
    for c in range(4):
        n = sum(int(counts[s][c]) for s in protos)
        expected = sum(int(counts[s][c]) * protos[s][c] for s in protos) / n if n else torch.zeros(3)
        assert torch.allclose(g[c], expected)


def test_prototype_loss_closed_form_and_loop():
    # z equidistant (inner product 0) from 3 present prototypes: −log(1/3).
    z = torch.tensor([[0.0, 0.0, 1.0]])
    protos = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [-1.0, 0, 0], [0, -1.0, 0]])
    assert prototype_contrastive_loss(z, torch.tensor([0]), protos, torch.tensor([1.0, 1, 1, 0]),
                                      temperature=0.5).item() == pytest.approx(math.log(3), rel=1e-6)
    gen = torch.Generator().manual_seed(1)
    z, p = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    expected = sum(-math.log(math.exp(float(z[i] @ p[y[i]]) / 0.1) /
                             sum(math.exp(float(z[i] @ p[c]) / 0.1) for c in range(3))) for i in range(6)) / 6
    assert (prototype_contrastive_loss(z, y, p, torch.ones(3), temperature=0.1).item()
            == pytest.approx(expected, rel=1e-9))


def test_site_with_no_sample_still_gets_every_prototype():
    alg = get_algorithm("fedpcl")()
    uploads = {"site_0": {LOCAL_PROTOTYPES: torch.tensor([[1.0, 1.0], [2.0, 0.0]]), COUNTS: torch.tensor([4, 6])},
               "site_1": {LOCAL_PROTOTYPES: torch.zeros(2, 2), COUNTS: torch.tensor([0, 0])}}
    server = ServerContext(model=None, round_num=0, seed=0, device=torch.device("cpu"), num_classes=2,
                           sites=["site_0", "site_1"])
    downlink = alg.aggregate(uploads, {"site_0": 10.0, "site_1": 0.0}, server)
    assert torch.equal(downlink.global_tensors[LOCAL_SETS][1], downlink.global_tensors[GLOBAL_PROTOTYPES])
    assert torch.equal(downlink.global_tensors[PRESENT], torch.ones(2))


@pytest.mark.parametrize("counts,protos_row,weight,match", [
    ([-1, 11], None, 10, "negative"), ([0, 10], 1.0, 10, "counts 0"), ([3, 3], None, 10, "not its 10"),
])
def test_bad_prototype_uploads_are_rejected(counts, protos_row, weight, match):
    protos = torch.zeros(2, 4)
    if protos_row is not None:
        protos[0] = protos_row
    with pytest.raises(InvalidUploadError, match=f"site 'x'.*{match}"):
        get_algorithm("fedpcl")().check_upload("x", {LOCAL_PROTOTYPES: protos, COUNTS: torch.tensor(counts)}, weight)


def test_never_uploads_weights_and_sites_may_differ(tmp_path):
    # Two sites with different projection networks (hidden 16 and 48) federate through prototypes.
    config = RunConfig(algorithm="fedpcl", dataset="synthetic", image_size=16, clients=2, rounds=2, min_samples=5,
                       public_fraction=0.2, projection_dim=32, training=TrainingConfig(local_epochs=2, batch_size=32),
                       hyperparameters={"fedpcl": {"projection_hidden": [16, 48], "pretrain_epochs": 2}})
    from fedcontrast.sim import Federation

    federation = Federation(config)
    assert all(not s.name.startswith("model.") for s in federation.upload_specs)
    assert {s.name for s in federation.upload_specs} == {LOCAL_PROTOTYPES, COUNTS}
    for r in range(2):
        rows = federation.run_round(r + 1)
    shapes = [site.state[HEAD]["0.weight"].shape for site in federation.sites]
    assert shapes[0][0] == 16 and shapes[1][0] == 48
    glob = next(r for r in rows if r["site"] == "global")
    assert 0.0 <= glob["accuracy"] <= 1.0 and "local_accuracy" in glob["extra"]
    summary = run_simulation(config, tmp_path / "run")
    assert summary["rounds_completed"] == 2


def test_backbone_files(tmp_path, synthetic):
    encoder = pretrain_backbone("simple_cnn", synthetic.test, seed=0, epochs=1)
    path = tmp_path / "b.pt"
    torch.save(encoder.state_dict(), path)
    loaded = load_backbone("simple_cnn", path, in_channels=1, image_size=16)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), encoder.state_dict().values()))
    with pytest.raises(DataError, match="does not exist"):
        load_backbone("simple_cnn", tmp_path / "missing.pt", in_channels=1, image_size=16)
    with pytest.raises(ConfigError, match="does not fit a resnet18 backbone"):
        load_backbone("resnet18", path, in_channels=1, image_size=16)
    with pytest.raises(ConfigError, match="one file per backbone"):
        get_algorithm("fedpcl").from_settings({"backbones": ["simple_cnn", "resnet18"], "backbone_files": [str(path)]})


def test_distribution_weighted_accuracy_hand_computed():
    from fedcontrast.evaluation import distribution_weighted_accuracy

    y = torch.tensor([0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 0, 1, 0, 1, 1])  # per class: 1.0, 0.5, 0.0
    # a site holding classes 0 and 1 in a 3:1 ratio: (3·1.0 + 1·0.5) / 4
    assert distribution_weighted_accuracy(pred, y, torch.tensor([3.0, 1.0, 0.0])) == pytest.approx(0.875)
    assert distribution_weighted_accuracy(pred, y, torch.ones(3)) == pytest.approx(0.5)  # balanced
