"""The aggregator's screen of every round's uploads (:class:`UploadScreen`): each upload checked
alone (weight, the plugin's checks of meaning, update size, replay) and against the others of its
round; accepted ones clipped when the plan says so; a non-finite aggregate traced to the upload that
caused it; abnormal moves of the global model remembered to name a likely cause (:mod:`.blame`)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..aggregation import UploadError, normalised_weights
from ..config import MIN_ROBUST_SITES
from ..errors import FedContrastError
from ..tensors import InvalidUploadError, shared
from .blame import BLAME_WINDOW, Move, _cosine_to, _non_finite, _round_spans, abnormal_move, all_rejected_hint
from .replay import ReceivedSketches, ReplayMark, SketchHistory, stale, upload_digest, upload_sketch
from .updates import (
    _reference_norm,
    _shared_weight_names,
    _update_norm,
    _update_norm_sq,
    _weight_names,
    clip_update,
    update_cosines,
    update_spreads,
)

if TYPE_CHECKING:
    from ..algorithms.base import Downlink

logger = logging.getLogger("fedcontrast.robust")  # the package's name: one logger for the screen, as before

COUNT_NOISE_ALLOWANCE = 6.0  # standard deviations of a noised count's noise allowed above the declared bound


class RejectedUpload(FedContrastError):
    """An upload the aggregator does not take; the message names the site and the reason.
    ``model_may_explain``: the global model the site received may be the cause (its update over the
    bound may be a correction), so an earlier abnormal move of that model is named with it."""

    def __init__(self, message: str, *, model_may_explain: bool = False) -> None:
        super().__init__(message)
        self.model_may_explain = model_may_explain


class UploadFacts(NamedTuple):
    """What the screen measures of one upload on its own (:meth:`UploadScreen.measure`), against the
    global model its site received: the model tensors its update is over (``names``), the update's
    squared norm ``‖w_k − w‖²`` (None when it has none), its replay mark (None when the plan does not
    reject replays) and whether every value is finite (a finite sum of each tensor). A simulated site
    measures its own upload where it trains, with this code, so that the simulator's aggregator does
    not measure each upload again; a deployed aggregator measures what arrives itself (an engine
    passes no facts)."""
    names: tuple[str, ...]
    norm_sq: float | None
    mark: ReplayMark | None
    finite: bool = False  # every value finite (False: not known, the aggregator checks them)


def _finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def _magnitude(upload: Mapping[str, torch.Tensor]) -> float:
    values = [float(t.detach().abs().max()) for t in upload.values() if t.is_floating_point() and t.numel()]
    return max(values, default=0.0)


class UploadScreen:
    """One per engine, across rounds (it remembers what each site sent, to spot replays, and which
    uploads moved the global model abnormally, to name them; in memory: a restarted aggregator
    forgets the moves).

    ``config``: the plan's :class:`~fedcontrast.config.RobustnessConfig`; ``algorithm``: the plugin
    (its :meth:`check_upload`); ``count_noise``: the standard deviation of the noise on released
    sample counts (DP), 0 when counts are exact."""

    def __init__(self, config: Any, algorithm: Any, *, count_noise: float = 0.0) -> None:
        self.config = config
        self.algorithm = algorithm
        self.count_noise = float(count_noise)
        self.digests: dict[str, dict[str, int]] = {}  # site → digest → round it was first sent
        self.fresh: dict[str, str] = {}  # site → its digest first sent in the round screen() saw last
        self.sketches: dict[str, SketchHistory] = {}  # site → the sketches of its accepted uploads (.replay)
        self.moves: list[Move] = []  # the last abnormal moves of the global model, oldest first
        self.moved: dict[str, list[int]] = {}  # site → every round in which its upload moved the model abnormally
        self.causes: dict[int, dict[str, Move]] = {}  # round → site named as a likely cause → its move
        self._move_vector: tuple[int, dict[str, torch.Tensor]] | None = None  # the last abnormal move's M
        self._reference: Mapping[str, torch.Tensor] | None = None  # the model the current round's sites received
        self._noted: set[tuple[int, str]] = set()  # (round, site) whose rejection screen() explained already
        self._facts: dict[str, UploadFacts] = {}  # the current round's accepted uploads as their sites measured them
        self._measured_against: tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]] | None = None  # measure()
        self._received = ReceivedSketches()  # each round's global model, sketched (min_progress: .replay)

    # single checks, each raising RejectedUpload naming the site
    def max_samples(self, site: str) -> float | None:
        bound = self.config.max_samples
        if isinstance(bound, Mapping):
            if site not in bound:  # a plan's mapping names every site (RunConfig); anything else is not bounded here
                raise RejectedUpload(f"site {site!r} has no bound in the plan's max_samples mapping (it names "
                                     f"{', '.join(map(str, bound))}), so its claimed samples cannot be checked; "
                                     "rejected")
            bound = bound[site]
        return None if bound is None else float(bound)

    def check_weight(self, site: str, weight: Any) -> None:
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise RejectedUpload(f"site {site!r} claimed an aggregation weight (sample count) of {weight!r}, which "
                                 "is not a finite number >= 0; rejected")
        bound = self.max_samples(site)
        if bound is not None:
            allowed = bound + COUNT_NOISE_ALLOWANCE * self.count_noise
            if weight > allowed:
                noise = f" plus {COUNT_NOISE_ALLOWANCE:g}σ of count noise" if self.count_noise else ""
                raise RejectedUpload(f"site {site!r} claimed {weight:.6g} samples, more than the plan's max_samples "
                                     f"{bound:g} for it{noise} (by {weight / allowed:.3g}×); rejected")

    def check_update(self, site: str, upload: Mapping[str, torch.Tensor],
                     reference: Mapping[str, torch.Tensor] | None,
                     reference_norms: dict[tuple[str, ...], float] | None = None,
                     facts: UploadFacts | None = None) -> float | None:
        """Returns the update's norm ``‖w_k − w‖`` when it was computed, else None. ``reference_norms``:
        ``‖w‖`` per set of model tensors, filled and reused across one round's sites; ``facts``: the
        upload as measured where it was made (:meth:`measure`)."""
        ratio = self.config.max_update_ratio
        if ratio is None or not reference:
            return None
        names = _weight_names(upload, reference)
        if not names:
            return None
        if facts is not None and facts.norm_sq is not None and facts.names == tuple(names):
            norm = math.sqrt(facts.norm_sq)  # as _update_norm computes it, measured where the upload was made
        else:
            norm = _update_norm(upload, reference, names)
        reference_norms = {} if reference_norms is None else reference_norms
        if tuple(names) not in reference_norms:
            reference_norms[tuple(names)] = _reference_norm(reference, names)
        ref_norm = reference_norms[tuple(names)]
        if ref_norm == 0 and math.isfinite(norm):
            return norm  # an all-zero global model gives no scale to compare with
        if not math.isfinite(norm):
            raise RejectedUpload(f"site {site!r} uploaded a model update whose norm is not finite (NaN or infinite), "
                                 f"so not within the plan's max_update_ratio {ratio:g}; rejected",
                                 model_may_explain=True)
        if norm > ratio * ref_norm:
            measured = norm / ref_norm
            raise RejectedUpload(f"site {site!r} uploaded a model update of norm {norm:.4g}, {measured:.3g}× the "
                                 f"global model's norm {ref_norm:.4g}, above the plan's max_update_ratio {ratio:g} "
                                 f"(by {measured / ratio:.3g}×); rejected", model_may_explain=True)
        return norm

    def check_replay(self, site: str, upload: Mapping[str, torch.Tensor], round_num: int,
                     mark: ReplayMark | None = None, reference: Mapping[str, torch.Tensor] | None = None,
                     names: tuple[str, ...] | None = None) -> ReplayMark | None:
        """The upload's digest and sketch, or None when the plan does not reject replays (nothing hashed);
        an exact copy of one of the site's earlier uploads, a near-copy or a stale one (:mod:`.replay`) is
        rejected. ``mark``, ``names``: as measured where the upload was made (:meth:`measure`)."""
        if not self.config.reject_replays:
            return None
        digest = upload_digest(upload) if mark is None else mark.digest
        first = self.digests.get(site, {}).get(digest)
        if first is not None and first != round_num:
            raise RejectedUpload(f"site {site!r} sent in round {round_num} exactly the upload it sent in round "
                                 f"{first} (a replay, not fresh work); rejected")
        sketch = upload_sketch(upload) if mark is None else mark.sketch
        follows = bool(self.config.min_progress) and getattr(self.algorithm, "uploads_follow_global", True)
        names, received = self._received.of(upload, reference if follows else None, names, round_num)
        found = stale(sketch, self.sketches.get(site), received=received, names=names,
                      min_progress=self.config.min_progress, skip_round=round_num)
        if found is not None and first is None:
            raise RejectedUpload(found.sentence(site, round_num, self.config.min_progress))
        return ReplayMark(digest, sketch, (names, received))

    def check(self, site: str, upload: Mapping[str, torch.Tensor], weight: Any, round_num: int,
              reference: Mapping[str, torch.Tensor] | None,
              reference_norms: dict[tuple[str, ...], float] | None = None,
              facts: UploadFacts | None = None) -> tuple[ReplayMark | None, float | None]:
        """Every check of one site's (already shape-validated) upload; returns its digest (None when
        replays are not checked) and its update's norm (None when not computed). ``facts``: the upload
        as measured where it was made (:meth:`measure`): the same checks, without measuring it again."""
        self.check_weight(site, weight)
        try:
            check = getattr(self.algorithm, "check_upload", None)  # the plugin's UploadChecks capability, if any
            if check is not None:
                check(site, upload, float(weight))
        except InvalidUploadError as exc:
            raise RejectedUpload(str(exc)) from None
        norm = self.check_update(site, upload, reference, reference_norms, facts)
        mark, names = (None, None) if facts is None else (facts.mark, facts.names)
        return self.check_replay(site, upload, round_num, mark, reference, names), norm

    def measure(self, upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor] | None) -> UploadFacts:
        """What :meth:`check` and :meth:`note_move` measure of ``upload`` on its own, against the global
        model ``reference`` its site received: for a simulated site to measure where it trains."""
        names = _weight_names(upload, reference) if reference else []
        norm_sq = _update_norm_sq(upload, reference, names, self._reference64(reference, names)) \
            if names and reference else None
        mark = ReplayMark(upload_digest(upload), upload_sketch(upload)) if self.config.reject_replays else None
        finite = all(bool(torch.isfinite(t.sum())) for t in upload.values() if t.is_floating_point())
        return UploadFacts(shared(tuple(names)), norm_sq, mark, finite)

    def _reference64(self, reference: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
        """``reference``'s tensors ``names`` in float64 on the CPU, converted once for every upload measured
        against the same reference (the sites of a round or of a Ray task); the mapping is held, so
        that another one is never mistaken for it."""
        if self._measured_against is None or self._measured_against[0] is not reference:
            self._measured_against = (reference, {})
        converted = self._measured_against[1]
        for name in names:
            if name not in converted:
                converted[name] = reference[name].detach().to("cpu", torch.float64)
        return converted

    def check_across(self, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                     reference: Mapping[str, torch.Tensor] | None) -> dict[str, str]:
        """The plan's checks of each update against the other sites' (``max_update_spread``,
        ``min_update_cosine``) when at least :data:`MIN_ROBUST_SITES` uploads carry model weights:
        site → why it is rejected. The direction check rejects the lowest cosine first and recomputes
        without it (a hostile site is among every honest site's "others"), while 3 sites remain."""
        spread, cosine = self.config.max_update_spread, self.config.min_update_cosine
        if (spread is None and cosine is None) or not reference:
            return {}
        sites = [s for s in sorted(uploads) if _weight_names(uploads[s], reference)]
        if len(sites) < MIN_ROBUST_SITES:
            return {}
        rejected: dict[str, str] = {}
        if spread is not None:
            names = _shared_weight_names({s: uploads[s] for s in sites}, reference)
            norms = {s: _update_norm(uploads[s], reference, names) for s in sites}
            for site, measured in update_spreads(norms).items():
                if not measured <= spread:
                    rejected[site] = (f"site {site!r} uploaded a model update of norm {norms[site]:.4g}, "
                                      f"{measured:.3g}× the median norm of the other sites' updates, above the plan's "
                                      f"max_update_spread {spread:g}; rejected")
        if cosine is not None:
            active = [s for s in sites if s not in rejected]
            while len(active) >= MIN_ROBUST_SITES:
                cosines = update_cosines({s: uploads[s] for s in active}, reference)
                if not cosines:
                    break
                worst = min(cosines, key=lambda s: (cosines[s], s))
                if cosines[worst] >= cosine:
                    break
                rejected[worst] = (f"site {worst!r}'s model update points away from the other sites' (cosine "
                                   f"{cosines[worst]:.3f} to the coordinate-wise median of their update directions), "
                                   f"below the plan's min_update_cosine {cosine:g}; rejected")
                active.remove(worst)
        return rejected

    # blame
    def likely_cause(self, round_num: int, site: str | None = None) -> Move | None:
        """The most recent abnormal move of the global model in the :data:`BLAME_WINDOW` rounds before
        ``round_num`` whose mover is not ``site``, or None."""
        return next((m for m in reversed(self.moves)
                     if m.site != site and 0 < round_num - m.round <= BLAME_WINDOW), None)

    def earlier_moves(self, site: str | None = None) -> str:
        """Every other site's upload that moved the global model abnormally so far in the run, with
        its rounds ('' when none): stated as a fact where no move is recent enough to be the likely
        cause (a slow attacker's upload dwarfs the honest ones only until the model it wrecks makes
        theirs large too)."""
        named = [f"site {s!r}'s upload (round{'s' if len(r) > 1 else ''} {_round_spans(r)})"
                 for s, r in sorted(self.moved.items()) if s != site]
        return ("the global model was moved abnormally by " + " and ".join(named)) if named else ""

    def cause_note(self, round_num: int, site: str, upload: Mapping[str, torch.Tensor] | None = None,
                   reference: Mapping[str, torch.Tensor] | None = None) -> str:
        """What to add to a rejection of ``site``'s upload that the global model may explain: the
        upload that moved that model abnormally, named as the likely cause ('' when there is none);
        with ``upload`` and ``reference``, whether the update points back against that move."""
        move = self.likely_cause(round_num, site)
        if move is None:
            earlier = self.earlier_moves(site)
            return f" — earlier in this run {earlier}" if earlier else ""
        self.causes.setdefault(round_num, {})[move.site] = move
        back = ""
        if upload is not None and reference and self._move_vector is not None and self._move_vector[0] == move.round:
            cos = _cosine_to(upload, reference, self._move_vector[1])
            if cos is not None and cos < 0:
                back = f"; its update points back against that move (cosine {cos:.2f})"
        return (f" — but the global model it received was moved abnormally in round {move.round} by site "
                f"{move.site!r}'s upload ({move.describe()}), so site {move.site!r} is the likely cause and this "
                f"update may be a correction{back}")

    def explain(self, round_num: int, rejected: Mapping[str, str], accepted: bool) -> tuple[dict[str, str], str]:
        """The round's rejections as the engines report them: a non-finite upload gets the likely cause
        added (:meth:`cause_note`), unless nothing is left to aggregate and every upload is non-finite,
        when the hint (second value) names the global model and its likely cause instead."""
        cause = self.likely_cause(round_num)
        hint = "" if accepted else all_rejected_hint(rejected, max_update_ratio=self.config.max_update_ratio,
                                                     cause=cause, earlier=self.earlier_moves())
        if hint:
            if cause is not None:
                self.causes.setdefault(round_num, {})[cause.site] = cause
            return dict(rejected), hint
        out = {}
        for site, reason in rejected.items():
            if _non_finite(reason) and (round_num, site) not in self._noted:  # not explained by screen() already
                reason += self.cause_note(round_num, site)
            out[site] = reason
        return out, ""

    # the round
    def screen(self, round_num: int, uploads: Mapping[str, dict[str, torch.Tensor]], weights: Mapping[str, Any],
               reference: Mapping[str, torch.Tensor] | None, facts: Mapping[str, UploadFacts] | None = None
               ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float], dict[str, str]]:
        """``(accepted uploads, their weights, rejected site → reason)``; accepted uploads are clipped
        when the plan says so, and remembered for replay detection. ``round_num``: the round as the
        run's records count it (1 = the round that makes model 1). ``facts``: site → its upload as
        measured where it was made (:meth:`measure`; a simulated site's), for the same checks without
        measuring the uploads again."""
        facts = facts or {}
        self._reference, self._facts, self.fresh = reference or None, {}, {}
        self.causes = {r: c for r, c in self.causes.items() if r >= round_num}
        self._noted = {(r, s) for r, s in self._noted if r >= round_num}
        passed, rejected = {}, {}
        reference_norms: dict[tuple[str, ...], float] = {}  # ‖w‖, computed once this round
        for site in sorted(uploads):
            try:
                passed[site] = self.check(site, uploads[site], weights.get(site), round_num, reference, reference_norms,
                                          facts.get(site))
            except RejectedUpload as exc:
                note = self.cause_note(round_num, site, uploads[site], reference) if exc.model_may_explain else ""
                self._noted.add((round_num, site))
                rejected[site] = f"round {round_num}: {exc}{note}"
        for site, reason in self.check_across({s: uploads[s] for s in passed}, reference).items():
            rejected[site] = f"round {round_num}: {reason}"
            del passed[site]
        accepted, kept = {}, {}
        for site, (digest, norm) in passed.items():
            if digest is not None:
                if self.digests.setdefault(site, {}).setdefault(digest.digest, round_num) == round_num:
                    self.fresh[site] = digest.digest
                if site not in self.sketches:
                    self.sketches[site] = SketchHistory()
                self.sketches[site].add(round_num, digest.sketch[0], digest.sketch[1], *digest.received)
            upload = uploads[site]
            if self.config.clip_update_norm is not None and reference:
                upload = clip_update(upload, reference, self.config.clip_update_norm, norm=norm)
            elif site in facts:  # the upload aggregated is the one measured: note_move may use its norm
                self._facts[site] = facts[site]
            accepted[site], kept[site] = upload, float(weights[site])
        if self.config.rule != "mean" and 0 < len(accepted) < MIN_ROBUST_SITES:
            logger.warning("round %d: only %d upload(s) to combine, so rule %s tolerates no hostile site this round",
                           round_num, len(accepted), self.config.rule)
        return accepted, kept, rejected

    def note_move(self, round_num: int, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                  weights: Mapping[str, float], new: Mapping[str, torch.Tensor]) -> Move | None:
        """Remember round ``round_num``'s move of the global model (from the model this round's sites
        received to ``new``) when it was abnormal (:func:`abnormal_move`); returns it."""
        reference = self._reference
        if not reference or not uploads:
            return None
        if self.config.rule == "mean":
            try:
                shares = normalised_weights({s: float(weights[s]) for s in uploads})
            except UploadError:  # every weight 0: the plugin's own fallback, counted equally here
                shares = {s: 1 / len(uploads) for s in uploads}
        else:  # median, trimmed mean: unweighted
            shares = {s: 1 / len(uploads) for s in uploads}
        names = tuple(n for n in _shared_weight_names(uploads, reference) if n in new)
        known = {s: f.norm_sq for s, f in self._facts.items()
                 if s in uploads and f.norm_sq is not None and f.names == names}
        move = abnormal_move(round_num, uploads, shares, reference, new, norms_sq=known)
        if move is None:
            return None
        self.moves = [*self.moves[-BLAME_WINDOW:], move]
        self.moved.setdefault(move.site, []).append(round_num)
        self._move_vector = (round_num, {n: (new[n].detach().to("cpu", torch.float64)
                                             - reference[n].detach().to("cpu", torch.float64)).to(torch.float32)
                                         for n in _shared_weight_names(uploads, reference) if n in new})
        logger.warning("round %d: site %r's upload moved the global model abnormally (%s)", round_num, move.site,
                       move.describe())
        return move

    def aggregate(self, aggregate: Callable[[Mapping[str, Mapping[str, torch.Tensor]], Mapping[str, float]], Downlink],
                  uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  state: dict[str, Any] | None = None, round_num: int = 0) -> tuple[Downlink, dict[str, str]]:
        """``aggregate(uploads, weights)`` → the plugin's downlink; when it is not finite, the sites are
        left out one at a time, largest upload first, until it is (``state``, the server state, is
        restored before each attempt). Returns ``(downlink, rejected site → reason)``; the move of the
        global model is noted (:meth:`note_move`)."""
        saved = copy.deepcopy(state) if state is not None else None
        downlink = aggregate(uploads, weights)
        if _finite(downlink.global_tensors) and all(_finite(t) for t in downlink.personal.values()):
            self.note_move(round_num, uploads, weights, downlink.global_tensors)
            return downlink, {}
        order = sorted(uploads, key=lambda s: -_magnitude(uploads[s]))
        for site in order:
            rest = {s: u for s, u in uploads.items() if s != site}
            if not rest:
                break
            if state is not None and saved is not None:  # saved: a copy of state
                state.clear()
                state.update(copy.deepcopy(saved))
            candidate = aggregate(rest, {s: weights[s] for s in rest})
            if _finite(candidate.global_tensors) and all(_finite(t) for t in candidate.personal.values()):
                reason = (f"round {round_num}: site {site!r}'s upload made the aggregated global model non-finite (NaN "
                          "or infinite "
                          f"values; its largest value {_magnitude(uploads[site]):.3g}); rejected")
                self.note_move(round_num, rest, weights, candidate.global_tensors)
                return candidate, {site: reason}
        raise FedContrastError(f"round {round_num}: the aggregated global model is not finite and no single site's "
                               "upload explains it; "
                               "nothing was sent to the sites (check the plan's settings, e.g. the learning rate)")
