"""Issue 34: a per-site bound given as a mapping names every site of the plan, and replay detection
catches near-copies of a site's earlier uploads (one value changed by one ULP), never honest rounds."""

import math

import pytest
import torch

from fedcontrast.config import RobustnessConfig, RunConfig
from fedcontrast.errors import ConfigError, FedContrastError
from fedcontrast.robust.replay import NEAR_REPLAY, upload_sketch
from fedcontrast.robust.screen import UploadScreen

from .test_robust import _Plugin


def test_a_max_samples_mapping_that_leaves_a_site_out_is_refused():
    with pytest.raises(ConfigError, match=r"robustness.max_samples gives no bound for site_2, a site of the plan "
                                          r"\(site_0, site_1, site_2\): a site left out of the mapping would be "
                                          "unbounded"):
        RunConfig(clients=3, robustness={"max_samples": {"site_0": 100, "site_1": 100}})
    config = RunConfig(clients=3, robustness={"max_samples": {"site_0": 100, "site_1": 100, "site_2": 50}})
    screen = UploadScreen(config.robustness, _Plugin())
    with pytest.raises(FedContrastError, match=r"'site_2' claimed 1e\+12 samples, more than the plan's max_samples 50"):
        screen.check_weight("site_2", 1e12)


def one_ulp_off(upload):
    changed = {k: v.clone() for k, v in upload.items()}
    flat = changed["model.w"].view(-1)
    flat[7] = torch.nextafter(flat[7], torch.tensor(math.inf))
    return changed


def test_a_replay_changed_by_one_ulp_is_still_a_replay():
    g = torch.Generator().manual_seed(0)
    ref = {"model.w": torch.randn(5000, generator=g)}
    first = {"model.w": ref["model.w"] + 0.01 * torch.randn(5000, generator=g)}
    screen = UploadScreen(RobustnessConfig(), _Plugin())
    accepted, _, rejected = screen.screen(1, {"a": first}, {"a": 10.0}, ref)
    assert "a" in accepted and not rejected
    honest = {"model.w": first["model.w"] + 1e-3 * torch.randn(5000, generator=g)}  # a small honest round
    accepted, _, rejected = screen.screen(2, {"a": honest}, {"a": 10.0}, ref)
    assert "a" in accepted and not rejected
    replay = one_ulp_off(first)
    accepted, _, rejected = screen.screen(3, {"a": replay}, {"a": 10.0}, ref)
    assert not accepted and rejected["a"].startswith("round 3: site 'a' sent in round 3 an upload within ")
    assert "of the one it sent in round 1, below the 1e-05 that honest training always exceeds: a replay altered in " \
           "its last digits" in rejected["a"]
    # another site's identical upload is not this site's replay
    accepted, _, rejected = screen.screen(3, {"b": replay}, {"b": 10.0}, ref)
    assert "b" in accepted


def test_the_sketch_measures_distances_as_the_threshold_assumes():
    g = torch.Generator().manual_seed(1)
    u = {"model.w": torch.randn(20000, generator=g), "model.b": torch.randn(30, generator=g)}
    for scale in (1e-2, 1e-3, 1e-4):  # a difference spread over every value: measured within ~30 %
        v = {k: t + scale * torch.randn(t.shape, generator=g) for k, t in u.items()}
        (su, nu), (sv, _) = upload_sketch(u), upload_sketch(v)
        true = math.sqrt(sum(float((u[k] - v[k]).double().pow(2).sum()) for k in u)) / nu
        assert 0.7 < float(torch.linalg.vector_norm(su - sv)) / nu / true < 1.3
    (su, nu), (sw, _) = upload_sketch(u), upload_sketch(one_ulp_off(u))
    assert float(torch.linalg.vector_norm(su - sw)) / nu < NEAR_REPLAY


def _sketch_one_tensor_at_a_time(upload):
    """The reference: the sketch as first written, one generator and one index_add_ per tensor."""
    import zlib

    from fedcontrast.robust.replay import BUCKETS

    sketch = torch.zeros(BUCKETS, dtype=torch.float64)
    squared = 0.0
    for name in sorted(upload):
        values = upload[name].detach().reshape(-1).to(torch.float64)
        if not values.numel():
            continue
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        buckets = torch.randint(0, BUCKETS, (values.numel(),), generator=g)
        signs = torch.randint(0, 2, (values.numel(),), generator=g, dtype=torch.float64) * 2 - 1
        sketch.index_add_(0, buckets, values * signs)
        squared += float(values.dot(values))
    return sketch, squared ** 0.5


def test_the_sketch_of_an_upload_at_once_equals_one_tensor_at_a_time_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    for dtypes in ([torch.float32] * 4, [torch.float32, torch.float64, torch.float16, torch.int64]):
        upload = {f"model.t{i}": (torch.randn(n, generator=g) * 10 ** i).to(dtype)
                  for i, (n, dtype) in enumerate(zip([40000, 7, 0, 3000], dtypes))}
        for _ in range(2):  # drawn, then cached
            got, want = upload_sketch(upload), _sketch_one_tensor_at_a_time(upload)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]


def _loop_nearest(sketch, earlier, skip_round):
    """The reference: each earlier (round, sketch, norm) on its own, as the screen compared them before
    the history was one matrix."""
    values, norm = sketch
    best = None
    for round_num, other, other_norm in earlier:
        scale = max(norm, other_norm)
        if round_num == skip_round or scale == 0:
            continue
        distance = float(torch.linalg.vector_norm(other - values)) / scale
        if distance < NEAR_REPLAY and (best is None or distance < best[1]):
            best = (round_num, distance)
    return best


def test_the_history_of_sketches_finds_the_nearest_earlier_upload_as_a_loop_over_rounds_does():
    from fedcontrast.robust.replay import BUCKETS, SketchHistory, nearest

    g = torch.Generator().manual_seed(2)
    history, earlier = SketchHistory(), []
    for round_num in range(1, 41):  # grows past its first room (4) several times
        sketch = (torch.randn(BUCKETS, generator=g, dtype=torch.float64), float(torch.rand((), generator=g)) + 1)
        history.add(round_num, *sketch)
        earlier.append((round_num, *sketch))
    assert nearest(earlier[9][1:], None) is None and nearest(earlier[9][1:], SketchHistory()) is None
    for probe_round, scale in [(10, 1 + 1e-7), (10, 1 + 1e-3), (25, 1 - 3e-6), (40, 1.0)]:
        _, values, norm = earlier[probe_round - 1]
        probe = (values * scale, norm)
        for skip in (None, 41, probe_round):
            got, want = nearest(probe, history, skip_round=skip), _loop_nearest(probe, earlier, skip)
            assert (got is None) == (want is None), (probe_round, scale, skip)
            if want is not None:
                assert got[0] == want[0] and got[1] == pytest.approx(want[1], rel=1e-12, abs=1e-18)
    twice = SketchHistory()  # the same sketch in rounds 3 and 5: the earlier one is named
    twice.add(3, earlier[0][1], earlier[0][2])
    twice.add(5, earlier[0][1], earlier[0][2])
    assert nearest(earlier[0][1:], twice) == (3, 0.0)
    assert nearest((torch.full((BUCKETS,), math.nan, dtype=torch.float64), 1.0), history) is None
