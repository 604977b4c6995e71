"""SimCLR's two augmented views of a batch, batched on the tensor's device (FLESD's local training).

Every sample gets its own random parameters, yet each view is one ``affine_grid``/``grid_sample``
call plus a few element-wise ops: no Python loop over samples. The images are the normalised
tensors of :class:`~fedcontrast.data.datasets.ArrayDataset`, so colour jitter works in those units
(see :func:`simclr_views`). All randomness comes from the caller's ``torch.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError

# Per-sample uniforms drawn for each view, always all of them, so that the stream of random numbers
# (and hence every view) does not depend on which augmentations are switched on.
_AREA, _RATIO, _CX, _CY, _SHIFT_X, _SHIFT_Y, _FLIP, _BRIGHT, _CONTRAST = range(9)
_NUM_UNIFORMS = 9


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ViewConfig:
    """The augmentation settings of :func:`simclr_views`, validated; a plugin can hold it as hyper-parameters.

    - ``crop_scale``: range of the crop's area as a fraction of the image, ``0 < lo ≤ hi ≤ 1``.
    - ``ratio``: range of the crop's aspect ratio (width/height), drawn log-uniformly; must contain 1.
    - ``max_shift``: extra translation of the crop, up to this fraction of the image side in each
      direction, ``[0, 1]`` (pixels that come from outside the image repeat the border).
    - ``flip``: random horizontal flips (off by default: digits are not mirror-symmetric).
    - ``jitter``: brightness/contrast strength, ``[0, 1]``.
    - ``noise_std``: standard deviation of added Gaussian noise, ``≥ 0``.
    """

    crop_scale: tuple[float, float] = (0.6, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    max_shift: float = 0.1
    flip: bool = False
    jitter: float = 0.4
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        for name in ("crop_scale", "ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_number(v) for v in value)):
                raise ConfigError(f"{name} must be a pair of finite numbers (low, high), got {value!r}.")
            object.__setattr__(self, name, (float(value[0]), float(value[1])))  # lists from a plan file
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ConfigError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}.")
        lo, hi = self.ratio
        if not 0 < lo <= 1 <= hi:
            raise ConfigError(f"ratio must satisfy 0 < low <= 1 <= high, got {self.ratio}.")
        if not (_is_number(self.max_shift) and 0 <= self.max_shift <= 1):
            raise ConfigError(f"max_shift must be a number in [0, 1], got {self.max_shift!r}.")
        if not isinstance(self.flip, bool):
            raise ConfigError(f"flip must be true or false, got {self.flip!r}.")
        if not (_is_number(self.jitter) and 0 <= self.jitter <= 1):
            raise ConfigError(f"jitter must be a number in [0, 1], got {self.jitter!r}.")
        if not (_is_number(self.noise_std) and self.noise_std >= 0):
            raise ConfigError(f"noise_std must be a finite number >= 0, got {self.noise_std!r}.")

    def views(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`simclr_views` with these settings."""
        return _two_views(x, generator, self)


def simclr_views(x: torch.Tensor, generator: torch.Generator, *, crop_scale: tuple[float, float] = (0.6, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), max_shift: float = 0.1, flip: bool = False,
                 jitter: float = 0.4, noise_std: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independently augmented views of a batch (SimCLR, Chen et al. 2020, §3 and appendix A).

    Per sample and per view, in this order:

    1. random resized crop: area ``a ~ U(crop_scale)`` of the image, aspect ratio ``r`` log-uniform in
       ``ratio`` narrowed to ``[a, 1/a]`` so that the crop fits (hence the area is exactly ``a``), centre
       uniform over the positions that keep it inside; the crop is resampled bilinearly to ``H × W``;
    2. translation of the crop by up to ``max_shift`` of the image side (border pixels repeat);
    3. horizontal flip with probability ½ when ``flip``;
    4. contrast and brightness, for normalised inputs: ``x ← (x − m)·c + m + b`` with ``m`` the sample's
       mean, ``c ~ U[1 − jitter, 1 + jitter]`` and ``b ~ U[−jitter, jitter]`` (in units of the data's
       standard deviation);
    5. Gaussian noise of standard deviation ``noise_std`` when it is > 0.

    With ``crop_scale=(1, 1)``, ``max_shift=0``, ``jitter=0`` and ``noise_std=0`` both views equal ``x``.
    The parameters are drawn from ``generator`` (on its own device, then moved to ``x``'s), so the same
    generator state gives the same views. Shape: ``x (B, C, H, W)`` floating → two ``(B, C, H, W)``.
    """
    config = ViewConfig(crop_scale=crop_scale, ratio=ratio, max_shift=max_shift, flip=flip,
                        jitter=jitter, noise_std=noise_std)
    return _two_views(x, generator, config)


def _two_views(x: torch.Tensor, generator: torch.Generator, config: ViewConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"simclr_views needs a floating (B, C, H, W) batch, got shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}")
    return _augment(x, generator, config), _augment(x, generator, config)


def _augment(x: torch.Tensor, generator: torch.Generator, config: ViewConfig) -> torch.Tensor:
    batch = x.shape[0]
    u = torch.rand(batch, _NUM_UNIFORMS, generator=generator, device=generator.device, dtype=torch.float64)
    u = u.to(x.device)  # (B, 9)

    # Crop size as fractions (w, h) of the image: w·h = a, w/h = r, and w, h ≤ 1 ⇔ a ≤ r ≤ 1/a.
    lo, hi = config.crop_scale
    area = lo + (hi - lo) * u[:, _AREA]
    log_lo = torch.log(area.clamp_min(config.ratio[0]))
    log_hi = torch.log((1 / area).clamp_max(config.ratio[1]))
    ratio = torch.exp(log_lo + (log_hi - log_lo) * u[:, _RATIO])
    width = torch.sqrt(area * ratio).clamp_max(1.0)
    height = torch.sqrt(area / ratio).clamp_max(1.0)
    # In affine_grid's [−1, 1] coordinates the crop's half-size is (w, h) and its centre may lie in
    # [−(1 − w), 1 − w]; a shift of s of the side is 2s there.
    cx = (1 - width) * (2 * u[:, _CX] - 1) + 2 * config.max_shift * (2 * u[:, _SHIFT_X] - 1)
    cy = (1 - height) * (2 * u[:, _CY] - 1) + 2 * config.max_shift * (2 * u[:, _SHIFT_Y] - 1)
    sign = torch.where(u[:, _FLIP] < 0.5, -1.0, 1.0) if config.flip else torch.ones_like(width)

    theta = torch.zeros(batch, 2, 3, dtype=torch.float64, device=x.device)  # output → input coordinates
    theta[:, 0, 0] = width * sign
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = height
    theta[:, 1, 2] = cy
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)  # (B, H, W, 2)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    if config.jitter > 0:
        j = config.jitter
        contrast = (1 + j * (2 * u[:, _CONTRAST] - 1)).to(x.dtype).view(batch, 1, 1, 1)
        brightness = (j * (2 * u[:, _BRIGHT] - 1)).to(x.dtype).view(batch, 1, 1, 1)
        mean = out.mean(dim=(1, 2, 3), keepdim=True)
        out = (out - mean) * contrast + mean + brightness
    if config.noise_std > 0:
        noise = torch.randn(x.shape, generator=generator, device=generator.device, dtype=x.dtype)
        out = out + config.noise_std * noise.to(x.device)
    return out

