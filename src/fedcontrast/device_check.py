"""The device-sensitive paths, as items that run on a given device: what the test suite runs through
the CPU stand-in (:func:`fedcontrast.devices.cpu_stand_in`) and ``benchmarks/gpu_check.py`` runs on CUDA.

Each item runs a small job (2 sites; synthetic 16×16 images) on ``device`` in a fresh folder and
returns its :class:`Outcome`: the numbers it produced (compared across runs and devices) and the
test accuracy where it has one.

CPU and GPU runs of one seed are not bit-identical (float sums differ in their last bits, and training
amplifies that into a different trajectory), so the two devices are compared as a statistic over seeds:
:func:`seeded_run` on digits where the models learn, :func:`paired` for the paired differences and
:func:`agree` for the criterion.
"""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import DPSGDConfig, PrivacyConfig, RepresentationDPConfig, RunConfig, TrainingConfig

# Small settings of the slow parts (pre-training, distillation, probes): the paths run, fast.
QUICK_HYPERPARAMETERS = {"fedpcl": {"pretrain_epochs": 1}, "flesd": {"distill_epochs": 1, "probe_epochs": 5},
                         "fedavg_simclr": {"probe_epochs": 5}}


@dataclass
class Outcome:
    values: dict[str, Any] = field(default_factory=dict)  # every number the item produced, by name
    accuracy: float | None = None  # the final test accuracy (None: the item has none)


def config(algorithm: str, device: str, *, rounds: int = 1, **settings: Any) -> RunConfig:
    """2 sites, ``rounds`` rounds, one local epoch, on ``device``."""
    hyper = {algorithm: QUICK_HYPERPARAMETERS[algorithm]} if algorithm in QUICK_HYPERPARAMETERS else {}
    settings = {"hyperparameters": hyper, "dataset": "synthetic", "image_size": 16,
                "training": TrainingConfig(local_epochs=1, batch_size=32), **settings}
    return RunConfig(algorithm=algorithm, clients=2, rounds=rounds, min_samples=5, projection_dim=32,
                     public_fraction=0.2, device=device, **settings)


def _metrics(run_dir: Path) -> dict[str, Any]:
    """Every metric of a run (``metrics.csv`` as text) and its final downlink, as numbers."""
    from .sim.checkpoint import load_checkpoint

    state = load_checkpoint(run_dir / "checkpoint.pt")["federation"]["downlink"]
    tensors = {f"global/{k}": v for k, v in state["global"].items()}
    tensors.update({f"{s}/{k}": v for s, d in state["personal"].items() for k, v in d.items()})
    return {"metrics.csv": (run_dir / "metrics.csv").read_text(), **tensors}


def _final_accuracy(run_dir: Path) -> float | None:
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    value = summary.get("final_accuracy")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def simulate(cfg: RunConfig) -> Outcome:
    from .sim.simulator import run_simulation

    with tempfile.TemporaryDirectory() as tmp:
        run_simulation(cfg, Path(tmp) / "run")
        return Outcome(_metrics(Path(tmp) / "run"), _final_accuracy(Path(tmp) / "run"))


def resume(cfg: RunConfig) -> Outcome:
    """A run stopped after round 1 and resumed equals the uninterrupted run; returns the resumed one's
    numbers (the item fails with AssertionError where they differ)."""
    from .sim.simulator import run_simulation

    with tempfile.TemporaryDirectory() as tmp:
        whole, parts = Path(tmp) / "whole", Path(tmp) / "parts"
        run_simulation(cfg, whole)
        run_simulation(cfg, parts, stop_after=1)
        run_simulation(cfg, parts, resume=True)
        a, b = _metrics(whole), _metrics(parts)
        differing = differences(a, b)
        if differing:
            raise AssertionError(f"the resumed run differs from the uninterrupted one in {', '.join(differing[:5])}")
        return Outcome(b, _final_accuracy(parts))


def compare(cfg: RunConfig) -> Outcome:
    """``fedcontrast compare`` of FedAvg and MOON at one seed."""
    from .sim.compare import run_comparison

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cmp"
        table = run_comparison(cfg, ["fedavg", "moon"], [cfg.seed], out)
        values = {f"{p.parent.name}/metrics.csv": p.read_text() for p in sorted(out.glob("*/metrics.csv"))}
        values.update({f"table/{row['algorithm']}/{k}": v for row in table for k, v in row.items() if "time" not in k})
        return Outcome(values)


def probe(cfg: RunConfig) -> Outcome:
    """``fedcontrast probe``: the linear probe of a trained model's encoder on ``cfg.device``."""
    from .construction import initial_model, load_splits
    from .devices import resolve_device
    from .evaluation import linear_probe

    splits = load_splits(cfg)
    model = initial_model(cfg, in_channels=splits.in_channels, image_size=splits.image_size,
                          num_classes=splits.num_classes)
    device = resolve_device(cfg.device)
    result = linear_probe(model.to(device).encoder, splits.train, splits.test, device, epochs=10, module=model)
    return Outcome(dict(result), result["probe_accuracy"])


def pretrain(cfg: RunConfig) -> Outcome:
    """FedPCL's backbone pre-training on the public split, on the device."""
    from .construction import load_splits
    from .devices import resolve_device, same_device
    from .models.backbones import pretrain_backbone

    device = resolve_device(cfg.device)
    public = load_splits(cfg).public
    encoder = pretrain_backbone(cfg.model, public, seed=0, epochs=1, device=device)
    if not all(same_device(p.device, device) for p in encoder.parameters()):
        raise AssertionError(f"the pre-trained backbone is on {sorted({str(p.device) for p in encoder.parameters()})}, "
                             f"not on {device}")
    return Outcome({k: v.cpu() for k, v in encoder.state_dict().items()})


@contextlib.contextmanager
def _fresh_aggregation():
    """The OpenFL aggregation function as in a fresh aggregator process: its module-wide state (left by
    an aggregator built earlier in this process) emptied, and its singleton (OpenFL's
    ``SingletonABCMeta``) built anew; the process's own put back afterwards."""
    from .openfl import aggregation as module

    kept = module.LINK
    instances = type(module.PluginAggregation)._instances  # type: ignore[attr-defined]  # OpenFL's singleton metaclass
    earlier = instances.pop(module.PluginAggregation, None)
    module.LINK = module.AggregatorLink()
    try:
        yield module.PluginAggregation
    finally:
        module.LINK = kept
        instances.pop(module.PluginAggregation, None)
        if earlier is not None:
            instances[module.PluginAggregation] = earlier


def openfl_round(cfg: RunConfig) -> Outcome:
    """One round of the OpenFL task runner in-process: two collaborators train on what the
    aggregator's initial model is, the aggregation function aggregates their packed uploads, and
    each site evaluates the result."""
    import numpy as np
    import pandas as pd

    from .openfl.loader import SiteDataLoader
    from .openfl.packing import GLOBAL_PACKED
    from .openfl.runner import WEIGHT_METRIC, PluginTaskRunner

    settings: dict[str, Any] = {"run_config": cfg.to_dict()}
    values: dict[str, Any] = {}
    uploads, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp, _fresh_aggregation() as PluginAggregation:
        runners = {}
        for i in range(cfg.clients):
            loader = SiteDataLoader(data_path=f"shard:{i}", **settings)
            runners[f"site_{i}"] = PluginTaskRunner(data_loader=loader, state_dir=str(Path(tmp) / f"s{i}"), **settings)
        first = next(iter(runners.values()))
        initial = first.initial_packed.copy()
        for name, runner in runners.items():
            for task in runner.algorithm.tasks:
                sent, _ = getattr(runner, task)(col_name=name, round_num=0, input_tensor_dict={GLOBAL_PACKED: initial})
                for key, array in sent.items():
                    if key.tensor_name == GLOBAL_PACKED:
                        uploads[name] = array
                    elif key.tensor_name == WEIGHT_METRIC:
                        rows.append({"tensor_name": WEIGHT_METRIC, "round": 0, "tags": ("metric", name),
                                     "nparray": array})  # as OpenFL stores it: tagged with the sender
                    values[f"{name}/{task}/{key.tensor_name}"] = np.asarray(array).copy()
        aggregation = PluginAggregation(run_config=cfg.to_dict(), model_shape=first.data_loader.shape)
        db = pd.DataFrame(rows, columns=["tensor_name", "round", "tags", "nparray"])
        local = [type("Local", (), {"col_name": s, "tensor": a})() for s, a in sorted(uploads.items())]
        aggregated = aggregation.call(local, db, GLOBAL_PACKED, 0, ("trained",))
        values["aggregated"] = np.asarray(aggregated).copy()
        for name, runner in runners.items():
            metrics, _ = runner.run_site_evaluation(col_name=name, round_num=1,
                                                    input_tensor_dict={GLOBAL_PACKED: aggregated})
            values.update({f"{name}/evaluate/{k.tensor_name}": np.asarray(v).copy() for k, v in metrics.items()})
    return Outcome(values)


DP_SGD = PrivacyConfig(dp_sgd=DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0))
REPRESENTATIONS = PrivacyConfig(representations=RepresentationDPConfig(noise_multiplier=2.0))


def items(device: str, *, rounds: int = 1) -> dict[str, Callable[[], Outcome]]:
    """Every device-sensitive item, by name, ready to run on ``device``."""
    from .algorithms import available_algorithms

    out: dict[str, Callable[[], Outcome]] = {}
    for name in available_algorithms():
        cfg = config(name, device, rounds=rounds)
        out[name] = functools.partial(simulate, cfg)
    for name, privacy in (("fedavg+dp_sgd", DP_SGD), ("fedssc+dp_sgd", DP_SGD),
                          ("fedssc+representations", REPRESENTATIONS), ("fedpcl+representations", REPRESENTATIONS),
                          ("flesd+representations", REPRESENTATIONS)):
        cfg = config(name.split("+")[0], device, rounds=rounds, privacy=privacy)
        out[name] = functools.partial(simulate, cfg)
    flesd = config("flesd", device, rounds=rounds,
                   hyperparameters={"flesd": {**QUICK_HYPERPARAMETERS["flesd"], "upload": "similarity",
                                              "quantize": "int8"}})
    out["flesd+similarity"] = lambda: simulate(flesd)
    out["fedpcl_pretrain"] = lambda: pretrain(config("fedpcl", device))
    out["resume"] = lambda: resume(config("moon", device, rounds=2))
    out["resume+dp_sgd"] = lambda: resume(config("fedssc", device, rounds=2, privacy=DP_SGD))
    out["compare"] = lambda: compare(config("fedavg", device))
    out["probe"] = lambda: probe(config("fedavg", device))
    out["openfl_round"] = lambda: openfl_round(config("fedssc", device))
    return out


# --- CPU against the device, over seeds -------------------------------------------------------------

AGREEMENT = {"rounds": 2, "local_epochs": 20, "lr": 0.01}  # digits, 2 sites: 60-90 % after 2 rounds


def digits_config(algorithm: str, device: str, seed: int, *, rounds: int = 2, local_epochs: int = 20,
                  lr: float = 0.01) -> RunConfig:
    """2 sites of digits (16×16), ``rounds`` rounds of ``local_epochs`` epochs: the models learn."""
    return config(algorithm, device, rounds=rounds, seed=seed, dataset="digits", image_size=16,
                  training=TrainingConfig(local_epochs=local_epochs, batch_size=32, lr=lr))


def fingerprint(values: dict[str, Any]) -> str:
    """A digest of every number of a run (tensors bit for bit): equal digests, equal runs."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for key in sorted(values):
        value = values[key]
        digest.update(key.encode())
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, np.ndarray):
            digest.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def seeded_run(algorithm: str, device: str, seed: int, *, threads: int = 1, stand_in: bool = False,
               **setting: Any) -> tuple[float, str]:
    """One :func:`digits_config` run in this process with ``threads`` torch threads (inside the CPU
    stand-in with ``stand_in``): its final test accuracy and :func:`fingerprint`."""
    from .devices import cpu_stand_in, make_cuda_deterministic

    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        make_cuda_deterministic()
    with cpu_stand_in() if stand_in else contextlib.nullcontext():
        outcome = simulate(digits_config(algorithm, device, seed, **setting))
    if outcome.accuracy is None:
        raise AssertionError(f"{algorithm} reported no final accuracy")
    return outcome.accuracy, fingerprint(outcome.values)


@dataclass(frozen=True)
class Paired:
    """Paired differences ``b − a`` (in points of accuracy) over ``n`` seeds: their mean, standard
    deviation, the mean's ``confidence`` interval (Student's t) and how often ``b`` was above or below."""
    n: int
    mean: float
    sd: float
    low: float
    high: float
    above: int
    below: int

    def __str__(self) -> str:
        return (f"n={self.n}: mean {self.mean:+.2f} ± {self.sd:.2f} points, "
                f"95 % CI [{self.low:+.2f}, {self.high:+.2f}], higher in {self.above}, lower in {self.below}")


def paired(a: list[float], b: list[float], confidence: float = 0.95) -> Paired:
    """:class:`Paired` of accuracies ``a`` and ``b`` (fractions, seed by seed)."""
    import statistics

    from scipy.stats import t

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired needs two lists of one length >= 2, got {len(a)} and {len(b)}")
    d = [100 * (y - x) for x, y in zip(a, b)]
    mean, sd = statistics.mean(d), statistics.stdev(d)
    half = float(t.ppf(0.5 + confidence / 2, len(d) - 1)) * sd / math.sqrt(len(d))
    return Paired(len(d), mean, sd, mean - half, mean + half, sum(x > 0 for x in d), sum(x < 0 for x in d))


def agree(p: Paired, bound: float = 1.0) -> bool:
    """The criterion: the mean paired difference's interval includes 0 (no difference shown) or lies
    within ``±bound`` points (any difference is small)."""
    return p.low <= 0.0 <= p.high or (-bound <= p.low and p.high <= bound)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The names whose values differ (exactly: tensors bit for bit, arrays element for element)."""
    import numpy as np

    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())
        elif isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
            same = x.shape == y.shape and np.array_equal(x, y)
        else:
            same = x == y
        if not same:
            out.append(key)
    return out
