"""FedPCL: prototype contrast over frozen pre-trained backbones (Tan et al., NeurIPS 2022;
docs/algorithms.md#fedpcl). Sites share class prototypes and counts only — never weights."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..aggregation import (
    CLASS_COUNT,
    CLASS_HOLDERS,
    CLASS_SUM,
    class_mean_terms,
    fill_missing_prototypes,
    global_prototypes,
    pooled_class_means,
)
from ..errors import ConfigError, DataError
from ..evaluation import PROTOTYPE_METRICS, distribution_weighted_accuracy, nearest_prototype
from ..losses import check_temperature, fedpcl_loss
from ..models import MODEL_NAMES, ContrastiveNet
from ..models.backbones import FrozenBackbones, backbone_set
from .base import Downlink, InvalidUploadError, ServerContext, SiteContext, TaskResult, TensorSpec
from .capabilities import PersonalEvaluation, SecureSum, SharedFiles, UploadChecks
from .facts import RunFacts
from .registry import register_algorithm
from .training import batch_indices, optimizer_step, site_generator

if TYPE_CHECKING:
    from ..data import ArrayDataset

LOCAL_PROTOTYPES = "fedpcl.local_prototypes"  # upload (C, d): mean normalised z per class (zero rows if absent)
COUNTS = "fedpcl.counts"  # upload (C,): samples per class
GLOBAL_PROTOTYPES = "fedpcl.global_prototypes"  # download (C, d)
PRESENT = "fedpcl.present"  # download (C,): 1 where some site has the class
LOCAL_SETS = "fedpcl.local_sets"  # download (K, C, d): every site's local set, filled with G^c
HEAD = "fedpcl.projection_head"  # site state: the personal projection network (never uploaded)
LOCAL_SET_RULES = ("individual", "global")


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclass(frozen=True)
class FedPCLHyperparameters:
    backbones: tuple[str, ...] = ("simple_cnn",)  # frozen encoders; features are concatenated
    backbone_files: tuple[str, ...] = ()  # one state_dict per backbone; empty: pre-train on the public split
    # the files' SHA-256 (a deployment's plan holds them): a different file is refused
    backbone_sha256: tuple[str, ...] = ()
    pretrain_epochs: int = 30  # supervised pre-training on the public split (Adam), when no files
    projection_hidden: tuple[int, ...] = (256,)  # site i's hidden width: projection_hidden[i % len]
    temperature: float = 0.07
    prototype_weighting: str = "count"  # or "paper_eq6"
    min_class_samples: int = 1  # classes with fewer (released) local samples are not uploaded
    nearest: str = "euclidean"  # prediction: the nearest prototype by squared distance (official code), or "cosine"
    # What each site's entry of the local sets is: its own prototypes filled with G^c (the paper), or
    # "global": G itself — no site's own prototypes leave the aggregator, so G (a function of sums
    # alone) is all it needs and secure aggregation applies; L_p then repeats L_g.
    local_sets: str = "individual"

    def __post_init__(self) -> None:
        for name in ("backbones", "backbone_files", "backbone_sha256", "projection_hidden"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        if not self.backbones or any(b not in MODEL_NAMES for b in self.backbones):
            raise ValueError(f"backbones must name architectures among {', '.join(MODEL_NAMES)}, got {self.backbones}")
        if self.backbone_files and len(self.backbone_files) != len(self.backbones):
            raise ValueError(f"backbone_files must give one file per backbone ({len(self.backbones)}), "
                             f"got {len(self.backbone_files)}")
        if self.backbone_sha256 and len(self.backbone_sha256) != len(self.backbone_files):
            raise ValueError(f"backbone_sha256 must give one hash per backbone file ({len(self.backbone_files)}), "
                             f"got {len(self.backbone_sha256)}")
        if not (isinstance(self.pretrain_epochs, int) and self.pretrain_epochs >= 1):
            raise ValueError(f"pretrain_epochs must be an integer >= 1, got {self.pretrain_epochs!r}")
        if not self.projection_hidden or any(not isinstance(h, int) or h < 1 for h in self.projection_hidden):
            raise ValueError(f"projection_hidden must be positive integers, got {self.projection_hidden}")
        check_temperature(self.temperature)
        if self.prototype_weighting not in ("count", "paper_eq6"):
            raise ValueError(f"prototype_weighting must be count or paper_eq6, got {self.prototype_weighting!r}")
        if not (isinstance(self.min_class_samples, int) and self.min_class_samples >= 1):
            raise ValueError(f"min_class_samples must be an integer >= 1, got {self.min_class_samples!r}")
        if self.nearest not in PROTOTYPE_METRICS:
            raise ValueError(f"nearest must be one of {', '.join(PROTOTYPE_METRICS)}, got {self.nearest!r}")
        if self.local_sets not in LOCAL_SET_RULES:
            raise ValueError(f"local_sets must be one of {', '.join(LOCAL_SET_RULES)}, got {self.local_sets!r}")


def check_backbone_files(files: Sequence[str], hashes: Sequence[str], *, base_dir: str | Path = ".") -> None:
    """Every backbone file exists (relative paths from ``base_dir``) and, when ``hashes`` are given,
    has exactly that SHA-256: sites of one federation must share the operator's frozen backbones."""
    for k, name in enumerate(files):
        path = Path(name) if Path(name).is_absolute() else Path(base_dir) / name
        if not path.is_file():
            raise DataError(f"backbone weight file {path} does not exist (the operator's workspace package ships "
                            "it under save/backbones/)")
        if hashes:
            found = hashlib.sha256(path.read_bytes()).hexdigest()
            if found != hashes[k]:
                raise DataError(f"backbone weight file {path} has SHA-256 {found[:16]}… but the plan expects "
                                f"{hashes[k][:16]}…: use the operator's file")


def class_prototypes(z: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean of ``z`` and counts (zero rows for absent classes). ``(N, d), (N,) → (C, d), (C,)``."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, labels, z)
    counts = torch.bincount(labels, minlength=num_classes)
    return sums / counts.clamp_min(1)[:, None].to(z.dtype), counts


@register_algorithm
class FedPCL(SecureSum, UploadChecks, SharedFiles, PersonalEvaluation):
    """Collaborator: train the personal projection head with ``L_g + L_p`` over frozen backbone
    features, then upload per-class prototypes and counts. Aggregator: count-weighted global
    prototypes and prototype fill (``local_sets: global``: G for every site, under secure aggregation
    too). Evaluation: per site, nearest global / own local prototype."""

    name = "fedpcl"
    secure_variant = ("fedpcl.local_sets: global", "sends every site's own prototypes to all sites "
                                                   "(local_sets: individual)")
    task_metrics = {"train": ("loss", "global_loss", "local_loss"), "prototypes": ("classes",)}
    evaluation_metrics = ("accuracy", "local_accuracy")
    Hyperparameters = FedPCLHyperparameters
    tasks = ("train", "prototypes")
    dp_kinds = frozenset({"representations"})
    hp: FedPCLHyperparameters

    def __init__(self, hp: FedPCLHyperparameters | None = None, facts: RunFacts | None = None) -> None:
        super().__init__(hp, facts)
        # Frozen backbones and no augmentation: a data set's features never change, so they are
        # computed once per process (keyed by the data tensor) instead of every round.
        self._features: dict[int, torch.Tensor] = {}

    @property
    def secure_sum(self) -> bool:  # type: ignore[override]  # decided by the settings, not by the class
        # individual: each site's own prototypes travel, not only their sum
        return self.hp.local_sets == "global"

    def features(self, data: ArrayDataset, public: ArrayDataset | None, device: torch.device) -> torch.Tensor:
        key = id(data.x)
        if key not in self._features:
            self._features[key] = self.backbones(data, public).to(device).features(data.x.to(device))
        return self._features[key]

    # --- deployment -----------------------------------------------------------------------------
    @classmethod
    def share_files(cls, settings: dict[str, Any], workspace: Path, *, public: Callable[[], Any], seed: int,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
        """The frozen backbones every site must share: the given ``backbone_files`` copied, or — without
        them — pre-trained here on the public data set, into ``save/backbones/``, pinned by SHA-256."""
        import shutil

        import torch

        from ..models.backbones import pretrain_backbone

        hp = cls.Hyperparameters(**settings)
        out = Path(workspace) / "save" / "backbones"
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for k, arch in enumerate(hp.backbones):
            target = out / f"backbone_{k}_{arch}.pt"
            if hp.backbone_files:
                if not Path(hp.backbone_files[k]).is_file():
                    raise DataError(f"backbone weight file {hp.backbone_files[k]} does not exist")
                shutil.copyfile(hp.backbone_files[k], target)
            else:
                data = public()
                if data is None:
                    raise ConfigError("fedpcl in a deployment needs frozen backbones that every site shares: pass "
                                      "--public-data FOLDER (they are pre-trained on it here) or "
                                      "--set fedpcl.backbone_files=[FILE,...]")
                log(f"pre-training FedPCL backbone {k} ({arch}, {hp.pretrain_epochs} epochs) on the public data "
                    f"({len(data)} images)")
                torch.save(pretrain_backbone(arch, data, seed=seed + k, epochs=hp.pretrain_epochs).state_dict(), target)
            files.append(target)
        return {**settings, "backbone_files": [f.relative_to(workspace).as_posix() for f in files],
                "backbone_sha256": [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]}

    def check_shared_files(self, workspace: str | Path = ".") -> None:
        if self.hp.backbone_files:
            check_backbone_files(self.hp.backbone_files, self.hp.backbone_sha256, base_dir=workspace)

    # --- the site's networks --------------------------------------------------------------------
    def backbones(self, data: ArrayDataset, public: ArrayDataset | None) -> FrozenBackbones:
        if self.hp.backbone_sha256:
            check_backbone_files(self.hp.backbone_files, self.hp.backbone_sha256)
        return backbone_set(self.hp.backbones, self.hp.backbone_files, public, in_channels=data.x.shape[1],
                            image_size=data.x.shape[-1], seed=0, pretrain_epochs=self.hp.pretrain_epochs)

    def head(self, site: SiteContext, in_dim: int, out_dim: int) -> nn.Module:
        """The site's personal projection network, restored from its state (created on first use)."""
        hidden = self.hp.projection_hidden[site.index % len(self.hp.projection_hidden)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 + site.index)  # the first initialisation is the site's own, reproducible
            with torch.device("cpu"):  # built on the host: the same first weights on every device
                head = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out_dim))
        if HEAD in site.state:
            head.load_state_dict(site.state[HEAD])
        return head.to(site.device)

    def _embed(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, nn.Module]:
        features = self.features(site.data, site.public, site.device)
        head = self.head(site, features.shape[1], received[GLOBAL_PROTOTYPES].shape[1])
        return features, head

    # --- collaborator tasks ---------------------------------------------------------------------
    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        features, head = self._embed(site, received)
        labels = site.data.y.to(site.device)
        protos, present, local_sets = received[GLOBAL_PROTOTYPES], received[PRESENT], received[LOCAL_SETS]
        if not bool(present.any()):  # the first round: no shared prototypes yet; contrast with the site's own
            with torch.no_grad():
                own, counts = class_prototypes(F.normalize(head(features), dim=1), labels, protos.shape[0])
            protos, present, local_sets = own, (counts > 0).to(own.dtype), own[None]
        cfg = site.training
        optimizer = torch.optim.SGD(head.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        generator = site_generator(site.seed)
        totals = torch.zeros(3, device=site.device)
        steps = 0
        head.train()
        for _ in range(cfg.local_epochs):
            for idx in batch_indices(len(features), cfg.batch_size, generator):
                idx = idx.to(site.device)
                z = F.normalize(head(features[idx]), dim=1)  # (B, d)
                l_g, l_p = fedpcl_loss(z, labels[idx], protos, present, local_sets, temperature=self.hp.temperature)
                loss = l_g + l_p
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer_step(optimizer, cfg)
                totals += torch.stack([loss.detach(), l_g.detach(), l_p.detach()])
                steps += 1
        site.state[HEAD] = {k: v.detach().clone() for k, v in head.state_dict().items()}
        loss, l_g, l_p = (totals / max(steps, 1)).tolist()
        return TaskResult({}, float(len(site.data)), {"loss": loss, "global_loss": l_g, "local_loss": l_p})

    def task_prototypes(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        features, head = self._embed(site, received)
        head.eval()
        with torch.no_grad():
            z = F.normalize(head(features), dim=1)  # (N, d)
        class_sums = site.class_sums(*received[GLOBAL_PROTOTYPES].shape)
        class_sums.add(z, site.data.y.to(site.device), torch.arange(len(z), device=site.device))
        sums, counts = class_sums.release()  # noisy under representation DP
        counts = counts.round().clamp_min(0)
        sent = counts >= self.hp.min_class_samples  # decided on the released counts: post-processing
        protos = torch.where(sent[:, None], sums / counts.clamp_min(1)[:, None], torch.zeros_like(sums))
        counts = torch.where(sent, counts, torch.zeros_like(counts))
        return TaskResult({LOCAL_PROTOTYPES: protos.float().cpu(), COUNTS: counts.long().cpu()}, float(len(site.data)),
                          {"classes": float(sent.sum())})

    # --- aggregator -----------------------------------------------------------------------------
    def check_upload(self, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
        counts, protos = uploads[COUNTS], uploads[LOCAL_PROTOTYPES]
        if bool((counts < 0).any()):
            raise InvalidUploadError(f"site {site!r} uploaded negative class counts; rejected")
        if bool(((counts == 0) & (protos.abs().sum(1) > 0)).any()):
            raise InvalidUploadError(f"site {site!r} uploaded a prototype for a class it counts 0 samples of; rejected")
        if bool(((counts > 0) & (counts < self.hp.min_class_samples)).any()):
            raise InvalidUploadError(f"site {site!r} uploaded a prototype from fewer than "
                                     f"{self.hp.min_class_samples} samples; rejected")
        # Exact only without noise and without a threshold: then every sample is in some class.
        exact = not self.facts.private_representations and self.facts.exact_weights and self.hp.min_class_samples == 1
        if exact and int(counts.sum()) != int(weight):
            raise InvalidUploadError(f"site {site!r} uploaded class counts summing to {int(counts.sum())}, "
                                     f"not its {int(weight)} samples; rejected")
        if not exact:
            self.check_class_counts(site, counts, weight)
        # A prototype is a mean of unit vectors: its norm is at most 1 (plus the DP noise's allowance).
        self.check_mean_norms(site, protos, counts, unit=True, what="a prototype",
                              bound="a mean of unit vectors can have")

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        protos = {s: u[LOCAL_PROTOTYPES] for s, u in uploads.items()}
        counts = {s: u[COUNTS] for s, u in uploads.items()}
        g, present = global_prototypes(protos, counts, weighting=self.hp.prototype_weighting)
        order = server.sites or sorted(uploads)
        if self.hp.local_sets == "global":
            return self._downlink(g, present, len(order))
        # A site that did not report this round (or lacks a class) gets the global prototype there.
        sets = torch.stack([fill_missing_prototypes(protos[s], counts[s], g) if s in uploads else g for s in order])
        return self._downlink(g, present, sets)

    @staticmethod
    def _downlink(g: torch.Tensor, present: torch.Tensor, sets: torch.Tensor | int) -> Downlink:
        """``sets``: the stacked local sets, or how many copies of ``g`` stand in for them."""
        sets = g.expand(sets, *g.shape).clone() if isinstance(sets, int) else sets
        return Downlink({GLOBAL_PROTOTYPES: g, PRESENT: present, LOCAL_SETS: sets},
                        metrics={"classes_with_prototype": float(present.sum())})

    # secure aggregation (local_sets: global): n_ic·P_i^c, n_ic and 1[n_ic > 0] per class
    def secure_terms(self, uploads: Mapping[str, torch.Tensor], weight: float, clip: float) -> dict[str, torch.Tensor]:
        return class_mean_terms(uploads[LOCAL_PROTOTYPES], uploads[COUNTS], weight, clip, holders=True)

    def aggregate_secure(self, sums: Mapping[str, torch.Tensor], server: ServerContext,
                         dtypes: Mapping[str, torch.dtype]) -> Downlink:
        g, present = pooled_class_means(sums, weighting=self.hp.prototype_weighting, dtype=dtypes[LOCAL_PROTOTYPES])
        return self._downlink(g, present, len(server.sites) or max(self.facts.num_sites, 1))

    def secure_counts(self, max_samples: float) -> dict[str, tuple[float, float]]:
        return {CLASS_COUNT: (0.0, float(max_samples)), CLASS_HOLDERS: (0.0, 1.0)}

    def secure_averages(self, clip: float) -> dict[str, tuple[str, float]]:
        # G^c: a count-weighted mean of prototypes, each a mean of unit vectors (norm ≤ 1, the allowance
        # check_mean_norms grants); under representation DP the noise lets an honest one reach the clip
        unit = float(self.mean_norm_allowance(torch.ones(1), 1, unit=True)[0])
        return {CLASS_SUM: (CLASS_COUNT, float(clip) if self.facts.private_representations else min(float(clip), unit))}

    def initial_downlink(self, server: ServerContext) -> Downlink:
        c, d, k = server.num_classes, server.model.projection_dim, max(self.facts.num_sites, len(server.sites), 1)
        zeros = functools.partial(torch.zeros, device=server.device)
        return Downlink({GLOBAL_PROTOTYPES: zeros(c, d), PRESENT: zeros(c), LOCAL_SETS: zeros(k, c, d)})

    # --- evaluation -----------------------------------------------------------------------------
    def evaluate(self, downlink: Downlink, server: ServerContext, test: Any) -> dict[str, float]:
        return {}  # no global model: see evaluate_site (personalised accuracy)

    def _predict(self, site: SiteContext, received: Mapping[str, torch.Tensor],
                 data: ArrayDataset) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictions of the site's personal model on ``data``: by the nearest global prototype and
        by the nearest of its own (filled) local prototypes (``hp.nearest``). ``→ (N,), (N,)``."""
        features = self.features(data, site.public, site.device)
        head = self.head(site, features.shape[1], received[GLOBAL_PROTOTYPES].shape[1]).eval()
        with torch.no_grad():
            z = F.normalize(head(features), dim=1)
        own = received[LOCAL_SETS][min(site.index, len(received[LOCAL_SETS]) - 1)]
        return (nearest_prototype(z, received[GLOBAL_PROTOTYPES], received[PRESENT], metric=self.hp.nearest),
                nearest_prototype(z, own, received[PRESENT], metric=self.hp.nearest))

    def evaluate_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """Personalised accuracy of the site's head, by nearest global prototype (``accuracy``) and by
        nearest own local prototype (``local_accuracy``), on the site's own label distribution: the
        per-class test accuracy weighted by the site's class shares (its local test distribution, as
        in the paper). ``balanced_accuracy``: the plain accuracy on the whole test split."""
        global_pred, local_pred = self._predict(site, received, test)
        y = test.y.to(site.device)
        shares = torch.bincount(site.data.y.to(site.device), minlength=len(received[PRESENT])).to(torch.float64)
        return {"accuracy": distribution_weighted_accuracy(global_pred, y, shares),
                "local_accuracy": distribution_weighted_accuracy(local_pred, y, shares),
                "balanced_accuracy": (global_pred == y).float().mean().item()}

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """The site's personal model on its own held-out split (already its own distribution):
        ``accuracy`` by nearest global prototype, ``local_accuracy`` by nearest own local prototype.
        Before any prototype is shared (the first round) there is nothing to measure."""
        if not bool(received[PRESENT].any()) or HEAD not in site.state:
            return {}
        global_pred, local_pred = self._predict(site, received, test)
        y = test.y.to(site.device)
        return {"accuracy": (global_pred == y).double().mean().item(),
                "local_accuracy": (local_pred == y).double().mean().item()}

    # --- declarations ---------------------------------------------------------------------------
    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d = model.projection_dim
        return [TensorSpec(LOCAL_PROTOTYPES, (num_classes, d), "float32", "upload",
                           description="per-class mean of the normalised representation (zero rows: absent classes)"),
                TensorSpec(COUNTS, (num_classes,), "int64", "upload", kind="count",
                           description="local samples per class")]

    def secure_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d = model.projection_dim
        return [TensorSpec(CLASS_SUM, (num_classes, d), "float64", "upload",
                           description="count · prototype, per class (prototype clipped to [-clip, clip])"),
                TensorSpec(CLASS_COUNT, (num_classes,), "float64", "upload", kind="count",
                           description="local samples per class"),
                TensorSpec(CLASS_HOLDERS, (num_classes,), "float64", "upload", kind="count",
                           description="1 where the site has the class (paper_eq6's |N_c|)")]

    def shared_class_minimum(self) -> int:
        return self.hp.min_class_samples

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d, k = model.projection_dim, max(self.facts.num_sites, 1)
        sets = ("the global prototypes once per site (no site's own prototypes)" if self.hp.local_sets == "global"
                else "every site's local prototypes, filled with the global ones")
        return [TensorSpec(GLOBAL_PROTOTYPES, (num_classes, d), "float32", "download", description="global prototypes"),
                TensorSpec(PRESENT, (num_classes,), "float32", "download",
                           description="1 where a class has a prototype"),
                TensorSpec(LOCAL_SETS, (k, num_classes, d), "float32", "download", description=sets)]


