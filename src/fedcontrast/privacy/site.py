"""A site's privacy: the mechanisms the plan turns on, their noise source, and the accountant state.

The engine (the simulator, an OpenFL collaborator or a Flower site) builds one :class:`SitePrivacy`
per task and puts it into ``SiteContext.privacy``; plugins reach it only through
``site.class_sums(...)`` and ``train_supervised(private=site.privacy)``.

The history lives in ``site.state["privacy.history"]`` as ``[round, noise_multiplier, sample_rate,
steps]`` lists (rounds counted from 1): the engine persists the state per site
(``local_state/sites/NAME.pt`` under OpenFL), so the cumulative ε survives restarts.

Noise must be unpredictable to the aggregator: the plan (and its seed) is shared with it, so under
OpenFL the generator is seeded from the operating system (``secrets``). The simulator passes a
seed derived from the task seed, for reproducible experiments only.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
from torch import nn

from ..config import PrivacyConfig
from ..devices import device_generator
from ..seeds import derive_seed
from .accounting import RELEASE_MECHANISMS, compact, count_history, epsilon

# secure_csprng_available lives beside the Opacus code that needs it; re-exported (imported from here before)
from .dp_sgd import DPSGDSession, secure_csprng_available
from .representations import GaussianClassSums, gaussian_noise, gaussian_public_representations, public_release_history

HISTORY_KEY = "privacy.history"
COUNT_KEY = "privacy.released_count"  # the sample count as released once (noised), reused every round


def history_of(state: dict[str, Any], round_num: int | None = None) -> list[list[float]]:
    """``[noise_multiplier, sample_rate, steps]`` entries recorded in ``state`` (of one round, if given)."""
    rows = state.get(HISTORY_KEY) or []
    return [list(r[1:]) for r in rows if round_num is None or int(r[0]) == round_num]


class SitePrivacy:
    """``noise_seed=None`` (a deployment): the noise generator is seeded from the operating system and,
    unless the plan says ``secure_mode: false``, noise is sampled securely (see
    :func:`~.representations.gaussian_noise`); a seed (the simulator): reproducible, secure sampling
    only when the plan says ``secure_mode: true``."""

    def __init__(self, config: PrivacyConfig, state: dict[str, Any], *, round_num: int,
                 noise_seed: int | None = None) -> None:
        self.config = config
        self.secure = config.secure_mode if config.secure_mode is not None else noise_seed is None
        self.dp_sgd = config.dp_sgd
        self.representations = config.representations
        self.state = state
        self.round_num = round_num
        # The host generator: count noise, representation noise (drawn on the CPU, then moved) and
        # DP-SGD's Poisson batches. DP-SGD's gradient noise is drawn where the model is (noise_generator).
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(noise_seed if noise_seed is not None else secrets.randbits(63))
        self._sessions = 0

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` for one DP-SGD session's gradient noise, seeded from this task's
        noise seed and the session's number (never the same stream twice; secret when the seed is)."""
        self._sessions += 1
        return device_generator(device, derive_seed(self.generator.initial_seed(), self._sessions))

    # --- accounting -----------------------------------------------------------------------------
    def record(self, entries: list[list[float]]) -> None:
        rows = self.state.setdefault(HISTORY_KEY, [])
        rows.extend([float(self.round_num), float(s), float(q), int(n)] for s, q, n in compact(entries))

    def epsilon(self, round_num: int | None = None) -> float:
        return epsilon(history_of(self.state, round_num), delta=self.config.delta, accountant=self.config.accountant)

    def metrics(self) -> dict[str, float]:
        """``dp_epsilon`` (cumulative, at ``delta``) and ``dp_epsilon_round`` (this round alone)."""
        if not self.state.get(HISTORY_KEY):
            return {}
        return {"dp_epsilon": self.epsilon(), "dp_epsilon_round": self.epsilon(self.round_num)}

    # --- mechanisms -----------------------------------------------------------------------------
    def released_count(self, n: float) -> float:
        """The site's sample count as it may leave: ``n + N(0, σ_n²)`` drawn once (the first time it
        is asked, recorded in the history), then the same value every round — post-processing of
        one release. At least 1: a weight must be positive (post-processing too)."""
        if COUNT_KEY not in self.state:
            sigma = self.config.count_noise_multiplier
            noisy = float(n) + float(gaussian_noise((1,), sigma, self.generator, secure=self.secure)[0])
            self.state[COUNT_KEY] = max(1.0, noisy)
            self.record(count_history(self.config))
        return float(self.state[COUNT_KEY])

    def training_session(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, num_samples: int,
                         batch_size: int):
        device = next(model.parameters()).device
        assert self.dp_sgd is not None  # a DP-SGD session only where the plan has dp_sgd
        return DPSGDSession(model, optimizer, num_samples=num_samples, batch_size=batch_size,
                            noise_multiplier=self.dp_sgd.noise_multiplier, max_grad_norm=self.dp_sgd.max_grad_norm,
                            generator=self.generator, noise_generator=self.noise_generator(device),
                            on_close=self.record, secure=self.secure)

    def class_sums(self, num_classes: int, dim: int, num_samples: int, device: torch.device) -> GaussianClassSums:
        rep = self.representations
        assert rep is not None  # representation DP only where the plan has it
        return GaussianClassSums(num_classes, dim, num_samples, device, noise_multiplier=rep.noise_multiplier,
                                 clip=rep.clip, generator=self.generator, secure=self.secure,
                                 on_release=lambda: self.record([[rep.noise_multiplier, 1.0, RELEASE_MECHANISMS]]))

    def public_representations(self, z: torch.Tensor) -> torch.Tensor:
        """FLESD's public-set release (:func:`gaussian_public_representations`), recorded."""
        assert self.representations is not None  # representation DP only where the plan has it
        sigma = self.representations.noise_multiplier
        noisy, _ = gaussian_public_representations(z, noise_multiplier=sigma, generator=self.generator,
                                                   secure=self.secure)
        self.record(public_release_history(sigma))
        return noisy


__all__ = ["COUNT_KEY", "HISTORY_KEY", "SitePrivacy", "history_of", "secure_csprng_available"]
