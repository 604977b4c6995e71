"""Issue 46: a free-rider resending its round-1 upload, altered beyond the fixed near-copy radius (noise
of 2 × 10⁻⁵ of its norm, a scale of 1 ± 10⁻⁴), is rejected and named for what it is — an upload that
does not follow the global model (``robustness.min_progress``) —, and honest sites never are."""

import math
import re

import pytest
import torch

from fedcontrast.config import RobustnessConfig, RunConfig
from fedcontrast.errors import ConfigError
from fedcontrast.robust.replay import NEAR_REPLAY, SketchHistory, stale, upload_sketch
from fedcontrast.robust.screen import UploadScreen

from .test_robust import _Plugin

SIZE = 4000


def _norm(tensors):
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def noised(upload, relative, seed):
    g = torch.Generator().manual_seed(seed)
    noise = {k: torch.randn(v.shape, generator=g) for k, v in upload.items()}
    scale = relative * _norm(upload) / _norm(noise)
    return {k: v + scale * noise[k] for k, v in upload.items()}


def scaled(upload, factor):
    return {k: v * factor for k, v in upload.items()}


FREE_RIDERS = {  # round → what site 'b' sends, from its round-1 upload
    "noise 2e-5": lambda first, r: noised(first, 2 * NEAR_REPLAY, r),
    "scale 1+1e-4": lambda first, r: scaled(first, 1 + 1e-4 * (1 + (r - 2) / 5)),
    "scale 1-1e-4": lambda first, r: scaled(first, 1 - 1e-4 * (1 + (r - 2) / 5)),
}


def federation(screen, rounds, free_rider=None, seed=0, step=1e-2):
    """Three sites a, b, c; each honest upload is the global model it received plus a step of relative
    size ``step`` (honest digits sites move up to 0.04 of ‖w‖ a round), half of it along the round's
    common direction (the sites learn the same task) and half its own; the global model is their
    mean. Site b is ``free_rider`` from round 2 on. Returns site → rounds in which it was rejected, and
    the reasons."""
    g = torch.Generator().manual_seed(seed)
    model = {"model.w": torch.randn(SIZE, generator=g), "model.b": torch.randn(30, generator=g)}
    rejected, reasons, first = {}, {}, None
    for r in range(1, rounds + 1):
        common = {k: torch.randn(v.shape, generator=g) for k, v in model.items()}
        uploads = {s: {k: v + step * v.norm() / math.sqrt(2 * v.numel())
                       * (common[k] + torch.randn(v.shape, generator=g)) for k, v in model.items()} for s in "abc"}
        if free_rider is not None and r > 1:
            uploads["b"] = free_rider(first, r)
        accepted, _, refused = screen.screen(r, uploads, {s: 10.0 for s in uploads}, model)
        if r == 1:
            first = {k: v.clone() for k, v in uploads["b"].items()}
        for site, reason in refused.items():
            rejected.setdefault(site, []).append(r)
            reasons.setdefault(site, []).append(reason)
        model = {k: torch.stack([u[k] for u in accepted.values()]).mean(0) for k in model}
    return rejected, reasons


@pytest.mark.parametrize("kind", sorted(FREE_RIDERS))
def test_a_free_rider_resending_its_round_one_upload_altered_is_rejected_and_named(kind):
    before, _ = federation(UploadScreen(RobustnessConfig(min_progress=None), _Plugin()), 8, FREE_RIDERS[kind])
    assert before == {}  # the fixed radius alone lets every altered copy through
    rejected, reasons = federation(UploadScreen(RobustnessConfig(), _Plugin()), 8, FREE_RIDERS[kind])
    assert rejected == {"b": list(range(2, 9))}  # every round after its first, and only site b
    for r, reason in zip(range(2, 9), reasons["b"]):
        assert reason.startswith(f"round {r}: site 'b' sent in round {r} an upload within ")
        assert "of the one it sent in round 1, though the global model it received moved" in reason
        assert "below the plan's min_progress 0.1 (honest uploads follow the global model): its earlier upload " \
               "resent, altered, not fresh work; rejected" in reason
        ratio = float(re.search(r"it moved (\S+)× the global model's move", reason).group(1))
        assert ratio < 0.05


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("step", [1e-3, 1e-2, 4e-2])
def test_honest_sites_are_never_rejected(seed, step):
    rejected, reasons = federation(UploadScreen(RobustnessConfig(), _Plugin()), 12, seed=seed, step=step)
    assert rejected == {}, reasons


def test_the_derived_radius_is_min_progress_times_the_global_models_move_by_hand():
    """The radius against which a site's upload is compared with its round-1 upload, computed by hand:
    0.1 × the distance between the sketches of the two global models it was made from (over its model
    tensors), which is that move's L2 norm up to the sketch's few per cent; just inside it the upload is
    rejected, just outside accepted."""
    g = torch.Generator().manual_seed(7)
    w1 = {"model.w": torch.randn(SIZE, generator=g), "model.b": torch.randn(30, generator=g)}
    w2 = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in w1.items()}  # the global model moved
    u1 = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in w1.items()}
    names = ("model.b", "model.w")
    # by hand: the sketches, and the radius they give
    move = float(torch.linalg.vector_norm(upload_sketch(w2)[0] - upload_sketch(w1)[0]))
    true_move = _norm({k: w2[k] - w1[k] for k in names})
    assert 0.85 < move / true_move < 1.15
    radius = 0.1 * move
    assert radius > 100 * NEAR_REPLAY * _norm(u1)  # the derived radius is the one that acts here
    direction = {k: torch.randn(v.shape, generator=g) for k, v in u1.items()}
    unit = float(torch.linalg.vector_norm(upload_sketch(direction)[0]))  # the sketch is linear
    for fraction, caught in ((0.9, True), (1.1, False)):
        screen = UploadScreen(RobustnessConfig(), _Plugin())
        accepted, _, refused = screen.screen(1, {"b": u1}, {"b": 1.0}, w1)
        assert "b" in accepted and not refused
        history = screen.sketches["b"]
        assert history.names == names and torch.equal(history.received[0], upload_sketch(w1)[0])
        u2 = {k: v + fraction * radius / unit * direction[k] for k, v in u1.items()}
        found = stale(upload_sketch(u2), history, received=upload_sketch(w2)[0], names=names, min_progress=0.1)
        if caught:
            assert found is not None and found.round == 1 and found.by_progress
            assert found.radius == pytest.approx(radius, rel=1e-9)
            assert found.moved == pytest.approx(move, rel=1e-9)
            assert found.distance == pytest.approx(fraction * radius, rel=1e-4)
        else:
            assert found is None
        accepted, _, refused = screen.screen(2, {"b": u2}, {"b": 1.0}, w2)
        assert ("b" in refused) == caught and ("b" in accepted) != caught
        if caught:
            assert f"it moved {fraction * 0.1:.2g}× the global model's move" in refused["b"]


def test_where_the_global_model_did_not_move_the_fixed_radius_remains():
    g = torch.Generator().manual_seed(3)
    w = {"model.w": torch.randn(SIZE, generator=g)}
    u1 = {"model.w": w["model.w"] + 0.01 * torch.randn(SIZE, generator=g)}
    history = SketchHistory()
    history.add(1, *upload_sketch(u1), received=upload_sketch(w)[0], names=("model.w",))
    for relative, caught in ((0.5 * NEAR_REPLAY, True), (2 * NEAR_REPLAY, False)):
        found = stale(upload_sketch(noised(u1, relative, 1)), history, received=upload_sketch(w)[0],
                      names=("model.w",), min_progress=0.1)
        assert (found is not None) == caught
        if caught:
            assert not found.by_progress and found.relative < NEAR_REPLAY


class _Persistent(_Plugin):
    uploads_follow_global = False  # e.g. FedSiam-DA's local_start: previous


def test_a_plugin_whose_uploads_do_not_start_from_the_global_model_gets_the_fixed_radius_only():
    screen = UploadScreen(RobustnessConfig(), _Persistent())
    rejected, _ = federation(screen, 5, FREE_RIDERS["noise 2e-5"])
    assert rejected == {}
    from fedcontrast.algorithms.fedsiam import FedSiamDA, FedSiamHyperparameters

    assert FedSiamDA().uploads_follow_global
    assert not FedSiamDA(FedSiamHyperparameters(local_start="previous")).uploads_follow_global


def test_min_progress_is_a_setting_of_the_plan():
    assert RobustnessConfig().min_progress == 0.1
    assert RunConfig(robustness={"min_progress": None}).robustness.min_progress is None
    for bad in (0, 1, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match="robustness.min_progress must be"):
            RobustnessConfig(min_progress=bad)


def test_a_free_rider_in_a_digits_federation_is_rejected_and_named_and_no_honest_site_is():
    """The simulator, FedAvg on digits (3 sites), site_1 resending its round-1 upload plus noise of
    2 × 10⁻⁵ of its norm from round 2 on; measured where the sites train, as the simulator does."""
    from fedcontrast.sim.federation import Federation

    config = RunConfig(algorithm="fedavg", dataset="digits", clients=3, rounds=3, min_samples=20,
                       training={"local_epochs": 1}, robustness={"on_rejected": "exclude"})
    fed = Federation(config)
    kept = {}
    train_site = fed.train_site

    def free_rider(site, round_num, received, reference=None):
        outcome = train_site(site, round_num, received, reference)
        if site.name == "site_1":
            if not kept:
                kept.update(outcome.uploads)
            else:
                outcome.uploads = noised(kept, 2 * NEAR_REPLAY, round_num)
                outcome.measured = fed.screen.measure(outcome.uploads, reference)
        return outcome

    fed.train_site = free_rider
    rejected = {}
    for r in range(1, 4):
        for row in fed.run_round(r):
            if row["task"] == "rejected":
                rejected.setdefault(row["site"], []).append(r)
    assert rejected == {"site_1": [2, 3]}
