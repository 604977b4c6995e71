"""The install: the range of torch and torchvision the project supports (a GPU machine keeps its own
build), the pair CI tests pinned in every extra the README's commands install, and a torchvision that
works with the torch beside it (the trap: a local CPU-only torch with the registry's torchvision)."""

import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
README_EXTRAS = ("openfl", "test", "test-flower")  # what the README's two commands install


def requirements(entries: list[str]) -> dict[str, Requirement]:
    return {(r := Requirement(e)).name: r for e in entries}


@pytest.fixture(scope="module")
def project():
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_the_installed_torch_and_torchvision_are_in_the_supported_range(project):
    base = requirements(project["dependencies"])
    for name in ("torch", "torchvision"):
        installed = Version(version(name))
        assert base[name].specifier.contains(installed, prereleases=True), (
            f"{name} {installed} is outside the supported range {base[name].specifier}")


def test_every_extra_the_readme_installs_pins_the_pair_ci_tests_inside_the_range(project):
    base = requirements(project["dependencies"])
    pinned = requirements(project["optional-dependencies"]["pinned"])
    torch_pin = next(iter(s for s in pinned["torch"].specifier if s.operator == "=="))
    vision_pin = next(iter(pinned["torchvision"].specifier))
    assert base["torch"].specifier.contains(torch_pin.version)
    assert base["torchvision"].specifier.contains(vision_pin.version)
    for extra in README_EXTRAS:
        pins = requirements(project["optional-dependencies"][extra])
        assert str(pins["torch"].specifier) == str(pinned["torch"].specifier), extra
        assert str(pins["torchvision"].specifier) == str(pinned["torchvision"].specifier), extra
    for spec in (base["torch"].specifier, pinned["torch"].specifier):  # the trap stays out everywhere
        assert not spec.contains("2.13.0+cpu") and spec.contains("2.13.0")
    assert base["torch"].specifier.contains("2.11.0+cu130")  # a GPU image's own build is kept


def test_torchvision_works_with_the_torch_beside_it():
    """The trap's symptom: importing torchvision fails ('operator torchvision::nms does not exist')."""
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.9], [2.0, 2.0, 3.0, 3.0]])
    kept = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
    assert kept.tolist() == [0, 2]
