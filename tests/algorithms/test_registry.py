"""The registry: unknown names, duplicates, and third-party discovery through entry points."""

import sys
import textwrap

import pytest

from fedcontrast.algorithms import available_algorithms, get_algorithm, register_algorithm, registry
from fedcontrast.algorithms.fedavg import FedAvg
from fedcontrast.errors import UnknownNameError


def test_builtins_are_registered():
    assert {"fedavg", "fedprox", "moon"} <= set(available_algorithms())


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownNameError) as info:
        get_algorithm("moonn")
    message = str(info.value)
    assert "moonn" in message and "fedavg" in message and "moon" in message


def test_duplicate_name_raises():
    class Impostor(FedAvg):
        name = "moon"

    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(Impostor)


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch):
    (tmp_path / "toyplugin.py").write_text(textwrap.dedent("""
        from fedcontrast.algorithms.fedavg import FedAvg

        class ToyAvg(FedAvg):
            name = "toyavg"
    """))
    dist = tmp_path / "toyplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedcontrast.algorithms]\ntoyavg = toyplugin:ToyAvg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert "toyavg" in available_algorithms()
    assert get_algorithm("toyavg").__name__ == "ToyAvg"
    sys.modules.pop("toyplugin", None)
