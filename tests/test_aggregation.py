"""FedAvg aggregation against hand-computed numbers and an explicit per-element loop."""

import pytest
import torch

from fedcontrast.aggregation import UploadError, normalised_weights, weighted_average


def test_hand_computed_two_sites():
    uploads = {"a": {"w": torch.tensor([1.0, 4.0])}, "b": {"w": torch.tensor([4.0, 1.0])}}
    out = weighted_average(uploads, {"a": 1, "b": 2})
    # (w0*1 + w1*2)/3
    assert torch.allclose(out["w"], torch.tensor([(1 * 1 + 4 * 2) / 3, (4 * 1 + 1 * 2) / 3]))


@pytest.mark.parametrize("sites", [1, 2, 5])
def test_matches_explicit_loop(sites):
    gen = torch.Generator().manual_seed(sites)
    uploads = {f"s{k}": {"a": torch.randn(3, 2, generator=gen), "b": torch.randn(4, generator=gen)}
               for k in range(sites)}
    weights = {f"s{k}": float(k + 1) * 7 for k in range(sites)}
    out = weighted_average(uploads, weights)
    n = sum(weights.values())
    for name in ("a", "b"):
        flat = [0.0] * uploads["s0"][name].numel()
        for site, tensors in uploads.items():
            for i, v in enumerate(tensors[name].flatten().tolist()):
                flat[i] += weights[site] / n * v
        assert torch.allclose(out[name].flatten(), torch.tensor(flat), atol=1e-6)
        assert out[name].dtype == torch.float32


def test_order_of_arrival_does_not_change_the_bits():
    gen = torch.Generator().manual_seed(3)
    items = [(f"s{k}", {"w": torch.randn(100, generator=gen)}) for k in range(4)]
    w = {f"s{k}": k + 1.0 for k in range(4)}
    a = weighted_average(dict(items), w)["w"]
    b = weighted_average(dict(reversed(items)), w)["w"]
    assert torch.equal(a, b)


def test_rejects_bad_inputs():
    good = {"a": {"w": torch.zeros(2)}, "b": {"w": torch.zeros(2)}}
    with pytest.raises(UploadError, match="'b'.*shape"):
        weighted_average({"a": {"w": torch.zeros(2)}, "b": {"w": torch.zeros(3)}}, {"a": 1, "b": 1})
    with pytest.raises(UploadError, match="different tensors"):
        weighted_average({"a": {"w": torch.zeros(2)}, "b": {"v": torch.zeros(2)}}, {"a": 1, "b": 1})
    with pytest.raises(UploadError, match="invalid aggregation weight"):
        weighted_average(good, {"a": -1, "b": 1})
    with pytest.raises(UploadError, match="weight of 0"):
        normalised_weights({"a": 0, "b": 0})
    with pytest.raises(UploadError, match="no site"):
        weighted_average({}, {})


def _loop_average(uploads, weights):
    """The reference: one site and one tensor at a time, in float64, in sorted-site order."""
    sites = sorted(uploads)
    share = normalised_weights({s: weights[s] for s in sites})
    out = {}
    for name, ref in uploads[sites[0]].items():
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for site in sites:
            acc += share[site] * uploads[site][name].to(torch.float64)
        out[name] = acc.to(ref.dtype)
    return out


@pytest.mark.parametrize("budget", [None, 1, 37, 5000])
def test_the_stacked_average_equals_the_loop_over_sites_bit_for_bit(monkeypatch, budget):
    import fedcontrast.aggregation as aggregation

    if budget is not None:  # blocks of one site, of a few sites, of many
        monkeypatch.setattr(aggregation, "BLOCK_VALUES", budget)
        monkeypatch.setattr(aggregation.site_blocks, "__defaults__", (budget,))
    g = torch.Generator().manual_seed(3)
    shapes = {"model.w": (7, 5), "model.b": (5,), "model.s": (), "model.h": (3, 2, 2)}
    uploads = {f"site_{k}": {n: (torch.randn(s, generator=g) * 10 ** float(torch.randint(-3, 4, (), generator=g)))
                             for n, s in shapes.items()} for k in range(57)}
    uploads["site_3"]["model.h"] = uploads["site_3"]["model.h"].to(torch.float64)
    for k in range(57):
        uploads[f"site_{k}"]["model.h"] = uploads[f"site_{k}"]["model.h"].to(torch.float64)
    weights = {s: float(torch.randint(1, 500, (), generator=g)) for s in uploads}
    got, want = weighted_average(uploads, weights), _loop_average(uploads, weights)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert torch.equal(got[name], want[name]), name
