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


@pytest.mark.parametrize("budget", [None, 1, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uploads_that_travelled_as_one_array_average_as_the_loop_and_are_left_unchanged(monkeypatch, budget, dtype):
    import fedcontrast.aggregation as aggregation
    from fedcontrast.sim.transfer import pack_flat, unpack

    if budget is not None:
        monkeypatch.setattr(aggregation, "BLOCK_VALUES", budget)
        monkeypatch.setattr(aggregation.site_blocks, "__defaults__", (budget,))
    g = torch.Generator().manual_seed(5)
    shapes = {"model.w": (7, 5), "model.b": (5,), "model.s": (), "model.h": (3, 2, 2)}
    plain = {f"site_{k}": {n: torch.randn(s, generator=g, dtype=dtype) for n, s in shapes.items()} for k in range(9)}
    arrived = {s: unpack(pack_flat(u)) for s, u in plain.items()}  # views of one array per site
    assert all(t._base is not None for u in arrived.values() for t in u.values())
    # one site's views taken in another order, one site's with a tensor replaced: not one array's pieces in order
    arrived["site_2"] = dict(reversed(list(arrived["site_2"].items())))
    arrived["site_4"] = {**arrived["site_4"], "model.b": arrived["site_4"]["model.b"].clone()}
    before = {s: {n: t.clone() for n, t in u.items()} for s, u in arrived.items()}
    weights = {s: float(torch.randint(1, 500, (), generator=g)) for s in plain}
    got, want = weighted_average(arrived, weights), _loop_average(plain, weights)
    for name in want:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
    assert all(torch.equal(arrived[s][n], before[s][n]) for s in arrived for n in arrived[s])


def test_an_upload_is_one_arrays_row_only_when_its_tensors_are_that_arrays_pieces_in_order():
    from fedcontrast.aggregation import _flat_row

    flat = torch.arange(10.0)
    pieces = {"a": flat[0:4].view(2, 2), "b": flat[4:10]}
    assert _flat_row(pieces, ["a", "b"], 10) is flat
    assert _flat_row(pieces, ["b", "a"], 10) is None  # out of order
    assert _flat_row({"a": flat[0:4].view(2, 2), "b": flat[5:10]}, ["a", "b"], 9) is None  # a gap
    assert _flat_row({"a": pieces["a"]}, ["a"], 4) is None  # part of the array only
    assert _flat_row({"a": flat[0:8].view(4, 2).t(), "b": flat[8:10]}, ["a", "b"], 10) is None  # not contiguous
    assert _flat_row({"a": torch.zeros(4), "b": torch.zeros(6)}, ["a", "b"], 10) is None  # separate tensors
