"""Issue 38: the screen's measurements of an upload made where the upload is produced (a simulated site:
:meth:`UploadScreen.measure`) give the very checks, digests and abnormal moves the aggregator gets
measuring each upload itself; the abnormal-move check over blocks of sites equals the loop over sites."""

import math
import statistics

import pytest
import torch

from fedcontrast.aggregation import weighted_average
from fedcontrast.config import RobustnessConfig
from fedcontrast.robust import UploadScreen, abnormal_move, update_spreads
from fedcontrast.robust.updates import _shared_weight_names

from .test_robust import _uploads


def _loop_move_figures(uploads, reference, new):
    """The reference: per site and tensor, ⟨Δ_k, M⟩ and ‖Δ_k‖² in float64 (the code before blocks)."""
    names = [n for n in _shared_weight_names(uploads, reference) if n in new]
    dots, norms = {}, {}
    for site in sorted(uploads):
        dots[site] = norms[site] = 0.0
        for name in names:
            ref = reference[name].to(torch.float64)
            update = uploads[site][name].to(torch.float64) - ref
            dots[site] += float((update * (new[name].to(torch.float64) - ref)).sum())
            norms[site] += float((update ** 2).sum())
    return dots, norms


@pytest.mark.parametrize("budget", [None, 1, 13])
def test_the_abnormal_move_over_blocks_of_sites_equals_the_loop(monkeypatch, budget):
    import fedcontrast.aggregation as aggregation

    if budget is not None:
        monkeypatch.setattr(aggregation.site_blocks, "__defaults__", (budget,))
    ups = _uploads(9, seed=4)
    ref = {k: torch.full_like(v, 0.1) for k, v in ups["s0"].items()}
    ups["s5"] = {k: 30 * v for k, v in ups["s5"].items()}  # the mover
    shares = {s: 1 / len(ups) for s in ups}
    new = weighted_average(ups, dict.fromkeys(ups, 1.0))
    move = abnormal_move(7, ups, shares, ref, new)
    dots, norms = _loop_move_figures(ups, ref, new)
    move_sq = sum(float(((new[n].to(torch.float64) - ref[n].to(torch.float64)) ** 2).sum()) for n in new)
    others = statistics.median(math.sqrt(v) for s, v in norms.items() if s != "s5")
    assert move is not None and move.site == "s5"
    assert move.share == pytest.approx(shares["s5"] * dots["s5"] / move_sq, rel=1e-12)
    assert move.spread == pytest.approx(math.sqrt(norms["s5"]) / others, rel=1e-12)
    # norms measured by the sites: the same move, the same figures
    screen = UploadScreen(RobustnessConfig(), None)
    known = {s: screen.measure(u, ref).norm_sq for s, u in ups.items()}
    assert known == pytest.approx(norms, rel=1e-12)
    again = abnormal_move(7, ups, shares, ref, new, norms_sq=known)
    assert again.site == move.site and again.share == pytest.approx(move.share, rel=1e-12)
    assert again.spread == update_spreads({s: math.sqrt(v) for s, v in norms.items()})["s5"]  # the loop's norms
    calm = {s: u for s, u in ups.items() if s != "s5"}  # no update 4× the others': no move, no dot computed
    assert abnormal_move(7, calm, {s: 1 / 8 for s in calm}, ref, weighted_average(calm, dict.fromkeys(calm, 1.0)),
                         norms_sq={s: known[s] for s in calm}) is None


def test_an_upload_measured_by_its_site_is_screened_as_one_measured_here():
    g = torch.Generator().manual_seed(2)
    ref = {"model.w": torch.randn(400, generator=g), "model.b": torch.randn(7, generator=g)}
    honest = {f"s{i}": {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in ref.items()} for i in range(4)}
    far = {k: v + 100 * torch.randn(v.shape, generator=g) for k, v in ref.items()}  # over max_update_ratio
    weights = {s: 10.0 for s in [*honest, "far"]}
    outcomes = []
    for measured in (False, True):
        screen = UploadScreen(RobustnessConfig(on_rejected="exclude"), None)
        rounds = []
        for r in (1, 2):
            uploads = {**honest, "far": far}
            if r == 2:  # a replay of round 1's upload
                uploads = {**uploads, "s1": honest["s1"]}
                uploads["s0"] = {k: v + 0.01 for k, v in honest["s0"].items()}
                uploads["s2"] = {k: v - 0.01 for k, v in honest["s2"].items()}
                uploads["s3"] = {k: v * 1.01 for k, v in honest["s3"].items()}
            facts = {s: screen.measure(u, ref) for s, u in uploads.items()} if measured else None
            accepted, kept, rejected = screen.screen(r, uploads, weights, ref, facts)
            rounds.append((sorted(accepted), kept, rejected))
        outcomes.append((rounds, screen.digests))
    assert outcomes[0] == outcomes[1]
    rounds = outcomes[0][0]
    assert "far" in rounds[0][2] and "max_update_ratio" in rounds[0][2]["far"]
    assert "exactly the upload it sent in round 1" in rounds[1][2]["s1"]


def test_facts_over_other_tensors_are_not_used():
    """Facts measured against another reference's tensors (names differ) are measured again here."""
    ref = {"model.w": torch.ones(5)}
    up = {"model.w": torch.full((5,), 1e6)}
    screen = UploadScreen(RobustnessConfig(), None)
    wrong = screen.measure(up, {"model.v": torch.ones(5)})._replace(norm_sq=0.0)
    _, _, rejected = screen.screen(1, {"a": up}, {"a": 1.0}, ref, {"a": wrong})
    assert "max_update_ratio" in rejected["a"]
