"""DP-SGD of a site's local training through Opacus (``PrivacyEngine``, ``ModuleValidator``).

The shared loop (:func:`fedcontrast.algorithms.training.train_supervised`) asks the site's privacy
object for a :class:`DPSGDSession` and trains through it: the model wrapped for per-sample
gradients (Opacus ``GradSampleModule``, hooks on ``Linear``/``Conv2d``/``GroupNorm``…), the optimizer
wrapped to clip each sample's gradient to ``max_grad_norm`` and add ``N(0, σ²·max_grad_norm²)``,
and Poisson batches (each sample in a batch with probability ``q = 1/⌈n/B⌉``). The session's
accountant history is Opacus's own, handed back when the session closes.

Which losses are correct under per-sample clipping: any loss that is a mean of per-sample terms given
frozen references — cross-entropy, MOON's ``l_con`` (its custom autograd function yields per-sample
gradients through ``z``), FedSSC's ``l_glob`` against the received class representations. A term
whose gradient does not flow through a module's forward (FedProx's proximal term acts on the
parameters directly) is dropped by Opacus, which is why FedProx does not declare ``dp_sgd``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

from ..errors import ConfigError

_NOISE_SAID: set[tuple[bool, bool]] = set()


def secure_csprng_available() -> bool:
    """Whether Opacus's full ``secure_mode`` can run here (it needs the ``torchcsprng`` package)."""
    import importlib.util

    return importlib.util.find_spec("torchcsprng") is not None


def _say_how_noise_is_sampled(secure: bool, csprng: bool) -> None:
    """One log line per process (and kind) saying how DP-SGD's noise is sampled, as the audit says it."""
    if (secure, csprng) in _NOISE_SAID:
        return
    _NOISE_SAID.add((secure, csprng))
    if csprng:
        how = "secure: Opacus secure_mode with torchcsprng (batches and noise from a CSPRNG)"
    elif secure:
        how = ("secure against floating-point attacks: Opacus's safe Gaussian sampling from an OS-seeded generator "
               "(torchcsprng, which Opacus's full secure_mode needs, is not installed)")
    else:
        how = "not secure (privacy.secure_mode: false, or a seeded simulation): plain Gaussian sampling"
    logging.getLogger(__name__).info("DP-SGD noise: %s", how)


_Module = TypeVar("_Module", bound=nn.Module)  # make_dp_compatible returns the class it is given


def make_dp_compatible(model: _Module) -> _Module:
    """``ModuleValidator.fix`` (BatchNorm → GroupNorm, …) then ``validate``; a model Opacus cannot
    train privately raises ConfigError naming the problem. Every party builds the same fixed model,
    so the weights that travel keep one shape. In-place activations are made out-of-place: Opacus's
    backward hooks return views that an in-place ReLU may not modify."""
    from .accounting import import_opacus

    import_opacus()
    from opacus.validators import ModuleValidator

    if not ModuleValidator.is_valid(model):
        model = ModuleValidator.fix(model)
    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False  # type: ignore[assignment]  # torch types module attributes as Tensor | Module
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(f"the model cannot be trained with DP-SGD: {errors[0]}")
    return model


class DPSGDSession:
    """One local training under DP-SGD. Use ``model``, ``optimizer`` and ``epoch_batches()`` in place
    of the plain ones, then ``close()`` (removes Opacus's hooks from the caller's model)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, num_samples: int, batch_size: int,
                 noise_multiplier: float, max_grad_norm: float, generator: torch.Generator,
                 noise_generator: torch.Generator | None = None, on_close: Callable[[list], None] | None = None,
                 secure: bool = False) -> None:
        """``generator`` (on the CPU) draws the Poisson batches; ``noise_generator`` (on the model's
        device; default ``generator``, for a model on the CPU) the gradient noise."""
        from .accounting import import_opacus

        import_opacus()
        from opacus import PrivacyEngine
        from opacus.data_loader import DPDataLoader

        # secure: Opacus's full secure_mode (a CSPRNG for batches and noise) where torchcsprng is
        # installed; otherwise its floating-point-safe noise sampling with our OS-seeded generator.
        self.csprng = secure and secure_csprng_available()
        with warnings.catch_warnings():  # Opacus's "Secure RNG turned off" (untrue when secure): one true line instead
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            self.engine = PrivacyEngine(accountant="rdp", secure_mode=self.csprng)  # its history is all we read
        _say_how_noise_is_sampled(secure, self.csprng)
        device = next(model.parameters()).device
        noise_generator = generator if noise_generator is None else noise_generator
        if generator.device.type != "cpu" or noise_generator.device != device:
            raise ValueError(f"DP-SGD needs its batch generator on the CPU and its noise generator on the model's "
                             f"device {device}; got {generator.device} and {noise_generator.device}")
        indices = torch.utils.data.TensorDataset(torch.arange(num_samples, device="cpu"))
        plain = torch.utils.data.DataLoader(indices, batch_size=batch_size)
        if self.csprng:  # Opacus draws the Poisson batches and the noise from its CSPRNG (no seed allowed)
            self.model, self.optimizer, self.loader = self.engine.make_private(
                module=model, optimizer=optimizer, data_loader=plain, noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm, poisson_sampling=True)
        else:  # Poisson sampling and noise drawn from our generator (PrivacyEngine would use the global RNG)
            loader = DPDataLoader.from_data_loader(plain, generator=generator)
            self.model, self.optimizer, self.loader = self.engine.make_private(
                module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm, poisson_sampling=False,  # the loader above already is Poisson
                noise_generator=noise_generator)
        if secure:
            self.optimizer.secure_mode = True  # Opacus's floating-point-safe noise sampling
        # The true Poisson rate q = 1/⌈n/B⌉. Opacus's accountant records 1/len(loader), and len(loader) =
        # int(1/q) is ⌈n/B⌉ − 1 whenever float rounding makes 1/(1/k) fall below k (k = 93, 99, 105, …):
        # that would over-state ε and disagree with the plan. The steps themselves (int(1/q) per epoch)
        # are what the sampler draws, so only the rate is replaced (see close()).
        self.sample_rate = self.loader.sample_rate
        self.noise_multiplier = noise_multiplier
        self.on_close = on_close
        self.model.forbid_grad_accumulation()

    def epoch_batches(self) -> Iterator[torch.Tensor]:
        """One epoch of Poisson batches of sample indices (an empty batch is skipped but still
        counted by the accountant: conservative; it has probability (1 − q)^n)."""
        with torch.device("cpu"):  # Opacus draws the batches with torch's default device: the host's
            batches = list(self.loader)
        for (idx,) in batches:
            if len(idx) == 0:
                self.engine.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
                continue
            yield idx

    def close(self) -> list[list[float]]:
        """Remove the hooks; returns (and passes to ``on_close``) the accountant history of this session."""
        self.model._close()
        history = [[float(s), float(self.sample_rate), int(n)] for s, _, n in self.engine.accountant.history]
        if self.on_close is not None:
            self.on_close(history)
        return history
