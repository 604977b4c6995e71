"""Device placement: the CPU stand-in for a GPU catches what CUDA would (a tensor, module or generator
created without a device), every device-sensitive path runs clean through it with the same numbers
as a plain CPU run, and CUDA runs are made deterministic."""

import os

import pytest
import torch

from fedcontrast import device_check
from fedcontrast.devices import (
    DeviceMistake,
    cpu_stand_in,
    device_generator,
    make_cuda_deterministic,
    resolve_device,
    same_device,
    stand_in_works,
)
from fedcontrast.errors import ConfigError
from fedcontrast.models import backbones

PACKAGE_FILE = os.path.join(os.path.dirname(device_check.__file__), "_stand_in_probe.py")


def run_as_package_code(source: str):
    """Run ``source`` as if it were a line of fedcontrast (the stand-in judges generators by their creator)."""
    scope = {"torch": torch}
    exec(compile(source, PACKAGE_FILE, "exec"), scope)
    return scope


def test_the_stand_in_makes_unplaced_tensors_fail_as_on_cuda():
    with cpu_stand_in() as device:
        placed = torch.zeros(3, device=device)
        unplaced = torch.zeros(3)  # no device: would be on the CPU beside CUDA tensors
        assert unplaced.device.type == "meta"
        with pytest.raises(RuntimeError, match="meta"):
            placed + unplaced
        with pytest.raises((RuntimeError, NotImplementedError)):
            unplaced.to(device)
        module = torch.nn.Linear(2, 2)  # built without `with torch.device(...)`
        with pytest.raises(RuntimeError):
            module(torch.ones(1, 2, device=device))
        with torch.device("cpu"):
            assert torch.nn.Linear(2, 2)(torch.ones(1, 2, device=device)).shape == (1, 2)
    assert torch.zeros(1).device.type == "cpu"  # torch's defaults are back


def test_the_stand_in_refuses_a_generator_the_package_makes_without_a_device():
    with cpu_stand_in():
        with pytest.raises(DeviceMistake, match=r"torch.Generator\(\) without a device at .*_stand_in_probe.py:1"):
            run_as_package_code("g = torch.Generator()")
        placed = run_as_package_code("g = torch.Generator(device='cpu')")["g"]
        assert placed.device.type == "cpu" and isinstance(placed, torch.Generator)
        assert torch.Generator().device.type == "cpu"  # other libraries keep torch's default
        assert isinstance(torch.default_generator, torch.Generator)
    assert torch.Generator is torch._C.Generator


def test_what_torch_optimisers_create_without_a_device_is_on_the_cpu_as_on_a_gpu_machine():
    """torch 2.11's Adam makes its step counter with ``torch.tensor(0.0)`` (no device; torch 2.13 names the
    CPU): on a GPU machine that is the CPU, so inside the stand-in it must not be ``meta``."""
    optim_file = os.path.join(os.path.dirname(torch.optim.__file__), "_stand_in_probe.py")
    source = "step = torch.tensor(0.0, dtype=torch.float32)"
    with cpu_stand_in():
        as_optimiser = {"torch": torch}
        exec(compile(source, optim_file, "exec"), as_optimiser)
        assert as_optimiser["step"].device.type == "cpu" and float(as_optimiser["step"]) == 0.0
        assert run_as_package_code(source)["step"].device.type == "meta"  # the package's own: judged
        with torch.device("cpu"):
            assert run_as_package_code(source)["step"].device.type == "cpu"
    assert stand_in_works() == (True, "")


def test_a_cuda_device_carries_its_index():
    assert same_device("cuda", "cuda:0") and same_device(torch.device("cpu"), "cpu")
    assert not same_device("cpu", "cuda:0") and not same_device("cuda:0", "cuda:1")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here: resolve_device('cuda') is refused "
                    "(test_cuda_is_refused_by_name_where_there_is_none)")
    device = resolve_device("cuda")
    assert device.index == torch.cuda.current_device() and torch.zeros(1, device=device).device == device
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_fedssc_class_representations_and_loss_follow_the_device_of_their_inputs():
    """The FedSSC crash on CUDA: `present` was made on the CPU beside representations on the GPU."""
    import numpy as np

    from fedcontrast.algorithms.fedssc import sample_class_representations
    from fedcontrast.losses.contrastive import global_class_contrastive_loss

    with cpu_stand_in() as device:
        means = {"a": torch.ones(3, 4, device=device), "b": torch.full((3, 4), 3.0, device=device)}
        counts = {"a": torch.tensor([5, 0, 5], device=device), "b": torch.tensor([5, 5, 0], device=device)}
        reps, present = sample_class_representations(means, counts, k=2, rng=np.random.default_rng(0))
        assert reps.device == present.device == device
        z = torch.randn(6, 4, device=device, generator=torch.Generator(device="cpu").manual_seed(0))
        labels = torch.tensor([0, 1, 2, 0, 1, 2], device=device)
        loss = global_class_contrastive_loss(z, labels, reps, present)
    assert present.tolist() == [1.0, 1.0, 1.0] and torch.isfinite(loss)
    assert torch.equal(reps[0], torch.full((4,), 2.0))  # the mean of both sites' class-0 means


def test_pretraining_runs_where_the_public_data_is(synthetic_public):
    """The FedPCL crash on CUDA: pre-training fed the device's data to a model left on the CPU."""
    with cpu_stand_in() as device:
        encoder = backbones.pretrain_backbone("simple_cnn", synthetic_public, seed=0, epochs=1)
    assert {p.device for p in encoder.parameters()} == {device}
    plain = backbones.pretrain_backbone("simple_cnn", synthetic_public, seed=0, epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), encoder.state_dict().values()))


def test_dp_sgd_draws_its_noise_on_the_model_device_and_its_batches_on_the_cpu():
    """The DP-SGD crash on CUDA: Opacus was handed a CPU generator for a CUDA model's noise."""
    from fedcontrast.config import PrivacyConfig
    from fedcontrast.privacy import SitePrivacy
    from fedcontrast.privacy.dp_sgd import DPSGDSession, make_dp_compatible

    privacy = SitePrivacy(PrivacyConfig(dp_sgd={"noise_multiplier": 1.0}), {}, round_num=0, noise_seed=7)
    with cpu_stand_in() as device:
        with torch.device(device):
            model = make_dp_compatible(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        session = privacy.training_session(model, torch.optim.SGD(model.parameters(), lr=0.1), num_samples=20,
                                           batch_size=5)
        assert session.optimizer.generator.device == device
        batches = list(session.epoch_batches())
        session.close()
    assert batches and all(b.device.type == "cpu" for b in batches)
    # two sessions of one task never share a noise stream
    assert privacy.noise_generator(device).initial_seed() != privacy.noise_generator(device).initial_seed()
    with pytest.raises(ValueError, match="batch generator on the CPU"):
        DPSGDSession(model, torch.optim.SGD(model.parameters(), lr=0.1), num_samples=4, batch_size=2,
                     noise_multiplier=1.0, max_grad_norm=1.0, generator=_FakeDeviceGenerator())


class _FakeDeviceGenerator:
    device = torch.device("cuda", 0)  # what a generator on a GPU reports


@pytest.fixture(scope="module")
def synthetic_public():
    from fedcontrast.data import load_dataset

    return load_dataset("synthetic", image_size=16, synthetic_samples=120, public_fraction=0.3).public


ITEMS = sorted(device_check.items("cpu"))
# DP-SGD's resume runs through benchmarks/gpu_check.py; here MOON's resume and DP-SGD apart (suite time)
SUITE_ITEMS = [name for name in ITEMS if name != "resume+dp_sgd"]


@pytest.mark.parametrize("name", SUITE_ITEMS)
def test_every_device_sensitive_path_runs_through_the_stand_in_with_the_numbers_of_a_cpu_run(name):
    works, why = stand_in_works()
    if not works:
        pytest.skip(why)
    backbones._CACHE.clear()  # FedPCL's backbones are pre-trained again, inside the stand-in
    plain = device_check.items("cpu")[name]()
    backbones._CACHE.clear()
    with cpu_stand_in():
        stood_in = device_check.items("cpu")[name]()
    assert plain.values, "the item produced no numbers"
    assert device_check.differences(plain.values, stood_in.values) == []
    assert plain.accuracy == stood_in.accuracy


def test_the_items_cover_every_registered_algorithm_and_the_named_paths():
    from fedcontrast.algorithms import available_algorithms

    assert set(available_algorithms()) <= set(ITEMS)
    assert {"fedavg+dp_sgd", "fedssc+representations", "fedpcl_pretrain", "resume", "compare", "probe",
            "openfl_round"} <= set(ITEMS)


def test_cuda_is_refused_by_name_where_there_is_none():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="'cuda:1' was requested but CUDA is not available"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_runs_use_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        make_cuda_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.benchmark is False
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32  # float32 is float32
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # an operator's own setting is kept
    make_cuda_deterministic()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_device_generators_are_seeded_where_asked():
    a, b = device_generator(torch.device("cpu"), 5), device_generator(torch.device("cpu"), 5)
    assert a.device.type == "cpu" and torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


def test_paired_differences_their_interval_and_the_criterion():
    cpu = [0.70, 0.80, 0.75, 0.90, 0.85]
    same = device_check.paired(cpu, [0.72, 0.79, 0.74, 0.91, 0.86])  # ±1-2 points either way
    assert same.n == 5 and same.mean == pytest.approx(0.4) and same.above == 3 and same.below == 2
    assert same.low < 0 < same.high and device_check.agree(same)
    # an interval from scipy's t quantile: mean ± t(0.975, 4) · sd / √5
    assert same.high - same.mean == pytest.approx(2.7764451 * same.sd / 5 ** 0.5, rel=1e-6)
    lower = device_check.paired(cpu, [c - 0.05 + e for c, e in zip(cpu, (0.004, -0.003, 0.002, 0.0, -0.004))])
    assert lower.high < -1 and not device_check.agree(lower)  # 5 points lower in every seed: a difference
    small = device_check.paired(cpu, [c + 0.003 + e for c, e in zip(cpu, (0.0005, -0.0005, 0.0, 0.0004, -0.0004))])
    assert small.low > 0 and device_check.agree(small, bound=1.0) and not device_check.agree(small, bound=0.1)
    with pytest.raises(ValueError, match="two lists of one length"):
        device_check.paired([0.5], [0.5])


def test_a_fingerprint_changes_with_any_bit_of_a_run():
    values = {"metrics.csv": "round,accuracy\n1,0.5\n", "global/w": torch.tensor([1.0, 2.0]), "s": torch.tensor(3.0)}
    same = {"metrics.csv": "round,accuracy\n1,0.5\n", "global/w": torch.tensor([1.0, 2.0]), "s": torch.tensor(3.0)}
    assert device_check.fingerprint(values) == device_check.fingerprint(same)
    next_after_2 = float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))
    nudged = dict(same, **{"global/w": torch.tensor([1.0, next_after_2])})
    assert device_check.fingerprint(values) != device_check.fingerprint(nudged)
    as_float64 = dict(same, s=torch.tensor(3.0, dtype=torch.float64))
    assert device_check.fingerprint(values) != device_check.fingerprint(as_float64)
