"""FLESD: federated representation learning by ensemble similarity distillation (Shi et al.;
docs/algorithms.md#flesd). Its weight-averaging baseline with the same local training, FedAvg-SimCLR,
and that training itself are in :mod:`.simclr`.

Collaborator tasks, each round:

1. ``train`` — self-supervised SimCLR on the site's own images (NT-Xent over two augmented views,
   in-batch negatives, Adam; labels are never read), starting from the global encoder.
2. ``similarity`` — similarity inference on the public set P that every site holds: the site first
   checks that its P is the aggregator's (same samples, same order: a SHA-256 fingerprint of the
   tensors), refuses otherwise, then uploads ``Z_k = normalize(f_k(P))`` (N×d) or
   ``M_k = Z_k Z_kᵀ`` (N×N) — the cheaper of the two by default — optionally quantised to fp16 or
   int8. Never weights.

Aggregator: ensemble similarity distillation (ESD). ``M = (1/|S|) Σ_k M_k / τ_T``; the global
encoder is trained on P with ``KL(p_T ‖ p_S)`` against a momentum encoder's FIFO anchor queue
(:func:`fedcontrast.losses.esd_loss`), Adam, and the new weights go to every site. The aggregator
keeps no state of its own: the student starts from the global model this round's sites received.
``M`` is a plain mean over sites, so secure aggregation gives it: each site masks its ``M_k`` (N×N,
computed at the site whichever form it uploads) and a 1, the aggregator unmasks only their sums.

Sites may run other encoder architectures than the global model (``site_models``): only
similarities travel. Such a site keeps training its own encoder from round to round.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError, FedContrastError
from ..losses import check_temperature, ensemble_similarity, esd_loss
from ..models import MODEL_NAMES, ContrastiveNet, build_model
from .base import (
    WEIGHT_PREFIX,
    Downlink,
    InvalidUploadError,
    ServerContext,
    SiteContext,
    TaskResult,
    TensorSpec,
    load_weights,
    weight_specs,
    weight_tensors,
)
from .capabilities import SecureSum, UploadChecks
from .facts import RunFacts
from .moon import represent_all
from .registry import register_algorithm

# The local SimCLR training and the FedAvg-SimCLR baseline; re-exported (imported from here before).
from .simclr import FedAvgSimCLR, SimCLRHyperparameters, _pair, probe, probe_at_site, train_simclr
from .training import batch_indices, site_generator

logger = logging.getLogger(__name__)

FINGERPRINT = "flesd.public_fingerprint"  # download (32,) uint8: SHA-256 of the aggregator's P
REPRESENTATIONS = "flesd.representations"  # upload (N, d): normalised f_k(P)
SIMILARITY = "flesd.similarity"  # upload (N, N): Z_k Z_kᵀ
SIMILARITY_SUM, SITES = "similarity.sum", "similarity.sites"  # secure-sum terms: M_k (N, N) and 1 (1,)
LOCAL_MODEL = "flesd.local_model"  # site state: the encoder after this round's local training
INT8_SCALE = 127.0  # int8 quantisation of values in [-1, 1]: round(127 x)
# How far a site's similarities may stray outside [-1, 1] (and from symmetry), per upload quantisation
SIMILARITY_TOLERANCE = {"none": 1e-4, "fp16": 2e-3, "int8": 1.0 / INT8_SCALE}
QUANTISED_DTYPES = {"none": "float32", "fp16": "float16", "int8": "int8"}


class PublicDataMismatch(FedContrastError):
    """A site's public data set is not the aggregator's: similarities would be meaningless."""


def public_fingerprint(public: Any) -> torch.Tensor:
    """SHA-256 of the public set's shape and pixel bytes (float32, in order) as 32 uint8 values."""
    x = public.x.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(repr(tuple(x.shape)).encode() + x.numpy().tobytes()).digest()
    return torch.tensor(list(digest), dtype=torch.uint8, device="cpu")


def quantise(values: torch.Tensor, mode: str) -> torch.Tensor:
    """Values in [−1, 1] → the upload's dtype: float32, float16, or int8 as ``round(127 x)``."""
    if mode == "fp16":
        return values.to(torch.float16)
    if mode == "int8":
        return torch.round(values.clamp(-1, 1) * INT8_SCALE).to(torch.int8)
    return values.to(torch.float32)


def dequantise(values: torch.Tensor) -> torch.Tensor:
    if values.dtype == torch.int8:
        return values.to(torch.float32) / INT8_SCALE
    return values.to(torch.float32)


@dataclass(frozen=True)
class FlesdHyperparameters(SimCLRHyperparameters):
    upload: str = "auto"  # "representations" (N×d), "similarity" (N×N), or "auto": the smaller
    quantize: str = "none"  # "fp16" or "int8" shrink the upload 2× / 4×
    target_temperature: float = 0.1  # τ_T (< 1, paper); the student's τ_S equals it
    distill_epochs: int = 20  # ESD epochs over P on the aggregator, each round
    distill_lr: float = 1e-3  # Adam
    distill_batch_size: int = 64
    momentum: float = 0.9  # EMA factor m of the momentum encoder (0: no momentum encoder)
    queue_size: int = 1024  # FIFO anchors (with their indices in P); at most N are kept
    distill_augment: bool = True  # the same views as local training during ESD (paper)
    site_models: tuple[str, ...] = ()  # site i's encoder: site_models[i % len]; empty: the run's model

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "site_models", tuple(_pair(self.site_models) or ()))
        if self.upload not in ("auto", "representations", "similarity"):
            raise ValueError(f"upload must be auto, representations or similarity, got {self.upload!r}")
        if self.quantize not in QUANTISED_DTYPES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTISED_DTYPES)}, got {self.quantize!r}")
        check_temperature(self.target_temperature)
        for name in ("distill_epochs", "distill_batch_size", "queue_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= (2 if name == "distill_batch_size" else 1)):
                raise ValueError(f"{name} must be an integer >= {2 if name == 'distill_batch_size' else 1}, "
                                 f"got {value!r}")
        if not (isinstance(self.distill_lr, (int, float)) and math.isfinite(self.distill_lr) and self.distill_lr > 0):
            raise ValueError(f"distill_lr must be a number > 0, got {self.distill_lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        unknown = [m for m in self.site_models if m not in MODEL_NAMES]
        if unknown:
            raise ValueError(f"site_models must name architectures among {', '.join(MODEL_NAMES)}, got {unknown}")


@register_algorithm
class Flesd(SecureSum, UploadChecks):
    """Collaborator: SimCLR, then similarity inference on P (uploads Z_k or M_k, never weights).
    Aggregator: ensemble similarity distillation into the global encoder."""

    name = "flesd"
    Hyperparameters = FlesdHyperparameters
    hp: FlesdHyperparameters
    tasks = ("train", "similarity")
    task_metrics = {"train": ("loss", "steps"), "similarity": ("public_samples",)}
    evaluation_metrics = ("accuracy", "probe_accuracy", "probe_train_accuracy")
    requires_public = True
    # Representation DP applies to Z_k (site.public_representations: one Gaussian release per round;
    # the sensitivity argument is in fedcontrast.privacy.representations). DP-SGD does not: NT-Xent
    # with in-batch negatives is not a sum of per-sample terms, so per-sample clipping would not
    # bound one sample's influence.
    dp_kinds = frozenset({"representations"})
    representation_releases = 1
    # SecureSum: the ensemble is the plain mean of the sites' M_k (see secure_terms)

    def __init__(self, hp: FlesdHyperparameters | None = None, facts: RunFacts | None = None) -> None:
        super().__init__(hp, facts)
        self._same_architecture: dict[str, bool] = {}  # site architecture → is it the run's model

    # --- what travels -----------------------------------------------------------------------------
    def upload_form(self, dim: int) -> str:
        if self.hp.upload != "auto":
            return self.hp.upload
        return "representations" if dim < self.facts.public_size else "similarity"

    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        n, d = self._public_size(), model.projection_dim
        dtype = QUANTISED_DTYPES[self.hp.quantize]
        if self.upload_form(d) == "representations":
            return [TensorSpec(REPRESENTATIONS, (n, d), dtype, "upload",
                               description="normalised representations of the public set (derived, no weights)")]
        return [TensorSpec(SIMILARITY, (n, n), dtype, "upload",
                           description="cosine similarities between public samples (derived, no weights)")]

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        return (weight_specs(model, "download", "distilled global encoder weights")
                + [TensorSpec(FINGERPRINT, (32,), "uint8", "download", description="SHA-256 of the public set",
                             kind="metadata")])

    def _public_size(self) -> int:
        if self.facts.public_size < 2:
            raise ConfigError("flesd needs a public data set of at least 2 samples that every site holds: "
                              "set public_fraction > 0")
        return self.facts.public_size

    # --- collaborator -----------------------------------------------------------------------------
    def site_architecture(self, index: int) -> str | None:
        return self.hp.site_models[index % len(self.hp.site_models)] if self.hp.site_models else None

    def local_model(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> ContrastiveNet:
        """The site's encoder at the start of local training: the global one, or — for a site of
        another architecture — its own, kept from its last round (freshly seeded on its first)."""
        arch = self.site_architecture(site.index)
        load_weights(site.model, received)
        if arch is None or self.same_architecture(site.model, arch, site):
            return site.model
        x = site.data.x
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1_000_003 + site.index)
            model = build_model(arch, in_channels=x.shape[1], image_size=x.shape[-1],
                                num_classes=site.model.num_classes,
                                projection_dim=site.model.projection_dim).to(site.device)
        own = site.state.get(LOCAL_MODEL)
        if own is not None:
            load_weights(model, own)
        return model

    def same_architecture(self, model: ContrastiveNet, arch: str, site: SiteContext) -> bool:
        """Whether ``arch`` is the run's own model (then the site trains the global encoder);
        decided once per architecture (two tasks per round ask)."""
        cache = self._same_architecture
        if arch not in cache:
            x = site.data.x
            other = build_model(arch, in_channels=x.shape[1], image_size=x.shape[-1], num_classes=model.num_classes,
                                projection_dim=model.projection_dim)
            mine, theirs = model.state_dict(), other.state_dict()
            cache[arch] = mine.keys() == theirs.keys() and all(mine[k].shape == theirs[k].shape for k in mine)
        return cache[arch]

    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        model = self.local_model(site, received)
        metrics = train_simclr(model, site.data, site.training, self.hp, generator=site_generator(site.seed),
                               device=site.device)
        site.state[LOCAL_MODEL] = weight_tensors(model)
        return TaskResult({}, float(len(site.data)), metrics)

    def task_similarity(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        if site.public is None:
            raise ConfigError(f"site {site.name!r} holds no public data set; flesd needs one on every site")
        mine, theirs = public_fingerprint(site.public), received[FINGERPRINT].to("cpu", torch.uint8)
        if not torch.equal(mine, theirs):
            raise PublicDataMismatch(
                f"site {site.name!r} refuses similarity inference: its public data set ({len(site.public)} samples, "
                f"fingerprint {bytes(mine.tolist()).hex()[:16]}…) is not the aggregator's "
                f"(fingerprint {bytes(theirs.tolist()).hex()[:16]}…); every site needs the same samples "
                "in the same order")
        model = self.local_model(site, received)
        state = site.state.get(LOCAL_MODEL)
        if state is not None:
            load_weights(model, state)
        model.eval()
        # Z_k as it may leave the site (noised under representation DP), re-normalised: post-processing,
        # so the guarantee is unchanged, and every upload stays a set of unit vectors / cosines.
        z = F.normalize(site.public_representations(represent_all(model, site.public.x.to(site.device)).float()), dim=1)
        if self.upload_form(z.shape[1]) == "representations":
            uploads = {REPRESENTATIONS: quantise(z, self.hp.quantize).cpu()}
        else:
            uploads = {SIMILARITY: quantise(z @ z.T, self.hp.quantize).cpu()}
        return TaskResult(uploads, float(len(site.data)), {"public_samples": float(len(z))})

    # --- aggregator -------------------------------------------------------------------------------
    def check_upload(self, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
        tol = SIMILARITY_TOLERANCE[self.hp.quantize]
        if SIMILARITY in uploads:
            m = dequantise(uploads[SIMILARITY])
            if m.ndim != 2 or m.shape[0] != m.shape[1]:
                raise InvalidUploadError(f"site {site!r} uploaded a similarity matrix of shape {tuple(m.shape)}, "
                                         "not N×N; rejected")
            if float((m - m.T).abs().max()) > tol:
                raise InvalidUploadError(f"site {site!r} uploaded a similarity matrix that is not symmetric "
                                         f"(largest |M − Mᵀ| {float((m - m.T).abs().max()):.3g}); rejected")
            if float(m.abs().max()) > 1 + tol:
                raise InvalidUploadError(f"site {site!r} uploaded similarities outside [−1, 1] "
                                         f"(largest |value| {float(m.abs().max()):.3g}); rejected")
            check_gram_matrix(site, m, tol)
        if REPRESENTATIONS in uploads:
            norms = dequantise(uploads[REPRESENTATIONS]).norm(dim=1)
            slack = tol * math.sqrt(uploads[REPRESENTATIONS].shape[1]) + 1e-3
            if float((norms - 1).abs().max()) > slack:
                raise InvalidUploadError(f"site {site!r} uploaded representations that are not unit vectors "
                                         f"(norms from {float(norms.min()):.3g} to {float(norms.max()):.3g}); rejected")

    def site_matrix(self, uploads: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """A site's similarity matrix M_k (N×N, float32), from either upload form."""
        if SIMILARITY in uploads:
            return dequantise(uploads[SIMILARITY].to(device))
        z = F.normalize(dequantise(uploads[REPRESENTATIONS].to(device)), dim=1)  # re-normalise after quantisation
        return z @ z.T

    def initial_downlink(self, server: ServerContext) -> Downlink:
        if server.public is None:
            raise ConfigError("flesd needs the public data set on the aggregator: set public_fraction > 0")
        return Downlink({**weight_tensors(server.model), FINGERPRINT: public_fingerprint(server.public)})

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        target = ensemble_similarity([self.site_matrix(uploads[s], server.device) for s in sorted(uploads)],
                                     target_temperature=self.hp.target_temperature)
        return self.distilled(target, server, len(uploads))

    def distilled(self, target: torch.Tensor, server: ServerContext, answered: int) -> Downlink:
        """The downlink after distilling ``target`` (``M``, N×N) into the round's global model."""
        if server.public is None or server.previous is None:
            raise ConfigError("flesd's distillation needs the public data set and the round's global model "
                              "on the aggregator")
        load_weights(server.model, server.previous)
        loss = distill(server.model, server.public.x.to(server.device), target, self.hp, seed=server.seed)
        return Downlink({**weight_tensors(server.model), FINGERPRINT: public_fingerprint(server.public)},
                        metrics={"esd_loss": loss, "sites_answered": float(answered)})

    # secure aggregation: M_k (clipped to [-clip, clip]; cosines are within [-1, 1]) and a 1 per site,
    # not weighted by counts: into the ring unscaled (secure_scale 1), at its full precision.
    def secure_scale(self, max_samples: float) -> float:
        return 1.0

    def secure_terms(self, uploads: Mapping[str, torch.Tensor], weight: float, clip: float) -> dict[str, torch.Tensor]:
        m = self.site_matrix(uploads, next(iter(uploads.values())).device).to(torch.float64).clamp(-clip, clip)
        return {SIMILARITY_SUM: m, SITES: torch.ones(1, dtype=torch.float64, device=m.device)}

    def aggregate_secure(self, sums: Mapping[str, torch.Tensor], server: ServerContext,
                         dtypes: Mapping[str, torch.dtype]) -> Downlink:
        answered = round(float(sums[SITES].reshape(())))
        if answered < 1:
            raise InvalidUploadError("the secure sum counts no site's similarities; nothing to distil")
        target = sums[SIMILARITY_SUM].to(torch.float64) / (answered * self.hp.target_temperature)
        return self.distilled(target.to(torch.float32), server, answered)

    def secure_counts(self, max_samples: float) -> dict[str, tuple[float, float]]:
        return {SITES: (1.0, 1.0)}  # each site that answered adds a 1: the sum is the survivors' number

    def secure_averages(self, clip: float) -> dict[str, tuple[str, float]]:
        # M: a plain mean of cosines, within [-1, 1] up to the tolerance check_upload grants each site
        return {SIMILARITY_SUM: (SITES, min(float(clip), 1.0 + SIMILARITY_TOLERANCE[self.hp.quantize]))}

    def secure_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        n = self._public_size()
        return [TensorSpec(SIMILARITY_SUM, (n, n), "float64", "upload",
                           description="M_k = Z_k Z_kᵀ on the public set, computed at the site from its upload"),
                TensorSpec(SITES, (1,), "float64", "upload", kind="metadata", description="1: the site answered")]

    def evaluate(self, downlink: Downlink, server: ServerContext, test: Any) -> dict[str, float]:
        load_weights(server.model, downlink.global_tensors)
        return probe(server.model, server, test, self.hp.probe_epochs)

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """The linear probe of the received (distilled) global encoder on the site's own labelled data."""
        load_weights(site.model, received)
        return probe_at_site(site.model, site, test, self.hp.probe_epochs)


def distill(student: ContrastiveNet, public_x: torch.Tensor, target: torch.Tensor, hp: FlesdHyperparameters, *,
            seed: int) -> float:
    """Ensemble similarity distillation of ``target`` (N×N, already ``/ τ_T``) into ``student`` on the
    public images, in place; returns the mean loss. The momentum encoder ``θ̄ ← m θ̄ + (1−m) θ``
    encodes each batch (a second view when ``distill_augment``) into a FIFO queue of anchors with
    their indices in P; the loss is ``KL(p_T ‖ p_S)`` over the queue, same-sample anchors masked."""
    device = public_x.device
    student.train()
    momentum = copy.deepcopy(student)
    momentum.requires_grad_(False)
    params = [p for name, p in student.named_parameters() if not name.startswith("classifier.")]
    optimizer = torch.optim.Adam(params, lr=hp.distill_lr)
    generator = site_generator(seed)
    views = hp.views
    d = student.projection_dim
    queue = torch.zeros(0, d, device=device)
    queue_index = torch.zeros(0, dtype=torch.long, device=device)
    capacity = min(hp.queue_size, len(public_x))  # more would only repeat samples with staler keys
    total, steps = torch.zeros((), device=device), 0
    for _ in range(hp.distill_epochs):
        for idx in batch_indices(len(public_x), hp.distill_batch_size, generator):
            idx = idx.to(device)
            x = public_x[idx]
            v1, v2 = views.views(x, generator) if hp.distill_augment else (x, x)
            with torch.no_grad():  # the momentum encoder encodes the batch first, then joins the queue
                keys = F.normalize(momentum.represent(v2), dim=1)
            queue = torch.cat([queue, keys])[-capacity:]
            queue_index = torch.cat([queue_index, idx])[-capacity:]
            loss = esd_loss(student.represent(v1), idx, queue, queue_index, target,
                            student_temperature=hp.target_temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for p_m, p_s in zip(momentum.parameters(), student.parameters()):
                    p_m.mul_(hp.momentum).add_(p_s.detach(), alpha=1 - hp.momentum)
                for b_m, b_s in zip(momentum.buffers(), student.buffers()):
                    b_m.copy_(b_s)
            total += loss.detach()
            steps += 1
    return (total / max(steps, 1)).item()


__all__ = ["FINGERPRINT", "REPRESENTATIONS", "SIMILARITY", "FedAvgSimCLR", "Flesd", "FlesdHyperparameters",
           "PublicDataMismatch", "SimCLRHyperparameters", "dequantise", "distill", "public_fingerprint", "quantise",
           "train_simclr", "WEIGHT_PREFIX"]


def check_gram_matrix(site: str, m: torch.Tensor, tol: float) -> None:
    """Refuse a similarity matrix that cannot be ``Z Zᵀ`` for unit rows ``Z`` (what every honest site
    sends, quantised within ``tol`` per entry): its diagonal must be 1 and it must be positive
    semi-definite — its smallest eigenvalue ≥ −N·tol (the largest spectral norm of the quantisation
    error). An all-ones matrix *is* such a matrix (every representation the same: a collapsed
    encoder): accepted, with a warning."""
    m64 = m.detach().to("cpu", torch.float64)
    n = m64.shape[0]
    diagonal = float((m64.diagonal() - 1).abs().max()) if n else 0.0
    if diagonal > tol + 1e-6:
        raise InvalidUploadError(f"site {site!r} uploaded a similarity matrix whose diagonal is not 1 (off by up to "
                                 f"{diagonal:.3g}): not the cosine similarities of unit vectors; rejected")
    slack = n * tol + 1e-3
    symmetric = (m64 + m64.T) / 2
    # λ_min ≥ −slack ⇔ M + slack·I has a Cholesky factor (≈ 1/3 of an eigen-decomposition's cost, every
    # round and site); the eigenvalue itself is computed only to word the rejection.
    shifted = symmetric + (slack + 1e-9) * torch.eye(n, dtype=torch.float64, device="cpu")
    if n and int(torch.linalg.cholesky_ex(shifted).info) != 0:
        smallest = float(torch.linalg.eigvalsh(symmetric)[0])
        raise InvalidUploadError(f"site {site!r} uploaded a similarity matrix that is not positive semi-definite "
                                 f"(smallest eigenvalue {smallest:.4g}): no set of representations has these "
                                 "similarities; rejected")
    if n > 1 and float(m64.min()) > 1 - tol - 1e-6:
        logger.warning("site %r uploaded a similarity matrix of all ones: its representations of the public set "
                       "have collapsed to one vector (nothing to distil from it)", site)
