"""FedPCL's prediction rule: the nearest prototype (specification and official code), not argmax z·P."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.evaluation import nearest_prototype


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_nearest_prototype_matches_an_explicit_loop(metric):
    gen = torch.Generator().manual_seed(3)
    z = F.normalize(torch.randn(40, 5, generator=gen), dim=1)
    protos = torch.randn(6, 5, generator=gen) * torch.rand(6, 1, generator=gen)  # norms differ by class
    present = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    predicted = nearest_prototype(z, protos, present, metric=metric)
    for i in range(len(z)):
        if metric == "euclidean":
            score = {c: -math.dist(z[i].tolist(), protos[c].tolist()) for c in range(6) if present[c]}
        else:
            score = {c: float(z[i] @ protos[c]) / float(protos[c].norm()) for c in range(6) if present[c]}
        assert int(predicted[i]) == max(score, key=score.get)


def test_on_data_labelled_by_the_nearest_prototype_it_is_exact_where_the_dot_product_is_not():
    # Prototypes are means of unit vectors: a tight class has a long prototype, a spread one a short
    # prototype. The dot product then prefers the long one for points nearer the short one.
    angles = torch.linspace(0, 2 * math.pi, 361)[:-1]
    z = torch.stack([angles.cos(), angles.sin()], dim=1)  # unit vectors all round the circle
    protos = torch.tensor([[0.95, 0.0], [-0.2, 0.25]])  # class 0: tight around +x; class 1: spread, short
    labels = torch.cdist(z, protos).argmin(1)  # the specification's rule
    assert bool((nearest_prototype(z, protos) == labels).all())
    dot = (z @ protos.T).argmax(1)
    assert float((dot == labels).double().mean()) < 0.9  # the old rule gets a good part wrong
    with pytest.raises(ValueError, match="metric must be one of"):
        nearest_prototype(z, protos, metric="manhattan")
